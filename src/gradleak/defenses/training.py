"""Training-time defenses (stage ``training`` of :mod:`gradleak.defenses.base`; the config's ``defense:`` section),
as opposed to the update transforms of ``defenses:`` (:mod:`gradleak.defenses.update`). Each is registered in
:data:`gradleak.registry.DEFENSES` with a pydantic ``Config`` and overrides the hooks it needs of
:class:`~gradleak.defenses.base.TrainingDefense`:

* ``apply(handle, experiment_cfg, data=None)`` — change the model before training (FISGuard re-parameterises
  layers, dropout installs hooks); ``data`` is the experiment's data source (min-max draws its reference set);
* ``wrap_loss(loss_fn, model)`` — change the client's objective (L2, dropout's training switch);
* ``loss_options()`` — options of the task loss itself (label smoothing);
* ``report(rounds)`` — numbers about the observed updates (FISGuard's rank condition);
* ``layer_condition(rounds)`` — per protected layer, whether the defense's guarantee held (the evaluation splits
  the per-layer AUCs by it);
* ``local_update(client, model, seed=...)`` — replace the client's training step (DP-SGD, min-max, the RDLV filter
  of :mod:`gradleak.defenses.filter`).

MIA defenses compared in paper 004 (FISGuard paper Sec. V-A): FISGuard, DP-SGD (Opacus), L2 regularisation, dropout, label
smoothing and min-max adversarial regularisation (Nasr et al. 2018), each registered here. Hatamizadeh et al.'s
percentile noise, which the ``defense:`` section also takes, is the update transform
:class:`gradleak.defenses.update.PercentileNoise`.
"""

from __future__ import annotations

from typing import Annotated, Any, Optional

import torch
from pydantic import Field

from gradleak.defenses.base import DefenseParams, TrainingDefense
from gradleak.errors import BadInput
from gradleak.registry import DEFENSES


@DEFENSES.register("none", "no training-time defense")
class NoDefense(TrainingDefense):
    protects = False
    modalities = None


class FISGuardParams(DefenseParams):
    rank: int = Field(64, ge=1, description="r: dimension of every fixed input subspace")
    public: Optional[str] = Field(None, description="public text set for Q (default: one disjoint from data.name)")
    public_size: int = Field(2000, ge=1, description="public samples stacked for the SVD (paper: 2,000)")
    protect_head: bool = Field(False, description="also give the task head a fixed input (rank head_rank)")
    head_rank: Optional[int] = Field(None, ge=1, description="r of the head (default: rank)")
    layer_ranks: Optional[dict[str, Annotated[int, Field(ge=1)]]] = Field(None, description="r of the protected layers whose name contains the "
                                                  "key (e.g. {layer_1: 3}: the last adapter before pooling reaches at "
                                                  "most C - 1 gradient directions); default: rank")


PUBLIC_TEXT_DEFAULTS = ("wordnet-examples", "news-sentences", "rt-sentences")


@DEFENSES.register("fisguard", "FISGuard: fixed input subspaces (Q from public data, U = 0 trained)")
class FISGuard(TrainingDefense):
    Config = FISGuardParams
    advice = ({"stage": "training", "param": "rank", "weak": 64, "strong": 4, "scale": "int", "fixed": {},
               "what": "rank of the fixed input subspaces", "attack_kinds": ("membership",), "order": 9, "rank": 9},)

    def check_experiment(self, cfg) -> None:
        if cfg.peft.kind not in ("adapters", "lora"):
            raise BadInput("peft.kind", f"FISGuard protects adapters or LoRA, not peft.kind={cfg.peft.kind}.",
                           "use peft.kind=adapter or lora.")

    def apply(self, handle, experiment_cfg, data=None) -> None:
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
                                     protect_head=c.protect_head, head_rank=c.head_rank, layer_ranks=c.layer_ranks)

    def report(self, rounds) -> dict[str, float]:
        from gradleak.peft.fisguard import rank_report

        checks = [v for r in rounds for u in r for v in rank_report(u.tensors, self.layers).values()]
        if not checks:
            return {}
        return {"fisguard_rank_condition_rate": sum(c["condition_holds"] for c in checks) / len(checks),
                "fisguard_min_rank_G_U": float(min(c["rank_G_U"] for c in checks)), "fisguard_r": float(self.cfg.rank)}

    def layer_condition(self, rounds) -> dict[str, bool]:
        """Per protected trainable module (U's module name, as attacks name layers): whether rank(G_U) = r held
        in every observed update — the layers where FISGuard's guarantee against ProjRes applies."""
        from gradleak.peft.fisguard import rank_report

        out: dict[str, bool] = {}
        for r in rounds:
            for u in r:
                for c in rank_report(u.tensors, self.layers).values():
                    out[c["module"]] = out.get(c["module"], True) and bool(c["condition_holds"])
        return out


class L2Params(DefenseParams):
    coefficient: float = Field(1e-3, ge=0, le=1e6, description="λ in loss + λ·‖θ_trainable‖²")


@DEFENSES.register("l2", "L2 regularisation of the trainable parameters")
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


@DEFENSES.register("dropout", "dropout on the inputs of the trainable layers during client training")
class Dropout(TrainingDefense):
    Config = DropoutParams

    def apply(self, handle, experiment_cfg, data=None) -> None:
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


@DEFENSES.register("label_smoothing", "label smoothing of the clients' cross-entropy")
class LabelSmoothing(TrainingDefense):
    Config = LabelSmoothingParams

    def loss_options(self) -> dict[str, Any]:
        return {"label_smoothing": self.cfg.factor}


class DPSGDParams(DefenseParams):
    noise_multiplier: float = Field(1.0, ge=0, le=1e4, description="σ: noise std = σ · max_grad_norm")
    max_grad_norm: float = Field(1.0, gt=0, description="C: per-sample gradient clipping norm")
    delta: float = Field(1e-5, gt=0, lt=1, description="δ of the reported (ε, δ)")


def _refuse_batchnorm(model) -> None:
    if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        raise BadInput("model.norm", "DP-SGD needs per-sample gradients, but the model has BatchNorm layers, which mix "
                       "the samples of a batch (Opacus refuses them); the defense does not convert them silently.",
                       "set model.norm=group (resnet18 with GroupNorm instead of BatchNorm).")


@DEFENSES.register("dpsgd", "DP-SGD (Opacus per-sample gradients): clip each sample to C, add N(0, σ²C²)")
class DPSGD(TrainingDefense):
    """DP-SGD as the client's local training, for text and image clients. Every step: Opacus'
    ``GradSampleModule`` gives the per-sample gradients of the trainable parameters on the step's batch of B
    samples, each clipped to ``max_grad_norm`` = C in total L2 norm; their sum plus Gaussian noise N(0, σ²C²)
    (σ = ``noise_multiplier``; float64, a generator seeded from the experiment seed, the client id and the
    round's seed), divided by B, is the step's private gradient.

    * **FedSGD** (``fl.algorithm=fedsgd``): one step on the client's whole local batch; the private gradient is
      the upload (``kind="gradient"``).
    * **FedAvg** (``fedavg``): ``epochs`` passes of minibatches of ``batch_size`` (the protocol's per-client
      settings), shuffled exactly as :meth:`gradleak.fl.core.Client.local_update` does (``torch.randperm`` from
      a generator seeded with the round's seed, so without noise and clipping the upload equals the plain
      FedAvg client's); each step is plain SGD with ``lr`` on the private gradient (B is the step's actual batch
      size, smaller for a last partial batch, as the plain client's mean loss). The upload is the
      pseudo-gradient (θ0 − θK)/lr, the change accumulated in float64 (``kind="pseudo_gradient"``, K steps).

    The model must have no BatchNorm (BadInput naming ``model.norm``: use ``model.norm=group``).

    Accounting: one Opacus ``RDPAccountant`` per client, one accountant step per local step with sampling rate
    q = B / (the client's images) — FedSGD: q = 1, one step per round. The clients' shuffled fixed-size batches
    are accounted as Poisson sampling at rate q, the usual approximation (Opacus does the same for shuffled
    data loaders); the rounds compose. ``report`` gives ``dp_epsilon`` at ``delta`` of the worst client (the
    largest ε), ``dp_epsilon_client{c}`` and ``dp_steps_client{c}`` per client and ``dp_rounds``; ε is
    infinite with ``noise_multiplier`` = 0. The accountants restart after each report (one per trial)."""

    Config = DPSGDParams
    modalities = ("text", "image")
    changes_upload = True
    is_dp = True
    clip_fit = ("max_grad_norm", "sample_gradient_norms", "the median per-sample gradient L2 norm of the undefended clients")
    advice = ({"stage": "training", "param": "noise_multiplier", "weak": 1e-3, "strong": 10.0, "scale": "log",
               "fixed": {"max_grad_norm": 1.0}, "what": "DP-SGD noise multiplier, per-sample clipping norm 1.0",
               "order": 7, "rank": 1},)

    @classmethod
    def advice_epsilon(cls, value, rounds: int, measured, delta: float, gaussian_epsilon):
        """DP-SGD's own accountant's ε (the run's ``dp_epsilon``: the worst client, at the config's ``delta``)."""
        return measured

    def dp_claims(self, cfg, gaussian_epsilon, delta: float) -> list[dict]:
        td = self
        return [{"name": "dpsgd", "clip": td.cfg.max_grad_norm, "covers": ["final_model", "every_round", "each_upload"],
                 "delta": td.cfg.delta, "claim": lambda rounds, rep: (
                     rep.get("canary_epsilon"),
                     f"DP-SGD's Opacus RDPAccountant for the canary example (noise multiplier "
                     f"{td.cfg.noise_multiplier:g}, sampling rate 1, {rep.get('canary_steps', 0):.0f} step(s)); the "
                     f"configured clients' worst: ε = {rep.get('dp_epsilon', float('nan')):.4g}")}]

    def server_knowledge(self) -> dict:
        return {"per_sample_clip_norm": float(self.cfg.max_grad_norm), "adds_noise": self.cfg.noise_multiplier > 0}

    def observed_noise_variance(self, update, aggregate_of: int = 1, individual: bool = True,
                                local_batch_size: int | None = None, tensor: str | None = None) -> float:
        """The noise the server knows is on an upload (:mod:`gradleak.defenses.declared`): each step's private
        gradient carries N(0, (σC/b)²) per coordinate for its batch of b samples; a FedSGD upload is one step on the
        client's whole batch (b = its samples), a FedAvg pseudo-gradient the sum of its K steps (variance K (σC/b)²,
        b the protocol's minibatch size; a last partial batch is slightly noisier, which this ignores)."""
        n = max(int(getattr(update, "num_samples", 1) or 1), 1)
        steps = max(int(getattr(update, "local_steps", 1) or 1), 1)
        b = n if steps == 1 else min(int(local_batch_size or n), n)
        var = steps * (self.cfg.noise_multiplier * self.cfg.max_grad_norm / b) ** 2
        return var / (1 if individual else max(aggregate_of, 1))

    def setup(self) -> None:
        self.seed = 0  # the experiment's seed, set by apply (a direct local_update call draws with seed 0)
        self._reset_accounting()

    def check_experiment(self, cfg) -> None:
        """Refuse a BatchNorm ResNet-18 at validation (before the model, or its pretraining, is built)."""
        model = getattr(cfg, "model", None)
        if model is not None and model.name == "resnet18" and getattr(model, "norm", "batch") == "batch":
            raise BadInput("model.norm", "DP-SGD needs per-sample gradients, but resnet18 with model.norm=batch has "
                           "BatchNorm layers, which mix the samples of a batch (Opacus refuses them).",
                           "set model.norm=group (GroupNorm instead of BatchNorm).")

    def apply(self, handle, experiment_cfg, data=None) -> None:
        try:
            import opacus  # noqa: F401
        except ModuleNotFoundError:
            raise BadInput("defense.name", "DP-SGD needs the `opacus` package.", "pip install 'gradleak[dp]'.") from None
        _refuse_batchnorm(handle.model)
        self.rounds = 0
        self.seed = experiment_cfg.seed
        self._reset_accounting()

    def _reset_accounting(self) -> None:
        self.rounds = 0
        self.accountants: dict[int, Any] = {}
        self.steps: dict[int, int] = {}

    def _account(self, client_id: int, sample_rate: float, steps: int = 1) -> None:
        from opacus.accountants import RDPAccountant

        acc = self.accountants.setdefault(client_id, RDPAccountant())
        self.steps[client_id] = self.steps.get(client_id, 0) + steps
        if self.cfg.noise_multiplier > 0:
            for _ in range(steps):
                acc.step(noise_multiplier=self.cfg.noise_multiplier, sample_rate=sample_rate)

    def _private_gradient(self, gsm, loss_fn, x, y, params, gen) -> list[torch.Tensor]:
        """Σ_i clip_C(g_i) + N(0, σ²C²), divided by B: one float64 tensor per parameter (flattened)."""
        import warnings

        for p in params:
            p.grad_sample, p.grad = None, None
        with warnings.catch_warnings():  # the stem's hook fires on the images, which need no gradient
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            loss = loss_fn(gsm, x, y)
            loss.backward()
        per = [p.grad_sample.reshape(len(x), -1).double() if p.grad_sample is not None
               else torch.zeros(len(x), p.numel(), dtype=torch.float64, device=p.device) for p in params]  # B × |p|
        for p in params:
            p.grad_sample, p.grad = None, None
        return self.privatise(per, gen)

    def privatise(self, per: list[torch.Tensor], gen) -> list[torch.Tensor]:
        """The mechanism on per-sample gradients ``per`` (one B × |p| float64 tensor per parameter): each sample
        clipped to C in total L2 norm, summed, N(0, σ²C²) added, divided by B."""
        c = self.cfg
        b = per[0].shape[0]
        norms = torch.sqrt(sum((g ** 2).sum(1) for g in per))
        scale = (c.max_grad_norm / norms.clamp_min(1e-12)).clamp(max=1.0)
        out = []
        for g in per:
            summed = (g * scale[:, None]).sum(0)
            noise = torch.randn(summed.shape, generator=gen, dtype=torch.float64) * (c.noise_multiplier * c.max_grad_norm)
            out.append((summed + noise.to(summed.device)) / b)
        return out

    def _canary_update(self, client, model, gen, *, algorithm: str, epochs: int):
        """A canary client (:mod:`gradleak.fl.canaries`) under DP-SGD: one example whose per-sample gradient is the
        canary (its direction × the canary scale × C), through :meth:`privatise` at every local step (FedSGD: one;
        FedAvg: ``epochs`` steps of its one-example batch), accounted like any client (sampling rate 1)."""
        from gradleak.fl.core import Update

        names = [n for n, p in model.named_parameters() if p.requires_grad]
        canary = client.tensors(client.scale * self.cfg.max_grad_norm)
        per = [canary[n].reshape(1, -1) for n in names]
        steps = 1 if algorithm == "fedsgd" else int(epochs)
        moved = [torch.zeros(g.shape[1], dtype=torch.float64) for g in per]
        for _ in range(steps):
            for m, g in zip(moved, self.privatise(per, gen)):
                m += g
        self._account(client.client_id, 1.0, steps)
        shapes = {n: p.shape for n, p in model.named_parameters() if p.requires_grad}
        kind = "gradient" if algorithm == "fedsgd" else "pseudo_gradient"
        return Update({n: m.reshape(shapes[n]) for n, m in zip(names, moved)}, client.num_samples, client.client_id,
                      kind, steps)

    def local_update(self, client, model, *, seed: int, algorithm: str = "fedsgd", lr: float | None = None,
                     epochs: int = 1, batch_size: int | None = None, **_: Any):
        from opacus import GradSampleModule

        from gradleak.fl.core import Update

        _refuse_batchnorm(model)
        if algorithm not in ("fedsgd", "fedavg"):
            raise BadInput("fl.algorithm", f"unknown algorithm '{algorithm}'.", "use 'fedsgd' or 'fedavg'.")
        gen = torch.Generator().manual_seed(int(self.seed) * 1_000_003 + int(client.client_id) * 7_919
                                            + int(seed))
        if getattr(client, "canary", False):  # the one-shot ε check's canary example (it reads no weights)
            return self._canary_update(client, model, gen, algorithm=algorithm, epochs=epochs)
        model.train()
        device = next(model.parameters()).device
        x, y = client._inputs.to(device), client._labels.to(device)
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        params = [p for p in model.parameters() if p.requires_grad]
        gsm = GradSampleModule(model, batch_first=True, loss_reduction="mean")
        try:
            if algorithm == "fedsgd":
                grads = self._private_gradient(gsm, client.loss_fn, x, y, params, gen)
                tensors = {n: g.reshape(p.shape).to(p.dtype) for n, p, g in zip(names, params, grads)}
                upd = Update(tensors, len(x), client.client_id, "gradient", 1)
                self._account(client.client_id, 1.0)
            else:
                if lr is None:
                    raise BadInput("fl.lr", "FedAvg DP-SGD clients need the round's learning rate.", "pass lr=...")
                bs = min(int(batch_size or len(x)), len(x))
                rate = bs / len(x)
                before = [p.detach().to(torch.float64).clone() for p in params]
                moved = [torch.zeros_like(b) for b in before]
                order_gen = torch.Generator().manual_seed(int(seed))  # Client.local_update's shuffle
                steps = 0
                for _ in range(int(epochs)):
                    order = torch.randperm(len(x), generator=order_gen)
                    for i in range(0, len(x), bs):
                        idx = order[i:i + bs].to(device)
                        grads = self._private_gradient(gsm, client.loss_fn, x[idx], y[idx], params, gen)
                        with torch.no_grad():
                            for p, b, m, g in zip(params, before, moved, grads):
                                m += lr * g.reshape(p.shape)
                                p.copy_((b - m).to(p.dtype))
                        steps += 1
                        self._account(client.client_id, rate)
                tensors = {n: m / lr for n, m in zip(names, moved)}  # float64, as Client.local_update's
                upd = Update(tensors, len(x), client.client_id, "pseudo_gradient", steps)
        finally:
            gsm._close()
        model.eval()
        if client.client_id == 0:
            self.rounds += 1
        return upd

    def report(self, rounds) -> dict[str, float]:
        from opacus.accountants import RDPAccountant

        sigma = self.cfg.noise_multiplier
        out: dict[str, float] = {}
        if not self.steps:  # no local step recorded: one full-batch step, as before per-client accounting
            acc = RDPAccountant()
            if sigma > 0:
                acc.step(noise_multiplier=sigma, sample_rate=1.0)
            eps = {}
            worst = float(acc.get_epsilon(self.cfg.delta)) if sigma > 0 else float("inf")
        else:
            eps = {c: (float(self.accountants[c].get_epsilon(self.cfg.delta)) if sigma > 0 else float("inf"))
                   for c in sorted(self.steps)}
            worst = max(eps.values())
        out["dp_epsilon"] = worst
        out["dp_rounds"] = float(self.rounds)
        for c, e in eps.items():
            out[f"dp_epsilon_client{c}"] = e
            out[f"dp_steps_client{c}"] = float(self.steps[c])
        self._reset_accounting()  # reported once per trial; the next trial trains from the start again
        return out


class MinMaxParams(DefenseParams):
    coefficient: float = Field(1.0, ge=0, le=1e4, description="λ: weight of the inference model's gain in the client's loss")
    attack_steps: int = Field(5, ge=1, le=1000, description="k: steps of the inference model per round (Nasr et al.: k)")
    attack_lr: float = Field(1e-2, gt=0, description="Adam learning rate of the inference model")
    reference_size: Optional[int] = Field(None, ge=1, description="reference (non-member) samples per client (default: batch size)")
    hidden: int = Field(64, ge=1, description="width of the inference model's hidden layers")


def _logits(model, x: torch.Tensor) -> torch.Tensor:
    """Task logits of a text (B × 2 × T: ids, mask) or image batch."""
    if x.dim() == 3 and not x.is_floating_point():
        return model(input_ids=x[:, 0], attention_mask=x[:, 1]).logits
    out = model(x)
    return out.logits if hasattr(out, "logits") else out


@DEFENSES.register("minmax", "min-max adversarial regularisation (Nasr et al. 2018): train against a local inference model")
class MinMax(TrainingDefense):
    """Min-max adversarial regularisation (Nasr, Shokri, Houmansadr, CCS 2018; a baseline of paper 004, Sec. V-A).

    Each client keeps a private inference model h(f(x), y) -> P(member) (an MLP on the softmax output and the
    one-hot label, Nasr et al.'s inputs) and, every round, (1) trains h for ``attack_steps`` Adam steps to tell its
    members (the local batch) from its reference set (``reference_size`` samples of the same task the client holds
    but does not train on), then (2) uploads the gradient of ``CE(f; batch) + λ · mean_batch log h(f(x), y)`` with
    h frozen: the classifier is pushed to make its members look like non-members to the best local attacker.

    Decisions the papers leave open: FedSGD (one local step, the benchmark's setting); the inference model and its
    optimiser persist per client across rounds (client state that is never uploaded); the reference set is a chunk of
    the experiment's own data set disjoint from members, the server's candidates and the test set
    (``TextData.reference``); the task loss is the plain cross-entropy. ``report`` gives the attacker's accuracy on
    its own training pairs in the last round (``minmax_inference_accuracy``; 0.5 = it cannot tell)."""

    Config = MinMaxParams

    def apply(self, handle, experiment_cfg, data=None) -> None:
        if experiment_cfg.fl.algorithm != "fedsgd":
            raise BadInput("fl.algorithm", "the min-max defense is implemented for FedSGD clients (one local step).",
                           "use fl.algorithm=fedsgd.")
        if data is None or not hasattr(data, "reference"):
            raise BadInput("defense.name", "min-max regularisation needs a reference set of the task's own samples, which "
                           "this experiment's data source does not provide (text data sets do).", "use a text data set.")
        self.data, self.handle = data, handle
        self.num_classes = int(experiment_cfg.model.num_classes)
        self.ref_size = self.cfg.reference_size or experiment_cfg.data.batch_size
        self.max_length = experiment_cfg.data.max_length
        self.seed = int(experiment_cfg.seed)
        self.reference: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.attackers: dict[int, tuple[torch.nn.Module, torch.optim.Optimizer]] = {}
        self.accuracy: dict[int, float] = {}

    def _reference(self, client_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        if client_id not in self.reference:
            texts, labels = self.data.reference(client_id, self.ref_size)
            enc = self.handle.text_model.encode(texts, self.max_length)
            x = torch.stack([enc["input_ids"], enc["attention_mask"]], 1)
            self.reference[client_id] = (x.to(device), (labels % self.num_classes).to(device))
        return self.reference[client_id]

    def _attacker(self, client_id: int, dtype):
        if client_id not in self.attackers:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + client_id * 7_919 + 17)
            C, H = self.num_classes, self.cfg.hidden
            h = torch.nn.Sequential(torch.nn.Linear(2 * C, H), torch.nn.ReLU(), torch.nn.Linear(H, H // 2 or 1),
                                    torch.nn.ReLU(), torch.nn.Linear(H // 2 or 1, 1)).to(dtype)
            with torch.no_grad():
                for p in h.parameters():
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=dtype) * (0.1 if p.dim() > 1 else 0.0))
            self.attackers[client_id] = (h, torch.optim.Adam(h.parameters(), lr=self.cfg.attack_lr))
        return self.attackers[client_id]

    def _features(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        onehot = torch.nn.functional.one_hot(y, self.num_classes).to(logits.dtype)
        return torch.cat([torch.softmax(logits, -1), onehot], -1)

    def local_update(self, client, model, *, seed: int, **_: Any):
        from gradleak.fl.core import Update

        x, y = client._inputs, client._labels
        rx, ry = self._reference(client.client_id, x.device)
        dtype = next(p for p in model.parameters()).dtype
        h, opt = self._attacker(client.client_id, dtype)
        h.to(x.device)
        with torch.no_grad():
            feats = torch.cat([self._features(_logits(model, x), y), self._features(_logits(model, rx), ry)])
        target = torch.cat([torch.ones(len(x)), torch.zeros(len(rx))]).to(feats)
        for p in h.parameters():
            p.requires_grad_(True)
        for _ in range(self.cfg.attack_steps):  # (1) the inference model's k steps: maximise its gain
            opt.zero_grad()
            torch.nn.functional.binary_cross_entropy_with_logits(h(feats).squeeze(-1), target).backward()
            opt.step()
        with torch.no_grad():
            self.accuracy[client.client_id] = float(((h(feats).squeeze(-1) > 0).to(target) == target).float().mean())
        for p in h.parameters():
            p.requires_grad_(False)
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        params = [p for p in model.parameters() if p.requires_grad]
        logits = _logits(model, x)  # (2) the classifier's step against the frozen inference model
        gain = torch.nn.functional.logsigmoid(h(self._features(logits, y)).squeeze(-1)).mean()
        loss = torch.nn.functional.cross_entropy(logits, y) + self.cfg.coefficient * gain
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        tensors = {n: (g.detach() if g is not None else torch.zeros_like(p)) for n, p, g in zip(names, params, grads)}
        return Update(tensors, len(x), client.client_id, "gradient", 1)

    def report(self, rounds) -> dict[str, float]:
        if not self.accuracy:
            return {}
        out = {"minmax_inference_accuracy": sum(self.accuracy.values()) / len(self.accuracy)}
        self.attackers, self.accuracy = {}, {}  # the next trial's clients start afresh
        return out
