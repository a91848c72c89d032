"""Pydantic-validated YAML configs (docs/DESIGN.md §4): unknown keys are errors, ``--set`` overrides are checked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from gradleak.errors import BadInput, unknown_key_fix
from gradleak.validation import Checked


class Strict(Checked):
    """Base for every config section: unknown keys are rejected, numbers must be finite numbers (not booleans)."""


class DuplicateKey(yaml.constructor.ConstructorError):
    """A mapping gives the same key twice (YAML would keep the last silently and drop the first block)."""

    def __init__(self, key: Any, first_line: int, line: int):
        self.key, self.first_line, self.line = key, first_line, line
        super().__init__(None, None, f"the key '{key}' is given twice (lines {first_line} and {line})")


class _Loader(yaml.SafeLoader):
    """YAML 1.1 safe loading, plus YAML 1.2 floats: ``1e-6`` / ``3E5`` (no dot) are numbers, not strings; a mapping
    that gives a key twice, at any level, is an error (:class:`DuplicateKey`) instead of keeping the last."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` merges; its keys may be overridden
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    if key in seen:
                        raise DuplicateKey(key, seen[key], line)
                    seen[key] = line
                except TypeError:  # an unhashable key: SafeLoader reports it
                    continue
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    __import__("re").compile(r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)"
                             r"|\.[0-9_]+(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."))


def yaml_value(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 -- a SafeLoader subclass


def parse_value(text: str, key: str = "--set") -> Any:
    """Parse a ``--set`` value with YAML rules (``32`` -> int, ``true`` -> bool, ``[8,16]`` -> list, ``1e-6`` -> float)."""
    try:
        value = yaml_value(text)
    except DuplicateKey as err:
        raise BadInput(key, f"the value {text!r} gives the key '{err.key}' twice.", "give each key once.") from None
    except yaml.YAMLError:
        return text
    if isinstance(value, str):  # YAML 1.1 reads 1e300 / 1e-3 (no dot) as strings
        try:
            return float(value)
        except ValueError:
            pass
    return value


def _field_names(model: type[BaseModel]) -> dict[str, str]:
    """Accepted keys of a config section -> field name (aliases such as ``num_layers`` included)."""
    out = {}
    for name, f in model.model_fields.items():
        out[name] = name
        alias = f.validation_alias
        for a in getattr(alias, "choices", None) or ([alias] if isinstance(alias, str) else []):
            if isinstance(a, str):
                out[a] = name
    return out


def apply_overrides(raw: dict, overrides: list[str], schema: type[BaseModel] | None = None) -> dict:
    """Apply ``dotted.key=value`` overrides to a raw config dict.

    The key must exist in the schema, so a typo fails with the key's name. Sections that accept free keys
    (``attack``, whose parameters the attack's own Config validates later, and dict fields such as
    ``attack.params``) take any key.
    """
    out = dict(raw)
    explicit_attack: set[str] = set()  # attack parameters the overrides set (kept when attack.name changes)
    for item in overrides:
        k = item.split("=", 1)[0].strip()
        if k.startswith("attack.") and k not in ("attack.name", "attack.params"):
            explicit_attack.add(k.split(".")[-1])
    file_attack = (raw.get("attack") or {}).get("name") if isinstance(raw.get("attack"), dict) else None
    for item in overrides:
        if "=" not in item:
            raise BadInput("--set", f"'{item}' is not of the form dotted.key=value.", "write e.g. --set data.batch_size=16.")
        key, value = item.split("=", 1)
        parts = [p for p in key.strip().split(".")]
        if not all(parts):
            raise BadInput(f"--set {key}", "the key has an empty part.", "write e.g. --set data.batch_size=16.")
        node, model = out, schema
        for i, part in enumerate(parts):
            if model is not None:
                names = _field_names(model)
                free = model.model_config.get("extra") == "allow"
                if part not in names and not free:
                    raise BadInput(f"--set {key}", f"the config has no key '{'.'.join(parts[:i + 1])}'.",
                                   unknown_key_fix(part, names, ".".join(parts[:i])))
                field = model.model_fields.get(names.get(part, part))
                if field is not None:  # write the field's own name; the file's other spellings of it (aliases:
                    own = names.get(part, part)  # num_layers for layers) are the same key, which the --set replaces
                    spellings = [a for a, f in names.items() if f == own and a != own]
                    if i == len(parts) - 1:
                        for a in spellings:
                            node.pop(a, None)
                    else:
                        for a in spellings:
                            if a in node and own not in node:
                                node[own] = node.pop(a)
                    part = own
            else:
                field = None
            if i == len(parts) - 1:
                node[part] = parse_value(value, f"--set {key}")
                _drop_other_spelling(out, parts)
            else:
                child = node.get(part)
                if child is not None and not isinstance(child, dict):
                    raise BadInput(f"--set {key}", f"'{'.'.join(parts[:i + 1])}' is not a section.",
                                   f"set it as a whole: --set {'.'.join(parts[:i + 1])}=VALUE.")
                node[part] = dict(child or {})
                node = node[part]
                ann = field.annotation if field is not None else None
                model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    att = out.get("attack")
    if isinstance(att, dict) and file_attack and att.get("name") not in (None, file_attack):
        out["attack"] = _retarget_attack(att, explicit_attack)
    return out


def _drop_other_spelling(out: dict, parts: list[str]) -> None:
    """An attack parameter may be written flat (``attack.eps_bag``) or under ``attack.params``: a ``--set`` of one
    spelling replaces the file's other spelling of the same parameter (it is the same key, and the --set wins)."""
    att = out.get("attack")
    if not isinstance(att, dict) or parts[0] != "attack":
        return
    params = att.get("params")
    if len(parts) == 2 and parts[1] not in ("name", "params") and isinstance(params, dict) and parts[1] in params:
        att["params"] = {k: v for k, v in params.items() if k != parts[1]}
    elif len(parts) == 3 and parts[1] == "params":
        att.pop(parts[2], None)
    elif len(parts) == 2 and parts[1] == "params" and isinstance(params, dict):
        for k in params:
            att.pop(k, None)


def _retarget_attack(att: dict, explicit: set[str]) -> dict:
    """``--set attack.name=OTHER`` on a config written for another attack: keep the parameters the new attack's
    Config knows (shared ones such as ``iterations``) and those the overrides set; drop the file's parameters
    that belong to the old attack only (UTR's ``eps_bag`` must not stop LAMP), logging what was dropped."""
    import logging

    from gradleak.registry import ATTACKS

    import gradleak.attacks  # noqa: F401  (registers every attack)

    name = att["name"]
    if name not in ATTACKS:
        return att  # the schema reports the unknown name with the list of attacks
    known = set(_field_names(ATTACKS.get(name).Config)) | explicit
    dropped = sorted(k for k in att if k not in ("name", "params") and k not in known)
    dropped += sorted(f"params.{k}" for k in (att.get("params") or {}) if k not in known)
    if dropped:
        logging.getLogger("gradleak").info("attack.name=%s: dropped the config file's parameters of the other attack: %s",
                                           name, ", ".join(dropped))
    new = {k: v for k, v in att.items() if k == "name" or (k != "params" and k in known)}
    params = {k: v for k, v in (att.get("params") or {}).items() if k in known}
    if params:
        new["params"] = params
    return new


def normalize_aliases(raw: dict, schema: type[BaseModel]) -> dict:
    """Rename alias keys (``model.num_layers``) to their field names, recursively, so defaults merge right."""
    out = dict(raw)
    names = _field_names(schema)
    for k in list(out):
        if k in names and names[k] != k:
            if names[k] in out:
                raise BadInput(k, f"is given together with its synonym '{names[k]}'.", f"keep only '{names[k]}'.")
            out[names[k]] = out.pop(k)
    for k, v in out.items():
        f = schema.model_fields.get(k)
        ann = f.annotation if f is not None else None
        if isinstance(v, dict) and isinstance(ann, type) and issubclass(ann, BaseModel):
            out[k] = normalize_aliases(v, ann)
    return out


def load_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.exists():
        raise BadInput("CONFIG", f"config file '{p}' does not exist.", "give the path to a YAML file, e.g. configs/peftleak/cifar_b32.yaml.")
    if p.is_dir():
        raise BadInput("CONFIG", f"'{p}' is a directory, not a config file.",
                       f"give one of the YAML files in it ({', '.join(sorted(x.name for x in p.glob('*.yaml'))[:5]) or 'none found'}).")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise BadInput("CONFIG", f"'{p}' is not UTF-8 text ({err.reason} at byte {err.start}).",
                       "save the config as UTF-8 YAML.") from None
    except OSError as err:
        raise BadInput("CONFIG", f"cannot read '{p}': {err.strerror}.", "check the path and its permissions.") from None
    try:
        raw = yaml_value(text) or {}
    except DuplicateKey as err:
        raise BadInput("CONFIG", f"'{p}' gives the key '{err.key}' twice in one mapping (lines {err.first_line} and "
                       f"{err.line}); YAML would silently keep only the second.",
                       f"merge the two '{err.key}' blocks into one (or delete the one you do not mean).") from None
    except yaml.YAMLError as err:
        raise BadInput("CONFIG", f"'{p}' is not valid YAML: {err}.", "fix the YAML syntax.") from None
    if not isinstance(raw, dict):
        raise BadInput("CONFIG", f"'{p}' must hold a mapping at the top level.", "start the file with keys like `experiment:`.")
    return raw
