"""The ``attack:`` parameters of ``peftleak`` (one source of their defaults: the server, the recovery and the registered
attack read them from here)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from gradleak.attacks.base import AttackConfig


class PEFTLeakConfig(AttackConfig):
    """Parameters of the ``peftleak`` attack (``attack:`` section of a config)."""

    design: Literal["paper", "improved"] = Field(
        "improved", description="'paper': Algorithm 1 as published; 'improved': one hash direction per adapter, no lost tails, peeling")
    sigma: float = Field(10.0, gt=0, le=1e4, description="std σ of the poisoned positional embeddings (paper: 10)")
    pe_distribution: Literal["gaussian", "laplacian"] = Field(
        "gaussian", description="distribution of the positional embeddings (std sigma either way)")
    adapters_per_position: Optional[int] = Field(
        None, ge=1, description="adapter slots per attacked position (default: the paper's rule, all slots of a round shared)")
    positions_per_round: Optional[int] = Field(
        None, ge=1, description="positions attacked per round (default: the paper's rule, slots // 5)")
    max_rounds: Optional[int] = Field(None, ge=1, description="stop after this many rounds (default: as many as the plan needs)")
    low_resolution: bool = Field(False, description="recover k×k block means when P²C > D (ViT-B/32, Table 3)")
    peel: bool = Field(True, description="improved design: subtract recovered patches from collided bins")
    quantiles: Literal["gaussian", "empirical"] = Field(
        "gaussian", description="paper design's bin edges: inverse Gaussian CDF (the paper's) or empirical quantiles")
    fedavg_aware: Optional[bool] = Field(
        None, description="FedAvg-aware scaling of the malicious weights (App. C.6); default: on when fl.algorithm is fedavg")
    up_scale: float = Field(1e-12, gt=0, le=1e-3, description="scale of the adapters' up-projection (forward perturbation)")


__all__ = ["PEFTLeakConfig"]
