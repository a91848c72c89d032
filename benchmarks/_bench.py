"""Shared plumbing of the benchmark scripts (not a benchmark itself).

* ``--out DIR`` (default ``runs/bench/<name>``, under the repository root and git-ignored): where a script's
  JSONL, JSON, per-cell run directories and plots go. ``benchmarks/out/`` holds the published reference
  results ``docs/REPRODUCTION.md`` was built from; a script writes there only when given ``--out benchmarks/out``.
* Resume: a cell counts as done only when its *latest* JSONL row has no ``"error"``; failed cells are retried.
  Reports keep the latest row per cell.
* ``--fresh``: move an existing JSONL to ``*.jsonl.bak`` and recompute every cell.
* ``docs/REPRODUCTION.md`` is rewritten only with ``--report-only`` or ``--update-docs``; otherwise the section's
  Markdown goes to ``<out>/<name>.md``.
* ``--check``: validate every cell's config (:func:`gradleak.experiments.validate`, plus the dataset,
  public-set and defense names the runner checks later) without running anything.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Iterable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from gradleak.experiments.results import latest_by_cell  # noqa: E402

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


def latest_rows(jsonl: Path) -> list[dict]:
    """The latest row of every cell (in the order cells first appear)."""
    return list(latest_by_cell(jsonl).values())


def done_cells(jsonl: Path) -> set[str]:
    """Cells whose latest row finished without error (the others are run again)."""
    return {r["cell"] for r in latest_rows(jsonl) if "error" not in r}


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
        md.parent.mkdir(parents=True, exist_ok=True)
        md.write_text(f"## {title}\n\n{body.rstrip()}\n")
        print(f"wrote {display(md)} ({display(DOCS)} not touched: pass --update-docs, or --report-only)", flush=True)


def check_configs(items: Iterable[tuple[str, dict, list[str]]]) -> int:
    """Validate ``(cell, raw config, overrides)`` triples as the runner would before loading anything.

    Beyond :func:`gradleak.experiments.validate` (schema, attack parameters, threat-model gate) this checks the
    names the runner resolves later: the dataset and its modality, the server's public set (registered and
    disjoint from the private one) when the threat model grants public data, and the defenses.
    Returns the process exit code (0: every config is valid)."""
    from gradleak.data import check_disjoint, dataset_modality, default_public
    from gradleak.defenses import build_defenses
    from gradleak.errors import BadInput
    from gradleak.experiments import validate

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


def save_figure(fig, path: Path) -> str:
    """Save a matplotlib figure (120 dpi), close it, and return its path relative to docs/ for Markdown links."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(os.path.relpath(path, DOCS.parent)).as_posix()


def fmt_num(x: Any, spec: str) -> str:
    try:
        return format(float(x), spec)
    except (TypeError, ValueError):
        return "–"


def run_pipeline_cell(config: Path, overrides: list[str], out_dir: Path, device: str = "cpu") -> dict:
    """One benchmark cell through the experiment pipeline (``validate`` -> ``run_experiment``) on ``device``, writing
    ``out_dir`` as ``gradleak run`` would (``results.json``, ``report.html``, ``report_data.json``); returns the
    pipeline's result dict with ``timings.total_seconds`` added."""
    import time

    import torch

    from gradleak.experiments import validate
    from gradleak.experiments.config import load_yaml
    from gradleak.experiments.results import write_json_atomic
    from gradleak.experiments.runner import RunContext, seed_everything
    from gradleak.report import write_report

    run_experiment, cfg = validate(load_yaml(config), overrides)
    out_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(cfg.seed)
    t0 = time.perf_counter()
    res = run_experiment(cfg, RunContext(out_dir, torch.device(device)))
    res["timings"]["total_seconds"] = time.perf_counter() - t0
    results = {"name": cfg.name, "experiment": cfg.experiment, "config": cfg.dump(), "metrics": res["metrics"],
               "timings": res["timings"], "artifacts": res.get("artifacts", []), "details": res["details"]}
    write_json_atomic(out_dir / "results.json", results)
    write_report(results, out_dir, res.get("report", {}))
    return res


def minilm_rt_update(batch: int, rf: int, seed: int):
    """The probes' common case: MiniLM (2 layers) with UTR's adapters at reduction factor ``rf``, one client's
    FedSGD update on ``batch`` Rotten Tomatoes sentences drawn with ``seed``. Returns (text model, encoding,
    update, true token ids of each sentence)."""
    return text_rt_update("minilm", batch, rf, seed)


def text_rt_update(model: str, batch: int, rf: int, seed: int):
    """:func:`minilm_rt_update` for any text model the pipeline loads (``minilm``, ``smollm2``, a local path)."""
    import torch

    from gradleak.data.text import load_text
    from gradleak.fl.core import Client
    from gradleak.models.text import load_text_model, text_loss
    from gradleak.peft.text_adapters import add_text_adapters

    tm = load_text_model(model, 2)
    add_text_adapters(tm.model, tm.layers(), tm.hidden_size, rf)
    texts, labels = load_text("rt-sentences").batch(batch, seed=seed)
    enc = tm.encode(texts)
    x = torch.stack([enc["input_ids"], enc["attention_mask"]], 1)
    upd = Client(0, x, torch.as_tensor(labels) % 2, loss_fn=text_loss(tm.kind)).local_update(tm.model)
    truth = [enc["input_ids"][i][enc["attention_mask"][i].bool()].tolist() for i in range(batch)]
    return tm, enc, upd, truth
