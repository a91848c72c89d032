"""The ``images`` unit: optimisation attacks' reconstructed images (docs/DESIGN.md §2).

Scores: PSNR/SSIM/MSE after an order-free (Hungarian, on MSE) matching of reconstructions to private images, feature
distance, the grey-image reference PSNR. Null: N random held-out images of the private set's source matched the
same way, plus the mean public, grey and best flat (each original's mean colour) images. Levels: exact = an image at PSNR >= the threshold (30 dB); strong =
best-image SSIM beyond the bar and >= 0.5; partial = best-image PSNR beyond the bar.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Mapping

import torch

from gradleak.evaluation.base import Evaluation, EvaluationUnit, Truth, attach_null, register
from gradleak.evaluation.levels import STRONG_SSIM, bar, beyond, graded, number


def null_images(truth: Truth, truth01: torch.Tensor, n: int, match: str, cfg, metrics: dict, notes: list,
                decoder_images: torch.Tensor | None = None) -> None:
    """The image nulls (random public images matched like the reconstruction; the mean public, grey and flat images).

    ``decoder_images``: the images a learned decoder (:mod:`gradleak.attacks.learned_image`) gives held-out public
    uploads through the same simulation and defenses; then each null draw is, draw for draw, the larger of the random
    images' score and the decoder images' (``<m>_random_image_null_p99`` and ``<m>_decoder_null_p99`` each alone),
    so a decoder that only learned the public mean, or a blur of it, is at chance (docs/DESIGN.md §6, "A learned
    attacker is graded through its own decoder")."""
    import numpy as np

    from gradleak.evaluation.nulls import image_null, reference_images

    pool = truth.null_pool
    if pool is None or not cfg.metrics.null:
        return
    pool = pool.to(torch.float32)
    if pool.shape[1:] != truth01.shape[1:]:
        pool = torch.nn.functional.interpolate(pool, size=truth01.shape[-2:], mode="bilinear", align_corners=False)
    nul = image_null(truth01.float(), pool, n=n, match=match, draws=cfg.metrics.null_draws, seed=cfg.seed + 17)
    if decoder_images is not None and len(decoder_images):
        dec = decoder_images.detach().to(torch.float32).cpu()
        if dec.shape[1:] != truth01.shape[1:]:
            dec = torch.nn.functional.interpolate(dec, size=truth01.shape[-2:], mode="bilinear", align_corners=False)
        dn = image_null(truth01.float(), dec, n=n, match=match, draws=cfg.metrics.null_draws, seed=cfg.seed + 19)
        for k in ("psnr", "ssim", "psnr_max", "ssim_max"):
            metrics[f"{k}_random_image_null_p99"] = float(np.nanquantile(nul[k], 0.99))
            metrics[f"{k}_decoder_null_p99"] = float(np.nanquantile(dn[k], 0.99))
            nul[k] = np.fmax(nul[k], dn[k])
    for k in ("psnr", "ssim", "psnr_max", "ssim_max"):
        attach_null(metrics, k, nul[k])
    metrics.update(reference_images(truth01.float(), pool))
    notes.append(f"null: {cfg.metrics.null_draws} draws of {n} random images of {truth.null_source} "
                 f"({len(pool)} in the pool), matched {'in order' if match == 'paired' else 'by MSE (Hungarian)'} "
                 "as the reconstruction; *_mean_public / *_grey / *_flat: the mean public image, the grey image and each "
                 "original's own mean colour (the best uniform image)"
                 + (f"; each draw the larger of that and {n} of the {len(decoder_images)} images the same decoder gives "
                    "held-out public uploads, matched the same way" if decoder_images is not None
                    and len(decoder_images) else "") + ".")


def image_metrics(truth01: torch.Tensor, recon01: torch.Tensor, cfg) -> dict[str, float]:
    from gradleak.metrics import lpips, psnr, ssim

    out = {}
    filled = torch.where(torch.isnan(recon01), torch.full_like(recon01, 0.5), recon01)
    out["image_psnr_mean"] = float(psnr(filled, truth01).mean())
    out["image_ssim_mean"] = float(ssim(filled, truth01).mean())
    out["psnr"], out["ssim"] = out["image_psnr_mean"], out["image_ssim_mean"]  # the outside checks' names
    out["image_mse_mean"] = float(((filled - truth01) ** 2).mean())
    if cfg.metrics.feature_distance:
        from gradleak.models.features import feature_distance

        out["feature_distance_mean"] = float(feature_distance(filled.float(), truth01.float()).mean())
    lp = lpips(filled.float(), truth01.float())  # None unless the user supplied AlexNet-LPIPS weights
    if lp is not None:
        out["lpips_mean"] = float(lp.mean())
    return out


#: the PNGs :func:`image_grids` writes, by the label the pipeline evaluates an attacked update under
#: (:func:`gradleak.run.pipeline.run_experiment`: ``trial`` for client 0, ``"{trial}_client{c}"`` for client c > 0):
#: ``ground_truth.png`` (trial 0, client 0), ``ground_truth_trial{t}.png``, ``ground_truth_trial{t}_client{c}.png``;
#: the same for ``reconstruction``
GRID_NAME = re.compile(r"^(ground_truth|reconstruction)(?:_trial(\d+)(?:_client(\d+))?)?\.png$")


def grid_owner(name: str) -> tuple[str, int, int] | None:
    """``(role, trial, client)`` of a PNG :func:`image_grids` wrote (``role``: ``ground_truth`` or
    ``reconstruction``; see :data:`GRID_NAME`), or None for any other file: what lets a report put each client's
    originals beside its own reconstructions."""
    m = GRID_NAME.match(Path(str(name)).name)
    return (m.group(1), int(m.group(2) or 0), int(m.group(3) or 0)) if m else None


def image_grids(truth01: torch.Tensor, recon01: torch.Tensor, out_dir: Path, trial: int, title: str, caption: str):
    from gradleak.report import save_image_grid

    B, S = len(truth01), truth01.shape[-1]
    nrow, show = min(8, B), min(B, 64)
    suffix = "" if trial == 0 else f"_trial{trial}"
    gt, rc = f"ground_truth{suffix}.png", f"reconstruction{suffix}.png"
    save_image_grid(truth01[:show], out_dir / gt, nrow=nrow, upscale=max(1, 128 // S))
    save_image_grid(recon01[:show], out_dir / rc, nrow=nrow, upscale=max(1, 128 // S))
    figs = [{"title": "ground truth (client's private batch)", "path": gt, "caption": f"first {show} of {B}"},
            {"title": title, "path": rc, "caption": caption}]
    return figs, [gt, rc]


def evaluate_images(truth: Truth, rec, cfg, out_dir: Path, trial: int) -> Evaluation:
    from scipy.optimize import linear_sum_assignment

    from gradleak.metrics import psnr

    truth01 = truth.inputs.to(torch.float32).cpu()
    x = rec.data["images"].detach().to(torch.float32).cpu()
    if x.shape[1:] != truth01.shape[1:]:
        x = torch.nn.functional.interpolate(x, size=truth01.shape[-2:], mode="bilinear", align_corners=False)
    n = min(len(x), len(truth01))
    cost = ((x[:, None] - truth01[None]) ** 2).flatten(2).mean(-1)  # recon × truth
    ri, ti = linear_sum_assignment(cost.numpy())
    matched = torch.full_like(truth01, float("nan"))
    matched[torch.as_tensor(ti)] = x[torch.as_tensor(ri)]
    metrics = image_metrics(truth01, matched, cfg)
    metrics["images_returned"] = float(len(x))
    metrics["images_total"] = float(len(truth01))
    metrics["reference_gray_image_psnr_mean"] = float(psnr(torch.full_like(truth01, 0.5), truth01).mean())
    per_image = psnr(torch.nan_to_num(matched, nan=0.5), truth01)
    metrics["images_above_threshold"] = float((per_image >= cfg.metrics.psnr_threshold_db).sum())
    from gradleak.metrics import ssim as _ssim

    metrics["psnr_max"] = float(per_image.max())
    metrics["ssim_max"] = float(_ssim(torch.nan_to_num(matched, nan=0.5), truth01).max())
    notes: list[str] = []
    null_images(truth, truth01, len(x), "hungarian", cfg, metrics, notes, rec.info.get("null_images"))
    for key in ("initial_matching_loss", "final_matching_loss"):
        if key in rec.info:
            metrics[key] = float(rec.info[key])
    figs, arts = image_grids(truth01, torch.nan_to_num(matched, nan=0.5), out_dir, trial,
                             "reconstruction (order-matched)", f"{n} of {len(truth01)} images matched to the private batch by MSE")
    return Evaluation(metrics, figs, [], arts, notes=notes)


IMAGE_REFS = ("mean_public", "grey", "flat")  # trivial images that show no private sample (nulls.reference_images)


def grade_image_kind(m: Mapping[str, Any], thr: float, exact_count: str, exact_words: str) -> dict:
    p = beyond(m, "psnr_max", IMAGE_REFS)
    if p is None:
        return graded("undefined", "best-image PSNR or its null is missing / NaN", psnr_max=number(m, "psnr_max"))
    ev = {"psnr_max": number(m, "psnr_max"), "psnr_max_bar": bar(m, "psnr_max", IMAGE_REFS),
          "ssim_max": number(m, "ssim_max"), "ssim_max_bar": bar(m, "ssim_max", IMAGE_REFS),
          "psnr_max_p_value": number(m, "psnr_max_p_value")}
    n_exact = number(m, exact_count)
    if not math.isnan(n_exact) and n_exact >= 1 and p:
        return graded("exact", f"{exact_words} at PSNR >= {thr:g} dB", **ev, n_exact=n_exact)
    s = beyond(m, "ssim_max", IMAGE_REFS)
    if s and number(m, "ssim_max") >= STRONG_SSIM:
        return graded("strong", f"best-image SSIM beyond the null (and the mean public, grey and flat images) and >= {STRONG_SSIM:g}", **ev)
    if p:
        return graded("partial", "best-image PSNR beyond the null's 99th percentile (and the mean public, grey and flat images)", **ev)
    return graded("none", "best-image PSNR not beyond the null", **ev)


def decided_by_image_kind(exact_count: str):
    """The metric whose test gives :func:`grade_image_kind` its level: the exact count, best-image SSIM (strong) or
    best-image PSNR (partial, none, undefined)."""
    def decided(m: Mapping[str, Any], level: str) -> str:
        return {"exact": exact_count, "strong": "ssim_max"}.get(level, "psnr_max")
    return decided


def grade_images(m: Mapping[str, Any], thr: float = 30.0) -> dict:
    return grade_image_kind(m, thr, "images_above_threshold", "a private image reconstructed")


def _audit_fields(m: Mapping[str, Any]) -> dict:
    return {"n_success": int(m.get("images_above_threshold", 0) or 0), "n_total": int(m.get("images_total", 0) or 0)}


RULES = ("exact: an image at PSNR >= the threshold / strong: best-image SSIM beyond the null and >= 0.5 / partial: "
         "best-image PSNR beyond the null (and the mean public, grey and best flat image)")

UNIT = register(EvaluationUnit("images", evaluate_images, headline="psnr_max", grade=grade_images, sweep_metric="psnr",
                               per_client=True, audit_fields=_audit_fields,
                               decided_by=decided_by_image_kind("images_above_threshold"), rules=RULES,
                               counts_batch_samples=True),
                "reconstructed images: order-free PSNR/SSIM/MSE, feature distance")
