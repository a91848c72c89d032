"""Moved to :mod:`gradleak.accounting` (foundation math every layer may use: the Flower engine's claims need it
below ``defenses``); this name stays while other modules move over."""

from gradleak.accounting import ORDERS, classic_gaussian_z, gaussian_rdp_epsilon  # noqa: F401
