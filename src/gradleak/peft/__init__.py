"""The PEFT layer (docs/DESIGN.md §2), shaped like HF peft: one config per kind and one ``apply_peft(model, spec)``.

Kinds (registry ``PEFT_KINDS``; ``gradleak list`` shows them with their parameters):

* ``adapters`` — bottleneck adapters. On a ViT: Houlsby placement, after the MSA and after the MLP of
  every block (``bottleneck`` hidden units; PEFTLeak). On a text model: an embedding adapter (input of
  layer 0) plus one adapter after each kept layer (``hidden_size / reduction_factor`` units; UTR).
* ``lora`` — LoRA through HF ``peft`` (``inject_adapter_in_model``) on ``lora_targets`` (module names;
  a name that matches no module lists the valid ones). ``lora_init: nonzero`` initialises B ~ N(0, 0.02²)
  as after some rounds of training (with peft's default B = 0 the gradient of A vanishes in round 1);
  ``lora_init: default`` (alias ``standard``, paper 001 Table 11 "Standard") keeps peft's: A ~ U(−1/√d, 1/√d)
  (peft's kaiming-uniform with a = √5, whose bound is 1/√fan_in), B = 0. ``lora_init: uniform`` is the paper's
  "Uniform" init behind its headline numbers (Supp. K, Table 11): **both** A and B ~ U(−1/√d, 1/√d), drawn from
  a generator seeded with the experiment seed. The paper leaves d open (open point A2.11, docs/PAPERS.md); we take d = the input
  dimension of the LoRA'd linear layer (A's fan-in) for both factors — the bound peft uses for A, so "Uniform"
  differs from "Standard" only in B.
* ``none`` — only the task head trains.

``layer_pe: true`` (kinds ``lora`` and ``none``, image ViTs) adds the server-prescribed layer-wise trainable
positional embeddings of paper 001 eq. 6 on top of the kind (:mod:`gradleak.peft.layer_pe`; ``layer_pe_init``
``zeros`` or ``input``): a trainable p_l added to the input of every block but the first, the input position
table made trainable too. It needs ``threat.preset: prescribes-architecture`` (checked with the config).

Each kind is a :class:`PeftKind` subclass registered with ``@PEFT_KINDS.register``: its fields, its config rules,
how it is applied and the bottleneck width the evaluation reads.
Importing this module imports no torch.
"""

from __future__ import annotations

from typing import ClassVar, Literal, Optional

from pydantic import Field, field_validator

from gradleak.errors import BadInput
from gradleak.registry import Registry
from gradleak.validation import Checked

PEFT_KINDS: Registry[type["PeftKind"]] = Registry("peft kind")


class PeftConfig(Checked):
    """The ``peft:`` config section (one class for every kind; fields of other kinds are refused)."""

    kind: Literal["adapters", "lora", "none"] = "adapters"
    # adapters
    bottleneck: Optional[int] = Field(None, gt=0, description="adapter hidden units (ViT; default 64)")
    reduction_factor: int = Field(2, ge=1, description="text adapters: hidden_size / reduction_factor units")
    embedding_adapter: bool = True
    layer_adapters: Optional[list[int]] = Field(None, description="text: layers (0-based) that get an adapter; "
                                                "default every kept layer; [] = none (the embedding adapter only)")
    init_std: float = Field(0.02, gt=0)
    # lora
    lora_rank: int = Field(128, ge=1)
    lora_alpha: Optional[float] = Field(None, gt=0)  # default: = rank
    lora_targets: Optional[list[str]] = Field(None, description="module names that get LoRA (default: query + key "
                                              "projections; value for ViTs); an empty list is refused")
    lora_layers: Optional[list[int]] = Field(None, description="layers (0-based) that get LoRA (default: every "
                                             "layer); an empty list is refused")
    lora_init: Literal["nonzero", "default", "uniform"] = Field(
        "nonzero", description="nonzero: B ~ N(0, 0.02²); default|standard: peft's (B = 0); uniform: A, B ~ U(±1/√d_in) "
        "(paper 001 Table 11)")
    # lora / none: server-prescribed layer-wise trainable positional embeddings (paper 001 eq. 6)
    layer_pe: bool = Field(False, description="add a trainable PE to the input of every ViT block but the first "
                           "and train the input PE too (paper 001 eq. 6; needs threat.preset=prescribes-architecture)")
    layer_pe_init: Literal["zeros", "input"] = Field("zeros", description="layer-wise PE init: zeros (the model's "
                                                     "function unchanged) or a copy of the input PE")
    # all kinds
    train_head: bool = True

    @field_validator("kind", mode="before")
    @classmethod
    def _singular(cls, v):  # `adapter` (paper 004's name) = `adapters`
        return "adapters" if v == "adapter" else v

    @field_validator("lora_init", mode="before")
    @classmethod
    def _standard(cls, v):  # `standard` (paper 001 Table 11's name for peft's init) = `default`
        return "default" if v == "standard" else v

    def check(self, num_layers: Optional[int] = None) -> None:
        """Config-time checks (no model loaded); ``num_layers``: the layers the model keeps, when the config says."""
        # a field of another kind is refused when it holds a non-default value (a config switched with
        # --set peft.kind=lora may keep the adapters' defaults; a LoRA rank under kind=adapters is a mistake)
        foreign = sorted(f for f in self.model_fields_set - {"kind"} if f not in KIND_FIELDS[self.kind]
                         and getattr(self, f) != type(self).model_fields[f].default)
        if foreign:
            owner = next(k for k, fs in KIND_FIELDS.items() if foreign[0] in fs)
            raise BadInput(f"peft.{foreign[0]}", f"applies to peft.kind={owner}, not to peft.kind={self.kind}.",
                           f"remove it, or set peft.kind={owner}.")
        # an empty list where a list names "these" would silently mean "the default" (lora_targets) or "nowhere"
        for f, fix in (("lora_targets", "name modules (e.g. [query, value]) or remove the key for the default"),
                       ("lora_layers", "name layers (e.g. [0, 1]) or remove the key for every layer; peft.kind=none "
                        "trains the head alone")):
            if getattr(self, f) is not None and len(getattr(self, f)) == 0:
                raise BadInput(f"peft.{f}", "is an empty list.", fix + ".")
        peft_kind(self.kind).check(self)  # the kind's own rules
        if num_layers is not None:
            for f in ("layer_adapters", "lora_layers"):
                bad = [i for i in (getattr(self, f) or []) if not 0 <= i < num_layers]
                if bad and f in KIND_FIELDS[self.kind]:
                    raise BadInput(f"peft.{f}", f"layer {bad[0]} does not exist (model.layers keeps {num_layers}).",
                                   f"use indices in 0..{num_layers - 1}, or keep more layers (model.layers).")


class PeftKind:
    """One PEFT kind (a plug-in of :data:`PEFT_KINDS`, docs/DESIGN.md §2): the ``peft.*`` fields it reads, its own
    config rules, what it inserts into a model and the bottleneck width the evaluation reads of it, so the pipeline
    asks the kind instead of naming it."""

    #: the fields of :class:`PeftConfig` this kind reads (a field set for another kind is refused)
    fields: ClassVar[frozenset[str]] = frozenset()

    def check(self, spec: "PeftConfig") -> None:
        """The kind's own config-time rules (no model loaded), beyond :meth:`PeftConfig.check`'s shared ones."""

    def apply(self, handle, spec: "PeftConfig", seed: int) -> list[str]:
        """Insert the kind's trainable modules into ``handle.model`` (in place); the names of the trainable
        parameters."""
        raise NotImplementedError

    def bottleneck(self, cfg, handle, modality) -> int | None:
        """The PEFT bottleneck width the evaluation reads (:class:`gradleak.evaluation.Truth`'s ``bottleneck``) for
        the experiment ``cfg`` on ``handle``; ``modality``: the experiment's modality plug-in
        (:class:`gradleak.modalities.Modality`). None: the kind has no bottleneck."""
        return None


@PEFT_KINDS.register("adapters", "bottleneck adapters: ViT Houlsby placement (bottleneck) / text embedding + layer adapters")
class AdaptersKind(PeftKind):
    fields = frozenset({"bottleneck", "reduction_factor", "embedding_adapter", "layer_adapters", "init_std",
                        "train_head"})

    def check(self, spec: "PeftConfig") -> None:
        if spec.layer_adapters == [] and not spec.embedding_adapter:
            raise BadInput("peft.layer_adapters", "is empty and peft.embedding_adapter is false: no adapter anywhere.",
                           "name layers (e.g. [0]), remove peft.layer_adapters, or set peft.embedding_adapter=true.")

    def apply(self, handle, spec: "PeftConfig", seed: int) -> list[str]:
        if handle.modality == "image":
            from gradleak.peft.adapters import add_vit_adapters

            add_vit_adapters(handle.model, spec.bottleneck or 64, train_head=spec.train_head)
        else:
            from gradleak.peft.text_adapters import add_text_adapters

            add_text_adapters(handle.model, handle.layers(), handle.hidden_size, spec.reduction_factor,
                              embedding=spec.embedding_adapter, layer_ids=spec.layer_adapters, init_std=spec.init_std,
                              seed=seed)
            _set_head(handle.model, spec.train_head)
        return trainable(handle.model)

    def bottleneck(self, cfg, handle, modality) -> int | None:
        """The adapter width of the modality's models (``peft.bottleneck``; text: hidden size / reduction factor)."""
        return modality.bottleneck(cfg, handle)


@PEFT_KINDS.register("lora", "LoRA through HF peft on the named modules (rank, alpha, targets, layers, init)")
class LoraKind(PeftKind):
    fields = frozenset({"lora_rank", "lora_alpha", "lora_targets", "lora_layers", "lora_init", "train_head",
                        "layer_pe", "layer_pe_init"})

    def apply(self, handle, spec: "PeftConfig", seed: int) -> list[str]:
        try:
            from peft import LoraConfig, inject_adapter_in_model
        except ModuleNotFoundError:
            raise BadInput("peft.kind", "LoRA needs the `peft` package.", "pip install 'gradleak[peft]'.") from None
        model = handle.model
        targets = _lora_targets(handle, spec)
        n_layers = handle.num_layers
        layers = spec.lora_layers if spec.lora_layers is not None else list(range(n_layers))
        bad = [i for i in layers if not 0 <= i < n_layers]
        if bad:
            raise BadInput("peft.lora_layers", f"layer {bad[0]} does not exist (the model has {n_layers}).",
                           f"use indices in 0..{n_layers - 1}.")
        for p in model.parameters():
            p.requires_grad_(False)
        conf = LoraConfig(r=spec.lora_rank, lora_alpha=spec.lora_alpha or spec.lora_rank, target_modules=targets,
                          layers_to_transform=layers, lora_dropout=0.0, bias="none")
        inject_adapter_in_model(conf, model)
        _init_lora(model, spec.lora_init, seed)
        _set_head(model, spec.train_head)
        return trainable(model)

    def bottleneck(self, cfg, handle, modality) -> int | None:
        """The LoRA rank (``peft.lora_rank``)."""
        return cfg.peft.lora_rank


def _lora_targets(handle, spec: "PeftConfig") -> list[str]:
    """The module names LoRA goes on (``peft.lora_targets``, else the model kind's default); a name that matches no
    linear module of the model is refused with the model's own names."""
    from torch import nn

    from gradleak.models import DEFAULT_LORA_TARGETS

    default = DEFAULT_LORA_TARGETS.get(handle.kind, DEFAULT_LORA_TARGETS["bidirectional"])
    targets = spec.lora_targets or default
    linear_names = sorted({n.rsplit(".", 1)[-1] for n, m in handle.model.named_modules() if isinstance(m, nn.Linear)})
    missing = [t for t in targets if t not in linear_names]
    if missing:
        # the same projection under another family's name (a Llama config's q_proj on a BERT-family model)
        same = {"q_proj": "query", "k_proj": "key", "v_proj": "value", "query": "q_proj", "key": "k_proj",
                "value": "v_proj"}
        meant = [same.get(t) if t in missing else t for t in targets]
        hint = (f"; this model names them [{', '.join(meant)}]" if all(m in linear_names for m in meant) else "")
        raise BadInput("peft.lora_targets", f"no linear module is named {missing[0]!r} in {handle.name}{hint}.",
                       f"use module names of this model: {', '.join(linear_names)}.")
    return targets


def _init_lora(model, init: str, seed: int) -> None:
    """Make the injected LoRA factors trainable and initialise them as ``peft.lora_init`` says (module docstring):
    ``nonzero`` draws B ~ N(0, 0.02²), ``uniform`` A and B ~ U(−1/√d_in, 1/√d_in), ``default`` keeps peft's."""
    import torch

    g = torch.Generator().manual_seed(seed + 31)
    params = dict(model.named_parameters())
    for n, p in params.items():
        if "lora_" in n:
            p.requires_grad_(True)
            if "lora_B" in n and init == "nonzero":
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.02)
            elif init == "uniform" and ("lora_A" in n or "lora_B" in n):
                d_in = params[n.replace("lora_B", "lora_A")].shape[1]  # A is (r, d_in): the layer's input dim
                bound = 1.0 / d_in ** 0.5
                with torch.no_grad():
                    p.copy_((torch.rand(p.shape, generator=g, dtype=torch.float64) * 2 - 1).mul_(bound).to(p.dtype))


@PEFT_KINDS.register("none", "no PEFT module: only the task head trains")
class NoPeftKind(PeftKind):
    fields = frozenset({"train_head", "layer_pe", "layer_pe_init"})

    def apply(self, handle, spec: "PeftConfig", seed: int) -> list[str]:
        for p in handle.model.parameters():
            p.requires_grad_(False)
        _set_head(handle.model, True)
        return trainable(handle.model)


#: which fields of PeftConfig each kind reads (a field set for another kind is refused), from the kinds' own ``fields``
KIND_FIELDS: dict[str, set[str]] = {e.name: set(e.obj.fields) for e in PEFT_KINDS}


def peft_kind(name: str) -> PeftKind:
    """The PEFT kind plug-in named ``name`` (``peft.kind``)."""
    return PEFT_KINDS.get(name, field="peft.kind")()


def _set_head(model, train: bool) -> None:
    for attr in ("head", "classifier", "score"):
        head = getattr(model, attr, None)
        if head is not None:
            for p in head.parameters():
                p.requires_grad_(train)
            return


def trainable(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def apply_peft(handle, spec: PeftConfig, seed: int = 0) -> list[str]:
    """Insert the trainable modules ``spec`` describes into ``handle.model`` (in place, like peft's
    ``get_peft_model``) and return the names of the parameters the clients train."""
    names = peft_kind(spec.kind).apply(handle, spec, seed)
    if spec.layer_pe:
        if handle.modality != "image":
            raise BadInput("peft.layer_pe", "layer-wise positional embeddings are defined for image ViTs (paper 001 "
                           f"eq. 6), not for the {handle.modality} model {handle.name}.", "remove peft.layer_pe.")
        from gradleak.peft.layer_pe import add_layer_pe

        add_layer_pe(handle.model, spec.layer_pe_init)
        names = trainable(handle.model)
    if not names:
        raise BadInput("peft", f"peft.kind={spec.kind} leaves nothing trainable on {handle.name}.",
                       "use adapters or lora, or set peft.train_head=true.")
    return names
