"""Optimisation-based gradient inversion by an honest server: Inverting Gradients (IG), DLG, APRIL, and the
positional-embedding anchor of paper 001 (eq. 7).

Geiping, Bauermeister, Dröge, Moeller, *Inverting Gradients — How easy is it to break privacy in
federated learning?*, NeurIPS 2020, §4 (eq. 4): starting from random dummy images ``x``, minimise

    1 − cos(∇_θ L(f_θ(x), y), Δ)  +  α_TV · TV(x)        subject to x ∈ [−1, 1]^{B×C×H×W},

with Adam on the *signed* gradient of the objective, ``Δ`` the observed update and ``TV`` the
anisotropic total variation (mean |horizontal| + mean |vertical| pixel differences). This is the
baseline PEFTLeak runs against adapter-tuned ViTs (PEFTLeak Sec. 5 and App. C.2, Figs 8, 10, 11: it "fails to
reconstruct any of the images in the batch"): the gradient is taken **only** over the parameters the client uploads
(adapters + classification head), on the honest model the server sent.

Registered names: ``inverting_gradients`` (the original entry, ``labels: known`` by default) and ``ig`` (the same
attack under paper 001's contract name, ``labels: auto``); ``dlg`` (Euclidean matching, :class:`DLG`); ``april``
(Euclidean matching + PE cosine, :class:`April`). GradViT and GIAS (image priors, generators) are the sibling
modules :mod:`~gradleak.attacks.optimization.gradvit` and :mod:`~gradleak.attacks.optimization.gias`.

**Spatial anchoring (paper 001 §3.5, eq. 7).** On a model with the server-prescribed layer-wise PEs
(``peft.layer_pe: true``, :mod:`gradleak.peft.layer_pe`), the update holds the gradients of the input position table
and of every p_l. The objective becomes

    L_match = d(∇_{θ'} L, g_{θ'})  +  w · d_cos(∇_{θ_PE} L, g_PE),     θ' = head + PEFT (LoRA / adapters),

with d the attack's own distance (IG: 1 − cos, DLG/APRIL: relative squared error) and ``w = anchor_weight`` (eq. 7
says 1; the authors' fork uses 0.1). ``anchor: true`` needs trainable layer-wise PEs: refused at config time
(``check_peft``), in ``prepare`` (on the model) and in ``reconstruct`` (on the update), each with ``BadInput``
naming ``attack.anchor``; it also requires ``threat.prescribes_architecture``.

Decisions the papers leave open, recorded here:

* **The PE gradients without the anchor.** With ``anchor: false`` (IG, DLG) on the prescribed architecture (the update
  holds layer-wise PEs) the PE tensors — the p_l and the input table that ``peft.layer_pe`` made trainable — are
  *not* matched (listed in ``info["unmatched_parameters"]``): the attack is then the paper's baseline, which matches
  head + LoRA only. With the default zero-initialised p_l the head/LoRA gradients equal those of the model without
  layer-wise PEs, so "IG" vs "IG + anchor" on one client update isolates the eq. 7 term exactly. Without layer-wise
  PEs an input table the client trains anyway (full fine-tuning) is matched with θ', as IG always did.
* **d_cos form** (open point A2.4, docs/PAPERS.md): 1 − cos (IG's form; eq. 7's "negative cosine" differs by a constant), one cosine over
  the concatenation of the PE tensors (``similarity="global"``) or the mean over tensors (``"per_parameter"``),
  as for θ'; the two groups are normalised separately (two cosines, as eq. 7 writes them).
* **Iteration cost.** ``timings.iteration_to_fwdbwd_ratio`` = the median wall time of one optimisation step (forward,
  gradient with ``create_graph``, double backward, Adam; the first step excluded) over the median wall time of one
  forward + backward of the sent model (the client's step: gradients of the uploaded parameters) on a batch of the
  client's size — 5 of them after a warm-up, plus ~10 spread over each restart, so both medians span the same
  machine load (on this loaded 2-core box a single up-front measurement gave ratios from 1.7 to 3.5 for the same
  attack). Unmatched PE parameters get no gradient.
* **Diverging restarts.** A restart whose objective becomes NaN/inf stops there (``info["diverged"]``, a warning);
  it scores +inf, so any finite restart wins.
* **Restarts batched** (docs/PERFORMANCE.md "Batched restarts";
  GradViT's and GIAS's group loop, :meth:`InvertingGradients.matching_terms_batch`).
  The restarts optimised together run through *one* forward and one double backward per step, their images stacked
  along the batch. Restart r's parameter gradients are recovered exactly from that pass: every matched tensor is the
  weight or bias of an ``nn.Linear`` (adapters, LoRA factors, the head), whose per-sample gradient is Σ δᵀ x over
  restart r's rows (δ the gradient at the layer's output, x its input, as Opacus' grad samplers). Each restart keeps
  its own image, Adam state, schedule, GLR term, history and divergence check, so it takes the step it would take
  alone, up to floating-point summation order (measured equal to 1e-10 relative in float64, tests/test_batched_restarts.py).
  It is used only where that is exact (:meth:`InvertingGradients._restart_batch_plan`: the default mean cross-entropy,
  ``emulate: single_step``, no BatchNorm on batch statistics, only ``nn.Linear`` tensors matched); otherwise (e.g. the
  layer-wise PEs of the anchor term) the restarts run one after another as before. ``info["restarts_batched"]`` says
  which. The step's wall time is then shared by its restarts: ``timings.iteration_seconds`` is the batched step's
  median wall time divided by the restarts in it (the cost of one restart's step). torch.func (``vmap`` over
  ``grad`` of ``functional_call``) gives the same gradients but was measured slower here (0.36 s vs 0.27 s for three
  restarts of the vit_adapters audit's ViT-S step on one CPU thread).

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
  ``labels="idlg"`` (:mod:`gradleak.attacks.optimization.labels`): inferred from the gradient of the
  classification-head bias (iDLG, Zhao et al.
  2020): with the mean cross-entropy, ``∂L/∂b_c = mean_i p_ic − n_c / B``. For B = 1 the unique negative
  entry is the label (exact). For B > 1 we assign labels greedily: repeatedly take the most negative
  residual entry and add ``1/B`` to it (exact when every predicted probability is below ``1/B``, which
  holds for an untrained head). The head bias is the last 1-D tensor in the update whose length equals
  the number of logits (or ``label_param``). Without a head bias but with the head weight, at B = 1 the label is
  the one row of ``∂L/∂W = (p − y) h̄ᵀ`` whose sign (along the largest row) differs from the others (exact; ≥ 3
  classes). Otherwise ``"idlg"`` is refused. ``labels="auto"``: the granted labels if the threat model grants
  them, else ``"idlg"`` (paper 001 §3.5: labels "known or recovered from the last-layer gradients").
* **Batch size.** ``view.public["batch_size"]`` if granted, else the ``num_samples`` the update carries
  (the server sees it for FedAvg weighting); recorded in ``info["batch_size_source"]``.
* **Loss.** The training loss is public protocol: the default is the mean cross-entropy the
  :class:`~gradleak.fl.core.Client` uses; pass ``loss_fn`` for another.
* **FedAvg: the server emulating one step or the client's steps** (``emulate``; paper 001 Supp. M, "(s)" vs
  "(m)"). A FedAvg client uploads the pseudo-gradient ``(θ_0 − θ_K)/lr = Σ_k g_k`` of its K local SGD steps
  (:meth:`gradleak.fl.core.Client.local_update`, ``Update.kind == "pseudo_gradient"``). ``single_step`` (default,
  the paper's baseline "(s)") matches it as if it were one gradient of the whole batch at θ_0 (an approximation
  for K > 1). ``local_steps`` ("(m)") simulates the client's K steps on the dummy images, differentiably
  (:func:`gradleak.attacks.common.simulation.simulate_local_training`: every step's gradient stays in the autograd
  graph), from the public training configuration (the attack's ``fl``: the client's ``client_batch_sizes`` /
  ``client_epochs`` entry, else ``local_batch_size`` / ``local_epochs``, and the round's ``lr_at``;
  :func:`gradleak.attacks.common.simulation.client_training_config`), and matches the *simulated* pseudo-gradient Σ_k ĝ_k
  — θ' and, with the anchor, the PE tensors alike (every tensor of the update is trained in the simulation, the
  unmatched PEs included, since they move the later steps). **Client-shuffle assumption:** the client shuffles
  with a private seed; the simulation takes consecutive batches of the dummies (``local_schedule``). The dummies
  are exchangeable, so epoch 1's order is without loss of generality *for the images*; it is not for the labels
  they are paired with: dummy i carries label i (granted order or the head-gradient inference's order), so which
  labels share a step is a guess — exact when every step's label multiset is the client's (e.g. all labels equal,
  or one step per epoch). Epochs > 1 re-use epoch 1's order (the client's later permutations are
  unknown: an approximation). ``local_steps`` is refused (``BadInput`` naming ``attack.emulate``) under FedSGD
  (at config time, and on an update of kind ``gradient``), under secure aggregation (the aggregate is no single
  client's trajectory), and when the configuration's step count differs from the update's ``local_steps``. The
  simulation runs the model in its own mode (as the client's copy) with the attack's ``loss_fn``.
* **Attention.** Second derivatives need eager attention (SDPA has no double backward): on the copy
  of the model, any ``config._attn_implementation`` other than ``"eager"`` is switched to ``"eager"``; a float64
  model gets ``"eager_precise"`` (:mod:`gradleak.models.attention`), since HF's eager softmax runs in float32.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from types import SimpleNamespace
from typing import Any, Callable, ClassVar, Literal, Optional, Sequence

import torch
from pydantic import Field
from torch import nn

from gradleak.attacks.base import AttackBase, AttackConfig, AttackContext, Reconstruction, ThreatModel
from gradleak.attacks.common.parameters import attack_parameters
from gradleak.attacks.common.simulation import (client_training_config, local_schedule, output_logits,
                                                simulate_local_training)
from gradleak.attacks.optimization.labels import recover_labels_from_head
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


def _force_eager_attention(model: nn.Module) -> bool:
    """Eager attention on the attack's copy (SDPA has no double backward). A float64 model gets ``eager_precise``
    (:mod:`gradleak.models.attention`): HF's eager softmax runs in float32 even in float64 models, which would cap
    the float64 objective's precision at ~1e-7."""
    p0 = next(model.parameters(), None)
    if p0 is not None and p0.dtype == torch.float64 and any(
            getattr(getattr(m, "config", None), "_attn_implementation", None) is not None for m in model.modules()):
        from gradleak.models.attention import use_precise_eager

        return use_precise_eager(model)
    switched = False
    for m in model.modules():
        cfg = getattr(m, "config", None)
        impl = getattr(cfg, "_attn_implementation", None) if cfg is not None else None
        if impl not in (None, "eager", "eager_precise"):
            try:
                cfg._attn_implementation = "eager"
                switched = True
            except Exception:  # pragma: no cover - exotic configs
                pass
    return switched


LabelMode = Literal["known", "idlg", "auto"]
EmulateMode = Literal["single_step", "local_steps"]


class MatchingFields(AttackConfig):
    """The gradient-matching parameters every optimisation attack here shares (ig, dlg, april, gradvit, gias)."""

    labels: LabelMode = Field("known", description="known (granted by the threat model), idlg (from the head gradient) "
                              "or auto (granted if granted, else from the head gradient)")
    signed: bool = Field(True, description="Adam on the sign of the gradient (IG)")
    similarity: Literal["global", "per_parameter"] = Field("global", description="one cosine over all tensors, or the mean per tensor")
    client_index: int = Field(0, ge=0, description="which observed update to attack")
    label_param: Optional[str] = Field(None, description="name of the head bias (idlg); default: detected")
    log_every: Optional[int] = Field(None, ge=1, description="progress every N steps")
    anchor: bool = Field(False, description="add the cosine term on the gradients of all positional embeddings "
                         "(paper 001 eq. 7; needs peft.layer_pe=true)")
    anchor_weight: float = Field(1.0, ge=0, le=1e6, description="weight of the PE-gradient cosine term (eq. 7: 1; "
                                 "the authors' fork: 0.1)")
    time_fwdbwd: bool = Field(True, description="time one forward+backward of the sent model for "
                              "timings.iteration_to_fwdbwd_ratio")
    emulate: EmulateMode = Field("single_step", description="FedAvg: match the pseudo-gradient as one gradient "
                                 "(single_step) or simulate the client's K local SGD steps (local_steps; paper 001 "
                                 "Supp. M)")
    noise_model: Literal["off", "declared"] = Field(
        "off", description="declared: attack the upload as the declared defenses make it (gradleak.defenses.declared): "
        "match by the Gaussian likelihood of the declared noise -- the squared error, the maximum-likelihood "
        "distance under isotropic per-coordinate noise (whitening by its std is a constant factor) -- instead of the "
        "attack's own distance, and simulate the declared clipping (the simulated gradient scaled to min(1, C / its "
        "norm); DP-SGD's per-sample bound, exact for B = 1)")


class InvertingGradientsConfig(MatchingFields):
    steps: int = Field(2000, ge=1, le=10_000_000, description="Adam steps per restart")
    lr: float = Field(0.1, gt=0, le=100, description="initial step size (cosine-decayed to 0)")
    tv_weight: float = Field(1e-4, ge=0, description="total-variation weight α_TV")
    restarts: int = Field(1, ge=1, le=1000, description="independent trials; the best final matching loss wins")
    box: Literal["clamp", "tanh"] = Field("clamp", description="box constraint on the pixels")


CPU_STEPS = 300  # the CPU-scale default of ig / dlg / april (our CPU budget: a few hundred iterations; set attack.steps)
#: paper scale (``scale: paper``) of ig / dlg / april / gradvit: paper 001 gives iterations only for GIAS (2000 latent
#: + 8000 generator steps, Supp. D); the optimisation baselines get GIAS's stage-1 budget, 2000 steps per restart
#: (also the registered ``inverting_gradients``' default)
PAPER_STEPS = 2000


class IGConfig(InvertingGradientsConfig):
    steps: int = Field(CPU_STEPS, ge=1, le=10_000_000, description="Adam steps per restart (default: CPU scale)")
    labels: LabelMode = Field("auto", description="known, idlg (from the head gradient) or auto (granted labels if "
                              "granted, else from the head gradient)")


class DLGConfig(InvertingGradientsConfig):
    steps: int = Field(CPU_STEPS, ge=1, le=10_000_000, description="Adam steps per restart (default: CPU scale)")
    tv_weight: float = Field(0.0, ge=0, description="total-variation weight (DLG has none)")
    signed: bool = Field(False, description="Adam on the sign of the gradient (DLG: plain gradient)")
    labels: LabelMode = Field("auto", description="known, idlg (from the head gradient) or auto")


class AprilConfig(DLGConfig):
    pass


@ATTACKS.register("inverting_gradients",
                  "honest-server optimisation attack: 1 − cos gradient matching + TV (Geiping et al. 2020)")
class InvertingGradients(AttackBase):
    """Inverting Gradients (Geiping et al. 2020) on whatever parameters the observed update holds.

    Parameters: the fields of ``Config`` (their defaults and constraints live there only): ``steps`` Adam steps
    per restart; ``lr`` initial step size (cosine-decayed to 0); ``tv_weight`` α_TV; ``restarts`` independent trials
    (best final matching loss wins); ``labels`` ``"known"`` (from ``view.public["labels"]``), ``"idlg"`` (from the
    head gradient) or ``"auto"``; ``signed`` use the sign of the gradient (IG); ``box`` ``"clamp"`` or ``"tanh"``;
    ``similarity`` ``"global"`` or ``"per_parameter"``; ``client_index`` which update of the view to attack;
    ``label_param`` name of the head bias; ``log_every`` progress period; ``anchor`` / ``anchor_weight`` the
    PE-gradient cosine term of paper 001 eq. 7; ``time_fwdbwd`` time one forward + backward for
    ``iteration_to_fwdbwd_ratio``; ``emulate`` the FedAvg emulation.

    Provided by the run, not configuration: ``seed``; ``image_shape`` (C, H, W) of one image (default:
    ``view.public["image_shape"]``, else the model config's ``num_channels``/``image_size``); ``progress`` a callable
    receiving a dict (``restart``, ``step``, ``steps``, ``matching_loss``, ``tv``, ``lr``) every ``log_every``
    steps; ``loss_fn`` the training loss; ``fl`` the public training configuration (``emulate: local_steps``).
    """

    name = "inverting_gradients"
    Config = InvertingGradientsConfig
    modality = "image"
    reconstruction = "images"
    #: distance of the head/PEFT gradients: "cosine" (IG) or "l2" (DLG, APRIL; relative squared error)
    distance: ClassVar[str] = "cosine"
    #: APRIL matches the input-PE gradient by cosine even without the anchor (its own positional term)
    input_pe_term: ClassVar[bool] = False
    #: ``scale:`` (experiment config) -> the attack parameters it sets unless the config sets them
    scales: ClassVar[dict[str, dict[str, Any]]] = {"cpu": {"steps": CPU_STEPS}, "paper": {"steps": PAPER_STEPS}}

    @classmethod
    def audit_variants(cls, params, defenses):
        """Under a declared defense that adds noise or clips, the audit also matches by the declared noise's
        likelihood with the declared clipping simulated (``noise_model: declared``): the attacker who knows the
        mechanism, beside the one who does not."""
        from gradleak.defenses.declared import as_declared

        d = as_declared(defenses)
        clips = d.clip_norm or d.per_sample_clip_norm
        if params.get("noise_model", "off") == "declared":
            return []
        if getattr(cls, "distance", None) == "l2" and not clips:
            # the squared error is already the declared noise's likelihood and there is no clip to simulate: the
            # variant would be this run again, step for step (DLG, APRIL)
            return []
        if d.adds_noise or d.noise_unknown or clips:
            return [{"noise_model": "declared"}]
        return []

    @classmethod
    def check_fl(cls, cfg, fl) -> None:
        """Config-time check of the FL protocol: ``emulate: local_steps`` simulates FedAvg's local steps."""
        if cfg.emulate != "local_steps":
            return
        if fl.algorithm != "fedavg":
            raise _emulate_needs_fedavg(fl.algorithm)
        if fl.secure_aggregation:
            raise _emulate_no_secagg()

    @classmethod
    def requires(cls, cfg=None) -> dict[str, bool]:
        cfg = cfg if cfg is not None else cls.Config()
        req = {"knows_batch_size": True, "knows_labels": cfg.labels == "known"}
        if cfg.anchor:
            req["prescribes_architecture"] = True  # the layer-wise PEs are the server's architecture (paper 001 §3.4)
        return req

    @classmethod
    def check_peft(cls, cfg, peft) -> None:
        """Config-time check (before any model loads): ``anchor`` needs the layer-wise PEs (``peft.layer_pe``)."""
        if cfg.anchor and not getattr(peft, "layer_pe", False):
            raise BadInput("attack.anchor", "is true, but the architecture has no trainable layer-wise positional "
                           "embeddings, so there are no PE gradients to anchor on (paper 001 eq. 7).",
                           "set peft.layer_pe=true (with peft.kind=lora or none and threat.preset=prescribes-architecture),"
                           " or attack.anchor=false.")

    @classmethod
    def from_config(cls, cfg: AttackConfig, ctx: AttackContext) -> "InvertingGradients":
        return cls(config=cfg, seed=ctx.seed, fl=dict(ctx.fl))

    def __init__(self, config: Optional[MatchingFields] = None, *, seed: int = 0,
                 image_shape: Sequence[int] | None = None, progress: ProgressFn | None = None,
                 loss_fn: LossFn = default_classification_loss, fl: Optional[dict[str, Any]] = None, **params: Any):
        """``config``: the attack's ``Config`` (default: its defaults); ``params``: parameters overriding it (the
        config's fields, validated by it: a bad one raises ``BadInput`` naming ``attack.<field>``). The rest is not
        configuration but what the run provides (see the class docstring)."""
        cfg = attack_parameters(self.Config, config, params)
        self.config = cfg
        self._set_matching(cfg, seed=seed, image_shape=image_shape, progress=progress, loss_fn=loss_fn, fl=fl)
        self._set_optimiser(steps=cfg.steps, lr=cfg.lr, tv_weight=cfg.tv_weight, restarts=cfg.restarts, box=cfg.box,
                            log_every=cfg.log_every)

    def _set_matching(self, cfg: MatchingFields, *, seed: int, image_shape: Sequence[int] | None,
                      progress: ProgressFn | None, loss_fn: LossFn, fl: Optional[dict[str, Any]]) -> None:
        """The gradient-matching settings every attack of this package shares (:class:`MatchingFields`) and the
        run-provided ones."""
        if image_shape is not None and len(tuple(image_shape)) != 3:
            raise BadInput("attack.image_shape", f"image_shape must be (C, H, W), got {image_shape}.", "e.g. (3, 32, 32).")
        if cfg.emulate == "local_steps" and fl and fl.get("algorithm", "fedavg") != "fedavg":
            raise _emulate_needs_fedavg(fl.get("algorithm"))
        self.labels = cfg.labels
        self.seed = int(seed)
        self.image_shape = tuple(int(s) for s in image_shape) if image_shape is not None else None
        self.progress = progress
        self.signed = cfg.signed
        self.similarity = cfg.similarity
        self.loss_fn = loss_fn
        self.client_index = cfg.client_index
        self.label_param = cfg.label_param
        self.anchor = cfg.anchor
        self.anchor_weight = cfg.anchor_weight
        self.noise_model = cfg.noise_model  # read by _setup (the declared clip) and matching_terms (the likelihood)
        self.time_fwdbwd = cfg.time_fwdbwd
        self.emulate = cfg.emulate
        self.fl = dict(fl or {})  # the public training configuration (local_steps reads the client's schedule)

    def _set_optimiser(self, *, steps: int, lr: float, tv_weight: float, restarts: int, box: str,
                       log_every: Optional[int]) -> None:
        """The optimisation budget: Adam steps per restart, initial lr, TV weight, restarts, box constraint, and the
        progress period (default: every twentieth of the steps)."""
        self.steps = int(steps)
        self.lr = float(lr)
        self.tv_weight = float(tv_weight)
        self.restarts = int(restarts)
        self.box = box
        self.log_every = int(log_every) if log_every else max(1, self.steps // 20)

    # ------------------------------------------------------------------ protocol
    def prepare(self, model: nn.Module, threat: ThreatModel) -> nn.Module:
        """Honest server: the model is sent unchanged. ``anchor`` on a model without trainable layer-wise PEs is
        refused here, before any round (the config check refuses it earlier when the config is at hand)."""
        if self.anchor:
            from gradleak.peft.layer_pe import has_layer_pe

            if not has_layer_pe(model):
                raise _no_layer_pe()
        return model

    def matching_objective(self, view: ServerView) -> Callable[..., tuple[torch.Tensor, torch.Tensor, Any]]:
        """The attack's gradient-matching objective on ``view`` as a function of dummy images ``x`` (model range
        [−1, 1], shape (B, C, H, W)): ``f(x, create_graph=True) -> (total, θ'-term, PE-term or None)``, with the
        same copy of the model, labels, groups and attention switch ``reconstruct`` uses (for checks and probes)."""
        st = self._setup(view, time_fwdbwd=False)

        def f(x: torch.Tensor, create_graph: bool = True):
            return self.matching_terms(st.model, st.params, st.targets, st.groups, st.norms, x, st.labels, create_graph)

        f.setup = st  # type: ignore[attr-defined]
        return f

    def _setup(self, view: ServerView, time_fwdbwd: bool) -> SimpleNamespace:
        from gradleak.peft.layer_pe import is_input_pe, is_layer_pe

        self._clip = None
        if self.noise_model == "declared":  # the declared defenses' clipping bound (the noise: the l2 distance)
            from gradleak.defenses.declared import view_declared

            declared = view_declared(view)
            upd = view.updates[min(self.client_index, len(view.updates) - 1)] if view.updates else None
            per_sample = declared.per_sample_clip_norm if int(getattr(upd, "num_samples", 0) or 0) == 1 else None
            self._clip = declared.clip_norm or per_sample

        if not view.updates:
            raise BadInput("view.updates", "the server view holds no update.", "run at least one client round.")
        if not 0 <= self.client_index < len(view.updates):
            raise BadInput("attack.client_index", f"client_index {self.client_index} but the view holds "
                           f"{len(view.updates)} update(s).", "pick an index of an observed update.")
        update = view.updates[self.client_index]
        if self.anchor and not any(is_layer_pe(k) for k in update.tensors):
            raise _no_layer_pe()
        model = copy.deepcopy(view.model)
        eager_switched = _force_eager_attention(model)
        names, params, targets = self._bind(model, update)
        device, dtype = params[0].device, params[0].dtype

        batch_size, bs_source = self._batch_size(view, update)
        shape = self._shape(view, model)
        labels, label_source = self._labels(view, model, update, batch_size, shape, device, dtype)

        # ---- the groups of eq. 7: θ' (head + PEFT) by the attack's distance, the PEs by one cosine
        # (the input table counts as the prescribed architecture's PE only next to layer-wise PEs; a client that
        # trains it on its own, e.g. full fine-tuning, has it matched with θ' as IG always did)
        prescribed = any(is_layer_pe(n) for n in names)
        pe_terms = [i for i, n in enumerate(names) if (self.anchor and (is_layer_pe(n) or is_input_pe(n)))
                    or (self.input_pe_term and is_input_pe(n))]
        unmatched = [i for i, n in enumerate(names) if prescribed and (is_layer_pe(n) or is_input_pe(n))
                     and i not in pe_terms]
        main = [i for i in range(len(names)) if i not in pe_terms and i not in unmatched]
        if not main:
            raise BadInput("view.updates", "the update holds only positional-embedding gradients; there is no "
                           "head/PEFT gradient to match.", "train the head or a PEFT module (peft.train_head=true).")
        fb_probe = self._fwdbwd_probe(model, params, batch_size, shape, labels, device, dtype) if time_fwdbwd else None
        fb_samples = [fb_probe() for _ in range(6)][1:] if fb_probe else []  # after one warm-up call
        for i in unmatched:  # not matched: no gradient needed (faster), and not part of the objective
            params[i].requires_grad_(False)
        groups = {"main": main, "pe": pe_terms}
        norms = {g: torch.sqrt(sum((targets[i] ** 2).sum() for i in idx)) if idx else None for g, idx in groups.items()}
        if float(norms["main"]) == 0.0:
            raise BadInput("view.updates", "the observed update is all zeros; there is nothing to match.",
                           "attack an update with non-zero gradients.")
        if pe_terms and float(norms["pe"]) == 0.0:
            pe_terms = groups["pe"] = []  # nothing to anchor on (recorded in info)
        emulation = None
        if self.emulate == "local_steps":  # matching_terms finds the client's schedule on the attack's model copy
            emulation = model._gradleak_local_steps = self._emulation(view, update, names, batch_size)
        return SimpleNamespace(update=update, model=model, eager_switched=eager_switched, names=names, params=params,
                               targets=targets, device=device, dtype=dtype, batch_size=batch_size, bs_source=bs_source,
                               shape=shape, labels=labels, label_source=label_source, groups=groups, norms=norms,
                               main=main, pe_terms=pe_terms, unmatched=unmatched, fb_probe=fb_probe,
                               fb_samples=fb_samples, emulation=emulation)

    def reconstruct(self, view: ServerView) -> Reconstruction:
        t0 = time.perf_counter()
        st = self._setup(view, self.time_fwdbwd)
        update, model, eager_switched, names, params, targets = (st.update, st.model, st.eager_switched, st.names,
                                                                 st.params, st.targets)
        device, dtype, batch_size, bs_source, shape = st.device, st.dtype, st.batch_size, st.bs_source, st.shape
        labels, label_source, groups, norms = st.labels, st.label_source, st.groups, st.norms
        main, pe_terms, unmatched = st.main, st.pe_terms, st.unmatched

        trials = []
        for r in range(self.restarts):
            trials.append(self._trial(r, model, params, targets, groups, norms, labels, batch_size, shape,
                                      device, dtype, st.fb_probe, st.fb_samples))
        best = min(range(len(trials)), key=lambda i: trials[i]["final_matching_loss"])
        x = trials[best].pop("x")
        images = ((x + 1.0) / 2.0).clamp(0.0, 1.0).detach()
        step_times = [t for tr in trials for t in tr.pop("step_seconds")]
        t_iter = float(statistics.median(step_times)) if step_times else float("nan")
        t_fb = float(statistics.median(st.fb_samples)) if st.fb_samples else float("nan")
        ratio = t_iter / t_fb if t_fb == t_fb and t_fb > 0 else float("nan")
        diverged = [{"restart": i, "step": t["diverged_at_step"]} for i, t in enumerate(trials)
                    if t["diverged_at_step"] is not None]
        info = {
            "attack": self.name, "steps": self.steps, "lr": self.lr, "tv_weight": self.tv_weight,
            "restarts": self.restarts, "signed": self.signed, "box": self.box, "similarity": self.similarity,
            "distance": self.distance, "anchor": self.anchor, "anchor_weight": self.anchor_weight,
            "batch_size": batch_size, "batch_size_source": bs_source, "image_shape": list(shape),
            "labels": labels.tolist(), "label_source": label_source, "matched_parameters": [names[i] for i in main],
            "pe_term_parameters": [names[i] for i in pe_terms], "unmatched_parameters": [names[i] for i in unmatched],
            "num_matched_values": int(sum(targets[i].numel() for i in main + pe_terms)),
            "initial_matching_loss": trials[best]["initial_matching_loss"],
            "final_matching_loss": trials[best]["final_matching_loss"],
            "final_main_term": trials[best]["final_main_term"], "final_pe_term": trials[best]["final_pe_term"],
            "history": trials[best]["history"], "best_restart": best,
            "restart_final_losses": [t["final_matching_loss"] for t in trials], "diverged": diverged,
            "attention_switched_to_eager": eager_switched, "update_kind": update.kind,
            **self._emulation_info(st.emulation),
            "seconds": time.perf_counter() - t0,
            "timings": {"attack_seconds": time.perf_counter() - t0, "iteration_seconds": t_iter,
                        "fwdbwd_seconds": t_fb, "iteration_to_fwdbwd_ratio": ratio},
        }
        if diverged:
            info["warning"] = (f"{self.name}: the objective became NaN/inf in {len(diverged)} of {self.restarts} "
                               "restart(s); those stopped early" + (" (all of them: the image is the last finite "
                               "iterate)" if len(diverged) == self.restarts else ", the others were kept"))
        if self.input_pe_term and not pe_terms:
            info["warning"] = ((info.get("warning", "") + "; ") if info.get("warning") else "") + (
                f"{self.name}: the upload holds no positional-embedding gradient (the client does not train a PE), "
                "so the PE cosine term is absent and this run is plain Euclidean gradient matching (DLG)")
        metrics = {"final_matching_loss": float(trials[best]["final_matching_loss"])}
        if pe_terms:
            metrics["final_pe_term"] = float(trials[best]["final_pe_term"])
        return Reconstruction({"images": images, "labels": labels.cpu()}, info, metrics)

    # ------------------------------------------------------------------ view reading
    def _emulation(self, view: ServerView, update: Update, names: list[str], n: int) -> SimpleNamespace:
        """The client's local-training schedule for ``emulate: local_steps`` (module docstring): its batch size,
        epochs and lr from the public training configuration, checked against the update's step count."""
        if update.kind != "pseudo_gradient":
            raise _emulate_needs_fedavg("fedsgd" if update.kind == "gradient" else update.kind)
        if view.secure_aggregation or update.client_id < 0:
            raise _emulate_no_secagg()
        r = len(view.rounds) - 1 if view.rounds else -1  # view.updates is the last observed round
        b, e, lr = client_training_config(self.fl, int(update.client_id), n, r)
        schedule = local_schedule(n, b, e)
        if update.local_steps and len(schedule) != int(update.local_steps):
            raise BadInput("attack.emulate", f"the public training configuration gives client {update.client_id} "
                           f"{len(schedule)} local step(s) ({n} samples, batch size {b}, {e} epoch(s)) but its update "
                           f"reports {update.local_steps}.", "give the attack the clients' training configuration "
                           "(fl: local_batch_size / local_epochs / client_batch_sizes / client_epochs, lr_at), or use "
                           "attack.emulate=single_step.")
        if lr is None and len(schedule) > 1:
            raise BadInput("attack.emulate", "the clients' learning rate is unknown, so their local steps cannot be "
                           "simulated.", "run through the pipeline (gradleak run), or give the attack fl={'lr': ...}.")
        return SimpleNamespace(names=list(names), schedule=schedule, lr=float(lr) if lr is not None else 0.0,
                               batch_size=b, epochs=e, steps=len(schedule), round=r)

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

    def _emulation_info(self, emu: Optional[SimpleNamespace]) -> dict[str, Any]:
        if emu is None:
            return {}
        return {"emulation": {"mode": "local_steps", "local_steps": emu.steps, "batch_size": emu.batch_size,
                              "epochs": emu.epochs, "lr": emu.lr, "round": emu.round,
                              "shuffle": "consecutive batches of the dummies; later epochs re-use epoch 1's order"}}

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
        lab = view.public.get("labels")
        if self.labels == "known" or (self.labels == "auto" and lab is not None):
            if lab is None:
                raise BadInput("view.public.labels", "labels='known' but the threat model grants no labels.",
                               "grant them via ServerView.public['labels'] or use labels='idlg' / 'auto'.")
            lab = torch.as_tensor(lab, dtype=torch.long).reshape(-1)
            if len(lab) != batch_size:
                raise BadInput("view.public.labels", f"{len(lab)} labels for a batch of {batch_size}.",
                               "grant one label per private sample.")
            return lab.to(device), "public"
        num_logits = view.public.get("num_classes")
        if num_logits is None:
            with torch.no_grad():
                num_logits = output_logits(model(torch.zeros((1, *shape), device=device, dtype=dtype))).shape[-1]
        labels, source = recover_labels_from_head(update, int(num_logits), batch_size, self.label_param)
        return labels.to(device), source

    # ------------------------------------------------------------------ optimisation
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

    # ------------------------------------------------------------------ restarts batched through one double backward
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


def _emulate_needs_fedavg(algorithm) -> BadInput:
    return BadInput("attack.emulate", f"is local_steps, but the clients run {algorithm} (one gradient of the whole "
                    "batch): there are no local steps to emulate.",
                    "use attack.emulate=single_step, or fl.algorithm=fedavg (local steps: fl.local_batch_size, "
                    "fl.local_epochs).")


def _emulate_no_secagg() -> BadInput:
    return BadInput("attack.emulate", "is local_steps, but the server sees only the secure aggregate of the clients' "
                    "updates, which is no single client's local-training trajectory.",
                    "use attack.emulate=single_step, or individual updates (fl.secure_aggregation=false).")


def _no_layer_pe() -> BadInput:
    return BadInput("attack.anchor", "is true, but the model has no trainable layer-wise positional embeddings, so "
                    "there are no PE gradients to anchor on (paper 001 eq. 7).",
                    "set peft.layer_pe=true (peft.kind=lora or none, threat.preset=prescribes-architecture), "
                    "or attack.anchor=false.")


@ATTACKS.register("ig", "Inverting Gradients: 1 − cos matching + TV; anchor adds the PE-gradient cosine (paper 001 eq. 7)")
class IG(InvertingGradients):
    """Inverting Gradients under the name paper 001's contract uses (``ig``): the same attack as
    ``inverting_gradients`` (kept for old configs), with ``labels: auto`` by default (granted labels, else the
    head gradient). "IG + Ours" = ``anchor: true`` on a model with ``peft.layer_pe: true``."""

    name = "ig"
    Config = IGConfig


@ATTACKS.register("dlg", "Deep Leakage from Gradients: Euclidean gradient matching (Zhu et al. 2019); anchor as ig")
class DLG(InvertingGradients):
    """DLG (Zhu, Liu, Han, NeurIPS 2019): minimise the Euclidean distance ‖∇_θ L(f(x), y) − g‖² between the dummy
    and the observed gradients (θ' = head + PEFT). Decisions: Adam (``lr`` 0.1, cosine decay, plain gradient:
    ``signed=False``) instead of DLG's L-BFGS (whose line search costs several double-backward passes per step:
    the ≤ 3× iteration budget would not hold); labels known or recovered from the head gradient (iDLG) instead of
    optimised jointly; no TV; the distance divided by ‖g‖² (a constant: the optimum and, Adam being invariant to a
    constant scale, the trajectory are DLG's) so that ``anchor_weight`` weighs two scale-free terms."""

    name = "dlg"
    Config = DLGConfig
    distance = "l2"


@ATTACKS.register("april", "APRIL, optimisation variant: Euclidean matching + PE-gradient cosine (Lu et al. 2022)")
class April(DLG):
    """APRIL-O (Lu, Huang, Zhao, Sun, *APRIL: Finding the Achilles' heel on privacy for vision transformers*, CVPR
    2022), the optimisation variant paper 001 runs as a baseline (Sec. 3.5, Table 1): the Euclidean distance of the
    head/PEFT gradients (as :class:`DLG`) plus a cosine term on the positional-embedding gradient. Without the anchor
    the PE term covers the *input* position table, APRIL's own term (present only if the client trains it — with
    ``peft.layer_pe`` it does; a plain LoRA client freezes it and the term is absent, recorded in
    ``info["pe_term_parameters"]``); ``anchor: true`` ("APRIL + Ours") adds every layer-wise PE to that cosine.
    Its weight is ``anchor_weight`` in both cases (APRIL's α; eq. 7's 1 by default).

    APRIL's **analytic** variant (closed-form input from the gradients of the attention weights and of the input PE,
    which needs the *full* gradient of the first block's query/key/value matrices) does **not** apply to LoRA
    clients: they upload only the low-rank factors' gradients (∂L/∂A = Bᵀ Σ δ hᵀ of rank ≤ r), from which the
    full-weight gradient the analytic system needs cannot be formed. It is not implemented; ``lora_span`` is the
    analytic attack that does apply to LoRA clients (from the row space of block 0's LoRA-A gradient)."""

    name = "april"
    Config = AprilConfig
    input_pe_term = True

    #: PEFT kinds whose clients never train the input position table (only :func:`gradleak.peft.layer_pe.add_layer_pe`
    #: makes it trainable, under ``peft.layer_pe``)
    NO_INPUT_PE_KINDS = ("lora", "adapters", "none")

    @classmethod
    def same_run_as(cls, experiment_cfg) -> tuple[str, str] | None:
        """DLG's run when APRIL's PE term has nothing to read: no anchor, and a client that trains no position table
        (no ``peft.layer_pe``, a PEFT kind that freezes it). The term is then absent (the warning of :meth:`run`)
        and the objective, parameters, seed and trajectory are DLG's, bit for bit."""
        a, peft = experiment_cfg.attack_cfg, experiment_cfg.peft
        if getattr(a, "anchor", False) or getattr(peft, "layer_pe", False) or peft.kind not in cls.NO_INPUT_PE_KINDS:
            return None
        return "dlg", (f"april: the client trains no positional embedding (peft.kind={peft.kind}, no peft.layer_pe), "
                       "so APRIL's PE cosine term is absent and its run is DLG's (Euclidean gradient matching, the same "
                       "parameters and seed): judged on DLG's run, not run twice")
