"""Metrics (docs/DESIGN.md §2): pure, batched functions with documented ranges, registered in ``METRICS``.

Image metrics take N×C×H×W tensors in [0, 1] and return one float64 value per image:
``mse`` ↓, ``psnr`` ↑ (dB), ``ssim`` ↑ [−1, 1], ``lpips`` ↓ (``None`` unless the user supplied AlexNet/LPIPS weights).
Heavy models load on first use. The ``feature_distance`` metric (↓ [0, 2], 1 − cos of the offline ViT-S/14's CLS
features) needs a pretrained backbone, a model: it lives in :mod:`gradleak.models.features` and registers in
``METRICS`` from there.
"""

from __future__ import annotations

from gradleak.metrics.image import mse, patch_grid, psnr, recovered_patches, ssim, ssim_window, unpatch_grid
from gradleak.metrics.lpips import lpips, lpips_status

# Other metric modules in this package (e.g. text metrics, owned elsewhere) register on import too.
import importlib as _importlib
import pkgutil as _pkgutil

for _info in _pkgutil.iter_modules(__path__):
    _importlib.import_module(f"{__name__}.{_info.name}")

__all__ = ["mse", "psnr", "ssim", "ssim_window", "lpips", "lpips_status", "patch_grid", "unpatch_grid",
           "recovered_patches"]
