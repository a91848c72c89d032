"""The post-processing rule of ``gradleak audit --advise``, measured (docs/DESIGN.md §6; ``gradleak.run.advise_carry``):
the attacks the rule would carry are run anyway on the defended upload, and the table counts how many rise above
``none``.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/postprocessing.py --out benchmarks/out      # -> postprocessing.{jsonl,md}
    .venv/bin/python benchmarks/postprocessing.py --out benchmarks/out --report-only           # rebuild the docs section

The rule: an update defense is a function of the upload alone, so an attack at ``none`` on a victim batch's raw upload
(its noise-aware variants too) need not be rerun on that batch's defended upload. Each cell is
``configs/audit/postprocessing_tiny.yaml`` (ViT-tiny + LoRA r = 8, real CIFAR sample images at 16 px, B = 1, FedSGD,
honest-but-curious; DLG, APRIL, IG, GradViT at 200 steps) with ``seed`` = ``data.seed`` = U:

* ``raw|sU``: ``gradleak audit CONFIG --only april,dlg,gradvit,ig`` on the raw upload: which attacks the rule would
  carry on that batch (level ``none``);
* ``<defense>|sU``: the same audit with one update defense declared: every attack runs at full strength (its
  noise-aware variants derived from the defense, e.g. ``noise_model: declared``), as the rule's check would have.

A (cell, attack) pair *tests the rule* when the attack read ``none`` on the same batch's raw upload; it *breaks the
rule* when the defended level is above ``none``. The reading is computed from the rows (:func:`reading`).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import (REVISION_NOTE, ROOT, add_out_args, display, fmt_num, latest_rows, resolve_out,  # noqa: E402
                    revision, revision_label, run_cells, start_fresh, write_section)

NAME = "postprocessing"
CONFIG = ROOT / "configs" / "audit" / "postprocessing_tiny.yaml"
ATTACKS = ("april", "dlg", "gradvit", "ig")
SEEDS = (0, 1)
LEAK_LEVELS = ("partial", "strong", "exact")
#: the update defenses of the cells: (label, its ``defenses`` list)
DEFENSES = (
    ("gaussian per-coordinate 0.3", [{"name": "gaussian_noise", "params": {"std": 0.3, "per_coordinate": True}}]),
    ("gaussian per-coordinate 3", [{"name": "gaussian_noise", "params": {"std": 3.0, "per_coordinate": True}}]),
    ("gaussian relative 0.1", [{"name": "gaussian_noise", "params": {"std": 0.1, "relative": True}}]),
    ("percentile noise 0.01", [{"name": "percentile_noise", "params": {"sigma0": 0.01}}]),
    ("percentile noise 0.1", [{"name": "percentile_noise", "params": {"sigma0": 0.1}}]),
    ("quantisation 8 bits", [{"name": "stochastic_quantization", "params": {"bits": 8}}]),
    ("quantisation 4 bits", [{"name": "stochastic_quantization", "params": {"bits": 4}}]),
    ("top-k 90 %", [{"name": "topk_pruning", "params": {"prune_fraction": 0.9}}]),
    ("top-k 99 %", [{"name": "topk_pruning", "params": {"prune_fraction": 0.99}}]),
    ("NVFlare percentile 90", [{"name": "nvflare_percentile", "params": {"percentile": 90}}]),
)
REV = revision()


def cells() -> list[dict]:
    out = [{"cell": f"raw|s{u}", "defense": "none (raw upload)", "seed": u, "defenses": []} for u in SEEDS]
    out += [{"cell": f"{label}|s{u}", "defense": label, "seed": u, "defenses": ds} for label, ds in DEFENSES
            for u in SEEDS]
    return out


def overrides(cell: dict) -> list[str]:
    return [f"seed={cell['seed']}", f"data.seed={cell['seed']}", "defenses=" + json.dumps(cell["defenses"])]


def command(cell: dict, out: str = "D") -> str:
    return (f"OMP_NUM_THREADS=1 gradleak audit {display(CONFIG)} --only {','.join(ATTACKS)} --out {out} "
            + " ".join(f"--set {shlex.quote(o)}" for o in overrides(cell)))


def job(cell: dict, out: Path) -> dict:
    from gradleak.config.loading import load_yaml
    from gradleak.run.audit import run_audit

    res = run_audit(load_yaml(CONFIG), out / NAME / cell["cell"].replace(" ", "_").replace("%", "pc").replace("|", "-"),
                    overrides(cell), None, only=list(ATTACKS), log=lambda m: None, workers=1)
    return {e["name"]: {k: e.get(k) for k in ("level", "value", "null_p99", "p_value", "metric", "variants",
                                               "worst_variant", "reason")}
            for e in res["attacks"] if e["name"] in ATTACKS}


def fill(res: dict, row: dict) -> str:
    row.update({"attacks": res, "revision": REV, "command": command(row)})
    return ", ".join(f"{a} {e.get('level')}" for a, e in res.items())


def pairs(rows: list[dict]) -> list[dict]:
    """Every (defended cell, attack) pair whose attack read ``none`` on the same seed's raw upload: the pairs that
    test the rule, each with its raw and defended readings."""
    raw = {r["seed"]: r for r in rows if r["cell"].startswith("raw|") and "attacks" in r}
    out = []
    for r in rows:
        if r["cell"].startswith("raw|") or "attacks" not in r or r["seed"] not in raw:
            continue
        for a in ATTACKS:
            before = (raw[r["seed"]]["attacks"].get(a) or {})
            after = (r["attacks"].get(a) or {})
            if before.get("level") != "none":
                continue
            out.append({"cell": r["cell"], "defense": r["defense"], "seed": r["seed"], "attack": a, "raw": before,
                        "defended": after, "row": r, "broke": after.get("level") in LEAK_LEVELS,
                        "measured": after.get("level") in LEAK_LEVELS + ("none",)})
    return out


def reading(rows: list[dict]) -> str:
    """The rule's verdict on the rows, computed: how many pairs test it, how many rose above none."""
    ps = pairs(rows)
    cells_n = len({p["cell"] for p in ps})
    measured = [p for p in ps if p["measured"]]
    broke = [p for p in measured if p["broke"]]
    unmeasured = len(ps) - len(measured)
    if not measured:
        return "No pair measured yet: the rule is untested here."
    def same_as_dlg(p: dict) -> bool:  # APRIL's numbers are DLG's, raw and defended
        dlg = next((q for q in measured if q["cell"] == p["cell"] and q["attack"] == "dlg"), None)
        return dlg is not None and all(p[k].get(f) == dlg[k].get(f) for k in ("raw", "defended")
                                       for f in ("value", "p_value"))

    shared = sum(1 for p in measured if p["attack"] == "april" and same_as_dlg(p))
    head = (f"{len(measured)} (cell, attack) pairs over {cells_n} defended cells test the rule (the attack read none "
            f"on the same seed's raw upload)" + (f"; {unmeasured} more did not measure (undefined)" if unmeasured
                                                  else "")
            + (f"; in {shared} of them APRIL, with no PE term to read, is judged on DLG's run "
               "(`gradleak.run.audit.shared_runs`), so {0} distinct runs".format(len(measured) - shared)
               if shared else "") + ". ")
    if not broke:
        return head + "None rose above none on the defended upload: the rule held in every pair measured."
    return head + (f"{len(broke)} rose above none, so the rule does not hold here: "
                   + "; ".join(f"{p['attack']} under {p['defense']} (seed {p['seed']}): {p['defended'].get('level')}"
                               for p in broke) + ".")


def report(rows: list[dict]) -> str:
    def cell_of(e: dict) -> str:
        if not e:
            return "–"
        return (f"{e.get('level')} ({fmt_num(e.get('value'), '.2f')} vs {fmt_num(e.get('null_p99'), '.2f')}, "
                f"p {fmt_num(e.get('p_value'), '.3f')})")

    lines = ["The post-processing rule of `--advise` (docs/DESIGN.md §6, `gradleak.run.advise_carry`), measured: each "
             "attack that read `none` on a victim's raw upload is run anyway, at full strength, on the same victim's "
             "defended upload. Config `configs/audit/postprocessing_tiny.yaml` (ViT-tiny + LoRA r = 8, CIFAR samples "
             "at 16 px, B = 1, FedSGD; DLG, APRIL, IG, GradViT at 200 steps); each cell's command is in its row. "
             "Metric: best-image PSNR (dB) against the null's p99.", "", f"**Reading:** {reading(rows)}", "",
             "| cell | attack | raw upload | defended upload | rose above none | revision |",
             "|---|---|---|---|---|---|"]
    for p in pairs(rows):
        lines.append(f"| {p['defense']}, seed {p['seed']} | {p['attack']} | {cell_of(p['raw'])} | "
                     f"{cell_of(p['defended'])} | {'yes' if p['broke'] else ('no' if p['measured'] else 'undefined')}"
                     f" | {revision_label(p['row'])} |")
    raw = [r for r in rows if r["cell"].startswith("raw|")]
    lines += ["", "The raw uploads (attacks not at `none` there do not test the rule): "
              + "; ".join(f"seed {r['seed']}: " + ", ".join(f"{a} {(r.get('attacks') or {}).get(a, {}).get('level')}"
                                                          for a in ATTACKS) for r in raw) + ".",
              "", REVISION_NOTE, ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_out_args(ap, NAME)
    ap.add_argument("--cells", default="", help="comma-separated cell ids (default: all)")
    args = ap.parse_args(argv)
    args.out = resolve_out(args.out)
    jsonl = args.out / f"{NAME}.jsonl"
    chosen = [c for c in cells() if not args.cells or c["cell"] in args.cells.split(",")]
    if args.check:
        from gradleak.config.loading import load_yaml
        from gradleak.run.audit import plan_audit

        for c in chosen:
            plan_audit(load_yaml(CONFIG), overrides(c), list(ATTACKS))
        print(f"checked {len(chosen)} cells")
        return
    if not args.report_only:
        if args.fresh:
            start_fresh(jsonl)
        run_cells(jsonl, [(c, job, (c, args.out)) for c in chosen], fill, label=NAME)
    rows = latest_rows(jsonl) if jsonl.exists() else []
    write_section(args, NAME, report(rows), "The post-processing rule of --advise, measured", NAME)


if __name__ == "__main__":
    main()
