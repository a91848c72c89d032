"""Paper 003 on the one pipeline: BN statistics in the round protocol, per-client settings, the percentile-noise
defense, the registered ``bn_inversion`` attack and the per-client leakage evaluation (RDLV, IIP)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from gradleak.cli import app
from gradleak.errors import BadInput
from gradleak.fl.core import Client, ServerView, Update, aggregate, batchnorm_buffer_names, secure_aggregate
from gradleak.fl.engines.builtin import run_rounds

ROOT = Path(__file__).resolve().parents[1]
LEAKAGE = ROOT / "configs" / "leakage" / "fmnist_resnet18.yaml"
runner = CliRunner()

#: the shipped config, shrunk: 2 clients (2 images at B = 2, and the high-risk 1-image client), 36 px, 1 round
TINY = ["data.image_size=36", "data.validation_size=0", "fl.rounds=2", "fl.clients=2", "fl.client_images=[2,1]",
        "fl.client_batch_sizes=[2,1]", "fl.client_epochs=[1,1]", "attack.iterations=2", "attack.warmup=1",
        "metrics.iip=false", "data.prior_size=8", "data.test_size=16", "model.pretrain.images=32",
        "model.pretrain.epochs=1", "model.pretrain.batch_size=16"]


def tiny_bn_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, 3)).double()


def _clients(n: int = 2):
    g = torch.Generator().manual_seed(0)
    return [Client(i, torch.rand(2 + i, 1, 8, 8, generator=g, dtype=torch.float64), torch.tensor([0, 1, 2][: 2 + i]))
            for i in range(n)]


# ------------------------------------------------------------------------------------------ round protocol
def test_updates_carry_bn_buffer_changes_and_the_server_averages_them():
    model = tiny_bn_net().eval()  # the clients must still train in train mode
    start = {k: v.clone() for k, v in model.state_dict().items()}
    clients = _clients()
    out = run_rounds(model, clients, rounds=2, algorithm="fedavg", lr=0.1, local_batch_size=2,
                     client_settings=[{"batch_size": 1, "epochs": 1}, {"batch_size": 3, "epochs": 2}])
    r0 = out.rounds[0]
    names = batchnorm_buffer_names(model)
    assert set(names) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    assert [u.local_steps for u in r0] == [2, 2]  # per-client settings: 2 images at B = 1; 3 images at B = 3, 2 epochs
    for u in r0:
        assert u.buffers is not None and set(u.buffers) == set(names)
        assert float(u.buffers["1.num_batches_tracked"]) == u.local_steps
        assert float(u.buffers["1.running_mean"].abs().max()) > 0
    # round_states holds the full checkpoint: parameters and BN buffers
    assert set(out.round_states[0]) == {n for n, _ in model.named_parameters()} | set(names)
    assert torch.equal(out.round_states[0]["1.running_var"], start["1.running_var"])
    mean = aggregate(r0).buffers
    for k in ("1.running_mean", "1.running_var"):
        expect = start[k].double() + mean[k]
        assert torch.allclose(out.round_states[1][k].double(), expect, atol=1e-12), k
    assert int(out.round_states[1]["1.num_batches_tracked"]) == 2
    sec = secure_aggregate(r0, seed=3).buffers
    for k in mean:
        assert torch.allclose(sec[k], mean[k], atol=1e-9)
    # a model without BatchNorm uploads no buffers (every earlier attack sees the same Update)
    lin = nn.Sequential(nn.Flatten(), nn.Linear(64, 3)).double()
    plain = run_rounds(lin, clients, rounds=1, algorithm="fedavg", lr=0.1)
    assert plain.rounds[0][0].buffers is None and set(plain.round_states[0]) == {"1.weight", "1.bias"}


def test_lr_step_decay_reaches_clients_and_server():
    from gradleak.config.schema import FLConfig

    f = FLConfig(lr=0.1, lr_decay=0.5, lr_step_rounds=2, rounds=5)
    assert [f.lr_at(r) for r in range(5)] == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025])
    model = tiny_bn_net()
    seen = []

    class Spy:
        def apply(self, upd, ctx):
            seen.append(ctx["lr"])
            return upd

    run_rounds(model, _clients(1), rounds=3, algorithm="fedavg", lr=0.1, defenses=[Spy()], lr_at=f.lr_at)
    assert seen == pytest.approx([0.1, 0.1, 0.05])


# ------------------------------------------------------------------------------------------ percentile noise
def _upd():
    g = torch.Generator().manual_seed(1)
    tensors = {"w": torch.randn(50, generator=g, dtype=torch.float64), "b": torch.zeros(5, dtype=torch.float64)}
    tensors["b"][0] = 3.0
    buffers = {"bn.running_mean": 100 * torch.randn(4, generator=g, dtype=torch.float64),
               "bn.num_batches_tracked": torch.tensor(2.0, dtype=torch.float64)}
    return Update(tensors, 4, 0, "pseudo_gradient", 2, buffers)


def test_percentile_noise_sigma_matches_numpy_over_nonzero_entries_on_the_weight_delta_scale():
    from gradleak.defenses.update import PercentileNoise as GaussianPercentileNoise

    u, lr = _upd(), 0.1
    d = GaussianPercentileNoise(10.0, seed=0)
    entries = np.concatenate([u.tensors["w"].numpy() * lr, u.tensors["b"].numpy() * lr, u.buffers["bn.running_mean"].numpy()])
    entries = np.abs(entries[entries != 0])
    expect = 10.0 * np.percentile(entries, 95)
    sig = d.sigmas(u, {"lr": lr})
    assert len(set(sig.values())) == 1 and next(iter(sig.values())) == pytest.approx(expect, rel=1e-12)
    out = d.apply(u, {"lr": lr, "client_id": 0, "seed": 0})
    assert float(out.buffers["bn.num_batches_tracked"]) == 2.0  # the step counter is not noised
    noise_w = (out.tensors["w"] - u.tensors["w"]) * lr  # on the Δw scale
    assert 0.5 * expect < float(noise_w.std()) < 1.5 * expect
    assert float((out.buffers["bn.running_mean"] - u.buffers["bn.running_mean"]).abs().max()) > 0
    per = GaussianPercentileNoise(10.0, per_tensor=True).sigmas(u, {"lr": lr})
    assert per["p:w"] == pytest.approx(10.0 * np.percentile(np.abs(u.tensors["w"].numpy() * lr), 95), rel=1e-12)
    assert per["p:b"] == pytest.approx(10.0 * 3.0 * lr)  # the one non-zero entry
    assert GaussianPercentileNoise(0.0).apply(u, {"lr": lr}) is u
    assert set(GaussianPercentileNoise(1e-2, absolute=True).sigmas(u, {"lr": lr}).values()) == {1e-2}
    with pytest.raises(BadInput, match="σ0 must be ≥ 0") as e:
        GaussianPercentileNoise(-1.0)
    assert e.value.field == "defense.sigma0"


# ------------------------------------------------------------------------------------------ schema / bad input
@pytest.mark.parametrize("override,field,match", [
    ("defense.sigma0=-1", "defense.sigma0", "σ0 must be ≥ 0"),
    ("data.image_size=32", "data.image_size", "at least 33×33"),
    ("fl.client_images=[8,4]", "fl.client_images", "one value per client"),
    ("peft.kind=lora", "model.train_all", "peft.kind=none"),
])
def test_leakage_config_bad_input_names_the_field(override, field, match):
    from gradleak.run import validate
    from gradleak.config.loading import load_yaml

    with pytest.raises(BadInput, match=match) as e:
        validate(load_yaml(LEAKAGE), [override])
    assert e.value.field == field


def test_num_channels_is_refused_for_a_vit_and_the_shipped_config_validates():
    from gradleak.run import validate
    from gradleak.config.loading import load_yaml

    raw = {"experiment": "image", "model": {"name": "vit-tiny", "num_channels": 1}, "data": {"image_size": 16},
           "attack": {"name": "inverting_gradients"}}
    with pytest.raises(BadInput, match="3-channel") as e:
        validate(raw)
    assert e.value.field == "model.num_channels"
    _, cfg = validate(load_yaml(LEAKAGE), ["seed=3", "defense.sigma0=25"])
    assert cfg.seed == 3 and cfg.training_defense.cfg.sigma0 == 25 and cfg.image_channels == 1
    assert [c["images"] for c in cfg.client_plan()] == [8, 8, 1]


def test_bn_inversion_refuses_a_model_without_batchnorm(tmp_path):
    from gradleak.run import run_config

    raw = {"experiment": "image", "data": {"name": "cifar-samples", "batch_size": 1, "image_size": 16},
           "model": {"name": "vit-tiny", "layers": 1}, "peft": {"kind": "none"}, "fl": {"algorithm": "fedavg"},
           "attack": {"name": "bn_inversion", "prior": "gray"}, "metrics": {"feature_distance": False}}
    with pytest.raises(BadInput, match="no BatchNorm") as e:
        run_config(raw, tmp_path)
    assert e.value.field == "model.name"


def test_bn_inversion_refuses_updates_without_running_statistics():
    from gradleak.attacks.bn_inversion import BNInversion, BNInversionConfig

    model = tiny_bn_net()
    upd = Update({n: torch.zeros_like(p) for n, p in model.named_parameters()}, 1, 0, "pseudo_gradient", 1)
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    view = ServerView(model=model, updates=[upd], public={"image_shape": (1, 8, 8), "num_classes": 3},
                      rounds=[[upd]], round_states=[state])
    attack = BNInversion(BNInversionConfig(prior="gray", iterations=1), fl={"lr_at": [0.1], "algorithm": "fedavg"})
    with pytest.raises(BadInput, match="no BatchNorm running statistics") as e:
        attack.reconstruct(view)
    assert e.value.field == "updates"


def test_labels_from_the_head_bias_update():
    from gradleak.attacks.bn_inversion import labels_from_head

    g = {"head.bias": torch.tensor([0.2, -0.9, 0.3, 0.4])}
    assert labels_from_head(g, 1, 4).tolist() == [1]
    g = {"head.bias": torch.tensor([0.2, -0.6, -0.3, 0.7])}
    assert sorted(labels_from_head(g, 3, 4).tolist()) == [1, 1, 2]


# ------------------------------------------------------------------------------------------ end to end
def test_shipped_leakage_config_runs_through_gradleak_run_with_overrides(tmp_path):
    args = ["run", str(LEAKAGE), "--out", str(tmp_path), "--set", "seed=1", "--set", "defense.sigma0=5"]
    for o in TINY:
        args += ["--set", o]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    r = json.loads((tmp_path / "results.json").read_text())
    m = r["metrics"]
    assert m["high_risk_client"] == 1.0
    assert m["rdlv_high_risk_client"] == m["rdlv_client1"] == m["rdlv_high_risk_client_low"]  # 1 image: no width
    assert m["rdlv_max_other_clients"] == m["rdlv_low_client0"]
    assert m["rdlv_low_client0"] <= m["rdlv_client0"] <= m["rdlv_high_client0"]
    assert m["noise_sigma0"] == 5.0
    # σ0 = 5 (the paper's strongest noise) and 2 iterations: client 0's reconstruction is at chance, not beyond its null
    assert m["ssim_client0"] < m["ssim_null_p99_client0"] and m["ssim_p_value_client0"] > 0.05
    assert m["rdlv_client0"] < m["rdlv_null_p99_client0"]
    assert r["config"]["seed"] == 1 and r["config"]["defense"]["sigma0"] == 5.0
    assert (tmp_path / "reconstructions_client1_round1.png").exists()
    assert not (tmp_path / "tsne.png").exists()  # metrics.iip=false: no features, no t-SNE map
    html = (tmp_path / "report.html").read_text()
    assert "Leakage per client and round</h2>" in html and "RDLV [low, high]" in html


def test_bn_inversion_view_holds_the_checkpoint_and_the_stale_ablation_reads_an_older_one(tmp_path, monkeypatch):
    from gradleak.attacks.bn_inversion import BNInversion
    from gradleak.run import run_config
    from gradleak.config.loading import load_yaml

    seen = []
    real = BNInversion.invert

    def spy(self, view, upd, state, r, prior):
        seen.append((r, {k: v.clone() for k, v in state.items() if "running_mean" in k}, upd.buffers is not None))
        return real(self, view, upd, state, r, prior)

    monkeypatch.setattr(BNInversion, "invert", spy)
    from gradleak.config.loading import apply_overrides

    raw = apply_overrides(load_yaml(LEAKAGE), TINY + ["attack.clients=[1]", "attack.iterations=1"])
    run_config(raw, tmp_path / "a")
    run_config(apply_overrides(raw, ["attack.ablation=stale_checkpoint"]), tmp_path / "b")
    (r_now, now, has), (r_stale, stale, _) = seen
    assert r_now == r_stale == 1 and has
    assert len(now) == 20  # ResNet-18's 20 BN layers in the checkpoint
    assert any(not torch.equal(now[k], stale[k]) for k in now)  # the stale checkpoint is round 0's
