"""Patch-level metrics for analytic attacks that return image patches (PEFTLeak).

Definition (decided here; PEFTLeak leaves it open, open point A1.7 in docs/PAPERS.md): a ground-truth patch (image m,
position t) counts as **recovered** only if the attacker places a patch at position t of the
reconstructed image matched to m and that patch's PSNR to the truth is ≥ ``threshold_db`` (30 dB by
default). Reconstructed images (the attacker's groups) are matched one-to-one to the true images by
the assignment that maximises the number of correctly placed patches (Hungarian algorithm).

PSNR is computed on [0, 1] pixels (inputs are in [-1, 1] and are mapped), per patch.

The patch geometry of a ViT's grid (:func:`image_to_patches`, :func:`patches_to_image`, :func:`upsample_patch`) lives
here too: the attack that recovers patches and the evaluation that places them share it.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from gradleak.registry import METRICS


# ------------------------------------------------------------------------------------------ patch geometry

def image_to_patches(images: torch.Tensor, patch: int, reduce: int = 1) -> torch.Tensor:
    """(B, C, H, W) -> (B, N, C·(P/reduce)²) in the conv's flatten order (c, i, j), row-major positions.

    ``reduce = k`` averages k×k pixel blocks first (ViT-B/32 low-resolution variant, Table 3).
    """
    b, c, h, w = images.shape
    x = images.reshape(b, c, h // patch, patch, w // patch, patch).permute(0, 2, 4, 1, 3, 5)
    x = x.reshape(b, (h // patch) * (w // patch), c, patch, patch)
    if reduce > 1:
        x = x.reshape(*x.shape[:3], patch // reduce, reduce, patch // reduce, reduce).mean((4, 6))
    return x.reshape(b, x.shape[1], -1)


def patches_to_image(patches: torch.Tensor, channels: int, image_size: int, patch: int) -> torch.Tensor:
    """(N, C·P²) patches (NaN allowed) -> (C, H, W) image."""
    g = image_size // patch
    x = patches.reshape(g, g, channels, patch, patch).permute(2, 0, 3, 1, 4)
    return x.reshape(channels, image_size, image_size)


def upsample_patch(vec: torch.Tensor, channels: int, patch: int, reduce: int) -> torch.Tensor:
    """Reduced patch vector -> full-resolution patch vector (nearest, k×k repeat)."""
    p = patch // reduce
    x = vec.reshape(-1, channels, p, p)
    x = x.repeat_interleave(reduce, 2).repeat_interleave(reduce, 3)
    return x.reshape(vec.shape[0], -1)


# ------------------------------------------------------------------------------------------ metrics

def patch_psnr(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """PSNR (dB) per patch of flattened patches in [-1, 1], on the [0, 1] pixel scale (the recovery criterion's)."""
    mse = ((a - b) ** 2).mean(-1) / 4.0  # [-1,1] -> [0,1] scale
    return 10 * torch.log10(1.0 / mse.clamp_min(1e-30))


@METRICS.register("patch_recovery", "patch recovery rate, grouping accuracy, false positives and PSNR of recovered patches")
def patch_recovery(truth: torch.Tensor, patches: torch.Tensor, positions: torch.Tensor, groups: torch.Tensor,
                   threshold_db: float = 30.0) -> dict:
    """Score recovered patches against the truth.

    ``truth``: (B, N, d) true patches in [-1, 1]; ``patches``: (n, d) recovered, ``positions``: (n,) in 1..N,
    ``groups``: (n,) the attacker's image id per patch. Returns a dict of metrics plus
    ``assignment`` (group -> true image) for assembling images.

    * ``patch_recovery_rate`` (0–1): share of the B·N true patches recovered in the sense above.
    * ``isolated_patch_rate`` (0–1): share of true patches recovered at ≥ threshold anywhere at the right
      position, ignoring grouping.
    * ``grouping_accuracy`` (0–1): of the recovered patches that match some true patch at ≥ threshold,
      the share placed in the group matched to their true image.
    * ``false_positives``: returned patches that match no true patch at ≥ threshold, plus duplicates.
    * ``recovered_patch_psnr_median`` / ``_mean`` (dB) over the patches that match a true patch.
    """
    B, N, _ = truth.shape
    n = len(patches)
    out: dict = {"num_true_patches": B * N, "num_returned_patches": n}
    if n == 0:
        out.update(patch_recovery_rate=0.0, isolated_patch_rate=0.0, grouping_accuracy=float("nan"),
                   false_positives=0, recovered_patch_psnr_median=float("nan"), recovered_patch_psnr_mean=float("nan"),
                   assignment={})
        return out
    truth = truth.to(torch.float64)
    patches = patches.to(torch.float64)
    idx = positions.long() - 1
    psnr_all = patch_psnr(truth[:, idx].permute(1, 0, 2), patches[:, None, :])  # n × B
    best_psnr, best_img = psnr_all.max(1)
    valid = best_psnr >= threshold_db
    gids = sorted(set(groups.tolist()))
    gindex = {g: i for i, g in enumerate(gids)}
    counts = np.zeros((len(gids), B))
    for i in torch.nonzero(valid)[:, 0].tolist():
        counts[gindex[int(groups[i])], int(best_img[i])] += 1
    rows, cols = linear_sum_assignment(-counts)
    assignment = {gids[r]: int(c) for r, c in zip(rows, cols) if counts[r, c] > 0}
    recovered: set[tuple[int, int]] = set()
    isolated: set[tuple[int, int]] = set()
    placed_ok = 0
    for i in range(n):
        t = int(idx[i])
        if valid[i]:
            isolated.add((int(best_img[i]), t))
        m = assignment.get(int(groups[i]))
        if m is not None and psnr_all[i, m] >= threshold_db:
            recovered.add((m, t))
            if valid[i] and m == int(best_img[i]):
                placed_ok += 1
    n_valid = int(valid.sum())
    out.update(
        patch_recovery_rate=len(recovered) / (B * N),
        isolated_patch_rate=len(isolated) / (B * N),
        grouping_accuracy=placed_ok / n_valid if n_valid else float("nan"),
        false_positives=int(n - len(isolated)),
        recovered_patch_psnr_median=float(best_psnr[valid].median()) if n_valid else float("nan"),
        recovered_patch_psnr_mean=float(best_psnr[valid].clamp(max=200).mean()) if n_valid else float("nan"),
        assignment=assignment,
    )
    return out


def assemble_images(patches: torch.Tensor, positions: torch.Tensor, groups: torch.Tensor, assignment: dict,
                    num_images: int, num_positions: int, dim: int) -> torch.Tensor:
    """Place recovered patches into (B, N, dim) slots of their matched true image; NaN where nothing is."""
    d = dim
    out = torch.full((num_images, num_positions, d), math.nan, dtype=torch.float64)
    for i in range(len(patches)):
        m = assignment.get(int(groups[i]))
        if m is not None:
            out[m, int(positions[i]) - 1] = patches[i].to(torch.float64)
    return out
