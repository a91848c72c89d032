"""Client-side update defenses shared by every attack."""

from gradleak.defenses.update import (
    Clipping,
    GaussianNoise,
    StochasticQuantization,
    TopKPruning,
    build_defenses,
)

__all__ = ["GaussianNoise", "Clipping", "TopKPruning", "StochasticQuantization", "build_defenses"]
