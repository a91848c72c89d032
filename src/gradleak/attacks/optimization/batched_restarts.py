"""Restarts batched through one double backward, for the group loop of GradViT and GIAS
(:meth:`BatchedRestarts.matching_terms_batch`; docs/PERFORMANCE.md "Batched restarts").

The restarts optimised together run through *one* forward and one double backward per step, their images stacked
along the batch. Restart r's parameter gradients are recovered exactly from that pass: every matched tensor is the
weight or bias of an ``nn.Linear`` (adapters, LoRA factors, the head), whose per-sample gradient is Σ δᵀ x over
restart r's rows (δ the gradient at the layer's output, x its input, as Opacus' grad samplers). Each restart keeps
its own image, Adam state, schedule, GLR term, history and divergence check, so it takes the step it would take
alone, up to floating-point summation order (measured equal to 1e-10 relative in float64, tests/test_batched_restarts.py).
It is used only where that is exact (:meth:`BatchedRestarts._restart_batch_plan`: the default mean cross-entropy,
``emulate: single_step``, no BatchNorm on batch statistics, only ``nn.Linear`` tensors matched); otherwise (e.g. the
layer-wise PEs of the anchor term) the restarts run one after another as before. ``info["restarts_batched"]`` says
which. The step's wall time is then shared by its restarts: ``timings.iteration_seconds`` is the batched step's
median wall time divided by the restarts in it (the cost of one restart's step). torch.func (``vmap`` over
``grad`` of ``functional_call``) gives the same gradients but was measured slower here (0.36 s vs 0.27 s for three
restarts of the vit_adapters audit's ViT-S step on one CPU thread).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn

from gradleak.attacks.common.simulation import output_logits
from gradleak.fl.core import default_classification_loss


class BatchedRestarts:
    """:meth:`matching_terms_batch`: the matching terms of several restarts from one pass (a mixin of
    :class:`~gradleak.attacks.optimization.inverting_gradients.InvertingGradients`; it falls back on the attack's
    ``matching_terms`` restart by restart where the batched form would not be exact)."""

    def _restart_batch_plan(self, model: nn.Module, names: list[str], used: list[int]) -> Optional[dict[str, dict]]:
        """How :meth:`matching_terms_batch` gets per-restart gradients from one forward of the stacked restarts: for
        each module owning a matched tensor, ``{module name: {"weight": i, "bias": j}}``; ``None`` when the batched
        form would not be exact (then the restarts run one after another, as :meth:`matching_terms`).

        Exact when (a) every matched tensor is the weight or bias of a plain ``nn.Linear`` (out = x Wᵀ + b, so the
        gradient of restart r is Σ_{rows of r} δᵀ x and Σ δ over its rows, δ = ∂L/∂out), (b) the samples do not
        interact in the forward (no BatchNorm on batch statistics), (c) the loss is the default mean cross-entropy
        (summed per restart: Σ_r L_r = Σ_rows CE / B), and (d) ``emulate`` is ``single_step`` (the simulated local
        steps batch the dummies themselves). An active dropout draws its masks for the stacked rows at once rather
        than restart by restart: the same distribution, another random stream."""
        if self.emulate != "single_step" or self.loss_fn is not default_classification_loss:
            return None
        modules = dict(model.named_modules())
        for m in modules.values():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and (m.training or not m.track_running_stats):
                return None
        plan: dict[str, dict] = {}
        for i in used:
            owner, _, attr = names[i].rpartition(".")
            mod = modules.get(owner)
            if (mod is None or not isinstance(mod, nn.Linear) or type(mod).forward is not nn.Linear.forward
                    or attr not in ("weight", "bias") or mod._forward_hooks or mod._forward_pre_hooks):
                return None  # (a hook could change the layer's input or output: the rule would not hold)
            plan.setdefault(owner, {"module": mod})[attr] = i
        return plan

    def _restart_gradients(self, plan: dict[str, dict], model: nn.Module, n_params: int, xs: Sequence[torch.Tensor],
                           labels: torch.Tensor, create_graph: bool) -> Optional[list[Any]]:
        """The matched ``nn.Linear`` tensors' gradients of every restart, stacked (R × the tensor's shape; ``None``
        for the tensors not matched), from one forward of
        the restarts' images stacked along the batch: a zero tensor added to each owning layer's output exposes
        δ = ∂(Σ_r L_r)/∂out (one backward, ``create_graph``), and restart r's gradients are δ_rᵀ x_r and Σ δ_r over
        its rows (x_r the layer's input rows of restart r). ``None`` if a layer was called without a positional input
        (the formula does not apply; the caller falls back)."""
        R, B = len(xs), int(xs[0].shape[0])
        records: dict[str, list] = {name: [] for name in plan}
        failed: list[str] = []

        def hook_for(name):
            def hook(module, inputs, out):
                if not inputs or not torch.is_tensor(inputs[0]):
                    failed.append(name)
                    return None
                z = torch.zeros_like(out, requires_grad=True)
                records[name].append((inputs[0], z))
                return out + z
            return hook

        handles = [entry["module"].register_forward_hook(hook_for(name)) for name, entry in plan.items()]
        try:
            logits = output_logits(model(torch.cat(list(xs))))
        finally:
            for h in handles:
                h.remove()
        if failed or any(not rec for rec in records.values()):
            return None
        rows = labels.repeat(R) if labels.dim() == 1 else labels.repeat(R, 1)
        loss = nn.functional.cross_entropy(logits, rows, reduction="sum") / B  # Σ_r (mean cross-entropy of restart r)
        zs = [z for name in plan for _, z in records[name]]
        deltas = iter(torch.autograd.grad(loss, zs, create_graph=create_graph))
        grads: list[Any] = [None] * n_params
        for name, entry in plan.items():
            gw = gb = None
            for inp, _ in records[name]:
                d = next(deltas)
                d = d.reshape(R, -1, d.shape[-1])
                if "weight" in entry:
                    w = torch.bmm(d.transpose(1, 2), inp.reshape(R, -1, inp.shape[-1]))
                    gw = w if gw is None else gw + w
                if "bias" in entry:
                    b = d.sum(1)
                    gb = b if gb is None else gb + b
            if "weight" in entry:
                grads[entry["weight"]] = gw
            if "bias" in entry:
                grads[entry["bias"]] = gb
        return grads

    def _flat_targets(self, targets: list[torch.Tensor], idx: list[int]) -> torch.Tensor:
        """The observed tensors ``idx`` flattened into one vector, built once per target list (not per step)."""
        key = (id(targets), tuple(idx))
        cache = self.__dict__.setdefault("_flat_target_cache", {})
        if key not in cache or cache[key][0] is not targets:
            if len(cache) >= 8:
                cache.clear()
            cache[key] = (targets, torch.cat([targets[i].reshape(-1) for i in idx]))
        return cache[key][1]

    def _distance_rows(self, grads: list[Any], targets, idx, norm, kind: str) -> torch.Tensor:
        """:meth:`_distance` of every restart at once (a vector, one entry per restart): ``grads[i]`` holds the
        restarts' gradients of tensor i stacked (R × its shape); the tensors ``idx`` are the rows of one matrix
        compared with the flattened observed update."""
        R = int(grads[idx[0]].shape[0])
        eps = torch.finfo(targets[idx[0]].dtype).tiny
        if kind == "l2" or self.similarity == "global":
            G = torch.cat([grads[i].reshape(R, -1) for i in idx], 1)
            t = self._flat_targets(targets, idx)
            if kind == "l2":
                return ((G - t) ** 2).sum(1) / (norm ** 2)
            return 1.0 - (G @ t) / (torch.sqrt((G * G).sum(1) + eps) * norm)
        terms = []
        for i in idx:
            tn = targets[i].norm()
            if float(tn) == 0.0:
                continue
            g = grads[i].reshape(R, -1)
            t = targets[i].reshape(-1)
            terms.append(1.0 - (g @ t) / (torch.sqrt((g * g).sum(1) + eps) * tn))
        return torch.stack(terms).mean(0)

    def _restarts_batched(self, model: nn.Module) -> bool:
        """Whether the last :meth:`matching_terms_batch` on ``model`` ran the restarts through one pass; forgets the
        cached plan and flattened targets (they hold the attack's model copy and the update)."""
        cached = self.__dict__.pop("_batch_plan", None)
        self.__dict__.pop("_flat_target_cache", None)
        return cached is not None and cached[0] is model and cached[2] is not None

    def matching_terms_batch(self, model: nn.Module, params: list[torch.Tensor], targets: list[torch.Tensor],
                             groups: dict[str, list[int]], norms: dict[str, Any], xs: Sequence[torch.Tensor],
                             labels: torch.Tensor, create_graph: bool, names: Optional[list[str]] = None,
                             ) -> list[tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]:
        """:meth:`matching_terms` of several restarts' dummy images ``xs`` (each B×C×H×W), through one forward and one
        (double) backward of the restarts stacked along the batch when :meth:`_restart_batch_plan` says that is
        exact (``names``: the matched tensors' parameter names; without them, or for one restart, the restarts run
        one after another). Restart r's terms depend on ``xs[r]`` only: the gradient of the sum of the returned
        totals with respect to ``xs[r]`` is that of restart r's own objective."""
        used = groups["main"] + groups["pe"]
        plan = None
        if names is not None and len(xs) > 1:
            key = tuple(names[i] for i in used)
            cached = self.__dict__.get("_batch_plan")
            if cached is None or cached[0] is not model or cached[1] != key:
                cached = (model, key, self._restart_batch_plan(model, names, used))
                self._batch_plan = cached
            plan = cached[2]
        grads = self._restart_gradients(plan, model, len(params), xs, labels, create_graph) if plan else None
        if grads is None:
            return [self.matching_terms(model, params, targets, groups, norms, x, labels, create_graph) for x in xs]
        R = len(xs)
        kind = self.distance
        if self.noise_model == "declared":  # as matching_terms: the likelihood, and the declared clip per restart
            kind = "l2"
            if getattr(self, "_clip", None):
                gn = torch.sqrt(sum((grads[i].reshape(R, -1) ** 2).sum(1) for i in used))
                factor = torch.clamp(self._clip / gn.clamp_min(1e-30), max=1.0)
                for i in used:
                    grads[i] = grads[i] * factor.reshape(R, *([1] * (grads[i].dim() - 1)))
        main = self._distance_rows(grads, targets, groups["main"], norms["main"], kind)
        if not groups["pe"]:
            return [(main[r], main[r], None) for r in range(len(xs))]
        pe = self._distance_rows(grads, targets, groups["pe"], norms["pe"], "cosine")
        total = main + self.anchor_weight * pe
        return [(total[r], main[r], pe[r]) for r in range(len(xs))]
