"""Pydantic-validated YAML configs (DESIGN §4): unknown keys are errors, ``--set`` overrides are checked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from gradleak.errors import BadInput


class Strict(BaseModel):
    """Base for every config section: unknown keys are rejected."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())


def parse_value(text: str) -> Any:
    """Parse a ``--set`` value with YAML rules (``32`` -> int, ``true`` -> bool, ``[8,16]`` -> list)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(raw: dict, overrides: list[str], schema: type[BaseModel] | None = None) -> dict:
    """Apply ``dotted.key=value`` overrides to a raw config dict.

    The key must exist in the schema (or already in the file), so a typo fails with the key's name.
    """
    out = dict(raw)
    for item in overrides:
        if "=" not in item:
            raise BadInput("--set", f"'{item}' is not of the form dotted.key=value.", "write e.g. --set data.batch_size=16.")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        node, model = out, schema
        for i, part in enumerate(parts):
            fields = model.model_fields if model is not None else None
            if fields is not None and part not in fields:
                raise BadInput(f"--set {key}", f"the config has no key '{'.'.join(parts[:i + 1])}'.",
                               f"valid keys here: {', '.join(sorted(fields))}.")
            if i == len(parts) - 1:
                node[part] = parse_value(value)
            else:
                node[part] = dict(node.get(part) or {})
                node = node[part]
                ann = fields[part].annotation if fields is not None else None
                model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return out


def describe_validation_error(err: ValidationError) -> BadInput:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "(config)"
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        return BadInput(loc, "this config key does not exist.", "remove it or check its spelling against the shipped configs.")
    return BadInput(loc, f"{msg} (got {first.get('input')!r}).", "change this value in the config or with --set.")


def load_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.exists():
        raise BadInput("CONFIG", f"config file '{p}' does not exist.", "give the path to a YAML file, e.g. configs/peftleak/cifar_b32.yaml.")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as err:
        raise BadInput("CONFIG", f"'{p}' is not valid YAML: {err}.", "fix the YAML syntax.") from None
    if not isinstance(raw, dict):
        raise BadInput("CONFIG", f"'{p}' must hold a mapping at the top level.", "start the file with keys like `experiment:`.")
    return raw
