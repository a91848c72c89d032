"""Layer-wise trainable positional embeddings (paper 001 eq. 6) and the PE-gradient anchor (eq. 7) on the gradient-
matching attacks ig / dlg / april; label recovery from the head gradient; the config gates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from gradleak.attacks.optimization.inverting_gradients import IG, DLG, April, InvertingGradients
from gradleak.attacks.optimization.labels import infer_label_from_head_weight_gradient, recover_labels_from_head
from gradleak.cli import app
from gradleak.data import load
from gradleak.errors import BadInput
from gradleak.fl.core import Client, Update
from gradleak.metrics import psnr
from gradleak.models import ModelHandle
from gradleak.models.vit import vit
from gradleak.peft import PeftConfig, apply_peft
from gradleak.peft.layer_pe import add_layer_pe, pe_parameter_names
from gradleak.registry import ATTACKS

from _tiny_vit import lora_pe_vit, view_of  # tests/ is on sys.path (rootdir conftest)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "lora_vit" / "cifar_b1.yaml"
runner = CliRunner()


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def images8() -> torch.Tensor:
    """Real CIFAR images, area-resized to 8×8, in [0, 1]."""
    return F.interpolate(load("cifar-samples", n=4).images, size=8, mode="area")


def test_names_registered_and_old_name_kept():
    assert ATTACKS.get("inverting_gradients") is InvertingGradients
    assert ATTACKS.get("ig") is IG and ATTACKS.get("dlg") is DLG and ATTACKS.get("april") is April
    assert IG.distance == "cosine" and DLG.distance == "l2" and April.input_pe_term
    assert "analytic" in April.__doc__ and "does **not** apply to LoRA" in April.__doc__
    assert IG.requires(IG.Config(anchor=True))["prescribes_architecture"] is True
    assert IG.requires(IG.Config())["knows_labels"] is False  # labels: auto


def test_layer_pe_inserts_trainable_pes_and_keeps_the_function_at_zero_init(images8):
    plain = vit("vit-tiny", image_size=8, patch_size=4, hidden_size=32, heads=2, layers=3, num_classes=4, seed=0)
    x = images8[:1] * 2 - 1
    before = plain(x).detach()
    names = add_layer_pe(plain)
    assert names == ["vit.embeddings.position_embeddings", "vit.encoder.layer.1.layer_pe", "vit.encoder.layer.2.layer_pe"]
    assert torch.equal(plain(x), before)  # zeros: the prescribed model computes the same function
    with torch.no_grad():
        plain.vit.encoder.layer[2].layer_pe.normal_()
    assert not torch.allclose(plain(x), before)  # the hook is live (eq. 6: added to block 2's input)
    h = lora_pe_vit()
    trainable = [n for n, p in h.model.named_parameters() if p.requires_grad]
    assert pe_parameter_names(trainable) == ["vit.embeddings.position_embeddings", "vit.encoder.layer.1.layer_pe"]
    assert any("lora_A" in n for n in trainable) and "head.bias" in trainable
    with pytest.raises(BadInput) as err:
        PeftConfig(kind="adapters", layer_pe=True).check()
    assert err.value.field == "peft.layer_pe"


def test_pe_gradient_term_is_present_and_changes_the_loss(images8):
    h = lora_pe_vit()
    view = view_of(h.model, images8[:1], torch.tensor([2]), labels=[2])
    upd = view.updates[0]
    assert float(upd.tensors["vit.encoder.layer.1.layer_pe"].norm()) > 0  # the anchor the client uploads
    x = torch.rand(1, 3, 8, 8, generator=torch.Generator().manual_seed(5)) * 2 - 1
    t_plain, m_plain, pe_plain = IG(steps=1, anchor=False).matching_objective(view)(x, False)
    f_anchor = IG(steps=1, anchor=True).matching_objective(view)
    t1, m1, pe1 = f_anchor(x, False)
    t_half, _, pe_half = IG(steps=1, anchor=True, anchor_weight=0.1).matching_objective(view)(x, False)
    assert pe_plain is None and torch.equal(t_plain, m_plain)
    assert float(pe1) > 1e-3 and torch.allclose(m1, m_plain)  # same θ' term, plus the PE cosine
    assert float(t1 - t_plain) == pytest.approx(float(pe1), rel=1e-5)
    assert float(t_half - m1) == pytest.approx(0.1 * float(pe_half), rel=1e-5)
    assert set(f_anchor.setup.names[i] for i in f_anchor.setup.pe_terms) == {
        "vit.embeddings.position_embeddings", "vit.encoder.layer.1.layer_pe"}
    rec = IG(steps=2, anchor=False, time_fwdbwd=False).reconstruct(view)
    assert set(rec.info["unmatched_parameters"]) == {"vit.embeddings.position_embeddings", "vit.encoder.layer.1.layer_pe"}
    # APRIL: its own cosine on the input PE without the anchor; the layer-wise PEs join it with the anchor
    assert April(steps=1).matching_objective(view).setup.pe_terms == [
        f_anchor.setup.names.index("vit.embeddings.position_embeddings")]
    # zero-initialised p_l: the head/LoRA gradients are those of the same model without layer-wise PEs
    bare = vit("vit-tiny", image_size=8, patch_size=4, hidden_size=32, heads=2, layers=2, num_classes=4, seed=0)
    hb = ModelHandle(bare, "image", "vit-tiny", "image", 32, 2)
    apply_peft(hb, PeftConfig(kind="lora", lora_rank=4, lora_targets=["query", "value"]), seed=0)
    ub = view_of(hb.model, images8[:1], torch.tensor([2])).updates[0]
    assert all(torch.allclose(ub.tensors[k], upd.tensors[k], atol=1e-6) for k in ub.tensors)


def test_double_backward_matches_finite_differences_in_float64(images8):
    h = lora_pe_vit(torch.float64, init="input")  # non-zero p_l
    view = view_of(h.model, images8[1:2], torch.tensor([1]), labels=[1])
    f = IG(steps=1, anchor=True).matching_objective(view)
    cfgs = {m.config._attn_implementation for m in f.setup.model.modules() if hasattr(m, "config")}
    assert cfgs == {"eager_precise"}  # HF eager's softmax would round to float32 inside the float64 model
    g = torch.Generator().manual_seed(3)
    x0 = (torch.rand(1, 3, 8, 8, generator=g, dtype=torch.float64) - 0.5)
    v = torch.randn(1, 3, 8, 8, generator=g, dtype=torch.float64)

    def errors():
        x = x0.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(f(x, True)[0], x)  # the second derivative the attack uses
        hstep = 1e-5
        fd = (f(x0 + hstep * v, False)[0] - f(x0 - hstep * v, False)[0]) / (2 * hstep)
        return abs(float(fd - (grad * v).sum())) / abs(float(fd))

    precise = errors()
    assert precise < 1e-6
    for m in f.setup.model.modules():  # the same check with HF's float32 softmax fails by orders of magnitude
        if hasattr(m, "config"):
            m.config._attn_implementation = "eager"
    assert errors() > 100 * precise


@pytest.mark.parametrize("anchor,image,steps", [(True, 1, 200), (False, 0, 300)])
def test_ig_recovers_one_image_on_a_tiny_vit_from_full_gradients(images8, anchor, image, steps):
    """Fully trainable tiny ViT (8×8, patch 4, d = 128, 2 blocks), B = 1. With layer-wise PEs and the anchor every
    image of the first three is recovered (47–50 dB at 300 steps); plain IG is image-dependent (36 / 7.7 / 15 dB),
    image 0 is its good case."""
    model = vit("vit-tiny", image_size=8, patch_size=4, hidden_size=128, heads=2, layers=2, num_classes=4, seed=0)
    for p in model.parameters():
        p.requires_grad_(True)
    if anchor:
        add_layer_pe(model)
    truth = images8[image:image + 1]
    view = view_of(model, truth, torch.tensor([1]), labels=[1])
    rec = IG(steps=steps, anchor=anchor, time_fwdbwd=False).reconstruct(view)
    assert float(psnr(rec.data["images"], truth)[0]) > 30.0
    assert rec.info["label_source"] == "public"


def test_label_recovery_exact_at_batch_one(images8):
    model = vit("vit-tiny", image_size=8, patch_size=4, hidden_size=32, heads=2, layers=1, num_classes=7, seed=1)
    for p in model.parameters():
        p.requires_grad_(False)
    for p in model.head.parameters():
        p.requires_grad_(True)
    for i in range(4):
        for label in (0, 3, 6):
            upd = Client(0, images8[i:i + 1] * 2 - 1, torch.tensor([label])).local_update(model)
            assert recover_labels_from_head(upd, 7, 1)[0].tolist() == [label]  # head-bias sign
            no_bias = Update({"head.weight": upd.tensors["head.weight"]}, 1)
            labels, source = recover_labels_from_head(no_bias, 7, 1)
            assert labels.tolist() == [label] and source == "head_rows:head.weight"  # head-weight rows
    with pytest.raises(BadInput):
        infer_label_from_head_weight_gradient(torch.randn(2, 5))  # two classes: ambiguous
    # through the attack: labels not granted -> recovered (ig's default labels: auto)
    h = lora_pe_vit()
    view = view_of(h.model, images8[:1], torch.tensor([3]))
    rec = IG(steps=1, time_fwdbwd=False).reconstruct(view)
    assert rec.info["labels"] == [3] and rec.info["label_source"] == "idlg:head.bias"


def test_anchor_without_layer_pes_is_refused(tmp_path, images8):
    plain = vit("vit-tiny", image_size=8, patch_size=4, hidden_size=32, heads=2, layers=2, num_classes=4, seed=0)
    with pytest.raises(BadInput) as err:
        IG(anchor=True).prepare(plain, None)
    assert err.value.field == "attack.anchor"
    for p in plain.parameters():
        p.requires_grad_(True)
    with pytest.raises(BadInput) as err:  # an update without layer-wise PE gradients
        DLG(anchor=True).reconstruct(view_of(plain, images8[:1], torch.tensor([1])))
    assert err.value.field == "attack.anchor"
    res = runner.invoke(app, ["run", str(CONFIG), "--out", str(tmp_path / "a"), "--set", "attack.name=ig",
                              "--set", "attack.anchor=true", "--set", "peft.layer_pe=false"])
    assert res.exit_code == 2 and "attack.anchor" in res.output
    res = runner.invoke(app, ["run", str(CONFIG), "--out", str(tmp_path / "b"), "--set", "threat.preset=honest-but-curious"])
    assert res.exit_code == 2 and "threat.preset" in res.output  # the layer-wise PEs are the server's architecture


def test_pipeline_ig_with_anchor_reports_psnr_ssim_and_the_iteration_ratio(tmp_path):
    from gradleak.run import run_config

    raw = {"experiment": "image", "seed": 0, "data": {"name": "cifar-samples", "batch_size": 1, "image_size": 8},
           "model": {"name": "vit-tiny", "layers": 2, "patch_size": 4, "hidden_size": 32, "heads": 2, "num_classes": 110},
           "peft": {"kind": "lora", "lora_rank": 4, "lora_targets": ["query", "value"], "layer_pe": True},
           "metrics": {"feature_distance": False}, "threat": {"preset": "prescribes-architecture"},
           "attack": {"name": "april", "steps": 5, "anchor": True, "anchor_weight": 0.1}}
    res = run_config(raw, tmp_path)
    assert {"psnr", "ssim"} <= set(res["metrics"])
    assert res["timings"]["iteration_to_fwdbwd_ratio"] > 0
    info = res["details"]["attack_info"]
    assert info["anchor"] and info["anchor_weight"] == 0.1 and "vit.encoder.layer.1.layer_pe" in info["pe_term_parameters"]


def test_lora_span_still_exact_with_layer_pes_on_the_shipped_config(tmp_path, vit_s14_available):
    """The PEs of blocks >= 1 do not change block 0: lora_span on the shipped config (2 blocks, so block 1 has p_1)."""
    out = tmp_path / "o"
    res = runner.invoke(app, ["run", str(CONFIG), "--out", str(out), "--set", "model.layers=2",
                              "--set", "metrics.feature_distance=false"])
    assert res.exit_code == 0, res.output
    r = json.loads((out / "results.json").read_text())
    assert r["config"]["peft"]["layer_pe"] is True and r["config"]["threat"]["preset"] == "prescribes-architecture"
    assert r["details"]["attack_info"]["row_space_rank"] == 65 and r["metrics"]["image_psnr_mean"] > 40
