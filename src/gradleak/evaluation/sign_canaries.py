"""A rigorous ε lower bound for a pure-DP local randomizer from per-coordinate (sign) canaries: the statistics behind
the DP check of NVFlare's SVTPrivacy filter (:mod:`gradleak.run.svt_check`, docs/DESIGN.md §6).

A per-coordinate canary is a vector of independent uniform signs s ∈ {−1, +1}^d scaled beyond the mechanism's
per-coordinate bound, so the bound clips it to ±bound on every coordinate: the largest change SVTPrivacy's
accounting allows on each coordinate (its queries' sensitivity is the per-coordinate clip γ, docs/DESIGN.md §7). The
mechanism releases an upload U; the statistic is the canary's *agreement*: on the n coordinates U releases (its
support, U_i ≠ 0), how many have the canary's sign.

The null is exact for any mechanism: a never-inserted canary's signs are independent of U and uniform, so its
agreement is Binomial(n, ½) given n. If the mechanism is ε-DP (pure, δ = 0, as NVFlare's SVT accountant claims) for
any two inputs within the bound, then for every event E of the output, P[E | canary s inserted] ≤ e^ε P[E | another
input] ≤ e^ε P[Binomial(n, ½) ≥ a] for E = {agreement with s ≥ a} (averaging the other input over independent
signs). With L = −log P[Binomial(n, ½) ≥ agreement] (the log-evidence of one inserted canary), P[L ≥ ε + t] ≤ e^−t,
so over k canaries P[max L ≥ ε + log(k / α)] ≤ α: **ε ≥ max_j L_j − log(k / α)** at confidence 1 − α
(:func:`agreement_bound`), a distribution-free bound with no Gaussian model. Its ceiling (every released sign agrees)
is n · log 2 − log(k / α): a claim above it is not testable at this size.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def log_half_tail(n: int, a: int) -> float:
    """log P[Binomial(``n``, ½) ≥ ``a``], exact in log space (no underflow: n log 2 can be tens of thousands)."""
    from scipy.special import gammaln, logsumexp

    n, a = int(n), int(a)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if a <= 0:
        return 0.0
    if a > n:
        return -math.inf
    k = np.arange(a, n + 1, dtype=float)
    return float(logsumexp(gammaln(n + 1) - gammaln(k + 1) - gammaln(n - k + 1)) - n * math.log(2.0))


def agreement_bound(support: Sequence[int], agree: Sequence[int], alpha: float) -> dict:
    """The pure-DP ε lower bound at confidence 1 − ``alpha`` from k canaries, canary j with ``agree[j]`` of its
    ``support[j]`` released coordinates agreeing in sign (module docstring): ``epsilon`` = max(0, max_j L_j −
    log(k / α)), L_j = −:func:`log_half_tail`; ``ceiling`` = max_j n_j log 2 − log(k / α) (every sign agreeing);
    ``evidence`` the largest L_j; ``agreement`` the mean share of agreeing coordinates."""
    n, a = np.asarray(support, int), np.asarray(agree, int)
    if len(n) != len(a) or len(n) == 0:
        raise ValueError(f"support and agree must be non-empty and of one length, got {len(n)} and {len(a)}")
    if np.any(a < 0) or np.any(a > n):
        raise ValueError("each agreement must lie in [0, its support]")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    k = len(n)
    evidence = max(-log_half_tail(int(nj), int(aj)) for nj, aj in zip(n, a))
    cost = math.log(k / alpha)
    with np.errstate(invalid="ignore", divide="ignore"):
        share = float(np.mean(np.where(n > 0, a / np.maximum(n, 1), 0.5)))
    return {"epsilon": max(0.0, evidence - cost), "evidence": evidence, "ceiling": max(0.0, float(n.max()) * math.log(2.0) - cost),
            "agreement": share, "support": [int(n.min()), int(n.max())], "confidence": 1 - alpha, "canaries": k}


def judge_agreement(support: Sequence[int], agree: Sequence[int], agree_unseen: Sequence[int], claimed: float,
                    alpha: float, *, vacuous_above: float) -> tuple[str, str, dict]:
    """The verdict of a pure-DP ``claimed`` ε from sign canaries: ``claim_violated`` when :func:`agreement_bound` of
    the inserted canaries exceeds it; else ``vacuous`` when the claim is above ``vacuous_above``, else ``consistent``;
    the sentence says whether the claim was testable at this size (below the bound's ceiling). The never-inserted
    canaries' bound (``null_epsilon``, on the same uploads) stands beside it: a correct null reads 0."""
    seen = agreement_bound(support, agree, alpha)
    null = agreement_bound(support, agree_unseen, alpha)
    m = {"threat_model": "each_upload", "kind": "per_coordinate", "epsilon": seen["epsilon"],
         "ceiling": seen["ceiling"], "evidence": seen["evidence"], "agreement": seen["agreement"],
         "null_epsilon": null["epsilon"], "null_agreement": null["agreement"], "support": seen["support"],
         "confidence": seen["confidence"], "claimed_epsilon": claimed, "testable": bool(claimed < seen["ceiling"])}
    from gradleak.evaluation.empirical_epsilon import fmt_epsilon

    measured = (f"the per-coordinate canaries prove ε ≥ {fmt_epsilon(seen['epsilon'])} per upload at "
                f"{100 * seen['confidence']:g} % ({100 * seen['agreement']:.1f} % of released signs agree; never-inserted "
                f"canaries {100 * null['agreement']:.1f} %, bound {fmt_epsilon(null['epsilon'])}), at most "
                f"{fmt_epsilon(seen['ceiling'])} with {seen['canaries']} canaries and this support")
    if seen["epsilon"] > claimed:
        m["verdict"] = "claim_violated"
        return "claim_violated", (f"{measured}: above the claimed ε = {fmt_epsilon(claimed)}: the implementation does "
                                  "not do what its accountant assumes"), m
    testable = ("testable at this size" if m["testable"] else
                "not testable at this size (the claim is above what these canaries could prove)")
    if not math.isfinite(claimed) or claimed > vacuous_above:
        m["verdict"] = "vacuous"
        return "vacuous", (f"the claimed ε = {fmt_epsilon(claimed)} is above {vacuous_above:g}: no meaningful "
                           f"guarantee; {measured}, within the claim, which is {testable}"), m
    m["verdict"] = "consistent"
    return "consistent", f"{measured}, within the claimed ε = {fmt_epsilon(claimed)}, which is {testable}", m
