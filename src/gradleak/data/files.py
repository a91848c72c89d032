"""Users' own image data: a folder of images (class = sub-folder) or an ``.npz`` array file.

These are how a user with CIFAR-10, TinyImageNet or CelebA on disk points gradleak at them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from gradleak.data.base import ImageSet, check_positive_int, pil_to_array, resize, stack
from gradleak.errors import BadInput
from gradleak.registry import DATASETS

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm"}


def _existing(path, field_name: str, want_dir: bool) -> Path:
    if path is None or str(path) == "":
        raise BadInput(field_name, "no path given.", "set it to a " + ("folder of images." if want_dir else ".npz file."))
    p = Path(path).expanduser()
    if want_dir and not p.is_dir():
        raise BadInput(field_name, f"'{p}' is not a folder.", "point it at a folder of images (one sub-folder per class).")
    if not want_dir and not p.is_file():
        raise BadInput(field_name, f"'{p}' does not exist.", "point it at an .npz file with arrays x/images and y/labels.")
    return p


def _images_in(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


@DATASETS.register("image-folder",
                   "your own images: `path` to a folder (class = sub-folder name); data.resize resizes to data.image_size")
def image_folder(path: str | None = None, size: int | None = None, n: int | None = None, mode: str = "RGB") -> ImageSet:
    """Load every image under ``path``.

    Layout: ``path/<class>/<image>`` (classes sorted by name → labels 0..K−1) or a flat folder of
    images (one class, label 0). ``size`` resizes to size×size (bicubic, no crop; in a config:
    ``data.resize: true`` with ``data.image_size``); without it every image must already have the same
    size. ``mode`` "RGB" (3 channels) or "L" (grey, 1 channel).
    """
    root = _existing(path, "data.path", want_dir=True)
    if mode not in ("RGB", "L"):
        raise BadInput("data.mode", f"unknown mode '{mode}'.", "use 'RGB' or 'L'.")
    if size is not None:  # the experiment passes data.image_size here when data.resize is set
        size = check_positive_int(size, "data.image_size")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and _images_in(p))
    entries: list[tuple[Path, int]] = []
    if classes:
        for k, c in enumerate(classes):
            entries += [(p, k) for p in _images_in(root / c)]
    else:
        entries = [(p, 0) for p in _images_in(root)]
        classes = [root.name]
    if not entries:
        raise BadInput("data.path", f"no images ({', '.join(sorted(IMAGE_SUFFIXES))}) found in '{root}'.")
    if n is not None:
        entries = entries[: check_positive_int(n, "data.n")]
    arrays = []
    for p, _ in entries:
        try:
            with Image.open(p) as im:
                im = im.convert(mode)
                arrays.append(pil_to_array(resize(im, size) if size else im, mode))
        except (UnidentifiedImageError, OSError) as err:
            raise BadInput("data.path", f"cannot read image '{p}': {err}.") from None
    shapes = {a.shape for a in arrays}
    if len(shapes) > 1:
        raise BadInput("data.resize", f"the images in '{root}' have different sizes {sorted(shapes)[:3]}….",
                       "set data.resize=true to resize them all to data.image_size×data.image_size "
                       "(e.g. data.image_size=32), or resize the files yourself.")
    names = [str(p.relative_to(root)) for p, _ in entries]
    return ImageSet(stack(arrays), torch.tensor([k for _, k in entries], dtype=torch.int64), names, len(classes),
                    "image-folder", {"classes": classes, "path": str(root)})


def _pick(arrays, keys: tuple[str, ...]):
    for k in keys:
        if k in arrays.files:
            return k, arrays[k]
    return None, None


def _to_nchw(x: np.ndarray, key: str) -> np.ndarray:
    if x.ndim == 3:  # N×H×W grey
        x = x[:, None]
    if x.ndim != 4:
        raise BadInput("data.path", f"array '{key}' has shape {x.shape}; expected N×H×W×C, N×C×H×W or N×H×W.")
    channels_first = x.shape[1] in (1, 3, 4) and x.shape[3] not in (1, 3, 4)
    channels_last = x.shape[3] in (1, 3, 4) and not channels_first
    if channels_last:
        x = x.transpose(0, 3, 1, 2)
    elif not channels_first:
        raise BadInput("data.path", f"array '{key}' has shape {x.shape}: cannot tell where the channel axis is "
                       "(expected 1, 3 or 4 channels first or last).")
    return x


@DATASETS.register("npz", "your own images in an .npz: `path`, arrays x|images (NHWC uint8 or NCHW float) and y|labels")
def npz(path: str | None = None, n: int | None = None, num_classes: int | None = None) -> ImageSet:
    """Load images from an ``.npz`` file.

    ``x``/``images``: N×H×W×C uint8 (0–255), or N×C×H×W float already in [0, 1] (also N×H×W grey; any
    uint8 layout is divided by 255). ``y``/``labels`` (optional; all 0 without them): integers ≥ 0.
    ``num_classes`` defaults to max(label) + 1.
    """
    p = _existing(path, "data.path", want_dir=False)
    try:
        arrays = np.load(p, allow_pickle=False)
    except Exception as err:
        raise BadInput("data.path", f"cannot read '{p}' as .npz: {err}.") from None
    xkey, x = _pick(arrays, ("x", "images", "X"))
    if x is None:
        raise BadInput("data.path", f"'{p}' has no image array (found: {', '.join(arrays.files) or 'nothing'}).",
                       "store the images under the key 'x' or 'images'.")
    x = _to_nchw(np.asarray(x), xkey)
    if x.dtype == np.uint8:
        x = x.astype(np.float32) / 255.0
    elif np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float32)
        lo, hi = float(np.nanmin(x)), float(np.nanmax(x))
        if lo < -1e-6 or hi > 1 + 1e-6:
            raise BadInput("data.path", f"float images in '{p}' span [{lo:.3g}, {hi:.3g}], not [0, 1].",
                           "store uint8 0–255 images, or divide float images into [0, 1].")
    else:
        raise BadInput("data.path", f"image array '{xkey}' has dtype {x.dtype}.", "use uint8 (0–255) or float in [0, 1].")
    ykey, y = _pick(arrays, ("y", "labels", "Y"))
    if y is None:
        y = np.zeros(x.shape[0], dtype=np.int64)
    y = np.asarray(y).reshape(-1)
    if y.shape[0] != x.shape[0]:
        raise BadInput("data.path", f"'{p}' holds {x.shape[0]} images but {y.shape[0]} labels.")
    if y.size and (not np.issubdtype(y.dtype, np.integer) or y.min() < 0):
        raise BadInput("data.path", f"labels '{ykey}' in '{p}' must be integers ≥ 0.")
    if n is not None:
        n = check_positive_int(n, "data.n")
        x, y = x[:n], y[:n]
    k = int(y.max()) + 1 if y.size else 1
    if num_classes is not None:
        num_classes = check_positive_int(num_classes, "data.num_classes")
        if num_classes < k:
            raise BadInput("data.num_classes", f"{num_classes} classes but a label is {k - 1}.")
        k = num_classes
    return ImageSet(torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y.astype(np.int64)),
                    [f"{p.name}#{i}" for i in range(x.shape[0])], k, "npz", {"path": str(p)})
