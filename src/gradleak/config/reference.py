"""The config reference, generated from the schema (docs/CONFIG.md is its output): every key of
:class:`gradleak.config.schema.ExperimentConfig` with its type, default and description, as Markdown.

``gradleak config-reference`` prints it and ``docs/CONFIG.md`` is its output (``tests/test_config_reference.py`` checks
that the two agree): a field added to the schema is documented by regenerating, never by hand::

    gradleak config-reference > docs/CONFIG.md
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal, Union

from pydantic import BaseModel

HEADER = """# Config reference

Generated from the schema (`src/gradleak/config/schema.py` and the sections it mounts) by
`gradleak config-reference > docs/CONFIG.md`; do not edit by hand. A key is written in YAML as nested sections
(`data: {batch_size: 4}`) or on the command line as `--set data.batch_size=4`. An unknown key or a bad value stops
with exit code 2 naming the field and the fix.

The parameters of each attack (`attack: {name, <parameters>}`) and defense (`defenses: [{name, params}]`,
`defense: {name, <parameters>}`) are listed with their defaults by `gradleak list attacks` and
`gradleak list defenses`; the `audit:` section (`advise`, `dp_check`, `params`, `seeds`) and `grid:` are described in
the README.
"""


def _type_name(ann: Any) -> str:
    origin = typing.get_origin(ann)
    args = typing.get_args(ann)
    if origin is Literal:
        return " \\| ".join(str(a) for a in args)
    if origin in (Union, types.UnionType):
        parts = [_type_name(a) for a in args if a is not type(None)]
        return " \\| ".join(parts) + (" \\| null" if type(None) in args else "")
    if origin in (list, tuple, set):
        return f"list[{', '.join(_type_name(a) for a in args if a is not Ellipsis)}]"
    if origin is dict:
        return "mapping"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "section"
    return getattr(ann, "__name__", str(ann)).replace("typing.", "")


def _bounds(field) -> str:
    lo = hi = None
    for m in field.metadata:
        for name, sign in (("ge", "≥"), ("gt", ">")):
            if getattr(m, name, None) is not None:
                lo = f"{sign} {getattr(m, name)}"
        for name, sign in (("le", "≤"), ("lt", "<")):
            if getattr(m, name, None) is not None:
                hi = f"{sign} {getattr(m, name)}"
    return ", ".join(b for b in (lo, hi) if b)


def _default(field) -> str:
    if field.is_required():
        return "(required)"
    v = field.get_default(call_default_factory=True)
    if isinstance(v, BaseModel):
        return "(section)"
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return f"`{v}`" if v != "" else '`""`'


def _section_model(ann: Any) -> type[BaseModel] | None:
    """The section model of a field (``X`` or ``Optional[X]``), else None."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    if typing.get_origin(ann) in (Union, types.UnionType):
        models = [a for a in typing.get_args(ann) if isinstance(a, type) and issubclass(a, BaseModel)]
        return models[0] if len(models) == 1 else None
    return None


Section = tuple[str, str, list[tuple[str, str, str, str]]]


def _describe(model: type[BaseModel], prefix: str, out: list[Section], about: str = "") -> None:
    rows: list[tuple[str, str, str, str]] = []
    nested: list[tuple[str, type[BaseModel], str]] = []
    for name, f in model.model_fields.items():
        key = f"{prefix}{name}"
        sub = _section_model(f.annotation)
        if name == "attack" and not prefix:  # its parameters are the attack's: `gradleak list attacks`
            rows.append((key, "{name, <parameters>}", "(none)", (f.description or "").replace("|", "\\|")))
            continue
        if sub is not None and sub.model_fields:
            nested.append((key, sub, f.description or ""))
            if typing.get_origin(f.annotation) in (Union, types.UnionType):  # an optional section: its own row too
                rows.append((key, "section \\| null", _default(f), (f.description or "").replace("|", "\\|")))
            continue
        typ = _type_name(f.annotation)
        if typing.get_origin(f.annotation) in (list,) and typing.get_args(f.annotation) and _section_model(
                typing.get_args(f.annotation)[0]) is not None:
            item = typing.get_args(f.annotation)[0]
            typ = f"list of {{{', '.join(item.model_fields)}}}"
        bounds = _bounds(f)
        desc = (f.description or "").replace("|", "\\|").replace("\n", " ")
        rows.append((key, typ + (f" ({bounds})" if bounds else ""), _default(f), desc))
    out.append((prefix.rstrip(".") or "top level", about, rows))
    for key, sub, desc in nested:
        _describe(sub, key + ".", out, desc)


def config_reference() -> str:
    """The Markdown reference of every config key (what ``gradleak config-reference`` prints)."""
    from gradleak.config.schema import ExperimentConfig

    sections: list[Section] = []
    _describe(ExperimentConfig, "", sections)
    lines = [HEADER]
    for title, about, rows in sections:
        if not rows:
            continue
        lines += [f"## `{title}`" if title != "top level" else "## Top level", ""]
        lines += [about[0].upper() + about[1:] + ("" if about.endswith(".") else "."), ""] if about else []
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        lines += [f"| `{k}` | {t} | {d} | {desc} |" for k, t, d, desc in rows]
        lines.append("")
    return "\n".join(lines)
