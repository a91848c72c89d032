"""Built-in offline image sets (ASSETS.md): foolbox's real CIFAR/ImageNet samples, crops of them,
a disjoint public set from scikit-image/scikit-learn photos, and Debian's Fashion-MNIST.

Package data is located with ``importlib.util.find_spec`` — foolbox itself is never imported (it
needs eagerpy); only its ``data/`` folder of PNG/JPEG files is read.
"""

from __future__ import annotations

import gzip
import importlib.util
import re
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from gradleak.data.base import ImageSet, center_square, check_positive_int, pil_to_array, random_square_crops, resize, stack
from gradleak.errors import BadInput, MissingAsset
from gradleak.registry import DATASETS

FOOLBOX_INSTALL = "pip install --no-deps foolbox==3.3.4"
FASHION_MNIST_INSTALL = "sudo apt-get install -y dataset-fashion-mnist"
#: Where Debian's ``dataset-fashion-mnist`` puts its files (module attribute so tests can point it elsewhere).
FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
CIFAR100_LABEL_OFFSET = 10

_NAME_RE = re.compile(r"^(?P<set>[A-Za-z0-9]+?)_(?P<index>\d+)_(?P<label>\d+)\.(png|jpg|jpeg)$")


def foolbox_data_dir() -> Path:
    """The ``foolbox/data`` folder of the installed foolbox package (not imported), or MissingAsset."""
    spec = importlib.util.find_spec("foolbox")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        d = Path(loc) / "data"
        if d.is_dir() and any(d.glob("cifar10_*")):
            return d
    raise MissingAsset("foolbox sample images", FOOLBOX_INSTALL)


def foolbox_files(prefix: str) -> list[tuple[Path, int]]:
    """``(path, label)`` of foolbox's ``{prefix}_{index}_{label}.*`` files, ordered by index."""
    found = []
    for p in foolbox_data_dir().iterdir():
        m = _NAME_RE.match(p.name)
        if m and m.group("set") == prefix:
            found.append((int(m.group("index")), p, int(m.group("label"))))
    if not found:
        raise MissingAsset(f"foolbox sample images ({prefix})", FOOLBOX_INSTALL)
    return [(p, label) for _, p, label in sorted(found)]


def _take(images: torch.Tensor, labels: list[int], names: list[str], num_classes: int, n: int | None,
          source: str) -> ImageSet:
    total = images.shape[0]
    if n is not None:
        n = check_positive_int(n, "data.batch_size")
        if n > total:
            raise BadInput("data.batch_size", f"'{source}' holds only {total} real images, {n} were asked for.",
                           f"use data.batch_size ≤ {total}, or the 'natural-crops' dataset (any number of "
                           "natural images cropped from the ImageNet samples).")
        images, labels, names = images[:n], labels[:n], names[:n]
    return ImageSet(images.contiguous(), torch.tensor(labels, dtype=torch.int64), list(names), num_classes, source)


@lru_cache(maxsize=None)
def _cifar(prefix: str) -> tuple[torch.Tensor, tuple[int, ...], tuple[str, ...]]:
    files = foolbox_files(prefix)
    arrays = [pil_to_array(Image.open(p)) for p, _ in files]
    return stack(arrays), tuple(label for _, label in files), tuple(p.name for p, _ in files)


@DATASETS.register("cifar10-samples", "20 real CIFAR-10 test images (32×32, foolbox package data), labels 0–9")
def cifar10_samples(n: int | None = None) -> ImageSet:
    x, y, names = _cifar("cifar10")
    return _take(x.clone(), list(y), list(names), 10, n, "cifar10-samples")


@DATASETS.register("cifar100-samples", "20 real CIFAR-100 images (32×32, foolbox package data), labels 0–99")
def cifar100_samples(n: int | None = None) -> ImageSet:
    x, y, names = _cifar("cifar100")
    return _take(x.clone(), list(y), list(names), 100, n, "cifar100-samples")


@DATASETS.register("cifar-samples",
                   "the 40 real CIFAR images in foolbox (20 CIFAR-10 then 20 CIFAR-100, labels +10), 110 classes")
def cifar_samples(n: int | None = None) -> ImageSet:
    """CIFAR-10 samples (labels 0–9) followed by CIFAR-100 samples (labels 10–109), in file-index order."""
    x10, y10, n10 = _cifar("cifar10")
    x100, y100, n100 = _cifar("cifar100")
    labels = list(y10) + [y + CIFAR100_LABEL_OFFSET for y in y100]
    return _take(torch.cat([x10, x100]), labels, list(n10) + list(n100), 10 + 100, n, "cifar-samples")


@lru_cache(maxsize=None)
def _imagenet_photos() -> tuple[tuple[Image.Image, ...], tuple[int, ...], tuple[str, ...]]:
    files = foolbox_files("imagenet")
    photos = []
    for p, _ in files:
        with Image.open(p) as im:
            photos.append(im.convert("RGB"))
    return tuple(photos), tuple(label for _, label in files), tuple(p.name for p, _ in files)


@DATASETS.register("imagenet-samples",
                   "20 real ImageNet photos (foolbox package data), centre-cropped and resized to `size` (default 224)")
def imagenet_samples(size: int = 224, n: int | None = None) -> ImageSet:
    size = check_positive_int(size, "data.size")
    photos, labels, names = _imagenet_photos()
    x = stack([pil_to_array(resize(center_square(p), size)) for p in photos])
    return _take(x, list(labels), list(names), 1000, n, "imagenet-samples")


@DATASETS.register("natural-crops",
                   "any number `n` of seeded random crops (size `size`) of the 20 ImageNet sample photos")
def natural_crops(n: int = 128, size: int = 32, seed: int = 0, min_scale: float = 0.25) -> ImageSet:
    """Random square crops of the ImageNet sample photos, for batches larger than the 40 CIFAR images.

    Each crop takes a side of ``U(min_scale, 1)`` × the photo's short side at a random position and is
    resized to ``size`` (see :func:`gradleak.data.base.random_square_crops`). The label is the ImageNet
    class of the source photo. These images overlap ``imagenet-samples`` — never use them as *public*
    data against an ImageNet-sample victim; use ``public-natural`` for that.
    """
    return _crops_of(range(20), "natural-crops", n, size, seed, min_scale)


def _crops_of(which, name: str, n: int, size: int, seed: int, min_scale: float) -> ImageSet:
    """``n`` seeded random crops of the ImageNet sample photos with indices ``which``."""
    n = check_positive_int(n, "data.n")
    size = check_positive_int(size, "data.size")
    if not 0.0 < float(min_scale) <= 1.0:
        raise BadInput("data.min_scale", f"expected a fraction in (0, 1], got {min_scale!r}.")
    photos, labels, names = _imagenet_photos()
    which = list(which)
    arrays, src, boxes = random_square_crops(tuple(photos[k] for k in which), n, size, int(seed), float(min_scale))
    src = [which[k] for k in src]
    crop_names = [f"{names[k]}#crop{i}" for i, k in enumerate(src)]
    return ImageSet(stack(arrays), torch.tensor([labels[k] for k in src], dtype=torch.int64), crop_names, 1000,
                    name, {"boxes": boxes, "seed": int(seed), "photos": sorted(set(src))})


#: the two halves of the 20 ImageNet sample photos (by file order): a same-distribution, disjoint private/public split
IMAGENET_HALVES = {"natural-crops-a": range(0, 10), "natural-crops-b": range(10, 20)}


@DATASETS.register("natural-crops-a",
                   "seeded random crops of ImageNet sample photos 0-9 (disjoint from natural-crops-b: the same "
                   "distribution for a server's public statistics)")
def natural_crops_a(n: int = 128, size: int = 32, seed: int = 0, min_scale: float = 0.25) -> ImageSet:
    return _crops_of(IMAGENET_HALVES["natural-crops-a"], "natural-crops-a", n, size, seed, min_scale)


@DATASETS.register("natural-crops-b",
                   "seeded random crops of ImageNet sample photos 10-19 (disjoint from natural-crops-a)")
def natural_crops_b(n: int = 128, size: int = 32, seed: int = 0, min_scale: float = 0.25) -> ImageSet:
    return _crops_of(IMAGENET_HALVES["natural-crops-b"], "natural-crops-b", n, size, seed, min_scale)


# Natural photographs shipped inside scikit-image (the ones that load offline; ASSETS.md) and scikit-learn.
PUBLIC_SKIMAGE_PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "camera", "coins", "moon", "clock",
                         "hubble_deep_field", "immunohistochemistry", "brick", "grass", "gravel", "retina", "cell")


@lru_cache(maxsize=None)
def _public_photos() -> tuple[tuple[Image.Image, ...], tuple[str, ...]]:
    photos: list[Image.Image] = []
    names: list[str] = []
    try:
        import skimage.data as skdata
    except Exception:  # pragma: no cover - scikit-image is a hard dependency
        skdata = None
    for name in PUBLIC_SKIMAGE_PHOTOS if skdata is not None else ():
        try:
            arr = np.asarray(getattr(skdata, name)())
        except Exception:  # not shipped in this scikit-image version (it would need a download): skip it
            continue
        if arr.dtype != np.uint8:
            arr = (255 * (arr - arr.min()) / max(float(arr.max() - arr.min()), 1e-12)).astype(np.uint8)
        if arr.ndim == 3 and arr.shape[2] == 4:
            arr = arr[..., :3]
        photos.append(Image.fromarray(arr).convert("RGB"))
        names.append(f"skimage.{name}")
    try:
        from sklearn.datasets import load_sample_images

        bunch = load_sample_images()
        for arr, fname in zip(bunch.images, bunch.filenames):
            photos.append(Image.fromarray(np.asarray(arr, dtype=np.uint8)).convert("RGB"))
            names.append(f"sklearn.{Path(fname).name}")
    except Exception:  # pragma: no cover
        pass
    if not photos:
        raise MissingAsset("scikit-image / scikit-learn sample photos", "pip install scikit-image scikit-learn")
    return tuple(photos), tuple(names)


LFW_FACES = 100  # skimage.data.lfw_subset(): 100 faces, then 100 non-faces
LFW_CLASSES = 20  # the paper's CelebA setting: 20 identities -> 20 classes (LFW's subset has no identity labels)


@DATASETS.register("lfw-faces", "100 real LFW face photos (scikit-image's lfw_subset, 25×25 grey; resized and "
                   "replicated to RGB by the pipeline), labels index mod 20 (the subset has no identities)")
def lfw_faces(n: int | None = None) -> ImageSet:
    """The real faces of scikit-image's ``lfw_subset()`` (its first 100 images; the others are non-faces), the
    victims of paper 001's face setting (Table 2: CelebA, 20 identities): offline, disjoint from the synthetic
    DigiFace-1M faces the ``faces`` generator was trained on. The subset carries no identities, so the class of
    image i is i mod 20 — a classification task for the client to train, not a claim about who is who."""
    try:
        import skimage.data as skdata

        arr = np.asarray(skdata.lfw_subset())[:LFW_FACES]
    except Exception as err:  # pragma: no cover - scikit-image is a hard dependency
        raise MissingAsset("scikit-image lfw_subset", "pip install scikit-image") from err
    x = torch.from_numpy(arr.astype(np.float32))[:, None].clamp(0, 1)
    labels = [i % LFW_CLASSES for i in range(len(x))]
    return _take(x, labels, [f"lfw_subset#{i}" for i in range(len(x))], LFW_CLASSES, n, "lfw-faces")


@DATASETS.register("public-natural",
                   "public data disjoint from every attacked set: seeded random crops of scikit-image/-learn photos")
def public_natural(n: int = 128, size: int = 32, seed: int = 0, min_scale: float = 0.25) -> ImageSet:
    """Crops of the natural photos shipped in scikit-image and scikit-learn (never foolbox/CIFAR/ImageNet).

    Use it wherever a threat model grants the server *public* data (statistics, priors, bias
    calibration): it cannot contain any attacked image. Label = index of the source photo.
    """
    n = check_positive_int(n, "data.n")
    size = check_positive_int(size, "data.size")
    if not 0.0 < float(min_scale) <= 1.0:
        raise BadInput("data.min_scale", f"expected a fraction in (0, 1], got {min_scale!r}.")
    photos, names = _public_photos()
    arrays, src, boxes = random_square_crops(photos, n, size, int(seed), float(min_scale))
    return ImageSet(stack(arrays), torch.tensor(src, dtype=torch.int64), [f"{names[k]}#crop{i}" for i, k in enumerate(src)],
                    len(photos), "public-natural", {"boxes": boxes, "seed": int(seed), "sources": list(names)})


def _idx_file(root: Path, kind: str, split: str) -> Path:
    prefixes = {"train": ("train",), "test": ("t10k", "test")}[split]
    ndim = 3 if kind == "images" else 1
    for prefix in prefixes:
        for ext in (".gz", ""):
            p = root / f"{prefix}-{kind}-idx{ndim}-ubyte{ext}"
            if p.is_file():
                return p
    raise MissingAsset("fashion-mnist", FASHION_MNIST_INSTALL)


def _read_idx(path: Path, offset: int) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        return np.frombuffer(f.read(), dtype=np.uint8, offset=offset)


@lru_cache(maxsize=2)
def _fashion(split: str, root: Path) -> tuple[torch.Tensor, torch.Tensor]:
    images = _read_idx(_idx_file(root, "images", split), 16)
    labels = _read_idx(_idx_file(root, "labels", split), 8)
    if images.size != labels.size * 28 * 28:
        raise BadInput("data.name", f"the Fashion-MNIST files in {root} are inconsistent "
                       f"({images.size} pixels for {labels.size} labels).", f"reinstall: `{FASHION_MNIST_INSTALL}`.")
    x = torch.from_numpy(images.reshape(-1, 1, 28, 28).astype(np.float32) / 255.0)
    return x, torch.from_numpy(labels.astype(np.int64))


@DATASETS.register("fashion-mnist", "Fashion-MNIST 28×28 grey (Debian dataset-fashion-mnist), split train|test")
def fashion_mnist(split: str = "train", n: int | None = None) -> ImageSet:
    if split not in ("train", "test"):
        raise BadInput("data.split", f"unknown split '{split}'.", "use 'train' (60,000 images) or 'test' (10,000).")
    x, y = _fashion(split, Path(FASHION_MNIST_DIR))
    if n is not None:
        n = check_positive_int(n, "data.n")
        if n > x.shape[0]:
            raise BadInput("data.n", f"fashion-mnist/{split} holds {x.shape[0]} images, {n} were asked for.")
        x, y = x[:n], y[:n]
    prefix = "train" if split == "train" else "t10k"
    return ImageSet(x.clone(), y.clone(), [f"{prefix}#{i}" for i in range(x.shape[0])], 10, "fashion-mnist")
