"""``gradleak audit``: every registered attack against one federated PEFT setup, and a verdict with evidence.

The audit config is an ordinary experiment config (``experiment``, ``model``, ``peft``, ``data``, ``fl``,
``defenses``, ``threat``) whose ``attack`` section, if any, is ignored: the audit tries every attack in the
registry with its default parameters, so an attack registered later appears without touching this module. An
optional ``audit:`` section overrides an attack's parameters (``params: {<attack>: {...}}``, a quick audit) and
runs every attack on several seeds (``seeds: [0, 1, 2]``): the entry then reports the worst (most leaking) run as
its evidence, with the median and the range of the headline metric and the per-seed results.

Applicability is the pipeline's own gate (:func:`gradleak.run.validate`): an attack is applicable when
the config with ``attack.name`` set to it validates. When it is refused only because the threat model withholds
a *server capability* (``malicious``, ``prescribes_architecture``, ``public_data``: what a dishonest server can
take for itself), the audit runs it again under the smallest such upgrade and records that threat -- that is
what makes the verdict "leaks only under a malicious server" possible. Refusals for other reasons (modality,
PEFT kind, facts of the deployment such as leaked sequence lengths or individual updates) are reported with the
gate's own message. An attack the gate accepts but that cannot measure anything in this architecture
(:meth:`AttackBase.measurable`: DAGER on a frozen backbone) is not applicable, with its reason, and is not run.
When no attack can run, the audit exits 2 with the error that concerns the setup (:func:`setup_error`: the refusal
the attacks meant for this modality and PEFT kind share, else each one's); an error found once the data and model
load (a split larger than the data) ends the same way when every planned run was refused
(:func:`runtime_setup_error`), and ``--out`` keeps nothing of the audit.

Levels, per reconstruction kind (:mod:`gradleak.evaluation.levels`; each beyond a null computed the same way as
the attack's score, :mod:`gradleak.evaluation.nulls`): ``exact`` / ``strong`` / ``partial`` / ``none`` /
``undefined``. Every client of the audited round is attacked (``metrics.attack_clients: all``) and the worst client
is the evidence. Each attack runs at full strength: besides its configured parameters, the audit runs the
variants the attack declares from the declared defenses (:meth:`AttackBase.audit_variants`: UTR's noise mode and
tolerances, lora_span's rank cut) and keeps the most leaking run.

Verdict: ``leaks`` when an attack reaches ``partial`` or more under the configured threat;
``leaks_stronger_server`` when only an upgraded server's does; ``no_leak_found`` otherwise (evidence, not proof).
An attack that crashed or measured nothing is ``undefined`` and listed as such, never counted as "ran".

What the report says is what decided (docs/ARCHITECTURE.md, "gradleak audit"): each entry's ``decided_by`` is the
metric whose test gave the level, with its own null and p-value, and the banner shows it; under secure aggregation
over N > 1 clients the evidence is credited to "the sum of N clients"; a warning stays with the run and client it
came from (``run_warnings``), the evidence shows only its own; ``--only`` checks the attacks it leaves out with the
gate (validation only): ``not_tested`` and the banner name those that apply here, ``not_applicable`` those that
never could.

This module orchestrates (:func:`run_audit`: plan, run every job through the one resumable cell loop, judge, write;
the DP check's job; the audit grid). Each role has its own module, and the names callers use stay importable here:
planning -- :mod:`gradleak.run.audit_plan` (candidate configs, the gate, full-strength variants, the setup's error);
judging -- :mod:`gradleak.run.audit_judge` (a client's level, an attack's entry, the verdict); the runs on disk --
:mod:`gradleak.run.audit_ledger` (folders, keys, the ledger); wording -- :mod:`gradleak.run.audit_words` (the setup
in words, the command, the report's context) and :mod:`gradleak.run.audit_report` (console and HTML). The level rules
and every per-kind decision are the evaluation units' (:class:`gradleak.evaluation.base.EvaluationUnit`).
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any, Callable

from gradleak.errors import BadInput
from gradleak.evaluation.levels import leak_rank  # noqa: F401 -- the audit's API too (one home)
from gradleak.run.answer import client_metric_sets, server_words  # noqa: F401 -- the audit's API too (one home)
from gradleak.run.audit_judge import (  # noqa: F401 -- the audit's public API; its home is the judging module
    client_row, headline_metric, judge, judge_attack, leakage_margin, record_failures, verdict_and_headline)
from gradleak.run.audit_ledger import (  # noqa: F401 -- the audit's public API; its home is the runs' ledger
    RUN_LEDGER, config_hash, discard_failed_audit, remove_stale_audit, reusable_runs, run_folder, run_key)
from gradleak.run.audit_plan import (  # noqa: F401 -- the audit's public API; its home is the planning module
    attack_names, audit_overrides, candidate, full_strength_variants, gate_attack, left_out_split, plan_audit,
    refusal, runtime_setup_error, shared_runs)
from gradleak.run.audit_report import write_audit_report
from gradleak.run.audit_words import (  # noqa: F401 -- the audit's public API; its home is the wording module
    audit_command, describe_setup, report_context)

#: torch's once-per-process "Overriding a previously registered kernel" warning block (a kernel registration in a
#: dependency, harmless to the run): each spawned audit worker would print it again, so the runs silence it alone
KERNEL_OVERRIDE_WARNING = r"(?s).*Overriding a previously registered kernel"


def check_workers(workers) -> None:
    """``--workers``: a whole number >= 1 (1: in this process; more: a spawned pool, one torch thread each)."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise BadInput("--workers", f"must be a whole number >= 1, got {workers!r}.",
                       "use --workers 1 (in this process) or more (parallel attacks).")


def plan_variants(planned: list, raw: dict, log: Callable[[str], Any] = print) -> dict[str, list[dict]]:
    """``{attack: its parameter sets}`` (:func:`full_strength_variants`), each also on its entry (``variants``); the
    parameters the user set run as set (the first run), and the log says so, so a variant's headline is not a
    surprise."""
    defenses = list(raw.get("defenses") or [])
    variants: dict[str, list[dict]] = {}
    for e, cand, cfg, A in planned:
        vs = full_strength_variants(A, cand, cfg, defenses)
        user = {k: v for k, v in cand["attack"].items() if k != "name"}
        if user:
            e["parameters_set"] = user
            log(f"[audit] {e['name']}: runs with {', '.join(f'{k}={v}' for k, v in user.items())} as set"
                + (f", and {len(vs) - 1} full-strength variant(s) ({', '.join(sorted({k for v in vs for k in v}))}); "
                   "the most leaking run is the evidence" if len(vs) > 1 else ""))
        variants[e["name"]] = vs
        e["variants"] = vs
    return variants


def attack_jobs(planned: list, shared: dict, seeds: list[int], variants: dict[str, list[dict]], out: Path,
                device: str | None) -> list[tuple]:
    """The ``(job, run config, folder, device)`` of every run the audit makes: each planned attack not judged on
    another's run (``shared``), on each seed, with each of its parameter sets; the job id is
    ``<attack>@<seed>#<variant>``."""
    multi = len(seeds) > 1
    return [(f"{e['name']}@{sd}#{k}", {**cand, "attack": {**cand["attack"], **v}, "seed": sd},
             str(out / run_folder(e["name"], sd, k, multi)), device)
            for e, cand, _, _ in planned if e["name"] not in shared
            for sd in seeds for k, v in enumerate(variants[e["name"]])]


def attack_runs(name: str, src: str, results: dict[str, dict], seeds: list[int], n_variants: int) -> list[tuple]:
    """``(seed, variant, result)`` of every run of attack ``name``, read from ``src``'s jobs (its own, or the attack
    whose runs it shares)."""
    return [(sd, k, results[f"{src}@{sd}#{k}"]) for sd in seeds for k in range(n_variants)]


def audit_result(raw: dict, names: list[str], entries: list[dict], planned: list, seeds: list[int],
                 only: list[str] | None, command: str, t_all: float) -> dict:
    """``audit.json``'s content once the attacks are judged: the verdict and its banner, the entries, the report's
    context (:func:`report_context`, from one validated config of the audit), what was not tested (``--only``: the
    left-out attacks checked by the gate, validated, not run, so the banner and ``not_tested`` say which of them could
    have run here and the ones that never could are grouped apart), what was not applicable or undefined, and the
    evidence record (config, weights, split seeds and source hashes)."""
    from gradleak.run.evidence import evidence_record  # never raises
    from gradleak.run.runner import validate

    ran = [e for e in entries if "level" in e]
    left_out = left_out_split(raw, names) if only else {"applicable": [], "not_applicable": []}
    verdict, headline = verdict_and_headline(entries, [x["name"] for x in left_out["applicable"]])
    shown_cand = next((c for e, c, _, _ in planned if e in ran), planned[0][1] if planned else None)
    _, shown = validate(shown_cand if shown_cand is not None else candidate(raw, names[0]))
    result = {"verdict": verdict, "headline": headline, "attacks": entries, **report_context(raw, shown, command),
              "seconds": time.perf_counter() - t_all,
              "not_tested": [f"{x['name']}: applicable (under {x['threat_words']}), not run: left out by --only"
                             for x in left_out["applicable"]],
              "not_applicable": [f"{e['name']}: {e['reason']}" for e in entries if "level" not in e]
                                + [f"{x['name']}: {x['reason']}" for x in left_out["not_applicable"]],
              "undefined": [f"{e['name']}: {e['reason']}" for e in entries if e.get("level") == "undefined"],
              "only": list(only) if only else None,
              "left_out_by_only": [n for n in attack_names() if n not in names] if only else [],
              "left_out": left_out}
    result["evidence_record"] = evidence_record(raw, shown, [c for _, _, c, _ in planned], seeds, command)
    return result


def run_audit(raw: dict, out_dir: str | Path, overrides: list[str] | None = None, device: str | None = None,
              only: list[str] | None = None, command: str = "", log: Callable[[str], Any] = print,
              workers: int = 1) -> dict:
    """Run the audit of ``raw`` (+ ``overrides``) into ``out_dir``: ``audit.json`` + ``report.html``.
    ``workers`` > 1 runs the applicable attacks in a spawned process pool (one torch thread each). The plan is
    :func:`plan_audit`'s, every run goes through the one resumable cell loop (:func:`_run_jobs`) and each attack is
    judged by :func:`gradleak.run.audit_judge.judge_attack`."""
    from gradleak.run.results import write_json_atomic
    from gradleak.run.runner import check_out_dir, protect_private_artifacts

    check_workers(workers)
    raw, names, entries, planned, seeds, base_err = plan_audit(raw, overrides, only)
    t_all = time.perf_counter()
    created = not Path(out_dir).exists()
    out = check_out_dir(out_dir)  # validated first, then created (stale files: removed once the runs are known)
    variants = plan_variants(planned, raw, log)
    shared = shared_runs(planned, variants)  # e.g. APRIL without a PE term to read: DLG's run, run once
    for name, (other, why) in shared.items():
        log(f"[audit] {name}: judged on {other}'s run (the same run: {why.split(': ', 1)[-1]})")
    jobs = attack_jobs(planned, shared, seeds, variants, out, device)
    for e, _, cfg, _ in planned:
        log(f"[audit] {e['name']}: running under the {e['applicable_under']} threat ({e['threat_words']})"
            + (f", seeds {seeds}" if len(seeds) > 1 else ""))
    dp_job = dp_check_job(raw, planned, out, device)
    if dp_job is not None:  # first: the longest jobs start early in a worker pool
        jobs.insert(0, dp_job)
        log("[audit] dp_check: the declared DP mechanism's claim is checked (canary clients; gradleak.run.dp_check)")
    results = _run_jobs(out, jobs, workers, log)
    for entry, cand, cfg, A in planned:
        name = entry["name"]
        src = shared[name][0] if name in shared else name  # whose runs these are
        judge_attack(entry, cfg, A.reconstruction, attack_runs(name, src, results, seeds, len(variants[name])),
                     variants[name], seeds, shared.get(name), log)
    if not any("level" in e for e in entries):
        # every planned run was refused once its data and model were known: the setup's error, exit 2
        err = runtime_setup_error(planned, results, shared, seeds, variants)
        discard_failed_audit(out, created)
        raise err
    result = audit_result(raw, names, entries, planned, seeds, only, command, t_all)
    dp = dp_check_entry(results.get(DP_JOB) if dp_job is not None else None)
    if dp is not None:
        result["dp_check"] = dp
        log(f"[audit] dp_check: {dp['verdict'].upper()} -- {dp['sentence']}")
    write_json_atomic(out / "audit.json", result)
    write_audit_report(result, out)
    protect_private_artifacts(out)
    return result


#: the job id of the DP check in the audit's cell loop (beside the attack runs; gradleak.run.dp_check)
DP_JOB = "dp_check"


_DP_KEY = "_dp_check"


def dp_check_job(raw: dict, planned: list, out: Path, device: str | None) -> tuple | None:
    """The DP check's job for :func:`_run_jobs` when the audited federation declares a DP mechanism and
    ``audit.dp_check`` is not false: the first planned run's config (its federation: model, data, clients, engine,
    rounds, defenses; the attack is not used) marked with the check's options. It runs in the same resumable cell loop
    as the attacks (in parallel with them under ``--workers``), so a rerun into the same ``--out`` reuses it."""
    from gradleak.run.dp_check import declares_dp, dp_section

    opts = dp_section((raw.get("audit") or {}).get("dp_check"))
    if opts is None or not planned or not declares_dp(planned[0][2]):
        return None
    return (DP_JOB, {**planned[0][1], _DP_KEY: opts}, str(out / "dp_check"), device)


def _run_dp_check(cand: dict, out_dir: str, device: str | None) -> dict:
    """The DP check of a marked run config (in this process or a worker), also written to ``out_dir/results.json``
    (what the ledger's reuse looks for); a crash comes back as ``error``."""
    t0 = time.perf_counter()
    try:
        from gradleak.run import dp_check as dpc
        from gradleak.run.runner import validate

        cand = dict(cand)
        opts = cand.pop(_DP_KEY)
        _, cfg = validate(cand)
        res = dpc.dp_check(cfg, device, canaries=opts["canaries"])
        from gradleak.run.results import write_json_atomic

        Path(out_dir).mkdir(parents=True, exist_ok=True)
        write_json_atomic(Path(out_dir) / "results.json", {"dp_check": res})
    except Exception as err:  # noqa: BLE001 -- a crashed check (or a BadInput) is undefined, never a pass
        return {"error": f"{type(err).__name__}: {err}", "seconds": time.perf_counter() - t0}
    return {"dp_check": res, "seconds": time.perf_counter() - t0}


def dp_check_entry(res: dict | None) -> dict | None:
    """``audit.json``'s ``dp_check`` from the job's result: the check, or ``undefined`` with the error."""
    if res is None:
        return None
    if res.get("dp_check") is not None:
        return res["dp_check"]
    return {"verdict": "undefined", "sentence": f"the DP check could not run: {res.get('error', 'no result')}"}


def run_audit_grid(raw: dict, out_dir: str | Path, overrides: list[str] | None = None, device: str | None = None,
                   only: list[str] | None = None, command: str = "", log: Callable[[str], Any] = print,
                   workers: int = 1, yes: bool = False) -> dict:
    """An audit per cell of the config's ``grid:`` (e.g. defense strengths) into ``OUT/cells/<cell>/``, one row per
    cell in ``OUT/audit_grid.jsonl`` through the one cell loop (:func:`gradleak.run.cells.run_cells`:
    resumable, a finished cell is not redone, a failed one is retried); ``OUT/audit_grid.json`` lists each cell's
    verdict. A setup the audit refuses (``BadInput``) stops the grid; a cell that still fails after its retry is
    raised once the others are done."""
    from gradleak.run.cells import Cell, cell_dir_name, error_text, run_cells
    from gradleak.run.results import write_json_atomic
    from gradleak.run.runner import check_out_dir
    from gradleak.run.sweep import MAX_CELLS, cell_config, expand_grid

    base, cells = expand_grid(raw)
    if len(cells) > MAX_CELLS and not yes:
        raise BadInput("grid", f"{len(cells)} cells exceed the limit of {MAX_CELLS} for one audit grid.",
                       "shrink the grid, or pass --yes.")
    for _, a in cells:  # every cell must plan (validate) before the folder is made or any cell runs
        plan_audit(cell_config(base, a), overrides, only)
    out = check_out_dir(out_dir)
    jobs = []
    for i, (cid, a) in enumerate(cells):
        d = out / "cells" / cell_dir_name(cid)
        jobs.append(Cell(cid, _audit_cell, (cell_config(base, a), d, overrides, device, only, command, log, workers,
                                            f"[audit grid] cell {i + 1}/{len(cells)}: {cid}"),
                         {"cell": cid, "assign": a, "out": str(d.relative_to(out))}))

    def row(cell, res, err, seconds):
        r = {"cell": cell.id, "assign": cell.info["assign"]}
        if err is not None:
            return {**r, "error": error_text(err), "out": cell.info["out"]}
        return {**r, "verdict": res["verdict"], "headline": res["headline"], "out": cell.info["out"]}

    latest = run_cells(jobs, out / "audit_grid.jsonl", row, fatal=(BadInput,), label="audit grid",
                       describe=lambda r: r["verdict"], log=log)
    rows = list(latest.values())
    summary = {"cells": rows, "command": command}
    write_json_atomic(out / "audit_grid.json", summary)
    failed = [r for r in rows if "error" in r]
    if failed:
        raise RuntimeError(f"{len(failed)} audit grid cell(s) failed (rerun to retry): "
                           + "; ".join(f"{r['cell']}: {r['error']}" for r in failed))
    return summary


def _audit_cell(raw: dict, out_dir: Path, overrides, device, only, command, log, workers, announce: str) -> dict:
    """One audit grid cell (in this process): its audit into ``out_dir``."""
    log(announce)
    return run_audit(raw, out_dir, overrides, device, only=only, command=command, log=log, workers=workers)


def _run_one(name: str, cand: dict, out_dir: str, device: str | None) -> dict:
    """One attack's run (in this process or a worker); errors come back as values (they must cross processes).
    The DP check's job (:data:`DP_JOB`) runs :func:`_run_dp_check` instead."""
    if name == DP_JOB:
        return _run_dp_check(cand, out_dir, device)
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():  # imports too: a dependency's kernel registration warns when first loaded
            warnings.filterwarnings("ignore", message=KERNEL_OVERRIDE_WARNING)
            from gradleak.run import runner

            res = runner.run_config(cand, out_dir, device=device)
    except BadInput as err:
        return {"bad_input": str(err), "bad_input_parts": [err.field, err.problem, err.fix],
                "seconds": time.perf_counter() - t0}
    except Exception as err:  # noqa: BLE001
        return {"error": f"{type(err).__name__}: {err}", "seconds": time.perf_counter() - t0}
    return {"metrics": res.get("metrics", {}), "artifacts": res.get("artifacts", []),
            "details": {"warnings": (res.get("details") or {}).get("warnings", []),
                        "trials": (res.get("details") or {}).get("trials", []),
                        "per_client": (res.get("details") or {}).get("per_client", [])},
            "seconds": time.perf_counter() - t0}


def _run_jobs(out: Path, jobs: list[tuple], workers: int, log: Callable[[str], Any] = print) -> dict[str, dict]:
    """``{job: result}`` of every ``(job, run config, folder, device)`` of the audit, through the one resumable cell
    loop (:func:`gradleak.run.cells.run_cells`; docs/ARCHITECTURE.md, ``run/``): each run is a cell whose id is
    ``<job>/<run key>`` (:func:`run_key`: a hash of the run's full config), and each finished run's row goes to the
    ledger ``OUT/attacks/runs.jsonl`` (atomically) as it ends. A killed audit rerun into the same ``--out`` with the
    same config reruns no finished run (its row and its folder are reused, and the log names them); a run whose
    config changed gets a new key and reruns; the previous audit's other files are removed
    (:func:`remove_stale_audit`). A run that failed is recorded (level undefined) and run again on the next audit.
    Runs go one after another in this process, or to a pool of ``workers`` spawned processes (one torch thread each)
    when > 1."""
    import uuid

    from gradleak.run.cells import Cell, error_text, run_cells

    folders = {f"{job}/{run_key(cand, dev, Path(d).relative_to(out).as_posix())}": Path(d).relative_to(out).as_posix()
               for job, cand, d, dev in jobs}
    cells = [Cell(cid, _run_one, job, {"job": job[0], "out": rel})
             for job, (cid, rel) in zip(jobs, folders.items())]
    reused = reusable_runs(out, folders)
    remove_stale_audit(out, keep={folders[c] for c in reused})
    if reused:
        log(f"[audit] reused {len(reused)} finished run(s) of this config from {RUN_LEDGER} (not rerun): "
            + ", ".join(r["job"] for r in reused.values()))

    def row(cell, res, err, seconds):
        res = {"error": error_text(err), "seconds": seconds} if err is not None else res  # the worker itself died
        r = {"cell": cell.id, "job": cell.info["job"], "out": cell.info["out"], "run_id": uuid.uuid4().hex,
             "result": res}
        if "error" in res:  # not done: run again by the next audit
            r["error"] = res["error"]
        return r

    todo = len(cells) - len(reused)
    latest = run_cells(cells, out / RUN_LEDGER, row, executor="inline" if workers <= 1 or todo <= 1 else "local",
                       workers=workers, retries=0, label="audit",
                       describe=lambda r: (f"refused -- {r['result']['bad_input']} --" if "bad_input" in r["result"]
                                           else "finished"), log=log)
    return {r["job"]: r["result"] for r in latest.values()}
