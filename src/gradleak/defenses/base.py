"""The defense protocol (docs/DESIGN.md §2): one registry (:data:`gradleak.registry.DEFENSES`), one base class with a stage,
each defense with a pydantic ``Config`` that holds its parameters and their defaults.

Two stages:

* ``update`` (:class:`UpdateDefense`) — a transform of the client's upload, ``apply(update, ctx) -> update``, run in
  the client after its training step and before the upload (noise, clipping, pruning, quantisation, local DP);
  ``server_apply`` for a mechanism the server runs on the aggregate (central DP). Named in the config's
  ``defenses:`` list (``[{name, params}]``, applied in order).
* ``training`` (:class:`TrainingDefense`) — changes how the client trains: the model before training (``apply``),
  its objective (``wrap_loss``, ``loss_options``), or its whole step (``local_update``: DP-SGD, the RDLV filter).
  Named in the config's single ``defense:`` section (``{name, <parameters>}``).

An update-stage defense may also be named in ``defense:`` (``defense: {name: percentile_noise, sigma0: 25}``, so
that ``--set defense.sigma0=…`` sweeps it): it trains nothing, and its transform runs on every upload after the
``defenses:`` list (:class:`UpdateInDefenseSection`).

Every hook is declared here with its default, so callers never probe a defense for an attribute. A defense is built
from its parameters (``GaussianNoise(0.1, relative=True)``: positional in the order of the Config's fields, or by
name) or from a Config instance (``DPSGD(DPSGDParams(noise_multiplier=2))``); the parameters that need more than a
type (ranges with a fix to suggest, exclusive options) are checked in :meth:`Defense.setup`, which raises
:class:`~gradleak.errors.BadInput` naming the field.

**Seeds.** A defense that draws randomness declares ``seeded = True`` and a ``seed`` field in its Config; the
builders (:func:`build_defenses`, :func:`build_defense_section`) set that field to the run's seed when the config
leaves it out. Nothing inspects signatures or code objects.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Literal, Optional

from pydantic import ConfigDict, Field, ValidationError

from gradleak.errors import BadInput, describe_validation_error
from gradleak.registry import DEFENSES
from gradleak.validation import Checked

if TYPE_CHECKING:
    from gradleak.fl.core import Update

Stage = Literal["update", "training"]


class DefenseParams(Checked):
    """Base of every defense's ``Config``: unknown parameters are errors, numbers must be finite (not booleans)."""


class Defense:
    """A registered defense: its ``Config``, its ``stage`` and the hooks both stages share."""

    #: parameters, with their defaults and documentation (the one place a default is written)
    Config: ClassVar[type[DefenseParams]] = DefenseParams
    stage: ClassVar[Stage]
    #: data modalities the defense is implemented for (checked when it is named in ``defense:``); None: every
    #: registered modality (an update-stage transform reads tensors, whatever the data)
    modalities: ClassVar[Optional[tuple[str, ...]]] = None
    #: False only for the no-defense entry (``defense: {name: none}``): it protects nothing, so it is never offered
    #: as a defense to add
    protects: ClassVar[bool] = True

    @classmethod
    def implemented_for(cls, modality: str) -> bool:
        """Whether the defense is implemented for ``modality``'s clients (:attr:`modalities`)."""
        return cls.modalities is None or modality in cls.modalities
    #: True: the Config has a ``seed`` field that the builders set to the run's seed when the config leaves it out
    seeded: ClassVar[bool] = False
    #: ``gradleak audit --advise``: the brackets this defense is searched over (none: not a candidate). Each is a dict:
    #: ``stage`` (where the probe puts it: ``update`` appended to ``defenses:``, ``training`` the ``defense:``
    #: section), ``param`` (the one parameter searched), ``weak`` -> ``strong`` (its bracket), ``scale`` (``log``,
    #: ``log1m`` (on ``unit - x``, ``unit`` default 1), ``int`` (whole numbers, log), ``lin``), ``fixed`` (other
    #: parameters), ``what`` (the words of the advice row); optional ``key`` (its name in the advice when one defense
    #: is searched in two modes), ``mode`` (the parameters that make a configured defense this candidate),
    #: ``requires`` (what the setup must have), ``attack_kinds`` (searched only when an attack of one of these
    #: reconstruction kinds leaks; default every kind); ``order`` (its place among the candidates) and
    #: ``rank`` (the tie-break among equally cheap rows: the most standard first). The name is the defense's own.
    advice: ClassVar[tuple[dict[str, Any], ...]] = ()
    #: a differential-privacy mechanism: its advice rows carry an epsilon (:meth:`advice_epsilon`), and one whose
    #: epsilon is above the advice's meaningful bound ranks after the other equally cheap rows
    is_dp: ClassVar[bool] = False
    #: the advice's clipping fit of a DP mechanism: ``(parameter, observed norms, words)`` -- the parameter is set to the
    #: median of the baseline utility run's ``update_norms`` (the uploads) or ``sample_gradient_norms`` (per sample),
    #: the median quantile of adaptive clipping (:func:`gradleak.run.advise_utility.fitted_clip`); None: no clip
    clip_fit: ClassVar[Optional[tuple[str, str, str]]] = None
    #: what a DP mechanism's advice epsilon is (its accountant, δ), added to the row's ``epsilon_note``; empty: nothing
    epsilon_words: ClassVar[str] = ""
    #: the δ of the defense's own ε when it is not the advice's (NVFlare's SVT: pure DP, 0.0); None: the advice's δ
    epsilon_delta: ClassVar[Optional[float]] = None

    @classmethod
    def describe(cls, params: dict[str, Any]) -> str:
        """Words the audit's setup adds after ``defense <name> <params>`` (what the parameters mean for who sees what);
        empty by default."""
        return ""

    @classmethod
    def advice_epsilon(cls, value: Any, rounds: int, measured: Optional[float], delta: float,
                       gaussian_epsilon: Callable[[float, int, float], Optional[float]]) -> Optional[float]:
        """The epsilon of an advice row at strength ``value`` over ``rounds`` rounds (a DP mechanism, :attr:`is_dp`):
        ``measured`` is the run's own ``dp_epsilon`` metric (an accountant that ran), ``delta`` the advice's delta,
        ``gaussian_epsilon(z, steps, delta)`` the Gaussian mechanism's RDP ε. None: not computed (default)."""
        return None

    def dp_claims(self, cfg: Any, gaussian_epsilon: Callable[[float, int, float], float], delta: float) -> list[dict]:
        """The DP mechanisms this defense declares for the audit's DP check (:mod:`gradleak.run.dp_check`), each a
        dict: ``name``, ``where`` (update defenses), ``clip`` (the bound a canary is scaled against, in the upload's
        units), ``covers`` (threat models its claim covers), ``delta`` and ``claim`` (rounds, the training defense's
        report -> (ε, accountant words)); ``gaussian_epsilon(z, steps, delta)`` is the Gaussian mechanism's RDP ε and
        ``delta`` the check's. Default: none."""
        return []

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if cls.seeded and "seed" not in cls.Config.model_fields:
            raise TypeError(f"{cls.__name__} is seeded but {cls.Config.__name__} has no `seed` field")
        # the signature `gradleak list`, help() and inspect show: the Config's fields and defaults
        cls.__signature__ = inspect.Signature([
            inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                              default=inspect.Parameter.empty if f.is_required() else f.get_default(call_default_factory=True))
            for n, f in cls.Config.model_fields.items()])

    def __init__(self, *args: Any, **params: Any):
        if len(args) == 1 and not params and isinstance(args[0], DefenseParams):
            if not isinstance(args[0], self.Config):
                raise TypeError(f"{type(self).__name__} takes a {self.Config.__name__}, not a {type(args[0]).__name__}")
            cfg = args[0]
        else:
            names = list(self.Config.model_fields)
            if len(args) > len(names):
                raise TypeError(f"{type(self).__name__} takes at most {len(names)} positional parameters "
                                f"({', '.join(names)}), got {len(args)}")
            for n, v in zip(names, args):
                if n in params:
                    raise TypeError(f"{type(self).__name__} got parameter '{n}' twice")
                params[n] = v
            cfg = self.Config(**params)
        self.cfg = cfg
        #: the seed was filled in from the run's seed (so it is not one of the configured parameters)
        self.seed_from_run = False
        self.setup()

    def setup(self) -> None:
        """Check the parameters beyond their types (BadInput naming the field) and derive the working state."""

    def params(self) -> dict[str, Any]:
        """The parameters as configured (JSON types); a seed taken from the run is left out (it is the run's ``seed``)."""
        return self.cfg.model_dump(mode="json", exclude={"seed"} if self.seed_from_run else None)

    def check_experiment(self, cfg: Any) -> None:
        """Refuse an experiment the defense cannot run on, at validation time (before any model is built)."""

    def report(self, rounds: list) -> dict[str, float]:
        """Numbers about the defense in this trial, added to the run's metrics (called once per trial)."""
        return {}

    def server_knowledge(self) -> dict[str, Any]:
        """What the server knows of this defense besides its noise (:mod:`gradleak.defenses.declared`):
        ``clip_norm`` / ``per_sample_clip_norm``, ``sparsity`` ({keep_fraction, scope}), ``quant_bits``,
        ``adds_noise`` (Gaussian noise of a scale :meth:`observed_noise_variance` computes), ``noise_per_tensor``
        (noise whose scale differs per tensor, read off each observed tensor of an individual upload: its
        :meth:`observed_noise_variance` needs the ``tensor``), ``noise_unknown`` (noise of a scale the server cannot
        compute). Default: nothing."""
        return {}


class UpdateDefense(Defense):
    """A transform of each client's upload (``defenses:``)."""

    stage: ClassVar[Stage] = "update"
    #: True: a mechanism the server applies to the aggregate (``server_apply``); the client step only ``apply``-s
    server_side: bool = False

    def apply(self, update: "Update", ctx: dict) -> "Update":
        """The upload after the defense; ``ctx`` holds ``client_id``, the round's ``seed`` and ``lr``."""
        return update

    def server_apply(self, aggregate: "Update", ctx: dict, num_updates: int) -> "Update":
        """The aggregate of ``num_updates`` uploads after the server's part of the mechanism (central DP)."""
        return aggregate

    def observed_noise_variance(self, update: "Update", aggregate_of: int = 1, individual: bool = True,
                                tensor: Optional[str] = None) -> Optional[float]:
        """Per-coordinate variance of the Gaussian noise this defense puts on an observed upload (``individual``)
        or on the mean of ``aggregate_of`` uploads, as the server can compute it from the published parameters
        and the observed (noisy) ``update``; 0 for no noise, None for noise of a scale the server cannot know.
        ``tensor``: the name of the observed tensor the variance is for (a defense whose noise differs per tensor,
        ``noise_per_tensor``, reads it off that tensor; None: the upload as a whole); a defense whose noise is the
        same on every tensor ignores it."""
        return 0.0

    def observed_error_variance(self, update: "Update", aggregate_of: int = 1, individual: bool = True,
                                tensor: Optional[str] = None) -> Optional[float]:
        """Per-coordinate variance of the *bounded, non-Gaussian* error this defense leaves on an observed upload
        (top-k pruning's dropped coordinates, :meth:`gradleak.defenses.update.TopKPruning.observed_error_variance`),
        read off the upload as the server sees it; 0 for none, None for an error of a scale the server cannot read.
        Not noise: the attacks' Gaussian tests never read it; it sets the error edge of the information limit
        (:func:`gradleak.attacks.common.subspace.spectral_margin`; docs/DESIGN.md, the information limit)."""
        return 0.0


class TrainingDefense(Defense):
    """A change to how clients train (``defense:``)."""

    stage: ClassVar[Stage] = "training"
    modalities: ClassVar[Optional[tuple[str, ...]]] = ("text",)  # most of paper 004's MIA defenses are for text clients
    #: True: the defense changes what the upload carries (noise, clipping, filtering), so the audit attacks it with
    #: full-strength variants (:mod:`gradleak.defenses.declared`); False: it changes only how the model learns
    changes_upload: ClassVar[bool] = False
    #: ``local_update(client, model, *, seed, algorithm, lr, round_index, epochs, batch_size) -> Update | None``
    #: replaces the client's training step (None: the client's own step); a defense that needs it defines the method
    local_update: Optional[Callable[..., Any]] = None

    def apply(self, handle: Any, experiment_cfg: Any, data: Any = None) -> None:
        """Change the model before training (FISGuard re-parameterises layers, dropout installs hooks); ``data`` is
        the experiment's data source."""

    def wrap_loss(self, loss_fn: Callable, model: Any) -> Callable:
        """The client's objective (L2, dropout's training switch)."""
        return loss_fn

    def loss_options(self) -> dict[str, Any]:
        """Options of the task loss itself (label smoothing)."""
        return {}

    def layer_condition(self, rounds: list) -> dict[str, bool]:
        """Per protected layer, whether the defense's guarantee held (empty: no per-layer guarantee)."""
        return {}

    def update_transforms(self, seed: int = 0) -> list[UpdateDefense]:
        """Update transforms the defense adds after the ``defenses:`` list."""
        return []

    def observed_noise_variance(self, update: "Update", aggregate_of: int = 1, individual: bool = True,
                                local_batch_size: Optional[int] = None, tensor: Optional[str] = None) -> Optional[float]:
        """Per-coordinate variance of the Gaussian noise the defense's training puts on an observed upload, as
        :meth:`UpdateDefense.observed_noise_variance` (``local_batch_size``: the protocol's minibatch size, for
        FedAvg; ``tensor``: the observed tensor's name, for noise that differs per tensor); 0 for none, None for
        noise of a scale the server cannot know."""
        return 0.0


class UpdateInDefenseSection(TrainingDefense):
    """An update-stage defense named in ``defense:``: it trains nothing; its transform runs on every upload after the
    ``defenses:`` list, and its report joins the metrics."""

    modalities: ClassVar[Optional[tuple[str, ...]]] = None
    changes_upload: ClassVar[bool] = True

    def server_knowledge(self) -> dict[str, Any]:
        return self.transform.server_knowledge()

    def observed_noise_variance(self, update: "Update", aggregate_of: int = 1, individual: bool = True,
                                local_batch_size: Optional[int] = None, tensor: Optional[str] = None) -> Optional[float]:
        return self.transform.observed_noise_variance(update, aggregate_of=aggregate_of, individual=individual,
                                                      tensor=tensor)

    def __init__(self, transform: UpdateDefense):
        self.transform = transform
        self.cfg = transform.cfg
        self.seed_from_run = transform.seed_from_run

    def params(self) -> dict[str, Any]:
        return self.transform.params()

    def update_transforms(self, seed: int = 0) -> list[UpdateDefense]:
        t = self.transform
        if t.seeded and t.seed_from_run and t.cfg.seed != seed:
            t = _with_run_seed(type(t), t.cfg.model_dump(exclude={"seed"}), seed)
        return [t]

    def check_experiment(self, cfg: Any) -> None:
        self.transform.check_experiment(cfg)

    def report(self, rounds: list) -> dict[str, float]:
        return self.transform.report(rounds)


# ------------------------------------------------------------------------------------------------- config entries

class DefenseConfig(Checked):
    """One entry of a config's ``defenses:`` list: ``{name: ..., params: {<parameters>}}``."""
    name: str
    params: dict[str, Any] = Field(default_factory=dict)


class DefenseSection(Checked):
    """The config's ``defense:`` section: ``{name: ..., <parameters>}`` (flat), validated against the Config of
    ``name``."""

    model_config = ConfigDict(extra="allow")
    name: str = "none"


def _with_run_seed(cls: type[Defense], params: dict[str, Any], seed: int) -> Defense:
    filled = cls.seeded and "seed" not in params
    d = cls(**({**params, "seed": seed} if filled else params))
    d.seed_from_run = filled
    return d


def _lookup(name: str, field: str, stage: Optional[Stage]) -> type[Defense]:
    names = [e.name for e in DEFENSES if stage is None or e.obj.stage == stage]
    if name not in DEFENSES:
        raise BadInput(field, f"unknown defense '{name}'.", f"use one of: {', '.join(names)}.")
    cls = DEFENSES.get(name, field=field)
    if stage is not None and cls.stage != stage:
        raise BadInput(field, f"'{name}' is a training-time defense; the `defenses:` list holds update transforms.",
                       f"name it in the `defense:` section (defense: {{name: {name}, ...}}), or use one of: "
                       f"{', '.join(names)}.")
    return cls


def _build(cls: type[Defense], name: str, params: dict[str, Any], seed: int, prefix: str) -> Defense:
    try:
        return _with_run_seed(cls, params, seed)
    except ValidationError as err:
        bad = describe_validation_error(err)
        fix = bad.fix if "does not exist" not in bad.problem else \
            f"parameters of '{name}': {', '.join(cls.Config.model_fields) or '(none)'}."
        raise BadInput(f"{prefix}.{bad.field}", bad.problem, fix) from None


def build_defenses(entries: list[DefenseConfig] | list[dict], seed: int = 0) -> list[UpdateDefense]:
    """The ``defenses:`` list as update transforms, in order; BadInput naming ``defenses[i]...`` for a bad name or
    parameter. Seeded defenses without a ``seed`` parameter get ``seed``."""
    out = []
    for i, e in enumerate(entries):
        e = e if isinstance(e, DefenseConfig) else DefenseConfig(**e)
        cls = _lookup(e.name, f"defenses[{i}].name", "update")
        out.append(_build(cls, e.name, dict(e.params), seed, f"defenses[{i}].params"))
    return out


def build_defense_section(section: DefenseSection, modality: str, seed: int = 0) -> TrainingDefense:
    """The ``defense:`` section as a training-time defense (an update-stage one wrapped in
    :class:`UpdateInDefenseSection`); BadInput naming ``defense.<field>``."""
    name = section.name
    cls = _lookup(name, "defense.name", None)
    if cls.protects and not cls.implemented_for(modality):
        raise BadInput("defense.name", f"training defense '{name}' is implemented for "
                       f"{' and '.join(cls.modalities)} clients.",
                       "use defense.name=none, or the update defenses in `defenses:`.")
    d = _build(cls, name, dict(section.model_extra or {}), seed, "defense")
    return UpdateInDefenseSection(d) if isinstance(d, UpdateDefense) else d


def defense_class(name: str) -> Optional[type[Defense]]:
    """The registered defense ``name`` (or an alias of it); None for a name that is no registered defense (an advice
    candidate of another kind: secure aggregation, a framework's wrapper, a second mode's key)."""
    return DEFENSES.get(name) if name in DEFENSES else None


def is_dp_defense(name: str) -> bool:
    """Whether ``name`` is a registered DP mechanism (:attr:`Defense.is_dp`)."""
    cls = defense_class(name)
    return bool(cls is not None and cls.is_dp)


def advice_candidates() -> list[dict[str, Any]]:
    """Every registered defense's advice brackets (:attr:`Defense.advice`), each with its ``name``, in their
    ``order``."""
    out = [{"name": e.name, **spec} for e in DEFENSES for spec in e.obj.advice]
    return sorted(out, key=lambda s: s.get("order", float("inf")))


__all__ = ["Defense", "DefenseConfig", "DefenseParams", "DefenseSection", "Stage", "TrainingDefense", "UpdateDefense",
           "UpdateInDefenseSection", "advice_candidates", "build_defense_section", "build_defenses", "defense_class",
           "is_dp_defense"]


def median_clip(norms) -> float | None:
    """The clipping norm fitted to observed L2 ``norms``: their median (the median quantile of adaptive clipping,
    Andrew et al. 2021), to 3 significant digits (it is printed in the advice and set with ``--set``); None when no
    finite positive norm was observed. The one fit of ``--advise`` and of the Flower audit's advice."""
    import math
    import statistics

    seen = [float(v) for v in norms if isinstance(v, (int, float)) and math.isfinite(v) and v > 0]
    return float(f"{statistics.median(seen):.3g}") if seen else None
