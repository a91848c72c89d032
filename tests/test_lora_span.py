"""lora_span: exact recovery from the block-0 LoRA-A row space, the regime it reports, bad input,
and the pretrained ViT-S/14 builder through the pipeline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from gradleak.attacks.lora_span import LoraSpan, spectral_rank
from gradleak.cli import app
from gradleak.errors import BadInput
from gradleak.fl.core import Client, ServerView
from gradleak.metrics import psnr
from gradleak.models import ModelHandle
from gradleak.peft import PeftConfig, apply_peft

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "lora_vit" / "cifar_b1.yaml"
runner = CliRunner()


def _tiny(kind: str, seed: int = 0):
    """A 1-block float64 ViT (d = 64, 2 heads, 8×8 images, patch 2: 16 patches of 12 pixels), random init with a
    random (non-zero) LayerNorm weight and bias, as HF ViT or as DINOv2 (layer-scale, ε = 1e-6)."""
    torch.manual_seed(seed)
    if kind == "vit":
        from gradleak.models.vit import vit

        model = vit("vit-tiny", image_size=8, patch_size=2, hidden_size=64, heads=2, layers=1, num_classes=4,
                    dtype=torch.float64, seed=seed)
        norm = model.vit.encoder.layer[0].layernorm_before
    else:
        from transformers import Dinov2Config

        from gradleak.models.dinov2 import Dinov2Classifier

        cfg = Dinov2Config(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128, patch_size=2,
                           image_size=8, layer_norm_eps=1e-6, attn_implementation="eager")
        model = Dinov2Classifier(cfg, 4).to(torch.float64)
        norm = model.vit.encoder.layer[0].norm1
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn_like(norm.weight))
        norm.bias.copy_(0.2 * torch.randn_like(norm.bias))
    return ModelHandle(model.eval(), "image", kind, "image", 64, 1)


def _view(handle, images01, labels, rank=32, targets=("query",), layers=None):
    apply_peft(handle, PeftConfig(kind="lora", lora_rank=rank, lora_targets=list(targets), lora_layers=layers), seed=0)
    x = images01.to(torch.float64) * 2 - 1
    upd = Client(0, x, labels).local_update(handle.model)
    return ServerView(model=handle.model, updates=[upd], public={"image_shape": tuple(x.shape[1:]), "num_classes": 4,
                                                                 "batch_size": len(x)})


def _images(n=1, seed=0):
    return torch.rand(n, 3, 8, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("kind", ["vit", "dinov2"])
def test_exact_recovery_on_a_tiny_float64_vit(kind):
    truth = _images()
    view = _view(_tiny(kind), truth, torch.tensor([1]))
    rec = LoraSpan(time_fwdbwd=False).reconstruct(view)
    assert rec.metrics["lora_span_rank_condition_holds"] == 1.0
    # 16 patches; the CLS token's query gets no gradient in one block with mean pooling (its output is unused)
    assert rec.info["row_space_rank"] == 16
    assert rec.info["unknowns_per_patch"] == 13 and rec.info["system_rank"] == 13
    assert float(psnr(rec.data["images"].double(), truth)) > 150  # exact up to float64 rounding
    assert rec.metrics["lora_span_patch_residual_max"] < 1e-8


def test_rank_condition_failures_are_flagged_not_silent():
    truth = _images()
    # LoRA rank 8 < 17 tokens: the row space is saturated
    rec = LoraSpan(time_fwdbwd=False).reconstruct(_view(_tiny("vit"), truth, torch.tensor([1]), rank=8))
    assert rec.metrics["lora_span_rank_condition_holds"] == 0.0
    assert "saturated" in rec.info["rank_condition"] and "warning" in rec.info
    # two images: tokens of both lie in the span, every patch is ambiguous
    rec = LoraSpan(time_fwdbwd=False).reconstruct(_view(_tiny("vit"), _images(2), torch.tensor([1, 2]), rank=48))
    assert rec.metrics["lora_span_rank_condition_holds"] == 0.0
    assert "batch of 2" in rec.info["rank_condition"]


def test_spectral_rank_finds_the_gap_or_reports_saturation():
    S = torch.tensor([1.0, 0.5, 0.2, 1e-3, 1e-7, 5e-8, 4e-8])
    assert spectral_rank(S, 10.0) == 4
    assert spectral_rank(torch.tensor([1.0, 0.7, 0.5, 0.3]), 10.0) == 4  # no gap: full (saturated) rank
    assert spectral_rank(S, 10.0, rtol=1e-2) == 3
    assert spectral_rank(torch.zeros(3), 10.0) == 0


@pytest.mark.parametrize("targets,layers,field", [(("query",), [1], "peft.lora_layers"),
                                                   (("dense",), None, "peft.lora_targets")])
def test_refused_without_lora_on_block_0(targets, layers, field):
    from gradleak.models.vit import vit

    model = vit("vit-tiny", image_size=8, patch_size=2, hidden_size=64, heads=2, layers=2, num_classes=4)
    handle = ModelHandle(model, "image", "vit-tiny", "image", 64, 2)
    apply_peft(handle, PeftConfig(kind="lora", lora_rank=8, lora_targets=list(targets), lora_layers=layers))
    with pytest.raises(BadInput) as err:
        LoraSpan().prepare(handle.model, None)
    assert err.value.field == field and err.value.fix


def test_cli_refuses_lora_span_without_lora(tmp_path):
    res = runner.invoke(app, ["run", str(CONFIG), "--out", str(tmp_path), "--set", "peft.kind=adapters"])
    assert res.exit_code == 2 and "peft.kind" in res.output


def test_pipeline_run_on_real_cifar_with_a_tiny_float32_vit(tmp_path):
    from gradleak.run import run_config

    raw = {"experiment": "image", "seed": 0, "data": {"name": "cifar-samples", "batch_size": 1, "image_size": 16},
           "model": {"name": "vit-tiny", "layers": 1, "patch_size": 4, "num_classes": 110, "dtype": "float32"},
           "peft": {"kind": "lora", "lora_rank": 32, "lora_targets": ["query", "value"]},
           "metrics": {"feature_distance": False}, "threat": {"preset": "honest-but-curious"},
           "attack": {"name": "lora_span"}}
    res = run_config(raw, tmp_path)
    m = res["metrics"]
    assert m["lora_span_rank_condition_holds"] == 1.0 and m["image_psnr_mean"] > 40
    assert m["attack_to_fwdbwd_ratio"] > 0 and res["details"]["attack_info"]["patch_size"] == 4
    assert (tmp_path / "reconstruction.png").is_file()


def test_shipped_config_on_the_pretrained_vit_s14_through_the_cli(tmp_path, vit_s14_available):
    out = tmp_path / "o"
    res = runner.invoke(app, ["run", str(CONFIG), "--out", str(out), "--set", "seed=1", "--set", "model.layers=1",
                              "--set", "metrics.feature_distance=false"])
    assert res.exit_code == 0, res.output
    r = json.loads((out / "results.json").read_text())
    info = r["details"]["attack_info"]
    assert info["backbone"].startswith("ViT-S/14 pretrained") and info["patch_size"] == 4 and info["num_patches"] == 64
    assert info["row_space_rank"] == 65 and r["metrics"]["lora_span_rank_condition_holds"] == 1.0
    assert r["metrics"]["image_psnr_mean"] > 40  # float32 upload, exact up to rounding
    assert r["config"]["model"]["name"] == "vit-s14-pretrained"
