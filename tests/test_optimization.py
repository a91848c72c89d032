"""Inverting Gradients (gradleak.attacks.optimization): runs on adapter ViTs, reads only the ServerView,
and truly reconstructs when the whole (small) model is trainable — so a failure on adapters is a finding."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradleak.attacks.base import ThreatModel
from gradleak.attacks.optimization.inverting_gradients import InvertingGradients
from gradleak.attacks.optimization.labels import infer_labels_from_bias_gradient
from gradleak.attacks.optimization.objective import total_variation
from gradleak.data import load
from gradleak.errors import BadInput
from gradleak.fl.core import Client, ServerView
from gradleak.metrics import psnr
from gradleak.models.vit import vit
from gradleak.peft.adapters import add_vit_adapters
from gradleak.registry import ATTACKS


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def images16() -> torch.Tensor:
    """Real CIFAR images, area-resized to 16×16, in [0, 1]."""
    return F.interpolate(load("cifar-samples", n=4).images, size=16, mode="area")


def tiny_adapter_vit() -> nn.Module:
    model = vit("vit-tiny", image_size=16, patch_size=8, num_classes=4)
    add_vit_adapters(model, 8)
    return model


def view_from_client(model: nn.Module, images01: torch.Tensor, targets: torch.Tensor, **public) -> ServerView:
    """The server sees the model it sent, the client's upload and what the threat model grants."""
    client = Client(0, images01 * 2 - 1, targets)
    update = client.local_update(model)
    return ServerView(model=model, updates=[update], public=dict(public))


def test_registered_and_honest():
    assert ATTACKS.get("inverting_gradients") is InvertingGradients
    model = tiny_adapter_vit()
    assert InvertingGradients(steps=1).prepare(model, ThreatModel()) is model
    with pytest.raises(BadInput):
        InvertingGradients(labels="guess")


def test_adapter_vit_matching_loss_decreases(images16):
    model = tiny_adapter_vit()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    view = view_from_client(model, images16[:1], torch.tensor([1]), batch_size=1, labels=[1])
    seen = []
    rec = InvertingGradients(steps=40, image_shape=(3, 16, 16), progress=seen.append).reconstruct(view)
    x = rec.data["images"]
    assert x.shape == (1, 3, 16, 16) and float(x.min()) >= 0.0 and float(x.max()) <= 1.0
    info = rec.info
    assert info["final_matching_loss"] < 0.5 * info["initial_matching_loss"]
    # only what the update holds (adapters + head) is matched
    assert set(info["matched_parameters"]) == set(view.updates[0].tensors)
    assert all(".adapter." in n or n.startswith("head.") for n in info["matched_parameters"])
    assert seen and seen[-1]["step"] == 40
    # the view's model is not mutated
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert flags == {n: p.requires_grad for n, p in model.named_parameters()}


def test_reads_only_the_server_view(images16):
    # the attack's whole input is a ServerView: no client, no private batch
    assert list(inspect.signature(InvertingGradients.reconstruct).parameters) == ["self", "view"]
    model = tiny_adapter_vit()
    view = view_from_client(model, images16[1:2], torch.tensor([3]))  # nothing granted
    with pytest.raises(BadInput, match="labels"):
        InvertingGradients(steps=2, labels="known").reconstruct(view)
    rec = InvertingGradients(steps=3, labels="idlg", box="tanh", similarity="per_parameter").reconstruct(view)
    assert rec.info["labels"] == [3] and rec.info["label_source"] == "idlg:head.bias"
    assert rec.info["batch_size_source"] == "update.num_samples"
    assert rec.info["image_shape"] == [3, 16, 16]  # from the model config the server sent
    assert rec.data["images"].shape == (1, 3, 16, 16)


def test_idlg_counts_repeated_labels(images16):
    torch.manual_seed(1)
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 32), nn.Sigmoid(), nn.Linear(32, 6))
    labels = torch.tensor([3, 0, 3, 5])
    update = Client(0, images16 * 2 - 1, labels).local_update(mlp)
    assert infer_labels_from_bias_gradient(update.tensors["3.bias"], 4).tolist() == [0, 3, 3, 5]


def test_total_variation_of_constant_is_zero():
    assert float(total_variation(torch.ones(2, 3, 5, 5))) == 0.0
    assert float(total_variation(torch.arange(4.0).reshape(1, 1, 1, 4))) == pytest.approx(1.0)


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_full_model_sanity_reconstructs(images16, kind):
    """Fully trainable tiny model, B = 1: IG must recover the image (proves the optimiser is right)."""
    torch.manual_seed(0)
    if kind == "linear":
        model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 32), nn.Sigmoid(), nn.Linear(32, 4))
    else:
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Sigmoid(), nn.Flatten(), nn.Linear(8 * 16 * 16, 4))
    truth = images16[:1]
    view = view_from_client(copy.deepcopy(model), truth, torch.tensor([2]), batch_size=1, labels=[2])
    rec = InvertingGradients(steps=200, image_shape=(3, 16, 16)).reconstruct(view)
    assert float(psnr(rec.data["images"], truth)[0]) > 20.0
