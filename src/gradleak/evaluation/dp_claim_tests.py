"""The claim tests of the DP check (ours; docs/DESIGN.md §6): the inserted canaries' statistics tested against what
the claimed (ε, δ) allows -- ``shift``, ``spread``, ``tail`` (:func:`claim_tests`, using the exact null of a
never-inserted canary's cosine, :func:`sphere_tail`) -- and each tensor's noise (:func:`tensor_tests`), which see the
partial, scale and per-tensor breakages the one-shot fit (Andrew et al., ICLR 2024, Sec. 3) averages away. Part of
:mod:`gradleak.evaluation.empirical_epsilon`."""

from __future__ import annotations

import functools
import math
from typing import Sequence

import numpy as np

from gradleak.evaluation.dp_gaussian_pair import gaussian_mechanism_epsilon


#: family-wise false-alarm rate of the claim tests over one check: every test of every distinct threat model, Bonferroni
ALPHA = 0.01
#: the tests run on each threat model's statistics: :func:`claim_tests` (the canary statistic) and
#: :func:`tensor_tests` (each tensor's noise, where the statistics carry a ``tensors`` summary)
CLAIM_TESTS = ("shift", "spread", "tail", "tensor_variance", "tensor_tail")


@functools.lru_cache(maxsize=256)
def claimed_mu(claimed: float | None, delta: float) -> float:
    """The μ of the Gaussian mechanism whose exact ε at ``delta`` is ``claimed`` (the inverse of
    :func:`gaussian_mechanism_epsilon`): the largest separation of the canary statistics, in units of their spread,
    that the claim allows in the Gaussian-mechanism model. ``inf`` for no claim or an infinite one."""
    if claimed is None or not math.isfinite(claimed):
        return math.inf
    if claimed <= 0:
        return 0.0
    lo, hi = 0.0, 1.0
    while gaussian_mechanism_epsilon(hi, delta) < claimed:
        if hi > 1e4:
            return math.inf
        lo, hi = hi, hi * 2
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if gaussian_mechanism_epsilon(mid, delta) < claimed else (lo, mid)
        if hi - lo < 1e-9 * hi:
            break
    return lo  # the side the claim allows: a test against it is never stricter than the claim


def sphere_tail(tau: float, dim: int) -> float:
    """P(cos(v, w) > ``tau``) for v uniform on the unit sphere of R^dim and any w independent of v: (1 + cos) / 2 is
    Beta((dim − 1)/2, (dim − 1)/2), so the tail is the regularised incomplete beta I_{(1 − τ)/2}. Exact: the null
    distribution of a never-inserted canary's cosine (its direction is drawn independently of everything released)."""
    from scipy.special import betainc

    a = 0.5 * (dim - 1)
    return float(betainc(a, a, min(max(0.5 * (1.0 - tau), 0.0), 1.0)))


def sphere_threshold(log_q: float, dim: int) -> float:
    """The τ with :func:`sphere_tail` (τ, ``dim``) = exp(``log_q``); 1.0 (no cosine exceeds it) below float range."""
    from scipy.special import betaincinv

    if log_q < -700:
        return 1.0
    a = 0.5 * (dim - 1)
    return float(1.0 - 2.0 * betaincinv(a, a, math.exp(min(log_q, math.log(0.5)))))


def claim_tests(seen: Sequence[float], unseen: Sequence[float], claimed: float | None, delta: float, *, dim: int,
                maxima: int = 1, alpha: float = ALPHA / 3) -> dict:
    """Three tests of the canary statistics against what the claimed (ε, δ) allows, each at level ``alpha`` (the
    caller splits the family-wise :data:`ALPHA` over every test of every distinct threat model, Bonferroni). The
    one-shot fit (:func:`estimate`) reads one Gaussian per side with one common spread; a mechanism that leaks on a
    fraction of its uploads makes the seen statistics a *mixture* (a few at cosine ≈ 1 among many near 0), whose
    common-spread fit *lowers* ε, and noise at the wrong scale moves the mean by less than the fit's 99.9 % bootstrap
    end can see. These tests look at what the fit averages away (docs/DESIGN.md §6):

    * ``shift`` (noise at the wrong scale): H0 μ ≤ μ_claim, μ_claim = :func:`claimed_mu` (the claim read as a
      Gaussian mechanism, the model of the fit; Andrew et al. Sec. 3, Thm. 3.2). When the statistic is one cosine
      (``maxima`` = 1) the never-inserted canaries' distribution is known exactly, mean 0 and spread 1/√dim
      (:func:`sphere_tail`), so the seen canaries are tested alone: T = (mean(√dim · seen) − μ_claim) / (sd / √k),
      Student's t with k − 1 degrees of freedom at the boundary (a seen spread below 1/√dim, which a correct mechanism
      has, only makes the pair more separable, so the test stays on the claim's side). For a largest cosine over
      several rounds the null is not known in closed form: the pooled two-sample t against the noncentral t with
      2k − 2 degrees of freedom and noncentrality μ_claim / √(1/k_seen + 1/k_unseen).
    * ``spread`` (a mixture): a Gaussian mechanism only shifts the canary's statistic -- the noise projected on its
      direction, over the upload's norm, has the spread of a never-inserted canary's cosine or less (cos = (C + X) /
      ((C + X)² + Y²)^½ with X the noise along the canary, Y across it: its derivative in X is at most 1/Y). H1: the
      seen statistics spread more. One cosine: (k − 1) · var(√dim · seen) against χ²(k − 1); a largest cosine over
      rounds: var(seen) / var(unseen) against F(k − 1, k − 1).
    * ``tail`` (uploads that escape the noise, distribution-free given the exact null): (ε, δ)-DP bounds the chance
      that a present canary's statistic exceeds any τ by e^ε · P(an absent canary's exceeds τ) + δ (the unseen
      canaries stand for the absent ones, Andrew et al. Sec. 3), and P(an absent one exceeds τ) ≤ ``maxima`` ·
      :func:`sphere_tail` (τ) (a union over the rounds a largest cosine is taken over). τ is fixed before looking:
      e^ε · maxima · sphere_tail(τ) = δ, so each seen canary exceeds it with probability ≤ 2δ under the claim; the
      count N above τ against Binomial(k, 2δ), exact binomial tail (the canaries' statistics read as independent
      draws, as the one-shot estimate reads them; exact for each upload under local noise, whose draws are
      independent).

    Each entry: ``statistic``, ``p_value``, ``alpha``, ``rejects`` and, where one exists, ``threshold`` (the statistic
    a rejection needs)."""
    from scipy.special import bdtrc, chdtrc, fdtrc, nctdtr, stdtr, stdtrit

    s, u = np.asarray(seen, float), np.asarray(unseen, float)
    k, ku = len(s), len(u)
    mu_c = claimed_mu(claimed, delta)
    root = math.sqrt(dim)
    out: dict[str, dict] = {}
    var_s = float(np.var(s, ddof=1))
    # shift
    if not math.isfinite(mu_c):
        out["shift"] = {"statistic": None, "p_value": 1.0, "note": "no finite claim to test against"}
    elif maxima == 1:
        x = s * root
        sd = math.sqrt(var_s) * root
        gap = float(np.mean(x)) - mu_c
        if sd > 0:
            t = gap / (sd / math.sqrt(k))
            out["shift"] = {"statistic": t, "p_value": float(stdtr(k - 1, -t)),
                            "threshold": float(stdtrit(k - 1, 1 - alpha)), "null": "exact: mean 0, spread 1/√dim",
                            "mu_claim": mu_c, "mu_seen": float(np.mean(x))}
        else:
            out["shift"] = {"statistic": math.copysign(math.inf, gap), "p_value": 0.0 if gap > 0 else 1.0,
                            "mu_claim": mu_c, "mu_seen": float(np.mean(x))}
    else:
        sp = math.sqrt(0.5 * (var_s + float(np.var(u, ddof=1)))) if k + ku > 2 else 0.0
        w = math.sqrt(1.0 / k + 1.0 / ku)
        gap = float(np.mean(s) - np.mean(u))
        t = gap / (sp * w) if sp > 0 else math.copysign(math.inf, gap)
        p = float(1.0 - nctdtr(k + ku - 2, mu_c / w, t)) if math.isfinite(t) else (0.0 if t > 0 else 1.0)
        out["shift"] = {"statistic": t, "p_value": min(max(p, 0.0), 1.0), "null": "two-sample (largest cosine over "
                        "rounds)", "mu_claim": mu_c, "mu_seen": gap / sp if sp > 0 else math.inf}
    # spread
    if maxima == 1:
        q = (k - 1) * var_s * dim
        out["spread"] = {"statistic": q / (k - 1), "p_value": float(chdtrc(k - 1, q)),
                         "null": "exact: spread 1/√dim (variance ratio against χ²(k − 1) / (k − 1))"}
    else:
        var_u = float(np.var(u, ddof=1))
        f = var_s / var_u if var_u > 0 else (math.inf if var_s > 0 else 1.0)
        out["spread"] = {"statistic": f, "p_value": float(fdtrc(k - 1, ku - 1, f)) if math.isfinite(f) else 0.0,
                         "null": "two-sample F (largest cosine over rounds)"}
    # tail
    if claimed is None or not math.isfinite(claimed):
        out["tail"] = {"statistic": None, "p_value": 1.0, "note": "no finite claim to test against"}
    else:
        tau = sphere_threshold(math.log(delta) - claimed - math.log(max(maxima, 1)), dim)
        n = int(np.sum(s > tau))
        p_tau = min(1.0, 2 * delta)
        out["tail"] = {"statistic": n, "threshold_cosine": tau, "p_value": float(bdtrc(n - 1, k, p_tau)) if n else 1.0,
                       "chance_each": p_tau,
                       "threshold": next(m for m in range(1, k + 2) if m > k or bdtrc(m - 1, k, p_tau) <= alpha)}
    for v in out.values():
        v["alpha"] = alpha
        v["rejects"] = bool(v["p_value"] <= alpha)
    return out


def tensor_ratios(energy: np.ndarray, df: np.ndarray, bound: float | np.ndarray = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Each tensor's noise energy per degree of freedom over the rest's, for one released vector or many (``energy``:
    (..., T) the energy each tensor holds beyond the canary signal, ``df`` (T,) its degrees of freedom). The claimed
    mechanism adds N(0, σ²) to every coordinate of every trainable tensor (Gaussian mechanism; the same σ on every
    tensor), so with nothing else in the vector the ratio of tensor t is F(df_t, Σ df − df_t) whatever σ is: the test
    needs no unit of the upload. ``bound``: an upper bound on the norm of the signal left in the vector (the real
    clients' clipped updates in an aggregate), taken off the rest's norm, ``(√rest − bound)₊²`` -- a lower bound of the
    rest's noise energy, so a signal can only raise the ratio (a conservative test); a signal inside tensor t raises
    it too (a noncentral χ² is stochastically larger). Returns (ratio, the rest's energy after the bound) with the
    shape of ``energy``; a ratio with no rest energy reads ∞ (1 when tensor t holds none either: nothing to compare)."""
    e = np.asarray(energy, float)
    df = np.asarray(df, float)
    rest = np.maximum(e.sum(axis=-1, keepdims=True) - e, 0.0)
    b = np.asarray(bound, float)
    if b.ndim:
        b = b[..., None]
    rest = np.maximum(np.sqrt(rest) - b, 0.0) ** 2
    rest_df = df.sum() - df
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = (e / np.where(df > 0, df, 1.0)) / (rest / np.where(rest_df > 0, rest_df, 1.0))
    ratio = np.where(rest > 0, ratio, np.where(e > 0, np.inf, 1.0))
    return ratio, rest


def tensor_test_names(tensors: dict | None) -> list[str]:
    """The per-tensor tests :func:`tensor_tests` runs on the summary ``tensors``: none without one or with fewer than
    two testable tensors; ``tensor_tail`` only over several vectors (over one it is ``tensor_variance``)."""
    if not tensors:
        return []
    df = np.asarray(tensors["df"], float)
    if int(np.sum((df > 0) & (df.sum() - df > 0))) < 2:
        return []
    return ["tensor_variance"] + (["tensor_tail"] if int(tensors["vectors"]) > 1 else [])


def tensor_tests(tensors: dict | None, *, alpha: float) -> dict:
    """Each tensor's noise against the claim (docs/DESIGN.md §6): the claimed Gaussian mechanism noises every
    coordinate of every trainable tensor with one σ, so each tensor's noise energy per degree of freedom over the
    rest's (:func:`tensor_ratios`) is F-distributed whatever σ is. An isotropic canary puts only a tensor's share of
    its norm in that tensor, so its cosine barely moves when one tensor is left un-noised; the tensor's own energy
    does (to the float rounding of the clipped upload). ``tensors``: the summary over ``vectors`` independent released
    vectors (:class:`gradleak.run.canary_statistics.CanaryStatistics`, or drawn by :func:`simulated_tensor_statistics`) --
    ``names``, ``df`` (each tensor's degrees of freedom in one vector), ``pooled_ratio`` (each tensor's summed energy
    per degree of freedom over the rest's, over every vector: F(N df_t, N (Σ df − df_t)) under the claim) and
    ``min_ratio`` (its smallest ratio in one vector). H1 for both: the tensor holds less noise than the claim says.

    * ``tensor_variance``: P(F ≤ pooled ratio), the smallest over the tensors, times their number (Bonferroni);
    * ``tensor_tail`` (some vectors with a tensor un-noised, e.g. one upload in ten): P(the smallest of N independent
      F(df_t, Σ df − df_t) ≤ min ratio) = 1 − (1 − F_cdf)^N, the smallest over the tensors times their number.

    Each entry: ``statistic`` (the worst tensor's ratio), ``tensor`` (its name), ``p_value`` (Bonferroni over the
    tensors), ``alpha``, ``rejects``, ``tensors_tested``, ``null``."""
    from scipy.special import fdtr

    names = tensor_test_names(tensors)
    if not names:
        return {}
    df = np.asarray(tensors["df"], float)
    rest_df = df.sum() - df
    ok = (df > 0) & (rest_df > 0)
    n = int(tensors["vectors"])
    tested = int(ok.sum())
    out = {}
    for name in names:
        if name == "tensor_variance":
            x = np.asarray(tensors["pooled_ratio"], float)
            p = np.where(ok, fdtr(np.maximum(n * df, 1), np.maximum(n * rest_df, 1), np.minimum(x, 1e300)), 1.0)
            null = f"F(N·df_t, N·(Σdf − df_t)) of each tensor's pooled noise energy, N = {n} vectors"
        else:
            x = np.asarray(tensors["min_ratio"], float)
            c = fdtr(np.maximum(df, 1), np.maximum(rest_df, 1), np.minimum(x, 1e300))
            with np.errstate(divide="ignore"):  # F_cdf = 1: the tail's p-value is 1
                p = np.where(ok, -np.expm1(n * np.log1p(-np.minimum(c, 1.0))), 1.0)
            null = f"the smallest of N = {n} independent F(df_t, Σdf − df_t)"
        worst = int(np.argmin(np.where(ok, p, np.inf)))
        pv = float(min(1.0, tested * float(p[worst])))
        out[name] = {"statistic": float(x[worst]), "tensor": tensors["names"][worst], "p_value": pv,
                     "tensors_tested": tested, "null": null, "alpha": alpha, "rejects": bool(pv <= alpha)}
    return out

