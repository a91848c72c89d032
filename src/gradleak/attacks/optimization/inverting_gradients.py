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
* **Restarts batched** (GradViT's and GIAS's group loop): one forward and one double backward for the restarts
  optimised together, exact where every matched tensor is an ``nn.Linear`` weight or bias
  (:mod:`gradleak.attacks.optimization.batched_restarts`, which records the rule and its conditions).

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

The attack is split by role: its configuration and refusals (:mod:`~gradleak.attacks.optimization.matching_config`),
the view reading (:mod:`~gradleak.attacks.optimization.matching_setup`), the objective and the TV prior
(:mod:`~gradleak.attacks.optimization.objective`), the batched restarts
(:mod:`~gradleak.attacks.optimization.batched_restarts`) and one restart's optimiser loop
(:mod:`~gradleak.attacks.optimization.optimiser`); this module assembles them into the registered attacks.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, ClassVar, Optional, Sequence

import torch
from torch import nn

from gradleak.attacks.base import AttackBase, AttackConfig, AttackContext, Reconstruction, ThreatModel
from gradleak.attacks.common.parameters import attack_parameters
from gradleak.attacks.optimization.batched_restarts import BatchedRestarts
from gradleak.attacks.optimization.matching_config import (CPU_STEPS, PAPER_STEPS, AprilConfig, DLGConfig, IGConfig,
                                                           InvertingGradientsConfig, MatchingFields, ProgressFn,
                                                           emulate_needs_fedavg, emulate_no_secagg, no_layer_pe)
from gradleak.attacks.optimization.matching_setup import MatchingSetup
from gradleak.attacks.optimization.objective import GradientMatching
from gradleak.attacks.optimization.optimiser import OptimiserLoop
from gradleak.errors import BadInput
from gradleak.fl.core import LossFn, ServerView, default_classification_loss
from gradleak.registry import ATTACKS


@ATTACKS.register("inverting_gradients",
                  "honest-server optimisation attack: 1 − cos gradient matching + TV (Geiping et al. 2020)")
class InvertingGradients(MatchingSetup, OptimiserLoop, BatchedRestarts, GradientMatching, AttackBase):
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
            raise emulate_needs_fedavg(fl.algorithm)
        if fl.secure_aggregation:
            raise emulate_no_secagg()

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
            raise emulate_needs_fedavg(fl.get("algorithm"))
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
                raise no_layer_pe()
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
