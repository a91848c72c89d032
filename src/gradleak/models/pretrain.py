"""A backbone pretrained by us on a disjoint split: no pretrained ResNet exists offline.

Used for ResNet-18 (the leakage study) and for the random-init ViT presets (``vit-s16``, ``vit-tiny``, ...: the
in-domain backbone of the spatial-anchor study; :func:`vit_arch` gives their cache key).

Hatamizadeh et al. 2022 fine-tune an ImageNet-pretrained ResNet-18 (§III-A). Offline there is none
(torchvision/timm weights are hub downloads, docs/DESIGN.md §3), so :func:`pretrain` trains the randomly
initialised network ourselves, centrally, on images the federated clients never hold — by default
Fashion-MNIST's *test* split (10 000 images; the clients draw from the 60 000-image *train* split) — and
the federation then starts from that checkpoint, as the paper's starts from ImageNet weights. What this
changes, measured: a random-init ResNet-18's BN statistics and gradients carry little of the image (the
attack stays below the prior, RDLV < 0); a trained network's do.

Recipe (``model.pretrain``, :class:`PretrainSpec`): ``images`` images of ``data``/``split`` resized to the
experiment's size and channel count, ``epochs`` epochs of SGD with momentum (batch ``batch_size``, a
seeded shuffle, cosine lr decay from ``lr``), in train mode, so the BN running statistics are those of the
pretraining data (what an ImageNet checkpoint brings). One torch thread during the training, so the weights
do not depend on the thread count.

**Cache.** The weights are cached under ``$GRADLEAK_CACHE/pretrained`` (default ``~/.cache/gradleak``),
keyed by a hash of everything that determines them (recipe, architecture, image size, channels, classes,
seed, dtype, torch version), written atomically (temporary file + rename): a second run, or an interrupted
one, retrains nothing or starts over cleanly. ``info`` reports the pretraining accuracy on the last epoch.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch

from gradleak.errors import BadInput


def _cache_dir() -> Path:
    """``$GRADLEAK_PRETRAIN_CACHE``, else ``$GRADLEAK_CACHE/pretrained`` (default ``~/.cache/gradleak/pretrained``)."""
    if os.environ.get("GRADLEAK_PRETRAIN_CACHE"):
        return Path(os.environ["GRADLEAK_PRETRAIN_CACHE"]).expanduser()
    return Path(os.environ.get("GRADLEAK_CACHE") or Path.home() / ".cache" / "gradleak").expanduser() / "pretrained"


def cache_key(spec: dict[str, Any], arch: dict[str, Any]) -> str:
    blob = json.dumps({"spec": spec, "arch": arch, "torch": torch.__version__.split("+")[0], "v": 1}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def vit_arch(name: str, config: Any, num_classes: int, pooling: str, dtype: str) -> dict[str, Any]:
    """The cache-key architecture of a ViT preset (``gradleak.models``): everything that shapes its weights. The
    experiment's seed is not in it: a pretrained ViT starts from the recipe's seed (``model.pretrain.seed``)."""
    return {"name": name, "image_size": int(config.image_size), "patch_size": int(config.patch_size),
            "layers": int(config.num_hidden_layers), "hidden_size": int(config.hidden_size),
            "heads": int(config.num_attention_heads), "channels": int(config.num_channels), "classes": int(num_classes),
            "pooling": pooling, "dtype": dtype}


def pretraining_images(spec: dict[str, Any], *, image_size: int, channels: int, num_classes: int):
    """``spec['images']`` images (first ones of a seeded permutation) of ``spec['data']``/``spec['split']``, resized
    to ``image_size`` (bilinear, antialiased) with ``channels`` channels; labels modulo ``num_classes``."""
    from gradleak.data import load

    try:
        ds = load(spec["data"], split=spec["split"])
    except BadInput as e:
        raise BadInput("model.pretrain.data", e.problem, e.fix) from None
    n = int(spec["images"])
    if n > len(ds.images):
        raise BadInput("model.pretrain.images", f"'{spec['data']}/{spec['split']}' holds {len(ds.images)} images, "
                       f"{n} were asked for.", f"use model.pretrain.images ≤ {len(ds.images)}.")
    perm = torch.randperm(len(ds.images), generator=torch.Generator().manual_seed(int(spec["seed"])))[:n]
    x, y = ds.images[perm].float(), ds.labels[perm].long() % num_classes
    if x.shape[-1] != image_size or x.shape[-2] != image_size:
        x = torch.nn.functional.interpolate(x, size=(image_size, image_size), mode="bilinear", antialias=True,
                                            align_corners=False)
    if x.shape[1] == 1 and channels == 3:
        x = x.expand(-1, 3, -1, -1)
    elif x.shape[1] == 3 and channels == 1:
        x = (x * torch.tensor([0.299, 0.587, 0.114]).reshape(1, 3, 1, 1)).sum(1, keepdim=True)
    return x.clamp(0, 1), y


def train(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, epochs: int, lr: float, momentum: float,
          batch_size: int, seed: int, progress: Callable[[str], None] | None = None) -> dict[str, float]:
    """Central SGD (momentum, cosine decay) in train mode on pixels mapped to ``2x − 1`` (the clients' input space)."""
    dtype = next(model.parameters()).dtype
    inputs = (x * 2 - 1).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    gen = torch.Generator().manual_seed(seed)
    steps_per_epoch = math.ceil(len(x) / batch_size)
    total = epochs * steps_per_epoch
    step, correct, seen, last_loss = 0, 0, 0, float("nan")
    model.train()
    t0 = time.perf_counter()
    for ep in range(epochs):
        order = torch.randperm(len(x), generator=gen)
        correct = seen = 0
        for i in range(0, len(x), batch_size):
            idx = order[i:i + batch_size]
            if len(idx) < 2:  # train-mode BatchNorm needs more than one value per channel
                continue
            for g in opt.param_groups:
                g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / total))
            out = model(inputs[idx])
            logits = out.logits if hasattr(out, "logits") else out
            loss = torch.nn.functional.cross_entropy(logits, y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            correct += int((logits.argmax(1) == y[idx]).sum())
            seen += len(idx)
            last_loss = float(loss.detach())
            step += 1
        if progress is not None:
            progress(f"pretraining epoch {ep + 1}/{epochs}: accuracy {correct / max(seen, 1):.3f}, "
                     f"loss {last_loss:.3f} ({time.perf_counter() - t0:.0f} s)")
    model.eval()
    return {"pretrain_accuracy_last_epoch": correct / max(seen, 1), "pretrain_loss_last_step": last_loss,
            "pretrain_seconds": time.perf_counter() - t0}


def pretrained(model: torch.nn.Module, spec: dict[str, Any], arch: dict[str, Any], *, image_size: int, channels: int,
               num_classes: int, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Load ``model``'s pretrained weights from the cache, or pretrain and cache them; returns the info dict."""
    key = cache_key(spec, arch)
    path = _cache_dir() / f"{arch.get('name', 'model')}-{key}.pt"
    if path.is_file():
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
            model.load_state_dict(blob["state"])
            return {**blob["info"], "pretrain_cache": str(path), "pretrain_cached": True}
        except Exception:  # a corrupt cache file: retrain and overwrite it
            pass
    x, y = pretraining_images(spec, image_size=image_size, channels=channels, num_classes=num_classes)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the weights must not depend on the thread count
    try:
        info = train(model, x, y, epochs=int(spec["epochs"]), lr=float(spec["lr"]), momentum=float(spec["momentum"]),
                     batch_size=int(spec["batch_size"]), seed=int(spec["seed"]), progress=progress)
    finally:
        torch.set_num_threads(threads)
    info = {**info, "pretrain_images": int(spec["images"]), "pretrain_data": f"{spec['data']}/{spec['split']}"}
    try:
        from gradleak.atomic import atomic_path

        with atomic_path(path) as tmp:
            torch.save({"state": model.state_dict(), "info": info}, tmp)
    except OSError:  # an unwritable cache only costs the next run the pretraining
        pass
    return {**info, "pretrain_cache": str(path), "pretrain_cached": False}


__all__ = ["pretrained", "pretraining_images", "train", "cache_key", "vit_arch"]
