"""Restarts batched through one double backward: ``matching_terms_batch`` gives every restart the matching
terms and image gradients ``matching_terms`` gives it alone; the group loop (GradViT, GIAS) takes the same steps
batched as one after another; the ViT feature prior of stacked restarts equals each restart's own."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gradleak.attacks.optimization.gias as gias_module
import gradleak.attacks.optimization.gradvit as gradvit_module
from gradleak.attacks.optimization.gias import GIAS
from gradleak.attacks.optimization.gradvit import GradViT, ViTFeaturePrior
from gradleak.attacks.optimization.inverting_gradients import DLG, IG, April
from gradleak.data import load
from gradleak.models.generator import DCGANGenerator
from gradleak.models.vit import vit
from gradleak.peft.adapters import add_vit_adapters

from _tiny_vit import lora_pe_vit, view_of  # tests/ is on sys.path (rootdir conftest)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def images8() -> torch.Tensor:
    return F.interpolate(load("cifar-samples", n=4).images, size=8, mode="area")


def adapter_view(images8, dtype=torch.float64, batch=2):
    """A tiny float64 ViT with bottleneck adapters (the audit's PEFT kind), one FedSGD client of ``batch`` images."""
    model = vit("vit-tiny", image_size=8, patch_size=4, hidden_size=32, heads=2, layers=2, num_classes=4, seed=0,
                dtype=dtype)
    add_vit_adapters(model, 8)
    with torch.no_grad():  # non-zero up-projections: every adapter tensor gets a gradient
        for n, p in model.named_parameters():
            if ".adapter." in n:
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n)), dtype=dtype))
    return view_of(model, images8[:batch], torch.tensor([1, 3][:batch]))


def _sequential_and_batched(attack, view, n=3):
    f = attack.matching_objective(view)
    st = f.setup
    g = torch.Generator().manual_seed(5)
    xs = [(torch.rand((st.batch_size, *st.shape), generator=g, dtype=torch.float64) * 2 - 1).to(st.dtype)
          .requires_grad_(True) for _ in range(n)]
    seq = []
    for x in xs:
        total, main, pe = attack.matching_terms(st.model, st.params, st.targets, st.groups, st.norms, x, st.labels,
                                                True)
        (grad,) = torch.autograd.grad(total, x)
        seq.append((float(total.detach()), float(main.detach()), None if pe is None else float(pe.detach()), grad))
    out = attack.matching_terms_batch(st.model, st.params, st.targets, st.groups, st.norms, xs, st.labels, True,
                                      names=st.names)
    grads = torch.autograd.grad(torch.stack([o[0] for o in out]).sum(), xs)
    bat = [(float(t.detach()), float(m.detach()), None if p is None else float(p.detach()), gr) for (t, m, p), gr in zip(out, grads)]
    return seq, bat, attack._batch_plan[2]


@pytest.mark.parametrize("make", [lambda: IG(), lambda: IG(similarity="per_parameter"), lambda: DLG(),
                                  lambda: IG(noise_model="declared")], ids=["ig", "ig-per-tensor", "dlg", "declared"])
def test_batched_matching_equals_each_restart_alone(images8, make):
    """Adapters + head are nn.Linear tensors: one forward of the stacked restarts, per-restart gradients from the
    layers' inputs and output gradients; terms and image gradients equal the one-restart computation (float64)."""
    attack = make()
    view = adapter_view(images8)
    if attack.noise_model == "declared":
        attack._clip = None
    seq, bat, plan = _sequential_and_batched(attack, view)
    if attack.noise_model == "declared":  # the declared clip, applied per restart
        attack._clip = 1e-3
        seq, bat, plan = _sequential_and_batched(attack, view)
    assert plan is not None  # the batched form was taken
    for (t0, m0, p0, g0), (t1, m1, p1, g1) in zip(seq, bat):
        assert t1 == pytest.approx(t0, rel=1e-10, abs=1e-13) and m1 == pytest.approx(m0, rel=1e-10, abs=1e-13)
        assert p0 is None and p1 is None
        assert torch.allclose(g1, g0, rtol=1e-8, atol=1e-14 * float(g0.abs().max()))


def test_pe_terms_fall_back_to_one_restart_after_another(images8):
    """Layer-wise PEs (not nn.Linear tensors) in the anchor term: no batched form; the results are the sequential
    ones exactly."""
    h = lora_pe_vit(dtype=torch.float64)
    view = view_of(h.model, images8[:1], torch.tensor([2]), labels=[2])
    seq, bat, plan = _sequential_and_batched(April(anchor=True), view)
    assert plan is None
    for a, b in zip(seq, bat):
        assert a[:3] == b[:3] and torch.equal(a[3], b[3])


def test_lora_tensors_are_batched(images8):
    """HF peft's LoRA factors are nn.Linear layers: batched (the PEs are unmatched without the anchor)."""
    h = lora_pe_vit(dtype=torch.float64)
    view = view_of(h.model, images8[:1], torch.tensor([2]), labels=[2])
    seq, bat, plan = _sequential_and_batched(IG(), view)
    assert plan is not None
    for (t0, _, _, g0), (t1, _, _, g1) in zip(seq, bat):
        assert t1 == pytest.approx(t0, rel=1e-10) and torch.allclose(g1, g0, rtol=1e-8, atol=1e-16)


def tiny_backbone():
    from transformers import Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    return Dinov2Model(Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                    patch_size=14, image_size=28, attn_implementation="eager")).eval()


def test_feature_prior_of_stacked_restarts_equals_each_alone():
    public = load("natural-crops", n=16, size=8, seed=1).images
    prior = ViTFeaturePrior(public, image_size=28, layers=None, max_images=16, backbone=tiny_backbone())
    g = torch.Generator().manual_seed(0)
    xs = [torch.rand(2, 3, 8, 8, generator=g) * 2 - 1 for _ in range(3)]
    alone = [prior(x) for x in xs]
    together = prior.batch(xs)
    assert all(float(b.detach()) == pytest.approx(float(a.detach()), rel=1e-5) for a, b in zip(alone, together))


def _without_batching(module, monkeypatch):
    orig = module.optimise_group

    def sequential(*args, **kwargs):
        kwargs.pop("batch_objective", None)
        return orig(*args, **kwargs)

    monkeypatch.setattr(module, "optimise_group", sequential)


def test_gradvit_restarts_batched_take_the_sequential_steps(images8, monkeypatch):
    """GradViT (every prior on, GLR over 3 restarts, signed Adam) in float64: the batched group loop ends where the
    sequential one does, restart by restart."""
    public = load("natural-crops", n=16, size=8, seed=1).images
    view = adapter_view(images8, batch=1)

    def run():
        return GradViT(steps=12, restarts=3, feature_weight=1e-2, feature_image_size=28, public_images=public,
                       feature_backbone=tiny_backbone(), glr_start=0, glr_every=4, time_fwdbwd=False,
                       labels="idlg").reconstruct(view)

    batched = run()
    _without_batching(gradvit_module, monkeypatch)
    sequential = run()
    assert batched.info["restart_final_losses"] == pytest.approx(sequential.info["restart_final_losses"], rel=1e-6)
    assert batched.info["best_restart"] == sequential.info["best_restart"]
    assert batched.info["restarts_batched"] and not sequential.info["restarts_batched"]
    assert torch.allclose(batched.data["images"], sequential.data["images"], atol=1e-6)
    assert [h[0] for h in batched.info["history"]] == [h[0] for h in sequential.info["history"]]


def test_gias_restarts_batched_take_the_sequential_steps(images8, monkeypatch):
    torch.manual_seed(0)
    gen = DCGANGenerator(latent_dim=16, image_size=32, channels=3, width=8).eval()  # 32 px, pooled to 8
    view = adapter_view(images8, batch=1)

    def run():
        return GIAS(gen, latent_steps=6, generator_steps=4, restarts=3, glr_start=0, glr_every=2,
                    time_fwdbwd=False).reconstruct(view)

    batched = run()
    _without_batching(gias_module, monkeypatch)
    sequential = run()
    for key in ("restart_final_losses", "stage1_final_losses"):
        assert batched.info[key] == pytest.approx(sequential.info[key], rel=1e-6)
    assert torch.allclose(batched.data["images"], sequential.data["images"], atol=1e-6)
    assert batched.info["restarts_batched"]


class _OneNaNRestart(GradViT):
    def _member(self, r, st):
        m = super()._member(r, st)
        if r == 1:
            with torch.no_grad():
                m.params[0][..., 0, 0] = float("nan")
        return m


def test_a_diverging_restart_leaves_the_batch_and_the_others_are_untouched(images8, monkeypatch):
    view = adapter_view(images8, batch=1)

    def run():
        return _OneNaNRestart(steps=5, restarts=3, feature_weight=0, glr_start=0, glr_every=1,
                              time_fwdbwd=False).reconstruct(view)

    batched = run()
    _without_batching(gradvit_module, monkeypatch)
    sequential = run()
    assert batched.info["diverged"] == sequential.info["diverged"] == [{"restart": 1, "step": 0}]
    b, s = batched.info["restart_final_losses"], sequential.info["restart_final_losses"]
    assert b[1] == s[1] == float("inf")
    assert [b[0], b[2]] == pytest.approx([s[0], s[2]], rel=1e-6)
