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

from gradleak.errors import BadInput
from gradleak.fl.engines.flower_bridge import (ClientReply, GradleakStrategy, RecordedRound, is_train_message,
                                               legacy_mod, reply_of, require_flower, run_inprocess,
                                               run_simulation_engine, single_record, to_arrays, to_tensors,
                                               update_defense_mod, view_of)

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

    cfg = _validated(config)
    handle, _ = build_handle(cfg)
    return handle, cfg


def _raw(config) -> dict:
    from pathlib import Path

    from gradleak.config.loading import load_yaml

    return load_yaml(config) if isinstance(config, (str, Path)) else copy.deepcopy(dict(config))


def _validated(config):
    from gradleak.run.runner import validate

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
    and ``OUT/flower_audit.json`` (every audited round, rewritten atomically).

    ``advise=True`` (or a mapping like ``audit.advise``: ``{"candidates": [...], "steps": n}``; ``budget=`` seconds
    bounds it) is ``gradleak audit --advise`` for this federation: on the first audited round (again when a later
    round leaks through an attack it did not search for) the weakest strength of each defense that stops every
    leaking attack, its accuracy cost and epsilon, with Flower's own DP mechanisms (``LocalDpMod``,
    ``DifferentialPrivacyClientSideFixedClipping``, ``DifferentialPrivacyServerSideFixedClipping``) among the
    candidates, each row saying how to apply it in the Flower app: ``advice`` in ``OUT/round_<r>/audit.json`` (the
    CLI's schema), ``advice.html`` and ``advice.png`` beside it, the recommendation in ``flower_audit.json``
    (:mod:`gradleak.integrations.flower_advise`). The probes are audits of the config (``OUT/advise/``, resumable);
    ``workers`` runs their attacks in parallel."""

    def __init__(self, config, out_dir, *, attacks: Sequence[str] | None = None,
                 truth: Callable[[int], list] | None = None, device: str = "cpu", log: Callable[[str], Any] = print,
                 advise: bool | dict = False, budget: float | None = None, workers: int = 1):
        from pathlib import Path

        from gradleak.run.audit import attack_names, candidate
        from gradleak.run.runner import validate
        from gradleak.registry import ATTACKS

        from gradleak.integrations.flower_advise import advise_options

        self.raw = _raw(config)
        self.cfg = _validated(self.raw)
        self.advise_opts = advise_options(advise, budget)
        if self.advise_opts is not None:
            self.advise_opts["workers"] = int(workers)
        self.advice_covered: set[str] | None = None  # the attacks an advice searched for (None: none given yet)
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.truth, self.log, self.device = truth, log, torch.device(device)
        names = list(attacks) if attacks else attack_names()
        unknown = sorted(set(names) - set(ATTACKS.names()))
        if unknown:
            raise BadInput("attacks", f"unknown attack(s) {', '.join(unknown)}.", f"choose from {', '.join(ATTACKS.names())}.")
        self.plans, self.not_run = [], []
        for name in names:
            try:
                _, cfg = validate(candidate(self.raw, name))
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
            from gradleak.data.splits import ImageData, TextData

            try:
                data = ImageData(self.cfg) if self.cfg.modality == "image" else TextData(self.cfg)
                self.null_pool = data.null_pool(0)
            except (BadInput, OSError, ValueError) as err:
                self.log(f"[flower audit] no null pool ({err}): levels will be undefined")

    def __call__(self, rec: RecordedRound) -> dict:
        from gradleak.attacks.base import AttackContext
        from gradleak.run.audit import judge, leak_rank, server_words, verdict_and_headline
        from gradleak.run.pipeline import always_public, clients_and_truth, evaluate_update, public_protocol
        from gradleak.run.results import write_json_atomic
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
        always = always_public(h, base)
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
                _, truth = clients_and_truth(h, b_v, h.loss_fn or default_classification_loss, self.device,
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
                        ev = evaluate_update(out, truth, handle=h, cfg=cfg, out_dir=where, label=0,
                                             null_pool=self.null_pool)
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
                                                    "null_median", "null_p99", "p_value", "criterion",
                                                    "decided_by") if k in worst})
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
        verdict, headline = verdict_and_headline(judged) if judged else (
            "not_scored", "no ground truth on the server: see the clients' own scores")
        result = {"server_round": rec.server_round, "verdict": verdict, "headline": headline,
                  "aggregated": rec.aggregated, "note": rec.note, "attacks": entries + self.not_run,
                  "client_scores": {str(k): v for k, v in rec.client_metrics.items() if v},
                  "seconds": time.perf_counter() - t_round}
        rdir.mkdir(parents=True, exist_ok=True)
        if self.advise_opts is not None:
            from gradleak.integrations.flower_advise import round_advice

            advice = round_advice(self, rec, result, rdir)
            if advice is not None:
                result["advice"] = advice
            result["seconds"] = time.perf_counter() - t_round
        write_json_atomic(rdir / "audit.json", result)
        self.summary.append({k: result[k] for k in ("server_round", "verdict", "headline", "aggregated", "seconds")}
                            | {"values": {e["name"]: e.get("value") for e in entries},
                               "client_scores": result["client_scores"]}
                            | ({"advice": {k: result["advice"].get(k) for k in ("sentence", "recommendation")}}
                               if "advice" in result else {}))
        write_json_atomic(self.out / "flower_audit.json", {"rounds": self.summary, "config": self.raw})
        return result


def _no_individual(threat):
    from dataclasses import replace as dc_replace

    return dc_replace(threat, individual_updates=False)


def _save_reconstruction(rec, out_dir, tokenizer=None) -> None:
    """What an attack produced, for a human to inspect when nothing can score it (no ground truth): images as a PNG
    grid, token sequences decoded, scores as numbers."""
    from gradleak.run.results import write_json_atomic

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
