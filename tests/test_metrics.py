"""gradleak.metrics: PSNR/SSIM/MSE identities, feature distance on the offline ViT-S/14, LPIPS gating."""

from __future__ import annotations

import math

import pytest
import torch

from gradleak import metrics
from gradleak.models import features
from gradleak.registry import METRICS


def _images(seed=0, n=4, size=32):
    g = torch.Generator().manual_seed(seed)
    # smooth-ish images so SSIM is meaningful
    base = torch.rand(n, 3, size // 4, size // 4, generator=g)
    return torch.nn.functional.interpolate(base, size=(size, size), mode="bilinear", align_corners=False)


def test_registered():
    for name in ("mse", "psnr", "ssim", "feature_distance", "lpips"):
        assert name in METRICS


def test_psnr_identical_is_inf_and_matches_mse():
    x = _images()
    assert torch.isinf(metrics.psnr(x, x)).all()
    y = (x + 0.1 * torch.randn_like(x)).clamp(0, 1)
    m, p = metrics.mse(x, y), metrics.psnr(x, y)
    assert p.shape == (4,) and m.shape == (4,)
    assert torch.allclose(p, 10 * torch.log10(1.0 / m))
    assert torch.allclose(metrics.psnr(x * 255, y * 255, data_range=255.0), p)
    # constant offset of 0.1 -> MSE 0.01 -> 20 dB
    assert metrics.psnr(torch.zeros(1, 1, 8, 8), torch.full((1, 1, 8, 8), 0.1)).item() == pytest.approx(20.0)


def test_ssim_identity_range_and_noise():
    x = _images()
    assert torch.allclose(metrics.ssim(x, x), torch.ones(4, dtype=torch.float64))
    previous = torch.ones(4, dtype=torch.float64)
    for sigma in (0.05, 0.2, 0.5):
        g = torch.Generator().manual_seed(1)
        s = metrics.ssim(x, (x + sigma * torch.randn(x.shape, generator=g)).clamp(0, 1))
        assert ((s >= -1) & (s <= 1)).all()
        assert (s < previous).all()
        previous = s
    assert (metrics.ssim(x, 1 - x) < 0.5).all()


def test_ssim_small_patches_and_window():
    assert metrics.ssim_window(32, 32)["gaussian_weights"] is True
    assert metrics.ssim_window(8, 8) == {"gaussian_weights": False, "win_size": 7, "use_sample_covariance": False}
    x = _images(size=8)
    assert torch.allclose(metrics.ssim(x, x), torch.ones(4, dtype=torch.float64))
    assert metrics.ssim(x[:, :1], x[:, :1]).shape == (4,)  # grey


def test_patch_grid_round_trip_and_recovered_patches():
    x = torch.rand(2, 3, 32, 32)
    p = metrics.patch_grid(x, 16)
    assert p.shape == (2, 4, 3, 16, 16)
    assert torch.equal(p[0, 1], x[0, :, :16, 16:])  # row-major order
    assert torch.equal(metrics.unpatch_grid(p, 32, 32), x)
    r = x.clone()
    r[0, :, :16, :16] = float("nan")
    rec, truth = metrics.recovered_patches(r, x, 16)
    assert rec.shape == (7, 3, 16, 16) and torch.equal(rec, truth)


def test_lpips_none_without_weights(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("GRADLEAK_LPIPS_WEIGHTS", raising=False)
    monkeypatch.delenv("GRADLEAK_ALEXNET_WEIGHTS", raising=False)
    x = _images()
    assert metrics.lpips(x, x) is None
    ok, msg = metrics.lpips_status()
    assert not ok and "nothing is downloaded" in msg


def test_lpips_with_supplied_weights(monkeypatch, tmp_path):
    """Synthetic weights in the torchvision / lpips file formats: identity gives 0, different images > 0."""
    from gradleak.metrics.lpips import CHANNELS, AlexNetFeatures

    torch.manual_seed(0)
    alex = tmp_path / "alexnet-owt-7be5be79.pth"
    torch.save(AlexNetFeatures().state_dict(), alex)  # same keys as torchvision: features.0.weight, ...
    lin = tmp_path / "alex.pth"
    torch.save({f"lin{k}.model.1.weight": torch.rand(1, c, 1, 1) for k, c in enumerate(CHANNELS)}, lin)
    monkeypatch.setenv("GRADLEAK_ALEXNET_WEIGHTS", str(alex))
    monkeypatch.setenv("GRADLEAK_LPIPS_WEIGHTS", str(lin))
    x, y = _images(0, size=64), _images(1, size=64)
    assert torch.allclose(metrics.lpips(x, x), torch.zeros(4, dtype=torch.float64))
    d = metrics.lpips(x, y)
    assert d.shape == (4,) and (d > 0).all()
    assert metrics.lpips(x[:, :, :16, :16], y[:, :, :16, :16]).shape == (4,)  # small patches upsampled
    assert metrics.lpips_status()[0]


def test_feature_distance_identical_zero_different_positive():
    """Real pretrained ViT-S/14 on 2 cores: ~8 forward passes at 224 px (a few seconds)."""
    from gradleak.data import load

    s = load("cifar-samples", n=4).images
    x, y = s[:2], s[2:4]
    noisy = (x + 0.05 * torch.randn(x.shape, generator=torch.Generator().manual_seed(0))).clamp(0, 1)
    same = features.feature_distance(x[:1], x[:1].clone())
    assert same.shape == (1,) and same.abs().max() < 1e-5
    feats = features.image_features(torch.cat([x, y, noisy]))
    assert feats.shape == (6, 384) and torch.isfinite(feats).all() and feats.std(0).mean() > 0.1
    cos = lambda a, b: 1 - torch.nn.functional.cosine_similarity(a, b, dim=1)  # noqa: E731
    diff, near = cos(feats[0:2], feats[2:4]), cos(feats[0:2], feats[4:6])
    assert (diff > 0.02).all() and (diff <= 2).all()
    assert (near < diff).all()
    assert "ViT-S/14" in features.feature_distance.backbone


@pytest.mark.timeout(300)
def test_feature_backbone_matches_onnx_graph(vit_s14_available):
    """The converted Dinov2Model reproduces the ONNX backbone output (onnx reference evaluator, ~15-25 s on 2 cores:
    in the default suite; the graph's input is fixed at 224×224, so the input is one image)."""
    from gradleak.models.features import verify_against_onnx

    assert verify_against_onnx() < 1e-3


def test_nan_propagates():
    x = _images()
    y = (x + 0.1).clamp(0, 1)
    y[0, 0, 0, 0] = math.nan
    assert torch.isnan(metrics.psnr(x, y)[0]) and torch.isfinite(metrics.psnr(x, y)[1])
    assert torch.isnan(metrics.ssim(x, y)[0])
