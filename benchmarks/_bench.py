"""Shared plumbing of the benchmark scripts (not a benchmark itself).

* ``--out DIR`` (default ``runs/bench/<name>``, under the repository root and git-ignored): where a script's
  JSONL, JSON, per-cell run directories and plots go. ``benchmarks/out/`` holds the published reference
  results ``docs/REPRODUCTION.md`` was built from; a script writes there only when given ``--out benchmarks/out``.
* Resume: the cells run through the one cell loop (:func:`gradleak.run.cells.run_cells`, via
  :func:`run_cells` here): a cell counts as done only when its *latest* JSONL row has no ``"error"``; failed cells
  are retried (once more in the run, and on the next run). Reports keep the latest row per cell.
* ``--fresh``: move an existing JSONL to ``*.jsonl.bak`` and recompute every cell.
* ``docs/REPRODUCTION.md`` is rewritten only with ``--report-only`` or ``--update-docs``; otherwise the section's
  Markdown goes to ``<out>/<name>.md``.
* ``--check``: validate every cell's config (:func:`gradleak.run.validate`, plus the dataset,
  public-set and defense names the runner checks later) without running anything.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from gradleak.atomic import write_text_atomic  # noqa: E402
from gradleak.run.results import history_path, latest_by_cell, supersede_rows  # noqa: E402

REFERENCE_OUT = ROOT / "benchmarks" / "out"
DOCS = ROOT / "docs" / "REPRODUCTION.md"


def default_out(name: str) -> Path:
    return ROOT / "runs" / "bench" / name


def add_out_args(ap: argparse.ArgumentParser, name: str, *, resumable: bool = True, docs: bool = True) -> None:
    ap.add_argument("--out", type=Path, default=default_out(name),
                    help=f"directory for the JSONL/JSON/plots (default: runs/bench/{name}; the published reference "
                         "results are in benchmarks/out)")
    if resumable:
        ap.add_argument("--fresh", action="store_true",
                        help="recompute every cell: move an existing JSONL in --out to *.jsonl.bak and start a new one")
    if docs:
        ap.add_argument("--report-only", action="store_true",
                        help="run nothing: rebuild the JSON and the docs/REPRODUCTION.md section from the JSONL in --out "
                             "(from the shipped reference: --out benchmarks/out --report-only)")
        ap.add_argument("--update-docs", action="store_true",
                        help="after running, also rewrite this benchmark's section of docs/REPRODUCTION.md "
                             f"(default: the Markdown goes to <out>/{name}.md only)")
    ap.add_argument("--check", action="store_true",
                    help="validate every selected cell's config without running it; print the count and exit")


def resolve_out(path: Path) -> Path:
    return (path if path.is_absolute() else Path.cwd() / path).resolve()


def display(path: Path) -> str:
    """``path`` relative to the repository root when it lies inside it (for commands and docs)."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)

def revision() -> str:
    """``git rev-parse --short HEAD``, ``+dirty`` when src/ differs from it (read-only: no index refresh); the code
    revision every benchmark row records."""
    import subprocess

    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "--no-optional-locks", "status", "--porcelain", "src"], cwd=ROOT,
                               capture_output=True, text=True).stdout
        return (rev or "unknown") + ("+dirty" if dirty.strip() else "")
    except OSError:
        return "unknown"


#: the sentence each docs section with a revision column carries once
REVISION_NOTE = ("Revision (last column): the code revision that wrote the row (`+dirty`: src/ had uncommitted changes); "
                 "`committed with <hash>`: written before rows recorded their revision -- the commit that added the row, "
                 "found in git by `scripts/revisions_from_blame.py` (the code that produced it is that commit's or "
                 "older); an aggregate lists its rows' revisions.")


def revision_label(rows: dict | Iterable[dict | None] | None) -> str:
    """The code revision(s) behind a table row, compact (every row names it): the short hash the row recorded when it was
    written; ``committed with <hash>`` for a row written before rows recorded it, whose revision was recovered from
    git as the commit that added the row (``revision_committed_with``, by ``scripts/revisions_from_blame.py``: the
    code that produced it is that commit or an earlier one); ``not recorded`` where neither is known; ``–`` for no
    row. Several rows (an aggregate): their recorded revisions, then ``committed with <hash>, <hash>``, then ``not
    recorded``, separated by ``; ``."""
    if rows is None or isinstance(rows, dict):
        rows = [rows]
    recorded, committed, unknown = set(), set(), False
    for r in rows:
        if r is None:
            continue
        if r.get("revision"):
            recorded.add(str(r["revision"]))
        elif r.get("revision_committed_with"):
            committed.add(str(r["revision_committed_with"]))
        else:
            unknown = True
    labels = sorted(recorded) + ([f"committed with {', '.join(sorted(committed))}"] if committed else [])
    return "; ".join(labels + (["not recorded"] if unknown else [])) or "–"



def latest_rows(jsonl: Path) -> list[dict]:
    """The latest row of every cell (in the order cells first appear)."""
    return list(latest_by_cell(jsonl).values())


def run_cells(jsonl: Path, cells: Iterable[tuple[dict, Callable[..., Any], tuple]], fill: Callable[[Any, dict], str],
              *, label: str, redo: bool = False, wall_seconds: bool = True, error_fields: dict | None = None,
              key: str = "cell") -> dict[str, dict]:
    """Run (or resume) a benchmark's cells in this process through the one cell loop; returns the latest row per cell.

    ``cells``: ``(row, job, args)`` -- the leading fields of the cell's row (its id under ``key`` first) and the job
    ``job(*args)``. A finished cell's row is ``row`` plus what ``fill(result, row)`` copies into it (``fill`` returns
    the progress message); a failed one's is ``row`` plus ``error`` (and ``error_fields``). Both end with
    ``wall_seconds`` (the job's run time) unless ``wall_seconds`` is false."""
    import copy

    from gradleak.run.cells import Cell, error_text
    from gradleak.run.cells import run_cells as cell_loop

    messages: dict[str, str] = {}

    def row(cell, result: Any, err: BaseException | None, seconds: float) -> dict:
        r = copy.deepcopy(cell.info)
        if err is None:
            try:
                messages[cell.id] = fill(result, r)
            except Exception as fill_err:  # noqa: BLE001 -- a result without what the tables need is a failed cell
                r, err = copy.deepcopy(cell.info), fill_err
        if err is not None:
            r["error"] = error_text(err)
            r.update(copy.deepcopy(error_fields or {}))
        if wall_seconds:
            r["wall_seconds"] = seconds
        return r

    jobs = [Cell(r[key], job, tuple(args), r) for r, job, args in cells]
    try:
        return cell_loop(jobs, jsonl, row, redo=redo, key=key, label=label,
                         describe=lambda r: messages.get(r[key], "done"), log=lambda m: print(m, flush=True))
    finally:  # a rerun replaces its cell's row (the latest row per cell); the superseded rows are the history, kept beside
        moved = supersede_rows(jsonl, key)
        if moved:
            print(f"{moved} superseded row(s) moved to {display(history_path(jsonl))}", flush=True)


def start_fresh(jsonl: Path) -> None:
    """Move ``jsonl`` aside (``*.jsonl.bak``; ``*.jsonl.bak.N`` when that exists) so every cell is recomputed."""
    if not jsonl.exists():
        return
    bak = jsonl.with_name(jsonl.name + ".bak")
    n = 1
    while bak.exists():
        bak = jsonl.with_name(f"{jsonl.name}.bak.{n}")
        n += 1
    os.replace(jsonl, bak)
    print(f"--fresh: moved {display(jsonl)} to {display(bak)}", flush=True)


def write_section(args: argparse.Namespace, key: str, body: str, title: str, name: str) -> None:
    """Rewrite the docs section only with --report-only / --update-docs; else write ``<out>/<name>.md``."""
    from gradleak.report.markdown import update_section

    if getattr(args, "report_only", False) or getattr(args, "update_docs", False):
        update_section(DOCS, key, body, title=title)
        print(f"updated the '{key}' section of {display(DOCS)}", flush=True)
    else:
        md = args.out / f"{name}.md"
        write_text_atomic(md, f"## {title}\n\n{body.rstrip()}\n", mode=0o644)  # gradleak.atomic: the one write
        print(f"wrote {display(md)} ({display(DOCS)} not touched: pass --update-docs, or --report-only)", flush=True)


def check_configs(items: Iterable[tuple[str, dict, list[str]]]) -> int:
    """Validate ``(cell, raw config, overrides)`` triples as the runner would before loading anything.

    Beyond :func:`gradleak.run.validate` (schema, attack parameters, threat-model gate) this checks the
    names the runner resolves later: the dataset and its modality, the server's public set (registered and
    disjoint from the private one) when the threat model grants public data, and the defenses.
    Returns the process exit code (0: every config is valid)."""
    from gradleak.data import check_disjoint, dataset_modality, default_public
    from gradleak.defenses import build_defenses
    from gradleak.errors import BadInput
    from gradleak.run import validate

    n, bad = 0, []
    for cell, raw, overrides in items:
        n += 1
        try:
            _, cfg = validate(raw, overrides)
            dm = dataset_modality(cfg.data.name)
            if dm != cfg.modality:
                raise BadInput("data.name", f"'{cfg.data.name}' is a {dm} dataset, the experiment works on {cfg.modality}.", "")
            if cfg.modality == "image" and cfg.threat_model.public_data:
                check_disjoint(cfg.data.name, cfg.data.public or default_public(cfg.data.name))
            build_defenses([d.model_dump() for d in cfg.defenses], seed=cfg.seed)
        except Exception as err:  # report every bad cell, not just the first
            bad.append((cell, err))
    for cell, err in bad:
        print(f"INVALID {cell}: {type(err).__name__}: {err}", flush=True)
    print(f"checked {n} cell configs: {n - len(bad)} valid, {len(bad)} invalid", flush=True)
    return 0 if not bad else 1


def client_samples(raw: dict, overrides: Iterable[str] = ()) -> dict[tuple[int, int], tuple[str, ...]]:
    """The private samples each client of a cell holds, per ``(trial, client)``: ``raw`` (a config as
    :func:`gradleak.config.loading.load_yaml` reads it) validated with ``overrides`` as the benchmarks run it (held
    out = data no tuned cell drew; tests/test_heldout_disjoint.py). Loads data only, never a model.

    Drawn by the pipeline's own code (``ImageData.clients`` / ``TextData.clients`` for every trial): for an image set
    each image's labels are replaced by its position in the set, which the seeded draw (``data.seed + 7919·trial``)
    carries through, so identity = the set's name for that image (``ImageSet.names``: the file for the CIFAR / ImageNet
    samples, shared by ``cifar-samples`` and ``cifar10/100-samples``; ``train#i`` for Fashion-MNIST). A generated set's
    crops are identified by their source photo (crops of one photo share pixels: not disjoint data). Text: the
    sentence itself."""
    import copy
    import dataclasses

    import torch

    import gradleak.data as registry
    from gradleak.data import splits
    from gradleak.run import validate

    _, cfg = validate(copy.deepcopy(raw), list(overrides))
    if cfg.modality == "text":
        data = splits.TextData(cfg)
        return {(t, c): tuple(texts) for t in range(cfg.trials)
                for c, (texts, _) in enumerate(data.clients(t, 1 << 30))}
    loaded: list = []

    def tagged(ds):
        loaded.append(ds)
        return dataclasses.replace(ds, labels=torch.arange(len(ds.images)))

    # one of the two loaders load_images calls (a built-in set: the process's cached copy, read and never written, so
    # the cache keeps the real labels; a user's folder / npz: read fresh), tagged while the clients are drawn
    where, attr = (registry, "load") if cfg.data.name in splits.USER_IMAGE_SETS else (splits, "_shared_set")
    original = getattr(where, attr)
    data, out = splits.ImageData(cfg), {}
    setattr(where, attr, lambda *a, **kw: tagged(original(*a, **kw)))
    try:
        for t in range(cfg.trials):
            for c, (_, idx) in enumerate(data.clients(t, 1 << 30)):
                names = loaded[-1].names
                out[(t, c)] = tuple(names[int(i)].split("#crop")[0] for i in idx)
    finally:
        setattr(where, attr, original)
    return out


def save_figure(fig, path: Path) -> str:
    """Save a matplotlib figure (120 dpi), close it, and return its path relative to docs/ for Markdown links."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(os.path.relpath(path, DOCS.parent)).as_posix()


def holm(pvalues: dict[Any, float]) -> dict[Any, float]:
    """Holm's step-down adjustment of a family of p-values (Holm 1979): sorted ascending, the i-th (0-based) of m is
    scaled by (m - i), made monotone, capped at 1. A test rejects at family-wise level alpha when its adjusted p is
    below alpha. ``{key: p}`` -> ``{key: adjusted p}``."""
    order = sorted(pvalues, key=lambda k: pvalues[k])
    m, out, running = len(order), {}, 0.0
    for i, k in enumerate(order):
        running = max(running, min(1.0, (m - i) * pvalues[k]))
        out[k] = running
    return out


def fmt_num(x: Any, spec: str) -> str:
    try:
        return format(float(x), spec)
    except (TypeError, ValueError):
        return "–"
