"""ResNet-18 on ``transformers`` (DESIGN §3: no torchvision/timm) for the BN-aware leakage study (SPEC §4).

:func:`resnet18` builds a :class:`transformers.ResNetForImageClassification` with the ResNet-18 layout of
He et al. 2016 (Table 1): basic blocks, ``depths = [2, 2, 2, 2]``, widths ``[64, 128, 256, 512]``, a 7×7/2
stem convolution followed by a 3×3/2 max-pool, 20 ``BatchNorm2d`` layers (stem 1 + 8 blocks × 2 + the three
projection shortcuts of stages 2–4), global average pooling and a linear head. Inputs are
``num_channels``-channel images (default 1: the grey Fashion-MNIST stand-in for the paper's chest X-rays;
NVFlare's code replicates grey to 3 channels for its ImageNet-pretrained torchvision model, SPEC §4.5 —
``num_channels=3`` does that here). ``forward(pixel_values)`` returns an output with ``.logits`` (the
:func:`gradleak.fl.core.default_classification_loss` reads it). Pixel normalisation is the caller's.

Decisions the paper (SPEC §4.4: "ImageNet-pretrained ResNet-18") leaves to us, recorded here:

* **No pretrained weights.** No pretrained ResNet is available offline, so the weights are random (seeded
  ``torch.manual_seed(seed)`` before construction, transformers' ``_init_weights``: Kaiming-normal convs,
  BN γ = 1, β = 0); a backbone pretrained by us on a disjoint split is the pipeline's job (issue 9 §1).
* **BatchNorm** is PyTorch's default: momentum 0.1, ε = 1e-5, ``track_running_stats=True`` — the
  NVFlare code's ``bn_momentum = 0.1`` (SPEC §4.5). :mod:`gradleak.attacks.bn_stats` reads the momentum
  from the modules, so another value stays consistent.
* **Minimum image size.** In train mode BatchNorm needs more than one value per channel
  (``N·H·W > 1``). The last stage sees an ``⌈…⌈⌈H/2⌉/2⌉…/2⌉`` (five halvings) map, so at B = 1 a square
  image needs a side of at least :data:`MIN_IMAGE_SIZE_B1` = 33 (32 px gives a 1×1 map in ``layer4``;
  Fashion-MNIST's 28 px too — it must be upsampled, e.g. to 64). :func:`min_image_size` computes the
  bound for any batch size; :func:`check_train_bn_input` raises :class:`~gradleak.errors.BadInput`
  naming it; :func:`resnet18` checks it for ``min_batch_size`` (default 1: the high-risk client of the
  paper trains on one image, SPEC §4.4).
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
             min_batch_size: int = 1, dtype: torch.dtype = torch.float32, seed: int = 0):
    """ResNet-18 (``transformers.ResNetForImageClassification``, basic blocks, 20 BN layers), random init.

    ``image_size`` (side or ``(H, W)``) and ``min_batch_size`` are only checked (the network accepts any size
    ≥ the minimum): BadInput when train-mode BN would fail (see the module docstring).
    """
    from transformers import ResNetConfig, ResNetForImageClassification

    if num_classes < 2:
        raise BadInput("model.num_classes", f"need at least 2 classes, got {num_classes}.")
    if num_channels < 1:
        raise BadInput("model.num_channels", f"need at least 1 input channel, got {num_channels}.")
    hw = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
    check_train_bn_input(int(hw[0]), int(hw[1]), min_batch_size)
    cfg = ResNetConfig(num_channels=num_channels, embedding_size=EMBEDDING_SIZE, hidden_sizes=list(HIDDEN_SIZES),
                       depths=list(DEPTHS), layer_type="basic", hidden_act="relu", downsample_in_first_stage=False,
                       num_labels=num_classes)
    torch.manual_seed(seed)
    model = ResNetForImageClassification(cfg).to(dtype)
    n_bn = sum(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    if n_bn != NUM_BN_LAYERS:  # pragma: no cover - guards against a transformers layout change
        raise RuntimeError(f"expected {NUM_BN_LAYERS} BatchNorm layers in ResNet-18, found {n_bn}")
    return model


def num_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = ["resnet18", "feature_map_sizes", "min_image_size", "check_train_bn_input", "MIN_IMAGE_SIZE_B1",
           "NUM_BN_LAYERS"]
