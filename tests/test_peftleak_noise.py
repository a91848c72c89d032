"""PEFTLeak's noise mode (gradleak.attacks.peftleak.denoise): recovery under upload noise where the exact recovery
finds nothing, no claims on pure noise, σ read off the upload, the audit's full-strength variant."""

import copy
import sys
from pathlib import Path

import pytest
import torch

from gradleak.attacks.peftleak.attack import PEFTLeak
from gradleak.attacks.peftleak.denoise import structural_noise_std
from gradleak.data import load
from gradleak.fl.core import ServerView, Update
from gradleak.metrics.patches import image_to_patches, patch_psnr, patch_recovery

sys.path.insert(0, str(Path(__file__).parent))
from test_peftleak import _run, _tiny  # noqa: E402

F64 = torch.float64
ROOT = Path(__file__).resolve().parents[1]


def _noisy(view: ServerView, std: float, seed: int, signal: bool = True) -> ServerView:
    gen = torch.Generator().manual_seed(seed)
    rounds = [[Update({k: (v if signal else torch.zeros_like(v)) + std * torch.randn(v.shape, generator=gen, dtype=F64)
                       for k, v in r[0].tensors.items()}, r[0].num_samples)] for r in view.rounds]
    return ServerView(model=view.model, updates=rounds[-1], rounds=rounds, round_states=view.round_states)


@pytest.fixture(scope="module")
def tiny():
    atk, model, x = _tiny("improved", B=8)
    view, _ = _run(atk, model, x)
    return atk, view, image_to_patches(x, 8)


def _score(atk, view, truth, noise):
    atk.recovery.noise = noise
    try:
        rec = atk.reconstruct(view)
    finally:
        atk.recovery.noise = "public"
    d = rec.data
    return rec, patch_recovery(truth, d["patches"], d["positions"], d["groups"])


def test_noise_mode_recovers_the_patches_the_exact_recovery_misses(tiny):
    """Upload noise σ = 1e-16 (≈ 1/60 to 1/1400 of the bins' bias differences): the exact recovery's exactness tests
    reject every bin; the noise mode (σ known, or read off the upload) recovers nearly every patch at > 45 dB, far
    above the null (random held-out CIFAR patches at the same positions), and predicts its own error."""
    atk, view, truth = tiny
    noisy = _noisy(view, 1e-16, seed=5)
    _, plain = _score(atk, noisy, truth, "none")
    assert plain["patch_recovery_rate"] <= 0.1
    other = torch.nn.functional.interpolate(load("cifar-samples").images[8:40], size=(16, 16), mode="bilinear",
                                            antialias=True, align_corners=False).clamp(0, 1).double() * 2 - 1
    null = patch_psnr(image_to_patches(other, 8)[:, None], truth[None]).reshape(-1)  # every pair at one position
    null_p99 = float(torch.quantile(null, 0.99))
    for noise in (1e-16, "estimate"):
        rec, m = _score(atk, noisy, truth, noise)
        assert m["isolated_patch_rate"] >= 0.9 and m["patch_recovery_rate"] >= 0.9, noise
        assert m["recovered_patch_psnr_median"] >= max(45.0, null_p99 + 20), noise
        assert m["false_positives"] <= 3, noise
        assert abs(rec.metrics["expected_patch_psnr_median"] - m["recovered_patch_psnr_median"]) <= 3, noise
        assert rec.metrics["noise_std_used"] == pytest.approx(1e-16, rel=0.1)
        assert max(rec.info["bins_per_patch"]) > 1  # the improved design's K adapters: estimates combined


def test_noise_mode_degrades_with_the_noise_and_never_errs_beyond_its_own_estimate(tiny):
    atk, view, truth = tiny
    rates = []
    for std in (1e-16, 1e-15, 1e-13):
        rec, m = _score(atk, _noisy(view, std, seed=6), truth, std)
        rates.append(m["isolated_patch_rate"])
        err = rec.data["patch_error_std"]
        assert (err ** 2 < atk.recovery._prior.pixel_variance).all()  # only patches better than the public mean
    assert rates[0] >= rates[1] >= rates[2] and rates[0] > rates[2]


@pytest.mark.parametrize("std", [1e-15, 1e-12])
def test_pure_noise_claims_no_patch(tiny, std):
    """No signal at all: the calibrated occupancy test (Bonferroni over every bin) claims no bin, so no patch."""
    atk, view, truth = tiny
    for seed in range(3):
        pure = _noisy(view, std, seed=100 + seed, signal=False)
        for noise in (std, "estimate"):
            rec, m = _score(atk, pure, truth, noise)
            assert len(rec.data["patches"]) == 0 and rec.metrics["occupied_bins"] == 0, (noise, seed)


def test_noise_is_read_off_the_ones_direction_of_the_down_projection_rows(tiny):
    """The adapter inputs are centred LayerNorm outputs: 1ᵀ∇W_j is zero without noise and pure noise with it."""
    atk, view, _ = tiny
    plan, upd = atk.server.plans[0], view.rounds[0][0]
    assert structural_noise_std(upd, plan, atk.D) < 1e-20
    for std in (1e-16, 1e-12):
        for signal in (True, False):
            est = structural_noise_std(_noisy(view, std, 3, signal).rounds[0][0], plan, atk.D)
            assert est == pytest.approx(std, rel=0.15)


def test_the_exact_recovery_is_unchanged_without_declared_noise(tiny):
    """Default ``noise: public`` with nothing declared runs the exact recovery, bit for bit."""
    atk, view, truth = tiny
    a = atk.reconstruct(view)
    b, _ = _score(atk, view, truth, "none")
    assert atk.recovery.noise == "public"
    assert torch.equal(a.data["patches"], b.data["patches"]) and torch.equal(a.data["groups"], b.data["groups"])
    assert a.metrics == b.metrics and "noise_std_used" not in a.metrics


def test_noise_parameters_are_checked():
    import pydantic

    for bad in ({"noise": 0.0}, {"noise": -1e-3}, {"noise": "loud"}, {"noise_false_alarm": 0}, {"noise_false_alarm": 1}):
        with pytest.raises(pydantic.ValidationError):
            PEFTLeak.Config(**bad)
    assert PEFTLeak.Config().noise == "public" and PEFTLeak.Config(noise=1e-9).noise == 1e-9


TINY_RUN = {"experiment": "image", "seed": 0, "data": {"name": "cifar-samples", "batch_size": 1, "image_size": 16},
            "model": {"name": "vit-tiny", "layers": 1}, "peft": {"kind": "adapters", "bottleneck": 8},
            "metrics": {"feature_distance": False}, "attack": {"name": "peftleak"},
            "threat": {"preset": "malicious", "public_data": True}, "fl": {"rounds": 1}}


@pytest.mark.parametrize("std, noise, level", [(1e-15, "none", "none"), (1e-15, "public", "exact"),
                                               (1e-6, "public", "none")])
def test_declared_gaussian_noise_end_to_end(tmp_path, std, noise, level):
    """Through the pipeline: the declared Gaussian upload noise reaches the noise mode (view_noise_std); the exact
    recovery finds nothing at a std the noise mode recovers exactly through; an overwhelming noise gives no patch and
    the level none."""
    from gradleak.run.audit import judge
    from gradleak.run.runner import run_config, validate

    raw = copy.deepcopy(TINY_RUN)
    raw["defenses"] = [{"name": "gaussian_noise", "params": {"std": std}}]
    raw["attack"]["noise"] = noise
    res = run_config(copy.deepcopy(raw), tmp_path)
    _, cfg = validate(copy.deepcopy(raw))
    m = res["metrics"]
    assert judge(cfg.attack_cls.reconstruction, m, cfg).level == level
    if level == "exact":
        assert m["psnr_max"] > m["psnr_max_null_p99"] + 20 and m["noise_std_used"] == pytest.approx(std)
    else:
        assert m["num_returned_patches"] == 0


def test_audit_runs_the_noise_mode_under_declared_noise():
    from gradleak.config.loading import load_yaml
    from gradleak.defenses.declared import as_declared
    from gradleak.run.audit import full_strength_variants, plan_audit

    gauss = [{"name": "gaussian_noise", "params": {"std": 1e-12}}]
    assert {"noise": "public"} in PEFTLeak.audit_variants({"noise": "none"}, as_declared(gauss))
    assert PEFTLeak.audit_variants({}, as_declared(gauss)) == [{"noise": "estimate"}]
    assert PEFTLeak.audit_variants({}, as_declared([])) == []
    assert PEFTLeak.audit_variants({}, as_declared([{"name": "topk_pruning", "params": {"prune_fraction": 0.9}}])) == []
    raw = load_yaml(ROOT / "configs" / "audit" / "vit_adapters.yaml")
    _, _, _, planned, _, _ = plan_audit(raw, ["defenses=[{name: gaussian_noise, params: {std: 1.0e-12}}]"], ["peftleak"])
    (_, cand, cfg, A), = planned
    assert cfg.attack_cfg.noise == "public"  # the configured run is already the noise mode at the declared std
    assert {"noise": "estimate"} in full_strength_variants(A, cand, cfg)
    _, _, _, planned, _, _ = plan_audit(raw, [], ["peftleak"])
    (_, cand, cfg, A), = planned
    assert full_strength_variants(A, cand, cfg) == [{}]
