"""Datasets as tensors + labels (docs/DESIGN.md §2): built-in offline assets, image folders and ``.npz`` files.

``load(name, **kwargs)`` looks the name up in the ``DATASETS`` registry; ``gradleak list`` shows them.
Importing this package only registers loaders: no file is read until ``load`` is called.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from gradleak.data import builtin, files  # noqa: F401  (registration)
from gradleak.data.base import ImageSet, from_model_range, to_model_range
from gradleak.data.sources import SOURCES, check_disjoint, default_public
from gradleak.registry import DATASETS

# Every other module of this package (e.g. text datasets, owned elsewhere) registers on import too.
for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")

__all__ = ["ImageSet", "SOURCES", "check_disjoint", "dataset_modality", "default_public", "load", "names",
           "to_model_range", "from_model_range"]

#: The module whose registered datasets are text (everything else in ``DATASETS`` is images).
TEXT_MODULE = f"{__name__}.text"


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


def dataset_modality(name: str) -> str:
    """The modality of the dataset registered as ``name``: the loader's own ``modality`` attribute when it declares
    one (a dataset of another modality plug-in, as the models' builders declare theirs), else ``"text"`` for a
    dataset registered in ``gradleak.data.text`` and ``"image"`` for the rest; reads no file.

    Unknown names raise the registry's :class:`gradleak.errors.BadInput` (field ``data.name``).
    """
    fn = DATASETS.get(name, field="data.name")
    declared = getattr(fn, "modality", None)
    if isinstance(declared, str):
        return declared
    return "text" if getattr(fn, "__module__", None) == TEXT_MODULE else "image"
