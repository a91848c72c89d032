"""The BatchNorm layers of a model that carry running statistics (read by BN-aware attacks and the RDLV filter)."""

from __future__ import annotations

from torch import nn

from gradleak.errors import BadInput

_BN = nn.modules.batchnorm._BatchNorm


def batchnorm_layers(model: nn.Module, field: str = "model") -> dict[str, nn.Module]:
    """Named BN modules that track running statistics; BadInput when the model has none."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, _BN) and m.track_running_stats}
    if not layers:
        raise BadInput(field, f"the model ({type(model).__name__}) has no BatchNorm layer with running statistics, "
                       "so a BN-aware attack or BN-statistics inference has nothing to read.",
                       "use a BatchNorm model (e.g. model.name: resnet18), or an attack that does not need BN "
                       "statistics (e.g. inverting_gradients).")
    return layers


__all__ = ["batchnorm_layers"]
