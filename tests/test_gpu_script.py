"""benchmarks/gpu.py, the prepared GPU run: every step checked on CPU at a tiny scale (the GPU itself is checked when a
session is lent one), rows labelled with the device, and a clear refusal where no CUDA device exists."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _gpu_module():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("gpu_script", ROOT / "benchmarks" / "gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_step_of_the_gpu_script_runs_tiny_on_cpu(tmp_path):
    gpu = _gpu_module()
    assert gpu.main(["--device", "cpu", "--tiny", "--out", str(tmp_path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "gpu.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == ["audit_vit_adapters", "audit_vit_lora", "advise_vit_lora", "generator",
                                         "anchor_gias"]
    assert all(r["device"] == "cpu" and r["device_name"] == "cpu" and r["tiny"] and "error" not in r for r in rows)
    assert all(r["revision"] and r["command"] for r in rows)
    assert rows[0]["levels"] == {"dlg": "none"} and rows[2]["unfinished"] == []
    assert set(rows[4]["cells"]) == {"tiny/ig+anchor"}
    # a rerun redoes nothing (resumable rows), and the plan's docstring names every step
    assert gpu.main(["--device", "cpu", "--tiny", "--out", str(tmp_path)]) == 0
    assert len((tmp_path / "gpu.jsonl").read_text().splitlines()) == 5
    for step in ("audit_vit_adapters", "audit_vit_lora", "advise_vit_lora", "generator", "anchor_gias"):
        assert step in gpu.__doc__


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_gpu_is_refused_with_the_fix(tmp_path, capsys):
    gpu = _gpu_module()
    assert gpu.main(["--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "--device cpu --tiny" in capsys.readouterr().err
    assert not (tmp_path / "gpu.jsonl").exists()
