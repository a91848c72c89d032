"""Which source images each image dataset is made of, so a server's *public* set is never the victim's data.

``SOURCES`` maps a dataset name to the families of source images it is built from (see ``builtin.py``):
two sets overlap when they share a family. A name without an entry (a user's ``image-folder`` / ``npz``,
a text set) is its own family, so the same name on both sides always overlaps — even a generator whose
seeds differ (``natural-crops`` with two seeds still crops the same 20 photos).
"""

from __future__ import annotations

from gradleak.errors import BadInput
from gradleak.registry import DATASETS

#: Source-image family -> what it is (for messages).
FAMILIES: dict[str, str] = {
    "foolbox-cifar10": "the 20 CIFAR-10 test images shipped in foolbox",
    "foolbox-cifar100": "the 20 CIFAR-100 images shipped in foolbox",
    "foolbox-imagenet-a": "ImageNet photos 0-9 shipped in foolbox",
    "foolbox-imagenet-b": "ImageNet photos 10-19 shipped in foolbox",
    "skimage-sklearn": "the sample photos shipped in scikit-image and scikit-learn",
    "fashion-mnist": "Debian's Fashion-MNIST files",
    "skimage-lfw": "the LFW faces of scikit-image's lfw_subset",
}

#: Dataset name -> the source-image families it is made of.
SOURCES: dict[str, frozenset[str]] = {
    "cifar10-samples": frozenset({"foolbox-cifar10"}),
    "cifar100-samples": frozenset({"foolbox-cifar100"}),
    "cifar-samples": frozenset({"foolbox-cifar10", "foolbox-cifar100"}),
    "imagenet-samples": frozenset({"foolbox-imagenet-a", "foolbox-imagenet-b"}),
    "natural-crops": frozenset({"foolbox-imagenet-a", "foolbox-imagenet-b"}),  # crops of the imagenet-samples photos
    "natural-crops-a": frozenset({"foolbox-imagenet-a"}),  # crops of photos 0-9 only
    "natural-crops-b": frozenset({"foolbox-imagenet-b"}),  # crops of photos 10-19 only
    "public-natural": frozenset({"skimage-sklearn"}),  # built to be disjoint from every attacked set
    "fashion-mnist": frozenset({"fashion-mnist"}),  # train and test splits: one family (same name)
    "lfw-faces": frozenset({"skimage-lfw"}),  # not among public-natural's photos (PUBLIC_SKIMAGE_PHOTOS)
}

#: Sets that yield any number of images, i.e. usable as public data; tried in this order.
PUBLIC_SETS = ("natural-crops", "public-natural")


def source_families(name: str) -> frozenset[str]:
    """The source-image families of dataset ``name`` (its own name when it has no ``SOURCES`` entry)."""
    return SOURCES.get(name, frozenset({name}))


def _disjoint_public(private: str) -> list[str]:
    fam = source_families(private)
    return [n for n in PUBLIC_SETS if n in DATASETS and source_families(n).isdisjoint(fam)]


def default_public(private: str) -> str:
    """The first of :data:`PUBLIC_SETS` sharing no source image with ``private`` (``natural-crops``, or
    ``public-natural`` when the private set is made of the ImageNet sample photos)."""
    DATASETS.get(private, field="data.name")
    return _disjoint_public(private)[0]


def check_disjoint(private: str, public: str) -> None:
    """Refuse a public set that shares source images with the private (attacked) set.

    Raises the registry's :class:`BadInput` for an unknown name (``data.name`` / ``data.public``) and
    ``BadInput("data.public", ...)`` naming a disjoint public set when the two overlap.
    """
    DATASETS.get(private, field="data.name")
    DATASETS.get(public, field="data.public")
    shared = source_families(private) & source_families(public)
    if not shared:
        return
    what = ", ".join(FAMILIES.get(f, f"the files of '{f}'") for f in sorted(shared))
    same = " (the same dataset on both sides: other seeds or crops still come from the same images)" \
        if private == public else ""
    options = _disjoint_public(private)
    fix = (f"use data.public={options[-1]}" + (f" (or {', '.join(options[:-1])})" if len(options) > 1 else "")
           + f", which shares no source image with '{private}'." if options
           else "use a public set made of other images than the private set.")
    raise BadInput("data.public", f"the public set '{public}' and the private set '{private}' are both made of "
                   f"{what}{same}: the server's public data would contain the attacked images.", fix)
