"""The bridge between NVFlare (2.9) and gradleak's federated core: the ground floor of the NVFlare engine.

Optional extra ``nvflare`` (``pip install 'gradleak[nvflare]'``, ``nvflare==2.9.0``); ``nvflare`` is imported inside
functions only. The NVFlare component classes a job names by path (:class:`GradleakExecutor`,
:class:`GradleakController`) are built on first access (a module ``__getattr__``), so importing this module needs no
NVFlare. It knows NVFlare and :mod:`gradleak.fl`, nothing above them (no config, no attack, no defense registry).

What travels is NVFlare's own message: the server sends an ``FLModel`` (``params_type`` FULL: the trainable arrays as
numpy, plus every frozen tensor a server hook rewrote; ``meta["lr"]`` the round's learning rate; ``current_round``
counted from 0, as NVFlare's ``FedAvg`` does) through :meth:`FLModelUtils.to_shareable` (a DXO of kind WEIGHTS);
each client replies with an ``FLModel`` of float64 arrays:

* ``reply: FULL`` -- its new weights ``sent − lr · upload`` (the server forms ``(sent − new) / lr`` in float64,
  which is the upload to ~1e-15; a float32 reply would round the small step against the weights);
* ``reply: DIFF`` -- the weight change ``new − sent = −lr · upload`` (NVFlare's ``WEIGHT_DIFF`` convention; the
  server forms ``−diff / lr``).

The pieces:

* :func:`client_step` -- one client's round on its own copy of the model (the pipeline's
  :class:`~gradleak.fl.core.Client`, the defenses as the builtin engine applies them) and its reply.
* :class:`ServerRounds` -- the honest server of the builtin engine (:func:`gradleak.fl.engines.builtin.run_rounds`)
  written as ``send(r)`` / ``receive(r, results)``: what the NVFlare controller does each round, recorded into the
  same :class:`~gradleak.fl.engines.builtin.RoundsOutcome`.
* :class:`GradleakExecutor` (an NVFlare ``Executor``) and :class:`GradleakController` (an NVFlare
  ``ModelController``: ``send_model_and_wait`` to every client, then :class:`ServerRounds`) -- the job's components
  for NVFlare's simulator; each builds its side from a state file (the engine: the model and the clients,
  cloudpickled) or from a gradleak config (the example: the model and the partitions rebuilt from the config).
* :func:`run_inprocess` -- NVFlare's message objects, the executor, the server's task-data and task-result filter
  chains (with ``ContentBlockedException`` answered as NVFlare's server runner answers it) driven round by round in
  this process: no simulator, no cells, no subprocess. :func:`run_simulator` runs a job through NVFlare's
  ``SimulatorRunner`` (the server in a child process, every client in its own ``simulator_worker`` subprocess).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import numpy as np
import torch

from gradleak.errors import BadInput
from gradleak.fl.core import apply_update_defenses, model_as_sent

#: the NVFlare version the integration is written and tested against (``FLModel``, ``ModelController``, ``FedJob``)
NVFLARE_RANGE = ((2, 9), (2, 10))
INSTALL = "pip install 'gradleak[nvflare]'   (or: pip install 'nvflare==2.9.0')"
TASK = "train"
META_LR, META_CLIENT, META_STEPS, META_WITHHELD = "gradleak.lr", "gradleak.client_id", "gradleak.local_steps", \
    "gradleak.withheld"
META_SAMPLES = "gradleak.num_examples"
NVFLARE_WEIGHT = "NUM_STEPS_CURRENT_ROUND"  # NVFlare's FedAvg weighs a result by this meta key (set to the samples)


def nvflare_problem(field: str = "fl.engine", what: str = "the NVFlare integration") -> BadInput | None:
    """Why NVFlare cannot be used (not installed, or a version outside :data:`NVFLARE_RANGE`), read from the package
    metadata without importing NVFlare (seconds); None when it can."""
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("nvflare") is None:
        return BadInput(field, f"{what} needs the optional `nvflare` extra (NVFlare), which is not installed.",
                        f"install it with `{INSTALL}`.")
    try:
        version = importlib.metadata.version("nvflare")
    except importlib.metadata.PackageNotFoundError:
        return None  # an unpackaged checkout: the import decides
    ver = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    lo, hi = NVFLARE_RANGE
    if not (lo <= ver < hi):
        return BadInput("nvflare", f"NVFlare {version} is installed, but gradleak's NVFlare integration supports "
                        f"nvflare {lo[0]}.{lo[1]}.x (FLModel, ModelController, FedJob, the privacy filters as of 2.9).",
                        f"install a supported version: `{INSTALL}`.")
    return None


def require_nvflare(field: str = "fl.engine", what: str = "the NVFlare integration"):
    """The ``nvflare`` module, or a clear error naming the field, the install command / the supported version."""
    problem = nvflare_problem(field, what)
    if problem is not None:
        raise problem
    try:
        import nvflare
    except ImportError:
        raise BadInput(field, f"{what} needs the optional `nvflare` extra (NVFlare), which is not installed.",
                       f"install it with `{INSTALL}`.") from None
    return nvflare


# ------------------------------------------------------------------------------------------ arrays, names

def to_numpy(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """CPU tensors as numpy arrays (FOBS serialises numpy natively; dtype kept, float64 stays float64)."""
    return {k: np.ascontiguousarray(t.detach().cpu().numpy()) for k, t in tensors.items()}


def to_torch(params: dict) -> dict[str, torch.Tensor]:
    """An FLModel's params (numpy arrays or tensors) as CPU tensors (a copy; dtype kept)."""
    return {k: (v.detach().clone().cpu() if isinstance(v, torch.Tensor) else torch.from_numpy(np.array(v, copy=True)))
            for k, v in params.items()}


def site_name(index: int) -> str:
    """NVFlare's simulator names its clients ``site-1`` .. ``site-n``; client ``index`` (0-based) is ``site-<index+1>``."""
    return f"site-{int(index) + 1}"


def site_index(name: str) -> int:
    """The 0-based client index of a site name ``site-<k>`` (the pipeline's client id / partition)."""
    try:
        return int(str(name).rsplit("-", 1)[1]) - 1
    except (IndexError, ValueError):
        raise BadInput("client", f"cannot tell the client index of site {name!r}.",
                       "name the NVFlare clients site-1 .. site-n (the simulator's default), or send "
                       f"meta['{META_CLIENT}'] in the result.") from None


def reply_kind(reply: str):
    """NVFlare's ``ParamsType`` for ``fl.nvflare.reply`` (``FULL`` | ``DIFF``)."""
    from nvflare.app_common.abstract.fl_model import ParamsType

    if reply not in ("FULL", "DIFF"):
        raise BadInput("fl.nvflare.reply", f"must be FULL or DIFF, got {reply!r}.", "use FULL (new weights) or DIFF.")
    return ParamsType.FULL if reply == "FULL" else ParamsType.DIFF


def update_of(sent: dict[str, torch.Tensor], params: dict[str, torch.Tensor], *, params_type: str, algorithm: str,
              lr: float, num_examples: int, client_id: int, local_steps: int = 1):
    """A gradleak :class:`~gradleak.fl.core.Update` from an NVFlare result's params, in float64: ``(sent − new) / lr``
    for FULL (new weights), ``−diff / lr`` for DIFF (the weight change ``new − sent``)."""
    from gradleak.fl.core import Update

    kind = "gradient" if algorithm == "fedsgd" else "pseudo_gradient"
    pt = str(getattr(params_type, "value", params_type)).upper()
    if pt.endswith("FULL"):
        missing = sorted(set(params) - set(sent))
        if missing:
            raise BadInput("reply", f"the result holds params the server did not send ({', '.join(missing[:3])}), so "
                           "no update can be formed from it.", "reply with the params the server sent.")
        tensors = {k: (sent[k].to(torch.float64) - v.to(torch.float64)) / lr for k, v in params.items()}
    elif pt.endswith("DIFF"):
        tensors = {k: -v.to(torch.float64) / lr for k, v in params.items()}
    else:
        raise BadInput("reply", f"params_type {pt} cannot be read as an update.", "reply with FULL or DIFF params.")
    from gradleak.fl.recorded import rounding_std

    upd = Update(tensors, int(num_examples), int(client_id), kind, int(local_steps))
    if pt.endswith("FULL"):
        upd.rounding_std = rounding_std(params, lr)
    return upd


# ------------------------------------------------------------------------------------------ the client

def client_step(c, base, sent: dict[str, torch.Tensor], *, round_index: int, lr: float, algorithm: str, epochs: int,
                batch_size: int | None, defenses: Sequence[Any] = (), seed: int = 0,
                local_update: Callable[..., Any] | None = None, reply: str = "FULL") -> tuple[Any, Any]:
    """One client's round, as the builtin engine runs it: ``c`` (a :class:`~gradleak.fl.core.Client`) trains on its
    own deep copy of ``base`` loaded with what it was ``sent`` (a client that reads no model, a canary, gets ``base``
    itself), the defenses transform its upload, and it replies in float64 (module docstring). Returns ``(FLModel,
    the update it computed)``; a withheld update (a client-side filter such as the RDLV) replies with metrics only."""
    from nvflare.app_common.abstract.fl_model import FLModel

    r = int(round_index)
    c = c.for_round(r)
    reads = getattr(c, "reads_model", True)
    local = model_as_sent(base, sent, reads=reads, field="params")
    if local_update is None:
        upd = c.local_update(local, algorithm=algorithm, epochs=epochs, lr=lr, batch_size=batch_size,
                             defenses=defenses, seed=seed + r, in_place=True)
    else:
        upd = local_update(c, local, seed=seed + r, algorithm=algorithm, lr=lr, round_index=r, epochs=epochs,
                           batch_size=batch_size)
        if upd is not None:
            upd = apply_update_defenses(upd, defenses, client_id=c.client_id, seed=seed + r, lr=lr)
    meta = {META_CLIENT: int(c.client_id), META_LR: float(lr), "current_round": r}
    if upd is None:
        return FLModel(metrics={META_WITHHELD: 1.0}, current_round=r, meta={**meta, META_WITHHELD: True}), None
    tensors = {k: v.detach().cpu() for k, v in upd.tensors.items()}
    step = {k: lr * v.to(torch.float64) for k, v in tensors.items()}
    if reply == "FULL":
        out = {k: sent[k].to(torch.float64) - s for k, s in step.items()}
    else:
        out = {k: -s for k, s in step.items()}
    meta.update({META_SAMPLES: int(upd.num_samples), NVFLARE_WEIGHT: int(upd.num_samples), META_STEPS: int(upd.local_steps), "gradleak.kind": upd.kind})
    return FLModel(params=to_numpy(out), params_type=reply_kind(reply), current_round=r, meta=meta), upd


class ClientSide:
    """Everything the clients of a federation need: the model every client downloaded before round 1 (``base``),
    the clients, and the public training configuration. ``train(index, fl_model)`` is one client's round."""

    def __init__(self, base, clients: Sequence[Any], *, algorithm: str, local_epochs: int = 1,
                 local_batch_size: int | None = None, defenses: Sequence[Any] = (), seed: int = 0,
                 local_update: Callable[..., Any] | None = None, client_settings: Sequence[dict] | None = None,
                 reply: str = "FULL"):
        self.base, self.clients = base, list(clients)
        self.algorithm, self.local_epochs, self.local_batch_size = algorithm, local_epochs, local_batch_size
        self.defenses, self.seed, self.local_update = list(defenses), seed, local_update
        self.client_settings, self.reply = client_settings, reply
        self.computed: dict[tuple[int, int], Any] = {}  # (round, client) -> the update the client computed
        self.seconds = 0.0

    def train(self, index: int, model) -> Any:
        """Client ``index``'s round on the FLModel ``model`` it was sent; its reply (an FLModel)."""
        if not 0 <= index < len(self.clients):
            raise BadInput("client", f"client index {index} is not one of this federation's {len(self.clients)} "
                           "client(s).", f"run the job with {len(self.clients)} client(s) (site-1 .. "
                           f"site-{len(self.clients)}).")
        sent = to_torch(model.params or {})
        r = int(model.current_round or 0)
        lr = float((model.meta or {}).get(META_LR, (model.meta or {}).get("lr", float("nan"))))
        if not lr == lr:
            raise BadInput("lr", "the task's FLModel carries no learning rate (meta 'gradleak.lr' or 'lr'), so the "
                           "client cannot take its step.", "send the round's lr in the FLModel's meta.")
        own = (self.client_settings[index] if self.client_settings is not None else None) or {}
        t0 = time.perf_counter()
        out, upd = client_step(self.clients[index], self.base, sent, round_index=r, lr=lr, algorithm=self.algorithm,
                               epochs=own.get("epochs", self.local_epochs),
                               batch_size=own.get("batch_size", self.local_batch_size), defenses=self.defenses,
                               seed=self.seed, local_update=self.local_update, reply=self.reply)
        self.seconds += time.perf_counter() - t0
        if upd is not None:
            self.computed[(r, index)] = {k: v.detach().cpu() for k, v in upd.tensors.items()}
        return out


# ------------------------------------------------------------------------------------------ the server

class ServerRounds:
    """The builtin engine's honest server, one round at a time (what :class:`GradleakController` runs): ``send(r)``
    applies the previous round's aggregate (``w −= lr · mean upload``), lets the server hook set the model and
    returns what travels; ``receive(r, results)`` forms each client's upload from its result, aggregates them as
    the builtin engine does (sample-weighted mean; server-side central DP noise; the simulated secure aggregation
    of :func:`gradleak.fl.core.secure_aggregate`) and records the round in :attr:`out`."""

    def __init__(self, model, *, algorithm: str, lr_of: Callable[[int], float], seed: int = 0,
                 server_hook: Callable[[int, Any], Any] | None = None, secure_aggregation: bool = False,
                 keep_round: Callable[[int], bool] | None = None, central: Sequence[Any] = ()):
        from gradleak.fl.engines.builtin import RoundsOutcome

        self.model, self.algorithm, self.lr_of, self.seed = model, algorithm, lr_of, seed
        self.server_hook, self.secure_aggregation, self.keep_round = server_hook, secure_aggregation, keep_round
        self.central = list(central)
        self.trainable = [nm for nm, p in model.named_parameters() if p.requires_grad]
        self.initial = {nm: p.detach().clone().cpu() for nm, p in model.named_parameters() if not p.requires_grad}
        self.out = RoundsOutcome(model=model, secure_sums=[] if secure_aggregation else None)
        self.sent: dict[int, dict[str, torch.Tensor]] = {}
        self.blocked: list[tuple[int, int]] = []  # (round, client) of results a server filter blocked

    def send(self, r: int) -> dict[str, torch.Tensor]:
        from gradleak.fl.engines.builtin import apply_aggregate

        if r > 0 and self.out.last_aggregate is not None:
            apply_aggregate(self.model, self.out.last_aggregate, self.lr_of(r - 1))
        if self.server_hook is not None:
            t0 = time.perf_counter()
            self.model = self.server_hook(r, self.model)
            self.out.server_hook_seconds += time.perf_counter() - t0
        self.out.model = self.model
        params = dict(self.model.named_parameters())
        if self.keep_round is None or self.keep_round(r):
            self.out.kept_rounds.append(r)
            self.out.round_states.append({nm: params[nm].detach().clone().cpu() for nm in self.trainable})
        send = {nm: params[nm].detach().clone().cpu() for nm in self.trainable}
        if self.server_hook is not None:  # frozen tensors the server rewrote travel too
            for nm, v in self.initial.items():
                if not torch.equal(params[nm].detach().cpu(), v):
                    send[nm] = params[nm].detach().clone().cpu()
        self.sent[r] = send
        for old in [k for k in self.sent if k < r - 1]:
            del self.sent[old]
        return send

    def task(self, r: int, rounds: int):
        """The FLModel the server sends in round ``r`` (the arrays of :meth:`send`, the round's lr)."""
        from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

        return FLModel(params=to_numpy(self.send(r)), params_type=ParamsType.FULL, start_round=0, current_round=r,
                       total_rounds=rounds, meta={META_LR: float(self.lr_of(r))})

    def receive(self, r: int, results: Sequence[tuple[int, Any]]) -> None:
        """Round ``r``'s results ``[(client index, FLModel)]`` (in any order; a blocked or failed result is absent)."""
        from gradleak.errors import TrainingDiverged
        from gradleak.fl.core import Update, aggregate, secure_aggregate

        sent = self.sent[r]
        lr = self.lr_of(r)
        ups = []
        for index, m in sorted(results, key=lambda t: t[0]):
            meta = m.meta or {}
            cid = int(meta.get(META_CLIENT, index))
            if meta.get(META_WITHHELD) or m.params is None:
                self.out.withheld.append((r, cid))
                continue
            upd = update_of(sent, to_torch(m.params), params_type=m.params_type, algorithm=self.algorithm,
                            lr=float(meta.get(META_LR, lr)), num_examples=int(meta.get(META_SAMPLES, 1)),
                            client_id=cid, local_steps=int(meta.get(META_STEPS, 1)))
            if not all(bool(torch.isfinite(t).all()) for t in upd.tensors.values()):
                raise TrainingDiverged(cid, r, lr)
            ups.append(upd)
        if not ups:  # every client withheld (or was blocked): the model stays as it is
            params = dict(self.model.named_parameters())
            self.out.last_aggregate = Update({n: torch.zeros_like(params[n].detach().cpu(), dtype=torch.float64)
                                              for n in self.trainable}, 0, -1, "pseudo_gradient", 0)
        else:
            self.out.last_aggregate = self._noise(aggregate(ups), len(ups), r)
        if self.keep_round is None or self.keep_round(r):
            self.out.rounds.append(ups)
            if self.secure_aggregation:
                self.out.secure_sums.append(self._noise(secure_aggregate(ups, seed=self.seed + 7 * r + 1), len(ups), r)
                                            if ups else self.out.last_aggregate)

    def _noise(self, agg, k: int, r: int):
        for d in self.central:  # central DP on the aggregate, seeded per round as the builtin engine seeds it
            agg = d.server_apply(agg, {"seed": self.seed + r}, k)
        return agg


# ------------------------------------------------------------------------------------------ in-process runner

def _filter_chain(filters: Sequence[Any], data, fl_ctx, direction: str):
    """Apply ``filters`` as NVFlare's ``apply_filters`` does (the direction in the context, each filter in turn)."""
    from nvflare.apis.fl_constant import FLContextKey

    fl_ctx.set_prop(FLContextKey.FILTER_DIRECTION, direction, private=True, sticky=False)
    for f in filters:
        data = f.process(data, fl_ctx)
    return data


def run_inprocess(server: ServerRounds, executor, num_clients: int, rounds: int, *,
                  task_data_filters: Sequence[Any] = (), task_result_filters: Sequence[Any] = (),
                  on_round: Callable[[int], Any] | None = None) -> float:
    """``rounds`` rounds of ``server`` against ``executor`` (an NVFlare ``Executor``: :class:`GradleakExecutor`) for
    ``num_clients`` clients ``site-1`` .. ``site-n``, in this process, one client after another: each round the
    server's FLModel becomes a Shareable (:meth:`FLModelUtils.to_shareable`), passes the server's task-data filters,
    is executed by the client, and its result passes the server's task-result filters (a filter's exception --
    ``ContentBlockedException`` included -- makes it ``TASK_RESULT_FILTER_ERROR``, as NVFlare's ``ServerRunner``
    does, and the result is dropped) before the server reads it back (:meth:`FLModelUtils.from_shareable`).
    Returns seconds."""
    require_nvflare()
    from nvflare.apis.filter import FilterChainType, FilterContextKey
    from nvflare.apis.fl_constant import FilterKey, ReservedKey, ReturnCode
    from nvflare.apis.fl_context import FLContext
    from nvflare.apis.shareable import make_reply
    from nvflare.apis.signal import Signal
    from nvflare.app_common.utils.fl_model_utils import FLModelUtils

    for f in task_data_filters:
        f.set_prop(FilterContextKey.CHAIN_TYPE, FilterChainType.TASK_DATA_CHAIN)
        f.set_prop(FilterContextKey.SOURCE, "server")
    for f in task_result_filters:
        f.set_prop(FilterContextKey.CHAIN_TYPE, FilterChainType.TASK_RESULT_CHAIN)
        f.set_prop(FilterContextKey.SOURCE, "server")
    t0 = time.perf_counter()
    abort = Signal()
    for r in range(rounds):
        model = server.task(r, rounds)
        results = []
        for i in range(num_clients):
            site = site_name(i)
            server_ctx, client_ctx = FLContext(), FLContext()
            server_ctx.set_prop(ReservedKey.IDENTITY_NAME, "server", private=False, sticky=False)
            client_ctx.set_prop(ReservedKey.IDENTITY_NAME, site, private=False, sticky=False)
            peer = FLContext()
            peer.set_prop(ReservedKey.IDENTITY_NAME, site, private=False, sticky=False)
            server_ctx.set_peer_context(peer)
            task = FLModelUtils.to_shareable(model)
            task = _filter_chain(task_data_filters, task, server_ctx, FilterKey.OUT)
            result = executor.execute(TASK, task, client_ctx, abort)
            result.set_peer_props({ReservedKey.IDENTITY_NAME: site})
            try:
                result = _filter_chain(task_result_filters, result, server_ctx, FilterKey.IN)
            except Exception:  # noqa: BLE001 -- NVFlare's ServerRunner turns any filter error into this reply
                result = make_reply(ReturnCode.TASK_RESULT_FILTER_ERROR)
            if result.get_return_code(ReturnCode.OK) != ReturnCode.OK:
                server.blocked.append((r, i))
                continue
            results.append((i, FLModelUtils.from_shareable(result)))
        server.receive(r, results)
        if on_round is not None:
            on_round(r)
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------------------ state files

def save_state(obj: Any, path) -> None:
    """``obj`` cloudpickled to ``path`` (the simulator's processes load the federation from it), atomically and
    owner-only (:func:`gradleak.atomic.atomic_open`): the federation holds the clients' private data."""
    import cloudpickle

    from gradleak.atomic import atomic_open

    with atomic_open(path, binary=True) as f:
        cloudpickle.dump(obj, f)


def resolve(path: str) -> Callable[..., Any]:
    """The function a job names as ``"package.module:function"`` (a component's builder: the job's JSON holds names)."""
    import importlib

    mod, _, fn = str(path).partition(":")
    if not mod or not fn:
        raise BadInput("builder", f"{path!r} is not 'package.module:function'.",
                       "name the builder as e.g. 'gradleak.integrations.nvflare:client_side_of_config'.")
    return getattr(importlib.import_module(mod), fn)


def load_state(path) -> Any:
    import pickle

    with open(path, "rb") as f:
        return pickle.load(f)  # noqa: S301 -- a file this run wrote for its own child processes


# ------------------------------------------------------------------------------------------ NVFlare components

def _make_executor_class():
    require_nvflare()
    from nvflare.apis.executor import Executor
    from nvflare.apis.fl_constant import ReturnCode
    from nvflare.apis.shareable import make_reply
    from nvflare.app_common.utils.fl_model_utils import FLModelUtils

    class GradleakExecutor(Executor):
        """An NVFlare client that trains the pipeline's :class:`~gradleak.fl.core.Client` on its copy of what it was
        sent and replies FULL or DIFF in float64 (:func:`client_step`). ``state``: a file :func:`save_state` wrote
        (the engine's :class:`ClientSide`); or ``config``: a gradleak config (the model, the client's partition and
        the defenses rebuilt from it, as the pipeline builds them: the example job). ``reply`` FULL | DIFF."""

        def __init__(self, state: str = "", config: str = "", builder: str = "", reply: str = "FULL",
                     task_name: str = TASK):
            super().__init__()
            self.state, self.config, self.builder, self.reply, self.task_name = state, config, builder, reply, task_name
            self.side: ClientSide | None = None

        def client_side(self) -> ClientSide:
            if self.side is None:
                if self.state:
                    self.side = load_state(self.state)
                elif self.config and self.builder:
                    self.side = resolve(self.builder)(self.config, reply=self.reply)
                else:
                    raise BadInput("GradleakExecutor", "neither a state file nor a gradleak config (with its builder) "
                                   "was given.", "pass state= (the engine) or config= and builder= (a job of your own: "
                                   "gradleak.integrations.nvflare.executor_for).")
            return self.side

        def execute(self, task_name, shareable, fl_ctx, abort_signal):
            if task_name != self.task_name:
                return make_reply(ReturnCode.TASK_UNKNOWN)
            model = FLModelUtils.from_shareable(shareable)
            index = site_index(fl_ctx.get_identity_name())
            return FLModelUtils.to_shareable(self.client_side().train(index, model))

    GradleakExecutor.__module__ = __name__
    GradleakExecutor.__qualname__ = "GradleakExecutor"
    return GradleakExecutor


def _make_controller_class():
    require_nvflare()
    from nvflare.app_common.workflows.model_controller import ModelController

    class GradleakController(ModelController):
        """NVFlare's FedAvg-like workflow with gradleak's honest server (:class:`ServerRounds`): each round it sends
        the model to every client (``send_model_and_wait``), forms each client's upload from its result and steps
        ``w −= lr · mean upload``. ``state``: a file :func:`save_state` wrote (the engine's server side); or
        ``config``: a gradleak config (the example job). ``record``: where the outcome is written at the end (the
        engine reads it back). A result a server filter blocked is dropped (NVFlare's ``ignore_result_error``)."""

        def __init__(self, state: str = "", config: str = "", builder: str = "", record: str = "",
                     num_rounds: int = 0, task_name: str = TASK):
            super().__init__(persistor_id="", ignore_result_error=True)
            self.state, self.config, self.builder, self.record = state, config, builder, record
            self.num_rounds, self.task_name = num_rounds, task_name

        def run(self) -> None:
            if self.state:
                spec = load_state(self.state)
                server = ServerRounds(spec["model"], **spec["server"])
                rounds = int(spec["rounds"])
            elif self.config and self.builder:
                server, rounds = resolve(self.builder)(self.config)
            else:
                raise BadInput("GradleakController", "neither a state file nor a gradleak config (with its builder) "
                               "was given.", "pass state= (the engine) or config= and builder= (a job of your own: "
                               "gradleak.integrations.nvflare.controller_for).")
            rounds = int(self.num_rounds or rounds)
            for r in range(rounds):
                self.info(f"gradleak round {r + 1} of {rounds}")
                results = self.send_model_and_wait(task_name=self.task_name, data=server.task(r, rounds))
                got = []
                for m in results:
                    meta = m.meta or {}
                    index = int(meta[META_CLIENT]) if META_CLIENT in meta else site_index(meta.get("client_name", ""))
                    got.append((index, m))
                seen = {i for i, _ in got}
                server.blocked += [(r, site_index(c)) for c in self.sample_clients() if site_index(c) not in seen]
                server.receive(r, got)
            if self.record:
                out = server.out
                last = {nm: p.detach().clone().cpu() for nm, p in server.model.named_parameters()}
                out.model = None
                save_state({"outcome": out, "last_state": last, "blocked": server.blocked}, self.record)

    GradleakController.__module__ = __name__
    GradleakController.__qualname__ = "GradleakController"
    return GradleakController


_LAZY = {"GradleakExecutor": _make_executor_class, "GradleakController": _make_controller_class}


def __getattr__(name: str):  # the NVFlare classes, built on first access (NVFlare is optional)
    if name in _LAZY:
        cls = _LAZY[name]()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------------------------------ the simulator

#: gradleak's component classes a job names (NVFlare 2.9 builds only classes on the site's ``class_allow_list``)
COMPONENTS = (f"{__name__}.GradleakController", f"{__name__}.GradleakExecutor")


def allow_components(workspace, paths: Sequence[str]) -> None:
    """Put ``paths`` (component class paths) on the simulator workspace's ``class_allow_list`` (``local/resources.json``,
    which the simulator copies to every site), beside NVFlare's default list: NVFlare 2.9 refuses to build a
    component class that is not listed (unless the job ships its code in ``custom/``, which would copy gradleak's
    sources into the job). A list already in the file is extended, not replaced."""
    import json
    from pathlib import Path

    from nvflare.app_common.default_component_policy import DEFAULT_CLASS_ALLOW_LIST
    from nvflare.app_common.widgets.component_path_authorizer import CLASS_ALLOW_LIST

    from gradleak.atomic import write_text_atomic

    local = Path(workspace) / "local"
    local.mkdir(parents=True, exist_ok=True)
    target = local / "resources.json"
    resources = json.loads(target.read_text()) if target.exists() else {"format_version": 2}
    listed = list(resources.get(CLASS_ALLOW_LIST, DEFAULT_CLASS_ALLOW_LIST))
    resources[CLASS_ALLOW_LIST] = listed + [p for p in paths if p not in listed]
    write_text_atomic(target, json.dumps(resources, indent=4), mode=0o644)


def run_simulator(job, workspace, num_clients: int, *, threads: int | None = None, log_config: str | None = None,
                  allow: Sequence[str] = COMPONENTS) -> float:
    """Run the ``FedJob`` ``job`` through NVFlare's simulator (``SimulatorRunner``: the server in a child process,
    each client in its own ``simulator_worker`` subprocess; ``threads`` clients at once, default all) in
    ``workspace``, with gradleak's component classes ``allow`` on the workspace's allow list
    (:func:`allow_components`; the job must name gradleak as an app package: ``job.set_app_packages(["gradleak"])``,
    so the sites import the installed package); returns seconds. Raises when the simulator reports a failed run."""
    require_nvflare()
    import os

    allow_components(workspace, allow)
    t0 = time.perf_counter()
    cwd = os.getcwd()  # the simulator's server thread changes the working directory
    try:
        rc = job.simulator_run(str(workspace), n_clients=int(num_clients), threads=int(threads or num_clients),
                               log_config=log_config)
    finally:
        os.chdir(cwd)
    if rc not in (None, 0):
        raise RuntimeError(f"the NVFlare simulator run failed (return code {rc}); see its log under {workspace}")
    return time.perf_counter() - t0
