"""PEFTLeak's malicious server (PEFTLeak Sec. 4; :mod:`gradleak.attacks.peftleak`): it poisons the ViT once (Sec.
4.1–4.5), plans the rounds (open point A1.8), writes every round's malicious adapters (Sec. 4.3, eqs. 15–23) and keeps the secrets the
recovery reads (positional embeddings, the embedding map ``M``, every slot's read-out direction and thresholds)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from gradleak.attacks.peftleak.config import PEFTLeakConfig
from gradleak.attacks.peftleak.geometry import F64, PatchGeometry, householder_complement, project_out, slot_scales
from gradleak.errors import BadInput
from gradleak.metrics.patches import image_to_patches
from gradleak.peft.adapters import AdapterSlot

#: γ of the identity MLP's ±γ biases (Sec. 4.5; A1.6: float64 keeps the cancellation exact) and the query scale that makes
#: the softmax an exact one-hot in float64: constants of the construction, not parameters
GAMMA = 1e4
Q_SCALE = 1e5


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


class PEFTLeakServer:
    """The malicious server of PEFTLeak with ``design="paper"`` (Algorithm 1 as published) or
    ``"improved"`` (default): poisoning (:meth:`prepare`, Sec. 4.1–4.5), round planning (:meth:`_plan_rounds`),
    the adapters of every round (:meth:`adapter_state`, Sec. 4.3) and the binning geometry both sides use.

    Improved design: every adapter of a position bins along its own direction
    ``w = E_pos(t) + α·d_k`` (d_k ⊥ all positional embeddings, from the top principal directions of the
    public patches, so the hashes are nearly independent), empirical equi-probable bins with no lost
    tails; the recovery cross-checks candidates against the other adapters' bins and peels collided
    bins (``peel``, a setting the server carries for the recovery).
    """

    def __init__(self, config: PEFTLeakConfig, *, public_images: torch.Tensor, fedavg_aware: bool,
                 expected_batch_size: int | None = None, seed: int = 0):
        """``config``: the attack's parameters (validated); ``fedavg_aware``: the FedAvg-aware scaling, resolved
        (the config's ``None`` means "on for FedAvg clients", which the caller decides from the protocol)."""
        if public_images is None or len(public_images) == 0:
            raise BadInput("attack.public", "PEFTLeak needs public images to estimate patch statistics.",
                           "give a public dataset (e.g. public-natural).")
        self.design = config.design
        self.sigma = float(config.sigma)
        self.pe_distribution = config.pe_distribution
        self.gamma = GAMMA
        self.q_scale = Q_SCALE
        self.up_scale = float(config.up_scale)
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
        self.adapters_per_position = config.adapters_per_position
        self.positions_per_round = config.positions_per_round
        self.low_resolution = config.low_resolution
        self.peel = config.peel and config.design == "improved"
        self.expected_batch_size = expected_batch_size
        self.quantiles = config.quantiles
        self.seed = seed
        self.public_images = public_images
        self.plans: list[RoundPlan] = []

    # ------------------------------------------------------------------ poisoning (once)
    @torch.no_grad()
    def prepare(self, model: nn.Module) -> nn.Module:
        """Poison the backbone and head in place; plan the rounds. Returns the model (float64)."""
        cfg = model.config
        self._check_model(model)
        model.to(F64)
        gen = torch.Generator().manual_seed(self.seed)
        D, P, C, S = cfg.hidden_size, cfg.patch_size, cfg.num_channels, cfg.image_size
        full = P * P * C
        k = self._reduction(D, P, full)
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
        self.M = self._patch_basis(pub, ones, gen)  # D × Pd, orthonormal columns
        self._set_positions(gen)
        self._poison_embeddings(model, k)
        self._poison_blocks(model)
        self._poison_head(model, ones, gen)
        self._plan_rounds()
        # the poisoned values of every parameter the clients train (the head; the adapters are rewritten each
        # round): the server re-sends them every round (round_state), undoing the aggregate step of the
        # previous round, so the rank-one head and g = ∂L/∂logit_0 hold in every round
        self.poisoned_trainable = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        return model

    @staticmethod
    def _check_model(model: nn.Module) -> None:
        """The poisoning is written for the HF ViT block layout under mean pooling; anything else is refused."""
        layer0 = model.vit.encoder.layer[0] if hasattr(model, "vit") else None
        if layer0 is None or not hasattr(getattr(layer0, "output", None), "dense") or not hasattr(layer0, "intermediate"):
            raise BadInput("model.name", f"PEFTLeak's poisoning is written for the HF ViT block layout (intermediate + "
                           f"output.dense), not {type(layer0).__name__ if layer0 is not None else type(model).__name__}.",
                           "use a random-init HF ViT (model.name=vit-b16, vit-s16, vit-tiny ...).")
        if getattr(model, "pooling", "mean") != "mean":
            raise BadInput("model.pooling", "PEFTLeak's identity attention gives patch tokens no gradient under CLS pooling.",
                           "use model.pooling=mean (the server prescribes the head).")

    def _reduction(self, D: int, P: int, full: int) -> int:
        """The block-mean factor k: 1 when a patch (P²C values) fits the width D, else (``low_resolution``) the k with
        P²C = k² D and k dividing P (k×k block means, PEFTLeak Table 3)."""
        if full <= D:
            return 1
        if not self.low_resolution:
            raise BadInput("model.patch_size", f"the patch dimension P²C = {full} is larger than the width D = {D}, "
                           "so a patch cannot pass the patch embedding intact.",
                           "set attack.low_resolution=true (recover k×k block means, Table 3) or use a smaller patch.")
        k = int(round(math.sqrt(full / D)))
        if k * k * D != full or P % k:
            raise BadInput("model.patch_size", f"P²C = {full} is not D = {D} times a square k² with k dividing P.",
                           "use ViT-B/32 (k = 2) or a patch size whose P²C/D is a perfect square.")
        return k

    def _patch_basis(self, pub: torch.Tensor, ones: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """The patch embedding's D × Pd basis M (orthonormal columns ⊥ 1 when Pd < D; else one low-energy pixel
        direction carried along 1, ``lost_dir``), and the public patches' principal directions (the improved
        design's binning directions)."""
        D = ones.shape[1]
        B0 = householder_complement(ones[0])  # D × (D-1), ⊥ 1
        sub = pub if len(pub) <= 4096 else pub[torch.randperm(len(pub), generator=gen)[:4096]]
        # principal pixel directions (improved design's binning directions), by a randomised SVD
        _, _, V_top = torch.svd_lowrank(sub - sub.mean(0), q=min(2 * self.L + 4, self.Pd), niter=3)
        self._principal = V_top.T
        if self.Pd < D:
            M = B0[:, : self.Pd]
            self.lost_dir, self.lost_mean = None, 0.0
        else:
            u, energy = self._low_energy_direction(sub)
            V = householder_complement(u)
            M = B0 @ V.T + ones.T @ u[None]
            self.lost_dir, self.lost_mean = u, float((pub @ u).mean())
            self.lost_energy = energy
        return M

    def _set_positions(self, gen: torch.Generator) -> None:
        """The positional embeddings (class token 0): Gaussian or Laplace of scale ``sigma``, and their centred
        rows and squared norms."""
        D = self.D
        if self.pe_distribution == "gaussian":
            pos = torch.randn(self.N + 1, D, generator=gen, dtype=F64) * self.sigma
        else:
            u01 = torch.rand(self.N + 1, D, generator=gen, dtype=F64) - 0.5
            pos = -torch.sign(u01) * torch.log1p(-2 * u01.abs()) * (self.sigma / math.sqrt(2))
        self.pos = pos
        self.pos_c = pos - pos.mean(1, keepdim=True)
        self._pos_norm2 = (self.pos_c * self.pos_c).sum(1)

    def _poison_embeddings(self, model: nn.Module, k: int) -> None:
        """The embeddings: the positions, a zero class token, the patch projection 0.5·M (block means when k > 1)."""
        D, P, C = self.D, self.P, self.C
        emb = model.vit.embeddings
        emb.position_embeddings.copy_(self.pos[None])
        emb.cls_token.zero_()
        E = 0.5 * self.M  # D × Pd
        if k > 1:
            E = (E.reshape(D, C, P // k, 1, P // k, 1) / (k * k)).expand(D, C, P // k, k, P // k, k)
        emb.patch_embeddings.projection.weight.copy_(E.reshape(D, C, P, P))
        emb.patch_embeddings.projection.bias.zero_()

    def _poison_blocks(self, model: nn.Module) -> None:
        """Every LayerNorm scaled to ``sigma`` (eps σ²; the final one damped under FedAvg), and every block's
        attention and MLP made the identity: q = q_scale·I, k = v = out = I, the MLP's ReLU pass-through at ``gamma``."""
        D = self.D
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.fill_(self.sigma)
                m.bias.zero_()
                m.eps = self.eps
        self.final_ln = self.sigma * (1e-4 if self.fedavg_aware else 1.0)
        model.vit.layernorm.weight.fill_(self.final_ln)
        model.config.layer_norm_eps = self.eps
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

    def _poison_head(self, model: nn.Module, ones: torch.Tensor, gen: torch.Generator) -> None:
        """The rank-one head along ŵ ⊥ 1 and ⊥ every positional embedding (u_out = ŵ), scaled to an O(1) logit
        spread over public images, its bias centring p(class 0) at 1/2."""
        D = self.D
        # head direction ŵ ⊥ 1 and ⊥ every positional embedding; u_out = ŵ
        self._blocked, _ = torch.linalg.qr(torch.cat([ones, self.pos_c / self.pos_c.norm(dim=1, keepdim=True)]).T)
        w = project_out(self._blocked, torch.randn(D, generator=gen, dtype=F64))
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
            d = project_out(self._blocked, self.M @ Vt[s_i % Vt.shape[0]])
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


__all__ = ["GAMMA", "Q_SCALE", "PEFTLeakServer", "RoundPlan", "SlotPlan"]
