"""Update transforms applied by the client before upload (PEFTLeak Fig. 21; UTR Table 3).

Each defense is a registered class with ``apply(update, ctx) -> update``. Randomness is seeded from
the defense's ``seed`` and the client id in ``ctx`` so runs are reproducible.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from gradleak.errors import BadInput
from gradleak.fl.core import Update
from gradleak.registry import DEFENSES


class DefenseConfig(BaseModel):
    """One entry of a config's ``defenses:`` list: ``{name: ..., <parameters>}``."""

    model_config = ConfigDict(extra="forbid")
    name: str
    params: dict[str, Any] = Field(default_factory=dict)


def _gen(ctx: dict, seed: int) -> torch.Generator:
    """Seeded per defense, client and round (``ctx["seed"]`` differs per round), so noise never repeats."""
    return torch.Generator().manual_seed(int(seed) * 1_000_003 + int(ctx.get("client_id", 0)) * 7_919
                                         + int(ctx.get("seed", 0)))


@DEFENSES.register("gaussian_noise", "add N(0, std^2) noise; std absolute or relative to the update's L2 norm")
class GaussianNoise:
    def __init__(self, std: float, relative: bool = False, seed: int = 0):
        if std < 0:
            raise BadInput("defenses.gaussian_noise.std", f"std must be >= 0, got {std}.", "use a non-negative std.")
        self.std, self.relative, self.seed = float(std), bool(relative), seed

    def apply(self, update: Update, ctx: dict) -> Update:
        g = _gen(ctx, self.seed)
        scale = self.std * (update.norm() if self.relative else 1.0)
        return update.map(lambda _, t: t + scale * torch.randn(t.shape, generator=g, dtype=torch.float64).to(t))


@DEFENSES.register("clipping", "scale the whole update down to L2 norm <= max_norm")
class Clipping:
    def __init__(self, max_norm: float):
        if max_norm <= 0:
            raise BadInput("defenses.clipping.max_norm", f"max_norm must be > 0, got {max_norm}.", "use e.g. 1.0.")
        self.max_norm = float(max_norm)

    def apply(self, update: Update, ctx: dict) -> Update:
        factor = min(1.0, self.max_norm / max(update.norm(), 1e-300))
        return update.map(lambda _, t: t * factor)


@DEFENSES.register("dp_gaussian", "clip the update to max_norm, then add N(0, (noise_multiplier*max_norm)^2) (UTR Table 3)")
class DPGaussian:
    def __init__(self, noise_multiplier: float, max_norm: float = 1.0, seed: int = 0):
        if noise_multiplier < 0:
            raise BadInput("defenses.dp_gaussian.noise_multiplier", "must be >= 0.", "use e.g. 1.0.")
        self.clip = Clipping(max_norm)
        self.noise = GaussianNoise(noise_multiplier * max_norm, relative=False, seed=seed)

    def apply(self, update: Update, ctx: dict) -> Update:
        return self.noise.apply(self.clip.apply(update, ctx), ctx)


@DEFENSES.register("topk_pruning", "zero all but the largest-magnitude (1 - prune_fraction) of the coordinates")
class TopKPruning:
    def __init__(self, prune_fraction: float):
        if not 0 <= prune_fraction < 1:
            raise BadInput("defenses.topk_pruning.prune_fraction", f"must be in [0, 1), got {prune_fraction}.",
                           "use e.g. 0.9 to zero 90% of the coordinates.")
        self.prune_fraction = float(prune_fraction)

    def apply(self, update: Update, ctx: dict) -> Update:
        flat = update.flat()
        keep = max(1, int(round(flat.numel() * (1 - self.prune_fraction))))
        thresh = flat.abs().kthvalue(flat.numel() - keep + 1).values if keep < flat.numel() else flat.abs().min() - 1
        return update.unflat(torch.where(flat.abs() >= thresh, flat, torch.zeros_like(flat)))


@DEFENSES.register("stochastic_quantization", "unbiased stochastic rounding of each tensor to 2^bits levels (QSGD-style)")
class StochasticQuantization:
    def __init__(self, bits: int, seed: int = 0):
        if bits < 1:
            raise BadInput("defenses.stochastic_quantization.bits", f"bits must be >= 1, got {bits}.", "use e.g. 8.")
        self.levels, self.seed = 2 ** int(bits) - 1, seed

    def apply(self, update: Update, ctx: dict) -> Update:
        g = _gen(ctx, self.seed)

        def q(_: str, t: torch.Tensor) -> torch.Tensor:
            lo, hi = t.min(), t.max()
            if hi <= lo:
                return t.clone()
            scaled = (t - lo) / (hi - lo) * self.levels
            floor = scaled.floor()
            up = (torch.rand(t.shape, generator=g, dtype=torch.float64).to(t) < (scaled - floor)).to(t.dtype)
            return lo + (floor + up) / self.levels * (hi - lo)

        return update.map(q)


def build_defenses(entries: list[DefenseConfig] | list[dict], seed: int = 0) -> list[Any]:
    """Instantiate defenses from config entries, with a clear error for bad names or parameters."""
    out = []
    for i, e in enumerate(entries):
        e = e if isinstance(e, DefenseConfig) else DefenseConfig(**e)
        cls = DEFENSES.get(e.name, field=f"defenses[{i}].name")
        params = dict(e.params)
        if "seed" in cls.__init__.__code__.co_varnames and "seed" not in params:
            params["seed"] = seed
        try:
            out.append(cls(**params))
        except TypeError as err:
            raise BadInput(f"defenses[{i}].params", f"bad parameters for '{e.name}': {err}.",
                           f"see `gradleak list` and the docstring of {cls.__name__}.") from None
    return out
