"""The pipeline's round engine through Flower (``fl.engine: flower``).

:func:`run_rounds_flower` returns the same :class:`~gradleak.fl.engines.builtin.RoundsOutcome` as the builtin
engine (:func:`gradleak.fl.engines.builtin.run_rounds`), so every attack, the audit and the reports run on a real
Flower federation unchanged, including under Flower's own DP wrappers (``fl.flower.dp``). It stands on the bridge
(:mod:`gradleak.fl.engines.flower_bridge`: the recording strategy wrapper, the client mods, the in-process runner);
``flwr`` (the optional ``fl`` extra) is imported inside functions only.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Callable, Literal, Sequence

import torch
from pydantic import Field

from gradleak.errors import BadInput
from gradleak.fl.engines import ENGINES, Engine
from gradleak.fl.engines.builtin import RoundsOutcome
from gradleak.fl.core import model_as_sent
from gradleak.fl.engines.flower_bridge import (GradleakStrategy, RecordedRound, legacy_mod, require_flower,
                                               run_inprocess, run_simulation_engine, to_arrays, to_tensors,
                                               update_defense_mod)
from gradleak.validation import Checked


class FlowerConfig(Checked):
    """``fl.flower``: how the Flower engine runs (``fl.engine: flower``, :mod:`gradleak.fl.engines.flower`)."""

    runtime: Literal["inprocess", "simulation"] = Field("inprocess", description="inprocess: every node in this "
                                                        "process, no Ray; simulation: Flower's simulation engine (Ray)")
    reply: Literal["weights", "update"] = Field("weights", description="clients reply with their new weights "
                                                "(Flower's convention) or with the update itself")
    dp: Literal["none", "server-fixed", "client-fixed", "local"] = Field(
        "none", description="Flower's own DP: DifferentialPrivacyServerSideFixedClipping (server-fixed), "
        "DifferentialPrivacyClientSideFixedClipping + fixedclipping_mod (client-fixed), LocalDpMod (local)")
    noise_multiplier: float = Field(1.0, ge=0, le=1e6, description="central DP: noise std = multiplier × clipping norm / "
                                    "clients (Flower's convention)")
    clipping_norm: float = Field(1.0, gt=0, le=1e9, description="L2 bound of each client's weight change (Δw, not Δw/lr)")
    local_sensitivity: float = Field(1.0, gt=0, le=1e9, description="LocalDpMod sensitivity")
    local_epsilon: float = Field(1.0, gt=0, le=1e6, description="LocalDpMod epsilon")
    local_delta: float = Field(1e-5, gt=0, lt=1, description="LocalDpMod delta")


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


def _check_flower_inputs(model, defenses: Sequence[Any], flower) -> None:
    """What the Flower engine cannot run, as a clear error: BatchNorm models, gradleak's own central DP, Flower's DP
    with update replies."""
    from gradleak.fl.core import batchnorm_buffer_names

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


class _FlowerRun:
    """One federation of :func:`run_rounds_flower`: what its server side (:meth:`serve`, :meth:`send`,
    :meth:`record`) and its client side (:meth:`train`) share -- the server's model, the outcome being recorded, the
    clocks and what the clients computed."""

    def __init__(self, model, clients: Sequence[Any], *, rounds: int, algorithm: str, lr_of: Callable[[int], float],
                 local_epochs: int, local_batch_size: int | None, seed: int,
                 server_hook: Callable[[int, Any], Any] | None, secure_aggregation: bool,
                 keep_round: Callable[[int], bool] | None, local_update: Callable[..., Any] | None,
                 client_settings: Sequence[dict] | None, flower):
        self.model, self.clients, self.rounds, self.algorithm, self.lr_of = model, clients, rounds, algorithm, lr_of
        self.local_epochs, self.local_batch_size, self.seed = local_epochs, local_batch_size, seed
        self.server_hook, self.secure_aggregation, self.keep_round = server_hook, secure_aggregation, keep_round
        self.local_update, self.client_settings, self.flower = local_update, client_settings, flower
        self.n = len(clients)
        self.trainable = [nm for nm, p in model.named_parameters() if p.requires_grad]
        self.base = copy.deepcopy(model)  # what every client downloaded before round 1 (frozen weights included)
        self.initial = {nm: p.detach().clone() for nm, p in self.base.named_parameters() if not p.requires_grad}
        self.out = RoundsOutcome(model=model, secure_sums=[] if secure_aggregation else None)
        self.clock = {"client": 0.0, "hook": 0.0}
        self.strategy = None
        self.computed: dict = {}
        self.bar: Callable[[int], Any] | None = None

    # -- server side: load what FedAvg aggregated into the server's model, let the attack set it, send it
    def send(self, server_round: int, arrays: dict) -> dict:
        """The strategy's server hook: what the server sends in round ``server_round``."""
        r = server_round - 1
        with torch.no_grad():
            for nm, p in self.model.named_parameters():
                if nm in arrays:
                    p.copy_(arrays[nm].to(device=p.device, dtype=p.dtype))
        if self.server_hook is not None:
            t0 = time.perf_counter()
            self.model = self.server_hook(r, self.model)
            self.clock["hook"] += time.perf_counter() - t0
        self.out.model = self.model
        params = dict(self.model.named_parameters())
        send = {nm: params[nm].detach().clone().cpu() for nm in self.trainable}
        if self.server_hook is not None:  # frozen tensors the server rewrote travel too
            for nm, v in self.initial.items():
                if not torch.equal(params[nm].detach().cpu(), v.cpu()):
                    send[nm] = params[nm].detach().clone().cpu()
        return send

    def record(self, rec: RecordedRound):
        """The strategy's ``on_round``: a finished round into the outcome (the rounds the attacker keeps)."""
        r = rec.server_round - 1
        keep = self.keep_round is None or self.keep_round(r)
        self.out.last_aggregate = rec.aggregate
        if keep:
            self.out.kept_rounds.append(r)
            self.out.round_states.append({k: v for k, v in rec.sent.items() if k in self.trainable})
            self.out.rounds.append([] if rec.aggregated else list(rec.updates))
            if self.secure_aggregation:
                self.out.secure_sums.append(rec.aggregate)
        if self.bar is not None:
            self.bar(r)
        return None

    def serve(self, grid, context) -> None:
        """The ``ServerApp``'s main: ``GradleakStrategy(FedAvg)`` (in Flower's central DP when asked) through
        Flower's own round loop."""
        from flwr.app import ConfigRecord
        from flwr.serverapp.strategy import FedAvg

        n = self.n
        inner = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=n, min_train_nodes=n,
                       min_evaluate_nodes=0)
        strategy = _dp_strategy(self.flower, inner, n)
        s = GradleakStrategy(strategy, lr=lambda sr: self.lr_of(sr - 1), algorithm=self.algorithm,
                             reply=self.flower.reply, secure_aggregation=self.secure_aggregation,
                             on_round=self.record, server_hook=self.send, keep=1, send_lr=True)
        self.strategy = s
        first = {nm: p.detach().clone().cpu() for nm, p in self.model.named_parameters() if p.requires_grad}
        s.start(grid=grid, initial_arrays=to_arrays(first), num_rounds=self.rounds, train_config=ConfigRecord({}),
                timeout=None)

    # -- client side: the pipeline's Client on its own copy of what it was sent
    def train(self, msg, ctx):
        """The ``ClientApp``'s train: the client of partition ``partition-id`` trains on its copy of what it was
        sent and replies with its new weights (float64) or its update (``fl.flower.reply``)."""
        from flwr.app import Message, MetricRecord, RecordDict

        pid = int(ctx.node_config["partition-id"])
        conf = msg.content["config"]
        r = int(conf["server-round"]) - 1
        c = self.clients[pid].for_round(r)  # a client holding a dataset trains on this round's batch of it
        lr_r = float(conf["lr"])
        sent = to_tensors(msg.content["arrays"])
        reads = getattr(c, "reads_model", True)  # a canary client reads no weights (only the trainable names)
        local = model_as_sent(self.base, sent, reads=reads, field="arrays",
                              fix="the ClientApp and the ServerApp must build the same model.")
        t0 = time.perf_counter()
        upd = self._local_step(pid, c, local, r, lr_r)
        self.clock["client"] += time.perf_counter() - t0
        tensors = {k: v.detach().cpu() for k, v in upd.tensors.items()}
        if self.flower.reply == "weights":
            tensors = {k: sent[k].to(torch.float64) - lr_r * v.to(torch.float64) for k, v in tensors.items()}
        self.computed[(r, pid)] = tensors
        metrics = MetricRecord({"num-examples": int(upd.num_samples), "partition-id": pid,
                                "local-steps": int(upd.local_steps)})
        return Message(RecordDict({"arrays": to_arrays(tensors), "metrics": metrics}), reply_to=msg)

    def _local_step(self, pid: int, c, local, r: int, lr_r: float):
        """Client ``pid``'s own training (gradleak's update defenses run in the client mod), or the training-time
        defense's ``local_update``; a withheld update is an error here."""
        own = (self.client_settings[pid] if self.client_settings is not None else None) or {}
        epochs, batch_size = own.get("epochs", self.local_epochs), own.get("batch_size", self.local_batch_size)
        if self.local_update is None:
            return c.local_update(local, algorithm=self.algorithm, epochs=epochs, lr=lr_r, batch_size=batch_size,
                                  defenses=(), seed=self.seed + r, in_place=True)
        upd = self.local_update(c, local, seed=self.seed + r, algorithm=self.algorithm, lr=lr_r, round_index=r,
                                epochs=epochs, batch_size=batch_size)
        if upd is None:
            raise BadInput("defense", "a client withheld its update (the RDLV filter); the Flower engine has no "
                           "withheld replies.", "use fl.engine=builtin with this defense.")
        return upd


def run_rounds_flower(model, clients: Sequence[Any], *, rounds: int, algorithm: str, lr: float, local_epochs: int = 1,
                      local_batch_size: int | None = None, defenses: Sequence[Any] = (), seed: int = 0,
                      server_hook: Callable[[int, Any], Any] | None = None, secure_aggregation: bool = False,
                      track: Callable[..., Any] | None = None, keep_round: Callable[[int], bool] | None = None,
                      local_update: Callable[..., Any] | None = None, client_settings: Sequence[dict] | None = None,
                      lr_at: Callable[[int], float] | None = None, flower, verbose: bool = False):
    """:func:`gradleak.fl.engines.builtin.run_rounds` through a real Flower federation (``fl.engine: flower``).

    The server is a ``ServerApp`` running ``GradleakStrategy(FedAvg)`` (wrapped in Flower's central-DP strategy when
    ``fl.flower.dp`` asks for it) through Flower's own round loop (``Strategy.start``); each client is a node whose
    ``ClientApp`` trains the pipeline's :class:`~gradleak.fl.core.Client` on its own copy of the model it was sent
    and replies with its new weights in float64 (``(sent − new) / lr`` is then its upload to 1e-15; a float32 reply
    would round the small step against the weights) or with the update (``fl.flower.reply: update``). gradleak's
    update defenses run in :func:`~gradleak.fl.engines.flower_bridge.update_defense_mod`, Flower's client-side DP in its own mods (:func:`~gradleak.fl.engines.flower_bridge.legacy_mod`). What
    the attacks get is what the strategy wrapper recorded, round by round. The server sends the trainable arrays,
    plus every frozen tensor that differs from the model the clients downloaded (a malicious server's poisoning).
    ``flower`` is the ``fl.flower`` section (:class:`FlowerConfig`: runtime, reply, dp)."""
    require_flower()
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp

    _check_flower_inputs(model, defenses, flower)
    _quiet_flower(verbose)
    run = _FlowerRun(model, clients, rounds=rounds, algorithm=algorithm, lr_of=lr_at or (lambda _r: lr),
                     local_epochs=local_epochs, local_batch_size=local_batch_size, seed=seed, server_hook=server_hook,
                     secure_aggregation=secure_aggregation, keep_round=keep_round, local_update=local_update,
                     client_settings=client_settings, flower=flower)
    sapp = ServerApp()

    @sapp.main()
    def _main(grid, context):
        run.serve(grid, context)

    capp_mods = _dp_mods(flower)  # outermost: Flower's DP acts last on the reply, as its docs ask
    if defenses:
        capp_mods.append(update_defense_mod(list(defenses), seed=seed, algorithm=algorithm, names=None))
    capp = ClientApp(mods=capp_mods)

    @capp.train()
    def _train(msg, ctx):
        return run.train(msg, ctx)

    if track is not None:
        bar_it = iter(track(range(rounds), description=f"Flower rounds ({run.n} client(s), {algorithm}, "
                                                       f"{flower.runtime})", total=rounds))
        run.bar = lambda _r: next(bar_it, None)
    if flower.runtime == "simulation":
        run_simulation_engine(sapp, capp, run.n)
    else:
        run_inprocess(sapp, capp, run.n)
    if run.bar is not None:
        for _ in bar_it:
            pass
    out = run.out
    if run.strategy is None or out.last_aggregate is None:
        raise RuntimeError("the Flower run recorded no round (see Flower's log above)")
    out.client_seconds, out.server_hook_seconds = run.clock["client"], run.clock["hook"]
    out.flower_computed = run.computed  # what the clients computed (tests compare the record to it)
    return out


_SEES = {"none": "each client's update as sent",
         "server-fixed": "each client's raw update (Flower clips and noises on the server, after it has them)",
         "client-fixed": "each client's clipped update, without noise (the noise goes on the aggregate)",
         "local": "each client's clipped and noised update (LocalDpMod)"}


@ENGINES.register("flower", "the same rounds through a Flower ServerApp/ClientApp (the fl extra)")
class FlowerEngine(Engine):
    """``fl.engine: flower`` (:func:`run_rounds_flower`), configured by ``fl.flower`` (:class:`FlowerConfig`)."""

    name = "flower"
    section = FlowerConfig
    extra = "fl"

    def rounds(self, fl: Any) -> Callable[..., Any]:
        from functools import partial

        return partial(run_rounds_flower, flower=fl.flower)

    def describe(self, fl: Any) -> str:
        f = fl.flower
        return (f"engine: Flower ({f.runtime}; clients reply with their "
                f"{'new weights' if f.reply == 'weights' else 'update'}"
                + (f"; Flower DP: {f.dp}, clipping norm {f.clipping_norm:g} on the weight change"
                   + (f", noise multiplier {f.noise_multiplier:g}" if f.dp != "local" else
                      f", epsilon {f.local_epsilon:g}, delta {f.local_delta:g}") if f.dp != "none" else "")
                + f") -- the server sees {_SEES[f.dp]}")

    def framework_dp(self, fl: Any) -> tuple[str, dict] | None:
        if fl.flower.dp == "none":
            return None
        return f"Flower DP ({fl.flower.dp})", fl.flower.model_dump()

    def dp_claims(self, cfg: Any, delta: float) -> list[dict]:
        """Flower's central wrappers (RDP of the Gaussian mechanism; Flower keeps no accountant) and ``LocalDpMod``
        (its per-round ε as the RDP of its noise multiplier over the rounds). The clip is in the upload's units:
        Flower clips the weight change, the upload is the change / lr."""
        from gradleak.accounting import classic_gaussian_z, gaussian_rdp_epsilon as gaussian_epsilon

        f, lr = cfg.fl.flower, cfg.fl.lr
        if f.dp in ("server-fixed", "client-fixed"):
            z = f.noise_multiplier
            return [{"name": f"flower {f.dp}", "clip": f.clipping_norm / lr, "covers": ["final_model", "every_round"],
                     "delta": delta, "claim": lambda rounds, rep, z=z, mode=f.dp: (
                         gaussian_epsilon(z, rounds, delta),
                         f"RDP of the Gaussian mechanism (closed form, as Opacus' RDPAccountant; Flower's {mode} strategy "
                         f"keeps no accountant), noise multiplier {z:g}, sampling rate 1, {rounds} round(s)")}]
        if f.dp == "local":
            z = classic_gaussian_z(f.local_epsilon, f.local_delta) * f.local_sensitivity / f.clipping_norm
            return [{"name": "flower LocalDpMod", "clip": f.clipping_norm / lr,
                     "covers": ["final_model", "every_round", "each_upload"], "delta": f.local_delta,
                     "claim": lambda rounds, rep, z=z, e=f.local_epsilon: (
                         gaussian_epsilon(z, rounds, f.local_delta),
                         f"LocalDpMod's ε = {e:g} per round (classic Gaussian-mechanism bound); over {rounds} "
                         f"round(s): RDP of its noise multiplier {z:.4g} (closed form, as Opacus' RDPAccountant)")}]
        return []
