"""The DP check's claim tests: DP bugs that look like real ones -- a fraction of the uploads left
un-noised, noise at too small a scale -- are ``claim_violated`` on simulated canary statistics, and a correct
mechanism is called violated in at most 1 % of simulated checks. The statistics are drawn exactly in distribution
(:func:`gradleak.evaluation.empirical_epsilon.simulated_statistics`) at the text audit's size: 445,636 trainable
coordinates, 100 canaries inserted and 100 never inserted, one round, z = 1, clip C, δ = 1e-5, the accountant's
(RDP) claim. Nothing here tunes a threshold: every test runs at the family-wise α = 0.01 the check uses."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gradleak.accounting import gaussian_rdp_epsilon
from gradleak.evaluation import empirical_epsilon
from gradleak.evaluation.empirical_epsilon import (ALPHA, CLAIM_TESTS, claim_tests, claimed_mu,
                                                   gaussian_mechanism_epsilon, simulated_statistics, sphere_tail,
                                                   sphere_threshold)

DIM, K, DELTA = 445_636, 100, 1e-5
CLAIM = gaussian_rdp_epsilon(1.0, 1, DELTA)  # 4.73: what dp_gaussian (z = 1, one round) claims


def simulated_check(seed: int, *, central: bool = False, **breakage) -> tuple[str, list[dict]]:
    return empirical_epsilon.simulated_check(seed, central=central, canaries=K, dim=DIM, delta=DELTA, **breakage)


def fit_alone_violates(measured: list[dict]) -> bool:
    """The verdict before the claim tests: the fit's 99.9 % lower end above the claim."""
    return any(m["strict_lower"] > m["claimed_epsilon"] for m in measured)


# ------------------------------------------------------------------------------------------------ the exact null
def test_the_sphere_null_is_the_cosine_of_a_random_direction():
    """A never-inserted canary's cosine with a fixed vector: its tail is sphere_tail (Monte Carlo, d = 40, 200k
    directions), its variance 1/d, and sphere_threshold inverts the tail."""
    rng = np.random.default_rng(0)
    d = 40
    v = rng.standard_normal((200_000, d))
    cos = v[:, 0] / np.linalg.norm(v, axis=1)
    assert np.var(cos) == pytest.approx(1 / d, rel=0.02)
    for tau in (0.1, 0.3, 0.5):
        p = sphere_tail(tau, d)
        assert np.mean(cos > tau) == pytest.approx(p, abs=4 * math.sqrt(p / len(cos)))  # 4 Monte Carlo errors
    for q in (1e-3, 1e-8, 1e-40):
        assert sphere_tail(sphere_threshold(math.log(q), DIM), DIM) == pytest.approx(q, rel=1e-6)
    assert sphere_threshold(-1e4, DIM) == 1.0  # below float range: nothing can exceed it


def test_the_claims_mu_inverts_the_gaussian_mechanisms_epsilon():
    for mu in (0.3, 1.0, 2.5):
        assert claimed_mu(gaussian_mechanism_epsilon(mu, DELTA), DELTA) == pytest.approx(mu, rel=1e-6)
    assert claimed_mu(CLAIM, DELTA) > 1.0  # the RDP claim is looser than the exact ε of μ = 1/z = 1
    assert claimed_mu(None, DELTA) == math.inf and claimed_mu(math.inf, DELTA) == math.inf


def test_the_simulated_statistics_are_the_gaussian_mechanisms():
    """√d · seen ~ N(1/z, 1) and √d · unseen ~ N(0, 1) on each upload; the fit recovers the exact ε of μ = 1/z."""
    rng = np.random.default_rng(3)
    s, u = simulated_statistics(rng, 20_000, DIM, 1.0)
    assert np.mean(s) * math.sqrt(DIM) == pytest.approx(1.0, abs=0.03)
    assert np.std(s) * math.sqrt(DIM) == pytest.approx(1.0, abs=0.02)
    assert np.mean(u) * math.sqrt(DIM) == pytest.approx(0.0, abs=0.03)
    assert np.std(u) * math.sqrt(DIM) == pytest.approx(1.0, abs=0.02)


# ------------------------------------------------------------------------------------------------ breakages
@pytest.mark.parametrize("unnoised", [2, 5, 10], ids=["2%", "5%", "10%"])
def test_uploads_left_unnoised_are_claim_violated(unnoised):
    """k of n canary uploads clipped but not noised (2 %, 5 %, 10 %): every one of 20 seeded checks reads
    claim_violated, by the tail and spread tests, while the fit alone (the verdict before these tests) sees none --
    the mixture lowers its ε (the issue's 1.88 at 10 %)."""
    verdicts, fit_alone = [], []
    for seed in range(20):
        v, measured = simulated_check(seed, unnoised=unnoised)
        verdicts.append(v)
        fit_alone.append(fit_alone_violates(measured))
        each = next(m for m in measured if m["threat_model"] == "each_upload")
        assert each["tests"]["tail"]["rejects"] and each["tests"]["spread"]["rejects"]
        assert each["tests"]["tail"]["statistic"] == unnoised  # exactly the un-noised ones lie beyond the claim's τ
    assert verdicts.count("claim_violated") == 20
    assert sum(fit_alone) <= 1


@pytest.mark.parametrize("scale, least", [(1.5, 0.8), (2.0, 1.0)], ids=["1.5x", "2x"])
def test_noise_at_too_small_a_scale_is_claim_violated(scale, least):
    """Noise 1.5× / 2× too small on every upload (μ = 1.5 / 2 against the claim's μ = 1.07): the shift test flags
    at least 80 % / all of 40 seeded checks (the expected power at k = 100 and α = 0.01 / 6: 0.9 and 1.0)."""
    hits = [simulated_check(seed, noise_scale=scale)[0] == "claim_violated" for seed in range(40)]
    assert np.mean(hits) >= least


@pytest.mark.parametrize("central", [False, True], ids=["client", "server"])
def test_a_correct_mechanism_is_rarely_called_violated(central):
    """200 simulated checks of a correct DP-Gaussian (z = 1): at most 1 % read claim_violated (family-wise α = 0.01
    by construction; the count here is seeded)."""
    alarms = sum(simulated_check(10_000 + seed, central=central)[0] == "claim_violated" for seed in range(200))
    assert alarms <= 2


def test_the_family_splits_alpha_over_distinct_statistics():
    """After one round every_round's statistics are final_model's: one member of the family, not two."""
    _, measured = simulated_check(0)
    alphas = {m["threat_model"]: m["tests"]["tail"]["alpha"] for m in measured}
    # the final model (= every round): 3 cosine tests + the per-tensor variance (one vector: no per-tensor tail);
    # each upload: 3 + the per-tensor variance and tail
    assert alphas == {t: pytest.approx(ALPHA / (4 + 5)) for t in alphas}
    assert len(CLAIM_TESTS) == 5
    _, measured = simulated_check(0, central=True)
    assert measured[0]["tests"]["shift"]["alpha"] == pytest.approx(ALPHA / 4)


def test_the_tests_across_rounds_use_the_two_sample_nulls():
    """A largest cosine over rounds has no closed-form null: the shift and spread tests read the never-inserted
    canaries (two-sample); the tail test takes a union over the rounds (a higher τ)."""
    rng = np.random.default_rng(1)
    s, u = simulated_statistics(rng, K, DIM, 1.0)
    one = claim_tests(s, u, CLAIM, DELTA, dim=DIM, maxima=1)
    five = claim_tests(s, u, CLAIM, DELTA, dim=DIM, maxima=5)
    assert "two-sample" in five["shift"]["null"] and "two-sample" in five["spread"]["null"]
    assert five["tail"]["threshold_cosine"] > one["tail"]["threshold_cosine"]
    assert not any(one[t]["rejects"] or five[t]["rejects"] for t in ("shift", "spread", "tail"))
    s[:10] = 1.0
    assert all(claim_tests(s, u, CLAIM, DELTA, dim=DIM, maxima=5)[t]["rejects"] for t in ("spread", "tail"))


def test_without_a_finite_claim_only_the_spread_is_tested():
    rng = np.random.default_rng(2)
    s, u = simulated_statistics(rng, K, DIM, 1.0, unnoised=10)
    t = claim_tests(s, u, None, DELTA, dim=DIM)
    assert not t["shift"]["rejects"] and not t["tail"]["rejects"] and t["spread"]["rejects"]


def test_the_threshold_bounds_ceiling_says_what_this_canary_count_cannot_test():
    """With 100 + 100 canaries the distribution-free threshold bound reads at most 3.95 (perfect separation): the
    RDP claim 4.73 of z = 1 lies above it, and a consistent verdict says so; more canaries raise the ceiling."""
    from gradleak.evaluation.empirical_epsilon import bound_ceiling, threshold_lower_bound

    ceiling = bound_ceiling(K, K, DELTA)
    assert ceiling == pytest.approx(3.945, abs=1e-3) and ceiling < CLAIM < bound_ceiling(1000, 1000, DELTA)
    rng = np.random.default_rng(5)
    s, u = simulated_statistics(rng, K, DIM, 0.05)  # far beyond any claim: perfectly separated
    assert threshold_lower_bound(s, u, DELTA) == pytest.approx(ceiling)
    verdict, measured = simulated_check(11)
    assert verdict == "consistent" and all(m["lower_bound"] <= m["lower_bound_ceiling"] == ceiling for m in measured)
    seen, _ = simulated_statistics(np.random.default_rng(11), K, DIM, 1.0)
    _, unseen = simulated_statistics(np.random.default_rng(12), K, DIM, 1.0)
    verdict, sentence, _ = empirical_epsilon.judge(
        {"each_upload": {"seen": seen, "unseen": unseen, "claimed_epsilon": CLAIM}}, CLAIM, DELTA, dim=DIM)
    assert verdict == "consistent" and "not testable at this size" in sentence
