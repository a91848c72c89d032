"""Training-time defenses (the config's ``defense:`` section), as opposed to the update transforms of
``defenses:``. Each is registered in ``TRAINING_DEFENSES`` with a pydantic ``Config`` and may

* ``apply(handle, experiment_cfg)`` — change the model before training (FISGuard re-parameterises layers,
  dropout installs hooks);
* ``wrap_loss(loss_fn, model)`` — change the client's objective (L2, dropout's training switch);
* ``loss_options()`` — options of the task loss itself (label smoothing);
* ``report(rounds)`` — numbers about the observed updates (FISGuard's rank condition).

* ``local_update(client, model, seed=...)`` — replace the client's training step (DP-SGD).

MIA defenses compared in paper 004 (SPEC §5.3): FISGuard, DP-SGD (Opacus), L2 regularisation, dropout, label
smoothing. Min-max adversarial regularisation is not implemented yet (not registered, so a config asking for it
stops with the list of what exists).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field

from gradleak.errors import BadInput
from gradleak.registry import Registry

TRAINING_DEFENSES: Registry[Any] = Registry("training defense")


class DefenseParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TrainingDefense:
    Config: type[DefenseParams] = DefenseParams

    def __init__(self, cfg: DefenseParams):
        self.cfg = cfg

    def apply(self, handle, experiment_cfg) -> None:
        return None

    def wrap_loss(self, loss_fn, model):
        return loss_fn

    def loss_options(self) -> dict[str, Any]:
        return {}

    def report(self, rounds) -> dict[str, float]:
        return {}


@TRAINING_DEFENSES.register("none", "no training-time defense")
class NoDefense(TrainingDefense):
    pass


class FISGuardParams(DefenseParams):
    rank: int = Field(64, ge=1, description="r: dimension of every fixed input subspace")
    public: Optional[str] = Field(None, description="public text set for Q (default: one disjoint from data.name)")
    public_size: int = Field(2000, ge=1, description="public samples stacked for the SVD (paper: 2,000)")
    protect_head: bool = Field(False, description="also give the task head a fixed input (rank head_rank)")
    head_rank: Optional[int] = Field(None, ge=1, description="r of the head (default: rank)")


PUBLIC_TEXT_DEFAULTS = ("wordnet-examples", "news-sentences", "rt-sentences")


@TRAINING_DEFENSES.register("fisguard", "FISGuard: fixed input subspaces (Q from public data, U = 0 trained)")
class FISGuard(TrainingDefense):
    Config = FISGuardParams

    def apply(self, handle, experiment_cfg) -> None:
        from gradleak.data.text import load_text
        from gradleak.peft.fisguard import apply_fisguard

        c = self.cfg
        private = experiment_cfg.data.name
        name = c.public
        if name is None:
            name = next(n for n in PUBLIC_TEXT_DEFAULTS if n != private)
        if name == private:
            raise BadInput("defense.public", f"the public set '{name}' is the clients' data set.",
                           f"use an independent set, e.g. {next(n for n in PUBLIC_TEXT_DEFAULTS if n != private)}.")
        ds = load_text(name)
        texts, _ = ds.batch(min(c.public_size, len(ds)), seed=experiment_cfg.seed + 99)
        self.public_name = name
        self.layers = apply_fisguard(handle, base_kind=experiment_cfg.peft.kind, rank=c.rank, public_texts=list(texts),
                                     protect_head=c.protect_head, head_rank=c.head_rank)

    def report(self, rounds) -> dict[str, float]:
        from gradleak.peft.fisguard import rank_report

        checks = [v for r in rounds for u in r for v in rank_report(u.tensors, self.layers).values()]
        if not checks:
            return {}
        return {"fisguard_rank_condition_rate": sum(c["condition_holds"] for c in checks) / len(checks),
                "fisguard_min_rank_G_U": float(min(c["rank_G_U"] for c in checks)), "fisguard_r": float(self.cfg.rank)}


class L2Params(DefenseParams):
    coefficient: float = Field(1e-3, ge=0, le=1e6, description="λ in loss + λ·‖θ_trainable‖²")


@TRAINING_DEFENSES.register("l2", "L2 regularisation of the trainable parameters")
class L2(TrainingDefense):
    Config = L2Params

    def wrap_loss(self, loss_fn, model):
        lam = self.cfg.coefficient

        def loss(m, x, y):
            reg = sum((p.double() ** 2).sum() for p in m.parameters() if p.requires_grad)
            return loss_fn(m, x, y) + lam * reg.to(torch.get_default_dtype())

        return loss


class DropoutParams(DefenseParams):
    rate: float = Field(0.1, ge=0, lt=1, description="dropout on the inputs of every trainable linear layer")


@TRAINING_DEFENSES.register("dropout", "dropout on the inputs of the trainable layers during client training")
class Dropout(TrainingDefense):
    Config = DropoutParams

    def apply(self, handle, experiment_cfg) -> None:
        self.active = False
        p = self.cfg.rate
        for m in handle.model.modules():
            if isinstance(m, torch.nn.Linear) and any(q.requires_grad for q in m.parameters(recurse=False)):
                m.register_forward_pre_hook(lambda mod, args: (torch.nn.functional.dropout(args[0], p, True),) + args[1:]
                                            if self.active else None)

    def wrap_loss(self, loss_fn, model):
        def loss(m, x, y):
            self.active = True
            try:
                return loss_fn(m, x, y)
            finally:
                self.active = False

        return loss


class LabelSmoothingParams(DefenseParams):
    factor: float = Field(0.1, ge=0, lt=1, description="label smoothing of the task loss")


@TRAINING_DEFENSES.register("label_smoothing", "label smoothing of the clients' cross-entropy")
class LabelSmoothing(TrainingDefense):
    Config = LabelSmoothingParams

    def loss_options(self) -> dict[str, Any]:
        return {"label_smoothing": self.cfg.factor}


class DPSGDParams(DefenseParams):
    noise_multiplier: float = Field(1.0, ge=0, le=1e4, description="σ: noise std = σ · max_grad_norm")
    max_grad_norm: float = Field(1.0, gt=0, description="C: per-sample gradient clipping norm")
    delta: float = Field(1e-5, gt=0, lt=1, description="δ of the reported (ε, δ)")


@TRAINING_DEFENSES.register("dpsgd", "DP-SGD (Opacus per-sample gradients): clip each sample to C, add N(0, σ²C²)")
class DPSGD(TrainingDefense):
    """DP-SGD as the client's local step (FedSGD): Opacus' ``GradSampleModule`` gives per-sample gradients of
    the trainable parameters, each clipped to ``max_grad_norm`` in total L2 norm; their sum plus Gaussian
    noise of std σ·C, divided by B, is the upload. ε is accounted by Opacus' RDP accountant per client with
    sampling rate 1 (each client uses its whole local batch every round), one step per round, and reported
    as ``metrics.dp_epsilon`` at ``delta``."""

    Config = DPSGDParams

    def apply(self, handle, experiment_cfg) -> None:
        try:
            import opacus  # noqa: F401
        except ModuleNotFoundError:
            raise BadInput("defense.name", "DP-SGD needs the `opacus` package.", "pip install 'gradleak[dp]'.") from None
        if experiment_cfg.fl.algorithm != "fedsgd":
            raise BadInput("fl.algorithm", "the DP-SGD defense is implemented for FedSGD clients (one local step).",
                           "use fl.algorithm=fedsgd.")
        self.rounds = 0
        self.seed = experiment_cfg.seed

    def local_update(self, client, model, *, seed: int, **_: Any):
        from opacus import GradSampleModule

        from gradleak.fl.core import Update

        c = self.cfg
        model.train()
        gsm = GradSampleModule(model, batch_first=True, loss_reduction="mean")
        x, y = client._inputs, client._labels
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        params = [p for p in model.parameters() if p.requires_grad]
        loss = client.loss_fn(gsm, x, y)
        loss.backward()
        per = [p.grad_sample.reshape(len(x), -1).double() for p in params]  # B × |p| each
        norms = torch.sqrt(sum((g ** 2).sum(1) for g in per))
        scale = (c.max_grad_norm / norms.clamp_min(1e-12)).clamp(max=1.0)
        gen = torch.Generator().manual_seed(int(self.seed) * 1_000_003 + int(client.client_id) * 7_919 + int(seed))
        tensors = {}
        for n, p, g in zip(names, params, per):
            summed = (g * scale[:, None]).sum(0)
            noise = torch.randn(summed.shape, generator=gen, dtype=torch.float64) * (c.noise_multiplier * c.max_grad_norm)
            tensors[n] = ((summed + noise) / len(x)).reshape(p.shape).to(p.dtype)
        gsm._close()
        model.eval()
        if client.client_id == 0:
            self.rounds += 1
        return Update(tensors, len(x), client.client_id, "gradient", 1)

    def report(self, rounds) -> dict[str, float]:
        from opacus.accountants import RDPAccountant

        if self.cfg.noise_multiplier == 0:
            self.rounds = 0
            return {"dp_epsilon": float("inf")}
        acc = RDPAccountant()
        for _ in range(max(self.rounds, 1)):
            acc.step(noise_multiplier=self.cfg.noise_multiplier, sample_rate=1.0)
        out = {"dp_epsilon": float(acc.get_epsilon(self.cfg.delta)), "dp_rounds": float(self.rounds)}
        self.rounds = 0  # reported once per trial; the next trial trains from the start again
        return out
