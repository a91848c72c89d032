"""Pixel metrics between reconstructions and ground truth: MSE, PSNR, SSIM, and patch utilities.

Conventions (docs/PAPERS.md, metric conventions): images are N×C×H×W (a single C×H×W image is treated as a batch of one) with
values in ``[0, data_range]``, ``data_range = 1`` by default. Every metric returns a float64 tensor of
shape (N,) — one value per image — so callers report mean ± std. A NaN pixel (an unrecovered pixel)
makes that image's value NaN; compute on recovered patches (:func:`patch_grid`) instead.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from gradleak.registry import METRICS


def _pair(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.as_tensor(x)
    y = torch.as_tensor(y)
    if x.ndim == 3:
        x = x.unsqueeze(0)
    if y.ndim == 3:
        y = y.unsqueeze(0)
    if x.shape != y.shape or x.ndim != 4:
        raise ValueError(f"metrics need two N×C×H×W tensors of the same shape, got {tuple(x.shape)} and {tuple(y.shape)}")
    return x.detach().to("cpu", torch.float64), y.detach().to("cpu", torch.float64)


@METRICS.register("mse", "mean squared error per image, ↓, range [0, data_range²]")
def mse(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean squared error over C×H×W, per image. Range [0, data_range²]; lower is better."""
    x, y = _pair(x, y)
    return ((x - y) ** 2).flatten(1).mean(1)


@METRICS.register("psnr", "peak signal-to-noise ratio per image in dB, ↑, 10·log10(range²/MSE), +inf if identical")
def psnr(x: torch.Tensor, y: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """PSNR = 10·log10(data_range² / MSE) in dB per image (our convention, docs/PAPERS.md: images in [0, 1] → 10·log10(1/MSE)).

    Range (−∞, +∞]; identical images give +inf; higher is better. Typical: ≈10 dB noise, >30 dB near-exact.
    """
    m = mse(x, y)
    out = torch.full_like(m, math.inf)
    nz = m > 0
    out[nz] = 10.0 * torch.log10(data_range**2 / m[nz])
    out[torch.isnan(m)] = math.nan
    return out


def ssim_window(height: int, width: int) -> dict:
    """The structural_similarity window settings we use for an image of this size.

    ≥ 11 px: the standard Gaussian window of Wang et al. 2004 (σ = 1.5, 11×11, ``use_sample_covariance=False``)
    — docs/PAPERS.md, metric conventions. Smaller patches (e.g. 8×8 CIFAR patches) cannot hold that window: there a uniform window of
    the largest odd size ≤ the short side (min 3) is used. Below 3 px SSIM is undefined (NaN).
    """
    side = min(height, width)
    if side >= 11:
        return {"gaussian_weights": True, "sigma": 1.5, "use_sample_covariance": False}
    win = side if side % 2 else side - 1
    return {"gaussian_weights": False, "win_size": win, "use_sample_covariance": False}


@METRICS.register("ssim", "structural similarity per image (Gaussian 11×11, σ=1.5), ↑, range [-1, 1]")
def ssim(x: torch.Tensor, y: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """SSIM per image via ``skimage.metrics.structural_similarity`` (channels averaged).

    Range [−1, 1]; 1 for identical images; higher is better. Window: :func:`ssim_window`.
    """
    from skimage.metrics import structural_similarity

    x, y = _pair(x, y)
    n, c, h, w = x.shape
    if min(h, w) < 3:
        return torch.full((n,), math.nan, dtype=torch.float64)
    kw = ssim_window(h, w)
    xs, ys = x.numpy(), y.numpy()
    vals = []
    for a, b in zip(xs, ys):
        if np.isnan(a).any() or np.isnan(b).any():
            vals.append(math.nan)
            continue
        vals.append(float(structural_similarity(a, b, channel_axis=0, data_range=data_range, **kw)))
    return torch.tensor(vals, dtype=torch.float64)


def patch_grid(images: torch.Tensor, patch: int) -> torch.Tensor:
    """Split N×C×H×W images into non-overlapping patches: returns N×P×C×patch×patch, row-major (ViT order).

    H and W must be multiples of ``patch``. Inverse: :func:`unpatch_grid`.
    """
    n, c, h, w = images.shape
    if h % patch or w % patch:
        raise ValueError(f"image size {h}×{w} is not a multiple of the patch size {patch}")
    gh, gw = h // patch, w // patch
    t = images.reshape(n, c, gh, patch, gw, patch).permute(0, 2, 4, 1, 3, 5)
    return t.reshape(n, gh * gw, c, patch, patch)


def unpatch_grid(patches: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Inverse of :func:`patch_grid`: N×P×C×p×p → N×C×H×W."""
    n, num, c, p, _ = patches.shape
    gh, gw = height // p, width // p
    if gh * gw != num:
        raise ValueError(f"{num} patches of {p}×{p} do not tile {height}×{width}")
    t = patches.reshape(n, gh, gw, c, p, p).permute(0, 3, 1, 4, 2, 5)
    return t.reshape(n, c, height, width)


def recovered_patches(reconstruction: torch.Tensor, truth: torch.Tensor, patch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs (recovered, truth) of the patches whose reconstruction has no NaN pixel, as M×C×p×p each.

    PEFTLeak (Sec. 5, Table 1) reports MSE/SSIM/LPIPS "across the recovered patches": feed these to the metrics.
    """
    r = patch_grid(reconstruction, patch).flatten(0, 1)
    t = patch_grid(truth, patch).flatten(0, 1)
    ok = ~torch.isnan(r).flatten(1).any(1)
    return r[ok], t[ok]
