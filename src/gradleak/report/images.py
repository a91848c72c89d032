"""Image grids for reports: originals next to reconstructions, unrecovered (NaN) pixels in grey."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from gradleak.atomic import atomic_path

UNRECOVERED_GREY = 0.5

#: the one register of the files that hold the clients' private data, by name: the private images (ground truth,
#: reconstructions), the report embedding them, and every file holding the private sentences or what was recovered
#: of them -- a run's results.json and report_data.json (the reference and reconstructed sentences), an audit's
#: audit.json (its evidence rows), a Flower scorer's reconstruction.json / images.png. Each is written owner-only
#: (0600) from the moment the file exists (:func:`gradleak.atomic.atomic_path`), never readable by others even briefly;
#: :func:`gradleak.run.runner.protect_private_artifacts` is the backstop on a run folder
PRIVATE_ARTIFACTS = re.compile(r"^(report\.html|report_data\.json|results\.json|audit\.json|reconstruction\.json|"
                               r"images\.png|(ground_truth|reconstruction|reconstructions_client\d+_round\d+)"
                               r"(_trial\w+)?\.png)$")


def artifact_mode(path: str | Path) -> int:
    """The permission bits a report artifact is written with: 0600 for a private artifact (its name matches
    :data:`PRIVATE_ARTIFACTS`), 0644 for the others."""
    return 0o600 if PRIVATE_ARTIFACTS.match(Path(path).name) else 0o644


def publish_mode(path: str | Path) -> int | None:
    """The ``mode`` an artifact's atomic write (:func:`gradleak.atomic.atomic_path`) is given: None for a private one,
    which keeps the 0600 it was created with (no chmod), :func:`artifact_mode` (0644) for the others."""
    mode = artifact_mode(path)
    return None if mode == 0o600 else mode


def grid_array(images: torch.Tensor, nrow: int = 8, padding: int = 1, pad_value: float = 1.0) -> np.ndarray:
    """N×C×H×W images in [0, 1] → one H'×W'×3 uint8 array (NaN → grey 0.5, values clamped to [0, 1])."""
    x = torch.as_tensor(images).detach().to("cpu", torch.float32)
    if x.ndim == 3:
        x = x.unsqueeze(0)
    if x.ndim != 4 or x.shape[1] not in (1, 3, 4):
        raise ValueError(f"save_image_grid needs N×C×H×W images with C in 1/3/4, got {tuple(x.shape)}")
    x = torch.nan_to_num(x, nan=UNRECOVERED_GREY).clamp(0.0, 1.0)
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    x = x[:, :3]
    n, _, h, w = x.shape
    nrow = max(1, min(nrow, n)) if n else 1
    rows = max(1, math.ceil(n / nrow))
    canvas = np.full((rows * (h + padding) + padding, nrow * (w + padding) + padding, 3), pad_value, np.float32)
    arr = x.permute(0, 2, 3, 1).numpy()
    for i in range(n):
        r, c = divmod(i, nrow)
        top, left = padding + r * (h + padding), padding + c * (w + padding)
        canvas[top:top + h, left:left + w] = arr[i]
    return (canvas * 255.0 + 0.5).astype(np.uint8)


def save_image_grid(images: torch.Tensor, path: str | Path, nrow: int = 8, upscale: int = 4,
                    padding: int = 1) -> Path:
    """Save N×C×H×W images in [0, 1] as one PNG grid, ``nrow`` per row, each pixel drawn ``upscale``×``upscale``.

    NaN pixels (unrecovered) are drawn grey (0.5); nearest-neighbour upscaling keeps 32×32 images crisp.
    Written atomically; returns the path.
    """
    path = Path(path)
    img = Image.fromarray(grid_array(images, nrow=nrow, padding=padding))
    if upscale and upscale > 1:
        img = img.resize((img.width * upscale, img.height * upscale), Image.NEAREST)
    return save_png_atomically(path, lambda tmp: img.save(tmp, format="PNG"))


def save_png_atomically(path, write) -> Path:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it to ``path``
    (:func:`gradleak.atomic.atomic_path`: created 0600, opened to others only when it is not private,
    :func:`publish_mode`)."""
    path = Path(path)
    with atomic_path(path, mode=publish_mode(path), suffix=".png.tmp") as tmp:
        write(tmp)
    return path
