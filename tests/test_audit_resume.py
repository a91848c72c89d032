"""A killed ``gradleak audit`` resumes: each finished attack run (attack x seed x variant) is kept in the ledger
``OUT/attacks/runs.jsonl`` of the one resumable cell loop (docs/ARCHITECTURE.md, ``run/cells.py``), keyed by a hash
of its full run config; a rerun into the same ``--out`` with the same config reruns none of them, a changed config
reruns."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the shipped text audit made fast: two quick attacks (projres, then utr), small batches, one process (DAGER does
#: not apply to adapters: the audit does not run it)
ARGS = ["configs/audit/text_adapters.yaml", "--workers", "1", "--only", "utr,projres",
        "--set", "data.batch_size=2", "--set", "data.test_size=50"]


def _audit(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "gradleak.cli", "audit", ARGS[0], "--out", str(out), *ARGS[1:], *extra]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}


def _ledger(out: Path) -> list[dict]:
    path = out / "attacks" / "runs.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _levels(audit: dict) -> dict:
    return {a["name"]: (a.get("level"), a.get("value"), a.get("n_success")) for a in audit["attacks"]}


def test_a_sigkilled_audit_reruns_no_finished_run_and_ends_as_a_clean_one(tmp_path):
    killed = tmp_path / "killed"
    proc = subprocess.Popen(_audit(killed), cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        t0 = time.monotonic()
        while not _ledger(killed):  # the first run's row: written atomically as it finished
            assert proc.poll() is None, "the audit ended before its first run was recorded"
            assert time.monotonic() - t0 < 120, "no run finished in 120 s"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)  # the whole process group, mid-audit
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    at_kill = {r["job"]: r for r in _ledger(killed)}
    assert "projres@0#0" in at_kill and not (killed / "audit.json").exists()  # killed before the audit ended
    first = killed / at_kill["projres@0#0"]["out"] / "results.json"
    mtime = first.stat().st_mtime_ns

    rerun = subprocess.run(_audit(killed), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    log = rerun.stdout + rerun.stderr
    assert f"reused {len(at_kill)} finished run(s) of this config" in log and "projres@0#0" in log
    assert f"{len(at_kill)} done before" in log
    after = {r["job"]: r for r in _ledger(killed)}
    assert set(after) == {"projres@0#0", "utr@0#0"}
    for job, row in at_kill.items():  # not rerun: the same recorded run, its results.json untouched
        assert after[job]["run_id"] == row["run_id"]
    assert first.stat().st_mtime_ns == mtime

    clean = tmp_path / "clean"
    subprocess.run(_audit(clean), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300, check=True)
    a, b = (json.loads((d / "audit.json").read_text()) for d in (killed, clean))
    assert a["verdict"] == b["verdict"] == "leaks"
    assert _levels(a) == _levels(b) and _levels(a)["utr"][0] == "exact"


def test_a_changed_run_config_reruns_and_stale_runs_are_removed(tmp_path, monkeypatch):
    """Same folder, a run whose config changed: a new key, rerun; an attack no longer audited loses its files and
    its ledger row; an unchanged run is reused."""
    from gradleak.run import audit as mod

    calls = []

    def fake_run(cand, out, device=None):
        calls.append((cand["attack"]["name"], cand["data"]["batch_size"]))
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "results.json").write_text("{}")
        return {"metrics": {"rouge1_f1": 0.0, "rouge1_f1_null_p99": 23.9}, "artifacts": [], "details": {}}

    monkeypatch.setattr("gradleak.run.runner.run_config", fake_run)
    import yaml

    raw = yaml.safe_load((ROOT / ARGS[0]).read_text())
    quiet = lambda m: None  # noqa: E731
    mod.run_audit(raw, tmp_path, ["data.batch_size=2"], only=["utr", "projres"], log=quiet)
    assert sorted(calls) == [("projres", 2), ("utr", 2)]
    logs: list[str] = []
    mod.run_audit(raw, tmp_path, ["data.batch_size=2"], only=["utr"], log=logs.append)
    assert sorted(calls) == [("projres", 2), ("utr", 2)]  # utr reused
    assert any("reused 1 finished run(s)" in m and "utr@0#0" in m for m in logs)
    assert not (tmp_path / "attacks" / "projres").exists() and [r["job"] for r in _ledger(tmp_path)] == ["utr@0#0"]
    mod.run_audit(raw, tmp_path, ["data.batch_size=3"], only=["utr"], log=quiet)
    assert calls[-1] == ("utr", 3) and len(calls) == 3  # a changed config reruns
    assert [r["job"] for r in _ledger(tmp_path)] == ["utr@0#0"] and len(_ledger(tmp_path)) == 1
