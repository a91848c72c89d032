"""Denoised span tests on synthetic low-rank + noise blocks with a known edge (gradleak.attacks.common.subspace):
the signal above the noise spectrum's edge is recovered, nothing below it is claimed, the leakage margin predicts
the noise that drowns the signal, and the sparsity-aware test reads a top-k pruned block on its support."""

from __future__ import annotations

import pytest
import torch

from gradleak.attacks.common.subspace import noisy_subspace, pruned_membership, spectral_margin


def _block(m=48, n=96, r=5, scale=1.0, seed=0):
    """A rank-r (m x n) gradient block G = A X with orthonormal row space X (r x n) and singular values scale x
    (10, 8, 6, 4, 3)."""
    g = torch.Generator().manual_seed(seed)
    X = torch.linalg.qr(torch.randn(n, r, generator=g, dtype=torch.float64))[0].T
    U = torch.linalg.qr(torch.randn(m, r, generator=g, dtype=torch.float64))[0]
    s = torch.tensor([10.0, 8.0, 6.0, 4.0, 3.0][:r], dtype=torch.float64) * scale
    return (U * s) @ X, X, s


def _noise(shape, std, seed=1):
    return std * torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _captured(basis, X, cos=0.99):
    if basis.shape[1] == 0:
        return 0
    return int((torch.linalg.svdvals(X @ basis) > cos).sum())


def test_signal_above_the_edge_is_recovered():
    G, X, s = _block()
    m, n = G.shape
    std = 0.2 * float(s[-1]) / (m ** 0.5 + n ** 0.5)  # the weakest direction stands 5x above the edge
    sub = noisy_subspace([G + _noise(G.shape, std)], std)
    assert sub.rank == 5
    assert _captured(sub.basis, X, cos=0.95) == 5
    # a true row-space member passes at the tolerance the edge implies; a random vector does not
    member = X[0] + 0.5 * X[3]
    other = torch.randn(n, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    assert float(sub.residual(member)) < sub.tol < float(sub.residual(other))


def test_signal_below_the_edge_is_not_claimed():
    G, X, s = _block()
    m, n = G.shape
    std = 3.0 * float(s[0]) / (m ** 0.5 + n ** 0.5)  # every direction 3x below the edge
    sub = noisy_subspace([G + _noise(G.shape, std)], std)
    assert sub.rank == 0  # nothing above the edge: no direction, so no member (the attack reports none)
    assert float(sub.residual(X[0])) == 1.0


def test_only_the_directions_above_the_edge_are_kept():
    G, X, s = _block()
    m, n = G.shape
    std = 5.0 / (m ** 0.5 + n ** 0.5)  # edge 5: the 10, 8, 6 directions stand above it, the 4 and 3 below
    sub = noisy_subspace([G + _noise(G.shape, std)], std)
    assert sub.rank == 3
    assert _captured(sub.basis, X[:3], cos=0.85) == 3  # Wedin: the 6 direction, nearest the edge, tilts most


def test_the_margin_predicts_the_noise_that_drowns_the_weakest_direction():
    G, X, s = _block()
    clean = spectral_margin([G], 5)
    assert clean["drowning_noise_std"] == pytest.approx(float(s[-1]) / (G.shape[0] ** 0.5 + G.shape[1] ** 0.5))
    for factor, kept in ((0.5, 5), (2.0, 4)):
        std = factor * clean["drowning_noise_std"]
        noisy = G + _noise(G.shape, std)
        m = spectral_margin([noisy], 5, std)
        assert (m["spectral_margin"] > 1) == (factor < 1)
        assert noisy_subspace([noisy], std).rank <= kept
    assert noisy_subspace([G + _noise(G.shape, 0.5 * clean["drowning_noise_std"])],
                          0.5 * clean["drowning_noise_std"]).rank == 5


def _vocabulary_batch(V=3000, n=64, members=6, m=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    E = torch.randn(V, n, generator=g, dtype=torch.float64)
    idx = torch.randperm(V, generator=g)[:members]
    A = torch.randn(m, members, generator=g, dtype=torch.float64)
    return E, idx, A @ E[idx]


def _prune(G, keep):
    flat = G.reshape(-1)
    k = max(1, int(round(flat.numel() * keep)))
    thr = flat.abs().kthvalue(flat.numel() - k + 1).values
    return torch.where(G.abs() >= thr, G, torch.zeros_like(G))


def test_sparsity_aware_membership_reads_a_pruned_block_on_its_support():
    E, idx, G = _vocabulary_batch()
    P = _prune(G, 0.3)  # 70 % of the coordinates zeroed
    tokens, sub, info = pruned_membership([P], lambda s: s.residual(E))
    found = set(tokens)
    truth = set(idx.tolist())
    # every member; at most one false token (the claimed tokens are capped at the signal rank, here 7 for 6 members:
    # the bulk's lower tail is heavier than the Gaussian the z-rule assumes)
    assert found >= truth and len(found - truth) <= 1
    assert info["sparsity_kept_fraction"] < 0.35


def test_sparsity_aware_membership_returns_nothing_when_the_block_was_pruned_away():
    E, idx, G = _vocabulary_batch()
    P = torch.zeros_like(G)
    P[0, 0] = 1.0  # one coordinate kept of the whole block: the information is absent
    tokens, sub, info = pruned_membership([P], lambda s: s.residual(E))
    assert tokens == [] and info["sparsity_reading"].startswith("information absent")


def test_sparsity_aware_membership_claims_nothing_on_pure_noise():
    """No signal: the vocabulary has no lower outliers, so no token is claimed (the vocabulary is the null)."""
    E, _, G = _vocabulary_batch()
    P = _prune(_noise(G.shape, 1.0, seed=3), 0.3)
    tokens, _, _ = pruned_membership([P], lambda s: s.residual(E))
    assert tokens == []
