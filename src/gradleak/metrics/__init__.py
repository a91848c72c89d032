"""Metrics (DESIGN §2): pure, batched functions with documented ranges, registered in ``METRICS``.

Image metrics take N×C×H×W tensors in [0, 1] and return one float64 value per image:
``mse`` ↓, ``psnr`` ↑ (dB), ``ssim`` ↑ [−1, 1], ``feature_distance`` ↓ [0, 2] on the offline ViT-S/14,
``lpips`` ↓ (``None`` unless the user supplied AlexNet/LPIPS weights). Heavy models load on first use.
"""

from __future__ import annotations

from gradleak.metrics.features import BACKBONE_NAME, feature_distance, image_features
from gradleak.metrics.image import mse, patch_grid, psnr, recovered_patches, ssim, ssim_window, unpatch_grid
from gradleak.metrics.lpips import lpips, lpips_status

# Other metric modules in this package (e.g. text metrics, owned elsewhere) register on import too.
import importlib as _importlib
import pkgutil as _pkgutil

for _info in _pkgutil.iter_modules(__path__):
    _importlib.import_module(f"{__name__}.{_info.name}")

__all__ = ["mse", "psnr", "ssim", "ssim_window", "feature_distance", "image_features", "BACKBONE_NAME",
           "lpips", "lpips_status", "patch_grid", "unpatch_grid", "recovered_patches"]
