"""Intrinsic dimension of per-sample gradients (paper 001 Supp. A, Fig. 2).

Paper 001 argues that LoRA shrinks the manifold the shared gradients lie on (Fig. 2: full fine-tuning vs the
low-rank-adapted ViT-Small) and that trainable layer-wise PEs add "spatially meaningful directions" back. Supp. A
measures it on the sample-wise gradients ``g_i = vec(∇_Θobs ℓ(f(x_i), y_i))`` (eq. 9) with estimators implemented
here as pure functions of a point cloud / matrix (numpy in, floats out):

* :func:`mle_intrinsic_dimension` — Levina & Bickel's MLE with ``k`` nearest neighbours (eq. 10, k = 20),
* :func:`twonn_intrinsic_dimension` — Facco et al. 2017's TwoNN (μ = T₂/T₁, slope of −log(1 − F(μ)) vs log μ),
* :func:`effective_rank` / :func:`energy_ranks` — the entropy effective rank exp(−Σ q log q), q = σ²/Σσ² (eqs.
  14–15, Roy & Vetterli) and r90/r95/r99 = min{r : Σ_{m≤r} σ_m² / Σσ² ≥ τ} (eqs. 16–17),
* :func:`achlioptas_projection` / :class:`AchlioptasProjection` — the sparse random projection of Supp. A.3
  (eq. 18, entries √(3/m)·{+1, 0, −1} with probabilities 1/6, 2/3, 1/6) that makes the huge gradient vectors
  tractable, with :func:`jl_min_dim` / :func:`jl_epsilon` for the JL bound the paper uses (eq. 19),

and :func:`gradient_intrinsic_dimension`, which collects the per-sample gradients of a model's trainable
parameters, projects them and reports every estimator plus the paper's *Jacobian* effective ranks: for a sample
``(x_i, y_i)`` the Jacobian ``J_i = ∂φ(x_i, y_i)/∂x_i`` (eqs. 12–13) of the (projected) gradient map w.r.t. the
input image with the label held fixed — how many input-space directions change the gradient the server sees.

Decisions the paper leaves open, each recorded here:

* **MLE averaging**: eq. 10 averages the *inverse* local estimates over the points and inverts the mean
  (MacKay & Ghahramani's correction of Levina–Bickel), with the ``1/(k − 1)`` normalisation:
  ``d = [ (1/N) Σ_i (1/(k−1)) Σ_{j<k} log(T_k(x_i)/T_j(x_i)) ]⁻¹``. ``average="local"`` gives Levina–Bickel's
  original arithmetic mean of the local estimates instead.
* **TwoNN**: empirical F(μ_(i)) = i/N on the sorted ratios; the largest ``discard_fraction`` of the ratios are
  dropped (Facco et al.: 10 %) and always the last point (F = 1 has −log 0 = ∞); least-squares line *through the
  origin*, d = Σ x y / Σ x² with x = log μ, y = −log(1 − F).
* **Effective rank**: the paper's q = σ²/Σσ² (``power=2``, default); ``power=1`` is Roy & Vetterli's original
  p = σ/Σσ. A zero matrix has effective rank 0 and energy ranks 0. Energy ranks compare the cumulative energy with
  τ up to a relative 1e-10 so that a spectrum built to hit τ exactly is not pushed one rank up by rounding.
* **Neighbours**: Euclidean distances (brute force; the points are few and high-dimensional); a point is never
  its own neighbour; duplicate points (a zero distance) are refused (BadInput) because every log-ratio estimator
  is undefined there.
* **Projection**: generated in blocks of ``ROW_BLOCK × COL_BLOCK`` entries, block (i, j) from its own seed
  derived from ``(seed, i, j)`` (numpy ``SeedSequence``) — the matrix is a deterministic function of
  ``(d_in, d_out, seed)`` that never has to exist in memory (for ViT-S full fine-tuning it would have
  2048 × 21 M entries); :func:`achlioptas_projection` materialises the same matrix for small sizes.
  The paper centres then projects; projection is linear, so we project then centre (the same vectors).
* **Jacobian**: the paper projects to m = 8192 > d_x and takes J of the projected gradient. We take J of a
  separate ``jacobian_dim``-row Achlioptas projection of the gradient (seed + 1), computed *exactly* row by row
  with double-backward vector–Jacobian products (``jacobian_dim`` VJPs per sample). Its ranks are therefore at
  most ``min(jacobian_dim, d_x)``; ``saturated`` says that some sample's top energy rank (r99) exceeds 90 % of
  that cap — then the sketch is too small to resolve the spectrum and the values are lower bounds. The reported
  values are mean ± std over the first ``jacobian_samples`` images.
* **Bootstrap** (the paper's mean ± std over resamples): subsamples of ``bootstrap_fraction`` of the points
  *without* replacement (with replacement would create duplicates, whose zero distances break the estimators).
* **Exact reference**: with N ≪ D the projection is not needed at all — every estimator depends only on the
  pairwise distances / singular values of the centred N × P matrix, i.e. on its N × N Gram matrix. When all raw
  gradients fit in ``memory_bytes`` the result also holds ``exact``: the same estimators on the isometric
  N-dimensional embedding of the raw centred gradients (no projection error).

This module imports nothing of gradleak but its errors and registry (docs/DESIGN.md §2: metrics depend on nothing of
ours); the caller builds the model (full FT / LoRA / LoRA + layer-wise PEs: which parameters ``requires_grad``
decides what the server observes).
"""

from __future__ import annotations

import math
import time
from typing import Callable, Iterable, Literal, Optional, Sequence

import numpy as np
import torch

from gradleak.errors import BadInput
from gradleak.registry import METRICS

#: rows × columns of one generated block of the Achlioptas matrix (1 Mi entries)
ROW_BLOCK = 32
COL_BLOCK = 32768
#: relative slack when comparing cumulative spectral energy with a level τ
ENERGY_RTOL = 1e-10


# ----------------------------------------------------------------------------------------------------------------
# point-cloud estimators
# ----------------------------------------------------------------------------------------------------------------

def _as_points(X, field: str, min_points: int) -> np.ndarray:
    if isinstance(X, torch.Tensor):
        X = X.detach().cpu().double().numpy()
    X = np.asarray(X, dtype=np.float64)
    if X.ndim != 2:
        raise BadInput(field, f"expected an N × D array of points, got shape {X.shape}.", "pass one point per row.")
    if X.shape[0] < min_points:
        raise BadInput(field, f"{X.shape[0]} points are too few (this estimator needs at least {min_points}).",
                       "pass more points, or lower the neighbour count.")
    if not np.isfinite(X).all():
        raise BadInput(field, "the points contain NaN or infinite values.", "remove or fix those points.")
    return X


def neighbour_distances(X, n_neighbors: int, field: str = "X") -> np.ndarray:
    """(N, n_neighbors) Euclidean distances T_1 ≤ … ≤ T_n of every point to its nearest *other* points.

    Raises BadInput if ``n_neighbors ≥ N`` or if two points coincide (a zero distance)."""
    from sklearn.neighbors import NearestNeighbors

    X = _as_points(X, field, 2)
    n = X.shape[0]
    if not 1 <= n_neighbors < n:
        raise BadInput(field, f"{n_neighbors} nearest neighbours need more than {n_neighbors} points, got {n}.",
                       f"use at most {n - 1} neighbours (k < N), or pass more points.")
    dist, _ = NearestNeighbors(n_neighbors=n_neighbors, algorithm="brute").fit(X).kneighbors()  # self excluded
    if (dist[:, 0] <= 0).any():
        raise BadInput(field, f"{int((dist[:, 0] <= 0).sum())} points coincide with another point (distance 0); "
                       "log distance ratios are undefined there.", "remove duplicate points.")
    return dist


@METRICS.register("mle_intrinsic_dimension", "Levina–Bickel MLE of intrinsic dimension, k neighbours, "
                  "MacKay–Ghahramani inverse averaging (paper 001 eq. 10)")
def mle_intrinsic_dimension(X, k: int = 20, *, average: Literal["inverse", "local"] = "inverse") -> float:
    """Levina–Bickel maximum-likelihood intrinsic dimension of the rows of ``X`` with ``k`` neighbours.

    Per point, ``m_i⁻¹ = (1/(k−1)) Σ_{j=1}^{k−1} log(T_k/T_j)``. ``average="inverse"`` (default, paper 001 eq. 10,
    MacKay & Ghahramani): ``d = 1 / mean_i m_i⁻¹``; ``"local"`` (Levina & Bickel 2004): ``d = mean_i m_i``.
    Needs 2 ≤ k < N. Range (0, ∞); ``inf`` when every neighbourhood is equidistant."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 2:
        raise BadInput("k", f"the MLE needs k ≥ 2 neighbours, got {k!r}.", "use k = 20 (the paper's) or any k ≥ 2.")
    if average not in ("inverse", "local"):
        raise BadInput("average", f"unknown averaging {average!r}.", "use 'inverse' (eq. 10) or 'local'.")
    T = neighbour_distances(X, int(k))
    inv = np.log(T[:, -1:] / T[:, :-1]).sum(1) / (k - 1)
    if average == "inverse":
        m = inv.mean()
        return float("inf") if m <= 0 else float(1.0 / m)
    with np.errstate(divide="ignore"):
        return float(np.mean(1.0 / inv))


@METRICS.register("twonn_intrinsic_dimension", "TwoNN intrinsic dimension (Facco et al. 2017): slope through the "
                  "origin of −log(1−F(μ)) vs log μ, μ = T2/T1")
def twonn_intrinsic_dimension(X, discard_fraction: float = 0.1) -> float:
    """TwoNN estimate (Facco, d'Errico, Rodriguez & Laio 2017) of the rows of ``X``.

    μ_i = T₂/T₁; sorted ascending, F(μ_(i)) = i/N; the largest ``discard_fraction`` of the μ (and always the last,
    F = 1) are dropped; d = Σ x y / Σ x² with x = log μ, y = −log(1 − F) (a line through the origin).
    Range (0, ∞); ``inf`` if every kept μ equals 1."""
    f = float(discard_fraction)
    if not 0.0 <= f < 1.0:
        raise BadInput("discard_fraction", f"expected a fraction in [0, 1), got {discard_fraction!r}.",
                       "use 0.1 (Facco et al.).")
    T = neighbour_distances(X, 2)
    n = T.shape[0]
    mu = np.sort(T[:, 1] / T[:, 0])
    keep = min(int(math.floor(n * (1.0 - f))), n - 1)
    if keep < 2:
        raise BadInput("X", f"{n} points leave {keep} ratio(s) after discarding {f:.0%}; the fit needs 2.",
                       "pass more points or lower discard_fraction.")
    x = np.log(mu[:keep])
    y = -np.log1p(-np.arange(1, keep + 1) / n)
    sxx = float(x @ x)
    return float("inf") if sxx == 0 else float(x @ y / sxx)


# ----------------------------------------------------------------------------------------------------------------
# spectra
# ----------------------------------------------------------------------------------------------------------------

def singular_values(J) -> np.ndarray:
    """Singular values (descending, float64) of a matrix (numpy or torch)."""
    if isinstance(J, torch.Tensor):
        J = J.detach().cpu().double().numpy()
    J = np.asarray(J, dtype=np.float64)
    if J.ndim != 2 or 0 in J.shape:
        raise BadInput("J", f"expected a non-empty matrix, got shape {J.shape}.", "pass a 2-D array.")
    if not np.isfinite(J).all():
        raise BadInput("J", "the matrix contains NaN or infinite values.", "fix the matrix.")
    return np.linalg.svd(J, compute_uv=False)


def _spectrum(s) -> np.ndarray:
    s = np.abs(np.asarray(s, dtype=np.float64).ravel())
    if not np.isfinite(s).all():
        raise BadInput("singular_values", "the spectrum contains NaN or infinite values.", "fix the matrix.")
    return np.sort(s)[::-1]


def spectrum_effective_rank(s, power: float = 2.0) -> float:
    """exp(entropy) of q_m = σ_m^power / Σ σ^power (0 for a zero spectrum); see :func:`effective_rank`."""
    s = _spectrum(s)
    w = s ** power
    total = w.sum()
    if total <= 0:
        return 0.0
    q = w[w > 0] / total
    return float(np.exp(-(q * np.log(q)).sum()))


def _level_name(tau: float) -> str:
    return f"r{100 * tau:.10g}"


def spectrum_energy_ranks(s, levels: Sequence[float] = (0.90, 0.95, 0.99)) -> dict[str, int]:
    """{"r90": …, …}: the fewest leading σ whose σ² hold a share ≥ τ of Σσ² (0 for a zero spectrum)."""
    for tau in levels:
        if not 0.0 < float(tau) <= 1.0:
            raise BadInput("levels", f"energy levels are fractions in (0, 1], got {tau!r}.", "use e.g. (0.9, 0.95, 0.99).")
    e = _spectrum(s) ** 2
    total = e.sum()
    if total <= 0:
        return {_level_name(t): 0 for t in levels}
    cum = np.cumsum(e) / total
    return {_level_name(t): int(min(np.searchsorted(cum, float(t) - ENERGY_RTOL, side="left") + 1, len(e)))
            for t in levels}


@METRICS.register("effective_rank", "entropy effective rank exp(−Σ q log q), q = σ²/Σσ² (Roy & Vetterli; paper 001 "
                  "eqs. 14–15), range [0, min(shape)]")
def effective_rank(J, *, power: float = 2.0) -> float:
    """Entropy effective rank of ``J``'s singular values: ``exp(−Σ_m q_m log q_m)``, ``q_m = σ_m²/Σσ²``
    (paper 001 eqs. 14–15; ``power=1``: Roy & Vetterli's original ``σ_m/Σσ``). Identity n×n → n, rank 1 → 1,
    zero matrix → 0. Range [0, min(J.shape)]."""
    return spectrum_effective_rank(singular_values(J), power)


@METRICS.register("energy_ranks", "r90/r95/r99: fewest singular values holding 90/95/99 % of Σσ² (paper 001 eq. 17)")
def energy_ranks(J, levels: Sequence[float] = (0.90, 0.95, 0.99)) -> dict[str, int]:
    """``{"r90": r, "r95": r, "r99": r}`` (keys ``r<100τ>``): ``r_τ = min{r : Σ_{m≤r} σ_m² / Σ σ² ≥ τ}``
    (paper 001 eqs. 16–17). Range [0, min(J.shape)]."""
    return spectrum_energy_ranks(singular_values(J), levels)


# ----------------------------------------------------------------------------------------------------------------
# random projection
# ----------------------------------------------------------------------------------------------------------------

def jl_min_dim(n_points: int, eps: float) -> int:
    """The JL sufficient dimension ``m ≥ 4 ln N / (ε²/2 − ε³/3)`` (paper 001 eq. 19), rounded up."""
    if n_points < 2 or not 0.0 < eps < 1.0:
        raise BadInput("eps", "the JL bound needs N ≥ 2 points and 0 < ε < 1.", "")
    return int(math.ceil(4 * math.log(n_points) / (eps ** 2 / 2 - eps ** 3 / 3)))


def jl_epsilon(n_points: int, dim: int) -> Optional[float]:
    """The distortion ε for which ``dim`` meets eq. 19 with equality for ``n_points`` (None if no ε < 1 does)."""
    if n_points < 2:
        return None
    need = 4 * math.log(n_points) / dim  # = ε²/2 − ε³/3, increasing on (0, 1) up to 1/6
    if need >= 1.0 / 6.0:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mid ** 2 / 2 - mid ** 3 / 3 < need else (lo, mid)
    return hi


class AchlioptasProjection:
    """The ``d_out × d_in`` Achlioptas matrix R, ``R_ab = √(3/d_out)·{+1 w.p. 1/6, 0 w.p. 2/3, −1 w.p. 1/6}``
    (paper 001 eq. 18), so that ``E‖R g‖² = ‖g‖²``; generated block by block, never stored.

    Block (i, j) covers rows ``i·ROW_BLOCK …`` and columns ``j·COL_BLOCK …``; its entries come from a torch
    generator seeded from ``SeedSequence((seed, i, j))`` as ``randint(−1, 5) >> 2`` (−1 → −1, 0…3 → 0, 4 → +1:
    exactly 1/6, 2/3, 1/6)."""

    def __init__(self, d_in: int, d_out: int, seed: int = 0):
        for name, v in (("d_in", d_in), ("d_out", d_out)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise BadInput(name, f"expected a positive integer, got {v!r}.", "")
        self.d_in, self.d_out, self.seed = int(d_in), int(d_out), int(seed)
        self.scale = math.sqrt(3.0 / self.d_out)
        self._gen = torch.Generator()

    @property
    def row_blocks(self) -> int:
        return -(-self.d_out // ROW_BLOCK)

    @property
    def col_blocks(self) -> int:
        return -(-self.d_in // COL_BLOCK)

    def _rows(self, i: int) -> tuple[int, int]:
        return i * ROW_BLOCK, min((i + 1) * ROW_BLOCK, self.d_out)

    def _cols(self, j: int) -> tuple[int, int]:
        return j * COL_BLOCK, min((j + 1) * COL_BLOCK, self.d_in)

    def trits(self, i: int, j: int) -> torch.Tensor:
        """Block (i, j) as int8 in {−1, 0, +1} (multiply by ``scale`` for R's entries)."""
        r0, r1 = self._rows(i)
        c0, c1 = self._cols(j)
        s = int(np.random.SeedSequence((self.seed, i, j)).generate_state(1, np.uint64)[0]) & (2 ** 63 - 1)
        self._gen.manual_seed(s)
        return torch.randint(-1, 5, (r1 - r0, c1 - c0), dtype=torch.int8, generator=self._gen) >> 2

    def row_trits(self, i: int) -> torch.Tensor:
        """Row block i over every column, int8 trits (``(≤ ROW_BLOCK) × d_in``)."""
        return torch.cat([self.trits(i, j) for j in range(self.col_blocks)], 1)

    def matrix(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """R as a dense tensor (small sizes only)."""
        if self.d_in * self.d_out > 2 ** 28:
            raise BadInput("d_in", f"a dense {self.d_out} × {self.d_in} projection has too many entries.",
                           "use AchlioptasProjection(...).project(G), which streams the blocks.")
        return torch.cat([self.row_trits(i) for i in range(self.row_blocks)], 0).to(dtype) * self.scale

    def project(self, G: torch.Tensor) -> torch.Tensor:
        """``G Rᵀ`` for the rows of ``G`` (N × d_in) → N × d_out, streaming the blocks (one generation pass)."""
        if G.ndim != 2 or G.shape[1] != self.d_in:
            raise BadInput("G", f"expected N × {self.d_in}, got {tuple(G.shape)}.", "")
        out = torch.zeros(G.shape[0], self.d_out, dtype=G.dtype)
        for j in range(self.col_blocks):
            c0, c1 = self._cols(j)
            Gj = G[:, c0:c1]
            for i in range(self.row_blocks):
                r0, r1 = self._rows(i)
                out[:, r0:r1] += Gj @ self.trits(i, j).to(G.dtype).T
        return out.mul_(self.scale)


def achlioptas_projection(d_in: int, d_out: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense ``d_out × d_in`` Achlioptas random projection (paper 001 eq. 18; entries √(3/d_out)·{+1, 0, −1}
    with probabilities 1/6, 2/3, 1/6): ``g ↦ R g`` preserves squared norms in expectation. Deterministic in
    ``seed``; the same matrix :class:`AchlioptasProjection` streams for sizes too large to store."""
    return AchlioptasProjection(d_in, d_out, seed).matrix(dtype)


# ----------------------------------------------------------------------------------------------------------------
# gradients of a model
# ----------------------------------------------------------------------------------------------------------------

def _default_loss(output, labels: torch.Tensor) -> torch.Tensor:
    logits = getattr(output, "logits", output)
    return torch.nn.functional.cross_entropy(logits, labels)


def _summary(values: Iterable[float]) -> dict:
    v = np.asarray(list(values), dtype=np.float64)
    return {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0, "values": v.tolist()}


def _point_cloud_report(X: np.ndarray, k: int, discard_fraction: float, levels) -> dict:
    """Every estimator on centred points ``X`` (N × D)."""
    Xc = X - X.mean(0, keepdims=True)
    s = np.linalg.svd(Xc, compute_uv=False)
    return {"mle": mle_intrinsic_dimension(Xc, k), "twonn": twonn_intrinsic_dimension(Xc, discard_fraction),
            "effective_rank": spectrum_effective_rank(s), **spectrum_energy_ranks(s, levels)}


def _gram_embedding(G: torch.Tensor) -> np.ndarray:
    """Rows of an N × N matrix with the same pairwise distances and centred spectrum as the rows of G (N × P):
    the Gram matrix accumulated in float64 over column chunks (no float64 copy of G), double-centred."""
    n = G.shape[0]
    K = torch.zeros(n, n, dtype=torch.float64)
    for c0 in range(0, G.shape[1], 2 ** 20):
        Gj = G[:, c0:c0 + 2 ** 20].double()
        K += Gj @ Gj.T
    H = torch.eye(n, dtype=torch.float64) - 1.0 / n
    K = (H @ K @ H).numpy()
    w, U = np.linalg.eigh((K + K.T) / 2)
    return U * np.sqrt(np.clip(w, 0.0, None))


def gradient_intrinsic_dimension(
        model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, *,
        parameters: Optional[Sequence[str]] = None, loss_fn: Optional[Callable] = None,
        projection_dim: Optional[int] = 2048, seed: int = 0, k: int = 20, discard_fraction: float = 0.1,
        levels: Sequence[float] = (0.90, 0.95, 0.99), jacobian_samples: int = 4, jacobian_dim: int = 256,
        jacobian_batch: int = 8, bootstrap: int = 0, bootstrap_fraction: float = 0.8,
        memory_bytes: int = 4 * 2 ** 30, progress: Optional[Callable[[str], None]] = None) -> dict:
    """Paper 001 Supp. A on ``model``: per-sample gradients of the observed parameters, their intrinsic dimension
    and the Jacobian effective ranks.

    ``images`` (N, C, H, W) are the model's inputs (our ViTs take pixels in [−1, 1]), ``labels`` (N,).
    Observed parameters Θ_obs: ``parameters`` (names) or every parameter with ``requires_grad`` — build the model
    as full fine-tuning (all trainable), LoRA, or LoRA + layer-wise PEs to compare (Fig. 2). ``loss_fn(output,
    labels)`` defaults to cross-entropy on the logits. The model runs in eval mode (restored afterwards).

    Gradients g_i (flattened, concatenated; a parameter the loss does not reach contributes zeros) are projected
    with :class:`AchlioptasProjection` to ``projection_dim`` (``None``: no projection), centred, and measured:
    MLE (``k``), TwoNN, and the effective rank / energy ranks of the N × D gradient matrix. The Jacobian
    ``J_i = ∂(R_J g(x_i, y_i))/∂x_i`` (``jacobian_dim`` × d_x, R_J an Achlioptas projection with seed + 1) is
    computed exactly with ``jacobian_dim`` double-backward VJPs for the first ``jacobian_samples`` images
    (0: skipped; it needs double backward: HF eager attention, as our ViT builders set, not SDPA; a float64 model
    should use ``gradleak.models.attention.use_precise_eager``). ``bootstrap`` > 0 adds mean ± std of the
    point-cloud estimators over that many subsamples of ``bootstrap_fraction`` of the points. See the module docstring for every convention.

    Returns a JSON-ready dict: ``samples``, ``gradient_coordinates`` (P), ``projection_dim``, ``jl_epsilon``,
    ``mle``, ``twonn``, ``effective_rank``, ``r90``/``r95``/``r99``, ``jacobian`` {``rows``, ``input_dim``,
    ``effective_rank``/``r90``… each {mean, std, values}, ``cap``, ``saturated``}, ``exact`` (same estimators
    without projection, when the raw gradients fit in ``memory_bytes``; else None), ``bootstrap``, ``seconds``."""
    say = progress or (lambda _msg: None)
    t_start = time.perf_counter()
    named = dict(model.named_parameters())
    names = _observed_names(named, parameters)
    params = [named[n] for n in names]
    sizes = [p.numel() for p in params]
    P = int(sum(sizes))
    images = torch.as_tensor(images)
    labels = torch.as_tensor(labels)
    N = _checked_points(images, labels, k, projection_dim)
    loss_fn = loss_fn or _default_loss
    was_training = model.training
    model.eval()
    flags = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(True)
    try:
        t0 = time.perf_counter()
        proj = AchlioptasProjection(P, int(projection_dim), seed) if projection_dim is not None else None
        X, raw = _projected_gradients(model, images, labels, params, loss_fn, proj, memory_bytes, say)
        t_grad = time.perf_counter() - t0
        result = {"samples": N, "gradient_coordinates": P, "observed_parameters": len(names),
                  "projection_dim": int(projection_dim) if projection_dim is not None else None,
                  "jl_epsilon": jl_epsilon(N, int(projection_dim)) if projection_dim is not None else 0.0,
                  "k": k, "discard_fraction": discard_fraction,
                  **_point_cloud_report(X, k, discard_fraction, levels)}
        result["exact"] = (_point_cloud_report(_gram_embedding(raw), k, discard_fraction, levels)
                           if raw is not None and proj is not None else None)
        del raw
        result["bootstrap"] = (_bootstrap_report(X, k, discard_fraction, levels, int(bootstrap), bootstrap_fraction,
                                                 seed) if bootstrap else None)
        t1 = time.perf_counter()
        result["jacobian"] = (_jacobian_report(model, images, labels, params, sizes, loss_fn, jacobian_samples,
                                               jacobian_dim, jacobian_batch, seed + 1, levels, say)
                              if jacobian_samples else None)
        result["seconds"] = {"gradients_and_projection": t_grad, "jacobian": time.perf_counter() - t1,
                             "total": time.perf_counter() - t_start}
        return result
    finally:
        for p, f in zip(params, flags):
            p.requires_grad_(f)
        model.train(was_training)


def _observed_names(named: dict[str, torch.nn.Parameter], parameters: Optional[Sequence[str]]) -> list[str]:
    """The observed parameters Θ_obs of :func:`gradient_intrinsic_dimension`: ``parameters`` (checked against the
    model's names) or every parameter with ``requires_grad``; at least one."""
    if parameters is None:
        names = [n for n, p in named.items() if p.requires_grad]
    else:
        unknown = [n for n in parameters if n not in named]
        if unknown:
            raise BadInput("parameters", f"the model has no parameter named {unknown[0]!r}.",
                           "pass names from model.named_parameters().")
        names = list(parameters)
    if not names:
        raise BadInput("parameters", "no observed parameter: nothing in the model requires grad.",
                       "make the parameters the clients train trainable (full FT, LoRA, PEs).")
    return names


def _checked_points(images: torch.Tensor, labels: torch.Tensor, k: int, projection_dim: Optional[int]) -> int:
    """The number of points N of :func:`gradient_intrinsic_dimension`, after checking one label per image, enough
    points for MLE with ``k`` neighbours and TwoNN, and ``projection_dim``."""
    N = int(images.shape[0])
    if images.ndim < 2 or labels.shape[:1] != (N,):
        raise BadInput("labels", f"expected one label per image ({N}), got shape {tuple(labels.shape)}.", "")
    min_points = max(k + 1, 3)
    if N < min_points:
        raise BadInput("images", f"{N} images are too few: MLE with k = {k} needs k < N (and TwoNN 3 points).",
                       f"pass at least {min_points} images or lower k.")
    if projection_dim is not None and (isinstance(projection_dim, bool) or int(projection_dim) < 1):
        raise BadInput("projection_dim", f"expected a positive integer or None, got {projection_dim!r}.", "")
    return N


def _projected_gradients(model, images: torch.Tensor, labels: torch.Tensor, params: Sequence[torch.Tensor],
                         loss_fn: Callable, proj: Optional["AchlioptasProjection"], memory_bytes: int,
                         say: Callable[[str], None]) -> tuple[np.ndarray, Optional[torch.Tensor]]:
    """Every image's flattened per-sample gradient of ``params`` (zeros where the loss does not reach a parameter),
    computed in groups that fit ``memory_bytes`` and projected by ``proj`` (``None``: kept raw). Returns the N × D
    matrix (float64) and the raw N × P gradients when they fit in one group (else ``None``)."""
    N = int(images.shape[0])
    P = int(sum(p.numel() for p in params))
    dtype = params[0].dtype
    group = max(1, min(N, memory_bytes // max(1, P * torch.finfo(dtype).bits // 8)))
    chunks, raw = [], None
    for start in range(0, N, group):
        stop = min(N, start + group)
        buf = torch.empty(stop - start, P, dtype=dtype)
        for r, i in enumerate(range(start, stop)):
            loss = loss_fn(model(images[i:i + 1].to(dtype)), labels[i:i + 1])
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(grads, params)],
                      out=buf[r])
        say(f"gradients {stop}/{N}")
        chunks.append(proj.project(buf) if proj is not None else buf)
        if group >= N:
            raw = buf
    return torch.cat(chunks).double().numpy(), raw


def _bootstrap_report(X: np.ndarray, k: int, discard_fraction: float, levels: Sequence[float], bootstrap: int,
                      bootstrap_fraction: float, seed: int) -> dict:
    """Mean ± std of the point-cloud estimators over ``bootstrap`` subsamples of ``bootstrap_fraction`` of the
    points of ``X`` (without replacement, seeded)."""
    N = X.shape[0]
    rng = np.random.default_rng(seed)
    m = int(round(bootstrap_fraction * N))
    if m <= k:
        raise BadInput("bootstrap_fraction", f"subsamples of {m} points cannot hold k = {k} neighbours.",
                       "raise bootstrap_fraction or lower k.")
    reps = [_point_cloud_report(X[np.sort(rng.choice(N, m, replace=False))], k, discard_fraction, levels)
            for _ in range(bootstrap)]
    return {"resamples": bootstrap, "subsample": m, **{key: _summary(r[key] for r in reps) for key in reps[0]}}


def input_jacobian(model, x: torch.Tensor, y: torch.Tensor, params: Sequence[torch.Tensor],
                   projection: AchlioptasProjection, *, loss_fn: Optional[Callable] = None,
                   batch: int = 8) -> torch.Tensor:
    """``J = ∂(R g(x, y))/∂x`` (``projection.d_out`` × x.numel()) for one input ``x`` (1, …) and label ``y`` (1,):
    g = the flattened gradient of ``loss_fn(model(x), y)`` w.r.t. ``params``, R = ``projection``; exact, one
    double-backward VJP per row (``batch`` rows at a time via ``is_grads_batched``)."""
    loss_fn = loss_fn or _default_loss
    sizes = [p.numel() for p in params]
    if projection.d_in != sum(sizes):
        raise BadInput("projection", f"projects {projection.d_in} coordinates, the gradient has {sum(sizes)}.", "")
    x = x.detach().clone().requires_grad_(True)
    grads = torch.autograd.grad(loss_fn(model(x), y), params, create_graph=True, allow_unused=True)
    live = [(g, off, n) for g, off, n in zip(grads, np.cumsum([0] + sizes[:-1]).tolist(), sizes)
            if g is not None and g.requires_grad]
    J = torch.zeros(projection.d_out, x.numel(), dtype=x.dtype)
    if not live:
        return J
    outs = [g for g, _, _ in live]
    for i in range(projection.row_blocks):
        r0, _ = projection._rows(i)
        block = projection.row_trits(i)
        for b0 in range(0, block.shape[0], batch):
            rows = block[b0:b0 + batch].to(x.dtype).mul_(projection.scale)
            cots = [rows[:, off:off + n].reshape(rows.shape[0], *g.shape) for g, off, n in live]
            if rows.shape[0] == 1:
                (v,) = torch.autograd.grad(outs, x, [c[0] for c in cots], retain_graph=True, allow_unused=True)
                v = None if v is None else v.unsqueeze(0)
            else:
                (v,) = torch.autograd.grad(outs, x, cots, retain_graph=True, allow_unused=True, is_grads_batched=True)
            if v is not None:
                J[r0 + b0:r0 + b0 + rows.shape[0]] = v.reshape(rows.shape[0], -1)
    return J


def _jacobian_report(model, images, labels, params, sizes, loss_fn, n_samples, dim, batch, seed, levels, say) -> dict:
    n = min(int(n_samples), int(images.shape[0]))
    proj = AchlioptasProjection(int(sum(sizes)), int(dim), seed)
    d_x = int(images[0].numel())
    cap = min(int(dim), d_x)
    per = []
    for i in range(n):
        J = input_jacobian(model, images[i:i + 1].to(params[0].dtype), labels[i:i + 1], params, proj,
                           loss_fn=loss_fn, batch=batch)
        s = singular_values(J)
        per.append({"effective_rank": spectrum_effective_rank(s), **spectrum_energy_ranks(s, levels)})
        say(f"jacobian {i + 1}/{n}")
    keys = list(per[0])
    top = _level_name(max(levels))
    return {"samples": n, "rows": int(dim), "input_dim": d_x, "cap": cap,
            "saturated": any(r[top] > 0.9 * cap for r in per),
            **{key: _summary(r[key] for r in per) for key in keys}}


METRICS.register("gradient_intrinsic_dimension", "paper 001 Supp. A on a model: per-sample gradient MLE/TwoNN/"
                 "effective rank after an Achlioptas projection, and the input-Jacobian effective ranks")(
    gradient_intrinsic_dimension)
