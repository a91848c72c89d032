"""Sweeps: grid expansion and its errors, a killed sweep resumes without a duplicated or lost
cell, seeded cells give the same metrics whichever executor ran them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from gradleak.errors import BadInput

BASE = {"experiment": "image", "seed": 0, "data": {"name": "cifar-samples", "batch_size": 1, "image_size": 16},
        "model": {"name": "vit-tiny", "layers": 1}, "peft": {"kind": "adapters", "bottleneck": 8},
        "metrics": {"feature_distance": False}, "threat": {"preset": "honest-but-curious", "knows_labels": True},
        "attack": {"name": "dlg", "steps": 1, "labels": "known"},
        "defenses": [{"name": "gaussian_noise", "params": {"std": 0.01}}]}
GRID24 = {"seed": [0, 1, 2], "defenses.0.params.std": [0.0, 0.001, 0.01, 0.1], "attack.steps": [1, 2]}


def test_grid_expands_in_a_stable_order_and_sets_list_entries():
    from gradleak.run.sweep import cell_config, expand_grid

    base, cells = expand_grid({**BASE, "grid": GRID24})
    assert "grid" not in base and len(cells) == 24 and len({c for c, _ in cells}) == 24
    cid, a = cells[5]
    cfg = cell_config(base, a)
    assert cfg["defenses"][0]["params"]["std"] == a["defenses.0.params.std"] and cfg["seed"] == a["seed"]
    assert base["defenses"][0]["params"]["std"] == 0.01  # the base is not modified


def test_grid_bad_input(tmp_path):
    from gradleak.run.sweep import run_sweep

    with pytest.raises(BadInput, match=r"grid\.model\.colour.*no key"):
        run_sweep({**BASE, "grid": {"model.colour": [1, 2]}}, tmp_path, log=lambda m: None)
    with pytest.raises(BadInput, match=r"grid\.defenses\.3\.params\.std.*0\.\.0"):
        run_sweep({**BASE, "grid": {"defenses.3.params.std": [1.0]}}, tmp_path, log=lambda m: None)
    with pytest.raises(BadInput, match=r"70 cells exceed the limit of 64.*--yes"):
        run_sweep({**BASE, "grid": {"seed": list(range(70))}}, tmp_path, log=lambda m: None)
    with pytest.raises(BadInput, match=r"grid.*non-empty list"):
        run_sweep({**BASE, "grid": {"seed": []}}, tmp_path, log=lambda m: None)
    if __import__("importlib").util.find_spec("ray") is None:  # the missing extra is named with its install command
        with pytest.raises(BadInput, match=r"Ray.*not installed.*pip install 'gradleak\[sweeps\]'"):
            run_sweep({**BASE, "grid": {"seed": [0]}}, tmp_path, executor="ray", log=lambda m: None)


def _rows(path: Path) -> list[dict]:
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []


def test_a_killed_24_cell_sweep_restarts_without_duplicated_or_lost_cells(tmp_path):
    cfg = tmp_path / "grid.yaml"
    cfg.write_text(yaml.safe_dump({**BASE, "grid": GRID24}))
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-c", "from gradleak.cli import main; main()", "run", str(cfg), "--out", str(out),
           "--workers", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    t0 = time.time()
    while len(_rows(out / "results.jsonl")) < 6 and proc.poll() is None and time.time() - t0 < 300:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the parent and its workers, mid-sweep
    proc.wait()
    before = _rows(out / "results.jsonl")
    assert 6 <= len(before) < 24, len(before)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = _rows(out / "results.jsonl")
    ok = [r["cell"] for r in rows if "error" not in r]
    assert len(set(ok)) == 24 and len(ok) == 24  # every cell once: none lost, none redone
    assert rows[:len(before)] == before  # append-only: the first run's lines are untouched
    summary = json.loads((out / "sweep.json").read_text())
    assert summary["done"] == 24 and not summary["failed"]


def test_seeded_cell_same_metrics_in_process_pool_and_in_process(tmp_path):
    from gradleak.run.runner import run_config
    from gradleak.run.sweep import run_sweep

    summary = run_sweep({**BASE, "grid": {"seed": [3]}}, tmp_path / "pool", workers=1, log=lambda m: None)
    direct = run_config({**BASE, "seed": 3, "threads": 1}, tmp_path / "direct")  # the workers' one thread
    assert summary["rows"][0]["metrics"]["psnr"] == direct["metrics"]["psnr"]


def test_local_and_ray_executors_agree(tmp_path):
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'gradleak[sweeps]'); the Ray executor is untested here")
    from gradleak.run.sweep import run_sweep

    grid = {**BASE, "grid": {"seed": [0, 1]}}
    a = run_sweep(grid, tmp_path / "local", workers=2, log=lambda m: None)
    b = run_sweep(grid, tmp_path / "ray", executor="ray", workers=2, log=lambda m: None)
    assert {r["cell"]: r["metrics"]["psnr"] for r in a["rows"]} == {r["cell"]: r["metrics"]["psnr"] for r in b["rows"]}
