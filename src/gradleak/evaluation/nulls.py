"""Null distributions: what chance scores on an attack's own metric, matched exactly as the attack is (docs/DESIGN.md §6).

A number means nothing without its null. Every function here takes *public* samples of the attacked data's own
source family (never a victim's sample: the pipeline hands over the chunk after every client's, validation, prior
and test chunk) and scores them against the private originals the way the evaluator scores a reconstruction:
the same count N, the same matching (Hungarian on MSE, best-of-N, or paired), the same metric function. Each
returns, per metric, the array of values over ``draws`` seeded draws; :func:`summarize` turns a value and its null
into ``{value, null_median, null_p99, p_value}``.

* images / patches -- :func:`image_null`: N random public images as the reconstruction (pairwise PSNR / SSIM /
  MSE against the originals are computed once, each draw picks N rows and matches them); the *mean public image*
  and the grey image are scored too (:func:`reference_images`), because a blur that sits at the mean beats random
  images on PSNR without showing anything private;
* leakage (RDLV) -- :func:`rdlv_null`: N random held-out images with the same best-of-N as the attack's RDLV;
* text -- :func:`text_null`: N random public sentences (ROUGE F1, the same matching), and a random word bag of
  the attack's bag size drawn from the public sentences' tokens (word-bag recall), plus the attack's *own* word bag
  in random order (:func:`bag_order_null`): what knowing which words, but not which sentences, scores;
* membership -- :func:`membership_null`: the attack's scores under random member sets (label permutations),
  a bootstrap 95 % interval of the AUC and an exact (Clopper-Pearson) interval of the TPR at 1 % FPR.

``p_value`` = (1 + #{null >= value}) / (1 + draws) (one-sided, upper; the add-one keeps it valid for a finite
null). ``null_p99`` is the 99th percentile of the draws; "beyond the null" means strictly above it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Sequence

import numpy as np
import torch

#: draws of every null (docs/DESIGN.md §6: >= 200); cheap because the pairwise scores are computed once
NULL_DRAWS = 1000


def summarize(value: float, null: np.ndarray, lower_is_leak: bool = False) -> dict[str, float]:
    """``{value, null_median, null_p99, p_value}`` of ``value`` against the draws ``null`` (NaNs dropped).
    ``lower_is_leak``: a metric where smaller means closer (MSE): the p-value and the percentile flip."""
    v = float(value)
    nul = np.asarray(null, dtype=float)
    nul = nul[np.isfinite(nul)]
    if nul.size == 0 or not math.isfinite(v) and not (v == math.inf and not lower_is_leak):
        return {"value": v, "null_median": math.nan, "null_p99": math.nan, "p_value": math.nan}
    if lower_is_leak:
        p = (1 + int((nul <= v).sum())) / (1 + nul.size)
        p99 = float(np.quantile(nul, 0.01))
    else:
        p = (1 + int((nul >= v).sum())) / (1 + nul.size)
        p99 = float(np.quantile(nul, 0.99))
    return {"value": v, "null_median": float(np.median(nul)), "null_p99": p99, "p_value": float(p)}


def draw_subsets(pool: int, n: int, draws: int, seed: int) -> np.ndarray:
    """``draws`` × ``n`` indices into a pool of ``pool``: distinct within a draw when the pool allows it."""
    rng = np.random.default_rng(seed)
    if pool >= n:
        return np.stack([rng.choice(pool, size=n, replace=False) for _ in range(draws)])
    return rng.integers(0, pool, size=(draws, n))


def _pairwise(pool01: torch.Tensor, originals01: torch.Tensor) -> dict[str, np.ndarray]:
    """P×N matrices of MSE, PSNR and SSIM of every pool image against every original (the evaluator's functions)."""
    from gradleak.metrics import psnr, ssim

    P, N = len(pool01), len(originals01)
    mse = np.empty((P, N))
    ps = np.empty((P, N))
    ss = np.empty((P, N))
    x = pool01.to(torch.float32)
    for j in range(N):
        y = originals01[j:j + 1].to(torch.float32).expand(P, -1, -1, -1)
        mse[:, j] = ((x - y) ** 2).flatten(1).mean(1).numpy()
        ps[:, j] = psnr(x, y).numpy()
        ss[:, j] = ssim(x, y).numpy()
    return {"mse": mse, "psnr": ps, "ssim": ss}


#: image nulls already drawn in this process (:func:`image_null`), most recent last
_IMAGE_NULLS: "OrderedDict[tuple, dict[str, np.ndarray]]" = OrderedDict()
_IMAGE_NULLS_KEPT = 16


def _digest(t: torch.Tensor) -> str:
    import hashlib

    a = t.detach().to("cpu", torch.float32).contiguous()
    return hashlib.sha1(a.numpy().tobytes()).hexdigest() + str(tuple(a.shape))


def image_null(originals01: torch.Tensor, pool01: torch.Tensor, *, n: int | None = None, match: str = "hungarian",
               draws: int = NULL_DRAWS, seed: int = 0) -> dict[str, np.ndarray]:
    """:func:`_image_null`, kept per process for the same originals, pool, count, matching, draws and seed (the
    variants of an attack and the probes of ``--advise`` score the same private images against the same pool; the
    draws are seeded, so a kept null is the one that would be drawn again)."""
    key = (_digest(originals01), _digest(pool01), n, match, int(draws), int(seed))
    if key in _IMAGE_NULLS:
        _IMAGE_NULLS.move_to_end(key)
    else:
        _IMAGE_NULLS[key] = _image_null(originals01, pool01, n=n, match=match, draws=draws, seed=seed)
        while len(_IMAGE_NULLS) > _IMAGE_NULLS_KEPT:
            _IMAGE_NULLS.popitem(last=False)
    return {k: v.copy() for k, v in _IMAGE_NULLS[key].items()}


def _image_null(originals01: torch.Tensor, pool01: torch.Tensor, *, n: int | None = None, match: str = "hungarian",
                draws: int = NULL_DRAWS, seed: int = 0) -> dict[str, np.ndarray]:
    """Null draws of the image metrics: ``n`` (default: as many as originals) random pool images as the attack's
    output, matched to the originals like :func:`gradleak.evaluation.images.evaluate_images` (``hungarian``:
    order-free on MSE, unmatched originals scored against grey) or in order (``paired``, PEFTLeak's placement).
    Returns arrays (one value per draw) for ``psnr`` (mean over originals), ``ssim`` (mean), ``psnr_max`` and
    ``ssim_max`` (the best original) and ``images_above_threshold`` needs a threshold: see the caller."""
    from scipy.optimize import linear_sum_assignment

    from gradleak.metrics import psnr, ssim

    N = len(originals01)
    n = N if n is None else int(n)
    if len(pool01) == 0 or N == 0 or n == 0:
        return {k: np.full(draws, np.nan) for k in ("psnr", "ssim", "psnr_max", "ssim_max")}
    pw = _pairwise(pool01, originals01)
    grey = torch.full_like(originals01[:1], 0.5).expand(N, -1, -1, -1).to(torch.float32)
    g_psnr = psnr(grey, originals01.to(torch.float32)).numpy()
    g_ssim = ssim(grey, originals01.to(torch.float32)).numpy()
    idx = draw_subsets(len(pool01), n, draws, seed)
    out = {k: np.empty(draws) for k in ("psnr", "ssim", "psnr_max", "ssim_max")}
    for d in range(draws):
        rows = idx[d]
        if match == "paired":
            k = min(n, N)
            p_img, s_img = np.array(g_psnr, dtype=float), np.array(g_ssim, dtype=float)
            p_img[:k] = pw["psnr"][rows[:k], np.arange(k)]
            s_img[:k] = pw["ssim"][rows[:k], np.arange(k)]
        else:
            ri, ti = linear_sum_assignment(pw["mse"][rows])
            p_img, s_img = np.array(g_psnr, dtype=float), np.array(g_ssim, dtype=float)
            p_img[ti] = pw["psnr"][rows[ri], ti]
            s_img[ti] = pw["ssim"][rows[ri], ti]
        out["psnr"][d], out["ssim"][d] = p_img.mean(), s_img.mean()
        out["psnr_max"][d], out["ssim_max"][d] = p_img.max(), s_img.max()
    return out


def reference_images(originals01: torch.Tensor, pool01: torch.Tensor) -> dict[str, float]:
    """The scores of trivial reconstructions that show nothing private: the mean public image, the grey image, and
    the best flat image (each original's own per-channel mean colour: the most any uniform image can score, e.g. an
    attack's near-constant output under heavy noise), each put in place of every original (mean and max over originals
    of PSNR / SSIM). A level rule takes the larger of these and the random-image null's 99th percentile as the bar."""
    from gradleak.metrics import psnr, ssim

    y = originals01.to(torch.float32)
    out: dict[str, float] = {}
    refs = {"grey": torch.full_like(y[:1], 0.5), "flat": y.mean(dim=(2, 3), keepdim=True).expand_as(y)}
    if len(pool01):
        refs["mean_public"] = pool01.to(torch.float32).mean(0, keepdim=True)
    for name, img in refs.items():
        x = img.expand(len(y), -1, -1, -1).contiguous()
        p, s = psnr(x, y).numpy(), ssim(x, y).numpy()
        out[f"psnr_{name}"], out[f"psnr_max_{name}"] = float(p.mean()), float(p.max())
        out[f"ssim_{name}"], out[f"ssim_max_{name}"] = float(s.mean()), float(s.max())
    return out


def rdlv_null(originals01: torch.Tensor, pool01: torch.Tensor, prior01: torch.Tensor, *, n: int | None = None,
              ssim: str = "gaussian", draws: int = NULL_DRAWS, seed: int = 0) -> dict[str, np.ndarray]:
    """Null draws of a client's RDLV (mean over its originals) and SSIM: ``n`` random held-out images as its
    reconstructions, each original taking its best of the ``n`` (:func:`gradleak.metrics.leakage.rdlv`'s
    ``match="best"``). Returns ``rdlv``, ``ssim`` (mean matched SSIM) and ``rdlv_max`` arrays."""
    from gradleak.metrics.leakage import pairwise_ssim, rdlv_from_ssim

    N = len(originals01)
    n = N if n is None else int(n)
    if len(pool01) == 0 or N == 0:
        return {k: np.full(draws, np.nan) for k in ("rdlv", "ssim", "rdlv_max")}
    mat = pairwise_ssim(pool01.to(torch.float64), originals01.to(torch.float64), ssim).numpy()  # N × P
    pri = prior01.to(torch.float64)
    pri = pri.unsqueeze(0) if pri.ndim == 3 else pri
    sp = np.array([float(pairwise_ssim(pri[:1], originals01[j:j + 1].to(torch.float64), ssim,
                                       rescale_sources=False)[0, 0]) for j in range(N)])
    idx = draw_subsets(mat.shape[1], n, draws, seed)
    out = {k: np.empty(draws) for k in ("rdlv", "ssim", "rdlv_max")}
    for d in range(draws):
        sr = mat[:, idx[d]].max(1)
        per = rdlv_from_ssim(torch.as_tensor(sr), torch.as_tensor(sp)).numpy()
        fin = per[np.isfinite(per)]
        out["rdlv"][d] = fin.mean() if fin.size else np.nan
        out["rdlv_max"][d] = fin.max() if fin.size else np.nan
        out["ssim"][d] = sr.mean()
    return out


# ------------------------------------------------------------------------------------------------ text

def text_null(references: Sequence[str], pool_sentences: Sequence[str], *, n: int | None = None,
              draws: int = NULL_DRAWS, seed: int = 0) -> dict[str, np.ndarray]:
    """Null draws of the batch-level ROUGE-1/2 F1 (:func:`gradleak.metrics.text.rouge_f1_scores`, the same
    matching): ``n`` (default: as many as references) random public sentences as the reconstruction."""
    from gradleak.metrics.text import rouge_f1_tokenized, tokenize_for_rouge

    refs = [tokenize_for_rouge(r) for r in references]
    pool = [tokenize_for_rouge(s) for s in pool_sentences]
    n = len(refs) if n is None else int(n)
    out = {k: np.full(draws, np.nan) for k in ("rouge1_f1", "rouge2_f1")}
    if not pool or not refs or n == 0:
        return out
    idx = draw_subsets(len(pool), n, draws, seed)
    for d in range(draws):
        s = rouge_f1_tokenized(refs, [pool[i] for i in idx[d]])
        out["rouge1_f1"][d], out["rouge2_f1"][d] = s["rouge1_f1"], s["rouge2_f1"]
    return out


def bag_order_null(references: Sequence[str], bag_words: Sequence[str], lengths: Sequence[int], *,
                   draws: int = 200, seed: int = 0) -> dict[str, np.ndarray]:
    """What knowing the words but not the sentences scores: the attack's recovered word bag, shuffled and cut
    into sentences of the references' lengths (in words), as the reconstruction (ROUGE-1/2 F1 arrays)."""
    from gradleak.metrics.text import rouge_f1_tokenized, tokenize_for_rouge

    refs = [tokenize_for_rouge(r) for r in references]
    words = [w for b in bag_words for w in tokenize_for_rouge(b).tokens]
    out = {k: np.full(draws, np.nan) for k in ("rouge1_f1", "rouge2_f1")}
    if not words or not refs:
        return out
    rng = np.random.default_rng(seed)
    for d in range(draws):
        seq = [words[i] for i in rng.permutation(len(words))]
        cands, a = [], 0
        for L in lengths:
            cands.append(seq[a:a + max(1, int(L))] if a < len(seq) else [])
            a += max(1, int(L))
        s = rouge_f1_tokenized(refs, [c for c in cands if c])
        out["rouge1_f1"][d], out["rouge2_f1"][d] = s["rouge1_f1"], s["rouge2_f1"]
    return out


def word_bag_null(true_tokens: set[int], bag_size: int, token_pool: Sequence[int], *, draws: int = NULL_DRAWS,
                  seed: int = 0) -> np.ndarray:
    """Null draws of word-bag recall (0-100): a bag of the attack's size drawn without replacement from the public
    sentences' distinct tokens, weighted by how many public sentences hold each (a common word is a likelier guess);
    a bag at least as large as the pool is the whole pool."""
    from collections import Counter

    cnt = Counter(token_pool)
    toks = np.array(sorted(cnt), dtype=np.int64)
    out = np.full(draws, np.nan)
    if not true_tokens or len(toks) == 0:
        return out
    w = np.array([cnt[t] for t in toks], dtype=float)
    w /= w.sum()
    hit = np.isin(toks, np.array(sorted(true_tokens), dtype=np.int64))
    rng = np.random.default_rng(seed)
    k = min(int(bag_size), len(toks))
    for d in range(draws):
        if k == 0:
            out[d] = 0.0
            continue
        pick = rng.choice(len(toks), size=k, replace=False, p=w) if k < len(toks) else np.arange(len(toks))
        out[d] = 100.0 * hit[pick].sum() / len(true_tokens)
    return out


# ------------------------------------------------------------------------------------------------ membership

def roc_summary(labels, scores) -> dict[str, float]:
    """ROC AUC (ties count ½) and the largest TPR at FPR ≤ 1 % and ≤ 0.1 % (the values of scikit-learn's
    ``roc_auc_score`` / ``roc_curve``, computed from one sort so the nulls can afford thousands of them)."""
    y = np.asarray(labels, dtype=int)
    s = np.nan_to_num(np.asarray(scores, dtype=float), neginf=-1e300, posinf=1e300)
    n1 = int(y.sum())
    n0 = y.size - n1
    if y.size == 0 or n1 == 0 or n0 == 0:
        return {"auc": float("nan"), "tpr_at_1pct_fpr": float("nan"), "tpr_at_0.1pct_fpr": float("nan")}
    order = np.argsort(-s, kind="mergesort")
    ss, yy = s[order], y[order]
    last = np.r_[ss[1:] != ss[:-1], True]  # the end of every run of tied scores: one ROC point per threshold
    tp = np.cumsum(yy)[last] / n1
    fp = np.cumsum(1 - yy)[last] / n0
    # the trapezoid area under the ROC points is the Mann-Whitney AUC with ties counted 1/2
    tpz, fpz = np.r_[0.0, tp], np.r_[0.0, fp]
    out = {"auc": float(np.sum((fpz[1:] - fpz[:-1]) * (tpz[1:] + tpz[:-1]) / 2))}
    for name, at in (("tpr_at_1pct_fpr", 0.01), ("tpr_at_0.1pct_fpr", 0.001)):
        ok = fp <= at
        out[name] = float(tp[ok].max()) if ok.any() else 0.0
    return out


def _roc_rows(Y: np.ndarray, S: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`roc_summary`'s AUC and TPR at 1 % FPR for every row of labels ``Y`` / scores ``S`` at once (each row
    holds both classes)."""
    S = np.nan_to_num(np.asarray(S, dtype=float), neginf=-1e300, posinf=1e300)
    order = np.argsort(-S, axis=1, kind="mergesort")
    ss = np.take_along_axis(S, order, 1)
    yy = np.take_along_axis(np.asarray(Y, dtype=float), order, 1)
    n1 = yy.sum(1, keepdims=True)
    n0 = yy.shape[1] - n1
    tp, fp = np.cumsum(yy, 1) / n1, np.cumsum(1 - yy, 1) / n0
    tie_next = np.concatenate([ss[:, 1:] == ss[:, :-1], np.zeros((len(ss), 1), bool)], 1)
    # inside a run of ties only the run's end is a ROC point: every position takes its run's end
    n = ss.shape[1]
    end = np.where(tie_next, n, np.arange(n)[None, :])
    end = np.minimum.accumulate(end[:, ::-1], axis=1)[:, ::-1]
    tp, fp = np.take_along_axis(tp, end, 1), np.take_along_axis(fp, end, 1)
    tpz = np.concatenate([np.zeros((len(tp), 1)), tp], 1)
    fpz = np.concatenate([np.zeros((len(fp), 1)), fp], 1)
    auc = np.sum((fpz[:, 1:] - fpz[:, :-1]) * (tpz[:, 1:] + tpz[:, :-1]) / 2, 1)
    tpr = np.where(fp <= 0.01, tp, 0.0).max(1)
    return auc, tpr


def membership_null(labels: Sequence[int], scores: Sequence[float], *, draws: int = NULL_DRAWS, seed: int = 0,
                    bootstrap: int = 1000) -> dict:
    """The attack's scores under random member sets: ``labels`` permuted ``draws`` times (same member count),
    giving null arrays of ``auc`` and ``tpr_at_1pct_fpr``; plus a bootstrap 95 % interval of the AUC (members and
    non-members resampled separately) and the exact binomial (Clopper-Pearson) 95 % interval of the TPR at 1 % FPR."""
    from scipy.stats import beta

    y = np.asarray(labels, dtype=int)
    s = np.asarray(scores, dtype=float)
    out: dict = {"auc": np.full(draws, np.nan), "tpr_at_1pct_fpr": np.full(draws, np.nan)}
    if y.size == 0 or y.min() == y.max():
        out.update({"auc_interval": (math.nan, math.nan), "tpr_interval": (math.nan, math.nan)})
        return out
    rng = np.random.default_rng(seed)
    perm = np.stack([rng.permutation(y) for _ in range(draws)])
    out["auc"], out["tpr_at_1pct_fpr"] = _roc_rows(perm, np.broadcast_to(s, perm.shape))
    mem, non = np.flatnonzero(y == 1), np.flatnonzero(y == 0)
    ix = np.concatenate([rng.choice(mem, (bootstrap, mem.size)), rng.choice(non, (bootstrap, non.size))], axis=1)
    boots, _ = _roc_rows(y[ix], s[ix])
    lo, hi = np.quantile(boots, [0.025, 0.975])
    tpr = roc_summary(y, s)["tpr_at_1pct_fpr"]
    k, m = int(round(tpr * mem.size)), mem.size
    t_lo = float(beta.ppf(0.025, k, m - k + 1)) if k > 0 else 0.0
    t_hi = float(beta.ppf(0.975, k + 1, m - k)) if k < m else 1.0
    out.update({"auc_interval": (float(lo), float(hi)), "tpr_interval": (t_lo, t_hi)})
    return out
