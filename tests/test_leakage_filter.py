"""The RDLV-threshold filter defense (``defense: {name: rdlv_filter}``): each client inverts its own update
with the BN-aware attack and withholds it when the RDLV lower 95 % bound exceeds the threshold."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from gradleak.errors import BadInput
from gradleak.fl.core import Client
from gradleak.fl.engines.builtin import run_rounds

ROOT = Path(__file__).resolve().parents[1]
LEAKAGE = ROOT / "configs" / "leakage" / "fmnist_resnet18.yaml"
SIZE, LR, CLASSES = 36, 0.01, 4
AUDIT = {"warmup": 1, "energy": 0.1}  # bn_inversion settings of the audit (2 iterations below)


@pytest.fixture(scope="module")
def setup():
    """A random-init ResNet-18 at 36 px, two Fashion-MNIST clients (2 and 1 images) and the dataset-mean prior."""
    from gradleak.data.splits import load_images
    from gradleak.models.resnet import resnet18

    torch.set_num_threads(1)
    imgs, labels = load_images("fashion-mnist", 11, SIZE, 0, "data.name", channels=1)
    model = resnet18(num_classes=CLASSES, num_channels=1, image_size=SIZE, seed=0)
    batches = [(imgs[:2], labels[:2] % CLASSES), (imgs[2:3], labels[2:3] % CLASSES)]
    prior = imgs[3:].mean(0)
    return model, batches, prior


def _clients(batches):
    return [Client(i, x * 2 - 1, y) for i, (x, y) in enumerate(batches)]


def _filter(prior, **params):
    from gradleak.defenses.filter import RDLVFilter, RDLVFilterParams

    params = {"iterations": 2, "attack": dict(AUDIT), "bootstrap": 200, **params}
    f = RDLVFilter(RDLVFilterParams(**params))
    f.num_classes = CLASSES
    f.data = SimpleNamespace(prior_image=lambda: prior)  # what the pipeline's ImageData gives (dataset mean image)
    return f


def _run(model, batches, f=None, rounds=1, algorithm="fedavg"):
    import copy

    return run_rounds(copy.deepcopy(model), _clients(batches), rounds=rounds, algorithm=algorithm, lr=LR,
                      local_batch_size=2, seed=5, local_update=None if f is None else f.local_update)


def _same(a, b) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------ (a) withholding
def test_a_leaking_update_is_withheld_and_left_out_of_the_aggregate(setup, one_thread):
    model, batches, prior = setup
    plain = _run(model, batches, rounds=2)
    f = _filter(prior, threshold=-1e9, clients=[0], rounds=[0])  # every audited update "leaks"
    out = _run(model, batches, f, rounds=2)
    assert out.withheld == [(0, 0)]  # the server side records it: round 0, client 0 sent nothing
    assert [u.client_id for u in out.rounds[0]] == [1] and [u.client_id for u in out.rounds[1]] == [0, 1]
    # the aggregate of round 0 is client 1's upload alone (identical to client 1's upload without the filter)
    assert _same(out.rounds[0][0].tensors, plain.rounds[0][1].tensors)
    assert _same(out.rounds[0][0].buffers, plain.rounds[0][1].buffers)
    assert not _same(out.round_states[1], plain.round_states[1])  # round 1's checkpoint excludes client 0
    rep = f.report(out.rounds)
    assert rep["filter_withheld"] == 1.0 and rep["filter_audited"] == 1.0
    assert rep["filter_withheld_client0"] == 1.0 and rep["filter_withheld_client1"] == 0.0
    assert math.isfinite(rep["filter_rdlv_low_client0"]) and "filter_rdlv_low_client1" not in rep
    assert set(f.records) == set()  # reset per trial
    assert f.report([])["filter_audited"] == 0.0


def test_a_nothing_is_withheld_above_every_rdlv_and_the_uploads_equal_the_plain_clients(setup, one_thread):
    model, batches, prior = setup
    plain = _run(model, batches, rounds=2)
    f = _filter(prior, threshold=1e9)
    out = _run(model, batches, f, rounds=2)
    assert out.withheld == [] and len(f.records) == 4 and not any(v["withheld"] for v in f.records.values())
    for r in range(2):
        assert _same(out.round_states[r], plain.round_states[r])
        for u, p in zip(out.rounds[r], plain.rounds[r], strict=True):
            assert _same(u.tensors, p.tensors) and _same(u.buffers, p.buffers) and u.num_samples == p.num_samples
    rep = f.report(out.rounds)
    assert rep["filter_withheld"] == 0.0 and rep["filter_audited"] == 4.0


def test_a_fedsgd_updates_are_audited_too(setup, one_thread):
    model, batches, prior = setup
    f = _filter(prior, threshold=-1e9, clients=[1])
    out = _run(model, batches, f, algorithm="fedsgd")
    assert out.withheld == [(0, 1)] and [u.client_id for u in out.rounds[0]] == [0]
    assert math.isfinite(f.records[(0, 1)]["rdlv_low"])


# ------------------------------------------------------------------------------------------ (b) the decision
def test_b_the_decision_uses_the_rdlv_bound_of_the_returned_reconstruction_which_is_the_servers(setup, one_thread):
    from gradleak.attacks.bn_inversion import BNInversion
    from gradleak.fl.core import ServerView
    from gradleak.metrics.leakage import rdlv

    model, batches, prior = setup
    f = _filter(prior, threshold=0.0, rounds=[0], seed=3)
    out = _run(model, batches, f)
    for c, cl in enumerate(_clients(batches)):
        rec = f.records[(0, c)]
        own = (cl._inputs.double() + 1) / 2  # the client's own images, from its 2x − 1 inputs
        res = rdlv(rec["reconstruction"], own, prior, ssim="gaussian", match="best", resamples=200, seed=3)
        assert rec["rdlv_low"] == res.low and rec["rdlv"] == res.mean  # identity: metrics/leakage.py's numbers
        ref = rdlv(rec["reconstruction"], batches[c][0], prior, resamples=200, seed=3)  # the evaluation's originals
        assert rec["rdlv_low"] == pytest.approx(ref.low, abs=1e-6)
        assert rec["withheld"] == (res.low > 0.0)
        assert ((0, c) in out.withheld) == rec["withheld"]
    # the audit is the honest-but-curious server's attack: same reconstruction from the same upload and checkpoint
    sent = _run(model, batches)
    view = ServerView(model=sent.model, updates=sent.rounds[0], rounds=sent.rounds, round_states=sent.round_states,
                      public={"num_classes": CLASSES, "image_shape": (1, SIZE, SIZE), "prior_image": prior})
    attack = BNInversion(f.attack_cfg.model_copy(update={"rounds": [0]}),
                         fl={"lr_at": [LR], "algorithm": "fedavg", "local_batch_size": 2, "local_epochs": 1, "clients": 2})
    server = {d["client"]: d["images"] for d in attack.reconstruct(view).data["per_client"]}
    for c in range(2):
        assert torch.equal(server[c], f.records[(0, c)]["reconstruction"])


# ------------------------------------------------------------------------------------------ (c) bad input
def test_c_bad_inputs_name_the_field(setup, one_thread):
    from gradleak.defenses.filter import RDLVFilter, RDLVFilterParams
    from gradleak.run import validate
    from gradleak.config.loading import load_yaml

    model, batches, prior = setup
    from pydantic import ValidationError

    for bad in (float("nan"), float("inf"), -float("inf")):  # refused by the parameters' model itself
        with pytest.raises(ValidationError, match="finite"):
            RDLVFilter(RDLVFilterParams(threshold=bad))
    raw = load_yaml(LEAKAGE)
    raw["defense"] = {"name": "rdlv_filter"}
    with pytest.raises(BadInput, match="finite") as e:
        validate(raw, ["defense.threshold=.inf"])
    assert e.value.field == "defense.threshold"
    with pytest.raises(BadInput) as e:
        validate(raw, ["defense.attack={bogus: 1}"])
    assert e.value.field == "defense.attack.bogus"
    with pytest.raises(BadInput) as e:
        validate(raw, ["defense.attack={ablation: stale_checkpoint}"])
    assert e.value.field == "defense.attack.ablation"
    with pytest.raises(BadInput, match="only one") as e:
        validate(raw, ["defense.iterations=5", "defense.attack={iterations: 7}"])
    assert e.value.field == "defense.iterations"
    _, cfg = validate(raw, ["defense.threshold=0.5", "attack.iterations=7"])
    d = cfg.training_defense
    assert d.cfg.threshold == 0.5 and d.attack_cfg.iterations == 100  # `iterations` (default 100) sets the audit's
    handle = SimpleNamespace(model=model)
    d.apply(handle, cfg, data=SimpleNamespace(wants_prior=True))
    assert d.attack_cfg.matching == cfg.attack_cfg.matching and d.attack_cfg.warmup == cfg.attack_cfg.warmup == 10
    with pytest.raises(BadInput, match="does not exist") as e:
        _, c2 = validate(raw, ["defense.rounds=[5]"])
        c2.training_defense.apply(handle, c2, data=SimpleNamespace(wants_prior=True))
    assert e.value.field == "defense.rounds"
    # a model without BatchNorm: the audit reads BN statistics
    lin = nn.Sequential(nn.Flatten(), nn.Linear(SIZE * SIZE, CLASSES))
    with pytest.raises(BadInput, match="no BatchNorm") as e:
        d.apply(SimpleNamespace(model=lin), cfg, data=SimpleNamespace(wants_prior=True))
    assert e.value.field == "model.name"
    f = _filter(prior)
    with pytest.raises(BadInput, match="no BatchNorm") as e:
        f.local_update(_clients(batches)[0], lin, seed=0, algorithm="fedavg", lr=LR, round_index=0)
    assert e.value.field == "model.name"
    with pytest.raises(BadInput) as e:
        f.local_update(_clients(batches)[0], model, seed=0, algorithm="fedprox", lr=LR, round_index=0)
    assert e.value.field == "fl.algorithm"
    with pytest.raises(BadInput) as e:  # the dataset-mean prior needs the pipeline's prior images
        d.apply(handle, cfg, data=SimpleNamespace(wants_prior=False))
    assert e.value.field == "defense.attack.prior"


# ------------------------------------------------------------------------------------------ (d) end to end
#: the shipped config, shrunk (as tests/test_leakage_pipeline.py): 2 clients (2 images at B = 2, 1 image), 36 px
TINY = ["data.image_size=36", "data.validation_size=0", "fl.rounds=2", "fl.clients=2", "fl.client_images=[2,1]",
        "fl.client_batch_sizes=[2,1]", "fl.client_epochs=[1,1]", "attack.iterations=2", "attack.warmup=1",
        "metrics.iip=false", "data.prior_size=8"]


def test_d_leakage_pipeline_with_the_filter_copes_with_a_withheld_client(tmp_path, one_thread):
    from gradleak.run import run_config
    from gradleak.config.loading import apply_overrides, load_yaml

    # random init (no cached pretraining needed); the server attacks both clients, so it notes client 0's silence
    raw = apply_overrides(load_yaml(LEAKAGE), TINY + ["attack.clients=[0,1]", "model.pretrain=null"])
    raw["defense"] = {"name": "rdlv_filter", "threshold": -1e9, "iterations": 2, "clients": [0], "rounds": [-1]}
    res = run_config(raw, tmp_path)
    m = res["metrics"]
    assert m["filter_withheld"] == 1.0 and m["filter_audited"] == 1.0  # client 0, last round
    assert m["filter_withheld_client0"] == 1.0 and m["filter_withheld_client1"] == 0.0
    assert m["withheld_client0"] == 1.0 and m["rdlv_client0"] == 0.0  # nothing sent: the prior is the best guess
    assert m["withheld_client1"] == 0.0 and math.isfinite(m["rdlv_client1"])
