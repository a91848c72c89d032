"""PEFTLeak (Sami et al., CVPR 2025; ``shared/papers/000``, SPEC §1): exact patch recovery from the
adapter gradients of a ViT poisoned by a malicious server.

The attack is split into the two parties' pieces, composed by the registered attack :class:`PEFTLeak`
(the round protocol of :mod:`gradleak.attacks.base`):

* :class:`PEFTLeakServer` — the malicious server: poisons the model once, plans the rounds, writes each
  round's malicious adapters. It owns the secrets the analysis needs (positional embeddings, the
  embedding map ``M``, every slot's read-out direction and thresholds) and the binning geometry
  (:meth:`~PEFTLeakServer.geometry`, :meth:`~PEFTLeakServer.stats`, :meth:`~PEFTLeakServer.adapter_inputs`)
  both pieces use.
* :class:`PEFTLeakRecovery` — the attacker's analysis, built as ``PEFTLeakRecovery(server)``: it reads the
  server's secrets through ``self.server`` and, at reconstruction time, only the
  :class:`~gradleak.fl.core.ServerView`. It holds no reference to the model or to any client data.

Pipeline (Algorithm 1):

1. :meth:`PEFTLeakServer.prepare` poisons the backbone once (§3.3, eq. 9–19): positional embeddings
   i.i.d. with std ``sigma`` (SPEC A1.1: "N(0, σ)" read as std), patch embedding ``E = 0.5·M``,
   LayerNorm weights ``sigma`` and bias 0, identity attention (Q = K = V = W_O = I, Q scaled by
   ``q_scale`` so the softmax is an exact one-hot in float64), identity MLP with ±γ biases (γ = 1e4);
   then it plans the rounds (:meth:`PEFTLeakServer._plan_rounds`, A1.8).
2. :meth:`PEFTLeakServer.adapter_state` writes the malicious adapters of one round (§3.4, eq. 20–23):
   every down-projection row of an adapter assigned to position t reads the target token through
   ``w = E_pos(t)`` (+ ``α·d_k`` in the improved design), the biases are thresholds from the public-data
   statistic (inverse Gaussian CDF in the paper design), the up-projection is ``up_scale·u_out·1ᵀ``.
   :meth:`PEFTLeak.server_model` loads it, and the poisoned head again (:meth:`PEFTLeakServer.round_state`),
   into the model the server sends that round.
3. :meth:`PEFTLeakRecovery.reconstruct` reads only the :class:`~gradleak.fl.core.ServerView`: eq. (24)
   (differences of consecutive neurons) isolates the adapter input of a lone patch in a bin, eq. (25)
   maps it back to pixels, then patches are grouped into images.

Decisions the paper leaves open (SPEC §1.11), each recorded here:

* A1.2 open quantiles: paper design uses probabilities ``i/(k+1)`` over the ``k = S_t·r`` neurons of a
  position, so no threshold is infinite.
* A1.3 the interval between the last neuron of one adapter and the first of the next cannot be
  differenced (different upstream coefficients) and is lost in the paper design, as are both tails.
  The improved design puts neuron 1 below every target statistic (but above every non-target one) and
  uses the top neuron alone for the top interval, so an adapter of width r gives r bins, not r−1.
* A1.4 "first neuron ≈ 1e-6": the up-projection is ``up_scale·u_out·1ᵀ`` — every hidden unit writes the
  same tiny vector, so every neuron of an adapter sees the same upstream coefficient per token and
  eq. (24) holds. ``up_scale = 1e-9`` (float64) keeps the forward perturbation negligible.
* A1.5/A1.9 LayerNorm. A LayerNorm destroys each token's mean and rescales it. We (i) set every
  LayerNorm's ``eps = sigma²`` (the server ships the config), so the norm of a LayerNorm output
  reveals the input's variance and the scale can be undone exactly; (ii) choose ``E = 0.5·M`` with
  ``M`` orthogonal mapping the *lowest-energy* pixel direction of the public patches (not the patch
  mean, as ``E = 0.5·I`` does) onto the all-ones direction the LayerNorm removes; that one pixel
  coordinate is filled with its public mean. When ``D > P²C`` (ViT-L/16) no pixel direction is lost.
  The authors' code leaves both effects uncorrected (≈17 dB patches).
* A1.6 float64 throughout (γ = 1e4 would cost ~1e-3 per pixel in float32).
* A1.8 placement: positions are served round-robin in blocks of ``positions_per_round``; each gets
  ``adapters_per_position`` consecutive adapter slots (paper: 5 per position, 4 positions a round,
  which reproduces its 1 round for CIFAR, 4 rounds for TinyImageNet, 2 rounds on ViT-L/16).
* Public statistics: the pixel distribution is pooled over all patches of the public images (the
  attacked images are never used); the per-position statistic is then exact, because a patch's
  adapter input is a known function of its pixels and E_pos(t) (identity attention, see
  :func:`slot_scales`).
* A1.9 grouping. The paper's image tag (first-MSA uniform head) overwrites 64 pixel values of every
  patch. We group *without a tag*: the head is rank one (logit 0 = ``head_scale·ŵᵀ pooled``) and the
  model mean-pools patch tokens, so the upstream coefficient of a lone patch in its bin is
  ``g_m·κ(x)`` with ``g_m = ∂L/∂logit_0`` shared by every token of image m and ``κ(x)`` a derivative
  the server computes from the recovered patch alone (tokens never mix under identity attention).
  ``g = Δb / κ(x)`` is therefore identical (to ~1e-10) for all patches of one image and differs
  between images; patches are grouped by it. This also enables *peeling* (improved design): the
  contribution of an already recovered patch to a collided bin is known exactly and can be removed.
* A1.10 the classification head is mean pooling over patch tokens (``model.pooling = mean``); with
  the CLS head and exactly-identity attention patch tokens get no gradient at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import numpy as np
import torch
from pydantic import Field
from torch import nn

from gradleak.attacks.base import AttackBase, AttackConfig, AttackContext, Reconstruction, ThreatModel
from gradleak.errors import BadInput
from gradleak.fl.core import ServerView
from gradleak.peft.adapters import AdapterSlot
from gradleak.registry import ATTACKS

F64 = torch.float64
#: two recovered patches closer than this (max-abs, pixels in [-1, 1]) are the same patch found twice
#: (each copy is exact to ~1e-4; distinct natural patches differ by far more)
SAME_PATCH = 1e-3


# --------------------------------------------------------------------------------------------------
# geometry helpers
# --------------------------------------------------------------------------------------------------

def image_to_patches(images: torch.Tensor, patch: int, reduce: int = 1) -> torch.Tensor:
    """(B, C, H, W) -> (B, N, C·(P/reduce)²) in the conv's flatten order (c, i, j), row-major positions.

    ``reduce = k`` averages k×k pixel blocks first (ViT-B/32 low-resolution variant, Table 3).
    """
    b, c, h, w = images.shape
    x = images.reshape(b, c, h // patch, patch, w // patch, patch).permute(0, 2, 4, 1, 3, 5)
    x = x.reshape(b, (h // patch) * (w // patch), c, patch, patch)
    if reduce > 1:
        x = x.reshape(*x.shape[:3], patch // reduce, reduce, patch // reduce, reduce).mean((4, 6))
    return x.reshape(b, x.shape[1], -1)


def patches_to_image(patches: torch.Tensor, channels: int, image_size: int, patch: int) -> torch.Tensor:
    """(N, C·P²) patches (NaN allowed) -> (C, H, W) image."""
    g = image_size // patch
    x = patches.reshape(g, g, channels, patch, patch).permute(2, 0, 3, 1, 4)
    return x.reshape(channels, image_size, image_size)


def upsample_patch(vec: torch.Tensor, channels: int, patch: int, reduce: int) -> torch.Tensor:
    """Reduced patch vector -> full-resolution patch vector (nearest, k×k repeat)."""
    p = patch // reduce
    x = vec.reshape(-1, channels, p, p)
    x = x.repeat_interleave(reduce, 2).repeat_interleave(reduce, 3)
    return x.reshape(vec.shape[0], -1)


def _householder_complement(u: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis (d × (d−1)) of the complement of the unit vector u, in O(d²) (Householder)."""
    d = u.shape[0]
    e = torch.zeros(d, dtype=F64)
    e[0] = 1.0
    v = e - u
    if float(v.norm()) < 1e-12:
        return torch.eye(d, dtype=F64)[:, 1:]
    H = torch.eye(d, dtype=F64) - 2 * torch.outer(v, v) / (v @ v)
    return H[:, 1:]  # H e_1 = u, so the other columns are orthonormal and ⊥ u


def _project_out(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Project x (d or n × d) onto the orthogonal complement of the orthonormal columns of q (d × k)."""
    return x - (x @ q) @ q.T


def slot_scales(v: torch.Tensor, n_blocks: int, sigma: float, eps: float) -> torch.Tensor:
    """Adapter-input scale φ for every slot, for tokens whose centred embedding has variance ``v``.

    Under the poisoned backbone the residual stream of a token stays ``a·y_c`` (y_c = its centred
    embedding): each LayerNorm outputs ``σ·a·y_c / sqrt(a²v + eps)`` (the MSA and MLP are identities and
    the adapters add ~up_scale), which is both the adapter's input and what the residual adds. Returns
    ``(..., 2·n_blocks + 1)``: slots in forward order, then the final LayerNorm.
    """
    a = torch.ones_like(v)
    out = []
    for _ in range(2 * n_blocks):
        phi = sigma * a / torch.sqrt(a * a * v + eps)
        out.append(phi)
        a = a + phi
    out.append(sigma * a / torch.sqrt(a * a * v + eps))
    return torch.stack(out, -1)


# --------------------------------------------------------------------------------------------------
# the plan the server keeps secret (read by the recovery)
# --------------------------------------------------------------------------------------------------

@dataclass
class SlotPlan:
    slot: AdapterSlot
    index: int  # slot index in forward order
    position: int  # target token position (1..N; 0 is the class token)
    weight: torch.Tensor  # (D,) read-out w of every neuron
    thresholds: torch.Tensor  # (r,) ascending c_j
    usable_bins: list[int]  # bin j = (c_j, c_{j+1}] (top bin: (c_r, inf))


@dataclass
class RoundPlan:
    slots: list[SlotPlan] = field(default_factory=list)


# --------------------------------------------------------------------------------------------------
# the malicious server: poisoning, planning, per-round adapters
# --------------------------------------------------------------------------------------------------

class PEFTLeakServer:
    """The malicious server of PEFTLeak with ``design="paper"`` (Algorithm 1 as published) or
    ``"improved"`` (default): poisoning (:meth:`prepare`, §3.3), round planning (:meth:`_plan_rounds`),
    the adapters of every round (:meth:`adapter_state`, §3.4) and the binning geometry both sides use.

    Improved design: every adapter of a position bins along its own direction
    ``w = E_pos(t) + α·d_k`` (d_k ⊥ all positional embeddings, from the top principal directions of the
    public patches, so the hashes are nearly independent), empirical equi-probable bins with no lost
    tails; the recovery cross-checks candidates against the other adapters' bins and peels collided
    bins (``peel``, a setting the server carries for the recovery).
    """

    def __init__(self, *, public_images: torch.Tensor, design: str = "improved", sigma: float = 10.0,
                 pe_distribution: str = "gaussian", gamma: float = 1e4, q_scale: float = 1e5,
                 up_scale: float = 1e-12, adapters_per_position: int | None = None,
                 positions_per_round: int | None = None, low_resolution: bool = False,
                 peel: bool = True, quantiles: str = "gaussian", fedavg_aware: bool = False,
                 expected_batch_size: int | None = None, seed: int = 0):
        if design not in ("paper", "improved"):
            raise BadInput("attack.design", f"unknown design '{design}'.", "use 'paper' or 'improved'.")
        if sigma <= 0:
            raise BadInput("attack.sigma", f"the positional-embedding std σ must be > 0, got {sigma}.", "use e.g. 10 (the paper's).")
        if pe_distribution not in ("gaussian", "laplacian"):
            raise BadInput("attack.pe_distribution", f"unknown '{pe_distribution}'.", "use 'gaussian' or 'laplacian'.")
        if public_images is None or len(public_images) == 0:
            raise BadInput("attack.public", "PEFTLeak needs public images to estimate patch statistics.",
                           "give a public dataset (e.g. public-natural).")
        self.design = design
        self.sigma = float(sigma)
        self.pe_distribution = pe_distribution
        self.gamma = float(gamma)
        self.q_scale = float(q_scale)
        self.up_scale = float(up_scale)
        # FedAvg (App. C.6): the client's SGD steps must neither round away the update against the large
        # thresholds nor move the adapters between local steps. The server shrinks the down-projection
        # (ε = 1e-7, bins unchanged), enlarges the up-projection (1e-5, same forward perturbation
        # ε·up_scale = 1e-12), shrinks the final LayerNorm (so the head barely trains) and lowers the
        # logit spread (so upstream gradients are small). See the FedAvg notes in docs/REPRODUCTION.md.
        self.fedavg_aware = fedavg_aware
        self.down_scale = 1e-9 if fedavg_aware else 1.0
        if fedavg_aware:
            self.up_scale = 1e-3
        self.logit_spread = 0.2 if fedavg_aware else 2.0
        self.adapters_per_position = adapters_per_position
        self.positions_per_round = positions_per_round
        self.low_resolution = low_resolution
        self.peel = peel and design == "improved"
        self.expected_batch_size = expected_batch_size
        if quantiles not in ("gaussian", "empirical"):
            raise BadInput("attack.quantiles", f"unknown '{quantiles}'.", "use 'gaussian' (the paper's) or 'empirical'.")
        self.quantiles = quantiles
        self.seed = seed
        self.public_images = public_images
        self.plans: list[RoundPlan] = []

    # ------------------------------------------------------------------ poisoning (once)
    @torch.no_grad()
    def prepare(self, model: nn.Module) -> nn.Module:
        """Poison the backbone and head in place; plan the rounds. Returns the model (float64)."""
        cfg = model.config
        layer0 = model.vit.encoder.layer[0] if hasattr(model, "vit") else None
        if layer0 is None or not hasattr(getattr(layer0, "output", None), "dense") or not hasattr(layer0, "intermediate"):
            raise BadInput("model.name", f"PEFTLeak's poisoning is written for the HF ViT block layout (intermediate + "
                           f"output.dense), not {type(layer0).__name__ if layer0 is not None else type(model).__name__}.",
                           "use a random-init HF ViT (model.name=vit-b16, vit-s16, vit-tiny ...).")
        if getattr(model, "pooling", "mean") != "mean":
            raise BadInput("model.pooling", "PEFTLeak's identity attention gives patch tokens no gradient under CLS pooling.",
                           "use model.pooling=mean (the server prescribes the head).")
        model.to(F64)
        gen = torch.Generator().manual_seed(self.seed)
        D, P, C, S = cfg.hidden_size, cfg.patch_size, cfg.num_channels, cfg.image_size
        full = P * P * C
        k = 1
        if full > D:
            if not self.low_resolution:
                raise BadInput("model.patch_size", f"the patch dimension P²C = {full} is larger than the width D = {D}, "
                               "so a patch cannot pass the patch embedding intact.",
                               "set attack.low_resolution=true (recover k×k block means, Table 3) or use a smaller patch.")
            k = int(round(math.sqrt(full / D)))
            if k * k * D != full or P % k:
                raise BadInput("model.patch_size", f"P²C = {full} is not D = {D} times a square k² with k dividing P.",
                               "use ViT-B/32 (k = 2) or a patch size whose P²C/D is a perfect square.")
        self.reduce = k
        self.D, self.P, self.C, self.S = D, P, C, S
        self.N = (S // P) ** 2
        self.Pd = full // (k * k)
        self.L = cfg.num_hidden_layers
        self.eps = self.sigma ** 2
        self.r = model.get_submodule(AdapterSlot(0, "msa").prefix).down.out_features

        pub = image_to_patches(self.public_images.to(F64) * 2 - 1, P, k).reshape(-1, self.Pd)
        self._pub = pub
        ones = torch.ones(1, D, dtype=F64) / math.sqrt(D)
        B0 = _householder_complement(ones[0])  # D × (D-1), ⊥ 1
        sub = pub if len(pub) <= 4096 else pub[torch.randperm(len(pub), generator=gen)[:4096]]
        # principal pixel directions (improved design's binning directions), by a randomised SVD
        _, _, V_top = torch.svd_lowrank(sub - sub.mean(0), q=min(2 * self.L + 4, self.Pd), niter=3)
        self._principal = V_top.T
        if self.Pd < D:
            M = B0[:, : self.Pd]
            self.lost_dir, self.lost_mean = None, 0.0
        else:
            u, energy = self._low_energy_direction(sub)
            V = _householder_complement(u)
            M = B0 @ V.T + ones.T @ u[None]
            self.lost_dir, self.lost_mean = u, float((pub @ u).mean())
            self.lost_energy = energy
        self.M = M  # D × Pd, orthonormal columns
        # positional embeddings, class token 0
        if self.pe_distribution == "gaussian":
            pos = torch.randn(self.N + 1, D, generator=gen, dtype=F64) * self.sigma
        else:
            u01 = torch.rand(self.N + 1, D, generator=gen, dtype=F64) - 0.5
            pos = -torch.sign(u01) * torch.log1p(-2 * u01.abs()) * (self.sigma / math.sqrt(2))
        self.pos = pos
        self.pos_c = pos - pos.mean(1, keepdim=True)
        self._pos_norm2 = (self.pos_c * self.pos_c).sum(1)
        emb = model.vit.embeddings
        emb.position_embeddings.copy_(pos[None])
        emb.cls_token.zero_()
        E = 0.5 * M  # D × Pd
        if k > 1:
            E = (E.reshape(D, C, P // k, 1, P // k, 1) / (k * k)).expand(D, C, P // k, k, P // k, k)
        emb.patch_embeddings.projection.weight.copy_(E.reshape(D, C, P, P))
        emb.patch_embeddings.projection.bias.zero_()
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.fill_(self.sigma)
                m.bias.zero_()
                m.eps = self.eps
        self.final_ln = self.sigma * (1e-4 if self.fedavg_aware else 1.0)
        model.vit.layernorm.weight.fill_(self.final_ln)
        cfg.layer_norm_eps = self.eps
        eye = torch.eye(D, dtype=F64)
        for layer in model.vit.encoder.layer:
            att = layer.attention.attention
            att.query.weight.copy_(eye * self.q_scale)
            att.key.weight.copy_(eye)
            att.value.weight.copy_(eye)
            for lin in (att.query, att.key, att.value):
                lin.bias.zero_()
            out = layer.attention.output.dense
            out = out.base if hasattr(out, "base") else out
            out.weight.copy_(eye)
            out.bias.zero_()
            inter = layer.intermediate.dense
            inter.weight.zero_()
            inter.weight[:D].copy_(eye)
            inter.bias.fill_(self.gamma)
            o2 = layer.output.dense
            o2 = o2.base if hasattr(o2, "base") else o2
            o2.weight.zero_()
            o2.weight[:, :D].copy_(eye)
            o2.bias.fill_(-self.gamma)
        # head direction ŵ ⊥ 1 and ⊥ every positional embedding; u_out = ŵ
        self._blocked, _ = torch.linalg.qr(torch.cat([ones, self.pos_c / self.pos_c.norm(dim=1, keepdim=True)]).T)
        w = _project_out(self._blocked, torch.randn(D, generator=gen, dtype=F64))
        self.w_head = w / w.norm()
        self.u_out = self.w_head
        # head scale: spread of the pooled feature over public images -> logits of O(1) spread
        feat = self._pooled_feature(self.public_images[:256])
        self.head_scale = float(self.logit_spread / max(feat.std().item(), 1e-300))
        model.head.weight.zero_()
        model.head.weight[0].copy_(self.head_scale * self.w_head)
        # centre p(class 0) at 1/2 so every image's coefficient g = p_0 − [y = 0] is of order 1/2
        # (a tiny g would let a colliding patch hide behind a dominant one)
        model.head.bias.zero_()
        model.head.bias[0] = math.log(max(model.head.out_features - 1, 1)) - self.head_scale * float(feat.mean())
        self._plan_rounds()
        # the poisoned values of every parameter the clients train (the head; the adapters are rewritten each
        # round): the server re-sends them every round (round_state), undoing the aggregate step of the
        # previous round, so the rank-one head and g = ∂L/∂logit_0 hold in every round
        self.poisoned_trainable = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        return model


    def _low_energy_direction(self, pub: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The pixel direction the LayerNorm is allowed to destroy: the least-energy combination (on the
        public patches) of the highest-frequency 2-D DCT atoms of each channel. Natural patches carry
        almost nothing there, so filling it with its public mean costs ~1e-4 per pixel or less."""
        p = int(round(math.sqrt(self.Pd / self.C)))
        i = torch.arange(p, dtype=F64)
        basis = []
        for c in range(self.C):
            for ku in (p - 1, p - 2):
                for kv in (p - 1, p - 2):
                    atom = torch.zeros(self.C, p, p, dtype=F64)
                    atom[c] = torch.outer(torch.cos(math.pi * (i + 0.5) * ku / p), torch.cos(math.pi * (i + 0.5) * kv / p))
                    basis.append(atom.reshape(-1) / atom.norm())
        A = torch.stack(basis)  # k × Pd, orthonormal (distinct DCT atoms)
        proj = pub @ A.T
        evals, evecs = torch.linalg.eigh(proj.T @ proj / len(proj))
        u = evecs[:, 0] @ A
        return u / u.norm(), float(evals[0])

    # ------------------------------------------------------------------ statistics
    def geometry(self, x: torch.Tensor) -> "PatchGeometry":
        """Precompute what every statistic of reduced pixel vectors ``x`` (n × Pd) needs."""
        Mx = x @ self.M.T
        Mx_c = Mx - Mx.mean(1, keepdim=True)
        return PatchGeometry(Mx_c, (Mx_c * Mx_c).sum(1), Mx_c @ self.pos_c.T)

    def _variance(self, geo: "PatchGeometry", t: torch.Tensor) -> torch.Tensor:
        rows = torch.arange(len(geo.norm2))
        return (0.25 * geo.norm2 + geo.pdot[rows, t] + self._pos_norm2[t]) / self.D

    def stats(self, geo: "PatchGeometry", t: torch.Tensor | int, idx: torch.Tensor | int,
              w: torch.Tensor) -> torch.Tensor:
        """Pre-activation ``wᵀh`` of each patch at position(s) t in slot(s) idx (w: D or n × D)."""
        n = len(geo.norm2)
        t = torch.as_tensor(t).expand(n) if torch.as_tensor(t).dim() == 0 else torch.as_tensor(t)
        idx = torch.as_tensor(idx).expand(n) if torch.as_tensor(idx).dim() == 0 else torch.as_tensor(idx)
        if w.dim() == 1:
            proj = 0.5 * (geo.Mx_c @ w) + (self.pos_c @ w)[t]
        else:
            proj = 0.5 * (geo.Mx_c * w).sum(1) + (self.pos_c[t] * w).sum(1)
        return self._phi(geo, t).gather(1, idx[:, None])[:, 0] * proj

    def _phi(self, geo: "PatchGeometry", t: torch.Tensor) -> torch.Tensor:
        """φ for every slot (n × slots+1), cached per geometry for a constant position."""
        if bool((t == t[0]).all()):
            key = int(t[0])
            if key not in geo.cache:
                geo.cache[key] = slot_scales(self._variance(geo, t), self.L, self.sigma, self.eps)
            return geo.cache[key]
        return slot_scales(self._variance(geo, t), self.L, self.sigma, self.eps)

    def adapter_inputs(self, geo: "PatchGeometry", t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Exact adapter inputs h (n × D) of patches at positions t in slots idx."""
        v = self._variance(geo, t)
        phi = slot_scales(v, self.L, self.sigma, self.eps).gather(1, idx[:, None])
        return phi * (0.5 * geo.Mx_c + self.pos_c[t])

    def _pooled_feature(self, images: torch.Tensor) -> torch.Tensor:
        x = image_to_patches(images.to(F64) * 2 - 1, self.P, self.reduce)
        feats = []
        for t in range(1, self.N + 1):
            geo = self.geometry(x[:, t - 1])
            feats.append(self.stats(geo, t, 2 * self.L, self.w_head) * (self.final_ln / self.sigma))
        return torch.stack(feats, 1).mean(1)

    # ------------------------------------------------------------------ planning
    def _plan_rounds(self) -> None:
        n_slots = 2 * self.L
        N = self.N
        K = self.adapters_per_position
        ppr = self.positions_per_round
        if K is None and ppr is None:
            # the paper's rule: 5 adapters per position (4 positions a round on ViT-B/16, 9 on ViT-L/16);
            # the slots left over are spread over the same positions (so 6 per position on ViT-B/16)
            ppr = min(N, max(1, n_slots // 5))
        if ppr is None:
            ppr = max(1, n_slots // K)
        if K is None:
            K = max(1, n_slots // ppr)
        if K * ppr > n_slots:
            raise BadInput("attack.adapters_per_position", f"{K} adapters × {ppr} positions exceed the {n_slots} adapter slots.",
                           "lower attack.adapters_per_position or attack.positions_per_round.")
        self.K, self.ppr = K, ppr
        # Improved design: one hash direction per adapter pays off when a patch is likely to sit alone in
        # at least one of its K bins of width 1/r and peeling can cascade from there. With few bins per
        # adapter (small r) or a single adapter per position, one long direction over all K·r neurons
        # isolates more; then the improved design falls back to the paper's single-direction binning.
        self.multi_direction = self.design == "improved"
        B = self.expected_batch_size
        if self.multi_direction and (K == 1 or B):
            p_multi = 1 - (1 - (1 - 1 / self.r) ** (B - 1)) ** K if B else 0.0
            p_single = (1 - 1 / (K * (self.r - 1) + 1)) ** (B - 1) if B else 1.0
            self.multi_direction = K > 1 and (p_multi >= 0.3 or p_multi >= p_single)
        slots = [AdapterSlot(b, kind) for b in range(self.L) for kind in ("msa", "mlp")]
        gen = torch.Generator().manual_seed(self.seed + 1)
        pub = self._pub
        if len(pub) > 3072:
            pub = pub[torch.randperm(len(pub), generator=gen)[:3072]]
        self._pub_geo = self.geometry(pub)
        small = pub[torch.randperm(len(pub), generator=gen)[:512]]
        self._pub_geo_small = self.geometry(small)
        self._cls_geo = PatchGeometry(torch.zeros(1, self.D, dtype=F64), torch.zeros(1, dtype=F64),
                                      torch.zeros(1, self.N + 1, dtype=F64))
        # improved design: binning directions from the public patches' principal directions
        # (the first one, ~the patch mean, is shared by every position's E_pos read-out, so skip it)
        Vt = self._principal[1:]
        self.plans = []
        positions = list(range(1, N + 1))
        for start in range(0, N, ppr):
            round_plan = RoundPlan()
            chunk = positions[start:start + ppr]
            for pi, t in enumerate(chunk):
                my_slots = list(range(pi * K, (pi + 1) * K))
                for s_i, idx in enumerate(my_slots):
                    round_plan.slots.append(self._plan_slot(slots[idx], idx, t, s_i, K, Vt))
            self.plans.append(round_plan)

    def _nontarget_stats(self, t: int, idx: int, w: torch.Tensor) -> torch.Tensor:
        """Pre-activations every other token gets (other positions' public patches, the class token)."""
        geo = self._pub_geo_small
        n = len(geo.norm2)
        parts = [self.stats(self._cls_geo, 0, idx, w)]
        parts += [self.stats(geo, torch.full((n,), pos), idx, w) for pos in range(1, self.N + 1) if pos != t]
        return torch.cat(parts)

    def _plan_slot(self, slot: AdapterSlot, idx: int, t: int, s_i: int, K: int, Vt: torch.Tensor) -> SlotPlan:
        r = self.r
        p_t = self.pos[t]
        geo = self._pub_geo
        if not self.multi_direction:
            w = p_t.clone()
            stat = self.stats(geo, t, idx, w)
            k_t = K * r
            probs = (np.arange(s_i * r, (s_i + 1) * r) + 1) / (k_t + 1)
            if self.quantiles == "gaussian":  # the paper: inverse CDF of a Gaussian fitted to the public statistic
                from scipy.stats import norm as _normal

                mu, sd = float(stat.mean()), float(stat.std())
                thr = torch.tensor(mu + sd * _normal.ppf(probs), dtype=F64)
            else:  # ablation: empirical quantiles of the public statistic
                thr = torch.quantile(stat, torch.tensor(probs, dtype=F64))
            usable = list(range(r - 1))
        else:
            d = _project_out(self._blocked, self.M @ Vt[s_i % Vt.shape[0]])
            d = d / d.norm()
            # largest α that keeps every non-target token below every target statistic (with margin);
            # statistics are linear in the read-out, so stats(p_t + α·d) = stats(p_t) + α·stats(d)
            tgt_p, tgt_d = self.stats(geo, t, idx, p_t), self.stats(geo, t, idx, d)
            non_p, non_d = self._nontarget_stats(t, idx, p_t), self._nontarget_stats(t, idx, d)
            gap = float(tgt_p.min() - non_p.max())
            alpha = max(gap / (4 * (float(tgt_d.abs().max()) + 1e-12)), 0.0)
            for _ in range(60):
                w = p_t + alpha * d
                tgt = tgt_p + alpha * tgt_d
                non = float((non_p + alpha * non_d).max())
                if float(tgt.min()) - non > 0.25 * float(tgt.max() - tgt.min()) or alpha == 0:
                    break
                alpha = alpha / 2 if alpha > 1e-6 else 0.0
            probs = torch.arange(1, r, dtype=F64) / r
            inner = torch.quantile(tgt, probs)
            lo, hi = float(tgt.min()), float(tgt.max())
            floor = max(non + 0.5 * max(lo - non, 0.0), non + 1e-9 * abs(non))
            floor = min(floor, lo - 1e-3 * (hi - lo))
            thr = torch.cat([torch.tensor([floor], dtype=F64), inner])
            usable = list(range(r))
        return SlotPlan(slot, idx, t, w, thr, usable)

    @property
    def num_rounds(self) -> int:
        return len(self.plans)

    # ------------------------------------------------------------------ malicious adapters (each round)
    @torch.no_grad()
    def adapter_state(self, round_index: int) -> dict[str, torch.Tensor]:
        """Adapter parameters the server sends in round ``round_index`` (eq. 20–23)."""
        r, D = self.r, self.D
        state: dict[str, torch.Tensor] = {}
        used = {sp.index: sp for sp in self.plans[round_index].slots}
        for b in range(self.L):
            for kind in ("msa", "mlp"):
                slot = AdapterSlot(b, kind)
                idx = 2 * b + (kind == "mlp")
                sp = used.get(idx)
                down_w = torch.zeros(r, D, dtype=F64)
                down_b = torch.full((r,), -1.0, dtype=F64)  # benign: never active
                up_w = torch.zeros(D, r, dtype=F64)
                if sp is not None:
                    down_w[:] = sp.weight * self.down_scale
                    down_b = -sp.thresholds * self.down_scale
                    up_w = self.up_scale * self.u_out[:, None].expand(D, r).clone()
                state[f"{slot.prefix}.down.weight"] = down_w
                state[f"{slot.prefix}.down.bias"] = down_b
                state[f"{slot.prefix}.up.weight"] = up_w
                state[f"{slot.prefix}.up.bias"] = torch.zeros(D, dtype=F64)
        return state

    def round_state(self, round_index: int) -> dict[str, torch.Tensor]:
        """Every trainable parameter the server sends in round ``round_index``: the poisoned head (and any
        other trainable parameter) as after :meth:`prepare`, and that round's :meth:`adapter_state`."""
        return {**self.poisoned_trainable, **self.adapter_state(round_index)}


# --------------------------------------------------------------------------------------------------
# the attacker's analysis: recovery from the server view
# --------------------------------------------------------------------------------------------------

class PEFTLeakRecovery:
    """The attacker's side of PEFTLeak: eq. (24)–(25) per bin, the consistency and trust checks, peeling,
    deduplication and grouping by the image coefficient g.

    Built from a prepared server (``PEFTLeakRecovery(server)``); reads the server's secrets (plans,
    positional embeddings, ``M``, thresholds, scales) through ``self.server`` and, in :meth:`reconstruct`,
    the observed updates and per-round adapter states of the :class:`~gradleak.fl.core.ServerView` only.
    Holds no reference to the model or to any client data.
    """

    def __init__(self, server: PEFTLeakServer):
        self.server = server
        # per reconstruction: tolerance on g agreement, and each slot's bin differences Δb of the round
        self._match_tol = 1e-6
        self._dgb: dict[int, torch.Tensor] = {}

    def simulate_tokens(self, y: torch.Tensor, state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Per-token forward of the poisoned model for embedding outputs ``y`` (n × D).

        Under the poisoned backbone the MSA of a token is exactly its LayerNorm output (one-hot softmax,
        identity Q/K/V/W_O) and the MLP is the identity (±γ biases), so a token's path is
        ``x ← x + A(LN(x))`` twice per block with A the round's adapters. Returns the final LayerNorm
        output and every adapter output (in slot order). ``tests/test_peftleak.py`` checks it against the
        real model.
        """
        srv = self.server
        D = srv.D
        ln_w = torch.full((D,), srv.sigma, dtype=F64)
        ln_b = torch.zeros(D, dtype=F64)
        x = y
        outs = []
        for b in range(srv.L):
            for kind in ("msa", "mlp"):
                pre = AdapterSlot(b, kind).prefix
                z = nn.functional.layer_norm(x, (D,), ln_w, ln_b, srv.eps)
                act = torch.relu(z @ state[f"{pre}.down.weight"].T + state[f"{pre}.down.bias"])
                out = z + act @ state[f"{pre}.up.weight"].T + state[f"{pre}.up.bias"]
                outs.append(out)
                x = x + out
        return nn.functional.layer_norm(x, (D,), torch.full((D,), srv.final_ln, dtype=F64), ln_b, srv.eps), outs

    def _token_coefficients(self, state: dict[str, torch.Tensor], x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """κ (n × slots): the coefficient a lone token adds to every neuron's bias gradient per unit g,
        where g = ∂L/∂logit_0 of its image: κ = up_scale · u_outᵀ ∂(head_scale/N · ŵᵀ LN_f(token))/∂(adapter out)."""
        srv = self.server
        y = (0.5 * (x @ srv.M.T) + srv.pos[positions]).requires_grad_(True)
        with torch.enable_grad():
            final, outs = self.simulate_tokens(y, state)
            for o in outs:
                o.retain_grad()
            ((srv.head_scale / srv.N) * (final @ srv.w_head)).sum().backward()
        return torch.stack([o.grad @ srv.u_out for o in outs], 1).detach() * srv.up_scale

    def reconstruct(self, view: ServerView) -> Reconstruction:
        """Recover patches from the observed per-round adapter gradients and group them into images.

        ``data``: ``patches`` (n × P²C/reduce², in [-1, 1]), their ``positions`` (1..N), image ``groups``,
        image coefficients ``g``, and the geometry the evaluation needs to place them (``reduce``,
        ``patch_size``, ``channels``, ``num_positions``, ``image_size``, ``attacked_positions``: the
        positions attacked in the rounds the view holds). ``metrics``: the plan's numbers (no ground truth).
        """
        srv = self.server
        if view.secure_aggregation or not view.rounds:
            raise BadInput("fl.secure_aggregation", "PEFTLeak needs the victim's individual per-round updates.",
                           "turn secure aggregation off for this attack (it then sees only the aggregate).")
        n_rounds = min(len(view.rounds), len(srv.plans))
        # how closely the image coefficient g of two patches of one image agree: to float64 rounding
        # after one gradient step; to ~1e-4 after several FedAvg steps (the adapters move a little)
        multi_step = any(u.kind == "pseudo_gradient" and u.local_steps > 1 for r in view.rounds for u in r)
        self._match_tol = 1e-4 if multi_step else 1e-6
        found: list[dict[str, Any]] = []
        bins_seen = 0
        for k in range(n_rounds):
            upd = view.rounds[k][0]
            state = {n: v.detach().cpu() for n, v in view.round_states[k].items()}  # the analysis runs on the CPU
            found += self._recover_round(k, upd, state)
            bins_seen += sum(len(sp.usable_bins) for sp in srv.plans[k].slots)
        patches, positions, gvals = self._dedupe(found)
        groups = group_by_coefficient(gvals, positions, self._match_tol)
        info = {"candidates": len(found), "unique_patches": int(len(patches)), "rounds": n_rounds,
                "bins": bins_seen, "groups": int(groups.max() + 1) if len(groups) else 0,
                "design": srv.design}
        attacked = sorted({sp.position for plan in srv.plans[:n_rounds] for sp in plan.slots})
        data = {"patches": patches, "positions": positions, "groups": groups, "g": gvals, "reduce": srv.reduce,
                "patch_size": srv.P, "channels": srv.C, "num_positions": srv.N, "image_size": srv.S,
                "attacked_positions": attacked}
        metrics = {"attacked_positions": len(attacked), "rounds_used": n_rounds, "adapters_per_position": srv.K,
                   "hash_directions_per_position": srv.K if srv.multi_direction else 1,
                   "positions_per_round": srv.ppr, "rounds_needed_all_positions": srv.num_rounds}
        return Reconstruction(data, info, metrics)

    def _recover_round(self, k: int, upd, state: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
        plan = self.server.plans[k]
        self._dgb: dict[int, torch.Tensor] = {}
        nonempty: dict[int, torch.Tensor] = {}
        bins: list[dict[str, Any]] = []  # every nonempty bin of this round
        for sp in plan.slots:
            pre = sp.slot.prefix
            if f"{pre}.down.weight" not in upd.tensors:
                raise BadInput("update", f"the observed update lacks '{pre}.down.weight'.",
                               "the client must upload the adapter gradients (adapters trainable).")
            GW = upd.tensors[f"{pre}.down.weight"].to("cpu", F64)
            Gb = upd.tensors[f"{pre}.down.bias"].to("cpu", F64)
            dGb = torch.cat([Gb[:-1] - Gb[1:], Gb[-1:]])  # bin j = neuron j minus neuron j+1; top bin alone
            dGW = torch.cat([GW[:-1] - GW[1:], GW[-1:]])
            scale = float(Gb.abs().max()) + 1e-300
            ok = torch.zeros(self.server.r, dtype=torch.bool)
            ok[sp.usable_bins] = True
            tol = (1e-6 if upd.kind == "pseudo_gradient" else 1e-9) * scale  # FedAvg: update is a weight difference
            ok &= dGb.abs() > tol
            nonempty[sp.index] = dGb.abs() > tol
            self._dgb[sp.index] = dGb
            for j in torch.nonzero(ok)[:, 0].tolist():
                bins.append({"plan": sp, "bin": j, "db": float(dGb[j]), "dw": dGW[j]})
        if not bins:
            return []
        cands = self._candidates(bins, [b["db"] for b in bins], torch.stack([b["dw"] for b in bins]), k)
        if self.server.multi_direction:
            cands = self._filter_consistent(cands, plan, nonempty)
        self._attach_g(cands, state)
        if self.server.multi_direction:
            cands = self._trusted(cands, plan)
        if self.server.peel and self.server.multi_direction:
            cands = self._peel(cands, bins, plan, nonempty, state)
        return cands

    def _trusted(self, cands: list[dict], plan: RoundPlan) -> list[dict]:
        """Keep a candidate if another adapter confirms it (its predicted bin there holds exactly
        ``g·κ``: it is alone there too) or another patch of a different position shares its image
        coefficient g. A mixture of colliding patches has a meaningless g and fails both."""
        if not cands:
            return []
        t = torch.tensor([c["position"] for c in cands])
        g = torch.tensor([c["g"] for c in cands], dtype=F64)
        kappa = torch.stack([c["kappa"] for c in cands])
        own = torch.tensor([c["bin"]["plan"].index for c in cands])
        trusted = torch.zeros(len(cands), dtype=torch.bool)
        for idx, b in self._candidate_bins(cands, plan).items():
            rows = torch.nonzero((b >= 0) & (own != idx))[:, 0]
            if len(rows):
                observed = self._dgb[idx][b[rows]]
                expected = g[rows] * kappa[rows, idx]
                trusted[rows] |= (observed - expected).abs() <= self._match_tol * observed.abs()
        order = torch.argsort(g)
        gs, ts = g[order], t[order]
        close = (gs[1:] - gs[:-1]).abs() <= self._match_tol * torch.maximum(gs[1:].abs(), gs[:-1].abs())
        pair = close & (ts[1:] != ts[:-1])
        shared = torch.zeros(len(cands), dtype=torch.bool)
        shared[order[1:][pair]] = True
        shared[order[:-1][pair]] = True
        keep = trusted | shared
        return [c for c, k in zip(cands, keep.tolist()) if k]

    def _candidates(self, bins: list[dict], db: list[float], dw: torch.Tensor, k: int) -> list[dict]:
        """Eq. (24)–(25) for every bin at once: h = Δw/Δb, then undo LayerNorm scale and embedding."""
        if not bins:
            return []
        H = dw / torch.tensor(db, dtype=F64)[:, None]
        t = torch.tensor([b["plan"].position for b in bins])
        idx = torch.tensor([b["plan"].index for b in bins])
        X = self._h_to_pixels(H, t, idx)
        return [{"x": X[i], "position": int(t[i]), "bin": {**bins[i], "db": db[i]}, "round": k} for i in range(len(bins))]

    def _h_to_pixels(self, h: torch.Tensor, t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Adapter inputs h (n × D) -> reduced pixel vectors: solve φ(v)²v = ‖h‖²/D for the variance v,
        divide out the LayerNorm scale φ, subtract E_pos and invert E = 0.5·M (eq. 25)."""
        srv = self.server
        target = (h * h).sum(1) / srv.D
        lo = torch.full_like(target, -30.0)
        hi = torch.full_like(target, 30.0)
        for _ in range(64):  # bisection on log v; φ(v)²v is increasing in v
            mid = 0.5 * (lo + hi)
            v = torch.exp(mid)
            val = slot_scales(v, srv.L, srv.sigma, srv.eps).gather(1, idx[:, None])[:, 0] ** 2 * v
            up = val < target
            lo = torch.where(up, mid, lo)
            hi = torch.where(up, hi, mid)
        v = torch.exp(0.5 * (lo + hi))
        phi = slot_scales(v, srv.L, srv.sigma, srv.eps).gather(1, idx[:, None])
        x = 2 * (h / phi - srv.pos_c[t]) @ srv.M
        if srv.lost_dir is not None:
            x = x + srv.lost_mean * srv.lost_dir
        return x

    def _bins_of(self, X: torch.Tensor, t: torch.Tensor, plan: RoundPlan) -> dict[int, torch.Tensor]:
        """Bin index of each patch in every slot of its position (-2: other position, -1: below c_1)."""
        geo = self.server.geometry(X)
        out = {}
        for sp in plan.slots:
            b = torch.full((len(X),), -2, dtype=torch.long)
            rows = torch.nonzero(t == sp.position)[:, 0]
            if len(rows):
                sub = PatchGeometry(geo.Mx_c[rows], geo.norm2[rows], geo.pdot[rows])
                s = self.server.stats(sub, sp.position, sp.index, sp.weight)
                b[rows] = torch.searchsorted(sp.thresholds, s) - 1
            out[sp.index] = b
        return out

    def _candidate_bins(self, cands: list[dict], plan: RoundPlan) -> dict[int, torch.Tensor]:
        """``_bins_of`` for candidates, computed once per candidate and kept in ``c["bins"]`` (the
        consistency filter, the trust check and every peeling pass ask for the same bins)."""
        missing = [c for c in cands if "bins" not in c]
        if missing:
            X = torch.stack([c["x"] for c in missing])
            t = torch.tensor([c["position"] for c in missing])
            where = self._bins_of(X, t, plan)
            for i, c in enumerate(missing):
                c["bins"] = torch.stack([where[sp.index][i] for sp in plan.slots])
        table = torch.stack([c["bins"] for c in cands])  # n × slots of the round, in plan order
        return {sp.index: table[:, k] for k, sp in enumerate(plan.slots)}

    def _filter_consistent(self, cands: list[dict], plan: RoundPlan, nonempty: dict[int, torch.Tensor]) -> list[dict]:
        """Keep candidates in [-1, 1] that fall, in every adapter of their position, into a nonempty bin
        (a mixture of colliding patches almost never does)."""
        if not cands:
            return []
        X = torch.stack([c["x"] for c in cands])
        keep = X.abs().amax(1) <= 1.0 + 1e-3
        for idx, b in self._candidate_bins(cands, plan).items():
            mine = b != -2
            ok = torch.zeros_like(keep)
            ok[mine] = (b[mine] >= 0) & nonempty[idx][b[mine].clamp(min=0)]
            keep &= ~mine | ok
        return [c for c, k in zip(cands, keep.tolist()) if k]

    def _attach_g(self, cands: list[dict], state: dict[str, torch.Tensor]) -> None:
        if not cands:
            return
        X = torch.stack([c["x"] for c in cands])
        pos = torch.tensor([c["position"] for c in cands])
        kappa = self._token_coefficients(state, X, pos)
        for c, kap in zip(cands, kappa):
            c["kappa"] = kap
            c["g"] = c["bin"]["db"] / float(kap[c["bin"]["plan"].index])

    def _peel(self, cands: list[dict], bins: list[dict], plan: RoundPlan, nonempty: dict[int, torch.Tensor],
              state: dict[str, torch.Tensor]) -> list[dict]:
        """Subtract the exact contribution ``g·κ·(h, 1)`` of recovered patches from collided bins and
        recover what is left when it is a lone patch (checked like any candidate)."""
        known = self._unique(cands)
        for _ in range(8):
            if not known:
                break
            X = torch.stack([c["x"] for c in known])
            t = torch.tensor([c["position"] for c in known])
            g = torch.tensor([c["g"] for c in known], dtype=F64)
            kappa = torch.stack([c["kappa"] for c in known])
            where = self._candidate_bins(known, plan)
            geo = self.server.geometry(X)
            res_b, res_w, res_bins = [], [], []
            for b in bins:
                sp = b["plan"]
                members = torch.nonzero(where[sp.index] == b["bin"])[:, 0]
                if len(members) == 0:
                    continue
                coef = g[members] * kappa[members, sp.index]
                sub = PatchGeometry(geo.Mx_c[members], geo.norm2[members], geo.pdot[members])
                h = self.server.adapter_inputs(sub, t[members], torch.full((len(members),), sp.index))
                db = b["db"] - float(coef.sum())
                if abs(db) <= 1e-6 * abs(b["db"]):
                    continue
                res_b.append(db)
                res_w.append(b["dw"] - coef @ h)
                res_bins.append(b)
            if not res_bins:
                break
            new = self._candidates(res_bins, res_b, torch.stack(res_w), known[0]["round"])
            new = self._filter_consistent(new, plan, nonempty)
            new = self._unique(known + new)[len(known):]  # known is duplicate-free, so its entries all stay
            if not new:
                break
            self._attach_g(new, state)
            ok = {id(c) for c in self._trusted(known + new, plan)}
            new = [c for c in new if id(c) in ok]
            if not new:
                break
            known += new
        return known

    @staticmethod
    def _unique(cands: list[dict]) -> list[dict]:
        seen: list[dict] = []
        by_pos: dict[int, list[torch.Tensor]] = {}
        for c in cands:
            lst = by_pos.setdefault(c["position"], [])
            if lst and float((torch.stack(lst) - c["x"]).abs().amax(1).min()) < SAME_PATCH:
                continue
            lst.append(c["x"])
            seen.append(c)
        return seen

    def _dedupe(self, found: list[dict]):
        uniq = self._unique(found)  # the same patch isolated by two adapters is one patch
        if not uniq:
            return (torch.zeros(0, self.server.Pd, dtype=F64), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=F64))
        X = torch.stack([c["x"] for c in uniq]).clamp(-1, 1)
        pos = torch.tensor([c["position"] for c in uniq], dtype=torch.long)
        g = torch.tensor([c.get("g", float("nan")) for c in uniq], dtype=F64)
        return X, pos, g


# --------------------------------------------------------------------------------------------------
# the registered attack: the round protocol over the two pieces
# --------------------------------------------------------------------------------------------------

class PEFTLeakConfig(AttackConfig):
    """Parameters of the ``peftleak`` attack (``attack:`` section of a config)."""

    design: Literal["paper", "improved"] = Field(
        "improved", description="'paper': Algorithm 1 as published; 'improved': one hash direction per adapter, no lost tails, peeling")
    sigma: float = Field(10.0, gt=0, le=1e4, description="std σ of the poisoned positional embeddings (paper: 10)")
    pe_distribution: Literal["gaussian", "laplacian"] = Field(
        "gaussian", description="distribution of the positional embeddings (std sigma either way)")
    adapters_per_position: Optional[int] = Field(
        None, ge=1, description="adapter slots per attacked position (default: the paper's rule, all slots of a round shared)")
    positions_per_round: Optional[int] = Field(
        None, ge=1, description="positions attacked per round (default: the paper's rule, slots // 5)")
    max_rounds: Optional[int] = Field(None, ge=1, description="stop after this many rounds (default: as many as the plan needs)")
    low_resolution: bool = Field(False, description="recover k×k block means when P²C > D (ViT-B/32, Table 3)")
    peel: bool = Field(True, description="improved design: subtract recovered patches from collided bins")
    quantiles: Literal["gaussian", "empirical"] = Field(
        "gaussian", description="paper design's bin edges: inverse Gaussian CDF (the paper's) or empirical quantiles")
    fedavg_aware: Optional[bool] = Field(
        None, description="FedAvg-aware scaling of the malicious weights (App. C.6); default: on when fl.algorithm is fedavg")
    up_scale: float = Field(1e-12, gt=0, le=1e-3, description="scale of the adapters' up-projection (forward perturbation)")


_MISSING = object()


@ATTACKS.register("peftleak", "malicious-server exact patch recovery from ViT adapter gradients (Sami et al. 2025)")
class PEFTLeak(AttackBase):
    """PEFTLeak as a protocol attack: a :class:`PEFTLeakServer` (``self.server``) poisons the model and
    writes every round's adapters, a :class:`PEFTLeakRecovery` (``self.recovery``) recovers the patches
    from the :class:`~gradleak.fl.core.ServerView`.

    The keyword constructor takes the server's parameters plus ``max_rounds``. For the single-class API
    of earlier versions, attributes this class does not define (``plans``, ``K``, ``ppr``, ``N``, ``P``,
    ``C``, ``S``, ``D``, ``r``, ``L``, ``reduce``, ``num_rounds``, ``multi_direction``, ``sigma``,
    ``design``, ``adapter_state``, ``simulate_tokens``, ...) are *read* from the server, then from the
    recovery (see :meth:`__getattr__`); set parameters through the constructor, not on this object.
    """

    name = "peftleak"
    Config = PEFTLeakConfig
    modality = "image"
    peft_kinds = ("adapters",)
    reconstruction = "patches"
    needs_float64 = True
    rewrites_weights = True
    summary = "malicious server poisons a ViT + adapters and recovers exact image patches from the adapter gradients"

    def __init__(self, *, public_images: torch.Tensor, design: str = "improved", sigma: float = 10.0,
                 pe_distribution: str = "gaussian", gamma: float = 1e4, q_scale: float = 1e5,
                 up_scale: float = 1e-12, adapters_per_position: int | None = None,
                 positions_per_round: int | None = None, low_resolution: bool = False,
                 peel: bool = True, quantiles: str = "gaussian", fedavg_aware: bool = False,
                 expected_batch_size: int | None = None, seed: int = 0, max_rounds: int | None = None):
        if max_rounds is not None and max_rounds < 1:
            raise BadInput("attack.max_rounds", f"must be at least 1, got {max_rounds}.", "omit it to run every planned round.")
        self.server = PEFTLeakServer(public_images=public_images, design=design, sigma=sigma,
                                     pe_distribution=pe_distribution, gamma=gamma, q_scale=q_scale,
                                     up_scale=up_scale, adapters_per_position=adapters_per_position,
                                     positions_per_round=positions_per_round, low_resolution=low_resolution,
                                     peel=peel, quantiles=quantiles, fedavg_aware=fedavg_aware,
                                     expected_batch_size=expected_batch_size, seed=seed)
        self.recovery = PEFTLeakRecovery(self.server)
        self.max_rounds = max_rounds

    @classmethod
    def requires(cls, cfg: Optional[AttackConfig] = None) -> dict[str, bool]:
        return {"malicious": True, "public_data": True, "individual_updates": True}

    @classmethod
    def from_config(cls, cfg: PEFTLeakConfig, ctx: AttackContext) -> "PEFTLeak":
        public_images = ctx.public.get("public_images")
        if public_images is None:
            raise BadInput("threat.public_data", "PEFTLeak sets its bin thresholds from public images, but none were granted.",
                           "set threat.public_data=true and give a public dataset (e.g. natural-crops).")
        fedavg_aware = (ctx.fl.get("algorithm") == "fedavg") if cfg.fedavg_aware is None else cfg.fedavg_aware
        return cls(public_images=public_images, expected_batch_size=ctx.public.get("batch_size"),
                   fedavg_aware=fedavg_aware, seed=ctx.seed, **cfg.model_dump(exclude={"fedavg_aware"}))

    def __getattr__(self, name: str) -> Any:
        """Read-only delegation for the single-class API: the server's attribute, else the recovery's.
        Only reached when ordinary lookup fails (so ``server``, ``recovery`` and this class's methods win)."""
        if name.startswith("__") or name in ("server", "recovery"):
            raise AttributeError(name)
        for part in (self.__dict__.get("server"), self.__dict__.get("recovery")):
            if part is not None:
                value = getattr(part, name, _MISSING)
                if value is not _MISSING:
                    return value
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    # ------------------------------------------------------------------ the round protocol
    def prepare(self, model: nn.Module, threat: ThreatModel | None = None) -> nn.Module:
        """Refuse a non-malicious threat model, then let the server poison the model and plan the rounds."""
        if threat is not None and not threat.malicious:
            raise BadInput("threat.malicious", "PEFTLeak needs a malicious server (it rewrites weights).",
                           "set the threat model to malicious or pick an honest attack.")
        return self.server.prepare(model)

    def rounds_wanted(self, fl_rounds: int) -> int:
        """The rounds the plan needs to attack every position (``fl_rounds`` is ignored), capped by
        ``max_rounds``. Known only after :meth:`prepare`."""
        if not self.server.plans:
            raise RuntimeError("PEFTLeak plans its rounds in prepare(model); call prepare before rounds_wanted.")
        n = self.server.num_rounds
        return n if self.max_rounds is None else min(self.max_rounds, n)

    def server_model(self, round_index: int, model: nn.Module) -> nn.Module:
        """Load round ``round_index``'s malicious adapters (:meth:`PEFTLeakServer.adapter_state`) into
        ``model`` (on its device) and return it. The poisoned head is loaded again too
        (:meth:`PEFTLeakServer.round_state`): the runner applies each round's aggregate to the model, and a
        trained head would break the rank-one head the grouping relies on (A1.9)."""
        if not 0 <= round_index < self.server.num_rounds:
            raise ValueError(f"PEFTLeak planned {self.server.num_rounds} round(s); round {round_index} was asked "
                             "(run rounds_wanted(...) rounds).")
        device = next(model.parameters()).device
        model.load_state_dict({n: v.to(device) for n, v in self.server.round_state(round_index).items()}, strict=False)
        return model

    def reconstruct(self, view: ServerView) -> Reconstruction:
        """Recover the patches from the view alone (:meth:`PEFTLeakRecovery.reconstruct`)."""
        return self.recovery.reconstruct(view)


@dataclass
class PatchGeometry:
    """Per-patch quantities every statistic needs: centred ``M x`` (n × D), its squared norm, and its
    inner products with the centred positional embeddings (n × (N+1))."""

    Mx_c: torch.Tensor
    norm2: torch.Tensor
    pdot: torch.Tensor
    cache: dict = field(default_factory=dict)


def group_by_coefficient(g: torch.Tensor, positions: torch.Tensor, rel_tol: float = 1e-6) -> torch.Tensor:
    """Group patches whose image coefficient g agrees to ``rel_tol``; at most one patch per position
    per group (a second patch at a taken position opens a new group). Returns a group id per patch."""
    n = len(g)
    groups = torch.full((n,), -1, dtype=torch.long)
    if n == 0:
        return groups
    order = torch.argsort(g)
    clusters: list[list[int]] = []
    prev = None
    for i in order.tolist():
        gi = float(g[i])
        if prev is None or not math.isfinite(gi) or abs(gi - prev) > rel_tol * max(abs(gi), abs(prev)):
            clusters.append([])
        clusters[-1].append(i)
        prev = gi
    gid = 0
    for cl in clusters:
        taken: list[set[int]] = []
        for i in cl:
            t = int(positions[i])
            for k, s in enumerate(taken):
                if t not in s:
                    s.add(t)
                    groups[i] = gid + k
                    break
            else:
                taken.append({t})
                groups[i] = gid + len(taken) - 1
        gid += len(taken)
    return groups
