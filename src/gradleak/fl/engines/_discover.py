"""Imports every module of :mod:`gradleak.fl.engines`, so each engine registers itself in
:data:`~gradleak.fl.engines.ENGINES` (an engine's optional dependencies are imported inside its functions only)."""

from __future__ import annotations

import importlib
import pkgutil

import gradleak.fl.engines as _pkg

for _m in pkgutil.iter_modules(_pkg.__path__):
    if not _m.name.startswith("_"):
        importlib.import_module(f"{_pkg.__name__}.{_m.name}")
