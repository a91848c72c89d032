"""Leakage measures of Hatamizadeh et al. 2022 (arXiv:2202.06924 §II-D, §III-C–G; docs/PAPERS.md).

Pure functions on tensors/arrays (no model is loaded here: image features come from the caller, e.g.
:func:`gradleak.models.features.image_features`, the offline ViT-S/14).

* :func:`ssim_vs_prior` — SSIM(reconstruction, original) next to SSIM(prior, original) (§III-D: the
  "safe" criterion is SSIM(x̂, x) ≤ SSIM(x_prior, x)). Range [−1, 1] each.
* :func:`rdlv` — relative data leakage value (§III-E; the paper defines it in words, the formula is the
  NVFlare code's ``RelativeDataLeakageValueFilter.compute_rdlv``)::

      RDLV(x̂, x) = (SSIM(x̂, x) − SSIM(x_prior, x)) / SSIM(x_prior, x)

  > 0: the reconstruction is closer to the original than the prior is; ≤ 0: no leakage beyond the prior.
  Range (−∞, ∞) in general; [−1 − 1/s_p, 1/s_p − 1] for a prior SSIM s_p ∈ (0, 1].
* :func:`bootstrap_interval` — percentile-bootstrap 95 % interval of the mean RDLV (seeded).
* :func:`identifiability_precision` — the FL-adjusted image identifiability precision (§II-D, §III-G)
  and the matched-image cosine similarity. Range [0, 1] each (cosine: [−1, 1]).

Decisions the paper leaves open (open point A4.4, docs/PAPERS.md), recorded here:

* **Pairing reconstructions with originals.** ``match="best"`` (default, NVFlare ``rdlv_reduce="max"``):
  each original takes its best RDLV over all reconstructions (reconstructions come unordered);
  ``match="paired"``: reconstruction i ↔ original i.
* **Client RDLV and its interval.** The client's value is the **mean** of the per-original values, and
  the 95 % interval is the percentile bootstrap of that mean over originals (1000 resamples) — what
  NVFlare's plots draw (``seaborn.lineplot``'s default estimator and ``errorbar=("ci", 95)``). NVFlare's
  filter additionally uses the **max** (:attr:`RDLVResult.max`). A client with one image has a degenerate
  interval [v, v]; pool several observations (restarts, rounds) into ``bootstrap_interval`` to get a width.
* **SSIM settings.** ``ssim="gaussian"`` (default, our convention in docs/PAPERS.md: Wang et al. 11×11 Gaussian window σ = 1.5,
  as :func:`gradleak.metrics.image.ssim`, images in [0, 1]); ``ssim="nvflare"`` reproduces the public
  code: reconstruction min–max rescaled to [0, 255] (MONAI ``ScaleIntensity``), original and prior in
  [0, 255], ``skimage.metrics.structural_similarity`` defaults (7×7 uniform window, sample covariance)
  with ``data_range=256``. Grey images are compared on their single channel (NVFlare replicates to
  3 channels, which gives the same value).
* **Undefined RDLV.** Where SSIM(prior, x) ≤ 0 the ratio changes sign meaning: those originals get NaN,
  are counted in ``undefined`` and left out of mean, max and interval.
* **IIP.** Cosine similarity of the caller's feature vectors (the paper embeds with "a pretrained
  network"; gradleak uses the offline ViT-S/14 CLS token, :data:`gradleak.models.features.BACKBONE_NAME`).
  A reconstruction counts as identified when its nearest pool image is a *training* image of the attacked
  client (the paper's adjustment: the pool holds all clients' training and validation images).
  ``matched_cosine`` is the mean nearest-neighbour cosine over the identified reconstructions (NaN if
  none), ``nearest_cosine`` the mean over all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from gradleak.errors import BadInput
from gradleak.metrics.image import ssim as _ssim_gaussian
from gradleak.registry import METRICS

BOOTSTRAP_RESAMPLES = 1000


def _batch(x, name: str) -> torch.Tensor:
    t = torch.as_tensor(x).detach().to("cpu", torch.float64)
    if t.ndim == 3:
        t = t.unsqueeze(0)
    if t.ndim != 4:
        raise BadInput(name, f"expected N×C×H×W images (or one C×H×W image), got shape {tuple(t.shape)}.")
    return t


def _ssim_nvflare(x: torch.Tensor, y: torch.Tensor, rescale_x: bool) -> torch.Tensor:
    from skimage.metrics import structural_similarity

    out = []
    for a, b in zip(x.numpy(), y.numpy()):
        if rescale_x:
            lo, hi = a.min(), a.max()
            a = (a - lo) / (hi - lo) * 255.0 if hi > lo else np.zeros_like(a)
        else:
            a = a * 255.0
        b = b * 255.0
        out.append(float(structural_similarity(b, a, channel_axis=0, data_range=256.0)))
    return torch.tensor(out, dtype=torch.float64)


def pairwise_ssim(sources: torch.Tensor, references: torch.Tensor, ssim: str = "gaussian",
                  rescale_sources: bool = True) -> torch.Tensor:
    """SSIM of every source against every reference: R×S matrix (reference-major), float64.

    ``ssim="gaussian"``: :func:`gradleak.metrics.image.ssim` on [0, 1] images. ``ssim="nvflare"``: see the
    module docstring (``rescale_sources`` min–max rescales each source as NVFlare does for reconstructions;
    pass ``False`` for the prior).
    """
    if ssim not in ("gaussian", "nvflare"):
        raise BadInput("metrics.ssim", f"unknown SSIM setting '{ssim}'.", "use 'gaussian' or 'nvflare'.")
    s, r = _batch(sources, "reconstruction"), _batch(references, "original")
    if s.shape[1:] != r.shape[1:]:
        raise BadInput("reconstruction", f"reconstructions {tuple(s.shape[1:])} and originals {tuple(r.shape[1:])} "
                       "differ in shape.", "compare images of the same size and channel count.")
    out = torch.empty(len(r), len(s), dtype=torch.float64)
    for i in range(len(r)):
        ref = r[i:i + 1].expand(len(s), -1, -1, -1)
        out[i] = _ssim_gaussian(s, ref) if ssim == "gaussian" else _ssim_nvflare(s, ref, rescale_sources)
    return out


def ssim_vs_prior(reconstructions: torch.Tensor, originals: torch.Tensor, prior: torch.Tensor,
                  ssim: str = "gaussian", match: str = "best") -> dict[str, torch.Tensor]:
    """Per original: ``ssim_reconstruction`` (of its matched reconstruction) and ``ssim_prior``; both (N,).

    ``prior``: one C×H×W image (e.g. the dataset mean image) or one per original. ``match``: ``"best"``
    (the reconstruction with the highest SSIM to that original) or ``"paired"``.
    """
    orig = _batch(originals, "original")
    rec = _batch(reconstructions, "reconstruction")
    pri = _batch(prior, "prior")
    if len(pri) == 1:
        pri = pri.expand(len(orig), -1, -1, -1)
    if len(pri) != len(orig):
        raise BadInput("prior", f"{len(pri)} prior images for {len(orig)} originals.", "give one prior or one per original.")
    if match not in ("best", "paired"):
        raise BadInput("metrics.match", f"unknown matching '{match}'.", "use 'best' or 'paired'.")
    if match == "paired" and len(rec) != len(orig):
        raise BadInput("reconstruction", f"{len(rec)} reconstructions for {len(orig)} originals with match='paired'.",
                       "give one reconstruction per original, or use match='best'.")
    sp = torch.stack([pairwise_ssim(pri[i:i + 1], orig[i:i + 1], ssim, rescale_sources=False)[0, 0]
                      for i in range(len(orig))])
    if match == "paired":
        sr = torch.stack([pairwise_ssim(rec[i:i + 1], orig[i:i + 1], ssim)[0, 0] for i in range(len(orig))])
        idx = torch.arange(len(orig))
    else:
        mat = pairwise_ssim(rec, orig, ssim)
        sr, idx = mat.max(1)
    return {"ssim_reconstruction": sr, "ssim_prior": sp, "matched_index": idx}


def rdlv_from_ssim(ssim_reconstruction: torch.Tensor, ssim_prior: torch.Tensor) -> torch.Tensor:
    """``(s_rec − s_prior) / s_prior`` elementwise (float64); NaN where ``s_prior ≤ 0`` (module docstring)."""
    sr = torch.as_tensor(ssim_reconstruction, dtype=torch.float64)
    sp = torch.as_tensor(ssim_prior, dtype=torch.float64)
    out = (sr - sp) / sp
    return torch.where(sp > 0, out, torch.full_like(out, math.nan))


@dataclass
class RDLVResult:
    """A client's RDLV: per-original values, their mean with a bootstrap 95 % interval, and the max."""

    per_image: torch.Tensor
    mean: float
    low: float
    high: float
    max: float
    ssim_reconstruction: torch.Tensor
    ssim_prior: torch.Tensor
    matched_index: torch.Tensor
    undefined: int = 0
    confidence: float = 0.95
    info: dict = field(default_factory=dict)

    @property
    def leaks(self) -> bool:
        """RDLV > 0 beyond its interval (the paper's "leaks beyond the confidence interval", §III-E)."""
        return self.low > 0


def bootstrap_interval(values, confidence: float = 0.95, resamples: int = BOOTSTRAP_RESAMPLES,
                       seed: int = 0) -> tuple[float, float, float]:
    """``(mean, low, high)``: percentile bootstrap of the mean of ``values`` (NaNs dropped), seeded.

    One value gives ``(v, v, v)``; no finite value gives NaNs. The interval is the plain percentile interval
    (not clamped): for a very skewed sample it can, in principle, miss the point estimate.
    """
    if not 0 < confidence < 1:
        raise BadInput("metrics.confidence", f"confidence must be in (0, 1), got {confidence}.")
    v = np.asarray(torch.as_tensor(values, dtype=torch.float64).reshape(-1).numpy())
    v = v[np.isfinite(v)]
    if v.size == 0:
        return math.nan, math.nan, math.nan
    mean = float(v.mean())
    if v.size == 1:
        return mean, mean, mean
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, v.size, size=(resamples, v.size))].mean(1)
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return mean, float(low), float(high)


@METRICS.register("rdlv", "relative data leakage value (SSIM(x̂,x) − SSIM(prior,x)) / SSIM(prior,x) per original, "
                  "mean with bootstrap 95 % interval; > 0 leaks beyond the prior")
def rdlv(reconstructions: torch.Tensor, originals: torch.Tensor, prior: torch.Tensor, *, ssim: str = "gaussian",
         match: str = "best", confidence: float = 0.95, resamples: int = BOOTSTRAP_RESAMPLES,
         seed: int = 0) -> RDLVResult:
    """Relative data leakage value of one client's reconstructions (§III-E; module docstring).

    Images in [0, 1], N×C×H×W. Returns per-original RDLV, their mean with a seeded percentile-bootstrap
    ``confidence`` interval, and their max (NVFlare's filter statistic).
    """
    s = ssim_vs_prior(reconstructions, originals, prior, ssim=ssim, match=match)
    per = rdlv_from_ssim(s["ssim_reconstruction"], s["ssim_prior"])
    mean, low, high = bootstrap_interval(per, confidence, resamples, seed)
    finite = per[torch.isfinite(per)]
    return RDLVResult(per, mean, low, high, float(finite.max()) if len(finite) else math.nan,
                      s["ssim_reconstruction"], s["ssim_prior"], s["matched_index"],
                      undefined=int((~torch.isfinite(per)).sum()), confidence=confidence,
                      info={"ssim": ssim, "match": match, "resamples": resamples, "seed": seed})


@dataclass
class IIPResult:
    """Adjusted image identifiability precision and nearest-neighbour similarities."""

    iip: float
    identified: torch.Tensor  # (N,) bool
    nearest_index: torch.Tensor  # (N,) pool index of each reconstruction's nearest neighbour
    nearest_cosine: torch.Tensor  # (N,)
    matched_cosine: float  # mean over identified reconstructions (NaN if none)


@METRICS.register("iip", "adjusted image identifiability precision [0, 1]: nearest pool image (all clients' train+val "
                  "features) is an attacked client's training image; with matched-image cosine")
def identifiability_precision(reconstruction_features, pool_features, pool_client, pool_is_training, client,
                              original_features=None, tolerance: float = 1e-5) -> IIPResult:
    """FL-adjusted IIP (§II-D): share of reconstructions whose nearest pool image (cosine similarity of
    features) is a training image of ``client``.

    ``pool_features``: M×d features of **all clients' training and validation images**; ``pool_client``:
    (M,) client id of each; ``pool_is_training``: (M,) bool. ``original_features`` (K×d, optional): the
    attacked client's training images; each must be in the pool among that client's training entries
    (cosine ≥ 1 − ``tolerance``), else BadInput. Without it, the pool must at least hold one training image
    of ``client``.
    """
    rf = torch.as_tensor(reconstruction_features, dtype=torch.float64)
    pf = torch.as_tensor(pool_features, dtype=torch.float64)
    owner = torch.as_tensor(pool_client).reshape(-1)
    train = torch.as_tensor(pool_is_training, dtype=torch.bool).reshape(-1)
    if rf.ndim != 2 or pf.ndim != 2 or rf.shape[1] != pf.shape[1]:
        raise BadInput("metrics.iip", f"features must be N×d and M×d with the same d, got {tuple(rf.shape)} and "
                       f"{tuple(pf.shape)}.")
    if len(owner) != len(pf) or len(train) != len(pf):
        raise BadInput("metrics.iip", f"{len(pf)} pool features but {len(owner)} owners and {len(train)} "
                       "training flags.", "give one client id and one training flag per pool image.")
    own_train = (owner == client) & train
    if not bool(own_train.any()):
        raise BadInput("metrics.iip", f"the identifiability pool holds no training image of the attacked client "
                       f"{client}.", "build the pool from all clients' training and validation images, "
                       "including the attacked client's.")
    pn = torch.nn.functional.normalize(pf, dim=1)
    if original_features is not None:
        of = torch.nn.functional.normalize(torch.as_tensor(original_features, dtype=torch.float64).reshape(-1, pf.shape[1]), dim=1)
        best = (of @ pn[own_train].T).max(1).values
        missing = torch.nonzero(best < 1.0 - tolerance).reshape(-1)
        if len(missing):
            raise BadInput("metrics.iip", f"{len(missing)} of the attacked client's {len(of)} training images are not "
                           f"in the identifiability pool (first: original {int(missing[0])}, best cosine "
                           f"{float(best[missing[0]]):.6f}).", "add every client's training and validation images "
                           "to the pool.")
    if len(rf) == 0:
        raise BadInput("metrics.iip", "no reconstruction features given.")
    sims = torch.nn.functional.normalize(rf, dim=1) @ pn.T
    cos, idx = sims.max(1)
    identified = own_train[idx]
    matched = float(cos[identified].mean()) if bool(identified.any()) else math.nan
    return IIPResult(float(identified.double().mean()), identified, idx, cos, matched)


TSNE_PERPLEXITY = 30.0


def tsne_embedding(features_by_group: dict, seed: int = 0, perplexity: float | None = None) -> dict[str, np.ndarray]:
    """2-D t-SNE of feature vectors given per group (§III-F's visualisation; scikit-learn ``TSNE``).

    ``features_by_group``: name → N_g×d features (e.g. ``"client 0 training"``, ``"client 0 reconstruction"``);
    all groups are embedded *jointly* (one map) and split back: name → N_g×2 float64 array, same order.
    Deterministic for a fixed ``seed`` (``random_state=seed``, PCA initialisation). ``perplexity``: default
    ``min(30, max(1, (n − 1) / 3))`` for n points in all; a given value is clipped to ``n − 1`` (scikit-learn needs
    it strictly below the sample count). Fewer than 2 points: zeros. Empty groups give 0×2 arrays.
    """
    if not isinstance(features_by_group, dict):
        raise BadInput("metrics.tsne", "features must be given as a dict: group name → N×d features.")
    names = list(features_by_group)
    mats = [np.asarray(torch.as_tensor(features_by_group[k]).detach().to("cpu", torch.float64).numpy()) for k in names]
    mats = [m.reshape(len(m), -1) if m.ndim != 2 else m for m in mats]
    dims = {m.shape[1] for m in mats if len(m)}
    if len(dims) > 1:
        raise BadInput("metrics.tsne", f"groups have features of different widths {sorted(dims)}.",
                       "embed every group with the same network.")
    d = dims.pop() if dims else 1
    x = np.concatenate([m if len(m) else np.zeros((0, d)) for m in mats]) if mats else np.zeros((0, d))
    n = len(x)
    if n < 2:
        y = np.zeros((n, 2))
    else:
        from sklearn.manifold import TSNE

        if perplexity is None:
            p = min(TSNE_PERPLEXITY, max(1.0, (n - 1) / 3.0))
        else:
            if not perplexity > 0:
                raise BadInput("metrics.tsne", f"perplexity must be > 0, got {perplexity}.")
            p = min(float(perplexity), n - 1.0)
        y = TSNE(n_components=2, perplexity=p, init="pca", random_state=seed, n_jobs=1).fit_transform(x)
        y = np.asarray(y, dtype=np.float64)
    out, start = {}, 0
    for k, m in zip(names, mats):
        out[k] = y[start:start + len(m)]
        start += len(m)
    return out


__all__ = ["pairwise_ssim", "ssim_vs_prior", "rdlv_from_ssim", "rdlv", "RDLVResult", "bootstrap_interval",
           "identifiability_precision", "IIPResult", "BOOTSTRAP_RESAMPLES", "tsne_embedding", "TSNE_PERPLEXITY"]
