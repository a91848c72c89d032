"""``lora_span``: exact analytic image recovery from the LoRA-A gradient of block 0 by an honest server
(beyond the paper; paper 001, the LoRA-ViT paper of docs/PAPERS.md, studies optimisation attacks on LoRA ViTs, its best
reaching 25.9 dB at B = 1, r = 128, Table 11 — this attack needs no optimisation and no prescribed architecture).

**The span.** LoRA on a linear layer ``y = W h + s·B A h`` (s = α/r) has ``∂L/∂A = s·Bᵀ Σₜ δₜ hₜᵀ`` with
``δₜ = ∂L/∂yₜ``: every row of the gradient is a combination of the layer's inputs hₜ. For block 0's attention
projections (``query``/``key``/``value`` share one input) the inputs are the first-layer tokens

    hₜ = LN(zₜ) = γ ⊙ C zₜ / σₜ + β,   zₜ = E xₜ + b + posₜ (patches),  z₀ = cls + pos₀ (CLS),

C = I − 11ᵀ/d the centring, σₜ = (‖C zₜ‖²/d + ε)^{1/2}. So the row space V of the stacked LoRA-A gradients
(every block-0 q/k/v LoRA the update carries) lies in span{hₜ}, and equals it when the stacked rank
(Σ rᵢ rows) exceeds the number of distinct tokens (B·(N+1) with N patches + CLS).

**Per-patch membership (linear).** With U⊥ an orthonormal basis of V's complement, hₜ ∈ V ⟺ U⊥ᵀ hₜ = 0.
Multiplying by σₜ and making σₜ an unknown gives, for patch position t,

    [U⊥ᵀ Γ C E | U⊥ᵀ β] · [x; σ] = −U⊥ᵀ Γ C (b + posₜ)          (d − k equations, n + 1 unknowns, n = c·p²)

which is linear in (x, σ) (with β = 0, e.g. HF's LayerNorm init, σ drops out and x alone is solved): ε drops
out (σ absorbs it) and the inhomogeneous right side fixes the scale — no normalisation of a null vector is
needed (the homogeneous form [x; σ; τ] with τ = 1 is the same system). The matrix is shared by all positions, so one SVD solves all N positions at once. The patches are placed on the
(S/p)² grid and the pipeline's pixel map u = 2x − 1 is undone (x = (u + 1)/2, clipped to [0, 1]; a model that
folds another normalisation into its patch embedding, as :mod:`gradleak.models.dinov2`, needs nothing more).

**When it holds (and when it cannot).** (i) the stacked gradient must not be saturated (k < Σ rᵢ and k < d);
(ii) the per-patch system must have full column rank n + 1 ≤ d − k. (iii) B ≥ 2 fails for a structural
reason, whatever r: all tokens lie in span{ΓCE, β, ΓC(b + posₜ), h₀} of dimension ≤ n + N + 2 (114 for
ViT-S/4 at 32 px), and for two images the differences σ₁h₁ₜ − σ₂h₂ₜ = ΓCE(x₁ₜ − x₂ₜ) + (σ₁ − σ₂)β lie in both
V and the system's column space, so the system loses rank min(n + 1, (B − 1)·N) (all of it at patch 4: V then
holds every pixel direction) and every patch is ambiguous. Patch 16 at 32 px has n = 768 > d = 384 unknowns:
under-determined. The attack detects these from the spectra (never from the truth) and reports ``lora_span_rank_condition_holds`` = 0 with the reason in
``info["rank_condition"]``; it still returns its least-squares (minimum-norm) image, flagged. FedAvg: block 0's
input is frozen, so every local step's gradient lies in the same token span and the attack applies unchanged.

Decisions left open (no paper describes this attack), each recorded:

* **Rows used**: every block-0 attention LoRA-A gradient in the update (``query``, ``key``, ``value``),
  stacked; more targets = more rows = a later saturation. LoRA on block 0 is required (BadInput otherwise).
* **Rank of the gradient** (``rank_rtol`` unset): the cut is the largest ratio of consecutive singular values
  when it is at least ``min_gap`` (10×), else the row space counts as saturated (full rank). Measured on the
  pretrained ViT-S/4, float32 uploads, B = 1: the 65 true values end at 1.4–3.3e-5 × S₀, the rounding noise
  starts at 2.5–7e-8 × S₀ (a 2.4–2.8-decade gap), while no other step of either spectrum exceeds 0.4 decade;
  a saturated gradient (64 rows for 65 tokens) has no step above 0.25 decade. ``rank_rtol`` fixes a plain
  relative cut instead. The known CLS token must lie in V: its relative residual ``lora_span_cls_residual`` is a
  truth-free check of the cut.
* **Rank of the per-patch system**: each column is divided by its norm *before* the projection U⊥ᵀ (so a column
  lying inside V keeps a near-zero value), then singular values above ``system_tol`` (default 1e-5) count;
  fewer than n + 1 → under-determined / ambiguous (flagged), minimum-norm solution. Measured (float32, ViT-S/4):
  B = 1 → smallest value 1.8e-3; B = 2 → largest 4.2e-3, tail 2.6e-8 (patch 8, B = 2: 16 values ≤ 1.9e-7).
* **Which block-0 parameters**: the round's state the server sent (``view.round_states[-1]``) overrides the
  model's for the embedding and norm (they are frozen by LoRA, so equal, unless a future PEFT kind trains them).
* **Verification** (no truth): each recovered patch is pushed through the exact LayerNorm (with ε) and its
  relative residual outside V is reported (median / max); a failed case shows residuals far above the CLS one.
* **CLS**: known to the server (no pixel), it is one of the span's directions whenever its query/key/value
  influences the loss (always from two blocks on; not in a single block with mean pooling, where its output is
  unused) and then serves as the check above; it is not solved for. Token layouts with register tokens are
  not handled.
* **Timing**: ``attack_seconds`` (span + solve + assembly) and ``attack_to_fwdbwd_ratio`` = that over one
  forward + backward of the model the server sent on a batch of the client's size (the same run, so machine
  noise cancels); in ``info["timings"]`` and the attack-side metrics.

**Under noise: the measurements solver** (``solver: measurements``; the audit runs it as a full-strength variant under
any declared defense). Noise hides the weaker of the N + 1 token directions, and the span solver above needs all of
them (it asks every token to lie in V). Each direction that does stand above the noise edge still lies in the known
token basis [ΓCE | ΓC(b + posₜ) | β | h₀], so its coordinates there are linear measurements of the image:
:mod:`gradleak.attacks.common.token_measurements` inverts them under a Gaussian image prior (the granted public
images', or a data-free Gauss-Markov prior chosen per upload by its evidence), each direction weighted by the noise read
off its own residual outside that basis. Noise-free with every direction it is the exact attack (80.8 dB on the
vit_lora audit's image); ``directions: K`` fixes the count (the oracle ceiling of ``benchmarks/info_limit.py``).
Measured there (percentile noise σ0 = 0.01 / 0.003, vit_lora, B = 1): beyond the null on the tuned image and on one of
the two held-out images at both σ0; on the other held-out image the noise-free ceiling at the same K is beyond its null
while the noisy upload is not (docs/REPRODUCTION.md, "Information limit").

Measured (``benchmarks/lora_vit.py``, pretrained ViT-S/14, float32 uploads, 1 thread): B = 1, r = 128, patch 4,
query + value: median 95 dB (min 74.7) over 12 distinct real CIFAR images, 0.02 s per image (0.19 × one
forward + backward); r = 64 on query + value (128 rows): 89–96 dB; r = 64 on query only (64 rows < 65 tokens,
flagged saturated): 32–36 dB; patch 8: 116–120 dB; patch 16 (flagged under-determined): 17–23 dB;
B = 2 and 4 (flagged): 11.5–15.5 dB, no image ≥ 30 dB.
"""

from __future__ import annotations

import math
import re
import time
from types import SimpleNamespace
from typing import Any, Literal, Optional

import torch
from pydantic import Field

from gradleak.attacks.common.parameters import set_config_fields
from gradleak.attacks.base import AttackBase, AttackConfig, Reconstruction
from gradleak.errors import BadInput
from gradleak.registry import ATTACKS

#: block-0 attention LoRA-A parameters: ...encoder.layer.0.attention.attention.{query,key,value}.lora_A.<adapter>.weight
_LORA_A0 = re.compile(r"(^|\.)encoder\.layer\.0\.attention\.attention\.(query|key|value)\.lora_A\.[^.]+\.weight$")


class LoraSpanConfig(AttackConfig):
    rank_rtol: Optional[float] = Field(None, gt=0, lt=1, description="fixed relative singular-value cut of the LoRA-A "
                                       "gradient (default: largest spectral gap, see min_gap)")
    min_gap: float = Field(10.0, gt=1, description="smallest ratio of consecutive singular values accepted as the "
                           "gradient's rank cut (else the row space counts as saturated)")
    system_tol: float = Field(1e-5, gt=0, lt=1, description="singular-value cut of the per-patch system (columns of unit "
                              "norm before the projection)")
    clip: bool = Field(True, description="clip the recovered pixels to [0, 1]")
    rank_cut: Literal["gap", "noise_edge", "tokens"] = Field(
        "gap", description="how the gradient's rank is cut: gap = the largest spectral gap (or rank_rtol; exact, "
        "noise-free uploads); noise_edge = the singular values above the noise spectrum's edge sigma (sqrt(rows) + "
        "sqrt(d)) (sigma from the declared defenses, else read off the spectrum); tokens = the B (N + 1) strongest "
        "directions, the number of tokens a batch of B images has (truncated SVD: the best rank-B(N+1) denoising)")
    solver: Literal["span", "measurements"] = Field(
        "span", description="span = every token must lie in the recovered row space (exact; needs all B (N + 1) "
        "directions); measurements = each recovered direction decomposed in the known token basis is a linear "
        "measurement of the image, inverted with a Gaussian image prior (uses every direction above the cut, B = 1; "
        "gradleak.attacks.common.token_measurements)")
    prior: Literal["auto", "public", "stationary"] = Field(
        "auto", description="the measurements solver's image prior: public = mean and shrunk covariance of the granted "
        "public images; stationary = data-free Gauss-Markov prior; auto = public when granted, else stationary")
    iterations: int = Field(4, ge=1, le=50, description="iterations of the measurements solver (the coefficients' noise covariance at the current image, then the image)")
    directions: Optional[int] = Field(None, ge=1, description="use exactly this many strongest directions (overrides "
                                      "rank_cut; the oracle ceiling runs the noise-free upload at the k a defended "
                                      "upload leaves above its noise edge)")
    time_fwdbwd: bool = Field(True, description="time one forward+backward of the sent model for attack_to_fwdbwd_ratio")


def first_block(model):
    """Block 0's input pieces, float64: patch kernel E (d × n), bias b, positions (N+1 × d), CLS, γ, β, ε, p, c."""
    backbone = getattr(model, "vit", model)
    emb, layers = getattr(backbone, "embeddings", None), getattr(getattr(backbone, "encoder", None), "layer", None)
    if emb is None or layers is None:
        raise BadInput("model.name", "lora_span reads a ViT's patch embedding and block 0 (HF ViT / DINOv2 layout).",
                       "use a ViT model (vit-tiny, vit-s16, vit-b16, vit-s14-pretrained, ...).")
    layer0 = layers[0]
    norm = getattr(layer0, "norm1", None) or getattr(layer0, "layernorm_before", None)
    conv = emb.patch_embeddings.projection
    w = conv.weight.detach().to(torch.float64)
    d, c, p, _ = w.shape
    return {"E": w.reshape(d, c * p * p), "b": conv.bias.detach().to(torch.float64) if conv.bias is not None else
            torch.zeros(d, dtype=torch.float64), "pos": emb.position_embeddings.detach()[0].to(torch.float64),
            "cls": emb.cls_token.detach().reshape(-1).to(torch.float64),
            "gamma": norm.weight.detach().to(torch.float64), "beta": norm.bias.detach().to(torch.float64),
            "eps": float(norm.eps), "patch": int(p), "channels": int(c), "d": int(d),
            "prefix": _module_prefix(model, conv, emb, norm)}


def _module_prefix(model, conv, emb, norm) -> dict[str, str]:
    names = {id(m): n for n, m in model.named_modules()}
    return {"conv": names.get(id(conv), ""), "emb": names.get(id(emb), ""), "norm": names.get(id(norm), "")}


def layer_norm(z: torch.Tensor, gamma, beta, eps) -> torch.Tensor:
    zc = z - z.mean(-1, keepdim=True)
    return gamma * zc / torch.sqrt((zc ** 2).mean(-1, keepdim=True) + eps) + beta


def spectral_rank(S: torch.Tensor, min_gap: float, rtol: Optional[float] = None) -> int:
    """Numerical rank of a gradient from its singular values ``S`` (descending).

    ``rtol`` given: the count above ``rtol``·S₀. Else the cut sits at the largest ratio of consecutive singular
    values, provided it is at least ``min_gap`` (the rounding noise of a float32 gradient sits ~2.5 decades below
    the smallest true value at B = 1 on ViT-S/4; its own spectrum and the true one each decay by < 0.4 decade per
    step); no such gap = no rank deficiency, i.e. the rank is ``len(S)`` (saturated)."""
    if len(S) == 0 or float(S[0]) == 0.0:
        return 0
    if rtol is not None:
        return int((S > rtol * S[0]).sum())
    if len(S) == 1:
        return 1
    logs = torch.log10((S / S[0]).clamp_min(1e-300))
    gaps = logs[:-1] - logs[1:]
    j = int(torch.argmax(gaps))
    return j + 1 if float(gaps[j]) >= math.log10(min_gap) else len(S)


@ATTACKS.register("lora_span", "exact analytic images from block-0 LoRA-A gradient row space (honest server, B = 1)")
class LoraSpan(AttackBase):
    """Honest-but-curious server; LoRA on block 0's attention. See the module docstring for the math."""

    name = "lora_span"
    Config = LoraSpanConfig

    @classmethod
    def audit_variants(cls, params, defenses):
        """The rank cut decides the attack under noise (measured: 16-bit quantisation, 14.3 dB at the spectral-gap
        default, 56.8 dB at rank_rtol 1e-4): the audit also runs a ladder of fixed relative cuts, and under a
        declared defense the two denoising cuts -- the noise spectrum's edge and the token count (truncated SVD)."""
        ladder = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2) if defenses else (1e-5, 1e-4)
        out = [{"rank_rtol": v} for v in ladder if params.get("rank_rtol") != v]
        if defenses:
            out += [{"rank_cut": c} for c in ("noise_edge", "tokens") if params.get("rank_cut") != c]
            # every direction above the noise edge, each a linear measurement of the image (the information limit
            # of a subspace attacker; gradleak.attacks.common.token_measurements)
            # (the public prior is kept only where threat.public_data grants it: the audit drops a refused variant)
            out += [{"rank_cut": "noise_edge", "solver": "measurements", "prior": p} for p in ("stationary", "public")]
        return out
    modality = "image"
    peft_kinds = ("lora",)
    reconstruction = "images"
    devices = ("cpu", "cuda")

    def __init__(self, public_images: Optional[torch.Tensor] = None, **params: Any):
        set_config_fields(self, params)  # LoraSpanConfig: the one place the defaults live
        self.public_images = public_images

    @classmethod
    def requires(cls, cfg=None) -> dict[str, bool]:
        cfg = cfg if cfg is not None else cls.Config()
        req = super().requires(cfg)
        if cfg.solver == "measurements" and cfg.prior == "public":
            req["public_data"] = True  # the prior's mean and covariance come from public images
        return req

    @classmethod
    def from_config(cls, cfg, ctx):
        return cls(public_images=ctx.public.get("public_images"), **cfg.model_dump())

    def prepare(self, model, threat):
        """Refuse early (before any round) a model without LoRA on block 0's attention."""
        names = [n for n, _ in model.named_parameters()]
        if not any(_LORA_A0.search(n) for n in names):
            raise _no_block0_lora(names)
        first_block(model)  # the layout is readable
        return model

    # ------------------------------------------------------------------------------------------ reconstruct
    def reconstruct(self, view) -> Reconstruction:
        t0 = time.perf_counter()
        upd = view.updates[0]
        keys = sorted(k for k in upd.tensors if _LORA_A0.search(k))
        if not keys:
            raise _no_block0_lora(list(upd.tensors))
        fb = first_block(view.model)
        state = view.round_states[-1] if view.round_states else {}
        self._override(fb, state)
        G = torch.cat([upd.tensors[k].detach().to(torch.float64).cpu() for k in keys])  # Σr × d
        _, S, Vh = torch.linalg.svd(G, full_matrices=True)
        d, P, C = fb["d"], fb["patch"], fb["channels"]
        shape = view.public.get("image_shape")
        side = int(shape[-1]) if shape else int(round(math.sqrt(len(fb["pos"]) - 1))) * P
        grid = side // P
        N = grid * grid
        k, noise_std = self._rank(view, G, S, N, keys)
        if len(fb["pos"]) != N + 1:
            raise BadInput("model.patch_size", f"the model has {len(fb['pos']) - 1} patch positions but a "
                           f"{side}-px image at patch {P} has {N}.", "use the image size the model was built for.")
        if self.directions is not None:
            k = min(int(self.directions), len(S))
        if self.solver == "measurements":
            return self._measurements(view, fb, G, S, Vh, k, noise_std, N, side, keys, t0)
        sv = self._solve_patches(fb, Vh, k)
        n, srank, unknowns = sv.n, sv.srank, sv.unknowns
        imgs = sv.X.reshape(grid, grid, C, P, P).permute(2, 0, 3, 1, 4).reshape(1, C, side, side)
        imgs = (imgs + 1) / 2
        if self.clip:
            imgs = imgs.clamp(0, 1)
        t_attack = time.perf_counter() - t0
        # ---- the regime
        batch = int(view.public.get("batch_size") or upd.num_samples or 0)
        rows = G.shape[0]
        reasons = self._regime_reasons(k, rows, d, n, N, srank, unknowns, batch)
        holds = not reasons
        t_fb = self._time_fwdbwd(view, max(batch, 1), side, C) if self.time_fwdbwd else float("nan")
        info = {
            "backbone": getattr(view.model, "backbone_name", type(getattr(view.model, "vit", view.model)).__name__),
            "patch_size": P, "image_size": side, "num_patches": N, "lora_A_parameters": keys,
            "gradient_rows": rows, "row_space_rank": k, "row_space_rank_max": min(rows, d),
            "tokens_expected": (batch * (N + 1)) if batch else None, "token_span_dim_max": n + N + 2,
            "spectrum_head": [float(v) for v in (S / S[0] if len(S) and S[0] > 0 else S)[max(0, k - 3):k + 3]],
            "rank_cut": self._rank_cut_description(noise_std),
            "unknowns_per_patch": unknowns, "sigma_unknown": sv.use_sigma, "equations_per_patch": d - k,
            "system_rank": srank,
            "system_condition": float(sv.s[0] / sv.s[srank - 1]) if srank else float("inf"),
            "rank_condition": "holds" if holds else "; ".join(reasons),
            "timings": {"attack_seconds": t_attack, "fwdbwd_seconds": t_fb,
                        "attack_to_fwdbwd_ratio": t_attack / t_fb if t_fb == t_fb and t_fb > 0 else float("nan")},
        }
        if not holds:
            info["warning"] = (f"lora_span: under-determined setting, the rank condition fails "
                               f"({info['rank_condition']}); the image is a least-squares guess, not an exact "
                               "recovery (lora_span_rank_condition_holds = 0)")
        metrics = {"lora_span_rank_condition_holds": float(holds), "lora_span_row_space_rank": float(k),
                   "lora_span_system_rank": float(srank), "lora_span_cls_residual": float(sv.cls_res),
                   "lora_span_patch_residual_median": float(sv.res.median()),
                   "lora_span_patch_residual_max": float(sv.res.max()),
                   "lora_span_sigma_relative_error_median": sv.sigma_err,
                   "attack_seconds": t_attack, "attack_to_fwdbwd_ratio": info["timings"]["attack_to_fwdbwd_ratio"]}
        # the leakage margin: the weakest of the B (N + 1) token directions over the noise edge the declared defenses
        # imply, and the noise that would drown it (gradleak.attacks.common.subspace.spectral_margin)
        from gradleak.attacks.common.subspace import spectral_margin
        from gradleak.defenses.declared import view_noise_std

        margin = spectral_margin([G], max(batch, 1) * (N + 1), view_noise_std(view, upd, tensor=keys))
        info["leakage_margin"] = {"layer": "block0_lora_A", **margin}
        metrics.update({f"{k}_block0_lora_A": v for k, v in margin.items()})
        return Reconstruction({"images": imgs.to(torch.float32)}, info, metrics)

    def _solve_patches(self, fb: dict[str, Any], Vh: torch.Tensor, k: int) -> SimpleNamespace:
        """The per-patch linear system [U⊥ᵀΓCE | U⊥ᵀβ] [x; σ] = −U⊥ᵀΓC(b + pos_t) (module docstring), all positions at
        once, solved by a truncated SVD (``system_tol``), with its truth-free verification: the recovered patches'
        exact tokens must lie in the row space V. ``X``: N × n pixels in the model's range."""
        n = fb["E"].shape[1]
        Uperp = Vh[k:].T  # d × (d − k): the complement of the row space V
        gamma, beta, eps = fb["gamma"], fb["beta"], fb["eps"]
        h_cls = layer_norm(fb["cls"] + fb["pos"][0], gamma, beta, eps)
        cls_res = _rel_residual(h_cls, Uperp)
        # ---- the per-patch linear system [U⊥ᵀΓCE | U⊥ᵀβ] [x; σ] = −U⊥ᵀΓC(b + pos_t), all positions at once;
        # with β = 0 (e.g. HF's LayerNorm init) σ drops out of the condition and is not an unknown
        use_sigma = float(beta.norm()) > 1e-12 * float(gamma.norm())
        K = Uperp.T * gamma  # (d − k) × d : U⊥ᵀ Γ
        K = K - K.mean(1, keepdim=True)  # · C (right-multiplying by the centring subtracts the row means)
        GE = fb["E"] * gamma[:, None]
        cols, norms = [K @ fb["E"]], [(GE - GE.mean(0, keepdim=True)).norm(dim=0)]
        if use_sigma:
            cols.append((Uperp.T @ beta)[:, None])
            norms.append(beta.norm().reshape(1))
        A0 = torch.cat(cols, 1)  # (d − k) × (n + 1)
        rhs = -(K @ (fb["b"][None] + fb["pos"][1:]).T)  # (d − k) × N
        # columns scaled by their norm *before* the projection: a column (nearly) inside V — B ≥ 2, where the
        # span holds every pixel direction — keeps its (near-)zero singular value instead of being blown up to 1
        scale = torch.cat(norms).clamp_min(1e-300)
        U, s, Wh = torch.linalg.svd(A0 / scale, full_matrices=False)
        srank = int((s > self.system_tol).sum())
        sol = (Wh[:srank].T @ ((U[:, :srank].T @ rhs) / s[:srank, None])) / scale[:, None]  # unknowns × N
        X = sol[:n].T  # N × n pixels in the model's range
        # ---- truth-free verification: the recovered patches' exact tokens must lie in V
        z = X @ fb["E"].T + fb["b"] + fb["pos"][1:]
        h = layer_norm(z, gamma, beta, eps)
        res = _rel_residual(h, Uperp)
        sigma_true = torch.sqrt(((z - z.mean(1, keepdim=True)) ** 2).mean(1) + eps)
        sigma_err = float(((sol[n] - sigma_true).abs() / sigma_true).median()) if use_sigma else 0.0
        return SimpleNamespace(X=X, n=n, use_sigma=use_sigma, unknowns=n + int(use_sigma), s=s, srank=srank,
                               cls_res=cls_res, res=res, sigma_err=sigma_err)

    def _regime_reasons(self, k: int, rows: int, d: int, n: int, N: int, srank: int, unknowns: int,
                        batch: int) -> list[str]:
        """Why the rank condition fails (empty when it holds): a zero or saturated row space, a rank reaching the
        token span's dimension, an under-determined or rank-deficient per-patch system, a batch of several images."""
        reasons = []
        if k == 0:
            reasons.append("the LoRA-A gradient is zero (peft.lora_init=default has B = 0 in round 1)")
        if k >= min(rows, d):
            reasons.append(f"row space saturated: rank {k} = min(rows {rows}, d {d}) (no spectral gap >= "
                           f"{self.min_gap:g}x): more tokens than LoRA rows, or several images")
        if k >= n + N + 2:
            reasons.append(f"row space rank {k} reaches the token span's dimension n + N + 2 = {n + N + 2}: every "
                           "pixel direction lies in it (several images' tokens, e.g. B ≥ 2)")
        if srank < unknowns:
            if unknowns > d - k:
                reasons.append(f"per-patch system under-determined: {unknowns} unknowns > {d - k} equations")
            else:
                reasons.append(f"per-patch system rank {srank} < {unknowns} unknowns (several images' tokens per "
                               "position, e.g. B ≥ 2: patches ambiguous)")
        if batch > 1:
            reasons.append(f"batch of {batch}: the span holds several images' tokens; this attack returns one image")
        return reasons

    def _rank_cut_description(self, noise_std: Optional[float]) -> str:
        """How the row space's rank was cut (``info["rank_cut"]``)."""
        return ({"tokens": "the token count B (N + 1) (truncated SVD)",
                 "noise_edge": f"the noise edge (per-coordinate std {noise_std:.3g})" if noise_std else
                 "the noise edge"}.get(self.rank_cut) or
                (f"rank_rtol {self.rank_rtol:g}" if self.rank_rtol is not None
                 else f"largest spectral gap (>= {self.min_gap:g}x)"))

    def _prior(self, C: int, side: int, P: int):
        from gradleak.attacks.common.token_measurements import GaussianImagePrior

        if self.prior in ("public", "auto") and self.public_images is not None and len(self.public_images) >= 2:
            key = (self.prior, C, side, P)
            if getattr(self, "_prior_cache", (None, None))[0] != key:
                self._prior_cache = (key, GaussianImagePrior.from_public(self.public_images, P))
            return self._prior_cache[1]
        if self.prior == "public":
            raise BadInput("threat.public_data", "lora_span's public prior needs the granted public images.",
                           "grant threat.public_data=true, or set attack.prior=stationary (data-free).")
        # a grid of data-free priors; the solver keeps the one the upload supports best (its evidence)
        return [GaussianImagePrior.stationary(C, side, P, rho=r, std=sd) for r in (0.9, 0.95, 0.98)
                for sd in (0.35, 0.5, 0.7)]

    def _measurements(self, view, fb, G, S, Vh, k, declared_std, N, side, keys, t0) -> Reconstruction:
        """The measurements solver (``solver: measurements``; gradleak.attacks.common.token_measurements)."""
        from gradleak.attacks.common.subspace import spectral_margin
        from gradleak.attacks.common.token_measurements import invert_token_directions, residual_noise_std
        from gradleak.defenses.declared import view_noise_std
        from gradleak.metrics.patches import patches_to_image

        P, C = fb["patch"], fb["channels"]
        batch = int(view.public.get("batch_size") or view.updates[0].num_samples or 1)
        k = max(1, min(int(k), batch * (N + 1), len(S)))  # more directions than tokens hold noise only
        K, Pm, extra = token_basis(fb)
        Y = S[:k, None] * Vh[:k]  # U_kᵀ G: rows with i.i.d. noise of the upload's per-coordinate std
        M = torch.cat([K, Pm, extra], 1)
        read_std = residual_noise_std(Y, M)
        row_std = residual_noise_std(Y, M, per_row=True)  # each direction's own noise (near the edge: more)
        floor = declared_std or read_std or 1e-12
        prior = self._prior(C, side, P)
        sol = invert_token_directions(Y, K, Pm, extra, prior, row_std.clamp_min(1e-3 * floor), self.iterations)
        X = sol["X"]
        imgs = (patches_to_image(X, C, side, P)[None] + 1) / 2
        if self.clip:
            imgs = imgs.clamp(0, 1)
        t_attack = time.perf_counter() - t0
        reasons = []
        if batch > 1:
            reasons.append(f"batch of {batch}: the measurements solver recovers one image (B = 1)")
        if k < N:  # N patch directions determine the image (the CLS direction, when present, adds none)
            reasons.append(f"{k} of the {N + 1} token directions stand above the cut: the image is the posterior "
                           f"mean of {sol['measurements']} measurements of {sol['unknowns']} pixels under the prior")
        holds = batch <= 1 and k >= N
        t_fb = self._time_fwdbwd(view, max(batch, 1), side, C) if self.time_fwdbwd else float("nan")
        declared = view_noise_std(view, view.updates[0], tensor=keys)
        margin = spectral_margin([G], max(batch, 1) * (N + 1), declared or read_std)
        info = {"solver": "measurements (each direction above the cut decomposed in the known token basis; MAP under "
                          "a Gaussian image prior)", "prior": sol["prior"].source, "directions_used": k,
                "prior_evidence": sol["prior_evidence"],
                "token_directions": batch * (N + 1), "noise_std_read_off_residual": read_std,
                "noise_std_declared": declared, "objective": sol["objective"],
                "measurements": sol["measurements"], "unknowns": sol["unknowns"],
                "rank_condition": "holds" if holds else "; ".join(reasons),
                "rank_cut": (f"{k} directions (fixed)" if self.directions is not None else self.rank_cut),
                "prior_alone": ("the prior's mean, i.e. what the attack returns without the upload: the mean public "
                                "image (the evaluation's psnr_mean_public) or grey (psnr_grey) for the stationary prior"),
                "leakage_margin": {"layer": "block0_lora_A", **margin},
                "timings": {"attack_seconds": t_attack, "fwdbwd_seconds": t_fb,
                            "attack_to_fwdbwd_ratio": t_attack / t_fb if t_fb == t_fb and t_fb > 0 else float("nan")}}
        metrics = {"lora_span_rank_condition_holds": float(holds), "lora_span_row_space_rank": float(k),
                   "lora_span_directions_used": float(k), "lora_span_noise_std_read": read_std,
                   "attack_seconds": t_attack, "attack_to_fwdbwd_ratio": info["timings"]["attack_to_fwdbwd_ratio"]}
        metrics.update({f"{key}_block0_lora_A": v for key, v in margin.items()})
        return Reconstruction({"images": imgs.to(torch.float32)}, info, metrics)

    def _rank(self, view, G: torch.Tensor, S: torch.Tensor, N: int,
              keys: Optional[list[str]] = None) -> tuple[int, Optional[float]]:
        """The gradient's rank under ``rank_cut`` (config), and the noise std it assumed (None: exact). ``keys``: the
        upload's tensors stacked in G (per-tensor noise, stochastic rounding: their variances pooled by size)."""
        if self.rank_cut == "tokens":
            batch = int(view.public.get("batch_size") or 1)
            return min(batch * (N + 1), len(S)), None
        if self.rank_cut == "noise_edge":
            from gradleak.attacks.common.subspace import estimate_noise_std
            from gradleak.defenses.declared import view_noise_std

            sigma = view_noise_std(view, tensor=keys)
            if not sigma:
                sigma = estimate_noise_std([G])
            edge = sigma * (G.shape[0] ** 0.5 + G.shape[1] ** 0.5)
            return int((S > 1.05 * edge).sum()), float(sigma)
        return spectral_rank(S, self.min_gap, self.rank_rtol), None

    @staticmethod
    def _override(fb, state):
        """Use the sent round's values of the block-0 input parameters when the state carries them."""
        pre = fb["prefix"]
        mapping = {f"{pre['conv']}.weight": "E", f"{pre['conv']}.bias": "b", f"{pre['emb']}.position_embeddings": "pos",
                   f"{pre['emb']}.cls_token": "cls", f"{pre['norm']}.weight": "gamma", f"{pre['norm']}.bias": "beta"}
        for name, key in mapping.items():
            if name in state:
                v = state[name].detach().to(torch.float64).cpu()
                fb[key] = v.reshape(fb["d"], -1) if key == "E" else (v[0] if key == "pos" else v.reshape(-1))

    @staticmethod
    def _time_fwdbwd(view, batch, side, channels) -> float:
        """Seconds of one forward + backward (mean cross-entropy, gradients of the trainable parameters) of the
        sent model on a random batch of the client's size; the model is not changed."""
        model = view.model
        params = [p for p in model.parameters() if p.requires_grad]
        p0 = next(model.parameters())
        ncls = int(view.public.get("num_classes") or 2)
        g = torch.Generator().manual_seed(0)
        x = (torch.rand(batch, channels, side, side, generator=g) * 2 - 1).to(p0.device, p0.dtype)
        y = torch.randint(0, ncls, (batch,), generator=g).to(p0.device)
        best = float("inf")
        for _ in range(2):  # the first call pays one-off costs; keep the faster
            t = time.perf_counter()
            out = model(x)
            logits = out.logits if hasattr(out, "logits") else out
            torch.autograd.grad(torch.nn.functional.cross_entropy(logits, y), params, allow_unused=True)
            best = min(best, time.perf_counter() - t)
        return best


def token_basis(fb: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The known basis every block-0 token lies in (``first_block``'s pieces): ΓCE (d × n), ΓC(b + posₜ) (d × N), and
    the other known directions (d × e): β (when not zero) and the CLS token h₀."""
    gamma, beta = fb["gamma"], fb["beta"]
    K = gamma[:, None] * (fb["E"] - fb["E"].mean(0, keepdim=True))
    pos = fb["b"][None] + fb["pos"][1:]
    Pm = gamma[:, None] * (pos - pos.mean(1, keepdim=True)).T
    extra = [layer_norm(fb["cls"] + fb["pos"][0], gamma, beta, fb["eps"])[:, None]]
    if float(beta.norm()) > 1e-12 * float(gamma.norm()):
        extra.insert(0, beta[:, None])
    return K, Pm, torch.cat(extra, 1)


def _rel_residual(h: torch.Tensor, Uperp: torch.Tensor) -> torch.Tensor:
    return (h @ Uperp).norm(dim=-1) / h.norm(dim=-1).clamp_min(1e-300)


def _no_block0_lora(names) -> BadInput:
    lora = [n for n in names if "lora_A" in n]
    if any(re.search(r"(^|\.)encoder\.layer\.0\.", n) for n in lora):
        return BadInput("peft.lora_targets", "lora_span needs LoRA on block 0's attention query/key/value (their "
                        "shared input is the first-layer tokens); block 0 has LoRA only on other modules.",
                        "add query (and/or key, value) to peft.lora_targets, e.g. --set 'peft.lora_targets=[query,value]'.")
    if lora:
        return BadInput("peft.lora_layers", "lora_span needs LoRA on block 0 (its input is the first-layer tokens); "
                        "the LoRA layers chosen exclude block 0.", "include 0 in peft.lora_layers (or remove it: all layers).")
    return BadInput("peft.kind", "lora_span reads LoRA's A gradient on block 0, but the update holds no LoRA parameter.",
                    "set peft.kind=lora with query in peft.lora_targets and block 0 in peft.lora_layers.")
