"""The client's local training as the server re-runs it (docs/DESIGN.md §2: shared by attack families).

Two attack families simulate a FedAvg client's K local SGD steps on candidate inputs and match the simulated update
to the observed one: BN-aware inversion (:mod:`gradleak.attacks.bn_inversion`, Hatamizadeh et al. 2022) and the FedAvg
emulation of the image optimisation attacks (:mod:`gradleak.attacks.optimization`, ``attack.emulate: local_steps``;
paper 001 Supp. M). This module holds what both need:

* :func:`client_training_config` — the client's (batch size, epochs, lr) from the public training configuration
  ``fl`` (:class:`~gradleak.attacks.base.AttackContext` ``fl``: ``algorithm``, ``local_batch_size``,
  ``local_epochs``, ``lr``, per client ``client_batch_sizes`` / ``client_epochs`` and the per-round ``lr_at``);
* :func:`local_schedule` — the index tensors of its local steps;
* :func:`simulate_local_training` — the K steps, differentiable in the candidates and labels.

Decisions (recorded where BN inversion first made them):

* **Update convention.** The simulation returns the pseudo-gradient ``Σ_k g_k = (θ_0 − θ_K)/lr``
  (gradleak's FedAvg upload, :class:`~gradleak.fl.core.Update` ``kind="pseudo_gradient"``) and the weight
  delta ``θ_K − θ_0 = −lr Σ_k g_k`` (NVFlare's ``WEIGHT_DIFF``). Summing the gradients (not differencing weights)
  keeps float32 rounding out.
* **Step schedule.** :func:`local_schedule` cuts ``num_images`` candidates into consecutive batches of
  ``batch_size`` (last one smaller, as :meth:`gradleak.fl.core.Client.local_update`), for every epoch. The
  client shuffles with a private seed; candidates are exchangeable, so epoch 1's assignment is without loss
  of generality. For epochs > 1 the client's permutation is unknown and we re-use epoch 1's order
  (an approximation; pass ``schedule=`` when the permutation is known).
* **Labels.** Soft labels ``p = softmax(z)`` with the client's mean cross-entropy ``−Σ_c p_c log q_c``
  (identical to the client's loss for one-hot ``p``); hard (``long``) labels are accepted.
* **BatchNorm.** The simulation runs ``torch.func.functional_call`` on cloned buffers (the model is never
  modified) and records every BN layer's per-step batch statistics
  (:class:`~gradleak.attacks.common.bn_stats.BatchStatsRecorder`), combined with the K-step weights of
  :mod:`gradleak.attacks.common.bn_stats`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.func import functional_call

from gradleak.attacks.common.bn_stats import BatchStatsRecorder, combined_candidate_stats, normalised_step_weights
from gradleak.errors import BadInput


def client_training_config(fl: Mapping[str, Any], client_id: int, n: int,
                           round_index: int) -> tuple[int, int, Optional[float]]:
    """(local batch size, local epochs, lr) of client ``client_id`` holding ``n`` samples in round
    ``round_index`` (negative: from the end): its own ``client_batch_sizes`` / ``client_epochs`` entry, else the
    protocol's ``local_batch_size`` (default ``n``: full batch) / ``local_epochs`` (default 1); FedSGD is one
    full-batch step. The batch size is capped at ``n`` (as the client's minibatching does). The lr is
    ``lr_at[round_index]``, else ``lr``, else ``None`` (unknown)."""
    bs = fl.get("client_batch_sizes") or []
    ep = fl.get("client_epochs") or []
    b = int(bs[client_id]) if 0 <= client_id < len(bs) else int(fl.get("local_batch_size") or n)
    e = int(ep[client_id]) if 0 <= client_id < len(ep) else int(fl.get("local_epochs") or 1)
    if fl.get("algorithm", "fedavg") == "fedsgd":
        b, e = n, 1
    lr_at = fl.get("lr_at") or []
    lr = lr_at[round_index] if lr_at else fl.get("lr")
    return min(b, n), e, (float(lr) if lr is not None else None)


def local_schedule(num_images: int, batch_size: int, epochs: int = 1) -> list[torch.Tensor]:
    """Index tensors of the client's local steps: consecutive batches of ``batch_size``, every epoch."""
    if num_images < 1 or batch_size < 1 or epochs < 1:
        raise BadInput("fl", f"need num_images, batch_size, epochs ≥ 1 (got {num_images}, {batch_size}, {epochs}).")
    one = [torch.arange(i, min(i + batch_size, num_images)) for i in range(0, num_images, batch_size)]
    return [idx for _ in range(epochs) for idx in one]


def output_logits(out: Any) -> torch.Tensor:
    """The logits of a model output: HF outputs carry them in ``.logits``, plain modules return them."""
    return out.logits if hasattr(out, "logits") else out


def soft_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy; ``labels`` are class ids (long) or per-sample distributions (B×C)."""
    if labels.dtype == torch.long:
        return nn.functional.cross_entropy(logits, labels)
    return -(labels * torch.log_softmax(logits, dim=1)).sum(1).mean()


@dataclass
class Simulation:
    """Result of :func:`simulate_local_training` (every tensor differentiable in images and labels)."""

    pseudo_gradient: dict[str, torch.Tensor]  # Σ_k g_k = (θ_0 − θ_K)/lr
    lr: float
    step_stats: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]
    step_weights: torch.Tensor  # normalised K-step weights of the first BN layer (per layer: its own momentum)
    combined_stats: dict[str, tuple[torch.Tensor, torch.Tensor]]
    losses: list[torch.Tensor] = field(default_factory=list)

    def weight_delta(self) -> dict[str, torch.Tensor]:
        """θ_K − θ_0 = −lr Σ_k g_k (NVFlare's WEIGHT_DIFF)."""
        return {n: -self.lr * g for n, g in self.pseudo_gradient.items()}


def simulate_local_training(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, *, lr: float,
                            schedule: Sequence[torch.Tensor] | None = None, batch_size: int | None = None,
                            epochs: int = 1, params: Mapping[str, torch.Tensor] | None = None,
                            param_names: Sequence[str] | None = None, create_graph: bool = True,
                            bn_momentum_steps_before: int = 0, loss_fn: Any = None,
                            train_mode: Optional[bool] = True) -> Simulation:
    """Simulate the client's K local SGD steps (no momentum) from the global checkpoint on candidates.

    ``model``: the global model (its weights = θ_0 unless ``params`` overrides them; never modified: the BN
    buffers are cloned, the module is switched to train mode for the call and restored). ``labels``: soft
    (B×C, rows summing to 1) or hard. ``param_names``: the parameters the client trains (default: those
    with ``requires_grad``); the others stay fixed. ``bn_momentum_steps_before``: ``num_batches_tracked``
    of the checkpoint (only matters for ``momentum=None``). ``loss_fn``: the client's loss
    ``loss_fn(model, inputs, labels)`` (a :data:`~gradleak.fl.core.LossFn`; it receives a callable that runs the
    model on the simulated weights), default the soft/hard mean cross-entropy. ``train_mode``: the module mode of
    the simulation (``None``: the model's own mode, as the client that trains a copy of it without BatchNorm).
    """
    if schedule is None:
        schedule = local_schedule(len(images), batch_size or len(images), epochs)
    if not schedule:
        raise BadInput("fl", "an empty local-training schedule.", "simulate at least one local step.")
    names = list(param_names) if param_names is not None else [n for n, p in model.named_parameters() if p.requires_grad]
    if not names:
        raise BadInput("model", "no trainable parameter to simulate.", "give param_names or unfreeze parameters.")
    all_params = dict(model.named_parameters())
    base = {n: (params[n] if params is not None and n in params else p.detach()) for n, p in all_params.items()}
    for n in names:  # θ_0: differentiable leaves (the step gradients are taken with respect to them)
        if not base[n].requires_grad:
            base[n] = base[n].detach().requires_grad_(True)
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}  # BN updates these in place, not the model's
    bn = {n: m for n, m in model.named_modules()  # none in a GroupNorm model (DP-SGD): no statistics to record
          if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats}
    layer_weights = {n: normalised_step_weights(mod.momentum, len(schedule), bn_momentum_steps_before)
                     for n, mod in bn.items()}  # each layer's own momentum
    weights = (next(iter(layer_weights.values())) if layer_weights
               else torch.full((len(schedule),), 1.0 / len(schedule), dtype=torch.float64))
    current = dict(base)
    total: dict[str, torch.Tensor] = {}
    losses = []
    was_training = model.training
    if train_mode is not None:
        model.train(train_mode)
    rec = BatchStatsRecorder(model, allow_none=True)
    try:
        with rec:
            for k, idx in enumerate(schedule):
                rec.new_step()
                if loss_fn is None:
                    out = functional_call(model, {**current, **buffers}, (images[idx],))
                    loss = soft_cross_entropy(output_logits(out), labels[idx])
                else:
                    state = {**current, **buffers}
                    loss = loss_fn(lambda inp, _s=state: functional_call(model, _s, (inp,)), images[idx], labels[idx])
                grads = torch.autograd.grad(loss, [current[n] for n in names], create_graph=create_graph,
                                            allow_unused=True)
                last = k == len(schedule) - 1
                for n, g in zip(names, grads):
                    if g is None:
                        g = torch.zeros_like(current[n])
                    total[n] = g if n not in total else total[n] + g
                    if not last:  # θ_K itself is never used: skip the last update (a parameter-sized pass)
                        current[n] = torch.add(current[n], g, alpha=-lr)  # one op, one backward pass
                losses.append(loss)
    finally:
        model.train(was_training)
    return Simulation(total, float(lr), rec.steps, weights, combined_candidate_stats(rec.steps, layer_weights), losses)


__all__ = ["client_training_config", "local_schedule", "output_logits", "soft_cross_entropy", "Simulation",
           "simulate_local_training"]
