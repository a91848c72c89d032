"""The runner: config file -> validated config -> the one pipeline -> results.json + report.html.

``experiment:`` names a preset of defaults (``EXPERIMENTS``, see :mod:`gradleak.config.schema`); every
preset runs through :func:`gradleak.run.pipeline.run_experiment`. Validation (config keys, values,
attack applicability, the threat-model gate, the output directory) happens before any model is loaded.
"""

from __future__ import annotations

import os
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from pydantic import ValidationError

from gradleak.atomic import write_text_atomic
from gradleak.errors import BadInput, describe_validation_error
from gradleak.config.loading import apply_overrides, load_yaml, normalize_aliases
from gradleak.run.results import environment, write_json_atomic


@dataclass
class RunContext:
    out_dir: Path
    device: torch.device
    progress: Callable[..., Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    stage_fn: Callable[[str], Any] | None = None

    def track(self, iterable, description: str = "", total: int | None = None):
        """Wrap a loop in a progress bar when the CLI supplied one."""
        if self.progress is None:
            return iterable
        return self.progress(iterable, description=description, total=total)

    def stage(self, description: str):
        """A context manager that shows a running step (spinner + elapsed time) when the CLI supplied one."""
        import contextlib

        if self.stage_fn is None:
            return contextlib.nullcontext()
        return self.stage_fn(description)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def resolve_device(name: str | None) -> torch.device:
    name = (name or "cpu").lower()
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise BadInput("--device", f"'{name}' was asked for but no CUDA device is available.", "use --device cpu.")
        try:
            dev = torch.device(name)
        except RuntimeError:
            raise BadInput("--device", f"'{name}' is not a device name.", "use cuda or cuda:N.") from None
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise BadInput("--device", f"'{name}' does not exist ({torch.cuda.device_count()} CUDA device(s)).",
                           f"use cuda:0..cuda:{torch.cuda.device_count() - 1}.")
        return dev
    if name == "cpu":
        return torch.device("cpu")
    if name == "mps":
        raise BadInput("--device", "mps (Apple GPUs) is not supported: the attacks need float64, which MPS lacks.",
                       "use --device cpu (or cuda on an NVIDIA machine).")
    raise BadInput("--device", f"unknown device '{name}'.", "use cpu, cuda, cuda:N or auto.")


def validate(raw: dict, overrides: list[str] | None = None):
    """Return (experiment runner, validated ExperimentConfig) for a raw config dict and ``--set`` overrides."""
    from gradleak.config.schema import ExperimentConfig, with_defaults

    # The ``audit:`` section configures ``gradleak audit`` (run/audit.py validates it there); a plain run of an audit
    # config ignores it, and so do overrides aimed at it.
    raw = {k: v for k, v in raw.items() if k != "audit"}
    overrides = [o for o in overrides or [] if not o.split("=", 1)[0].strip().startswith("audit.")]
    raw = normalize_aliases(apply_overrides(raw, overrides, ExperimentConfig), ExperimentConfig)
    full = with_defaults(raw)
    try:
        cfg = ExperimentConfig(**full)
    except ValidationError as err:
        raise describe_validation_error(err, ExperimentConfig) from None
    cfg.check()
    from gradleak.run.pipeline import run_experiment

    return run_experiment, cfg


def check_out_dir(out_dir: str | Path) -> Path:
    """Create ``out_dir`` and prove it writable before any work (a run must not be lost at the end)."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise BadInput("--out", f"'{out}' exists and is not a directory.", "give a directory path (it is created if missing).")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".gradleak-write-test"
        write_text_atomic(probe, "ok")  # what every artifact's write does: a temporary file in the folder, a rename
        probe.unlink()
    except OSError as err:
        raise BadInput("--out", f"cannot write to '{out}': {err.strerror or err}.",
                       "choose a directory you can write to.") from None
    return out


#: the files a run writes into its --out folder (gradleak's own names only: nothing else is ever removed)
RUN_ARTIFACTS = re.compile(r"^(results\.json|report\.html|report_data\.json|"
                           r"(ground_truth|reconstruction|tsne|roc|reconstructions_client\d+_round\d+)(_trial\w+)?\.png)$")


def remove_stale_artifacts(out: Path, pattern: re.Pattern = RUN_ARTIFACTS) -> list[str]:
    """Remove the previous run's artifacts from a reused ``--out`` (files whose names ``pattern`` matches, at the top
    of ``out`` only), so that no stale private image lies beside the new results; returns the names removed."""
    gone = []
    for p in sorted(out.iterdir()) if out.is_dir() else []:
        if p.is_file() and not p.is_symlink() and pattern.match(p.name):
            try:
                p.unlink()
                gone.append(p.name)
            except OSError as err:
                raise BadInput("--out", f"cannot remove the previous run's '{p}': {err.strerror or err}.",
                               "use a new --out folder, or one you can write to.") from None
    return gone


def protect_private_artifacts(out: Path) -> None:
    """Owner-only permissions (0600) on the artifacts that hold the clients' private data -- images, sentences, what
    was recovered of them -- as :data:`gradleak.report.images.PRIVATE_ARTIFACTS` registers them (a backstop: the
    writers already create them 0600, :func:`gradleak.atomic.atomic_path`)."""
    from gradleak.report.images import PRIVATE_ARTIFACTS

    for p in out.iterdir():
        if p.is_file() and not p.is_symlink() and PRIVATE_ARTIFACTS.match(p.name):
            os.chmod(p, 0o600)


def run_config(raw: dict, out_dir: str | Path, overrides: list[str] | None = None, device: str | None = None,
               progress: Callable[..., Any] | None = None, stage: Callable[[str], Any] | None = None) -> dict:
    run, cfg = validate(raw, overrides)
    dev = resolve_device(device or cfg.device)
    out = check_out_dir(out_dir)  # validated first, then created
    remove_stale_artifacts(out)
    seed_everything(int(cfg.seed))
    ctx = RunContext(out, dev, progress, stage_fn=stage)
    t0 = time.perf_counter()
    try:
        res = run(cfg, ctx)
    finally:  # also when the run fails midway: the images it wrote are private
        protect_private_artifacts(out)
    wall = time.perf_counter() - t0
    results = {
        "name": cfg.name or cfg.experiment,
        "experiment": cfg.experiment,
        "config": cfg.dump(),
        "metrics": res.get("metrics", {}),
        "timings": {**res.get("timings", {}), "total_seconds": wall},
        "environment": {**environment(), "device": str(dev)},
        "artifacts": res.get("artifacts", []),
        "details": res.get("details", {}),
    }
    write_json_atomic(out / "results.json", results)
    from gradleak.report import write_report
    from gradleak.run.answer import run_answer

    # the page opens with the answer: one sentence built from these results (gradleak.run.answer)
    write_report(results, out, {**res.get("report", {}), "answer": run_answer(results)})
    protect_private_artifacts(out)
    return results


def run_file(path: str | Path, out_dir: str | Path, overrides: list[str] | None = None, device: str | None = None,
             progress: Callable[..., Any] | None = None, stage: Callable[[str], Any] | None = None) -> dict:
    return run_config(load_yaml(path), out_dir, overrides, device, progress, stage)
