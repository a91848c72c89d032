"""data.samples_per_client: each text client holds a dataset (the members) and trains each round
on a batch of data.batch_size drawn from it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gradleak.errors import BadInput
from gradleak.fl.core import Client

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "projres" / "minilm_adapter.yaml"
#: a small dataset setting on the shipped ProjRes config: 3 clients × 40 quotes, batches of 16
SETTING = ["fl.clients=3", "data.samples_per_client=40", "data.nonmembers=10", "data.test_size=20"]


def _cfg(extra=()):
    from gradleak.config.loading import load_yaml
    from gradleak.run import validate

    return validate(load_yaml(CONFIG), [*SETTING, *extra])[1]


def _client(n=40, B=16, seed=0, cid=0):
    x = torch.arange(n, dtype=torch.float64)[:, None]
    return Client(cid, x, torch.zeros(n, dtype=torch.long), round_batch=B, sample_seed=seed)


def test_rounds_draw_batches_of_the_client_dataset_epoch_by_epoch():
    c = _client()
    per_epoch = 40 // 16  # drop_last: 2 batches, 8 samples left over each epoch
    for epoch in range(3):
        idx = [c.round_indices(epoch * per_epoch + k) for k in range(per_epoch)]
        assert all(len(i) == 16 for i in idx)
        seen = torch.cat(idx)
        assert len(set(seen.tolist())) == 32 and int(seen.min()) >= 0 and int(seen.max()) < 40  # disjoint in an epoch
    assert not torch.equal(torch.sort(c.round_indices(0)).values, torch.sort(c.round_indices(2)).values)
    r = c.for_round(3)  # the round's client: same id and loss, that round's batch of the dataset
    assert r.client_id == 0 and r.num_samples == 16 and r.loss_fn is c.loss_fn
    assert torch.equal(r._inputs[:, 0].long(), c.round_indices(3))
    # deterministic by seed (and client id), another seed draws other batches
    assert torch.equal(_client().round_indices(5), c.round_indices(5))
    assert not torch.equal(_client(seed=1).round_indices(0), c.round_indices(0))
    assert not torch.equal(_client(cid=1).round_indices(0), c.round_indices(0))
    # without a dataset (the default) the client is its own round's client
    plain = Client(0, torch.zeros(4, 1), torch.zeros(4, dtype=torch.long))
    assert plain.for_round(7) is plain
    with pytest.raises(BadInput, match="data.batch_size"):
        _client(n=8, B=16)


def test_fedsgd_rounds_upload_the_gradient_of_the_rounds_batch():
    from gradleak.fl.engines.builtin import run_rounds

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    x, y = torch.randn(40, 3, dtype=torch.float64), torch.randint(0, 2, (40,))
    c = Client(0, x, y, round_batch=16, sample_seed=3)
    out = run_rounds(model, [c], rounds=3, algorithm="fedsgd", lr=0.1)
    for r, (ups, state) in enumerate(zip(out.rounds, out.round_states)):
        ref = torch.nn.Linear(3, 2).double()
        ref.load_state_dict(state)
        idx = c.round_indices(r)
        torch.nn.functional.cross_entropy(ref(x[idx]), y[idx]).backward()
        assert ups[0].num_samples == 16
        assert torch.allclose(ups[0].tensors["weight"], ref.weight.grad)


def test_members_are_the_client_dataset_and_nonmembers_are_held_by_no_client():
    from gradleak.data.splits import TextData
    from gradleak.evaluation.membership import draw_candidates as _candidates

    cfg = _cfg()
    data = TextData(cfg)
    clients = data.clients(0, cfg.model.num_classes)
    assert [len(t) for t, _ in clients] == [40, 40, 40]
    held = [t for texts, _ in clients for t in texts]
    assert len(set(held)) == 120  # disjoint datasets
    cands, member = _candidates(data, 0, clients, cfg.threat_model, cfg)
    for ci, (texts, _) in enumerate(clients):
        mem = {t for t, m in zip(cands[ci], member[ci]) if m}
        non = {t for t, m in zip(cands[ci], member[ci]) if not m}
        assert mem == set(texts) and len(non) == 10 and not non & set(held)
    again = TextData(_cfg()).clients(0, cfg.model.num_classes)
    assert [t for t, _ in again] == [t for t, _ in clients]  # deterministic by seed
    other = TextData(_cfg(["seed=1"])).clients(0, cfg.model.num_classes)
    assert [t for t, _ in other] != [t for t, _ in clients]


@pytest.mark.parametrize("extra,fix", [
    (["data.samples_per_client=8"], "data.samples_per_client >= 16"),  # fewer than one batch
    (["data.samples_per_client=0"], ""),
    (["data.samples_per_client=1000"], "at most 2441"),  # 3 × 1,000 quotes do not fit fortunes-topics
    (["attack={name: lamp}"], "membership attacks"),
])
def test_bad_samples_per_client_is_refused_naming_the_field(extra, fix):
    from gradleak.data.splits import TextData

    with pytest.raises(BadInput) as err:
        TextData(_cfg(extra))
    assert err.value.field == "data.samples_per_client" and fix in str(err.value)


def test_samples_per_client_is_a_text_field():
    from gradleak.run import validate

    with pytest.raises(BadInput) as err:
        validate({"experiment": "image", "data": {"samples_per_client": 32}, "attack": {"name": "peftleak"}})
    assert err.value.field == "data.samples_per_client"
