"""The distribution-free ε lower bounds of the DP check, each with its ceiling (docs/DESIGN.md §6):

* the threshold bound (Jagielski et al. 2020, Jeffreys intervals; :func:`threshold_lower_bound`,
  :func:`bound_ceiling`), which Andrew et al. (ICLR 2024, Sec. 3) report beside their estimate;
* the rigorous one-run bound (Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run", NeurIPS 2023,
  Thm. 3.1 / 5.2; :func:`one_run_bound`, :func:`one_run_ceiling`).

Part of :mod:`gradleak.evaluation.empirical_epsilon`."""

from __future__ import annotations

import functools
import math
from typing import Sequence

import numpy as np

from gradleak.evaluation.dp_gaussian_pair import EPSILON_CAP


def _jeffreys_high(k: np.ndarray, n: int, alpha: float) -> np.ndarray:
    """One-sided upper Jeffreys bound on a binomial rate (k of n), confidence 1 − alpha."""
    from scipy.special import betaincinv  # the Beta(k + ½, n − k + ½) quantile, without scipy.stats' import

    return np.where(k >= n, 1.0, betaincinv(k + 0.5, n - k + 0.5, 1 - alpha))


def threshold_lower_bound(seen: Sequence[float], unseen: Sequence[float], delta: float, alpha: float = 0.05) -> float:
    """The threshold test's ε lower bound at confidence 1 − ``alpha`` (Jagielski et al. 2020, Jeffreys intervals):
    for every threshold t, a canary is called present when its statistic ≥ t; with FPR and FNR at their upper
    confidence bounds, ε ≥ max(log((1 − δ − FNR) / FPR), log((1 − δ − FPR) / FNR)); the best threshold's bound."""
    s, u = np.sort(np.asarray(seen, float)), np.sort(np.asarray(unseen, float))
    t = np.concatenate([s, u])
    fp = len(u) - np.searchsorted(u, t, side="left")  # unseen ≥ t
    fn = np.searchsorted(s, t, side="left")  # seen < t
    fpr, fnr = _jeffreys_high(fp, len(u), alpha), _jeffreys_high(fn, len(s), alpha)
    with np.errstate(divide="ignore", invalid="ignore"):
        b1 = np.where((1 - delta - fnr > 0) & (fpr > 0), np.log(np.clip(1 - delta - fnr, 1e-300, None)) - np.log(fpr), -np.inf)
        b2 = np.where((1 - delta - fpr > 0) & (fnr > 0), np.log(np.clip(1 - delta - fpr, 1e-300, None)) - np.log(fnr), -np.inf)
    return float(max(0.0, np.max(b1), np.max(b2)))


@functools.lru_cache(maxsize=64)
def bound_ceiling(seen: int, unseen: int, delta: float, alpha: float = 0.05) -> float:
    """The largest ε :func:`threshold_lower_bound` can certify with ``seen`` and ``unseen`` canaries at confidence
    1 − ``alpha``: its value on perfectly separated statistics (100 + 100 canaries: 3.95 at δ = 1e-5). A claim above
    it cannot be refuted by the distribution-free bound at this canary count ("not testable at this size"); the fit
    and the claim tests, which use the Gaussian model and the exact null of a never-inserted canary, still can."""
    return threshold_lower_bound(np.ones(int(seen)), np.zeros(int(unseen)), delta, alpha)


# ------------------------------------------------------------------------------------- the one-run bound (rigorous)
#: the guess counts the one-run bound tries, as fractions of the canaries (or pairs) it may guess on; each is a
#: separate test of the same null, so the level is split evenly over them (Bonferroni): fixed before looking
ONE_RUN_GUESSES = (0.1, 0.3, 1.0)


def _log_binom_pmf(k: np.ndarray, n: int, log_q: float, log_1mq: float) -> np.ndarray:
    from scipy.special import gammaln

    k = np.asarray(k, float)
    with np.errstate(invalid="ignore"):
        out = gammaln(n + 1) - gammaln(k + 1) - gammaln(n - k + 1) + np.where(k > 0, k * log_q, 0.0) \
            + np.where(n - k > 0, (n - k) * log_1mq, 0.0)
    return out


def one_run_p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """The p-value of ``v`` correct guesses out of ``r`` (the rest abstentions) on ``m`` canaries, each included
    independently with probability ½, under the null "the mechanism is (``eps``, ``delta``)-DP" (Steinke, Nasr &
    Jagielski, "Privacy Auditing with One (1) Training Run", NeurIPS 2023, Thm. 3.1 for δ = 0, Thm. 5.2 for δ > 0):
    the correct guesses are then dominated by Binomial(r, q), q = e^ε / (1 + e^ε) (ε-DP randomized response's
    accuracy), up to δ's share, so p = P[Binomial(r, q) ≥ v] + 2mδ · max_{1 ≤ i ≤ v} P[v − i ≤ Binomial(r, q) < v] / i
    (capped at 1)."""
    from scipy.special import bdtrc, log_expit

    m, r, v = int(m), int(r), int(v)
    if not 0 <= v <= r <= m:
        raise ValueError(f"one_run_p_value needs 0 <= v <= r <= m, got v={v}, r={r}, m={m}")
    if not (eps >= 0 and 0 <= delta <= 1):
        raise ValueError(f"one_run_p_value needs eps >= 0 and delta in [0, 1], got eps={eps}, delta={delta}")
    if v == 0:
        return 1.0
    log_q, log_1mq = float(log_expit(eps)), float(log_expit(-eps))
    tail = float(bdtrc(v - 1, r, math.exp(log_q)))  # P[Binomial(r, q) >= v]
    if delta == 0:
        return min(tail, 1.0)
    i = np.arange(1, v + 1)
    below = np.cumsum(np.exp(_log_binom_pmf(v - i, r, log_q, log_1mq)))  # P[v - i <= Binomial(r, q) < v]
    return min(tail + 2.0 * m * delta * float(np.max(below / i)), 1.0)


def one_run_epsilon(m: int, r: int, v: int, delta: float, level: float, *, pairs: bool = False) -> float:
    """The largest ε whose null :func:`one_run_p_value` rejects at ``level`` (the lower bound at confidence
    1 − ``level``; 0 when even ε = 0 is not rejected). ``pairs``: the guesses are on pairs whose members are swapped
    (:func:`one_run_bound`'s paired design): swapping is two add/remove steps, so the null for the add/remove ε is
    (2ε, (1 + e^ε) δ)-DP of the swap (group privacy, k = 2)."""

    def p(e):
        return one_run_p_value(m, r, v, 2 * e, min(1.0, (1 + math.exp(e)) * delta)) if pairs else \
            one_run_p_value(m, r, v, e, delta)

    if p(0.0) > level:
        return 0.0
    lo, hi = 0.0, 1.0
    while p(hi) <= level:
        if hi >= EPSILON_CAP:
            return math.inf
        lo, hi = hi, min(4 * hi, EPSILON_CAP)
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if p(mid) <= level else (lo, mid)
        if hi - lo < 1e-6 * max(hi, 1.0):
            break
    return lo  # the side the test rejects: never above what the guesses prove


def _balanced_share(n_seen: int, n_unseen: int) -> float:
    """P[Binomial(n_seen + n_unseen, ½) = n_seen]: the chance that independent fair inclusion puts exactly the
    inserted count in."""
    from scipy.special import gammaln

    m = n_seen + n_unseen
    return math.exp(gammaln(m + 1) - gammaln(n_seen + 1) - gammaln(n_unseen + 1) - m * math.log(2.0))


def one_run_bound(seen: Sequence[float], unseen: Sequence[float], delta: float, alpha: float = 0.05, *,
                  paired: bool = False) -> dict:
    """A rigorous ε lower bound at confidence 1 − ``alpha`` from one run (Steinke, Nasr & Jagielski, NeurIPS 2023,
    Alg. 1 with Thm. 3.1 / 5.2: :func:`one_run_p_value`), on the check's existing in / out structure: the ``seen``
    canaries were inserted, the ``unseen`` never, and every canary's direction is an independent draw of the same
    law (:func:`gradleak.fl.canaries.direction`), so which of them are inserted is, in law, a random choice the
    guesser does not see. Two designs (both read every canary's statistic only through the released output):

    * ``paired`` = False (a statistic every canary reads off the same release: ``final_model``, ``every_round``):
      the guesser ranks all n_s + n_u statistics, guesses "inserted" for the top r·n_s/(n_s + n_u) and "not
      inserted" for the bottom rest of r, abstains otherwise (ties broken against the guesser). The paper's theorem
      wants each canary included independently with probability ½; here exactly n_s of the m = n_s + n_u are, which
      is independent inclusion *conditioned* on that count, so P[≥ v correct] ≤ p / P[Binomial(m, ½) = n_s]
      (:func:`_balanced_share`; 0.056 at 100 + 100): the test runs at level ``alpha`` × that share.
    * ``paired`` = True (``each_upload``: canary j's statistic reads upload j, inserted canary j's or, for
      never-inserted canary j, the same upload): slot j holds two independent directions of which one was inserted,
      in law by a fair coin per slot, independent across slots -- the paper's independent inclusion, on pairs. The
      guess per slot: the member with the larger statistic was inserted (a tie counts as wrong), on the r slots with
      the largest difference. Swapping a slot's member is two add/remove steps, so the bound is on ε of the
      add/remove claim through group privacy (:func:`one_run_epsilon`).

    Guess counts r: :data:`ONE_RUN_GUESSES` of the canaries (pairs), fixed before looking, ``alpha`` split over them
    (Bonferroni); the largest bound is reported. ``ceiling``: the most the bound can read with these counts (every
    guess right at the largest r): a claim above it is not testable by this bound at this size. Returns ``epsilon``,
    ``ceiling``, ``guesses`` and ``correct`` (of the r that gave it), ``confidence``, ``design``."""
    s, u = np.asarray(seen, float), np.asarray(unseen, float)
    ns, nu = len(s), len(u)
    if ns < 1 or nu < 1:
        raise ValueError("the one-run bound needs at least one seen and one unseen canary")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if paired:
        if ns != nu:
            raise ValueError(f"the paired one-run bound needs as many seen as unseen canaries, got {ns} and {nu}")
        m = ns
        level = alpha / len(ONE_RUN_GUESSES)
        diff = s - u
        order = np.argsort(-np.abs(diff), kind="stable")
        right = diff[order] > 0  # a tie guesses neither member right
    else:
        m = ns + nu
        level = alpha * _balanced_share(ns, nu) / len(ONE_RUN_GUESSES)
        x = np.concatenate([s, u])
        is_seen = np.concatenate([np.ones(ns, bool), np.zeros(nu, bool)])
        # ascending by statistic; among ties a seen canary sorts below an unseen one (against the guesser both ways)
        order = np.lexsort((is_seen.astype(int) * -1, x))
        ranked = is_seen[order]
    best = {"epsilon": 0.0, "guesses": 0, "correct": 0}
    for frac in ONE_RUN_GUESSES:
        r = max(1, min(m, int(round(frac * m))))
        if paired:
            v = int(np.sum(right[:r]))
        else:
            top = int(round(r * ns / m))
            top = min(max(top, 0), r)
            bottom = r - top
            v = int(np.sum(ranked[m - top:])) + int(np.sum(~ranked[:bottom]))
        e = one_run_epsilon(m, r, v, delta, level, pairs=paired)
        if e > best["epsilon"] or best["guesses"] == 0:
            best = {"epsilon": e, "guesses": r, "correct": v}
    return {**best, "ceiling": one_run_ceiling(ns, nu, delta, alpha, paired), "confidence": 1 - alpha,
            "design": "pairs (each slot: the inserted canary and a never-inserted one)" if paired else
            "inserted vs never-inserted, ranked together (fixed count: level × P[Binomial(m, ½) = inserted])",
            "canaries": m}


@functools.lru_cache(maxsize=64)
def one_run_ceiling(seen: int, unseen: int, delta: float, alpha: float = 0.05, paired: bool = False) -> float:
    """The largest ε :func:`one_run_bound` can certify with ``seen`` and ``unseen`` canaries: its value when every
    guess is right (perfectly separated statistics)."""
    m = int(seen) if paired else int(seen) + int(unseen)
    level = alpha / len(ONE_RUN_GUESSES) * (1.0 if paired else _balanced_share(int(seen), int(unseen)))
    return one_run_epsilon(m, m, m, delta, level, pairs=paired)
