"""PEFTLeak's analysis (PEFTLeak Sec. 4.3; :mod:`gradleak.attacks.peftleak`): eq. (24)–(25) per bin, the consistency and trust
checks, peeling, deduplication and grouping by the image coefficient g — from the server's secrets and the
:class:`~gradleak.fl.core.ServerView` only."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from gradleak.attacks.base import Reconstruction
from gradleak.attacks.peftleak.denoise import (NoiseTests, PatchPrior, agreement, estimate_patches, group_noisy,
                                               merge_estimates, resolve_noise_std)
from gradleak.attacks.peftleak.geometry import F64, PatchGeometry, slot_scales
from gradleak.attacks.peftleak.limit import apply_mask, bin_differences, bin_limit, strongest_bins
from gradleak.attacks.peftleak.server import PEFTLeakServer, RoundPlan
from gradleak.errors import BadInput
from gradleak.fl.core import ServerView
from gradleak.peft.adapters import AdapterSlot

#: two recovered patches closer than this (max-abs, pixels in [-1, 1]) are the same patch found twice
#: (each copy is exact to ~1e-4; distinct natural patches differ by far more)
SAME_PATCH = 1e-3


class PEFTLeakRecovery:
    """The attacker's side of PEFTLeak: eq. (24)–(25) per bin, the consistency and trust checks, peeling,
    deduplication and grouping by the image coefficient g.

    Built from a prepared server (``PEFTLeakRecovery(server)``); reads the server's secrets (plans,
    positional embeddings, ``M``, thresholds, scales) through ``self.server`` and, in :meth:`reconstruct`,
    the observed updates and per-round adapter states of the :class:`~gradleak.fl.core.ServerView` only.
    Holds no reference to the model or to any client data.

    ``noise`` / ``noise_false_alarm``: the noise mode of :mod:`.denoise` (``attack.noise``); when it resolves to no
    noise (``none``, or ``public`` with nothing declared) the exact recovery below runs unchanged.
    ``keep_bins``: the oracle restriction of :mod:`.limit` (only the K strongest bins kept; None: every bin).
    """

    def __init__(self, server: PEFTLeakServer, noise: Any = "none", noise_false_alarm: float = 0.01,
                 keep_bins: int | None = None):
        self.server = server
        self.noise = noise
        self.noise_false_alarm = float(noise_false_alarm)
        self.keep_bins = keep_bins
        self._masks: dict | None = None
        self._prior: PatchPrior | None = None
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
        positions attacked in the rounds the view holds). ``metrics``: the plan's numbers (no ground truth) and the
        information limit of the observed bins (:func:`.limit.bin_limit`, ``*_adapter_bins``) at the noise std the
        noise mode resolves (``noise: none``: the declared one), whichever recovery runs. With ``keep_bins`` set, only
        the upload's ``keep_bins`` strongest bins are read (:func:`.limit.strongest_bins`).
        """
        srv = self.server
        if view.secure_aggregation or not view.rounds:
            raise BadInput("fl.secure_aggregation", "PEFTLeak needs the victim's individual per-round updates.",
                           "turn secure aggregation off for this attack (it then sees only the aggregate).")
        n_rounds = min(len(view.rounds), len(srv.plans))
        mode = "public" if self.noise == "none" else self.noise
        sigmas = [resolve_noise_std(mode, view, view.rounds[k][0], srv.plans[k], srv.D) for k in range(n_rounds)]
        known = [s for s in sigmas if s is not None and s > 0]
        limit = bin_limit(view, srv, n_rounds, sum(known) / len(known) if known else None, self.noise_false_alarm)
        self._masks = (strongest_bins(view, srv, n_rounds, self.keep_bins) if self.keep_bins is not None else None)
        kept = None if self._masks is None else float(sum(int(m.sum()) for m in self._masks.values()))
        try:
            if self.noise != "none" and known:
                rec = self._reconstruct_noisy(view, n_rounds, sigmas)
            else:
                rec = self._reconstruct_exact(view, n_rounds)
        finally:
            self._masks = None
        rec.metrics.update(limit)
        if kept is not None:
            rec.metrics["bins_kept"] = kept
        return rec

    def _bins(self, k: int, upd, sp) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`bin_differences` of slot ``sp`` in round k, restricted to the kept bins under ``keep_bins``."""
        GW, Gb, dGW, dGb = bin_differences(upd, sp.slot.prefix)
        dGW, dGb = apply_mask(dGW, dGb, None if self._masks is None else self._masks[(k, sp.index)])
        return GW, Gb, dGW, dGb

    def _unknown(self, k: int, sp) -> torch.Tensor:
        """The bins of slot ``sp`` in round k that ``keep_bins`` zeroed: not read, so neither evidence that a bin is
        empty (the consistency filter lets a candidate fall there) nor of what it holds (no trust from them)."""
        if self._masks is None:
            return torch.zeros(self.server.r, dtype=torch.bool)
        return ~self._masks[(k, sp.index)]

    def _reconstruct_exact(self, view: ServerView, n_rounds: int) -> Reconstruction:
        """The exact recovery (PEFTLeak Sec. 4.3) of :meth:`reconstruct`."""
        srv = self.server
        # how closely the image coefficient g of two patches of one image agree: to float64 rounding
        # after one gradient step; to ~1e-4 after several FedAvg steps (the adapters move a little)
        multi_step = any(u.kind == "pseudo_gradient" and u.local_steps > 1 for r in view.rounds for u in r)
        self._match_tol = 1e-4 if multi_step else 1e-6
        found: list[dict[str, Any]] = []
        bins_seen = 0
        self._nonzero_bins = 0  # the authors' count (recover_adapter.py): every usable bin with dGb != 0
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
                   "nonzero_bins": self._nonzero_bins,
                   "hash_directions_per_position": srv.K if srv.multi_direction else 1,
                   "positions_per_round": srv.ppr, "rounds_needed_all_positions": srv.num_rounds}
        return Reconstruction(data, info, metrics)

    def _recover_round(self, k: int, upd, state: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
        plan = self.server.plans[k]
        self._dgb: dict[int, torch.Tensor] = {}
        nonempty: dict[int, torch.Tensor] = {}
        bins: list[dict[str, Any]] = []  # every nonempty bin of this round
        for sp in plan.slots:
            GW, Gb, dGW, dGb = self._bins(k, upd, sp)
            scale = float(Gb.abs().max()) + 1e-300
            ok = torch.zeros(self.server.r, dtype=torch.bool)
            ok[sp.usable_bins] = True
            tol = (1e-6 if upd.kind == "pseudo_gradient" else 1e-9) * scale  # FedAvg: update is a weight difference
            ok &= dGb.abs() > tol
            nonempty[sp.index] = (dGb.abs() > tol) | self._unknown(k, sp)
            self._dgb[sp.index] = dGb
            for j in torch.nonzero(ok)[:, 0].tolist():
                bins.append({"plan": sp, "bin": j, "db": float(dGb[j]), "dw": dGW[j]})
        self._nonzero_bins += len(bins)
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

    # ------------------------------------------------------------------ noise mode (:mod:`.denoise`)
    def _reconstruct_noisy(self, view: ServerView, n_rounds: int, sigmas: list[float | None]) -> Reconstruction:
        """:meth:`reconstruct` under upload noise of per-coordinate std ``sigmas[k]`` in round k: calibrated occupancy
        tests, the scale-estimated patches of :func:`.denoise.estimate_patches`, noise-derived consistency, trust and
        peeling, estimates of one patch combined, grouping within each patch's error on g."""
        srv = self.server
        known = [s for s in sigmas if s is not None and s > 0]
        sigmas = [s if s is not None and s > 0 else min(known) for s in sigmas]
        n_tests = sum(len(sp.usable_bins) for k in range(n_rounds) for sp in srv.plans[k].slots)
        tests = NoiseTests.at(self.noise_false_alarm, n_tests, srv.D, srv.Pd)
        if self._prior is None:
            self._prior = PatchPrior.from_server(srv)
        # the exact recovery's agreement of g (float64 rounding; a few FedAvg steps move the adapters a little)
        # is the floor of every tolerance on g
        multi_step = any(u.kind == "pseudo_gradient" and u.local_steps > 1 for r in view.rounds for u in r)
        self._match_tol = 1e-4 if multi_step else 1e-6
        self._nonzero_bins = 0
        found: list[dict[str, Any]] = []
        for k in range(n_rounds):
            state = {n: v.detach().cpu() for n, v in view.round_states[k].items()}
            found += self._noisy_round(k, view.rounds[k][0], state, float(sigmas[k]), tests)
        merged = merge_estimates(found, tests)
        # an estimate whose error is as large as the public patches' spread says nothing the public mean does not
        informative = [c for c in merged if c["err"] ** 2 < self._prior.pixel_variance]
        dropped = len(merged) - len(informative)
        merged = informative
        if merged:
            patches = torch.stack([c["x"] for c in merged]).clamp(-1, 1)
            positions = torch.tensor([c["position"] for c in merged], dtype=torch.long)
            gvals = torch.tensor([c.get("g", float("nan")) for c in merged], dtype=F64)
            gerr = torch.tensor([c.get("g_err", float("inf")) for c in merged], dtype=F64)
            err = torch.tensor([c["err"] for c in merged], dtype=F64)
        else:
            patches = torch.zeros(0, srv.Pd, dtype=F64)
            positions = torch.zeros(0, dtype=torch.long)
            gvals, gerr, err = (torch.zeros(0, dtype=F64),) * 3
        groups = group_noisy(gvals, gerr, positions, tests.z)
        expected = 10 * torch.log10(4 / (err * err).clamp(min=1e-300)) if len(err) else torch.zeros(0, dtype=F64)
        bins = sum(len(sp.usable_bins) for plan in srv.plans[:n_rounds] for sp in plan.slots)
        info = {"candidates": len(found), "unique_patches": int(len(patches)), "rounds": n_rounds, "bins": bins,
                "groups": int(groups.max() + 1) if len(groups) else 0, "design": srv.design,
                "noise_mode": self.noise, "noise_std": [float(s) for s in sigmas],
                "occupancy_threshold_chi2": tests.occupancy, "tolerance_z": tests.z,
                "bins_per_patch": [int(c.get("members", 1)) for c in merged],
                "uninformative_patches_dropped": dropped}
        attacked = sorted({sp.position for plan in srv.plans[:n_rounds] for sp in plan.slots})
        data = {"patches": patches, "positions": positions, "groups": groups, "g": gvals, "reduce": srv.reduce,
                "patch_size": srv.P, "channels": srv.C, "num_positions": srv.N, "image_size": srv.S,
                "attacked_positions": attacked, "patch_error_std": err}
        metrics = {"attacked_positions": len(attacked), "rounds_used": n_rounds, "adapters_per_position": srv.K,
                   "nonzero_bins": self._nonzero_bins,
                   "hash_directions_per_position": srv.K if srv.multi_direction else 1,
                   "positions_per_round": srv.ppr, "rounds_needed_all_positions": srv.num_rounds,
                   "noise_std_used": float(sum(sigmas) / len(sigmas)), "occupied_bins": self._nonzero_bins,
                   "expected_patch_psnr_median": float(expected.median()) if len(expected) else float("nan")}
        return Reconstruction(data, info, metrics)

    def _noisy_round(self, k: int, upd, state: dict[str, torch.Tensor], sigma: float,
                     tests: NoiseTests) -> list[dict[str, Any]]:
        srv = self.server
        plan = srv.plans[k]
        self._dgb, self._nvb = {}, {}
        occupied: dict[int, torch.Tensor] = {}
        bins: list[dict[str, Any]] = []
        for sp in plan.slots:
            GW, Gb, dGW, dGb = self._bins(k, upd, sp)
            nv = torch.full((srv.r,), 2 * sigma * sigma, dtype=F64)
            nv[-1] = sigma * sigma  # the top bin is one neuron, not a difference
            occ = ((dGW * dGW).sum(1) + dGb * dGb) / nv > tests.occupancy
            usable = torch.zeros(srv.r, dtype=torch.bool)
            usable[sp.usable_bins] = True
            occupied[sp.index] = occ | self._unknown(k, sp)
            self._dgb[sp.index], self._nvb[sp.index] = dGb, nv
            for j in torch.nonzero(usable & occ)[:, 0].tolist():
                bins.append({"plan": sp, "bin": j, "db": float(dGb[j]), "dw": dGW[j], "nv": float(nv[j])})
        self._nonzero_bins += len(bins)
        if not bins:
            return []
        cands = self._noisy_candidates(bins, k)
        if srv.multi_direction:
            cands = self._noisy_consistent(cands, plan, occupied, tests)
        self._noisy_attach_g(cands, state)
        if srv.multi_direction:
            cands = self._noisy_trusted(cands, plan, tests)
        if srv.peel and srv.multi_direction:
            cands = self._noisy_peel(cands, bins, plan, occupied, state, tests)
        return cands

    def _noisy_candidates(self, bins: list[dict], k: int) -> list[dict]:
        """:func:`.denoise.estimate_patches` for every bin at once."""
        if not bins:
            return []
        dw = torch.stack([b["dw"] for b in bins])
        db = torch.tensor([b["db"] for b in bins], dtype=F64)
        nv = torch.tensor([b["nv"] for b in bins], dtype=F64)
        t = torch.tensor([b["plan"].position for b in bins])
        idx = torch.tensor([b["plan"].index for b in bins])
        est = estimate_patches(dw, db, nv, t, idx, self.server, self._prior)
        return [{"x": est["x"][i], "err": float(est["err"][i]), "err_iso": float(est["err_iso"][i]),
                 "scale_dir": est["scale_dir"][i], "axis": est["axis"][i], "position": int(t[i]), "bin": bins[i],
                 "round": k}
                for i in range(len(bins))]

    def _noisy_ranges(self, cands: list[dict], plan: RoundPlan, z: float) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Per slot of the round, the lowest and highest bin each candidate's statistic can fall in within ``z``
        errors (-2: another position; -1: below c_1): its estimate's i.i.d. error through the read-out, and its scale
        error by evaluating the statistic at the estimate moved one std along ``scale_dir``."""
        srv = self.server
        X = torch.stack([c["x"] for c in cands])
        S = torch.stack([c["scale_dir"] for c in cands])
        t = torch.tensor([c["position"] for c in cands])
        iso = torch.tensor([c.get("err_iso", c["err"]) for c in cands], dtype=F64)
        geos = [srv.geometry(X), srv.geometry(X + S), srv.geometry(X - S)]
        out = {}
        for sp in plan.slots:
            lo = torch.full((len(X),), -2, dtype=torch.long)
            hi = torch.full((len(X),), -2, dtype=torch.long)
            rows = torch.nonzero(t == sp.position)[:, 0]
            if len(rows):
                st = []
                for geo in geos:
                    sub = PatchGeometry(geo.Mx_c[rows], geo.norm2[rows], geo.pdot[rows])
                    st.append(srv.stats(sub, sp.position, sp.index, sp.weight))
                s0 = st[0]
                phi = srv._phi(PatchGeometry(geos[0].Mx_c[rows], geos[0].norm2[rows], geos[0].pdot[rows]),
                               torch.full((len(rows),), sp.position))[:, sp.index]
                wc = sp.weight - sp.weight.mean()
                e_iso = phi * 0.5 * float((wc @ srv.M).norm()) * iso[rows]
                e_scale = 0.5 * (st[1] - st[2]).abs()
                e = torch.sqrt(e_iso ** 2 + e_scale ** 2)
                lo[rows] = torch.searchsorted(sp.thresholds, s0 - z * e) - 1
                hi[rows] = torch.searchsorted(sp.thresholds, s0 + z * e) - 1
            out[sp.index] = (lo, hi)
        return out

    def _noisy_consistent(self, cands: list[dict], plan: RoundPlan, occupied: dict[int, torch.Tensor],
                          tests: NoiseTests) -> list[dict]:
        """:meth:`_filter_consistent` within the noise: pixels in [-1, 1] up to z errors, and in every adapter of the
        position some bin the statistic can reach within z errors is occupied."""
        if not cands:
            return []
        X = torch.stack([c["x"] for c in cands])
        err = torch.tensor([c["err"] for c in cands], dtype=F64)
        keep = X.abs().amax(1) <= 1.0 + 1e-3 + tests.z * err
        ranges = self._noisy_ranges(cands, plan, tests.z)
        for c, rg in zip(cands, zip(*[[(int(lo[i]), int(hi[i])) for i in range(len(cands))]
                                      for lo, hi in ranges.values()])):
            c["ranges"] = dict(zip(ranges.keys(), rg))
        for idx, (lo, hi) in ranges.items():
            occ = occupied[idx]
            for i in range(len(cands)):
                a, b = int(lo[i]), int(hi[i])
                if a == -2 or not keep[i]:
                    continue
                keep[i] = b >= 0 and bool(occ[max(a, 0):b + 1].any())
        return [c for c, k in zip(cands, keep.tolist()) if k]

    def _noisy_attach_g(self, cands: list[dict], state: dict[str, torch.Tensor]) -> None:
        """κ at each estimate and g = Δb/κ with its error (the noise of Δb, √v/|Δb| relative, and κ's change when the
        estimate moves one std along its scale direction), floored by the exact recovery's agreement of g."""
        if not cands:
            return
        X = torch.stack([c["x"] for c in cands])
        S = torch.stack([c["scale_dir"] for c in cands])
        pos = torch.tensor([c["position"] for c in cands])
        kappa = self._token_coefficients(state, X, pos)
        # κ's own error: κ moves with the estimate, most along its scale direction
        dk = 0.5 * (self._token_coefficients(state, X + S, pos) - self._token_coefficients(state, X - S, pos))
        for c, kap, dkap in zip(cands, kappa, dk):
            j = c["bin"]["plan"].index
            k0 = float(kap[j])
            c["kappa"] = kap
            c["g"] = c["bin"]["db"] / k0
            rel = math.hypot(math.sqrt(c["bin"]["nv"]) / max(abs(c["bin"]["db"]), 1e-300), float(dkap[j]) / k0)
            c["g_err"] = math.hypot(rel * abs(c["g"]), self._match_tol * abs(c["g"]))

    def _noisy_trusted(self, cands: list[dict], plan: RoundPlan, tests: NoiseTests) -> list[dict]:
        """:meth:`_trusted` within the noise: a candidate is kept when (a) another adapter's bin it must fall in
        holds g·κ within z errors (and g·κ stands out of that bin's noise), (b) a patch of another position shares
        its g within z errors, or (c) an estimate from another adapter at its position agrees with it
        (:func:`.denoise.agreement`)."""
        if not cands:
            return []
        z = tests.z
        n = len(cands)
        t = torch.tensor([c["position"] for c in cands])
        g = torch.tensor([c["g"] for c in cands], dtype=F64)
        ge = torch.tensor([c["g_err"] for c in cands], dtype=F64)
        kappa = torch.stack([c["kappa"] for c in cands])
        own = torch.tensor([c["bin"]["plan"].index for c in cands])
        trusted = torch.zeros(n, dtype=torch.bool)
        for sp in plan.slots:
            idx = sp.index
            rg = torch.tensor([c.get("ranges", {}).get(idx, (-2, -2)) for c in cands])
            rows = torch.nonzero((rg[:, 0] == rg[:, 1]) & (rg[:, 0] >= 0) & (own != idx))[:, 0]
            if len(rows):
                b = rg[rows, 0]
                observed = self._dgb[idx][b]
                expected = g[rows] * kappa[rows, idx]
                tol = z * torch.sqrt(self._nvb[idx][b] + (kappa[rows, idx] * ge[rows]) ** 2) \
                    + self._match_tol * observed.abs()
                trusted[rows] |= ((observed - expected).abs() <= tol) & (expected.abs() > tol)
        informative = g.abs() > z * ge
        close = (g[:, None] - g[None]).abs() <= z * torch.sqrt(ge[:, None] ** 2 + ge[None] ** 2)
        shared = (close & (t[:, None] != t[None]) & informative[:, None] & informative[None]).any(1)
        agree = torch.zeros(n, n, dtype=torch.bool)
        for p in t.unique().tolist():
            rows = torch.nonzero(t == p)[:, 0]
            sub = [cands[i] for i in rows.tolist()]
            agree[rows[:, None], rows[None]] = agreement(sub, sub, tests)
        agree &= own[:, None] != own[None]
        keep = trusted | shared | agree.any(1)
        return [c for c, k in zip(cands, keep.tolist()) if k]

    def _noisy_peel(self, cands: list[dict], bins: list[dict], plan: RoundPlan, occupied: dict[int, torch.Tensor],
                    state: dict[str, torch.Tensor], tests: NoiseTests) -> list[dict]:
        """:meth:`_peel` within the noise: subtract the estimated ``g·κ·(h, 1)`` of recovered patches from the bins
        they fall in (bins a patch may straddle within z errors are left alone), test what is left for occupancy
        against the bin's noise plus the subtracted estimates' errors, and recover it like any bin."""
        srv = self.server
        known = merge_estimates(cands, tests)
        for _ in range(8):
            if not known:
                break
            X = torch.stack([c["x"] for c in known])
            t = torch.tensor([c["position"] for c in known])
            g = torch.tensor([c["g"] for c in known], dtype=F64)
            ge = torch.tensor([c["g_err"] for c in known], dtype=F64)
            err = torch.tensor([c["err"] for c in known], dtype=F64)
            kappa = self._token_coefficients(state, X, t)
            ranges = self._noisy_ranges(known, plan, tests.z)
            for i, c in enumerate(known):
                c["ranges"] = {idx: (int(lo[i]), int(hi[i])) for idx, (lo, hi) in ranges.items()}
            geo = srv.geometry(X)
            res: list[dict] = []
            for b in bins:
                sp = b["plan"]
                lo, hi = ranges[sp.index]
                mine = (lo <= b["bin"]) & (hi >= b["bin"])
                if not bool(mine.any()) or bool(((lo != hi) & mine).any()):
                    continue
                members = torch.nonzero(mine)[:, 0]
                coef = g[members] * kappa[members, sp.index]
                sub = PatchGeometry(geo.Mx_c[members], geo.norm2[members], geo.pdot[members])
                h = srv.adapter_inputs(sub, t[members], torch.full((len(members),), sp.index))
                y = 0.5 * sub.Mx_c + srv.pos_c[t[members]]
                phi = h.norm(dim=1) / y.norm(dim=1)
                kap_err2 = (kappa[members, sp.index] * ge[members]) ** 2
                var_w = b["nv"] + float(((coef * phi * 0.5 * err[members]) ** 2 + kap_err2 * (h * h).sum(1) / srv.D).sum())
                var = max(var_w, b["nv"] + float(kap_err2.sum()))
                db = b["db"] - float(coef.sum())
                dw = b["dw"] - coef @ h
                if (float(dw @ dw) + db * db) / var <= tests.occupancy:
                    continue
                res.append({**b, "db": db, "dw": dw, "nv": var})
            if not res:
                break
            new = self._noisy_candidates(res, known[0]["round"])
            new = self._noisy_consistent(new, plan, occupied, tests)
            new = [c for c in new if not any(bool(agreement([c], [m], tests)[0, 0])
                                             for m in known if m["position"] == c["position"])]
            if not new:
                break
            self._noisy_attach_g(new, state)
            ok = {id(c) for c in self._noisy_trusted(known + new, plan, tests)}
            new = [c for c in new if id(c) in ok]
            if not new:
                break
            known = merge_estimates(known + new, tests)
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


__all__ = ["PEFTLeakRecovery", "SAME_PATCH", "group_by_coefficient"]
