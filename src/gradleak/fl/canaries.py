"""Canary clients for the one-shot empirical ε (Andrew et al., ICLR 2024, arXiv 2302.03098, Sec. 4 / Alg. 2).

A canary client takes part in the rounds like any client (every engine calls ``for_round`` and ``local_update``), but
its "training" ignores the model: it uploads a fixed random direction of the trainable (PEFT) parameter space,
isotropic and of unit norm, scaled :data:`CANARY_SCALE` times beyond the declared clipping bound, so a mechanism that
clips as it claims passes exactly the bound and one that does not passes far more. Its update defenses run on it as on
a real client's upload. Under DP-SGD (a training-time defense) the canary is one example whose per-sample gradient is
that direction (:meth:`gradleak.defenses.training.DPSGD.local_update`): example-level DP then covers it as it covers
every private sample.

Directions are drawn from a seeded generator, one per canary index, never stored: :func:`direction` regenerates them
for the statistics (the paper's code does the same), so k canaries cost no k × d memory.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from gradleak.fl.core import Update, apply_update_defenses

#: a canary's norm over the clipping bound it should be clipped to
CANARY_SCALE = 1e3


def direction(shapes: Sequence[tuple[str, torch.Size]], seed: int, index: int) -> torch.Tensor:
    """The flat unit direction (float64, the order of ``shapes``) of canary ``index`` (inserted or not) under
    ``seed``."""
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + 7_907 * int(index) + 12_345)
    n = sum(int(torch.Size(s).numel()) for _, s in shapes)
    v = torch.randn(n, generator=g, dtype=torch.float32).to(torch.float64)  # float32 draws: 6× faster, as isotropic
    return v / v.norm()


class CanaryClient:
    """A client whose upload is ``scale`` × the unit direction of canary ``index`` (:func:`direction`)."""

    canary = True
    reads_model = False  # the engines hand it the sent model itself, not a copy: it never touches it

    def __init__(self, client_id: int, index: int, shapes: Sequence[tuple[str, torch.Size]], seed: int, scale: float,
                 num_samples: int = 1):
        self.client_id, self.index, self.shapes, self.seed = client_id, index, list(shapes), seed
        self.scale, self._n = float(scale), int(num_samples)

    @property
    def num_samples(self) -> int:
        return self._n

    def for_round(self, round_index: int) -> "CanaryClient":
        return self

    def unit(self) -> torch.Tensor:
        """Its flat unit direction (float64); drawn once and kept in float32 (the statistics read it again)."""
        if getattr(self, "_unit", None) is None:
            self._unit = direction(self.shapes, self.seed, self.index).to(torch.float32)
        return self._unit.to(torch.float64)

    def tensors(self, scale: float | None = None) -> dict[str, torch.Tensor]:
        """The canary as per-parameter tensors (float64), ``scale`` × its unit direction."""
        v = self.unit() * (self.scale if scale is None else scale)
        out, i = {}, 0
        for name, shape in self.shapes:
            k = int(torch.Size(shape).numel())
            out[name] = v[i:i + k].reshape(shape)
            i += k
        return out

    def local_update(self, model: Any, *, algorithm: str = "fedsgd", epochs: int = 1, lr: float = 0.01,
                     batch_size: int | None = None, defenses: Sequence[Any] = (), seed: int = 0,
                     in_place: bool = False) -> Update:
        kind = "gradient" if algorithm == "fedsgd" else "pseudo_gradient"
        upd = Update(self.tensors(), self._n, self.client_id, kind, 1)
        upd = apply_update_defenses(upd, defenses, client_id=self.client_id, seed=seed, lr=lr)
        return upd


def flat(tensors: dict[str, torch.Tensor], shapes: Sequence[tuple[str, torch.Size]]) -> torch.Tensor:
    """``tensors`` flattened in the order of ``shapes`` (float64, CPU); a missing tensor counts as zeros."""
    parts = []
    for name, shape in shapes:
        t = tensors.get(name)
        parts.append(torch.zeros(int(torch.Size(shape).numel()), dtype=torch.float64) if t is None
                     else t.detach().reshape(-1).to("cpu", torch.float64))
    return torch.cat(parts)
