"""``FlowerAudit(config, out, advise=True)``: ``gradleak audit --advise`` for the federation a
Flower server watches, with Flower's own DP mechanisms among the candidates.

On the first audited round (again when a later round leaks through an attack no earlier advice searched for; without
ground truth on the server the leaking attacks are measured once, on the config's simulated federation),
:func:`gradleak.run.advise.advise` searches
the weakest strength of each candidate that brings every leaking attack back to level ``none``: gradleak's own
candidates (:data:`gradleak.run.advise_options.CANDIDATES`) and Flower's three DP mechanisms, each with its real
semantics and in Flower's own parameters:

* ``LocalDpMod`` (``flwr.clientapp.mod``): each client clips its weight change Δw to ``clipping_norm`` and adds
  N(0, s²) per coordinate, s = sensitivity · √(2 ln(1.25/δ)) / ε, before the reply leaves. That is gradleak's
  ``dp_gaussian`` with ``where: client``, ``max_norm = clipping_norm / lr`` (a gradleak update is Δw / lr) and
  ``noise_multiplier = s / clipping_norm``: the probe runs that defense (seeded), searching ε.
* ``DifferentialPrivacyClientSideFixedClipping`` (+ ``fixedclipping_mod`` on the clients): the clients clip Δw to
  ``clipping_norm``, the server adds N(0, (σ C / K)²) to the mean of the K replies. That is ``dp_gaussian`` with
  ``where: server``: the server receives every clipped update without noise. Searched: σ.
* ``DifferentialPrivacyServerSideFixedClipping``: the server clips each reply itself and noises the mean, so an
  honest-but-curious server holds every raw update before its own clipping (``GradleakStrategy`` records the
  replies before the wrapper rewrites them). gradleak has no defense where the server clips, so the probe runs the
  real wrapper on the pipeline's Flower engine (``fl.engine: flower``, ``fl.flower.dp: server-fixed``, float64
  weight replies). Searched: σ.

The noise multiplier of the central wrappers does not change what the server receives, so no σ stops an attack the
server runs on the uploads: the search says so from its strong end (one probe each) and the row's ε is the released
model's (user-level, against third parties). The clipping norm C is Flower's parameter on Δw; unless the config
sets it (``fl.flower.clipping_norm`` with ``fl.flower.dp`` of the same mechanism) it is fitted to the audited round:
the median of the clients' ‖Δw‖ = lr · ‖update‖ (the target quantile 0.5 of Flower's adaptive clipping), so it binds
for half of them. LocalDpMod's sensitivity is set to C (the clipped update's L2 bound). Every row names the Flower
class and the Flower-side setting (``row["flower"]``), and gradleak's own rows say how to apply them in a Flower app
(``defense_mod``, SecAgg+, the clients' training step).
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

from gradleak.errors import BadInput

LOCAL, CLIENT_FIXED, SERVER_FIXED = ("LocalDpMod", "DifferentialPrivacyClientSideFixedClipping",
                                     "DifferentialPrivacyServerSideFixedClipping")
#: the Flower candidates, by the name of Flower's class (the ``defense`` of their advice rows)
FLOWER_CANDIDATES = (LOCAL, CLIENT_FIXED, SERVER_FIXED)
#: ``fl.flower.dp`` of each Flower candidate
MODE = {LOCAL: "local", CLIENT_FIXED: "client-fixed", SERVER_FIXED: "server-fixed"}
#: LocalDpMod's bracket in epsilon: the weak end is the epsilon whose noise is this fraction of the per-coordinate
#: RMS of an update at the clipping norm (gaussian_noise's weak end), the strong end a standard local-DP epsilon
LOCAL_WEAK_RELATIVE, LOCAL_STRONG_EPSILON = 1e-3, 1.0


def advise_options(advise: Any, budget: Any) -> dict | None:
    """The validated ``advise=`` / ``budget=`` of :class:`~gradleak.integrations.flower.FlowerAudit`: None (off) or
    ``{"candidates", "steps", "batches", "budget"}``; ``advise`` is ``True`` or a mapping like ``audit.advise`` whose
    ``candidates`` may name Flower's classes (:data:`FLOWER_CANDIDATES`)."""
    from gradleak.run.advise_options import advise_section, check_budget

    opts = advise_section(advise, "advise", FLOWER_CANDIDATES)
    budget = check_budget(budget, "budget")
    if opts is None:
        if budget is not None:
            raise BadInput("budget", "bounds the advice search, but the audit is not advising.",
                           "pass advise=True (or drop budget=).")
        return None
    return {**opts, "budget": budget}


def z_of_epsilon(epsilon: float, delta: float) -> float:
    """LocalDpMod's noise std over its sensitivity: √(2 ln(1.25/δ)) / ε (the classic Gaussian mechanism)."""
    from gradleak.accounting import classic_gaussian_z

    return classic_gaussian_z(epsilon, delta)


def _flower_section(raw: dict) -> dict:
    return dict(((raw.get("fl") or {}).get("flower")) or {})


def _with_flower(raw: dict, **flower) -> dict:
    out = copy.deepcopy(raw)
    fl = dict(out.get("fl") or {})
    fl["flower"] = {**_flower_section(raw), **flower}
    out["fl"] = fl
    return out


def _with_dp_gaussian(raw: dict, params: dict) -> dict:
    """``raw`` without Flower's DP and with the one ``dp_gaussian`` of ``params`` (a configured one is replaced)."""
    out = _with_flower(raw, dp="none") if _flower_section(raw).get("dp", "none") != "none" else copy.deepcopy(raw)
    out["defenses"] = [d for d in out.get("defenses") or [] if d.get("name") != "dp_gaussian"] + [
        {"name": "dp_gaussian", "params": params}]
    return out


def flower_candidates(raw: dict, *, clip: float, lr: float, clients: int, coordinates: int, delta: float,
                      clip_note: str) -> list[dict]:
    """The three Flower candidates (specs for :func:`gradleak.run.advise.advise`'s ``extra``) for the federation of
    ``raw``: clipping norm ``clip`` on Δw, the clients' ``lr`` (Δw = lr · update), ``clients`` per round,
    ``coordinates`` trainable coordinates (LocalDpMod's bracket), ``delta`` of LocalDpMod and every epsilon."""
    from gradleak.run.advise_utility import gaussian_epsilon

    fl = _flower_section(raw)
    configured = fl.get("dp", "none")
    C = float(fl["clipping_norm"]) if configured != "none" and fl.get("clipping_norm") else float(clip)
    sens = float(fl.get("local_sensitivity", C)) if configured == "local" else C
    max_norm = C / lr
    where = {LOCAL: "the ClientApp's mods (outermost: it acts last on the reply)",
             CLIENT_FIXED: "the ServerApp's strategy, inside GradleakStrategy, and fixedclipping_mod in the ClientApp's mods",
             SERVER_FIXED: "the ServerApp's strategy, inside GradleakStrategy"}
    z = lambda eps: z_of_epsilon(eps, delta) * sens / C  # noqa: E731 -- LocalDpMod's std over the clipping norm

    def local_config(r, eps):
        return _with_dp_gaussian(r, {"noise_multiplier": float(f"{z(eps):.6g}"), "max_norm": max_norm, "where": "client"})

    def client_fixed_config(r, sigma):
        return _with_dp_gaussian(r, {"noise_multiplier": float(sigma), "max_norm": max_norm, "where": "server"})

    def server_fixed_config(r, sigma):
        out = _with_flower(r, dp="server-fixed", noise_multiplier=float(sigma), clipping_norm=C, reply="weights")
        out["fl"]["engine"] = "flower"
        out["defenses"] = [d for d in out.get("defenses") or [] if d.get("name") != "dp_gaussian"]
        return out

    def start(mode, param):
        return lambda r: _flower_section(r).get(param) if _flower_section(r).get("dp") == mode else None

    def sets(configure):
        def set_strings(r, value):
            cfg = configure(r, value)
            out = []
            if (cfg.get("defenses") or []) != (r.get("defenses") or []):
                out.append("defenses=" + json.dumps(cfg.get("defenses") or []))
            for k, v in _flower_section(cfg).items():
                if _flower_section(r).get(k) != v:
                    out.append(f"fl.flower.{k}={v}")
            if (cfg.get("fl") or {}).get("engine") != (r.get("fl") or {}).get("engine"):
                out.append(f"fl.engine={cfg['fl']['engine']}")
            return out
        return set_strings

    def central_epsilon(sigma, rounds):
        return {"epsilon": gaussian_epsilon(sigma, rounds, delta),
                "epsilon_note": f"of the released model, user-level (one client's clipped update), Gaussian mechanism on "
                                f"the sum, RDP, every client every round, {rounds} round(s); none against the server, "
                                "which receives the updates before the noise"}

    def local_epsilon(eps, rounds):
        return {"epsilon": gaussian_epsilon(z(eps), rounds, delta),
                "epsilon_note": f"LocalDpMod's epsilon = {eps:.4g} per round (classic Gaussian-mechanism bound at delta = "
                                f"{delta:g}, sensitivity {sens:.4g}); over {rounds} round(s): RDP of the Gaussian "
                                f"mechanism with noise multiplier {z(eps):.4g}, as the dp_gaussian row"}

    weak_eps = float(f"{math.sqrt(2 * math.log(1.25 / delta)) * sens / C * math.sqrt(max(coordinates, 1)) / LOCAL_WEAK_RELATIVE:.3g}")
    common = {"stage": "flower", "scale": "log", "fixed": {"clipping_norm": C, "lr": lr, "clients": clients}}
    return [
        {**common, "name": LOCAL, "param": "epsilon", "weak": weak_eps, "strong": LOCAL_STRONG_EPSILON,
         "fixed": {**common["fixed"], "sensitivity": sens, "delta": delta},
         "what": f"LocalDpMod's epsilon per round (clipping norm {C:.4g} on Δw, {clip_note}; sensitivity {sens:.4g}, "
                 f"delta {delta:g}); probed as dp_gaussian where: client, max_norm {max_norm:.4g}, noise multiplier "
                 "sqrt(2 ln(1.25/delta)) x sensitivity / (epsilon x clipping norm)",
         "configure": local_config, "set": sets(local_config), "start": start("local", "local_epsilon"),
         "epsilon": local_epsilon,
         "row": {"tie_break": -3, "scale": "log", "is_dp": True, "flower_class": LOCAL, "flower_where": where[LOCAL]}},
        {**common, "name": CLIENT_FIXED, "param": "noise_multiplier", "weak": 1e-3, "strong": 10.0,
         "what": f"Flower's central-DP noise multiplier (clipping norm {C:.4g} on Δw, {clip_note}; noise std sigma x "
                 f"clipping norm / {clients} on the mean); probed as dp_gaussian where: server, max_norm {max_norm:.4g}",
         "configure": client_fixed_config, "set": sets(client_fixed_config),
         "start": start("client-fixed", "noise_multiplier"), "epsilon": central_epsilon,
         "row": {"tie_break": -2, "scale": "log", "is_dp": True, "flower_class": CLIENT_FIXED,
                 "flower_where": where[CLIENT_FIXED],
                 "server_sees": "each client's update clipped to the norm, without noise (the noise goes on the mean)"}},
        {**common, "name": SERVER_FIXED, "param": "noise_multiplier", "weak": 1e-3, "strong": 10.0,
         "what": f"Flower's central-DP noise multiplier (the server clips each reply to {C:.4g} on Δw, {clip_note}, and "
                 f"noises the mean: std sigma x clipping norm / {clients}); probed with Flower's own wrapper "
                 "(fl.engine: flower, fl.flower.dp: server-fixed, float64 weight replies)",
         "configure": server_fixed_config, "set": sets(server_fixed_config),
         "start": start("server-fixed", "noise_multiplier"), "epsilon": central_epsilon,
         "row": {"tie_break": -1, "scale": "log", "is_dp": True, "flower_class": SERVER_FIXED,
                 "flower_where": where[SERVER_FIXED],
                 "server_sees": "every raw update (the server clips and noises after receiving it)"}},
    ]


def flower_setting(row: dict, algorithm: str, lr: float, delta: float) -> dict | None:
    """How to apply an advice row's defense at its strength (the strong end when nothing stopped) in a Flower app:
    the class, its parameters and a line of code."""
    value = row.get("strength", (row.get("bracket") or [None, None])[1])
    cls = row.get("flower_class")
    fx = row.get("fixed") or {}
    if cls == LOCAL:
        params = {"clipping_norm": fx["clipping_norm"], "sensitivity": fx["sensitivity"], "epsilon": value,
                  "delta": fx["delta"]}
        return {"class": cls, "module": "flwr.clientapp.mod", "params": params, "where": row["flower_where"],
                "code": f"ClientApp(mods=[LocalDpMod({_kw(params)})])"}
    if cls in (CLIENT_FIXED, SERVER_FIXED):
        params = {"noise_multiplier": value, "clipping_norm": fx["clipping_norm"], "num_sampled_clients": fx["clients"]}
        code = f"GradleakStrategy({cls}(FedAvg(...), {_kw(params)}), ...)"
        if cls == CLIENT_FIXED:
            code += "; ClientApp(mods=[fixedclipping_mod])"
        return {"class": cls, "module": "flwr.serverapp.strategy", "params": params, "where": row["flower_where"],
                "code": code}
    cfg = row.get("config") or {}
    if row.get("stage") == "update" and cfg.get("defenses"):
        return {"class": "gradleak.integrations.flower.defense_mod", "params": {"defenses": cfg["defenses"]},
                "where": "the ClientApp's mods",
                "code": f"ClientApp(mods=[defense_mod({json.dumps(cfg['defenses'])}, algorithm={algorithm!r}, lr={lr:g})])"}
    if row.get("stage") == "fl":
        return {"class": "SecAggPlusWorkflow + secaggplus_mod", "params": {"clients": value},
                "where": "Flower's secure aggregation (SecAgg+): SecAggPlusWorkflow on the ServerApp, secaggplus_mod "
                         "in the ClientApp's mods; GradleakStrategy(..., secure_aggregation=True) then records only "
                         "the sum", "code": f"at least {value} clients summed per round"}
    if row.get("stage") == "training":
        return {"class": "the clients' training step", "params": dict(cfg.get("defense") or {}),
                "where": "inside the ClientApp's train function (a training-time defense, no Flower mod)",
                "code": "the clients train as the gradleak config with " + " ".join(row.get("set") or [])}
    return None


def _kw(params: dict) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def fitted_clip(rec, lr: float) -> tuple[float, str]:
    """The clipping norm on Δw fitted to the audited round: the median of the replies' ‖Δw‖ = lr · ‖update‖."""
    from gradleak.defenses.base import median_clip

    norms = [lr * u.norm() for u in rec.updates]
    med = median_clip(norms) if norms and all(math.isfinite(n) and n > 0 for n in norms) else None
    if med is None:
        raise BadInput("advise", f"round {rec.server_round}'s updates have no finite non-zero norm to fit Flower's "
                       "clipping norm to.", "set fl.flower.clipping_norm (with fl.flower.dp) in the config.")
    what = "the aggregate's" if rec.aggregated else f"the {len(norms)} replies'"
    return med, (f"fitted: the median of {what} ‖Δw‖ in round {rec.server_round} "
                                 f"({', '.join(f'{n:.3g}' for n in norms)})")


def round_advice(audit, rec, result: dict, rdir) -> dict | None:
    """The advice for the round ``rec`` that ``audit`` (a :class:`~gradleak.integrations.flower.FlowerAudit` with
    ``advise=``) just judged into ``result``, or None when an earlier round's advice already covers every attack
    leaking here. Probes go to ``audit.out/advise/`` (resumable: a rerun redoes no finished probe); the plot and the
    advice page to ``rdir``."""
    from gradleak.evaluation.levels import LEAKING
    from gradleak.run.advise import advise
    from gradleak.run.advise_options import DELTA
    from gradleak.run.advise_report import plot_panels
    from gradleak.run.audit import run_audit

    opts = audit.advise_opts
    covered = audit.advice_covered  # the attacks an earlier round's advice searched for (None: no advice yet)
    if covered is not None and audit.truth is None:
        return None
    base = copy.deepcopy(audit.raw)
    base.pop("audit", None)
    basis = f"the audit of round {rec.server_round} (the clients' own data)"
    source = result
    if audit.truth is None:  # no ground truth on the server: which attacks leak is measured on the simulated federation
        audit.log("[flower audit] no ground truth: measuring which attacks leak on the config's simulated federation")
        source = run_audit(base, audit.out / "advise" / "simulated", [], str(audit.device),
                           only=[n for n, _ in audit.plans], log=lambda m: None, workers=opts["workers"])
        basis = ("an audit of the config's simulated federation (same model, PEFT, data source and shape, threat): the "
                 "server has no ground truth")
    leaking = [e["name"] for e in source["attacks"] if e.get("level") in LEAKING]
    if covered is not None and set(leaking) <= covered:
        return None
    audit.advice_covered = (covered or set()) | set(leaking)
    cfg = audit.cfg
    lr = cfg.fl.lr_at(rec.server_round - 1)
    extra, clip, clip_note = [], None, ""
    if leaking:
        clip, clip_note = fitted_clip(rec, lr)
        coords = sum(int(t.numel()) for t in rec.updates[0].tensors.values())
        extra = flower_candidates(base, clip=clip, lr=lr, clients=cfg.fl.clients, coordinates=coords, delta=DELTA,
                                  clip_note=clip_note)
    audit.log(f"[flower audit] round {rec.server_round}: searching the weakest defense that stops "
              + (", ".join(leaking) or "nothing (no leak)"))
    adv = advise(base, audit.out, source, device=str(audit.device), workers=opts["workers"], budget_seconds=opts["budget"],
                 candidates=opts["candidates"], steps=opts["steps"], log=audit.log, extra=extra,
                 batches=opts.get("batches"))
    adv["basis"] = basis
    adv["server_round"] = rec.server_round
    if clip is not None:
        adv["clipping_norm"] = {"value": clip, "how": clip_note, "lr": lr}
    if cfg.fl.lr_step_rounds:
        adv["lr_note"] = (f"the lr decays (fl.lr_step_rounds): Flower's clipping norm on Δw maps to gradleak's "
                          f"max_norm = norm / lr at round {rec.server_round}'s lr {lr:g} only")
    specs = {s["name"]: s for s in extra}
    for row in adv["rows"]:
        row.pop("tie_break", None)
        spec = specs.get(row["defense"])
        if spec is not None and "epsilon" not in row and row.get("status") == "not_stopped":
            # what the mechanism guarantees at the strength that still leaves the leak (its strong end)
            row.update(spec["epsilon"](spec["strong"], cfg.fl.rounds))
            row["epsilon_note"] = f"at the strong end {spec['param']} = {spec['strong']:g}: " + row["epsilon_note"]
        if row.get("server_sees"):
            row["note"] = "; ".join(x for x in (row.get("note"), "the server receives " + row["server_sees"]) if x)
        setting = flower_setting(row, cfg.fl.algorithm, lr, DELTA)
        if setting is not None:
            if row.get("flower_class") and cfg.fl.flower.reply == "update":
                setting["requires"] = ("the clients reply with their new weights: Flower's DP mechanisms clip the "
                                       "weight change, and this federation's clients reply with their update "
                                       "(fl.flower.reply: update)")
            row["flower"] = setting
    rec_ = adv.get("recommendation")
    if rec_ is not None:
        row = next(r for r in adv["rows"] if r["defense"] == rec_["defense"])
        if row.get("flower"):
            rec_["flower"] = row["flower"]
            adv["sentence"] += (f" In the Flower app: {row['flower']['code']} ({row['flower']['where']}"
                                + (f"; {row['flower']['requires']}" if row["flower"].get("requires") else "") + ").")
    panels = plot_panels(adv)
    if panels:
        from gradleak.report.plots import save_privacy_utility_plot

        rdir.mkdir(parents=True, exist_ok=True)
        save_privacy_utility_plot(panels, rdir / "advice.png")
        adv["plot"] = "advice.png"
    _write_page(adv, rdir)
    audit.log(f"[flower audit] advice: {adv['sentence']}")
    return adv


def _write_page(adv: dict, rdir) -> None:
    """``rdir/advice.html``: the CLI report's advice section (table, recommendation, plot) on its own page."""
    import html

    from gradleak.report.html import write_atomic
    from gradleak.run.audit_report import advice_section

    rdir.mkdir(parents=True, exist_ok=True)
    title = f"gradleak advice, Flower round {adv.get('server_round')}"
    write_atomic(rdir / "advice.html",
        f"<!doctype html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title></head><body>"
        f"<h1>{html.escape(title)}</h1><p>Basis: {html.escape(adv.get('basis', ''))}.</p>"
        + advice_section(adv) + "</body></html>")
