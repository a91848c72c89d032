"""The ``leakage`` unit: BN-aware inversion's per-client reconstructions (Hatamizadeh et al. 2022; docs/DESIGN.md §2).

Scores per client and round: SSIM vs the prior, RDLV with its bootstrap interval, adjusted IIP over all clients'
training + validation images. Null: N random held-out images as a client's N reconstructions, each original taking
its best match (``rdlv_excess`` = RDLV - the null's 99th percentile). Levels: exact = a best-matched reconstruction at
PSNR >= the threshold; strong = SSIM beyond the null and >= 0.5; partial = RDLV beyond its null.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from gradleak.evaluation.base import Evaluation, EvaluationUnit, Truth, attach_null, every_client_data, register
from gradleak.evaluation.levels import STRONG_SSIM, bar, beyond, graded, number


def evaluate_leakage(truth: Truth, rec, cfg, out_dir: Path, trial: int) -> Evaluation:
    """Leakage quantification of Hatamizadeh et al. 2022 (§III-D/E/G; :mod:`gradleak.metrics.leakage`).

    Per attacked (client c, round r): ``ssim_client{c}_round{r}`` / ``ssim_prior_client{c}_round{r}`` (means over
    c's originals, each matched to its best reconstruction), ``rdlv_client{c}_round{r}`` with ``_low`` / ``_high``
    (percentile bootstrap 95 % of the mean, seeded by the config's seed), ``iip_client{c}_round{r}`` and
    ``iip_matched_cosine_client{c}_round{r}`` (features: the offline ViT-S/14 CLS token,
    :data:`gradleak.models.features.BACKBONE_NAME`, not the paper's unnamed network). The same without the round
    suffix for the last attacked round, and the headline numbers of the leakage study (last attacked round):

    * ``rdlv_high_risk_client`` (+ ``_low``/``_high``): the mean RDLV of the high-risk client —
      ``metrics.high_risk_client``, else the client with the fewest training images, then the fewest local
      steps, then the highest id (the paper's "client 9": one image, one step);
    * ``rdlv_max_other_clients``: the largest RDLV *lower* confidence bound among the other attacked clients
      (> 0: some other client leaks beyond its interval); NaN when no other client was attacked.
    """
    if truth.client_inputs is None:
        raise ValueError("the leakage evaluation needs every client's images (pipeline bug)")
    originals = [x.to(torch.float64).cpu() for x in truth.client_inputs]
    val = truth.client_validation or [x[:0] for x in originals]
    prior = rec.data["prior"].to(torch.float64).cpu()
    per = _attacked_updates(rec, originals, prior)
    pool = _iip_pool(originals, val) if cfg.metrics.iip else None
    metrics: dict[str, float] = {}
    figs, arts = [], []
    rec_feats: dict = {}  # (client, round) → reconstruction features (IIP), reused by the t-SNE map
    last_round = max(d["round"] for d in per) if per else None
    null_pool = None
    if cfg.metrics.null and truth.null_pool is not None and len(truth.null_pool):
        null_pool = truth.null_pool.to(torch.float64).cpu()
    null_cache: dict = {}
    suffix = "" if trial == 0 else f"_trial{trial}"
    for d in per:
        c, r, x = d["client"], d["round"], d["images"].to(torch.float64)
        vals, res = _scores(x, originals[c], prior, cfg, c, null_pool, null_cache)
        if pool is not None:
            vals.update(_iip_scores(x, c, pool, rec_feats if not d.get("withheld") else None, r))
        vals["withheld"] = float(bool(d.get("withheld")))
        _record(metrics, vals, d, len(originals[c]), last_round)
        if not d.get("withheld"):  # every attacked (client, round): prior, originals over best-matching reconstructions
            name = f"reconstructions_client{c}_round{r}{suffix}.png"
            _grid_figure(originals[c], x, prior, res, vals, c, r, out_dir / name, figs, arts)
    attacked = sorted({d["client"] for d in per if d["round"] == last_round})
    high = _high_risk(metrics, originals, truth, cfg, attacked)
    notes = _notes(cfg, truth, high, attacked, last_round, null_pool, pool)
    if pool is not None and rec_feats and getattr(cfg.metrics, "figures", True):
        # t-SNE of the IIP's features: all clients' training images and the reconstructions
        from gradleak.models.features import BACKBONE_NAME

        _tsne_figure(pool.feats, pool.offsets, len(originals), rec_feats, cfg.seed, BACKBONE_NAME,
                     out_dir / f"tsne{suffix}.png", figs, arts, notes)
    tables: list = []  # the report builds the per-client, per-round table from these metrics (gradleak.report.leakage)
    return Evaluation(metrics, figs, tables, arts, notes=notes)


def _attacked_updates(rec, originals: list, prior: torch.Tensor) -> list[dict]:
    """The reconstruction's per-(client, round) entries, plus one per update a client withheld (the server's best
    guess is the prior itself: RDLV 0), ordered by round, then client."""
    per = list(rec.data["per_client"])
    withheld = {(int(c), int(r)) for c, r in (rec.info.get("no_update") or [])}
    for c, r in sorted(withheld):  # the client sent nothing: the server's best guess is the prior itself (RDLV 0)
        per.append({"client": c, "round": r, "images": prior.expand(len(originals[c]), *prior.shape).clone(),
                    "steps": 0, "withheld": True})
    per.sort(key=lambda d: (d["round"], d["client"]))
    return per


@dataclass
class _IipPool:
    """The adjusted IIP's pool: every client's training then validation images' features, each row's owner and
    whether it is a training image, and the offsets of each (client, split) block in the rows."""

    feats: torch.Tensor
    owner: torch.Tensor
    is_train: torch.Tensor
    offsets: torch.Tensor


def _iip_pool(originals: list, val: list) -> _IipPool:
    """The features of all clients' training and validation images (:func:`gradleak.models.features.image_features`)."""
    from gradleak.models.features import image_features

    pool = [x for c in range(len(originals)) for x in (originals[c], val[c])]
    owner = torch.tensor([c for c in range(len(originals)) for x in (originals[c], val[c]) for _ in range(len(x))])
    is_train = torch.tensor([k == 0 for c in range(len(originals)) for k, x in enumerate((originals[c], val[c]))
                             for _ in range(len(x))])
    feats = image_features(torch.cat(pool).float())
    offsets = torch.cumsum(torch.tensor([0] + [len(x) for x in pool]), 0)
    return _IipPool(feats, owner, is_train, offsets)


def _scores(x: torch.Tensor, originals: torch.Tensor, prior: torch.Tensor, cfg, c: int, null_pool,
            null_cache: dict) -> tuple[dict, Any]:
    """One (client, round)'s SSIM, RDLV (with its interval) and best-match PSNR against client ``c``'s originals,
    with the null beside RDLV and SSIM when a null pool is given (cached per client and reconstruction count):
    ``(values, the RDLV result)``."""
    from gradleak.metrics import psnr as _psnr
    from gradleak.metrics.leakage import rdlv

    res = rdlv(x, originals, prior, ssim=cfg.metrics.leakage_ssim, match="best", seed=cfg.seed)
    vals = {"ssim": float(res.ssim_reconstruction.mean()), "ssim_prior": float(res.ssim_prior.mean()),
            "rdlv": res.mean, "rdlv_low": res.low, "rdlv_high": res.high, "rdlv_max": res.max}
    vals["psnr_max"] = float(_psnr(x[res.matched_index].float(), originals.float()).max())
    if null_pool is not None:  # chance: random held-out images as the client's reconstructions, best of N
        from gradleak.evaluation.nulls import rdlv_null

        key = (c, len(x))
        if key not in null_cache:
            null_cache[key] = rdlv_null(originals, null_pool, prior, n=len(x), ssim=cfg.metrics.leakage_ssim,
                                        draws=cfg.metrics.null_draws, seed=cfg.seed + 31 + c)
        for k in ("rdlv", "ssim"):
            tmp = {k: vals[k]}
            attach_null(tmp, k, null_cache[key][k])
            vals.update({kk: vv for kk, vv in tmp.items() if kk != k})
        vals["rdlv_excess"] = vals["rdlv"] - vals["rdlv_null_p99"]
    return vals, res


def _iip_scores(x: torch.Tensor, c: int, pool: _IipPool, rec_feats: dict | None, r: int) -> dict:
    """The adjusted IIP of client ``c``'s reconstructions ``x`` against the pool; their features kept in
    ``rec_feats`` under ``(c, r)`` (for the t-SNE map) unless it is None (a withheld update)."""
    from gradleak.metrics.leakage import identifiability_precision
    from gradleak.models.features import image_features

    own = pool.feats[int(pool.offsets[2 * c]):int(pool.offsets[2 * c + 1])]
    feats = image_features(x.float())
    if rec_feats is not None:  # kept for the t-SNE map (the features are not computed twice)
        rec_feats[(c, r)] = feats
    ip = identifiability_precision(feats, pool.feats, pool.owner, pool.is_train, c, original_features=own)
    return {"iip": ip.iip, "iip_matched_cosine": ip.matched_cosine,
            "iip_nearest_cosine": float(ip.nearest_cosine.mean())}


def _record(metrics: dict, vals: dict, d: dict, n_images: int, last_round) -> None:
    """One (client, round)'s values as metrics with the client and round suffix (and without the round for the last
    attacked round), its image count and its local steps (the report's per-client table)."""
    c, r = d["client"], d["round"]
    for k, v in vals.items():
        metrics[f"{k}_client{c}_round{r}"] = float(v)
        if r == last_round:
            metrics[f"{k}_client{c}"] = float(v)
    metrics[f"images_client{c}_round{r}"] = float(n_images)  # the report's per-client table
    if d.get("steps") is not None:
        metrics[f"local_steps_client{c}_round{r}"] = float(d["steps"])


def _grid_figure(originals: torch.Tensor, x: torch.Tensor, prior: torch.Tensor, res, vals: dict, c: int, r: int,
                 path: Path, figs: list, arts: list) -> None:
    """Save client ``c``'s round ``r`` grid (prior, originals over their best-matching reconstructions; the first 16)
    to ``path`` and list it as a figure and an artifact."""
    from gradleak.report.leakage import save_reconstruction_grid

    show = min(len(originals), 16)
    save_reconstruction_grid(originals, x, prior, path, order=res.matched_index, max_images=show)
    figs.append({"title": f"client {c}, round {r}: prior (first column), originals (top), reconstructions "
                 "(bottom)", "path": path.name,
                 "caption": f"RDLV {res.mean:+.3f} [{res.low:+.3f}, {res.high:+.3f}], SSIM {vals['ssim']:.3f} "
                 f"vs prior {vals['ssim_prior']:.3f}" + (f"; first {show} of {len(originals)} originals"
                                                        if show < len(originals) else "")})
    arts.append(path.name)


def _high_risk(metrics: dict, originals: list, truth: Truth, cfg, attacked: list) -> int:
    """The high-risk client (``metrics.high_risk_client``, else the fewest training images, then the fewest local
    steps, then the highest id) and the study's headline numbers added to ``metrics``: its values under
    ``*_high_risk_client`` and ``rdlv_max_other_clients`` (the largest RDLV lower bound among the other attacked
    clients; NaN when none)."""
    sizes = [len(x) for x in originals]
    steps = truth.client_steps or [0] * len(originals)
    high = cfg.metrics.high_risk_client
    if high is None:
        high = min(range(len(originals)), key=lambda i: (sizes[i], steps[i], -i))
    metrics["high_risk_client"] = float(high)
    nan = float("nan")
    headline = {"rdlv_high_risk_client": "rdlv", "rdlv_high_risk_client_low": "rdlv_low",
                "rdlv_high_risk_client_high": "rdlv_high", "ssim_high_risk_client": "ssim",
                "ssim_prior_high_risk_client": "ssim_prior", "iip_high_risk_client": "iip"}
    for key, k in headline.items():
        metrics[key] = metrics.get(f"{k}_client{high}", nan)
    for k in ("rdlv_null_median", "rdlv_null_p99", "rdlv_p_value", "rdlv_excess", "psnr_max"):
        metrics[f"{k}_high_risk_client"] = metrics.get(f"{k}_client{high}", nan)
    others = [metrics[f"rdlv_low_client{c}"] for c in attacked if c != high and math.isfinite(metrics[f"rdlv_low_client{c}"])]
    metrics["rdlv_max_other_clients"] = max(others) if others else nan
    return high


def _notes(cfg, truth: Truth, high: int, attacked: list, last_round, null_pool, pool: _IipPool | None) -> list[str]:
    """The evaluation's notes: what RDLV is, the high-risk client, the null and the IIP's pool."""
    notes = [f"RDLV = (SSIM(x̂, x) − SSIM(prior, x)) / SSIM(prior, x) per original, best-matching reconstruction; "
             f"client value = mean with a percentile-bootstrap 95 % interval ({cfg.metrics.leakage_ssim} SSIM). A client "
             "with one image has a degenerate interval.",
             f"high-risk client: {high}; rdlv_max_other_clients = the largest lower bound among clients "
             f"{[c for c in attacked if c != high]} (round {last_round})."]
    if null_pool is not None:
        notes.append(f"null: {cfg.metrics.null_draws} draws of N random held-out images of {truth.null_source} "
                     f"({len(null_pool)} in the pool) as a client's N reconstructions, each original taking its best "
                     "match, as the attack's RDLV does; rdlv_excess_client<c> = RDLV − the null's 99th percentile "
                     "(> 0: beyond chance).")
    if pool is not None:
        from gradleak.models.features import BACKBONE_NAME

        notes.append(f"adjusted IIP: nearest neighbour (cosine of {BACKBONE_NAME} features) among all clients' training "
                     f"and validation images ({int(len(pool.owner))} in the pool) must be a training image of the attacked "
                     "client; the paper's embedding network is unnamed (A4.4).")
    return notes


def _tsne_figure(pool_feats, offsets, n_clients: int, rec_feats: dict, seed: int, backbone: str, path: Path,
                 figs: list, arts: list, notes: list) -> None:
    """Embed every client's training-image features and the reconstructions' (those the IIP computed) jointly
    with t-SNE and save the map to ``path``; skipped with a note when scikit-learn or matplotlib is missing."""
    groups, meta = {}, {}
    for c in range(n_clients):  # pool order per client: training, then validation
        groups[f"client {c} training"] = pool_feats[int(offsets[2 * c]):int(offsets[2 * c + 1])]
        meta[f"client {c} training"] = {"client": c, "reconstruction": False}
    for (c, r), f in sorted(rec_feats.items()):
        groups[f"client {c} reconstruction (round {r})"] = f
        meta[f"client {c} reconstruction (round {r})"] = {"client": c, "reconstruction": True}
    try:
        from gradleak.metrics.leakage import tsne_embedding
        from gradleak.report.leakage import save_tsne_plot

        emb = tsne_embedding(groups, seed=seed)
        written = save_tsne_plot(emb, path, meta, title=f"t-SNE of {backbone} features")
        why = "matplotlib is not installed"
    except ImportError as err:
        written, why = None, f"{err.name or err} is not installed"
    if written is None:
        notes.append(f"t-SNE map skipped: {why}.")
        return
    figs.append({"title": "t-SNE: training images (dots) and reconstructions (crosses), coloured by client",
                 "path": path.name, "caption": f"{sum(len(v) for v in emb.values())} points; {backbone} features "
                 f"(those the IIP uses), seed {seed}"})
    arts.append(path.name)


def grade_leakage(m: Mapping[str, Any], thr: float = 30.0) -> dict:
    """One client's leakage metrics (keys without the client suffix: ``rdlv``, ``rdlv_null_p99``, ``ssim``, ...)."""
    ev = {"rdlv": number(m, "rdlv"), "rdlv_null_p99": number(m, "rdlv_null_p99"), "rdlv_excess": number(m, "rdlv_excess"),
          "rdlv_p_value": number(m, "rdlv_p_value"), "ssim": number(m, "ssim"), "ssim_bar": bar(m, "ssim"),
          "psnr_max": number(m, "psnr_max")}
    r = beyond(m, "rdlv")
    if r is None:
        return graded("undefined", "RDLV or its null is missing / NaN", **ev)
    if number(m, "psnr_max") >= thr and r:
        return graded("exact", f"a best-matched reconstruction at PSNR >= {thr:g} dB", **ev)
    if beyond(m, "ssim") and number(m, "ssim") >= STRONG_SSIM:
        return graded("strong", f"SSIM beyond the null and >= {STRONG_SSIM:g}", **ev)
    if r:
        return graded("partial", "RDLV beyond the null's 99th percentile (random held-out images, best of N)", **ev)
    return graded("none", "RDLV not beyond the null", **ev)



def _audit_fields(m: Mapping[str, Any]) -> dict:
    return {"rdlv_excess": m.get("rdlv_excess")}


UNIT = register(EvaluationUnit("leakage", evaluate_leakage, headline="rdlv", grade=grade_leakage,
                               sweep_metric="rdlv_high_risk_client", audit_fields=_audit_fields,
                               decided_by=lambda m, level: {"exact": "psnr_max", "strong": "ssim"}.get(level, "rdlv"),
                               rules="exact: a reconstruction at PSNR >= the threshold / strong: SSIM beyond the null "
                                     "and >= 0.5 / partial: RDLV beyond the null (rdlv_excess > 0)",
                               scores_every_client=True, truth_fields=every_client_data),
                "per client and round: SSIM vs prior, RDLV with bootstrap 95 % interval, adjusted IIP")
