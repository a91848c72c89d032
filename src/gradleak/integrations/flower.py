"""gradleak on a Flower federation: audit what a Flower server sees, and defend and score clients with
gradleak's own registries.

Optional extra ``fl`` (``pip install 'gradleak[fl]'``, Flower's Message API: ``flwr>=1.42,<2``). The Flower
mechanics this stands on -- the recording strategy wrapper :class:`~gradleak.fl.engines.flower_bridge.GradleakStrategy`,
:func:`~gradleak.fl.engines.flower_bridge.legacy_mod`, the in-process runner -- live in
:mod:`gradleak.fl.engines.flower_bridge`, below the pipeline, because the pipeline's Flower round engine
(:mod:`gradleak.fl.engines.flower`, ``fl.engine: flower``) runs on them. Here, the pieces that need gradleak's
configs, registries and audit, each usable in any Flower app:

* :func:`build_model` builds the model (+ PEFT) of a gradleak config exactly as the pipeline does, so the ServerApp,
  the ClientApps and the audit share one description.
* :class:`FlowerAudit` is an ``on_round`` callback for ``GradleakStrategy``: gradleak's attacks on every audited
  round, scored, judged and given a verdict by the audit's own functions (:mod:`gradleak.run.audit`).
* :func:`defense_mod` is a client mod that applies gradleak's update defenses (``defenses:`` entries) to the reply.
* :func:`scoring_mod` is a client mod for deployments where the server has no ground truth: the client runs a
  scoring function on its own update and private data and adds only scalars (RDLV-style) to the reply's metrics;
  :func:`client_scorer` is such a function, running the audit's attacks on the client's own update.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Callable, Iterable, Sequence

import torch

from gradleak.run.round_audit import RoundAudit
from gradleak.fl.engines.flower_bridge import (ClientReply, GradleakStrategy, RecordedRound, is_train_message,
                                               legacy_mod, reply_of, require_flower, run_inprocess,
                                               run_simulation_engine, single_record, to_arrays, to_tensors,
                                               update_defense_mod)

# The user-facing Flower API, one import away (the mechanics live below the pipeline, in fl/engines/flower_bridge.py).
__all__ = ["FlowerAudit", "GradleakStrategy", "build_model", "client_scorer", "defense_mod", "legacy_mod",
           "run_inprocess", "run_simulation_engine", "scoring_mod", "to_arrays", "to_tensors"]

# ------------------------------------------------------------------------------------------ client mods

def defense_mod(defenses: list, *, seed: int = 0, algorithm: str = "fedavg", lr: float | None = None,
                names: Iterable[str] | None = None):
    """A client mod that applies gradleak's update defenses (``defenses:`` entries, e.g.
    ``[{"name": "clipping", "params": {"max_norm": 1}}, {"name": "gaussian_noise", "params": {"std": 0.01}}]``) to
    the client's update before it leaves (built defense objects are accepted too): see
    :func:`~gradleak.fl.engines.flower_bridge.update_defense_mod`, which runs them."""
    require_flower()
    from gradleak.defenses import build_defenses

    entries = list(defenses)
    built = [d for d in entries if hasattr(d, "apply")]  # already-built defenses pass through
    built += build_defenses([d for d in entries if not hasattr(d, "apply")], seed=seed)
    return update_defense_mod(built, seed=seed, algorithm=algorithm, lr=lr, names=names)


def scoring_mod(score: Callable[[dict[str, torch.Tensor], Any, Any], dict[str, float]], *, lr: float | None = None,
                algorithm: str = "fedavg"):
    """A client mod that scores the client's own leakage and sends only scalars: after training it calls
    ``score(sent_arrays, update, context) -> {name: value}`` (the client knows its private data; the update is what
    the server will receive, after the mods inside this one, so put this mod outermost) and adds the values to the
    reply's metrics under ``gradleak.<name>`` (a real deployment measures leakage without sending data)."""
    require_flower()

    def mod(msg, ctx, call_next):
        if not is_train_message(msg):
            return call_next(msg, ctx)
        out = call_next(msg, ctx)
        if out.has_error():
            return out
        sent, _, _, upd, _, _, _ = reply_of(msg, out, ctx, algorithm=algorithm, lr=lr, mod="scoring_mod")
        _, mrec = single_record(out.content.metric_records, "MetricRecord", "reply")
        values = score(sent, upd, ctx) or {}
        for k, v in values.items():
            v = float(v)
            mrec[f"gradleak.{k}"] = v if v == v else -1.0  # Flower's metrics take no nan; -1 = undefined
        return out

    return mod


# ------------------------------------------------------------------------------------------ the audit, live

def build_model(config):
    """The model (+ PEFT) a Flower app trains, built from a gradleak config (a path or a dict) exactly as the
    pipeline builds it, so the ServerApp, the ClientApps and the audit share one description. Returns
    ``(handle, cfg)``: ``handle.model`` is the torch model, ``cfg`` the validated config."""
    from gradleak.run.pipeline import build_handle
    from gradleak.run.round_audit import validated_config

    cfg = validated_config(config, "the Flower app")
    handle, _ = build_handle(cfg)
    return handle, cfg


class FlowerAudit(RoundAudit):
    """gradleak's attacks on every audited Flower round: ``GradleakStrategy(..., on_round=FlowerAudit(config, out))``.

    ``config`` is the gradleak config that describes the federation (model, PEFT, data kind, threat, fl); its
    ``attack`` names the setting the app models, and every registered attack the config's gate accepts is run on
    the round's :class:`~gradleak.fl.core.ServerView` (``attacks=[...]`` restricts them). Attacks that poison the
    weights the server sends cannot run after the fact: they are listed as not run (run them through
    ``server_hook`` / ``fl.engine: flower``). ``truth(server_round) -> [(inputs, labels), ...]`` (per client, the
    pipeline's form: images in [0, 1], or texts) is what a *simulation* knows; with it every attack is scored and
    judged as ``gradleak audit`` judges it. Without it (a real deployment) the reconstructions are saved for
    inspection (each attack ``undefined``: nothing on the server scores it) and the clients' own scalars
    (:func:`scoring_mod`) are reported. Writes ``OUT/round_<r>/audit.json``, ``OUT/round_<r>/report.html``
    (``gradleak audit``'s page; ``gradleak report OUT/round_<r>/audit.json`` rebuilds it) and ``OUT/flower_audit.json``
    (every audited round, rewritten atomically), and prints each round answer first as ``gradleak audit`` words it
    (:func:`gradleak.run.round_audit.round_console`). ``command``: how to reproduce the audit, for the report.

    ``advise=True`` (or a mapping like ``audit.advise``: ``{"candidates": [...], "steps": n}``; ``budget=`` seconds
    bounds it) is ``gradleak audit --advise`` for this federation: on the first audited round (again when a later
    round leaks through an attack it did not search for) the weakest strength of each defense that stops every
    leaking attack, its accuracy cost and epsilon, with Flower's own DP mechanisms (``LocalDpMod``,
    ``DifferentialPrivacyClientSideFixedClipping``, ``DifferentialPrivacyServerSideFixedClipping``) among the
    candidates, each row saying how to apply it in the Flower app: ``advice`` in ``OUT/round_<r>/audit.json`` (the
    CLI's schema), ``advice.html`` and ``advice.png`` beside it, the recommendation in ``flower_audit.json``
    (:mod:`gradleak.integrations.flower_advise`). The probes are audits of the config (``OUT/advise/``, resumable);
    ``workers`` runs their attacks in parallel."""

    who = "the Flower app"
    log_prefix = "[flower audit]"

    def __init__(self, config, out_dir, *, attacks: Sequence[str] | None = None,
                 truth: Callable[[int], list] | None = None, device: str = "cpu", log: Callable[[str], Any] = print,
                 advise: bool | dict = False, budget: float | None = None, workers: int = 1, command: str = ""):
        from gradleak.integrations.flower_advise import advise_options

        self.advise_opts = advise_options(advise, budget)
        if self.advise_opts is not None:
            self.advise_opts["workers"] = int(workers)
        self.advice_covered: set[str] | None = None  # the attacks an advice searched for (None: none given yet)
        super().__init__(config, out_dir, attacks=attacks, truth=truth, device=device, log=log, command=command)

    def __call__(self, rec: RecordedRound) -> dict:
        t_round = time.perf_counter()
        result = self.audit(rec)
        if self.advise_opts is not None:
            from gradleak.integrations.flower_advise import round_advice

            rdir = self.out / f"round_{rec.server_round}"
            rdir.mkdir(parents=True, exist_ok=True)
            advice = round_advice(self, rec, result, rdir)
            if advice is not None:
                result["advice"] = advice
            result["seconds"] = time.perf_counter() - t_round
        self.write(result, "flower_audit.json")
        return result


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
