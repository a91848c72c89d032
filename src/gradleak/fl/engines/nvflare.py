"""The pipeline's round engine through NVFlare (``fl.engine: nvflare``).

:func:`run_rounds_nvflare` returns the same :class:`~gradleak.fl.engines.builtin.RoundsOutcome` as the builtin
engine (:func:`gradleak.fl.engines.builtin.run_rounds`), so every attack, the audit and the reports run on NVFlare
unchanged. It stands on the bridge (:mod:`gradleak.fl.engines.nvflare_bridge`: the client step, the server's rounds,
the NVFlare executor and controller, the in-process and simulator runners); ``nvflare`` (the optional ``nvflare``
extra, 2.9) is imported inside functions only.

Two runtimes (``fl.nvflare.runtime``):

* ``inprocess`` (default): NVFlare's messages (``FLModel`` -> ``Shareable``/DXO -> ``FLModel``), its ``Executor``
  (:class:`~gradleak.fl.engines.nvflare_bridge.GradleakExecutor`) and the server's task-data / task-result filter
  chains, driven round by round in this process (:func:`~gradleak.fl.engines.nvflare_bridge.run_inprocess`). NVFlare
  2.9 has no in-process federation: its simulator always runs the server in a child process and each client in a
  ``simulator_worker`` subprocess, so this is the light way (seconds, no subprocess).
* ``simulator``: a real ``FedJob`` (:class:`~gradleak.fl.engines.nvflare_bridge.GradleakController` on the server,
  the executor on every client) through NVFlare's ``SimulatorRunner``. The model, the clients and the defenses reach
  the subprocesses cloudpickled in the job's workspace; the server's outcome comes back the same way. A server hook
  cannot cross into the simulator's server process, so attacks that rewrite the weights the server sends are refused
  there (use ``inprocess``).
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import torch
from pydantic import Field

from gradleak.errors import BadInput
from gradleak.fl.engines import ENGINES, Engine
from gradleak.fl.engines.nvflare_bridge import (ClientSide, ServerRounds, nvflare_problem, require_nvflare,
                                                run_inprocess)
from gradleak.validation import Checked


class NVFlareConfig(Checked):
    """``fl.nvflare``: how the NVFlare engine runs (``fl.engine: nvflare``, :mod:`gradleak.fl.engines.nvflare`)."""

    runtime: Literal["inprocess", "simulator"] = Field(
        "inprocess", description="inprocess: NVFlare's executor, messages and server filter chains driven in this "
        "process; simulator: a FedJob through NVFlare's SimulatorRunner (server and clients in subprocesses)")
    reply: Literal["FULL", "DIFF"] = Field("FULL", description="the clients' FLModel params_type: FULL (their new "
                                           "weights, float64) or DIFF (the weight change new - sent, float64)")
    threads: int = Field(0, ge=0, le=1024, description="simulator: clients run at once (0: all)")
    workspace: str = Field("", description="simulator: the job's workspace (empty: a temporary folder, removed after)")


def _refuse_unsupported(model, defenses: Sequence[Any]) -> None:
    from gradleak.fl.core import batchnorm_buffer_names

    if batchnorm_buffer_names(model):
        raise BadInput("fl.engine", "the NVFlare engine does not carry BatchNorm running statistics in its messages.",
                       "use fl.engine=builtin for BatchNorm models (the leakage study's ResNet-18).")


def run_rounds_nvflare(model, clients: Sequence[Any], *, rounds: int, algorithm: str, lr: float, local_epochs: int = 1,
                       local_batch_size: int | None = None, defenses: Sequence[Any] = (), seed: int = 0,
                       server_hook: Callable[[int, Any], Any] | None = None, secure_aggregation: bool = False,
                       track: Callable[..., Any] | None = None, keep_round: Callable[[int], bool] | None = None,
                       local_update: Callable[..., Any] | None = None, client_settings: Sequence[dict] | None = None,
                       lr_at: Callable[[int], float] | None = None, nvflare: NVFlareConfig | None = None,
                       task_data_filters: Sequence[Any] = (), task_result_filters: Sequence[Any] = ()):
    """:func:`gradleak.fl.engines.builtin.run_rounds` through NVFlare (``fl.engine: nvflare``; module docstring).

    The server (:class:`~gradleak.fl.engines.nvflare_bridge.ServerRounds`) sends the trainable params as an FLModel
    (FULL, with the round's lr); each client trains the pipeline's :class:`~gradleak.fl.core.Client` on its own copy
    with the update defenses applied as the builtin engine applies them, and replies in float64 (FULL: new weights,
    DIFF: the weight change), from which the server forms ``(sent − new) / lr`` (``−diff / lr``): the upload to
    ~1e-15. Aggregation, central DP noise and the simulated secure aggregation are the builtin engine's.
    ``task_data_filters`` / ``task_result_filters``: NVFlare filters on the server's chains (in-process runtime;
    e.g. :class:`gradleak.integrations.nvflare.NVFlareAudit`). ``nvflare``: the ``fl.nvflare`` section."""
    require_nvflare()
    cfg = nvflare or NVFlareConfig()
    _refuse_unsupported(model, defenses)
    lr_of = lr_at or (lambda _r: lr)
    n = len(clients)
    update_defenses = [d for d in defenses if not getattr(d, "server_side", False)]
    central = [d for d in defenses if getattr(d, "server_side", False)]
    base = copy.deepcopy(model)  # what every client downloaded before round 1 (frozen weights included)
    side = ClientSide(base, clients, algorithm=algorithm, local_epochs=local_epochs, local_batch_size=local_batch_size,
                      defenses=update_defenses, seed=seed, local_update=local_update, client_settings=client_settings,
                      reply=cfg.reply)
    server_kw = dict(algorithm=algorithm, lr_of=lr_of, seed=seed, secure_aggregation=secure_aggregation,
                     keep_round=keep_round, central=central)
    bar = None
    if track is not None:
        bar_it = iter(track(range(rounds), description=f"NVFlare rounds ({n} client(s), {algorithm}, {cfg.runtime})",
                            total=rounds))
        bar = lambda _r: next(bar_it, None)  # noqa: E731
    if cfg.runtime == "simulator":
        if task_data_filters or task_result_filters:
            raise BadInput("fl.nvflare.runtime", "filter objects cannot be handed to the simulator's server process.",
                           "add the filters to a FedJob of your own (examples/nvflare), or use runtime inprocess.")
        if getattr(getattr(server_hook, "__self__", None), "rewrites_weights", False):
            raise BadInput("fl.nvflare.runtime", "the attack rewrites the weights the server sends, a hook that cannot "
                           "cross into the NVFlare simulator's server process.",
                           "set fl.nvflare.runtime=inprocess (NVFlare's executor and messages in this process).")
        out = _run_simulator(model, side, server_kw, rounds, n, cfg)
    else:
        from gradleak.fl.engines.nvflare_bridge import GradleakExecutor

        server = ServerRounds(model, server_hook=server_hook, **server_kw)
        executor = GradleakExecutor(reply=cfg.reply)
        executor.side = side
        run_inprocess(server, executor, n, rounds, task_data_filters=task_data_filters,
                      task_result_filters=task_result_filters, on_round=bar)
        out = server.out
        out.nvflare_blocked = list(server.blocked)
    if bar is not None:
        for _ in bar_it:
            pass
    out.client_seconds = side.seconds if cfg.runtime == "inprocess" else out.client_seconds
    out.nvflare_computed = side.computed  # what the clients computed (in-process; tests compare the record to it)
    return out


def _run_simulator(model, side: ClientSide, server_kw: dict, rounds: int, n: int, cfg: NVFlareConfig):
    """The rounds as a FedJob through NVFlare's SimulatorRunner; the outcome read back from the server's record."""
    from gradleak.fl.engines.nvflare_bridge import (GradleakController, GradleakExecutor, load_state, run_simulator,
                                                    save_state)
    from nvflare.job_config.api import FedJob

    tmp = None
    if cfg.workspace:
        root = Path(cfg.workspace)
        root.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="gradleak-nvflare-")
        root = Path(tmp.name)
    try:
        root = root.resolve()
        client_file, server_file, record = root / "clients.pkl", root / "server.pkl", root / "record.pkl"
        save_state(side, client_file)
        save_state({"model": model, "server": server_kw, "rounds": rounds}, server_file)
        job = FedJob(name="gradleak")
        job.set_app_packages(["gradleak"])  # an installed package: the processes import it (no copy into custom/)
        job.to_server(GradleakController(state=str(server_file), record=str(record), num_rounds=rounds))
        job.to_clients(GradleakExecutor(state=str(client_file), reply=cfg.reply), tasks=["train"])
        run_simulator(job, root / "workspace", n, threads=cfg.threads or n)
        if not record.exists():
            raise RuntimeError(f"the NVFlare simulator ran but its server recorded no outcome (log under {root})")
        rec = load_state(record)
    finally:
        if tmp is not None:
            tmp.cleanup()
    out = rec["outcome"]
    with torch.no_grad():  # the model the server sent last, in this process's model object
        params = dict(model.named_parameters())
        for nm, v in rec["last_state"].items():
            params[nm].copy_(v.to(device=params[nm].device, dtype=params[nm].dtype))
    out.model = model
    out.nvflare_blocked = rec["blocked"]
    return out


@ENGINES.register("nvflare", "the same rounds through NVFlare (executor, FLModel messages, server filters; the "
                  "nvflare extra)")
class NVFlareEngine(Engine):
    """``fl.engine: nvflare`` (:func:`run_rounds_nvflare`), configured by ``fl.nvflare`` (:class:`NVFlareConfig`)."""

    name = "nvflare"
    section = NVFlareConfig
    extra = "nvflare"

    def rounds(self, fl: Any) -> Callable[..., Any]:
        from functools import partial

        return partial(run_rounds_nvflare, nvflare=fl.nvflare)

    def check(self, cfg: Any) -> None:
        problem = nvflare_problem()  # from the package metadata: validation does not import NVFlare
        if problem is not None:
            raise problem
        nv = cfg.fl.nvflare
        if nv.runtime == "simulator" and cfg.attack_cls.rewrites_weights:
            raise BadInput("fl.nvflare.runtime", f"the attack {cfg.attack.name} rewrites the weights the server sends, "
                           "a hook that cannot cross into the NVFlare simulator's server process.",
                           "set fl.nvflare.runtime=inprocess (NVFlare's executor and messages in this process).")

    def describe(self, fl: Any) -> str:
        nv = fl.nvflare
        how = ("NVFlare 2.9 in process (FLModel/DXO messages, Executor, the server's filter chains)"
               if nv.runtime == "inprocess" else "NVFlare 2.9 simulator (FedJob: ModelController + Executor, "
               "server and clients in subprocesses)")
        sees = ("each client's new weights (FULL, float64), from which it forms (sent - new) / lr" if nv.reply == "FULL"
                else "each client's weight change (DIFF, float64), from which it forms -diff / lr")
        return f"engine: {how}; clients reply {nv.reply} -- the server sees {sees}"
