"""The learned image decoder (``learned_image``, src/gradleak/attacks/learned_image.py; Wu et al. 2023 and ROG, the
image slice): it learns a real leak of an undefended upload beyond the stricter null (random held-out images and its
own images of held-out public uploads), stays at chance where the defense leaves nothing (huge noise: the filter can
only learn the public mean), reuses its cached decoder, and shows in ``gradleak list`` with its threat requirement.

Tiny real case: the ViT audit's setup (configs/audit/vit_lora.yaml: pretrained ViT-S/14 at patch 4, LoRA rank 128 on
query/value, FedSGD, B = 1, 32 px Fashion-MNIST) cut to one block, a prior split of 72 images (24 held out for the
decoder's null, 48 to train on); seeded, CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["attack.name=learned_image", "threat.public_data=true", "model.layers=1", "data.prior_size=72",
         "attack.params.null_images=24", "metrics.feature_distance=false"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADLEAK_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _run(out: Path, extra: list[str] = ()):
    from gradleak.config.loading import load_yaml
    from gradleak.run.audit import judge
    from gradleak.run.runner import run_config

    raw = load_yaml(ROOT / "configs/audit/vit_lora.yaml")
    raw.pop("audit", None)
    res = run_config(raw, out, overrides=QUICK + list(extra))
    return res, judge("images", res["metrics"], _Cfg()).as_dict()


class _Cfg:
    class metrics:  # noqa: N801 -- the judge reads cfg.metrics.psnr_threshold_db only
        psnr_threshold_db = 30.0


def test_decoder_learns_an_undefended_leak_and_reuses_its_cache(tmp_path, cache, vit_s14_available, one_thread):
    res, j = _run(tmp_path / "a")
    m = res["metrics"]
    assert m["decoder_cache_hit"] == 0.0 and m["decoder_train_seconds"] > 0 and m["decoder_public_images"] == 48
    # graded against the stricter of the two nulls, each reported alone
    assert m["psnr_max_null_p99"] >= max(m["psnr_max_decoder_null_p99"], m["psnr_max_random_image_null_p99"]) - 1e-9
    assert m["psnr_max"] > m["psnr_max_null_p99"] + 10, m  # the planted leak: block 0's LoRA span, undefended
    assert j["level"] in ("strong", "exact") and m["decoder_heldout_psnr"] > 25
    assert len(list(cache.glob("learned_image/*.pt"))) == 1
    res2, j2 = _run(tmp_path / "b")
    m2 = res2["metrics"]
    assert m2["decoder_cache_hit"] == 1.0 and m2["decoder_train_seconds"] == 0.0
    assert m2["psnr_max"] == m["psnr_max"] and j2["level"] == j["level"]
    assert len(list(cache.glob("learned_image/*.pt"))) == 1


def test_decoder_stays_at_chance_when_the_defense_removes_everything(tmp_path, cache, vit_s14_available, one_thread):
    """Absolute noise of std 1e3 on every coordinate (the gradient's entries are < 1): nothing of the image is left,
    the filter can learn only the public mean, and its images of held-out public uploads are as close to the
    victim as its image of the victim's upload."""
    res, j = _run(tmp_path / "n", ["defenses=[{name: gaussian_noise, params: {std: 1000.0}}]"])
    m = res["metrics"]
    assert j["level"] == "none", m
    assert m["psnr_max"] <= m["psnr_max_null_p99"] and m["ssim_max"] <= m["ssim_max_null_p99"]
    assert m["decoder_heldout_psnr"] < 20  # on public images too it returns no more than a blur of their mean


def test_filter_is_a_ridge_fit():
    """The decoder's filter on a planted distortion: coarse = 2 target + 0.3 + small noise is undone (in the
    least-squares sense) far better than the coarse image itself reads."""
    from gradleak.attacks.learned_image import apply_filter, fit_filter

    g = torch.Generator().manual_seed(0)
    target = torch.rand(200, 1, 8, 8, generator=g, dtype=torch.float64)
    coarse = 2 * target + 0.3 + 0.01 * torch.randn(200, 1, 8, 8, generator=g, dtype=torch.float64)
    f = fit_filter(coarse[:150], target[:150], 3, 1e-6)
    err = float(((apply_filter(f, coarse[150:]) - target[150:]) ** 2).mean())
    assert err < 1e-3 < float(((coarse[150:].clamp(0, 1) - target[150:]) ** 2).mean())


def test_list_shows_the_attack_and_its_requirement(cache):
    from typer.testing import CliRunner

    from gradleak.cli import app

    out = CliRunner().invoke(app, ["list", "attacks", "--modality", "image"]).output
    block = out[out.index("learned_image —"):].split("\n  ")[0:3]
    assert "learned_image —" in out and "public_data" in "\n".join(block), block


def test_too_few_public_images_name_the_field(tmp_path, cache, vit_s14_available, one_thread):
    from gradleak.errors import BadInput

    with pytest.raises(BadInput) as e:
        _run(tmp_path / "e", ["data.prior_size=20"])
    assert e.value.field == "data.prior_size"


def test_an_update_transform_in_the_defense_section_is_simulated_a_training_time_defense_is_not():
    """``--advise`` places SVT in ``defense:`` (an update transform applied after ``defenses:``): the decoder
    simulates it, so the attack is measurable there; DP-SGD changes the clients' training, which this slice does not
    simulate."""
    from gradleak.attacks.learned_image import LearnedImage
    from gradleak.config.loading import load_yaml
    from gradleak.run.runner import validate

    raw = load_yaml(Path(__file__).resolve().parents[1] / "configs" / "audit" / "vit_lora.yaml")
    attack = "attack.name=lora_span"  # the audit config names no attack; measurable reads the defense only
    svt = validate(raw, [attack, 'defense={"name": "nvflare_svt", "noise_var": 1.0}'])[1]
    sgd = validate(raw, [attack, 'defense={"name": "dpsgd", "noise_multiplier": 1.0}'])[1]
    assert LearnedImage.measurable(svt) and LearnedImage.measurable(validate(raw, [attack])[1])
    assert not LearnedImage.measurable(sgd) and "dpsgd" in LearnedImage.not_measurable_reason(sgd)
