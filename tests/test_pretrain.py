"""The backbone pretrained by us on a split the clients never see (gradleak.models.pretrain; paper 003's study)."""

import pytest
import torch

from gradleak.errors import BadInput
from gradleak.run import validate
from gradleak.config.loading import load_yaml
from gradleak.models.pretrain import pretrained, pretraining_images
from gradleak.models.resnet import resnet18

from pathlib import Path

LEAKAGE = Path(__file__).resolve().parents[1] / "configs" / "leakage" / "fmnist_resnet18.yaml"
SPEC = {"data": "fashion-mnist", "split": "test", "images": 32, "epochs": 1, "lr": 0.05, "momentum": 0.9,
        "batch_size": 16, "seed": 0}
ARCH = {"name": "resnet18", "image_size": 33, "channels": 1, "classes": 10, "seed": 0, "dtype": "float32"}


def _fresh():
    return resnet18(image_size=33, seed=0)


def test_pretraining_trains_caches_atomically_and_reloads_the_same_weights(one_thread, tmp_path, monkeypatch):
    monkeypatch.setenv("GRADLEAK_PRETRAIN_CACHE", str(tmp_path))
    torch.set_num_threads(2)
    init = {k: v.clone() for k, v in _fresh().state_dict().items()}
    a = _fresh()
    info = pretrained(a, SPEC, ARCH, image_size=33, channels=1, num_classes=10)
    assert torch.get_num_threads() == 2  # one thread while training, restored after
    assert not info["pretrain_cached"] and info["pretrain_data"] == "fashion-mnist/test"
    sa = a.state_dict()
    assert not torch.equal(sa["classifier.1.weight"], init["classifier.1.weight"])  # it trained
    bn = "resnet.embedder.embedder.normalization.running_mean"
    assert not torch.equal(sa[bn], init[bn])  # in train mode: the running statistics are the pretraining data's
    files = list(tmp_path.iterdir())
    assert len(files) == 1 and files[0].suffix == ".pt"  # no temporary file left behind
    b = _fresh()
    info2 = pretrained(b, SPEC, ARCH, image_size=33, channels=1, num_classes=10)
    assert info2["pretrain_cached"]
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in sa.items())
    # another recipe is another cache entry; a corrupt entry is retrained, not trusted
    pretrained(_fresh(), {**SPEC, "seed": 1}, ARCH, image_size=33, channels=1, num_classes=10)
    assert len(list(tmp_path.iterdir())) == 2
    files[0].write_bytes(b"not a checkpoint")
    c = _fresh()
    assert not pretrained(c, SPEC, ARCH, image_size=33, channels=1, num_classes=10)["pretrain_cached"]
    assert all(torch.equal(v, c.state_dict()[k]) for k, v in sa.items())  # deterministic retraining


def test_pretraining_images_come_from_the_split_asked_for():
    x, y = pretraining_images(SPEC, image_size=40, channels=1, num_classes=10)
    assert x.shape == (32, 1, 40, 40) and 0 <= float(x.min()) and float(x.max()) <= 1 and y.max() < 10
    with pytest.raises(BadInput, match="holds 10000 images") as e:
        pretraining_images({**SPEC, "images": 10_001}, image_size=40, channels=1, num_classes=10)
    assert e.value.field == "model.pretrain.images"


@pytest.mark.parametrize("override, field", [
    (["model.pretrain.split=train"], "model.pretrain.split"),  # the clients' own split
    (["model.name=vit-s14-pretrained", "model.num_channels=3", "model.train_all=false", "peft.kind=none"],
     "model.pretrain"),  # pretrained already: only resnet18 and the random-init ViT presets pretrain
])
def test_pretraining_that_would_share_the_clients_images_or_another_model_is_refused(override, field):
    with pytest.raises(BadInput) as e:
        validate(load_yaml(LEAKAGE), override)
    assert e.value.field.startswith(field)


# --- the ViT presets (the in-domain backbone of benchmarks/anchor.py) ------------------------------

ANCHOR = Path(__file__).resolve().parents[1] / "configs" / "anchor" / "fmnist_b1.yaml"
TINY_VIT = ["model.name=vit-tiny", "model.layers=1", "model.patch_size=8", "model.pretrain.images=16",
            "model.pretrain.epochs=1", "model.pretrain.batch_size=8"]


def _vit(overrides, seed=0):
    from gradleak.models import build

    _, cfg = validate(load_yaml(ANCHOR), TINY_VIT + overrides + [f"seed={seed}"])
    return build(cfg.model, "image", image_size=cfg.data.image_size, seed=cfg.seed, dtype="float32")


def test_a_vit_preset_pretrains_once_and_its_weights_do_not_depend_on_the_experiment_seed(one_thread, tmp_path,
                                                                                         monkeypatch):
    monkeypatch.setenv("GRADLEAK_PRETRAIN_CACHE", str(tmp_path))
    a = _vit([], seed=0)
    assert not a.info["pretrain_cached"] and a.info["pretrain_data"] == "fashion-mnist/test"
    b = _vit([], seed=5)  # another experiment seed: the same checkpoint, from the cache
    assert b.info["pretrain_cached"] and len(list(tmp_path.iterdir())) == 1
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert all(torch.equal(v, sb[k]) for k, v in sa.items())
    r0, r5 = _vit(["model.pretrain=null"], 0).model.state_dict(), _vit(["model.pretrain=null"], 5).model.state_dict()
    key = "head.weight"
    assert not torch.equal(r0[key], r5[key])  # random init follows the experiment seed
    assert not torch.equal(r0[key], sa[key])  # and pretraining changed the weights it started from
    # another architecture or recipe is another cache entry
    _vit(["model.layers=2"])
    _vit(["model.pretrain.seed=1"])
    assert len(list(tmp_path.iterdir())) == 3


def test_vit_cache_key_holds_the_architecture_not_the_experiment_seed():
    from gradleak.models.pretrain import cache_key, vit_arch
    from gradleak.models.vit import vit

    m = vit("vit-tiny", image_size=32, patch_size=8, layers=1, num_classes=10)
    arch = vit_arch("vit-tiny", m.config, 10, "mean", "float32")
    assert arch["layers"] == 1 and arch["patch_size"] == 8 and arch["hidden_size"] == 192 and "seed" not in arch
    assert cache_key(SPEC, arch) != cache_key(SPEC, {**arch, "layers": 2})
    assert cache_key(SPEC, arch) != cache_key(SPEC, {**arch, "pooling": "cls"})
    assert cache_key(SPEC, arch) == cache_key(dict(SPEC), dict(arch))


def test_the_anchor_config_pretrains_its_vit_on_a_split_disjoint_from_the_victims():
    _, cfg = validate(load_yaml(ANCHOR), [])
    assert cfg.model.name == "vit-s16" and cfg.data.name == "fashion-mnist" and cfg.model.pretrain.split == "test"
    with pytest.raises(BadInput) as e:  # the victims' own split
        validate(load_yaml(ANCHOR), ["model.pretrain.split=train"])
    assert e.value.field == "model.pretrain.split"
    with pytest.raises(BadInput) as e:  # the offline ViT-S/14 is pretrained already
        validate(load_yaml(ANCHOR), ["model.name=vit-s14-pretrained"])
    assert e.value.field == "model.pretrain"


def test_a_vit_preset_built_with_init_weights_unset_is_initialised_by_its_seed():
    """``model.init_weights`` unset (None) initialises; only an explicit False skips it (a CI flake: the builder took
    None for False, and a random-init ViT built outside the pipeline was whatever memory the allocator handed back)."""
    a, b = (_vit(["model.pretrain=null"], 3).model.state_dict() for _ in range(2))
    assert all(torch.equal(v, b[k]) for k, v in a.items())  # seeded, not uninitialised memory
    w = a["head.weight"]
    assert torch.isfinite(w).all() and 0 < float(w.abs().max()) < 1  # nn.Linear's uniform init, bound 1/sqrt(384)
