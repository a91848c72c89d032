"""``gradleak audit --fail-on`` (the CI gate: exit 3 at or above the level, 0 below, 2 for a bad value) and
``audit.json``'s ``evidence_record`` (:mod:`gradleak.run.evidence`)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from gradleak.cli import GATE_EXIT, app, check_fail_on, fail_on_decision
from gradleak.errors import BadInput

runner = CliRunner()

TINY = {"experiment": "image", "seed": 0, "data": {"name": "cifar-samples", "batch_size": 2, "image_size": 16},
        "model": {"name": "vit-tiny", "layers": 1}, "peft": {"kind": "adapters", "bottleneck": 8},
        "metrics": {"feature_distance": False}, "threat": {"preset": "honest-but-curious"},
        "audit": {"params": {"dlg": {"steps": 2}}}}


def _entry(name, level, applicable=True, **kw):
    return {"name": name, "level": level, "applicable": applicable, "threat_words": "an honest-but-curious server"
            if applicable else "a malicious server", **kw}


REFUSED = {"name": "utr", "applicable": False, "reason": "text only"}  # not applicable: no level, never read


@pytest.mark.parametrize("attacks, threshold, code", [
    ([_entry("ig", "strong"), _entry("dlg", "none")], "partial", GATE_EXIT),
    ([_entry("ig", "strong"), _entry("dlg", "none")], "strong", GATE_EXIT),  # at the level: trips
    ([_entry("ig", "strong"), _entry("dlg", "none")], "exact", 0),  # below
    ([_entry("ig", "partial")], "strong", 0),
    ([_entry("dlg", "none"), REFUSED], "partial", 0),
    ([_entry("ig", "exact")], "exact", GATE_EXIT),
    ([_entry("peftleak", "exact", applicable=False), _entry("dlg", "none")], "exact", GATE_EXIT),  # upgraded server too
    ([REFUSED], "partial", 0),  # nothing ran: nothing to gate
    ([], "partial", 0),
])
def test_the_gate_compares_the_worst_level_of_every_attack_that_ran(attacks, threshold, code):
    got, line = fail_on_decision({"attacks": attacks}, threshold)
    assert got == code, line
    assert line.startswith(f"gate --fail-on {threshold}: ") and line.endswith(f"exit {code}")
    assert ("FAIL" in line) == bool(code)


def test_an_undefined_or_crashed_attack_never_passes_the_gate():
    undefined = [_entry("dlg", "none"), _entry("projres", "undefined", reason="no non-member candidates")]
    code, line = fail_on_decision({"attacks": undefined}, "partial")
    assert code == GATE_EXIT and "could not be evaluated" in line and "projres: no non-member candidates" in line
    # one variant crashed, another measured `none`: the full-strength run is missing, the gate cannot pass
    crashed = [_entry("ig", "none", failed="RuntimeError: boom")]
    code, line = fail_on_decision({"attacks": crashed}, "exact")
    assert code == GATE_EXIT and "ig: RuntimeError: boom" in line
    # a measured level that trips the gate decides, whatever else is undefined
    code, line = fail_on_decision({"attacks": [_entry("ig", "exact"), _entry("gias", "undefined")]}, "strong")
    assert code == GATE_EXIT and "worst level exact (by ig" in line and "could not" not in line


def test_fail_on_values():
    assert check_fail_on(None) is None and check_fail_on(" Strong ") == "strong"
    for bad in ("none", "undefined", "high", ""):
        with pytest.raises(BadInput, match="--fail-on.*partial, strong or exact"):
            check_fail_on(bad)


def _config(tmp_path: Path, raw: dict = TINY, name: str = "tiny.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def test_a_bad_fail_on_value_exits_2_before_anything_runs(tmp_path):
    out = tmp_path / "o"
    res = runner.invoke(app, ["audit", str(_config(tmp_path)), "--out", str(out), "--fail-on", "high"])
    assert res.exit_code == 2, res.output
    assert "--fail-on" in res.output and "partial, strong or exact" in res.output
    assert not out.exists()
    grid = _config(tmp_path, {**TINY, "grid": {"seed": [0, 1]}}, "grid.yaml")
    res = runner.invoke(app, ["audit", str(grid), "--out", str(out), "--fail-on", "partial"])
    assert res.exit_code == 2 and "--fail-on" in res.output and "grid" in res.output


def _fake_runs(monkeypatch, leaking: str | None = None, crash: str | None = None):
    """The attack runs faked (no model is trained): ``leaking`` recovers every image exactly, ``crash`` raises, every
    other attack stays below its null."""

    def fake_run(cand, out, device=None):
        name = cand["attack"]["name"]
        if name == crash:
            raise RuntimeError("boom")
        ok = name == leaking
        return {"metrics": {"images_above_threshold": 2.0 if ok else 0.0, "images_total": 2.0,
                            "psnr_max": 40.0 if ok else 9.0, "psnr_max_null_p99": 12.0,
                            "ssim_max": 0.9 if ok else 0.1, "ssim_max_null_p99": 0.3}, "artifacts": []}

    monkeypatch.setattr("gradleak.run.runner.run_config", fake_run)


@pytest.mark.parametrize("leaking, crash, threshold, code, words", [
    ("ig", None, "exact", GATE_EXIT, "worst level exact (by ig under an honest-but-curious server) reaches exact"),
    ("ig", None, "partial", GATE_EXIT, "worst level exact (by ig"),
    (None, None, "partial", 0, "pass -- worst level none"),
    (None, "dlg", "exact", GATE_EXIT, "could not be evaluated: 1 attack(s) undefined or failed (dlg:"),
])
def test_the_cli_exit_code_follows_the_gate(tmp_path, monkeypatch, leaking, crash, threshold, code, words):
    _fake_runs(monkeypatch, leaking, crash)
    out = tmp_path / "o"
    res = runner.invoke(app, ["audit", str(_config(tmp_path)), "--out", str(out), "--only", "ig,dlg",
                              "--workers", "1", "--fail-on", threshold])
    assert res.exit_code == code, res.output
    assert words in " ".join(res.output.split()), res.output
    assert (out / "audit.json").is_file()  # the gate decides after the audit is written
    # without --fail-on the same audit exits 0, whatever it found
    res = runner.invoke(app, ["audit", str(_config(tmp_path)), "--out", str(out), "--only", "ig,dlg",
                              "--workers", "1"])
    assert res.exit_code == 0 and "gate --fail-on" not in res.output


def test_evidence_record_of_a_real_tiny_audit(tmp_path, monkeypatch):
    """A real audit (DLG, 2 steps, tiny ViT) through the CLI: the gate passes (exit 0) and audit.json's
    evidence_record ties it to the config file's bytes, the resolved config, the split seeds, the version and the
    source commit."""
    from gradleak import __version__
    from gradleak.run.evidence import canonical_json

    monkeypatch.setenv("GRADLEAK_CACHE", str(tmp_path / "cache"))
    cfg = _config(tmp_path, {**TINY, "data": {**TINY["data"], "seed": 5}})
    out = tmp_path / "o"
    res = runner.invoke(app, ["audit", str(cfg), "--out", str(out), "--only", "dlg", "--workers", "1",
                              "--set", "seed=3", "--fail-on", "partial"])
    assert res.exit_code == 0, res.output
    assert "gate --fail-on partial: pass -- worst level none (by dlg" in " ".join(res.output.split())
    audit = json.loads((out / "audit.json").read_text())
    rec = audit["evidence_record"]
    assert rec["config_file"] == {"path": str(cfg), "bytes": cfg.stat().st_size,
                                  "sha256": hashlib.sha256(cfg.read_bytes()).hexdigest()}
    assert rec["config_sha256"] == hashlib.sha256(canonical_json(audit["config"])).hexdigest()
    assert audit["config"]["seed"] == 3  # the resolved config holds the --set
    assert len(rec["validated_config_sha256"]) == 64
    assert rec["weights"] == []  # a random-init ViT loads no weights file
    assert rec["split_seeds"] == {"data_seed": 5, "run_seeds": [3], "trials": 1, "modality": "image",
                                  "decided_by": "data_seed"}
    assert rec["gradleak_version"] == __version__
    assert rec["config_sha256"] in (out / "report.html").read_text()  # one line of the report's Reproducibility
    src = rec["source"]
    pkg = Path(__import__("gradleak").__file__).resolve().parent
    try:
        head = subprocess.run(["git", "-C", str(pkg), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        head = None
    if head is None:
        assert src["commit"] is None and src["reason"]
    else:
        assert src["commit"] == head and isinstance(src["dirty"], bool)


def test_the_record_changes_with_the_config(tmp_path):
    from gradleak.run.audit import candidate
    from gradleak.run.evidence import config_file_path, config_file_record, evidence_record
    from gradleak.run.runner import validate

    a, b = _config(tmp_path, TINY, "a.yaml"), _config(tmp_path, {**TINY, "seed": 1}, "b.yaml")
    ra, rb = config_file_record(a), config_file_record(b)
    assert ra["sha256"] == hashlib.sha256(a.read_bytes()).hexdigest() and ra["sha256"] != rb["sha256"]
    assert config_file_path(f"gradleak audit '{a}' --out o") == str(a) and config_file_path("python x.py") is None
    assert config_file_record(None) is None
    missing = config_file_record(tmp_path / "gone.yaml")  # never raises: the reason instead of a hash
    assert missing["sha256"] is None and "FileNotFoundError" in missing["error"]

    def record(raw):
        _, cfg = validate(candidate(raw, "dlg"))
        return evidence_record(raw, cfg, [cfg], [raw["seed"]], command="")

    one, two = record(TINY), record({**TINY, "peft": {**TINY["peft"], "bottleneck": 4}})
    assert one["config_file"] is None  # an audit from Python: no file
    assert one["config_sha256"] != two["config_sha256"]
    assert one["validated_config_sha256"] != two["validated_config_sha256"]
    assert record(TINY)["config_sha256"] == one["config_sha256"]  # deterministic


def test_weights_files_hash_what_the_model_loads_and_cache_the_hash(tmp_path, monkeypatch):
    """A checkpoint pretrained by gradleak: reported missing (and never trained) until a run made it, then its file
    and sha256; the hash is cached by (path, size, mtime)."""
    from gradleak.run import evidence
    from gradleak.run.audit import candidate
    from gradleak.run.pipeline import build_handle
    from gradleak.run.runner import validate

    monkeypatch.setenv("GRADLEAK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("GRADLEAK_PRETRAIN_CACHE", str(tmp_path / "pretrained"))
    raw = {**TINY, "model": {**TINY["model"], "pretrain": {"images": 8, "epochs": 1, "batch_size": 4, "seed": 3}}}
    _, cfg = validate(candidate(raw, "dlg"))
    (row,) = evidence.weights_files([cfg])
    assert row["sha256"] is None and "not in the cache" in row["error"]
    assert not list((tmp_path / "pretrained").glob("*.pt"))  # the record never pretrains
    handle, _ = build_handle(cfg)  # what a run does: pretrain and cache
    path = Path(handle.info["pretrain_cache"])
    (row,) = evidence.weights_files([cfg, cfg])
    assert row["path"] == str(path.resolve()) and row["bytes"] == path.stat().st_size
    assert row["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    monkeypatch.setattr(evidence, "sha256_file", lambda p: pytest.fail("hashed again"))
    monkeypatch.setattr("gradleak.run.pipeline.build_handle", lambda c: pytest.fail("built again"))
    assert evidence.weights_files([cfg]) == [row]  # from the caches (the hash on disk, the checkpoint's path)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched: another mtime, hashed again
    monkeypatch.setattr(evidence, "sha256_file", lambda p: "0" * 64)
    assert evidence.weights_files([cfg])[0]["sha256"] == "0" * 64


def test_weights_files_of_the_builtin_text_model():
    from gradleak.errors import MissingAsset
    from gradleak.models.text import resolve_model
    from gradleak.run.evidence import weights_files
    from gradleak.run.runner import validate

    try:
        folder, _ = resolve_model("minilm", 2)
    except MissingAsset:
        pytest.skip("the offline MiniLM package is not installed")
    raw = {"experiment": "text", "seed": 0, "model": {"name": "minilm", "layers": 2},
           "data": {"name": "rt-sentences", "batch_size": 2}, "peft": {"kind": "adapters"},
           "attack": {"name": "utr"}}
    _, cfg = validate(raw)
    (row,) = weights_files([cfg])
    f = Path(folder) / "model.safetensors"
    assert row["path"] == str(f.resolve()) and row["sha256"] == hashlib.sha256(f.read_bytes()).hexdigest()
