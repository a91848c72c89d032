"""What an attack receives under each withheld grant (labels, lengths, batch size, public data, individual
updates), from both sides: withheld -> absent from the view (and from the attack's construction context), granted ->
present and equal to the fact. On :func:`gradleak.fl.threat.build_view` flag by flag, then through the pipeline (the
``AttackContext`` an attack is built from and the ``ServerView`` its ``reconstruct`` gets).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from gradleak.fl.core import Update, aggregate
from gradleak.fl.threat import FLAG_MEANING, ThreatModel, build_view, check_requirements

pytestmark = pytest.mark.timeout(300)

ALWAYS = {"image_shape": (3, 16, 16), "num_classes": 10, "update_defenses": [], "clients": 2}
PRIOR = torch.full((3, 16, 16), 0.5)
KNOWLEDGE = {
    "knows_labels": {"labels": [3, 1]},
    "knows_batch_size": {"batch_size": 2},
    "knows_lengths": {"lengths": [7, 5]},
    "public_data": {"candidates": {0: ["a", "b"]}, "prior_image": PRIOR, "public_images": torch.zeros(4, 3, 16, 16)},
}
#: the keys each flag grants (nothing else may carry them)
GRANTS = {"knows_labels": {"labels"}, "knows_batch_size": {"batch_size"}, "knows_lengths": {"lengths"},
          "public_data": {"candidates", "prior_image", "public_images"}}
NOTHING = ThreatModel(knows_labels=False, knows_batch_size=False, knows_lengths=False, public_data=False)


def _rounds():
    g = torch.Generator().manual_seed(0)
    return [[Update({"w": torch.randn(3, generator=g, dtype=torch.float64)}, 2 + c, c) for c in range(2)]]


def _view(threat: ThreatModel):
    rounds = _rounds()
    return build_view(model=torch.nn.Linear(1, 1), rounds=rounds, round_states=[{}], threat=threat,
                      secure_sum=[aggregate(r) for r in rounds], knowledge=KNOWLEDGE, always_public=ALWAYS)


def test_nothing_granted_the_view_holds_only_what_the_protocol_publishes():
    v = _view(NOTHING)
    assert set(v.public) == set(ALWAYS)
    assert all(u.num_samples == 0 for r in v.rounds for u in r)  # the sample count would be the batch size


@pytest.mark.parametrize("flag", sorted(GRANTS))
def test_each_flag_grants_exactly_its_facts(flag):
    off, on = _view(NOTHING), _view(replace(NOTHING, **{flag: True}))
    assert not GRANTS[flag] & set(off.public)
    assert set(on.public) == set(ALWAYS) | GRANTS[flag]
    for k in GRANTS[flag]:
        want = KNOWLEDGE[flag][k]
        got = on.public[k]
        assert torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want
    for k, v in ALWAYS.items():
        assert on.public[k] == v and off.public[k] == v


def test_batch_size_withheld_also_strips_every_sample_count_and_granted_keeps_them():
    for individual in (True, False):
        off = _view(replace(NOTHING, individual_updates=individual))
        on = _view(replace(NOTHING, individual_updates=individual, knows_batch_size=True))
        assert all(u.num_samples == 0 for r in off.rounds for u in r) and all(u.num_samples == 0 for u in off.updates)
        want = [2, 3] if individual else [5]
        assert [u.num_samples for u in on.updates] == want and [u.num_samples for u in on.rounds[0]] == want
        for a, b in zip(off.updates, on.updates):  # only the count goes: the tensors are the same
            assert torch.equal(a.tensors["w"], b.tensors["w"]) and a.client_id == b.client_id


def test_individual_updates_withheld_gives_one_sum_granted_gives_each_upload():
    off, on = _view(replace(NOTHING, individual_updates=False)), _view(replace(NOTHING, individual_updates=True))
    assert off.secure_aggregation and len(off.updates) == 1 and off.updates[0].client_id == -1
    assert not on.secure_aggregation and [u.client_id for u in on.updates] == [0, 1]


def test_a_fact_under_an_unknown_or_withheld_flag_never_reaches_the_view():
    v = build_view(model=torch.nn.Linear(1, 1), rounds=_rounds(), round_states=[{}], threat=NOTHING, secure_sum=None,
                   knowledge={"knows_labels": {"labels": [1]}, "public_data": {"secret": 1}}, always_public={})
    assert v.public == {}


@pytest.mark.parametrize("flag", sorted(FLAG_MEANING))
def test_the_gate_refuses_an_attack_that_requires_a_withheld_flag(flag):
    from gradleak.errors import BadInput

    withheld = replace(ThreatModel(), **{flag: False})
    with pytest.raises(BadInput) as e:
        check_requirements("x", {flag: True}, withheld)
    assert e.value.field == f"threat.{flag}"
    check_requirements("x", {flag: True}, replace(ThreatModel(), **{flag: True}))  # granted: no error
    check_requirements("x", {flag: False}, withheld)  # not required: no error


# ------------------------------------------------------------------------------------------- through the pipeline
TINY = {"experiment": "image", "seed": 0,
        "data": {"name": "cifar-samples", "batch_size": 2, "image_size": 16, "public_size": 6},
        "model": {"name": "vit-tiny", "layers": 1}, "peft": {"kind": "adapters", "bottleneck": 8},
        "metrics": {"feature_distance": False, "null": False}, "attack": {"name": "ig", "steps": 1}}


def _spy(monkeypatch, cls):
    ctxs, views = [], []
    real_from, real_rec = cls.from_config, cls.reconstruct

    def from_config(klass, cfg, ctx):
        ctxs.append(ctx)
        return real_from(cfg, ctx)

    def reconstruct(self, view):
        views.append(view)
        return real_rec(self, view)

    monkeypatch.setattr(cls, "from_config", classmethod(from_config))
    monkeypatch.setattr(cls, "reconstruct", reconstruct)
    return ctxs, views


def _spy_clients(monkeypatch):
    from gradleak.fl.engines import builtin as protocol

    seen = []
    real = protocol.run_rounds

    def keep(model, clients, **k):
        seen.append(list(clients))
        return real(model, clients, **k)

    monkeypatch.setattr(protocol, "run_rounds", keep)
    return seen


@pytest.mark.parametrize("public_data,knows_labels", [(False, False), (True, False), (False, True), (True, True)])
def test_pipeline_attack_gets_public_data_and_labels_only_when_granted(tmp_path, monkeypatch, one_thread,
                                                                       public_data, knows_labels):
    from gradleak.attacks.optimization.inverting_gradients import IG
    from gradleak.run import run_config

    ctxs, views = _spy(monkeypatch, IG)
    clients = _spy_clients(monkeypatch)
    raw = {**TINY, "threat": {"preset": "honest-but-curious", "public_data": public_data, "knows_labels": knows_labels}}
    res = run_config(raw, tmp_path)
    (ctx,), (view,) = ctxs, views
    public_keys = {"public_images", "candidates", "prior_image"}
    if public_data:
        imgs = ctx.public["public_images"]
        assert imgs.shape == (6, 3, 16, 16) and float(imgs.min()) >= 0 and float(imgs.max()) <= 1
    else:  # withheld: no public images/candidates/prior anywhere the attack can read
        assert not public_keys & set(ctx.public) and not public_keys & set(view.public)
    assert not {"candidates", "prior_image"} & set(view.public)  # IG reads no prior, it is not a membership attack
    assert ("labels" in view.public) == knows_labels
    if knows_labels:  # the attacked client's true labels
        assert view.public["labels"] == clients[0][0]._labels.tolist()
    assert view.public["batch_size"] == ctx.public["batch_size"] == 2
    assert res["config"]["threat_resolved"]["public_data"] == public_data


def test_pipeline_public_data_withheld_for_an_attack_that_needs_it_is_refused(tmp_path):
    """PEFTLeak needs public images: without the grant the gate refuses it before any round (exit 2 names the flag)."""
    from gradleak.errors import BadInput
    from gradleak.run import run_config

    raw = {**TINY, "attack": {"name": "peftleak"}, "threat": {"preset": "malicious", "public_data": False}}
    with pytest.raises(BadInput) as e:
        run_config(raw, tmp_path)
    assert e.value.field == "threat.public_data"
