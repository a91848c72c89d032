"""PEFTLeak under upload noise (``attack.noise``; extends PEFTLeak Sec. 4.3, eqs. (24)–(25), which assume the server
reads the adapter gradients exactly): the noise level, a calibrated occupancy test per bin, a patch estimate whose
error is known, and the consistency / trust / peeling / grouping checks of :mod:`.recovery` with tolerances derived
from the noise instead of float64 rounding. docs/DESIGN.md §6: the server attacks at full strength against the
declared defenses.

**Noise model.** A declared defense (Gaussian upload noise, DP-Gaussian, DP-SGD, …) adds i.i.d. N(0, σ²) to every
coordinate of the upload. For bin j of an adapter (neuron j minus neuron j+1; the top bin is the top neuron alone)
the difference (ΔW_j, Δb_j) then carries N(0, 2σ²) per coordinate (σ² for the top bin).

**σ** (``noise``): ``public`` — what the declared defenses imply
(:func:`gradleak.defenses.declared.view_noise_std`, per observed upload, so a relative noise follows each round's
norm); ``estimate`` — read off the upload (:func:`structural_noise_std`): the adapter input of every poisoned slot
is a LayerNorm output with bias 0, hence *centred*, so every row of every attacked ``down.weight`` gradient is
orthogonal to the all-ones vector by the server's design. Its projection ``1ᵀ∇W_j / √D`` is pure noise, one
N(0, σ²) draw per row (r × slots per round, no signal to trim, unlike a MAD of "mostly empty" bins, which a
crowded batch biases); a float — a known σ.

**Occupancy test.** Bin j is occupied when ``(‖ΔW_j‖² + Δb_j²) / v_j`` (v_j = 2σ², σ² for the top bin) exceeds the
χ²_{D+1} quantile at ``noise_false_alarm / n_bins`` (Bonferroni over every usable bin of every observed round), so
pure noise yields no claimed bin with probability ≥ 1 − ``noise_false_alarm``. The row statistic is far more
sensitive than ``|Δb_j| > z·σ·√2`` alone (the row holds D coordinates of a lone patch's gradient, ‖ΔW_j‖ ≈ 100·|Δb_j|
on the poisoned ViT). Every other tolerance uses ``z``, the two-sided normal quantile at the same level.

**Patch estimate (measured decision).** Eq. (24)'s ratio ``h = ΔW/Δb`` followed by the LayerNorm undo of eq. (25)
is ill-conditioned in Δb: the undo solves φ(v)²v = ‖h‖²/D, and after the first slot φ(v)²v saturates (the
LayerNorm removes the scale), so a relative error ε in Δb becomes a relative error ε / e_F in the patch's scale
(e_F = d log(φ²v) / d log v ≪ 1), i.e. the error 2·(ε/e_F)·pos_c(t)M along one pixel direction of norm ≈ 2σ_pos√D.
Measured on the tiny test ViT (D = 192, 8 CIFAR images; the 8 lone bins of round 0, one noise draw per σ): at
|Δb|/σ ≈ 43–57 the ratio estimate is at −6 to 8 dB where the estimate below reaches 26–29 dB; at |Δb|/σ ≈ 1400 the
ratio is at 28–47 dB, the estimate below at 59 dB. We therefore write the adapter input as ``ΔW_j = s·y_c`` with
``y_c = pos_c(t) + ½M x`` (the patch x, a known positional embedding, an unknown scale s) and estimate
``λ = 1/s`` — the patch is then ``x(λ) = 2(λΔW_j − pos_c(t))M`` (+ the public mean on the lost direction, A1.5),
affine in λ — by generalised least squares combining three independent pieces of evidence:

* the coordinates of ΔW_j outside span(M) (when P²C < D − 1): ``λ·ΔW_⊥ = pos_c(t)_⊥`` + noise, exact in λ;
* a Gaussian prior of natural patches (:class:`PatchPrior`: mean and covariance of the server's *public* patches,
  A1.5's pool): x(λ) must be a plausible patch; only the one direction along which λ moves x is constrained, so
  this fills one pixel direction from public data, as A1.5 already does for the lost direction;
* the ratio route itself (Δb and the LayerNorm undo), with its variance (ε/e_F)².

The ΔW noise reaches the patch as i.i.d. pixel noise of std ``2|λ|·√v_j`` (M has orthonormal columns); the
recorded per-pixel error of a patch is ``√(4λ²v_j + var(λ)·‖u‖²/P²C)`` (u = 2ΔW_jM): it is what σ/|Δb| predicts,
through the slot's LayerNorm scale. On the tiny case this estimate reaches 29 dB at |Δb|/σ ≈ 57 (ratio: 1 dB) and
its predicted PSNR matches the measured one to ≈ 1 dB.

**Several bins carrying one patch** (the improved design hashes every patch into each of the K adapters of its
position): estimates at one position that agree within their errors (:func:`agreement`: one degree of freedom along
the position's scale axis, χ²_{P²C} across the rest, at the same level) are one patch;
they are combined with inverse-variance weights (∝ (|Δb|·φ)²/v: the paper's |Δb|² weighting at one slot), and
so are their image coefficients g = Δb/κ (weights κ²/v). The grouping by g (A1.9, :func:`group_noisy`) pools g per
image within z errors.

**Checks within the noise** (:class:`~.recovery.PEFTLeakRecovery`, ``_noisy_*``): consistency — in every adapter of
its position some bin the candidate's statistic can reach within z errors (its i.i.d. error through the read-out,
its scale error evaluated) is occupied, and its pixels lie in [−1, 1] within z errors; trust — another adapter's bin
holds g·κ within z errors (and g·κ stands out of that bin's noise), or a patch of another position shares g within
z errors, or an estimate from another adapter at its position agrees (:func:`agreement`); peeling — the estimated g·κ·(h, 1) of
known patches is subtracted only from bins they cannot straddle, and the residual is tested against the bin's noise
plus the subtracted estimates' errors. The exact recovery's agreement of g (1e-6, 1e-4 after FedAvg steps) floors
every tolerance on g; :data:`NUMERIC_ERROR` floors every patch error. A patch whose error² reaches the public
patches' per-pixel variance is not returned: it says nothing the public mean does not.

Not done: shrinking each patch towards the public prior (a Wiener filter) — it adds 4–12 dB at |Δb|/σ ≤ 50 on the
tiny case but moves pure noise towards a natural-looking patch, which the null of random held-out images does not
model; the estimate here constrains one direction per patch from the prior, not the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from gradleak.attacks.peftleak.geometry import F64, slot_scales

#: floor of every estimate's per-pixel error: what float64 leaves of an exact recovery (two copies of one patch
#: differ by ~1e-4 per pixel, :data:`gradleak.attacks.peftleak.recovery.SAME_PATCH` is 1e-3 max-abs)
NUMERIC_ERROR = 3e-4

#: ridge added to the public patch covariance (pixels in [-1, 1]): an error floor of 0.01 per pixel direction, so
#: no direction of the prior is trusted beyond what a public set of another distribution can say
PRIOR_RIDGE = 1e-4


def structural_noise_std(upd, plan, D: int) -> float:
    """σ read off the upload: ``1ᵀ∇W_j/√D`` of every row of every attacked slot's ``down.weight`` gradient is pure
    noise (the adapter inputs are centred LayerNorm outputs), so σ̂² is their mean square (module docstring)."""
    rows = [upd.tensors[f"{sp.slot.prefix}.down.weight"].to("cpu", F64).sum(1) / math.sqrt(D) for sp in plan.slots]
    v = torch.cat(rows)
    return float(v.pow(2).mean().sqrt())


def resolve_noise_std(mode: Any, view, upd, plan, D: int) -> Optional[float]:
    """σ of the observed upload ``upd`` for the ``noise`` mode (module docstring); None: the exact recovery."""
    if mode == "none":
        return None
    if isinstance(mode, (int, float)) and not isinstance(mode, bool):
        return float(mode)
    if mode == "estimate":
        return structural_noise_std(upd, plan, D)
    from gradleak.defenses.declared import view_noise_std

    std = view_noise_std(view, upd)
    return float(std) if std else None


@dataclass
class NoiseTests:
    """Thresholds of one reconstruction at false-alarm rate ``alpha`` over ``n_tests`` bins (module docstring)."""

    alpha: float
    n_tests: int
    occupancy: float  # χ²_{D+1} quantile of the bin statistic
    z: float  # two-sided normal quantile, every scalar tolerance
    same_patch: float  # χ²_{P²C} quantile of the squared difference of two estimates over their summed variance

    @classmethod
    def at(cls, alpha: float, n_tests: int, D: int, Pd: int) -> "NoiseTests":
        from scipy.stats import chi2, norm

        a = alpha / max(n_tests, 1)
        return cls(alpha, n_tests, float(chi2.isf(a, D + 1)), float(norm.isf(a / 2)), float(chi2.isf(a, Pd)))


@dataclass
class PatchPrior:
    """Gaussian model of the server's public patches (reduced pixel vectors): mean, eigenvectors and eigenvalues of
    the covariance + :data:`PRIOR_RIDGE`; ``floor`` caches, per position, the relative error of λ the prior alone
    leaves (measured on other public patches through the noise-free estimate)."""

    mean: torch.Tensor
    evecs: torch.Tensor
    evals: torch.Tensor
    held_out: torch.Tensor
    floor: dict = field(default_factory=dict)

    @property
    def pixel_variance(self) -> float:
        """Mean per-pixel variance of the public patches: an estimate whose error is as large says no more about
        the patch than the public mean does."""
        return float((self.evals - PRIOR_RIDGE).mean())

    @classmethod
    def from_server(cls, srv) -> "PatchPrior":
        pub = srv._pub
        fit, held = pub[0::2], pub[1::2]
        if len(fit) > 4096:
            fit = fit[torch.linspace(0, len(fit) - 1, 4096).long()]
        mean = fit.mean(0)
        cov = torch.cov(fit.T).reshape(len(mean), len(mean))
        evals, evecs = torch.linalg.eigh(cov)
        if len(held) > 256:
            held = held[torch.linspace(0, len(held) - 1, 256).long()]
        return cls(mean, evecs, evals.clamp(min=0) + PRIOR_RIDGE, held)

    def relative_floor(self, srv, t: int) -> float:
        """RMS relative error of λ from the prior alone at position t (noise-free rows of held-out public patches)."""
        if t not in self.floor:
            x = self.held_out if len(self.held_out) else self.mean[None]
            y = srv.pos_c[t] + 0.5 * (x @ srv.M.T - (x @ srv.M.T).mean(1, keepdim=True))
            n = len(y)
            lam, _ = _gls_scale(y, torch.zeros(n, dtype=F64), torch.full((n,), t), srv, self, prior_only=True)
            self.floor[t] = float(((lam - 1) ** 2).mean().sqrt())
        return self.floor[t]


def _affine(dw: torch.Tensor, t: torch.Tensor, srv) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x(λ) = λu − c in pixel space, and the part of the row outside span(M, 1): λa = b (+ noise)."""
    M = srv.M
    u = 2 * dw @ M
    c = 2 * srv.pos_c[t] @ M
    if srv.lost_dir is not None:
        ld = srv.lost_dir
        u = u - (u @ ld)[:, None] * ld
        c = c - srv.lost_mean * ld
    if srv.Pd < srv.D - 1:
        ones = torch.full((srv.D,), 1.0 / math.sqrt(srv.D), dtype=F64)
        a = dw - (dw @ M) @ M.T
        a = 2 * (a - (a @ ones)[:, None] * ones)
        p = srv.pos_c[t]
        b = 2 * (p - (p @ M) @ M.T)
    else:
        a = b = torch.zeros(len(dw), 0, dtype=F64)
    return u, c, a, b


def _gls_scale(dw: torch.Tensor, nv: torch.Tensor, t: torch.Tensor, srv, prior: PatchPrior,
               prior_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """λ from the span(M)-complement and the patch prior (module docstring), and 1 / its Fisher information."""
    u, c, a, b = _affine(dw, t, srv)
    if prior_only:
        a = b = torch.zeros(len(dw), 0, dtype=F64)
    p = srv.pos_c[t]
    proj = (dw * p).sum(1)
    lam = srv._pos_norm2[t] / torch.where(proj.abs() > 1e-300, proj, torch.full_like(proj, 1e-300))
    ut = u @ prior.evecs
    rt = (c + prior.mean) @ prior.evecs
    ab, aa = (a * b).sum(1), (a * a).sum(1)
    den = torch.ones_like(lam)
    for _ in range(4):
        nu = 4 * lam * lam * nv  # per-pixel (and per ⊥ coordinate) noise variance of λ·2ΔW
        w = 1.0 / (prior.evals[None] + nu[:, None])
        num = (ut * rt * w).sum(1)
        den = (ut * ut * w).sum(1)
        if a.shape[1]:
            safe = nu.clamp(min=1e-300)
            num, den = num + ab / safe, den + aa / safe
        lam = num / den
    return lam, 1.0 / den


def _ratio_scale(dw: torch.Tensor, db: torch.Tensor, nv: torch.Tensor, idx: torch.Tensor,
                 srv) -> tuple[torch.Tensor, torch.Tensor]:
    """λ by eq. (24)–(25)'s route (h = ΔW/Δb, LayerNorm undo by the norm; the noise's share of ‖ΔW‖² removed) and
    its variance from σ/|Δb| through the undo's conditioning e_F (module docstring)."""
    D = srv.D
    sig2 = ((dw * dw).sum(1) - D * nv).clamp(min=1e-300)
    target = sig2 / (db * db).clamp(min=1e-300) / D

    def F(v):
        return slot_scales(v, srv.L, srv.sigma, srv.eps).gather(1, idx[:, None])[:, 0] ** 2 * v

    lo = torch.full_like(target, -30.0)
    hi = torch.full_like(target, 30.0)
    for _ in range(64):
        mid = 0.5 * (lo + hi)
        up = F(torch.exp(mid)) < target
        lo = torch.where(up, mid, lo)
        hi = torch.where(up, hi, mid)
    logv = 0.5 * (lo + hi)
    v = torch.exp(logv)
    d = 1e-4
    eF = ((torch.log(F(torch.exp(logv + d))) - torch.log(F(torch.exp(logv - d)))) / (2 * d)).clamp(min=1e-12)
    lam = torch.sign(db) * torch.sqrt(D * v / sig2)
    rel = nv / (db * db).clamp(min=1e-300) / eF ** 2 + nv / sig2 * (1 / eF - 1) ** 2
    saturated = (hi > 29.9) | (lo < -29.9)  # no variance solves the undo: no evidence
    rel = torch.where(saturated, torch.full_like(rel, float("inf")), rel)
    return lam, rel * lam * lam


def estimate_patches(dw: torch.Tensor, db: torch.Tensor, nv: torch.Tensor, t: torch.Tensor, idx: torch.Tensor,
                     srv, prior: PatchPrior) -> dict[str, torch.Tensor]:
    """Patches (n × P²C) from noisy bin rows ``dw`` (n × D), bias differences ``db``, noise variances ``nv`` (per
    coordinate of the difference), positions ``t`` and slot indices ``idx``: λ by inverse-variance combination of
    :func:`_gls_scale` (floored by the prior's own error) and :func:`_ratio_scale`. Returns ``x``, ``lam`` and
    ``err`` (expected per-pixel error std), ``err_iso`` (its i.i.d. part, from ΔW), ``scale_dir`` (the one-std
    displacement of x along which an error in λ moves it) and ``axis`` (the noise-free unit direction of that
    displacement, 2·pos_c(t)M: the same for every estimate at position t)."""
    lam_g, var_g = _gls_scale(dw, nv, t, srv, prior)
    floor = torch.tensor([prior.relative_floor(srv, int(p)) for p in t.tolist()], dtype=F64)
    if srv.Pd < srv.D - 1:
        floor = torch.zeros_like(floor)  # the ⊥ coordinates fix λ; the prior barely contributes
    var_g = var_g + (floor * lam_g) ** 2
    lam_r, var_r = _ratio_scale(dw, db, nv, idx, srv)
    w_g, w_r = 1.0 / var_g.clamp(min=1e-300), 1.0 / var_r.clamp(min=1e-300)
    w_r = torch.where(torch.isfinite(lam_r) & torch.isfinite(var_r), w_r, torch.zeros_like(w_r))
    lam = (lam_g * w_g + torch.nan_to_num(lam_r) * w_r) / (w_g + w_r)
    var_lam = 1.0 / (w_g + w_r)
    u, c, _, _ = _affine(dw, t, srv)
    x = lam[:, None] * u - c
    err = torch.sqrt(4 * lam * lam * nv + var_lam * (u * u).sum(1) / srv.Pd + NUMERIC_ERROR ** 2)
    axis = c - (c @ srv.lost_dir)[:, None] * srv.lost_dir if srv.lost_dir is not None else c
    axis = axis / axis.norm(dim=1, keepdim=True).clamp(min=1e-300)
    return {"x": x, "lam": lam, "err": err, "err_iso": 2 * lam.abs() * nv.sqrt(), "scale_dir": var_lam.sqrt()[:, None] * u,
            "axis": axis}


def agreement(A: list[dict], B: list[dict], tests: "NoiseTests") -> torch.Tensor:
    """Whether estimate i of ``A`` and j of ``B`` (one position) can be one patch (|A| × |B| bool): their difference
    d is split into its part along the position's scale axis (``axis``: a λ error moves an estimate along
    2·pos_c(t)M, up to a few per cent), tested with one degree of freedom against both scale errors and the i.i.d.
    errors, and the rest, tested by χ²_{P²C} against the i.i.d. errors ``err_iso`` (floored by
    :data:`NUMERIC_ERROR`). The axis is the noise-free one: each estimate's own direction 2ΔW_jM carries its noise,
    so the span of two of them would absorb the very difference under test."""
    XA = torch.stack([c["x"] for c in A])
    XB = torch.stack([c["x"] for c in B])
    axis = A[0]["axis"]
    sa = torch.stack([c["scale_dir"] for c in A]) @ axis
    sb = torch.stack([c["scale_dir"] for c in B]) @ axis
    ia = torch.tensor([c.get("err_iso", c["err"]) ** 2 + NUMERIC_ERROR ** 2 for c in A], dtype=F64)
    ib = torch.tensor([c.get("err_iso", c["err"]) ** 2 + NUMERIC_ERROR ** 2 for c in B], dtype=F64)
    d2 = torch.cdist(XA, XB) ** 2
    par = ((XA @ axis)[:, None] - (XB @ axis)[None]) ** 2
    perp = (d2 - par).clamp(min=0)
    iso = ia[:, None] + ib[None]
    return (perp <= tests.same_patch * iso) & (par <= tests.z ** 2 * (sa[:, None] ** 2 + sb[None] ** 2 + iso))


def merge_estimates(cands: list[dict], tests: "NoiseTests") -> list[dict]:
    """Combine candidates at one position whose estimates agree within their errors (:func:`agreement`) into one
    patch, most precise first: x (and its i.i.d. and scale errors) and g by inverse-variance weights. Each result
    keeps its most precise member's dict (bin, κ, round) with ``x``, ``err``, ``g``, ``g_err`` replaced and
    ``members`` (how many bins carried it)."""
    out: list[dict] = []
    by_pos: dict[int, list[dict]] = {}
    for c in sorted(cands, key=lambda c: c["err"]):
        pool = by_pos.setdefault(c["position"], [])
        hit = None
        if pool:
            ok = agreement([c], pool, tests)[0]
            if bool(ok.any()):
                hit = pool[int(torch.nonzero(ok)[0, 0])]
        if hit is None:
            m = {**c, "members": c.get("members", 1), "_err0": c["err"], "_w": 1.0 / max(c["err"] ** 2, 1e-300),
                 "_xs": c["x"] / max(c["err"] ** 2, 1e-300)}
            if c.get("g_err") is not None:
                m["_gw"] = 1.0 / max(c["g_err"] ** 2, 1e-300)
                m["_gs"] = c["g"] * m["_gw"]
            pool.append(m)
            out.append(m)
            continue
        wi = 1.0 / max(c["err"] ** 2, 1e-300)
        hit["_w"] += wi
        hit["_xs"] = hit["_xs"] + c["x"] * wi
        hit["x"] = hit["_xs"] / hit["_w"]
        hit["err"] = hit["_w"] ** -0.5
        hit["members"] += c.get("members", 1)
        shrink = hit["err"] / max(float(hit["_err0"]), 1e-300)  # the combined errors shrink alike
        hit["_err0"] = hit["err"]
        if "scale_dir" in hit:
            hit["scale_dir"] = hit["scale_dir"] * shrink
        if "err_iso" in hit:
            hit["err_iso"] = hit["err_iso"] * shrink
        if c.get("g_err") is not None and "_gw" in hit:
            gw = 1.0 / max(c["g_err"] ** 2, 1e-300)
            hit["_gw"] += gw
            hit["_gs"] += c["g"] * gw
            hit["g"] = hit["_gs"] / hit["_gw"]
            hit["g_err"] = hit["_gw"] ** -0.5
    for m in out:
        for k in ("_w", "_xs", "_gw", "_gs", "_err0"):
            m.pop(k, None)
    return out


def group_noisy(g: torch.Tensor, g_err: torch.Tensor, positions: torch.Tensor, z: float) -> torch.Tensor:
    """Images from noisy image coefficients (A1.9 within the noise): most precise g first, each patch joins the image
    whose pooled g (inverse-variance weighted) is nearest within ``z``·√(err² + pooled err²) and has its position
    free, else opens a new image. Returns a group id per patch (no chaining: a wide tolerance cannot string many
    images into one, as consecutive-difference grouping does)."""
    n = len(g)
    groups = torch.full((n,), -1, dtype=torch.long)
    pooled: list[list[float]] = []  # [weighted sum, weight]
    taken: list[set[int]] = []
    for i in torch.argsort(g_err).tolist():
        gi, ei, ti = float(g[i]), float(g_err[i]), int(positions[i])
        best, best_d = -1, float("inf")
        if math.isfinite(gi) and math.isfinite(ei):
            for k, (s, w) in enumerate(pooled):
                if ti in taken[k]:
                    continue
                d = abs(gi - s / w)
                if d <= z * math.sqrt(ei * ei + 1.0 / w) and d < best_d:
                    best, best_d = k, d
        if best < 0:
            w = 1.0 / max(ei * ei, 1e-300) if math.isfinite(ei) else 1e-300
            pooled.append([gi * w if math.isfinite(gi) else 0.0, w])
            taken.append({ti})
            best = len(pooled) - 1
        else:
            w = 1.0 / max(ei * ei, 1e-300)
            pooled[best][0] += gi * w
            pooled[best][1] += w
            taken[best].add(ti)
        groups[i] = best
    return groups


__all__ = ["NUMERIC_ERROR", "NoiseTests", "PRIOR_RIDGE", "PatchPrior", "agreement", "estimate_patches", "group_noisy",
           "merge_estimates", "resolve_noise_std", "structural_noise_std"]
