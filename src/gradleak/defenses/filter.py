"""RDLV-threshold filter: a client withholds an update that its own audit judges to leak.

Hatamizadeh et al. 2022 (arXiv:2202.06924 §III-E, NVFlare's ``RelativeDataLeakageValueFilter``): before
uploading, the client attacks its own update exactly as the honest-but-curious server would and measures the
relative data leakage value of the reconstruction against its own images; when the RDLV's lower 95 % bootstrap
bound exceeds ``threshold`` the update is not sent this round (the round protocol records it in
``RoundsOutcome.withheld`` and aggregates the other clients only).

The audit reuses the attack, found by name in :data:`gradleak.registry.ATTACKS` (``bn_inversion``; defenses sit below
attacks in the pipeline, so they never import one): its ``_invert`` (simulation from the
received checkpoint, BN targets from the client's own buffer change, the dataset-mean prior the pipeline computes,
Adam on images and soft labels), fed with a minimal server view (the checkpoint the client received, the class
count) and the client's public training configuration (its batch size, epochs, this round's lr); the RDLV is
:func:`gradleak.metrics.leakage.rdlv` with the evaluation's settings (``metrics.leakage_ssim``, best matching).

Decisions recorded:

* **Which attack.** ``attack:`` (a dict validated into the registered attack's ``Config``, ``BNInversionConfig``)
  on top of the experiment's own attack settings when that attack is ``bn_inversion`` (else its defaults);
  ``iterations`` (default 100) sets the audit's iterations unless only ``attack.iterations`` is given. With the
  experiment's attack settings and iterations the audit reproduces the server's reconstruction (CPU,
  deterministic). The ``attack.rounds`` / ``attack.clients`` of the experiment are ignored (``rounds`` /
  ``clients`` here choose what is audited); an inherited ``stale_checkpoint`` ablation is reset to ``none`` (the
  client knows its checkpoint) and refused when asked for here.
* **What is audited.** The client's update before the ``defenses:`` update transforms (the protocol applies them
  after the training-time defense): noise transforms only lower the leakage the audit sees without them.
* **Undefined RDLV** (SSIM(prior, x) ≤ 0 for every image: NaN bound): ``on_undefined`` (default ``withhold``,
  fail-safe).
* **Cost.** The audit runs inside the client's step: ``client_step_seconds`` includes it
  (``filter_audit_seconds`` reports it separately).
"""

from __future__ import annotations

import math
import time
from types import SimpleNamespace
from typing import Any, Literal, Optional

import torch
from pydantic import Field, ValidationError

from gradleak.defenses.base import DefenseParams, TrainingDefense
from gradleak.errors import BadInput, describe_validation_error
from gradleak.registry import ATTACKS, DEFENSES

#: the registered attack the client audits its update with
AUDIT_ATTACK = "bn_inversion"


class RDLVFilterParams(DefenseParams):
    threshold: float = Field(0.0, description="withhold the update when the audit's RDLV lower 95 % bound > threshold")
    iterations: int = Field(100, ge=1, le=1_000_000, description="iterations of the self-audit inversion")
    rounds: Optional[list[int]] = Field(None, description="rounds to audit, 0-based, negative from the end (default: all)")
    clients: Optional[list[int]] = Field(None, description="client ids that audit (default: all)")
    bootstrap: int = Field(1000, ge=1, le=1_000_000, description="bootstrap resamples of the RDLV interval")
    confidence: float = Field(0.95, gt=0, lt=1, description="confidence of the RDLV interval")
    seed: Optional[int] = Field(None, ge=0, description="bootstrap seed (default: the experiment's seed, as the evaluation)")
    on_undefined: Literal["withhold", "send"] = Field("withhold", description="an undefined RDLV (SSIM(prior, x) ≤ 0)")
    attack: dict[str, Any] = Field(default_factory=dict, description="bn_inversion settings of the audit (default: the "
                                   "experiment's attack settings when it is bn_inversion)")


def _check_bn(model, field: str = "model.name") -> None:
    from gradleak.models.batchnorm import batchnorm_layers

    try:
        batchnorm_layers(model, field=field)
    except BadInput as err:
        raise BadInput(field, "the RDLV filter audits updates with the BN-aware inversion, which reads BatchNorm "
                       f"running statistics, and the model ({type(model).__name__}) has no BatchNorm layer.",
                       "use a BatchNorm model (model.name: resnet18, model.norm: batch), or audit with the matching "
                       "term alone (defense.attack.ablation=gradient_only).") from err


@DEFENSES.register("rdlv_filter", "RDLV filter (Hatamizadeh et al. 2022): each client inverts its own update "
                            "with the BN-aware attack and withholds it when the RDLV lower 95 % bound > threshold")
class RDLVFilter(TrainingDefense):
    Config = RDLVFilterParams
    modalities = ("image",)
    changes_upload = True  # it withholds what leaks: the upload differs from the plain client's
    advice = ({"stage": "training", "param": "threshold", "weak": 1.0, "strong": 0.0, "scale": "lin", "fixed": {},
               "requires": "batchnorm", "order": 10, "rank": 10,
               "what": "RDLV threshold: a client withholds an update whose self-audit's RDLV lower 95 % bound exceeds it"},)

    def setup(self) -> None:
        cfg = self.cfg
        if not math.isfinite(cfg.threshold):
            raise BadInput("defense.threshold", f"the RDLV threshold must be a finite number, got {cfg.threshold}.",
                           "use e.g. 0 (withhold what leaks beyond the prior).")
        if cfg.attack.get("ablation") == "stale_checkpoint":
            raise BadInput("defense.attack.ablation", "the client audits with the checkpoint it received; a stale "
                           "checkpoint is not available to it.", "use another ablation (or none).")
        if "iterations" in cfg.attack and "iterations" in cfg.model_fields_set \
                and cfg.attack["iterations"] != cfg.iterations:
            raise BadInput("defense.iterations", f"set to {cfg.iterations} and defense.attack.iterations to "
                           f"{cfg.attack['iterations']}.", "set only one of them.")
        self.attack_cfg = self._attack_config({})  # validates defense.attack
        self.num_classes: Optional[int] = None
        self.total_rounds: Optional[int] = None
        self.bootstrap_seed = cfg.seed if cfg.seed is not None else 0
        self.ssim = "gaussian"
        self.data = None
        self._rounds = self._resolve_rounds()
        self._reset()

    def _reset(self) -> None:
        self.records: dict[tuple[int, int], dict[str, Any]] = {}
        self.seen: set[int] = set()
        self.audit_seconds = 0.0

    def _attack_config(self, base: dict):
        config_cls = ATTACKS.get(AUDIT_ATTACK).Config
        merged = {k: v for k, v in base.items() if k not in ("rounds", "clients")}
        if merged.get("ablation") == "stale_checkpoint":
            merged["ablation"] = "none"
        merged["iterations"] = self.cfg.iterations
        merged.update(self.cfg.attack)  # attack.iterations wins only where `iterations` is not set (else refused)
        try:
            return config_cls(**merged)
        except ValidationError as err:
            bad = describe_validation_error(err)
            raise BadInput(f"defense.attack.{bad.field}", bad.problem,
                           f"settings of {AUDIT_ATTACK}: {', '.join(config_cls.model_fields)}.") from None

    # ---- pipeline hooks
    def apply(self, handle, experiment_cfg, data=None) -> None:
        base = {}
        if getattr(experiment_cfg.attack, "name", None) == AUDIT_ATTACK and experiment_cfg.attack_cfg is not None:
            base = experiment_cfg.attack_cfg.model_dump()
        self.attack_cfg = self._attack_config(base)
        self._check_model(handle.model)
        self.num_classes = int(experiment_cfg.model.num_classes)
        self.total_rounds = int(experiment_cfg.fl.rounds)
        self.bootstrap_seed = self.cfg.seed if self.cfg.seed is not None else int(experiment_cfg.seed)
        self.ssim = experiment_cfg.metrics.leakage_ssim
        if self.attack_cfg.prior == "dataset_mean" and not getattr(data, "wants_prior", False):
            raise BadInput("defense.attack.prior", "the audit's prior is the dataset mean image, which this experiment "
                           "does not draw (its attack reads no prior).", "use defense.attack.prior=gray, or the "
                           "bn_inversion attack.")
        self.data = data
        self._rounds = self._resolve_rounds()
        self._reset()

    def _resolve_rounds(self) -> Optional[set[int]]:
        if self.cfg.rounds is None:
            return None
        total = self.total_rounds
        out = set()
        for r in self.cfg.rounds:
            if total is None:  # outside the pipeline (before apply): a negative round is resolved at apply
                out.add(r)
                continue
            rr = r + total if r < 0 else r
            if not 0 <= rr < total:
                raise BadInput("defense.rounds", f"round {r} does not exist (fl.rounds = {total}).",
                               f"use rounds in 0..{total - 1} (or negative from the end).")
            out.add(rr)
        return out

    def prior(self, shape) -> torch.Tensor:
        """The audit's prior image (C×H×W in [0, 1]): the pipeline's dataset mean image, or grey."""
        if self.attack_cfg.prior == "gray":
            return torch.full(tuple(shape), 0.5)
        p = self.data.prior_image() if self.data is not None else None
        if p is None:
            raise BadInput("defense.attack.prior", "the audit's prior is the dataset mean image, which is not available.",
                           "use defense.attack.prior=gray, or run through the pipeline with the bn_inversion attack.")
        return torch.as_tensor(p, dtype=torch.float32)

    def _check_model(self, model) -> None:
        if self.attack_cfg.ablation != "gradient_only":  # the matching term alone reads no BN statistics
            _check_bn(model)

    def audits(self, round_index: int, client_id: int) -> bool:
        return ((self._rounds is None or round_index in self._rounds)
                and (self.cfg.clients is None or client_id in self.cfg.clients))

    def local_update(self, client, model, *, seed: int, algorithm: str = "fedavg", lr: float = 0.01,
                     round_index: int = 0, epochs: int = 1, batch_size: Optional[int] = None, **_: Any):
        from gradleak.metrics.leakage import rdlv

        if algorithm not in ("fedavg", "fedsgd"):
            raise BadInput("fl.algorithm", f"the RDLV filter audits fedavg or fedsgd updates, not '{algorithm}'.",
                           "use fl.algorithm=fedavg or fedsgd.")
        self._check_model(model)
        cid, r = int(client.client_id), int(round_index)
        self.seen.add(cid)
        audit = self.audits(r, cid)
        state = ({n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
                 if audit else None)  # the checkpoint the client received (training is in place)
        upd = client.local_update(model, algorithm=algorithm, epochs=epochs, lr=lr, batch_size=batch_size, seed=seed,
                                  in_place=True)
        if not audit:
            return upd
        t0 = time.perf_counter()
        images = ((client._inputs.detach().to("cpu", torch.float64) + 1) / 2).clamp(0, 1)  # inputs are 2x − 1
        prior = self.prior(images.shape[1:])
        num_classes = self.num_classes
        if num_classes is None:
            with torch.no_grad():
                was = model.training
                model.eval()
                out = model(client._inputs[:1])
                model.train(was)
            num_classes = int((out.logits if hasattr(out, "logits") else out).shape[-1])
        fl = {"algorithm": algorithm, "local_batch_size": batch_size, "local_epochs": epochs,
              "lr_at": [float(lr)] * (r + 1)}
        attacker = ATTACKS.get(AUDIT_ATTACK)(self.attack_cfg, fl=fl, device=next(model.parameters()).device)
        view = SimpleNamespace(model=model, public={"num_classes": num_classes, "image_shape": tuple(images.shape[1:])})
        was_training = model.training
        try:
            d = attacker.invert(view, upd, state, r, prior)
        finally:
            model.train(was_training)
        res = rdlv(d["images"].to(torch.float64), images, prior, ssim=self.ssim, match="best",
                   confidence=self.cfg.confidence, resamples=self.cfg.bootstrap, seed=self.bootstrap_seed)
        low = float(res.low)
        withhold = (low > self.cfg.threshold) if math.isfinite(low) else (self.cfg.on_undefined == "withhold")
        self.audit_seconds += time.perf_counter() - t0
        self.records[(r, cid)] = {"rdlv": float(res.mean), "rdlv_low": low, "rdlv_high": float(res.high),
                                  "withheld": bool(withhold), "reconstruction": d["images"], "prior": prior}
        return None if withhold else upd

    def report(self, rounds) -> dict[str, float]:
        recs = self.records
        out = {"filter_withheld": float(sum(v["withheld"] for v in recs.values())),
               "filter_audited": float(len(recs)), "filter_threshold": float(self.cfg.threshold),
               "filter_audit_seconds": float(self.audit_seconds)}
        for c in sorted(self.seen | {c for _, c in recs}):
            mine = [(r, v) for (r, cc), v in sorted(recs.items()) if cc == c]
            out[f"filter_withheld_client{c}"] = float(sum(v["withheld"] for _, v in mine))
            if mine:
                out[f"filter_rdlv_low_client{c}"] = mine[-1][1]["rdlv_low"]
        self._reset()  # reported once per trial; the next trial's clients start afresh
        return out


__all__ = ["RDLVFilter", "RDLVFilterParams"]
