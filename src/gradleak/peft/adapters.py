"""Bottleneck adapters in the Houlsby layout for ViTs (PEFTLeak Fig. 2): one after MSA, one after MLP.

We write this small module instead of using AdapterHub ``adapters`` (docs/DESIGN.md §3 allows it): PEFTLeak
needs (i) the adapter input to be exactly the MSA / MLP output with the adapter's *own* residual
before the block residual (authors' code), (ii) a ReLU that zeroes negative inputs exactly (open
point A1.10a, docs/PAPERS.md), (iii) float64 and stable parameter names the server writes every round. AdapterHub's ViT
integration fuses its residual with the block's and adds scaling/LN options; keeping the layout
explicit here makes the threat model auditable.

Adapter: ``out = h + up(relu(down(h)))``, down: D -> r, up: r -> D.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from gradleak.errors import BadInput


class BottleneckAdapter(nn.Module):
    def __init__(self, dim: int, bottleneck: int):
        super().__init__()
        self.down = nn.Linear(dim, bottleneck)
        self.up = nn.Linear(bottleneck, dim)
        nn.init.normal_(self.down.weight, std=1e-2)
        nn.init.zeros_(self.down.bias)
        nn.init.zeros_(self.up.weight)  # Houlsby near-identity init
        nn.init.zeros_(self.up.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.up(torch.relu(self.down(h)))


class AdaptedLinear(nn.Module):
    """A frozen linear layer followed by a bottleneck adapter (``adapter(base(x))``)."""

    def __init__(self, base: nn.Linear, adapter: BottleneckAdapter):
        super().__init__()
        self.base = base
        self.adapter = adapter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.adapter(self.base(x))


@dataclass(frozen=True)
class AdapterSlot:
    """One adapter position: block index and ``kind`` ("msa" after attention, "mlp" after the MLP)."""

    block: int
    kind: str
    mlp_out: str = "output.dense"  # the MLP's output projection: HF ViT ``output.dense``, DINOv2 ``mlp.fc2``

    @property
    def prefix(self) -> str:
        where = "attention.output.dense" if self.kind == "msa" else self.mlp_out
        return f"vit.encoder.layer.{self.block}.{where}.adapter"


def _mlp_out(layer: nn.Module) -> str:
    """Path of a ViT block's MLP output projection (HF ViTLayer, or the DINOv2 layout of the pretrained ViT-S/14)."""
    if isinstance(getattr(getattr(layer, "output", None), "dense", None), nn.Linear):
        return "output.dense"
    if isinstance(getattr(getattr(layer, "mlp", None), "fc2", None), nn.Linear):
        return "mlp.fc2"
    raise BadInput("peft.kind", f"bottleneck adapters do not know the MLP layout of {type(layer).__name__}.",
                   "use peft.kind=lora, or a ViT with HF ViT or DINOv2 blocks.")


def add_vit_adapters(model: nn.Module, bottleneck: int, train_head: bool = True) -> list[AdapterSlot]:
    """Insert adapters after MSA and after MLP in every block; freeze everything else.

    Returns the slots in forward order (block 0 msa, block 0 mlp, block 1 msa, ...).
    """
    if bottleneck <= 0:
        raise BadInput("model.adapter_bottleneck", f"the adapter bottleneck r must be > 0, got {bottleneck}.",
                       "use e.g. 64 (the PEFTLeak default).")
    dim = model.config.hidden_size
    dtype = next(model.parameters()).dtype
    for p in model.parameters():
        p.requires_grad_(False)
    slots = []
    for i, layer in enumerate(model.vit.encoder.layer):
        layer.attention.output.dense = AdaptedLinear(layer.attention.output.dense, BottleneckAdapter(dim, bottleneck).to(dtype))
        mlp = _mlp_out(layer)
        parent = layer.get_submodule(mlp.rsplit(".", 1)[0])
        leaf = mlp.rsplit(".", 1)[1]
        setattr(parent, leaf, AdaptedLinear(getattr(parent, leaf), BottleneckAdapter(dim, bottleneck).to(dtype)))
        slots += [AdapterSlot(i, "msa", mlp), AdapterSlot(i, "mlp", mlp)]
    for n, p in model.named_parameters():
        if ".adapter." in n or (train_head and n.startswith("head.")):
            p.requires_grad_(True)
    return slots


def get_adapter(model: nn.Module, slot: AdapterSlot) -> BottleneckAdapter:
    return model.get_submodule(slot.prefix)
