"""Gradient row spaces and the membership test every span-based text attack runs (UTR paper Sec. 4.2, DAGER).

The rows of a linear layer's weight gradient are sums of that layer's inputs, so the stacked rows span the inputs of
the batch: :func:`subspace_from_gradients` builds an orthonormal basis of that span (SVD in float64) and
:meth:`Subspace.residual` tests candidate inputs by their relative residual. Under a noise defense the rank comes from
the noise spectrum's edge (:func:`noisy_subspace`); :func:`estimate_noise_std` reads the noise level off the
spectrum when it is not published.

Open decisions recorded (open points A3.2/A3.3, docs/PAPERS.md): S from raw gradient rows (not row/bias ratios: same span, better
conditioned); relative residuals; rank cut-off relative to the largest singular value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

@dataclass
class Subspace:
    basis: torch.Tensor  # (n, r) orthonormal, float64
    singular_values: torch.Tensor
    rank: int
    rows: int  # number of gradient rows stacked (the bottleneck width per observed update)
    dim: int  # ambient dimension n
    noise_edge: float = 0.0  # noise mode: the edge sigma (sqrt(rows) + sqrt(n)) of the noise spectrum (0: exact mode)
    tol: float = 0.0  # noise mode: the membership tolerance the noise floor implies (edge / weakest kept value)

    @property
    def saturated(self) -> bool:
        """True when the rank reached the bottleneck width (or the ambient dimension): capacity exhausted."""
        return self.rank >= min(self.rows, self.dim)

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        """Relative residual ||x - P x|| / ||x|| along the last dimension (float64)."""
        x = x.to(torch.float64)
        coef = x @ self.basis
        perp = x - coef @ self.basis.T
        return perp.norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-300)


def gap_index(desc: torch.Tensor, ratio: float = 20.0, below: float = 1.0, largest: bool = False) -> int | None:
    """Index i of a drop desc[i] / desc[i+1] > ``ratio`` in a descending sequence (values after the drop below
    ``below`` * desc[0]): the first such drop, or the largest one with ``largest``. None if there is none."""
    if len(desc) < 2:
        return None
    drop = desc[:-1] / desc[1:].clamp_min(1e-300)
    ok = (drop > ratio) & (desc[1:] < below * desc[0])
    if not bool(ok.any()):
        return None
    return int(torch.where(ok, drop, torch.zeros_like(drop)).argmax()) if largest else int(ok.nonzero()[0])


def stack_rows(grads: list[torch.Tensor]) -> torch.Tensor:
    """The (sum m_i, n) float64 matrix of the stacked gradient rows."""
    return torch.cat([g.detach().to(torch.float64).reshape(-1, g.shape[-1]) for g in grads], 0)


def noisy_subspace(grads: list[torch.Tensor], noise_std: float, margin: float = 1.05,
                   max_rank: int | None = None) -> Subspace:
    """Signal subspace of gradients observed through i.i.d. N(0, noise_std^2) noise on every coordinate.

    The singular values of an M x n matrix of such noise stay below the edge noise_std (sqrt(M) + sqrt(n))
    (Bai-Yin; the Marchenko-Pastur bulk's end), so a direction is signal only when its singular value stands above
    ``margin`` x the edge; below it no test of this matrix can tell it from noise. Rows are *not* normalised (that
    would scale the noise row by row). The tolerance a true member needs grows as the kept directions approach the
    edge: by Wedin's sin-theta bound the estimated basis is off by about edge / s for a direction of singular value
    s, so ``tol`` = edge / s_r (s_r the weakest kept value), capped at 0.5."""
    rows = stack_rows(grads)
    M, n = rows.shape
    _, s, vh = torch.linalg.svd(rows, full_matrices=False)
    edge = float(noise_std) * (M ** 0.5 + n ** 0.5)
    r = int((s > margin * edge).sum())
    if max_rank is not None:
        r = min(r, max_rank)
    tol = min(0.5, edge / float(s[r - 1])) if r else 0.5
    return Subspace(vh[:r].T.contiguous(), s, r, sum(g.shape[0] for g in grads), n, noise_edge=edge, tol=tol)


def subspace_from_gradients(grads: list[torch.Tensor], rank_rtol: float = 1e-5, max_rank: int | None = None,
                            noise_std: float | None = None) -> Subspace:
    """Orthonormal basis of the row space of the stacked (m_i x n) gradients, by SVD in float64.

    ``noise_std`` (> 0): the observed coordinates carry i.i.d. Gaussian noise of that std (a DP / noise defense);
    the rank then comes from the noise spectrum's edge (:func:`noisy_subspace`), not from the float32 gap rule."""
    if noise_std:
        return noisy_subspace(grads, noise_std, max_rank=max_rank)
    rows = stack_rows(grads)
    rows = rows[rows.abs().sum(1) > 0]
    n = rows.shape[1] if rows.ndim == 2 else grads[0].shape[-1]
    if rows.numel() == 0:
        return Subspace(torch.zeros(n, 0, dtype=torch.float64), torch.zeros(0, dtype=torch.float64), 0,
                        sum(g.shape[0] for g in grads), n)
    # Scale rows to unit norm: rank decisions then do not depend on how strongly each neuron fired.
    rows = rows / rows.norm(dim=1, keepdim=True)
    _, s, vh = torch.linalg.svd(rows, full_matrices=False)
    r = int((s > rank_rtol * s[0]).sum())
    # Numerical rank by the noise-floor gap: float32 gradients put the true directions' weakest singular values
    # (tokens with small upstream gradients) within 1e-5 of the largest, and the noise floor ~10^2 below them.
    # The largest drop of more than 20x between consecutive values below 1e-3 * s[0] marks the rank -- the largest,
    # not the first: weak true directions can step down too (measured, MiniLM rf=2 WordNet B=4 seed 4242, 35
    # layer states: 1.1e-2 -> 4.1e-4 (27.8x) at 32, then the noise floor 1.05e-4 -> 1.3e-8 (7932x) at 35; the
    # first drop cut the rank to 32 and no true sentence verified)
    if len(s) > 1 and float(s[0]) > 0:
        k = gap_index(s, below=1e-3, largest=True)
        if k is not None:
            r = k + 1
    r = max(r, 1)
    if max_rank is not None:
        r = min(r, max_rank)
    return Subspace(vh[:r].T.contiguous(), s, r, sum(g.shape[0] for g in grads), n)


def _mp_median(beta: float) -> float:
    """Median of the Marchenko-Pastur law with aspect ratio beta in (0, 1] (unit variance), by quadrature."""
    import numpy as np

    a, b = (1 - beta ** 0.5) ** 2, (1 + beta ** 0.5) ** 2
    x = np.linspace(a, b, 20001)[1:-1]
    f = np.sqrt((b - x) * (x - a)) / (2 * np.pi * beta * x)
    cdf = np.cumsum(f) * (x[1] - x[0])
    return float(x[np.searchsorted(cdf, 0.5 * cdf[-1])])


def estimate_noise_std(grads: list[torch.Tensor]) -> float:
    """Per-coordinate noise std of stacked gradients from their median singular value (Gavish-Donoho 2014):
    sigma = s_med / sqrt(N mu_beta) for an M x N (M <= N) matrix; biased upwards when the signal's rank is a
    sizeable fraction of M."""
    rows = stack_rows(grads)
    M, N = sorted(rows.shape)
    s = torch.linalg.svdvals(rows)
    return float(s.median()) / (N * _mp_median(M / N)) ** 0.5


def spectral_margin(grads: list[torch.Tensor], rank: int, noise_std: float | None = None) -> dict[str, float]:
    """How far the observed upload's signal stands from the noise (the leakage margin), for the ``rank`` directions an
    attack uses of the stacked (M x n) gradient rows:

    * ``spectral_margin`` -- the weakest used singular value s_rank over the noise edge noise_std (sqrt(M) + sqrt(n))
      (> 1: it stands above pure noise of that level; nan without declared or estimated noise);
    * ``drowning_noise_std`` -- the per-coordinate noise std at which that edge reaches s_rank: noise of this std
      drowns the weakest direction the attack needs (Bai-Yin edge, as :func:`noisy_subspace`);
    * ``drowning_noise_std_all`` -- the std at which the edge reaches the largest singular value: every direction
      drowned, nothing a spectral test of this matrix can find.

    Singular values of the raw rows (not row-normalised), so the numbers are on the upload's own scale."""
    rows = stack_rows(grads)
    M, n = rows.shape
    if rows.numel() == 0 or rank < 1:
        return {"spectral_margin": float("nan"), "drowning_noise_std": 0.0, "drowning_noise_std_all": 0.0}
    s = torch.linalg.svdvals(rows)
    k = min(int(rank), len(s))
    scale = M ** 0.5 + n ** 0.5
    edge = float(noise_std) * scale if noise_std else float("nan")
    return {"spectral_margin": float(s[k - 1]) / edge if noise_std else float("nan"),
            "drowning_noise_std": float(s[k - 1]) / scale, "drowning_noise_std_all": float(s[0]) / scale,
            "signal_rank": float(k)}


def support_mask(grads: list[torch.Tensor]) -> torch.Tensor | None:
    """The retained support of a pruned upload (True where a coordinate was kept), stacked as :func:`stack_rows`;
    None when nothing was pruned (every coordinate nonzero)."""
    rows = stack_rows(grads)
    mask = rows != 0
    return None if bool(mask.all()) else mask


def masked_membership(rows: torch.Tensor, mask: torch.Tensor, candidates: torch.Tensor, rank: int,
                      min_kept: int | None = None) -> torch.Tensor:
    """Sparsity-aware membership of candidate input vectors in the row space of a top-k pruned gradient.

    Each gradient row is g_j = sum_t a_jt x_t; pruning keeps g_j only on its support S_j (known to the server: the
    nonzeros). Restricted to S_j the identity still holds: g_j|S_j = sum_t a_jt x_t|S_j. So for a candidate x the
    test is whether it explains the kept rows jointly with the other members: we recover the row space from the
    *rows with enough kept coordinates*, completing each such row on its unseen coordinates by alternating
    projection onto the rank-``rank`` row space (masked low-rank completion, a few iterations of hard impute), and
    score every candidate by its relative residual to that space. Rows with fewer than ``min_kept`` kept coordinates
    (default 2 x rank) carry too little to complete and are dropped. Returns the residuals (one per candidate);
    the caller thresholds them against a null of non-member candidates."""
    rows = rows.to(torch.float64)
    mask = mask.to(torch.bool)
    need = int(min_kept if min_kept is not None else 2 * max(rank, 1))
    keep = mask.sum(1) >= need
    if int(keep.sum()) == 0:
        return torch.full((len(candidates),), float("nan"), dtype=torch.float64)
    R, Mk = rows[keep], mask[keep]
    X = R.clone()
    k = max(1, min(int(rank), min(X.shape)))
    for _ in range(30):  # hard impute: project on rank k, keep the observed entries, fill the rest
        U, S, Vh = torch.linalg.svd(X, full_matrices=False)
        low = (U[:, :k] * S[:k]) @ Vh[:k]
        X_new = torch.where(Mk, R, low)
        if float((X_new - X).norm()) <= 1e-10 * float(X.norm().clamp_min(1e-300)):
            X = X_new
            break
        X = X_new
    _, _, Vh = torch.linalg.svd(X, full_matrices=False)
    basis = Vh[:k].T
    c = candidates.to(torch.float64)
    perp = c - (c @ basis) @ basis.T
    return perp.norm(dim=-1) / c.norm(dim=-1).clamp_min(1e-300)


def _hard_impute(R: torch.Tensor, M: torch.Tensor, k: int, iters: int = 60) -> torch.Tensor:
    """Rank-k completion of R observed on mask M (hard impute: project on rank k, restore the observed entries)."""
    X = torch.where(M, R, torch.zeros_like(R))
    for _ in range(iters):
        U, S, Vh = torch.linalg.svd(X, full_matrices=False)
        low = (U[:, :k] * S[:k]) @ Vh[:k]
        X_new = torch.where(M, R, low)
        if float((X_new - X).norm()) <= 1e-9 * float(X.norm().clamp_min(1e-300)):
            return X_new
        X = X_new
    return X


def complete_pruned(grads: list[torch.Tensor], max_rank: int | None = None, seed: int = 0,
                    ranks: list[int] | None = None) -> tuple[list[torch.Tensor], float, dict] | None:
    """Sparsity-aware reading of a top-k pruned upload: the server knows which coordinates were kept (the nonzeros).

    Each gradient row is a combination of the batch's inputs, so the stacked rows are low rank; pruning observes
    them on a known support. We complete the matrix on the rows that kept at least 4 coordinates (a row with fewer
    carries almost nothing of the row space) by hard impute, choosing the rank by held-out error: 10 % of the kept
    entries are hidden, each candidate rank completes the rest, and the rank whose completion predicts the hidden
    entries best wins (then the completion is redone on every kept entry). The held-out error per entry is returned as
    the completion's noise std, so the membership tests downstream run in noise mode with tolerances from it.

    Returns ``(completed grads (one stacked matrix), noise std, info)``, or None when nothing was pruned (no row is
    partially zero)."""
    rows = stack_rows(grads)
    mask = rows != 0
    partial = mask.any(1) & ~mask.all(1)
    if not bool(partial.any()):
        return None
    keep = mask.sum(1) >= 4
    info: dict = {"sparsity_kept_fraction": float(mask.double().mean()), "sparsity_rows_used": int(keep.sum()),
                  "sparsity_rows": int(rows.shape[0])}
    if int(keep.sum()) < 2:
        info["sparsity_completion"] = "too few kept coordinates: the word bag's matrix was pruned away"
        return [rows[:0]], float("nan"), info
    R, Mk = rows[keep], mask[keep]
    m, n = R.shape
    cap = min(m, n) - 1 if max_rank is None else min(max_rank, min(m, n) - 1)
    obs = Mk.nonzero()
    g = torch.Generator().manual_seed(seed)
    hide = obs[torch.randperm(len(obs), generator=g)[: max(1, len(obs) // 10)]]
    train = Mk.clone()
    train[hide[:, 0], hide[:, 1]] = False
    truth = R[hide[:, 0], hide[:, 1]]
    cands = ranks or sorted({k for k in (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128) if k <= cap} | {cap})
    errs = {}
    for k in cands:
        if int(train.sum()) <= k * (m + n - k):  # more unknowns than observations: not identifiable at this rank
            break
        X = _hard_impute(R, train, k)
        errs[k] = float(((X[hide[:, 0], hide[:, 1]] - truth) ** 2).mean().sqrt())
    if not errs:
        info["sparsity_completion"] = "not identifiable: fewer kept coordinates than a rank-1 completion needs"
        return [rows[:0]], float("nan"), info
    k = min(errs, key=errs.get)
    X = _hard_impute(R, Mk, k)
    info.update({"sparsity_completion": "ok", "sparsity_completion_rank": k,
                 "sparsity_heldout_rmse": errs[k], "sparsity_heldout_rel": errs[k] / float(truth.abs().mean() + 1e-300)})
    return [X], errs[k], info
