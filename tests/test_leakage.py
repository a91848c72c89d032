"""Leakage study (paper 003) foundations: ResNet-18 builder, BN batch-statistics inference, the differentiable local-training
simulation and the leakage measures (SSIM vs prior, RDLV with bootstrap interval, adjusted IIP)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from gradleak.attacks.bn_inversion import ObjectiveWeights, inversion_objective, matching_loss, measure_iteration_cost
from gradleak.attacks.common.simulation import local_schedule, simulate_local_training
from gradleak.attacks.common.bn_stats import (BatchStatsRecorder, BNTarget, bn_statistics_loss,
                                       combined_candidate_stats, infer_bn_targets,
                                       normalised_step_weights, single_step_batch_stats, step_weights)
from gradleak.errors import BadInput
from gradleak.fl.core import Client
from gradleak.metrics.image import ssim as gaussian_ssim
from gradleak.metrics.leakage import bootstrap_interval, identifiability_precision, rdlv, ssim_vs_prior
from gradleak.models.batchnorm import batchnorm_layers


def tiny_resnet(dtype=torch.float64, num_classes=3, seed=0):
    """Same transformers architecture as resnet18, 2 stages of 1 basic block, widths 4/8 (6 BN layers)."""
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(num_channels=1, embedding_size=4, hidden_sizes=[4, 8], depths=[1, 1], layer_type="basic",
                       num_labels=num_classes)
    torch.manual_seed(seed)
    return ResNetForImageClassification(cfg).to(dtype)


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# ---------------------------------------------------------------------------------------------- ResNet-18
def test_resnet18_layout_and_registry():
    from gradleak.models import MODELS, model_modality
    from gradleak.models.resnet import resnet18

    m = resnet18(num_classes=7, num_channels=1, image_size=64)
    assert sum(isinstance(x, nn.BatchNorm2d) for x in m.modules()) == 20
    assert m.config.depths == [2, 2, 2, 2] and m.config.layer_type == "basic"
    assert 11_000_000 < sum(p.numel() for p in m.parameters()) < 11_300_000  # ResNet-18 ≈ 11.2 M
    m.train()
    assert m(torch.rand(1, 1, 64, 64)).logits.shape == (1, 7)
    assert "resnet18" in MODELS and model_modality("resnet18") == "image"


def test_resnet18_image_too_small_for_train_mode_bn_names_the_minimum():
    from gradleak.models.resnet import MIN_IMAGE_SIZE_B1, check_train_bn_input, min_image_size, resnet18

    assert MIN_IMAGE_SIZE_B1 == 33 and min_image_size(2) == 1
    with pytest.raises(BadInput, match="at least 33×33") as e:
        resnet18(image_size=28)
    assert e.value.field == "data.image_size"
    check_train_bn_input(28, 28, batch_size=2)  # two images give two values per channel
    m = resnet18(image_size=64).train()
    with pytest.raises(ValueError, match="more than 1 value per channel"):  # the bound is the real one
        m(torch.rand(1, 1, 32, 32))
    m(torch.rand(1, 1, 33, 33))


def test_bn_aware_functions_refuse_a_model_without_batchnorm():
    net = nn.Sequential(nn.Flatten(), nn.Linear(16, 3))
    with pytest.raises(BadInput, match="no BatchNorm"):
        batchnorm_layers(net)
    # the simulation itself runs without BN (the matching term alone: the GroupNorm model DP-SGD needs) ...
    sim = simulate_local_training(net, torch.rand(2, 1, 4, 4), torch.tensor([0, 1]), lr=0.1)
    assert sim.combined_stats == {} and set(sim.pseudo_gradient) == {"1.weight", "1.bias"}
    # ... but the BN-aware attack refuses such a model unless told to use the matching term alone
    from gradleak.attacks.bn_inversion import BNInversion, BNInversionConfig

    with pytest.raises(BadInput, match="no BatchNorm") as e:
        BNInversion(BNInversionConfig()).prepare(net, None)
    assert e.value.field == "model.name" and "gradient_only" in e.value.fix
    BNInversion(BNInversionConfig(ablation="gradient_only")).prepare(net, None)


# ------------------------------------------------------------------------------- BN statistics inference
def _toy_bn(dtype, seed=0, momentum=0.1):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Conv2d(1, 6, 3), nn.BatchNorm2d(6, momentum=momentum)).to(dtype).train()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # earlier rounds: running statistics of other data (the global checkpoint's)
        for _ in range(10):
            net(torch.rand(4, 1, 12, 12, generator=gen, dtype=dtype) * 3.0 + 1.0)
    return net, gen


def _run_steps(net, gen, steps, batch, dtype):
    old = {k: v.clone() for k, v in net.state_dict().items()}
    rec = BatchStatsRecorder(net)
    with rec, torch.no_grad():
        for k in range(steps):
            rec.new_step()
            net(torch.rand(batch, 1, 12, 12, generator=gen, dtype=dtype) * (1.0 + 0.5 * k) - 0.3)
    return old, {k: v.clone() for k, v in net.state_dict().items()}, rec.steps


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_single_step_batch_statistics_are_exact(dtype, tol):
    net, gen = _toy_bn(dtype)
    old, new, steps = _run_steps(net, gen, 1, 2, dtype)
    mean, var = steps[0]["1"]
    est_mean = single_step_batch_stats(old["1.running_mean"], new["1.running_mean"], 0.1)
    est_var = single_step_batch_stats(old["1.running_var"], new["1.running_var"], 0.1)
    assert rel(est_mean, mean) <= tol and rel(est_var, var) <= tol  # running_var holds the unbiased variance
    t = infer_bn_targets(net, old, new)["1"]  # K read from num_batches_tracked
    assert t.steps == 1 and torch.allclose(t.mean, est_mean) and torch.allclose(t.var, est_var)


def test_multi_step_combination_is_exact_where_the_single_step_formula_is_far_off():
    dtype = torch.float32  # the client's precision
    report = {}
    for steps in (2, 4, 8):
        net, gen = _toy_bn(dtype, seed=steps)
        old, new, per_step = _run_steps(net, gen, steps, 1, dtype)
        target = infer_bn_targets(net, old, new)["1"]
        assert target.steps == steps
        combined = combined_candidate_stats(per_step, target.weights)["1"]
        assert rel(combined[0], target.mean) <= 1e-5 and rel(combined[1], target.var) <= 1e-5
        # the public code's single-step formula against the same like-with-like quantity
        single_mean = single_step_batch_stats(old["1.running_mean"], new["1.running_mean"], 0.1)
        single_var = single_step_batch_stats(old["1.running_var"], new["1.running_var"], 0.1)
        report[steps] = (rel(single_mean, target.mean), rel(single_var, target.var))
        assert min(report[steps]) >= 0.13, report
    print("single-step formula relative error (mean, var) by K:", report)


def test_step_weights_and_cumulative_momentum():
    w, decay = step_weights(0.1, 3)
    assert torch.allclose(w, torch.tensor([0.1 * 0.81, 0.1 * 0.9, 0.1], dtype=torch.float64))
    assert decay == pytest.approx(0.9**3) and float(w.sum() + decay) == pytest.approx(1.0)
    assert float(normalised_step_weights(0.1, 5).sum()) == pytest.approx(1.0)
    # momentum=None: cumulative moving average, m_k = 1/(t0 + k)
    net, gen = _toy_bn(torch.float64, momentum=None)
    old, new, per_step = _run_steps(net, gen, 3, 2, torch.float64)
    t = infer_bn_targets(net, old, new)["1"]
    comb = combined_candidate_stats(per_step, t.weights)["1"]
    assert rel(comb[0], t.mean) <= 1e-10 and rel(comb[1], t.var) <= 1e-10


def test_bn_targets_need_running_statistics_and_a_step_count():
    net, gen = _toy_bn(torch.float64)
    old, new, _ = _run_steps(net, gen, 1, 2, torch.float64)
    no_stats = {k: v for k, v in new.items() if "running" not in k}
    with pytest.raises(BadInput, match="running_mean") as e:
        infer_bn_targets(net, old, no_stats)
    assert e.value.field == "updates"
    bare_old = {k: v for k, v in old.items() if "num_batches" not in k}
    with pytest.raises(BadInput, match="local steps"):
        infer_bn_targets(net, bare_old, new)
    assert infer_bn_targets(net, bare_old, new, steps=1)["1"].steps == 1


def test_bn_statistics_loss_is_zero_at_the_truth_and_differentiable():
    net, gen = _toy_bn(torch.float64)
    x = torch.rand(2, 1, 12, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    old = {k: v.clone() for k, v in net.state_dict().items()}
    rec = BatchStatsRecorder(net)
    with rec:
        rec.new_step()
        net(x)
    targets = infer_bn_targets(net, old, net.state_dict())
    stats = combined_candidate_stats(rec.steps, targets["1"].weights)
    loss = bn_statistics_loss(stats, targets)
    assert float(loss.detach()) < 1e-10
    moved = bn_statistics_loss({"1": (stats["1"][0] + 0.1, stats["1"][1])}, targets)
    assert float(moved.detach()) == pytest.approx(0.1 * math.sqrt(6), rel=1e-6)
    (g,) = torch.autograd.grad(bn_statistics_loss({"1": (stats["1"][0] + 0.1, stats["1"][1])}, targets), x)
    assert float(g.abs().sum()) > 0


# --------------------------------------------------------------------------- differentiable simulation
def test_simulation_reproduces_the_clients_fedavg_upload_and_bn_statistics():
    model = tiny_resnet().train()
    gen = torch.Generator().manual_seed(1)
    x = torch.rand(4, 1, 16, 16, generator=gen, dtype=torch.float64)
    y = torch.tensor([0, 2, 1, 2])
    start = copy.deepcopy(model)
    old = {k: v.clone() for k, v in start.state_dict().items()}
    client_model = copy.deepcopy(model)
    upd = Client(0, x, y).local_update(client_model, algorithm="fedavg", lr=0.05, batch_size=2, seed=3, in_place=True)
    order = torch.randperm(4, generator=torch.Generator().manual_seed(3))  # the client's (private) shuffle
    sim = simulate_local_training(start, x, y, lr=0.05, schedule=[order[:2], order[2:]], create_graph=False)
    assert upd.local_steps == 2
    for n, t in upd.tensors.items():
        assert rel(sim.pseudo_gradient[n], t) <= 1e-9, n
    targets = infer_bn_targets(start, old, client_model.state_dict())
    assert len(targets) == 6 and all(t.steps == 2 for t in targets.values())
    for n, t in targets.items():
        assert rel(sim.combined_stats[n][0], t.mean) <= 1e-9 and rel(sim.combined_stats[n][1], t.var) <= 1e-9
    assert all(torch.equal(v, old[k]) for k, v in start.state_dict().items())  # the global model is untouched


@pytest.mark.parametrize("form", ["l2", "cosine"])
def test_matching_term_gradient_reaches_images_and_agrees_with_finite_differences(form):
    model = tiny_resnet()
    gen = torch.Generator().manual_seed(2)
    truth = torch.rand(2, 1, 16, 16, generator=gen, dtype=torch.float64)
    ref = simulate_local_training(model, truth, torch.tensor([1, 0]), lr=0.1, batch_size=1, create_graph=False)
    observed = {n: g.detach() for n, g in ref.pseudo_gradient.items()}
    x0 = torch.rand(2, 1, 16, 16, generator=gen, dtype=torch.float64)
    z = torch.randn(2, 3, generator=gen, dtype=torch.float64)
    direction = torch.randn(x0.shape, generator=gen, dtype=torch.float64)

    def loss(x, zz):  # two simulated local steps of one image each: the gradient passes through step 1's update
        sim = simulate_local_training(model, x, torch.softmax(zz, 1), lr=0.1, batch_size=1)
        return matching_loss(sim, observed, form=form)

    x = x0.clone().requires_grad_(True)
    zz = z.clone().requires_grad_(True)
    gx, gz = torch.autograd.grad(loss(x, zz), [x, zz])
    assert float(gx.abs().max()) > 0 and float(gz.abs().max()) > 0
    eps = 1e-6
    fd = (loss(x0 + eps * direction, z).detach() - loss(x0 - eps * direction, z).detach()) / (2 * eps)
    analytic = (gx * direction).sum()
    assert float(abs(fd - analytic)) <= 1e-6 * max(1.0, float(abs(analytic))), (float(fd), float(analytic))


def test_the_public_codes_matching_term_has_no_gradient_path():
    """NVFlare differences detached state dicts of a model trained in place: nothing reaches the images."""
    model = tiny_resnet()
    x = torch.rand(1, 1, 16, 16, dtype=torch.float64, requires_grad=True)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    nn.functional.cross_entropy(model(x).logits, torch.tensor([1])).backward()
    opt.step()
    delta = {k: model.state_dict()[k] - before[k] for k, _ in model.named_parameters()}
    public_loss = sum(d.norm() for d in delta.values())
    assert not public_loss.requires_grad  # the term cannot move the images
    ours = simulate_local_training(tiny_resnet(), x, torch.tensor([1]), lr=0.1)
    assert sum(g.norm() for g in ours.pseudo_gradient.values()).requires_grad


def test_objective_terms_and_ablations():
    model = tiny_resnet()
    x = torch.rand(2, 1, 16, 16, dtype=torch.float64, requires_grad=True)
    sim = simulate_local_training(model, x, torch.tensor([0, 1]), lr=0.1)
    observed = {n: torch.ones_like(g) for n, g in sim.pseudo_gradient.items()}
    targets = {n: BNTarget(m.detach() + 1, v.detach(), 1, sim.step_weights) for n, (m, v) in sim.combined_stats.items()}
    full = inversion_objective(sim, observed, targets, x)
    w = ObjectiveWeights()
    assert float(full["total"]) == pytest.approx(float(w.matching * full["matching"] + w.bn * full["bn"]
                                                       + w.tv * full["tv"] + w.l2 * full["l2"]))
    bn_only = inversion_objective(sim, None, targets, x, ObjectiveWeights(matching=0.0))
    assert float(bn_only["matching"]) == 0.0 and float(bn_only["bn"]) > 0
    assert local_schedule(5, 2, epochs=2)[2].tolist() == [4] and len(local_schedule(5, 2, epochs=2)) == 6


def test_iteration_cost_measurement_runs():
    r = measure_iteration_cost(tiny_resnet(torch.float32), torch.rand(2, 1, 16, 16), torch.tensor([0, 1]), steps=2,
                               repeats=1)
    assert r["steps"] == 2 and r["batch_size"] == 1 and r["ratio_per_step"] > 0


# -------------------------------------------------------------------------------------- leakage metrics
def _images():
    yy, xx = torch.meshgrid(torch.linspace(0, 1, 32, dtype=torch.float64), torch.linspace(0, 1, 32, dtype=torch.float64),
                            indexing="ij")
    a = (0.5 + 0.4 * torch.sin(8 * xx) * torch.cos(6 * yy)).reshape(1, 1, 32, 32)
    b = (0.5 + 0.4 * torch.sin(5 * yy + 3 * xx)).reshape(1, 1, 32, 32)
    originals = torch.cat([a, b])
    prior = originals.mean(0, keepdim=True) * 0.5 + 0.25  # a flat "mean image" prior
    return originals, prior[0]


def test_rdlv_sign_and_value_on_constructed_images():
    originals, prior = _images()
    gen = torch.Generator().manual_seed(0)
    close = (originals + 0.02 * torch.randn(originals.shape, generator=gen, dtype=torch.float64)).clamp(0, 1)
    far = (prior.expand_as(originals) + 0.3 * torch.randn(originals.shape, generator=gen, dtype=torch.float64)).clamp(0, 1)
    good = rdlv(close, originals, prior, match="paired")
    bad = rdlv(far, originals, prior, match="paired")
    assert (good.per_image > 0).all() and (bad.per_image < 0).all()
    s_rec, s_pri = gaussian_ssim(close, originals), gaussian_ssim(prior.expand_as(originals), originals)
    assert torch.allclose(good.per_image, (s_rec - s_pri) / s_pri, atol=1e-12)
    # exact values: the prior itself scores 0, the original itself 1/s_p − 1
    same_as_prior = rdlv(prior.expand_as(originals), originals, prior, match="paired")
    assert torch.allclose(same_as_prior.per_image, torch.zeros(2, dtype=torch.float64), atol=1e-12)
    exact = rdlv(originals, originals, prior, match="paired")
    assert torch.allclose(exact.per_image, 1.0 / s_pri - 1.0, atol=1e-12)
    # order-free matching ("best", NVFlare's reduce="max") finds the pairing of shuffled reconstructions
    best = rdlv(close.flip(0), originals, prior)
    assert best.matched_index.tolist() == [1, 0] and torch.allclose(best.per_image, good.per_image)


def test_rdlv_nvflare_ssim_settings_match_skimage_directly():
    from skimage.metrics import structural_similarity

    originals, prior = _images()
    rec = originals * 0.6 + 0.1  # min–max rescaling makes this equal to the original up to scale
    r = rdlv(rec, originals, prior, ssim="nvflare", match="paired")
    o = originals[0, 0].numpy() * 255
    rr = rec[0, 0].numpy()
    rr = (rr - rr.min()) / (rr.max() - rr.min()) * 255
    s_rec = structural_similarity(o, rr, data_range=256.0)
    s_pri = structural_similarity(o, prior[0].numpy() * 255, data_range=256.0)
    assert float(r.per_image[0]) == pytest.approx((s_rec - s_pri) / s_pri, rel=1e-9)
    s = ssim_vs_prior(rec, originals, prior, ssim="nvflare", match="paired")
    assert float(s["ssim_prior"][0]) == pytest.approx(s_pri, rel=1e-9)


def test_bootstrap_interval_contains_the_point_estimate_and_is_seeded():
    values = torch.tensor([0.3, -0.1, 0.5, 0.2, 0.05, 0.4, -0.2, 0.1])
    mean, low, high = bootstrap_interval(values, seed=7)
    assert low <= mean <= high and mean == pytest.approx(float(values.double().mean()))
    assert (mean, low, high) == bootstrap_interval(values, seed=7)
    assert bootstrap_interval(values, seed=8) != (mean, low, high)
    assert bootstrap_interval([0.4]) == (0.4, 0.4, 0.4)
    nan_mean = bootstrap_interval([math.nan, 1.0, 3.0], seed=0)
    assert nan_mean[0] == pytest.approx(2.0)
    originals, prior = _images()
    r = rdlv(originals, originals, prior, match="paired")
    assert r.low <= r.mean <= r.high and r.leaks and r.max == pytest.approx(float(r.per_image.max()))
    with pytest.raises(BadInput):
        bootstrap_interval(values, confidence=1.5)


def test_identifiability_precision_on_a_pool_with_known_nearest_neighbours():
    eye = torch.eye(6, dtype=torch.float64)
    pool = eye[:5]  # 0, 1: client 0 train; 2: client 0 validation; 3, 4: client 1 train
    owner = torch.tensor([0, 0, 0, 1, 1])
    training = torch.tensor([True, True, False, True, True])
    recon = torch.stack([eye[0] + 0.1 * eye[5],  # → pool 0: identified
                         eye[2] + 0.2 * eye[1],  # → pool 2 (validation image): not counted
                         eye[3] + 0.1 * eye[0],  # → pool 3 (another client): not counted
                         eye[1] + 0.5 * eye[5]])  # → pool 1: identified
    r = identifiability_precision(recon, pool, owner, training, client=0, original_features=pool[:2])
    assert r.iip == 0.5 and r.nearest_index.tolist() == [0, 2, 3, 1]
    assert r.identified.tolist() == [True, False, False, True]
    cos = torch.nn.functional.cosine_similarity(recon, pool[r.nearest_index], dim=1)
    assert torch.allclose(r.nearest_cosine, cos)
    assert r.matched_cosine == pytest.approx(float(cos[[0, 3]].mean()))
    with pytest.raises(BadInput, match="not in the identifiability pool"):
        identifiability_precision(recon, pool, owner, training, client=0, original_features=eye[5:6])
    with pytest.raises(BadInput, match="no training image of the attacked client"):
        identifiability_precision(recon, pool, owner, training, client=2)
    none = identifiability_precision(recon[2:3], pool, owner, training, client=0)
    assert none.iip == 0.0 and math.isnan(none.matched_cosine)
