"""The attack protocol (docs/DESIGN.md §2).

An attack is a class registered in ``ATTACKS`` that subclasses :class:`AttackBase` and declares

* ``Config`` — a pydantic model of its parameters (constraints on the fields: bad values exit 2);
* ``modality`` (``"image"`` / ``"text"``), ``peft_kinds`` (the PEFT kinds it applies to) and
  ``reconstruction`` (the kind of output, which picks the evaluation: ``"patches"``, ``"images"``,
  ``"token_sequences"``, ``"membership"``);
* :meth:`requires` — the threat-model flags it needs (``{"malicious": True, "knows_labels": True}``);
  the runner refuses a config whose threat model withholds one (exit 2 naming ``threat.<flag>``).

and implements the round protocol, called by the one runner (:mod:`gradleak.run.pipeline`):

1. ``prepare(model, threat) -> model`` once, before round 0 (malicious attacks may rewrite weights);
2. ``server_model(round, model) -> model`` before every round: the model the server sends that round
   (honest attacks return it unchanged; PEFTLeak writes that round's malicious adapters);
3. ``reconstruct(view) -> Reconstruction`` after the rounds, from the :class:`ServerView` alone — the
   attack never receives the clients' data; ground truth is used only by the evaluation step.

``rounds_wanted(fl_rounds)`` lets a multi-round attack ask for the rounds its plan needs.
``from_config(cfg, ctx)`` builds the attack from its config and the :class:`AttackContext`, which holds
only what the threat model grants before any round (public data, batch size if announced).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from gradleak.fl.threat import ThreatModel
from gradleak.validation import Checked

__all__ = ["AttackBase", "AttackConfig", "AttackContext", "Reconstruction", "ThreatModel"]


class AttackConfig(Checked):
    """Base of every attack's parameter model: unknown parameters are errors, numbers must be finite (not booleans)."""


@dataclass
class Reconstruction:
    """What an attack returns. ``data`` is attack-specific (images, patches, token ids, scores);
    ``info`` carries diagnostics (e.g. number of candidate patches, rounds used); ``metrics`` holds
    attack-side numbers the evaluation copies into the results (they use no ground truth)."""

    data: Any
    info: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class AttackContext:
    """What an attack may know when it is built: the seed, the device, the resolved threat model, the
    public protocol (``fl``: algorithm, local epochs, ...) and the facts the threat model grants up front
    (``public``: e.g. ``public_images`` under ``public_data``, ``batch_size`` under ``knows_batch_size``)."""

    seed: int
    device: Any
    threat: ThreatModel
    fl: dict[str, Any] = field(default_factory=dict)
    public: dict[str, Any] = field(default_factory=dict)


class AttackBase:
    """Defaults of the protocol; subclasses override what they need."""

    name: ClassVar[str] = ""
    Config: ClassVar[type[AttackConfig]] = AttackConfig
    modality: ClassVar[str] = "image"
    peft_kinds: ClassVar[tuple[str, ...]] = ("adapters", "lora", "none")
    reconstruction: ClassVar[str] = "images"
    #: devices the attack has been run on; the runner refuses the others with a clear message
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    #: whether the attack needs float64 arithmetic in the model (analytic attacks)
    needs_float64: ClassVar[bool] = False
    #: whether ``prepare`` overwrites every weight (then the runner skips the random initialisation)
    rewrites_weights: ClassVar[bool] = False
    #: whether the attack reads a domain prior image (the pipeline then holds ``data.prior_size`` images out)
    uses_prior: ClassVar[bool] = False
    #: per ``scale`` (cpu / paper), the parameter values a config that does not set them gets (iteration budgets)
    scales: ClassVar[dict[str, dict[str, Any]]] = {}
    summary: ClassVar[str] = ""

    @classmethod
    def check_peft(cls, cfg: AttackConfig, peft) -> None:
        """Config-time check of the PEFT section (before any model loads), e.g. ``attack.anchor`` needs
        ``peft.layer_pe``; raise :class:`~gradleak.errors.BadInput` naming the field. Default: nothing to check."""

    @classmethod
    def check_fl(cls, cfg: AttackConfig, fl) -> None:
        """Config-time check of the FL section, e.g. ``attack.emulate: local_steps`` needs FedAvg. Default: none."""

    @classmethod
    def requires(cls, cfg: Optional[AttackConfig] = None) -> dict[str, bool]:
        """Threat flags this attack needs under ``cfg`` (default config when ``None``)."""
        return {}

    @classmethod
    def audit_variants(cls, params: dict[str, Any], defenses: list[dict]) -> list[dict[str, Any]]:
        """Parameter sets the audit runs *besides* ``params`` so that the attack is judged at full strength
        (docs/DESIGN.md §6: declared defenses are public; no verdict may rest on a default tolerance). ``params``: the
        attack's parameters as configured; ``defenses``: the update defenses the deployment declares. Each returned
        dict overrides ``params``; the audit keeps the most leaking run. Default: none (no key tolerance)."""
        return []

    @classmethod
    def same_run_as(cls, experiment_cfg) -> tuple[str, str] | None:
        """``(other attack, why)`` when this attack's run on ``experiment_cfg`` is, step for step, the run of
        ``other`` with the same parameters (e.g. APRIL without a PE term to read is DLG): the audit then runs it once
        and judges both on that run, provided the two runs' configs are equal but for the name
        (:func:`gradleak.run.audit.shared_runs`). Default: None (its own run)."""
        return None

    @classmethod
    def measurable(cls, experiment_cfg) -> bool:
        """False when the attack can find nothing to use in this setup's uploads whatever its parameters, decided from
        the model and its PEFT (the audit then reports it not applicable, with :meth:`not_measurable_reason`, and does
        not run it: ``undefined`` stays for a run that should have measured and did not). Default: True."""
        return True

    @classmethod
    def not_measurable_reason(cls, experiment_cfg) -> str:
        """Why :meth:`measurable` is False for this setup, in the user's words (what the architecture does not
        upload, and what would change that)."""
        return f"'{cls.name}' finds nothing it can use in this setup's uploads, whatever its parameters"

    @classmethod
    def from_config(cls, cfg: AttackConfig, ctx: AttackContext) -> "AttackBase":
        return cls(**cfg.model_dump())

    def rounds_wanted(self, fl_rounds: int) -> int:
        return fl_rounds

    def observes_round(self, round_index: int, total_rounds: int) -> bool:
        """Whether the attack reads round ``round_index``'s uploads (the runner keeps only those)."""
        return True

    def prepare(self, model, threat: ThreatModel):
        return model

    def server_model(self, round_index: int, model):
        return model

    def reconstruct(self, view) -> Reconstruction:  # pragma: no cover - abstract
        raise NotImplementedError
