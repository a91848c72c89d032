"""An attack's parameters from one source: its pydantic config (docs/DESIGN.md §2: an attack's defaults live in one place).

An attack built from an experiment config receives its validated ``Config`` (``from_config``); one built directly in
Python (tests, probes) passes the same parameters as keywords. :func:`attack_parameters` turns either into one
validated config, so every default lives in the config's fields and every constraint is checked by pydantic, the same
way for both routes. A bad value raises :class:`~gradleak.errors.BadInput` naming ``attack.<field>``.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, TypeVar

from pydantic import BaseModel, ValidationError

from gradleak.errors import BadInput

C = TypeVar("C", bound=BaseModel)


def attack_parameters(config_cls: type[C], config: Optional[BaseModel] = None,
                      overrides: Optional[Mapping[str, Any]] = None) -> C:
    """``config`` (default: ``config_cls``'s defaults) with ``overrides`` applied, validated by ``config_cls``."""
    overrides = dict(overrides or {})
    if isinstance(config, config_cls) and not overrides:
        return config
    values = {**(config.model_dump() if config is not None else {}), **overrides}
    try:
        return config_cls(**values)
    except ValidationError as err:
        first = err.errors()[0]
        name = ".".join(str(p) for p in first["loc"] if not str(p).startswith("function-")) or "(parameters)"
        if first["type"] == "extra_forbidden":
            raise BadInput(f"attack.{name}", "this parameter does not exist.",
                           f"parameters: {', '.join(sorted(config_cls.model_fields))}.") from None
        raise BadInput(f"attack.{name}", f"{first['msg']} (got {first.get('input')!r}).",
                       "change this value (in the config's attack section or the constructor's keyword).") from None


def set_config_fields(attack: Any, params: Mapping[str, Any]) -> None:
    """Validate ``params`` against ``type(attack).Config`` (:func:`attack_parameters`: defaults for the fields not
    given, BadInput naming ``attack.<field>`` for a bad one) and set every field as an attribute of ``attack``."""
    cfg = attack_parameters(type(attack).Config, None, params)
    for name in type(cfg).model_fields:
        setattr(attack, name, getattr(cfg, name))


__all__ = ["attack_parameters", "set_config_fields"]
