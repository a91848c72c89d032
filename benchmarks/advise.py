"""What stops each attack: ``gradleak audit --advise`` on the shipped audit configs, two seeds each, and the
round trip (the recommended strength set in the config, a plain audit, its verdict).

Every cell is one advised audit through :func:`gradleak.run.advise.run_audit_advised` (the code path of
``gradleak audit CONFIG --advise``) into ``<out>/advise/<cell>/`` (itself resumable probe by probe), then one plain
audit with the recommendation's ``--set`` strings into ``<out>/advise/<cell>/roundtrip/``. A line per cell goes to
``<out>/advise.jsonl`` through the one cell loop (a finished cell is not rerun).

Cells: ``text_adapters`` (every applicable attack), ``vit_lora`` with ``--only lora_span`` (the exact LoRA inversion; the
optimisation attacks on the pretrained ViT-S/14 at patch 4 take far longer and stay at chance, see the nulls section),
``text_lora`` with ``--only projres,projres_adaptive`` (membership). Seeds 0 and 1 (nothing is tuned here: seed 1 is
the held-out repetition with other clients' sentences / image and other noise draws).

    python benchmarks/advise.py --out benchmarks/out --update-docs
    python benchmarks/advise.py --out benchmarks/out --report-only     # rebuild the docs section from the JSONL
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import (REVISION_NOTE, ROOT, add_out_args, display, fmt_num, latest_rows, resolve_out, revision_label,  # noqa: E402
                    run_cells, start_fresh, write_section)
from gradleak.report.markdown import markdown_table  # noqa: E402
from gradleak.run.results import history_path, read_jsonl, write_json_atomic  # noqa: E402

CONFIGS = {"text_adapters": ("configs/audit/text_adapters.yaml", None),
           "vit_lora": ("configs/audit/vit_lora.yaml", ["lora_span"]),
           "text_lora": ("configs/audit/text_lora.yaml", ["projres", "projres_adaptive"])}
#: ``--budget`` per config: a vit_lora probe (an audit of the 12-block ViT-S/14 with lora_span's full-strength ladder)
#: took 230-280 s on the shared 2-core machine and its utility run 560 s, ~3 h for every candidate: the budget bounds
#: the search and the report lists the candidates it did not finish (``--budget``'s own contract)
BUDGETS: dict[str, float] = {}  # no budget: every candidate finishes (an unfinished row recommends nothing)
#: what a config's ``--only`` leaves out (the section's caption says so: a strength found stops only what was searched)
LEFT_OUT = {"vit_lora": "the optimisation attacks april, dlg, gias, gradvit and ig",
            "text_lora": "DAGER, whose span test reads this config's LoRA query + key gradients"}
SEEDS = (0, 1)


#: the round trip's second victim batch: ``seed`` = ``data.seed`` = the cell's seed + this, drawn by no probe of the
#: search (the advice's own extra batches move both by multiples of gradleak.run.advise_options.BATCH_SEED_STEP, 1009)
UNSEARCHED_STEP = 4999


def cells(only: set[str] | None = None) -> list[tuple[str, str, int]]:
    return [(f"{name}-s{s}", name, s) for name in CONFIGS for s in SEEDS if not only or name in only]


def cell_overrides(seed: int) -> list[str]:
    """The ``--set`` strings of a cell: ``seed`` and ``data.seed`` both (images follow ``data.seed``, sentences
    ``seed``: gradleak.data.splits), so seed 1's victim is other data than seed 0's on every config."""
    return [f"seed={seed}", f"data.seed={seed}"]


def unsearched_overrides(seed: int) -> list[str]:
    """The victim batch of the second round trip (:data:`UNSEARCHED_STEP`)."""
    return cell_overrides(seed + UNSEARCHED_STEP)


def drew_other_data(row: dict) -> bool:
    """Whether a stored row's victim differs from what :func:`cell_overrides` draws now: its command left
    ``data.seed`` at the config's 0 at a seed other than 0 on an image config (images follow ``data.seed``), i.e. it
    attacked seed 0's image."""
    from gradleak.config.loading import load_yaml as load_config

    seed, cmd = int(row.get("seed") or 0), row.get("command") or ""
    image = load_config(ROOT / CONFIGS[row["config"]][0]).get("experiment") == "image"
    return bool(image and seed and f"--set data.seed={seed}" not in cmd)


#: processes per cell (``--workers``): the advice's probes and the round trips' attacks in parallel
WORKERS = [1]


def command(name: str, seed: int, out: str = "D") -> str:
    path, only = CONFIGS[name]
    w = WORKERS[0]
    return (f"gradleak audit {path} --advise --workers {w} " + ("--executor local " if w > 1 else "") + f"--out {out} "
            + " ".join(f"--set {o}" for o in cell_overrides(seed))
            + (f" --only {','.join(only)}" if only else "")
            + (f" --budget {BUDGETS[name]}" if name in BUDGETS else ""))


def config_sha(name: str) -> str:
    """The shipped config's content hash: a row measured on another version of the file is stale."""
    import hashlib

    return hashlib.sha256((ROOT / CONFIGS[name][0]).read_bytes()).hexdigest()[:12]


#: earlier versions of a shipped config that differ from the file now in comments only: their :func:`config_sha` ->
#: the commit that changed the comment. A row measured on one of them was measured on this config (its numbers are
#: shown, and it is the "before" of a rerun); tests/test_advise_bench.py checks each entry against the git history.
SAME_CONFIG = {"vit_lora": {"f8bf0826cd3e": "ef4b5b9"}}


def on_current_config(row: dict) -> bool:
    """Whether a stored row was measured on the shipped config as it is now: the same file, or a version of it
    :data:`SAME_CONFIG` lists."""
    name, sha = row.get("config", ""), row.get("config_sha")
    return sha == config_sha(name) or sha in SAME_CONFIG.get(name, {})


def advised_cell(name: str, seed: int, out_dir: Path) -> dict:
    """The advised audit of one cell, then the round trip of its recommendation (a plain audit)."""
    from gradleak.config.loading import load_yaml as load_config
    from gradleak.run.advise import run_audit_advised
    from gradleak.run.audit import run_audit

    path, only = CONFIGS[name]
    raw = load_config(ROOT / path)
    res = run_audit_advised(raw, out_dir, cell_overrides(seed), only=only, command=command(name, seed, str(out_dir)),
                            log=lambda m: None, workers=WORKERS[0], advise_on=True, budget_seconds=BUDGETS.get(name),
                            executor="local" if WORKERS[0] > 1 else "inline")
    adv = res.get("advice") or {}
    rec = adv.get("recommendation")
    trip = None
    if rec:
        # the round trip is a plain audit of every applicable attack (not only those the advice searched against)
        t = run_audit(raw, out_dir / "roundtrip", cell_overrides(seed) + list(rec["set"]), only=None,
                      log=lambda m: None, workers=WORKERS[0])
        trip = {"verdict": t["verdict"], "levels": {a["name"]: a.get("level") for a in t["attacks"] if a.get("level")}}
        # and at a victim batch the search never drew (neither the audited one nor the advice's extra batches)
        new = seed + UNSEARCHED_STEP
        t = run_audit(raw, out_dir / "roundtrip_unsearched", unsearched_overrides(seed) + list(rec["set"]),
                      only=None, log=lambda m: None, workers=WORKERS[0])
        trip["unsearched"] = {"seed": new, "verdict": t["verdict"],
                              "levels": {a["name"]: a.get("level") for a in t["attacks"] if a.get("level")}}
    return {"verdict": res["verdict"], "advice": adv, "roundtrip": trip}


def fill(res: dict, row: dict) -> str:
    adv = res["advice"]
    keep = ("defense", "parameter", "strength", "bracket", "interval", "levels", "accuracy", "accuracy_curve", "cost",
            "epsilon", "epsilon_attacked", "epsilon_note", "clip_norm", "clip_note", "utility_note", "utility_error",
            "diverged", "cost_se", "status", "note", "set", "what", "batches", "carried", "spot_check")
    row.update({"verdict": res["verdict"], "attacks": adv.get("attacks"), "baseline": adv.get("baseline"),
                "rows": [{k: r.get(k) for k in keep if k in r} for r in adv.get("rows", [])],
                "recommendation": adv.get("recommendation"), "sentence": adv.get("sentence"),
                "cost_note": adv.get("cost_note"), "unfinished": adv.get("unfinished"),
                "utility_rounds": adv.get("utility_rounds"), "test_size": adv.get("test_size"),
                "advice_seconds": adv.get("seconds"), "roundtrip": res["roundtrip"]})
    rec = adv.get("recommendation") or {}
    return (f"{res['verdict']}; recommended {rec.get('defense')} {rec.get('parameter')}={rec.get('strength')}; "
            f"round trip {(res['roundtrip'] or {}).get('verdict')}")


def cost_se(x: dict, r: dict) -> float | None:
    """The test set's sampling error of a row's cost (the row's own, or from the accuracies and ``test_size`` for
    rows stored before the advice computed it)."""
    from gradleak.run.advise_utility import cost_sampling_error

    if x.get("cost_se") is not None:
        return x["cost_se"]
    return cost_sampling_error((r.get("baseline") or {}).get("accuracy"), x.get("accuracy"), r.get("test_size"))


def _fmt(v) -> str:
    return fmt_num(v, ".3g")


def report(out: Path, args) -> int:
    rows = [r for r in latest_rows(out / "advise.jsonl") if "error" not in r]
    if not rows:
        print(f"no finished cells in {display(out / 'advise.jsonl')}", flush=True)
        return 1
    write_json_atomic(out / "advise.json", {"cells": rows})
    md = ["Each cell is `gradleak audit CONFIG --advise` (command below; `D` = a fresh folder): for every attack at "
          "`partial` or more, each candidate defense's weakest strength probed (a log-scale bisection: the bracket's "
          "strong end first, then 3 halvings) at which **every** leaking attack is back to `none`, each probe an audit "
          "with the attacks re-run at full strength (their noise and tolerances set from the defense). Accuracy = the "
          "global model's test accuracy after `audit.utility_rounds` rounds of federated training without an attack "
          "(fresh samples of the attacked round's batch size each round, cycling when the data set runs out; "
          "`data.test_size` held-out samples), with the defense at the strength found vs without it (the baseline), "
          "same seeds; cost = the difference. DP rows: clipping norm = the median observed norm of the undefended "
          "run (uploads for DP-Gaussian, per-sample gradients for DP-SGD; the median quantile of adaptive clipping, "
          "Andrew et al. 2021); ε at δ = 1e-5 (RDP accountant) over the utility rounds and, in brackets, over the "
          "audited round (ε > 10 guarantees nothing). Round trip = a plain audit with the recommended `--set` strings. "
          "Seed 1 is the held-out repetition (nothing is tuned on it). Machine: 2 CPU cores shared with other jobs, "
          "one worker, CPU, one torch thread a process (`OMP_NUM_THREADS=1`; text_adapters-s0 and vit_lora-s0 were "
          "killed once and resumed, their first probes at 2 threads: no finished probe ran again). The accuracies are "
          "not bit-identical across thread counts (float reductions in a different order over 200 rounds): "
          "text_adapters seed 0's DP-SGD row trained to 0.255 at 2 threads and 0.2875 at 1, its DP-Gaussian row to "
          "0.225 and 0.2425; the levels and the strengths found were the same.", "",
          "**Scope.** Not every attack of each config is searched against: "
          + "; ".join(f"`{name}` runs with `--only {','.join(only)}` (not {LEFT_OUT.get(name, 'its other attacks')})"
                      for name, (_, only) in CONFIGS.items() if only)
          + ". A strength found for such a cell stops the attacks of its `leaking` line only; no strength is searched "
          "for the attacks left out (a round trip that lists them measured them at the recommended strength only).", "",
          REVISION_NOTE, ""]
    for r in rows:
        b = r.get("baseline") or {}
        if not on_current_config(r):  # measured on another version of the shipped config
            md += [f"### {r['cell']}: `{command(r['config'], r['seed'])}`", "",
                   f"*Not measured on the current `{CONFIGS[r['config']][0]}`: its stored row comes from an earlier "
                   "version of the file (another data set or model), so its numbers are not shown. Run the command "
                   "(or `python benchmarks/advise.py --out benchmarks/out --only " + r["config"] + "`) to measure "
                   "it.*", ""]
            continue
        # the command the row measured (its own: a row from before cell_overrides set data.seed shows it unset)
        md += [f"### {r['cell']}: `{r.get('command') or command(r['config'], r['seed'])}`", ""]
        if drew_other_data(r):
            md += [f"*Stale: measured before the cell set `data.seed` (the images follow it): this row attacked seed 0's "
                   f"image, not held-out data, and the Reading below leaves it out. The cell now runs "
                   f"`{command(r['config'], r['seed'])}`; rerun it (`python benchmarks/advise.py --out benchmarks/out "
                   f"--only {r['config']} --seeds {r['seed']} --redo`).*", ""]
        if r.get("utility_rounds") is None:  # a row from before the advice measured utility
            md += ["*Predates the utility runs and the fitted clipping norms: accuracy after the single attacked round "
                   "(it does not move, every cost 0), DP clipping norm fixed at 1.0. Rerun to refresh.*", ""]
        curve = b.get("accuracy_curve")
        md += [f"Audit: **{r['verdict']}**; leaking: {', '.join(r.get('attacks') or []) or 'none'}; baseline accuracy "
               f"{_fmt(b.get('accuracy'))}" + (f" after {r['utility_rounds']} rounds (before, halfway, end: "
                                               + " → ".join(_fmt(x) for x in curve) + ")" if curve else "")
               + f"; search {_fmt(r.get('advice_seconds'))} s (the last call: a resumed search counts only what it "
               "ran then).", ""]
        table = [{"defense": x["defense"], "strength": (f"{x['parameter']} = {_fmt(x.get('strength'))}"
                                                        if x.get("strength") is not None else "–"),
                  "bracket": f"[{_fmt(x['bracket'][0])}, {_fmt(x['bracket'][1])}]" if x.get("bracket") else "–",
                  "levels": ", ".join(f"{a} {lv}" for a, lv in (x.get("levels") or {}).items()) or "–",
                  "acc": _fmt(x.get("accuracy")),
                  "cost": (f"{x['cost'] * 100:+.1f} pts" + (f" (± {se * 100:.1f})" if (se := cost_se(x, r)) else ""))
                  if isinstance(x.get("cost"), (int, float)) else "–",
                  "eps": _fmt(x.get("epsilon")) + (f" ({_fmt(x['epsilon_attacked'])})"
                                                   if x.get("epsilon_attacked") is not None else ""),
                  "clip": _fmt(x.get("clip_norm")),
                  "status": "; ".join(v for v in (x.get("status"), x.get("utility_note")) if v) or "–",
                  "revision": revision_label(r)}
                 for x in r.get("rows") or []]
        md += [markdown_table(table, ["defense", "strength", "bracket", "levels", "acc", "cost", "eps", "clip", "status",
                                      "revision"],
                              ["defense", "weakest stopping strength", "bracket", "levels there", "accuracy",
                               "cost", "ε (audited round)", "clip norm", "status", "revision"]), ""]
        trip = r.get("roundtrip")
        md += [f"{r.get('sentence') or ''}" + (f" {r['cost_note'][0].upper()}{r['cost_note'][1:]}." if r.get("cost_note") else ""),
               "", ("Round trip (the recommendation set in the config, a plain audit): **" + trip["verdict"] + "** ("
                    + ", ".join(f"{a} {lv}" for a, lv in trip["levels"].items()) + ")." if trip else
                    "No recommendation, so no round trip.")
               + (f" At a victim batch no probe drew (seed = data.seed = {trip['unsearched']['seed']}): **"
                  + trip["unsearched"]["verdict"] + "** (" + ", ".join(f"{a} {lv}" for a, lv in
                                                                         trip["unsearched"]["levels"].items()) + ")."
                  if trip and trip.get("unsearched") else ""), ""]
        checked = [x for x in r.get("rows") or [] if x.get("batches")]
        if checked:
            md += ["Each strength found, probed on the victim batches (data seed: strength, stopped):", ""]
            md += [f"* {x['defense']}: " + "; ".join(
                f"{b['data_seed']}: {_fmt(b['strength'])}, {'yes' if b['stopped'] else ('no' if b['stopped'] is False else 'not measured')}"
                for b in x["batches"]) for x in checked]
            md += [""]
    md += before_after(out / "advise.jsonl", rows)
    md += summary([r for r in rows if on_current_config(r) and not drew_other_data(r)])
    write_section(args, "advise", "\n".join(md), "What stops each attack: `gradleak audit --advise`", "advise")
    return 0


def before_after(jsonl: Path, rows: list[dict]) -> list[str]:
    """Per cell measured again (``--redo``): the strengths found by the earlier measurement of the same cell on the
    same config beside the latest (the superseded rows are kept in ``advise.history.jsonl``, the latest in the JSONL:
    :func:`gradleak.run.results.supersede_rows`), with each one's revision where the row carries it."""
    history: dict[str, list[dict]] = {}
    for r in read_jsonl(history_path(jsonl)) + read_jsonl(jsonl):
        if "error" not in r and r.get("config") in CONFIGS and on_current_config(r):
            history.setdefault(r["cell"], []).append(r)
    out = []
    for r in rows:
        h = history.get(r["cell"], [])
        if len(h) < 2:
            continue
        old = h[-2]

        def found(row, name):
            x = next((x for x in row.get("rows") or [] if x["defense"] == name), {})
            return (f"{_fmt(x['strength'])}" if x.get("strength") is not None else (x.get("status") or "–"))

        names = [x["defense"] for x in r.get("rows") or []]
        table = [{"defense": n, "before": found(old, n), "after": found(r, n),
                  "revision": f"{revision_label(old)} → {revision_label(r)}"} for n in names]
        rec = lambda row: (f"{row['recommendation']['defense']} {_fmt(row['recommendation'].get('strength'))}"  # noqa: E731
                           if row.get("recommendation") else "none")
        out += [f"**{r['cell']}, before and after** (revision {revision_label(old)} → "
                f"{revision_label(r)}; weakest stopping strength, or the status):", "",
                markdown_table(table, ["defense", "before", "after", "revision"],
                               ["defense", "before", "after", "revision (before → after)"]), "",
                f"Recommended before: {rec(old)}; after: {rec(r)}. Round trip after: "
                f"{(r.get('roundtrip') or {}).get('verdict', 'none')}.", ""]
    return out


def summary(rows: list[dict]) -> list[str]:
    """Per config, computed from the rows: which defenses stopped every leaking attack on every seed measured, which
    made training diverge, which stopped nothing within their brackets, and the recommendation per seed."""
    out = ["**Reading** (computed from the cells above):", ""]
    for name in CONFIGS:
        cells = [r for r in rows if r["config"] == name]
        if not cells:
            out.append(f"* {name}: not measured on its current config.")
            continue
        seeds = ", ".join(str(r["seed"]) for r in cells)
        status = {}
        for r in cells:
            for x in r.get("rows") or []:
                status.setdefault(x["defense"], []).append(x)
        always = [d for d, xs in status.items() if len(xs) == len(cells) and all(x.get("status") == "stopped" for x in xs)]
        never = [d for d, xs in status.items() if all(x.get("status") == "not_stopped" for x in xs)]
        diverged = [d for d, xs in status.items() if any(x.get("diverged") or "training diverged" in (x.get("utility_note") or "")
                                                         for x in xs)]
        unfinished = sorted({d for r in cells for d in r.get("unfinished") or []})
        def rec(r: dict) -> str:
            x = r.get("recommendation")
            if not x:
                return f"seed {r['seed']}: none"
            cost = x.get("cost")
            return (f"seed {r['seed']}: {x['defense']} at {x.get('parameter')} = {_fmt(x.get('strength'))}, cost "
                    + (f"{cost * 100:+.1f} pts" if isinstance(cost, (int, float)) else "not measured")
                    + f", round trip {(r.get('roundtrip') or {}).get('verdict')}")

        recs = "; ".join(rec(r) for r in cells)
        out.append(f"* {name} (seeds {seeds}): stopped every leaking attack on every seed: "
                   f"{', '.join(always) or 'none'}; of those, training diverged under {', '.join(diverged) or 'none'}; "
                   f"stopped nothing within its bracket on any seed: {', '.join(never) or 'none'}"
                   + (f"; not finished within the budget: {', '.join(unfinished)}" if unfinished else "")
                   + f". Recommended: {recs}. Costs within twice their ± (the test set's sampling error alone) are not "
                   "distinguishable from each other or from 0.")
    return out + [""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out_args(ap, "advise")
    ap.add_argument("--redo", action="store_true", help="measure the selected cells again on this revision (the "
                    "JSONL keeps the earlier rows: the before / after of a change)")
    ap.add_argument("--seeds", default="", help="comma-separated seeds (default: all)")
    ap.add_argument("--only", default="", help=f"comma-separated configs: {','.join(CONFIGS)}")
    ap.add_argument("--workers", type=int, default=1, help="processes per cell: the advice's probes (the local "
                    "executor) and the round trips' attacks in parallel (default 1)")
    args = ap.parse_args(argv)
    WORKERS[0] = max(1, args.workers)
    args.out = resolve_out(args.out)
    only = set(args.only.split(",")) - {""} or None
    if only and only - set(CONFIGS):
        ap.error(f"--only: unknown config(s) {', '.join(sorted(only - set(CONFIGS)))}")
    sel = cells(only)
    if args.seeds:
        sel = [c for c in sel if str(c[2]) in args.seeds.split(",")]
    if args.check:
        from gradleak.config.loading import load_yaml as load_config
        from gradleak.run.audit import plan_audit

        for _, name, s in sel:
            plan_audit(load_config(ROOT / CONFIGS[name][0]), cell_overrides(s), CONFIGS[name][1])
        print(f"checked {len(sel)} cell configs", flush=True)
        return 0
    if args.report_only:
        return report(args.out, args)
    if args.fresh:
        start_fresh(args.out / "advise.jsonl")
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    jsonl = args.out / "advise.jsonl"
    stored = {r["cell"]: r for r in latest_rows(jsonl)} if jsonl.exists() else {}
    stale = {cid for cid, name, _ in sel if cid in stored and not on_current_config(stored[cid])}
    for part, redo in (([c for c in sel if c[0] in stale], True), ([c for c in sel if c[0] not in stale], args.redo)):
        if part:  # a cell measured on another version of its config (or --redo) is measured again
            run_cells(jsonl, [({"cell": cid, "config": name, "seed": s, "command": command(name, s),
                                "config_sha": config_sha(name), "revision": rev}, advised_cell,
                               (name, s, args.out / "advise" / cid))
                              for cid, name, s in part], fill, label="advise", redo=redo)
    return report(args.out, args)


if __name__ == "__main__":
    raise SystemExit(main())
