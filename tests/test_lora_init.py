"""LoRA initialisations (paper 001 Table 11): standard (peft's, B = 0), uniform (A, B ~ U(±1/√d_in))."""

import pytest
import torch

from gradleak.errors import BadInput
from gradleak.models import ModelHandle
from gradleak.models.vit import vit
from gradleak.peft import PeftConfig, apply_peft

pytest.importorskip("peft")


def lora_vit(init: str, seed: int = 0, rank: int = 4) -> ModelHandle:
    """A tiny ViT (8×8 images, patch 4, d = 32, 2 blocks) with LoRA on query + value."""
    torch.manual_seed(123)  # peft draws A from the global generator: fix it so only our seed varies
    model = vit("vit-tiny", image_size=8, patch_size=4, hidden_size=32, heads=2, layers=2, num_classes=4, seed=0)
    handle = ModelHandle(model, "image", "vit-tiny", "image", 32, 2)
    apply_peft(handle, PeftConfig(kind="lora", lora_rank=rank, lora_targets=["query", "value"], lora_init=init),
               seed=seed)
    return handle


def lora_params(handle, which: str) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in handle.model.named_parameters() if f"lora_{which}" in n}


def test_standard_keeps_b_zero_and_a_within_peft_bound(one_thread):
    h = lora_vit("standard")
    B, A = lora_params(h, "B"), lora_params(h, "A")
    assert len(B) == 4 and all(float(b.abs().max()) == 0.0 for b in B.values())
    assert all(float(a.abs().max()) <= 1 / a.shape[1] ** 0.5 for a in A.values())  # kaiming(a=√5) = U(±1/√d_in)
    assert PeftConfig(kind="lora", lora_init="standard").lora_init == "default"  # the same init as `default`


def test_uniform_draws_both_factors_in_bound_and_is_seeded(one_thread):
    h = lora_vit("uniform", seed=5)
    A, B = lora_params(h, "A"), lora_params(h, "B")
    d_in = 32
    for t in (*A.values(), *B.values()):
        assert float(t.abs().max()) <= 1 / d_in ** 0.5 and float(t.abs().max()) > 0.5 / d_in ** 0.5
    assert all(float(b.abs().max()) > 0 for b in B.values())
    assert all(p.requires_grad for n, p in h.model.named_parameters() if "lora_" in n)
    again = lora_params(lora_vit("uniform", seed=5), "B")
    other = lora_params(lora_vit("uniform", seed=6), "B")
    assert all(torch.equal(B[n], again[n]) for n in B)
    assert not all(torch.equal(B[n], other[n]) for n in B)
    # fully seeded: A does not depend on the global generator either
    torch.manual_seed(999)
    model = vit("vit-tiny", image_size=8, patch_size=4, hidden_size=32, heads=2, layers=2, num_classes=4, seed=0)
    h2 = ModelHandle(model, "image", "vit-tiny", "image", 32, 2)
    apply_peft(h2, PeftConfig(kind="lora", lora_rank=4, lora_targets=["query", "value"], lora_init="uniform"), seed=5)
    assert all(torch.equal(A[n], p.detach()) for n, p in h2.model.named_parameters() if n in A)


def test_default_nonzero_unchanged(one_thread):
    assert PeftConfig().lora_init == "nonzero"
    B = lora_params(lora_vit("nonzero", seed=0), "B")
    g = torch.Generator().manual_seed(31)  # the documented draw: B ~ N(0, 0.02²) from seed + 31, in parameter order
    for n in B:
        assert torch.equal(B[n], torch.randn(B[n].shape, generator=g) * 0.02)


def test_unknown_init_is_refused():
    with pytest.raises(Exception) as err:
        PeftConfig(kind="lora", lora_init="gaussian")
    assert "lora_init" in str(err.value)
    with pytest.raises(BadInput):
        PeftConfig(kind="adapters", lora_init="uniform").check()
