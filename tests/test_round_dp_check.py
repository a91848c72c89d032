"""The live framework audits check a declared DP claim as ``gradleak audit`` does (docs/DESIGN.md §6, the DP check;
§7, framework audits): when the federation's config declares a DP mechanism, the first audited round is replayed
with canaries through :func:`gradleak.run.dp_check.dp_check` (``RoundAudit.round_dp_check``: the same code, from the
round's sent weights), and the round writes ``round_<r>/dp_check.json``, ``dp_check`` in its ``audit.json`` and the
report's DP section. The shipped examples (examples/flower, examples/nvflare) with the local dp_gaussian (z = 1)
declared; a correct mechanism reads ``consistent``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DP = [{"name": "dp_gaussian", "params": {"noise_multiplier": 1.0, "max_norm": 1.0e-3}}]


def _check_round(rdir: Path) -> dict:
    dp = json.loads((rdir / "dp_check.json").read_text())["dp_check"]
    assert dp["verdict"] == "consistent", dp["sentence"]
    assert dp["replayed_round"] == 1 and dp["rounds"] == 1
    assert dp["started_from"] == "the recorded round's sent weights"
    assert dp["canaries"] == 100 and {m["threat_model"] for m in dp["measured"]} >= {"each_upload", "final_model"}
    assert [c["name"] for c in dp["mechanisms"]] == ["dp_gaussian"]
    res = json.loads((rdir / "audit.json").read_text())
    assert res["dp_check"] == dp
    assert 'id="dp_check"' in (rdir / "report.html").read_text()
    return dp


@pytest.mark.timeout(600)  # a budget for a hung federation, not a speed claim
def test_the_flower_example_writes_the_dp_check_of_its_declared_mechanism(tmp_path):
    out = tmp_path / "flower"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "flower" / "app.py"),
                           str(ROOT / "examples" / "flower" / "text_adapters.yaml"), "--out", str(out), "--rounds", "1",
                           "--attacks", "utr", "--set", f"defenses={json.dumps(DP)}"],
                          capture_output=True, text=True, env=env, timeout=580, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    dp = _check_round(out / "round_1")
    assert dp["engine"] == "builtin"
    assert "[flower audit] dp_check (round 1 replayed with canaries): CONSISTENT -- " in proc.stdout


def test_the_nvflare_example_writes_the_dp_check_of_its_declared_mechanism(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "examples" / "nvflare"))
    try:
        import importlib

        job = importlib.import_module("job")
    finally:
        sys.path.pop(0)
    raw = yaml.safe_load((ROOT / "examples" / "nvflare" / "text_adapters.yaml").read_text())
    cfg = tmp_path / "text_adapters_dp.yaml"
    cfg.write_text(yaml.safe_dump({**raw, "defenses": DP}))
    job.run(str(cfg), str(tmp_path / "nvflare"), rounds=1, attacks=["utr"], runtime="inprocess")
    dp = _check_round(tmp_path / "nvflare" / "round_1")
    assert dp["engine"] == "nvflare"
    # one replay for the round: each client's result carries the same check
    assert capsys.readouterr().out.count("dp_check (round 1 replayed with canaries)") == 1


@pytest.mark.parametrize("case", ["shipped", "dp_check_off"])
def test_no_declared_mechanism_no_dp_check(tmp_path, case):
    """The NVFlare example as shipped declares no DP mechanism, and one that declares it with ``audit.dp_check:
    false`` asks for no check: no dp_check file, none in audit.json."""
    sys.path.insert(0, str(ROOT / "examples" / "nvflare"))
    try:
        import importlib

        job = importlib.import_module("job")
    finally:
        sys.path.pop(0)
    cfg = ROOT / "examples" / "nvflare" / "text_adapters.yaml"
    if case == "dp_check_off":
        raw = yaml.safe_load(cfg.read_text())
        cfg = tmp_path / "text_adapters_dp_off.yaml"
        cfg.write_text(yaml.safe_dump({**raw, "defenses": DP, "audit": {**(raw.get("audit") or {}), "dp_check": False}}))
    job.run(str(cfg), str(tmp_path / "nv"), rounds=1, attacks=["utr"], runtime="inprocess")
    assert not (tmp_path / "nv" / "round_1" / "dp_check.json").exists()
    assert "dp_check" not in json.loads((tmp_path / "nv" / "round_1" / "audit.json").read_text())
