"""GradViT (gradleak.attacks.optimization.gradvit) and group lazy regularisation (gradleak.attacks.optimization.glr): the GLR consensus, the
ViT-S/14 feature prior (the substitute for GradViT's CNN BN prior), recovery on a tiny ViT, the anchor gate, diverging
restarts and the pipeline on paper 001's config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner

from gradleak.attacks.optimization.glr import GroupLazyRegularizer, GroupMember, consensus, optimise_group
from gradleak.attacks.optimization.gradvit import GradViT, l2_prior, model_patch_size, patch_prior
from gradleak.attacks.optimization.inverting_gradients import IG
from gradleak.cli import app
from gradleak.data import load
from gradleak.errors import BadInput
from gradleak.metrics import psnr
from gradleak.models.vit import vit
from gradleak.peft.layer_pe import add_layer_pe
from gradleak.registry import ATTACKS

from _tiny_vit import lora_pe_vit, view_of  # tests/ is on sys.path (rootdir conftest)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "lora_vit" / "cifar_b1.yaml"
runner = CliRunner()

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def images8() -> torch.Tensor:
    return F.interpolate(load("cifar-samples", n=4).images, size=8, mode="area")


@pytest.fixture(scope="module")
def public8() -> torch.Tensor:
    return load("natural-crops", n=16, size=8, seed=1).images


def tiny_backbone():
    """A small random Dinov2 (the architecture of the offline ViT-S/14) standing in for the prior's backbone."""
    from transformers import Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    return Dinov2Model(Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                    patch_size=14, image_size=28, attn_implementation="eager")).eval()


# ------------------------------------------------------------------------------------------------ GLR

def test_glr_consensus_is_the_mean_zero_for_identical_restarts_and_lazy():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 3, 4, 4, generator=g, dtype=torch.float64), torch.randn(2, 3, 4, 4, generator=g,
                                                                                    dtype=torch.float64)
    assert torch.equal(consensus([a, b]), (a + b) / 2)  # eq. 21: pixel-wise mean, no registration
    glr = GroupLazyRegularizer(1e-3, every=10, start=5)
    assert float(glr.penalty(a)) == 0.0  # no consensus before the first refresh
    assert [s for s in range(40) if glr.due(s)] == [5, 15, 25, 35]
    assert not GroupLazyRegularizer(0.0).due(0)  # weight 0: never built
    glr.refresh([a, a.clone(), a.clone()], 5)
    assert float(glr.penalty(a)) < 1e-30  # identical restarts: the term vanishes (up to the mean's rounding)
    glr.refresh([a, b], 15)
    e = (a + b) / 2
    assert float(glr.penalty(a)) == pytest.approx(1e-3 * float(((a - e) ** 2).sum()), rel=1e-12)
    l2 = GroupLazyRegularizer(1e-4, norm="l2")
    l2.refresh([a, b])
    assert float(l2.penalty(b)) == pytest.approx(1e-4 * float((b - e).norm()), rel=1e-12)
    # the gradient of the term points from each member to the consensus
    x = a.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(glr.penalty(x), x)
    assert torch.allclose(grad, 2e-3 * (a - e))
    # the target is detached: it carries no gradient path between members
    assert not glr.target.requires_grad and glr.refreshed_at == [5, 15]


def test_glr_pulls_the_group_together_in_the_group_loop():
    """Two members with different optima t_i (data term ‖x − t_i‖²): without GLR each reaches its own; with λ_G the
    group settles where x_i = (t_i + λ_G·E)/(1 + λ_G) with E = their mean = mean(t), so the gap between the members
    shrinks by exactly 1/(1 + λ_G) (float64, lazy consensus every 5 steps)."""
    g = torch.Generator().manual_seed(1)
    targets = [torch.randn(1, 1, 3, 3, generator=g, dtype=torch.float64) for _ in range(2)]

    def run(weight):
        members = []
        for i in range(len(targets)):
            v = torch.zeros(1, 1, 3, 3, dtype=torch.float64, requires_grad=True)
            members.append(GroupMember(i, [v], (lambda v=v: v), torch.optim.Adam([v], lr=0.05)))
        target_of = {id(m.params[0]): t for m, t in zip(members, targets)}

        def objective(x):
            d = ((x - target_of[id(x)]) ** 2).sum()
            return d, d, {}

        optimise_group(members, 300, objective, GroupLazyRegularizer(weight, every=5, start=0))
        return [m.params[0].detach() for m in members]

    gap = lambda xs: float((xs[0] - xs[1]).norm())  # noqa: E731
    free = run(0.0)
    assert all(torch.allclose(x, t, atol=1e-5) for x, t in zip(free, targets))
    mean_t = (targets[0] + targets[1]) / 2
    for lam in (1.0, 3.0):
        pulled = run(lam)
        assert gap(pulled) / gap(free) == pytest.approx(1 / (1 + lam), rel=1e-5)
        assert all(torch.allclose(x, (t + lam * mean_t) / (1 + lam), atol=1e-5) for x, t in zip(pulled, targets))


def test_image_priors():
    x = torch.zeros(1, 1, 8, 8, dtype=torch.float64)
    x[..., 4:, :] = 1.0  # one horizontal edge exactly on a patch border (patch 4)
    assert float(patch_prior(x, 4)) == pytest.approx(float(((x[..., 4, :] - x[..., 3, :]) ** 2).mean()))
    y = torch.zeros_like(x)
    y[..., 5:, :] = 1.0  # the same edge inside a patch: no border jump
    assert float(patch_prior(y, 4)) == 0.0 and float(patch_prior(x, 8)) == 0.0
    assert float(l2_prior(torch.full((1, 3, 2, 2), 0.5))) == pytest.approx(0.25)


# ------------------------------------------------------------------------------------------------ attack

def test_registered_requires_and_config_descriptions():
    assert ATTACKS.get("gradvit") is GradViT and issubclass(GradViT, IG)
    assert GradViT.modality == "image" and GradViT.reconstruction == "images"
    assert set(GradViT.peft_kinds) >= {"lora", "none"}
    req = GradViT.requires()
    assert req["public_data"] is True and req["knows_batch_size"] is True and req["knows_labels"] is False
    assert "public_data" not in GradViT.requires(GradViT.Config(feature_weight=0))
    assert GradViT.requires(GradViT.Config(anchor=True))["prescribes_architecture"] is True
    cfg = GradViT.Config()
    assert cfg.restarts == 3 and cfg.glr_weight == 1e-4 and cfg.steps == 300
    assert all(f.description for f in GradViT.Config.model_fields.values())
    with pytest.raises(BadInput) as err:
        GradViT(steps=1)  # the feature prior without public images
    assert err.value.field == "threat.public_data"
    with pytest.raises(Exception):
        GradViT.Config(feature_image_size=100)  # not a multiple of 14
    import gradleak.attacks.optimization.gradvit as mod

    assert "SUBSTITUTED" in mod.__doc__ and "ViT-S/14" in mod.__doc__


def test_feature_prior_is_present_and_changes_the_loss(images8, vit_s14_available):
    """The offline ViT-S/14 prior (28 px here for speed): a real term in the objective, weighted by feature_weight,
    lower for a natural image than for noise, and recorded as a substitute in info."""
    pub = load("natural-crops", n=32, size=32, seed=1).images
    h = lora_pe_vit()
    view = view_of(h.model, images8[:1], torch.tensor([2]), labels=[2])
    attack = GradViT(steps=2, restarts=2, feature_weight=0.5, feature_image_size=28, public_images=pub,
                     time_fwdbwd=False)
    f = attack.objective(view)
    f0 = GradViT(steps=2, feature_weight=0.0).objective(view)
    noise = torch.rand(1, 3, 8, 8, generator=torch.Generator().manual_seed(4)) * 2 - 1
    total, match, parts = f(noise, False)
    total0, match0, parts0 = f0(noise, False)
    assert "feature" in parts and "feature" not in parts0
    assert float(parts["feature"].detach()) > 0.1
    assert torch.allclose(match, match0)
    assert float((total - total0).detach()) == pytest.approx(0.5 * float(parts["feature"].detach()), rel=1e-4)
    natural = attack.feature_prior(images8[1:2] * 2 - 1)
    assert float(natural.detach()) < float(parts["feature"].detach())  # a real image is closer to the public set
    x = noise.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(attack.feature_prior(x), x)
    assert float(g.abs().sum()) > 0  # differentiable w.r.t. the dummy image
    rec = attack.reconstruct(view)
    fp = rec.info["feature_prior"]
    assert "ResNet-50" in fp["substitute_for"] and "ViT-S/14" in fp["backbone"] and fp["public_images"] == 32
    assert fp["layers"] == list(range(12)) and rec.info["patch_size"] == 4


def test_gradvit_recovers_one_image_on_a_tiny_vit_from_full_gradients(images8, public8):
    """Fully trainable tiny ViT (8×8, patch 4, d = 128, 2 blocks, layer-wise PEs + anchor), B = 1, image 1 — the one
    plain IG recovers only to 7.7 dB (tests/test_lora_vit_pe.py). Every GradViT term is on (TV, ℓ2, patch, feature
    prior on a small random Dinov2 at weight 1e-4, GLR over 2 restarts). Measured: 34.3 dB; gray image: ~12 dB."""
    model = vit("vit-tiny", image_size=8, patch_size=4, hidden_size=128, heads=2, layers=2, num_classes=4, seed=0)
    for p in model.parameters():
        p.requires_grad_(True)
    add_layer_pe(model)
    truth = images8[1:2]
    view = view_of(model, truth, torch.tensor([1]), labels=[1])
    rec = GradViT(steps=250, restarts=2, anchor=True, feature_weight=1e-4, feature_image_size=28,
                  public_images=public8, feature_backbone=tiny_backbone(), glr_every=25,
                  time_fwdbwd=False).reconstruct(view)
    assert float(psnr(rec.data["images"], truth)[0]) > 30.0
    info = rec.info
    assert info["glr"]["active"] and info["glr"]["refreshed_at"][0] == 62  # a quarter of the steps
    assert info["patch_size"] == 4 and info["feature_prior"]["backbone"] == "Dinov2Model"
    assert len(info["restart_final_losses"]) == 2 and info["final_matching_loss"] < 1e-3


def test_labels_recovered_when_not_granted_and_iteration_ratio(images8):
    h = lora_pe_vit()
    view = view_of(h.model, images8[:1], torch.tensor([3]))  # no labels granted
    rec = GradViT(steps=3, restarts=2, feature_weight=0).reconstruct(view)
    assert rec.info["labels"] == [3] and rec.info["label_source"] == "idlg:head.bias"
    assert rec.info["timings"]["iteration_to_fwdbwd_ratio"] > 0
    assert rec.info["feature_prior"] is None and model_patch_size(h.model) == 4


def test_anchor_without_layer_pes_is_refused(tmp_path, images8):
    plain = vit("vit-tiny", image_size=8, patch_size=4, hidden_size=32, heads=2, layers=2, num_classes=4, seed=0)
    with pytest.raises(BadInput) as err:
        GradViT(anchor=True, feature_weight=0).prepare(plain, None)
    assert err.value.field == "attack.anchor"
    for p in plain.parameters():
        p.requires_grad_(True)
    with pytest.raises(BadInput) as err:
        GradViT(steps=1, anchor=True, feature_weight=0).reconstruct(view_of(plain, images8[:1], torch.tensor([1])))
    assert err.value.field == "attack.anchor"
    res = runner.invoke(app, ["run", str(CONFIG), "--out", str(tmp_path / "a"), "--set", "attack.name=gradvit",
                              "--set", "attack.anchor=true", "--set", "peft.layer_pe=false",
                              "--set", "threat.public_data=true"])
    assert res.exit_code == 2 and "attack.anchor" in res.output
    res = runner.invoke(app, ["run", str(CONFIG), "--out", str(tmp_path / "b"), "--set", "attack.name=gradvit"])
    assert res.exit_code == 2 and "threat.public_data" in res.output  # the feature prior's public images


class _OneNaNRestart(GradViT):
    def _member(self, r, st):
        m = super()._member(r, st)
        if r == 1:
            with torch.no_grad():
                m.params[0][..., 0, 0] = float("nan")
        return m


def test_nan_restart_is_stopped_and_the_others_kept(images8):
    h = lora_pe_vit()
    view = view_of(h.model, images8[:1], torch.tensor([2]), labels=[2])
    rec = _OneNaNRestart(steps=6, restarts=3, feature_weight=0, glr_start=0, glr_every=1,
                         time_fwdbwd=False).reconstruct(view)
    info = rec.info
    assert info["diverged"] == [{"restart": 1, "step": 0}] and "the others were kept" in info["warning"]
    losses = info["restart_final_losses"]
    assert losses[1] == float("inf") and all(torch.isfinite(torch.tensor([losses[0], losses[2]])))
    assert info["best_restart"] != 1 and torch.isfinite(rec.data["images"]).all()
    assert info["glr"]["refreshed_at"] == list(range(6))  # the consensus kept being built from the finite members


def test_gradvit_runs_on_the_lora_vit_config(tmp_path, vit_s14_available):
    """`--set attack.name=gradvit` on configs/lora_vit/cifar_b1.yaml (2 blocks, 2 steps): PSNR/SSIM, the iteration
    ratio and the feature prior's record reach results.json."""
    out = tmp_path / "gv"
    res = runner.invoke(app, ["run", str(CONFIG), "--out", str(out), "--set", "attack.name=gradvit",
                              "--set", "attack.steps=2", "--set", "attack.restarts=2", "--set", "model.layers=2",
                              "--set", "threat.public_data=true", "--set", "data.public_size=32",
                              "--set", "attack.feature_image_size=28", "--set", "metrics.feature_distance=false"])
    assert res.exit_code == 0, res.output
    r = json.loads((out / "results.json").read_text())
    assert {"psnr", "ssim"} <= set(r["metrics"]) and r["timings"]["iteration_to_fwdbwd_ratio"] > 0
    info = r["details"]["attack_info"]
    assert info["attack"] == "gradvit" and "ResNet-50" in info["feature_prior"]["substitute_for"]
    assert info["feature_prior"]["public_images"] == 32 and info["patch_size"] == 4


def test_the_feature_priors_public_statistics_are_kept_and_reused_bit_for_bit(images8, vit_s14_available, tmp_path,
                                                                              monkeypatch):
    """The public set's token statistics are computed once ($GRADLEAK_CACHE/feature_prior, keyed by the images and
    the prior's settings) and read back identical by the next attack; another public set or size is another file."""
    from gradleak.attacks.optimization.gradvit import ViTFeaturePrior

    monkeypatch.setenv("GRADLEAK_CACHE", str(tmp_path))
    pub = load("natural-crops", n=8, size=32, seed=1).images
    first = ViTFeaturePrior(pub, image_size=28, layers=None, max_images=8)
    first.fit(torch.device("cpu"))
    assert not first.from_cache and len(list((tmp_path / "feature_prior").glob("*.pt"))) == 1
    again = ViTFeaturePrior(pub, image_size=28, layers=None, max_images=8)
    again.fit(torch.device("cpu"))
    assert again.from_cache and again.layers == first.layers == list(range(12))
    assert all(torch.equal(a, b) for (m1, v1), (m2, v2) in zip(first.stats, again.stats) for a, b in ((m1, m2), (v1, v2)))
    x = images8[:1] * 2 - 1
    assert torch.equal(first(x), again(x))
    ViTFeaturePrior(pub[:4], image_size=28, layers=None, max_images=8).fit(torch.device("cpu"))
    ViTFeaturePrior(pub, image_size=42, layers=[0, 1], max_images=8).fit(torch.device("cpu"))
    assert len(list((tmp_path / "feature_prior").glob("*.pt"))) == 3
