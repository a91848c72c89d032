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

    With the noise std known (declared, or read off the upload), also the information limit of the spectrum:

    * ``directions_above_edge`` -- how many singular values stand above the edge (1.05 x, as the attacks' noise-edge
      cut): the signal directions any subspace attacker can separate from the noise;
    * ``margin_strongest`` -- the largest singular value over the edge (does not saturate at the cut: ≤ 1 means no
      direction at all stands out);
    * ``debiased_strongest`` / ``debiased_weakest_above_edge`` -- the signal singular values behind the strongest and
      the weakest above-edge observed ones, debiased for the noise (spiked rectangular model, Benaych-Georges &
      Nadakuditi 2012; the inversion Gavish & Donoho 2017 use for optimal shrinkage: with x = s/(τ√n), c = M/n,
      θ/(τ√n) = ((x² − 1 − c + ((x² − 1 − c)² − 4c)^{1/2}) / 2)^{1/2}).

    Singular values of the raw rows (not row-normalised), so the numbers are on the upload's own scale."""
    rows = stack_rows(grads)
    M, n = rows.shape
    if rows.numel() == 0:
        return {"spectral_margin": float("nan"), "drowning_noise_std": 0.0, "drowning_noise_std_all": 0.0,
                "signal_rank": 0.0}
    s = torch.linalg.svdvals(rows)
    k = min(int(rank), len(s))
    scale = M ** 0.5 + n ** 0.5
    edge = float(noise_std) * scale if noise_std else float("nan")
    # an attack that used no direction (rank 0) has no weakest-used margin, but the spectrum's limit is still read
    out = {"spectral_margin": float(s[k - 1]) / edge if noise_std and k >= 1 else float("nan"),
           "drowning_noise_std": float(s[k - 1]) / scale if k >= 1 else 0.0,
           "drowning_noise_std_all": float(s[0]) / scale, "signal_rank": float(max(k, 0))}
    if noise_std:
        above = int((s > 1.05 * edge).sum())
        out.update({"directions_above_edge": float(above), "margin_strongest": float(s[0]) / edge,
                    "debiased_strongest": debias_singular_value(float(s[0]), float(noise_std), M, n),
                    "debiased_weakest_above_edge": (debias_singular_value(float(s[above - 1]), float(noise_std), M, n)
                                                    if above else 0.0)})
    return out


def debias_singular_value(s: float, noise_std: float, M: int, n: int) -> float:
    """The signal singular value behind an observed one ``s`` of an M × n matrix with i.i.d. noise of std
    ``noise_std`` (spiked model; 0 at or below the edge τ(√M + √n)): see :func:`spectral_margin`."""
    big, small = max(M, n), min(M, n)
    c = small / big
    x2 = (s / (noise_std * big ** 0.5)) ** 2
    b = x2 - 1 - c
    disc = b * b - 4 * c
    if b <= 0 or disc < 0:
        return 0.0
    return noise_std * big ** 0.5 * ((b + disc ** 0.5) / 2) ** 0.5


def is_pruned(grads: list[torch.Tensor], min_fraction: float = 0.01) -> bool:
    """Whether the upload was top-k pruned: at least ``min_fraction`` of the entries of its nonzero rows are exactly
    zero (a gradient row is a sum of dense inputs, so it has no exact zeros; whole zero rows -- a neuron that did not
    fire -- are not pruning). The kept support (the nonzeros) is then known to the server."""
    rows = stack_rows(grads)
    mask = rows != 0
    live = mask.any(1)
    return bool(live.any()) and float((~mask[live]).double().mean()) >= min_fraction


def pruned_membership(grads: list[torch.Tensor], residuals, exclude: list[int] | None = None,
                      z: float = 6.0, rank: int | None = None) -> tuple[list[int], Subspace, dict]:
    """Sparsity-aware membership for a top-k pruned upload (the server knows the support: the nonzeros).

    Pruning keeps the largest entries, so the zero-filled upload is the true gradient plus an error whose entries are
    bounded by the smallest kept magnitude; its top singular directions still align with the signal's (measured on
    MiniLM's embedding-adapter gradient, docs/REPRODUCTION.md). The error is neither i.i.d. nor known, so the rank
    is cut at the noise edge of a Gavish-Donoho estimate of its level (:func:`estimate_noise_std`), and the tolerance
    is not Wedin's: a member's residual is inflated by the directions' angle error, a non-member's sits near
    sqrt(1 - rank / n). Every candidate is scored (``residuals(sub)``: one residual per vocabulary entry) and the
    members are the lower outliers of that distribution -- below its median by more than ``z`` robust standard
    deviations (1.4826 x MAD) -- at most ``rank`` of them (one signal direction per member). The vocabulary is the
    null: a threshold that chance would cross once in ~10^9 draws of the bulk.

    ``rank``: use exactly the ``rank`` strongest directions of the (raw) rows instead of the cut at the estimated
    error's edge -- the oracle ceiling's reading of an upload through its K strongest directions (UTR's
    ``directions``), the same outlier test on them; ``sparsity_noise_std`` is then None.

    Returns ``(tokens, subspace, info)``; info holds the kept fraction, the noise estimate, the threshold and the
    residuals (for the diagnostics)."""
    rows = stack_rows(grads)
    mask = rows != 0
    info: dict = {"sparsity_kept_fraction": float(mask.double().mean()), "sparsity_aware": True}
    rows = rows[mask.any(1)]
    n = rows.shape[-1]
    if rows.shape[0] < 2 or int(mask.sum()) < 2:
        info.update({"sparsity_noise_std": None, "sparsity_threshold": 0.0, "residuals": None,
                     "sparsity_reading": "information absent: the pruning removed this matrix (fewer than 2 kept rows)"})
        return [], Subspace(torch.zeros(n, 0, dtype=torch.float64), torch.zeros(0, dtype=torch.float64), 0,
                            rows.shape[0], n), info
    if rank is not None:
        _, s, vh = torch.linalg.svd(rows, full_matrices=False)
        k = max(0, min(int(rank), int((s > 0).sum())))
        sigma, sub = None, Subspace(vh[:k].T.contiguous(), s, k, rows.shape[0], n)
    else:
        sigma = estimate_noise_std([rows])
        sub = noisy_subspace([rows], sigma)
    info["sparsity_noise_std"] = sigma
    if sub.rank == 0:
        info.update({"sparsity_threshold": 0.0, "residuals": None,
                     "sparsity_reading": "information absent: no direction above the pruning error's edge"})
        return [], sub, info
    res = residuals(sub).to(torch.float64)
    ok = torch.isfinite(res)
    for v in exclude or []:
        if v is not None and 0 <= int(v) < len(ok):
            ok[int(v)] = False
    med = res[ok].median()
    mad = (res[ok] - med).abs().median().clamp_min(1e-12)
    thr = float(med - z * 1.4826 * mad)
    cand = (ok & (res < thr)).nonzero().flatten()
    cand = cand[res[cand].argsort()][: sub.rank]
    info.update({"sparsity_threshold": thr, "residuals": res, "sparsity_rank": sub.rank,
                 "sparsity_null_median": float(med), "sparsity_reading": "ok"})
    return sorted(int(v) for v in cand), sub, info
