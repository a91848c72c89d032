"""The gradient-matching objective of the optimisation attacks: the distance of the dummy images' parameter
gradients to the observed update, and the total-variation image prior.

Inverting Gradients (Geiping et al. 2020, §4 eq. 4) minimises ``1 − cos(∇_θ L(f_θ(x), y), Δ) + α_TV · TV(x)``;
DLG / APRIL use the relative squared error; paper 001 eq. 7 adds the cosine of the positional-embedding gradients
(:meth:`GradientMatching.matching_terms`). Under ``emulate: local_steps`` (paper 001 Supp. M, "(m)") the dummy
gradient is the pseudo-gradient of the client's simulated local steps; under ``noise_model: declared`` the distance
is the squared error (the declared Gaussian noise's likelihood) and the declared clipping is simulated. The decisions
are recorded in :mod:`gradleak.attacks.optimization.inverting_gradients`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from gradleak.attacks.common.simulation import simulate_local_training
from gradleak.errors import BadInput


def total_variation(x: torch.Tensor) -> torch.Tensor:
    """Anisotropic TV of a B×C×H×W batch: mean |x[..., i+1, :] − x[..., i, :]| + mean |x[..., j+1] − x[..., j]|."""
    tv = x.new_zeros(())
    if x.shape[-2] > 1:
        tv = tv + (x[..., 1:, :] - x[..., :-1, :]).abs().mean()
    if x.shape[-1] > 1:
        tv = tv + (x[..., 1:] - x[..., :-1]).abs().mean()
    return tv


class GradientMatching:
    """The matching terms of eq. 7 on one dummy batch (a mixin of
    :class:`~gradleak.attacks.optimization.inverting_gradients.InvertingGradients`; it reads the attack's
    ``similarity``, ``distance``, ``noise_model``, ``anchor_weight``, ``emulate``, ``loss_fn`` and the declared clip
    ``_clip`` set by its ``_setup``)."""

    def _simulated_gradients(self, model: nn.Module, used: list[int], x: torch.Tensor, labels: torch.Tensor,
                             create_graph: bool) -> list[torch.Tensor]:
        """The pseudo-gradient Σ_k ĝ_k of the client's K simulated local steps on ``x`` (tensors ``used``)."""
        emu = getattr(model, "_gradleak_local_steps", None)
        if emu is None:
            raise BadInput("attack.emulate", "local_steps needs the client's schedule, which is set up with the "
                           "attack's copy of the model.", "call reconstruct / matching_objective on the view.")
        sim = simulate_local_training(model, x, labels, lr=emu.lr, schedule=emu.schedule, param_names=emu.names,
                                      create_graph=create_graph, loss_fn=self.loss_fn, train_mode=None)
        return [sim.pseudo_gradient[emu.names[i]] for i in used]

    def _distance(self, grads, targets, idx, norm, kind: str) -> torch.Tensor:
        """``1 − cos`` (global or per tensor) or the relative squared error Σ‖g − t‖² / Σ‖t‖² over tensors ``idx``."""
        eps = torch.finfo(grads[idx[0]].dtype).tiny
        if kind == "l2":
            return sum(((grads[i] - targets[i]) ** 2).sum() for i in idx) / (norm ** 2)
        if self.similarity == "global":
            dot = sum((grads[i] * targets[i]).sum() for i in idx)
            gnorm = torch.sqrt(sum((grads[i] * grads[i]).sum() for i in idx) + eps)
            return 1.0 - dot / (gnorm * norm)
        terms = []
        for i in idx:
            tn = targets[i].norm()
            if float(tn) == 0.0:
                continue
            terms.append(1.0 - (grads[i] * targets[i]).sum() / (torch.sqrt((grads[i] * grads[i]).sum() + eps) * tn))
        return torch.stack(terms).mean()

    def matching_terms(self, model: nn.Module, params: list[torch.Tensor], targets: list[torch.Tensor],
                       groups: dict[str, list[int]], norms: dict[str, Any], x: torch.Tensor, labels: torch.Tensor,
                       create_graph: bool) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """(total, θ'-term, PE-term or None) of eq. 7 for dummy images ``x`` (model range [−1, 1])."""
        used = groups["main"] + groups["pe"]
        if self.emulate == "local_steps":  # FedAvg "(m)": the simulated pseudo-gradient of the client's K steps
            got = self._simulated_gradients(model, used, x, labels, create_graph)
        else:
            loss = self.loss_fn(model, x, labels)
            got = torch.autograd.grad(loss, [params[i] for i in used], create_graph=create_graph, allow_unused=True)
        grads: list[Any] = [None] * len(params)
        for i, g in zip(used, got):
            grads[i] = g if g is not None else torch.zeros_like(params[i])
        kind = self.distance
        if self.noise_model == "declared":  # the declared noise's likelihood; the declared clip
            kind = "l2"
            if getattr(self, "_clip", None):
                gn = torch.sqrt(sum((grads[i] ** 2).sum() for i in used))
                factor = torch.clamp(self._clip / gn.clamp_min(1e-30), max=1.0)
                grads = [g * factor if g is not None else None for g in grads]
        main = self._distance(grads, targets, groups["main"], norms["main"], kind)
        if not groups["pe"]:
            return main, main, None
        pe = self._distance(grads, targets, groups["pe"], norms["pe"], "cosine")
        return main + self.anchor_weight * pe, main, pe

