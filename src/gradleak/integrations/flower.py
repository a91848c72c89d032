"""Flower integration (issue 13): record what a Flower server sees, attack it, and defend clients with gradleak.

Optional extra ``fl`` (``pip install 'gradleak[fl]'``, Flower's Message API: ``flwr>=1.42,<2``; the simulation
engine needs ``gradleak[fl-simulation]``, which adds Ray). The pieces, each usable in any Flower app:

* :class:`GradleakStrategy` wraps any ``flwr.serverapp.strategy.Strategy``. ``configure_train`` stores the arrays
  the server sends (Flower's ``aggregate_train`` does not receive them; Flower's own DP wrappers store them the
  same way) and ``aggregate_train`` records every reply *before* the wrapped strategy sees it (Flower's
  server-side DP clipping rewrites the replies in place), so the record is exactly what a curious server holds.
  Replies are the client's new weights (Flower's convention; ``reply="weights"``), from which the update is
  ``(sent − returned) / lr`` in float64 (gradleak's FedAvg upload, :mod:`gradleak.fl.core`), or the update itself
  (``reply="update"``, NVFlare's ``WEIGHT_DIFF`` style; the wrapper then applies the wrapped strategy's mean update
  ``w − lr · mean`` to the global model). A round whose replies are all identical holds only the aggregate
  (legacy SecAgg+ gives every result the aggregate's parameters): the record then keeps the one sum and says so,
  and the attacks read that sum. Every ``audit_every`` rounds the ``on_round`` callback gets the round's
  :class:`RecordedRound`; :meth:`GradleakStrategy.server_view` turns recorded rounds into gradleak's
  :class:`~gradleak.fl.core.ServerView` through the threat model (:func:`gradleak.fl.threat.build_view`).
* :func:`defense_mod` is a client mod that applies gradleak's update defenses (``defenses:`` entries) to the reply.
* :func:`scoring_mod` is a client mod for deployments where the server has no ground truth: the client runs a
  scoring function on its own update and private data and adds only scalars (RDLV-style) to the reply's metrics.
* :func:`legacy_mod` lets a legacy-format mod (Flower's ``fixedclipping_mod``, ``LocalDpMod``, which read
  ``fitins.parameters`` and return unnamed arrays) run inside a Message-API ClientApp, restoring the names.
* :func:`run_inprocess` runs a ``ServerApp`` against a ``ClientApp`` in this process with no Ray (CI, tests,
  laptops). It needs Flower's private ``flwr.supercore.task_identity`` (messages take their run and node ids from
  it), guarded by the pinned version range. :func:`run_simulation_engine` runs the same apps through Flower's
  simulation engine (Ray).
* :func:`run_rounds_flower` is the pipeline's round protocol through Flower (``fl.engine: flower``): the same
  ``RoundsOutcome`` as :func:`gradleak.fl.protocol.run_rounds`, so every attack, the audit and the reports run on
  a real Flower federation unchanged, including under Flower's own DP wrappers (``fl.flower.dp``).
"""

from __future__ import annotations

import copy
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from gradleak.errors import BadInput

#: the Flower versions the integration is written and tested against (the Message API, ``flwr.serverapp.strategy``)
FLOWER_RANGE = ((1, 42), (2, 0))
INSTALL = "pip install 'gradleak[fl]'   (or: pip install 'flwr>=1.42,<2')"
UPDATE_KEY = "gradleak.update"  # a reply's config flag: its arrays are the update, not the new weights


def require_flower():
    """The ``flwr`` module, or a clear error naming the install command / the supported version range."""
    try:
        import flwr
    except ImportError:
        raise BadInput("fl.engine", "the Flower integration needs the optional `fl` extra (Flower), which is not "
                       "installed.", f"install it with `{INSTALL}`.") from None
    ver = tuple(int(p) for p in flwr.__version__.split(".")[:2] if p.isdigit())
    lo, hi = FLOWER_RANGE
    if not (lo <= ver < hi):
        raise BadInput("flwr", f"Flower {flwr.__version__} is installed, but gradleak's Flower integration supports "
                       f"flwr >= {lo[0]}.{lo[1]}, < {hi[0]} (the Message API it is written against).",
                       f"install a supported version: `{INSTALL}`.")
    return flwr


# ------------------------------------------------------------------------------------------ arrays <-> tensors

def to_tensors(record) -> dict[str, torch.Tensor]:
    """An ``ArrayRecord`` as CPU tensors (a copy; dtype kept, float64 stays float64; names kept, dots included)."""
    return {k: torch.from_numpy(np.array(v.numpy(), copy=True)) for k, v in record.items()}


def to_arrays(tensors: dict[str, torch.Tensor]):
    """CPU tensors as an ``ArrayRecord`` of ``Array(ndarray)`` (the form Flower's strategies aggregate)."""
    from flwr.app import Array, ArrayRecord

    return ArrayRecord({k: Array(np.ascontiguousarray(t.detach().cpu().numpy())) for k, t in tensors.items()})


def _single(records: dict, what: str, where: str):
    if len(records) != 1:
        raise BadInput(where, f"expected exactly one {what} in the message, found {len(records)} "
                       f"({', '.join(records) or 'none'}).", "send the model as one ArrayRecord (Flower's convention).")
    return next(iter(records.items()))


# ------------------------------------------------------------------------------------------ the record

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
    """What the server held in one Flower round (``server_round`` counts from 1, as Flower does)."""

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
        if not v.is_floating_point():
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
    """gradleak's ServerView of recorded Flower rounds, built by the threat model's one gate
    (:func:`gradleak.fl.threat.build_view`). A round that held only the aggregate gives the view the sum, whatever
    the threat model would grant."""
    from dataclasses import replace as dc_replace

    from gradleak.fl.threat import build_view

    rs = list(rounds)
    if not rs:
        raise BadInput("rounds", "no round has been recorded yet.", "run at least one Flower round first.")
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


# ------------------------------------------------------------------------------------------ the strategy wrapper

def _make_strategy_class():
    require_flower()
    from flwr.serverapp.strategy import Strategy

    class GradleakStrategy(Strategy):
        """Wrap ``strategy`` and record every client's reply as the server sees it (see the module docstring).

        ``lr`` (a number or ``round -> lr`` for a 1-based round) is the clients' public learning rate, needed to
        turn new weights into the update; ``algorithm`` ``fedavg`` | ``fedsgd`` names the upload kind;
        ``secure_aggregation=True`` keeps only the aggregate of every round (what SecAgg leaves a server);
        ``on_round(recorded)`` runs every ``audit_every`` rounds (e.g. the audit); ``server_hook(round, arrays)`` may
        replace the arrays sent (a malicious server: PEFTLeak's poisoning); ``keep`` bounds the rounds kept in
        memory (``None``: all); ``send_lr`` puts the round's ``lr`` into every train config."""

        def __init__(self, strategy, *, lr: float | Callable[[int], float], algorithm: str = "fedavg",
                     reply: str = "weights", secure_aggregation: bool = False, audit_every: int = 1,
                     on_round: Callable[[RecordedRound], Any] | None = None,
                     server_hook: Callable[[int, dict], dict] | None = None, keep: int | None = None,
                     send_lr: bool = False):
            if not isinstance(strategy, Strategy):
                raise BadInput("strategy", f"{type(strategy).__name__} is not a flwr.serverapp.strategy.Strategy "
                               "(the Message API).", "wrap a Message-API strategy such as "
                               "flwr.serverapp.strategy.FedAvg(...).")
            if reply not in ("weights", "update"):
                raise BadInput("reply", f"must be 'weights' or 'update', got {reply!r}.",
                               "use 'weights' (Flower's convention: clients return their new weights).")
            if algorithm not in ("fedavg", "fedsgd"):
                raise BadInput("algorithm", f"must be 'fedavg' or 'fedsgd', got {algorithm!r}.", "use 'fedavg'.")
            if int(audit_every) < 1:
                raise BadInput("audit_every", f"must be >= 1, got {audit_every}.", "audit e.g. every round: 1.")
            self.strategy, self.reply, self.algorithm = strategy, reply, algorithm
            self._lr = lr if callable(lr) else (lambda _r, v=float(lr): v)
            self.secure_aggregation, self.audit_every = bool(secure_aggregation), int(audit_every)
            self.on_round, self.server_hook, self.keep = on_round, server_hook, keep
            self.send_lr = bool(send_lr)
            self.rounds: list[RecordedRound] = []
            self._sent: dict[int, dict[str, torch.Tensor]] = {}
            self.audit_results: dict[int, Any] = {}

        def lr(self, server_round: int) -> float:
            return float(self._lr(server_round))

        # -- Strategy protocol
        def configure_train(self, server_round, arrays, config, grid):
            if self.server_hook is not None:
                arrays = to_arrays(self.server_hook(server_round, to_tensors(arrays)))
            self._sent[server_round] = to_tensors(arrays)
            if self.send_lr:  # the round's learning rate travels with the round (step decay)
                config["lr"] = self.lr(server_round)
            if self.reply == "update":
                config[UPDATE_KEY] = True
            return self.strategy.configure_train(server_round, arrays, config, grid)

        def aggregate_train(self, server_round, replies):
            replies = list(replies)
            errors = [m.error for m in replies if m.has_error()]
            if errors:
                raise RuntimeError(f"{len(errors)} client(s) failed in round {server_round}: "
                                   + "; ".join(str(getattr(e, "reason", e)) for e in errors[:3]))
            rec = self._record(server_round, replies)  # before the wrapped strategy: it may clip replies in place
            arrays, metrics = self.strategy.aggregate_train(server_round, replies)
            if arrays is not None:
                agg = to_tensors(arrays)
                if self.reply == "update":  # the mean update -> the new global weights
                    from gradleak.fl.core import Update

                    rec.aggregate = Update(agg, sum(r.num_examples for r in rec.replies) or 1, -1,
                                           rec.updates[0].kind if rec.updates else "pseudo_gradient")
                    new = {k: (rec.sent[k].to(torch.float64) - self.lr(server_round) * agg[k].to(torch.float64))
                           .to(rec.sent[k].dtype) for k in agg}
                    arrays = to_arrays(new)
                else:
                    rec.aggregate = reply_update(rec.sent, agg, reply="weights", algorithm=self.algorithm,
                                                 lr=self.lr(server_round), client_id=-1,
                                                 num_examples=sum(r.num_examples for r in rec.replies) or 1)
                if rec.aggregated:  # only the sum was ever held: it is what the attacks read
                    rec.updates = [rec.aggregate]
            if server_round % self.audit_every == 0 and self.on_round is not None:
                self.audit_results[server_round] = self.on_round(rec)
            return arrays, metrics

        def configure_evaluate(self, server_round, arrays, config, grid):
            return self.strategy.configure_evaluate(server_round, arrays, config, grid)

        def aggregate_evaluate(self, server_round, replies):
            return self.strategy.aggregate_evaluate(server_round, replies)

        def summary(self) -> None:
            self.strategy.summary()

        # -- recording
        def _record(self, server_round: int, replies: list) -> RecordedRound:
            sent = self._sent.pop(server_round)
            rec = RecordedRound(server_round, sent)
            got = []
            for m in replies:
                _, arr = _single(m.content.array_records, "ArrayRecord", "reply")
                metrics = {k: float(v) for mr in m.content.metric_records.values() for k, v in mr.items()
                           if isinstance(v, (int, float))}
                cid = int(metrics.get("partition-id", m.metadata.src_node_id))
                got.append(ClientReply(int(m.metadata.src_node_id), cid, to_tensors(arr),
                                       int(metrics.get("num-examples", 1)), metrics))
            got.sort(key=lambda r: r.client_id)
            rec.client_metrics = {r.client_id: {k: v for k, v in r.metrics.items() if k.startswith("gradleak.")}
                                  for r in got}
            identical = len(got) > 1 and all(
                r.arrays.keys() == got[0].arrays.keys() and all(torch.equal(r.arrays[k], got[0].arrays[k])
                                                                for k in r.arrays) for r in got[1:])
            if self.secure_aggregation or identical:
                rec.aggregated = True
                rec.note = ("secure aggregation: the server holds only the aggregate, which is what is attacked"
                            if self.secure_aggregation else
                            f"all {len(got)} replies carry identical arrays: the results are already aggregated "
                            "(e.g. SecAgg+), so only the sum is attackable; the attacks read the sum")
                rec.replies = [ClientReply(-1, -1, {}, sum(r.num_examples for r in got), {})]
            else:
                rec.replies = got
                steps = lambda r: int(r.metrics.get("local-steps", 1))  # noqa: E731
                rec.updates = [reply_update(sent, r.arrays, reply=self.reply, algorithm=self.algorithm,
                                            lr=self.lr(server_round), num_examples=r.num_examples,
                                            client_id=r.client_id, local_steps=steps(r)) for r in got]
            self.rounds.append(rec)
            if self.keep is not None and len(self.rounds) > self.keep:
                self.rounds.pop(0)
            return rec

        def server_view(self, *, model, threat, knowledge: dict | None = None, always_public: dict | None = None,
                        rounds: Sequence[RecordedRound] | None = None):
            """gradleak's :class:`~gradleak.fl.core.ServerView` of the recorded rounds (default: all kept), built by
            the threat model's one gate, :func:`gradleak.fl.threat.build_view`. A round that held only the aggregate
            gives the view the sum even if the threat model would grant individual updates."""
            return view_of(list(rounds if rounds is not None else self.rounds), model=model, threat=threat,
                           knowledge=knowledge, always_public=always_public)

    return GradleakStrategy


_STRATEGY_CLASS = None


def GradleakStrategy(strategy, **kwargs):  # noqa: N802 -- a class to the user; built lazily (Flower is optional)
    """See the class docstring (:func:`_make_strategy_class`); raises a clear error when Flower is missing."""
    global _STRATEGY_CLASS
    if _STRATEGY_CLASS is None:
        _STRATEGY_CLASS = _make_strategy_class()
    return _STRATEGY_CLASS(strategy, **kwargs)


# ------------------------------------------------------------------------------------------ client mods

def _train_message(msg) -> bool:
    return str(msg.metadata.message_type).split(".")[0] == "train"


def _rebuild_reply(out, key: str, arrays: dict[str, torch.Tensor]):
    """Replace the reply's ArrayRecord by ``ArrayRecord({k: Array(ndarray)})`` (Flower's aggregation drops replies
    that are not in this form, silently)."""
    out.content[key] = to_arrays(arrays)
    return out


def _reply_of(msg, out, ctx, *, algorithm: str, lr: float | None, mod: str):
    """What a client mod needs of a train message and its reply: ``(sent, reply key, reply arrays, update, config,
    is_update, lr)``. The lr comes from the message's config, else the mod's argument; a weight reply without either
    is refused (the update would be wrong by an unknown factor)."""
    _, sent_rec = _single(msg.content.array_records, "ArrayRecord", mod)
    sent = to_tensors(sent_rec)
    key, arr = _single(out.content.array_records, "ArrayRecord", "reply")
    got = to_tensors(arr)
    conf = next(iter(msg.content.config_records.values()), {})
    is_update = bool(conf.get(UPDATE_KEY, False))
    step = float(conf.get("lr", lr if lr is not None else float("nan")))
    if not is_update and not step == step:
        raise BadInput(f"{mod}.lr", "the client's learning rate is needed to turn its new weights into its update, "
                       "but the message's config has no 'lr'.",
                       f"pass {mod}(..., lr=<the clients' lr>) or send 'lr' in the train config.")
    metrics = {k: float(v) for mr in out.content.metric_records.values() for k, v in mr.items()
               if isinstance(v, (int, float))}
    upd = reply_update(sent, got, reply="update" if is_update else "weights", algorithm=algorithm, lr=step,
                       num_examples=int(metrics.get("num-examples", 1)),
                       client_id=int(metrics.get("partition-id", ctx.node_id)))
    return sent, key, got, upd, conf, is_update, step


def defense_mod(defenses: list, *, seed: int = 0, algorithm: str = "fedavg", lr: float | None = None,
                names: Iterable[str] | None = None):
    """A client mod that applies gradleak's update defenses (``defenses:`` entries, e.g.
    ``[{"name": "clipping", "params": {"max_norm": 1}}, {"name": "gaussian_noise", "params": {"std": 0.01}}]``) to
    the client's update before it leaves (built defense objects are accepted too): the update is ``(sent − new) / lr`` for weight replies (``lr`` from the
    message's config ``lr``, else the argument), the reply is rebuilt from the defended update. ``names``: the
    model's parameter names; a message whose arrays do not match them is refused (wrong model). Server-side
    mechanisms (``dp_gaussian`` with ``where: server``) belong to the server: use Flower's central-DP wrappers."""
    require_flower()
    from gradleak.defenses import build_defenses

    entries = list(defenses)
    built = [d for d in entries if hasattr(d, "apply")]  # already-built defenses (the pipeline's) pass through
    built += build_defenses([d for d in entries if not hasattr(d, "apply")], seed=seed)
    central = [d for d in built if getattr(d, "server_side", False)]
    if central:
        raise BadInput("defenses", "a server-side mechanism (dp_gaussian where: server) cannot run in a client mod.",
                       "use Flower's DifferentialPrivacyServerSideFixedClipping on the server, or where: client.")
    expected = set(names) if names is not None else None

    def mod(msg, ctx, call_next):
        if not _train_message(msg):
            return call_next(msg, ctx)
        _, sent_rec = _single(msg.content.array_records, "ArrayRecord", "defense_mod")
        names_sent = set(sent_rec.keys())
        if expected is not None and names_sent != expected:
            extra, miss = sorted(names_sent - expected), sorted(expected - names_sent)
            raise BadInput("defense_mod.names", "the parameters sent do not match the model the mod was given"
                           + (f"; unknown: {', '.join(extra[:3])}" if extra else "")
                           + (f"; missing: {', '.join(miss[:3])}" if miss else "") + ".",
                           "give defense_mod the names of the model the ClientApp trains (its trainable parameters).")
        out = call_next(msg, ctx)
        if out.has_error():
            return out
        sent, key, got, upd, conf, is_update, step = _reply_of(msg, out, ctx, algorithm=algorithm, lr=lr,
                                                               mod="defense_mod")
        cid = upd.client_id
        server_round = int(conf.get("server-round", 1))
        for d in built:
            upd = d.apply(upd, {"client_id": cid, "seed": seed + server_round - 1, "lr": step})
        new = upd.tensors if is_update else {k: (sent[k].to(torch.float64) - step * v.to(torch.float64)).to(got[k].dtype)
                                             for k, v in upd.tensors.items()}
        return _rebuild_reply(out, key, new)

    return mod


def scoring_mod(score: Callable[[dict[str, torch.Tensor], Any, Any], dict[str, float]], *, lr: float | None = None,
                algorithm: str = "fedavg"):
    """A client mod that scores the client's own leakage and sends only scalars: after training it calls
    ``score(sent_arrays, update, context) -> {name: value}`` (the client knows its private data; the update is what
    the server will receive, after the mods inside this one, so put this mod outermost) and adds the values to the
    reply's metrics under ``gradleak.<name>`` (a real deployment measures leakage without sending data)."""
    require_flower()

    def mod(msg, ctx, call_next):
        if not _train_message(msg):
            return call_next(msg, ctx)
        out = call_next(msg, ctx)
        if out.has_error():
            return out
        sent, _, _, upd, _, _, _ = _reply_of(msg, out, ctx, algorithm=algorithm, lr=lr, mod="scoring_mod")
        _, mrec = _single(out.content.metric_records, "MetricRecord", "reply")
        values = score(sent, upd, ctx) or {}
        for k, v in values.items():
            v = float(v)
            mrec[f"gradleak.{k}"] = v if v == v else -1.0  # Flower's metrics take no nan; -1 = undefined
        return out

    return mod


def legacy_mod(mod):
    """Run a legacy-format Flower mod (``fixedclipping_mod``, ``LocalDpMod``: they read ``fitins.parameters`` and
    ``fitins.config`` and return unnamed ``fitres.parameters``) inside a Message-API ClientApp: the message is
    translated both ways and the reply gets its parameter names, its ``num-examples`` metric and the Message API's
    record names back (without this, Flower's Message-API strategies skip the reply)."""
    require_flower()
    from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

    def bridged(msg, ctx, call_next):
        if not _train_message(msg):
            return call_next(msg, ctx)
        akey, arrays = _single(msg.content.array_records, "ArrayRecord", "legacy_mod")
        ckey, config = next(iter(msg.content.config_records.items()), ("config", ConfigRecord()))
        names = list(arrays.keys())
        state: dict[str, Any] = {}

        def named(rec) -> dict[str, torch.Tensor]:
            t = to_tensors(rec)
            if list(t) != names and len(t) == len(names):  # legacy parameters are a list: names by position
                t = dict(zip(names, t.values()))
            return t

        def inner(lmsg, c):
            content = RecordDict({akey: to_arrays(named(lmsg.content.array_records["fitins.parameters"])),
                                  ckey: lmsg.content.config_records["fitins.config"]})
            reply = call_next(Message(content=content, metadata=msg.metadata), c)
            if reply.has_error():
                return reply
            rkey, rarr = _single(reply.content.array_records, "ArrayRecord", "reply")
            mkey, mrec = _single(reply.content.metric_records, "MetricRecord", "reply")
            state.update(rkey=rkey, mkey=mkey, metrics=dict(mrec))
            reply.content = RecordDict({
                "fitres.parameters": rarr, "fitres.metrics": ConfigRecord({}),
                "fitres.num_examples": MetricRecord({"num_examples": int(mrec.get("num-examples", 1))}),
                "fitres.status": ConfigRecord({"code": 0, "message": "Success"})})
            return reply

        legacy = RecordDict({"fitins.parameters": arrays, "fitins.config": config})
        out = mod(Message(content=legacy, metadata=msg.metadata), ctx, inner)
        if out.has_error() or "rkey" not in state:
            return out
        out.content = RecordDict({state["rkey"]: to_arrays(named(out.content.array_records["fitres.parameters"])),
                                  state["mkey"]: MetricRecord(state["metrics"])})
        return out

    return bridged


# ------------------------------------------------------------------------------------------ running the apps

def _private_task_identity():
    """Flower's private task identity (messages read their run and node ids from it), behind the version guard."""
    require_flower()
    try:
        from flwr.supercore.task_identity import TaskIdentity
    except ImportError:  # pragma: no cover -- moved in a Flower release inside the pinned range
        import flwr

        raise BadInput("flwr", f"the in-process runner needs Flower's private flwr.supercore.task_identity, which "
                       f"Flower {flwr.__version__} does not have.", "use run_simulation_engine (Ray) instead, or "
                       f"install a supported version: `{INSTALL}`.") from None
    return TaskIdentity


def _make_grid_class():
    require_flower()
    from flwr.app import Context, RecordDict
    from flwr.serverapp import Grid
    from flwr.supercore.run import Run

    class InProcessGrid(Grid):
        """A Grid that delivers every message to ``client_app`` in this process, one node after another (node ids
        1..n, ``node_config`` ``partition-id`` 0..n−1 and ``num-partitions`` n, as Flower's simulation engine)."""

        def __init__(self, client_app, num_nodes: int, run_config: dict | None = None, run_id: int = 1):
            self.client_app = client_app
            self._run = Run.create_empty(run_id)
            self.contexts = {i + 1: Context(run_id=run_id, node_id=i + 1,
                                            node_config={"partition-id": i, "num-partitions": num_nodes},
                                            state=RecordDict(), run_config=dict(run_config or {}))
                             for i in range(num_nodes)}
            self._inbox: dict[str, Any] = {}

        def set_run(self, run) -> None:
            self._run = run

        @property
        def run(self):
            return self._run

        def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
            from flwr.app import Message

            return Message(content=content, dst_node_id=dst_node_id, message_type=message_type, ttl=ttl,
                           group_id=group_id)

        def get_node_ids(self):
            return list(self.contexts)

        def push_messages(self, messages):
            ids = []
            for m in messages:
                mid = uuid.uuid4().hex
                m.metadata.__dict__["_message_id"] = mid  # read-only in the API: the SuperLink sets it
                self._inbox[mid] = m
                ids.append(mid)
            return ids

        def pull_messages(self, message_ids):
            out = []
            for mid in message_ids:
                m = self._inbox.pop(mid)
                ctx = self.contexts.get(m.metadata.dst_node_id)
                if ctx is None:
                    raise BadInput("dst_node_id", f"no node {m.metadata.dst_node_id} in this in-process federation.",
                                   f"send to one of {list(self.contexts)}.")
                reply = self.client_app(m, ctx)
                reply.metadata.__dict__["_message_id"] = uuid.uuid4().hex
                out.append(reply)
            return out

        def send_and_receive(self, messages, *, timeout=None):
            return self.pull_messages(self.push_messages(messages))

    return InProcessGrid


def run_inprocess(server_app, client_app, num_supernodes: int, run_config: dict | None = None) -> float:
    """Run ``server_app`` against ``client_app`` on ``num_supernodes`` in-process nodes (no Ray); returns seconds."""
    if int(num_supernodes) < 1:
        raise BadInput("num_supernodes", f"must be >= 1, got {num_supernodes}.", "run at least one client node.")
    TaskIdentity = _private_task_identity()
    from flwr.app import Context, RecordDict

    grid = _make_grid_class()(client_app, int(num_supernodes), run_config)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, grid.run.run_id, 0  # 0: the SuperLink
    t0 = time.perf_counter()
    server_app(grid, Context(run_id=grid.run.run_id, node_id=0, node_config={}, state=RecordDict(),
                             run_config=dict(run_config or {})))
    return time.perf_counter() - t0


def run_simulation_engine(server_app, client_app, num_supernodes: int, backend_config: dict | None = None) -> float:
    """Run the apps through Flower's simulation engine (Ray; ``gradleak[fl-simulation]``); returns seconds."""
    require_flower()
    try:
        import ray  # noqa: F401 -- Flower's simulation backend
        from flwr.simulation import run_simulation
    except ImportError:
        raise BadInput("fl.flower.runtime", "Flower's simulation engine needs Ray, which is not installed.",
                       "pip install 'gradleak[fl-simulation]', or use the in-process runtime (no Ray).") from None
    t0 = time.perf_counter()
    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=int(num_supernodes),
                   backend_config=backend_config or {"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                                     "init_args": {"num_cpus": 1, "include_dashboard": False}})
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------------------ the pipeline's engine

def _quiet_flower(verbose: bool) -> None:
    import logging

    logging.getLogger("flwr").setLevel(logging.INFO if verbose else logging.WARNING)


def _dp_strategy(flower_cfg, inner, n_clients: int):
    """``inner`` wrapped in Flower's central-DP strategy for ``fl.flower.dp`` server-fixed / client-fixed."""
    from flwr.serverapp.strategy import DifferentialPrivacyClientSideFixedClipping, DifferentialPrivacyServerSideFixedClipping

    wrap = {"server-fixed": DifferentialPrivacyServerSideFixedClipping,
            "client-fixed": DifferentialPrivacyClientSideFixedClipping}.get(flower_cfg.dp)
    return inner if wrap is None else wrap(inner, flower_cfg.noise_multiplier, flower_cfg.clipping_norm, n_clients)


def _dp_mods(flower_cfg) -> list:
    """Flower's client-side DP mods for ``fl.flower.dp`` (client-fixed: fixedclipping_mod; local: LocalDpMod)."""
    if flower_cfg.dp == "client-fixed":
        from flwr.client.mod import fixedclipping_mod

        return [legacy_mod(fixedclipping_mod)]
    if flower_cfg.dp == "local":
        from flwr.client.mod import LocalDpMod

        return [legacy_mod(LocalDpMod(flower_cfg.clipping_norm, flower_cfg.local_sensitivity, flower_cfg.local_epsilon,
                                      flower_cfg.local_delta))]
    return []


def run_rounds_flower(model, clients: Sequence[Any], *, rounds: int, algorithm: str, lr: float, local_epochs: int = 1,
                      local_batch_size: int | None = None, defenses: Sequence[Any] = (), seed: int = 0,
                      server_hook: Callable[[int, Any], Any] | None = None, secure_aggregation: bool = False,
                      track: Callable[..., Any] | None = None, keep_round: Callable[[int], bool] | None = None,
                      local_update: Callable[..., Any] | None = None, client_settings: Sequence[dict] | None = None,
                      lr_at: Callable[[int], float] | None = None, flower=None, verbose: bool = False):
    """:func:`gradleak.fl.protocol.run_rounds` through a real Flower federation (``fl.engine: flower``).

    The server is a ``ServerApp`` running ``GradleakStrategy(FedAvg)`` (wrapped in Flower's central-DP strategy when
    ``fl.flower.dp`` asks for it) through Flower's own round loop (``Strategy.start``); each client is a node whose
    ``ClientApp`` trains the pipeline's :class:`~gradleak.fl.core.Client` on its own copy of the model it was sent
    and replies with its new weights in float64 (``(sent − new) / lr`` is then its upload to 1e-15; a float32 reply
    would round the small step against the weights) or with the update (``fl.flower.reply: update``). gradleak's
    update defenses run in :func:`defense_mod`, Flower's client-side DP in its own mods (:func:`legacy_mod`). What
    the attacks get is what the strategy wrapper recorded, round by round. The server sends the trainable arrays,
    plus every frozen tensor that differs from the model the clients downloaded (a malicious server's poisoning)."""
    require_flower()
    from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp
    from flwr.serverapp.strategy import FedAvg

    from gradleak.fl.core import batchnorm_buffer_names
    from gradleak.fl.protocol import RoundsOutcome

    if flower is None:
        from gradleak.experiments.schema import FlowerConfig

        flower = FlowerConfig()
    if batchnorm_buffer_names(model):
        raise BadInput("fl.engine", "the Flower engine does not carry BatchNorm running statistics in its messages.",
                       "use fl.engine=builtin for BatchNorm models (the leakage study's ResNet-18).")
    if any(getattr(d, "server_side", False) for d in defenses):
        raise BadInput("defenses", "dp_gaussian with where: server is gradleak's own central DP; on the Flower engine "
                       "the server's mechanism is Flower's.", "use fl.flower.dp=server-fixed (or client-fixed), or "
                       "fl.engine=builtin.")
    if flower.dp != "none" and flower.reply != "weights":
        raise BadInput("fl.flower.reply", f"Flower's DP mechanisms (fl.flower.dp={flower.dp}) clip the change of the "
                       "weights, so the clients must reply with their new weights.", "set fl.flower.reply=weights.")
    _quiet_flower(verbose)
    lr_of = lr_at or (lambda _r: lr)
    n = len(clients)
    trainable = [nm for nm, p in model.named_parameters() if p.requires_grad]
    base = copy.deepcopy(model)  # what every client downloaded before round 1 (frozen weights included)
    initial = {nm: p.detach().clone() for nm, p in base.named_parameters() if not p.requires_grad}
    out = RoundsOutcome(model=model, secure_sums=[] if secure_aggregation else None)
    clock = {"client": 0.0, "hook": 0.0}
    holder: dict[str, Any] = {}
    progress = {"bar": None}

    # -- server side: load what FedAvg aggregated into the server's model, let the attack set it, send it
    def hook(server_round: int, arrays: dict) -> dict:
        nonlocal model
        r = server_round - 1
        with torch.no_grad():
            for nm, p in model.named_parameters():
                if nm in arrays:
                    p.copy_(arrays[nm].to(device=p.device, dtype=p.dtype))
        if server_hook is not None:
            t0 = time.perf_counter()
            model = server_hook(r, model)
            clock["hook"] += time.perf_counter() - t0
        out.model = model
        params = dict(model.named_parameters())
        send = {nm: params[nm].detach().clone().cpu() for nm in trainable}
        if server_hook is not None:  # frozen tensors the server rewrote travel too
            for nm, v in initial.items():
                if not torch.equal(params[nm].detach().cpu(), v.cpu()):
                    send[nm] = params[nm].detach().clone().cpu()
        return send

    def on_round(rec: RecordedRound):
        r = rec.server_round - 1
        keep = keep_round is None or keep_round(r)
        out.last_aggregate = rec.aggregate
        if keep:
            out.kept_rounds.append(r)
            out.round_states.append({k: v for k, v in rec.sent.items() if k in trainable})
            out.rounds.append([] if rec.aggregated else list(rec.updates))
            if secure_aggregation:
                out.secure_sums.append(rec.aggregate)
        if progress["bar"] is not None:
            progress["bar"](r)
        return None

    sapp = ServerApp()

    @sapp.main()
    def _main(grid, context):
        inner = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=n, min_train_nodes=n,
                       min_evaluate_nodes=0)
        strategy = _dp_strategy(flower, inner, n)
        s = GradleakStrategy(strategy, lr=lambda sr: lr_of(sr - 1), algorithm=algorithm, reply=flower.reply,
                             secure_aggregation=secure_aggregation, on_round=on_round, server_hook=hook, keep=1,
                             send_lr=True)
        holder["strategy"] = s
        first = {nm: p.detach().clone().cpu() for nm, p in model.named_parameters() if p.requires_grad}
        s.start(grid=grid, initial_arrays=to_arrays(first), num_rounds=rounds, train_config=ConfigRecord({}),
                timeout=None)

    # -- client side: the pipeline's Client on its own copy of what it was sent
    capp_mods = _dp_mods(flower)  # outermost: Flower's DP acts last on the reply, as its docs ask
    if defenses:
        capp_mods.append(defense_mod(list(defenses), seed=seed, algorithm=algorithm, names=None))
    capp = ClientApp(mods=capp_mods)

    @capp.train()
    def _train(msg, ctx):
        pid = int(ctx.node_config["partition-id"])
        c = clients[pid]
        conf = msg.content["config"]
        r = int(conf["server-round"]) - 1
        lr_r = float(conf["lr"])
        sent = to_tensors(msg.content["arrays"])
        local = copy.deepcopy(base)
        params = dict(local.named_parameters())
        unknown = sorted(set(sent) - set(params))
        if unknown:
            raise BadInput("arrays", f"the server sent arrays the client's model does not have ({', '.join(unknown[:3])}).",
                           "the ClientApp and the ServerApp must build the same model.")
        with torch.no_grad():
            for nm, v in sent.items():
                params[nm].copy_(v.to(device=params[nm].device, dtype=params[nm].dtype))
        own = (client_settings[pid] if client_settings is not None else None) or {}
        t0 = time.perf_counter()
        if local_update is None:
            upd = c.local_update(local, algorithm=algorithm, epochs=own.get("epochs", local_epochs), lr=lr_r,
                                 batch_size=own.get("batch_size", local_batch_size), defenses=(), seed=seed + r,
                                 in_place=True)
        else:
            upd = local_update(c, local, seed=seed + r, algorithm=algorithm, lr=lr_r, round_index=r,
                               epochs=own.get("epochs", local_epochs), batch_size=own.get("batch_size", local_batch_size))
            if upd is None:
                raise BadInput("defense", "a client withheld its update (the RDLV filter); the Flower engine has no "
                               "withheld replies.", "use fl.engine=builtin with this defense.")
        clock["client"] += time.perf_counter() - t0
        tensors = {k: v.detach().cpu() for k, v in upd.tensors.items()}
        if flower.reply == "weights":
            tensors = {k: sent[k].to(torch.float64) - lr_r * v.to(torch.float64) for k, v in tensors.items()}
        holder.setdefault("computed", {})[(r, pid)] = tensors
        metrics = MetricRecord({"num-examples": int(upd.num_samples), "partition-id": pid,
                                "local-steps": int(upd.local_steps)})
        return Message(RecordDict({"arrays": to_arrays(tensors), "metrics": metrics}), reply_to=msg)

    if track is not None:
        bar_it = iter(track(range(rounds), description=f"Flower rounds ({n} client(s), {algorithm}, "
                                                       f"{flower.runtime})", total=rounds))
        progress["bar"] = lambda _r: next(bar_it, None)
    if flower.runtime == "simulation":
        run_simulation_engine(sapp, capp, n)
    else:
        run_inprocess(sapp, capp, n)
    if progress["bar"] is not None:
        for _ in bar_it:
            pass
    if holder.get("strategy") is None or out.last_aggregate is None:
        raise RuntimeError("the Flower run recorded no round (see Flower's log above)")
    out.client_seconds, out.server_hook_seconds = clock["client"], clock["hook"]
    out.flower_computed = holder.get("computed", {})  # what the clients computed (tests compare the record to it)
    return out


# ------------------------------------------------------------------------------------------ the audit, live

def build_model(config):
    """The model (+ PEFT) a Flower app trains, built from a gradleak config (a path or a dict) exactly as the
    pipeline builds it, so the ServerApp, the ClientApps and the audit share one description. Returns
    ``(handle, cfg)``: ``handle.model`` is the torch model, ``cfg`` the validated config."""
    from gradleak.experiments.pipeline import build_handle

    cfg = _validated(config)
    handle, _ = build_handle(cfg)
    return handle, cfg


def _raw(config) -> dict:
    from pathlib import Path

    from gradleak.experiments.config import load_yaml

    return load_yaml(config) if isinstance(config, (str, Path)) else copy.deepcopy(dict(config))


def _validated(config):
    from gradleak.experiments.runner import validate

    raw = _raw(config)
    raw.pop("audit", None)
    if not (raw.get("attack") or {}).get("name"):
        raise BadInput("attack.name", "the Flower app's config names no attack, so its model's dtype is not fixed.",
                       "name the attack whose setting the app models (e.g. attack: {name: lora_span}).")
    return validate(raw)[1]


class FlowerAudit:
    """gradleak's attacks on every audited Flower round: ``GradleakStrategy(..., on_round=FlowerAudit(config, out))``.

    ``config`` is the gradleak config that describes the federation (model, PEFT, data kind, threat, fl); its
    ``attack`` names the setting the app models, and every registered attack the config's gate accepts is run on
    the round's :class:`~gradleak.fl.core.ServerView` (``attacks=[...]`` restricts them). Attacks that poison the
    weights the server sends cannot run after the fact: they are listed as not run (run them through
    ``server_hook`` / ``fl.engine: flower``). ``truth(server_round) -> [(inputs, labels), ...]`` (per client, the
    pipeline's form: images in [0, 1], or texts) is what a *simulation* knows; with it every attack is scored and
    judged as ``gradleak audit`` judges it. Without it (a real deployment) the reconstructions are saved for
    inspection and the clients' own scalars (:func:`scoring_mod`) are reported. Writes ``OUT/round_<r>/audit.json``
    and ``OUT/flower_audit.json`` (every audited round, rewritten atomically)."""

    def __init__(self, config, out_dir, *, attacks: Sequence[str] | None = None,
                 truth: Callable[[int], list] | None = None, device: str = "cpu", log: Callable[[str], Any] = print):
        from pathlib import Path

        from gradleak.experiments.audit import _attack_names, _candidate
        from gradleak.experiments.runner import validate
        from gradleak.registry import ATTACKS

        self.raw = _raw(config)
        self.cfg = _validated(self.raw)
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.truth, self.log, self.device = truth, log, torch.device(device)
        names = list(attacks) if attacks else _attack_names()
        unknown = sorted(set(names) - set(ATTACKS.names()))
        if unknown:
            raise BadInput("attacks", f"unknown attack(s) {', '.join(unknown)}.", f"choose from {', '.join(ATTACKS.names())}.")
        self.plans, self.not_run = [], []
        for name in names:
            try:
                _, cfg = validate(_candidate(self.raw, name))
            except BadInput as err:
                self.not_run.append({"name": name, "applicable": False, "reason": str(err)})
                continue
            if cfg.attack_cls.rewrites_weights:
                self.not_run.append({"name": name, "applicable": False, "reason": "poisons the weights the server "
                                     "sends, which a recorded honest federation did not do; run it through "
                                     "GradleakStrategy(server_hook=...) or gradleak run with fl.engine=flower"})
                continue
            self.plans.append((name, cfg))
        if not self.plans:
            raise BadInput("attacks", "no attack applies to this federation's config: "
                           + "; ".join(f"{e['name']}: {e['reason']}" for e in self.not_run[:4]),
                           "check the config's model / PEFT kind / threat, or name attacks that apply.")
        self.handle, _ = build_model(self.raw)
        self.handle.model.to(self.device)
        self.summary: list[dict] = []
        self.null_pool = None  # chance, for the levels (public samples of the config's data no client holds)
        if truth is not None:
            from gradleak.experiments.pipeline import ImageData, TextData

            try:
                data = ImageData(self.cfg) if self.cfg.modality == "image" else TextData(self.cfg)
                self.null_pool = data.null_pool(0)
            except (BadInput, OSError, ValueError) as err:
                self.log(f"[flower audit] no null pool ({err}): levels will be undefined")

    def __call__(self, rec: RecordedRound) -> dict:
        from gradleak.attacks.base import AttackContext
        from gradleak.experiments.audit import _verdict, judge, leak_rank, server_words
        from gradleak.experiments.evaluation import Truth, evaluate
        from gradleak.experiments.pipeline import _always_public, _bottleneck, _clients, public_protocol
        from gradleak.experiments.results import write_json_atomic
        from gradleak.fl.core import default_classification_loss

        t_round = time.perf_counter()
        h, base = self.handle, self.cfg
        model = h.model
        with torch.no_grad():
            params = dict(model.named_parameters())
            for k, v in rec.sent.items():
                if k in params:
                    params[k].copy_(v.to(device=params[k].device, dtype=params[k].dtype))
        threat = base.threat_model
        batches = self.truth(rec.server_round) if self.truth is not None else None
        # every client's update is attacked in turn (the view's first update is the attacked one); under secure
        # aggregation the one sum, against every client's data
        victims = [None] if (rec.aggregated or not threat.individual_updates) else list(range(len(rec.updates)))
        always = _always_public(h, base)
        rdir = self.out / f"round_{rec.server_round}"
        targets = []  # (client id, view, truth) per attacked update: the same for every attack
        for v in victims:
            r_v = rec if v is None else RecordedRound(rec.server_round, rec.sent, rec.replies,
                                                      rec.updates[v:] + rec.updates[:v], rec.aggregated,
                                                      rec.aggregate, rec.note)
            knowledge, truth = {}, None
            if batches is not None:
                b_v = batches if v is None else [batches[rec.updates[v].client_id]] + [
                    batches[u.client_id] for u in rec.updates if u is not rec.updates[v]]
                _, truth = _clients(h, b_v, h.loss_fn or default_classification_loss, self.device,
                                    threat if v is not None else _no_individual(threat), base)
                knowledge = truth.pop("_knowledge")
            view = view_of([r_v], model=model, threat=threat, knowledge=knowledge, always_public=always)
            targets.append(("sum" if v is None else rec.updates[v].client_id, view, truth))
        entries = []
        for name, cfg in self.plans:
            A = cfg.attack_cls
            entry = {"name": name, "reconstruction": A.reconstruction, "applicable": True, "threat": threat.capability}
            per, t0 = [], time.perf_counter()
            for cid, view, truth in targets:
                public = {"batch_size": view.updates[0].num_samples} if threat.knows_batch_size else {}
                ctx = AttackContext(seed=cfg.seed, device=self.device, threat=cfg.threat_model,
                                    fl=public_protocol(cfg), public=public)
                one: dict[str, Any] = {"client": cid}
                try:
                    attack = A.from_config(cfg.attack_cfg, ctx)
                    attack.prepare(model, cfg.threat_model)
                    out = attack.reconstruct(view)
                    where = rdir / name / f"client_{cid}"
                    if truth is not None:
                        tr = Truth(h.modality, truth["inputs"], truth["labels"], texts=truth.get("texts"),
                                   tokenizer=h.tokenizer, model_kind=h.kind, bottleneck=_bottleneck(cfg, h))
                        if self.null_pool is not None:
                            tr.null_pool, tr.null_source = self.null_pool
                        ev = evaluate(A.reconstruction, tr, out, cfg, where, 0)
                        one.update(judge(A.reconstruction, ev.metrics, cfg))
                        if one.get("n_total") is not None and A.reconstruction != "patches":
                            one["n_total"] = int(len(truth["labels"]))
                    else:
                        _save_reconstruction(out, where, h.tokenizer)
                        one.update({"success": None})
                except BadInput as err:
                    one.update({"refused": str(err)})
                except Exception as err:  # noqa: BLE001 -- one attack's crash must not stop the federation's audit
                    one.update({"failed": f"{type(err).__name__}: {err}"})
                per.append(one)
            entry["seconds"] = time.perf_counter() - t0
            entry["per_client"] = per
            ran = [o for o in per if "success" in o]
            if not ran:
                first = per[0]
                entry.update({"applicable": "refused" not in first,
                              "reason": first.get("refused") or first.get("failed", "")})
                if "failed" in first:
                    entry["failed"] = first["failed"]
            elif all(o["success"] is None for o in ran):
                entry.update({"success": None, "reason": "no ground truth on the server: the reconstructions are "
                              "saved for inspection; see the clients' own scores"})
            else:
                worst = max(ran, key=leak_rank)
                entry.update({k: worst[k] for k in ("success", "level", "rule", "evidence", "metric", "value",
                                                    "null_median", "null_p99", "p_value", "criterion") if k in worst})
                entry["threat_words"] = server_words(threat)
                entry["per_client_levels"] = [{"client": o["client"], "level": o.get("level"), "value": o.get("value")}
                                              for o in ran]
                entry["success"] = any(o["success"] for o in ran)
                if all(o.get("n_success") is not None for o in ran):
                    entry["n_success"] = sum(o["n_success"] for o in ran)
                    entry["n_total"] = sum(o["n_total"] for o in ran)
                    if "unit" in worst:
                        entry["unit"] = worst["unit"]
                entry["worst_client"] = worst["client"]
            entries.append(entry)
            self.log(f"[flower audit] round {rec.server_round} {name}: "
                     + ("SUCCESS" if entry.get("success") else "no success" if entry.get("success") is False else
                        entry.get("failed") or entry.get("reason", "")[:80])
                     + (f" ({entry['metric']} = {entry['value']:.4g}, worst of {len(ran)} update(s))"
                        if isinstance(entry.get("value"), (int, float)) else ""))
        judged = [e for e in entries if e.get("success") is not None and "level" in e]
        verdict, headline = _verdict(judged) if judged else ("not_scored", "no ground truth on the server: see the "
                                                              "clients' own scores")
        result = {"server_round": rec.server_round, "verdict": verdict, "headline": headline,
                  "aggregated": rec.aggregated, "note": rec.note, "attacks": entries + self.not_run,
                  "client_scores": {str(k): v for k, v in rec.client_metrics.items() if v},
                  "seconds": time.perf_counter() - t_round}
        rdir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(rdir / "audit.json", result)
        self.summary.append({k: result[k] for k in ("server_round", "verdict", "headline", "aggregated", "seconds")}
                            | {"values": {e["name"]: e.get("value") for e in entries},
                               "client_scores": result["client_scores"]})
        write_json_atomic(self.out / "flower_audit.json", {"rounds": self.summary, "config": self.raw})
        return result


def _no_individual(threat):
    from dataclasses import replace as dc_replace

    return dc_replace(threat, individual_updates=False)


def _save_reconstruction(rec, out_dir, tokenizer=None) -> None:
    """What an attack produced, for a human to inspect when nothing can score it (no ground truth): images as a PNG
    grid, token sequences decoded, scores as numbers."""
    from gradleak.experiments.results import write_json_atomic

    out_dir.mkdir(parents=True, exist_ok=True)
    data, saved = rec.data, {"metrics": {k: float(v) for k, v in (getattr(rec, "metrics", {}) or {}).items()}}
    if isinstance(data, dict) and isinstance(data.get("images"), torch.Tensor):
        from gradleak.report import save_image_grid

        save_image_grid(data["images"].detach().float().clamp(0, 1).cpu(), out_dir / "images.png")
        saved["images"] = "images.png"
    elif isinstance(data, dict) and "scores" in data:
        saved["scores"] = {str(k): [float(x) for x in v] for k, v in dict(data["scores"]).items()}
    elif isinstance(data, (list, tuple)) and tokenizer is not None:
        saved["texts"] = [tokenizer.decode(list(s), skip_special_tokens=True).strip() for s in data]
    write_json_atomic(out_dir / "reconstruction.json", saved)


def client_scorer(config, data: Callable[[Any], tuple], *, attacks: Sequence[str] | None = None,
                  out_dir=None, device: str = "cpu"):
    """A score function for :func:`scoring_mod`: the client runs the audit's attacks on its own update, against its
    own private batch ``data(context) -> (inputs, labels)`` (the pipeline's form), and returns only scalars:
    ``<attack>`` = the headline metric and ``<attack>.success`` = 1 / 0 (nan when undefined)."""
    import tempfile
    from pathlib import Path

    state: dict[str, Any] = {}

    def score(sent, update, ctx) -> dict[str, float]:
        if "audit" not in state:
            state["audit"] = FlowerAudit(config, Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="gl-score-")),
                                         attacks=attacks, truth=lambda _r: [state["batch"]], device=device,
                                         log=lambda _m: None)
        state["batch"] = data(ctx)
        update = copy.copy(update)
        update.client_id = 0  # the one update of this client's own audit, against its own batch (index 0)
        rnd = int(state.setdefault("round", 0)) + 1
        state["round"] = rnd
        res = state["audit"](RecordedRound(rnd, sent, [ClientReply(int(ctx.node_id), 0, {}, update.num_samples, {})],
                                           [update]))
        out = {}
        for e in res["attacks"]:
            if e.get("success") is None:
                continue
            v = e.get("value")
            out[e["name"]] = float(v) if isinstance(v, (int, float)) else float("nan")
            out[f"{e['name']}.success"] = 1.0 if e["success"] else 0.0
        return out

    return score
