"""Profile one ``gradleak audit`` in this process (one torch thread, ``--workers 1``) and print where the time goes.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/profile_audit.py configs/audit/vit_adapters.yaml --out /tmp/prof
    OMP_NUM_THREADS=1 .venv/bin/python scripts/profile_audit.py configs/audit/vit_lora.yaml --only lora_span \\
        --set 'defenses=[{name: gaussian_noise, params: {std: 0.1}}]' --out /tmp/prof_probe     # one --advise probe

Prints (and writes ``OUT/profile.md``): the wall time, each attack run's seconds (from ``audit.json``), the gradleak
functions with the largest cumulative time, and the operations with the largest own time (torch kernels show as
``{built-in method ...}``). ``OUT/profile.prof`` keeps the full cProfile data (``python -m pstats``). The audit's
resumable ledger is not reused: ``OUT/audit`` is emptied first, so every run is measured.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import shutil
import sys
import time
from pathlib import Path


def _table(stats: pstats.Stats, key: str, pattern: str | None, n: int) -> list[tuple[float, float, int, str]]:
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _) in stats.stats.items():
        name = f"{Path(file).name}:{line}({fn})" if file != "~" else fn
        if pattern is not None and pattern not in file:
            continue
        rows.append((ct, tt, nc, name if "gradleak" not in file else f"{file.split('gradleak/', 1)[-1]}:{line}({fn})"))
    rows.sort(key=lambda r: r[0] if key == "cumulative" else r[1], reverse=True)
    return rows[:n]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", default=None, help="comma-separated attacks (as gradleak audit --only)")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="--set overrides (as gradleak audit)")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    from gradleak.config.loading import load_yaml
    from gradleak.run.audit import run_audit

    audit_out = args.out / "audit"
    shutil.rmtree(audit_out, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    only = args.only.split(",") if args.only else None
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    res = run_audit(load_yaml(args.config), audit_out, args.sets, None, only=only, log=lambda m: None, workers=1)
    prof.disable()
    wall = time.perf_counter() - t0
    prof.dump_stats(str(args.out / "profile.prof"))
    stats = pstats.Stats(prof, stream=io.StringIO())
    cmd = " ".join(["OMP_NUM_THREADS=1 .venv/bin/python scripts/profile_audit.py", args.config]
                   + ([f"--only {args.only}"] if args.only else []) + [f"--set '{s}'" for s in args.sets])
    lines = [f"`{cmd}`", "", f"Wall {wall:.1f} s (one process, one torch thread, --workers 1); verdict "
             f"{res['verdict']}.", "", "| attack | level | seconds |", "|---|---|---|"]
    lines += [f"| {a['name']} | {a['level']} | {a.get('seconds', 0):.1f} |" for a in res["attacks"] if "level" in a]
    lines += ["", "Largest cumulative time (gradleak functions):", "", "| cumulative s | own s | calls | function |",
              "|---|---|---|---|"]
    lines += [f"| {ct:.1f} | {tt:.1f} | {nc} | `{name}` |" for ct, tt, nc, name in
              _table(stats, "cumulative", "gradleak", args.top)]
    lines += ["", "Largest own time (any function; torch kernels are the built-in methods):", "",
              "| own s | cumulative s | calls | function |", "|---|---|---|---|"]
    lines += [f"| {tt:.1f} | {ct:.1f} | {nc} | `{name}` |" for ct, tt, nc, name in _table(stats, "tottime", None, args.top)]
    text = "\n".join(lines) + "\n"
    (args.out / "profile.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
