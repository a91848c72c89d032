"""The CLI contract: `gradleak run/list/report`, results.json keys, exit codes and error messages."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gradleak.cli import app

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "peftleak" / "cifar_b32.yaml"
runner = CliRunner()
# a 2-block ViT-B/16 keeps the end-to-end test fast; the attack and data are the real ones
FAST = ["--set", "model.layers=2", "--set", "data.batch_size=8", "--set", "data.public_size=300",
        "--set", "metrics.feature_distance=false"]


def test_run_end_to_end_on_real_cifar(tmp_path):
    out = tmp_path / "run"
    res = runner.invoke(app, ["run", str(CONFIG), "--out", str(out), *FAST])
    assert res.exit_code == 0, res.output
    r = json.loads((out / "results.json").read_text())
    for key in ("name", "config", "metrics", "timings", "environment", "artifacts"):
        assert key in r
    m = r["metrics"]
    assert 0 <= m["patch_recovery_rate"] <= 1 and m["patch_recovery_rate"] >= 0.9
    assert m["recovered_patch_psnr_median"] >= 40
    assert m["grouping_accuracy"] >= 0.99
    assert r["timings"]["attack_to_client_step_ratio"] > 0
    assert "lpips_mean" not in m  # no AlexNet-LPIPS weights offline: never a made-up LPIPS
    assert r["config"]["data"]["batch_size"] == 8
    html = (out / "report.html").read_text()
    assert "patch_recovery_rate" in html and "data:image/png;base64" in html
    # report can be rebuilt from the directory
    (out / "report.html").unlink()
    res = runner.invoke(app, ["report", str(out)])
    assert res.exit_code == 0 and (out / "report.html").exists()


#: the same shipped config on a 1-block ViT-Tiny over 16×16 images (4 patches per image): a few seconds
TINY_VIT = ["--set", "model.name=vit-tiny", "--set", "model.layers=1", "--set", "data.image_size=16",
            "--set", "data.batch_size=4", "--set", "data.public_size=300", "--set", "metrics.feature_distance=false"]


def test_paper_design_override(tmp_path):
    """--set reaches the attack: the paper design (Algorithm 1 as published) runs and its recovered patches are exact."""
    res = runner.invoke(app, ["run", str(CONFIG), "--out", str(tmp_path), *TINY_VIT, "--set", "attack.design=paper",
                              "--set", "seed=3"])
    assert res.exit_code == 0, res.output
    r = json.loads((tmp_path / "results.json").read_text())
    assert r["config"]["attack"]["design"] == "paper" and r["config"]["seed"] == 3
    assert r["details"]["attack_info"]["design"] == "paper"  # the attack that ran, not only the echoed config
    m = r["metrics"]
    assert m["num_true_patches"] == 16 and m["false_positives"] == 0
    assert m["patches_exact"] == m["num_returned_patches"] >= 8  # every returned patch is a private patch, exactly
    assert m["recovered_patch_psnr_median"] >= 40 and m["grouping_accuracy"] == 1.0
    assert m["psnr_max"] > m["psnr_max_null_p99"]  # beyond chance


@pytest.mark.parametrize("override,field", [
    ("attack.nonexistent=1", "attack.nonexistent"),
    ("data.image_size=33", "data.image_size"),
    ("attack.sigma=0", "attack.sigma"),
    ("model.adapter_bottleneck=-4", "model.adapter_bottleneck"),
    ("attack.design=magic", "attack.design"),
    ("data.name=no-such-data", "data.name"),
])
def test_bad_input_exits_2_naming_the_field(tmp_path, override, field):
    res = runner.invoke(app, ["run", str(CONFIG), "--out", str(tmp_path), "--set", override])
    assert res.exit_code == 2, res.output
    assert field in res.output


def test_unknown_key_in_yaml(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(CONFIG.read_text() + "\nbogus_key: 1\n")
    res = runner.invoke(app, ["run", str(cfg), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "bogus_key" in res.output


def test_patch_larger_than_width_without_low_resolution(tmp_path):
    res = runner.invoke(app, ["run", str(CONFIG), "--out", str(tmp_path), "--set", "model.name=vit-b32",
                              "--set", "model.layers=1", "--set", "data.batch_size=2", "--set", "data.public_size=20"])
    assert res.exit_code == 2 and "low_resolution" in res.output


def test_missing_offline_asset_names_install_command(tmp_path, monkeypatch):
    import gradleak.data.builtin as builtin

    real_find_spec = builtin.importlib.util.find_spec
    monkeypatch.setattr(builtin.importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "foolbox" else real_find_spec(name, *a, **k))
    for obj in vars(builtin).values():  # drop cached image loads so the files are looked up again
        if hasattr(obj, "cache_clear"):
            obj.cache_clear()
    res = runner.invoke(app, ["run", str(CONFIG), "--out", str(tmp_path)])
    assert res.exit_code == 2, res.output
    assert "pip install" in res.output and "foolbox" in res.output


def test_list_shows_registries():
    res = runner.invoke(app, ["list"])
    assert res.exit_code == 0
    for name in ("peftleak", "gaussian_noise", "cifar-samples", "psnr", "patch_recovery"):
        assert name in res.output


def test_console_script_exit_code_for_missing_config(tmp_path):
    exe = Path(sys.executable).parent / "gradleak"
    res = subprocess.run([str(exe), "run", str(tmp_path / "nope.yaml"), "--out", str(tmp_path)], capture_output=True, text=True)
    assert res.returncode == 2 and "does not exist" in res.stderr + res.stdout


def test_scientific_notation_without_a_dot_is_a_number_everywhere():
    """PyYAML reads `1e-6` as a string (YAML 1.1); configs and --set values nested in lists read it as a float."""
    from gradleak.config.loading import parse_value, yaml_value

    assert parse_value("[{name: gaussian_noise, params: {std: 1e-06}}]")[0]["params"]["std"] == 1e-6
    assert yaml_value("a: 3E5\nb: 1.5\nc: 7\nd: abc\ne: .5")== {"a": 3e5, "b": 1.5, "c": 7, "d": "abc", "e": 0.5}


# ------------------------------------------------------------------------------ console and report

def _audit_result(reason="needs a stronger server than configured: run as an honest-but-curious server holding "
                         "public data, and this note is long enough to be cut at eighty columns"):
    return {"verdict": "leaks", "headline": "LEAKS: EXACT leakage by utr", "modality": "text",
            "attacks": [{"name": "utr", "modality": "text", "applicable": True, "level": "exact", "metric": "rouge1_f1",
                         "value": 100.0, "null_p99": 23.9, "worst_client": 0, "rule": "word for word", "out": "attacks/utr"},
                        {"name": "projres_adaptive", "modality": "text", "applicable": False,
                         "applicable_under": "upgraded", "level": "strong", "metric": "auc", "value": 1.0,
                         "null_p99": 0.93, "worst_client": 0, "reason": reason, "rule": "auc"},
                        *({"name": n, "modality": "image", "applicable": False,
                           "reason": f"attack.name: '{n}' attacks image data, but this experiment's data are text. "
                                     "Fix: attacks for text ..."} for n in ("dlg", "ig", "peftleak"))],
            "levels": {"null": "n", "psnr_db": 40.0, "rules": {}}, "setup": ["s"], "threat": ["t"],
            "command": "gradleak audit c.yaml --out o", "config_hash": "h", "seed": 0, "environment": {},
            "not_tested": [], "undefined": [], "defenses_available": []}


def test_audit_console_table_not_cut_when_not_a_tty(capsys, monkeypatch, tmp_path):
    """Piped (not a TTY) the table is as wide as COLUMNS says, else 200: no note cut mid-word at 80 columns, no
    ellipsis; the image attacks of a text audit are one row."""
    from gradleak import cli

    monkeypatch.delenv("COLUMNS", raising=False)
    cli._fit_consoles()
    cli._print_audit_table(_audit_result(), tmp_path)
    text = capsys.readouterr().out
    assert "…" not in text
    tokens = text.replace("│", " ").split()
    for word in _audit_result()["attacks"][1]["reason"].split():  # wrapped at words, never cut inside one
        assert word in tokens, word
    assert max(len(line) for line in text.splitlines()) > 80
    assert any("projres_adaptive" in line for line in text.splitlines())
    assert "3 image attacks" in text and "dlg, ig, peftleak" in text
    assert not any(line.lstrip("│ ").startswith(("dlg ", "ig ", "peftleak ")) for line in text.splitlines())
    monkeypatch.setenv("COLUMNS", "120")
    cli._fit_consoles()
    assert cli.out_console.width == 120


def test_audit_command_line_is_shell_quoted(tmp_path, monkeypatch):
    import shlex

    seen = {}

    def fake_audit(raw, out, overrides, device, **kw):
        seen.update(kw)
        return {**_audit_result(), "attacks": []}

    monkeypatch.setattr("gradleak.run.audit.run_audit", fake_audit)
    value = "defenses=[{name: clipping, params: {max_norm: 1.0}}]"
    res = runner.invoke(app, ["audit", str(ROOT / "configs" / "audit" / "text_adapters.yaml"), "--out",
                              str(tmp_path / "a b"), "--set", value, "--only", "utr", "--workers", "1"])
    assert res.exit_code == 0, res.output
    args = shlex.split(seen["command"])
    assert args[4] == str(tmp_path / "a b") and args[5:7] == ["--set", value] and args[7:9] == ["--only", "utr"]


def test_list_prints_no_pydantic_undefined():
    res = runner.invoke(app, ["list"])
    assert res.exit_code == 0
    assert "PydanticUndefined" not in res.output
    assert "defense.attack = {}" in res.output  # a default_factory's value


def test_report_rebuilds_an_audit_report(tmp_path, monkeypatch):
    (tmp_path / "audit.json").write_text(json.dumps(_audit_result()))
    res = runner.invoke(app, ["report", str(tmp_path)])
    assert res.exit_code == 0, res.output
    page = (tmp_path / "report.html").read_text()
    assert 'id="verdict"' in page and "What to do next" in page and "3 image attacks" in page
    (tmp_path / "audit.json").write_text(json.dumps({"verdict": "leaks"}))
    res = runner.invoke(app, ["report", str(tmp_path)])
    assert res.exit_code == 2 and "DIR" in res.output and "not a gradleak audit file" in res.output


@pytest.mark.parametrize("kind", ["audit", "run"])
def test_report_on_a_read_only_directory_exits_2(tmp_path, monkeypatch, kind):
    """A directory the report cannot be written to: exit 2 naming DIR and the fix, no traceback."""
    if kind == "audit":
        (tmp_path / "audit.json").write_text(json.dumps(_audit_result()))
    else:
        (tmp_path / "results.json").write_text(json.dumps({"name": "x", "metrics": {"a": 1.0}}))

    def read_only(*a, **k):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr("gradleak.report.html.write_atomic", read_only)
    res = runner.invoke(app, ["report", str(tmp_path)])
    assert res.exit_code == 2, res.output
    assert "DIR" in res.output and "Read-only file system" in res.output and "Traceback" not in res.output


def test_run_prints_the_attack_warnings(tmp_path, monkeypatch):
    """An attack's warning (e.g. lora_span on an under-determined setting) is said on the console."""
    w = "lora_span: under-determined setting, the rank condition fails (batch of 2)"

    def fake_run(raw, out, overrides, device, track, stage):
        return {"name": "x", "metrics": {"psnr_max": 12.0}, "timings": {"total_seconds": 1.0},
                "details": {"warnings": [w]}}

    monkeypatch.setattr("gradleak.run.run_config", fake_run)
    res = runner.invoke(app, ["run", str(CONFIG), "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "warning: " + w in " ".join(res.output.split())
