"""The mutation check (docs/MUTATION.md): the exact contracts of the update transforms, the view and the
aggregation, pinned where the statistical tests of test_guarantees_defenses cannot see a change:

* every transform keeps an upload's metadata (sample count, client, kind, local steps, BN buffers) and dtype;
* the noise is exactly the documented seeded draw (defense seed, client id, round), added, not subtracted;
* the percentile is numpy's (linear interpolation), over the non-zero entries;
* the secure-aggregation sum averages the BN buffer changes too, at the documented fixed-point precision.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradleak.defenses.update import (
    Clipping,
    DPGaussian,
    GaussianNoise,
    PercentileNoise as GaussianPercentileNoise,
    StochasticQuantization,
    TopKPruning,
    _percentile,
)
from gradleak.fl.core import Update, aggregate, secure_aggregate
from gradleak.fl.threat import ThreatModel, build_view

pytestmark = pytest.mark.timeout(120)


def _gen(seed: int, client: int, round_seed: int) -> torch.Generator:
    """The documented seeding: per defense seed, client id and round (ctx["seed"])."""
    return torch.Generator().manual_seed(seed * 1_000_003 + client * 7_919 + round_seed)


def _meta_update(dtype=torch.float32) -> Update:
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(4, 3, generator=g).to(dtype), "b": torch.randn(5, generator=g).to(dtype),
               "c": torch.randn(2, 2, generator=g).to(dtype)}
    buffers = {"bn.running_mean": torch.randn(3, generator=g, dtype=torch.float64),
               "bn.num_batches_tracked": torch.tensor(1.0, dtype=torch.float64)}
    return Update(tensors, 7, 5, "pseudo_gradient", 3, buffers)


TRANSFORMS = [
    ("clipping", lambda: Clipping(0.1)),
    ("gaussian_noise", lambda: GaussianNoise(0.1, seed=2)),
    ("gaussian_relative", lambda: GaussianNoise(0.1, relative=True, seed=2)),
    ("gaussian_per_coordinate", lambda: GaussianNoise(0.1, per_coordinate=True, seed=2)),
    ("percentile", lambda: GaussianPercentileNoise(2.0, include_buffers=False, seed=2)),
    ("percentile_buffers", lambda: GaussianPercentileNoise(2.0, seed=2)),
    ("dp_client", lambda: DPGaussian(1.0, max_norm=0.1, seed=2)),
    ("dp_server", lambda: DPGaussian(1.0, max_norm=0.1, where="server", seed=2)),
    ("topk", lambda: TopKPruning(0.5)),
    ("quantization", lambda: StochasticQuantization(2, seed=2)),
]


@pytest.mark.parametrize("name,make", TRANSFORMS, ids=[t[0] for t in TRANSFORMS])
def test_every_transform_keeps_the_metadata_and_the_dtype(name, make):
    u = _meta_update()
    out = make().apply(u, {"client_id": 5, "seed": 1, "lr": 0.5})
    assert (out.num_samples, out.client_id, out.kind, out.local_steps) == (7, 5, "pseudo_gradient", 3)
    assert out.buffers is not None and out.buffers.keys() == u.buffers.keys()
    if name != "percentile_buffers":  # only this one noises the buffers (tested below)
        assert all(torch.equal(out.buffers[k], u.buffers[k]) for k in u.buffers)
    assert out.tensors.keys() == u.tensors.keys()
    for k, t in u.tensors.items():
        assert out.tensors[k].dtype == t.dtype == torch.float32 and out.tensors[k].shape == t.shape


def test_update_map_flat_unflat_round_trip_keeps_everything():
    u = _meta_update(torch.float64)
    back = u.unflat(u.flat().to(torch.float32))
    assert (back.num_samples, back.client_id, back.kind, back.local_steps) == (7, 5, "pseudo_gradient", 3)
    assert back.buffers is u.buffers
    for k, t in u.tensors.items():  # three tensors: each from its own slice, in its own dtype
        assert back.tensors[k].dtype == torch.float64 and torch.allclose(back.tensors[k], t, atol=1e-6)
    assert u.norm() == pytest.approx(float(torch.sqrt((u.flat() ** 2).sum())), rel=1e-12)


def test_gaussian_noise_is_the_documented_seeded_draw_added_to_the_update():
    u = _meta_update()
    ctx = {"client_id": 5, "seed": 3}
    for d, scale in ((GaussianNoise(0.2, seed=4), 0.2), (GaussianNoise(0.2, relative=True, seed=4), 0.2 * u.norm())):
        out = d.apply(u, ctx)
        g = _gen(4, 5, 3)
        for k, t in u.tensors.items():
            want = t + scale * torch.randn(t.shape, generator=g, dtype=torch.float64).to(t)
            assert torch.equal(out.tensors[k], want), k
    one = Update({"w": torch.tensor([3.0], dtype=torch.float64)}, 1)  # one coordinate: std = s ||u|| / sqrt(1)
    out = GaussianNoise(0.5, per_coordinate=True, seed=1).apply(one, {})
    want = 3.0 + 0.5 * 3.0 * torch.randn(1, generator=_gen(1, 0, 0), dtype=torch.float64)
    assert torch.equal(out.tensors["w"], want)


def test_dp_gaussian_noise_is_the_documented_draw_on_the_client_and_on_the_aggregate():
    u = _meta_update(torch.float64)
    d = DPGaussian(2.0, max_norm=0.1, seed=9)
    clipped = Clipping(0.1).apply(u, {})
    out = d.apply(u, {"client_id": 5, "seed": 3})
    g = _gen(9, 5, 3)
    for k, t in clipped.tensors.items():
        assert torch.equal(out.tensors[k], t + 0.2 * torch.randn(t.shape, generator=g, dtype=torch.float64))
    central = DPGaussian(2.0, max_norm=0.1, where="server", seed=9)
    agg = central.server_apply(u, {"seed": 3}, 4)
    g = _gen(9, -1, 3)  # the server's draw: client id -1, the defense's own seed
    for k, t in u.tensors.items():
        assert torch.equal(agg.tensors[k], t + 0.05 * torch.randn(t.shape, generator=g, dtype=torch.float64))


def test_percentile_noise_is_the_documented_draw_and_an_all_zero_update_gets_none():
    u = _meta_update(torch.float64)
    d = GaussianPercentileNoise(2.0, include_buffers=False, seed=6)
    out = d.apply(u, {"client_id": 5, "seed": 3, "lr": 0.5})
    s = d.sigmas(u, {"lr": 0.5})["p:a"]
    g = _gen(6, 5, 3)
    for k, t in u.tensors.items():
        assert torch.equal(out.tensors[k], t + (s / 0.5 * torch.randn(t.shape, generator=g, dtype=torch.float64)))
    zero = Update({"w": torch.zeros(10, dtype=torch.float64)}, 1)
    assert d.sigmas(zero, {}) == {"p:w": 0.0}
    assert torch.equal(d.apply(zero, {}).tensors["w"], zero.tensors["w"])


def test_percentile_is_over_the_nonzero_entries_in_float64():
    g = torch.Generator().manual_seed(1)
    t = torch.randn(1000, generator=g).to(torch.float32)
    t[::2] = 0.0  # half the entries are exact zeros (e.g. a pruned upload)
    u = Update({"w": t}, 1)
    s = GaussianPercentileNoise(1.0, percentile=95).sigmas(u, {})["p:w"]
    v = t.double().numpy()
    assert s == pytest.approx(float(np.percentile(np.abs(v[v != 0]), 95)), rel=1e-15)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("q", [0.5, 10.0, 50.0, 90.0, 95.0, 100.0])
def test_percentile_equals_numpys_linear_interpolation(n, q):
    v = torch.tensor([0.3, 2.0, 1.1, 5.0, 0.7, 4.2, 3.3, 0.9][:n], dtype=torch.float64)
    assert float(_percentile(v, q)) == pytest.approx(float(np.percentile(v.numpy(), q)), rel=1e-12)


def test_stochastic_quantization_is_the_documented_seeded_rounding():
    u = _meta_update()
    out = StochasticQuantization(3, seed=8).apply(u, {"client_id": 5, "seed": 2})
    g = _gen(8, 5, 2)
    for k, t in u.tensors.items():
        lo, hi = t.min(), t.max()
        scaled = (t - lo) / (hi - lo) * 7
        floor = scaled.floor()
        up = (torch.rand(t.shape, generator=g, dtype=torch.float64).to(t) < (scaled - floor)).to(t.dtype)
        assert torch.equal(out.tensors[k], lo + (floor + up) / 7 * (hi - lo)), k


def test_secure_sum_averages_the_buffers_and_keeps_the_metadata():
    ups = [_meta_update(torch.float64) for _ in range(3)]
    for i, u in enumerate(ups):
        u.num_samples, u.client_id, u.local_steps = i + 1, i, i + 1
        u.buffers = {k: b + i for k, b in u.buffers.items()}
    s, plain = secure_aggregate(ups, seed=4), aggregate(ups)
    assert (s.num_samples, s.client_id, s.kind, s.local_steps) == (6, -1, "pseudo_gradient", 3)
    assert s.buffers.keys() == plain.buffers.keys()
    for k in plain.buffers:
        assert torch.allclose(s.buffers[k], plain.buffers[k], rtol=0, atol=1e-9)
    # the documented precision: 40 fraction bits below the largest magnitude (the mask seed changes nothing)
    for k in plain.tensors:
        assert torch.equal(s.tensors[k], secure_aggregate(ups, seed=11, frac_bits=40).tensors[k])
    assert secure_aggregate([Update({"w": torch.ones(2)}, 1), Update({"w": torch.ones(2)}, 1)]).buffers is None


def test_withheld_batch_size_strips_only_the_count():
    u = _meta_update()
    v = build_view(model=torch.nn.Linear(1, 1), rounds=[[u]], round_states=[{}],
                   threat=ThreatModel(knows_batch_size=False), secure_sum=None, knowledge={}, always_public={})
    (seen,) = v.updates
    assert seen.num_samples == 0
    assert (seen.client_id, seen.kind, seen.local_steps, seen.buffers) == (5, "pseudo_gradient", 3, u.buffers)
    assert seen.tensors is u.tensors


def test_documented_defaults_and_bounds():
    """The defaults `gradleak list` prints (and configs rely on when they leave a parameter out)."""
    import inspect

    from gradleak.registry import DEFENSES

    want = {"gaussian_noise": {"relative": False, "per_coordinate": False, "seed": 0},
            "gaussian_percentile": {"percentile": 95.0, "per_tensor": False, "include_buffers": True,
                                    "absolute": False, "seed": 0},
            "dp_gaussian": {"max_norm": 1.0, "where": "client", "seed": 0},
            "stochastic_quantization": {"seed": 0}}
    for name, defaults in want.items():
        params = inspect.signature(DEFENSES.get(name)).parameters
        assert {k: params[k].default for k in defaults} == defaults, name
    d = DPGaussian(0.5)
    assert (d.max_norm, d.where, d.server_side, d.noise.std, d.noise.relative) == (1.0, "client", False, 0.5, False)
    p = GaussianPercentileNoise(1.0)
    assert p.include_buffers and p.percentile == 95.0 and not p.per_tensor and not p.absolute
    assert GaussianPercentileNoise(1.0, percentile=100).percentile == 100.0  # (0, 100]: both ends as documented
    assert GaussianPercentileNoise(1.0, percentile=0.5).percentile == 0.5
    assert StochasticQuantization(3).levels == 7 and StochasticQuantization(1).levels == 1


# ------------------------------------------------------------------------------------------- secure aggregation masks
@pytest.mark.parametrize("k", [2, 3, 4])
def test_every_client_sends_a_masked_vector_and_the_masks_cancel_in_the_sum(k):
    """What each client sends is its fixed-point vector plus masks: never its plain encoding (a missing mask pair,
    e.g. between neighbours, fails here); a fresh mask seed changes every upload but not the sum."""
    from gradleak.fl.core import MODULUS, fixed_point, masked_uploads

    g = torch.Generator().manual_seed(3)
    dicts = [{"w": torch.randn(64, generator=g, dtype=torch.float64), "b": torch.randn(3, generator=g,
                                                                                      dtype=torch.float64)}
             for _ in range(k)]
    weights = [1.0 / k] * k
    plain, scale = fixed_point(dicts, weights, 40)
    sent, scale2 = masked_uploads(dicts, weights, torch.Generator().manual_seed(0), 40)
    again, _ = masked_uploads(dicts, weights, torch.Generator().manual_seed(1), 40)
    same, _ = masked_uploads(dicts, weights, torch.Generator().manual_seed(0), 40)  # the simulation is seeded
    assert all(torch.equal(a[key], b[key]) for a, b in zip(sent, same) for key in ("w", "b"))
    assert scale == scale2
    for i in range(k):
        for key in ("w", "b"):
            assert not bool((sent[i][key] == plain[i][key]).any()), (i, key)  # masked in every coordinate
            assert not bool((sent[i][key] == again[i][key]).any())
            assert bool((sent[i][key] >= 0).all() and (sent[i][key] < MODULUS).all())
    for key in ("w", "b"):
        total = lambda vs: torch.remainder(sum(v[key] for v in vs), MODULUS)  # noqa: E731
        assert torch.equal(total(sent), total(plain)) and torch.equal(total(again), total(plain))


def test_secure_aggregation_of_one_client_is_its_update():
    u = Update({"w": torch.randn(5, dtype=torch.float64), "h": torch.randn(2, 2).to(torch.float32)}, 3, 0)
    s = secure_aggregate([u])
    assert s.tensors["h"].dtype == torch.float32 and s.num_samples == 3
    assert torch.allclose(s.tensors["w"], u.tensors["w"], rtol=0, atol=1e-9)


# ------------------------------------------------------------------------------------------- threat resolution
def test_threat_resolution_presets_defaults_and_one_client_exposure():
    from gradleak.fl.threat import ThreatConfig

    tm = ThreatConfig().resolve()
    assert tm.capability == "honest-but-curious" and tm.individual_updates is True and tm.exposure is None
    assert ThreatConfig(preset="malicious").resolve().capability == "malicious"
    assert ThreatConfig(preset="malicious").resolve().malicious is True
    hidden = ThreatConfig().resolve(secure_aggregation=True)  # clients unknown: hidden
    assert hidden.individual_updates is False and hidden.exposure is None
    assert ThreatConfig().resolve(True, clients=2).individual_updates is False
    one = ThreatConfig(knows_labels=True).resolve(True, clients=1)  # the sum of one update is that update
    assert one.individual_updates is True and one.exposure and "one client" in one.exposure
    assert one.knows_labels is True and one.capability == "honest-but-curious"  # the rest of the threat is kept


# ------------------------------------------------------------------------------------------- killed survivors (round 2)
def test_seeded_defenses_default_to_seed_0():
    u = _meta_update(torch.float64)
    ctx = {"client_id": 1, "seed": 2, "lr": 0.5}
    for plain, seeded in ((GaussianNoise(0.3), GaussianNoise(0.3, seed=0)),
                          (GaussianPercentileNoise(1.0), GaussianPercentileNoise(1.0, seed=0)),
                          (DPGaussian(1.0), DPGaussian(1.0, seed=0)),
                          (StochasticQuantization(2), StochasticQuantization(2, seed=0))):
        assert torch.equal(plain.apply(u, ctx).flat(), seeded.apply(u, ctx).flat()), type(plain).__name__


def test_build_defenses_takes_config_objects_and_defaults_to_seed_0():
    from gradleak.defenses import DefenseConfig, build_defenses

    (d,) = build_defenses([DefenseConfig(name="gaussian_noise", params={"std": 0.1})])
    assert isinstance(d, GaussianNoise) and d.seed == 0 and d.std == 0.1


def test_aggregate_keeps_kind_steps_and_buffers_of_one_or_many_updates():
    one = _meta_update()
    one.buffers = {k: b.to(torch.float32) for k, b in one.buffers.items()}
    a = aggregate([one])  # a single update: its own mean
    assert (a.num_samples, a.client_id, a.kind, a.local_steps) == (7, -1, "pseudo_gradient", 3)
    assert all(b.dtype == torch.float64 for b in a.buffers.values())  # BN changes averaged in float64
    assert all(torch.equal(a.tensors[k], one.tensors[k]) for k in one.tensors)
    two = _meta_update()
    two.local_steps, two.num_samples = 5, 3
    assert aggregate([one, two]).local_steps == 5 and aggregate([one, two]).num_samples == 10


def test_update_map_passes_the_parameter_name():
    u = _meta_update(torch.float64)
    m = u.map(lambda k, t: t * (2.0 if k == "a" else 1.0))
    assert torch.equal(m.tensors["a"], 2 * u.tensors["a"]) and torch.equal(m.tensors["b"], u.tensors["b"])


def test_view_holds_the_model_the_server_sent_and_a_missing_sum_is_named():
    model = torch.nn.Linear(2, 2)
    v = build_view(model=model, rounds=[[_meta_update()]], round_states=[{}], threat=ThreatModel(), secure_sum=None,
                   knowledge={}, always_public={})
    assert v.model is model
    with pytest.raises(ValueError, match=r"^secure aggregation requested but no sums were computed$"):
        build_view(model=model, rounds=[[_meta_update()]], round_states=[{}],
                   threat=ThreatModel(individual_updates=False), secure_sum=None, knowledge={}, always_public={})


@pytest.mark.parametrize("flag,fix", [("malicious", "threat.preset=malicious"),
                                      ("prescribes_architecture", "threat.preset=prescribes-architecture"),
                                      ("individual_updates", "fl.secure_aggregation=false"),
                                      ("knows_labels", "--set threat.knows_labels=true"),
                                      ("public_data", "--set threat.public_data=true")])
def test_the_gate_tells_how_to_grant_each_flag(flag, fix):
    from dataclasses import replace

    from gradleak.errors import BadInput
    from gradleak.fl.threat import check_requirements

    with pytest.raises(BadInput) as e:
        check_requirements("atk", {flag: True}, replace(ThreatModel(), **{flag: False}))
    assert fix in e.value.fix and "atk" in e.value.problem
    with pytest.raises(ValueError, match="atk.*unknown threat flag 'telepathy'"):
        check_requirements("atk", {"telepathy": True}, ThreatModel())


def test_one_client_exposure_overrides_a_configured_secure_view():
    from gradleak.fl.threat import ThreatConfig

    tm = ThreatConfig(individual_updates=False).resolve(True, clients=1)
    assert tm.individual_updates is True and tm.exposure


# ---------------------------------------------- what the server infers from a published defense (attacks at strength)

def _plain_update(P_a=12, P_b=4) -> Update:
    g = torch.Generator().manual_seed(1)
    return Update({"a": torch.randn(P_a, generator=g, dtype=torch.float64),
                   "b": torch.randn(P_b, generator=g, dtype=torch.float64)}, 1, 0)


def test_observed_noise_variance_of_each_defense_exactly():
    """The per-coordinate noise variance each published defense puts on an observed upload (individual) or on the
    observed mean of K uploads: absolute σ², relative σ²‖g‖²/(1 + Pσ²), per-coordinate σ²‖g‖²/(1 + σ²)/P; DP-Gaussian
    (σC)² on each upload, (σC/K)² on a central mean; None where the scale is unknown to the server."""
    u = _plain_update()
    P, n2 = 16, float(u.norm()) ** 2
    assert GaussianNoise(0.3).observed_noise_variance(u) == pytest.approx(0.09, rel=1e-12)
    assert GaussianNoise(0.3).observed_noise_variance(u, aggregate_of=4, individual=False) == pytest.approx(0.09 / 4)
    assert GaussianNoise(0.3).observed_noise_variance(u, individual=False) == pytest.approx(0.09)  # default K = 1
    assert GaussianNoise(0.3).observed_noise_variance(u, aggregate_of=4) == pytest.approx(0.09)  # individual: no 1/K
    rel = GaussianNoise(0.3, relative=True).observed_noise_variance(u)
    assert rel == pytest.approx(0.09 * n2 / (1 + P * 0.09), rel=1e-12)
    pc = GaussianNoise(0.3, per_coordinate=True).observed_noise_variance(u)
    assert pc == pytest.approx(0.09 * n2 / (1 + 0.09) / P, rel=1e-12)
    assert GaussianNoise(0.3, per_coordinate=True).observed_noise_variance(u, aggregate_of=2, individual=False) == \
        pytest.approx(pc / 2, rel=1e-12)
    dp = DPGaussian(noise_multiplier=0.5, max_norm=3.0)  # σC = 1.5
    assert dp.observed_noise_variance(u) == pytest.approx(2.25)
    assert dp.observed_noise_variance(u, aggregate_of=4) == pytest.approx(2.25)  # an individual upload: no 1/K
    assert dp.observed_noise_variance(u, aggregate_of=4, individual=False) == pytest.approx(2.25 / 4)
    assert dp.observed_noise_variance(u, individual=False) == pytest.approx(2.25)
    central = DPGaussian(noise_multiplier=0.5, max_norm=2.0, where="server")
    assert central.observed_noise_variance(u) == 0.0
    assert central.observed_noise_variance(u, aggregate_of=4, individual=False) == pytest.approx(1 / 16)
    assert central.observed_noise_variance(u, individual=False) == pytest.approx(1.0)
    # percentile noise: read off the observed upload, sigma0 p95(|u|) / (1 + (1.96 sigma0)^2)^(1/2) (its docstring)
    v = torch.cat([t.abs().reshape(-1) for t in u.tensors.values()])
    p95 = float(torch.quantile(v[v > 0], 0.95))
    z = float(torch.special.ndtri(torch.tensor(0.975, dtype=torch.float64)))
    assert GaussianPercentileNoise(sigma0=0.1).observed_noise_variance(u) == pytest.approx(
        (0.1 * p95) ** 2 / (1 + (z * 0.1) ** 2), rel=1e-9)
    assert GaussianPercentileNoise(sigma0=0.1).observed_noise_variance(u, aggregate_of=3, individual=False) is None
    assert StochasticQuantization(bits=4).observed_noise_variance(u) is None
    assert StochasticQuantization(bits=4).observed_noise_variance(u, aggregate_of=3, individual=False) is None
    assert GaussianPercentileNoise(sigma0=0.25).report([]) == {"noise_sigma0": 0.25}


def test_build_defenses_names_the_entry_and_the_parameter():
    from gradleak.defenses.base import build_defenses
    from gradleak.errors import BadInput

    with pytest.raises(BadInput) as err:
        build_defenses([{"name": "clipping", "params": {"max_norm": 1.0}}, {"name": "dpsgd"}])
    assert err.value.field == "defenses[1].name" and "training-time defense" in err.value.problem
    with pytest.raises(BadInput) as err:
        build_defenses([{"name": "clipping", "params": {"max_norm": 1.0, "max_nrm": 1.0}}])
    assert err.value.field == "defenses[0].params.max_nrm" and "parameters of 'clipping': max_norm" in err.value.fix
    with pytest.raises(BadInput) as err:
        build_defenses([{"name": "clipping", "params": {}}])
    assert err.value.field == "defenses[0].params.max_norm"
