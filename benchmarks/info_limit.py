"""The information limit under a defense, per cell (docs/DESIGN.md §6): what the audit's attacks find, beside what the
upload's spectrum holds and what the best subspace attacker reaches on it -- for the vit_lora audit under the noise
``--advise`` recommended (percentile noise, σ0 = 0.01) and a weaker one (σ0 = 0.003).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/info_limit.py --out benchmarks/out   # -> info_limit.{jsonl,md}
    .venv/bin/python benchmarks/info_limit.py --out benchmarks/out --report-only        # rebuild the docs section

Every cell is ``configs/audit/vit_lora.yaml`` (pretrained ViT-S/14 at patch 4, LoRA r = 128 on query + value,
Fashion-MNIST, B = 1, FedSGD, honest-but-curious server) with ``seed`` = ``data.seed`` = U and
``defenses=[{name: percentile_noise, params: {sigma0: S}}]``. Each cell runs, in one job:

1. **the audit** ``gradleak audit CONFIG --only lora_span`` (every full-strength variant the declared defense implies,
   the measurements solver of :mod:`gradleak.attacks.common.token_measurements` among them): level, headline, null,
   the variant that decided it, and the per-tensor information limit of ``leakage_margin`` (directions above the
   noise edge, the strongest and weakest-needed margins, debiased singular values);
2. **the oracle ceiling**: ``gradleak run`` of the *undefended* upload (same seed, same image) with
   ``attack.solver=measurements attack.directions=K`` (K = the directions above the edge of the defended upload) --
   the best a subspace attacker could do with the directions the noise leaves, graded by the same null.

The label is computed from those numbers (:func:`label`), never typed: ``leaks`` (the audit's level ≥ partial),
``information present, missed`` (the ceiling beyond its null while the audit reads none) or ``information absent above
the edge`` (the ceiling at chance too). Images: U = 0 is *tuned* (the solver was developed on it); U = 1, 2 are *held
out* (no tuned run drew them: the images follow ``data.seed``; ``tests/test_heldout_disjoint.py`` checks the draws
differ).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import (REVISION_NOTE, ROOT, add_out_args, display, fmt_num, latest_rows, resolve_out,  # noqa: E402
                    revision, revision_label, run_cells, start_fresh, write_section)

NAME = "info_limit"
CONFIG = ROOT / "configs" / "audit" / "vit_lora.yaml"
SIGMAS = (0.01, 0.003)
IMAGES = {0: "tuned", 1: "held out", 2: "held out"}
LEAK_LEVELS = ("partial", "strong", "exact")
REV = revision()


def defense(sigma0: float) -> str:
    return f"defenses=[{{name: percentile_noise, params: {{sigma0: {sigma0:g}}}}}]"


def gradleak(args: list[str]) -> subprocess.CompletedProcess:
    """The CLI of this checkout (``ROOT/src`` first on the path), one torch thread."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    code = "import sys; from gradleak.cli import app; sys.argv = ['gradleak'] + sys.argv[1:]; app()"
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True)


def command(kind: str, overrides: list[str], out: str) -> str:
    extra = " --only lora_span" if kind == "audit" else ""
    return (f"OMP_NUM_THREADS=1 gradleak {kind} {display(CONFIG)}{extra} --out {out} "
            + " ".join(f"--set {shlex.quote(o)}" for o in overrides))


def label(level: str, ceiling_beyond: bool | None) -> str:
    """The cell's conclusion from its numbers (module docstring)."""
    if level in LEAK_LEVELS:
        return "leaks"
    if ceiling_beyond is None:
        return "undefined (no ceiling)"
    return "information present, missed" if ceiling_beyond else "information absent above the edge"


def data_overrides(cell: dict) -> list[str]:
    """The cell's victim: ``seed`` = ``data.seed`` = U (the image follows ``data.seed``; gradleak.data.splits)."""
    return [f"seed={cell['image']}", f"data.seed={cell['image']}"]


def audit_overrides(cell: dict) -> list[str]:
    """The ``--set`` strings of the cell's audit (``--only lora_span``): its victim under its percentile noise."""
    return data_overrides(cell) + [defense(cell["sigma0"])]


def ceiling_overrides(cell: dict, k: int) -> list[str]:
    """The ``--set`` strings of the cell's oracle ceiling: the undefended upload of the same victim, the measurements
    solver on its ``k`` strongest directions."""
    return data_overrides(cell) + ["attack.name=lora_span", "attack.solver=measurements", "attack.prior=stationary",
                                   f"attack.directions={k}"]


def job(cell: dict, out: Path) -> dict:
    run_dir = out / NAME / cell["cell"].replace("|", "_")
    audit_ov = audit_overrides(cell)
    p = gradleak(["audit", str(CONFIG), "--only", "lora_span", "--out", str(run_dir / "audit"),
                  *sum((["--set", o] for o in audit_ov), [])])
    aj = run_dir / "audit" / "audit.json"
    if not aj.exists():
        raise RuntimeError(f"audit failed (exit {p.returncode}): {p.stderr[-800:]}")
    entry = next(e for e in json.loads(aj.read_text())["attacks"] if e["name"] == "lora_span")
    margin = (entry.get("leakage_margin") or {}).get("block0_lora_A", {})
    k = int(margin.get("directions_above_edge") or 0)
    res = {"level": entry.get("level"), "value": entry.get("value"), "null_p99": entry.get("null_p99"),
           "p_value": entry.get("p_value"), "decided_by_variant": entry.get("worst_variant"),
           "margin": margin, "audit_command": command("audit", audit_ov, "DIR")}
    if k >= 1:
        ceil_ov = ceiling_overrides(cell, k)
        p = gradleak(["run", str(CONFIG), "--out", str(run_dir / "ceiling"), *sum((["--set", o] for o in ceil_ov), [])])
        rj = run_dir / "ceiling" / "results.json"
        if not rj.exists():
            raise RuntimeError(f"ceiling run failed (exit {p.returncode}): {p.stderr[-800:]}")
        m = json.loads(rj.read_text())["metrics"]
        res["ceiling"] = {key: m.get(key) for key in ("psnr_max", "psnr_max_null_p99", "psnr_max_p_value", "ssim_max",
                                                     "ssim_max_null_p99", "psnr_max_mean_public", "psnr_max_grey")}
        res["ceiling_command"] = command("run", ceil_ov, "DIR")
    return res


def fill(res: dict, row: dict) -> str:
    row.update(res)
    c = res.get("ceiling")
    beyond = None if c is None else bool(c["psnr_max"] > c["psnr_max_null_p99"])
    row["label"] = label(res["level"], beyond)
    row["revision"] = REV
    return f"{row['cell']}: {res['level']} ({res['value']:.2f} dB), {row['label']}"


def cells() -> list[dict]:
    return [{"cell": f"vit_lora|percentile{s:g}|u{u}", "sigma0": s, "image": u, "role": role}
            for s in SIGMAS for u, role in IMAGES.items()]


def report(rows: list[dict]) -> str:
    lines = [
        "`benchmarks/info_limit.py` (module docstring: the cells, the ceiling and the label rule). vit_lora audit "
        "(pretrained ViT-S/14, patch 4, LoRA r = 128, Fashion-MNIST, B = 1) under percentile noise σ = σ0 × p95(|Δw|), "
        "`--only lora_span` at full strength; **K** = directions of the 65 above the noise edge (std read off the "
        "upload), **margin** = the weakest of the 65 token directions / the strongest over the edge, **ceiling** = the "
        "measurements solver on the undefended upload's K strongest directions (the best subspace attacker), each "
        "graded against the same null (best-image PSNR, null p99). One torch thread, 2-core CPU.",
        "",
        "| σ0 | image (data.seed) | level | PSNR dB (null p99, p) | decided by | K | margin weakest / strongest | "
        "debiased s₁ / s_K | ceiling PSNR dB (null p99) | label | revision |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['sigma0']:g} | {r['image']} ({r['role']}) | error: {r['error'][:60]} | | | | | | | | "
                         f"{revision_label(r)} |")
            continue
        m, c = r.get("margin") or {}, r.get("ceiling") or {}
        var = r.get("decided_by_variant")
        var = ", ".join(f"{k}={v}" for k, v in var.items()) if isinstance(var, dict) else (var or "as configured")
        lines.append(
            f"| {r['sigma0']:g} | {r['image']} ({r['role']}) | {r['level']} | {fmt_num(r['value'], '.2f')} "
            f"({fmt_num(r['null_p99'], '.2f')}, {fmt_num(r['p_value'], '.3f')}) | {var} | "
            f"{int(m.get('directions_above_edge') or 0)} | {fmt_num(m.get('spectral_margin'), '.2f')} / "
            f"{fmt_num(m.get('margin_strongest'), '.1f')} | {fmt_num(m.get('debiased_strongest'), '.3g')} / "
            f"{fmt_num(m.get('debiased_weakest_above_edge'), '.3g')} | {fmt_num(c.get('psnr_max'), '.2f')} "
            f"({fmt_num(c.get('psnr_max_null_p99'), '.2f')}) | {r['label']} | {revision_label(r)} |")
    ok = [r for r in rows if "error" not in r]
    by = {}
    for r in ok:
        by.setdefault(r["role"], []).append(r)
    parts = []
    for role, rs in by.items():
        n_leak = sum(r["label"] == "leaks" for r in rs)
        n_missed = sum(r["label"] == "information present, missed" for r in rs)
        n_absent = sum(r["label"].startswith("information absent") for r in rs)
        parts.append(f"{role}: {n_leak} of {len(rs)} cells leak (level ≥ partial), {n_missed} hold information the "
                     f"audit missed, {n_absent} show none above the edge")
    lines += ["", "**Reading** (computed from the rows): " + ("; ".join(parts) if parts else "no rows yet") + ".",
              "", REVISION_NOTE, "", "Commands: each row's `audit_command` / `ceiling_command` in "
              "`benchmarks/out/info_limit.jsonl` (DIR: any fresh folder)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_out_args(ap, NAME)
    args = ap.parse_args(argv)
    args.out = resolve_out(args.out)
    jsonl = args.out / f"{NAME}.jsonl"
    if args.check:
        print(f"{len(cells())} cells")
        return
    if not args.report_only:
        if args.fresh:
            start_fresh(jsonl)
        todo = [(c, job, (c, args.out)) for c in cells()]
        run_cells(jsonl, todo, fill, label=NAME)
    rows = latest_rows(jsonl) if jsonl.exists() else []
    write_section(args, NAME, report(rows), "Information limit under percentile noise (vit_lora, lora_span)", NAME)


if __name__ == "__main__":
    main()
