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
