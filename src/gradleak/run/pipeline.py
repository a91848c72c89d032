"""The one experiment runner (docs/DESIGN.md §1) for every attack:

    data -> model -> PEFT -> attack.prepare -> FL rounds (attack.server_model each round, clients on their own
    copies, defenses, secure aggregation) -> ServerView (threat model) -> attack.reconstruct -> evaluation -> report

The ground truth (the clients' private samples) leaves this module only towards the evaluation step.

Timings: ``attack_to_client_step_ratio`` = (attack prepare + per-round server model + reconstruction) /
(the clients' local training over the same rounds), measured in the same run so machine noise cancels.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gradleak.errors import BadInput, TrainingDiverged
from gradleak.evaluation import Truth, evaluate, unit
from gradleak.evaluation.membership import split_by_guarantee
from gradleak.config.schema import ExperimentConfig
from gradleak.modalities import final_global_model, jsonable, modality_of



# ------------------------------------------------------------------------------------------------ runner

def attacked_clients(n_clients: int, cfg: ExperimentConfig, threat, reconstruction: str) -> list[int]:
    """The clients attacked, each on its own upload: every client when the audit asks for it
    (``metrics.attack_clients = all``), the server sees individual updates, there is more than one client and the
    evaluation unit grades clients apart; else client 0 alone (under secure aggregation: the sum)."""
    every = (cfg.metrics.attack_clients == "all" and threat.individual_updates and n_clients > 1
             and unit(reconstruction).per_client)
    return list(range(n_clients)) if every else [0]


def victim_rounds(rounds: list, v: int) -> list:
    """Each observed round's uploads rotated so client ``v``'s comes first: the attack reads the view's first update,
    so victim ``v`` is attacked on its own upload (and the others keep their order after it)."""
    return [list(r[v:]) + list(r[:v]) for r in rounds] if v else rounds


@dataclass
class _Experiment:
    """One experiment's parts, built once by :func:`run_experiment` and shared by its trials, and the clocks its
    steps advance (seconds: the clients' local training, the attack's per-round server model, its reconstruction)."""

    cfg: ExperimentConfig
    ctx: Any
    mod: Any  # the modality plug-in
    data: Any
    handle: Any
    mcfg: Any
    defense: Any  # the training-time defense (``defense:``)
    attack: Any
    model: Any
    rounds: int  # the rounds the attack wants run
    defenses: list  # the update defenses of every round
    loss_fn: Any
    start_state: dict = field(default_factory=dict)
    t_client: float = 0.0
    t_hook: float = 0.0
    t_rec: float = 0.0


def run_experiment(cfg: ExperimentConfig, ctx) -> dict[str, Any]:
    """The experiment ``cfg`` (module docstring): the data and model built once, the attack prepared, then every
    trial's federation, attacked updates and evaluations; the mean metrics, the timings and the report."""
    mod = modality_of(cfg)
    _check_device(cfg.attack_cls, ctx.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    data, public, handle, mcfg, defense = _setup(cfg, ctx, mod)
    timings["model_load_seconds"] = time.perf_counter() - t0
    ex, t_prepare = _prepared(cfg, ctx, mod, data, public, handle, mcfg, defense)
    evals, infos = [], []
    for trial in range(cfg.trials):
        _run_trial(ex, trial, evals, infos)
    metrics = {k: float(np.mean([e.metrics[k] for e in evals if k in e.metrics])) for k in evals[0].metrics}
    _add_timings(timings, ex, t_prepare, infos)
    return _results(cfg, handle, evals, infos, metrics, timings)


def _check_device(A, dev) -> None:
    """Refuse a device the attack does not run on."""
    if dev.type not in A.devices:
        raise BadInput("--device", f"attack '{A.name}' runs on {', '.join(A.devices)} only, not on {dev.type}.",
                       "use --device cpu.")


def _setup(cfg: ExperimentConfig, ctx, mod):
    """The data (private: the clients'; public: the server's, only if the threat model grants it) and the model +
    PEFT with the training-time defense applied: ``(data, public, handle, model config, training defense)``."""
    data = mod.data(cfg)
    data.check_labels(cfg.model.num_classes)  # a user's labels beyond model.num_classes: refused before any model loads
    public: dict[str, Any] = dict(mod.attack_public(cfg, data, cfg.threat_model))  # public data the threat model grants
    handle, mcfg = build_handle(cfg, ctx.stage)
    defense = cfg.training_defense
    defense.apply(handle, cfg, data=data)  # training-time defense (FISGuard re-parameterises the protected layers)
    return data, public, handle, mcfg, defense


def _prepared(cfg: ExperimentConfig, ctx, mod, data, public: dict, handle, mcfg, defense) -> tuple[_Experiment, float]:
    """The attack built from its config and what the threat model grants before any round, its ``prepare`` run on
    the model (timed: the second value, seconds), the model on the device, and the round defenses and loss."""
    from gradleak.attacks.base import AttackContext

    threat, dev = cfg.threat_model, ctx.device
    if threat.knows_batch_size:
        public["batch_size"] = cfg.data.batch_size * (1 if threat.individual_updates else cfg.fl.clients)
    actx = AttackContext(seed=cfg.seed, device=dev, threat=threat, fl=public_protocol(cfg), public=public)
    attack = cfg.attack_cls.from_config(cfg.attack_cfg, actx)
    t0 = time.perf_counter()
    model = attack.prepare(handle.model, threat)
    t_prepare = time.perf_counter() - t0
    model.to(dev)
    handle.model = model
    start_state = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    rounds = attack.rounds_wanted(cfg.fl.rounds)
    defenses, loss_fn = round_defenses_and_loss(cfg, handle, model)
    ex = _Experiment(cfg=cfg, ctx=ctx, mod=mod, data=data, handle=handle, mcfg=mcfg, defense=defense, attack=attack,
                     model=model, rounds=rounds, defenses=defenses, loss_fn=loss_fn, start_state=start_state)
    return ex, t_prepare


def _run_trial(ex: _Experiment, trial: int, evals: list, infos: list) -> None:
    """One trial: the model restored to its prepared weights (after the first), the clients' batches, the rounds,
    then every attacked update reconstructed and evaluated (appended to ``evals`` and ``infos``)."""
    cfg, A, threat = ex.cfg, ex.cfg.attack_cls, ex.cfg.threat_model
    if trial:
        _restore(ex.model, ex.start_state)
    batches = ex.data.clients(trial, ex.mcfg.num_classes)
    clients, truth = clients_and_truth(ex.handle, batches, ex.loss_fn, ex.ctx.device, threat, cfg)
    knowledge = truth.pop("_knowledge")
    ex.mod.trial_knowledge(cfg, ex.data, knowledge)  # e.g. a prior image the server is granted
    # what the kind needs beside the private batch (its evaluation unit's truth_fields): knowledge the server is
    # granted (the membership candidates) and truth fields for the evaluation (membership labels; the leakage kind's
    # every client's training and validation images)
    granted, fields = unit(A.reconstruction).truth_fields(ex.data, trial, batches, threat, cfg)
    knowledge.update(granted)
    outcome = _federate(ex, clients)
    # the attacked updates: the first client's (the view's first update), or every client's in turn
    # (metrics.attack_clients = all; the audit): the view's rounds rotated so the victim comes first
    victims = attacked_clients(len(batches), cfg, threat, A.reconstruction)
    null_pool = None
    if cfg.metrics.null and unit(A.reconstruction).draws_null_pool:
        null_pool = ex.data.null_pool(trial)
    for v in victims:
        truth_v, knowledge_v = _victim_truth(ex, batches, v, truth, knowledge)
        rec, view = _attack_victim(ex, outcome, v, knowledge_v, _stage_label(cfg, trial, v, len(victims)))
        with ex.ctx.stage("evaluation"):
            ev = _evaluate_victim(ex, rec, view, outcome, truth_v, trial, v, null_pool, fields)
            evals.append(ev)
        infos.append(rec.info)


def _restore(model, start_state: dict) -> None:
    """The trainable parameters back to the prepared model's (a later trial starts where the first did)."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in start_state:
                p.copy_(start_state[n])


def _federate(ex: _Experiment, clients: list):
    """The trial's federated rounds through the configured engine (builtin, or the same rounds through a real Flower
    federation: ``fl.engine: flower``), the attack's server model each round; the clocks advanced."""
    from gradleak.fl.engines import rounds_engine

    cfg, threat, attack, rounds = ex.cfg, ex.cfg.threat_model, ex.attack, ex.rounds
    rounds_fn = rounds_engine(cfg.fl)
    outcome = rounds_fn(ex.model, clients, rounds=rounds, algorithm=cfg.fl.algorithm, lr=cfg.fl.lr,
                        local_epochs=cfg.fl.local_epochs, local_batch_size=cfg.fl.local_batch_size,
                        defenses=ex.defenses, seed=cfg.seed, server_hook=attack.server_model,
                        secure_aggregation=not threat.individual_updates, track=ex.ctx.track,
                        keep_round=lambda r: attack.observes_round(r, rounds) and
                        (threat.rounds_observed is None or r < threat.rounds_observed),
                        local_update=ex.defense.local_update,
                        client_settings=cfg.client_plan() if cfg.fl.algorithm == "fedavg" else None,
                        lr_at=cfg.fl.lr_at)
    ex.t_client += outcome.client_seconds
    ex.t_hook += outcome.server_hook_seconds
    return outcome


def _victim_truth(ex: _Experiment, batches: list, v: int, truth: dict, knowledge: dict) -> tuple[dict, dict]:
    """The truth and the server's knowledge of victim ``v``'s upload: client 0's as computed, another client's from
    the batches rotated so it comes first (the public data granted, e.g. the membership candidates, carried over)."""
    if not v:
        return truth, knowledge
    _, truth_v = clients_and_truth(ex.handle, batches[v:] + batches[:v], ex.loss_fn, ex.ctx.device,
                                   ex.cfg.threat_model, ex.cfg)
    knowledge_v = truth_v.pop("_knowledge")
    for k in ("public_data",):
        if k in knowledge:
            knowledge_v[k] = knowledge[k]
    return truth_v, knowledge_v


def _stage_label(cfg: ExperimentConfig, trial: int, v: int, n_victims: int) -> str:
    """The attack stage's suffix: the trial (several trials) and the client (several attacked clients)."""
    return (f" (trial {trial + 1}/{cfg.trials})" if cfg.trials > 1 else "") + \
        (f" (client {v + 1}/{n_victims})" if n_victims > 1 else "")


def _attack_victim(ex: _Experiment, outcome, v: int, knowledge_v: dict, label: str):
    """The server's view of victim ``v``'s upload (the threat model's) and the attack's reconstruction from it
    (timed): ``(reconstruction, view)``."""
    from gradleak.fl.threat import build_view

    cfg = ex.cfg
    view = build_view(model=outcome.model, rounds=victim_rounds(outcome.rounds, v), round_states=outcome.round_states,
                      threat=cfg.threat_model, secure_sum=outcome.secure_sums, knowledge=knowledge_v,
                      always_public=always_public(ex.handle, cfg))
    with ex.ctx.stage(f"attack {cfg.attack_cls.name}" + label):
        t0 = time.perf_counter()
        rec = ex.attack.reconstruct(view)
        ex.t_rec += time.perf_counter() - t0
    return rec, view


def _evaluate_victim(ex: _Experiment, rec, view, outcome, truth_v: dict, trial: int, v: int, null_pool,
                     fields: dict):
    """The evaluation of one attacked update: the unit's metrics against the truth (with the kind's ``fields``:
    :meth:`~gradleak.evaluation.base.EvaluationUnit.truth_fields`), the training-time defense's per-layer guarantee
    and report, and the released model's accuracy when ``metrics.utility`` asks for it."""
    cfg, data, defense, mod = ex.cfg, ex.data, ex.defense, ex.mod
    ev = evaluate_update(rec, truth_v, handle=ex.handle, cfg=cfg, out_dir=ex.ctx.out_dir,
                         label=trial if not v else f"{trial}_client{v}", null_pool=null_pool, **fields)
    split_by_guarantee(ev, defense.layer_condition(view.rounds))  # {}: no per-layer guarantee
    ev.metrics.update(defense.report(view.rounds))
    test = data.test(ex.mcfg.num_classes) if cfg.metrics.utility else None
    if test is not None:
        with final_global_model(ex.model, outcome, cfg, eval_mode=mod.eval_mode_for_release()):
            ev.metrics.update(mod.accuracy(ex.handle, ex.model, cfg, test, ex.ctx.device))
    ev.client, ev.trial = v, trial
    return ev


def _add_timings(timings: dict[str, float], ex: _Experiment, t_prepare: float, infos: list[dict]) -> None:
    """Add to ``timings`` the attack's cost against the clients' (module docstring), the modality's benchmark names
    and the attack's own timings (mean over trials; a name already there is kept)."""
    attack_time = t_prepare + ex.t_hook + ex.t_rec
    timings.update({"attack_prepare_seconds": t_prepare, "attack_adapter_state_seconds": ex.t_hook,
               "attack_reconstruct_seconds": ex.t_rec, "attack_total_seconds": attack_time,
               "client_step_seconds": ex.t_client,
               "attack_to_client_step_ratio": attack_time / max(ex.t_client, 1e-12)})
    timings.update(ex.mod.timings(ex.cfg, infos, ex.t_client, ex.t_rec))  # the modality's benchmark names
    for k in sorted({k for i in infos for k in (i.get("timings") or {})}):  # the attack's own timings (mean over trials)
        vals = [float(i["timings"][k]) for i in infos if k in (i.get("timings") or {})]
        timings.setdefault(k, float(np.mean(vals)))


def train_global(cfg: ExperimentConfig, device, rounds: int, *, slices: int | None = None,
                 norms: bool = False, accuracy_start: float | None = None) -> dict[str, Any]:
    """Federated training without an attack: the utility of a setup (``gradleak audit --advise``).

    ``cfg``'s clients hold ``slices`` (default ``rounds``) times their round's samples (one seeded draw, disjoint from
    the ``data.test_size`` test samples); round r hands each client its slice r mod ``slices`` (fresh samples every
    round until the slices run out, then again from the first: epochs over the clients' data; each round's batch the
    size of the attacked round's), through the same round engine, defenses (update transforms, the
    training-time defense's step and loss) and seeds (``seed + r``, lr ``fl.lr_at(r)``) as the pipeline; the honest
    server applies each aggregate. Returns the test accuracy before training, halfway and at the end
    (``accuracy_curve``), the final ``accuracy``, the training-time defense's report (DP-SGD: ``dp_epsilon`` over
    these rounds), ``diverged`` when a client's upload held NaN/inf (the 1-based round, the client, the lr: training
    stops there and ``accuracy`` is the global model's at that point: a measured outcome, not an error) and, with
    ``norms``, every upload's L2 norm (``update_norms``, after the config's own defenses) and
    every sample's gradient L2 norm at the model sent that round (``sample_gradient_norms``). ``accuracy_start``:
    the accuracy before training when another run of the same model, data and test samples measured it (the advice's
    update-defense candidates start from the baseline's model: an update defense changes nothing before the first
    upload); it is then not measured again (``accuracy_start_from``: ``given``)."""
    from gradleak.fl.engines import rounds_engine
    from gradleak.fl.engines.builtin import apply_aggregate

    dev = torch.device(device) if not isinstance(device, torch.device) else device
    data, handle, mcfg, defense, defenses, loss_fn = federation(cfg, dev)
    model = handle.model
    batches = data.clients(0, mcfg.num_classes)
    test = data.test(mcfg.num_classes)
    if test is None:
        raise BadInput("data.test_size", "the utility needs held-out test samples.", "set data.test_size (e.g. 64).")
    plan = cfg.client_plan()
    slices = slices or rounds
    per = [p["images"] // slices for p in plan]
    settings = [{"batch_size": min(p["batch_size"], n), "epochs": p["epochs"]} for p, n in zip(plan, per)]

    mod = modality_of(cfg)

    def accuracy() -> float:
        return mod.accuracy(handle, model, cfg, test, dev)["accuracy"]

    rounds_fn = rounds_engine(cfg.fl)
    every = max(1, rounds // 2)  # the curve: before training, halfway and at the end
    curve, update_norms, sample_norms = [accuracy() if accuracy_start is None else float(accuracy_start)], [], []
    diverged: dict[str, Any] | None = None
    t0 = time.perf_counter()
    for r in range(rounds):
        k = r % slices
        part = [(x[k * n:(k + 1) * n], y[k * n:(k + 1) * n]) for (x, y), n in zip(batches, per)]
        clients, _ = clients_and_truth(handle, part, loss_fn, dev, cfg.threat_model, cfg)
        if norms:
            sample_norms += [v for c in clients for v in c.per_sample_gradient_norms(model)]
        lr = cfg.fl.lr_at(r)
        try:
            outcome = rounds_fn(model, clients, rounds=1, algorithm=cfg.fl.algorithm, lr=lr,
                                local_epochs=cfg.fl.local_epochs, local_batch_size=cfg.fl.local_batch_size,
                                defenses=defenses, seed=cfg.seed + r, keep_round=lambda _r: norms,
                                local_update=defense.local_update, lr_at=lambda _r: lr,
                                client_settings=settings if cfg.fl.algorithm == "fedavg" else None)
        except TrainingDiverged as e:  # a measured outcome, not a failure: this setup cannot train (for that many rounds)
            diverged = {"round": r + 1, "client": e.client_id, "lr": lr}
            curve.append(accuracy())
            break
        if norms:
            update_norms += [u.norm() for u in outcome.rounds[0]]
        apply_aggregate(model, outcome.last_aggregate, lr)
        if (r + 1) % every == 0 or r + 1 == rounds:
            curve.append(accuracy())
    out: dict[str, Any] = {"accuracy": curve[-1], "accuracy_start": curve[0], "accuracy_curve": curve,
                           **({"diverged": diverged} if diverged else {}),
                           **({"accuracy_start_from": "given"} if accuracy_start is not None else {}),
                           "rounds": rounds, "slices": slices, "test_samples": len(test[0]), "train_seconds": time.perf_counter() - t0,
                           **{k: v for k, v in defense.report([]).items() if isinstance(v, (int, float))}}
    if norms:
        out.update(update_norms=update_norms, sample_gradient_norms=sample_norms)
    return out


def federation(cfg: ExperimentConfig, dev: torch.device):
    """The honest federation of ``cfg`` without an attack (the utility run, the DP check): its data, the model handle
    on ``dev`` with the training-time defense applied, the model config, that defense, the round defenses and the
    clients' loss."""
    data = modality_of(cfg).data(cfg)
    handle, mcfg = build_handle(cfg)
    defense = cfg.training_defense
    defense.apply(handle, cfg, data=data)
    handle.model = handle.model.to(dev)
    defenses, loss_fn = round_defenses_and_loss(cfg, handle, handle.model)
    return data, handle, mcfg, defense, defenses, loss_fn


def evaluate_update(rec, truth: dict, *, handle, cfg: ExperimentConfig, out_dir, label, null_pool=None,
                    **truth_fields):
    """The evaluation step of one attacked update (the pipeline's trial body and the Flower audit's, one code path):
    ``rec`` (what the attack reconstructed) against ``truth`` (:func:`clients_and_truth`'s private samples of the
    update) and ``null_pool`` (chance reconstructions, ``(samples, source)``). ``truth_fields``: further
    :class:`~gradleak.evaluation.Truth` fields (``membership``; the leakage kind's per-client data)."""
    tr = Truth(cfg.modality, truth["inputs"], truth["labels"], texts=truth.get("texts"), tokenizer=handle.tokenizer,
               model_kind=handle.kind, bottleneck=peft_bottleneck(cfg, handle), **truth_fields)
    if null_pool is not None:
        tr.null_pool, tr.null_source = null_pool
    return evaluate(cfg.attack_cls.reconstruction, tr, rec, cfg, out_dir, label)


def public_protocol(cfg: ExperimentConfig) -> dict[str, Any]:
    """The federated training configuration the server runs and so knows (Hatamizadeh et al. 2022 §I): algorithm, lr schedule,
    per-client local batch size and epochs."""
    return {"algorithm": cfg.fl.algorithm, "local_epochs": cfg.fl.local_epochs, "lr": cfg.fl.lr,
            "local_batch_size": cfg.fl.local_batch_size, "clients": cfg.fl.clients,
            "client_batch_sizes": [p["batch_size"] for p in cfg.client_plan()],
            "client_epochs": [p["epochs"] for p in cfg.client_plan()],
            "lr_at": [cfg.fl.lr_at(r) for r in range(cfg.fl.rounds)]}


def build_handle(cfg: ExperimentConfig, stage=None):
    """The model + PEFT exactly as the pipeline builds it for ``cfg`` (dtype: float64 when the attack needs it); also
    what a Flower app built from the same config trains (:func:`gradleak.integrations.flower.build_model`). Returns
    ``(handle, model config)``."""
    from gradleak.models import build
    from gradleak.peft import apply_peft

    A = cfg.attack_cls
    dtype = cfg.model.dtype or ("float64" if A.needs_float64 else "float32")
    mcfg = cfg.model
    if mcfg.init_weights is None:
        mcfg = mcfg.model_copy(update={"init_weights": not A.rewrites_weights})
    extra_build = dict(modality_of(cfg).build_kwargs(cfg))
    if getattr(mcfg, "pretrain", None) is not None:
        import sys

        extra_build["progress"] = lambda msg: print(msg, file=sys.stderr, flush=True)
    with (stage("model" + (" (pretraining, cached after the first run)" if "progress" in extra_build else ""))
          if stage is not None else contextlib.nullcontext()):
        handle = build(mcfg, cfg.modality, image_size=cfg.data.image_size, seed=cfg.seed, dtype=dtype, **extra_build)
    apply_peft(handle, cfg.peft, seed=cfg.seed)
    if cfg.model.train_all:  # full fine-tuning (the leakage study's ResNet-18)
        for p in handle.model.parameters():
            p.requires_grad_(True)
    return handle, mcfg


def clients_and_truth(handle, batches, loss_fn, dev, threat, cfg):
    """Clients from the private batches, plus the truth for evaluation and the facts the view may be granted."""
    from gradleak.fl.core import Client

    mod = modality_of(cfg)
    clients, kept_all, raw_all, labels_all, lengths = [], [], [], [], []
    # data.samples_per_client: each client holds a dataset and trains each round on a batch of data.batch_size of it
    round_batch = cfg.data.batch_size if cfg.data.samples_per_client else None
    for i, (x, y) in enumerate(batches):
        inputs, kept, lens = mod.encode(handle, x, cfg, dev)
        raw_all.append(x)
        kept_all.append(kept)
        lengths += lens
        clients.append(Client(i, inputs, y.to(dev), loss_fn=loss_fn, round_batch=round_batch, sample_seed=cfg.seed))
        labels_all.append(y)
    victim = slice(0, 1) if threat.individual_updates else slice(0, len(batches))  # what the observed update holds
    labels = torch.cat(labels_all[victim])
    per_update = len(labels) if round_batch is None else round_batch * (victim.stop - victim.start)  # one round's
    knowledge = {"knows_labels": {"labels": labels.tolist()},
                 "knows_batch_size": {"batch_size": int(per_update)}}
    truth = mod.truth(handle, kept_all[victim], raw_all, lengths, labels, threat, cfg, knowledge)
    truth["_knowledge"] = knowledge
    return clients, truth


def round_defenses_and_loss(cfg: ExperimentConfig, handle, model):
    """The update defenses of every round (``defenses:``, then a ``defense:`` that is an update transform) and the
    clients' loss (the training-time defense's loss options and wrapper), as the pipeline trains with them."""
    from gradleak.defenses import build_defenses
    from gradleak.fl.core import default_classification_loss

    defense = cfg.training_defense
    defenses = build_defenses([d.model_dump() for d in cfg.defenses], seed=cfg.seed)
    defenses = defenses + defense.update_transforms(seed=cfg.seed)  # a `defense:` that is an update transform
    loss_fn = handle.loss_fn or default_classification_loss
    if defense.loss_options():  # the modality shapes its clients' loss
        from gradleak.modalities import modality_of

        loss_fn = modality_of(cfg).loss_with_options(handle, defense.loss_options())
    return defenses, defense.wrap_loss(loss_fn, model)


def always_public(handle, cfg) -> dict[str, Any]:
    """What the protocol makes public whatever the threat model: the architecture's interface, and the update
    defenses' configuration (a DP deployment publishes its mechanism and parameters; the server runs the protocol)."""
    from gradleak.defenses.declared import declared_defenses

    defenses = [d.model_dump() for d in cfg.defenses]
    # every declared defense -- the update list, the training-time `defense:`, secure aggregation, a framework's DP
    # wrapper -- resolved once into what the server knows of it (gradleak.defenses.declared)
    known = {"update_defenses": defenses, "declared_defenses": declared_defenses(cfg), "clients": cfg.fl.clients}
    return {**modality_of(handle.modality).always_public(handle, cfg), **known}


def peft_bottleneck(cfg, handle) -> int | None:
    """The PEFT bottleneck width the evaluation reads (adapter width, LoRA rank), or None: the PEFT kind's own
    (:meth:`gradleak.peft.PeftKind.bottleneck`)."""
    from gradleak.peft import peft_kind

    return peft_kind(cfg.peft.kind).bottleneck(cfg, handle, modality_of(handle.modality))


def _results(cfg, handle, evals, infos, metrics, timings) -> dict[str, Any]:
    figures = [f for e in evals[:1] for f in e.figures]
    artifacts = [a for e in evals for a in e.artifacts]
    notes = [n for e in evals for n in e.notes]
    tables = [t for e in evals for t in e.tables]
    rows = [r for e in evals for r in e.rows]
    if rows:
        tables.insert(0, {"title": f"{cfg.attack.name}: reference vs reconstructed sentences ({handle.name})",
                          "columns": list(rows[0]), "rows": rows[:200]})
    warnings = [i.get("warning") for i in infos if i.get("warning")]
    if warnings:
        tables.append({"title": "Warnings", "columns": ["warning"], "rows": [{"warning": w} for w in warnings]})
    threat = cfg.threat_model
    notes = [f"threat model — {line}" for line in threat.describe()] + notes
    report = {"figures": figures, "figure_rows": [list(range(len(figures)))] if figures else [], "tables": tables,
              "notes": notes}
    details = {"model": handle.name, "model_kind": handle.kind, "hidden_size": handle.hidden_size,
               "attack": {"name": cfg.attack.name, "params": cfg.attack_cfg.model_dump(mode="json"),
                          "requires": cfg.attack_cls.requires(cfg.attack_cfg)},
               "threat": threat.as_dict(),
               "trials": [{"info": jsonable(i)} for i in infos], "warnings": warnings}
    # each attacked client's own warnings beside its metrics (evals and infos are appended together, one per client
    # and trial): the audit shows on its evidence only the warnings of the client that is the evidence
    details["per_client"] = [{"trial": e.trial, "client": e.client,
                              "metrics": {k: v for k, v in e.metrics.items() if isinstance(v, (int, float))},
                              "warnings": [i["warning"]] if i.get("warning") else []}
                             for e, i in zip(evals, infos)]
    details.update(modality_of(handle.modality).details(cfg, evals, infos))
    return {"metrics": metrics, "timings": timings, "artifacts": artifacts, "details": details, "report": report}
