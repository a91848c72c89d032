"""What a server held in one federated round of a framework's federation (Flower, NVFlare), engine-neutral: the
clients' replies as received, the gradleak :class:`~gradleak.fl.core.Update` formed from each, and the server's view
of recorded rounds (:func:`view_of`, built by the threat model's one gate). The framework bridges
(:mod:`gradleak.fl.engines.flower_bridge`, the NVFlare engine and filter) record into it; the round audit
(:mod:`gradleak.run.round_audit`) reads it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from gradleak.errors import BadInput

@dataclass
class ClientReply:
    """One client's reply as the server received it."""

    node_id: int
    client_id: int  # ``partition-id`` when the client reports it, else the node id
    arrays: dict[str, torch.Tensor]  # exactly the reply's arrays
    num_examples: int
    metrics: dict[str, float]


@dataclass
class RecordedRound:
    """What the server held in one round of a framework's federation (``server_round`` counts from 1, as Flower and
    NVFlare do)."""

    server_round: int
    sent: dict[str, torch.Tensor]  # the arrays the server sent
    replies: list[ClientReply] = field(default_factory=list)  # sorted by client id; [] when only the sum is held
    updates: list[Any] = field(default_factory=list)  # gradleak Updates, one per reply (or the one aggregate)
    aggregated: bool = False  # the server held only the aggregate (secure aggregation)
    aggregate: Any = None  # the mean update over the round's replies (what the server applies)
    note: str = ""
    client_metrics: dict[int, dict[str, float]] = field(default_factory=dict)  # scalars from scoring_mod


def reply_update(sent: dict[str, torch.Tensor], arrays: dict[str, torch.Tensor], *, reply: str, algorithm: str,
                 lr: float, num_examples: int, client_id: int, local_steps: int = 1):
    """A gradleak :class:`~gradleak.fl.core.Update` from a reply: ``(sent − returned) / lr`` in float64 for weight
    replies (the FedAvg pseudo-gradient; for one FedSGD step it is the gradient), the arrays for update replies."""
    from gradleak.fl.core import Update

    kind = "gradient" if algorithm == "fedsgd" else "pseudo_gradient"
    if reply == "update":
        return Update(dict(arrays), num_examples, client_id, kind, local_steps)
    missing = sorted(set(arrays) - set(sent))
    if missing:
        raise BadInput("reply", f"the reply holds arrays the server did not send ({', '.join(missing[:3])}), so no "
                       "update can be formed from it.", "reply with the arrays the server sent (Flower's convention).")
    tensors = {k: (sent[k].to(torch.float64) - v.to(torch.float64)) / lr for k, v in arrays.items()}
    upd = Update(tensors, num_examples, client_id, kind, local_steps)
    upd.rounding_std = rounding_std(arrays, lr)
    return upd


def rounding_std(new_weights: dict[str, torch.Tensor], lr: float) -> float:
    """Per-coordinate std (RMS over coordinates) of the rounding a weight reply puts on the update
    ``(sent − new) / lr``: the new weights are rounded to their dtype (error uniform in ±ulp/2, variance ulp²/12),
    then divided by lr. 0 for float64 replies below 1e-15 relative (negligible). The server knows the dtype it
    received and the lr, so this is public noise an attack can model (:mod:`gradleak.attacks.utr` ``noise:
    public``)."""
    total, count = 0.0, 0
    for v in new_weights.values():
        if not v.is_floating_point() or v.dtype == torch.float64:  # float64: below 1e-15 relative, as documented
            continue
        x = v.detach().to(torch.float64).abs()
        mant = torch.finfo(v.dtype).eps  # 2^-(mantissa bits)
        ulp = torch.where(x > 0, torch.exp2(torch.floor(torch.log2(x.clamp_min(torch.finfo(v.dtype).tiny)))) * mant,
                          torch.zeros_like(x))
        total += float((ulp ** 2).sum()) / 12.0
        count += v.numel()
    return (total / max(count, 1)) ** 0.5 / lr


def view_of(rounds: Sequence[RecordedRound], *, model, threat, knowledge: dict | None = None,
            always_public: dict | None = None):
    """gradleak's ServerView of recorded rounds, built by the threat model's one gate
    (:func:`gradleak.fl.threat.build_view`). A round that held only the aggregate gives the view the sum, whatever
    the threat model would grant."""
    from dataclasses import replace as dc_replace

    from gradleak.fl.threat import build_view

    rs = list(rounds)
    if not rs:
        raise BadInput("rounds", "no round has been recorded yet.", "run at least one round first.")
    summed = any(r.aggregated for r in rs)
    if summed and threat.individual_updates:
        threat = dc_replace(threat, individual_updates=False)
    always_public = dict(always_public or {})
    seen = [u for r in rs for u in (r.updates if not summed else [r.aggregate]) if u is not None]
    rounding = max((float(getattr(u, "rounding_std", 0.0) or 0.0) for u in seen), default=0.0)
    if rounding > 0:  # the rounding of the clients' weight replies: known to the server (dtype and lr)
        always_public["upload_rounding_std"] = rounding
    return build_view(model=model, rounds=[r.updates for r in rs], round_states=[r.sent for r in rs],
                      threat=threat, secure_sum=[r.aggregate for r in rs] if summed else None,
                      knowledge=knowledge or {}, always_public=always_public or {})
