"""Optimisation-based gradient inversion by an honest server: "Inverting Gradients" (IG).

Geiping, Bauermeister, Dröge, Moeller, *Inverting Gradients — How easy is it to break privacy in
federated learning?*, NeurIPS 2020, §4 (eq. 4): starting from random dummy images ``x``, minimise

    1 − cos(∇_θ L(f_θ(x), y), Δ)  +  α_TV · TV(x)        subject to x ∈ [−1, 1]^{B×C×H×W},

with Adam on the *signed* gradient of the objective, ``Δ`` the observed update and ``TV`` the
anisotropic total variation (mean |horizontal| + mean |vertical| pixel differences). This is the
baseline PEFTLeak §4 runs against adapter-tuned ViTs (SPEC §1.9; Figs 8, 10, 11 of the PEFTLeak paper:
"fails to recover any image"): the gradient is taken **only** over the parameters the client uploads
(adapters + classification head), on the honest model the server sent. The same objective, with a
positional-embedding term and image priors, underlies APRIL / GradViT / GIAS (SPEC §2.3); this module
implements the plain IG form.

The attack needs nothing model-specific: ``model(x) -> logits`` (or an object with ``.logits``) and
the parameter names in the observed :class:`~gradleak.fl.core.Update`. It reads only the
:class:`~gradleak.fl.core.ServerView`: the model (deep-copied, never mutated), one update, and the
public knowledge the threat model grants (``batch_size``, ``labels``, ``image_shape``).

Decisions the papers leave open, recorded here:

* **Cosine over what.** IG (and its reference code ``inversefed``) takes *one* cosine over the
  concatenation of all observed gradient tensors (``similarity="global"``, default): numerator and
  norms are sums over the trainable parameters. ``similarity="per_parameter"`` averages
  ``1 − cos`` over the individual tensors instead (tensors whose observed norm is zero are skipped,
  e.g. the down-projections of Houlsby adapters whose up-projection is still zero).
* **Learning-rate schedule.** IG uses step decay (×0.1 at 3/8, 5/8, 7/8 of the steps); following the
  later ``breaching`` configurations we use cosine decay to zero over ``steps`` (``torch``'s
  ``CosineAnnealingLR``). Adam, ``lr = 0.1``, signed gradients (``signed=True``) as in IG.
* **Box constraint.** Pixels live in the model range [−1, 1] (mean = std = 0.5 normalisation).
  ``box="clamp"`` (IG's "boxed" optimisation, default) clamps after every step;
  ``box="tanh"`` optimises ``z`` with ``x = tanh(z)`` instead.
* **Initialisation.** ``x ~ N(0, 1)`` (IG), then clamped into the box (``tanh`` mode: ``z ~ N(0, 1)``);
  seeded by ``seed`` and the restart index.
* **Restarts.** ``restarts`` independent trials; the one with the lowest final gradient-matching loss
  is returned (IG scores trials by the reconstruction objective). The *final* iterate of each trial is
  used, not the best one seen (IG does the same; cosine decay makes the end of the run the most
  refined point).
* **TV weight.** ``tv_weight = 1e-4`` (IG's CIFAR setting). PEFTLeak gives no value.
* **Labels.** ``labels="known"``: ``view.public["labels"]`` must be granted (IG assumes known labels).
  ``labels="idlg"``: inferred from the gradient of the classification-head bias (iDLG, Zhao et al.
  2020): with the mean cross-entropy, ``∂L/∂b_c = mean_i p_ic − n_c / B``. For B = 1 the unique negative
  entry is the label (exact). For B > 1 we assign labels greedily: repeatedly take the most negative
  residual entry and add ``1/B`` to it (exact when every predicted probability is below ``1/B``, which
  holds for an untrained head). The head bias is the last 1-D tensor in the update whose length equals
  the number of logits (or ``label_param``). Without a trainable head bias, ``"idlg"`` is refused.
* **Batch size.** ``view.public["batch_size"]`` if granted, else the ``num_samples`` the update carries
  (the server sees it for FedAvg weighting); recorded in ``info["batch_size_source"]``.
* **Loss.** The training loss is public protocol: the default is the mean cross-entropy the
  :class:`~gradleak.fl.core.Client` uses; pass ``loss_fn`` for another. FedAvg pseudo-gradients are
  matched as if they were one gradient (a known approximation for several local steps).
* **Attention.** Second derivatives need eager attention (SDPA has no double backward): on the copy
  of the model, any ``config._attn_implementation`` other than ``"eager"`` is switched to ``"eager"``.
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any, Callable, Sequence

import torch
from torch import nn

from typing import Literal, Optional

from pydantic import Field

from gradleak.attacks.base import AttackBase, AttackConfig, Reconstruction, ThreatModel
from gradleak.errors import BadInput
from gradleak.fl.core import LossFn, ServerView, Update, default_classification_loss
from gradleak.registry import ATTACKS

ProgressFn = Callable[[dict[str, Any]], None]


def total_variation(x: torch.Tensor) -> torch.Tensor:
    """Anisotropic TV of a B×C×H×W batch: mean |x[..., i+1, :] − x[..., i, :]| + mean |x[..., j+1] − x[..., j]|."""
    tv = x.new_zeros(())
    if x.shape[-2] > 1:
        tv = tv + (x[..., 1:, :] - x[..., :-1, :]).abs().mean()
    if x.shape[-1] > 1:
        tv = tv + (x[..., 1:] - x[..., :-1]).abs().mean()
    return tv


def infer_labels_from_bias_gradient(bias_grad: torch.Tensor, batch_size: int) -> torch.Tensor:
    """iDLG label inference from ``∂L/∂b`` of the head (mean cross-entropy); see the module docstring."""
    residual = bias_grad.detach().to(torch.float64).clone()
    labels = []
    for _ in range(batch_size):
        c = int(torch.argmin(residual))
        labels.append(c)
        residual[c] += 1.0 / batch_size
    return torch.tensor(sorted(labels), dtype=torch.long)


def _logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def _force_eager_attention(model: nn.Module) -> bool:
    switched = False
    for m in model.modules():
        cfg = getattr(m, "config", None)
        impl = getattr(cfg, "_attn_implementation", None) if cfg is not None else None
        if impl not in (None, "eager"):
            try:
                cfg._attn_implementation = "eager"
                switched = True
            except Exception:  # pragma: no cover - exotic configs
                pass
    return switched


class InvertingGradientsConfig(AttackConfig):
    steps: int = Field(2000, ge=1, le=10_000_000, description="Adam steps per restart")
    lr: float = Field(0.1, gt=0, le=100, description="initial step size (cosine-decayed to 0)")
    tv_weight: float = Field(1e-4, ge=0, description="total-variation weight α_TV")
    restarts: int = Field(1, ge=1, le=1000, description="independent trials; the best final matching loss wins")
    labels: Literal["known", "idlg"] = Field("known", description="known (granted by the threat model) or idlg (from the head-bias gradient)")
    signed: bool = Field(True, description="Adam on the sign of the gradient (IG)")
    box: Literal["clamp", "tanh"] = Field("clamp", description="box constraint on the pixels")
    similarity: Literal["global", "per_parameter"] = Field("global", description="one cosine over all tensors, or the mean per tensor")
    client_index: int = Field(0, ge=0, description="which observed update to attack")
    label_param: Optional[str] = Field(None, description="name of the head bias (idlg); default: detected")
    log_every: Optional[int] = Field(None, ge=1, description="progress every N steps")


@ATTACKS.register("inverting_gradients",
                  "honest-server optimisation attack: 1 − cos gradient matching + TV (Geiping et al. 2020)")
class InvertingGradients(AttackBase):
    """Inverting Gradients (Geiping et al. 2020) on whatever parameters the observed update holds.

    Parameters: ``steps`` Adam steps per restart; ``lr`` initial step size (cosine-decayed to 0);
    ``tv_weight`` α_TV; ``restarts`` independent trials (best final matching loss wins);
    ``labels`` ``"known"`` (from ``view.public["labels"]``) or ``"idlg"`` (inferred from the head bias
    gradient); ``seed``; ``image_shape`` (C, H, W) of one image (default: ``view.public["image_shape"]``,
    else the model config's ``num_channels``/``image_size``); ``progress`` a callable receiving a dict
    (``restart``, ``step``, ``steps``, ``matching_loss``, ``tv``, ``lr``) every ``log_every`` steps;
    ``signed`` use the sign of the gradient (IG); ``box`` ``"clamp"`` or ``"tanh"``;
    ``similarity`` ``"global"`` or ``"per_parameter"``; ``loss_fn`` the training loss;
    ``client_index`` which update of the view to attack; ``label_param`` name of the head bias.
    """

    name = "inverting_gradients"
    Config = InvertingGradientsConfig
    modality = "image"
    reconstruction = "images"

    @classmethod
    def requires(cls, cfg=None) -> dict[str, bool]:
        labels = cfg.labels if cfg is not None else "known"
        return {"knows_batch_size": True, "knows_labels": labels == "known"}

    @classmethod
    def from_config(cls, cfg, ctx):
        return cls(**cfg.model_dump(), seed=ctx.seed)

    def __init__(self, steps: int = 2000, lr: float = 0.1, tv_weight: float = 1e-4, restarts: int = 1,
                 labels: str = "known", seed: int = 0, image_shape: Sequence[int] | None = None,
                 progress: ProgressFn | None = None, *, signed: bool = True, box: str = "clamp",
                 similarity: str = "global", loss_fn: LossFn = default_classification_loss,
                 client_index: int = 0, label_param: str | None = None, log_every: int | None = None):
        if int(steps) < 1:
            raise BadInput("attack.steps", f"steps must be >= 1, got {steps}.", "use e.g. 2000.")
        if not lr > 0:
            raise BadInput("attack.lr", f"lr must be > 0, got {lr}.", "use e.g. 0.1 (IG).")
        if tv_weight < 0:
            raise BadInput("attack.tv_weight", f"tv_weight must be >= 0, got {tv_weight}.", "use e.g. 1e-4.")
        if int(restarts) < 1:
            raise BadInput("attack.restarts", f"restarts must be >= 1, got {restarts}.", "use 1 or more.")
        if labels not in ("known", "idlg"):
            raise BadInput("attack.labels", f"unknown label strategy '{labels}'.", "use 'known' or 'idlg'.")
        if box not in ("clamp", "tanh"):
            raise BadInput("attack.box", f"unknown box constraint '{box}'.", "use 'clamp' or 'tanh'.")
        if similarity not in ("global", "per_parameter"):
            raise BadInput("attack.similarity", f"unknown similarity '{similarity}'.", "use 'global' or 'per_parameter'.")
        if image_shape is not None and len(tuple(image_shape)) != 3:
            raise BadInput("attack.image_shape", f"image_shape must be (C, H, W), got {image_shape}.", "e.g. (3, 32, 32).")
        self.steps = int(steps)
        self.lr = float(lr)
        self.tv_weight = float(tv_weight)
        self.restarts = int(restarts)
        self.labels = labels
        self.seed = int(seed)
        self.image_shape = tuple(int(s) for s in image_shape) if image_shape is not None else None
        self.progress = progress
        self.signed = bool(signed)
        self.box = box
        self.similarity = similarity
        self.loss_fn = loss_fn
        self.client_index = int(client_index)
        self.label_param = label_param
        self.log_every = int(log_every) if log_every else max(1, self.steps // 20)

    # ------------------------------------------------------------------ protocol
    def prepare(self, model: nn.Module, threat: ThreatModel) -> nn.Module:
        """Honest server: the model is sent unchanged."""
        return model

    def reconstruct(self, view: ServerView) -> Reconstruction:
        t0 = time.perf_counter()
        if not view.updates:
            raise BadInput("view.updates", "the server view holds no update.", "run at least one client round.")
        if not 0 <= self.client_index < len(view.updates):
            raise BadInput("attack.client_index", f"client_index {self.client_index} but the view holds "
                           f"{len(view.updates)} update(s).", "pick an index of an observed update.")
        update = view.updates[self.client_index]
        model = copy.deepcopy(view.model)
        eager_switched = _force_eager_attention(model)
        names, params, targets = self._bind(model, update)
        device, dtype = params[0].device, params[0].dtype

        batch_size, bs_source = self._batch_size(view, update)
        shape = self._shape(view, model)
        labels, label_source = self._labels(view, model, update, batch_size, shape, device, dtype)

        target_norms = [t.norm() for t in targets]
        total_norm = torch.sqrt(sum(n ** 2 for n in target_norms))
        if float(total_norm) == 0.0:
            raise BadInput("view.updates", "the observed update is all zeros; there is nothing to match.",
                           "attack an update with non-zero gradients.")

        trials = []
        for r in range(self.restarts):
            trials.append(self._trial(r, model, params, targets, target_norms, total_norm, labels,
                                      batch_size, shape, device, dtype))
        best = min(range(len(trials)), key=lambda i: trials[i]["final_matching_loss"])
        x = trials[best].pop("x")
        images = ((x + 1.0) / 2.0).clamp(0.0, 1.0).detach()
        info = {
            "attack": self.name, "steps": self.steps, "lr": self.lr, "tv_weight": self.tv_weight,
            "restarts": self.restarts, "signed": self.signed, "box": self.box, "similarity": self.similarity,
            "batch_size": batch_size, "batch_size_source": bs_source, "image_shape": list(shape),
            "labels": labels.tolist(), "label_source": label_source, "matched_parameters": names,
            "num_matched_values": int(sum(t.numel() for t in targets)),
            "initial_matching_loss": trials[best]["initial_matching_loss"],
            "final_matching_loss": trials[best]["final_matching_loss"],
            "history": trials[best]["history"], "best_restart": best,
            "restart_final_losses": [t["final_matching_loss"] for t in trials],
            "attention_switched_to_eager": eager_switched, "update_kind": update.kind,
            "seconds": time.perf_counter() - t0,
        }
        return Reconstruction({"images": images, "labels": labels.cpu()}, info)

    # ------------------------------------------------------------------ view reading
    def _bind(self, model: nn.Module, update: Update):
        named = dict(model.named_parameters())
        missing = [k for k in update.tensors if k not in named]
        if missing:
            raise BadInput("view.updates", f"the update holds tensors the model does not have: {missing[:3]}.",
                           "attack an update produced on the model in the same view.")
        for p in model.parameters():
            p.requires_grad_(False)
        names, params, targets = [], [], []
        for k, t in update.tensors.items():
            p = named[k]
            if tuple(p.shape) != tuple(t.shape):
                raise BadInput("view.updates", f"'{k}' has shape {tuple(t.shape)} in the update but "
                               f"{tuple(p.shape)} in the model.", "attack an update produced on this model.")
            if not p.is_floating_point():
                continue
            p.requires_grad_(True)
            names.append(k)
            params.append(p)
            targets.append(t.detach().to(p.device, p.dtype))
        if not params:
            raise BadInput("view.updates", "the update holds no floating-point parameter gradients.",
                           "attack an update with trainable parameters.")
        return names, params, targets

    def _batch_size(self, view: ServerView, update: Update) -> tuple[int, str]:
        bs = view.public.get("batch_size")
        if bs is not None:
            if int(bs) < 1:
                raise BadInput("view.public.batch_size", f"batch size must be >= 1, got {bs}.", "grant the true batch size.")
            return int(bs), "public"
        if update.num_samples >= 1:
            return int(update.num_samples), "update.num_samples"
        raise BadInput("view.public.batch_size", "the batch size is neither granted nor carried by the update.",
                       "put it into ServerView.public['batch_size'].")

    def _shape(self, view: ServerView, model: nn.Module) -> tuple[int, int, int]:
        if self.image_shape is not None:
            return self.image_shape  # type: ignore[return-value]
        shp = view.public.get("image_shape")
        if shp is not None:
            return tuple(int(s) for s in shp)  # type: ignore[return-value]
        cfg = getattr(model, "config", None)
        size, ch = getattr(cfg, "image_size", None), getattr(cfg, "num_channels", None)
        if size is not None and ch is not None:
            h, w = (size, size) if isinstance(size, int) else tuple(size)
            return int(ch), int(h), int(w)
        raise BadInput("attack.image_shape", "the image shape is unknown.",
                       "pass image_shape=(C, H, W) or grant ServerView.public['image_shape'].")

    def _labels(self, view: ServerView, model: nn.Module, update: Update, batch_size: int,
                shape: tuple[int, int, int], device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, str]:
        if self.labels == "known":
            lab = view.public.get("labels")
            if lab is None:
                raise BadInput("view.public.labels", "labels='known' but the threat model grants no labels.",
                               "grant them via ServerView.public['labels'] or use labels='idlg'.")
            lab = torch.as_tensor(lab, dtype=torch.long).reshape(-1)
            if len(lab) != batch_size:
                raise BadInput("view.public.labels", f"{len(lab)} labels for a batch of {batch_size}.",
                               "grant one label per private sample.")
            return lab.to(device), "public"
        with torch.no_grad():
            num_logits = _logits(model(torch.zeros((1, *shape), device=device, dtype=dtype))).shape[-1]
        key = self.label_param
        if key is None:
            cands = [k for k, t in update.tensors.items() if t.ndim == 1 and t.numel() == num_logits and k.endswith("bias")]
            key = cands[-1] if cands else None
        if key is None or key not in update.tensors:
            raise BadInput("attack.labels", "labels='idlg' needs the gradient of a trainable classification-head bias, "
                           "which the update does not hold.",
                           "grant labels via ServerView.public['labels'] (labels='known') or train the head bias.")
        return infer_labels_from_bias_gradient(update.tensors[key], batch_size).to(device), f"idlg:{key}"

    # ------------------------------------------------------------------ optimisation
    def _matching(self, model: nn.Module, params: list[torch.Tensor], targets: list[torch.Tensor],
                  target_norms: list[torch.Tensor], total_norm: torch.Tensor, x: torch.Tensor,
                  labels: torch.Tensor, create_graph: bool) -> torch.Tensor:
        loss = self.loss_fn(model, x, labels)
        grads = torch.autograd.grad(loss, params, create_graph=create_graph, allow_unused=True)
        grads = [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, params)]
        eps = torch.finfo(x.dtype).tiny
        if self.similarity == "global":
            dot = sum((g * t).sum() for g, t in zip(grads, targets))
            gnorm = torch.sqrt(sum((g * g).sum() for g in grads) + eps)
            return 1.0 - dot / (gnorm * total_norm)
        terms = []
        for g, t, tn in zip(grads, targets, target_norms):
            if float(tn) == 0.0:
                continue
            terms.append(1.0 - (g * t).sum() / (torch.sqrt((g * g).sum() + eps) * tn))
        return torch.stack(terms).mean()

    def _trial(self, restart: int, model, params, targets, target_norms, total_norm, labels,
               batch_size: int, shape, device, dtype) -> dict[str, Any]:
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
        initial = None
        for step in range(self.steps):
            opt.zero_grad(set_to_none=True)
            x = pixels(var)
            match = self._matching(model, params, targets, target_norms, total_norm, x, labels, True)
            tv = total_variation(x)
            objective = match + self.tv_weight * tv
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
        x = pixels(var).detach()
        with torch.enable_grad():
            final = float(self._matching(model, params, targets, target_norms, total_norm, x, labels, False))
        history.append([self.steps, final])
        if self.progress is not None:
            self.progress({"restart": restart, "step": self.steps, "steps": self.steps, "matching_loss": final,
                           "tv": float(total_variation(x)), "lr": 0.0})
        if not math.isfinite(final):
            final = float("inf")
        return {"x": x, "initial_matching_loss": initial, "final_matching_loss": final, "history": history}
