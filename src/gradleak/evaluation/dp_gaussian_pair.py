"""The privacy of telling two Gaussians apart: δ(ε) and ε(δ) of the pair (Andrew et al., "One-shot Empirical Privacy
Estimation for Federated Learning", ICLR 2024, Sec. 3: the estimate is this ε of the two fitted Gaussians), and the
exact ε of a μ-GDP mechanism. The part of the DP check's measurement every other part builds on
(:mod:`gradleak.evaluation.empirical_epsilon`; docs/DESIGN.md §6)."""

from __future__ import annotations

import math

import numpy as np
from scipy.special import log_ndtr

#: ε beyond which two fitted Gaussians count as perfectly separable (reported as infinite)
EPSILON_CAP = 1e3


def _log_mass(lo: float, hi: float, mu: float, s: float) -> float:
    """log P(lo < X < hi) for X ~ N(mu, s²), stable in the tails."""
    a, b = (lo - mu) / s, (hi - mu) / s
    if b <= 0:  # both in the lower tail: Φ(b) − Φ(a)
        la, lb = log_ndtr(a), log_ndtr(b)
        return lb + math.log1p(-math.exp(la - lb)) if la < lb else -math.inf
    if a >= 0:  # both in the upper tail: Φ(−a) − Φ(−b)
        la, lb = log_ndtr(-b), log_ndtr(-a)
        return lb + math.log1p(-math.exp(la - lb)) if la < lb else -math.inf
    return math.log(max(1.0 - math.exp(log_ndtr(a)) - math.exp(log_ndtr(-b)), 1e-300))


def _region(mu_p: float, s_p: float, mu_q: float, s_q: float, eps: float) -> list[tuple[float, float]]:
    """The intervals where log p(x) − log q(x) > eps, p = N(mu_p, s_p²), q = N(mu_q, s_q²): a quadratic in x."""
    a = 0.5 / (s_q * s_q) - 0.5 / (s_p * s_p)
    b = mu_p / (s_p * s_p) - mu_q / (s_q * s_q)
    c = 0.5 * (mu_q / s_q) ** 2 - 0.5 * (mu_p / s_p) ** 2 + math.log(s_q / s_p) - eps
    inf = math.inf
    if abs(a) * max(s_p, s_q) ** 2 < 1e-12:  # equal spreads: a half-line
        if b == 0:
            return [(-inf, inf)] if c > 0 else []
        t = -c / b
        return [(t, inf)] if b > 0 else [(-inf, t)]
    disc = b * b - 4 * a * c
    if disc <= 0:
        return [(-inf, inf)] if a > 0 else []
    r = math.sqrt(disc)
    x1, x2 = sorted(((-b - r) / (2 * a), (-b + r) / (2 * a)))
    return [(-inf, x1), (x2, inf)] if a > 0 else [(x1, x2)]


def _log_hockey_stick(mu_p: float, s_p: float, mu_q: float, s_q: float, eps: float) -> float:
    """log of E_q[(p/q − e^eps)_+] = P(S) − e^eps Q(S), S = {log p/q > eps}: the δ at which p vs q is (eps, δ)-DP."""
    parts = _region(mu_p, s_p, mu_q, s_q, eps)
    if not parts:
        return -math.inf
    lp = np.logaddexp.reduce([_log_mass(lo, hi, mu_p, s_p) for lo, hi in parts])
    lq = np.logaddexp.reduce([_log_mass(lo, hi, mu_q, s_q) for lo, hi in parts])
    if not math.isfinite(lp):
        return -math.inf
    f = eps + lq - lp
    return -math.inf if f >= 0 else float(lp + math.log1p(-math.exp(f)))


def delta_two_gaussians(mu0: float, s0: float, mu1: float, s1: float, eps: float) -> float:
    """δ(ε) of telling N(mu0, s0²) from N(mu1, s1²), the larger of the two directions."""
    return math.exp(max(_log_hockey_stick(mu0, s0, mu1, s1, eps), _log_hockey_stick(mu1, s1, mu0, s0, eps)))


def epsilon_two_gaussians(mu0: float, s0: float, mu1: float, s1: float, delta: float) -> float:
    """The smallest ε ≥ 0 with δ(ε) ≤ ``delta`` for the pair N(mu0, s0²), N(mu1, s1²) (paper Sec. 3: the estimate);
    ``inf`` when they are separable beyond :data:`EPSILON_CAP` (e.g. a zero spread: nothing random in the statistic)."""
    if not (s0 > 0 and s1 > 0):
        return 0.0 if (mu0 == mu1 and s0 == s1) else math.inf
    ld = math.log(delta)

    def over(e):
        return max(_log_hockey_stick(mu0, s0, mu1, s1, e), _log_hockey_stick(mu1, s1, mu0, s0, e)) > ld

    if not over(0.0):
        return 0.0
    lo, hi = 0.0, 1.0
    while over(hi):
        if hi >= EPSILON_CAP:
            return math.inf
        lo, hi = hi, min(hi * 4, EPSILON_CAP)
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if over(mid) else (lo, mid)
        if hi - lo < 1e-6 * max(hi, 1.0):
            break
    return hi


def gaussian_mechanism_epsilon(mu: float, delta: float) -> float:
    """The exact ε of a μ-GDP mechanism (one Gaussian mechanism with sensitivity / noise std = μ, or R of them
    composed with μ = √R / z) at ``delta``: :func:`epsilon_two_gaussians` of N(0, 1) and N(μ, 1)."""
    return epsilon_two_gaussians(0.0, 1.0, float(mu), 1.0, delta)

