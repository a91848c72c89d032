"""The learned inversion (Wu et al., "Learning to Invert", UAI 2023, Sec. 3; ``learned_wordbag``, the text slice:
docs/DESIGN.md §6 "A learned attacker is graded through its own decoder") under the defenses users deploy, each cell
one full ``gradleak audit`` (every applicable attack, so the learned attack's level stands beside UTR's, ProjRes',
DAGER's and LAMP's, each beside its null), with the decoder's training cost.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/learned.py --out D         # -> D/learned.{jsonl,json,md}
    .venv/bin/python benchmarks/learned.py --check                            # validate every cell, run nothing
    .venv/bin/python benchmarks/learned.py --out benchmarks/out --report-only # rebuild the JSON + the docs section

Cells = config x defense x split, through the one cell loop (resumable; rows carry the code revision and the
equivalent ``gradleak audit`` command). Configs (:data:`CONFIGS`): ``text_adapters`` (configs/audit/text_adapters.yaml:
MiniLM 2 layers, bottleneck adapters, fortunes-topics, one client of B = 2) with ``learned_wordbag``, every applicable
attack beside it; ``vit_lora`` (configs/audit/vit_lora.yaml: LoRA ViT, B = 1) with ``learned_image`` beside
``lora_span``, the analytic attack that decides its audit (:data:`ONLY`: the optimisation attacks DLG, APRIL, IG,
GradViT and GIAS take about 25 minutes a cell on 2 cores, so the image cells leave them out and say so). Defenses
(:func:`defenses`):

* none; NVFlare ``PercentilePrivacy`` at percentile 90 and 99; top-k pruning 90 % and 99 % read globally and per
  tensor; stochastic quantisation to 4 and 8 bits;
* the strengths ``gradleak audit --advise`` found for this config (benchmarks/advise.py's stored rows of the config's
  revision in :data:`ADVICE_REVISION`, read from ``benchmarks/out/advise.jsonl`` and its history): NVFlare
  ``SVTPrivacy`` at each seed's weakest stopping ``noise_var``, DP-Gaussian at each seed's stopping
  ``noise_multiplier`` (with its fitted clipping norm), and each seed's recommendation where it is another defense -- each as the advice's own ``--set``
  strings (SVT in ``defense:``, where the advice places it).

Splits: seed 0 is *tuned* (the learned attack's defaults were set on the text audit at seed 0); the *held-out* cells
set ``seed`` and ``data.seed`` to :data:`SPLITS`' other seeds (sentences follow ``seed``, images ``data.seed``), which
draw no sample a tuned cell draws (tests/test_heldout_disjoint.py). The learned decoder is trained per cell (its cache
key holds the model, the simulated defenses and the seed; the run uses its own ``GRADLEAK_CACHE`` so the cost is
measured), its training cost (public sentences simulated, seconds) and cache hit are in the row.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import (REFERENCE_OUT, REVISION_NOTE, ROOT, add_out_args, display, fmt_num, latest_rows,  # noqa: E402
                    resolve_out, revision, revision_label, run_cells, start_fresh, write_section)

NAME = "learned"
#: config name -> (path, the learned attack that reads it)
CONFIGS = {"text_adapters": ("configs/audit/text_adapters.yaml", "learned_wordbag"),
           "vit_lora": ("configs/audit/vit_lora.yaml", "learned_image")}
#: config name -> the attacks its cells run (absent: every applicable attack); named in the table
ONLY = {"vit_lora": ("learned_image", "lora_span")}
#: seed -> split (``seed`` and ``data.seed`` both set to it)
SPLITS = {0: "tuned", 11: "held out"}
#: config name -> the stored advice its advice-strength cells test (benchmarks/advise.py rows written at this revision,
#: before the learned attack was searched against)
ADVICE_REVISION = {"text_adapters": "4c4f312", "vit_lora": "23355de"}
LEAK = ("partial", "strong", "exact")
FIXED = [
    ("none", "none", []),
    ("nvflare-p90", "NVFlare percentile 90", ["defenses=[{name: nvflare_percentile, params: {percentile: 90}}]"]),
    ("nvflare-p99", "NVFlare percentile 99", ["defenses=[{name: nvflare_percentile, params: {percentile: 99}}]"]),
    ("topk0.9-global", "top-k 90 % global", ["defenses=[{name: topk_pruning, params: {prune_fraction: 0.9}}]"]),
    ("topk0.99-global", "top-k 99 % global", ["defenses=[{name: topk_pruning, params: {prune_fraction: 0.99}}]"]),
    ("topk0.9-per_tensor", "top-k 90 % per tensor",
     ["defenses=[{name: topk_pruning, params: {prune_fraction: 0.9, per_tensor: true}}]"]),
    ("topk0.99-per_tensor", "top-k 99 % per tensor",
     ["defenses=[{name: topk_pruning, params: {prune_fraction: 0.99, per_tensor: true}}]"]),
    ("quant4", "quantisation 4 bits", ["defenses=[{name: stochastic_quantization, params: {bits: 4}}]"]),
    ("quant8", "quantisation 8 bits", ["defenses=[{name: stochastic_quantization, params: {bits: 8}}]"]),
]
#: the advice's candidates this benchmark takes at the strength the advice found (and the recommendation, any)
ADVICE_DEFENSES = ("nvflare_svt", "dp_gaussian")
REV = revision()


def advice_rows(config: str, out: Path = REFERENCE_OUT, rev: str | None = None) -> list[dict]:
    """benchmarks/advise.py's finished rows of ``config`` written at ``rev`` (default: the config's
    :data:`ADVICE_REVISION`; the JSONL and its history), by seed."""
    from gradleak.run.results import history_path, read_jsonl

    rev = rev or ADVICE_REVISION[config]
    jsonl = out / "advise.jsonl"
    rows = [r for r in read_jsonl(history_path(jsonl)) + read_jsonl(jsonl)
            if r.get("config") == config and r.get("revision") == rev and "error" not in r]
    latest = {}
    for r in rows:
        latest[r["cell"]] = r
    return sorted(latest.values(), key=lambda r: r["seed"])


def defenses(config: str, out: Path = REFERENCE_OUT) -> list[tuple[str, str, list[str], str]]:
    """``(tag, label, --set strings, source)`` of every defense cell of ``config``: :data:`FIXED`, then the advice's
    strengths (:func:`advice_rows`)."""
    cells = [(t, lab, ov, "fixed") for t, lab, ov in FIXED]
    seen = set()
    for r in advice_rows(config, out):
        src = f"advice {r['cell']} ({r['revision']})"
        found = [x for x in r.get("rows") or [] if x.get("status") == "stopped" and x.get("set")]
        rec = r.get("recommendation") or {}
        for x in found:
            if x["defense"] not in ADVICE_DEFENSES and x["defense"] != rec.get("defense"):
                continue
            key = tuple(x["set"])
            role = "recommended" if x["defense"] == rec.get("defense") else "stopping strength"
            if key in seen:
                continue
            seen.add(key)
            cells.append((f"{x['defense']}{x['strength']:g}@s{r['seed']}",
                          f"{x['defense']} {x['parameter']} {x['strength']:g} (advice seed {r['seed']}: {role})",
                          list(x["set"]), src))
    return cells


def command(path: str, overrides: list[str], out: str, only: tuple[str, ...] | None = None) -> str:
    return (f"OMP_NUM_THREADS=1 .venv/bin/gradleak audit {path} --workers 1 --out {out} "
            + " ".join(f"--set {shlex.quote(o)}" for o in overrides) + (f" --only {','.join(only)}" if only else ""))


def split_overrides(seed: int) -> list[str]:
    return [f"seed={seed}", f"data.seed={seed}"]


def cells(out: Path, advice_out: Path = REFERENCE_OUT) -> list[dict]:
    todo = []
    for name, (path, learned) in CONFIGS.items():
        for tag, label, dov, source in defenses(name, advice_out):
            for seed, split in SPLITS.items():
                cid = f"{name}|{tag}|seed{seed}"
                ov = split_overrides(seed) + dov
                run_dir = out / NAME / cid.replace("|", "_")
                todo.append({"cell": cid, "config": name, "learned": learned, "defense": tag, "label": label,
                             "source": source, "seed": seed, "split": split, "overrides": ov,
                             "run_dir": run_dir, "command": command(path, ov, display(run_dir), ONLY.get(name))})
    return todo


def run_audit_cell(config: str, overrides: list[str], out: str) -> dict:
    from gradleak.config.loading import load_yaml
    from gradleak.run.audit import run_audit

    only = ONLY.get(config)
    return run_audit(load_yaml(ROOT / CONFIGS[config][0]), out, overrides, None, only=list(only) if only else None,
                     log=lambda m: None, workers=1)


#: what a row keeps of the learned attack's metrics
LEARNED_KEEP = ("word_bag_recall", "word_bag_recall_null_p99", "word_bag_recall_random_bag_null_p99",
                "word_bag_recall_decoder_null_p99", "word_bag_recall_p_value", "decoder_train_seconds",
                "decoder_cache_hit", "decoder_public_batches", "decoder_public_images", "decoder_heldout_psnr",
                "learned_attack_seconds")


def fill(res: dict, row: dict) -> str:
    row["revision"] = REV
    row["verdict"] = res["verdict"]
    row["audit_seconds"] = res.get("seconds")
    batch = int(((res.get("config") or {}).get("data") or {}).get("batch_size") or 1)
    row["batch_size"] = batch
    attacks = {}
    for e in res["attacks"]:
        if e.get("modality") not in (None, res.get("modality")) and "level" not in e:
            continue  # another modality's attack: not applicable by construction
        a = {k: e.get(k) for k in ("level", "metric", "value", "null_p99", "p_value") if e.get(k) is not None}
        if "level" not in a:
            a["reason"] = str(e.get("reason") or "no result")[:300]
        d = e.get("decided_by") or {}
        if d.get("metric"):
            a["decided_by"] = {k: d.get(k) for k in ("metric", "value", "null_p99") if d.get(k) is not None}
        if e["name"] == row["learned"]:
            m = e.get("metrics") or {}
            a["metrics"] = {k: m[k] for k in LEARNED_KEEP if k in m}
        attacks[e["name"]] = a
    row["attacks"] = attacks
    la = attacks.get(row["learned"], {})
    m = la.get("metrics") or {}
    return (f"{row['learned']} {la.get('level', 'not run')} "
            f"(recall {fmt_num(m.get('word_bag_recall'), '.1f')} vs null p99 "
            f"{fmt_num(m.get('word_bag_recall_null_p99'), '.1f')}); verdict {res['verdict']}")


def _lv(a: dict | None) -> str:
    if not a:
        return "–"
    if "level" not in a:
        r = a.get("reason", "")
        return "n/a" if r.startswith("not applicable") else "not run"
    return f"{a['level']} ({_against_null(a)})"


def _against_null(a: dict) -> str:
    """The deciding metric's value / its null p99; where the level was decided by a count without a null (an exact
    image: images above the PSNR threshold), the headline metric against its null beside it."""
    d = a.get("decided_by") or a
    out = f"{d.get('metric', '')} {fmt_num(d.get('value'), '.3g')} / {fmt_num(d.get('null_p99'), '.3g')}"
    if d is not a and d.get("null_p99") is None and a.get("null_p99") is not None:
        out += f"; {a.get('metric', '')} {fmt_num(a.get('value'), '.3g')} / {fmt_num(a.get('null_p99'), '.3g')}"
    return out


def table(rows: list[dict], advice_out: Path) -> str:
    rows = [r for r in rows if r.get("config") in CONFIGS]
    done = [r for r in rows if "attacks" in r]
    others = sorted({a for r in done for a, x in r["attacks"].items() if a != r["learned"]
                     and ("level" in x or not str(x.get("reason", "")).startswith("attack.name"))})
    lines = ["Each cell is one `gradleak audit` of the config at the defense and seed shown (every applicable attack "
             "at full strength; command below). Learned: the word-bag recall of `learned_wordbag` (Wu et al. 2023 "
             "Sec. 3, text slice) beside its null's 99th percentile, the larger, draw for draw, of a random public bag "
             "and the same decoder's bags on held-out public batches (docs/DESIGN.md §6); the random bag's and the "
             "decoder's own p99 follow. Other attacks: level (the deciding metric's value / its null p99), `n/a` = not "
             "applicable to this setup, `not run` = the threat model withholds what it needs (LAMP: the lengths and "
             "labels). Training: public sentences simulated for the decoder's training (batches x B; the null adds "
             "its own held-out batches), seconds of simulation + fit + null (0 when the decoder came from the "
             "cache), cache hit. Seed 0 is tuned, the other seeds held out (other sentences). Advice strengths from "
             "benchmarks/out/advise.jsonl rows of revision "
             + ", ".join(f"{ADVICE_REVISION[c]} ({c})" for c in CONFIGS) + " (`gradleak audit --advise` searched "
             "against the other attacks only). "
             + "".join(f"The {c} cells run {' and '.join(o)} only (`--only`; its optimisation attacks take about 25 "
                       "minutes a cell). " for c, o in ONLY.items()) + REVISION_NOTE, ""]
    head = (["config", "defense", "seed (split)", "learned level", "learned recall (null p99)", "random-bag / decoder p99"]
            + others + ["training: sentences, s, cache", "audit s", "revision"])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        pre = [r["config"], label(r), f"{r['seed']} ({r['split']})"]
        if "attacks" not in r:
            err = str(r.get("error", ""))[:100].replace("|", "/").replace("\n", " ")
            lines.append("| " + " | ".join(pre + [f"failed: {err}"] + ["–"] * (len(head) - 5)
                                           + [fmt_num(r.get("wall_seconds"), ".0f"), revision_label(r)]) + " |")
            continue
        la = r["attacks"].get(r["learned"], {})
        m = la.get("metrics") or {}
        if "level" in la:
            lev = la["level"]
            if "word_bag_recall" in m:  # the text slice's grade
                rec = f"{fmt_num(m['word_bag_recall'], '.1f')} ({fmt_num(m.get('word_bag_recall_null_p99'), '.1f')})"
            else:  # another learned attack (an image slice): its deciding metric / its null p99
                rec = _against_null(la)
            parts = (f"{fmt_num(m.get('word_bag_recall_random_bag_null_p99'), '.1f')} / "
                     f"{fmt_num(m.get('word_bag_recall_decoder_null_p99'), '.1f')}")
            n = m.get("decoder_public_batches")
            n = n * r["batch_size"] if n is not None else m.get("decoder_public_images")  # sentences, or images
            cost = (f"{int(n) if n is not None else '–'}, "
                    f"{fmt_num(m.get('decoder_train_seconds'), '.0f')}, "
                    f"{'hit' if m.get('decoder_cache_hit') else 'trained'}")
        else:
            why = la.get("reason", "")
            lev = ("not applicable: " + why.split(": ", 1)[-1] if why.startswith("not applicable")
                   else "not run: " + why[:120])
            rec, parts, cost = "–", "–", "–"
        lines.append("| " + " | ".join(pre + [lev, rec, parts] + [_lv(r["attacks"].get(a)) for a in others]
                                       + [cost, fmt_num(r.get("audit_seconds"), ".0f"), revision_label(r)]) + " |")
    lines += [""] + reading(rows) + [""] + advice_moves(rows, advice_out)
    cmd = next((command(CONFIGS[r["config"]][0], r["overrides"], "D", ONLY.get(r["config"])) for r in rows
                if r.get("defense") != "none"), None)
    if cmd:
        lines += ["", f"Reproduce: `OMP_NUM_THREADS=1 .venv/bin/python benchmarks/learned.py --out D` (one cell, e.g. "
                      f"`{cmd}`)."]
    return "\n".join(lines) + "\n"


def label(r: dict) -> str:
    return "undefended" if r.get("defense") == "none" else r["label"]


def _leaks(a: dict | None) -> bool:
    return bool(a) and a.get("level") in LEAK


def reading(rows: list[dict]) -> list[str]:
    """Counts from the rows: where the learned attack leaks, where it is the only attack that does, and where every
    attack is at its null."""
    done = [r for r in rows if "attacks" in r]
    if not done:
        return ["**Reading**: no finished cell yet."]
    out = ["**Reading** (computed from the rows above):", ""]
    for config, split in dict.fromkeys((r["config"], r["split"]) for r in done):
        cs = [r for r in done if r["config"] == config and r["split"] == split]
        learned = [r for r in cs if _leaks(r["attacks"].get(r["learned"]))]
        alone = [r for r in learned if not any(_leaks(x) for a, x in r["attacks"].items() if a != r["learned"])]
        na = [r for r in cs if "level" not in r["attacks"].get(r["learned"], {})]
        quiet = [r for r in cs if not any(_leaks(x) for x in r["attacks"].values())]
        names = lambda rs: ", ".join(label(r) for r in rs) or "no cell"  # noqa: E731
        out.append(f"* {config}, {split} (seed {', '.join(sorted({str(r['seed']) for r in cs}))}, {len(cs)} cells): the learned "
                   f"attack leaks under {len(learned)} ({names(learned)}); it is the only attack above its null under "
                   f"{len(alone)} ({names(alone)}); every attack that ran at its null under {len(quiet)} ({names(quiet)}); "
                   f"not applicable under {len(na)} ({names(na)}).")
    return out


def advice_moves(rows: list[dict], advice_out: Path) -> list[str]:
    """Where the learned attack leaks at a strength the advice found (its stopping strength or its recommendation),
    that strength no longer stops every attack; the advice rerun at a later revision (benchmarks/advise.py, rows
    appended to the same JSONL) is shown beside the stored one, per seed: each candidate's weakest stopping strength
    and the recommendation, before and after."""
    from gradleak.report.markdown import markdown_table
    from gradleak.run.results import history_path, read_jsonl

    out = ["**The advice at the learned attack's levels** (computed from the rows above and benchmarks/out/advise.jsonl):",
           ""]
    adv = [r for r in rows if "attacks" in r and r.get("source", "fixed") != "fixed"]
    for r in adv:
        la = r["attacks"].get(r["learned"], {})
        state = (f"leaks ({la['level']})" if _leaks(la) else "at its null" if "level" in la
                 else "not measured (" + ("not applicable" if la.get("reason", "").startswith("not applicable")
                                         else "not run") + ")")
        out.append(f"* {r['label']} from {r['source']}, seed {r['seed']} ({r['split']}): the learned attack "
                   f"{state}; the other attacks "
                   + ("leak" if any(_leaks(x) for a, x in r["attacks"].items() if a != r["learned"]) else "at their null")
                   + ".")
    moved = [r for r in adv if _leaks(r["attacks"].get(r["learned"]))]
    out += ["", (f"The learned attack leaks at {len(moved)} advice strength cell(s): the advice must move there."
                 if moved else "The learned attack leaks at none of the advice's strengths measured here.")
            if adv else "No advice-strength cell finished.", ""]
    jsonl = advice_out / "advise.jsonl"
    every = [r for r in read_jsonl(history_path(jsonl)) + read_jsonl(jsonl) if "error" not in r]
    for name in CONFIGS:
        before, after = {}, {}
        for r in every:  # the history (superseded rows) first, then the JSONL, each in the order written
            if r.get("config") != name:
                continue
            if r.get("revision") == ADVICE_REVISION[name]:
                before[r["seed"]], _ = r, after.pop(r["seed"], None)
            elif r["seed"] in before:
                after[r["seed"]] = r  # the latest rerun written after the stored row
        if not after:
            out += [f"No rerun of the {name} advice after {ADVICE_REVISION[name]} is stored: no after to show"
                    + (" (one is needed: the learned attack leaks at an advice strength above)." if moved else "."), ""]
            continue
        for seed in sorted(after):
            b, a = before[seed], after[seed]
            names = list(dict.fromkeys([x["defense"] for x in b.get("rows") or []] + [x["defense"] for x in a.get("rows") or []]))

            def found(row, n):
                x = next((x for x in row.get("rows") or [] if x["defense"] == n), {})
                if x.get("strength") is not None and x.get("status") == "stopped":
                    return fmt_num(x["strength"], ".3g")
                lv = x.get("levels") or {}
                why = [f"{k} {v}" for k, v in lv.items() if v in LEAK or not str(v).startswith(("none", "partial",
                                                                                                  "strong", "exact"))]
                return (x.get("status") or "–") + (f" ({'; '.join(w[:60] for w in why[:2])})" if why else "")

            def rec(row):
                x = row.get("recommendation")
                return (f"{x['defense']} {x['parameter']} = {fmt_num(x.get('strength'), '.3g')}" if x else "none")

            tab = [{"defense": n, "before": found(b, n), "after": found(a, n),
                    "revision": f"{revision_label(b)} → {revision_label(a)}"} for n in names]
            out += [f"{name}, seed {seed}: `{a.get('command')}`; tested against "
                    f"{', '.join(sorted(set((a.get('baseline') or {}).get('levels') or {})))} after "
                    f"(leaking undefended: {', '.join(a.get('attacks') or []) or 'none'}), search "
                    f"{fmt_num(a.get('advice_seconds'), '.0f')} s after vs {fmt_num(b.get('advice_seconds'), '.0f')} s "
                    "before.", "",
                    markdown_table(tab, ["defense", "before", "after", "revision"],
                                   ["defense", "weakest stopping strength before", "after", "revision (before → after)"]),
                    "", f"Recommended before: {rec(b)}; after: {rec(a)}"
                    + (" (moved)." if rec(b) != rec(a) else " (unchanged).")
                    + (f" Round trip after: {(a.get('roundtrip') or {}).get('verdict', 'none')}." if a.get("roundtrip")
                       else ""), ""]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_args(ap, NAME)
    ap.add_argument("--cells", nargs="+", metavar="PATTERN", default=None,
                    help="run only the cells whose id matches one of these shell-style patterns (e.g. "
                         "'text_adapters|*|seed0'); the table still reads every row of the JSONL")
    ap.add_argument("--advice", type=Path, default=REFERENCE_OUT,
                    help="where advise.jsonl (and its history) is read from (default: benchmarks/out)")
    args = ap.parse_args(argv)
    args.out = resolve_out(args.out)
    jsonl = args.out / f"{NAME}.jsonl"
    if args.fresh:
        start_fresh(jsonl)
    todo = cells(args.out, args.advice)
    if args.cells:
        todo = [c for c in todo if any(fnmatch.fnmatchcase(c["cell"], p) for p in args.cells)]
    if args.check:
        from gradleak.config.loading import load_yaml
        from gradleak.run.audit import plan_audit

        bad = 0
        for c in todo:  # the audit's own plan: schema, defenses, every attack's gate
            try:
                only = ONLY.get(c["config"])
                plan_audit(load_yaml(ROOT / CONFIGS[c["config"]][0]), c["overrides"], list(only) if only else None)
            except Exception as err:  # report every bad cell, not just the first
                bad += 1
                print(f"INVALID {c['cell']}: {type(err).__name__}: {err}", flush=True)
        print(f"checked {len(todo)} cell configs: {len(todo) - bad} valid, {bad} invalid", flush=True)
        return 1 if bad else 0
    if not args.report_only:
        keep = ("cell", "config", "learned", "defense", "label", "source", "seed", "split", "overrides", "command")
        run_cells(jsonl, [({k: c[k] for k in keep}, run_audit_cell, (c["config"], c["overrides"], str(c["run_dir"])))
                          for c in todo], fill, label=NAME, error_fields={"revision": REV})
    rows = latest_rows(jsonl) if jsonl.exists() else []
    (args.out / f"{NAME}.json").write_text(json.dumps(rows, indent=1, default=str))
    write_section(args, NAME, table(rows, args.advice),
                  "The learned inversion (Wu et al. 2023) under the deployed defenses, beside every attack", NAME)
    print(f"{len(rows)} rows in {display(jsonl)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
