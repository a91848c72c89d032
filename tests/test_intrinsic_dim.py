"""Gradient intrinsic dimension (paper 001 Supp. A, Fig. 2): MLE / TwoNN on known manifolds,
effective and energy ranks, the Achlioptas projection, and the per-sample-gradient analysis on a tiny LoRA ViT."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gradleak.data import load
from gradleak.errors import BadInput
from gradleak.metrics.intrinsic_dim import (COL_BLOCK, ROW_BLOCK, AchlioptasProjection, achlioptas_projection,
                                            effective_rank, energy_ranks, gradient_intrinsic_dimension,
                                            input_jacobian, jl_epsilon, jl_min_dim, mle_intrinsic_dimension,
                                            spectrum_energy_ranks, twonn_intrinsic_dimension)
from gradleak.models import ModelHandle
from gradleak.models.attention import use_precise_eager
from gradleak.models.vit import vit
from gradleak.peft import PeftConfig, apply_peft
from gradleak.registry import METRICS

pytestmark = pytest.mark.usefixtures("one_thread")


def embedded(points: np.ndarray, ambient: int, seed: int) -> np.ndarray:
    """``points`` (N × d) mapped isometrically into R^ambient by a random orthonormal frame, plus an offset."""
    rng = np.random.default_rng(seed)
    Q, _ = np.linalg.qr(rng.standard_normal((ambient, points.shape[1])))
    return points @ Q.T + rng.standard_normal(ambient)


@pytest.mark.parametrize("d", [3, 6])
def test_mle_and_twonn_recover_the_dimension_of_a_linear_subspace_and_a_sphere(d):
    rng = np.random.default_rng(d)
    flat = embedded(rng.standard_normal((1200, d)), 40, seed=1)  # Gaussian on a d-dimensional subspace
    s = rng.standard_normal((1200, d + 1))
    sphere = embedded(s / np.linalg.norm(s, axis=1, keepdims=True), 40, seed=2)  # the unit d-sphere S^d
    for X in (flat, sphere):
        assert mle_intrinsic_dimension(X, k=20) == pytest.approx(d, rel=0.2)
        assert twonn_intrinsic_dimension(X) == pytest.approx(d, rel=0.2)
        assert mle_intrinsic_dimension(X, k=20, average="local") == pytest.approx(d, rel=0.2)
    # invariances: rotation / translation / scale do not change a distance-ratio estimate
    assert mle_intrinsic_dimension(3.0 * flat + 7.0, k=10) == pytest.approx(mle_intrinsic_dimension(flat, k=10))
    assert twonn_intrinsic_dimension(torch.tensor(flat)) == pytest.approx(twonn_intrinsic_dimension(flat))


def test_estimators_refuse_too_few_points_and_duplicates():
    X = np.random.default_rng(0).standard_normal((10, 5))
    with pytest.raises(BadInput, match="k < N"):
        mle_intrinsic_dimension(X, k=10)
    with pytest.raises(BadInput) as err:
        mle_intrinsic_dimension(X, k=1)
    assert err.value.field == "k"
    with pytest.raises(BadInput, match="too few"):
        twonn_intrinsic_dimension(X[:1])
    with pytest.raises(BadInput, match="coincide"):
        twonn_intrinsic_dimension(np.vstack([X, X[:1]]))
    with pytest.raises(BadInput) as err:
        twonn_intrinsic_dimension(X, discard_fraction=1.0)
    assert err.value.field == "discard_fraction"
    with pytest.raises(BadInput, match="N × D"):
        mle_intrinsic_dimension(X[0], k=3)


def test_effective_rank_and_energy_ranks():
    assert effective_rank(np.eye(7)) == pytest.approx(7.0)
    assert effective_rank(torch.eye(5, dtype=torch.float64) * 3.0) == pytest.approx(5.0)
    assert effective_rank(np.outer(np.arange(1, 6), np.arange(1, 4))) == pytest.approx(1.0)
    assert effective_rank(np.eye(4), power=1) == pytest.approx(4.0)
    assert effective_rank(np.zeros((3, 3))) == 0.0 and energy_ranks(np.zeros((3, 3))) == {"r90": 0, "r95": 0, "r99": 0}
    # squared spectrum 50/30/10/5/4/1 % -> cumulative 50, 80, 90, 95, 99, 100 %: each level hit exactly
    sigma = np.sqrt([5.0, 3.0, 1.0, 0.5, 0.4, 0.1])
    rot, _ = np.linalg.qr(np.random.default_rng(0).standard_normal((6, 6)))
    assert energy_ranks(rot @ np.diag(sigma)) == {"r90": 3, "r95": 4, "r99": 5}
    assert spectrum_energy_ranks(sigma[::-1], levels=(0.5, 0.81, 1.0)) == {"r50": 1, "r81": 3, "r100": 6}
    q = sigma ** 2 / (sigma ** 2).sum()
    assert effective_rank(np.diag(sigma)) == pytest.approx(math.exp(-(q * np.log(q)).sum()))
    with pytest.raises(BadInput):
        energy_ranks(np.eye(3), levels=(1.5,))


def test_achlioptas_projection_is_deterministic_sparse_and_preserves_norms_in_expectation():
    R = achlioptas_projection(300, 50, seed=3)
    assert R.shape == (50, 300) and torch.equal(R, achlioptas_projection(300, 50, seed=3))
    assert not torch.equal(R, achlioptas_projection(300, 50, seed=4))
    vals, counts = torch.unique(torch.round(R * math.sqrt(50 / 3)).to(torch.int64), return_counts=True)
    assert vals.tolist() == [-1, 0, 1]
    share = counts.double() / R.numel()
    assert torch.allclose(share, torch.tensor([1 / 6, 2 / 3, 1 / 6], dtype=torch.float64), atol=0.01)
    assert torch.allclose(R.abs().max(), torch.tensor(math.sqrt(3 / 50)))
    # E‖Rg‖² = ‖g‖²: the empirical ratio over many seeds and vectors
    g = torch.randn(200, 300, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ratios = torch.cat([(g @ achlioptas_projection(300, 64, seed=s, dtype=torch.float64).T).pow(2).sum(1)
                        / g.pow(2).sum(1) for s in range(20)])
    assert float(ratios.mean()) == pytest.approx(1.0, abs=0.02)
    assert float(ratios.std()) == pytest.approx(math.sqrt(2 / 64), rel=0.25)  # χ²-like spread of one projection
    # the streamed projection is the same matrix, across block boundaries in both directions
    d_in, d_out = COL_BLOCK + 123, ROW_BLOCK + 5
    P = AchlioptasProjection(d_in, d_out, seed=7)
    G = torch.randn(3, d_in, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(P.project(G), G @ P.matrix(torch.float64).T, atol=1e-10)
    assert jl_min_dim(20000, 0.102) == 8171  # paper 001 eq. 20
    assert jl_epsilon(20000, 8171) == pytest.approx(0.102, abs=1e-4) and jl_epsilon(100, 10) is None
    with pytest.raises(BadInput):
        achlioptas_projection(0, 4)


def tiny_vit(kind: str, seed: int = 0, dtype=torch.float32):
    """A tiny random ViT (8×8 images, patch 4, d = 32, 2 blocks): all parameters trainable, or LoRA r = 4 (+ PEs)."""
    model = vit("vit-tiny", image_size=8, patch_size=4, hidden_size=32, heads=2, layers=2, num_classes=4, seed=seed,
                dtype=dtype)
    if kind != "full":
        handle = ModelHandle(model, "image", "vit-tiny", "image", 32, 2)
        apply_peft(handle, PeftConfig(kind="lora", lora_rank=4, lora_targets=["query", "value"],
                                      layer_pe=kind == "lora_pe"), seed=seed)
    return model


@pytest.fixture(scope="module")
def batch():
    x = F.interpolate(load("cifar-samples", n=20).images, size=8, mode="area") * 2 - 1
    return x, torch.arange(20) % 4


def test_gradient_intrinsic_dimension_on_a_tiny_lora_vit(batch):
    x, y = batch
    res = {}
    for kind in ("full", "lora", "lora_pe"):
        model = tiny_vit(kind)
        flags, mode = [p.requires_grad for p in model.parameters()], model.training
        r = gradient_intrinsic_dimension(model, x, y, projection_dim=128, k=5, jacobian_samples=2, jacobian_dim=24,
                                         bootstrap=2)
        assert [p.requires_grad for p in model.parameters()] == flags and model.training == mode  # restored
        for key in ("mle", "twonn", "effective_rank"):
            assert math.isfinite(r[key]) and r[key] > 0 and math.isfinite(r["exact"][key])
        assert 1 <= r["r90"] <= r["r95"] <= r["r99"] <= len(x) - 1  # centred N × D: rank ≤ N − 1
        j = r["jacobian"]
        assert j["rows"] == 24 and j["input_dim"] == 3 * 8 * 8 and j["cap"] == 24
        assert all(0 < v <= 24 for v in j["effective_rank"]["values"]) and j["r99"]["mean"] <= 24
        assert r["bootstrap"]["resamples"] == 2 and r["bootstrap"]["subsample"] == 16
        res[kind] = r
    trainable = {k: sum(p.numel() for p in tiny_vit(k).parameters() if p.requires_grad) for k in res}
    assert {k: r["gradient_coordinates"] for k, r in res.items()} == trainable
    # LoRA observes fewer gradient coordinates than full fine-tuning, and (this seed) a smaller Jacobian rank
    assert res["lora"]["gradient_coordinates"] < res["full"]["gradient_coordinates"]
    assert res["lora"]["jacobian"]["effective_rank"]["mean"] <= res["full"]["jacobian"]["effective_rank"]["mean"]
    # the JL projection keeps the estimates near the exact (unprojected) ones
    assert res["full"]["effective_rank"] == pytest.approx(res["full"]["exact"]["effective_rank"], rel=0.2)
    # deterministic in the seed
    again = gradient_intrinsic_dimension(tiny_vit("lora"), x, y, projection_dim=128, k=5, jacobian_samples=1,
                                         jacobian_dim=8)
    assert again["mle"] == res["lora"]["mle"] and again["twonn"] == res["lora"]["twonn"]
    with pytest.raises(BadInput, match="too few"):
        gradient_intrinsic_dimension(tiny_vit("lora"), x[:5], y[:5], k=5)
    with pytest.raises(BadInput) as err:
        gradient_intrinsic_dimension(tiny_vit("lora"), x, y, parameters=["nope"])
    assert err.value.field == "parameters"


def test_input_jacobian_matches_finite_differences(batch):
    x, y = batch
    model = tiny_vit("lora", dtype=torch.float64)
    use_precise_eager(model)  # HF eager's float32 softmax would limit the finite differences to ~1e-7
    params = [p for p in model.parameters() if p.requires_grad]
    proj = AchlioptasProjection(sum(p.numel() for p in params), 6, seed=1)
    x0 = x[:1].double()
    J = input_jacobian(model, x0, y[:1], params, proj, batch=4)  # 6 rows: one batched VJP of 4, then 2

    def phi(z):
        g = torch.autograd.grad(F.cross_entropy(model(z), y[:1]), params)
        return proj.project(torch.cat([t.reshape(-1) for t in g]).unsqueeze(0))[0]

    v = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    h = 1e-5
    fd = (phi(x0 + h * v) - phi(x0 - h * v)) / (2 * h)
    assert J.shape == (6, 3 * 8 * 8) and float(fd.abs().max()) > 1e-3
    assert torch.allclose(J @ v.reshape(-1), fd, rtol=1e-5, atol=1e-8)


def test_registered_in_the_metric_registry():
    for name in ("mle_intrinsic_dimension", "twonn_intrinsic_dimension", "effective_rank", "energy_ranks",
                 "gradient_intrinsic_dimension"):
        assert name in METRICS
