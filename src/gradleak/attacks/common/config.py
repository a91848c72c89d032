"""An attack's parameters from its pydantic ``Config``: the config's defaults and constraints are the one source
(DESIGN §2), so ``__init__`` signatures do not repeat them."""

from __future__ import annotations

from typing import Any


def set_config_fields(attack: Any, params: dict[str, Any]) -> None:
    """Validate ``params`` against ``type(attack).Config`` (defaults for the fields not given; a bad value raises
    pydantic's ValidationError) and set every field of the config as an attribute of ``attack``."""
    cfg = type(attack).Config(**params)
    for name in type(cfg).model_fields:
        setattr(attack, name, getattr(cfg, name))
