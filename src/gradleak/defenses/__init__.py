"""Defenses: one registry (:data:`gradleak.registry.DEFENSES`), one protocol with a stage (:mod:`.base`).

* :mod:`.update` — update transforms on the client's upload (``defenses:``);
* :mod:`.training` — training-time defenses (``defense:``); :mod:`.filter` — the RDLV filter (also training-time);
* :mod:`.nvflare` — NVFlare's own privacy filters (``nvflare_percentile``, ``nvflare_svt``, ``nvflare_exclude``).

Every module of this package is imported (and so registers its defenses) when the package is imported, as the
attacks are (:mod:`gradleak.attacks`): adding a defense means adding its module, nothing else here; a defense's
optional dependencies (NVFlare) are imported inside its functions only.
"""

import importlib as _importlib
import pkgutil as _pkgutil

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

for _info in _pkgutil.iter_modules(__path__):
    if not _info.name.startswith("_"):
        _importlib.import_module(f"{__name__}.{_info.name}")

__all__ = ["Clipping", "DPGaussian", "Defense", "DefenseConfig", "DefenseParams", "DefenseSection", "GaussianNoise",
           "PercentileNoise", "StochasticQuantization", "TopKPruning", "TrainingDefense", "UpdateDefense",
           "build_defense_section", "build_defenses"]
