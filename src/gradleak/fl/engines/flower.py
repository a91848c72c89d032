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
    from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp
    from flwr.serverapp.strategy import FedAvg

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
        capp_mods.append(update_defense_mod(list(defenses), seed=seed, algorithm=algorithm, names=None))
    capp = ClientApp(mods=capp_mods)

    @capp.train()
    def _train(msg, ctx):
        pid = int(ctx.node_config["partition-id"])
        conf = msg.content["config"]
        r = int(conf["server-round"]) - 1
        c = clients[pid].for_round(r)  # a client holding a dataset trains on this round's batch of it
        lr_r = float(conf["lr"])
        sent = to_tensors(msg.content["arrays"])
        reads = getattr(c, "reads_model", True)  # a canary client reads no weights (only the trainable names)
        local = model_as_sent(base, sent, reads=reads, field="arrays",
                              fix="the ClientApp and the ServerApp must build the same model.")
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
