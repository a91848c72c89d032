"""LPIPS (Zhang et al. 2018, v0.1, AlexNet backbone) against weights the user supplies.

The AlexNet and LPIPS linear-layer weights cannot be had offline here (ASSETS.md), so nothing is
downloaded: :func:`lpips` looks for

* the torchvision AlexNet checkpoint ``alexnet-owt-7be5be79.pth`` in the torch hub cache
  (``torch.hub.get_dir()/checkpoints``, i.e. ``$TORCH_HOME/hub/checkpoints``, default
  ``~/.cache/torch/hub/checkpoints``) or at ``$GRADLEAK_ALEXNET_WEIGHTS``;
* the LPIPS linear layers ``alex.pth`` (keys ``lin{0..4}.model.1.weight``) at ``weights_path``, else
  ``$GRADLEAK_LPIPS_WEIGHTS``, else inside an installed ``lpips`` package (``lpips/weights/v0.1/alex.pth``);

and returns ``None`` when either is missing (``lpips_status()`` says which). The papers leave the
backbone open (docs/PAPERS.md); we pick AlexNet, the LPIPS default. The AlexNet feature extractor is written here
(torchvision layout: conv 11/4 → 5 → 3 → 3 → 3, taps after each ReLU), no torchvision needed.

Computation (lpips v0.1): inputs [0, 1] → [−1, 1] → ``(x − shift) / scale`` with shift
(−.030, −.088, −.188), scale (.458, .448, .450); per tap, unit-normalise features over channels
(ε = 1e-10), square the difference, weight channels by the 1×1 linear layer, average over space, sum
over the five taps. Range [0, ∞), typically ≤ 1; 0 for identical images; lower is better.
Verified (2026-11-29): with the real LPIPS v0.1 linear layers (``alex.pth`` from the PyPI ``lpips==0.1.4``
wheel) and a random AlexNet in torchvision layout, this matches the reference ``lpips.LPIPS(net="alex")``
to max |Δ| = 1.5e-8 on CIFAR samples vs crops and on 64 px ImageNet samples vs noisy copies
(the reference was run with a stub ``torchvision`` returning our :class:`AlexNetFeatures`).

Images smaller than 32 px on a side are bicubic-upsampled to 32 px first (AlexNet's pooling needs it;
a decision of ours, the paper does not cover it).
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from gradleak.registry import METRICS

ALEXNET_FILE = "alexnet-owt-7be5be79.pth"
CHANNELS = (64, 192, 384, 256, 256)
SHIFT = (-0.030, -0.088, -0.188)
SCALE = (0.458, 0.448, 0.450)
MIN_SIDE = 32


class AlexNetFeatures(nn.Module):
    """torchvision's ``alexnet().features`` (same parameter names), returning the five ReLU outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, 11, stride=4, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),
            nn.Conv2d(64, 192, 5, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),
            nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(),
            nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(),
            nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2),
        )

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        taps = []
        for i, layer in enumerate(self.features):
            x = layer(x)
            if i in (1, 4, 7, 9, 11):
                taps.append(x)
                if i == 11:
                    break
        return taps


class LPIPS(nn.Module):
    """AlexNet-LPIPS v0.1 with given state dicts (``alexnet``: torchvision keys; ``linear``: lpips keys)."""

    def __init__(self, alexnet_state: dict, linear_state: dict) -> None:
        super().__init__()
        self.net = AlexNetFeatures()
        feats = {k: v for k, v in alexnet_state.items() if k.startswith("features.")}
        self.net.load_state_dict(feats)
        self.lins = nn.ParameterList()
        for k, c in enumerate(CHANNELS):
            w = linear_state.get(f"lin{k}.model.1.weight", linear_state.get(f"lin{k}.weight"))
            if w is None or tuple(w.shape) != (1, c, 1, 1):
                raise ValueError(f"LPIPS linear weights: lin{k}.model.1.weight of shape (1, {c}, 1, 1) not found")
            self.lins.append(nn.Parameter(w.detach().float().clone(), requires_grad=False))
        self.register_buffer("shift", torch.tensor(SHIFT).view(1, 3, 1, 1))
        self.register_buffer("scale", torch.tensor(SCALE).view(1, 3, 1, 1))
        self.eval().requires_grad_(False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Per-image LPIPS of [0, 1] images (N×C×H×W), shape N."""
        fx = self.net((x * 2 - 1 - self.shift) / self.scale)
        fy = self.net((y * 2 - 1 - self.shift) / self.scale)
        total = torch.zeros(x.shape[0], device=x.device)
        for a, b, w in zip(fx, fy, self.lins):
            a = a / (a.pow(2).sum(1, keepdim=True).sqrt() + 1e-10)
            b = b / (b.pow(2).sum(1, keepdim=True).sqrt() + 1e-10)
            total = total + ((a - b) ** 2 * w).sum(1).mean((1, 2))
        return total


def _alexnet_path(backbone_path: str | Path | None) -> Path | None:
    candidates = [backbone_path, os.environ.get("GRADLEAK_ALEXNET_WEIGHTS")]
    try:
        candidates.append(Path(torch.hub.get_dir()) / "checkpoints" / ALEXNET_FILE)
    except Exception:  # pragma: no cover
        pass
    candidates.append(Path.home() / ".cache" / "torch" / "hub" / "checkpoints" / ALEXNET_FILE)
    for c in candidates:
        if c and Path(c).expanduser().is_file():
            return Path(c).expanduser()
    return None


def _linear_path(weights_path: str | Path | None) -> Path | None:
    candidates: list = [weights_path, os.environ.get("GRADLEAK_LPIPS_WEIGHTS")]
    spec = importlib.util.find_spec("lpips")
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        candidates.append(Path(loc) / "weights" / "v0.1" / "alex.pth")
    for c in candidates:
        if c and Path(c).expanduser().is_file():
            return Path(c).expanduser()
    return None


def lpips_status(weights_path: str | Path | None = None, backbone_path: str | Path | None = None) -> tuple[bool, str]:
    """Whether LPIPS can be computed, and a sentence saying which weights are used or missing."""
    a, l = _alexnet_path(backbone_path), _linear_path(weights_path)
    if a and l:
        return True, f"LPIPS (AlexNet, v0.1) with backbone {a} and linear layers {l}"
    missing = []
    if not a:
        missing.append(f"AlexNet weights ({ALEXNET_FILE} in {Path(torch.hub.get_dir()) / 'checkpoints'} "
                       "or $GRADLEAK_ALEXNET_WEIGHTS)")
    if not l:
        missing.append("LPIPS linear layers (alex.pth at $GRADLEAK_LPIPS_WEIGHTS)")
    return False, "LPIPS not computed: missing " + " and ".join(missing) + "; nothing is downloaded."


@lru_cache(maxsize=4)
def _model(alexnet: str, linear: str) -> LPIPS:
    load = lambda p: torch.load(p, map_location="cpu", weights_only=True)  # noqa: E731
    return LPIPS(load(alexnet), load(linear))


@METRICS.register("lpips", "LPIPS (AlexNet v0.1) per image, ↓, ≥ 0 — only with user-supplied weights, else None")
def lpips(x: torch.Tensor, y: torch.Tensor, weights_path: str | Path | None = None,
          backbone_path: str | Path | None = None) -> torch.Tensor | None:
    """Per-image LPIPS (float64, shape N) of [0, 1] images, or ``None`` when the weights are absent."""
    a, l = _alexnet_path(backbone_path), _linear_path(weights_path)
    if a is None or l is None:
        return None
    model = _model(str(a), str(l))
    x = torch.as_tensor(x).float()
    y = torch.as_tensor(y).float()
    if x.ndim == 3:
        x, y = x.unsqueeze(0), y.unsqueeze(0)
    if x.shape != y.shape:
        raise ValueError(f"lpips needs two tensors of the same shape, got {tuple(x.shape)} and {tuple(y.shape)}")
    if x.shape[1] == 1:
        x, y = x.expand(-1, 3, -1, -1), y.expand(-1, 3, -1, -1)
    h, w = x.shape[-2:]
    if min(h, w) < MIN_SIDE:
        f = MIN_SIDE / min(h, w)
        size = (max(MIN_SIDE, round(h * f)), max(MIN_SIDE, round(w * f)))
        x = torch.nn.functional.interpolate(x, size=size, mode="bicubic", align_corners=False)
        y = torch.nn.functional.interpolate(y, size=size, mode="bicubic", align_corners=False)
    with torch.no_grad():
        return model.to(x.device)(x, y).double().cpu()
