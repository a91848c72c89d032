"""The one-run ε lower bound (Steinke, Nasr & Jagielski, NeurIPS 2023; gradleak.evaluation.empirical_epsilon
.one_run_bound): values by hand on tiny cases, validity (a correct mechanism's bound stays below its true ε in at
least 95 % of seeded draws, in both designs the check uses, on mechanisms where the bound could exceed it), and a
mechanism without noise reading the bound's ceiling."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gradleak.evaluation.empirical_epsilon import (gaussian_mechanism_epsilon, judge, one_run_bound,
                                                   one_run_ceiling, one_run_epsilon, one_run_p_value,
                                                   simulated_check, simulated_statistics)

DELTA = 1e-5
DIM = 445_636


def test_p_value_by_hand():
    # pure DP: P[Binomial(r, q) >= v], q = e^eps / (1 + e^eps); 3 of 4 right at eps = log 3 (q = 3/4):
    # 4 (3/4)^3 (1/4) + (3/4)^4 = 27/64 + 81/256 = 189/256
    assert one_run_p_value(10, 4, 3, math.log(3.0), 0.0) == pytest.approx(189 / 256, rel=1e-12)
    # with delta (Thm. 5.2): m = r = v = 2, eps = 0: tail 1/4; max_i P[2 - i <= Bin(2, 1/2) < 2] / i
    # = max(1/2, (1/2 + 1/4) / 2) = 1/2; p = 1/4 + 2 m delta / 2 = 0.25 + 0.02 at delta = 0.01
    assert one_run_p_value(2, 2, 2, 0.0, 0.01) == pytest.approx(0.27, rel=1e-12)
    assert one_run_p_value(5, 3, 0, 2.0, 0.0) == 1.0
    with pytest.raises(ValueError, match="v <= r <= m"):
        one_run_p_value(3, 4, 2, 1.0, 0.0)


def test_epsilon_by_hand():
    # every one of 10 guesses right, delta = 0, level 0.05: q^10 = 0.05, eps = log(q / (1 - q)) = 1.0519
    q = 0.05 ** 0.1
    assert one_run_epsilon(10, 10, 10, 0.0, 0.05) == pytest.approx(math.log(q / (1 - q)), abs=1e-5)
    assert one_run_epsilon(10, 10, 10, 0.0, 0.05) == pytest.approx(1.05187, abs=1e-4)
    # half right proves nothing
    assert one_run_epsilon(100, 40, 20, 0.0, 0.05) == 0.0
    # pairs: the swap is (2 eps, (1 + e^eps) delta)-DP, so the bound is half the unpaired one at delta = 0
    assert one_run_epsilon(10, 10, 10, 0.0, 0.05, pairs=True) == pytest.approx(0.5 * math.log(q / (1 - q)), abs=1e-5)


def test_ceiling_by_hand():
    # 20 + 20 canaries, all guessed right (r = 40): the level is alpha x P[Bin(40, 1/2) = 20] / 3 guess counts;
    # q^40 = level
    level = 0.05 * math.comb(40, 20) / 2 ** 40 / 3
    q = level ** (1 / 40)
    assert one_run_ceiling(20, 20, 0.0) == pytest.approx(math.log(q / (1 - q)), abs=1e-5)
    assert one_run_ceiling(20, 20, 0.0) == pytest.approx(1.7909, abs=1e-3)
    assert one_run_bound(np.ones(20), np.zeros(20), 0.0)["epsilon"] == pytest.approx(one_run_ceiling(20, 20, 0.0))
    # 3 + 3 canaries cannot prove anything: q^6 = 0.05 x (20 / 64) / 3 needs q < 1/2
    assert one_run_ceiling(3, 3, 0.0) == 0.0


def test_no_noise_reads_the_ceiling():
    """No noise: every guess right, in both designs (each upload: paired; the final model: pooled)."""
    verdict, measured = simulated_check(0, noise_scale=1e9)
    assert verdict == "claim_violated"
    for m in measured:
        assert m["one_run_bound"] == pytest.approx(m["one_run_ceiling"]) and m["one_run_bound"] > 1.5
        assert m["one_run"]["correct"] == m["one_run"]["guesses"] == m["one_run"]["canaries"]
    assert {m["threat_model"]: round(m["one_run_ceiling"], 2) for m in measured} == \
        {"final_model": 3.27, "every_round": 3.27, "each_upload": 1.57}


def test_ties_go_against_the_guesser():
    # all statistics equal: no guess counts as right, nothing is proven
    assert one_run_bound(np.zeros(50), np.zeros(50), DELTA)["epsilon"] == 0.0
    assert one_run_bound(np.zeros(50), np.zeros(50), DELTA, paired=True)["epsilon"] == 0.0


@pytest.mark.parametrize("paired", [False, True])
def test_valid_on_a_correct_gaussian_mechanism(paired):
    """DP-Gaussian z = 2 (exact ε 1.99 at δ = 1e-5), 1000 canaries at the text audit's size, 200 seeded draws: the 95 %
    bound exceeds the exact ε in at most 5 % (it is a lower bound); with 1000 canaries its ceiling is above the
    exact ε, so an invalid bound could exceed it."""
    exact = gaussian_mechanism_epsilon(0.5, DELTA)
    k, over, bounds = 1000, 0, []
    assert one_run_ceiling(k, k, DELTA, 0.05, paired) > exact
    for seed in range(200):
        rng = np.random.default_rng(10_000 + seed)
        if paired:  # each upload under local noise
            s, u = simulated_statistics(rng, k, DIM, 2.0)
        else:  # the aggregate of the k canaries' noised uploads
            s, u = simulated_statistics(rng, k, DIM, 2.0, aggregate_of=k + 1, central=True)
        b = one_run_bound(s, u, DELTA, paired=paired)["epsilon"]
        bounds.append(b)
        over += b > exact
    assert over <= 10
    assert max(bounds) > 0  # it does read something (not a bound that is always 0)


def _randomized_response(rng, eps, n):
    """ε-DP randomized response of each inclusion bit: the statistic is the bit, flipped with prob 1 / (1 + e^ε)."""
    return (rng.random(n) < 1.0 / (1.0 + math.exp(eps)))


def test_tight_on_randomized_response():
    """Randomized response is exactly ε-DP and the worst case of the theorem: with independent inclusion the 95 %
    bound (one_run_epsilon) exceeds the true ε in at most about 5 % of draws, and in some (the bound is tight there);
    with the check's fixed count (exactly half inserted) one_run_bound stays valid."""
    eps, m, draws = 1.0, 200, 400
    over_indep = over_fixed = 0
    for seed in range(draws):
        rng = np.random.default_rng(seed)
        incl = rng.random(m) < 0.5
        guess = incl ^ _randomized_response(rng, eps, m)
        over_indep += one_run_epsilon(m, m, int(np.sum(guess == incl)), 0.0, 0.05) > eps
        fixed = np.zeros(m, bool)
        fixed[rng.permutation(m)[: m // 2]] = True
        stat = (fixed ^ _randomized_response(rng, eps, m)).astype(float) + 1e-9 * rng.random(m)
        over_fixed += one_run_bound(stat[fixed], stat[~fixed], 0.0)["epsilon"] > eps
    assert 0 < over_indep <= 0.05 * draws + 3 * math.sqrt(0.05 * 0.95 * draws)
    assert over_fixed <= 0.05 * draws


def test_the_fixed_count_correction_is_needed():
    """Without the conditioning on the inserted count a perfectly mixing (ε = 0) mechanism with a fixed count could
    look like a leak: exactly 1 of 2 inserted, both guessed: both right with probability 1/2, not 1/4. The bound
    with its correction proves nothing there."""
    assert one_run_bound([1.0], [0.0], 0.0)["epsilon"] == 0.0


def test_in_the_check_and_its_sentence():
    verdict, sentence, measured = judge(
        {"final_model": {"seen": np.random.default_rng(0).normal(0, 1e-3, 100),
                         "unseen": np.random.default_rng(1).normal(0, 1e-3, 100), "claimed_epsilon": 4.73}},
        4.73, DELTA, dim=DIM)
    assert verdict == "consistent"
    assert "one-run bound (Steinke et al. 2023, 95 %) proves ε ≥ 0 (final model), at most 3.27" in sentence
    assert "not testable at this size" in sentence
    assert measured[0]["one_run"]["design"].startswith("inserted vs never-inserted")
