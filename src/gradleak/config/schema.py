"""The one config language (docs/DESIGN.md §4): every experiment is ``data -> model + peft -> fl -> threat -> attack``.

``experiment:`` names a *preset* (``EXPERIMENTS``) that fills defaults before validation. The presets are registered
by the modality plug-ins (:func:`gradleak.modalities.register_experiment`; ``gradleak list experiments``):

* ``peftleak`` — images, ViT-B/16 + adapters, attack ``peftleak``, threat ``malicious`` with public data;
* ``utr`` — text, MiniLM (2 layers) + adapters, attack ``utr``, threat ``honest-but-curious``;
* ``leakage`` — images, grey ResNet-18 (full fine-tuning, BatchNorm), FedAvg, attack ``bn_inversion``, evaluated
  per client by RDLV and adjusted IIP (Hatamizadeh et al. 2022, §II-D, §III-E);
* ``image`` / ``text`` — the same sections with no attack-specific defaults.

The preset's modality (:mod:`gradleak.modalities`, docs/DESIGN.md §7) owns its rules of the config: which ``data.*``
and ``model.*`` fields are its own, the layer count the PEFT checks assume, its checks of the model's shape, of its
clients' training and of its public data. This module names no modality: a new modality validates by registering
its plug-in and a preset.

The ``attack:`` section holds ``name`` plus the attack's parameters, either flat (``attack.sigma``) or
under ``attack.params`` (``attack.params.eps_bag``); both are validated against the attack's ``Config``
class, so a bad value exits 2 naming ``attack.<parameter>``.

Defenses (one registry, :mod:`gradleak.defenses.base`) appear in two sections that differ in meaning, not spelling:

* ``defenses:`` — a *list* of update transforms (stage ``update``), ``[{name, params: {...}}]``, applied in order to
  every client's upload (noise, clipping, pruning, quantisation, local or central DP); a training-time name here is
  refused, naming ``defense:``. What the server is told about them (``update_defenses``) comes from this list.
* ``defense:`` — *one* defense that changes how clients train (stage ``training``: FISGuard, DP-SGD, L2, dropout,
  label smoothing, min-max, the RDLV filter), ``{name, <parameters>}`` with the parameters flat so that
  ``--set defense.<parameter>=...`` sweeps them; default ``none``. An update-stage defense may be named here too
  (``percentile_noise``, the leakage configs' way to sweep ``defense.sigma0``): it trains nothing, and its transform
  runs after the ``defenses:`` list. ``scale: cpu | paper`` fills the optimisation attacks'
iteration parameters the config leaves unset from the attack class's ``scales`` table (``ig``: 300 / 2000 steps;
``gias``: 300 + 100 / 2000 + 8000); the dump records them under ``scale_resolved``. Fields that belong to the other
modality (``data.max_length`` in an image experiment, ``model.patch_size`` in a text one) are refused
(:meth:`gradleak.modalities.Modality.refuse_foreign`).
"""

from __future__ import annotations

import copy
from typing import Any, Literal, Optional

from pydantic import AliasChoices, ConfigDict, Field, ValidationError

from gradleak.defenses.base import DefenseConfig, DefenseSection, build_defense_section, build_defenses
from gradleak.errors import BadInput, describe_validation_error
from gradleak.config.loading import Strict
from gradleak.fl.threat import ThreatConfig, ThreatModel, with_article
from gradleak.modalities import Modality, modality_of
from gradleak.peft import PeftConfig
from gradleak.registry import ATTACKS, EXPERIMENTS
from gradleak.validation import Checked

#: the fewest tokens a sentence takes: its two special tokens ([CLS] … [SEP], or BOS … EOS) and one word
MIN_SENTENCE_TOKENS = 3


class DataConfig(Strict):
    name: str = Field("cifar-samples", description="dataset (`gradleak list data`): a built-in one, or your own: "
                      "csv / tsv (text), image-folder / npz (images) with data.path")
    batch_size: int = Field(8, ge=1, le=100_000, description="samples per client")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="images: which samples form the batch")
    path: Optional[str] = Field(None, description="your own data: the CSV/TSV file, the image folder "
                                "(class = sub-folder) or the .npz file")
    # images
    image_size: int = Field(32, ge=4, le=1024, description="images: side in pixels (your own images: their size, or "
                            "the size data.resize resizes them to)")
    public: Optional[str] = Field(None, description="images: the public dataset a server granted threat.public_data "
                                  "holds (default natural-crops; public-natural when the private set shares its photos)")
    public_size: int = Field(2000, ge=1, le=1_000_000, description="images: public samples drawn from data.public (the "
                             "server's statistics and the null's random samples)")
    resize: bool = Field(False, description="images: resize a user's folder/npz to image_size (else sizes must match)")
    validation_size: int = Field(0, ge=0, le=100_000, description="images: validation images per client (the "
                                 "identifiability pool of the leakage evaluation; the paper's clients hold 200)")
    prior_size: int = Field(256, ge=1, le=100_000, description="images: held-out images of the private dataset whose "
                            "mean image is the attack's domain prior (granted under threat.public_data)")
    # text
    text_column: Optional[str] = Field(None, description="text: the CSV/TSV column (header name or 0-based index) of "
                                       "the sentences (default: a column named text/sentence/..., else the longest)")
    label_column: Optional[str] = Field(None, description="text: the column of the integer labels (default: a "
                                        "column named label/..., else every label 0)")
    split: str = Field("train", description="a dataset's split (fashion-mnist, hf)")
    subset: Optional[str] = Field(None, description="hf: the dataset's configuration")
    limit: Optional[int] = Field(None, ge=1, description="text: read at most this many sentences of the file")
    max_length: Optional[int] = Field(None, ge=1, description=f"text: most tokens of a client's sentence, its special "
                                      f"tokens included (at least {MIN_SENTENCE_TOKENS}); default the model's context")
    nonmembers: int = Field(0, ge=0, le=1_000_000, description="membership attacks: non-member candidates per client (>= 100 for the TPR at 1 % FPR to be graded; fewer: the level is partial at most)")
    samples_per_client: Optional[int] = Field(None, ge=1, le=1_000_000, description="membership attacks: each client "
                                              "holds a dataset of this size (the members) and trains each round on a "
                                              "batch of data.batch_size drawn from it (default: the batch is the "
                                              "client's whole data)")
    test_size: int = Field(0, ge=0, le=1_000_000, description="held-out samples for the final model's accuracy")


class PretrainConfig(Strict):
    """Central pretraining of a backbone on a split the clients never see (:mod:`gradleak.models.pretrain`)."""

    data: str = Field("fashion-mnist", description="dataset of the pretraining images")
    split: str = Field("test", description="its split (the clients draw images from the train split)")
    images: int = Field(4096, ge=2, le=1_000_000, description="pretraining images (a seeded subset of the split)")
    epochs: int = Field(3, ge=1, le=1000, description="passes over the pretraining images")
    lr: float = Field(0.05, gt=0, le=10, description="SGD lr (cosine decay to 0)")
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum")
    batch_size: int = Field(64, ge=2, le=100_000, description="pretraining batch size")
    seed: int = Field(0, ge=0, description="subset, shuffle and initialisation")


class ModelConfig(Strict):
    name: str = Field("vit-b16", description="model (`gradleak list models`), or a local HF text model directory; "
                      "`gradleak list --model NAME` names its LoRA targets")
    layers: Optional[int] = Field(None, ge=1, le=256, validation_alias=AliasChoices("layers", "num_layers"),
                                  description="keep the first N blocks (text default 2; ViT: the preset's)")
    dtype: Optional[Literal["float32", "float64"]] = None  # default: float64 if the attack needs it, else float32
    num_classes: int = Field(10, ge=2, le=100_000, description="classes of the task head")
    # images (ViT)
    patch_size: Optional[int] = Field(None, ge=1)
    hidden_size: Optional[int] = Field(None, ge=1, le=16_384)
    heads: Optional[int] = Field(None, ge=1, le=1024)
    pooling: Optional[Literal["mean", "cls"]] = None  # ViT default mean; text default cls (BERT's pooler / last token)
    adapter_bottleneck: Optional[int] = Field(None, ge=1, description="= peft.bottleneck (kept for old configs)")
    init_weights: Optional[bool] = None  # default: skip random init when a malicious attack rewrites every weight
    num_channels: Optional[int] = Field(None, ge=1, le=4, description="image channels the model takes (resnet18: 1 = "
                                        "grey, e.g. Fashion-MNIST; default 3); the data are converted to it")
    train_all: bool = Field(False, description="every parameter trains (full fine-tuning, with peft.kind=none), as the "
                            "leakage study's ResNet-18")
    pretrain: Optional[PretrainConfig] = Field(None, description="resnet18 or a ViT preset: start from weights pretrained "
                                               "by us on a split the clients never see (gradleak.models.pretrain)")
    norm: Literal["batch", "group"] = Field("batch", description="resnet18: normalisation layers; group replaces every "
                                            "BatchNorm2d by GroupNorm(min(32, C), C) (DP-SGD: Opacus refuses BatchNorm)")
    # text
    task: Optional[Literal["classification", "lm"]] = None  # default: LM loss for causal models, else a class head


class _FLProtocol(Strict):
    """``fl``: the round protocol. ``engine`` and the engines' own sections (``fl.<engine>``) are mounted from the
    engine registry (:data:`gradleak.fl.engines.ENGINES`) in :data:`FLConfig`: the schema names no engine."""

    algorithm: Literal["fedsgd", "fedavg"] = "fedsgd"
    rounds: int = Field(1, ge=1, le=10_000)
    lr: float = Field(0.05, gt=0, le=1e4)
    local_epochs: int = Field(1, ge=1, le=10_000)
    local_batch_size: Optional[int] = Field(None, ge=1)
    clients: int = Field(1, ge=1, le=10_000, description="clients per round; client 0 is the attacked one")
    secure_aggregation: bool = False
    # per-client settings (the leakage study's clients differ in data, batch size and steps; Hatamizadeh et al. 2022 §III-A)
    client_images: Optional[list[int]] = Field(None, description="training images per client (default data.batch_size each)")
    client_batch_sizes: Optional[list[int]] = Field(None, description="local batch size per client (default "
                                                    "fl.local_batch_size)")
    client_epochs: Optional[list[int]] = Field(None, description="local epochs per client (default fl.local_epochs)")
    lr_decay: float = Field(1.0, gt=0, le=1, description="step decay: lr × lr_decay every lr_step_rounds rounds")
    lr_step_rounds: Optional[int] = Field(None, ge=1, description="rounds between lr decays (the paper: 40 of 100)")

    def lr_at(self, r: int) -> float:
        """The learning rate of round ``r`` (step decay; constant without ``lr_step_rounds``)."""
        return self.lr * (self.lr_decay ** (r // self.lr_step_rounds) if self.lr_step_rounds else 1.0)


def _fl_config() -> type:
    """The ``fl`` section: :class:`_FLProtocol` plus ``engine`` (one of the registered engines) and each engine's
    ``fl.<name>`` section (its default when not given)."""
    from pydantic import create_model

    from gradleak.fl.engines import ENGINES, engine_sections

    names = tuple(ENGINES.names())
    words = "; ".join(f"{e.name}: {e.summary}" for e in ENGINES)
    fields: dict[str, Any] = {"engine": (Literal[names], Field("builtin", description=words))}  # type: ignore[valid-type]
    for name, model in engine_sections().items():
        fields[name] = (model, Field(default_factory=model, description=f"the {name} engine's settings (fl.engine: {name})"))
    return create_model("FLConfig", __base__=_FLProtocol, __module__=__name__, **fields)


FLConfig = _fl_config()


class MetricsConfig(Strict):
    psnr_threshold_db: float = Field(30.0, gt=0, le=400)
    figures: bool = Field(True, description="plotted figures in the run folders (ROC curves, t-SNE of the IIP "
                          "features); false for --advise probes, of which only the numbers are read")
    feature_distance: bool = True  # 1 − cos of ViT-S/14 features (offline); LPIPS is added when its weights exist
    # leakage evaluation (reconstruction kind "leakage")
    high_risk_client: Optional[int] = Field(None, ge=0, description="the client reported as rdlv_high_risk_client "
                                            "(default: the one with the fewest images, then fewest local steps)")
    leakage_ssim: Literal["gaussian", "nvflare"] = Field("gaussian", description="SSIM of the RDLV: 11×11 Gaussian "
                                                         "window, or NVFlare's skimage settings")
    iip: bool = Field(True, description="adjusted image identifiability precision on ViT-S/14 features (offline)")
    attack_clients: Literal["first", "all"] = Field(
        "first", description="which observed updates a reconstruction attack is run on: the first client's ('first'), "
        "or every client's in turn ('all': the audit's setting; per-client results in details.per_client)")
    null: bool = Field(True, description="score chance (random public samples, matched like the reconstruction) on "
                       "every headline metric: <m>_null_median / _null_p99 / _p_value (gradleak.evaluation.nulls)")
    null_draws: int = Field(1000, ge=200, le=100_000, description="draws of every null (>= 200)")
    utility: bool = Field(True, description="the global model's accuracy on the data.test_size held-out samples after "
                          "the run's rounds (metrics accuracy / test_samples). The audit's attack runs turn it off: "
                          "nothing reads a model's accuracy after one attacked round, and --advise measures the "
                          "utility of a defense in runs of its own (on vit_lora it was 60 % of a run's time)")


class AttackSection(Checked):
    """``attack: {name: ..., params: {...}, <flat parameters>}`` — validated against the attack's Config."""

    model_config = ConfigDict(extra="allow")
    name: Optional[str] = None
    params: dict[str, Any] = Field(default_factory=dict)

    def merged(self) -> dict[str, Any]:
        flat = dict(self.model_extra or {})
        both = sorted(set(flat) & set(self.params))
        if both:
            raise BadInput(f"attack.{both[0]}", "is given both flat and under attack.params.", "give it once.")
        return {**flat, **self.params}


class ExperimentConfig(Strict):
    experiment: str = Field("image", description="preset (`gradleak list experiments`): image, text or a paper's preset")
    name: Optional[str] = Field(None, description="the run's name in its results and report")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="seeds the model, the clients' data draw and the attack")
    device: str = Field("cpu", description="cpu, cuda or cuda:N")
    threads: Optional[int] = Field(None, ge=1, le=1024, description="torch CPU threads (results must not depend on it)")
    trials: int = Field(1, ge=1, le=10_000, description="independent repetitions of the attack, each on its "
                        "own disjoint draw of the clients' data")
    scale: Optional[Literal["cpu", "paper"]] = Field(None, description="iteration budget of the optimisation attacks: "
                                                     "paper (the paper's steps/restarts) or cpu (CPU-scale defaults), "
                                                     "filling the attack parameters the config does not set")
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    peft: PeftConfig = Field(default_factory=PeftConfig)
    fl: FLConfig = Field(default_factory=FLConfig)
    threat: ThreatConfig = Field(default_factory=ThreatConfig)
    attack: AttackSection = Field(default_factory=AttackSection, description="{name, <parameters>}: the attack of "
                                  "`gradleak run` and its parameters (`gradleak list attacks`); `gradleak audit` runs every applicable one")
    defenses: list[DefenseConfig] = Field(default_factory=list, description="update defenses, applied to each upload in "
                                          "order (`gradleak list defenses`)")
    defense: DefenseSection = Field(default_factory=DefenseSection, description="{name, <parameters>}: the training-time "
                                    "defense (DP-SGD, FISGuard, ...; `gradleak list defenses`)")
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)

    # resolved by check()
    _modality: str = "image"
    _attack_cls: Any = None
    _attack_cfg: Any = None
    _scale_filled: dict = {}
    _threat: Optional[ThreatModel] = None
    _defense: Any = None

    @property
    def modality(self) -> str:
        return self._modality

    @property
    def attack_cls(self):
        return self._attack_cls

    @property
    def attack_cfg(self):
        return self._attack_cfg

    @property
    def training_defense(self):
        """The resolved ``defense:`` section: a :class:`~gradleak.defenses.base.TrainingDefense` (an update-stage
        defense named there is wrapped so that it runs after the ``defenses:`` list)."""
        return self._defense

    @property
    def threat_model(self) -> ThreatModel:
        return self._threat

    @property
    def modality_plugin(self) -> Modality:
        """The plug-in of the experiment's modality (:mod:`gradleak.modalities`), which owns its rules of the config."""
        return modality_of(self._modality)

    def check(self) -> None:
        preset = EXPERIMENTS.get(self.experiment, field="experiment")
        self._modality = preset["modality"]
        mod = self.modality_plugin
        mod.refuse_foreign("data", self.data.model_fields_set)
        mod.refuse_foreign("model", self.model.model_fields_set)
        if self.data.max_length is not None and self.data.max_length < MIN_SENTENCE_TOKENS:
            raise BadInput("data.max_length", f"{self.data.max_length} token(s) is below the minimum a sentence needs, "
                           f"{MIN_SENTENCE_TOKENS} (its two special tokens and one word).",
                           f"use data.max_length >= {MIN_SENTENCE_TOKENS} (every sentence must fit), or remove it.")
        if self.metrics.high_risk_client is not None and self.metrics.high_risk_client >= self.fl.clients:
            raise BadInput("metrics.high_risk_client", f"client {self.metrics.high_risk_client} does not exist "
                           f"(fl.clients = {self.fl.clients}: clients 0..{self.fl.clients - 1}).",
                           f"use a client id in 0..{self.fl.clients - 1}, or remove it (the default picks one).")
        # the layers the model keeps, where the config decides it (the modality's default when model.layers is unset)
        self.peft.check(self.model.layers or mod.default_layers)
        if self.model.adapter_bottleneck is not None:
            if "bottleneck" in self.peft.model_fields_set and self.peft.bottleneck != self.model.adapter_bottleneck:
                raise BadInput("model.adapter_bottleneck", f"is {self.model.adapter_bottleneck} but peft.bottleneck is "
                               f"{self.peft.bottleneck}.", "set only peft.bottleneck.")
            self.peft.bottleneck = self.model.adapter_bottleneck
        mod.check_peft(self)  # e.g. text adapters are sized by peft.reduction_factor
        mod.check_architecture(self)  # e.g. a ViT's patch size divides the image side
        self._check_clients()
        mod.check_training(self)  # e.g. per-client image counts, input channels, BatchNorm in train mode
        from gradleak.models import model_modality

        mm = model_modality(self.model.name)
        if mm != self._modality:
            raise BadInput("model.name", f"'{self.model.name}' is {with_article(mm)} model but experiment "
                           f"'{self.experiment}' works on {self._modality}.",
                           f"use experiment: {mm} or a {self._modality} model.")
        if self.model.name != "resnet18" and ("norm" in self.model.model_fields_set or self.model.norm != "batch"):
            raise BadInput("model.norm", f"the normalisation layers are chosen for resnet18, not '{self.model.name}'.",
                           "remove model.norm, or use model.name=resnet18.")
        if self.fl.local_batch_size and not self.fl.client_images and self.fl.local_batch_size > self.data.batch_size:
            raise BadInput("fl.local_batch_size", f"{self.fl.local_batch_size} is larger than the client's batch "
                           f"({self.data.batch_size}).", "use at most data.batch_size.")
        self._check_samples_per_client()
        from gradleak.data import dataset_modality

        dm = dataset_modality(self.data.name)
        if dm != self._modality:
            raise BadInput("data.name", f"'{self.data.name}' is a {dm} dataset but experiment '{self.experiment}' works on "
                           f"{self._modality}.", f"use a {self._modality} dataset (see `gradleak list`) or experiment: {dm}.")
        self._resolve_attack()
        self._attack_cls.check_peft(self._attack_cfg, self.peft)  # e.g. attack.anchor needs peft.layer_pe
        self._attack_cls.check_fl(self._attack_cfg, self.fl)  # e.g. attack.emulate=local_steps needs FedAvg
        if self._attack_cls.needs_float64 and self.model.dtype == "float32":
            raise BadInput("model.dtype", f"attack '{self._attack_cls.name}' is exact only in float64 (the server ships "
                           "the model in float64).", "remove model.dtype or set it to float64.")
        self._threat = self.threat.resolve(self.fl.secure_aggregation, clients=self.fl.clients)
        if self.peft.layer_pe and not self._threat.prescribes_architecture:  # paper 001 §3.4: the server's architecture
            raise BadInput("threat.preset", f"peft.layer_pe adds server-prescribed layer-wise positional embeddings, "
                           f"which {with_article(self._threat.capability)} server cannot choose.",
                           "set threat.preset=prescribes-architecture (or malicious), or peft.layer_pe=false.")
        mod.check_public_data(self)  # e.g. the public images share no source image with the private ones
        build_defenses([d.model_dump() for d in self.defenses], seed=self.seed)  # names and parameters
        self._resolve_defense()
        if (self._attack_cls.reconstruction == "membership" and self.peft.kind == "lora" and self.peft.lora_init == "default"
                and self.fl.rounds == 1 and self.defense.name != "fisguard"):
            raise BadInput("peft.lora_init", "with peft's default LoRA init (B = 0) the gradient of A is zero in round 1, "
                           "so a membership score on it would read as a defense (AUC 0.5) when nothing was protected.",
                           "use peft.lora_init=nonzero (as after some rounds of training) or fl.rounds >= 2.")
        from gradleak.fl.threat import check_requirements

        check_requirements(self._attack_cls.name, self._attack_cls.requires(self._attack_cfg), self._threat)
        from gradleak.fl.engines import engine_of

        engine_of(self.fl.engine).check(self)  # what the round engine cannot run (its extra missing, say)

    @property
    def image_channels(self) -> int:
        """Channels of the images the clients hold (= the model's input channels): model.num_channels, else 3."""
        return self.model.num_channels or 3

    def client_plan(self) -> list[dict[str, int]]:
        """Per client: ``images``, local ``batch_size`` and ``epochs`` (fl.client_* lists over the defaults)."""
        f = self.fl
        out = []
        for i in range(f.clients):
            n = f.client_images[i] if f.client_images else self.data.batch_size
            b = f.client_batch_sizes[i] if f.client_batch_sizes else (f.local_batch_size or n)
            e = f.client_epochs[i] if f.client_epochs else f.local_epochs
            out.append({"images": n, "batch_size": min(b, n) if f.algorithm == "fedavg" else n, "epochs": e})
        return out

    def _check_clients(self) -> None:
        """The ``fl.client_*`` lists: one value per client, each >= 1; local batch sizes and epochs for FedAvg. The
        modality checks the rest of its clients' training (:meth:`gradleak.modalities.Modality.check_training`)."""
        f = self.fl
        for key in ("client_images", "client_batch_sizes", "client_epochs"):
            vals = getattr(f, key)
            if vals is None:
                continue
            if len(vals) != f.clients:
                raise BadInput(f"fl.{key}", f"gives {len(vals)} value(s) for {f.clients} client(s).",
                               f"give one value per client, or set fl.clients={len(vals)}.")
            if any(int(v) < 1 for v in vals):
                raise BadInput(f"fl.{key}", f"every value must be ≥ 1, got {vals}.", "use positive integers.")
        if (f.client_batch_sizes or f.client_epochs) and f.algorithm != "fedavg":
            raise BadInput("fl.client_batch_sizes" if f.client_batch_sizes else "fl.client_epochs",
                           "per-client local batch sizes and epochs apply to FedAvg clients.", "set fl.algorithm=fedavg.")

    def _check_samples_per_client(self) -> None:
        """``data.samples_per_client`` (text membership experiments): a dataset of at least one batch per client."""
        n = self.data.samples_per_client
        if n is None:
            return
        if n < self.data.batch_size:
            raise BadInput("data.samples_per_client", f"{n} samples per client is fewer than one batch "
                           f"(data.batch_size = {self.data.batch_size}).",
                           f"use data.samples_per_client >= {self.data.batch_size}, or remove it (the batch is then "
                           "the client's whole data).")
        import gradleak.attacks  # noqa: F401  (registration)

        cls = ATTACKS.get(self.attack.name, field="attack.name") if self.attack.name else None
        if cls is not None and cls.reconstruction != "membership":
            raise BadInput("data.samples_per_client", f"applies to membership attacks (the members are the client's "
                           f"dataset); attack '{cls.name}' reconstructs each round's batch.",
                           "remove data.samples_per_client (each client then holds one batch).")

    def _resolve_defense(self) -> None:
        self._defense = build_defense_section(self.defense, self._modality, seed=self.seed)
        self._defense.check_experiment(self)  # e.g. FISGuard needs adapters or LoRA, DP-SGD refuses a BatchNorm model

    def _resolve_attack(self) -> None:
        import gradleak.attacks  # noqa: F401  (registration)

        name = self.attack.name
        if name is None:
            raise BadInput("attack.name", "no attack is named.", f"use one of: {', '.join(ATTACKS.names())}.")
        cls = ATTACKS.get(name, field="attack.name")
        applicable = [e.name for e in ATTACKS if e.obj.modality == self._modality and self.peft.kind in e.obj.peft_kinds]
        if cls.modality != self._modality:
            raise BadInput("attack.name", f"'{name}' attacks {cls.modality} data, but this experiment's data are "
                           f"{self._modality}.", f"attacks for {self._modality} with peft.kind={self.peft.kind}: "
                           f"{', '.join(applicable) or '(none)'}.")
        if self.peft.kind not in cls.peft_kinds:
            raise BadInput("peft.kind", f"attack '{name}' applies to peft.kind in {{{', '.join(cls.peft_kinds)}}}, "
                           f"not {self.peft.kind}.", f"change peft.kind, or use one of: {', '.join(applicable) or '(none)'}.")
        merged = self.attack.merged()
        # scale: the attack's iteration budget for that scale, for every parameter the config does not set itself
        filled = {k: v for k, v in cls.scales.get(self.scale, {}).items() if k not in merged}
        self._scale_filled = filled
        try:
            acfg = cls.Config(**{**merged, **filled})
        except ValidationError as err:
            bad = describe_validation_error(err)
            known = ", ".join(sorted(cls.Config.model_fields)) or "(none)"
            fix = bad.fix if "does not exist" not in bad.problem else f"parameters of '{name}': {known}."
            raise BadInput(f"attack.{bad.field}", bad.problem, fix) from None
        self._attack_cls, self._attack_cfg = cls, acfg

    def dump(self) -> dict[str, Any]:
        """The config as run: every section with defaults filled, the attack's parameters resolved."""
        out = self.model_dump(mode="json")
        out["attack"] = {"name": self.attack.name, **(self._attack_cfg.model_dump(mode="json") if self._attack_cfg else {})}
        out["threat_resolved"] = self._threat.as_dict() if self._threat else None
        if self.scale is not None:  # which attack parameters the scale set (the others: the config's own)
            out["scale_resolved"] = {"scale": self.scale, "attack_parameters_set": dict(self._scale_filled)}
        if self._defense is not None:
            out["defense"] = {"name": self.defense.name, **self._defense.params()}
        return out


def with_defaults(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` over its preset's defaults (deep merge; the user's keys win)."""
    kind = raw.get("experiment")
    if kind is None:
        raise BadInput("experiment", "the config has no `experiment:` key.", f"add one of: {', '.join(EXPERIMENTS.names())}.")
    if not isinstance(kind, str):
        raise BadInput("experiment", f"must be a name, got {kind!r}.", f"use one of: {', '.join(EXPERIMENTS.names())}.")
    preset = EXPERIMENTS.get(kind, field="experiment")
    return _merge(copy.deepcopy(preset["defaults"]), raw)


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out
