"""Datasets as tensors + labels (DESIGN §2): built-in offline assets, image folders and ``.npz`` files.

``load(name, **kwargs)`` looks the name up in the ``DATASETS`` registry; ``gradleak list`` shows them.
Importing this package only registers loaders: no file is read until ``load`` is called.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from gradleak.data import builtin, files  # noqa: F401  (registration)
from gradleak.data.base import ImageSet, from_model_range, to_model_range
from gradleak.registry import DATASETS

# Every other module of this package (e.g. text datasets, owned elsewhere) registers on import too.
for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")

__all__ = ["ImageSet", "load", "names", "to_model_range", "from_model_range"]


def load(name: str, **kwargs: Any) -> ImageSet:
    """Load the dataset registered as ``name`` (keyword options are the loader's, e.g. ``n``, ``size``).

    Image datasets return an :class:`ImageSet`; text datasets (``gradleak.data.text``) return their own type.

    Unknown names and options raise :class:`gradleak.errors.BadInput` naming ``data.name`` /
    ``data.<option>``; missing offline assets raise :class:`gradleak.errors.MissingAsset` with the
    install command.
    """
    from gradleak.data.base import check_kwargs

    fn = DATASETS.get(name, field="data.name")
    check_kwargs(fn, name, kwargs)
    return fn(**kwargs)


def names() -> list[str]:
    return DATASETS.names()
