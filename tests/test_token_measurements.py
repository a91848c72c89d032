"""The information limit of a noisy first-layer gradient (docs/DESIGN.md §6): lora_span's measurements solver
(gradleak.attacks.common.token_measurements), the noise std read off the upload (percentile noise, the residual
outside the token basis) and the debiased spectrum (gradleak.attacks.common.subspace.spectral_margin)."""

from __future__ import annotations

import pytest
import torch

from gradleak.attacks.common.subspace import debias_singular_value, spectral_margin
from gradleak.attacks.common.token_measurements import GaussianImagePrior, residual_noise_std
from gradleak.attacks.lora_span import LoraSpan
from gradleak.defenses.update import PercentileNoise as GaussianPercentileNoise
from gradleak.fl.core import Update
from gradleak.metrics import psnr
from gradleak.metrics.patches import image_to_patches, patches_to_image
from test_lora_span import _images, _tiny, _view

F64 = torch.float64


def _smooth_images(n=1, seed=0, side=8):
    """Images drawn from the stationary prior itself (so the prior is the truth's law)."""
    pr = GaussianImagePrior.stationary(3, side, 2, rho=0.9, channel_corr=0.5, std=0.3)
    g = torch.Generator().manual_seed(seed)
    L = torch.linalg.cholesky(pr.cov + 1e-9 * torch.eye(len(pr.cov), dtype=F64))
    x = (L @ torch.randn(len(pr.cov), n, generator=g, dtype=F64)).T + pr.mean
    imgs = torch.stack([patches_to_image(p, 3, side, 2) for p in x.reshape(n, (side // 2) ** 2, -1)])
    return ((imgs + 1) / 2).clamp(0, 1)


def _attack(**kw):
    return LoraSpan(time_fwdbwd=False, solver="measurements", prior="stationary", **kw)


def test_patch_layout_round_trips_and_matches_the_conv_kernel_order():
    x = torch.rand(2, 3, 8, 8, dtype=F64)
    X = image_to_patches(x, 2)
    assert X.shape == (2, 16, 12)
    assert torch.equal(torch.stack([patches_to_image(p, 3, 8, 2) for p in X]), x)
    # patch (row 0, col 1), channel 1, pixel (1, 0) of the patch: the conv's flattened (c, py, px) order
    assert X[0, 1, 1 * 4 + 1 * 2 + 0] == x[0, 1, 1, 2]


@pytest.mark.parametrize("kind", ["vit", "dinov2"])
def test_every_direction_noise_free_is_exact_and_equals_the_span_solver(kind):
    """Where the rank is full (all N + 1 token directions, no noise) the measurements solver is the exact attack: the
    oracle ceiling at full rank equals the attack on the noise-free input."""
    x = _images()
    view = _view(_tiny(kind), x, torch.tensor([1]))
    meas = _attack().reconstruct(view)
    span = LoraSpan(time_fwdbwd=False).reconstruct(view)
    assert meas.info["directions_used"] == span.metrics["lora_span_row_space_rank"] >= 16
    assert float(psnr(meas.data["images"].double(), x).min()) > 60
    assert torch.allclose(meas.data["images"], span.data["images"], atol=1e-4)


def test_fewer_directions_are_measurements_more_of_them_recover_more():
    """Below full rank each direction still measures the image: the error falls as directions are added, and 8 of 17
    directions already beat the prior alone (its mean, grey) by a wide margin."""
    x = _smooth_images(seed=3)
    view = _view(_tiny("vit", seed=1), x, torch.tensor([2]))
    scores = {}
    for k in (2, 5, 9, 17):
        rec = _attack(directions=k, iterations=6).reconstruct(view)
        scores[k] = float(psnr(rec.data["images"].double(), x))
        assert rec.metrics["lora_span_rank_condition_holds"] == float(rec.info["directions_used"] >= 16)
    grey = float(psnr(torch.full_like(x, 0.5), x))
    assert scores[2] < scores[5] < scores[9] < scores[17]
    assert scores[9] > grey + 6 and scores[17] > 60


def test_noisy_upload_the_solver_stays_above_the_prior_alone():
    """Gaussian noise on the upload that buries part of the spectrum: the noise-edge directions still carry the
    image (PSNR well above the prior alone) and the noise std read off the residual outside the token basis matches
    the true std."""
    x = _smooth_images(seed=5)
    view = _view(_tiny("vit", seed=2), x, torch.tensor([0]))
    upd = view.updates[0]
    key = next(k for k in upd.tensors if "lora_A" in k and "layer.0" in k)
    G = upd.tensors[key]
    s = torch.linalg.svdvals(G.double())
    std = float(s[8]) / (G.shape[0] ** 0.5 + G.shape[1] ** 0.5)  # the 9th direction sits at the edge
    g = torch.Generator().manual_seed(0)
    noisy = {k: (t + std * torch.randn(t.shape, generator=g, dtype=t.dtype) if "lora_A" in k else t)
             for k, t in upd.tensors.items()}
    view.updates[0] = Update(noisy, upd.num_samples, upd.client_id, upd.kind, upd.local_steps, upd.buffers)
    rec = _attack(rank_cut="noise_edge", iterations=6).reconstruct(view)
    k = rec.info["directions_used"]
    assert 3 <= k < 17
    assert rec.info["noise_std_read_off_residual"] == pytest.approx(std, rel=0.35)
    grey = float(psnr(torch.full_like(x, 0.5), x))
    assert float(psnr(rec.data["images"].double(), x)) > grey + 3
    assert rec.info["leakage_margin"]["directions_above_edge"] >= 1


def test_residual_noise_std_reads_the_noise_outside_the_basis():
    g = torch.Generator().manual_seed(1)
    d, m, k, tau = 200, 40, 30, 0.07
    M = torch.randn(d, m, generator=g, dtype=F64)
    Y = torch.randn(k, m, generator=g, dtype=F64) @ M.T + tau * torch.randn(k, d, generator=g, dtype=F64)
    assert residual_noise_std(Y, M) == pytest.approx(tau, rel=0.03)
    rows = residual_noise_std(Y, M, per_row=True)
    assert rows.shape == (k,) and float(rows.mean()) == pytest.approx(tau, rel=0.05)


@pytest.mark.parametrize("sigma0,rel", [(0.003, 0.02), (0.01, 0.02), (1.0, 0.12), (100.0, 0.02)])
def test_percentile_noise_std_is_read_off_the_noisy_upload(sigma0, rel):
    """σ = σ0 × p95(|clean|) is estimated from the *noisy* upload: exact in both limits, within 12 % between."""
    g = torch.Generator().manual_seed(2)
    clean = {"a": torch.randn(300, 200, generator=g, dtype=F64) * torch.rand(300, 1, generator=g, dtype=F64),
             "b": torch.randn(5000, generator=g, dtype=F64).exp()}
    u = Update(clean, 1, 0)
    d = GaussianPercentileNoise(sigma0=sigma0)
    true = sigma0 * float(torch.quantile(torch.cat([t.abs().reshape(-1) for t in clean.values()]), 0.95))
    noisy = d.apply(u, {"seed": 0, "client_id": 0, "lr": 1.0})
    est = d.observed_noise_variance(noisy, lr=1.0) ** 0.5
    assert est == pytest.approx(true, rel=rel)
    assert d.observed_noise_variance(noisy, individual=False) is None  # a sum of clients' own scales: unknown


def test_debiased_singular_values_recover_planted_signal():
    g = torch.Generator().manual_seed(0)
    M, n, tau = 256, 384, 1.0
    U = torch.linalg.qr(torch.randn(M, 4, generator=g, dtype=F64))[0]
    V = torch.linalg.qr(torch.randn(n, 4, generator=g, dtype=F64))[0]
    theta = torch.tensor([200.0, 90.0, 45.0, 30.0], dtype=F64)
    X = U @ torch.diag(theta) @ V.T + tau * torch.randn(M, n, generator=g, dtype=F64)
    s = torch.linalg.svdvals(X)
    for i in range(4):
        assert debias_singular_value(float(s[i]), tau, M, n) == pytest.approx(float(theta[i]), rel=0.1)
    assert debias_singular_value(float(s[10]), tau, M, n) == 0.0  # a noise value: no signal behind it
    m = spectral_margin([X], 4, tau)
    assert m["directions_above_edge"] == 4 and m["margin_strongest"] > 5


def test_audit_variants_add_the_measurements_solver_only_under_a_defense():
    plain = LoraSpan.audit_variants({}, None)
    assert not any(v.get("solver") == "measurements" for v in plain)
    defended = LoraSpan.audit_variants({}, object())
    assert {"rank_cut": "noise_edge", "solver": "measurements", "prior": "stationary"} in defended
    assert LoraSpan.requires(LoraSpan.Config(solver="measurements", prior="public")).get("public_data")
    assert not LoraSpan.requires(LoraSpan.Config(solver="measurements", prior="stationary")).get("public_data")


def test_the_prior_is_chosen_by_its_evidence_on_the_upload_not_by_the_truth():
    """Several candidate priors: the solver keeps the one with the largest evidence p(y | W, prior); on images drawn
    from one of them, that one (or a close neighbour) wins and the image is no worse than under a mis-scaled prior."""
    from gradleak.attacks.common.token_measurements import invert_token_directions

    x = _smooth_images(seed=7)
    view = _view(_tiny("vit", seed=3), x, torch.tensor([1]))
    rec = _attack(directions=6).reconstruct(view)
    ev = rec.info["prior_evidence"]
    assert len(ev) == 9 and max(ev) == pytest.approx(ev[max(range(9), key=lambda i: ev[i])])
    assert "Gauss-Markov" in rec.info["prior"]
    wrong = GaussianImagePrior.stationary(3, 8, 2, rho=0.0, channel_corr=0.0, std=5.0)
    upd = view.updates[0]
    G = torch.cat([upd.tensors[k].double() for k in sorted(upd.tensors) if "lora_A" in k and "layer.0." in k])
    _, S, Vh = torch.linalg.svd(G, full_matrices=False)
    from gradleak.attacks.lora_span import first_block, token_basis

    K, Pm, extra = token_basis(first_block(view.model))
    Y = S[:6, None] * Vh[:6]
    good = invert_token_directions(Y, K, Pm, extra, [wrong, GaussianImagePrior.stationary(3, 8, 2, rho=0.9,
                                                                                         channel_corr=0.5, std=0.3)],
                                   1e-9, 2)
    assert good["prior"].source.startswith("data-free") and "rho 0.9" in good["prior"].source
    assert good["prior_evidence"][1] > good["prior_evidence"][0]


def test_measurement_covariance_is_the_law_of_the_coefficients_noise():
    """u − Xᵀŵ from a noisy row's coordinates in M = [K | P | extra] has covariance τ² C(X) (the errors-in-variables
    likelihood the solver uses): checked by Monte Carlo at a known image and coefficients."""
    from gradleak.attacks.common.token_measurements import measurement_covariance

    g = torch.Generator().manual_seed(3)
    d, n, N, e = 40, 6, 5, 2
    K, P, extra = (torch.randn(d, m, generator=g, dtype=F64) for m in (n, N, e))
    M = torch.cat([K, P, extra], 1)
    X = torch.randn(N, n, generator=g, dtype=F64)
    w, a = torch.randn(N, generator=g, dtype=F64), torch.randn(e, generator=g, dtype=F64)
    y0 = K @ (X.T @ w) + P @ w + extra @ a  # a noise-free row: tokens (X K^T + P^T) weighted by w, plus extra
    tau, draws = 0.1, 20000
    Y = y0 + tau * torch.randn(draws, d, generator=g, dtype=F64)
    Gi = torch.linalg.inv(M.T @ M)
    coef = Y @ M @ Gi  # draws × (n + N + e)
    r = coef[:, :n] - coef[:, n:n + N] @ X  # u − Xᵀŵ per draw
    assert torch.allclose(r.mean(0), torch.zeros(n, dtype=F64), atol=5 * tau * Gi.diagonal().max().sqrt() / draws ** 0.5 * 10)
    emp = torch.cov(r.T)
    C = tau ** 2 * measurement_covariance(Gi, n, N, X)
    assert torch.allclose(emp, C, rtol=0.08, atol=0.08 * float(C.diagonal().mean()))
    # treating ŵ as exact (the covariance at X = 0) misses the image-dependent part
    assert not torch.allclose(emp, tau ** 2 * measurement_covariance(Gi, n, N, torch.zeros_like(X)), rtol=0.08,
                              atol=0.08 * float(C.diagonal().mean()))
