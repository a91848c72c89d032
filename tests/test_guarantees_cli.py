"""The sweep and the audit through the CLI -- exit 0 / 1 / 2 (DESIGN §4), a failed sweep cell retried on the
next run, ``--only`` restricting the audit. Tiny models (a 1-block ViT-Tiny on 16×16 CIFAR images) keep them fast.
"""

from __future__ import annotations

import json
import sys

import pytest
import yaml
from typer.testing import CliRunner

from gradleak.cli import app, main

pytestmark = pytest.mark.timeout(600)
runner = CliRunner()

TINY = {"experiment": "image", "seed": 0, "data": {"name": "cifar-samples", "batch_size": 1, "image_size": 16},
        "model": {"name": "vit-tiny", "layers": 1}, "peft": {"kind": "adapters", "bottleneck": 8},
        "metrics": {"feature_distance": False, "null": False},
        "threat": {"preset": "honest-but-curious", "knows_labels": True},
        "attack": {"name": "dlg", "steps": 1, "labels": "known"}}
AUDIT = {**{k: v for k, v in TINY.items() if k != "attack"}, "metrics": {"feature_distance": False},
         "audit": {"params": {"dlg": {"steps": 1}}}}


def _yaml(tmp_path, raw: dict, name: str = "c.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(raw))
    return p


def _rows(path) -> list[dict]:
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []


def _main_exit(monkeypatch, args: list[str]) -> int:
    """Run the console entry point (``gradleak.cli.main``: the one that maps internal errors to exit 1) in process."""
    monkeypatch.setattr(sys, "argv", ["gradleak", *args])
    with pytest.raises(SystemExit) as e:
        main()
    return e.value.code if isinstance(e.value.code, int) else (0 if e.value.code is None else 1)


# ------------------------------------------------------------------------------------------- sweep
def test_sweep_through_the_cli_exits_0_and_writes_every_cell(tmp_path, one_thread):
    cfg = _yaml(tmp_path, {**TINY, "grid": {"seed": [0, 1]}})
    out = tmp_path / "sweep"
    res = runner.invoke(app, ["run", str(cfg), "--out", str(out), "--workers", "1"])
    assert res.exit_code == 0, res.output
    assert "2 of 2 cells done" in res.output
    rows = _rows(out / "results.jsonl")
    assert sorted(r["assign"]["seed"] for r in rows) == [0, 1] and not any("error" in r for r in rows)
    assert all("psnr" in r["metrics"] for r in rows)
    summary = json.loads((out / "sweep.json").read_text())
    assert summary["done"] == 2 and summary["failed"] == []
    res = runner.invoke(app, ["run", str(cfg), "--out", str(out), "--workers", "1"])  # resumed: nothing to redo
    assert res.exit_code == 0 and len(_rows(out / "results.jsonl")) == 2


@pytest.mark.parametrize("grid,extra,field", [
    ({"model.colour": [1, 2]}, [], "grid.model.colour"),
    ({"seed": []}, [], "grid"),
    ({"seed": [0, 1]}, ["--set", "attack.nonexistent=1"], "attack.nonexistent"),
    ({"attack.steps": [1, -3]}, [], "attack.steps"),
])
def test_sweep_bad_input_exits_2_naming_the_field(tmp_path, grid, extra, field):
    cfg = _yaml(tmp_path, {**TINY, "grid": grid})
    res = runner.invoke(app, ["run", str(cfg), "--out", str(tmp_path / "o"), *extra])
    assert res.exit_code == 2, res.output
    assert field in res.output
    assert not (tmp_path / "o" / "results.jsonl").exists()  # refused before any cell ran


def test_sweep_unknown_executor_exits_2(tmp_path):
    cfg = _yaml(tmp_path, {**TINY, "grid": {"seed": [0]}})
    res = runner.invoke(app, ["run", str(cfg), "--out", str(tmp_path / "o"), "--executor", "slurm"])
    assert res.exit_code == 2 and "--executor" in res.output


def test_a_failed_sweep_cell_exits_1_and_is_retried_on_the_next_run(tmp_path, monkeypatch):
    """Cell seed=1 fails (in its run and its in-run retry): exit 1, error rows, not done. The rerun runs only that cell
    again, which now succeeds: exit 0, every cell done once."""
    from gradleak.run import cells
    from gradleak.run import runner as runner_mod

    def in_process(fn, jobs, workers, hold=None):  # the pool in this process, so that the patched run_config applies
        for i, job in enumerate(jobs):
            if hold is not None and hold(i):  # as pool_results does: held back before it starts
                yield i, cells.NotStarted()
                continue
            try:
                yield i, fn(*job)
            except Exception as err:  # noqa: BLE001 -- as pool_results does
                yield i, err

    calls, broken = [], {"on": True}
    real = runner_mod.run_config

    def flaky(raw, out_dir, *a, **k):
        calls.append(raw["seed"])
        if broken["on"] and raw["seed"] == 1:
            raise RuntimeError("transient failure of cell seed=1")
        return real(raw, out_dir, *a, **k)

    monkeypatch.setattr(cells, "pool_results", in_process)
    monkeypatch.setattr(runner_mod, "run_config", flaky)
    cfg = _yaml(tmp_path, {**TINY, "grid": {"seed": [0, 1]}})
    out = tmp_path / "sweep"
    res = runner.invoke(app, ["run", str(cfg), "--out", str(out)])
    assert res.exit_code == 1, res.output
    assert "1 failed (rerun to retry)" in res.output
    assert calls == [0, 1, 1]  # the failed cell got one more try in the same run
    rows = _rows(out / "results.jsonl")
    assert [("error" in r) for r in rows] == [False, True, True] and "transient failure" in rows[-1]["error"]
    summary = json.loads((out / "sweep.json").read_text())
    assert summary["done"] == 1 and len(summary["failed"]) == 1 and summary["failed"][0] == rows[-1]["cell"]
    broken["on"] = False
    calls.clear()
    res = runner.invoke(app, ["run", str(cfg), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert calls == [1]  # only the failed cell is run again
    summary = json.loads((out / "sweep.json").read_text())
    assert summary["done"] == 2 and summary["failed"] == []
    ok = [r["cell"] for r in _rows(out / "results.jsonl") if "error" not in r]
    assert len(ok) == 2 and len(set(ok)) == 2


# ------------------------------------------------------------------------------------------- audit
@pytest.mark.parametrize("args,field", [
    (["--only", "nope"], "--only"),
    (["--only", "dlg", "--set", "model.colour=3"], "colour"),
    (["--only", "dlg", "--set", "threat.preset=godlike"], "threat.preset"),
])
def test_audit_bad_input_exits_2_naming_the_field(tmp_path, args, field):
    cfg = _yaml(tmp_path, AUDIT)
    res = runner.invoke(app, ["audit", str(cfg), "--out", str(tmp_path / "o"), "--workers", "1", *args])
    assert res.exit_code == 2, res.output
    assert field in res.output
    assert not (tmp_path / "o" / "audit.json").exists()


def test_audit_missing_config_exits_2(tmp_path):
    res = runner.invoke(app, ["audit", str(tmp_path / "nope.yaml"), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "does not exist" in res.output


def test_audit_only_restricts_the_attacks(tmp_path, one_thread):
    cfg = _yaml(tmp_path, AUDIT)
    out = tmp_path / "o"
    res = runner.invoke(app, ["audit", str(cfg), "--out", str(out), "--only", "dlg", "--workers", "1"])
    assert res.exit_code == 0, res.output
    saved = json.loads((out / "audit.json").read_text())
    assert [a["name"] for a in saved["attacks"]] == ["dlg"]
    assert saved["attacks"][0].get("applicable") and "verdict" in saved
    assert (out / "attacks" / "dlg" / "results.json").exists() and not (out / "attacks" / "ig").exists()
    assert (out / "report.html").exists()


@pytest.mark.parametrize("command", ["run", "audit"])
def test_an_internal_error_exits_1_with_the_message(tmp_path, monkeypatch, capsys, command):
    from gradleak.run import runner as runner_mod

    def boom(*a, **k):
        raise RuntimeError("simulated internal failure")

    monkeypatch.setattr(runner_mod, "check_out_dir", boom)
    cfg = _yaml(tmp_path, AUDIT if command == "audit" else TINY)
    code = _main_exit(monkeypatch, [command, str(cfg), "--out", str(tmp_path / "o")])
    assert code == 1
    err = capsys.readouterr().err
    assert "internal error" in err and "simulated internal failure" in err


def test_bad_input_through_main_is_still_exit_2_not_1(tmp_path, monkeypatch):
    cfg = _yaml(tmp_path, AUDIT)
    assert _main_exit(monkeypatch, ["audit", str(cfg), "--out", str(tmp_path / "o"), "--only", "nope"]) == 2
