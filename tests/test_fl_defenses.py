"""Federated core and update defenses: properties that must hold exactly."""

import numpy as np
import pytest
import torch

from gradleak.defenses import Clipping, GaussianNoise, StochasticQuantization, TopKPruning, build_defenses
from gradleak.errors import BadInput
from gradleak.fl import Client, Update, aggregate, dirichlet_split, secure_aggregate


def _upd(seed=0, n=10):
    g = torch.Generator().manual_seed(seed)
    return Update({"a": torch.randn(5, 4, generator=g, dtype=torch.float64), "b": torch.randn(7, generator=g, dtype=torch.float64)}, n, seed)


def test_clipping_bounds_norm_and_keeps_direction():
    u = _upd()
    c = Clipping(0.5).apply(u, {})
    assert c.norm() == pytest.approx(0.5)
    assert torch.allclose(c.flat() / c.norm(), u.flat() / u.norm())
    assert Clipping(1e6).apply(u, {}).norm() == pytest.approx(u.norm())


def test_topk_pruning_keeps_largest():
    u = _upd()
    p = TopKPruning(0.75).apply(u, {})
    flat, orig = p.flat(), u.flat()
    kept = (flat != 0).sum().item()
    assert kept == round(orig.numel() * 0.25)
    assert flat.abs().max() == orig.abs().max()
    assert orig.abs()[flat == 0].max() <= orig.abs()[flat != 0].min()


def test_noise_relative_scale_and_seeded():
    u = _upd(n=1)
    big = Update({"a": torch.zeros(200000, dtype=torch.float64) + 1e-3}, 1)
    n = GaussianNoise(0.1, relative=True, seed=1).apply(big, {"client_id": 0})
    assert (n.flat() - big.flat()).std().item() == pytest.approx(0.1 * big.norm(), rel=0.02)
    a = GaussianNoise(1.0, seed=3).apply(u, {"client_id": 2}).flat()
    b = GaussianNoise(1.0, seed=3).apply(u, {"client_id": 2}).flat()
    assert torch.equal(a, b)
    c = GaussianNoise(1.0, seed=3).apply(u, {"client_id": 2, "seed": 1}).flat()  # another round: fresh noise
    assert not torch.equal(a, c)


def test_stochastic_quantization_is_unbiased_and_on_grid():
    u = Update({"a": torch.linspace(-1, 1, 101, dtype=torch.float64)}, 1)
    outs = torch.stack([StochasticQuantization(2, seed=s).apply(u, {}).flat() for s in range(400)])
    assert torch.allclose(outs.mean(0), u.flat(), atol=0.05)
    levels = torch.unique(outs)
    assert len(levels) <= 4


@pytest.mark.parametrize("scale", [1.0, 1e-12])
def test_secure_aggregation_equals_plain_weighted_mean(scale):
    ups = [_upd(s, n=s + 1).map(lambda _, t: t * scale) for s in range(4)]
    plain, masked = aggregate(ups), secure_aggregate(ups, seed=0)
    bound = max(float(t.abs().max()) for t in plain.tensors.values())
    for k in plain.tensors:
        assert torch.allclose(plain.tensors[k], masked.tensors[k], rtol=0, atol=bound * 1e-9)


def test_dirichlet_split_partitions_all_indices():
    labels = np.repeat(np.arange(5), 40)
    parts = dirichlet_split(labels, 6, alpha=0.3, seed=0)
    allidx = np.sort(np.concatenate(parts))
    assert np.array_equal(allidx, np.arange(200))
    with pytest.raises(BadInput):
        dirichlet_split(labels, 3, alpha=0)


def test_fedavg_pseudo_gradient_equals_gradient_for_one_full_batch_step():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randint(0, 2, (8,))
    c = Client(0, x, y)
    g = c.local_update(model, algorithm="fedsgd")
    p = c.local_update(model, algorithm="fedavg", epochs=1, lr=0.1)
    for k in g.tensors:
        assert torch.allclose(g.tensors[k], p.tensors[k], atol=1e-10)


def test_build_defenses_errors_name_the_field():
    with pytest.raises(BadInput) as e:
        build_defenses([{"name": "nope"}])
    assert "defenses[0].name" in str(e.value)
    with pytest.raises(BadInput) as e:
        build_defenses([{"name": "clipping", "params": {"max_norm": -1}}])
    assert "max_norm" in str(e.value)


def test_coordinate_noise_std_from_the_published_defenses():
    from gradleak.defenses.update import coordinate_noise_std
    from gradleak.fl.core import Update

    u = Update({"w": torch.full((100,), 0.1)}, 1, 0, "gradient", 1)  # ||u|| = 1, P = 100
    assert coordinate_noise_std([], u) is None
    assert coordinate_noise_std([{"name": "topk_pruning", "params": {"prune_fraction": 0.9}}], u) is None
    assert coordinate_noise_std([{"name": "gaussian_noise", "params": {"std": 0.2}}], u) == pytest.approx(0.2)
    dp = {"name": "dp_gaussian", "params": {"noise_multiplier": 0.5, "max_norm": 2.0}}
    assert coordinate_noise_std([dp], u) == pytest.approx(1.0)
    assert coordinate_noise_std([dp], u, aggregate_of=4, individual=False) == pytest.approx(0.5)  # mean of 4
    central = {"name": "dp_gaussian", "params": {"noise_multiplier": 0.5, "max_norm": 2.0, "where": "server"}}
    assert coordinate_noise_std([central], u) is None  # the raw upload carries no noise
    assert coordinate_noise_std([central], u, aggregate_of=4, individual=False) == pytest.approx(0.25)
    # per-coordinate noise-to-signal ratio s: std = s ||g|| / sqrt(P), ||g|| estimated from the noisy upload
    pc = {"name": "gaussian_noise", "params": {"std": 0.1, "per_coordinate": True}}
    assert coordinate_noise_std([pc], u) == pytest.approx(0.1 / 10 / (1.01) ** 0.5)


def test_server_side_dp_noises_only_the_aggregate():
    """dp_gaussian(where=server): uploads are clipped, not noised; the mean of K clipped uploads gets
    N(0, (σC/K)²), the same draw in the applied aggregate and in the secure-aggregation sum."""
    from gradleak.fl.core import Client
    from gradleak.defenses import build_defenses
    from gradleak.fl.engines.builtin import run_rounds

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 4)
    clients = [Client(i, torch.randn(8, 64), torch.randint(0, 4, (8,))) for i in range(4)]
    dp = build_defenses([{"name": "dp_gaussian", "params": {"noise_multiplier": 2.0, "max_norm": 1.0,
                                                              "where": "server"}}])
    out = run_rounds(model, clients, rounds=1, algorithm="fedsgd", lr=0.0, defenses=dp, secure_aggregation=True)
    raw = run_rounds(model, clients, rounds=1, algorithm="fedsgd", lr=0.0, defenses=[], secure_aggregation=True)
    for a, b in zip(out.rounds[0], raw.rounds[0]):  # individual uploads: clipped copies of the raw ones
        f = min(1.0, 1.0 / b.norm())
        for k in a.tensors:
            assert torch.allclose(a.tensors[k], b.tensors[k] * f, atol=1e-6)
    clean_mean = sum(u.flat() for u in out.rounds[0]) / 4
    noise = out.secure_sums[0].flat() - clean_mean
    assert torch.allclose(out.last_aggregate.flat() - clean_mean, noise, atol=1e-5)
    assert float(noise.std()) == pytest.approx(2.0 * 1.0 / 4, rel=0.2)
