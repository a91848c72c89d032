"""Evaluation: the only step that sees the ground truth, chosen by the kind of reconstruction (DESIGN §2).

``EVALUATORS`` maps an attack's ``reconstruction`` kind to a function
``(truth: Truth, rec: Reconstruction, cfg, out_dir, trial) -> Evaluation``:

* ``patches`` — PEFTLeak: patch recovery (a true patch counts when a returned patch at its image and
  position reaches ``metrics.psnr_threshold_db``), grouping accuracy, image PSNR/SSIM/MSE, feature distance;
* ``images`` — optimisation attacks: PSNR/SSIM/MSE after an order-free (Hungarian, on MSE) matching of
  reconstructions to private images, feature distance, the grey-image reference PSNR;
* ``leakage`` — BN-aware inversion (Hatamizadeh et al. 2022): per client and round, SSIM vs the prior, RDLV
  with its bootstrap interval, adjusted IIP over all clients' training + validation images;
* ``token_sequences`` — text attacks: ROUGE-1/2/L recall (the papers' metric) *and* F1 (extra output is
  penalised), exact sentences, word-bag precision/recall, sentences returned / verified, and the
  capacity measures computed from the truth (unique tokens, layer states).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from gradleak.registry import Registry

EVALUATORS: Registry[Callable[..., "Evaluation"]] = Registry("evaluator")


@dataclass
class Truth:
    """The private samples the observed update came from (never shown to the attack)."""

    modality: str
    inputs: Any  # images in [0, 1] (B×C×H×W) or encoded text {"input_ids", "attention_mask"}
    labels: torch.Tensor
    texts: list[str] | None = None
    tokenizer: Any = None
    model_kind: str | None = None
    bottleneck: int | None = None
    membership: dict[int, list[bool]] | None = None  # per observed update: which candidates are members
    client_inputs: list[torch.Tensor] | None = None  # leakage: every client's training images in [0, 1]
    client_validation: list[torch.Tensor] | None = None  # leakage: every client's validation images (IIP pool)
    client_steps: list[int] | None = None  # leakage: every client's local steps (picks the high-risk client)
    null_pool: Any = None  # public samples of the same source no client holds (images in [0, 1] / sentences)
    null_source: str | None = None  # what the null pool is, in words


@dataclass
class Evaluation:
    metrics: dict[str, float]
    figures: list[dict] = field(default_factory=list)
    tables: list[dict] = field(default_factory=list)
    artifacts: list[str] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)  # per-sample rows (text: reference vs reconstruction)
    notes: list[str] = field(default_factory=list)
    client: int = 0  # the attacked client (metrics.attack_clients = all: every client in turn)
    trial: Any = 0


def attach_null(metrics: dict, key: str, null, lower_is_leak: bool = False) -> None:
    """``metrics[key]`` gets its null beside it: ``<key>_null_median``, ``<key>_null_p99``, ``<key>_p_value``."""
    from gradleak.evaluation.nulls import summarize

    s = summarize(metrics.get(key, float("nan")), null, lower_is_leak)
    metrics[f"{key}_null_median"], metrics[f"{key}_null_p99"], metrics[f"{key}_p_value"] = (
        s["null_median"], s["null_p99"], s["p_value"])


def _null_images(truth: Truth, truth01: torch.Tensor, n: int, match: str, cfg, metrics: dict, notes: list) -> None:
    """The image nulls (random public images matched like the reconstruction; the mean public and grey images)."""
    from gradleak.evaluation.nulls import image_null, reference_images

    pool = truth.null_pool
    if pool is None or not cfg.metrics.null:
        return
    pool = pool.to(torch.float32)
    if pool.shape[1:] != truth01.shape[1:]:
        pool = torch.nn.functional.interpolate(pool, size=truth01.shape[-2:], mode="bilinear", align_corners=False)
    nul = image_null(truth01.float(), pool, n=n, match=match, draws=cfg.metrics.null_draws, seed=cfg.seed + 17)
    for k in ("psnr", "ssim", "psnr_max", "ssim_max"):
        attach_null(metrics, k, nul[k])
    metrics.update(reference_images(truth01.float(), pool))
    notes.append(f"null: {cfg.metrics.null_draws} draws of {n} random images of {truth.null_source} "
                 f"({len(pool)} in the pool), matched {'in order' if match == 'paired' else 'by MSE (Hungarian)'} "
                 "as the reconstruction; *_mean_public / *_grey: the mean public image and the grey image.")


def evaluate(kind: str, truth: Truth, rec, cfg, out_dir: Path, trial: int = 0) -> Evaluation:
    ev = EVALUATORS.get(kind, field="attack.reconstruction")(truth, rec, cfg, out_dir, trial)
    for k, v in (rec.metrics or {}).items():  # attack-side numbers (no truth involved)
        ev.metrics.setdefault(k, float(v))
    return ev


# ------------------------------------------------------------------------------------------------ images

def _image_metrics(truth01: torch.Tensor, recon01: torch.Tensor, cfg) -> dict[str, float]:
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


def _grids(truth01: torch.Tensor, recon01: torch.Tensor, out_dir: Path, trial: int, title: str, caption: str):
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


@EVALUATORS.register("patches", "PEFTLeak patches: recovery rate, grouping, image PSNR/SSIM")
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
    metrics.update(_image_metrics(truth01, recon01, cfg))
    from gradleak.metrics import psnr as _psnr
    from gradleak.metrics import ssim as _ssim2

    filled = torch.nan_to_num(recon01, nan=0.5)
    metrics["psnr_max"] = float(_psnr(filled, truth01).max())
    metrics["ssim_max"] = float(_ssim2(filled.float(), truth01.float()).max())
    total = int(metrics.get("num_true_patches", 0))
    ok = metrics.get("recovered_patch_psnr_median", 0) >= thr
    metrics["patches_exact"] = float(round(metrics.get("patch_recovery_rate", 0.0) * total)) if ok else 0.0
    null_notes: list[str] = []
    _null_images(truth, truth01.float(), B, "paired", cfg, metrics, null_notes)
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
    figs, arts = _grids(truth01, recon01, out_dir, trial, f"PEFTLeak reconstruction ({rec.info.get('design', '')} design)",
                        "grey = patch not recovered; images placed by the attacker's grouping")
    notes = [f"{rec.info.get('unique_patches')} patches returned from {rec.info.get('bins')} bins over "
             f"{rec.info.get('rounds')} round(s).",
             f"A true patch counts as recovered only if a patch at its image and position has PSNR ≥ {thr:g} dB "
             "(gradleak.metrics.patches)."] + null_notes
    return Evaluation(metrics, figs, [], arts, notes=notes)


@EVALUATORS.register("images", "reconstructed images: order-free PSNR/SSIM/MSE, feature distance")
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
    metrics = _image_metrics(truth01, matched, cfg)
    metrics["images_returned"] = float(len(x))
    metrics["images_total"] = float(len(truth01))
    metrics["reference_gray_image_psnr_mean"] = float(psnr(torch.full_like(truth01, 0.5), truth01).mean())
    per_image = psnr(torch.nan_to_num(matched, nan=0.5), truth01)
    metrics["images_above_threshold"] = float((per_image >= cfg.metrics.psnr_threshold_db).sum())
    from gradleak.metrics import ssim as _ssim

    metrics["psnr_max"] = float(per_image.max())
    metrics["ssim_max"] = float(_ssim(torch.nan_to_num(matched, nan=0.5), truth01).max())
    notes: list[str] = []
    _null_images(truth, truth01, len(x), "hungarian", cfg, metrics, notes)
    for key in ("initial_matching_loss", "final_matching_loss"):
        if key in rec.info:
            metrics[key] = float(rec.info[key])
    figs, arts = _grids(truth01, torch.nan_to_num(matched, nan=0.5), out_dir, trial, "reconstruction (order-matched)",
                        f"{n} of {len(truth01)} images matched to the private batch by MSE")
    return Evaluation(metrics, figs, [], arts, notes=notes)


@EVALUATORS.register("leakage", "per client and round: SSIM vs prior, RDLV with bootstrap 95 % interval, adjusted IIP")
def evaluate_leakage(truth: Truth, rec, cfg, out_dir: Path, trial: int) -> Evaluation:
    """Leakage quantification of Hatamizadeh et al. 2022 (§III-D/E/G; :mod:`gradleak.metrics.leakage`).

    Per attacked (client c, round r): ``ssim_client{c}_round{r}`` / ``ssim_prior_client{c}_round{r}`` (means over
    c's originals, each matched to its best reconstruction), ``rdlv_client{c}_round{r}`` with ``_low`` / ``_high``
    (percentile bootstrap 95 % of the mean, seeded by the config's seed), ``iip_client{c}_round{r}`` and
    ``iip_matched_cosine_client{c}_round{r}`` (features: the offline ViT-S/14 CLS token,
    :data:`gradleak.models.features.BACKBONE_NAME`, not the paper's unnamed network). The same without the round
    suffix for the last attacked round, and the headline numbers of issue 9's contract (last attacked round):

    * ``rdlv_high_risk_client`` (+ ``_low``/``_high``): the mean RDLV of the high-risk client —
      ``metrics.high_risk_client``, else the client with the fewest training images, then the fewest local
      steps, then the highest id (the paper's "client 9": one image, one step);
    * ``rdlv_max_other_clients``: the largest RDLV *lower* confidence bound among the other attacked clients
      (> 0: some other client leaks beyond its interval); NaN when no other client was attacked.
    """
    from gradleak.metrics.leakage import identifiability_precision, rdlv
    from gradleak.report.leakage import save_reconstruction_grid

    if truth.client_inputs is None:
        raise ValueError("the leakage evaluation needs every client's images (pipeline bug)")
    originals = [x.to(torch.float64).cpu() for x in truth.client_inputs]
    val = truth.client_validation or [x[:0] for x in originals]
    prior = rec.data["prior"].to(torch.float64).cpu()
    per = list(rec.data["per_client"])
    withheld = {(int(c), int(r)) for c, r in (rec.info.get("no_update") or [])}
    for c, r in sorted(withheld):  # the client sent nothing: the server's best guess is the prior itself (RDLV 0)
        per.append({"client": c, "round": r, "images": prior.expand(len(originals[c]), *prior.shape).clone(),
                    "steps": 0, "withheld": True})
    per.sort(key=lambda d: (d["round"], d["client"]))
    use_iip = cfg.metrics.iip
    pool_feats = owner = is_train = None
    if use_iip:
        from gradleak.models.features import image_features

        pool = [x for c in range(len(originals)) for x in (originals[c], val[c])]
        owner = torch.tensor([c for c in range(len(originals)) for x in (originals[c], val[c]) for _ in range(len(x))])
        is_train = torch.tensor([k == 0 for c in range(len(originals)) for k, x in enumerate((originals[c], val[c]))
                                 for _ in range(len(x))])
        pool_feats = image_features(torch.cat(pool).float())
        offsets = torch.cumsum(torch.tensor([0] + [len(x) for x in pool]), 0)
    metrics: dict[str, float] = {}
    figs, arts = [], []
    rec_feats: dict = {}  # (client, round) → reconstruction features (IIP), reused by the t-SNE map
    last_round = max(d["round"] for d in per) if per else None
    null_pool = None
    if cfg.metrics.null and truth.null_pool is not None and len(truth.null_pool):
        from gradleak.evaluation.nulls import rdlv_null

        null_pool = truth.null_pool.to(torch.float64).cpu()
    null_cache: dict = {}
    suffix = "" if trial == 0 else f"_trial{trial}"
    for d in per:
        c, r, x = d["client"], d["round"], d["images"].to(torch.float64)
        res = rdlv(x, originals[c], prior, ssim=cfg.metrics.leakage_ssim, match="best", seed=cfg.seed)
        vals = {"ssim": float(res.ssim_reconstruction.mean()), "ssim_prior": float(res.ssim_prior.mean()),
                "rdlv": res.mean, "rdlv_low": res.low, "rdlv_high": res.high, "rdlv_max": res.max}
        from gradleak.metrics import psnr as _psnr

        vals["psnr_max"] = float(_psnr(x[res.matched_index].float(), originals[c].float()).max())
        if null_pool is not None:  # chance: random held-out images as the client's reconstructions, best of N
            key = (c, len(x))
            if key not in null_cache:
                null_cache[key] = rdlv_null(originals[c], null_pool, prior, n=len(x), ssim=cfg.metrics.leakage_ssim,
                                            draws=cfg.metrics.null_draws, seed=cfg.seed + 31 + c)
            for k in ("rdlv", "ssim"):
                tmp = {k: vals[k]}
                attach_null(tmp, k, null_cache[key][k])
                vals.update({kk: vv for kk, vv in tmp.items() if kk != k})
            vals["rdlv_excess"] = vals["rdlv"] - vals["rdlv_null_p99"]
        if use_iip:
            own = pool_feats[int(offsets[2 * c]):int(offsets[2 * c + 1])]
            feats = image_features(x.float())
            if not d.get("withheld"):  # kept for the t-SNE map (the features are not computed twice)
                rec_feats[(c, r)] = feats
            ip = identifiability_precision(feats, pool_feats, owner, is_train, c, original_features=own)
            vals.update({"iip": ip.iip, "iip_matched_cosine": ip.matched_cosine,
                         "iip_nearest_cosine": float(ip.nearest_cosine.mean())})
        vals["withheld"] = float(bool(d.get("withheld")))
        for k, v in vals.items():
            metrics[f"{k}_client{c}_round{r}"] = float(v)
            if r == last_round:
                metrics[f"{k}_client{c}"] = float(v)
        metrics[f"images_client{c}_round{r}"] = float(len(originals[c]))  # the report's per-client table
        if d.get("steps") is not None:
            metrics[f"local_steps_client{c}_round{r}"] = float(d["steps"])
        if not d.get("withheld"):  # every attacked (client, round): prior, originals over best-matching reconstructions
            name = f"reconstructions_client{c}_round{r}{suffix}.png"
            show = min(len(originals[c]), 16)
            save_reconstruction_grid(originals[c], x, prior, out_dir / name, order=res.matched_index, max_images=show)
            figs.append({"title": f"client {c}, round {r}: prior (first column), originals (top), reconstructions "
                         "(bottom)", "path": name,
                         "caption": f"RDLV {res.mean:+.3f} [{res.low:+.3f}, {res.high:+.3f}], SSIM {vals['ssim']:.3f} "
                         f"vs prior {vals['ssim_prior']:.3f}" + (f"; first {show} of {len(originals[c])} originals"
                                                                if show < len(originals[c]) else "")})
            arts.append(name)
    attacked = sorted({d["client"] for d in per if d["round"] == last_round})
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
    if use_iip:
        from gradleak.models.features import BACKBONE_NAME

        notes.append(f"adjusted IIP: nearest neighbour (cosine of {BACKBONE_NAME} features) among all clients' training "
                     f"and validation images ({int(len(owner))} in the pool) must be a training image of the attacked "
                     "client; the paper's embedding network is unnamed (A4.4).")
        if rec_feats:  # t-SNE of the IIP's features: all clients' training images and the reconstructions
            _tsne_figure(pool_feats, offsets, len(originals), rec_feats, cfg.seed, BACKBONE_NAME,
                         out_dir / f"tsne{suffix}.png", figs, arts, notes)
    tables: list = []  # the report builds the per-client, per-round table from these metrics (gradleak.report.leakage)
    return Evaluation(metrics, figs, tables, arts, notes=notes)


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


# ------------------------------------------------------------------------------------------------ text

@EVALUATORS.register("token_sequences", "text: ROUGE recall and F1, exact sentences, word bag, verified sentences")
def evaluate_tokens(truth: Truth, rec, cfg, out_dir: Path, trial: int) -> Evaluation:
    from gradleak.metrics.text import match_sentences, rouge_f1_scores, rouge_scores, word_bag_scores

    tok = truth.tokenizer
    ids, mask = truth.inputs["input_ids"], truth.inputs["attention_mask"].bool()
    refs = [tok.decode(i[m], skip_special_tokens=True).strip() for i, m in zip(ids, mask)]
    recs = [tok.decode(s, skip_special_tokens=True).strip() for s in rec.data]
    out = dict(rouge_scores(refs, recs))
    out.update(rouge_f1_scores(refs, recs))
    if truth.model_kind == "causal":  # the final EOS gets no gradient under the LM loss: it is not part of what leaks
        last = mask.sum(1) - 1
        vis = mask.clone()
        vis[torch.arange(len(ids)), last] = False
        true_tokens = set(ids[vis].tolist())
        vectors = len(true_tokens)
        lens = mask.sum(1).tolist()  # distinct layer states = distinct prefixes that receive a gradient
        states = len({tuple(ids[i, :k + 1].tolist()) for i in range(len(ids)) for k in range(int(lens[i]) - 1)})
    else:
        true_tokens = set(ids[mask].tolist())
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        vectors = len(set(zip(ids[mask].tolist(), pos[mask].tolist())))
        states = int(mask.sum())  # every token's layer state differs (the whole sentence is its context)
    bag = set(rec.info.get("word_bag", []))
    if "word_bag" in rec.info:
        out.update(word_bag_scores(true_tokens, bag))
    verified = list(rec.info.get("verified", [False] * len(recs)))
    n_verified = int(sum(bool(v) for v in verified))
    out.update({
        "unique_tokens": len(true_tokens),
        "unique_token_vectors": vectors,
        "layer_states": states,
        "bottleneck": truth.bottleneck if truth.bottleneck is not None else float("nan"),
        "total_tokens": int(mask.sum()),
        "recovered_tokens": int(sum(len(s) for s in rec.data)),
        "word_bag_size": len(bag),
        "sentences_returned": len(recs),
        "sentences_total": len(refs),
        "sentences_verified": n_verified,
        # a batch is flagged unless the attack verified one sentence per private sentence
        "unverified_batch": float(n_verified < len(refs)),
        "capacity_exhausted": float(bool(rec.info.get("capacity_exhausted", False))),
        "attack_failed": float(bool(rec.info.get("failure"))),
        "search_truncated": float(bool(rec.info.get("search_truncated"))),
    })
    matched = match_sentences(refs, recs)
    rows = []
    for ref, j in zip(refs, matched):
        r = recs[j] if j is not None else ""
        rows.append({"trial": trial, "reference": ref, "reconstruction": r,
                     "verified": "yes" if (j is not None and j < len(verified) and verified[j]) else "no",
                     "exact": "yes" if ref.lower().split() == r.lower().split() else "no"})
    out["sentences_exact"] = sum(r["exact"] == "yes" for r in rows)  # private sentences recovered word for word
    used = {m for m in matched if m is not None}
    extra = [recs[j] for j in range(len(recs)) if j not in used]
    for r in extra:
        rows.append({"trial": trial, "reference": "(none: extra output)", "reconstruction": r, "verified": "-", "exact": "no"})
    notes = []
    if cfg.metrics.null and truth.null_pool:
        _null_text(truth, refs, recs, true_tokens, bag, out, cfg, notes)
    if n_verified < len(refs):
        notes.append(f"trial {trial}: {n_verified} of {len(refs)} sentences verified by the attack — "
                     "unverified text is a best guess, not a proven reconstruction.")
    return Evaluation(out, rows=rows, notes=notes)


def _null_text(truth: Truth, refs: list[str], recs: list[str], true_tokens: set, bag: set, out: dict, cfg,
               notes: list) -> None:
    """The text nulls: N random public sentences (ROUGE F1, the same matching), a random word bag of the attack's
    size from the public sentences' tokens (word-bag recall), and the attack's own bag in random order (ROUGE)."""
    from gradleak.evaluation.nulls import bag_order_null, text_null, word_bag_null

    tok, pool = truth.tokenizer, list(truth.null_pool)
    draws, seed = cfg.metrics.null_draws, cfg.seed + 23
    nul = text_null(refs, pool, n=len(recs) or len(refs), draws=draws, seed=seed)
    for k in ("rouge1_f1", "rouge2_f1"):
        attach_null(out, k, nul[k])
    special = set(getattr(tok, "all_special_ids", []) or [])
    token_pool = [t for sent in pool for t in set(tok(sent, add_special_tokens=False)["input_ids"]) if t not in special]
    what = f"{draws} draws of {len(recs) or len(refs)} random sentences of {truth.null_source} ({len(pool)} in the pool)"
    if "word_bag_recall" in out:
        attach_null(out, "word_bag_recall", word_bag_null(true_tokens, len(bag), token_pool, draws=draws, seed=seed))
        words = []
        for t in sorted(bag):
            w = tok.convert_ids_to_tokens(int(t))
            w = str(w).replace("##", "").replace("\u0120", " ").replace("\u2581", " ").strip()
            if w and int(t) not in special:
                words.append(w)
        lengths = [len(r.split()) for r in refs]
        bo = bag_order_null(refs, words, lengths, draws=200, seed=seed)
        for k in ("rouge1_f1", "rouge2_f1"):
            vals = bo[k][np.isfinite(bo[k])] if len(bo[k]) else bo[k]
            out[f"{k}_bag_order"] = float(np.quantile(vals, 0.99)) if len(vals) else float("nan")
        what += (f"; word bag: {draws} random bags of {len(bag)} tokens from the pool's tokens (weighted by how many "
                 "sentences hold each); *_bag_order: the 99th percentile of the attack's own bag in random order")
    notes.append("null: " + what + ".")


# ------------------------------------------------------------------------------------------------ membership

from gradleak.evaluation.nulls import roc_summary  # noqa: E402 -- re-exported (its home: the evaluation unit)


@EVALUATORS.register("membership", "membership scores: ROC AUC, TPR at 1 % / 0.1 % FPR, per layer")
def evaluate_membership(truth: Truth, rec, cfg, out_dir: Path, trial: int) -> Evaluation:
    scores = rec.data["scores"]
    labels, flat = [], []
    scored = {ci: lab for ci, lab in (truth.membership or {}).items() if ci in scores}  # an attack may score a subset
    for ci, lab in scored.items():
        labels += [int(v) for v in lab]
        flat += list(scores[ci])
    m = roc_summary(labels, flat)
    m["members"] = float(sum(labels))
    m["nonmembers"] = float(len(labels) - sum(labels))
    if cfg.metrics.null:  # random member sets (label permutations); bootstrap / exact binomial intervals
        from gradleak.evaluation.nulls import membership_null

        nul = membership_null(labels, flat, draws=cfg.metrics.null_draws, seed=cfg.seed + 29)
        m["auc_distance"] = abs(m["auc"] - 0.5)
        attach_null(m, "auc", nul["auc"])
        attach_null(m, "auc_distance", np.abs(nul["auc"] - 0.5))
        attach_null(m, "tpr_at_1pct_fpr", nul["tpr_at_1pct_fpr"])
        m["auc_low"], m["auc_high"] = nul["auc_interval"]
        m["tpr_at_1pct_fpr_low"], m["tpr_at_1pct_fpr_high"] = nul["tpr_interval"]
    per_layer = []
    for name, by_client in (rec.info.get("layer_scores") or {}).items():
        ls = [v for ci in scored for v in by_client[ci]]
        auc = roc_summary(labels, ls)["auc"]
        per_layer.append({"layer": name, "auc": round(auc, 4),
                          "rank": rec.info.get("rank_per_layer", {}).get(name),
                          "input_width": rec.info.get("input_width_per_layer", {}).get(name)})
    if per_layer:
        m["auc_best_layer"] = max(r["auc"] for r in per_layer)  # oracle choice (uses the truth): diagnostic only
    notes = [f"{int(m['members'])} members vs {int(m['nonmembers'])} non-members pooled over the observed clients; "
             "auc_best_layer picks the layer with the truth (an upper bound, not an attack)."]
    if m["nonmembers"] < 1000:
        notes.append(f"only {int(m['nonmembers'])} non-members: TPR at 0.1 % FPR is not resolved below 1,000.")
    tables = [{"title": "ProjRes AUC per layer", "columns": ["layer", "auc", "rank", "input_width"], "rows": per_layer}]
    figs, arts = _roc_figure(labels, flat, out_dir, trial, m)
    return Evaluation(m, figures=figs, tables=tables, notes=notes, artifacts=arts)


def _roc_figure(labels, scores, out_dir: Path, trial: int, m: dict) -> tuple[list[dict], list[str]]:
    """The ROC curve on log-log axes (the low-FPR regime is what matters for membership), as ``roc*.png``."""
    if len(set(labels)) < 2:
        return [], []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from sklearn.metrics import roc_curve

    fpr, tpr, _ = roc_curve(labels, scores)
    name = "roc.png" if trial == 0 else f"roc_trial{trial}.png"
    fig, ax = plt.subplots(figsize=(4.5, 4))
    lo = 1.0 / max(1, len(labels) - sum(labels))
    ax.plot(fpr.clip(lo), tpr.clip(lo), label=f"attack (AUC {m['auc']:.3f})")
    ax.plot([lo, 1], [lo, 1], "--", color="grey", label="chance")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("false-positive rate")
    ax.set_ylabel("true-positive rate")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    from gradleak.report.images import save_png_atomically

    save_png_atomically(out_dir / name, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)
    return [{"title": "ROC (log axes)", "path": name,
             "caption": f"TPR at 1 % FPR {m.get('tpr_at_1pct_fpr', float('nan')):.3g}"}], [name]


def split_by_guarantee(ev: Evaluation, condition: dict[str, bool]) -> None:
    """Annotate the per-layer AUC table with a defense's per-layer guarantee (FISGuard: rank(G_U) = r in every
    observed update) and add the largest per-layer AUC among the layers where it holds, where it fails, and among
    the unprotected layers (``auc_max_guarantee_holds`` / ``_fails`` / ``auc_max_unprotected``, each with its layer
    count ``layers_guarantee_holds`` / ... ; a group without layers has count 0 and no AUC key)."""
    table = next((t for t in ev.tables if t.get("title") == "ProjRes AUC per layer"), None)
    if table is None or not condition:
        return
    groups: dict[str, list[float]] = {"holds": [], "fails": [], "unprotected": []}
    for row in table["rows"]:
        state = condition.get(row["layer"])
        row["guarantee"] = "unprotected" if state is None else ("holds" if state else "fails")
        groups[row["guarantee"]].append(row["auc"])
    table["columns"] = table["columns"] + ["guarantee"]
    for g, aucs in groups.items():
        key = "auc_max_unprotected" if g == "unprotected" else f"auc_max_guarantee_{g}"
        if aucs:
            ev.metrics[key] = max(aucs)
        ev.metrics[f"layers_{'unprotected' if g == 'unprotected' else 'guarantee_' + g}"] = float(len(aucs))
    failing = [r["layer"] for r in table["rows"] if r["guarantee"] == "fails"]
    if failing:
        ev.notes.append("the defense's guarantee does not hold (rank(G_U) < r) on " + ", ".join(failing)
                        + ": these layers are not protected against ProjRes.")
