"""Stochastic quantisation's rounding noise, read off each observed tensor (gradleak.defenses.update
StochasticQuantization.observed_noise_variance): step = (max - min) / (2^bits - 1) of the observed tensor, variance
step² / 6 per coordinate; the declared-defense model and the exact attacks pass the tensor they test."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from gradleak.defenses.declared import as_declared, view_noise_std
from gradleak.defenses.update import GaussianNoise, StochasticQuantization
from gradleak.fl.core import Update

QUANT = {"name": "stochastic_quantization", "params": {"bits": 4}}


def _clean(seed: int = 0, n: int = 200_000) -> Update:
    g = torch.Generator().manual_seed(seed)
    return Update({"w": torch.randn(n, generator=g, dtype=torch.float64),
                   "b": 10.0 * torch.randn(n // 4, generator=g, dtype=torch.float64)}, 2, 0, "gradient", 1)


def _quantised(bits: int, seed: int = 0) -> tuple[Update, Update]:
    clean = _clean(seed)
    return clean, StochasticQuantization(bits, seed=3).apply(clean, {"client_id": 0, "seed": seed})


def _view(observed: Update, clients: int = 1, secure: bool = False, entries=(QUANT,)):
    return SimpleNamespace(public={"update_defenses": list(entries), "clients": clients}, updates=[observed],
                           secure_aggregation=secure)


@pytest.mark.parametrize("bits", [8, 6, 4])
def test_the_variance_read_off_a_quantised_tensor_is_step_squared_over_six_and_matches_the_rounding(bits):
    clean, q = _quantised(bits)
    levels = 2 ** bits - 1
    for name in ("w", "b"):
        t = clean.tensors[name]
        step = float(t.max() - t.min()) / levels
        var = StochasticQuantization(bits).observed_noise_variance(q, tensor=name)
        assert var == pytest.approx(step * step / 6, rel=1e-12)  # min and max are kept: the step is exact
        err = q.tensors[name] - t
        assert abs(float(err.mean())) < 0.01 * step  # unbiased
        assert float(err.pow(2).mean()) == pytest.approx(var, rel=0.03)  # the empirical rounding noise
    # each tensor has its own step: "b" is 10x wider
    ratio = StochasticQuantization(bits).observed_noise_variance(q, tensor="b") / \
        StochasticQuantization(bits).observed_noise_variance(q, tensor="w")
    assert 50 < ratio < 200


def test_quantisation_noise_is_none_without_a_tensor_or_under_a_sum():
    _, q = _quantised(4)
    sq = StochasticQuantization(4)
    assert sq.observed_noise_variance(q) is None  # tensor=None: the step differs per tensor
    assert sq.observed_noise_variance(q, aggregate_of=3, individual=False) is None
    assert sq.observed_noise_variance(q, aggregate_of=3, individual=False, tensor="w") is None  # steps not readable
    assert sq.observed_noise_variance(q, tensor="missing") is None
    assert sq.observed_noise_variance(q, aggregate_of=1, individual=False, tensor="w") == \
        sq.observed_noise_variance(q, tensor="w")  # secure aggregation over one client: its own upload
    const = Update({"c": torch.full((5,), 0.5, dtype=torch.float64)}, 1)
    assert sq.observed_noise_variance(const, tensor="c") == 0.0
    # a defense whose noise is the same on every tensor ignores the name
    assert GaussianNoise(0.3).observed_noise_variance(q, tensor="w") == pytest.approx(0.09)


def test_view_noise_std_of_a_tensor_under_quantisation():
    clean, q = _quantised(4)
    step_w = float(clean.tensors["w"].max() - clean.tensors["w"].min()) / 15
    step_b = float(clean.tensors["b"].max() - clean.tensors["b"].min()) / 15
    view = _view(q)
    assert view_noise_std(view) is None
    assert view_noise_std(view, tensor="w") == pytest.approx(math.sqrt(step_w ** 2 / 6), rel=1e-12)
    nw, nb = q.tensors["w"].numel(), q.tensors["b"].numel()
    pooled = math.sqrt((nw * step_w ** 2 + nb * step_b ** 2) / 6 / (nw + nb))
    assert view_noise_std(view, tensor=["w", "b"]) == pytest.approx(pooled, rel=1e-12)  # a concatenation's noise
    # with a Gaussian noise beside it, the variances add
    both = _view(q, entries=(QUANT, {"name": "gaussian_noise", "params": {"std": 0.1}}))
    assert view_noise_std(both) == pytest.approx(0.1)
    assert view_noise_std(both, tensor="w") == pytest.approx(math.sqrt(step_w ** 2 / 6 + 0.01), rel=1e-12)
    # secure aggregation over 2 clients: the steps cannot be read off the sum
    assert view_noise_std(_view(q, clients=2, secure=True), tensor="w") is None


def test_the_declared_model_says_quantisation_noise_is_known_per_tensor():
    d = as_declared([QUANT])
    assert d.noise_per_tensor and d.adds_noise and not d.noise_unknown and d.quant_bits == 4
    assert d.as_dict()["noise_per_tensor"] is True
    summed = as_declared([QUANT])
    summed.secure_aggregation, summed.clients = True, 2
    assert summed.noise_unknown and summed.adds_noise  # the sum hides each client's step
    gauss = as_declared([{"name": "gaussian_noise", "params": {"std": 0.1}}])
    assert not gauss.noise_per_tensor and not gauss.noise_unknown


def test_the_exact_attacks_read_the_noise_of_the_tensor_they_test():
    from gradleak.attacks.common.text import declared_noise_std
    from gradleak.attacks.projres import ProjRes
    from gradleak.attacks.utr.attack import UTRAttack

    clean, q = _quantised(4)
    view = _view(q)
    view.public["upload_rounding_std"] = 0.0
    expect = view_noise_std(view, tensor="w")
    assert UTRAttack().noise_std(view, [], "w") == pytest.approx(expect)
    assert UTRAttack().noise_std(view, []) is None
    assert declared_noise_std(view, "public", [], tensor="b") == pytest.approx(view_noise_std(view, tensor="b"))
    # the audit runs the declared (public) level under quantisation, not only the one read off the spectrum
    variants = ProjRes.audit_variants({}, as_declared([QUANT]))
    assert {v["noise"] for v in variants} == {"public", "estimate"}
    assert {"noise": "public"} in UTRAttack.audit_variants({"noise": "none"}, as_declared([QUANT]))
    assert [v["noise"] for v in UTRAttack.audit_variants({}, as_declared([QUANT]))] == ["estimate"]
