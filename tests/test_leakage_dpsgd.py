"""DP-SGD (Opacus) for the image leakage study: the GroupNorm ResNet-18 (``model.norm=group``), DP-SGD FedAvg
clients (clipped, noised per-sample gradients, one step per minibatch), per-client RDP accounting, and a run of
the leakage pipeline with the defense."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from gradleak.errors import BadInput
from gradleak.fl.core import Client

pytest.importorskip("opacus")

ROOT = Path(__file__).resolve().parents[1]
LEAKAGE = ROOT / "configs" / "leakage" / "fmnist_resnet18.yaml"

#: the shipped leakage config, shrunk (as tests/test_leakage_pipeline.py's TINY)
TINY = ["data.image_size=36", "data.validation_size=0", "fl.rounds=2", "fl.clients=2", "fl.client_images=[2,1]",
        "fl.client_batch_sizes=[2,1]", "fl.client_epochs=[1,1]", "attack.iterations=2", "attack.warmup=1",
        "metrics.iip=false", "data.prior_size=8"]


@pytest.fixture(scope="module")
def gn_resnet():
    """The GroupNorm ResNet-18 in float64 (33 px: the smallest side the BatchNorm model accepts at B = 1)."""
    from gradleak.models.resnet import resnet18

    return resnet18(num_classes=10, num_channels=1, image_size=33, seed=0, dtype=torch.float64, norm="group")


def _images(n: int, side: int = 33, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 1, side, side, generator=g, dtype=torch.float64), torch.arange(n) % 10


def _dp(**kw):
    from gradleak.defenses.training import DPSGD, DPSGDParams

    dp = DPSGD(DPSGDParams(**kw))
    dp.seed = 0
    return dp


def _tiny_gn_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, 3)).double()


# ------------------------------------------------------------------------------------------ the GroupNorm model
def test_groupnorm_resnet18_has_no_batchnorm_and_the_same_convs_and_head(one_thread, monkeypatch):
    from opacus.validators import ModuleValidator

    from gradleak.config.schema import ModelConfig, PretrainConfig
    from gradleak.models import MODELS
    from gradleak.models.resnet import resnet18

    bn = resnet18(num_classes=10, num_channels=1, image_size=33, seed=0)
    gn = resnet18(num_classes=10, num_channels=1, image_size=33, seed=0, norm="group")
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in gn.modules())
    norms = {n: m for n, m in gn.named_modules() if isinstance(m, nn.GroupNorm)}
    assert len(norms) == 20 and all(m.num_groups == min(32, m.num_channels) for m in norms.values())
    assert not list(gn.buffers())  # no running statistics: uploads carry no BN buffers

    def weights(model):  # conv and linear parameters, by name
        return {f"{n}.{k}": p for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))
                for k, p in m.named_parameters(recurse=False)}

    wb, wg = weights(bn), weights(gn)
    assert wb.keys() == wg.keys() and sum(p.numel() for p in wb.values()) == sum(p.numel() for p in wg.values())
    assert all(torch.equal(wb[k], wg[k]) for k in wb)  # the same seeded weights
    assert [(n, p.shape) for n, p in bn.named_parameters()] == [(n, p.shape) for n, p in gn.named_parameters()]
    # Opacus' own fixer builds the same modules; its in-place residual block computes the same function
    fixed = ModuleValidator.fix(bn)
    assert {n: (m.num_groups, m.num_channels, m.eps) for n, m in fixed.named_modules() if isinstance(m, nn.GroupNorm)} \
        == {n: (m.num_groups, m.num_channels, m.eps) for n, m in norms.items()}
    x, _ = _images(2, side=32)  # GroupNorm needs no image-size minimum (32 px: a 1×1 map in the last stage)
    fixed.train(), gn.train()
    with torch.no_grad():
        assert torch.allclose(gn(x.float()).logits, fixed(x.float()).logits, atol=1e-6)
    # the builder: model.norm, the info, and the pretraining (of the GroupNorm model) under its own cache key
    seen = []

    def fake_pretrained(model, spec, arch, **_):
        seen.append((arch, any(isinstance(m, nn.GroupNorm) for m in model.modules())))
        return {}

    monkeypatch.setattr("gradleak.models.pretrain.pretrained", fake_pretrained)
    build = MODELS.get("resnet18")
    for norm in ("batch", "group"):
        h = build(ModelConfig(name="resnet18", num_classes=10, norm=norm, pretrain=PretrainConfig()), image_size=36,
                  seed=0, dtype="float32", num_channels=1)
        assert h.info["batchnorm_layers"] == (20 if norm == "batch" else 0)
    (arch_bn, gn_bn), (arch_gn, gn_gn) = seen
    assert "norm" not in arch_bn and not gn_bn  # the BatchNorm cache key is unchanged
    assert arch_gn == {**arch_bn, "norm": "group"} and gn_gn


def test_model_norm_is_refused_for_other_models_and_lifts_the_bn_image_size_minimum():
    from gradleak.run import validate
    from gradleak.config.loading import load_yaml

    raw = {"experiment": "image", "model": {"name": "vit-tiny", "norm": "group"}, "data": {"image_size": 16},
           "attack": {"name": "inverting_gradients"}}
    with pytest.raises(BadInput, match="resnet18") as e:
        validate(raw)
    assert e.value.field == "model.norm"
    with pytest.raises(BadInput) as e:
        validate(load_yaml(LEAKAGE), ["data.image_size=32"])
    assert e.value.field == "data.image_size"
    _, cfg = validate(load_yaml(LEAKAGE), ["data.image_size=32", "model.norm=group"])
    assert cfg.model.norm == "group"


# ------------------------------------------------------------------------------------------ DP-SGD FedAvg clients
def test_dpsgd_fedavg_without_noise_or_clipping_equals_plain_fedavg(gn_resnet, one_thread):
    """3 images at B = 2 (a full and a partial batch), 1 epoch: Opacus' per-sample gradients, unclipped and
    noiseless, give the plain FedAvg client's pseudo-gradient (same shuffle, same SGD steps)."""
    x, y = _images(3)
    client = Client(0, x, y)
    plain = client.local_update(copy.deepcopy(gn_resnet), algorithm="fedavg", epochs=1, lr=0.05, batch_size=2, seed=4)
    dp = _dp(noise_multiplier=0.0, max_grad_norm=1e9)
    upd = dp.local_update(client, copy.deepcopy(gn_resnet), seed=4, algorithm="fedavg", lr=0.05, round_index=0,
                          epochs=1, batch_size=2)
    assert (upd.kind, upd.local_steps, upd.num_samples, upd.client_id) == ("pseudo_gradient", 2, 3, 0)
    assert upd.buffers is None and plain.buffers is None
    assert upd.tensors.keys() == plain.tensors.keys()
    assert all(t.dtype == torch.float64 for t in upd.tensors.values())
    diff = math.sqrt(sum(float(((upd.tensors[k] - plain.tensors[k]) ** 2).sum()) for k in plain.tensors))
    assert diff <= 1e-6 * plain.norm()
    assert dp.steps == {0: 2}


def test_dpsgd_fedavg_clips_every_per_sample_gradient(gn_resnet, one_thread, monkeypatch):
    """Noiseless DP-SGD with a small clip C: each step's private gradient is a mean of B vectors of norm ≤ C, so it
    has norm ≤ C, and the upload (θ0 − θK)/lr = Σ_k of them has norm ≤ K·C. With one image the single step's
    clipped gradient is exactly C·g/‖g‖ (the plain gradient's direction, at norm C)."""
    from gradleak.defenses.training import DPSGD

    C = 1e-3
    step_norms = []
    real = DPSGD._private_gradient

    def spy(self, *a):
        out = real(self, *a)
        step_norms.append(math.sqrt(sum(float((g ** 2).sum()) for g in out)))
        return out

    monkeypatch.setattr(DPSGD, "_private_gradient", spy)
    x, y = _images(3, seed=1)
    dp = _dp(noise_multiplier=0.0, max_grad_norm=C)
    upd = dp.local_update(Client(0, x, y), copy.deepcopy(gn_resnet), seed=0, algorithm="fedavg", lr=0.05,
                          epochs=1, batch_size=2)
    assert len(step_norms) == upd.local_steps == 2
    assert all(n <= C * (1 + 1e-9) for n in step_norms)
    assert upd.norm() <= upd.local_steps * C * (1 + 1e-9)
    one = Client(1, x[:1], y[:1])
    plain = one.local_update(copy.deepcopy(gn_resnet), algorithm="fedavg", epochs=1, lr=0.05, batch_size=1, seed=0)
    assert plain.norm() > 10 * C  # the clip is active
    u1 = dp.local_update(one, copy.deepcopy(gn_resnet), seed=0, algorithm="fedavg", lr=0.05, epochs=1, batch_size=1)
    assert u1.norm() == pytest.approx(C, rel=1e-9)
    for k, g in plain.tensors.items():
        assert torch.allclose(u1.tensors[k], g * (C / plain.norm()), rtol=1e-6, atol=1e-15), k


def test_dpsgd_noise_epsilon_per_client_worst_client_and_monotone_in_sigma(one_thread):
    """Through the round protocol (2 rounds; client 0: 4 images at B = 2 for 2 epochs = 4 steps at q = 1/2 per
    round; client 1: 1 image, 1 step at q = 1): ε per client is Opacus' RDP accountant of its steps, dp_epsilon
    the worst; finite for σ > 0, decreasing in σ, infinite for σ = 0; the noise is seeded."""
    from opacus.accountants import RDPAccountant

    from gradleak.fl.engines.builtin import run_rounds

    g = torch.Generator().manual_seed(0)
    clients = [Client(0, torch.rand(4, 1, 8, 8, generator=g, dtype=torch.float64), torch.tensor([0, 1, 2, 0])),
               Client(1, torch.rand(1, 1, 8, 8, generator=g, dtype=torch.float64), torch.tensor([1]))]
    settings = [{"batch_size": 2, "epochs": 2}, {"batch_size": 1, "epochs": 1}]

    def run(sigma):
        dp = _dp(noise_multiplier=sigma, max_grad_norm=1.0, delta=1e-5)
        dp._reset_accounting()
        out = run_rounds(_tiny_gn_net(), clients, rounds=2, algorithm="fedavg", lr=0.1, local_update=dp.local_update,
                         client_settings=settings)
        return out, dp.report(out.rounds), dp

    epsilons = []
    for sigma in (0.6, 1.0, 2.0, 4.0):
        out, rep, dp = run(sigma)
        assert [u.local_steps for u in out.rounds[0]] == [4, 1]
        assert rep["dp_steps_client0"] == 8.0 and rep["dp_steps_client1"] == 2.0 and rep["dp_rounds"] == 2.0
        for c, (q, k) in {0: (0.5, 8), 1: (1.0, 2)}.items():
            acc = RDPAccountant()
            for _ in range(k):
                acc.step(noise_multiplier=sigma, sample_rate=q)
            assert rep[f"dp_epsilon_client{c}"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12)
        assert rep["dp_epsilon"] == max(rep["dp_epsilon_client0"], rep["dp_epsilon_client1"])
        assert math.isfinite(rep["dp_epsilon"]) and rep["dp_epsilon"] > 0
        assert dp.steps == {}  # reset at report: the next trial trains from the start again
        epsilons.append(rep["dp_epsilon"])
    assert all(a > b for a, b in zip(epsilons, epsilons[1:]))
    _, rep0, _ = run(0.0)
    assert rep0["dp_epsilon"] == math.inf == rep0["dp_epsilon_client0"] and rep0["dp_steps_client1"] == 2.0
    # the noise: reproducible for a seed, different across rounds, absent at σ = 0
    a, _, _ = run(1.0)
    b, _, _ = run(1.0)
    assert all(torch.equal(a.rounds[1][0].tensors[k], b.rounds[1][0].tensors[k]) for k in a.rounds[1][0].tensors)
    noisy, clean = a.rounds[0][0].flat(), run(0.0)[0].rounds[0][0].flat()
    assert float((noisy - clean).norm()) > 0.1


def test_dpsgd_refuses_batchnorm_naming_model_norm():
    from gradleak.run import validate
    from gradleak.config.loading import load_yaml

    torch.manual_seed(0)
    bn_net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                           nn.Linear(4, 3)).double()
    x = torch.rand(2, 1, 8, 8, dtype=torch.float64)
    with pytest.raises(BadInput, match="model.norm=group") as e:
        _dp().local_update(Client(0, x, torch.tensor([0, 1])), bn_net, seed=0, algorithm="fedavg", lr=0.1,
                           epochs=1, batch_size=2)
    assert e.value.field == "model.norm"
    assert any(isinstance(m, nn.BatchNorm2d) for m in bn_net.modules())  # not converted silently
    raw = load_yaml(LEAKAGE)
    raw["defense"] = {"name": "dpsgd", "noise_multiplier": 1.0}
    with pytest.raises(BadInput, match="model.norm=group") as e:
        validate(raw)
    assert e.value.field == "model.norm"
    _, cfg = validate(raw, ["model.norm=group"])  # the image modality is allowed
    assert cfg.training_defense.cfg.noise_multiplier == 1.0


# ------------------------------------------------------------------------------------------ end to end
def test_leakage_run_with_dpsgd_on_the_groupnorm_resnet(tmp_path, one_thread):
    """`gradleak run`'s path (run_config) on the shrunk leakage config: GroupNorm ResNet-18 (no pretraining: it
    would be a separate cache), DP-SGD FedAvg clients, the gradient-only inversion (no BN statistics exist)."""
    from gradleak.run import run_config
    from gradleak.config.loading import apply_overrides, load_yaml

    raw = load_yaml(LEAKAGE)
    raw["model"] = {k: v for k, v in raw["model"].items() if k != "pretrain"}
    raw["defense"] = {"name": "dpsgd", "noise_multiplier": 1.0, "max_grad_norm": 1.0, "delta": 1e-5}
    raw = apply_overrides(raw, TINY + ["model.norm=group", "attack.ablation=gradient_only"])
    r = run_config(raw, tmp_path)
    m = r["metrics"]
    assert r["config"]["model"]["norm"] == "group" and r["config"]["defense"]["name"] == "dpsgd"
    # client 0: 2 images at B = 2 (q = 1), client 1: 1 image (q = 1); one step per round each, 2 rounds
    assert m["dp_steps_client0"] == m["dp_steps_client1"] == 2.0
    assert math.isfinite(m["dp_epsilon"]) and m["dp_epsilon"] == max(m["dp_epsilon_client0"], m["dp_epsilon_client1"])
    assert "rdlv_client0" in m and "rdlv_client1" in m
