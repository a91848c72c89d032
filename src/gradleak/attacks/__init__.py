"""Attacks, one module per family, registered by name in ``gradleak.registry.ATTACKS``."""

import importlib as _importlib

for _mod in ("peftleak", "optimization", "utr", "dager", "lamp"):
    try:
        _importlib.import_module(f"gradleak.attacks.{_mod}")
    except ModuleNotFoundError as _err:  # modules of later issues may not exist yet
        if _err.name != f"gradleak.attacks.{_mod}":
            raise
