"""What the server knows of every declared defense, resolved once (docs/DESIGN.md §6-§7: attack at full strength).

A deployment's privacy mechanism is public: the server runs the protocol, so it knows the update defenses of the
``defenses:`` list, the training-time ``defense:`` section (DP-SGD's noise multiplier and clipping norm, FISGuard,
…), whether uploads are summed by secure aggregation (and over how many clients), and a framework's DP wrapper
(Flower's ``fl.flower.dp``). :func:`declared_defenses` turns all of it into one :class:`DeclaredDefenses`, the
object every attack's full-strength settings derive from:

* ``noise_std(update, individual, tensor)`` -- the per-coordinate std of the Gaussian noise on an observed upload
  (or on the observed mean of the clients' uploads under secure aggregation), from each defense's
  :meth:`~gradleak.defenses.base.Defense.observed_noise_variance`; ``None`` when nothing adds noise, and
  ``noise_unknown`` when a defense adds noise whose scale the server cannot compute (percentile noise;
  stochastic rounding of a summed upload): the attack then reads the level off the upload's spectrum.
  ``noise_per_tensor``: a defense's noise differs per tensor (stochastic rounding of an individual upload: the
  step of each observed tensor), so an attack passes the ``tensor`` whose spectrum it cuts;
* ``clip_norm`` -- the L2 bound of an upload (update clipping) or of each sample's gradient (DP-SGD);
* ``sparsity`` -- top-k pruning: the kept fraction and its scope (``global`` / ``per_tensor``); the server sees
  the retained support (the upload's nonzero coordinates), which the sparsity-aware tests use;
* ``quant_bits`` -- stochastic quantisation's levels per tensor (the step is (max - min) / (2^bits - 1), read off
  the observed tensor's own range; its rounding noise, step² / 6 per coordinate, is ``noise_std(..., tensor)``);
* ``error_std(update, individual, tensor)`` -- the noise and the bounded, non-Gaussian errors together (top-k
  pruning: each dropped coordinate <= the kept threshold t, scale t, read off the upload): the edge of the
  information limit, never a Gaussian test's noise;
* ``summed`` -- how many clients' uploads the server sees only as their sum (1: individual uploads).

Each defense contributes through two hooks of :class:`~gradleak.defenses.base.Defense`: ``server_knowledge()``
(the non-noise facts above) and ``observed_noise_variance(...)`` (the noise), so a new defense is one module and
its tests; this file composes.

DP-SGD (Abadi et al. 2016; :class:`gradleak.defenses.training.DPSGD`): each step's private gradient is
(Σ_i clip_C(g_i) + N(0, σ²C²)) / B, so a FedSGD upload carries per-coordinate noise σC/B, and a FedAvg
pseudo-gradient of K steps (their sum) σC√K / b for the minibatch size b.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from gradleak.defenses.base import Defense, TrainingDefense, UpdateDefense, build_defense_section, build_defenses


@dataclass
class DeclaredDefenses:
    """Every declared defense, as the server knows it (module docstring)."""

    update: list[UpdateDefense] = field(default_factory=list)
    training: Optional[TrainingDefense] = None
    secure_aggregation: bool = False
    clients: int = 1
    algorithm: str = "fedsgd"
    local_batch_size: Optional[int] = None
    #: Flower's own DP (``fl.flower.dp`` and its parameters), when the Flower engine runs it
    framework_dp: Optional[dict[str, Any]] = None
    #: the learning rate of the upload's round (Flower's DP acts on Δw = lr × the upload)
    lr: float = 1.0
    names: list[str] = field(default_factory=list)

    # ------------------------------------------------------------------------------------------ derived facts
    def _all(self) -> list[Defense]:
        out: list[Defense] = list(self.update)
        if self.training is not None:
            out.append(self.training)
        return out

    def _facts(self) -> dict[str, Any]:
        facts: dict[str, Any] = {}
        for d in self._all():
            for k, v in (d.server_knowledge() or {}).items():
                if k == "clip_norm" and "clip_norm" in facts:
                    facts[k] = min(facts[k], v)
                else:
                    facts[k] = v
        return facts

    @property
    def clip_norm(self) -> Optional[float]:
        return self._facts().get("clip_norm")

    @property
    def per_sample_clip_norm(self) -> Optional[float]:
        return self._facts().get("per_sample_clip_norm")

    @property
    def sparsity(self) -> Optional[dict[str, Any]]:
        return self._facts().get("sparsity")

    @property
    def quant_bits(self) -> Optional[int]:
        return self._facts().get("quant_bits")

    @property
    def summed(self) -> int:
        return self.clients if self.secure_aggregation else 1

    @property
    def noise_per_tensor(self) -> bool:
        """A declared defense adds noise whose scale differs per tensor (stochastic rounding): :meth:`noise_std`
        needs the observed tensor's name, and is None without it."""
        return bool(self._facts().get("noise_per_tensor"))

    @property
    def noise_unknown(self) -> bool:
        """A declared defense adds noise whose scale the server cannot compute from the protocol (percentile noise;
        per-tensor noise read off an individual upload, stochastic rounding, when the server sees only the sum of
        several clients' uploads): the attack must read it off the upload's spectrum."""
        facts = self._facts()
        return bool(facts.get("noise_unknown")) or (bool(facts.get("noise_per_tensor")) and self.summed > 1)

    @property
    def adds_noise(self) -> bool:
        return bool(self._facts().get("adds_noise")) or self.noise_unknown or self._framework_noise(True) > 0 \
            or self._framework_noise(False) > 0

    def _framework_noise(self, individual: bool, aggregate_of: int = 1) -> float:
        f = self.framework_dp
        if not f or f.get("dp", "none") == "none":
            return 0.0
        lr = self.lr or 1.0
        if f["dp"] == "local":  # LocalDpMod: Gaussian noise of std sensitivity sqrt(2 ln(1.25/δ)) / ε on Δw
            import math

            std = f["local_sensitivity"] * math.sqrt(2 * math.log(1.25 / f["local_delta"])) / f["local_epsilon"] / lr
            return std * std / (1 if individual else aggregate_of)
        if individual:  # server-side noise: the raw reply carries none
            return 0.0
        std = f["noise_multiplier"] * f["clipping_norm"] / max(aggregate_of, 1) / lr
        return std * std

    def noise_std(self, update: Any, individual: Optional[bool] = None,
                  tensor: Optional[str | Sequence[str]] = None) -> Optional[float]:
        """Per-coordinate std of the Gaussian noise on the observed ``update`` (an individual upload, or under
        secure aggregation the mean of ``clients`` uploads); None when no declared defense adds noise of a scale the
        server can compute. ``tensor``: the observed tensor it is for (per-tensor noise, ``noise_per_tensor``, is
        read off it; without it that part counts as unknown), or several names, whose variances are pooled
        weighted by their sizes (the std of the noise on their concatenation)."""
        if tensor is not None and not isinstance(tensor, str):
            names = list(tensor)
            sizes = [int(update.tensors[n].numel()) if n in update.tensors else 0 for n in names]
            if not names or sum(sizes) == 0:
                return self.noise_std(update, individual)
            var = sum(sz * (self.noise_std(update, individual, n) or 0.0) ** 2 for n, sz in zip(names, sizes))
            var /= sum(sizes)
            return var ** 0.5 if var > 0 else None
        if individual is None:
            individual = not self.secure_aggregation
        agg = 1 if individual else max(self.clients, 1)
        var = 0.0
        for d in self._all():
            extra = {"local_batch_size": self.local_batch_size} if isinstance(d, TrainingDefense) else {}
            if getattr(d, "observed_noise_needs_lr", False):
                extra["lr"] = self.lr
            v = d.observed_noise_variance(update, aggregate_of=agg, individual=individual, tensor=tensor, **extra)
            var += float(v) if v is not None else 0.0  # None: a scale the server cannot know (noise_unknown)
        var += self._framework_noise(individual, agg)
        return var ** 0.5 if var > 0 else None  # an unknown part (noise_unknown) is left to the spectrum

    def error_std(self, update: Any, individual: Optional[bool] = None,
                  tensor: Optional[str] = None) -> Optional[float]:
        """Per-coordinate scale of everything the declared defenses put on the observed ``tensor``: the Gaussian noise
        (:meth:`noise_std`) and the bounded errors (top-k pruning's dropped coordinates, each <= the kept threshold:
        :meth:`~gradleak.defenses.base.UpdateDefense.observed_error_variance`), added in variance. The scale of the
        information limit's edge (:func:`gradleak.attacks.common.subspace.spectral_margin`); never the noise of a
        Gaussian test. None when neither is declared or readable."""
        if individual is None:
            individual = not self.secure_aggregation
        agg = 1 if individual else max(self.clients, 1)
        noise = self.noise_std(update, individual, tensor)
        var = (noise or 0.0) ** 2
        for d in self._all():
            f = getattr(d, "observed_error_variance", None)
            if f is None and hasattr(d, "transform"):  # an update defense named in the defense: section
                f = getattr(d.transform, "observed_error_variance", None)
            v = f(update, aggregate_of=agg, individual=individual, tensor=tensor) if f is not None else 0.0
            var += float(v) if v is not None else 0.0
        return var ** 0.5 if var > 0 else None

    def __bool__(self) -> bool:
        """True when a declared defense changes what the server observes (the audit then runs full-strength
        variants)."""
        return bool(self.update) or (self.training is not None and self.training.changes_upload) \
            or self.secure_aggregation or bool(self.framework_dp and self.framework_dp.get("dp", "none") != "none")

    def as_dict(self) -> dict[str, Any]:
        """JSON summary (audit.json, the report's setup)."""
        return {"defenses": list(self.names), "secure_aggregation": self.secure_aggregation, "summed": self.summed,
                "adds_noise": self.adds_noise, "noise_unknown": self.noise_unknown,
                "noise_per_tensor": self.noise_per_tensor, "clip_norm": self.clip_norm,
                "per_sample_clip_norm": self.per_sample_clip_norm, "sparsity": self.sparsity,
                "quant_bits": self.quant_bits,
                "framework_dp": (self.framework_dp or {}).get("dp") if self.framework_dp else None}


def as_declared(defenses: Any) -> DeclaredDefenses:
    """A :class:`DeclaredDefenses` from what a caller holds: one already, or a ``defenses:`` list of entries."""
    if isinstance(defenses, DeclaredDefenses):
        return defenses
    entries = list(defenses or [])
    built = build_defenses(entries)
    return DeclaredDefenses(update=built, names=[d["name"] if isinstance(d, dict) else d.name for d in entries])


def view_declared(view: Any) -> DeclaredDefenses:
    """The declared defenses a server view carries (``view.public["declared_defenses"]``, set by the pipeline); a
    view built without them (a test, an integration's own view) falls back to its published update list and client
    count."""
    declared = view.public.get("declared_defenses")
    if declared is None:
        declared = as_declared(view.public.get("update_defenses") or [])
        declared.clients = int(view.public.get("clients") or 1)
    return declared


def view_noise_std(view: Any, update: Any = None, tensor: Optional[str | Sequence[str]] = None) -> Optional[float]:
    """Per-coordinate std of the declared noise on ``update`` (default: the view's first) as the server observes
    it: an individual upload, or under secure aggregation the mean of the clients' uploads; None: no noise of a
    known scale (:meth:`DeclaredDefenses.noise_std`). ``tensor``: the name (or names) of the observed tensor the
    attack cuts the spectrum of (stochastic rounding's noise is read off each tensor's own step)."""
    update = update if update is not None else (view.updates[0] if view.updates else None)
    if update is None:
        return None
    return view_declared(view).noise_std(update, individual=not view.secure_aggregation, tensor=tensor)


def view_error_std(view: Any, update: Any = None, tensor: Optional[str] = None) -> Optional[float]:
    """:meth:`DeclaredDefenses.error_std` of ``update`` (default: the view's first) as the server observes it: the
    declared noise and the bounded errors (top-k pruning) together, the scale of the information limit's edge."""
    update = update if update is not None else (view.updates[0] if view.updates else None)
    if update is None:
        return None
    return view_declared(view).error_std(update, individual=not view.secure_aggregation, tensor=tensor)


def declared_defenses(cfg: Any, seed: Optional[int] = None) -> DeclaredDefenses:
    """Resolve every defense a validated experiment config declares (module docstring)."""
    seed = cfg.seed if seed is None else seed
    entries = [d.model_dump() for d in cfg.defenses]
    update = build_defenses(entries, seed=seed)
    names = [f"{e['name']} (update)" for e in entries]
    training = getattr(cfg, "training_defense", None)
    if training is None and getattr(cfg, "defense", None) is not None:
        training = build_defense_section(cfg.defense, getattr(cfg, "modality", "text"), seed=seed)
    tname = getattr(getattr(cfg, "defense", None), "name", "none")
    if training is not None and tname != "none":
        names.append(f"{tname} (training)")
    else:
        training = None
    fl = cfg.fl
    framework = None
    from gradleak.fl.engines import engine_of

    own = engine_of(getattr(fl, "engine", "builtin")).framework_dp(fl)  # the engine's own DP (Flower's wrappers)
    if own is not None:
        names.append(own[0])
        framework = own[1]
    if fl.secure_aggregation:
        names.append(f"secure aggregation over {fl.clients} client(s)")
    return DeclaredDefenses(update=update, training=training, secure_aggregation=bool(fl.secure_aggregation),
                            clients=int(fl.clients), algorithm=fl.algorithm, local_batch_size=fl.local_batch_size,
                            framework_dp=framework, lr=float(fl.lr), names=names)


__all__ = ["DeclaredDefenses", "as_declared", "declared_defenses", "view_declared", "view_error_std",
           "view_noise_std"]
