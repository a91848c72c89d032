"""Every update defense does what it says, measured on seeded draws (gradleak.defenses.update).

Clipping holds its bound and leaves smaller updates untouched; Gaussian noise has the configured std (absolute,
relative to the norm, per coordinate, percentile-scaled); ``dp_gaussian`` adds N(0, (σC)²) on the client (local DP is
not just clipping) or clips on the client and noises only the aggregate (central DP); top-k keeps exactly k
coordinates; stochastic quantisation uses at most 2^bits levels per tensor and is unbiased.
"""

from __future__ import annotations

import math

import pytest
import torch

from gradleak.defenses import build_defenses
from gradleak.defenses.update import (
    Clipping,
    DPGaussian,
    GaussianNoise,
    PercentileNoise as GaussianPercentileNoise,
    StochasticQuantization,
    TopKPruning,
)
from gradleak.errors import BadInput
from gradleak.fl.core import Client, Update, aggregate
from gradleak.fl.engines.builtin import run_rounds

pytestmark = pytest.mark.timeout(300)

N = 200_000  # coordinates: the sample std of N(0, s²) is within ±1 % of s with ~5 sigma to spare (rel. sd 1/sqrt(2N))
TOL = 0.01


def _upd(seed: int = 0, scale: float = 1.0, n: int = 5, shapes=((5, 4), (7,))) -> Update:
    g = torch.Generator().manual_seed(seed)
    return Update({f"t{i}": scale * torch.randn(*s, generator=g, dtype=torch.float64) for i, s in enumerate(shapes)},
                  n, seed)


def _big(seed: int = 0, scale: float = 1e-3) -> Update:
    """Two tensors, N coordinates in all."""
    return _upd(seed, scale, shapes=((N // 2,), (N // 4, 2)))


def _noise(before: Update, after: Update) -> torch.Tensor:
    return after.flat().double() - before.flat().double()


# ------------------------------------------------------------------------------------------- clipping
@pytest.mark.parametrize("max_norm", [1e-3, 0.5, 3.0, 100.0])
def test_clipping_holds_the_bound_and_leaves_smaller_updates_untouched(max_norm):
    for seed in range(20):
        u = _upd(seed, scale=10 ** (seed % 5 - 2))  # norms from ~0.05 to ~500
        c = Clipping(max_norm).apply(u, {})
        assert c.norm() <= max_norm * (1 + 1e-12)
        if u.norm() <= max_norm:
            assert all(torch.equal(c.tensors[k], u.tensors[k]) for k in u.tensors)  # untouched below the bound
        else:
            assert c.norm() == pytest.approx(max_norm, rel=1e-12)  # scaled down to the bound, not further
            assert torch.allclose(c.flat() * (u.norm() / max_norm), u.flat(), rtol=1e-12, atol=0)
        assert (c.num_samples, c.client_id, c.kind) == (u.num_samples, u.client_id, u.kind)


def test_clipping_refuses_a_non_positive_bound():
    for bad in (0.0, -1.0):
        with pytest.raises(BadInput, match="max_norm"):
            Clipping(bad)


# ------------------------------------------------------------------------------------------- Gaussian noise
@pytest.mark.parametrize("std", [1e-4, 0.01, 1.0])
def test_absolute_gaussian_noise_has_the_configured_std(std):
    u = _big()
    n = _noise(u, GaussianNoise(std, seed=5).apply(u, {"client_id": 1, "seed": 2}))
    assert float(n.std()) == pytest.approx(std, rel=TOL)
    assert abs(float(n.mean())) < 5 * std / math.sqrt(N)
    for k, t in u.tensors.items():  # every tensor gets noise of the same std (not only the first)
        nk = GaussianNoise(std, seed=5).apply(u, {"client_id": 1, "seed": 2}).tensors[k] - t
        assert float(nk.std()) == pytest.approx(std, rel=3 * TOL)


def test_relative_and_per_coordinate_noise_scale_with_the_norm():
    u = _big(scale=3e-3)
    rel = _noise(u, GaussianNoise(0.05, relative=True, seed=1).apply(u, {}))
    assert float(rel.std()) == pytest.approx(0.05 * u.norm(), rel=TOL)
    pc = _noise(u, GaussianNoise(0.5, per_coordinate=True, seed=1).apply(u, {}))
    assert float(pc.std()) == pytest.approx(0.5 * u.norm() / math.sqrt(N), rel=TOL)
    # noise-to-signal ratio of the whole upload: E||n|| = s ||u||
    assert float(pc.norm()) == pytest.approx(0.5 * u.norm(), rel=TOL)
    assert torch.equal(GaussianNoise(0.0).apply(u, {}).flat(), u.flat())
    with pytest.raises(BadInput):
        GaussianNoise(0.1, relative=True, per_coordinate=True)
    with pytest.raises(BadInput):
        GaussianNoise(-0.1)


def test_noise_is_seeded_per_defense_client_and_round():
    u = _upd()
    draws = {(s, c, r): GaussianNoise(1.0, seed=s).apply(u, {"client_id": c, "seed": r}).flat()
             for s in (0, 1) for c in (0, 1) for r in (0, 1)}
    assert torch.equal(draws[(0, 0, 0)], GaussianNoise(1.0, seed=0).apply(u, {"client_id": 0, "seed": 0}).flat())
    keys = list(draws)
    for i in range(len(keys)):
        for j in range(i + 1, len(keys)):
            assert not torch.allclose(draws[keys[i]], draws[keys[j]]), (keys[i], keys[j])


# ------------------------------------------------------------------------------------------- percentile noise
def _pct(values: torch.Tensor, q: float) -> float:
    import numpy as np

    v = values.abs().reshape(-1).double().numpy()
    return float(np.percentile(v[v > 0], q))


def test_percentile_noise_std_is_sigma0_times_the_percentile_on_the_delta_w_scale():
    u = _big(scale=1e-2)
    lr = 0.1
    p95 = _pct(u.flat() * lr, 95)
    d = GaussianPercentileNoise(sigma0=2.0, seed=3)
    assert d.sigmas(u, {"lr": lr})["p:t0"] == pytest.approx(2.0 * p95, rel=1e-9)
    n = _noise(u, d.apply(u, {"lr": lr, "client_id": 0}))
    assert float(n.std()) == pytest.approx(2.0 * p95 / lr, rel=TOL)  # back on the upload's (Δw / lr) scale
    n50 = _noise(u, GaussianPercentileNoise(sigma0=1.0, percentile=50).apply(u, {}))
    assert float(n50.std()) == pytest.approx(_pct(u.flat(), 50), rel=TOL)


def test_percentile_noise_per_tensor_absolute_buffers_and_zero():
    g = torch.Generator().manual_seed(0)
    u = Update({"small": 1e-3 * torch.randn(N // 2, generator=g, dtype=torch.float64),
                "large": 1.0 * torch.randn(N // 2, generator=g, dtype=torch.float64)}, 4, 0,
               buffers={"bn.running_mean": 10.0 * torch.randn(N // 2, generator=g, dtype=torch.float64),
                        "bn.num_batches_tracked": torch.tensor(3.0, dtype=torch.float64)})
    pt = GaussianPercentileNoise(sigma0=1.0, per_tensor=True, include_buffers=False, seed=1).apply(u, {})
    for k in ("small", "large"):
        assert float((pt.tensors[k] - u.tensors[k]).std()) == pytest.approx(_pct(u.tensors[k], 95), rel=TOL)
    assert torch.equal(pt.buffers["bn.running_mean"], u.buffers["bn.running_mean"])  # buffers excluded
    glob = GaussianPercentileNoise(sigma0=1.0, include_buffers=True, seed=1).apply(u, {})
    everything = torch.cat([u.tensors["small"], u.tensors["large"], u.buffers["bn.running_mean"]])
    s = _pct(everything, 95)
    assert float((glob.tensors["small"] - u.tensors["small"]).std()) == pytest.approx(s, rel=TOL)
    assert float((glob.buffers["bn.running_mean"] - u.buffers["bn.running_mean"]).std()) == pytest.approx(s, rel=TOL)
    assert torch.equal(glob.buffers["bn.num_batches_tracked"], u.buffers["bn.num_batches_tracked"])  # a step counter
    ab = GaussianPercentileNoise(sigma0=0.02, absolute=True, seed=1).apply(u, {"lr": 0.5})
    assert float((ab.tensors["large"] - u.tensors["large"]).std()) == pytest.approx(0.02 / 0.5, rel=TOL)
    assert GaussianPercentileNoise(sigma0=0.0).apply(u, {}) is u
    with pytest.raises(BadInput):
        GaussianPercentileNoise(sigma0=-1.0)
    for bad in (0.0, 101.0):
        with pytest.raises(BadInput):
            GaussianPercentileNoise(sigma0=1.0, percentile=bad)


# ------------------------------------------------------------------------------------------- DP Gaussian mechanism
@pytest.mark.parametrize("nm,C", [(0.5, 1.0), (2.0, 0.1)])
def test_client_side_dp_gaussian_clips_then_adds_noise_of_std_sigma_c(nm, C):
    """Local DP is not just clipping: the mutation 'client-side dp_gaussian without its noise' fails here."""
    u = _big(scale=1.0)  # norm ~450: clipped to C
    d = DPGaussian(noise_multiplier=nm, max_norm=C, seed=7)
    assert not d.server_side
    out = d.apply(u, {"client_id": 3, "seed": 1})
    clipped = Clipping(C).apply(u, {})
    n = out.flat() - clipped.flat()
    assert float(n.std()) == pytest.approx(nm * C, rel=TOL)
    assert abs(float(n.mean())) < 5 * nm * C / math.sqrt(N)
    assert out.norm() == pytest.approx(math.sqrt(C ** 2 + N * (nm * C) ** 2), rel=TOL)
    small = _upd(scale=1e-4)  # below the bound: not scaled, still noised
    n_small = DPGaussian(noise_multiplier=nm, max_norm=C).apply(small, {}).flat() - small.flat()
    assert float(n_small.abs().max()) > 0
    assert torch.equal(DPGaussian(noise_multiplier=0.0, max_norm=C).apply(u, {}).flat(), clipped.flat())


def test_server_side_dp_gaussian_only_clips_the_upload_and_noises_the_aggregate():
    u = _big(scale=1.0)
    d = DPGaussian(noise_multiplier=2.0, max_norm=0.5, where="server", seed=4)
    assert d.server_side
    up = d.apply(u, {"client_id": 0})
    assert torch.equal(up.flat(), Clipping(0.5).apply(u, {}).flat())  # the upload itself carries no noise
    for K in (1, 4):
        agg = d.server_apply(up, {"seed": 3}, K)
        assert float((agg.flat() - up.flat()).std()) == pytest.approx(2.0 * 0.5 / K, rel=TOL)
    with pytest.raises(BadInput, match="where"):
        DPGaussian(1.0, where="both")
    with pytest.raises(BadInput, match="noise_multiplier"):
        DPGaussian(-1.0)


def test_client_side_dp_gaussian_through_the_rounds_noises_every_upload():
    """In the round protocol every client's upload is its clipped update plus N(0, (σC)²), fresh per client."""
    torch.manual_seed(0)
    model = torch.nn.Linear(400, 50)  # 20 050 coordinates
    clients = [Client(i, torch.randn(4, 400), torch.randint(0, 50, (4,))) for i in range(2)]
    dp = build_defenses([{"name": "dp_gaussian", "params": {"noise_multiplier": 1.5, "max_norm": 0.2}}], seed=1)
    out = run_rounds(model, clients, rounds=1, algorithm="fedsgd", lr=0.0, defenses=dp)
    raw = run_rounds(model, clients, rounds=1, algorithm="fedsgd", lr=0.0, defenses=[])
    noises = []
    for a, b in zip(out.rounds[0], raw.rounds[0]):
        n = a.flat().double() - Clipping(0.2).apply(b, {}).flat().double()
        assert float(n.std()) == pytest.approx(1.5 * 0.2, rel=0.03)
        noises.append(n)
    assert not torch.allclose(noises[0], noises[1])  # independent per client
    assert torch.allclose(out.last_aggregate.flat().double(), aggregate(out.rounds[0]).flat().double())


# ------------------------------------------------------------------------------------------- top-k
@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.5, 0.9, 0.99, 0.9999])
def test_topk_keeps_exactly_k_largest_coordinates(fraction):
    u = _upd(3, shapes=((60, 50), (123,)))  # 3123 coordinates
    P = 3123
    p = TopKPruning(fraction).apply(u, {})
    flat, orig = p.flat(), u.flat()
    k = max(1, int(round(P * (1 - fraction))))
    assert int((flat != 0).sum()) == k
    kept = flat != 0
    assert torch.equal(flat[kept], orig[kept])  # kept coordinates are unchanged
    if k < P:
        assert float(orig.abs()[~kept].max()) <= float(orig.abs()[kept].min())  # and they are the largest
    assert [t.shape for t in p.tensors.values()] == [t.shape for t in u.tensors.values()]
    for bad in (-0.1, 1.0):
        with pytest.raises(BadInput):
            TopKPruning(bad)


# ------------------------------------------------------------------------------------------- stochastic quantisation
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_stochastic_quantization_levels_range_and_unbiasedness(bits):
    u = _upd(1, shapes=((40, 10), (97,)))
    levels = 2 ** bits
    draws = [StochasticQuantization(bits, seed=s).apply(u, {"client_id": 0}) for s in range(300)]
    for k, t in u.tensors.items():
        stack = torch.stack([d.tensors[k] for d in draws])
        vals = torch.unique(stack)
        assert len(vals) <= levels
        grid = t.min() + torch.arange(levels, dtype=torch.float64) / (levels - 1) * (t.max() - t.min())
        assert all(bool(torch.isclose(v, grid).any()) for v in vals)  # every value on the 2^bits-level grid
        assert float(stack.min()) >= float(t.min()) - 1e-12 and float(stack.max()) <= float(t.max()) + 1e-12
        step = float(t.max() - t.min()) / (levels - 1)
        err = (stack.mean(0) - t).abs().max()  # unbiased: the mean of 300 draws is within ~4 sd of the value
        assert float(err) < 4 * 0.5 * step / math.sqrt(300) + 1e-12
        one = draws[0].tensors[k]
        assert float((one - t).abs().max()) <= step + 1e-12  # each draw rounds to a neighbouring level
    const = Update({"c": torch.full((10,), 0.3, dtype=torch.float64)}, 1)
    assert torch.equal(StochasticQuantization(bits).apply(const, {}).tensors["c"], const.tensors["c"])
    with pytest.raises(BadInput):
        StochasticQuantization(0)


def test_build_defenses_passes_the_run_seed_to_seeded_defenses():
    a = build_defenses([{"name": "gaussian_noise", "params": {"std": 1.0}}], seed=11)[0]
    b = build_defenses([{"name": "gaussian_noise", "params": {"std": 1.0, "seed": 2}}], seed=11)[0]
    c = build_defenses([{"name": "clipping", "params": {"max_norm": 1.0}}], seed=11)[0]
    assert a.seed == 11 and b.seed == 2 and c.max_norm == 1.0
