"""Tiny LoRA + layer-wise-PE ViTs and one-client server views, shared by the optimisation-attack tests
(test_lora_vit_pe, test_gradvit, test_gias)."""

from __future__ import annotations

import torch

from gradleak.fl.core import Client, ServerView
from gradleak.models import ModelHandle
from gradleak.models.vit import vit
from gradleak.peft import PeftConfig, apply_peft


def lora_pe_vit(dtype=torch.float32, layers=2, init="zeros", rank=4, seed=0, size=8) -> ModelHandle:
    """A tiny ViT (size×size images, patch 4; 8 px: 4 tokens + CLS, d = 32) with LoRA on query + value and layer-wise
    PEs."""
    model = vit("vit-tiny", image_size=size, patch_size=4, hidden_size=32, heads=2, layers=layers, num_classes=4,
                dtype=dtype, seed=seed)
    handle = ModelHandle(model, "image", "vit-tiny", "image", 32, layers)
    apply_peft(handle, PeftConfig(kind="lora", lora_rank=rank, lora_targets=["query", "value"], layer_pe=True,
                                  layer_pe_init=init), seed=seed)
    return handle


def view_of(model, images01, targets, **public) -> ServerView:
    """The server's view of one FedSGD client training ``model`` on ``images01`` (in [0, 1])."""
    x = images01.to(next(model.parameters()).dtype) * 2 - 1
    upd = Client(0, x, targets).local_update(model)
    return ServerView(model=model, updates=[upd], public={"image_shape": tuple(x.shape[1:]), "num_classes": 4,
                                                          "batch_size": len(x), **public})
