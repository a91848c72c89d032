"""Closed-form accounting of the full-batch Gaussian mechanism (no subsampling): what ``dp_gaussian``, Flower's
central DP wrappers and ``LocalDpMod`` over rounds claim, without importing Opacus (1.7 s) for a formula.

R compositions of the Gaussian mechanism with noise multiplier z (sensitivity 1, noise std z) are
(α, R·α / (2 z²))-RDP at every order α > 1 (Mironov 2017, Prop. 7 and composition). The conversion to (ε, δ) is
Balle et al. 2020 ("Hypothesis testing interpretations and Rényi differential privacy", Thm. 21):
ε = min over α of RDP(α) − (log δ + log α) / (α − 1) + log((α − 1) / α), over the orders Opacus' ``RDPAccountant``
uses, so the two give the same ε (``tests/test_dp_check.py`` compares them).
"""

from __future__ import annotations

import math

import numpy as np

#: the RDP orders (Opacus' RDPAccountant.DEFAULT_ALPHAS)
ORDERS = np.array([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)), dtype=float)


def gaussian_rdp_epsilon(noise_multiplier: float, steps: int, delta: float) -> float:
    """ε at ``delta`` of ``steps`` full-batch Gaussian mechanisms with ``noise_multiplier`` (inf without noise)."""
    if noise_multiplier <= 0:
        return math.inf
    if steps <= 0:
        return 0.0
    rdp = steps * ORDERS / (2.0 * noise_multiplier ** 2)
    eps = rdp - (math.log(delta) + np.log(ORDERS)) / (ORDERS - 1) + np.log((ORDERS - 1) / ORDERS)
    return float(np.nanmin(eps))


def classic_gaussian_z(epsilon: float, delta: float) -> float:
    """The classic Gaussian mechanism's noise std over its sensitivity for (ε, δ): √(2 ln(1.25/δ)) / ε (Dwork & Roth
    2014, Thm. A.1; what Flower's ``LocalDpMod`` adds)."""
    return math.sqrt(2 * math.log(1.25 / delta)) / epsilon
