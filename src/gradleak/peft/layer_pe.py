"""Server-prescribed layer-wise trainable positional embeddings (paper 001 §3.4, eq. 6).

For every encoder block l ≥ 1 (0-based; "every block but the first") with input tokens x_l the block computes

    x'_l = x_l + p_l,    x̃_l = MHSA(LN(x'_l)) + x'_l,    x_{l+1} = x̃_l + MLP(LN'(x̃_l))          (eq. 6)

i.e. p_l is added to the block input and is part of the residual stream. Block 0 keeps the ordinary input position
table (``embeddings.position_embeddings``). "Ours" trains **all** PEs, the input table and every p_l (Table 5), together
with the PEFT modules (LoRA) and the head; the gradients of the p_l are the "layer-wise spatial anchors" the attack's
eq. 7 term matches (:mod:`gradleak.attacks.optimization`, ``anchor: true``).

Implementation: one ``nn.Parameter`` named ``layer_pe`` of shape (1, N + 1, d) registered on each block module
(``vit.encoder.layer.<l>.layer_pe``, so it travels in ``state_dict``, ``named_parameters`` and the clients' uploads)
and a forward pre-hook on that block that adds it to the block's ``hidden_states``. The hook is a module-level function
reading the parameter from the module it is called on, so ``copy.deepcopy`` (every client trains its own copy, every
attack works on its own copy) carries both. It works on the HF ViT (:mod:`gradleak.models.vit`, ``ViTLayer``) and
the DINOv2 classifier (:mod:`gradleak.models.dinov2`, ``Dinov2Layer``): both blocks take ``hidden_states`` first and
apply their residuals to it. No model file changes.

Decisions the paper leaves open (open point A2.2, docs/PAPERS.md), each recorded:

* **Initialisation** (``peft.layer_pe_init``): ``zeros`` (default) — the prescribed model then computes exactly the
  function of the model without layer-wise PEs at round 0 (the server's benign-architecture argument, Supp. B, holds
  trivially; accuracy is unchanged until the clients train the p_l), and the gradients of the head and LoRA are
  *identical* to those of the plain LoRA ViT, so an attack that ignores the PE gradients is exactly the paper's
  baseline on the same client update. ``input`` — a copy of the model's input position table in every block
  (LaPE-style "propagate the input PE"); this changes the function of a pretrained backbone at round 0.
  The gradient ∂L/∂p_l = Σ_b ∂L/∂x'_{l,b} does not depend on the value of p_l except through the forward pass.
* **Class token**: p_l covers all N + 1 tokens (CLS included), the same shape as the input table.
* **Which blocks**: l = 1 … L − 1 of the blocks the model keeps (a 1-block model gets none; the input table is
  still made trainable).
* **Input table trainable**: yes ("all PEs trainable", Table 5's "Ours" row that the attack results use).

Threat model: only a server that may choose the architecture can prescribe this (``threat.preset:
prescribes-architecture`` or ``malicious``); the config check refuses it under ``honest-but-curious``.
"""

from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from gradleak.errors import BadInput

#: name of the per-block parameter (``<prefix>encoder.layer.<l>.layer_pe``)
LAYER_PE = "layer_pe"
INITS = ("zeros", "input")

_LAYER_PE_RE = re.compile(r"(^|\.)encoder\.layer\.(\d+)\.layer_pe$")
_INPUT_PE_RE = re.compile(r"(^|\.)embeddings\.position_embeddings$")


def _add_layer_pe(module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of a block: hidden_states ← hidden_states + p_l (eq. 6, x'_l = x_l + p_l)."""
    pe = module.layer_pe
    if args:
        return (args[0] + pe,) + tuple(args[1:]), kwargs
    kwargs = dict(kwargs)
    kwargs["hidden_states"] = kwargs["hidden_states"] + pe
    return args, kwargs


def _backbone_parts(model: nn.Module):
    backbone = getattr(model, "vit", None)
    emb = getattr(backbone, "embeddings", None)
    blocks = getattr(getattr(backbone, "encoder", None), "layer", None)
    pos = getattr(emb, "position_embeddings", None)
    if emb is None or blocks is None or not isinstance(pos, nn.Parameter):
        raise BadInput("peft.layer_pe", "layer-wise positional embeddings attach to a ViT's encoder blocks "
                       f"(HF ViT / DINOv2 layout with a position table), which {type(model).__name__} does not have.",
                       "use an image ViT (vit-tiny, vit-s16, vit-b16, vit-s14-pretrained, ...) or remove peft.layer_pe.")
    return emb, blocks, pos


def add_layer_pe(model: nn.Module, init: str = "zeros") -> list[str]:
    """Insert trainable p_l into blocks 1 … L − 1 of ``model`` (in place), make the input position table trainable
    and return the names of every PE parameter (input table first). Idempotent: a model that already has them is
    left as it is (its PEs are made trainable)."""
    if init not in INITS:
        raise BadInput("peft.layer_pe_init", f"unknown initialisation '{init}'.", f"use one of: {', '.join(INITS)}.")
    emb, blocks, pos = _backbone_parts(model)
    pos.requires_grad_(True)
    for block in list(blocks)[1:]:
        if isinstance(getattr(block, LAYER_PE, None), nn.Parameter):
            block.layer_pe.requires_grad_(True)
            continue
        value = pos.detach().clone() if init == "input" else torch.zeros_like(pos)
        block.register_parameter(LAYER_PE, nn.Parameter(value, requires_grad=True))
        block.register_forward_pre_hook(_add_layer_pe, with_kwargs=True)
    return pe_parameter_names(n for n, _ in model.named_parameters())


def is_layer_pe(name: str) -> bool:
    """Whether ``name`` is a layer-wise PE p_l (l ≥ 1)."""
    return _LAYER_PE_RE.search(name) is not None


def is_input_pe(name: str) -> bool:
    """Whether ``name`` is the input position table of a ViT."""
    return _INPUT_PE_RE.search(name) is not None


def pe_parameter_names(names: Iterable[str]) -> list[str]:
    """The positional-embedding parameters among ``names``: the input table(s) first, then the p_l by block."""
    names = list(names)
    inp = [n for n in names if is_input_pe(n)]
    layer = sorted((n for n in names if is_layer_pe(n)), key=lambda n: int(_LAYER_PE_RE.search(n).group(2)))
    return inp + layer


def has_layer_pe(model_or_names) -> bool:
    """Whether a model (trainable parameters) or a list of parameter names holds at least one layer-wise PE."""
    if isinstance(model_or_names, nn.Module):
        return any(is_layer_pe(n) and p.requires_grad for n, p in model_or_names.named_parameters())
    return any(is_layer_pe(n) for n in model_or_names)
