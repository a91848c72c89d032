"""Eager attention that keeps the model's precision (for float64 second derivatives).

HF's ``eager_attention_forward`` (ViT, DINOv2, transformers 4.57) runs the softmax with ``dtype=torch.float32`` and
casts back, so a float64 model's attention probabilities carry float32 rounding (~1e-7 relative): a float64
gradient-matching objective is then not differentiable to better than ~1e-7, and finite-difference checks of its
double backward fail. ``eager_precise`` is the same computation with the softmax in the query's dtype when that is
float32 or float64 (bitwise the same as ``eager`` for float32 models), and in float32 for half types (as ``eager``).
It is registered in transformers' ``AttentionInterface`` and selected per model by :func:`use_precise_eager`; like
``eager`` it supports double backward (SDPA does not).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

PRECISE_EAGER = "eager_precise"
_registered = False


def eager_precise_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                    attention_mask: Optional[torch.Tensor], scaling: float, dropout: float = 0.0,
                                    **kwargs):
    """``eager_attention_forward`` of HF ViT/DINOv2 with the softmax in the model's precision (module docstring)."""
    attn = torch.matmul(query, key.transpose(-1, -2)) * scaling
    soft_dtype = query.dtype if query.dtype in (torch.float32, torch.float64) else torch.float32
    attn = nn.functional.softmax(attn, dim=-1, dtype=soft_dtype).to(query.dtype)
    attn = nn.functional.dropout(attn, p=dropout, training=module.training)
    if attention_mask is not None:  # HF ViT passes the head mask here
        attn = attn * attention_mask
    out = torch.matmul(attn, value).transpose(1, 2).contiguous()
    return out, attn


def register() -> str:
    """Register ``eager_precise`` with transformers (once) and return its name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(PRECISE_EAGER, eager_precise_attention_forward)
        _registered = True
    return PRECISE_EAGER


def use_precise_eager(model: nn.Module) -> bool:
    """Switch every HF config in ``model`` to ``eager_precise`` (in place); returns whether anything changed.
    Only for models whose attention is eager/SDPA-style (ViT, DINOv2); call it on a copy you own."""
    name = register()
    changed = False
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation") and cfg._attn_implementation != name:
            cfg._attn_implementation = name
            changed = True
    return changed
