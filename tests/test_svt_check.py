"""The DP check of NVFlare's SVTPrivacy with per-coordinate canaries (gradleak.run.svt_check,
gradleak.evaluation.sign_canaries): the bound by hand, its null (never-inserted canaries prove nothing in at least
99 % of draws), the real filter read against its own accountant (a correct filter within its claim, the filter with
its release noise removed ``claim_violated``), and the audit declaring a check for it."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gradleak.evaluation.sign_canaries import agreement_bound, judge_agreement, log_half_tail


def test_log_half_tail_by_hand():
    assert log_half_tail(3, 2) == pytest.approx(math.log(4 / 8))
    assert log_half_tail(3, 3) == pytest.approx(math.log(1 / 8))
    assert log_half_tail(3, 0) == 0.0 and log_half_tail(3, 4) == -math.inf
    assert log_half_tail(50_000, 50_000) == pytest.approx(-50_000 * math.log(2.0))  # far below float range


def test_agreement_bound_by_hand():
    # one canary, 10 of 10 signs agree, alpha = 0.5: L = 10 log 2, bound L - log(1 / 0.5)
    b = agreement_bound([10], [10], 0.5)
    assert b["epsilon"] == pytest.approx(10 * math.log(2) - math.log(2))
    assert b["ceiling"] == pytest.approx(b["epsilon"]) and b["agreement"] == 1.0
    # two canaries, 9 of 10 and 5 of 10: L = -log(11 / 1024); bound L - log(2 / 0.1)
    b = agreement_bound([10, 10], [9, 5], 0.1)
    assert b["epsilon"] == pytest.approx(-math.log(11 / 1024) - math.log(20))
    with pytest.raises(ValueError, match="its support"):
        agreement_bound([10], [11], 0.1)


def test_the_null_proves_nothing():
    """Signs independent of the release (a never-inserted canary): the 99 % bound is 0 in at least 99 % of draws."""
    rng = np.random.default_rng(0)
    over = 0
    for _ in range(400):
        n = rng.integers(500, 2000, 50)
        over += agreement_bound(n, rng.binomial(n, 0.5), 0.01)["epsilon"] > 0
    assert over <= 4 + 3 * math.sqrt(4)


def test_valid_on_randomized_response():
    """Each of d signs released through ε_c-randomized response: the vector is (d ε_c)-DP; the bound stays below it
    in at least 99 % of draws, and reads well above 0 (it sees the leak)."""
    rng = np.random.default_rng(1)
    d, eps_c = 400, 0.05
    keep = math.exp(eps_c) / (1 + math.exp(eps_c))
    bounds = [agreement_bound(np.full(50, d), rng.binomial(d, keep, 50), 0.01)["epsilon"] for _ in range(300)]
    assert sum(b > d * eps_c for b in bounds) <= 3
    rr = [agreement_bound(np.full(50, d), rng.binomial(d, math.exp(2) / (1 + math.exp(2)), 50), 0.01)["epsilon"]
          for _ in range(50)]
    assert min(rr) > 50 and max(rr) <= 2 * d


def test_judge_reads_testability():
    v, s, m = judge_agreement([1000] * 20, [1000] * 20, [500] * 20, 100.0, 0.01, vacuous_above=10)
    assert v == "claim_violated" and m["epsilon"] > 100
    v, s, m = judge_agreement([1000] * 20, [520] * 20, [500] * 20, 5000.0, 0.01, vacuous_above=10)
    assert v == "vacuous" and "not testable at this size" in s and not m["testable"]
    v, s, m = judge_agreement([1000] * 20, [520] * 20, [500] * 20, 5.0, 0.01, vacuous_above=10)
    assert v == "consistent" and "testable at this size" in s and m["null_epsilon"] == 0


def _svt(noise_var: float):
    pytest.importorskip("nvflare")
    from gradleak.defenses import build_defenses

    return build_defenses([{"name": "nvflare_svt", "params": {"noise_var": noise_var}}], seed=0)[0]


def _cfg():
    return SimpleNamespace(seed=0, fl=SimpleNamespace(lr_at=lambda r: 0.05, algorithm="fedsgd", engine="gradleak",
                                                      clients=1))


SHAPES = [("a", torch.Size([100, 150])), ("b", torch.Size([5000]))]  # 20,000 coordinates, two tensors


def test_real_filter_within_its_claim():
    from gradleak.run.svt_check import svt_dp_check

    res = svt_dp_check(_cfg(), None, _svt(0.5), canaries=20, first_id=1, shapes=SHAPES)
    m = res["measured"][0]
    # NVFlare's accountant: epsilon + n_upload x noise_var = 0.1 + 2000 x 0.5 per call
    assert res["claimed_epsilon"] == pytest.approx(0.1 + 2000 * 0.5)
    assert res["verdict"] == "vacuous" and m["testable"] and 0 < m["epsilon"] < res["claimed_epsilon"]
    assert m["null_epsilon"] == 0 and 0.45 < m["null_agreement"] < 0.55 and m["agreement"] > 0.55


def test_real_filter_without_release_noise_is_violated(monkeypatch):
    from gradleak.defenses.nvflare import NVFlareSVT
    from gradleak.run.svt_check import svt_dp_check

    real = NVFlareSVT.apply

    def apply(self, update, ctx):  # the release noise forgotten: each released entry is its clipped input
        out = real(self, update, ctx)
        bound = self.cfg.gamma / float(ctx["lr"])
        return out.map(lambda k, v: v.where(v == 0, update.tensors[k].clamp(-bound, bound).to(v)))

    monkeypatch.setattr(NVFlareSVT, "apply", apply)
    res = svt_dp_check(_cfg(), None, _svt(0.5), canaries=20, first_id=1, shapes=SHAPES)
    m = res["measured"][0]
    assert res["verdict"] == "claim_violated" and m["agreement"] == 1.0 and m["epsilon"] > res["claimed_epsilon"]
    assert m["null_epsilon"] == 0


def test_the_audit_declares_a_check_for_svt():
    pytest.importorskip("nvflare")
    from conftest import bench_module

    from gradleak.run.dp_check import declares_dp
    from gradleak.run.runner import validate

    d = bench_module("dp_check")
    _, cfg = validate(d.cell_config(d.MECHANISMS[d.SVT][0], 0))
    assert declares_dp(cfg)
    _, cfg = validate(d.cell_config([], 0))
    assert not declares_dp(cfg)
