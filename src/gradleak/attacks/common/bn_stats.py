"""BatchNorm batch statistics from a client's running-statistics change (Hatamizadeh et al. 2022 §II-B; NVFlare's code).

The paper's "FL-specific BN loss" (Hatamizadeh et al. 2022, §II-B "Practical Gradient Inversion Attack")
needs the statistics the client's batches produced in every BN layer. A client that trains in train mode
updates, per BN layer and per local step k (PyTorch convention, ``torch.nn.BatchNorm*``)::

    r_k = (1 − m_k) · r_{k−1} + m_k · s_k        (s_k: the batch mean, or the *unbiased* batch variance)

with ``m_k = momentum`` (default 0.1), or ``m_k = 1 / (t0 + k)`` when ``momentum=None`` (cumulative moving
average; ``t0`` = ``num_batches_tracked`` before the round). The server knows ``r_0`` (the global checkpoint
it sent) and sees ``r_K`` (the update carries the running statistics).

* **One local step** (:func:`single_step_batch_stats`): ``s_1 = (r_1 − (1 − m) r_0) / m`` exactly —
  the NVFlare formula ``x_t = (running_new − (1 − m)·running_old)/m`` (authors' code, docs/PAPERS.md).
* **K local steps** (:func:`step_weights`, :func:`multi_step_target`): unrolling gives **one** equation
  ``r_K − D·r_0 = Σ_k w_k s_k`` with ``D = Π_k (1 − m_k)`` and ``w_k = m_k Π_{j>k} (1 − m_j)``
  (constant momentum: ``D = (1 − m)^K``, ``w_k = m (1 − m)^{K−k}``). The K batch statistics cannot be
  separated, but their momentum-weighted average ``t = (r_K − D r_0) / Σ_k w_k`` is exact. An attacker
  that simulates the K steps on its candidates (:mod:`gradleak.attacks.bn_inversion`) combines its
  per-step statistics with the same normalised weights (:func:`combine_step_stats`) and compares like
  with like. The public code applies the single-step formula whatever K is; for K > 1 that mixes
  ``((1 − m)^K − (1 − m))/m · r_0`` into the target (13–100 % off on the toy case of the tests).
* **BN loss** (:func:`bn_statistics_loss`): NVFlare/DeepInversion form
  ``Σ_layers ‖μ̂ − μ_t‖₂ + ‖σ̂² − σ²_t‖₂`` (NVFlare's code), differentiable in the candidates' statistics.

Decisions the paper leaves open, recorded here:

* **Variance convention.** ``running_var`` accumulates the *unbiased* batch variance (``n/(n−1)`` with
  ``n = N·H·W``), so the targets are unbiased variances and :class:`BatchStatsRecorder` records the
  unbiased variance of each BN input (``torch.var(unbiased=True)``) — like with like, including a smaller
  last minibatch (its own ``n``).
* **Normalised targets.** Targets are weighted *averages* (weights sum to 1), so they have the scale of a
  batch statistic and the K = 1 target is exactly the single-step formula.
* **Number of steps.** Taken from the ``num_batches_tracked`` change when the update carries it (it counts
  the client's BN steps), else it must be given (the training configuration is public, Hatamizadeh et al. 2022 §I).
* **Which layers.** Every ``_BatchNorm`` module with ``track_running_stats=True`` (ResNet-18: 20).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch
from torch import nn

from gradleak.errors import BadInput
from gradleak.models.batchnorm import batchnorm_layers

_BN = nn.modules.batchnorm._BatchNorm


@dataclass
class BNTarget:
    """Inferred statistics of one BN layer: the weighted average batch mean / unbiased variance."""

    mean: torch.Tensor
    var: torch.Tensor
    steps: int
    weights: torch.Tensor  # normalised step weights (sum 1), length ``steps``


def momenta(momentum: float | None, steps: int, num_batches_tracked: int = 0) -> torch.Tensor:
    """Per-step momenta ``m_k`` (float64): constant, or ``1/(t0 + k)`` for ``momentum=None`` (cumulative)."""
    if steps < 1:
        raise BadInput("fl.local_steps", f"the number of local steps must be ≥ 1, got {steps}.")
    if momentum is None:
        return 1.0 / (num_batches_tracked + torch.arange(1, steps + 1, dtype=torch.float64))
    if not 0.0 < float(momentum) <= 1.0:
        raise BadInput("model.bn_momentum", f"BN momentum must be in (0, 1], got {momentum}.")
    return torch.full((steps,), float(momentum), dtype=torch.float64)


def step_weights(momentum: float | None, steps: int, num_batches_tracked: int = 0) -> tuple[torch.Tensor, float]:
    """``(w, D)``: ``r_K = D·r_0 + Σ_k w_k s_k`` — unnormalised weights ``w_k = m_k Π_{j>k}(1 − m_j)``, ``D = Π(1 − m_k)``."""
    m = momenta(momentum, steps, num_batches_tracked)
    keep = 1.0 - m
    # suffix products Π_{j>k} (1 − m_j)
    suffix = torch.ones_like(m)
    for k in range(steps - 2, -1, -1):
        suffix[k] = suffix[k + 1] * keep[k + 1]
    return m * suffix, float(torch.prod(keep))


def single_step_batch_stats(old: torch.Tensor, new: torch.Tensor, momentum: float) -> torch.Tensor:
    """``s = (r_new − (1 − m) r_old) / m`` (NVFlare's formula): exact for one local step."""
    m = float(momentum)
    return (new.to(torch.float64) - (1.0 - m) * old.to(torch.float64)) / m


def multi_step_target(old: torch.Tensor, new: torch.Tensor, momentum: float | None, steps: int,
                      num_batches_tracked: int = 0) -> torch.Tensor:
    """Weighted average ``Σ_k ŵ_k s_k`` (``ŵ = w / Σw``) of the K steps' batch statistics, exact (float64)."""
    w, decay = step_weights(momentum, steps, num_batches_tracked)
    return (new.to(torch.float64) - decay * old.to(torch.float64)) / float(w.sum())


def normalised_step_weights(momentum: float | None, steps: int, num_batches_tracked: int = 0) -> torch.Tensor:
    """The weights ``ŵ_k = w_k / Σ w`` (sum 1) with which per-step statistics are combined."""
    w, _ = step_weights(momentum, steps, num_batches_tracked)
    return w / w.sum()


def combine_step_stats(per_step: Sequence[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    """``Σ_k ŵ_k s_k`` over a list of per-step statistics (differentiable; weights cast to their dtype)."""
    if len(per_step) != len(weights):
        raise BadInput("fl.local_steps", f"{len(per_step)} simulated steps but {len(weights)} step weights.",
                       "simulate as many local steps as the client took.")
    out = per_step[0] * weights[0].to(per_step[0].dtype)
    for s, w in zip(per_step[1:], weights[1:]):
        out = out + s * w.to(s.dtype)
    return out


def _get(state: Mapping[str, torch.Tensor], key: str, what: str) -> torch.Tensor:
    if key not in state:
        raise BadInput("updates", f"the {what} carries no '{key}', so the BN statistics cannot be inferred.",
                       "send BN running statistics with the update (the client's running_mean / running_var "
                       "buffers after local training).")
    return state[key]


def infer_bn_targets(model: nn.Module, old_state: Mapping[str, torch.Tensor], new_state: Mapping[str, torch.Tensor],
                     steps: int | None = None, layers: Iterable[str] | None = None) -> dict[str, BNTarget]:
    """Per BN layer, the inferred weighted-average batch mean / unbiased variance of the client's K steps.

    ``old_state``: the global checkpoint's buffers (``"<layer>.running_mean"``, ``.running_var``, optionally
    ``.num_batches_tracked``); ``new_state``: the client's buffers after local training. ``steps``: the
    client's number of local steps; default: the ``num_batches_tracked`` change. The momentum is each
    module's own.
    """
    bn = batchnorm_layers(model)
    names = list(layers) if layers is not None else list(bn)
    out: dict[str, BNTarget] = {}
    for name in names:
        mod = bn[name]
        t0 = 0
        k = steps
        nbt_old, nbt_new = old_state.get(f"{name}.num_batches_tracked"), new_state.get(f"{name}.num_batches_tracked")
        if nbt_old is not None:
            t0 = int(nbt_old)
        if k is None:
            if nbt_old is None or nbt_new is None:
                raise BadInput("fl.local_steps", f"the number of local steps is unknown for layer '{name}' (no "
                               "num_batches_tracked in the states).", "pass steps= (public training configuration).")
            k = int(nbt_new) - int(nbt_old)
        if k < 1:
            raise BadInput("updates", f"layer '{name}': {k} BN steps recorded between the checkpoint and the update.",
                           "the client must train in train mode (model.train()) so BN statistics move.")
        w = normalised_step_weights(mod.momentum, k, t0)
        mean = multi_step_target(_get(old_state, f"{name}.running_mean", "global checkpoint"),
                                 _get(new_state, f"{name}.running_mean", "update"), mod.momentum, k, t0)
        var = multi_step_target(_get(old_state, f"{name}.running_var", "global checkpoint"),
                                _get(new_state, f"{name}.running_var", "update"), mod.momentum, k, t0)
        out[name] = BNTarget(mean, var, k, w)
    return out


class BatchStatsRecorder:
    """Records, differentiably, the batch mean and unbiased variance of every BN layer's input.

    A forward pre-hook on each BN module (only while it normalises with batch statistics, i.e. in train
    mode) appends ``(mean, var)`` over all dimensions but the channel one. Works with
    ``torch.func.functional_call`` (hooks belong to the modules). Use as a context manager;
    :meth:`new_step` starts the next simulated local step; ``steps[k][layer] = (mean, var)``.
    """

    def __init__(self, model: nn.Module, layers: Iterable[str] | None = None, allow_none: bool = False):
        bn = ({n: m for n, m in model.named_modules() if isinstance(m, _BN) and m.track_running_stats} if allow_none
              else batchnorm_layers(model))  # allow_none: a model without BN (GroupNorm under DP-SGD) records nothing
        self.layers = {n: bn[n] for n in (layers if layers is not None else bn)}
        self.steps: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        self._handles: list = []

    def __enter__(self) -> "BatchStatsRecorder":
        for name, mod in self.layers.items():
            self._handles.append(mod.register_forward_pre_hook(self._hook(name)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def new_step(self) -> None:
        self.steps.append({})

    def _hook(self, name: str):
        def hook(mod, args):
            if not (mod.training or not mod.track_running_stats):
                return None
            x = args[0]
            dims = [d for d in range(x.ndim) if d != 1]
            if not self.steps:
                self.steps.append({})
            if name in self.steps[-1]:
                raise RuntimeError(f"BN layer '{name}' ran twice in one simulated step; call new_step() between steps")
            var, mean = torch.var_mean(x, dims, correction=1)
            self.steps[-1][name] = (mean, var)
            return None

        return hook


def combined_candidate_stats(steps: Sequence[Mapping[str, tuple[torch.Tensor, torch.Tensor]]],
                             weights: torch.Tensor | Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, ``(Σ ŵ_k μ̂_k, Σ ŵ_k σ̂²_k)`` of recorded per-step statistics; ``weights``: one vector for
    all layers, or one per layer (layers with different momenta)."""
    layers = steps[0].keys() if steps else ()

    def w(n: str) -> torch.Tensor:
        return weights[n] if isinstance(weights, Mapping) else weights

    return {n: (combine_step_stats([s[n][0] for s in steps], w(n)),
                combine_step_stats([s[n][1] for s in steps], w(n))) for n in layers}


def bn_statistics_loss(candidate: Mapping[str, tuple[torch.Tensor, torch.Tensor]], targets: Mapping[str, BNTarget],
                       form: str = "norm") -> torch.Tensor:
    """``Σ_layers ‖μ̂ − μ_t‖₂ + ‖σ̂² − σ²_t‖₂`` (``form="norm"``, NVFlare/DeepInversion code) or the
    squared norms (``form="squared"``). ``candidate``: :func:`combined_candidate_stats`; layers missing from
    ``candidate`` are an error (the simulation must run every targeted layer)."""
    if form not in ("norm", "squared"):
        raise BadInput("attack.bn_loss", f"unknown BN-loss form '{form}'.", "use 'norm' or 'squared'.")
    total = None
    for name, t in targets.items():
        if name not in candidate:
            raise BadInput("attack", f"no candidate statistics recorded for BN layer '{name}'.",
                           "run the simulation in train mode over every BN layer.")
        mu, var = candidate[name]
        dm = mu - t.mean.to(mu.dtype).to(mu.device)
        dv = var - t.var.to(var.dtype).to(var.device)
        term = (dm.norm() + dv.norm()) if form == "norm" else ((dm * dm).sum() + (dv * dv).sum())
        total = term if total is None else total + term
    if total is None:
        raise BadInput("attack", "no BN targets given.", "infer them with infer_bn_targets().")
    return total


__all__ = ["BNTarget", "momenta", "step_weights", "normalised_step_weights",
           "single_step_batch_stats", "multi_step_target", "combine_step_stats", "infer_bn_targets",
           "BatchStatsRecorder", "combined_candidate_stats", "bn_statistics_loss"]
