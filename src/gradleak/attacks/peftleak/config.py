"""The ``attack:`` parameters of ``peftleak`` (one source of their defaults: the server, the recovery and the registered
attack read them from here)."""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import Field, field_validator

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
    noise: Union[float, Literal["public", "none", "estimate"]] = Field(
        "public", description="noise on the observed adapter gradients (gradleak.attacks.peftleak.denoise): 'public' = "
        "the per-coordinate std the declared defenses imply (the exact recovery when there is none), 'none' = the "
        "exact recovery, 'estimate' = read off the upload (the ones-direction of every down-projection gradient row "
        "is pure noise by design), or a known std (float > 0); under noise bins are tested against it and patches "
        "estimated with their errors")
    noise_false_alarm: float = Field(
        0.01, gt=0, lt=1, description="noise mode: chance that pure noise yields any occupied bin (Bonferroni over "
        "every bin); every noise tolerance uses the same level")

    keep_bins: Optional[int] = Field(
        None, ge=1, description="oracle restriction (the ceiling of benchmarks/defended.py): keep only the K bins of "
        "the upload with the most energy per unit noise variance, zero every other bin, then recover "
        "(gradleak.attacks.peftleak.limit); default: every bin")

    @field_validator("noise")
    @classmethod
    def _positive_noise(cls, v):
        if isinstance(v, float) and not v > 0:
            raise ValueError("a known noise std must be > 0 (use 'none' for the exact recovery)")
        return v


__all__ = ["PEFTLeakConfig"]
