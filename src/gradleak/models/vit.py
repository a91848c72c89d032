"""ViT classifiers on ``transformers`` (docs/DESIGN.md §3): any depth/width, image and patch size free.

:func:`vit` builds a :class:`ViTClassifier` = ``transformers.ViTModel`` (eager attention, no pooler) +
a linear head over **mean-pooled patch tokens** (``pooling="mean"``, as timm/DeiT-III ``global_pool='avg'``)
or over the class token (``pooling="cls"``, as HF ``ViTForImageClassification``). Inputs are pixels in
[-1, 1] (mean = std = 0.5 normalisation, PEFTLeak Sec. 4).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # transformers is imported when a ViT is built, not with this module
    from transformers import ViTConfig

from gradleak.errors import BadInput

PRESETS: dict[str, dict[str, int]] = {
    # name: hidden, layers, heads, patch
    "vit-b16": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, patch_size=16),
    "vit-b32": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, patch_size=32),
    "vit-l16": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, patch_size=16),
    "vit-s16": dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, patch_size=16),
    "vit-tiny": dict(hidden_size=192, num_hidden_layers=4, num_attention_heads=3, patch_size=8),
}


class PooledClassifier(nn.Module):
    """A transformer backbone in ``self.vit`` (built by the subclass) + pooling of its tokens + a linear head.
    ``forward(pixels) -> logits``; mean pooling skips the class token."""

    def __init__(self, config, num_classes: int, pooling: str = "mean"):
        super().__init__()
        if pooling not in ("mean", "cls"):
            raise BadInput("model.pooling", f"unknown pooling '{pooling}'.", "use 'mean' or 'cls'.")
        self.config = config
        self.pooling = pooling
        self.vit = self.build_backbone(config)
        self.head = nn.Linear(config.hidden_size, num_classes)

    def build_backbone(self, config) -> nn.Module:
        raise NotImplementedError

    @property
    def num_patches(self) -> int:
        return (self.config.image_size // self.config.patch_size) ** 2

    def pool(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens[:, 1:].mean(1) if self.pooling == "mean" else tokens[:, 0]

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        tokens = self.vit(pixel_values=pixel_values).last_hidden_state
        return self.head(self.pool(tokens))


class ViTClassifier(PooledClassifier):
    """``ViTModel`` (no pooler) + pooling + linear head."""

    def build_backbone(self, config: ViTConfig) -> nn.Module:
        from transformers import ViTModel

        return ViTModel(config, add_pooling_layer=False)


def vit(preset: str = "vit-b16", *, image_size: int = 32, patch_size: int | None = None, num_classes: int = 10,
        pooling: str = "mean", num_channels: int = 3, layers: int | None = None, hidden_size: int | None = None,
        heads: int | None = None, layer_norm_eps: float = 1e-12, dtype: torch.dtype = torch.float32,
        seed: int = 0, init_weights: bool = True) -> ViTClassifier:
    """Build a randomly initialised ViT classifier (weights are set by the experiment or a checkpoint).

    ``init_weights=False`` skips the random initialisation (seconds for ViT-B/L) when every weight is
    about to be overwritten, e.g. by a malicious server's poisoning; the values are then undefined.
    """
    from transformers import ViTConfig

    if preset not in PRESETS:
        raise BadInput("model.name", f"unknown ViT preset '{preset}'.", f"use one of {', '.join(PRESETS)}.")
    p = dict(PRESETS[preset])
    if patch_size is not None:
        p["patch_size"] = patch_size
    if layers is not None:
        p["num_hidden_layers"] = layers
    if hidden_size is not None:
        p["hidden_size"] = hidden_size
    if heads is not None:
        p["num_attention_heads"] = heads
    if p["patch_size"] <= 0 or image_size <= 0:
        raise BadInput("model.patch_size", "image and patch sizes must be positive.", "use e.g. image 32, patch 16.")
    if image_size % p["patch_size"]:
        raise BadInput("data.image_size", f"image size {image_size} is not divisible by the patch size {p['patch_size']}.",
                       f"resize the images to a multiple of {p['patch_size']} (e.g. {max(1, image_size // p['patch_size']) * p['patch_size']}) or change model.patch_size.")
    if p["hidden_size"] % p["num_attention_heads"]:
        raise BadInput("model.heads", f"hidden size {p['hidden_size']} is not divisible by {p['num_attention_heads']} heads.",
                       "choose a head count that divides the hidden size.")
    cfg = ViTConfig(image_size=image_size, num_channels=num_channels, intermediate_size=4 * p["hidden_size"],
                    hidden_act="gelu", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                    layer_norm_eps=layer_norm_eps, qkv_bias=True, **p)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    if init_weights:
        return ViTClassifier(cfg, num_classes, pooling).to(dtype)
    from transformers.modeling_utils import no_init_weights

    with no_init_weights(), torch.device("meta"):
        model = ViTClassifier(cfg, num_classes, pooling)
    return model.to_empty(device="cpu").to(dtype)
