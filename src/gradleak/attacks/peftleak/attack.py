"""The registered attack ``peftleak``: the round protocol (:mod:`gradleak.attacks.base`) over PEFTLeak's two parties,
the malicious server (:mod:`.server`) and the analysis (:mod:`.recovery`)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from gradleak.attacks.base import AttackBase, AttackConfig, AttackContext, Reconstruction, ThreatModel
from gradleak.attacks.common.parameters import attack_parameters
from gradleak.attacks.peftleak.config import PEFTLeakConfig
from gradleak.attacks.peftleak.recovery import PEFTLeakRecovery
from gradleak.attacks.peftleak.server import PEFTLeakServer
from gradleak.errors import BadInput
from gradleak.fl.core import ServerView
from gradleak.registry import ATTACKS


@ATTACKS.register("peftleak", "malicious-server exact patch recovery from ViT adapter gradients (Sami et al. 2025)")
class PEFTLeak(AttackBase):
    """PEFTLeak as a protocol attack: a :class:`~gradleak.attacks.peftleak.server.PEFTLeakServer`
    (``self.server``) poisons the model and writes every round's adapters, a
    :class:`~gradleak.attacks.peftleak.recovery.PEFTLeakRecovery` (``self.recovery``) recovers the patches from the
    :class:`~gradleak.fl.core.ServerView`.

    ``config`` / keyword parameters: the fields of :class:`PEFTLeakConfig` (their only defaults); provided by the run:
    ``public_images`` (the granted public set), ``expected_batch_size`` (if announced), ``seed`` and ``fl`` (the
    public protocol: ``fedavg_aware`` unset means on for FedAvg clients). The server's plan is readable here too
    (``num_rounds``, ``K``, ``ppr``, ``multi_direction``, ``L``, ``D``, ``lost_dir``, ``lost_mean``, and
    :meth:`adapter_state` / :meth:`simulate_tokens`), after :meth:`prepare` where the plan is made.
    """

    name = "peftleak"
    Config = PEFTLeakConfig
    modality = "image"
    peft_kinds = ("adapters",)
    reconstruction = "patches"
    needs_float64 = True
    rewrites_weights = True
    summary = "malicious server poisons a ViT + adapters and recovers exact image patches from the adapter gradients"

    def __init__(self, config: Optional[PEFTLeakConfig] = None, *, public_images: torch.Tensor,
                 expected_batch_size: int | None = None, seed: int = 0, fl: Optional[dict[str, Any]] = None,
                 **params: Any):
        cfg = attack_parameters(self.Config, config, params)
        self.config = cfg
        fedavg_aware = ((fl or {}).get("algorithm") == "fedavg") if cfg.fedavg_aware is None else cfg.fedavg_aware
        self.server = PEFTLeakServer(cfg, public_images=public_images, fedavg_aware=fedavg_aware,
                                     expected_batch_size=expected_batch_size, seed=seed)
        self.recovery = PEFTLeakRecovery(self.server, noise=cfg.noise, noise_false_alarm=cfg.noise_false_alarm,
                                          keep_bins=cfg.keep_bins)
        self.max_rounds = cfg.max_rounds

    @classmethod
    def requires(cls, cfg: Optional[AttackConfig] = None) -> dict[str, bool]:
        return {"malicious": True, "public_data": True, "individual_updates": True}

    @classmethod
    def audit_variants(cls, params, defenses):
        """Under a declared defense that adds noise, the noise mode (:mod:`gradleak.attacks.peftleak.denoise`) at full
        strength: the declared std ('public', unless configured) and the std read off the upload ('estimate': it also
        covers noise of a scale the server cannot compute, e.g. stochastic rounding). The exact recovery on a noisy
        upload divides by noisy bias differences (measured: garbage or nothing), so it is not a variant."""
        from gradleak.defenses.declared import as_declared

        cfg = cls.Config(**params)
        declared = as_declared(defenses)
        if not declared.adds_noise:
            return []
        return [{"noise": m} for m in ("public", "estimate") if cfg.noise != m]

    @classmethod
    def from_config(cls, cfg: PEFTLeakConfig, ctx: AttackContext) -> "PEFTLeak":
        public_images = ctx.public.get("public_images")
        if public_images is None:
            raise BadInput("threat.public_data", "PEFTLeak sets its bin thresholds from public images, but none were granted.",
                           "set threat.public_data=true and give a public dataset (e.g. natural-crops).")
        return cls(config=cfg, public_images=public_images, expected_batch_size=ctx.public.get("batch_size"),
                   seed=ctx.seed, fl=dict(ctx.fl))

    # ------------------------------------------------------------------ the server's settings and plan, read-only
    @property
    def design(self) -> str:
        return self.server.design

    @property
    def fedavg_aware(self) -> bool:
        return self.server.fedavg_aware

    @property
    def expected_batch_size(self) -> int | None:
        return self.server.expected_batch_size

    @property
    def seed(self) -> int:
        return self.server.seed

    @property
    def num_rounds(self) -> int:
        """Rounds the plan needs to attack every position (after :meth:`prepare`)."""
        return self.server.num_rounds

    @property
    def K(self) -> int:
        """Adapter slots per attacked position."""
        return self.server.K

    @property
    def ppr(self) -> int:
        """Positions attacked per round."""
        return self.server.ppr

    @property
    def multi_direction(self) -> bool:
        """Whether every adapter of a position bins along its own direction (improved design)."""
        return self.server.multi_direction

    @property
    def L(self) -> int:
        """Transformer blocks of the poisoned model."""
        return self.server.L

    @property
    def D(self) -> int:
        """Width of the poisoned model."""
        return self.server.D

    @property
    def lost_dir(self) -> torch.Tensor | None:
        """The pixel direction the LayerNorm removes (A1.5), or None when no direction is lost."""
        return self.server.lost_dir

    @property
    def lost_mean(self) -> float:
        """The public mean the lost pixel direction is filled with."""
        return self.server.lost_mean

    def adapter_state(self, round_index: int) -> dict[str, torch.Tensor]:
        """The malicious adapters of round ``round_index`` (:meth:`PEFTLeakServer.adapter_state`)."""
        return self.server.adapter_state(round_index)

    def simulate_tokens(self, y: torch.Tensor,
                        state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The recovery's per-token forward of the poisoned model (:meth:`PEFTLeakRecovery.simulate_tokens`)."""
        return self.recovery.simulate_tokens(y, state)

    # ------------------------------------------------------------------ the round protocol
    def prepare(self, model: nn.Module, threat: ThreatModel | None = None) -> nn.Module:
        """Refuse a non-malicious threat model, then let the server poison the model and plan the rounds."""
        if threat is not None and not threat.malicious:
            raise BadInput("threat.malicious", "PEFTLeak needs a malicious server (it rewrites weights).",
                           "set the threat model to malicious or pick an honest attack.")
        return self.server.prepare(model)

    def rounds_wanted(self, fl_rounds: int) -> int:
        """The rounds the plan needs to attack every position (``fl_rounds`` is ignored), capped by
        ``max_rounds``. Known only after :meth:`prepare`."""
        if not self.server.plans:
            raise RuntimeError("PEFTLeak plans its rounds in prepare(model); call prepare before rounds_wanted.")
        n = self.server.num_rounds
        return n if self.max_rounds is None else min(self.max_rounds, n)

    def server_model(self, round_index: int, model: nn.Module) -> nn.Module:
        """Load round ``round_index``'s malicious adapters (:meth:`PEFTLeakServer.adapter_state`) into
        ``model`` (on its device) and return it. The poisoned head is loaded again too
        (:meth:`PEFTLeakServer.round_state`): the runner applies each round's aggregate to the model, and a
        trained head would break the rank-one head the grouping relies on (A1.9)."""
        if not 0 <= round_index < self.server.num_rounds:
            raise ValueError(f"PEFTLeak planned {self.server.num_rounds} round(s); round {round_index} was asked "
                             "(run rounds_wanted(...) rounds).")
        device = next(model.parameters()).device
        model.load_state_dict({n: v.to(device) for n, v in self.server.round_state(round_index).items()}, strict=False)
        return model

    def reconstruct(self, view: ServerView) -> Reconstruction:
        """Recover the patches from the view alone (:meth:`PEFTLeakRecovery.reconstruct`)."""
        return self.recovery.reconstruct(view)


__all__ = ["PEFTLeak"]
