"""BN-aware gradient inversion: the client's local training simulated differentiably, BN statistics and priors.

Hatamizadeh et al. 2022 (arXiv:2202.06924 §II-A, §II-B; docs/PAPERS.md): the attacker starts from the **current global
checkpoint**, simulates the client's local SGD (same number of iterations, batch size, lr) on candidate
images with trainable labels, and minimises

    L = α_match · matching(Δŵ, Δw) + α_BN · L_BN + α_TV · TV(x̂) + α_ℓ2 · ‖x̂‖₂                      (§II-B; weights: NVFlare code)

:func:`~gradleak.attacks.common.simulation.simulate_local_training` (shared with the FedAvg emulation of the image
optimisation attacks) runs the K SGD steps with ``torch.func.functional_call`` in train mode
(BatchNorm normalises with batch statistics, as the client did), keeping every step's gradient in the
autograd graph (``create_graph=True``), so the simulated update is a differentiable function of the
candidate images *and* the soft labels; a :class:`~gradleak.attacks.common.bn_stats.BatchStatsRecorder` collects
every BN layer's per-step batch statistics, combined with the K-step weights of
:mod:`gradleak.attacks.common.bn_stats` (like with like against :func:`~gradleak.attacks.common.bn_stats.infer_bn_targets`).
:func:`inversion_objective` assembles the loss.

**The public code's defect, fixed.** NVFlare's ``FLGradientInversion`` (authors' code, docs/PAPERS.md) forms its matching
term by differencing detached ``state_dict``s of a model trained in place, so that term has *no gradient
path* to the images (measured before the fix): its attack is driven by the BN loss and the
priors alone. Here the matching term's
gradient reaches the images (tests: non-zero, and equal to finite differences in float64).

Decisions the paper leaves open, recorded here:

* **Update convention.** The simulation returns the pseudo-gradient ``Σ_k g_k = (θ_0 − θ_K)/lr``
  (gradleak's FedAvg upload, :class:`~gradleak.fl.core.Update` ``kind="pseudo_gradient"``) and the weight
  delta ``θ_K − θ_0 = −lr Σ_k g_k`` (NVFlare's ``WEIGHT_DIFF``); :func:`matching_loss` is told which one
  the observation is. Summing the gradients (not differencing weights) keeps float32 rounding out.
* **Step schedule.** Consecutive batches of the candidates, epoch 1's order re-used in later epochs
  (:func:`~gradleak.attacks.common.simulation.local_schedule`, which records why).
* **Labels.** Soft labels ``p = softmax(z)`` with the client's mean cross-entropy ``−Σ_c p_c log q_c``
  (identical to the client's loss for one-hot ``p``); NVFlare's code uses BCE-with-logits on its binary
  CXR labels. Hard (``long``) labels are accepted.
* **Matching.** ``"l2"``: ``Σ_tensors ‖Δŵ − Δw‖₂`` (NVFlare, weight 1e-3); ``"cosine"``: one
  ``1 − cos`` over all tensors (Geiping et al. 2020). Which parameters: every parameter the observed update
  holds (the trainable ones).
* **Priors.** TV-ℓ2 of DeepInversion (``get_image_prior_losses``: ℓ2 norms of the horizontal, vertical and
  both diagonal differences) and the image norm ``‖x̂‖₂``; weights 1e-4 / 1e-5 in NVFlare's code.
* **BN-loss model.** The candidates' statistics are recorded inside the simulated steps (step k runs
  θ_{k−1}), which is the computation that produced the client's statistics; the public code forwards the
  candidates through the *updated* model (θ_0 + Δw) instead, a network the client never ran.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional

import torch
from pydantic import Field
from torch import nn

from gradleak.attacks.base import AttackBase, AttackConfig, Reconstruction
from gradleak.attacks.common.bn_stats import (BNTarget, bn_statistics_loss,
                                       combined_candidate_stats, infer_bn_targets)
from gradleak.attacks.common.simulation import (Simulation, client_training_config, local_schedule, output_logits,
                                                simulate_local_training, soft_cross_entropy)
from gradleak.errors import BadInput
from gradleak.models.batchnorm import batchnorm_layers
from gradleak.registry import ATTACKS


def matching_loss(sim: Simulation, observed: Mapping[str, torch.Tensor], *, kind: str = "pseudo_gradient",
                  form: str = "cosine") -> torch.Tensor:
    """Distance between the simulated and the observed update, over the observed tensors.

    ``kind``: what ``observed`` holds — ``"pseudo_gradient"`` (Σ g_k, gradleak's FedAvg upload) or
    ``"weight_delta"`` (θ_K − θ_0). ``form``: ``"cosine"`` (1 − cos over all tensors) or ``"l2"``
    (Σ_tensors ‖Δŵ − Δw‖₂, NVFlare).
    """
    if kind not in ("pseudo_gradient", "weight_delta"):
        raise BadInput("attack.update_kind", f"unknown update kind '{kind}'.", "use 'pseudo_gradient' or 'weight_delta'.")
    if form not in ("cosine", "l2"):
        raise BadInput("attack.matching", f"unknown matching form '{form}'.", "use 'cosine' or 'l2'.")
    sim_t = sim.pseudo_gradient if kind == "pseudo_gradient" else sim.weight_delta()
    missing = [n for n in observed if n not in sim_t]
    if missing:
        raise BadInput("updates", f"the observed update holds {len(missing)} tensors the simulation does not train "
                       f"(e.g. '{missing[0]}').", "simulate the same trainable parameters as the client.")
    sims = [sim_t[n] for n in observed]
    obs = [observed[n].to(sim_t[n].dtype).to(sim_t[n].device) for n in observed]
    fn = _SumOfNorms if form == "l2" else _OneMinusCosine
    return fn.apply(len(sims), *sims, *obs)


class _SumOfNorms(torch.autograd.Function):
    """``Σ_i ‖s_i − o_i‖₂`` with a one-pass backward ``∂/∂s_i = (s_i − o_i)/‖s_i − o_i‖`` (``o`` constant).

    Autograd's per-tensor norm backward makes three passes over the ~11 M ResNet-18 entries (multiply,
    divide, mask zero norms): a fifth of an inversion iteration. First derivatives only.
    """

    @staticmethod
    def forward(ctx, n, *tensors):
        sims, obs = tensors[:n], tensors[n:]
        diffs = torch._foreach_sub(list(sims), list(obs))
        norms = torch.stack(torch._foreach_norm(diffs))
        ctx.save_for_backward(norms, *diffs)
        return norms.sum()

    @staticmethod
    def backward(ctx, grad):
        norms, *diffs = ctx.saved_tensors
        scale = torch.where(norms > 0, grad / norms.clamp_min(torch.finfo(norms.dtype).tiny), torch.zeros_like(norms))
        grads = torch._foreach_mul(diffs, list(scale.unbind()))
        return (None, *grads, *([None] * len(diffs)))


class _OneMinusCosine(torch.autograd.Function):
    """``1 − ⟨s, o⟩ / (‖s‖ ‖o‖)`` over the concatenation of all tensors, with a fused backward
    ``∂/∂s = −o/(‖s‖‖o‖) + ⟨s, o⟩ s/(‖s‖³‖o‖)`` (``o`` constant). First derivatives only."""

    @staticmethod
    def forward(ctx, n, *tensors):
        sims, obs = list(tensors[:n]), list(tensors[n:])
        dot = torch.stack([torch.dot(a.reshape(-1), b.reshape(-1)) for a, b in zip(sims, obs)]).sum()
        sn = torch.sqrt(torch.stack(torch._foreach_norm(sims)).square().sum() + torch.finfo(sims[0].dtype).tiny)
        on = torch.sqrt(torch.stack(torch._foreach_norm(obs)).square().sum())
        ctx.save_for_backward(dot, sn, on, *sims, *obs)
        ctx.n = n
        return 1.0 - dot / (sn * on)

    @staticmethod
    def backward(ctx, grad):
        dot, sn, on, *rest = ctx.saved_tensors
        sims, obs = rest[:ctx.n], rest[ctx.n:]
        a = -grad / (sn * on)
        b = grad * dot / (sn ** 3 * on)
        grads = torch._foreach_mul(list(obs), a)
        torch._foreach_add_(grads, list(sims), alpha=float(b))  # one allocation, two passes
        return (None, *grads, *([None] * ctx.n))


def total_variation_l2(x: torch.Tensor) -> torch.Tensor:
    """DeepInversion's TV-ℓ2: ‖Δ_h x‖₂ + ‖Δ_v x‖₂ + ‖Δ_diag x‖₂ + ‖Δ_antidiag x‖₂ (B×C×H×W)."""
    d1 = x[:, :, :, :-1] - x[:, :, :, 1:]
    d2 = x[:, :, :-1, :] - x[:, :, 1:, :]
    d3 = x[:, :, 1:, :-1] - x[:, :, :-1, 1:]
    d4 = x[:, :, :-1, :-1] - x[:, :, 1:, 1:]
    return d1.norm() + d2.norm() + d3.norm() + d4.norm()


@dataclass
class ObjectiveWeights:
    """Weights of the inversion loss; defaults = NVFlare's client-9 configuration (authors' code)."""

    matching: float = 1e-3
    bn: float = 0.1
    tv: float = 1e-4
    l2: float = 1e-5


def inversion_objective(sim: Simulation, observed: Mapping[str, torch.Tensor] | None,
                        targets: Mapping[str, BNTarget] | None, images: torch.Tensor,
                        weights: ObjectiveWeights = ObjectiveWeights(), *, kind: str = "pseudo_gradient",
                        matching: str = "l2", bn_form: str = "norm") -> dict[str, torch.Tensor]:
    """The terms and their weighted ``total``; a zero weight (or ``None`` observation/targets) drops a term,
    which gives the ablations (gradient term only, BN term only)."""
    zero = images.new_zeros(())
    terms = {
        "matching": matching_loss(sim, observed, kind=kind, form=matching) if observed is not None and weights.matching else zero,
        "bn": bn_statistics_loss(sim.combined_stats, targets, form=bn_form) if targets is not None and weights.bn else zero,
        "tv": total_variation_l2(images) if weights.tv else zero,
        "l2": images.norm() if weights.l2 else zero,
    }
    terms["total"] = (weights.matching * terms["matching"] + weights.bn * terms["bn"] + weights.tv * terms["tv"]
                      + weights.l2 * terms["l2"])
    return terms


def measure_iteration_cost(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, *, lr: float = 0.01,
                           steps: int = 1, repeats: int = 3, matching: str = "l2") -> dict[str, float]:
    """Seconds of one training forward+backward vs one inversion iteration (K = ``steps`` simulated steps of
    ``len(images) // steps`` images), measured in one process; ratio = iteration / (K · forward+backward).

    The observation and BN targets are those of the true images (their content does not change the cost).
    ``repeats`` interleaved timings after one warm-up each; ``ratio_per_step`` from the fastest of each,
    ``ratio_per_step_median`` from the medians.
    """
    model.train()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for n, p in model.named_parameters() if p.requires_grad]
    per = len(images) // steps
    if per < 1:
        raise BadInput("batch", f"{len(images)} images cannot fill {steps} steps.")
    hard = labels.argmax(1) if labels.dtype != torch.long else labels

    def fwd_bwd() -> None:
        loss = soft_cross_entropy(output_logits(model(images[:per])), hard[:per])
        torch.autograd.grad(loss, params)

    sched = local_schedule(per * steps, per)
    with torch.no_grad():
        buffers_before = {n: b.clone() for n, b in model.named_buffers()}
    ref = simulate_local_training(model, images, hard, lr=lr, schedule=sched, create_graph=False)
    observed = {n: g.detach() for n, g in ref.pseudo_gradient.items()}
    targets = {n: BNTarget(m.detach(), v.detach(), steps, ref.step_weights) for n, (m, v) in ref.combined_stats.items()}
    x = images.clone().requires_grad_(True)
    model.eval()
    with torch.no_grad():
        num_classes = output_logits(model(images[:1])).shape[1]
    model.train()
    z = torch.zeros(len(images), num_classes, dtype=images.dtype).requires_grad_(True)

    def iteration() -> None:
        sim = simulate_local_training(model, x, torch.softmax(z, 1), lr=lr, schedule=sched)
        terms = inversion_objective(sim, observed, targets, x, matching=matching)
        torch.autograd.grad(terms["total"], [x, z])

    fwd_bwd()
    iteration()
    t_fb, t_it = [], []
    for _ in range(repeats):  # interleaved, so a busy neighbour slows both alike
        t0 = time.perf_counter()
        fwd_bwd()
        t_fb.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        iteration()
        t_it.append(time.perf_counter() - t0)
    t_fb.sort()
    t_it.sort()
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(buffers_before[n])
    med_fb, med_it = t_fb[len(t_fb) // 2], t_it[len(t_it) // 2]
    return {"forward_backward_s": t_fb[0], "iteration_s": t_it[0], "steps": steps, "batch_size": per,
            "ratio_per_step": t_it[0] / (steps * t_fb[0]), "ratio_per_step_median": med_it / (steps * med_fb),
            "trainable_tensors": len(names)}


# ============================================================================================ the attack

ABLATIONS = ("none", "gradient_only", "bn_only", "stale_checkpoint", "fixed_bn", "single_step_bn")


class BNInversionConfig(AttackConfig):
    iterations: int = Field(200, ge=1, le=1_000_000, description="Adam iterations per attacked client and round "
                            "(NVFlare: 40 000 on 224 px)")
    lr: float = Field(0.1, gt=0, le=100, description="Adam learning rate (NVFlare 0.1)")
    beta1: float = Field(0.9, ge=0, lt=1, description="Adam β1 (NVFlare 0.9)")
    beta2: float = Field(0.9, ge=0, lt=1, description="Adam β2 (NVFlare 0.9)")
    warmup: int = Field(20, ge=0, description="linear lr warm-up iterations before the cosine decay (NVFlare 100)")
    energy: float = Field(0.1, ge=0, description="Gaussian perturbation std of the images = energy × current lr, at "
                          "the prior initialisation and after every step (NVFlare 0.1)")
    matching: Literal["l2", "cosine"] = Field("l2", description="Σ_tensors ‖Δŵ − Δw‖₂ (NVFlare) or 1 − cos")
    matching_weight: float = Field(1e-3, ge=0, description="weight of the matching term (NVFlare 1e-3)")
    bn_weight: float = Field(0.1, ge=0, description="weight of the BN-statistics term (NVFlare 0.1)")
    tv_weight: float = Field(1e-4, ge=0, description="weight of the TV-ℓ2 prior (NVFlare 1e-4)")
    l2_weight: float = Field(1e-5, ge=0, description="weight of the image ℓ2 norm (NVFlare 1e-5)")
    bn_loss: Literal["norm", "squared"] = Field("norm", description="Σ‖μ̂ − μ‖ + ‖σ̂² − σ²‖ (NVFlare) or squared norms")
    labels: Literal["soft", "from_head"] = Field("soft", description="optimised soft labels (random init), or hard "
                                                  "labels read from the head-bias update")
    ablation: Literal["none", "gradient_only", "bn_only", "stale_checkpoint", "fixed_bn", "single_step_bn"] = Field(
        "none", description="gradient_only: no BN term; bn_only: no matching term; stale_checkpoint: simulate from "
        "the checkpoint stale_rounds earlier; fixed_bn: BN targets = the checkpoint's running statistics (prior work); "
        "single_step_bn: the public code's one-step BN inference (x = (new − (1 − m) old)/m) against the candidates' "
        "per-step statistics averaged uniformly (wrong for clients that took several steps)")
    stale_rounds: int = Field(1, ge=1, description="stale_checkpoint: how many rounds old the checkpoint is")
    prior: Literal["dataset_mean", "gray"] = Field("dataset_mean", description="initial image: the dataset mean image "
                                                   "(public_data) or uniform grey 0.5")
    clients: Optional[list[int]] = Field(None, description="client ids to attack (default: every observed client)")
    rounds: Optional[list[int]] = Field(None, description="rounds to attack, 0-based, negative from the end (default: "
                                        "the last round)")
    seed: int = Field(0, ge=0, description="candidate noise and soft-label initialisation")


def _cosine_lr(it: int, total: int, warmup: int, base: float) -> float:
    """Linear warm-up over ``warmup`` iterations, then cosine decay to 0 at ``total`` (NVFlare's schedule)."""
    if warmup and it < warmup:
        return base * (it + 1) / warmup
    span = max(1, total - warmup)
    return base * 0.5 * (1.0 + math.cos(math.pi * min(1.0, (it - warmup) / span)))


def labels_from_head(pseudo_gradient: Mapping[str, torch.Tensor], num_images: int, num_classes: int) -> torch.Tensor:
    """Hard labels from the head-bias update (iDLG's sign rule, extended to several images and steps).

    With the mean cross-entropy, ``∂L/∂b_c = mean_i (p_ic − y_ic)`` is negative only for the classes present
    (p < 1); summed over the K steps this still holds when the weights move little. The ``num_images``
    labels are spread over the classes with negative entries in proportion to ``−Σ_k ∂L/∂b_c``
    (largest-remainder rounding, each such class at least once while images remain) — an approximation for
    several images (a class whose samples are already well fitted reads as smaller). Falls back to the most
    negative class when none is negative.
    """
    bias = [g for n, g in pseudo_gradient.items() if n.endswith("bias") and g.ndim == 1 and g.numel() == num_classes]
    if not bias:
        raise BadInput("attack.labels", "labels: from_head needs the classifier bias in the update.",
                       "use labels: soft, or train the head's bias.")
    neg = (-bias[-1].to(torch.float64)).clamp_min(0)
    if float(neg.sum()) <= 0:
        neg = torch.zeros_like(neg)
        neg[int(bias[-1].argmin())] = 1.0
    present = torch.nonzero(neg > 0).reshape(-1).tolist()
    present.sort(key=lambda c: -float(neg[c]))
    counts = torch.zeros(num_classes, dtype=torch.long)
    for c in present[:num_images]:
        counts[c] = 1
    rest = num_images - int(counts.sum())
    if rest > 0:
        share = neg / neg.sum() * rest
        counts += share.floor().long()
        left = num_images - int(counts.sum())
        for c in torch.argsort(share - share.floor(), descending=True)[:left].tolist():
            counts[c] += 1
    return torch.repeat_interleave(torch.arange(num_classes), counts)


@ATTACKS.register("bn_inversion", "BN-aware gradient inversion of FedAvg clients (Hatamizadeh et al. 2022): simulate "
                  "the K local steps from the current checkpoint, match the update and the BN statistics inferred "
                  "from the running-statistics change")
class BNInversion(AttackBase):
    """Hatamizadeh et al. 2022 (arXiv:2202.06924 §II-B; NVFlare's code for the weights) on the round protocol.

    For every attacked client c and round r the server reads, from the :class:`~gradleak.fl.core.ServerView`:
    the checkpoint it sent in round r (``view.round_states``: parameters *and* BN buffers), c's upload
    (pseudo-gradient ``Σ_k g_k`` and the BN buffer changes), c's sample count (``knows_batch_size``) and the
    public training configuration (c's local batch size and epochs, round r's lr: ``AttackContext.fl``).
    It then minimises :func:`inversion_objective` over candidate images (and soft labels) by Adam:

    1. **Initialisation** from the domain prior (``prior: dataset_mean`` — the mean image of held-out images
       of the private dataset, granted under ``threat.public_data``; §II-B: domain-specific priors) plus Gaussian "energy"
       noise of std ``energy × lr`` that breaks the symmetry between candidates (NVFlare);
    2. **Simulation** of c's K local SGD steps (:func:`simulate_local_training`, differentiable: the
       matching term's gradient reaches the images — the public code's defect fixed);
    3. **BN loss** against :func:`~gradleak.attacks.common.bn_stats.infer_bn_targets` of the running-statistics
       change, combined over the K steps with the momentum weights (exact for any K, beyond the public code);
    4. **Priors** TV-ℓ2 and ‖x̂‖₂; soft labels ``softmax(z)`` trained through the simulated loss (or hard
       labels from the head-bias update, ``labels: from_head``).

    Ablations (``ablation``; §III-B: without the current global checkpoint or without correct BN
    accounting the attack fails): ``gradient_only`` (BN weight 0), ``bn_only`` (matching weight 0),
    ``stale_checkpoint`` (weights *and* buffers of the checkpoint ``stale_rounds`` rounds older; the BN
    targets are inferred from it as well — what an attacker without the current checkpoint would do),
    ``fixed_bn`` (prior work's assumption, Yin et al. 2021: the targets are the checkpoint's running
    statistics, not the client's batch statistics).

    Decisions the paper leaves open, recorded:

    * **Images**: the candidates live in the clients' input space ``2x − 1`` (``x`` in [0, 1], the pipeline's
      pixel map), are clamped to [−1, 1] after every step and returned as ``x = (v + 1)/2``; the client's
      channel count (grey stays grey: the paper's "grayscale constraint").
    * **How many candidates**: as many as the client's images (its sample count, granted under
      ``knows_batch_size``); the step schedule is the client's public batch size and epochs
      (:func:`local_schedule`, the client's private shuffle being irrelevant for exchangeable candidates in
      epoch 1; later epochs re-use epoch 1's order).
    * **Matching scale**: ``l2`` compares weight deltas ``Δw = −lr Σ_k g_k`` (NVFlare's ``WEIGHT_DIFF``
      scale, where its weight 1e-3 was tuned); ``cosine`` is scale-free.
    * **Which round**: default the last round (the paper's later rounds reconstruct best, §III-C); the
      runner keeps only the rounds the attack reads (each upload of ResNet-18 is 90 MB in float64).
    * **Output**: the final iterate (not the lowest-loss one); per (client, round) the images, the labels,
      the loss terms before and after.
    * The attack refuses a model without BatchNorm (``model.name``, at ``prepare``) and updates without BN
      running statistics (``updates``, at ``reconstruct``).
    """

    name = "bn_inversion"
    Config = BNInversionConfig
    modality = "image"
    peft_kinds = ("none", "adapters", "lora")
    reconstruction = "leakage"
    uses_prior = True
    summary = "BN-aware inversion of FedAvg updates with BN running statistics (Hatamizadeh et al. 2022)"

    @classmethod
    def requires(cls, cfg: Optional[BNInversionConfig] = None) -> dict[str, bool]:
        cfg = cfg or BNInversionConfig()
        need = {"individual_updates": True, "knows_batch_size": True}
        if cfg.prior == "dataset_mean":
            need["public_data"] = True
        return need

    @classmethod
    def from_config(cls, cfg: BNInversionConfig, ctx) -> "BNInversion":
        return cls(cfg, fl=dict(ctx.fl), device=ctx.device)

    def __init__(self, cfg: BNInversionConfig | None = None, fl: Mapping[str, Any] | None = None, device=None):
        self.cfg = cfg or BNInversionConfig()
        self.fl = dict(fl or {})
        self.device = device
        self._total = None

    # ---- round protocol
    def prepare(self, model, threat):
        if self.cfg.ablation != "gradient_only":  # BadInput for a model without BatchNorm
            try:
                batchnorm_layers(model, field="model.name")
            except BadInput as e:
                raise BadInput("model.name", e.problem, "use a BatchNorm model (model.name: resnet18 with model.norm: "
                               "batch), or attack.ablation=gradient_only (the matching term alone, e.g. on the "
                               "GroupNorm model DP-SGD needs).") from None
        return model

    def _targets(self, total: int) -> list[int]:
        rs = self.cfg.rounds if self.cfg.rounds is not None else [-1]
        out = []
        for r in rs:
            rr = r + total if r < 0 else r
            if not 0 <= rr < total:
                raise BadInput("attack.rounds", f"round {r} does not exist (fl.rounds = {total}).",
                               f"use rounds in 0..{total - 1} (or negative from the end).")
            out.append(rr)
        return sorted(set(out))

    def _checkpoint_round(self, r: int) -> int:
        if self.cfg.ablation != "stale_checkpoint":
            return r
        s = r - self.cfg.stale_rounds
        if s < 0:
            raise BadInput("attack.ablation", f"a checkpoint {self.cfg.stale_rounds} round(s) older than round {r} "
                           "does not exist.", f"attack a later round (fl.rounds ≥ {self.cfg.stale_rounds + 1}), or "
                           "lower attack.stale_rounds.")
        return s

    def observes_round(self, round_index: int, total_rounds: int) -> bool:
        keep = set(self._targets(total_rounds))
        keep |= {self._checkpoint_round(r) for r in keep}
        return round_index in keep

    # ---- reconstruction
    def reconstruct(self, view) -> Reconstruction:
        total = len(self.fl.get("lr_at") or []) or None
        if total is None:
            raise BadInput("fl.rounds", "the attack needs the public training configuration (rounds, lr).",
                           "run it through the pipeline (gradleak run).")
        kept = [r for r in range(total) if self.observes_round(r, total)][:len(view.rounds)]
        index = {r: i for i, r in enumerate(kept)}
        prior = self._prior(view)
        results, timings, missing = [], {"inversion_seconds": 0.0}, []
        for r in self._targets(total):
            if r not in index:
                raise BadInput("threat.rounds_observed", f"round {r} is not in the server view.",
                               "observe the attacked rounds (raise threat.rounds_observed).")
            ups = view.rounds[index[r]]
            state = view.round_states[index[self._checkpoint_round(r)]]
            every = list(range(int(self.fl.get("clients") or 0))) or [u.client_id for u in ups]
            wanted = self.cfg.clients if self.cfg.clients is not None else every  # a withheld one: reported, not skipped
            by_id = {u.client_id: u for u in ups}
            for c in wanted:
                if c not in by_id:
                    if 0 <= c < int(self.fl.get("clients") or 0):  # a client that withheld its update this round
                        missing.append((int(c), int(r)))
                        continue
                    raise BadInput("attack.clients", f"client {c} does not exist.",
                                   f"attack clients 0..{int(self.fl.get('clients') or 1) - 1}.")
                t0 = time.perf_counter()
                results.append(self.invert(view, by_id[c], state, r, prior))
                timings["inversion_seconds"] += time.perf_counter() - t0
        info = {"attacked": [(d["client"], d["round"]) for d in results], "ablation": self.cfg.ablation,
                "no_update": missing,  # (client, round) pairs the server received nothing from
                "prior": self.cfg.prior, "timings": timings,
                "terms": {f"client{d['client']}_round{d['round']}": d["terms"] for d in results}}
        return Reconstruction({"per_client": results, "prior": prior}, info)

    def _prior(self, view) -> torch.Tensor:
        shape = tuple(view.public.get("image_shape") or ())
        if self.cfg.prior == "gray":
            if not shape:
                raise BadInput("attack.prior", "the image shape is unknown.", "run through the pipeline.")
            return torch.full(shape, 0.5)
        p = view.public.get("prior_image")
        if p is None:
            raise BadInput("attack.prior", "prior: dataset_mean needs the dataset mean image, which the server view "
                           "does not hold.", "grant threat.public_data=true (held-out images of the domain), or use "
                           "attack.prior=gray.")
        return torch.as_tensor(p, dtype=torch.float32)

    def _client_config(self, cid: int, n: int, r: int) -> tuple[int, int, float]:
        return client_training_config(self.fl, cid, n, r)

    def invert(self, view, upd, state: Mapping[str, torch.Tensor], r: int, prior: torch.Tensor) -> dict:
        """Invert one client's update ``upd`` of round ``r`` (sent from ``state``) from ``prior``: the per-client step
        of :meth:`reconstruct`, public because the RDLV filter defense runs it on a client's own update."""
        cfg = self.cfg
        if upd.buffers is None and cfg.ablation != "gradient_only":
            raise BadInput("updates", f"client {upd.client_id}'s update in round {r} carries no BatchNorm running "
                           "statistics, so the BN-aware attack has no BN targets.",
                           "let the clients train in train mode and send their BN buffers (gradleak's round protocol "
                           "does for BatchNorm models), or use an attack that reads gradients only.")
        n = int(upd.num_samples)
        if n < 1:
            raise BadInput("threat.knows_batch_size", "the update's sample count is withheld.",
                           "grant threat.knows_batch_size=true.")
        b, e, lr = self._client_config(upd.client_id, n, r)
        schedule = local_schedule(n, b, e)
        model = copy.deepcopy(view.model)
        dev = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        with torch.no_grad():
            params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
            for k, v in state.items():
                (params.get(k) if k in params else buffers.get(k)).copy_(v.to(dev))
        steps = len(schedule)
        targets = None
        if cfg.ablation != "gradient_only":  # the BN targets (gradient_only reads none: the model may have no BN)
            old = {k: v.detach().clone() for k, v in model.state_dict().items()}
            new = dict(old)
            for k, d in upd.buffers.items():
                new[k] = (old[k].to(torch.float64) + d.to(dev, torch.float64)).to(old[k].dtype)
            targets = infer_bn_targets(model, old, new, steps=1 if cfg.ablation == "single_step_bn" else steps)
        if cfg.ablation == "fixed_bn":
            targets = {k: BNTarget(old[f"{k}.running_mean"].to(torch.float64), old[f"{k}.running_var"].to(torch.float64),
                                   t.steps, t.weights) for k, t in targets.items()}
        names = [k for k in upd.tensors if k in params]
        observed = ({k: (-lr * upd.tensors[k].to(torch.float64)).to(dev) for k in names} if cfg.matching == "l2"
                    else {k: upd.tensors[k].to(dev) for k in names})
        kind = "weight_delta" if cfg.matching == "l2" else "pseudo_gradient"
        w = ObjectiveWeights(matching=0.0 if cfg.ablation == "bn_only" else cfg.matching_weight,
                             bn=0.0 if cfg.ablation == "gradient_only" else cfg.bn_weight,
                             tv=cfg.tv_weight, l2=cfg.l2_weight)
        num_classes = int(view.public.get("num_classes") or model.config.num_labels)
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + upd.client_id * 7_919 + r)
        x0 = (prior.to(torch.float32) * 2 - 1).reshape(1, *prior.shape).expand(n, -1, -1, -1)
        v = (x0 + cfg.energy * cfg.lr * torch.randn(x0.shape, generator=gen)).clamp(-1, 1).to(dev, dtype)
        v.requires_grad_(True)
        leaves = [v]
        if cfg.labels == "soft":
            z = torch.randn(n, num_classes, generator=gen).to(dev, dtype).requires_grad_(True)
            leaves.append(z)
            hard = None
        else:
            hard = labels_from_head(upd.tensors, n, num_classes).to(dev)
        opt = torch.optim.Adam(leaves, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))

        def objective():
            lab = torch.softmax(leaves[1], 1) if hard is None else hard
            sim = simulate_local_training(model, v, lab, lr=lr, schedule=schedule, param_names=names)
            if cfg.ablation == "single_step_bn":  # like with unlike: uniform mean of the steps vs the one-step target
                uniform = torch.full((steps,), 1.0 / steps, dtype=torch.float64)
                sim.combined_stats = combined_candidate_stats(sim.step_stats, uniform)
            return inversion_objective(sim, observed if w.matching else None, targets if w.bn else None, v, w,
                                       kind=kind, matching=cfg.matching, bn_form=cfg.bn_loss)

        first = last = None
        for it in range(cfg.iterations):
            lr_t = _cosine_lr(it, cfg.iterations, cfg.warmup, cfg.lr)
            for g in opt.param_groups:
                g["lr"] = lr_t
            terms = objective()
            if first is None:
                first = {k: float(t.detach()) for k, t in terms.items()}
            grads = torch.autograd.grad(terms["total"], leaves, allow_unused=True)
            for p, g in zip(leaves, grads):
                p.grad = g if g is not None else torch.zeros_like(p)
            opt.step()
            with torch.no_grad():
                if cfg.energy:
                    v.add_(cfg.energy * lr_t * torch.randn(v.shape, generator=gen).to(v))
                v.clamp_(-1, 1)
            last = {k: float(t.detach()) for k, t in terms.items()}
        final = {k: float(t.detach()) for k, t in objective().items()}  # at the returned images (the simulation needs autograd)
        labels = torch.softmax(leaves[1], 1).detach().cpu() if hard is None else hard.cpu()
        return {"client": int(upd.client_id), "round": int(r), "images": ((v.detach() + 1) / 2).clamp(0, 1).float().cpu(),
                "labels": labels, "steps": steps, "batch_size": b, "epochs": e,
                "terms": {"initial": first, "final": final, "last_iteration": last}}


__all__ = ["matching_loss", "total_variation_l2", "ObjectiveWeights", "inversion_objective", "measure_iteration_cost",
           "BNInversion", "BNInversionConfig", "labels_from_head", "ABLATIONS"]
