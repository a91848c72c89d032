"""Secure aggregation exposes only the sum, everywhere the ServerView carries updates.

Pinned from both sides: with individual updates granted the view holds every client's upload (round by round); under
secure aggregation ``view.updates`` *and every round of* ``view.rounds`` hold exactly one update, the secure sum, and
nothing equal to any client's upload. Checked on :func:`gradleak.fl.threat.build_view` directly, on the round protocol
(:func:`gradleak.fl.engines.builtin.run_rounds`: the sums are the weighted means of the uploads) and through the real pipeline
(what an attack's ``reconstruct`` receives).
"""

from __future__ import annotations

import pytest
import torch

from gradleak.fl.core import Client, ServerView, Update, aggregate, secure_aggregate
from gradleak.fl.engines.builtin import run_rounds
from gradleak.fl.threat import ThreatConfig, ThreatModel, build_view

pytestmark = pytest.mark.timeout(300)


def _upd(seed: int, n: int = 3, client: int = 0) -> Update:
    g = torch.Generator().manual_seed(seed)
    return Update({"w": torch.randn(4, 3, generator=g, dtype=torch.float64),
                   "b": torch.randn(5, generator=g, dtype=torch.float64)}, n, client)


def _rounds(n_rounds: int = 3, n_clients: int = 3) -> list[list[Update]]:
    return [[_upd(100 * r + c, n=c + 1, client=c) for c in range(n_clients)] for r in range(n_rounds)]


def _same(a: Update, b: Update) -> bool:
    return a.tensors.keys() == b.tensors.keys() and all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)


def _view(threat: ThreatModel, rounds, sums=None, states=None, knowledge=None, always=None) -> ServerView:
    states = states if states is not None else [{"w": torch.full((1,), float(r))} for r in range(len(rounds))]
    return build_view(model=torch.nn.Linear(1, 1), rounds=rounds, round_states=states, threat=threat,
                      secure_sum=sums, knowledge=knowledge or {}, always_public=always or {})


# ------------------------------------------------------------------------------------------- build_view
def test_individual_updates_granted_every_upload_of_every_round_is_seen():
    rounds = _rounds()
    v = _view(ThreatModel(), rounds, sums=[aggregate(r) for r in rounds])
    assert not v.secure_aggregation
    assert len(v.rounds) == 3 and [len(r) for r in v.rounds] == [3, 3, 3]
    for seen, sent in zip(v.rounds, rounds):
        assert all(_same(a, b) and a.num_samples == b.num_samples for a, b in zip(seen, sent))
    assert len(v.updates) == 3 and all(_same(a, b) for a, b in zip(v.updates, rounds[-1]))
    assert [s["w"].item() for s in v.round_states] == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("knows_batch_size", [True, False])
def test_secure_aggregation_every_round_holds_only_the_sum(knows_batch_size):
    """The mutation 'keep each client's upload in view.rounds under secure aggregation' fails here."""
    rounds = _rounds()
    sums = [secure_aggregate(r, seed=i) for i, r in enumerate(rounds)]
    threat = ThreatModel(individual_updates=False, knows_batch_size=knows_batch_size)
    v = _view(threat, rounds, sums=sums)
    assert v.secure_aggregation
    assert len(v.updates) == 1 and _same(v.updates[0], sums[-1])
    assert len(v.rounds) == len(rounds)
    for r, (seen, s) in enumerate(zip(v.rounds, sums)):
        assert len(seen) == 1, f"round {r}: {len(seen)} updates under secure aggregation"
        assert _same(seen[0], s)
        assert seen[0].client_id == -1
        assert seen[0].num_samples == (s.num_samples if knows_batch_size else 0)
    individual = [u for r in rounds for u in r]
    for seen in [*v.updates, *(u for r in v.rounds for u in r)]:
        for u in individual:  # no client's upload anywhere in the view
            assert not any(torch.allclose(seen.tensors[k], u.tensors[k]) for k in u.tensors)
    # the sums are the sample-weighted means of the uploads (to the fixed point's precision)
    for s, r in zip(sums, rounds):
        plain = aggregate(r)
        assert all(torch.allclose(s.tensors[k], plain.tensors[k], rtol=0, atol=1e-9) for k in plain.tensors)
        assert s.num_samples == sum(u.num_samples for u in r) == 6


def test_secure_aggregation_round_states_are_the_server_sent_states_only():
    rounds = _rounds()
    states = [{"w": torch.full((2,), float(r))} for r in range(3)]
    v = _view(ThreatModel(individual_updates=False), rounds, sums=[aggregate(r) for r in rounds], states=states)
    assert len(v.round_states) == 3
    for seen, sent in zip(v.round_states, states):
        assert seen.keys() == sent.keys() and torch.equal(seen["w"], sent["w"])


def test_secure_aggregation_without_sums_is_an_error_not_a_leak():
    with pytest.raises(ValueError, match="secure aggregation"):
        _view(ThreatModel(individual_updates=False), _rounds(), sums=None)


@pytest.mark.parametrize("individual", [True, False])
def test_rounds_observed_keeps_the_first_rounds_and_their_states(individual):
    rounds = _rounds(4)
    sums = [aggregate(r) for r in rounds]
    v = _view(ThreatModel(individual_updates=individual, rounds_observed=2), rounds, sums=sums)
    assert len(v.rounds) == 2 and len(v.round_states) == 2
    assert [s["w"].item() for s in v.round_states] == [0.0, 1.0]
    expect = rounds[1] if individual else [sums[1]]
    assert len(v.updates) == len(expect) and all(_same(a, b) for a, b in zip(v.updates, expect))
    assert all(len(r) == (3 if individual else 1) for r in v.rounds)


def test_one_client_under_secure_aggregation_is_declared_as_exposed():
    """The sum of one update is that update: the resolved threat says so instead of pretending to hide it."""
    tm = ThreatConfig().resolve(secure_aggregation=True, clients=2)
    assert tm.individual_updates is False
    with pytest.raises(Exception, match="individual_updates"):
        ThreatConfig(individual_updates=True).resolve(secure_aggregation=True, clients=2)


# ------------------------------------------------------------------------------------------- the round protocol
def _clients(k: int = 3, n: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [Client(i, torch.randn(n + i, 6, generator=g), torch.randint(0, 3, (n + i,), generator=g)) for i in range(k)]


def test_run_rounds_secure_sums_are_the_weighted_means_of_each_round():
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3).double()
    clients = _clients()
    for c in clients:
        c._inputs = c._inputs.double()
    out = run_rounds(model, clients, rounds=3, algorithm="fedsgd", lr=0.1, secure_aggregation=True)
    assert len(out.rounds) == len(out.secure_sums) == len(out.round_states) == 3
    for r, (ups, s) in enumerate(zip(out.rounds, out.secure_sums)):
        assert len(ups) == 3 and s.client_id == -1 and s.num_samples == 4 + 5 + 6
        plain = aggregate(ups)
        for k in plain.tensors:
            assert torch.allclose(s.tensors[k], plain.tensors[k], rtol=0, atol=1e-9)
            assert not any(torch.allclose(s.tensors[k], u.tensors[k]) for u in ups)
    tm = ThreatModel(individual_updates=False)
    v = build_view(model=out.model, rounds=out.rounds, round_states=out.round_states, threat=tm,
                   secure_sum=out.secure_sums, knowledge={}, always_public={})
    assert [len(r) for r in v.rounds] == [1, 1, 1] and all(r[0] is s for r, s in zip(v.rounds, out.secure_sums))
    plain_run = run_rounds(torch.nn.Linear(6, 3), _clients(), rounds=1, algorithm="fedsgd", lr=0.1,
                           secure_aggregation=False)
    assert plain_run.secure_sums is None


def test_run_rounds_keeps_only_the_rounds_the_attacker_observes():
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    out = run_rounds(model, _clients(2), rounds=4, algorithm="fedsgd", lr=0.1, secure_aggregation=True,
                     keep_round=lambda r: r in (1, 3))
    assert out.kept_rounds == [1, 3] and len(out.rounds) == len(out.secure_sums) == len(out.round_states) == 2


# ------------------------------------------------------------------------------------------- through the pipeline
TINY = {"experiment": "image", "seed": 0, "data": {"name": "cifar-samples", "batch_size": 2, "image_size": 16},
        "model": {"name": "vit-tiny", "layers": 1}, "peft": {"kind": "adapters", "bottleneck": 8},
        "metrics": {"feature_distance": False, "null": False},
        "attack": {"name": "inverting_gradients", "steps": 1, "labels": "idlg"},
        "threat": {"preset": "honest-but-curious"},
        "fl": {"clients": 2, "secure_aggregation": True, "rounds": 2, "algorithm": "fedavg", "lr": 0.5}}


def _spy(monkeypatch, cls, what):
    seen = []
    real = getattr(cls, what)

    def spy(self, *a, **k):
        seen.append(a[0])
        return real(self, *a, **k)

    monkeypatch.setattr(cls, what, spy)
    return seen


def _keep_outcomes(monkeypatch):
    from gradleak.fl.engines import builtin as protocol

    outcomes = []
    real = protocol.run_rounds

    def keep(*a, **k):
        outcomes.append(real(*a, **k))
        return outcomes[-1]

    monkeypatch.setattr(protocol, "run_rounds", keep)
    return outcomes


def test_pipeline_attack_receives_only_the_sum_in_updates_and_every_round(tmp_path, monkeypatch, one_thread):
    from gradleak.attacks.optimization.inverting_gradients import InvertingGradients
    from gradleak.run import run_config

    outcomes = _keep_outcomes(monkeypatch)
    seen = _spy(monkeypatch, InvertingGradients, "reconstruct")
    run_config(TINY, tmp_path)
    (view,), (out,) = seen, outcomes
    assert view.secure_aggregation and len(out.rounds) == 2 and all(len(r) == 2 for r in out.rounds)
    assert len(view.updates) == 1 and len(view.rounds) == 2 and all(len(r) == 1 for r in view.rounds)
    for (seen_sum,), ups in zip(view.rounds, out.rounds):
        a, b = ups
        for k, v in seen_sum.tensors.items():
            mean = 0.5 * (a.tensors[k].double() + b.tensors[k].double())
            assert torch.allclose(v.double(), mean, atol=1e-9 * (1 + float(mean.abs().max())))
        flat = seen_sum.flat().double()  # (some adapter tensors are zero for every client: compare whole uploads)
        assert not torch.allclose(flat, a.flat().double()) and not torch.allclose(flat, b.flat().double())
    assert _same(view.updates[0], view.rounds[-1][0])
    # the batch size the server may know is the sum's: both clients' samples
    assert view.public["batch_size"] == 4 and view.updates[0].num_samples == 4


def test_pipeline_without_secure_aggregation_attack_receives_each_upload(tmp_path, monkeypatch, one_thread):
    """The other side: with individual updates granted the same run hands the attack both clients' uploads."""
    from gradleak.attacks.optimization.inverting_gradients import InvertingGradients
    from gradleak.run import run_config

    outcomes = _keep_outcomes(monkeypatch)
    seen = _spy(monkeypatch, InvertingGradients, "reconstruct")
    run_config({**TINY, "fl": {**TINY["fl"], "secure_aggregation": False}}, tmp_path)
    (view,), (out,) = seen, outcomes
    assert not view.secure_aggregation and len(view.updates) == 2
    assert [len(r) for r in view.rounds] == [2, 2]
    for seen_r, sent_r in zip(view.rounds, out.rounds):
        assert all(_same(a, b) for a, b in zip(seen_r, sent_r))
    assert view.public["batch_size"] == 2
