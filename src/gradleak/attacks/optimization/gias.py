"""GIAS — gradient inversion with a generative image prior (Jeon, Kim, Lee, Oh, Ok, *Gradient Inversion with
Generative Image Prior*, NeurIPS 2021), the generative attack of paper 001 (Sec. 3.5, eq. 8; "GIAS" / "GIAS + Ours"),
on the gradient-matching machinery of :mod:`gradleak.attacks.optimization.inverting_gradients`.

Two stages per restart, the restarts optimised together as the GLR group (:mod:`.glr`):

1. **latent search** (``latent_steps``, paper scale 2000): the generator G frozen, optimise z with x = G(z),
   minimising L_match(x) + α_TV · TV(x) + λ_G ‖x − E‖²;
2. **generator fine-tuning** (``generator_steps``, paper scale 8000): z fixed at its stage-1 value, optimise G's
   weights ω (a copy per image and restart) with a small learning rate — the image may leave the generator's range
   but stays near its manifold — on the same objective.

L_match is IG's 1 − cos over head + PEFT (+ ``anchor_weight`` · the PE cosine of eq. 7 with ``anchor: true``), which
paper 001 eq. 7 prescribes for every method; labels, batch size, the anchor checks, eager attention and the
iteration-cost timing (``timings.iteration_to_fwdbwd_ratio``) are IG's.

**Generator** (``attack.generator``): a safetensors file written by ``gradleak train-generator`` (DCGAN,
:func:`gradleak.models.generator.load_generator`), or ``"faces"`` for the pretrained 64×64 face DCGAN
(:func:`~gradleak.models.generator.face_generator`). Its channels must be the data's; its side S may differ from the
data's H only by an integer factor: S = k·H → average pooling k×k (the exact area downsampling), H = k·S → bilinear
upsampling ×k; anything else is refused (``BadInput`` naming ``attack.generator``), in ``prepare`` (from the model's
config) and in ``reconstruct`` (from the image shape). The generator is trained on public data
(paper 001 §3: "similar but non-overlapping"), so the attack requires ``threat.public_data``; the generator file's
own metadata (its training data) is copied into ``info["generator"]`` for the reader to check disjointness.

Decisions the papers leave open (open point A2.5, docs/PAPERS.md — the GIAS code's choices unless said otherwise):

* Adam for both stages, plain (not signed) gradients; latent lr 3e-2, generator lr 1e-3; step decay ×0.1 at 3/8, 5/8,
  7/8 of each stage (``schedule: step``; ``cosine`` decays to 0 instead); 3 restarts; TV weight 1e-6.
* z ~ N(0, I) per restart (a realistic starting image, seeded by ``seed`` and the restart), no latent regulariser.
* The generator runs in eval mode (BatchNorm on its training statistics: an image does not depend on the others in the
  batch); stage 2 fine-tunes every weight incl. BatchNorm's affine parameters, not the running statistics. No explicit
  penalty keeps ω near ω₀ (the small lr and the iteration count do, as in the GIAS code).
* ``stage2_restarts: all`` (default) fine-tunes a generator copy for every restart still running, so GLR acts in both
  stages; ``best`` keeps only the restart with the lowest stage-1 matching loss (the GIAS code's choice; GLR is then
  idle in stage 2). The returned image is the restart with the lowest final matching loss (priors excluded);
  ``data["stage1_images"]`` holds the best stage-1 image for comparison.
* GLR per stage: consensus rebuilt every ``glr_every`` steps from ``glr_start`` (default a quarter of the stage: 500 of
  2000 as in the GIAS code) on; λ_G = 1e-4 (paper 001).
* Iterations: the defaults are paper 001's (2000 + 8000, given for CelebA/CARS); they are far beyond CPU scale —
  override ``latent_steps`` / ``generator_steps``, or set the experiment's ``scale: cpu`` (300 + 100, ours).
* FedAvg: ``emulate: local_steps`` simulates the client's local steps on the generated images (IG's, see
  :mod:`gradleak.attacks.optimization.inverting_gradients`).
* NaN/inf: a restart whose objective is not finite stops (``info["diverged"]``, stage and step), leaves the group and
  scores +inf; a restart that diverged in stage 1 is not fine-tuned.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any, Literal, Optional, Sequence

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from gradleak.attacks.base import AttackConfig, AttackContext
from gradleak.attacks.common.parameters import attack_parameters
from gradleak.attacks.optimization.glr import GroupLazyRegularizer, GroupMember, optimise_group, step_decay_milestones
from gradleak.attacks.optimization.gradvit import GLRFields, GroupInversion, glr_start_of
from gradleak.attacks.optimization.matching_config import CPU_STEPS, LabelMode, MatchingFields, ProgressFn
from gradleak.attacks.optimization.objective import total_variation
from gradleak.errors import BadInput
from gradleak.fl.core import LossFn, ServerView, default_classification_loss
from gradleak.registry import ATTACKS

FIELD = "attack.generator"
PAPER_LATENT_STEPS = 2000
PAPER_GENERATOR_STEPS = 8000
CPU_GENERATOR_STEPS = 100


class GIASConfig(GLRFields, MatchingFields):
    generator: str = Field("faces", min_length=1, description="safetensors file of `gradleak train-generator`, or 'faces' "
                           "(the pretrained 64×64 face DCGAN, the default: the one generator that ships offline)")
    latent_steps: int = Field(PAPER_LATENT_STEPS, ge=0, le=10_000_000, description="stage 1: Adam steps on z, "
                              "generator frozen (paper: 2000)")
    generator_steps: int = Field(PAPER_GENERATOR_STEPS, ge=0, le=10_000_000, description="stage 2: Adam steps on the "
                                 "generator's weights, z fixed (paper: 8000)")
    latent_lr: float = Field(3e-2, gt=0, le=100, description="stage-1 learning rate (GIAS code: 3e-2)")
    generator_lr: float = Field(1e-3, gt=0, le=10, description="stage-2 learning rate (GIAS code: 1e-3)")
    schedule: Literal["step", "cosine"] = Field("step", description="per stage: ×0.1 at 3/8, 5/8, 7/8 (step) or "
                                                "cosine decay to 0")
    stage2_restarts: Literal["all", "best"] = Field("all", description="fine-tune every running restart's generator "
                                                    "(GLR in both stages) or only the best stage-1 restart's")
    tv_weight: float = Field(1e-6, ge=0, description="total-variation weight (GIAS code: 1e-6)")
    restarts: int = Field(3, ge=1, le=1000, description="restarts optimised together (the GLR group)")
    labels: LabelMode = Field("auto", description="known, idlg (from the head gradient) or auto (granted labels if "
                              "granted, else from the head gradient)")
    signed: bool = Field(False, description="Adam on the sign of the gradient (GIAS: plain gradient)")


def resolve_generator(spec: Any) -> tuple[nn.Module, str]:
    """The generator named by ``attack.generator`` (a path, ``"faces"``, or a module) and a description."""
    if isinstance(spec, nn.Module):
        return spec, f"module {type(spec).__name__}"
    if not isinstance(spec, str) or not spec:
        raise BadInput(FIELD, f"expected a generator file path or 'faces', got {spec!r}.",
                       "train one with `gradleak train-generator --out FILE.safetensors` and give its path.")
    from gradleak.models.generator import face_generator, load_generator

    if spec == "faces":
        return face_generator(), "faces (gan-face-generate 64×64 DCGAN)"
    return load_generator(spec), spec


def generator_fit(gen: nn.Module, channels: int, height: int, width: int) -> tuple[str, int]:
    """How the generator's S×S images become the data's H×W: ``("identity", 1)``, ``("avgpool", k)`` for S = k·H or
    ``("bilinear", k)`` for H = k·S; refuses other sizes and other channel counts (``BadInput`` attack.generator)."""
    s, c = int(getattr(gen, "image_size")), int(getattr(gen, "channels"))
    if c != channels:
        raise BadInput(FIELD, f"the generator makes {c}-channel images but the data have {channels} channel(s).",
                       f"train a generator with `gradleak train-generator --channels {channels}`.")
    if height != width:
        raise BadInput(FIELD, f"the generator makes square images but the data are {height}×{width}.",
                       "use square images (data.image_size).")
    if s == height:
        return "identity", 1
    if s > height and s % height == 0:
        return "avgpool", s // height
    if height > s and height % s == 0:
        return "bilinear", height // s
    raise BadInput(FIELD, f"the generator makes {s}×{s} images and the data are {height}×{width}: the sizes differ by "
                   "a non-integer factor, so its images cannot be resized exactly.",
                   f"train a generator for {height}×{height} images (`gradleak train-generator --image-size ...`), "
                   "or pick data.image_size an integer factor from the generator's side.")


def resize_generated(x: torch.Tensor, fit: tuple[str, int]) -> torch.Tensor:
    mode, k = fit
    if mode == "avgpool":
        return F.avg_pool2d(x, k)
    if mode == "bilinear":
        return F.interpolate(x, scale_factor=k, mode="bilinear", align_corners=False)
    return x


@ATTACKS.register("gias", "GIAS: latent search then generator fine-tuning on a DCGAN prior, 1 − cos matching + GLR; "
                  "anchor as ig (Jeon et al. 2021)")
class GIAS(GroupInversion):
    """GIAS with the spatial anchor option (module docstring). ``generator``: a path, ``"faces"`` or an
    ``nn.Module`` with ``latent_dim``, ``image_size``, ``channels`` (tests)."""

    name = "gias"
    Config = GIASConfig
    #: ``scale: paper`` = paper 001 Supp. D (2000 + 8000, 3 restarts); ``cpu`` = ours: IG's CPU budget for the latent
    #: search plus 100 generator steps
    scales = {"cpu": {"latent_steps": CPU_STEPS, "generator_steps": CPU_GENERATOR_STEPS, "restarts": 3},
              "paper": {"latent_steps": PAPER_LATENT_STEPS, "generator_steps": PAPER_GENERATOR_STEPS, "restarts": 3}}

    @classmethod
    def requires(cls, cfg=None) -> dict[str, bool]:
        if cfg is None:  # the defaults (the generator has none: it does not change the requirements)
            cfg = cls.Config.model_construct(generator="")
        req = super().requires(cfg)
        req["public_data"] = True  # the generative prior is trained on public data (paper 001 §3)
        return req

    @classmethod
    def from_config(cls, cfg: AttackConfig, ctx: AttackContext) -> "GIAS":
        return cls(config=cfg, seed=ctx.seed, fl=dict(ctx.fl))

    def __init__(self, generator: str | nn.Module | None = None, *, config: Optional[GIASConfig] = None, seed: int = 0,
                 image_shape: Sequence[int] | None = None, progress: ProgressFn | None = None,
                 loss_fn: LossFn = default_classification_loss, fl: Optional[dict[str, Any]] = None, **params: Any):
        """``generator``: a path or ``"faces"`` (the config's ``generator``), or an ``nn.Module``; ``config`` /
        ``params``: the attack's parameters as for IG; the rest is provided by the run (as for IG)."""
        module = generator if isinstance(generator, nn.Module) else None
        if generator is not None and module is None:
            params["generator"] = generator
        cfg = attack_parameters(self.Config, config, params)
        if cfg.latent_steps + cfg.generator_steps < 1:
            raise BadInput("attack.latent_steps", "both stages have 0 steps.", "give at least one step.")
        self.config = cfg
        self._set_matching(cfg, seed=seed, image_shape=image_shape, progress=progress, loss_fn=loss_fn, fl=fl)
        # the budget of the two stages together (IG's progress period); the box constraint does not apply (the
        # generator's tanh bounds the pixels)
        self._set_optimiser(steps=cfg.latent_steps + cfg.generator_steps, lr=cfg.latent_lr, tv_weight=cfg.tv_weight,
                            restarts=cfg.restarts, box="generator", log_every=cfg.log_every)
        self.latent_steps, self.generator_steps = cfg.latent_steps, cfg.generator_steps
        self.latent_lr, self.generator_lr = cfg.latent_lr, cfg.generator_lr
        self.schedule, self.stage2_restarts = cfg.schedule, cfg.stage2_restarts
        self.glr_weight, self.glr_every, self.glr_start, self.glr_norm = (cfg.glr_weight, cfg.glr_every, cfg.glr_start,
                                                                          cfg.glr_norm)
        gen, self.generator_source = resolve_generator(module if module is not None else cfg.generator)
        for attr in ("latent_dim", "image_size", "channels"):
            if not isinstance(getattr(gen, attr, None), int):
                raise BadInput(FIELD, f"the generator has no integer attribute '{attr}'.",
                               "use gradleak.models.generator.DCGANGenerator (load_generator / face_generator).")
        self.generator = gen.eval()
        for p in self.generator.parameters():
            p.requires_grad_(False)

    # ------------------------------------------------------------------ protocol
    def prepare(self, model: nn.Module, threat) -> nn.Module:
        """IG's anchor check, then the generator against the model's input (channels, size) before any round."""
        model = super().prepare(model, threat)
        for m in [model, *model.modules()]:
            cfg = getattr(m, "config", None)
            size, ch = getattr(cfg, "image_size", None), getattr(cfg, "num_channels", None)
            if size is not None and ch is not None:
                h, w = (size, size) if isinstance(size, int) else tuple(size)
                generator_fit(self.generator, int(ch), int(h), int(w))
                break
        return model

    # ------------------------------------------------------------------ stages
    def _scheduler(self, opt, steps: int):
        if steps < 1:
            return None
        if self.schedule == "cosine":
            return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps, eta_min=0.0)
        return torch.optim.lr_scheduler.MultiStepLR(opt, milestones=step_decay_milestones(steps), gamma=0.1)

    def _terms(self, st, x):
        match, main, pe = self.matching_terms(st.model, st.params, st.targets, st.groups, st.norms, x, st.labels, True)
        return self._combine(x, match, main, pe)

    def _terms_batch(self, st, xs):
        """:meth:`_terms` of every running restart's images, the matching terms through one double backward
        (:meth:`matching_terms_batch`)."""
        matches = self.matching_terms_batch(st.model, st.params, st.targets, st.groups, st.norms, xs, st.labels, True,
                                            names=st.names)
        return [self._combine(x, *m) for x, m in zip(xs, matches)]

    def _combine(self, x, match, main, pe):
        parts = {"main": main}
        if pe is not None:
            parts["pe"] = pe
        total = match
        if self.tv_weight > 0:
            parts["tv"] = total_variation(x)
            total = total + self.tv_weight * parts["tv"]
        return total, match, parts

    def _latent_member(self, r: int, st, gen: nn.Module, fit) -> GroupMember:
        g = torch.Generator().manual_seed(self.seed * 1000 + r)
        z = torch.randn((st.batch_size, gen.latent_dim), generator=g, dtype=torch.float32).to(st.device, st.dtype)
        z.requires_grad_(True)
        opt = torch.optim.Adam([z], lr=self.latent_lr)
        m = GroupMember(r, [z], lambda: resize_generated(gen(z), fit), opt, self._scheduler(opt, self.latent_steps))
        m.z = z  # type: ignore[attr-defined]
        return m

    def _generator_member(self, m1: GroupMember, st, gen: nn.Module, fit) -> GroupMember:
        z = m1.z.detach()  # type: ignore[attr-defined]
        copies = [copy.deepcopy(gen) for _ in range(len(z))]  # one generator per image (GIAS code)
        params = []
        for c in copies:
            for p in c.parameters():
                p.requires_grad_(True)
                params.append(p)

        def image():
            return resize_generated(torch.cat([c(z[i:i + 1]) for i, c in enumerate(copies)]), fit)

        opt = torch.optim.Adam(params, lr=self.generator_lr)
        m = GroupMember(m1.index, params, image, opt, self._scheduler(opt, self.generator_steps))
        m.z, m.history, m.initial_matching_loss = z, m1.history, None  # type: ignore[attr-defined]
        return m

    def reconstruct(self, view: ServerView):
        t0 = time.perf_counter()
        st = self._setup(view, self.time_fwdbwd)
        C, H, W = st.shape
        fit = generator_fit(self.generator, C, H, W)
        gen = copy.deepcopy(self.generator).to(st.device, st.dtype).eval()
        objective = lambda x: self._terms(st, x)  # noqa: E731
        batch_objective = lambda xs: self._terms_batch(st, xs)  # noqa: E731
        # ---- stage 1: latent search, generator frozen
        members = [self._latent_member(r, st, gen, fit) for r in range(self.restarts)]
        glr1 = GroupLazyRegularizer(self.glr_weight, self.glr_every, glr_start_of(self.glr_start, self.latent_steps),
                                    self.glr_norm)
        t1: list[float] = []
        optimise_group(members, self.latent_steps, objective, glr1, signed=self.signed, step_seconds=t1,
                       probe=st.fb_probe, probe_samples=st.fb_samples, log_every=self.log_every,
                       progress=self.progress, stage="latent", batch_objective=batch_objective)
        stage1 = [self._final(st, m, record=False) for m in members]
        best1 = min(range(len(stage1)), key=lambda i: stage1[i]["final_matching_loss"])
        # ---- stage 2: generator fine-tuning from the stage-1 latents
        t2: list[float] = []
        glr2 = GroupLazyRegularizer(self.glr_weight, self.glr_every,
                                    glr_start_of(self.glr_start, self.generator_steps), self.glr_norm)
        chosen: list[int] = []
        if self.generator_steps > 0:
            chosen = [i for i, m in enumerate(members) if m.diverged_at is None
                      and (self.stage2_restarts == "all" or i == best1)]
            stage2 = {i: self._generator_member(members[i], st, gen, fit) for i in chosen}
            optimise_group(list(stage2.values()), self.generator_steps, objective, glr2, signed=self.signed,
                           step_seconds=t2, probe=st.fb_probe, probe_samples=st.fb_samples, log_every=self.log_every,
                           progress=self.progress, stage="generator", step_offset=self.latent_steps,
                           batch_objective=batch_objective)
            for i, m2 in stage2.items():
                m2.initial_matching_loss = members[i].initial_matching_loss
                members[i] = m2
            for i, m in enumerate(members):
                if i not in stage2 and m.diverged_at is None:
                    m.active = False  # not fine-tuned (stage2_restarts: best): its stage-1 result still competes
        finals = [self._final(st, m) for m in members]
        stage1_images = ((stage1[best1]["x"] + 1.0) / 2.0).clamp(0.0, 1.0)
        diverged_stage = {m.index: ("latent" if m.diverged_at < self.latent_steps else "generator")
                          for m in members if m.diverged_at is not None}
        extra = {
            "latent_steps": self.latent_steps, "generator_steps": self.generator_steps, "latent_lr": self.latent_lr,
            "generator_lr": self.generator_lr, "schedule": self.schedule, "stage2_restarts": self.stage2_restarts,
            "generator": {"source": self.generator_source, "latent_dim": int(gen.latent_dim),
                          "image_size": int(gen.image_size), "channels": int(gen.channels),
                          "resize": f"{fit[0]}x{fit[1]}" if fit[0] != "identity" else "none",
                          "metadata": getattr(self.generator, "metadata", None)},
            "stage1_final_losses": [f["final_matching_loss"] for f in stage1], "stage1_best_restart": best1,
            "stage1_final_matching_loss": stage1[best1]["final_matching_loss"],
            "fine_tuned_restarts": chosen,
            "diverged_stage": diverged_stage,
            "glr_stage2": {"start": glr2.start, "refreshed_at": glr2.refreshed_at},
        }
        med = lambda v: float(statistics.median(v)) if v else float("nan")  # noqa: E731
        timings = {"latent_iteration_seconds": med(t1), "generator_iteration_seconds": med(t2)}
        return self._result(t0, st, members, finals, glr1, t1 + t2, extra, data_extra={"stage1_images": stage1_images},
                            timings_extra=timings)


__all__ = ["GIAS", "GIASConfig", "generator_fit", "resize_generated", "resolve_generator"]
