"""Bottleneck adapters for text models as UTR places them (UTR paper Sec. 3.1): an *embedding adapter* right after the
embedding layer (MAD-X position) and *layer adapters* between transformer layers.

Adapter = down-projection d -> d/rf, ReLU, up-projection d/rf -> d, residual (Houlsby/Pfeiffer layout).

Why our own small module and not AdapterHub ``adapters``: AdapterHub inserts bottleneck adapters *inside*
each transformer layer (after the attention / FFN sub-blocks, before the residual LayerNorm), and its MAD-X
"embedding" module is an invertible NICE-style adapter, not a bottleneck. The paper's attack surface is a
bottleneck whose input is exactly (a) the embedding output and (b) the hidden state *between* layers, a
placement AdapterHub cannot express. These adapters are attached with forward(-pre) hooks, so the
HF model code is untouched; hooks are small callable objects (not closures) so ``copy.deepcopy`` of the
model (FedAvg local training) rewires them to the copied adapters.

Parameter names in the update (the attacks rely on them):
``text_adapters.embedding.down.weight`` / ``.bias``, ``text_adapters.layer_{i}.down.weight``, ... where
``layer_i`` sits after transformer layer i (0-based), so ``layer_0`` is the paper's "first layer adapter".
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch import nn

from gradleak.errors import BadInput

PREFIX = "text_adapters"
VALID_REDUCTION_FACTORS = (1, 2, 4, 8, 16, 32)


class Bottleneck(nn.Module):
    """y = x + up(ReLU(down(x))). ``up`` is initialised small but non-zero (std ``init_std``): with a zero
    up-projection the down-projection would receive no gradient at all in the first round."""

    def __init__(self, hidden: int, bottleneck: int, init_std: float = 0.02):
        super().__init__()
        self.down = nn.Linear(hidden, bottleneck)
        self.up = nn.Linear(bottleneck, hidden)
        nn.init.normal_(self.down.weight, std=hidden ** -0.5)
        nn.init.normal_(self.down.bias, std=0.1)
        nn.init.normal_(self.up.weight, std=init_std)
        nn.init.zeros_(self.up.bias)
        self._capture: list[torch.Tensor] | None = None
        #: FISGuard's fixed-down adapter (gradleak.peft.fisguard): z = Q x, no non-linearity
        self.fixed_input = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._capture is not None:
            self._capture.append(x.detach())
            if getattr(self, "_stop", False):
                raise StopForward()
        z = self.down(x)
        return x + self.up(z if self.fixed_input else torch.relu(z))


class StopForward(Exception):
    """Raised by a capturing adapter to cut a probe forward pass short (only the adapter's input is needed)."""


class _PreHook:
    def __init__(self, adapter: Bottleneck):
        self.adapter = adapter

    def __call__(self, module, args, kwargs):
        if args:
            return (self.adapter(args[0]),) + tuple(args[1:]), kwargs
        kwargs = dict(kwargs)
        kwargs["hidden_states"] = self.adapter(kwargs["hidden_states"])
        return args, kwargs


class _PostHook:
    def __init__(self, adapter: Bottleneck):
        self.adapter = adapter

    def __call__(self, module, args, output):
        if isinstance(output, tuple):
            return (self.adapter(output[0]),) + tuple(output[1:])
        if hasattr(output, "last_hidden_state"):
            output.last_hidden_state = self.adapter(output.last_hidden_state)
            return output
        return self.adapter(output)


def add_text_adapters(model: nn.Module, layers: nn.ModuleList, hidden_size: int, reduction_factor: int,
                      embedding: bool = True, layer_ids: Iterable[int] | None = None, init_std: float = 0.02,
                      seed: int = 0) -> list[str]:
    """Insert the embedding adapter and layer adapters; freeze nothing else (the caller froze the backbone).

    The embedding adapter is a forward-pre-hook on layer 0 (its input *is* the embedding output, also when
    the caller passes ``inputs_embeds``); layer adapter i is a forward hook on layer i.
    Returns the names of the new trainable parameters.
    """
    rf = int(reduction_factor)
    if rf < 1 or hidden_size % rf != 0:
        raise BadInput("peft.reduction_factor", f"{reduction_factor} does not divide the hidden size {hidden_size}.",
                       f"use a divisor of {hidden_size}, e.g. one of "
                       f"{[r for r in VALID_REDUCTION_FACTORS if hidden_size % r == 0]}.")
    if hasattr(model, PREFIX):
        raise BadInput("peft", "the model already has text adapters.", "load a fresh model.")
    ids = list(range(len(layers))) if layer_ids is None else sorted(set(int(i) for i in layer_ids))
    for i in ids:
        if not 0 <= i < len(layers):
            raise BadInput("peft.layer_adapters", f"layer {i} does not exist (the model keeps {len(layers)} layer(s)).",
                           f"use indices in 0..{len(layers) - 1}, or keep more layers (model.layers).")
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed + 7919)
    dtype = next(model.parameters()).dtype
    mods = nn.ModuleDict()
    if embedding:
        mods["embedding"] = Bottleneck(hidden_size, hidden_size // rf, init_std).to(dtype)
    for i in ids:
        mods[f"layer_{i}"] = Bottleneck(hidden_size, hidden_size // rf, init_std).to(dtype)
    torch.random.set_rng_state(gen_state)
    model.add_module(PREFIX, mods)
    if embedding:
        layers[0].register_forward_pre_hook(_PreHook(mods["embedding"]), with_kwargs=True)
    for i in ids:
        layers[i].register_forward_hook(_PostHook(mods[f"layer_{i}"]))
    for p in mods.parameters():
        p.requires_grad_(True)
    return [f"{PREFIX}.{n}" for n, _ in mods.named_parameters()]


def adapter_param(name: str, part: str = "down.weight") -> str:
    """Full parameter name of an adapter part, e.g. ``adapter_param('layer_0')``."""
    return f"{PREFIX}.{name}.{part}"


class capture_inputs:
    """Context manager: record the inputs of the given adapters during forward passes of the model.

    ``stop=True`` aborts the forward pass right after the *last* listed adapter has seen its input (the
    probe only needs that), which makes membership tests cheap.
    """

    def __init__(self, model: nn.Module, names: Sequence[str], stop: bool = True):
        mods = getattr(model, PREFIX, None)
        if mods is None:
            raise BadInput("model", "the model has no text adapters.", "attach them with add_text_adapters().")
        self.mods = [mods[n] for n in names]
        self.stop = stop
        self.records: list[list[torch.Tensor]] = [[] for _ in names]

    def __enter__(self):
        for m, r in zip(self.mods, self.records):
            m._capture = r
            m._stop = False
        if self.stop:
            self.mods[-1]._stop = True
        return self

    def __exit__(self, *exc):
        for m in self.mods:
            m._capture = None
            m._stop = False
        return exc[0] is StopForward  # swallow the early stop


def probe(model: nn.Module, names: Sequence[str], **inputs) -> list[torch.Tensor]:
    """Run the model (no grad) and return the input of each named adapter (stopping after the last one)."""
    with torch.no_grad():
        cap = capture_inputs(model, names, stop=True)
        with cap:
            model(**inputs)
    return [r[-1] for r in cap.records]
