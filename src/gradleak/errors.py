"""Errors that carry the field to change and the fix (docs/DESIGN.md §4: exit code 2 for bad input)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError


class GradleakError(Exception):
    """Base class of the errors gradleak raises on purpose."""


class BadInput(GradleakError):
    """Bad user input: names the offending field and how to fix it. The CLI exits with code 2."""

    def __init__(self, field: str, problem: str, fix: str = ""):
        self.field = field
        self.problem = problem
        self.fix = fix
        msg = f"{field}: {problem}"
        if fix:
            msg += f" Fix: {fix}"
        super().__init__(msg)


class TrainingDiverged(BadInput):
    """A client's upload holds NaN/inf: training diverged (too high an lr, or a defense's noise). ``client_id`` and
    ``round_index`` (the engine's round) say where; :func:`gradleak.run.pipeline.train_global` turns it into a measured
    outcome of the utility run (the defense at that strength makes the model untrainable)."""

    def __init__(self, client_id: int, round_index: int, lr: float):
        super().__init__("fl.lr", f"training diverged: client {client_id}'s upload in round {round_index} holds NaN/inf "
                         f"(lr = {lr}).", "lower fl.lr (or check the defenses' parameters).")
        self.client_id = client_id
        self.round_index = round_index
        self.lr = lr


class MissingAsset(BadInput):
    """An offline asset (package data or Debian file) is not installed; names the install command."""

    def __init__(self, asset: str, install: str, field: str = "data.name"):
        super().__init__(field, f"the offline asset '{asset}' is not installed on this machine.",
                         f"install it with `{install}` (or run `make demo`, which installs every asset).")
        self.asset = asset
        self.install = install


#: the parts of a pydantic error location that name a validator or a union member, not a config key
_TYPE_TAG = re.compile(r"^(function-.*|float|int|str|bool|none|literal\[.*\]|list\[.*\]|dict\[.*\]|"
                       r"constrained-.*|function-after\[.*\]|is-instance\[.*\])$")


#: HF peft's ``LoraConfig`` names (and other common spellings) -> the ``peft:`` field that means the same here
PEFT_SYNONYMS = {"target_modules": "lora_targets", "r": "lora_rank", "rank": "lora_rank", "alpha": "lora_alpha",
                 "layers_to_transform": "lora_layers", "init_lora_weights": "lora_init",
                 "reduction": "reduction_factor", "bottleneck_size": "bottleneck"}


def nearest(name: str, choices) -> str | None:
    """The valid name closest to a misspelt ``name`` (:func:`difflib.get_close_matches`, cutoff 0.6), or None."""
    import difflib

    hits = difflib.get_close_matches(str(name), sorted(str(c) for c in choices), n=1, cutoff=0.6)
    return hits[0] if hits else None


def unknown_key_fix(key: str, valid, section: str = "") -> str:
    """The fix for an unknown config key: the field that means the same (HF peft's ``target_modules`` ->
    ``lora_targets``, ``r`` -> ``lora_rank``), else the nearest valid key ("did you mean"), else the valid keys."""
    where = f"{section}." if section else ""
    valid = sorted(str(v) for v in valid)
    if section.split(".")[-1] == "peft" and key in PEFT_SYNONYMS and PEFT_SYNONYMS[key] in valid:
        return f"gradleak's name for it is {where}{PEFT_SYNONYMS[key]} (HF peft calls it {key})."
    near = nearest(key, valid)
    if near is not None:
        return f"did you mean {where}{near}?"
    return (f"keys of {section or 'the config'}: {', '.join(valid)}." if valid
            else "remove it or check its spelling against the shipped configs.")


def _keys_at(schema, loc: tuple) -> tuple[list[str], str] | None:
    """The keys a pydantic ``schema`` accepts at the mapping ``loc`` (a path of field names and list indices), with
    the dotted section name; None where the path leaves the schema (a free mapping, a union)."""
    import typing

    from pydantic import BaseModel

    model, names = schema, []
    for part in loc:
        if isinstance(part, int):
            if names:
                names[-1] = f"{names[-1]}[{part}]"
            continue
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        names.append(str(part))
        ann, nxt = field.annotation, None
        for _ in range(3):  # Optional[X], list[X]: look inside
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                nxt = ann
                break
            args = [a for a in typing.get_args(ann) if a is not type(None)]
            if len(args) != 1:
                break
            ann = args[0]
        if nxt is None:
            return None
        model = nxt
    keys = set(model.model_fields)
    for f in model.model_fields.values():  # accepted aliases (model.num_layers) are keys too
        keys.update(a for a in (getattr(f.validation_alias, "choices", None) or []) if isinstance(a, str))
    return sorted(keys), ".".join(names)


def describe_validation_error(err: "ValidationError", schema=None) -> BadInput:
    """The first error of a pydantic validation as a BadInput naming its field (dotted location). With the
    validated ``schema`` (a pydantic model class) an unknown key's fix names the key it most likely means."""
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"] if not _TYPE_TAG.match(str(p))) or "(config)"
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        path = tuple(p for p in first["loc"] if not _TYPE_TAG.match(str(p)))
        found = _keys_at(schema, path[:-1]) if schema is not None and path else None
        if found is not None:
            return BadInput(loc, "this config key does not exist.", unknown_key_fix(str(path[-1]), *found))
        return BadInput(loc, "this config key does not exist.", "remove it or check its spelling against the shipped configs.")
    if first["type"] == "finite_number":
        return BadInput(loc, f"is not a finite number (got {first.get('input')!r}).",
                        "give a finite number (NaN and infinity are not allowed here).")
    if first["type"] == "nan_number":
        return BadInput(loc, "is NaN, not a number.", "give a number (this field accepts .inf).")
    if first["type"] == "bool_for_number":
        return BadInput(loc, f"{msg}.", "give a number (true/false would be read as 1/0).")
    return BadInput(loc, f"{msg} (got {first.get('input')!r}).", "change this value in the config or with --set.")
