"""The runner: config file -> validated config -> experiment -> results.json + report.html.

An *experiment* is a registered class (``EXPERIMENTS`` registry, keyed by the config's top-level
``experiment:`` field) with a pydantic ``Config`` and ``run(config, ctx) -> dict`` returning
``{"metrics": {...}, "timings": {...}, "artifacts": [...], "report": {...}}``.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from pydantic import ValidationError

from gradleak.errors import BadInput
from gradleak.experiments.config import apply_overrides, describe_validation_error, load_yaml
from gradleak.experiments.results import environment, write_json_atomic
from gradleak.registry import EXPERIMENTS, load_all


@dataclass
class RunContext:
    out_dir: Path
    device: torch.device
    progress: Callable[..., Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def track(self, iterable, description: str = "", total: int | None = None):
        """Wrap a loop in a progress bar when the CLI supplied one."""
        if self.progress is None:
            return iterable
        return self.progress(iterable, description=description, total=total)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def resolve_device(name: str | None) -> torch.device:
    name = (name or "cpu").lower()
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise BadInput("--device", f"'{name}' was asked for but no CUDA device is available.", "use --device cpu.")
    if name not in ("cpu",) and not name.startswith("cuda") and name != "mps":
        raise BadInput("--device", f"unknown device '{name}'.", "use cpu, cuda, cuda:N or auto.")
    return torch.device(name)


def validate(raw: dict, overrides: list[str] | None = None):
    """Return (experiment class, validated config) for a raw config dict and ``--set`` overrides."""
    load_all()
    kind = raw.get("experiment")
    if kind is None:
        raise BadInput("experiment", "the config has no `experiment:` key.", f"add one of: {', '.join(EXPERIMENTS.names())}.")
    exp_cls = EXPERIMENTS.get(kind, field="experiment")
    raw = apply_overrides(raw, overrides or [], exp_cls.Config)
    try:
        cfg = exp_cls.Config(**raw)
    except ValidationError as err:
        raise describe_validation_error(err) from None
    if hasattr(cfg, "check"):
        cfg.check()
    return exp_cls, cfg


def run_config(raw: dict, out_dir: str | Path, overrides: list[str] | None = None, device: str | None = None,
               progress: Callable[..., Any] | None = None) -> dict:
    exp_cls, cfg = validate(raw, overrides)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dev = resolve_device(device or getattr(cfg, "device", "cpu"))
    seed_everything(int(getattr(cfg, "seed", 0)))
    ctx = RunContext(out, dev, progress)
    t0 = time.perf_counter()
    res = exp_cls().run(cfg, ctx)
    wall = time.perf_counter() - t0
    results = {
        "name": getattr(cfg, "name", None) or exp_cls.__name__,
        "experiment": raw.get("experiment"),
        "config": cfg.model_dump(mode="json"),
        "metrics": res.get("metrics", {}),
        "timings": {**res.get("timings", {}), "total_seconds": wall},
        "environment": {**environment(), "device": str(dev)},
        "artifacts": res.get("artifacts", []),
        "details": res.get("details", {}),
    }
    write_json_atomic(out / "results.json", results)
    from gradleak.report import write_report

    write_report(results, out, res.get("report", {}))
    return results


def run_file(path: str | Path, out_dir: str | Path, overrides: list[str] | None = None, device: str | None = None,
             progress: Callable[..., Any] | None = None) -> dict:
    return run_config(load_yaml(path), out_dir, overrides, device, progress)
