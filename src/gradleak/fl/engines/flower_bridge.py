"""The bridge between Flower's Message API and gradleak's federated core (the engine's ground floor).

Optional extra ``fl`` (``pip install 'gradleak[fl]'``, Flower's Message API: ``flwr>=1.42,<2``; the simulation
engine needs ``gradleak[fl-simulation]``, which adds Ray); ``flwr`` is imported inside functions only. It knows
Flower and :mod:`gradleak.fl` and nothing above them (no config, no attack, no defense registry). The pieces, each
usable in any Flower app:

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
* :func:`update_defense_mod` is a client mod that applies built update defenses to the reply (from ``defenses:``
  config entries: :func:`gradleak.integrations.flower.defense_mod`); :func:`reply_of` is what every such mod
  reads of a train message and its reply.
* :func:`legacy_mod` lets a legacy-format mod (Flower's ``fixedclipping_mod``, ``LocalDpMod``, which read
  ``fitins.parameters`` and return unnamed arrays) run inside a Message-API ClientApp, restoring the names.
* :func:`run_inprocess` runs a ``ServerApp`` against a ``ClientApp`` in this process with no Ray (CI, tests,
  laptops). It needs Flower's private ``flwr.supercore.task_identity`` (messages take their run and node ids from
  it), guarded by the pinned version range. :func:`run_simulation_engine` runs the same apps through Flower's
  simulation engine (Ray).

The pipeline's round engine on top of these is :mod:`gradleak.fl.engines.flower`; gradleak's audit of a Flower
federation (and the client mods that need gradleak's registries) is :mod:`gradleak.integrations.flower`.
"""

from __future__ import annotations

import time
import uuid
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


def single_record(records: dict, what: str, where: str):
    """``(name, record)`` of the one record in ``records`` (a message's ArrayRecords or MetricRecords), else a clear
    error naming ``where``."""
    if len(records) != 1:
        raise BadInput(where, f"expected exactly one {what} in the message, found {len(records)} "
                       f"({', '.join(records) or 'none'}).", "send the model as one ArrayRecord (Flower's convention).")
    return next(iter(records.items()))


# ------------------------------------------------------------------------------------------ the record
# (engine-neutral: gradleak.fl.recorded, shared with the NVFlare engine and filter)
from gradleak.fl.recorded import ClientReply, RecordedRound, reply_update, rounding_std, view_of  # noqa: E402,F401


# ------------------------------------------------------------------------------------------ the strategy wrapper

class _RecordingStrategy:
    """What :class:`GradleakStrategy` does (its docstring: :func:`_make_strategy_class`), without Flower's base
    class, so it can live at module level while ``flwr`` stays an optional import; the class built by
    :func:`_make_strategy_class` puts Flower's ``Strategy`` under it."""

    def __init__(self, strategy, *, lr: float | Callable[[int], float], algorithm: str = "fedavg",
                 reply: str = "weights", secure_aggregation: bool = False, audit_every: int = 1,
                 on_round: Callable[[RecordedRound], Any] | None = None,
                 server_hook: Callable[[int, dict], dict] | None = None, keep: int | None = None,
                 send_lr: bool = False):
        from flwr.serverapp.strategy import Strategy

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
            _, arr = single_record(m.content.array_records, "ArrayRecord", "reply")
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


def _make_strategy_class():
    require_flower()
    from flwr.serverapp.strategy import Strategy

    class GradleakStrategy(_RecordingStrategy, Strategy):
        """Wrap ``strategy`` and record every client's reply as the server sees it (see the module docstring).

        ``lr`` (a number or ``round -> lr`` for a 1-based round) is the clients' public learning rate, needed to
        turn new weights into the update; ``algorithm`` ``fedavg`` | ``fedsgd`` names the upload kind;
        ``secure_aggregation=True`` keeps only the aggregate of every round (what SecAgg leaves a server);
        ``on_round(recorded)`` runs every ``audit_every`` rounds (e.g. the audit); ``server_hook(round, arrays)`` may
        replace the arrays sent (a malicious server: PEFTLeak's poisoning); ``keep`` bounds the rounds kept in
        memory (``None``: all); ``send_lr`` puts the round's ``lr`` into every train config."""

    return GradleakStrategy


_STRATEGY_CLASS = None


def GradleakStrategy(strategy, **kwargs):  # noqa: N802 -- a class to the user; built lazily (Flower is optional)
    """See the class docstring (:func:`_make_strategy_class`); raises a clear error when Flower is missing."""
    global _STRATEGY_CLASS
    if _STRATEGY_CLASS is None:
        _STRATEGY_CLASS = _make_strategy_class()
    return _STRATEGY_CLASS(strategy, **kwargs)


# ------------------------------------------------------------------------------------------ client mods

def is_train_message(msg) -> bool:
    """Whether ``msg`` is a train message (client mods leave evaluate/query messages alone)."""
    return str(msg.metadata.message_type).split(".")[0] == "train"


def _rebuild_reply(out, key: str, arrays: dict[str, torch.Tensor]):
    """Replace the reply's ArrayRecord by ``ArrayRecord({k: Array(ndarray)})`` (Flower's aggregation drops replies
    that are not in this form, silently)."""
    out.content[key] = to_arrays(arrays)
    return out


def reply_of(msg, out, ctx, *, algorithm: str, lr: float | None, mod: str):
    """What a client mod needs of a train message and its reply: ``(sent, reply key, reply arrays, update, config,
    is_update, lr)``. The lr comes from the message's config, else the mod's argument; a weight reply without either
    is refused (the update would be wrong by an unknown factor)."""
    _, sent_rec = single_record(msg.content.array_records, "ArrayRecord", mod)
    sent = to_tensors(sent_rec)
    key, arr = single_record(out.content.array_records, "ArrayRecord", "reply")
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


def update_defense_mod(built: list, *, seed: int = 0, algorithm: str = "fedavg", lr: float | None = None,
                       names: Iterable[str] | None = None):
    """A client mod that applies built gradleak update defenses (objects with ``apply(update, ctx)``) to the
    client's update before it leaves: the update is ``(sent − new) / lr`` for weight replies (``lr`` from the
    message's config ``lr``, else the argument), the reply is rebuilt from the defended update. ``names``: the
    model's parameter names; a message whose arrays do not match them is refused (wrong model). Server-side
    mechanisms (``dp_gaussian`` with ``where: server``) belong to the server: use Flower's central-DP wrappers.
    From config entries: :func:`gradleak.integrations.flower.defense_mod`."""
    from gradleak.fl.core import apply_update_defenses

    require_flower()
    built = list(built)
    central = [d for d in built if getattr(d, "server_side", False)]
    if central:
        raise BadInput("defenses", "a server-side mechanism (dp_gaussian where: server) cannot run in a client mod.",
                       "use Flower's DifferentialPrivacyServerSideFixedClipping on the server, or where: client.")
    expected = set(names) if names is not None else None

    def mod(msg, ctx, call_next):
        if not is_train_message(msg):
            return call_next(msg, ctx)
        _, sent_rec = single_record(msg.content.array_records, "ArrayRecord", "defense_mod")
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
        sent, key, got, upd, conf, is_update, step = reply_of(msg, out, ctx, algorithm=algorithm, lr=lr,
                                                              mod="defense_mod")
        cid = upd.client_id
        server_round = int(conf.get("server-round", 1))
        upd = apply_update_defenses(upd, built, client_id=cid, seed=seed + server_round - 1, lr=step)
        new = upd.tensors if is_update else {k: (sent[k].to(torch.float64) - step * v.to(torch.float64)).to(got[k].dtype)
                                             for k, v in upd.tensors.items()}
        return _rebuild_reply(out, key, new)

    return mod


def legacy_mod(mod):
    """Run a legacy-format Flower mod (``fixedclipping_mod``, ``LocalDpMod``: they read ``fitins.parameters`` and
    ``fitins.config`` and return unnamed ``fitres.parameters``) inside a Message-API ClientApp: the message is
    translated both ways and the reply gets its parameter names, its ``num-examples`` metric and the Message API's
    record names back (without this, Flower's Message-API strategies skip the reply)."""
    require_flower()
    from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

    def bridged(msg, ctx, call_next):
        if not is_train_message(msg):
            return call_next(msg, ctx)
        akey, arrays = single_record(msg.content.array_records, "ArrayRecord", "legacy_mod")
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
            rkey, rarr = single_record(reply.content.array_records, "ArrayRecord", "reply")
            mkey, mrec = single_record(reply.content.metric_records, "MetricRecord", "reply")
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
