"""Defenses: one registry (:data:`gradleak.registry.DEFENSES`), one protocol with a stage (:mod:`.base`).

* :mod:`.update` — update transforms on the client's upload (``defenses:``);
* :mod:`.training` — training-time defenses (``defense:``); :mod:`.filter` — the RDLV filter (also training-time);
* :mod:`.nvflare` — NVFlare's own privacy filters (``nvflare_percentile``, ``nvflare_svt``, ``nvflare_exclude``).

Importing the package registers every defense.
"""

import gradleak.defenses.filter  # noqa: F401  (registers rdlv_filter)
import gradleak.defenses.nvflare  # noqa: F401  (registers NVFlare's privacy filters; NVFlare imported when used)
import gradleak.defenses.training  # noqa: F401  (registers the training-time defenses)
from gradleak.defenses.base import (
    Defense,
    DefenseConfig,
    DefenseParams,
    DefenseSection,
    TrainingDefense,
    UpdateDefense,
    build_defense_section,
    build_defenses,
)
from gradleak.defenses.update import (
    Clipping,
    DPGaussian,
    GaussianNoise,
    PercentileNoise,
    StochasticQuantization,
    TopKPruning,
)

__all__ = ["Clipping", "DPGaussian", "Defense", "DefenseConfig", "DefenseParams", "DefenseSection", "GaussianNoise",
           "PercentileNoise", "StochasticQuantization", "TopKPruning", "TrainingDefense", "UpdateDefense",
           "build_defense_section", "build_defenses"]
