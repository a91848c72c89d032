"""FedAvg clients for the image optimisation attacks (paper 001 Supp. M): the server matching the
pseudo-gradient as one gradient (``emulate: single_step``) or simulating the client's K local SGD steps
(``local_steps``); the experiment's ``scale`` key (cpu / paper iteration budgets)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from gradleak.attacks.common.simulation import client_training_config
from gradleak.attacks.optimization.gias import GIAS
from gradleak.attacks.optimization.gradvit import GradViT
from gradleak.attacks.optimization.inverting_gradients import IG, April
from gradleak.cli import app
from gradleak.data import load
from gradleak.errors import BadInput
from gradleak.config.loading import load_yaml
from gradleak.run.runner import validate
from gradleak.fl.core import Client, ServerView
from gradleak.models import ModelHandle
from gradleak.models.attention import use_precise_eager
from gradleak.models.vit import vit
from gradleak.peft import PeftConfig, apply_peft

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "lora_vit" / "cifar_b1.yaml"
runner = CliRunner()
LR = 0.01  # large enough that the K steps move the weights: single_step's gradient is then visibly off

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def images8() -> torch.Tensor:
    """Six real CIFAR images, area-resized to 8×8, in [0, 1]."""
    return F.interpolate(load("cifar-samples", n=6).images, size=8, mode="area").to(torch.float64)


def lora_pe_vit(seed=0):
    """A tiny float64 ViT (8×8 images, patch 4, d = 32, 2 blocks) with LoRA on query + value and layer-wise PEs."""
    model = vit("vit-tiny", image_size=8, patch_size=4, hidden_size=32, heads=2, layers=2, num_classes=4,
                dtype=torch.float64, seed=seed)
    handle = ModelHandle(model, "image", "vit-tiny", "image", 32, 2)
    apply_peft(handle, PeftConfig(kind="lora", lora_rank=4, lora_targets=["query", "value"], layer_pe=True,
                                  layer_pe_init="zeros", lora_init="nonzero"), seed=seed)
    use_precise_eager(handle.model)  # the client too: HF's eager softmax runs in float32 (~1e-7) even in float64
    return handle.model


def fedavg_view(model, images01, targets, batch_size, epochs=1, seed=3):
    """The server's view of one FedAvg client, plus the client's epoch-1 order (to line the true images up with
    the simulation's consecutive batches) and the public training configuration."""
    x = images01 * 2 - 1
    upd = Client(0, x, targets).local_update(model, algorithm="fedavg", lr=LR, batch_size=batch_size, epochs=epochs,
                                             seed=seed)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))  # the client's first shuffle
    fl = {"algorithm": "fedavg", "local_batch_size": batch_size, "local_epochs": epochs, "lr_at": [LR],
          "client_batch_sizes": [batch_size], "client_epochs": [epochs]}
    view = ServerView(model=model, updates=[upd], public={"image_shape": tuple(x.shape[1:]), "num_classes": 4,
                                                          "batch_size": len(x), "labels": targets[order].tolist()})
    return view, x[order], fl


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("n,batch_size", [(4, 2), (6, 2)])  # K = 2 and 3 local steps
def test_local_steps_reproduce_the_pseudo_gradient_at_the_true_images(images8, n, batch_size):
    model = lora_pe_vit()
    targets = torch.tensor([0, 1, 2, 3, 1, 2][:n])
    view, x_true, fl = fedavg_view(model, images8[:n], targets, batch_size)
    upd = view.updates[0]
    assert upd.kind == "pseudo_gradient" and upd.local_steps == n // batch_size
    m = IG(steps=1, labels="known", emulate="local_steps", fl=fl, anchor=True, time_fwdbwd=False)
    f = m.matching_objective(view)
    st = f.setup
    used = st.groups["main"] + st.groups["pe"]
    sim = m._simulated_gradients(st.model, used, x_true, st.labels, create_graph=False)
    for i, g in zip(used, sim):  # every tensor (θ' and the PEs) of the client's upload, to float64 rounding
        assert _rel(g, st.targets[i]) <= 1e-8, st.names[i]
    total, main, pe = f(x_true, create_graph=False)
    assert abs(float(main)) < 1e-12 and abs(float(pe)) < 1e-12  # the objective is 0 at the truth
    # single_step: one gradient of the whole batch at θ0 is not the K-step pseudo-gradient
    one = IG(steps=1, labels="known", anchor=True, time_fwdbwd=False).matching_objective(view)
    loss = F.cross_entropy(one.setup.model(x_true), one.setup.labels)
    grads = torch.autograd.grad(loss, [one.setup.params[i] for i in used])
    full = torch.cat([(g * upd.local_steps).reshape(-1) for g in grads])  # K × the batch gradient: the best scale
    obs = torch.cat([one.setup.targets[i].reshape(-1) for i in used])
    assert _rel(full, obs) > 0.05  # measured 0.15 (K = 2 and 3) at lr 0.01
    t1, main1, pe1 = one(x_true, create_graph=False)
    assert float(main1) > 1e-3 and float(total) < float(t1)  # 1 − cos: 4e-3 and 7e-3


def test_ig_local_steps_objective_is_zero_at_the_truth_and_gradient_reaches_the_images(images8):
    model = lora_pe_vit()
    targets = torch.tensor([0, 1, 2, 3])
    view, x_true, fl = fedavg_view(model, images8[:4], targets, batch_size=2)
    multi = IG(steps=1, labels="known", emulate="local_steps", fl=fl, time_fwdbwd=False).matching_objective(view)
    single = IG(steps=1, labels="known", time_fwdbwd=False).matching_objective(view)
    m_loss = float(multi(x_true, create_graph=False)[0])
    s_loss = float(single(x_true, create_graph=False)[0])
    assert m_loss < 1e-12 < s_loss and m_loss < s_loss
    x = x_true.clone().add_(0.1 * torch.randn(x_true.shape, generator=torch.Generator().manual_seed(0),
                                              dtype=x_true.dtype)).clamp_(-1, 1).requires_grad_(True)
    (g,) = torch.autograd.grad(multi(x)[0], x)  # differentiable through the K simulated steps
    assert torch.isfinite(g).all() and float(g.abs().sum()) > 0


def test_reconstruct_records_the_emulation(images8):
    model = lora_pe_vit()
    view, _, fl = fedavg_view(model, images8[:4], torch.tensor([0, 1, 2, 3]), batch_size=2)
    rec = April(steps=2, labels="known", emulate="local_steps", fl=fl, time_fwdbwd=False).reconstruct(view)
    emu = rec.info["emulation"]
    assert emu["mode"] == "local_steps" and emu["local_steps"] == 2 and emu["batch_size"] == 2 and emu["lr"] == LR
    assert rec.data["images"].shape == (4, 3, 8, 8) and rec.info["update_kind"] == "pseudo_gradient"
    plain = April(steps=2, labels="known", time_fwdbwd=False).reconstruct(view)
    assert "emulation" not in plain.info  # single_step: the info of before


def test_local_steps_refused_under_fedsgd_secure_aggregation_and_a_wrong_schedule(images8, tmp_path):
    model = lora_pe_vit()
    x, targets = images8[:2] * 2 - 1, torch.tensor([0, 1])
    grad = Client(0, x, targets).local_update(model)  # FedSGD: kind "gradient"
    view = ServerView(model=model, updates=[grad], public={"image_shape": (3, 8, 8), "num_classes": 4,
                                                           "batch_size": 2, "labels": [0, 1]})
    with pytest.raises(BadInput) as err:
        IG(steps=1, labels="known", emulate="local_steps").reconstruct(view)
    assert err.value.field == "attack.emulate" and "fedsgd" in err.value.problem
    with pytest.raises(BadInput) as err:
        IG(steps=1, emulate="local_steps", fl={"algorithm": "fedsgd"})
    assert err.value.field == "attack.emulate"
    with pytest.raises(BadInput) as err:  # the configuration's step count (1: full batch) vs the update's 2
        view2, _, _ = fedavg_view(model, images8[:4], torch.tensor([0, 1, 2, 3]), batch_size=2)
        IG(steps=1, labels="known", emulate="local_steps", fl={"algorithm": "fedavg", "lr": LR}).reconstruct(view2)
    assert err.value.field == "attack.emulate" and "reports 2" in err.value.problem
    with pytest.raises(BadInput) as err:
        view2.secure_aggregation = True
        IG(steps=1, labels="known", emulate="local_steps", fl={"local_batch_size": 2, "lr": LR}).reconstruct(view2)
    assert err.value.field == "attack.emulate" and "secure aggregate" in err.value.problem
    raw = load_yaml(CONFIG)  # FedSGD config: refused at config time, before any model loads
    for name in ("ig", "gradvit"):
        with pytest.raises(BadInput) as err:
            validate(raw, [f"attack.name={name}", "attack.emulate=local_steps", "threat.public_data=true"])
        assert err.value.field == "attack.emulate"
    _, cfg = validate(raw, ["attack.name=ig", "attack.emulate=local_steps", "fl.algorithm=fedavg",
                            "data.batch_size=4", "fl.local_batch_size=2"])
    assert cfg.attack_cfg.emulate == "local_steps"
    res = runner.invoke(app, ["run", str(CONFIG), "--out", str(tmp_path), "--set", "attack.name=april",
                              "--set", "attack.emulate=local_steps"])
    assert res.exit_code == 2 and "attack.emulate" in res.output
    res = runner.invoke(app, ["run", str(CONFIG), "--out", str(tmp_path), "--set", "attack.name=ig",
                              "--set", "attack.emulate=bogus"])
    assert res.exit_code == 2 and "attack.emulate" in res.output


def test_defaults_and_the_schedule_helper():
    for cls in (IG, April, GradViT):
        assert cls.Config().emulate == "single_step"
    assert GIAS.Config.model_fields["emulate"].default == "single_step"
    fl = {"algorithm": "fedavg", "local_batch_size": 8, "local_epochs": 1, "client_batch_sizes": [4, 8],
          "client_epochs": [2, 1], "lr_at": [0.1, 0.05], "lr": 0.1}
    assert client_training_config(fl, 0, 16, -1) == (4, 2, 0.05)
    assert client_training_config(fl, 1, 6, 0) == (6, 1, 0.1)  # the batch size is capped at the samples
    assert client_training_config({**fl, "algorithm": "fedsgd"}, 0, 16, 0) == (16, 1, 0.1)


def test_scale_key_sets_iterations_and_explicit_values_win(tmp_path):
    raw = load_yaml(CONFIG)
    assert raw["scale"] == "cpu"
    _, cpu = validate(raw, ["attack.name=ig"])
    _, paper = validate(raw, ["attack.name=ig", "scale=paper"])
    _, mine = validate(raw, ["attack.name=ig", "scale=paper", "attack.steps=5"])
    assert (cpu.attack_cfg.steps, paper.attack_cfg.steps, mine.attack_cfg.steps) == (300, 2000, 5)
    assert paper.dump()["scale"] == "paper"
    assert paper.dump()["scale_resolved"] == {"scale": "paper", "attack_parameters_set": {"steps": 2000}}
    assert mine.dump()["scale_resolved"]["attack_parameters_set"] == {}
    _, g = validate(raw, ["attack.name=gias", "scale=paper", "attack.generator=faces", "threat.public_data=true"])
    assert (g.attack_cfg.latent_steps, g.attack_cfg.generator_steps, g.attack_cfg.restarts) == (2000, 8000, 3)
    _, g = validate(raw, ["attack.name=gias", "attack.generator=faces", "threat.public_data=true",
                          "attack.generator_steps=7"])
    assert (g.attack_cfg.latent_steps, g.attack_cfg.generator_steps) == (300, 7)  # scale: cpu from the file
    _, none = validate({k: v for k, v in raw.items() if k != "scale"}, ["attack.name=ig"])
    assert none.scale is None and "scale_resolved" not in none.dump() and none.attack_cfg.steps == 300
    res = runner.invoke(app, ["run", str(CONFIG), "--out", str(tmp_path), "--set", "scale=bogus"])
    assert res.exit_code == 2 and "scale" in res.output


def test_gradvit_and_gias_emulate_the_local_steps(images8):
    from gradleak.models.generator import DCGANGenerator

    model = lora_pe_vit()
    view, x_true, fl = fedavg_view(model, images8[:4], torch.tensor([0, 1, 2, 3]), batch_size=2)
    gv = GradViT(steps=2, restarts=2, labels="known", feature_weight=0.0, emulate="local_steps", fl=fl, anchor=True,
                 time_fwdbwd=False)
    assert float(gv.objective(view)(x_true, create_graph=False)[1]) < 1e-12  # matching term 0 at the truth
    rec = gv.reconstruct(view)
    assert rec.info["emulation"]["local_steps"] == 2 and rec.info["final_pe_term"] is not None
    torch.manual_seed(0)
    gen = DCGANGenerator(latent_dim=8, image_size=32, channels=3, width=4).eval()  # 32 px -> 8 px by 4×4 pooling
    rec = GIAS(gen, latent_steps=2, generator_steps=1, restarts=2, labels="known", emulate="local_steps", fl=fl,
               time_fwdbwd=False).reconstruct(view)
    assert rec.info["emulation"]["local_steps"] == 2 and rec.data["images"].shape == (4, 3, 8, 8)
    assert all(v < float("inf") for v in rec.info["restart_final_losses"])


def test_pipeline_fedavg_client_with_local_steps_emulation(tmp_path):
    """`gradleak run` on the shipped config as a 2-step FedAvg client (4 images, local batch 2), IG + anchor with
    local_steps: the emulation reads the public training configuration (batch size, epochs, the round's lr)."""
    import json

    out = tmp_path / "r"
    res = runner.invoke(app, ["run", str(CONFIG), "--out", str(out), "--set", "attack.name=ig", "--set",
                              "attack.steps=2", "--set", "model.layers=2", "--set", "fl.algorithm=fedavg", "--set",
                              "data.batch_size=4", "--set", "fl.local_batch_size=2", "--set",
                              "attack.emulate=local_steps", "--set", "attack.anchor=true", "--set",
                              "metrics.feature_distance=false"])
    assert res.exit_code == 0, res.output
    r = json.loads((out / "results.json").read_text())
    assert r["config"]["attack"]["emulate"] == "local_steps" and r["config"]["scale"] == "cpu"
    assert '"emulation": {"mode": "local_steps", "local_steps": 2, "batch_size": 2, "epochs": 1, "lr": 0.001' \
        in json.dumps(r["details"])  # the attack's info (fl.lr of cifar_b1)
