"""``gradleak audit``: every registered attack against one federated PEFT setup, and a verdict with evidence.

The audit config is an ordinary experiment config (``experiment``, ``model``, ``peft``, ``data``, ``fl``,
``defenses``, ``threat``) whose ``attack`` section, if any, is ignored: the audit tries every attack in the
registry with its default parameters, so an attack registered later appears without touching this module. An
optional ``audit:`` section overrides an attack's parameters (``params: {<attack>: {...}}``, a quick audit) and
runs every attack on several seeds (``seeds: [0, 1, 2]``): the entry then reports the worst (most leaking) run as
its evidence, with the median and the range of the headline metric and the per-seed results.

Applicability is the pipeline's own gate (:func:`gradleak.experiments.validate`): an attack is applicable when
the config with ``attack.name`` set to it validates. When it is refused only because the threat model withholds
a *server capability* (``malicious``, ``prescribes_architecture``, ``public_data``: what a dishonest server can
take for itself), the audit runs it again under the smallest such upgrade and records that threat -- that is
what makes the verdict "leaks only under a malicious server" possible. Refusals for other reasons (modality,
PEFT kind, facts of the deployment such as leaked sequence lengths or individual updates) are reported with the
gate's own message.

Success, per reconstruction kind (thresholds stated in the report and in ``audit.json``):

* images -- a private image reconstructed at PSNR >= ``metrics.psnr_threshold_db`` (default 30 dB);
* patches (PEFTLeak) -- private image patches recovered, their median PSNR >= the same threshold;
* token sequences -- a private sentence reconstructed word for word;
* membership -- TPR at 1 % FPR >= 0.1 (ten times chance at that false-positive rate);
* leakage (BN-aware inversion) -- the high-risk client's RDLV lower bound above 0 (reconstructions closer to the
  client's images than the prior image is).

Verdict: ``leaks`` when an attack succeeds under the configured threat; ``leaks_malicious_only`` when only an
upgraded one does; ``no_attack_succeeded`` otherwise (evidence, not proof).
"""

from __future__ import annotations

import copy
import hashlib
import html
import json
import time
from pathlib import Path
from typing import Any, Callable

from gradleak.errors import BadInput

#: threat flags a dishonest server can grant itself (the upgrade the audit tries); other flags are deployment facts
SERVER_CAPABILITIES = ("malicious", "prescribes_architecture", "public_data")
TPR_THRESHOLD = 0.1


def _attack_names() -> list[str]:
    from gradleak.registry import ATTACKS, load_all

    load_all()  # every attack module registers itself: later families appear here untouched
    return ATTACKS.names()


def _candidate(raw: dict, name: str, threat: dict | None = None) -> dict:
    """The run config of one attack: the setup, ``attack.name`` and the attack's defaults, plus any
    ``audit.params.<attack>`` the audit config gives (e.g. fewer steps for a quick audit)."""
    cand = copy.deepcopy(raw)
    extra = ((cand.pop("audit", None) or {}).get("params") or {}).get(name) or {}
    cand["attack"] = {"name": name, **extra}
    if threat is not None:
        cand["threat"] = threat
    return cand


def _upgrade(raw: dict, name: str) -> dict | None:
    """The smallest threat upgrade (server capabilities only) the attack needs, or None if it needs more."""
    from gradleak.registry import ATTACKS

    A = ATTACKS.get(name)
    try:
        need = dict(A.requires())
    except Exception:  # noqa: BLE001 -- an attack whose requirements depend on its config: no upgrade
        return None
    threat = dict(raw.get("threat") or {})
    if need.get("malicious"):
        threat["preset"] = "malicious"
    elif need.get("prescribes_architecture") and threat.get("preset", "honest-but-curious") == "honest-but-curious":
        threat["preset"] = "prescribes-architecture"
    if need.get("public_data"):
        threat["public_data"] = True
    return threat if threat != dict(raw.get("threat") or {}) else None


def _total(cfg) -> int:
    return int(cfg.data.batch_size) * int(getattr(cfg.fl, "clients", 1) or 1) * int(cfg.trials or 1)


def judge(kind: str, metrics: dict, cfg) -> dict:
    """Success and the headline metric of one attack's run (see the module docstring for the thresholds)."""
    m = metrics
    if kind == "images":
        n = int(m.get("images_above_threshold", 0))
        return {"success": n > 0, "n_success": n, "n_total": _total(cfg), "metric": "psnr",
                "value": m.get("psnr"), "criterion": f"PSNR >= {cfg.metrics.psnr_threshold_db:g} dB"}
    if kind == "patches":  # PEFTLeak: exact patches; an image counts through its recovered patches
        thr = cfg.metrics.psnr_threshold_db
        total = int(m.get("num_true_patches", 0))
        ok = m.get("recovered_patch_psnr_median", 0) >= thr
        n = int(round(m.get("patch_recovery_rate", 0.0) * total)) if ok else 0
        return {"success": n > 0, "n_success": n, "n_total": total, "unit": "image patches", "metric": "psnr",
                "value": m.get("psnr"), "criterion": f"patch PSNR >= {thr:g} dB (median of the recovered patches)"}
    if kind == "token_sequences":
        n = int(m.get("sentences_exact", 0))
        return {"success": n > 0, "n_success": n, "n_total": _total(cfg), "metric": "rouge1",
                "value": m.get("rouge1"), "criterion": "sentence reconstructed word for word"}
    if kind == "membership":
        tpr = m.get("tpr_at_1pct_fpr")
        ok = tpr is not None and tpr == tpr and tpr >= TPR_THRESHOLD
        return {"success": bool(ok), "n_success": None, "n_total": None, "metric": "tpr_at_1pct_fpr", "value": tpr,
                "auc": m.get("auc"), "criterion": f"TPR at 1 % FPR >= {TPR_THRESHOLD:g}"}
    if kind == "leakage":
        low = m.get("rdlv_high_risk_client_low")
        ok = low is not None and low == low and low > 0
        return {"success": bool(ok), "n_success": None, "n_total": None, "metric": "rdlv_high_risk_client",
                "value": m.get("rdlv_high_risk_client"), "criterion": "RDLV lower bound > 0 (closer than the prior)"}
    return {"success": False, "n_success": None, "n_total": None, "metric": None, "value": None,
            "criterion": f"no success rule for '{kind}'"}


def leak_rank(j: dict) -> tuple:
    """Order judged runs by how much they leak (success, samples reconstructed, headline value; nan last): the
    worst case for the client is the evidence."""
    v = j.get("value")
    return (bool(j["success"]), j.get("n_success") or 0, v if isinstance(v, (int, float)) and v == v else -1e300)


def config_hash(raw: dict) -> str:
    return hashlib.sha256(json.dumps(raw, sort_keys=True, default=str).encode()).hexdigest()[:16]


def run_audit(raw: dict, out_dir: str | Path, overrides: list[str] | None = None, device: str | None = None,
              only: list[str] | None = None, command: str = "", log: Callable[[str], Any] = print,
              workers: int = 1) -> dict:
    """Run the audit of ``raw`` (+ ``overrides``) into ``out_dir``: ``audit.json`` + ``report.html``.
    ``workers`` > 1 runs the applicable attacks in a spawned process pool (one torch thread each)."""
    from gradleak.experiments.config import apply_overrides
    from gradleak.experiments.results import environment
    from gradleak.experiments.runner import check_out_dir, validate
    from gradleak.experiments.schema import ExperimentConfig
    from gradleak.registry import ATTACKS

    out = check_out_dir(out_dir)
    raw = apply_overrides(copy.deepcopy(raw), overrides or [], ExperimentConfig) if overrides else copy.deepcopy(raw)
    names = _attack_names()
    if only:
        bad = sorted(set(only) - set(names))
        if bad:
            raise BadInput("--only", f"unknown attack(s) {', '.join(bad)}.", f"choose from {', '.join(names)}.")
        names = [n for n in names if n in only]
    # the setup itself must be valid: validate it with the first attack the gate accepts (or report the first error)
    base_err = None
    entries, planned = [], []
    t_all = time.perf_counter()
    for name in names:
        A = ATTACKS.get(name)
        summary = next((x.summary for x in ATTACKS if x.name == name), "")
        entry: dict[str, Any] = {"name": name, "description": summary, "reconstruction": A.reconstruction,
                                 "applicable": False}
        cand, threat_used = _candidate(raw, name), "configured"
        try:
            _, cfg = validate(cand)
        except BadInput as err:
            up = _upgrade(raw, name) if err.field.startswith("threat") else None
            if up is not None:
                try:
                    cand = _candidate(raw, name, up)
                    _, cfg = validate(cand)
                    threat_used = "upgraded"
                    entry["upgrade"] = up
                except BadInput as err2:
                    entry["reason"] = str(err2)
                    entries.append(entry)
                    continue
            else:
                entry["reason"] = str(err)
                base_err = base_err or err
                entries.append(entry)
                continue
        entry.update({"applicable": threat_used == "configured", "applicable_under": threat_used,
                      "threat": cfg.threat_model.capability})
        if threat_used == "upgraded":
            entry["reason"] = (f"needs a stronger server than configured ({cfg.threat_model.capability}"
                               f"{', public data' if cfg.threat_model.public_data else ''}); run under that upgrade")
        planned.append((entry, cand, cfg, A))
        entries.append(entry)
    # run the applicable attacks (x the audit's seeds): in this process (workers=1) or a spawned pool
    seeds = list(((raw.get("audit") or {}).get("seeds")) or [raw.get("seed", 0)])
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in seeds):
        raise BadInput("audit.seeds", f"must be a list of integers, got {seeds!r}.", "write e.g. audit: {seeds: [0, 1, 2]}.")
    multi = len(seeds) > 1

    def where(name, sd):
        return f"attacks/{name}" + (f"/seed{sd}" if multi else "")

    jobs = [(f"{e['name']}@{sd}", {**cand, "seed": sd}, str(out / where(e["name"], sd)), device)
            for e, cand, _, _ in planned for sd in seeds]
    for e, _, cfg, _ in planned:
        log(f"[audit] {e['name']}: running under the {e['applicable_under']} threat ({cfg.threat_model.capability})"
            + (f", seeds {seeds}" if multi else ""))
    results = dict(_run_all(jobs, workers, log))
    for entry, cand, cfg, A in planned:
        name = entry["name"]
        runs = [(sd, results[f"{name}@{sd}"]) for sd in seeds]
        entry["seconds"] = sum(r.get("seconds", 0.0) for _, r in runs)
        bad = next((r for _, r in runs if "bad_input" in r), None)
        if bad is not None:  # refused once the data/model are known (e.g. a generator shape)
            entry.update({"applicable": False, "applicable_under": None, "reason": bad["bad_input"]})
            continue
        err = next((r for _, r in runs if "error" in r), None)
        if err is not None:  # one attack's crash must not lose the others' results
            entry.update({"failed": err["error"], "reason": f"the run failed: {err['error']}"})
            log(f"[audit] {name}: FAILED ({err['error']})")
            continue
        judged = [(sd, r, judge(A.reconstruction, r["metrics"], cfg)) for sd, r in runs]

        sd, res, j = max(judged, key=lambda t: leak_rank(t[2]))  # the most leaking run is the evidence
        entry["out"] = where(name, sd)
        entry.update(j)
        vals = [t[2].get("value") for t in judged if isinstance(t[2].get("value"), (int, float))
                and t[2]["value"] == t[2]["value"]]
        if multi:
            entry["per_seed"] = [{"seed": t[0], "success": t[2]["success"], "value": t[2].get("value"),
                                  "n_success": t[2].get("n_success")} for t in judged]
            entry["worst_seed"] = sd
            if vals:
                srt = sorted(vals)
                entry["median"] = srt[len(srt) // 2] if len(srt) % 2 else 0.5 * (srt[len(srt) // 2 - 1] + srt[len(srt) // 2])
                entry["spread"] = [srt[0], srt[-1]]
        v = entry.get("value")
        if isinstance(v, float) and v != v:  # nan: the run could not measure its headline (e.g. too few candidates)
            entry["undefined"] = True
            entry["reason"] = (f"{entry['metric']} is undefined (nan) for this setup: the run measured nothing "
                               "(for membership: too few members / non-members); not evidence either way")
        entry["metrics"] = {k: v for k, v in res["metrics"].items() if isinstance(v, (int, float))}
        entry["artifacts"] = [a for a in res.get("artifacts", []) if str(a).endswith(".png")]
        entry["evidence_rows"] = _evidence_rows(res)
        warns = (res.get("details") or {}).get("warnings") or []
        if warns:
            entry["warnings"] = [str(w) for w in warns]
            entry["reason"] = "; ".join(([entry["reason"]] if entry.get("reason") else []) + entry["warnings"][:2])
        log(f"[audit] {name}: {'SUCCESS' if entry['success'] else 'no success'} "
            f"({entry['metric']} = {entry['value']}" + (f", worst of seeds {seeds}, median {entry.get('median')}"
                                                         if multi else "") + f", {entry['seconds']:.0f} s)")
    ran = [e for e in entries if "success" in e]
    if not ran and base_err is not None:
        raise base_err
    verdict, headline = _verdict(entries)
    _, shown = validate(_candidate(raw, next(e["name"] for e in ran)) if ran else _candidate(raw, names[0]))
    result = {"verdict": verdict, "headline": headline, "attacks": entries,
              "thresholds": {"psnr_db": shown.metrics.psnr_threshold_db, "text": "exact sentence",
                             "membership_tpr_at_1pct_fpr": TPR_THRESHOLD, "leakage": "RDLV lower bound > 0"},
              "setup": describe_setup(shown), "threat": shown.threat_model.describe(),
              "config": raw, "config_hash": config_hash(raw), "command": command,
              "seed": shown.seed, "environment": environment(), "seconds": time.perf_counter() - t_all,
              "not_tested": [f"{e['name']}: {e['reason']}" for e in entries if "success" not in e]}
    from gradleak.experiments.results import write_json_atomic

    write_json_atomic(out / "audit.json", result)
    write_audit_report(result, out)
    return result


def run_audit_grid(raw: dict, out_dir: str | Path, overrides: list[str] | None = None, device: str | None = None,
                   only: list[str] | None = None, command: str = "", log: Callable[[str], Any] = print,
                   workers: int = 1, yes: bool = False) -> dict:
    """An audit per cell of the config's ``grid:`` (e.g. defense strengths) into ``OUT/cells/<cell>/``; resumable
    (a cell whose ``audit.json`` exists is not redone); ``OUT/audit_grid.json`` lists each cell's verdict."""
    from gradleak.experiments.results import write_json_atomic
    from gradleak.experiments.runner import check_out_dir
    from gradleak.experiments.sweep import MAX_CELLS, _safe, cell_config, expand_grid

    out = check_out_dir(out_dir)
    base, cells = expand_grid(raw)
    if len(cells) > MAX_CELLS and not yes:
        raise BadInput("grid", f"{len(cells)} cells exceed the limit of {MAX_CELLS} for one audit grid.",
                       "shrink the grid, or pass --yes.")
    rows = []
    for i, (cid, a) in enumerate(cells):
        d = out / "cells" / _safe(cid)
        if (d / "audit.json").exists():
            res = json.loads((d / "audit.json").read_text())
            log(f"[audit grid] {cid}: done before ({res['verdict']})")
        else:
            log(f"[audit grid] cell {i + 1}/{len(cells)}: {cid}")
            res = run_audit(cell_config(base, a), d, overrides, device, only=only, command=command, log=log,
                            workers=workers)
        rows.append({"cell": cid, "assign": a, "verdict": res["verdict"], "headline": res["headline"],
                     "out": str(d.relative_to(out))})
    summary = {"cells": rows, "command": command}
    write_json_atomic(out / "audit_grid.json", summary)
    return summary


def _run_one(name: str, cand: dict, out_dir: str, device: str | None) -> dict:
    """One attack's run (in this process or a worker); errors come back as values (they must cross processes)."""
    from gradleak.experiments import runner

    t0 = time.perf_counter()
    try:
        res = runner.run_config(cand, out_dir, device=device)
    except BadInput as err:
        return {"bad_input": str(err), "seconds": time.perf_counter() - t0}
    except Exception as err:  # noqa: BLE001
        return {"error": f"{type(err).__name__}: {err}", "seconds": time.perf_counter() - t0}
    return {"metrics": res.get("metrics", {}), "artifacts": res.get("artifacts", []),
            "details": {"warnings": (res.get("details") or {}).get("warnings", []),
                        "trials": (res.get("details") or {}).get("trials", [])},
            "seconds": time.perf_counter() - t0}


def _run_all(jobs: list[tuple], workers: int, log: Callable[[str], Any] = print):
    """Yield (name, result) for every job as it finishes: in this process, or in a pool of ``workers`` spawned
    processes (one torch thread each) when > 1."""
    if workers <= 1 or len(jobs) <= 1:
        for name, cand, out, dev in jobs:
            yield name, _run_one(name, cand, out, dev)
        return
    from gradleak.experiments.sweep import pool_results

    for i, res in pool_results(_run_one, jobs, workers):
        if isinstance(res, Exception):  # the worker itself died
            res = {"error": f"{type(res).__name__}: {res}"}
        log(f"[audit] {jobs[i][0]}: finished ({res.get('seconds', 0):.0f} s)")
        yield jobs[i][0], res


def _evidence_rows(res: dict) -> list[dict]:
    rows = []
    for t in (res.get("details") or {}).get("trials", []) or []:
        for ref, rec in zip(t.get("references", []), t.get("reconstructions", [])):
            rows.append({"reference": ref, "reconstruction": rec})
    return rows[:16]


def _verdict(entries: list[dict]) -> tuple[str, str]:
    def order(e):
        return (-(e.get("n_success") or 0), -(e.get("value") or 0) if isinstance(e.get("value"), (int, float)) else 0)

    ok = sorted([e for e in entries if e.get("success") and e.get("applicable")], key=order)
    up = sorted([e for e in entries if e.get("success") and not e.get("applicable")], key=order)

    def words(e):
        if e.get("n_success") is not None:
            return (f"{e['n_success']} of {e['n_total']} private {e.get('unit', 'samples')} reconstructed "
                    f"({e['criterion']}) by "
                    f"{e['name']} under a {e['threat']} server")
        return f"{e['name']} succeeded ({e['criterion']}; {e['metric']} = {e['value']:.3g}) under a {e['threat']} server"

    if ok:
        return "leaks", "LEAKS: " + words(ok[0])
    if up:
        return "leaks_malicious_only", "LEAKS ONLY UNDER A STRONGER SERVER: " + words(up[0])
    n = len([e for e in entries if "success" in e])
    return "no_attack_succeeded", (f"NO ATTACK SUCCEEDED: {n} attack(s) ran with their default settings and none met "
                                   "its success threshold (evidence, not proof)")


def describe_setup(cfg) -> list[str]:
    """The configuration in plain words (who trains what, who sees what)."""
    lines = [f"model: {cfg.model.name}; PEFT: {cfg.peft.kind}; data: {cfg.data.name}, batch size {cfg.data.batch_size}",
             f"federated: {cfg.fl.algorithm}, {cfg.fl.clients} client(s), {cfg.fl.rounds} round(s)"
             + (f", {cfg.fl.local_epochs} local epoch(s)" if cfg.fl.algorithm == "fedavg" else ""),
             "secure aggregation: " + ("on -- the server sees only the sum of the updates"
                                       if getattr(cfg.fl, "secure_aggregation", False)
                                       else "off -- the server sees every client's update")]
    fl = cfg.fl
    if getattr(fl, "engine", "builtin") == "flower":
        f = fl.flower
        sees = {"none": "each client's update as sent",
                "server-fixed": "each client's raw update (Flower clips and noises on the server, after it has them)",
                "client-fixed": "each client's clipped update, without noise (the noise goes on the aggregate)",
                "local": "each client's clipped and noised update (LocalDpMod)"}[f.dp]
        lines.append(f"engine: Flower ({f.runtime}; clients reply with their {'new weights' if f.reply == 'weights' else 'update'}"
                     + (f"; Flower DP: {f.dp}, clipping norm {f.clipping_norm:g} on the weight change"
                        + (f", noise multiplier {f.noise_multiplier:g}" if f.dp != "local" else
                           f", epsilon {f.local_epsilon:g}, delta {f.local_delta:g}") if f.dp != "none" else "")
                     + f") -- the server sees {sees}")
    for d in cfg.defenses:
        p = d.params
        txt = f"defense {d.name} {json.dumps(p)}"
        if d.name == "dp_gaussian" and p.get("where") == "server":
            txt += (" -- central DP: the noise is added to the aggregate, so a server that sees individual "
                    "updates still sees them raw")
        lines.append(txt)
    if not cfg.defenses:
        lines.append("no update defense")
    return lines


def write_audit_report(result: dict, out: Path) -> Path:
    """One self-contained HTML page: verdict banner, setup, threat, per-attack table, evidence worst first."""
    e = html.escape
    colour = {"leaks": "#b00020", "leaks_malicious_only": "#b36b00", "no_attack_succeeded": "#2e7d32"}[result["verdict"]]
    rows = []
    for a in result["attacks"]:
        val = a.get("value")
        rows.append("<tr>" + "".join(f"<td>{e(str(x))}</td>" for x in (
            a["name"], "yes" if a.get("applicable") else ("under upgrade" if a.get("applicable_under") == "upgraded" else "no"),
            a.get("threat", "–"), "SUCCESS" if a.get("success") else ("undefined" if a.get("undefined") else
                                                                    ("no" if "success" in a else "not run")),
            (f"{a['metric']} = {val:.4g}" + (f" (worst of {len(a['per_seed'])} seeds; median {a['median']:.4g}, "
                                             f"range {a['spread'][0]:.4g}–{a['spread'][1]:.4g})"
                                             if a.get("per_seed") and "median" in a else ""))
            if isinstance(val, (int, float)) else "–",
            f"{a['n_success']} / {a['n_total']}" if a.get("n_success") is not None else "–",
            f"{a['seconds']:.0f} s" if "seconds" in a else "–", a.get("reason", ""))) + "</tr>")
    evidence = []
    ran = sorted([a for a in result["attacks"] if "success" in a], key=lambda a: (not a["success"], a["name"]))
    for a in ran:
        parts = [f"<h3>{e(a['name'])} — {'SUCCESS' if a['success'] else 'no success'} ({e(a['criterion'])})</h3>"]
        for img in a.get("artifacts", []):
            parts.append(f'<figure><img src="{e(a["out"])}/{e(img)}" alt="{e(img)}" style="max-width:100%">'
                         f"<figcaption>{e(img)}</figcaption></figure>")
        if a.get("evidence_rows"):
            tr = []
            for r in a["evidence_rows"]:
                exact = r["reference"].lower().split() == str(r["reconstruction"]).lower().split()
                style = ' style="background:#ffd6d6"' if exact else ""
                tr.append(f"<tr{style}><td>{e(r['reference'])}</td><td>{e(str(r['reconstruction']))}</td>"
                          f"<td>{'exact' if exact else ''}</td></tr>")
            parts.append("<table><tr><th>private</th><th>reconstruction</th><th></th></tr>" + "".join(tr) + "</table>")
        parts.append(f'<p><a href="{e(a["out"])}/report.html">full report of this attack</a></p>')
        evidence.append("\n".join(parts))
    th = result["thresholds"]
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>gradleak audit</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;vertical-align:top}}.banner{{color:#fff;background:{colour};padding:1em;font-size:1.2em}}</style>
</head><body>
<div class="banner" id="verdict">{e(result['headline'])}</div>
<p>Thresholds: images PSNR &ge; {th['psnr_db']:g} dB; text: {e(th['text'])}; membership: TPR at 1 % FPR &ge;
{th['membership_tpr_at_1pct_fpr']:g}; leakage: {e(th['leakage'])}. Every attack ran with its default settings.</p>
<h2>Configuration</h2><ul>{''.join(f'<li>{e(x)}</li>' for x in result['setup'])}</ul>
<h2>Threat model (configured)</h2><ul>{''.join(f'<li>{e(x)}</li>' for x in result['threat'])}</ul>
<h2>Attacks</h2><table id="attacks"><tr><th>attack</th><th>applicable</th><th>threat</th><th>result</th><th>headline</th>
<th>samples</th><th>time</th><th>note</th></tr>{''.join(rows)}</table>
<h2>Evidence (successes first)</h2>{''.join(evidence) or '<p>no attack ran</p>'}
<h2>Reproducibility</h2><ul><li>command: <code>{e(result['command'])}</code></li>
<li>config hash: {e(result['config_hash'])}; seed: {e(str(result['seed']))}</li>
<li>versions: {e(json.dumps(result['environment']))}</li>
<li>not tested: {e('; '.join(result['not_tested']) or 'nothing')}</li></ul>
<script>/* a real browser marks how many evidence images decoded (the headless check reads it) */
window.addEventListener("load", function () {{
  var imgs = Array.from(document.images), ok = imgs.filter(function (i) {{ return i.complete && i.naturalWidth > 0; }});
  document.body.setAttribute("data-images", ok.length + "/" + imgs.length);
  document.body.setAttribute("data-tables", String(document.querySelectorAll("table").length));
}});</script>
</body></html>"""
    from gradleak.report.html import _write_atomic

    path = out / "report.html"
    _write_atomic(path, page)
    return path
