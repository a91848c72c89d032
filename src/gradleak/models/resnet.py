"""ResNet-18 on ``transformers`` (docs/DESIGN.md §3: no torchvision/timm) for the BN-aware leakage study (Hatamizadeh et al. 2022).

:func:`resnet18` builds a :class:`transformers.ResNetForImageClassification` with the ResNet-18 layout of
He et al. 2016 (Table 1): basic blocks, ``depths = [2, 2, 2, 2]``, widths ``[64, 128, 256, 512]``, a 7×7/2
stem convolution followed by a 3×3/2 max-pool, 20 ``BatchNorm2d`` layers (stem 1 + 8 blocks × 2 + the three
projection shortcuts of stages 2–4), global average pooling and a linear head. Inputs are
``num_channels``-channel images (default 1: the grey Fashion-MNIST stand-in for the paper's chest X-rays;
NVFlare's code replicates grey to 3 channels for its ImageNet-pretrained torchvision model (authors' code) —
``num_channels=3`` does that here). ``forward(pixel_values)`` returns an output with ``.logits`` (the
:func:`gradleak.fl.core.default_classification_loss` reads it). Pixel normalisation is the caller's.

Decisions the paper (§III-A: an ImageNet-pretrained ResNet-18) leaves to us, recorded here:

* **No pretrained weights.** No pretrained ResNet is available offline, so the weights are random (seeded
  ``torch.manual_seed(seed)`` before construction, transformers' ``_init_weights``: Kaiming-normal convs,
  BN γ = 1, β = 0); a backbone pretrained by us on a disjoint split is the pipeline's job (:mod:`gradleak.models.pretrain`).
* **BatchNorm** is PyTorch's default: momentum 0.1, ε = 1e-5, ``track_running_stats=True`` — the
  NVFlare code's ``bn_momentum = 0.1``. :mod:`gradleak.attacks.common.bn_stats` reads the momentum
  from the modules, so another value stays consistent.
* **GroupNorm variant** (``norm="group"``, config ``model.norm``): for DP-SGD, which Opacus refuses on
  BatchNorm; every BN becomes ``GroupNorm(min(32, C), C)`` by hand (:func:`to_groupnorm` says why not Opacus'
  ``ModuleValidator.fix``). It has no running statistics, so its uploads carry no BN buffers.
* **Minimum image size.** In train mode BatchNorm needs more than one value per channel
  (``N·H·W > 1``). The last stage sees an ``⌈…⌈⌈H/2⌉/2⌉…/2⌉`` (five halvings) map, so at B = 1 a square
  image needs a side of at least :data:`MIN_IMAGE_SIZE_B1` = 33 (32 px gives a 1×1 map in ``layer4``;
  Fashion-MNIST's 28 px too — it must be upsampled, e.g. to 64). :func:`min_image_size` computes the
  bound for any batch size; :func:`check_train_bn_input` raises :class:`~gradleak.errors.BadInput`
  naming it; :func:`resnet18` checks it for ``min_batch_size`` (default 1: the high-risk client of the
  paper trains on one image, §III-E).
"""

from __future__ import annotations

from typing import Sequence

import torch

from gradleak.errors import BadInput

DEPTHS = (2, 2, 2, 2)
HIDDEN_SIZES = (64, 128, 256, 512)
EMBEDDING_SIZE = 64
NUM_BN_LAYERS = 20


def _conv_out(size: int, kernel: int, stride: int, padding: int) -> int:
    return (size + 2 * padding - kernel) // stride + 1


def feature_map_sizes(height: int, width: int, num_stages: int = len(DEPTHS),
                      downsample_in_first_stage: bool = False) -> list[tuple[int, int]]:
    """Spatial size after the stem (conv 7×7/2 pad 3, max-pool 3×3/2 pad 1) and after each stage.

    Returns ``[(h, w) after the stem, (h, w) after stage 1, …]``; a stride-2 stage halves with ``⌈·/2⌉``
    (3×3/2 pad 1 conv and 1×1/2 shortcut give the same size).
    """
    h, w = _conv_out(height, 7, 2, 3), _conv_out(width, 7, 2, 3)
    h, w = _conv_out(h, 3, 2, 1), _conv_out(w, 3, 2, 1)
    out = [(h, w)]
    for s in range(num_stages):
        stride = 2 if (s > 0 or downsample_in_first_stage) else 1
        h, w = _conv_out(h, 3, stride, 1), _conv_out(w, 3, stride, 1)
        out.append((h, w))
    return out


def min_image_size(batch_size: int = 1, num_stages: int = len(DEPTHS)) -> int:
    """Smallest square side for which every BatchNorm layer sees > 1 value per channel at ``batch_size``."""
    if batch_size < 1:
        raise BadInput("data.batch_size", f"batch size must be ≥ 1, got {batch_size}.")
    side = 1
    while True:
        h, w = feature_map_sizes(side, side, num_stages)[-1]
        if batch_size * h * w > 1:
            return side
        side += 1


MIN_IMAGE_SIZE_B1 = min_image_size(1)  # = 33


def check_train_bn_input(height: int, width: int, batch_size: int = 1, num_stages: int = len(DEPTHS),
                         field: str = "data.image_size") -> None:
    """BadInput unless train-mode BatchNorm works for ``batch_size`` images of ``height``×``width``."""
    h, w = feature_map_sizes(height, width, num_stages)[-1]
    if batch_size * h * w <= 1:
        need = min_image_size(batch_size, num_stages)
        raise BadInput(field, f"{height}×{width} images are too small for ResNet-18 in train mode at batch size "
                       f"{batch_size}: the last stage's feature map is {h}×{w}, so BatchNorm sees one value per "
                       f"channel.", f"use images of at least {need}×{need} pixels (e.g. upsample Fashion-MNIST's "
                       f"28 px to 64), or a batch size ≥ 2.")


def resnet18(*, num_classes: int = 10, num_channels: int = 1, image_size: int | Sequence[int] = 64,
             min_batch_size: int = 1, dtype: torch.dtype = torch.float32, seed: int = 0, norm: str = "batch"):
    """ResNet-18 (``transformers.ResNetForImageClassification``, basic blocks, 20 BN layers), random init.

    ``image_size`` (side or ``(H, W)``) and ``min_batch_size`` are only checked (the network accepts any size
    ≥ the minimum): BadInput when train-mode BN would fail (see the module docstring).

    ``norm="group"``: the same network with every ``BatchNorm2d`` replaced by ``GroupNorm`` (see
    :func:`to_groupnorm`) — what DP-SGD needs (Opacus refuses BatchNorm, whose output mixes the samples). The
    convolutions and the head get the same seeded weights as the BatchNorm model; no image-size minimum applies
    (GroupNorm normalises each sample on its own).
    """
    from transformers import ResNetConfig, ResNetForImageClassification

    if num_classes < 2:
        raise BadInput("model.num_classes", f"need at least 2 classes, got {num_classes}.")
    if num_channels < 1:
        raise BadInput("model.num_channels", f"need at least 1 input channel, got {num_channels}.")
    if norm not in ("batch", "group"):
        raise BadInput("model.norm", f"unknown normalisation '{norm}'.", "use model.norm=batch or group.")
    hw = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
    if norm == "batch":
        check_train_bn_input(int(hw[0]), int(hw[1]), min_batch_size)
    cfg = ResNetConfig(num_channels=num_channels, embedding_size=EMBEDDING_SIZE, hidden_sizes=list(HIDDEN_SIZES),
                       depths=list(DEPTHS), layer_type="basic", hidden_act="relu", downsample_in_first_stage=False,
                       num_labels=num_classes)
    torch.manual_seed(seed)
    model = ResNetForImageClassification(cfg).to(dtype)
    n_bn = sum(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    if n_bn != NUM_BN_LAYERS:  # pragma: no cover - guards against a transformers layout change
        raise RuntimeError(f"expected {NUM_BN_LAYERS} BatchNorm layers in ResNet-18, found {n_bn}")
    if norm == "group":
        to_groupnorm(model)
    return model


def _residual_basic_layer_class():
    from transformers.models.resnet.modeling_resnet import ResNetBasicLayer

    class ResidualBasicLayer(ResNetBasicLayer):
        """transformers' basic block with the residual added out of place (``h + r`` for ``h += r``): the same
        function, but the block output no longer modifies in place the output of the last normalisation layer,
        which Opacus' full backward hooks forbid ("Output 0 of BackwardHookFunction is a view and is being
        modified inplace")."""

        def forward(self, hidden_state):
            return self.activation(self.layer(hidden_state) + self.shortcut(hidden_state))

    ResidualBasicLayer.__qualname__ = "_ResidualBasicLayer"  # picklable as this module's global
    return ResidualBasicLayer


_ResidualBasicLayer = None  # built on first use (transformers is imported lazily)


def to_groupnorm(model) -> None:
    """Replace, in place, every ``BatchNorm2d`` of a transformers ResNet by ``nn.GroupNorm(min(32, C), C)``.

    Replaced by hand, not with Opacus' ``ModuleValidator.fix``: that builds the very same modules
    (``GroupNorm(gcd(32, C), C, affine=True)``, = min(32, C) for ResNet-18's widths 64…512, same parameter
    names), but Opacus is an optional dependency (``gradleak[dp]``), it returns float32 modules whatever the
    model's dtype, and the in-place residual addition still has to be fixed for Opacus' hooks (below). Each
    GroupNorm keeps the BatchNorm's ε and dtype/device and starts at γ = 1, β = 0 (transformers' BN init), so
    the replacement draws no random numbers. The basic blocks become :func:`_residual_basic_layer_class`'s
    out-of-place variant (same function, same state dict).
    """
    global _ResidualBasicLayer
    from transformers.models.resnet.modeling_resnet import ResNetBasicLayer

    if _ResidualBasicLayer is None:
        _ResidualBasicLayer = _residual_basic_layer_class()
    for mod in list(model.modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, torch.nn.BatchNorm2d):
                ref = child.weight if child.weight is not None else next(model.parameters())
                gn = torch.nn.GroupNorm(min(32, child.num_features), child.num_features, eps=child.eps,
                                        affine=child.affine).to(device=ref.device, dtype=ref.dtype)
                setattr(mod, child_name, gn)
        if type(mod) is ResNetBasicLayer:
            mod.__class__ = _ResidualBasicLayer


def num_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = ["resnet18", "feature_map_sizes", "min_image_size", "check_train_bn_input", "MIN_IMAGE_SIZE_B1",
           "NUM_BN_LAYERS", "to_groupnorm"]
