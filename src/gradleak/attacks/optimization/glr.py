"""Group lazy regularisation (GLR) and the group optimisation loop shared by ``gradvit`` and ``gias``.

Paper 001 Supp. C (eqs. 21–22, after GradInversion / GradViT): |G| reconstructions of the same batch run in parallel
from different initialisations; their **consensus** is the pixel-wise mean

    E = (1/|G|) Σ_g x̂_g                                                       (eq. 21)

and every member's objective gets  R_group-lazy = λ_G ‖x̂ − E‖  (eq. 22), λ_G = 1e-4 in paper 001's experiments
(1e-3 in Table 7 and in Supp. C's text; GradViT uses the same pair of values).

Decisions the papers leave open (open point A2.6, docs/PAPERS.md), recorded here:

* **No registration.** Paper 001 averages the group's images directly (eq. 21, "pixel-wise average"), as the GIAS code
  does; GradInversion (Yin et al. 2021) first registers the members to each other (RANSAC-flow) before averaging —
  that step is not implemented: the consensus is the plain pixel-wise mean of the members' current images. At
  B > 1 the members' images are averaged position by position in the batch (no matching of the batch order).
* **Squared norm** by default (``norm="squared"``: λ_G Σ (x̂ − E)² over the whole batch tensor; smooth, zero gradient
  at the consensus); ``norm="l2"`` gives eq. 22's plain Euclidean norm λ_G ‖x̂ − E‖₂ (the GIAS code's form, without
  its division by the image side²).
* **Lazy.** The consensus is a constant (detached) target, rebuilt every ``every`` steps from step ``start`` on (the
  GIAS code: built at iteration 500, refreshed every 100); in between the stale consensus is used, so GLR costs one
  mean per refresh and no extra gradient path between members. Before ``start`` there is no term.
* **Who counts.** Only the members still running whose image is finite (a member whose objective became NaN/inf
  stops and leaves the group, so it cannot poison the others' term). With one member the consensus is that member's
  own image: the term is zero (GLR needs ≥ 2 restarts).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

__all__ = ["GroupLazyRegularizer", "GroupMember", "consensus", "optimise_group", "step_decay_milestones"]


def consensus(images: Sequence[torch.Tensor]) -> torch.Tensor:
    """Pixel-wise mean (eq. 21) of the group's images (each B×C×H×W), detached: the lazy target."""
    if not len(images):
        raise ValueError("the consensus of an empty group is undefined")
    return torch.stack([x.detach() for x in images]).mean(0)


class GroupLazyRegularizer:
    """λ_G ‖x − E‖² (or ‖x − E‖₂) against a consensus E refreshed every ``every`` steps from ``start`` on."""

    def __init__(self, weight: float, every: int = 100, start: int = 0, norm: str = "squared"):
        if weight < 0:
            raise ValueError(f"GLR weight must be >= 0, got {weight}")
        if int(every) < 1:
            raise ValueError(f"GLR refresh period must be >= 1, got {every}")
        if norm not in ("squared", "l2"):
            raise ValueError(f"unknown GLR norm {norm!r}")
        self.weight = float(weight)
        self.every = int(every)
        self.start = max(0, int(start))
        self.norm = norm
        self.target: Optional[torch.Tensor] = None
        self.refreshed_at: list[int] = []

    def due(self, step: int) -> bool:
        """Whether the consensus is rebuilt at ``step`` (lazy: every ``every`` steps from ``start``)."""
        return self.weight > 0 and step >= self.start and (step - self.start) % self.every == 0

    def refresh(self, images: Sequence[torch.Tensor], step: int | None = None) -> torch.Tensor:
        self.target = consensus(images)
        if step is not None:
            self.refreshed_at.append(int(step))
        return self.target

    def reset(self) -> None:
        self.target = None

    def penalty(self, x: torch.Tensor) -> torch.Tensor:
        """The term of one member with image ``x`` (0 before the first refresh or with weight 0)."""
        if self.target is None or self.weight == 0.0:
            return x.new_zeros(())
        sq = ((x - self.target.to(x.dtype)) ** 2).sum()
        if self.norm == "squared":
            return self.weight * sq
        return self.weight * torch.sqrt(sq + torch.finfo(x.dtype).tiny)


def step_decay_milestones(steps: int) -> list[int]:
    """IG's / the GIAS code's step decay: ×0.1 at 3/8, 5/8 and 7/8 of the steps."""
    return sorted({max(1, int(steps * f)) for f in (3 / 8, 5 / 8, 7 / 8)})


@dataclass
class GroupMember:
    """One restart of a group: what is optimised (``params``), how its image is formed from them (``image()``: model
    range, differentiable), its optimiser / scheduler and an optional projection after each step (box clamp)."""

    index: int
    params: list[torch.Tensor]
    image: Callable[[], torch.Tensor]
    optimizer: torch.optim.Optimizer
    scheduler: Any = None
    project: Optional[Callable[[], None]] = None
    diverged_at: Optional[int] = None
    initial_matching_loss: Optional[float] = None
    history: list = field(default_factory=list)
    active: bool = True


def optimise_group(members: Sequence[GroupMember], steps: int,
                   objective: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]],
                   glr: Optional[GroupLazyRegularizer] = None, *, signed: bool = False,
                   step_seconds: Optional[list[float]] = None, probe: Optional[Callable[[], float]] = None,
                   probe_samples: Optional[list[float]] = None, log_every: int = 1,
                   progress: Optional[Callable[[dict[str, Any]], None]] = None, stage: str = "",
                   step_offset: int = 0,
                   batch_objective: Optional[Callable[[list[torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor,
                                                                                      dict[str, torch.Tensor]]]]] = None,
                   ) -> None:
    """Optimise the ``members`` together for ``steps`` steps.

    Each step: if the GLR consensus is due it is rebuilt from the running members' current images; then every running
    member takes one optimiser step on ``objective(x) + glr.penalty(x)`` (``objective`` returns (total, matching term,
    named parts)). A member whose objective is NaN/inf stops there (``diverged_at`` = global step, the others go
    on); non-finite gradient entries are zeroed as in IG. ``step_seconds`` collects the wall time of each member step
    but the first of the stage (one-off costs); ``probe`` (the sent model's forward + backward) is sampled ~10 times
    per member over the stage, so both medians span the same machine load.

    ``batch_objective`` (the objective of several members' images at once, one result per image, each depending on
    its own image only) runs the running members through one forward and one double backward per step instead of
    one after another: every member still has its own parameters, optimiser state, schedule, projection, history and
    divergence check, and takes exactly the step it would take alone (up to floating-point summation order). Its
    ``step_seconds`` entries are then the batched step's wall time divided by the members in it (the cost of one
    member step)."""
    every_probe = max(1, steps // 10)
    for step in range(steps):
        running = [m for m in members if m.active and m.diverged_at is None]
        if not running:
            break
        if glr is not None and glr.due(step):
            with torch.no_grad():  # a member whose image is not finite (about to diverge) is left out of the mean
                imgs = [x for x in (m.image() for m in running) if torch.isfinite(x).all()]
            if imgs:
                glr.refresh(imgs, step + step_offset)
        if batch_objective is not None and len(running) > 1:
            _batched_step(running, step, steps, objective, batch_objective, glr, signed, step_seconds, probe,
                          probe_samples, every_probe, log_every, progress, stage, step_offset)
            continue
        for m in running:
            t = time.perf_counter()
            for opt_group in m.optimizer.param_groups:
                for p in opt_group["params"]:
                    p.grad = None
            x = m.image()
            total, match, parts = objective(x)
            g_term = glr.penalty(x) if glr is not None else x.new_zeros(())
            full = total + g_term
            if not torch.isfinite(full):
                m.diverged_at = step + step_offset
                continue
            grads = torch.autograd.grad(full, m.params, allow_unused=True)
            _member_step(m, grads, match, parts, g_term, signed, step, steps, step_offset, log_every, progress, stage)
            if step and step_seconds is not None:
                step_seconds.append(time.perf_counter() - t)
            if probe is not None and probe_samples is not None and step % every_probe == every_probe // 2:
                probe_samples.append(probe())


def _member_step(m: GroupMember, grads, match, parts: dict, g_term, signed: bool, step: int, steps: int,
                 step_offset: int, log_every: int, progress, stage: str) -> None:
    """One member's optimiser step from its parameters' ``grads`` (non-finite entries zeroed as in IG; signed for
    sign-Adam), its history and progress record, its schedule and projection: the same in the sequential and the
    batched loop."""
    for p, g in zip(m.params, grads):
        if g is None:
            continue
        if not torch.isfinite(g).all():
            g = torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0)
        p.grad = g.sign() if signed else g
    mv = float(match.detach())
    if m.initial_matching_loss is None:
        m.initial_matching_loss = mv
    if step % log_every == 0:
        m.history.append([step + step_offset, mv])
        if progress is not None:
            rec = {"restart": m.index, "stage": stage, "step": step + step_offset, "steps": steps,
                   "matching_loss": mv, "glr": float(g_term.detach()), "lr": m.optimizer.param_groups[0]["lr"]}
            rec.update({k: float(v.detach()) for k, v in parts.items()})
            progress(rec)
    m.optimizer.step()
    if m.scheduler is not None:
        m.scheduler.step()
    if m.project is not None:
        with torch.no_grad():
            m.project()


def _batched_step(running: list[GroupMember], step: int, steps: int, objective, batch_objective, glr, signed: bool,
                  step_seconds, probe, probe_samples, every_probe: int, log_every: int, progress, stage: str,
                  step_offset: int) -> None:
    """One step of every running member through ``batch_objective`` (:func:`optimise_group`). A member whose
    objective is not finite stops there, as in the sequential loop; the step is then recomputed without it, so no
    non-finite value enters the others' backward."""
    t = time.perf_counter()
    while running:
        for m in running:
            for opt_group in m.optimizer.param_groups:
                for p in opt_group["params"]:
                    p.grad = None
        xs = [m.image() for m in running]
        results = batch_objective(xs) if len(running) > 1 else [objective(xs[0])]
        g_terms = [glr.penalty(x) if glr is not None else x.new_zeros(()) for x in xs]
        fulls = [res[0] + g for res, g in zip(results, g_terms)]
        bad = [i for i, f in enumerate(fulls) if not torch.isfinite(f)]
        if not bad:
            break
        for i in bad:
            running[i].diverged_at = step + step_offset
        running = [m for i, m in enumerate(running) if i not in bad]
    if not running:
        return
    flat = [p for m in running for p in m.params]
    grads = torch.autograd.grad(torch.stack(fulls).sum(), flat, allow_unused=True)
    k = 0
    for m, (total, match, parts), g_term in zip(running, results, g_terms):
        _member_step(m, grads[k:k + len(m.params)], match, parts, g_term, signed, step, steps, step_offset, log_every,
                     progress, stage)
        k += len(m.params)
    if step and step_seconds is not None:
        per_member = (time.perf_counter() - t) / len(running)
        step_seconds.extend([per_member] * len(running))
    if probe is not None and probe_samples is not None and step % every_probe == every_probe // 2:
        probe_samples.extend(probe() for _ in running)


def finite_or_inf(v: float) -> float:
    return v if math.isfinite(v) else float("inf")
