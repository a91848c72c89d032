"""The configuration of the gradient-matching attacks (Inverting Gradients, DLG, APRIL, GradViT, GIAS) and the
refusals their checks share.

:class:`MatchingFields` holds what every gradient-matching attack of :mod:`gradleak.attacks.optimization` shares
(labels, signed Adam, similarity, the anchor of paper 001 eq. 7, the FedAvg emulation of paper 001 Supp. M, the
declared-noise likelihood); :class:`InvertingGradientsConfig` adds the optimisation budget (IG, Geiping et al. 2020
§4), and ``IGConfig`` / ``DLGConfig`` / ``AprilConfig`` the registered attacks' defaults. The decisions behind the
fields are recorded in :mod:`gradleak.attacks.optimization.inverting_gradients`.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Optional

from pydantic import Field

from gradleak.attacks.base import AttackConfig
from gradleak.errors import BadInput

ProgressFn = Callable[[dict[str, Any]], None]

LabelMode = Literal["known", "idlg", "auto"]
EmulateMode = Literal["single_step", "local_steps"]


class MatchingFields(AttackConfig):
    """The gradient-matching parameters every optimisation attack here shares (ig, dlg, april, gradvit, gias)."""

    labels: LabelMode = Field("known", description="known (granted by the threat model), idlg (from the head gradient) "
                              "or auto (granted if granted, else from the head gradient)")
    signed: bool = Field(True, description="Adam on the sign of the gradient (IG)")
    similarity: Literal["global", "per_parameter"] = Field("global", description="one cosine over all tensors, or the mean per tensor")
    client_index: int = Field(0, ge=0, description="which observed update to attack")
    label_param: Optional[str] = Field(None, description="name of the head bias (idlg); default: detected")
    log_every: Optional[int] = Field(None, ge=1, description="progress every N steps")
    anchor: bool = Field(False, description="add the cosine term on the gradients of all positional embeddings "
                         "(paper 001 eq. 7; needs peft.layer_pe=true)")
    anchor_weight: float = Field(1.0, ge=0, le=1e6, description="weight of the PE-gradient cosine term (eq. 7: 1; "
                                 "the authors' fork: 0.1)")
    time_fwdbwd: bool = Field(True, description="time one forward+backward of the sent model for "
                              "timings.iteration_to_fwdbwd_ratio")
    emulate: EmulateMode = Field("single_step", description="FedAvg: match the pseudo-gradient as one gradient "
                                 "(single_step) or simulate the client's K local SGD steps (local_steps; paper 001 "
                                 "Supp. M)")
    noise_model: Literal["off", "declared"] = Field(
        "off", description="declared: attack the upload as the declared defenses make it (gradleak.defenses.declared): "
        "match by the Gaussian likelihood of the declared noise -- the squared error, the maximum-likelihood "
        "distance under isotropic per-coordinate noise (whitening by its std is a constant factor) -- instead of the "
        "attack's own distance, and simulate the declared clipping (the simulated gradient scaled to min(1, C / its "
        "norm); DP-SGD's per-sample bound, exact for B = 1)")


class InvertingGradientsConfig(MatchingFields):
    steps: int = Field(2000, ge=1, le=10_000_000, description="Adam steps per restart")
    lr: float = Field(0.1, gt=0, le=100, description="initial step size (cosine-decayed to 0)")
    tv_weight: float = Field(1e-4, ge=0, description="total-variation weight α_TV")
    restarts: int = Field(1, ge=1, le=1000, description="independent trials; the best final matching loss wins")
    box: Literal["clamp", "tanh"] = Field("clamp", description="box constraint on the pixels")


CPU_STEPS = 300  # the CPU-scale default of ig / dlg / april (our CPU budget: a few hundred iterations; set attack.steps)
#: paper scale (``scale: paper``) of ig / dlg / april / gradvit: paper 001 gives iterations only for GIAS (2000 latent
#: + 8000 generator steps, Supp. D); the optimisation baselines get GIAS's stage-1 budget, 2000 steps per restart
#: (also the registered ``inverting_gradients``' default)
PAPER_STEPS = 2000


class IGConfig(InvertingGradientsConfig):
    steps: int = Field(CPU_STEPS, ge=1, le=10_000_000, description="Adam steps per restart (default: CPU scale)")
    labels: LabelMode = Field("auto", description="known, idlg (from the head gradient) or auto (granted labels if "
                              "granted, else from the head gradient)")


class DLGConfig(InvertingGradientsConfig):
    steps: int = Field(CPU_STEPS, ge=1, le=10_000_000, description="Adam steps per restart (default: CPU scale)")
    tv_weight: float = Field(0.0, ge=0, description="total-variation weight (DLG has none)")
    signed: bool = Field(False, description="Adam on the sign of the gradient (DLG: plain gradient)")
    labels: LabelMode = Field("auto", description="known, idlg (from the head gradient) or auto")


class AprilConfig(DLGConfig):
    pass


def emulate_needs_fedavg(algorithm) -> BadInput:
    """``emulate: local_steps`` refused: the clients run ``algorithm`` (FedSGD), there are no local steps."""
    return BadInput("attack.emulate", f"is local_steps, but the clients run {algorithm} (one gradient of the whole "
                    "batch): there are no local steps to emulate.",
                    "use attack.emulate=single_step, or fl.algorithm=fedavg (local steps: fl.local_batch_size, "
                    "fl.local_epochs).")


def emulate_no_secagg() -> BadInput:
    """``emulate: local_steps`` refused: the secure aggregate is no single client's local-training trajectory."""
    return BadInput("attack.emulate", "is local_steps, but the server sees only the secure aggregate of the clients' "
                    "updates, which is no single client's local-training trajectory.",
                    "use attack.emulate=single_step, or individual updates (fl.secure_aggregation=false).")


def no_layer_pe() -> BadInput:
    """``anchor: true`` refused: no trainable layer-wise positional embeddings to anchor on (paper 001 eq. 7)."""
    return BadInput("attack.anchor", "is true, but the model has no trainable layer-wise positional embeddings, so "
                    "there are no PE gradients to anchor on (paper 001 eq. 7).",
                    "set peft.layer_pe=true (peft.kind=lora or none, threat.preset=prescribes-architecture), "
                    "or attack.anchor=false.")

