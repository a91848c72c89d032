"""The builtin round engine (``fl.engine: builtin``), gradleak's round protocol: server -> clients -> defenses ->
(secure) aggregation, round by round (docs/DESIGN.md §1).

Each round the server sends a model: the honest global model (updated by aggregation after every
round), or what the attack sets through its ``server_model(round, model)`` hook (a malicious server
re-poisons each round). Every client trains on **its own deep copy** of the sent model, so nothing a
client does touches the object the server (and the attacker's view) holds. Client-side defenses
transform each upload; secure aggregation optionally replaces the individual uploads by their sum.

BatchNorm models (Hatamizadeh et al. 2022 §II-B): each client's copy trains in train mode (its BN layers
normalise with batch statistics and update their running statistics, as a real client does); the upload
carries the BN buffer changes (:class:`~gradleak.fl.core.Update` ``buffers``), the (secure) aggregate averages
them, and the honest server adds the mean change to its buffers (``num_batches_tracked`` rounded to an
integer). ``round_states`` then holds the full checkpoint the server sent: trainable parameters *and* BN
buffers (the attack needs the current global checkpoint, §III-B). ``client_settings`` gives a client its
own local batch size and epochs (the paper's clients differ in both, §III-A); ``lr_at(r)`` the learning
rate of round r (step decay), used by the clients and, for that round's aggregate, by the server.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from gradleak.fl.core import Client, Update, aggregate, apply_update_defenses, secure_aggregate


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
    withheld: list[tuple[int, int]] = field(default_factory=list)  # (round, client id) of updates not sent


def run_rounds(model, clients: Sequence[Client], *, rounds: int, algorithm: str, lr: float, local_epochs: int = 1,
               local_batch_size: int | None = None, defenses: Sequence[Any] = (), seed: int = 0,
               server_hook: Callable[[int, Any], Any] | None = None, secure_aggregation: bool = False,
               track: Callable[..., Any] | None = None, keep_round: Callable[[int], bool] | None = None,
               local_update: Callable[..., Any] | None = None,
               client_settings: Sequence[dict] | None = None,
               lr_at: Callable[[int], float] | None = None,
               on_round: Callable[[int, dict, list], Any] | None = None) -> RoundsOutcome:
    """Run ``rounds`` federated rounds of ``clients`` on ``model`` and return the uploads of the rounds the
    attacker keeps (``keep_round(r)``, default every round: many rounds × clients of uploads add up).
    ``local_update(client, model, seed=...)`` replaces the client's own training step (a training-time
    defense such as DP-SGD); the defenses still transform its upload. ``on_round(r, sent, uploads)``: called after
    each round with the trainable state the server sent that round and the round's uploads, so a caller can measure
    round by round and keep nothing (with ``keep_round`` False: memory independent of the rounds; the DP check).

    The server model is updated after each round by SGD on the aggregate (``w -= lr · mean update``;
    for FedAvg uploads, which are ``Δw / -lr``, that applies the mean local change).
    """
    from gradleak.fl.core import batchnorm_buffer_names

    out = RoundsOutcome(model=model, secure_sums=[] if secure_aggregation else None)
    central = [d for d in defenses if getattr(d, "server_side", False)]  # central DP: noise on the aggregate
    has_bn = bool(batchnorm_buffer_names(model))
    lr_of = lr_at or (lambda _r: lr)
    training = _LocalTraining(algorithm=algorithm, lr=lr, lr_of=lr_of, local_epochs=local_epochs,
                              local_batch_size=local_batch_size, defenses=defenses, seed=seed,
                              local_update=local_update, client_settings=client_settings, has_bn=has_bn)
    it = range(rounds)
    if track is not None:
        it = track(it, description=f"FL rounds ({len(clients)} client(s), {algorithm})", total=rounds)
    for r in it:
        model = _start_round(out, model, r, lr_of, server_hook)
        keep = keep_round is None or keep_round(r)
        sent = _trainable_state(model) if on_round is not None else None
        if keep:
            out.kept_rounds.append(r)
            out.round_states.append(_sent_checkpoint(model, has_bn))
        ups = [u for ci, c in enumerate(clients) if (u := training.client_upload(out, ci, c, model, r)) is not None]
        if not ups:  # every client withheld: the model stays as it is
            out.last_aggregate = _zero_aggregate(model, out.last_aggregate)
        else:
            out.last_aggregate = _server_noise(central, aggregate(ups), len(ups), seed + r)
        if on_round is not None:
            on_round(r, sent, ups)
        if keep:
            out.rounds.append(ups)
            if secure_aggregation:  # the same server-side noise draw as the applied aggregate (seeded per round)
                out.secure_sums.append(_server_noise(central, secure_aggregate(ups, seed=seed + 7 * r + 1), len(ups),
                                                     seed + r) if ups else out.last_aggregate)
    return out


def _server_noise(central: Sequence[Any], agg: Update, k: int, seed: int) -> Update:
    """``agg`` through the server-side defenses (central DP: noise on the aggregate of ``k`` uploads), seeded."""
    for d in central:
        agg = d.server_apply(agg, {"seed": seed}, k)
    return agg


def _start_round(out: RoundsOutcome, model, r: int, lr_of: Callable[[int], float],
                 server_hook: Callable[[int, Any], Any] | None):
    """The server's side of round ``r`` before the clients: apply the previous round's aggregate, then the attack's
    ``server_hook`` (timed); returns the model the server sends."""
    if r > 0:  # the server applies the previous round's aggregate
        apply_aggregate(model, out.last_aggregate, lr_of(r - 1))
    if server_hook is not None:
        t0 = time.perf_counter()
        model = server_hook(r, model)
        out.server_hook_seconds += time.perf_counter() - t0
    out.model = model
    return model


def _trainable_state(model) -> dict[str, torch.Tensor]:
    """A CPU copy of ``model``'s trainable parameters (what the server sent, as the caller of ``on_round`` reads it)."""
    return {n: p.detach().clone().cpu() for n, p in model.named_parameters() if p.requires_grad}


def _sent_checkpoint(model, has_bn: bool) -> dict[str, torch.Tensor]:
    """The checkpoint the server sent, as ``round_states`` keeps it: trainable parameters and BN buffers."""
    state = _trainable_state(model)
    if has_bn:
        from gradleak.fl.core import batchnorm_buffers

        state.update(batchnorm_buffers(model))
    return state


def _zero_aggregate(model, last: Update | None) -> Update:
    """The aggregate of a round in which every client withheld: zeros on the trainable parameters (in the dtype of
    the last aggregate, if any), so the model stays as it is."""
    ref = next(iter(last.tensors.values())) if last is not None else None
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = dict(model.named_parameters())
    return Update({n: torch.zeros_like(params[n].detach().cpu(), dtype=ref.dtype if ref is not None
                                       else params[n].dtype) for n in names}, 0, -1, "pseudo_gradient", 0)


@dataclass
class _LocalTraining:
    """What every client's local step reads (:func:`run_rounds`' arguments), and the step itself."""

    algorithm: str
    lr: float
    lr_of: Callable[[int], float]
    local_epochs: int
    local_batch_size: int | None
    defenses: Sequence[Any]
    seed: int
    local_update: Callable[..., Any] | None
    client_settings: Sequence[dict] | None
    has_bn: bool

    def client_upload(self, out: RoundsOutcome, ci: int, c: Client, model, r: int) -> Update | None:
        """Client ``ci``'s defended upload in round ``r`` on its own copy of ``model`` (on the CPU; its training time
        added to ``out.client_seconds``), or None when it withheld it (recorded in ``out.withheld``)."""
        c = c.for_round(r)  # a client holding a dataset trains on this round's batch of it
        # the client's own copy (a canary client, which uploads a fixed direction, reads no model: none)
        reads = getattr(c, "reads_model", True)
        local = copy.deepcopy(model) if reads else model
        if self.has_bn and reads:
            local.train()  # BN normalises with batch statistics and updates its running statistics
        t0 = time.perf_counter()
        upd = self._train(ci, c, local, r)
        out.client_seconds += time.perf_counter() - t0
        if upd is None:  # the client withheld its update this round (e.g. the RDLV filter): nothing is sent
            out.withheld.append((r, c.client_id))
            return None
        if not all(bool(torch.isfinite(t).all()) for t in upd.tensors.values()):
            from gradleak.errors import TrainingDiverged

            raise TrainingDiverged(c.client_id, r, self.lr)
        return upd.map(lambda _, v: v.detach().cpu())

    def _train(self, ci: int, c: Client, local, r: int) -> Update | None:
        """The local step: the client's own training with the defenses, or the training-time defense's
        ``local_update`` (given the client's public training configuration) followed by the defenses."""
        own = (self.client_settings[ci] if self.client_settings is not None else None) or {}
        epochs, batch_size = own.get("epochs", self.local_epochs), own.get("batch_size", self.local_batch_size)
        if self.local_update is None:
            return c.local_update(local, algorithm=self.algorithm, epochs=epochs, lr=self.lr_of(r),
                                  batch_size=batch_size, defenses=self.defenses, seed=self.seed + r, in_place=True)
        upd = self.local_update(c, local, seed=self.seed + r, algorithm=self.algorithm, lr=self.lr_of(r),
                                round_index=r, epochs=epochs, batch_size=batch_size)
        if upd is not None:
            upd = apply_update_defenses(upd, self.defenses, client_id=c.client_id, seed=self.seed + r,
                                        lr=self.lr_of(r))
        return upd


def apply_aggregate(model, agg: Update, lr: float) -> None:
    """The honest server's step: ``w -= lr · aggregate`` on the parameters the aggregate holds, plus its mean BN
    buffer change."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in agg.tensors:
                p.sub_(lr * agg.tensors[n].to(device=p.device, dtype=p.dtype))
        if agg.buffers is not None:
            apply_buffer_change(model, agg.buffers)


def apply_buffer_change(model, change: dict[str, torch.Tensor]) -> None:
    """Add a (mean) BN buffer change to ``model``'s buffers in place; integer buffers are rounded."""
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for n, d in change.items():
            b = buffers[n]
            new = b.to(torch.float64) + d.to(device=b.device, dtype=torch.float64)
            b.copy_(torch.round(new).to(b.dtype) if not b.is_floating_point() else new.to(b.dtype))


from gradleak.fl.engines import ENGINES, Engine  # noqa: E402  (the plug-in registration, after the round loop)


@ENGINES.register("builtin", "gradleak's own round protocol, in this process")
class BuiltinEngine(Engine):
    name = "builtin"

    def rounds(self, fl: Any) -> Callable[..., Any]:
        return run_rounds
