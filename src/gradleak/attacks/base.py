"""The attack protocol (DESIGN §2) and the threat model's capability flags (LeakPro-style).

An attack is a class registered in ``ATTACKS`` with
``prepare(model, threat) -> model`` (malicious attacks may rewrite weights; honest ones return the
model unchanged) and ``reconstruct(view: ServerView) -> Reconstruction``. ``reconstruct`` receives a
:class:`~gradleak.fl.core.ServerView` and nothing else: it cannot reach the client's private batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import nn

from gradleak.fl.core import ServerView


@dataclass(frozen=True)
class ThreatModel:
    """What the server may do. ``malicious`` = may poison weights; ``prescribes_architecture`` = may choose
    the architecture (e.g. add trainable modules) but not weights; ``public_data`` = has public samples;
    ``knows_labels`` / ``knows_batch_size`` = these leak to it."""

    malicious: bool = False
    prescribes_architecture: bool = False
    public_data: bool = False
    knows_labels: bool = False
    knows_batch_size: bool = True
    individual_updates: bool = True


@dataclass
class Reconstruction:
    """What an attack returns. ``data`` is attack-specific (images, patches, token ids, scores);
    ``info`` carries diagnostics (e.g. number of candidate patches, rounds used)."""

    data: Any
    info: dict[str, Any] = field(default_factory=dict)


class Attack(Protocol):
    name: str

    def prepare(self, model: nn.Module, threat: ThreatModel) -> nn.Module: ...

    def reconstruct(self, view: ServerView) -> Reconstruction: ...
