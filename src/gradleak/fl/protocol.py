"""The round protocol: server -> clients -> defenses -> (secure) aggregation, round by round (DESIGN §1).

Each round the server sends a model: the honest global model (updated by aggregation after every
round), or what the attack sets through its ``server_model(round, model)`` hook (a malicious server
re-poisons each round). Every client trains on **its own deep copy** of the sent model, so nothing a
client does touches the object the server (and the attacker's view) holds. Client-side defenses
transform each upload; secure aggregation optionally replaces the individual uploads by their sum.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from gradleak.fl.core import Client, Update, aggregate, secure_aggregate


@dataclass
class RoundsOutcome:
    """What happened over the rounds (the runner turns it into a ServerView through the threat model)."""

    model: Any  # the model object the server sent in the last round
    rounds: list[list[Update]] = field(default_factory=list)  # per round, every client's defended upload
    round_states: list[dict[str, torch.Tensor]] = field(default_factory=list)  # trainable state sent per round
    secure_sums: list[Update] | None = None  # per round, the secure-aggregation sum (when computed)
    kept_rounds: list[int] = field(default_factory=list)  # which rounds the lists above hold
    last_aggregate: Update | None = None  # the last round's aggregate (what the server applies next)
    client_seconds: float = 0.0  # clients' local training, all rounds
    server_hook_seconds: float = 0.0  # time in the attack's per-round hook


def run_rounds(model, clients: Sequence[Client], *, rounds: int, algorithm: str, lr: float, local_epochs: int = 1,
               local_batch_size: int | None = None, defenses: Sequence[Any] = (), seed: int = 0,
               server_hook: Callable[[int, Any], Any] | None = None, secure_aggregation: bool = False,
               track: Callable[..., Any] | None = None, keep_round: Callable[[int], bool] | None = None,
               local_update: Callable[..., Any] | None = None) -> RoundsOutcome:
    """Run ``rounds`` federated rounds of ``clients`` on ``model`` and return the uploads of the rounds the
    attacker keeps (``keep_round(r)``, default every round: many rounds × clients of uploads add up).
    ``local_update(client, model, seed=...)`` replaces the client's own training step (a training-time
    defense such as DP-SGD); the defenses still transform its upload.

    The server model is updated after each round by SGD on the aggregate (``w -= lr · mean update``;
    for FedAvg uploads, which are ``Δw / -lr``, that applies the mean local change).
    """
    out = RoundsOutcome(model=model, secure_sums=[] if secure_aggregation else None)
    it = range(rounds)
    if track is not None:
        it = track(it, description=f"FL rounds ({len(clients)} client(s), {algorithm})", total=rounds)
    for r in it:
        if r > 0:  # the server applies the previous round's aggregate
            agg = out.last_aggregate
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if n in agg.tensors:
                        p.sub_(lr * agg.tensors[n].to(device=p.device, dtype=p.dtype))
        if server_hook is not None:
            t0 = time.perf_counter()
            model = server_hook(r, model)
            out.server_hook_seconds += time.perf_counter() - t0
        out.model = model
        keep = keep_round is None or keep_round(r)
        if keep:
            out.kept_rounds.append(r)
            out.round_states.append({n: p.detach().clone().cpu() for n, p in model.named_parameters() if p.requires_grad})
        ups = []
        for c in clients:
            local = copy.deepcopy(model)  # the client's own copy
            t0 = time.perf_counter()
            if local_update is None:
                upd = c.local_update(local, algorithm=algorithm, epochs=local_epochs, lr=lr, batch_size=local_batch_size,
                                     defenses=defenses, seed=seed + r, in_place=True)
            else:
                upd = local_update(c, local, seed=seed + r)
                for d in defenses:
                    upd = d.apply(upd, {"client_id": c.client_id, "seed": seed + r})
            out.client_seconds += time.perf_counter() - t0
            if not all(bool(torch.isfinite(t).all()) for t in upd.tensors.values()):
                from gradleak.errors import BadInput

                raise BadInput("fl.lr", f"training diverged: client {c.client_id}'s upload in round {r} holds NaN/inf "
                               f"(lr = {lr}).", "lower fl.lr (or check the defenses' parameters).")
            ups.append(upd.map(lambda _, v: v.detach().cpu()))
            del local
        out.last_aggregate = aggregate(ups)
        if keep:
            out.rounds.append(ups)
            if secure_aggregation:
                out.secure_sums.append(secure_aggregate(ups, seed=seed + 7 * r + 1))
    return out
