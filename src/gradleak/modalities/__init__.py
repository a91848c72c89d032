"""Modalities as plug-ins (docs/DESIGN.md §7): each brings its data class, its input encoding and truth, what the
protocol makes public about its inputs, its public data and its accuracy, so ``run/`` composes them without
branching on a modality.

A modality is a module of this package that registers a :class:`Modality` subclass in :data:`MODALITIES` under the
name ``cfg.modality`` takes (``image``, ``text``); every module here is imported when the registry is first read.

A modality also owns its rules of the config (docs/DESIGN.md §4, §7), so :mod:`gradleak.config` names no modality:
which ``data.*`` / ``model.*`` fields are its own (:attr:`Modality.data_fields`, :attr:`Modality.model_fields`; a
field another modality owns is refused, naming it), the layer count the PEFT checks assume, its checks of the model's
shape, of its clients' training and of its public data, and its experiment presets (:func:`register_experiment`,
read from :data:`gradleak.registry.EXPERIMENTS`).
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import torch

from gradleak.errors import BadInput
from gradleak.registry import EXPERIMENTS, Registry


class Modality:
    """One input modality (a plug-in). Every hook receives the validated experiment ``cfg``."""

    name: ClassVar[str] = ""
    #: which seed decides the data split (``audit.json`` ``evidence_record.split_seeds.decided_by``)
    split_decided_by: ClassVar[str] = "run_seeds"
    #: the ``data.*`` fields that belong to this modality: set in an experiment of a modality that does not own them,
    #: they are refused, naming the field (:meth:`foreign_fields`)
    data_fields: ClassVar[frozenset[str]] = frozenset()
    #: the ``model.*`` fields that belong to this modality (refused likewise elsewhere)
    model_fields: ClassVar[frozenset[str]] = frozenset()
    #: the layers the model keeps when ``model.layers`` is not set, as the PEFT checks count them (None: the model's
    #: own depth, which the config does not decide)
    default_layers: ClassVar[int | None] = None

    # ---------------------------------------------------------------------------------------- the config's rules

    def foreign_fields(self, section: str) -> dict[str, list[str]]:
        """``section``'s (``data`` / ``model``) fields that other registered modalities own and this one does not,
        each with the names of its owners (the config refuses them in this modality's experiments)."""
        own = self.section_fields(section)
        out: dict[str, list[str]] = {}
        for e in MODALITIES:
            if e.name == self.name:
                continue
            for f in e.obj.section_fields(section) - own:
                out.setdefault(f, []).append(e.name)
        return out

    @classmethod
    def section_fields(cls, section: str) -> frozenset[str]:
        """The fields of config section ``section`` this modality owns (``data`` or ``model``; no other section has
        modality-owned fields)."""
        return {"data": cls.data_fields, "model": cls.model_fields}.get(section, frozenset())

    def refuse_foreign(self, section: str, given: set[str]) -> None:
        """BadInput naming the first (sorted) of the ``given`` fields of ``section`` that belong to another modality:
        it applies to that modality's experiments only."""
        foreign = self.foreign_fields(section)
        bad = sorted(f for f in given if f in foreign)
        if bad:
            other = " or ".join(foreign[bad[0]])
            raise BadInput(f"{section}.{bad[0]}", f"applies to {other} experiments only; this one works on {self.name}.",
                           f"remove it, or use experiment: {other}.")

    def check_peft(self, cfg) -> None:
        """The modality's refusals of the ``peft:`` section (after ``peft.check`` and ``model.adapter_bottleneck``)."""

    def check_architecture(self, cfg) -> None:
        """The modality's checks of the model's shape against its data (before the clients' plan is checked)."""

    def check_training(self, cfg) -> None:
        """The modality's checks of how its clients train, after the generic checks of the ``fl.client_*`` lists.
        By default per-client sample counts (``fl.client_images``) are refused: they are the image clients'."""
        if cfg.fl.client_images:
            raise BadInput("fl.client_images", "per-client image counts apply to image experiments.",
                           f"use data.batch_size (every client the same) for {self.name}.")

    def check_public_data(self, cfg) -> None:
        """The modality's check of the public data a server granted ``threat.public_data`` holds (after the threat
        model is resolved: ``cfg.threat_model``)."""

    # ------------------------------------------------------------------------------------------- the pipeline

    def data(self, cfg) -> Any:
        """The experiment's data (clients' batches, public data, nulls, test samples)."""
        raise NotImplementedError

    def attack_public(self, cfg, data, threat) -> dict[str, Any]:
        """What the server holds before any round beyond the protocol (public data the threat model grants)."""
        return {}

    def trial_knowledge(self, cfg, data, knowledge: dict) -> None:
        """Add per-trial facts the server is granted (e.g. a prior image) to ``knowledge`` in place."""

    def build_kwargs(self, cfg) -> dict[str, Any]:
        """Extra keyword arguments of :func:`gradleak.models.build` for this modality."""
        return {}

    def encode(self, handle, x, cfg, dev) -> tuple[torch.Tensor, Any, list[int]]:
        """One client's private samples ``x`` as ``(model inputs on dev, the truth's form of them, token lengths)``."""
        raise NotImplementedError

    def truth(self, handle, kept: list, raws: list, lengths: list[int], labels: torch.Tensor, threat, cfg,
              knowledge: dict) -> dict:
        """The truth of the observed update from ``kept`` (the observed clients' encoded forms), ``raws`` (every
        client's private samples as given) and ``lengths`` (every client's token lengths); adds the modality's facts
        to ``knowledge`` in place."""
        raise NotImplementedError

    def always_public(self, handle, cfg) -> dict[str, Any]:
        """The architecture's interface the protocol makes public."""
        return {}

    def loss_with_options(self, handle, options: dict[str, Any]):
        """The clients' loss shaped by a training-time defense's loss options (label smoothing, ...); a modality
        whose clients' loss takes no options refuses them (the defense's ``modalities`` normally stops it first)."""
        raise BadInput("defense.name", f"the training-time defense shapes the clients' loss ({', '.join(options)}), "
                       f"which the {self.name} clients' loss does not take.",
                       f"use a defense implemented for {self.name} clients (`gradleak list defenses`).")

    def accuracy(self, handle, model, cfg, test, dev) -> dict[str, float]:
        """``model``'s accuracy on held-out ``test`` samples."""
        raise NotImplementedError

    def eval_mode_for_release(self) -> bool:
        """Whether a released model is evaluated in eval mode (BatchNorm's running statistics)."""
        return False

    def timings(self, cfg, infos: list[dict], t_client: float, t_rec: float) -> dict[str, float]:
        """The modality's benchmark timing names."""
        return {}

    def details(self, cfg, evals, infos) -> dict[str, Any]:
        """The modality's entries of a result's ``details``."""
        return {}

    def bottleneck(self, cfg, handle) -> int | None:
        """The adapter bottleneck width of this modality's models."""
        return cfg.peft.bottleneck or 64

    def fixed_size(self, cfg) -> int | None:
        """How many samples a fixed data set holds (None: as many as asked)."""
        return None

    def training_pool(self, cfg) -> int | None:
        """How many samples the utility run can draw its clients' slices and test samples from (None: unbounded)."""
        return None

    def weight_files(self, cfg) -> list[dict]:
        """The model weights files this modality's model loader reads for ``cfg`` (``{"role", "path"}``, or with
        ``"error"`` when a file cannot be named); the evidence record hashes them."""
        return []

    def metric_files(self, cfg) -> list[dict]:
        """Weights files the modality's metrics read (``{"role", "path"}``)."""
        return []

    def has_batchnorm(self, cfg) -> bool:
        """Whether the configured model has BatchNorm layers (their running statistics travel in the upload)."""
        return False


MODALITIES: Registry[type[Modality]] = Registry("modality", home="gradleak.modalities._discover")


def register_experiment(name: str, summary: str, modality: str, defaults: dict[str, Any]) -> None:
    """Register the experiment preset ``name`` (``experiment: name``) of ``modality``: the config sections'
    ``defaults``, which the user's keys override (:func:`gradleak.config.schema.with_defaults`)."""
    EXPERIMENTS.register(name, summary)({"modality": modality, "defaults": defaults})


def modality_of(cfg_or_name) -> Modality:
    """The modality plug-in of a validated experiment (or of a modality name)."""
    name = cfg_or_name if isinstance(cfg_or_name, str) else cfg_or_name.modality
    return MODALITIES.get(name, "modality")()


def modality_data(cfg) -> Any:
    """The data of experiment ``cfg`` (its modality's data class)."""
    return modality_of(cfg).data(cfg)


@contextlib.contextmanager
def final_global_model(model, outcome, cfg, *, eval_mode: bool):
    """``model`` as the global model after the last round's aggregate (parameters stepped at the last round's lr, BN
    buffers by the mean change), optionally in eval mode; restored to what the server sent on exit."""
    from gradleak.fl.core import batchnorm_buffers
    from gradleak.fl.engines.builtin import apply_aggregate

    agg = outcome.last_aggregate
    lr = cfg.fl.lr_at(cfg.fl.rounds - 1)
    params = {n: p.detach().clone() for n, p in model.named_parameters() if n in agg.tensors}
    buffers = batchnorm_buffers(model)
    was = model.training
    try:
        apply_aggregate(model, agg, lr)
        if eval_mode:
            model.eval()
        yield model
    finally:  # leave the model as the server sent it (later trials restore it anyway)
        with torch.no_grad():
            named = dict(model.named_parameters())
            for n, v in params.items():
                named[n].copy_(v)
            nb = dict(model.named_buffers())
            for n, v in buffers.items():
                nb[n].copy_(v.to(nb[n].device))
        model.train(was)


def jsonable(d: dict) -> dict:
    """``d`` with tensors as lists (64 values at most) or their shape."""
    out = {}
    for k, v in d.items():
        if isinstance(v, torch.Tensor):
            v = v.tolist() if v.numel() <= 64 else f"tensor{tuple(v.shape)}"
        out[k] = v
    return out
