"""Sweeps: a config's ``grid:`` section, run cell by cell, resumable.

``grid:`` maps dotted config keys (checked against the schema like ``--set`` keys) to lists of values; the sweep
is their Cartesian product, in a stable order. Each cell is the config with those values set, run through the one
pipeline (:func:`gradleak.run.run_config`) into ``OUT/cells/<cell id>/``, and appends one line to
``OUT/results.jsonl`` through the one cell loop (:func:`gradleak.run.cells.run_cells`: a rerun skips cells
whose latest line has no ``error``; failed cells are retried once more in the run and again on the next run). So a
killed sweep restarts without redoing or duplicating a cell.

Executors (the loop's): ``local`` (default) -- a process pool (spawned workers, one torch thread each, one cell per
task); ``ray`` -- plain ``ray.remote`` tasks on a cluster (the ``sweeps`` extra), started once per sweep. Cells are
seeded by their config, so the metrics do not depend on the executor or on the worker a cell lands on.

``OUT/sweep.json`` collects the latest row of every cell; a grid with one numeric key besides ``seed`` (a
defense-strength sweep) also gets ``OUT/sweep.png``: the headline metric against that key (mean over the other
keys), the model's accuracy on a second axis when the runs measure one.
"""

from __future__ import annotations

import copy
import itertools
import json
import time
from pathlib import Path
from typing import Any, Callable

from gradleak.errors import BadInput

MAX_CELLS = 64  # a larger grid needs --yes


def sweep_metrics() -> tuple[str, ...]:
    """Each evaluation unit's sweep metric (what a sweep prints per cell and plots), without repeats."""
    from gradleak.evaluation import EVALUATORS

    return tuple(dict.fromkeys(e.obj.sweep_metric for e in EVALUATORS))


def cell_id(assign: dict[str, Any]) -> str:
    return ",".join(f"{k}={json.dumps(v, sort_keys=True)}" for k, v in assign.items()) or "base"


def assign(raw: dict, key: str, value: Any) -> dict:
    """``raw`` with the dotted ``key`` set to ``value``. Keys are checked against the schema as ``--set`` keys are;
    a numeric part indexes a list (``defenses.0.params.std``: the first defense's std)."""
    from gradleak.config.loading import apply_overrides
    from gradleak.config.schema import ExperimentConfig

    parts = key.split(".")
    if not any(p.isdigit() for p in parts):
        return apply_overrides(raw, [f"{key}={json.dumps(value)}"], ExperimentConfig)
    out = copy.deepcopy(raw)
    node: Any = out
    for i, part in enumerate(parts):
        here = ".".join(parts[:i + 1])
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise BadInput(f"grid.{key}", f"'{here}': the list '{'.'.join(parts[:i])}' has {len(node)} entries.",
                               f"index it with 0..{len(node) - 1}.")
            if last:
                node[int(part)] = value
            else:
                node = node[int(part)]
        elif isinstance(node, dict):
            if i == 0:
                apply_overrides(copy.deepcopy(raw), [f"{part}={json.dumps(raw.get(part))}"], ExperimentConfig)
            if last:
                node[part] = value
            else:
                if part not in node:
                    if parts[i + 1].isdigit():
                        raise BadInput(f"grid.{key}", f"the config has no list '{here}'.", f"add {here}: [...] first.")
                    node[part] = {}
                node = node[part]
        else:
            raise BadInput(f"grid.{key}", f"'{'.'.join(parts[:i])}' is not a section.", "check the key.")
    return out


def expand_grid(raw: dict) -> tuple[dict, list[tuple[str, dict]]]:
    """(the config without ``grid``, [(cell id, {key: value})]). Grid keys are checked against the schema."""
    grid = raw.get("grid")
    base = {k: v for k, v in raw.items() if k != "grid"}
    if grid is None:
        return base, [("base", {})]
    if not isinstance(grid, dict) or not grid:
        raise BadInput("grid", "must map dotted config keys to lists of values.",
                       "write e.g. grid: {seed: [0, 1], defenses.0.params.std: [0.01, 0.1]}.")
    keys = list(grid)
    for k in keys:
        vals = grid[k]
        if not isinstance(vals, list) or not vals:
            raise BadInput(f"grid.{k}", "must be a non-empty list of values.", f"write e.g. grid: {{{k}: [a, b]}}.")
        try:  # the key must exist in the schema, as for --set
            assign(base, k, vals[0])
        except BadInput as err:
            raise BadInput(f"grid.{k}", err.problem, err.fix) from None
    cells = []
    for combo in itertools.product(*(grid[k] for k in keys)):
        a = dict(zip(keys, combo))
        cells.append((cell_id(a), a))
    return base, cells


def cell_config(base: dict, a: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in a.items():
        out = assign(out, k, v)
    return out


def _run_cell(raw: dict, out_dir: str, device: str | None) -> dict:
    """One cell (in a worker): one torch thread, the pipeline, the row's payload."""
    import torch

    torch.set_num_threads(1)
    from gradleak.run.runner import run_config

    t0 = time.perf_counter()
    res = run_config(raw, out_dir, None, device)
    return {"metrics": res["metrics"], "timings": res["timings"], "seconds": time.perf_counter() - t0,
            "warnings": (res.get("details") or {}).get("warnings", [])}


def _row(cell, payload: dict | None, err: BaseException | None, seconds: float) -> dict:
    from gradleak.run.cells import error_text

    row = {"cell": cell.id, "assign": cell.info}
    if err is not None:
        row["error"] = error_text(err)
    else:
        row.update(payload)
    return row


def _describe(row: dict) -> str:
    return ", ".join(f"{k} {row['metrics'][k]:.4g}" for k in sweep_metrics() if k in row["metrics"]) or "done"


def run_sweep(raw: dict, out_dir: str | Path, overrides: list[str] | None = None, device: str | None = None,
              executor: str = "local", workers: int | None = None, yes: bool = False,
              log: Callable[[str], Any] = print) -> dict:
    """Run (or resume) the sweep of ``raw``'s ``grid`` into ``out_dir``; returns the summary (``sweep.json``)."""
    from gradleak.run.cells import Cell, cell_dir_name, run_cells
    from gradleak.config.loading import apply_overrides
    from gradleak.run.results import write_json_atomic
    from gradleak.run.runner import check_out_dir, validate
    from gradleak.config.schema import ExperimentConfig

    if executor not in ("local", "ray"):
        raise BadInput("--executor", f"unknown executor '{executor}'.", "use local or ray.")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise BadInput("--workers", f"must be a whole number >= 1, got {workers!r}.",
                       "use --workers 1 or more, or leave it out (the CPU cores).")
    if overrides:
        grid = raw.get("grid")
        raw = apply_overrides({k: v for k, v in raw.items() if k != "grid"}, overrides, ExperimentConfig)
        if grid is not None:
            raw["grid"] = grid
    base, cells = expand_grid(raw)
    if len(cells) > MAX_CELLS and not yes:
        raise BadInput("grid", f"{len(cells)} cells exceed the limit of {MAX_CELLS} for one sweep.",
                       "shrink the grid, or pass --yes to run all of them.")
    for cid, a in cells:  # every cell must validate before any runs (a typo must not surface after an hour)
        try:
            validate(cell_config(base, a))
        except BadInput as err:
            raise BadInput(err.field, f"(grid cell {cid}) {err.problem}", err.fix) from None
    out = check_out_dir(out_dir)  # validated first, then created
    jobs = [Cell(cid, _run_cell, (cell_config(base, a), str(out / "cells" / cell_dir_name(cid)), device), a)
            for cid, a in cells]
    latest = run_cells(jobs, out / "results.jsonl", _row, executor=executor, workers=workers, label="sweep",
                       describe=_describe, log=log)
    rows = list(latest.values())
    summary = {"cells": len(cells), "done": sum("error" not in r for r in rows),
               "failed": [r["cell"] for r in rows if "error" in r], "rows": rows}
    write_json_atomic(out / "sweep.json", summary)
    _plot(raw.get("grid") or {}, rows, out)
    return summary


def _plot(grid: dict, rows: list[dict], out: Path) -> None:
    """Leakage against the strength of a one-key numeric grid, accuracy on a second axis: ``OUT/sweep.png``."""
    num = [k for k, v in grid.items() if k != "seed" and len(v) > 1
           and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)]
    ok = [r for r in rows if "error" not in r]
    if len(num) != 1 or not ok:
        return
    key = num[0]
    head = next((h for h in sweep_metrics() if h in ok[0]["metrics"]), None)
    if head is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts: dict[float, list] = {}
    for r in ok:
        pts.setdefault(float(r["assign"][key]), []).append(r["metrics"])
    xs = sorted(pts)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [sum(m[head] for m in pts[x]) / len(pts[x]) for x in xs], marker="o", color="C3", label=head)
    ax.set_xlabel(key)
    ax.set_ylabel(head + " (leakage)")
    if all(x > 0 for x in xs) and max(xs) / min(xs) > 20:
        ax.set_xscale("log")
    acc = next((k for k in ok[0]["metrics"] if "accuracy" in k), None)
    if acc:
        ax2 = ax.twinx()
        ax2.plot(xs, [sum(m.get(acc, float("nan")) for m in pts[x]) / len(pts[x]) for x in xs], marker="s",
                 color="C0", label=acc)
        ax2.set_ylabel(acc + " (utility)")
    fig.tight_layout()
    from gradleak.report.images import save_png_atomically

    save_png_atomically(out / "sweep.png", lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)
