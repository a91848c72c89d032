"""The image container every dataset returns, and the small PIL/numpy helpers the loaders share."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch
from PIL import Image

from gradleak.errors import BadInput


@dataclass
class ImageSet:
    """A batch of images with labels.

    ``images``: float32 tensor N×C×H×W with values in [0, 1]; ``labels``: int64 tensor N;
    ``names``: one source name per image (file name, or ``file#crop7`` for crops);
    ``num_classes``: size of the label space (labels lie in ``[0, num_classes)``).
    """

    images: torch.Tensor
    labels: torch.Tensor
    names: list[str]
    num_classes: int
    source: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.images.ndim != 4:
            raise ValueError(f"ImageSet.images must be N×C×H×W, got shape {tuple(self.images.shape)}")
        n = self.images.shape[0]
        if self.labels.shape != (n,) or len(self.names) != n:
            raise ValueError(f"ImageSet: {n} images but labels {tuple(self.labels.shape)} and {len(self.names)} names")

    def __len__(self) -> int:
        return int(self.images.shape[0])

    @property
    def shape(self) -> tuple[int, int, int]:
        """(C, H, W) of one image."""
        return tuple(self.images.shape[1:])  # type: ignore[return-value]

    def take(self, n: int) -> "ImageSet":
        """The first ``n`` images (deterministic)."""
        return ImageSet(self.images[:n], self.labels[:n], self.names[:n], self.num_classes, self.source, dict(self.meta))


def to_model_range(images: torch.Tensor) -> torch.Tensor:
    """Map images from [0, 1] to the [-1, 1] range most of our models take (x ↦ 2x − 1)."""
    return images * 2.0 - 1.0


def from_model_range(images: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_model_range`: [-1, 1] ↦ [0, 1] (x ↦ (x + 1) / 2); no clamping."""
    return (images + 1.0) / 2.0


def pil_to_array(img: Image.Image, mode: str = "RGB") -> np.ndarray:
    """PIL image -> float32 array C×H×W in [0, 1] (``mode`` "RGB" or "L")."""
    arr = np.asarray(img.convert(mode), dtype=np.float32) / 255.0
    if arr.ndim == 2:
        arr = arr[None]
    else:
        arr = arr.transpose(2, 0, 1)
    return np.ascontiguousarray(arr)


def stack(arrays: Sequence[np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(np.stack(arrays).astype(np.float32, copy=False))


def center_square(img: Image.Image) -> Image.Image:
    w, h = img.size
    s = min(w, h)
    left, top = (w - s) // 2, (h - s) // 2
    return img.crop((left, top, left + s, top + s))


def resize(img: Image.Image, size: int) -> Image.Image:
    """Square resize with PIL bicubic (PIL widens the kernel when down-scaling, i.e. it antialiases)."""
    if img.size == (size, size):
        return img
    return img.resize((size, size), Image.BICUBIC, reducing_gap=None)


def random_square_crops(sources: Sequence[Image.Image], n: int, size: int, seed: int,
                        min_scale: float = 0.25) -> tuple[list[np.ndarray], list[int], list[tuple[int, int, int]]]:
    """``n`` seeded random square crops, each resized to ``size``.

    For every crop: a source photo is drawn uniformly, a side ``s = U(min_scale, 1) × min(W, H)``,
    a uniform top-left corner, then an antialiased bicubic resize to ``size``×``size``. Returns the arrays, the
    source index of each crop and its box ``(left, top, side)``.
    """
    rng = np.random.default_rng(seed)
    arrays, src_idx, boxes = [], [], []
    for _ in range(n):
        k = int(rng.integers(len(sources)))
        img = sources[k]
        w, h = img.size
        side = max(1, int(round(rng.uniform(min_scale, 1.0) * min(w, h))))
        left = int(rng.integers(0, w - side + 1))
        top = int(rng.integers(0, h - side + 1))
        # resize straight from the box; reducing_gap=3 pre-shrinks by an integer factor first (3x faster,
        # ≤ 0.4/255 mean difference from a plain bicubic resize).
        crop = img.resize((size, size), Image.BICUBIC, box=(left, top, left + side, top + side), reducing_gap=3.0)
        arrays.append(pil_to_array(crop))
        src_idx.append(k)
        boxes.append((left, top, side))
    return arrays, src_idx, boxes


def check_positive_int(value: Any, field_name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < minimum:
        raise BadInput(field_name, f"expected an integer ≥ {minimum}, got {value!r}.")
    return int(value)


def check_kwargs(fn: Callable[..., Any], name: str, kwargs: dict[str, Any]) -> None:
    """Reject keyword arguments a dataset does not take, naming ``data.<key>`` and the accepted ones."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = sorted(set(kwargs) - set(params))
    if unknown:
        raise BadInput(f"data.{unknown[0]}", f"dataset '{name}' takes no option '{unknown[0]}'.",
                       f"its options are: {', '.join(params) or '(none)'}.")
