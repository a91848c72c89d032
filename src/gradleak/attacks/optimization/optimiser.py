"""The optimiser loop of Inverting Gradients (Geiping et al. 2020, §4): one restart's Adam run on the dummy images
(signed gradients, cosine-decayed step size, the box constraint, the TV prior), and the probe that times the
client's forward + backward for ``timings.iteration_to_fwdbwd_ratio``. The decisions (initialisation, schedule,
box, diverging restarts, iteration cost) are recorded in :mod:`gradleak.attacks.optimization.inverting_gradients`.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch

from gradleak.attacks.optimization.objective import total_variation


class OptimiserLoop:
    """One restart of the optimisation (a mixin of
    :class:`~gradleak.attacks.optimization.inverting_gradients.InvertingGradients`; it reads the attack's
    ``steps``, ``lr``, ``tv_weight``, ``box``, ``signed``, ``seed``, ``log_every``, ``progress`` and calls its
    ``matching_terms``)."""

    def _fwdbwd_probe(self, model, params, batch_size, shape, labels, device, dtype) -> Callable[[], float]:
        """A callable returning the seconds of one forward + backward (the client's step: gradients of every
        uploaded parameter) on a fixed random batch of the client's size; the model is not changed. It is called
        5 times (after a warm-up) before the optimisation and about 10 times spread over each restart, so the
        median compared with the iterations' median spans the same machine load."""
        g = torch.Generator().manual_seed(0)
        x = (torch.rand((batch_size, *shape), generator=g) * 2 - 1).to(device, dtype)
        params = list(params)

        def probe() -> float:
            live = [p for p in params if p.requires_grad]  # (unmatched PEs are frozen once the optimisation starts)
            t = time.perf_counter()
            torch.autograd.grad(self.loss_fn(model, x, labels), live, allow_unused=True)
            return time.perf_counter() - t

        return probe

    def _trial(self, restart: int, model, params, targets, groups, norms, labels,
               batch_size: int, shape, device, dtype, fb_probe=None, fb_samples=None) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(self.seed * 1000 + restart)
        init = torch.randn((batch_size, *shape), generator=gen, dtype=torch.float32).to(device, dtype)
        if self.box == "clamp":
            var = init.clamp(-1.0, 1.0).requires_grad_(True)
        else:
            var = init.requires_grad_(True)

        def pixels(v: torch.Tensor) -> torch.Tensor:
            return torch.tanh(v) if self.box == "tanh" else v

        opt = torch.optim.Adam([var], lr=self.lr)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.steps, eta_min=0.0)
        history: list[list[float]] = []
        step_seconds: list[float] = []
        initial = None
        diverged_at = None
        for step in range(self.steps):
            t_step = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            x = pixels(var)
            match, _, _ = self.matching_terms(model, params, targets, groups, norms, x, labels, True)
            tv = total_variation(x)
            objective = match + self.tv_weight * tv
            if not torch.isfinite(objective):  # stop this restart, report it, keep the others
                diverged_at = step
                break
            (g,) = torch.autograd.grad(objective, var)
            if not torch.isfinite(g).all():
                g = torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0)
            var.grad = g.sign() if self.signed else g
            m = float(match.detach())
            if initial is None:
                initial = m
            if step % self.log_every == 0:
                history.append([step, m])
                if self.progress is not None:
                    self.progress({"restart": restart, "step": step, "steps": self.steps, "matching_loss": m,
                                   "tv": float(tv.detach()), "lr": opt.param_groups[0]["lr"]})
            opt.step()
            sched.step()
            if self.box == "clamp":
                with torch.no_grad():
                    var.clamp_(-1.0, 1.0)
            if step:  # the first step pays one-off costs
                step_seconds.append(time.perf_counter() - t_step)
            if fb_probe is not None and step % max(1, self.steps // 10) == self.steps // 20:
                fb_samples.append(fb_probe())
        x = pixels(var).detach()
        with torch.enable_grad():
            total, main, pe = self.matching_terms(model, params, targets, groups, norms, x, labels, False)
        final = float(total)
        history.append([self.steps if diverged_at is None else diverged_at, final])
        if self.progress is not None:
            self.progress({"restart": restart, "step": self.steps, "steps": self.steps, "matching_loss": final,
                           "tv": float(total_variation(x)), "lr": 0.0})
        if not math.isfinite(final) or diverged_at is not None:
            final = float("inf")
        return {"x": x, "initial_matching_loss": initial if initial is not None else float("nan"),
                "final_matching_loss": final, "final_main_term": float(main),
                "final_pe_term": float(pe) if pe is not None else None, "history": history,
                "step_seconds": step_seconds, "diverged_at_step": diverged_at}
