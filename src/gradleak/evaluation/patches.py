"""The ``patches`` unit: PEFTLeak's recovered image patches (docs/DESIGN.md §2).

Scores: patch recovery (a true patch counts when a returned patch at its image and position reaches
``metrics.psnr_threshold_db``, :mod:`gradleak.metrics.patches`), grouping accuracy, image PSNR/SSIM/MSE of the
assembled images, feature distance. Null: N random held-out images placed in order (PEFTLeak's placement). Levels:
as images, with exact = private patches recovered (median of the recovered at PSNR >= the threshold).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

import torch

from gradleak.evaluation.base import Evaluation, EvaluationUnit, Truth, register
from gradleak.evaluation.images import decided_by_image_kind, grade_image_kind, image_grids, image_metrics, null_images


def evaluate_patches(truth: Truth, rec, cfg, out_dir: Path, trial: int) -> Evaluation:
    from gradleak.metrics.patches import image_to_patches, patches_to_image, upsample_patch
    from gradleak.metrics import ssim
    from gradleak.metrics.patches import assemble_images, patch_recovery

    d = rec.data
    k, P, C, N, S = d["reduce"], d["patch_size"], d["channels"], d["num_positions"], d["image_size"]
    truth01 = truth.inputs.to(torch.float64).cpu()
    B = len(truth01)
    truth_cmp = image_to_patches(truth01 * 2 - 1, P, k)
    thr = cfg.metrics.psnr_threshold_db
    m = patch_recovery(truth_cmp, d["patches"], d["positions"], d["groups"], thr)
    assignment = m.pop("assignment")
    placed = assemble_images(d["patches"], d["positions"], d["groups"], assignment, B, N, truth_cmp.shape[-1])
    if k > 1:
        placed = upsample_patch(placed.reshape(B * N, -1), C, P, k).reshape(B, N, -1)
    recon01 = (torch.stack([patches_to_image(placed[i], C, S, P) for i in range(B)]) + 1) / 2
    metrics = {k2: float(v) for k2, v in m.items() if isinstance(v, (int, float))}
    metrics.update(image_metrics(truth01, recon01, cfg))
    from gradleak.metrics import psnr as _psnr
    from gradleak.metrics import ssim as _ssim2

    filled = torch.nan_to_num(recon01, nan=0.5)
    metrics["psnr_max"] = float(_psnr(filled, truth01).max())
    metrics["ssim_max"] = float(_ssim2(filled.float(), truth01.float()).max())
    total = int(metrics.get("num_true_patches", 0))
    attacked_n = len(d.get("attacked_positions") or range(1, N + 1))
    nz = (rec.metrics or {}).get("nonzero_bins")
    if nz is not None and (rec.metrics or {}).get("hash_directions_per_position", 1) == 1:
        # the authors' count (info-ucr/PEFTLeak recover_adapter.py): every bin whose bias-gradient difference is
        # non-zero is one "recovered" patch, collisions included, correctness unchecked; a share of the B x (attacked
        # positions) true patches. Single-direction (paper) design only: the improved design hashes every patch into
        # each of its K adapters, so its non-zero bins count a patch K times.
        metrics["authors_count_rate"] = float(nz) / max(1, B * attacked_n)
    ok = metrics.get("recovered_patch_psnr_median", 0) >= thr
    metrics["patches_exact"] = float(round(metrics.get("patch_recovery_rate", 0.0) * total)) if ok else 0.0
    null_notes: list[str] = []
    null_images(truth, truth01.float(), B, "paired", cfg, metrics, null_notes)
    if k == 1:
        ok = ~torch.isnan(placed[..., 0])
        if ok.any():
            rp, tp = (placed[ok] + 1) / 2, (truth_cmp[ok] + 1) / 2
            metrics["recovered_patch_mse_mean"] = float(((rp - tp) ** 2).mean())
            side = int(math.isqrt(rp.shape[1] // C))
            metrics["recovered_patch_ssim_mean"] = float(ssim(rp.reshape(-1, C, side, side).float(),
                                                              tp.reshape(-1, C, side, side).float()).mean())
    attacked = list(d.get("attacked_positions") or range(1, N + 1))
    if len(attacked) < N:  # fewer rounds than the plan needs: also score the positions attacked
        keep = torch.isin(d["positions"], torch.tensor(attacked))
        remap = torch.zeros(N + 1, dtype=torch.long)
        remap[torch.tensor(attacked)] = torch.arange(1, len(attacked) + 1)
        sub = patch_recovery(truth_cmp[:, torch.tensor(attacked) - 1], d["patches"][keep], remap[d["positions"][keep]],
                             d["groups"][keep], thr)
        metrics["patch_recovery_rate_attacked_positions"] = float(sub["patch_recovery_rate"])
        metrics["isolated_patch_rate_attacked_positions"] = float(sub["isolated_patch_rate"])
    figs, arts = image_grids(truth01, recon01, out_dir, trial,
                             f"PEFTLeak reconstruction ({rec.info.get('design', '')} design)",
                             "grey = patch not recovered; images placed by the attacker's grouping")
    notes = [f"{rec.info.get('unique_patches')} patches returned from {rec.info.get('bins')} bins over "
             f"{rec.info.get('rounds')} round(s).",
             f"A true patch counts as recovered only if a patch at its image and position has PSNR ≥ {thr:g} dB "
             "(gradleak.metrics.patches)."] + null_notes
    return Evaluation(metrics, figs, [], arts, notes=notes)


def grade_patches(m: Mapping[str, Any], thr: float = 30.0) -> dict:
    return grade_image_kind(m, thr, "patches_exact", "private image patches recovered (median of the recovered)")



def _audit_fields(m: Mapping[str, Any]) -> dict:
    return {"n_success": int(m.get("patches_exact", 0) or 0), "n_total": int(m.get("num_true_patches", 0) or 0),
            "unit": "image patches"}


RULES = "exact: patches recovered at PSNR >= the threshold / strong, partial: as images"

UNIT = register(EvaluationUnit("patches", evaluate_patches, headline="psnr_max", grade=grade_patches,
                               sweep_metric="psnr", per_client=True, audit_fields=_audit_fields,
                               decided_by=decided_by_image_kind("patches_exact"), rules=RULES),
                "PEFTLeak patches: recovery rate, grouping, image PSNR/SSIM")
