"""Guarantees pinned against deliberate breakages that the rest of the suite let through (docs/MUTATION.md,
"Deliberate breakages of the splits, the victim rotation, the advice and the audit").

Each test states a property of the current code, not a recorded result:

* the data splits (docs/DESIGN.md §2, docs/ARCHITECTURE.md ``data/``): the nulls' pool (chance reconstructions;
  docs/DESIGN.md §6, every headline metric has a null) holds no image or sentence any client holds, and the server's
  domain prior (the "dataset mean image" of Hatamizadeh et al. 2022, §II-B) is the mean of held-out images only;
* the one runner (docs/DESIGN.md §1) under ``metrics.attack_clients: all``: each client is attacked on its own upload;
* the round engine (docs/DESIGN.md §1): a training-time defense's local step still goes through every update defense;
* the advice (``gradleak audit --advise``, the module docstring of ``gradleak.run.advise``): cheapest first, and only
  a measured ``none`` (or the gate's refusal for a hidden update) stops an attack;
* the audit (docs/DESIGN.md §6, the module docstring of ``gradleak.run.audit``): a crashed attack is ``undefined``,
  never ``none``; the report's banner is red for a leak and green only for ``no_leak_found``;
* the threat gate (docs/DESIGN.md §1, ``gradleak.fl.threat``): secure aggregation over one client exposes that
  client's update, over two or more it hides every update, and the client count is the config's ``fl.clients``.
"""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch

from gradleak.errors import BadInput

pytestmark = pytest.mark.timeout(300)


def _validate(raw: dict, overrides=()):
    from gradleak.run import validate

    return validate(copy.deepcopy(raw), list(overrides))[1]


def _rows(x: torch.Tensor) -> list[torch.Tensor]:
    return [t.reshape(-1).double() for t in x]


def _holds(pool: torch.Tensor, imgs: torch.Tensor) -> list[int]:
    """Indices of ``imgs`` that appear (pixel for pixel) among ``pool``'s images."""
    p = torch.stack(_rows(pool)) if len(pool) else torch.zeros(0, 1)
    return [i for i, x in enumerate(_rows(imgs)) if len(pool) and bool((p == x).all(1).any())]


# ------------------------------------------------------------------------------------------- data splits: images
#: a leakage setup (the BN-aware inversion reads the domain prior) with every image chunk in use, in the order
#: clients | validation | prior | test | nulls (self-contained: mutmut runs the tests in a copy without configs/)
LEAKAGE = {"experiment": "leakage", "seed": 0,
           "data": {"name": "cifar-samples", "image_size": 16, "validation_size": 2, "prior_size": 3, "test_size": 3},
           "model": {"name": "resnet18", "num_channels": 3, "num_classes": 10, "train_all": True},
           "peft": {"kind": "none"}, "metrics": {"feature_distance": False},
           "fl": {"algorithm": "fedavg", "rounds": 1, "lr": 0.01, "clients": 3, "client_images": [2, 2, 2],
                  "client_batch_sizes": [2, 2, 2], "client_epochs": [1, 1, 1]},
           "threat": {"preset": "honest-but-curious", "public_data": True}, "attack": {"name": "bn_inversion"}}
#: two clients of 2 images and nothing else before the nulls' pool (no validation, prior or test chunk)
TINY_IMAGES = {"experiment": "image", "seed": 0, "data": {"name": "cifar-samples", "batch_size": 2, "image_size": 16},
               "model": {"name": "vit-tiny", "layers": 1}, "peft": {"kind": "adapters", "bottleneck": 8},
               "metrics": {"feature_distance": False}, "threat": {"preset": "honest-but-curious"},
               "attack": {"name": "inverting_gradients", "steps": 1, "labels": "idlg"}, "fl": {"clients": 2}}


def _leakage_cfg(name: str):
    return _validate({**LEAKAGE, "data": {**LEAKAGE["data"], "name": name}})


def _image_cases():
    return [pytest.param(lambda: _leakage_cfg("cifar-samples"), id="leakage-cifar"),
            pytest.param(lambda: _leakage_cfg("natural-crops"), id="leakage-crops"),
            pytest.param(lambda: _validate(TINY_IMAGES), id="two-clients-only")]


@pytest.mark.parametrize("make", _image_cases())
@pytest.mark.parametrize("trial", [0, 1])
def test_image_null_pool_holds_no_image_of_any_chunk(make, trial):
    """The nulls' pool comes from the private set's own source but holds none of the clients' (nor the validation,
    prior or test) images: a chance reconstruction that *is* a private image would make the null leak."""
    from gradleak.data.splits import ImageData

    cfg = make()
    data = ImageData(cfg)
    clients = data.clients(trial, cfg.model.num_classes)
    chunks = {f"client {i}": x for i, (x, _) in enumerate(clients)}
    for i, v in enumerate(data.validation()):
        if len(v):
            chunks[f"validation {i}"] = v
    if data.test(cfg.model.num_classes) is not None:
        chunks["test"] = data.test(cfg.model.num_classes)[0]
    k = 8
    pool, source = data.null_pool(trial, k)
    assert cfg.data.name in source and "no client holds" in source  # the private set's own source, not the fallback
    assert len(pool) == k
    for what, imgs in chunks.items():
        assert len(imgs) and _holds(pool, imgs) == [], f"the null pool holds {what}'s images"
    # the same seeded draw as every chunk: the whole of it (clients, validation, prior, test) stays out of the pool
    sizes, val, prior = data._layout()
    used = sum(sizes) + val * len(sizes) + prior + data._test_size()
    drawn = data._load(trial, used)[0]
    assert _holds(drawn, clients[0][0]) == list(range(len(clients[0][0])))  # the draw is the clients' draw
    assert _holds(drawn, pool) == [], "the null pool overlaps the draw the chunks are cut from"


@pytest.mark.parametrize("name", ["cifar-samples", "natural-crops"])
@pytest.mark.parametrize("trial", [0, 1])
def test_the_domain_prior_is_the_mean_of_held_out_images_only(name, trial):
    """The server's prior (granted under public_data) is the mean of ``data.prior_size`` images of the draw that no
    client, validation or test chunk holds: exactly what remains of the draw once those chunks are removed."""
    from gradleak.data.splits import ImageData

    cfg = _leakage_cfg(name)
    data = ImageData(cfg)
    assert data.wants_prior
    clients = data.clients(trial, cfg.model.num_classes)
    taken = [x for x, _ in clients] + list(data.validation()) + [data.test(cfg.model.num_classes)[0]]
    sizes, val, prior = data._layout()
    drawn = data._load(trial, sum(sizes) + val * len(sizes) + prior + data._test_size())[0]
    held = torch.cat(taken)
    rest = [x for x in drawn if not _holds(held, x[None])]
    assert len(rest) == cfg.data.prior_size
    expected = torch.stack(rest).mean(0)
    got = data.prior_image()
    assert got is not None and got.shape == expected.shape
    assert torch.allclose(got.double(), expected.double(), atol=1e-6)
    for i, (x, _) in enumerate(clients):  # and it is not a mean that takes any client image in
        assert not torch.allclose(got.double(), torch.cat([torch.stack(rest[1:]), x[:1]]).mean(0).double(),
                                  atol=1e-6), i


def test_no_prior_without_an_attack_that_reads_one():
    """An attack without a domain prior gets no prior chunk: ``prior_image`` is None (not a mean over nothing)."""
    from gradleak.data.splits import ImageData

    cfg = _validate(TINY_IMAGES)
    data = ImageData(cfg)
    assert not data.wants_prior
    data.clients(0, cfg.model.num_classes)
    assert data.prior_image() is None


# ------------------------------------------------------------------------------------------- data splits: text
TEXT = {"experiment": "text", "seed": 0, "trials": 2, "model": {"name": "minilm", "layers": 2},
        "peft": {"kind": "adapters", "reduction_factor": 2}, "data": {"name": "rt-sentences", "batch_size": 2},
        "fl": {"algorithm": "fedsgd", "rounds": 1, "clients": 2}, "threat": {"preset": "honest-but-curious"},
        "attack": {"name": "utr"}}


@pytest.mark.parametrize("seed", [0, 3])
def test_text_null_pool_holds_no_sentence_of_any_client_in_any_trial(seed, monkeypatch):
    from gradleak.data import splits
    from gradleak.data.splits import TextData
    from gradleak.errors import MissingAsset

    try:
        cfg = _validate({**TEXT, "seed": seed})
        data = TextData(cfg)
    except MissingAsset:
        pytest.skip("rt-sentences (gensim test data) is not installed")
    members = {t for tr in range(cfg.trials) for texts, _ in data.clients(tr, cfg.model.num_classes) for t in texts}
    assert len(members) == cfg.trials * cfg.fl.clients * cfg.data.batch_size
    everything = set(data.ds.texts)
    for k in (None, 16, len(data.ds)):  # the default size, a small pool, and as many as the set could give
        pool, source = data.null_pool(0, k)
        assert not set(pool) & members, f"k={k}: the null pool holds a client's sentence"
        assert set(pool) <= everything and "no client holds" in source
        assert len(pool) == min(len(everything - members), splits.NULL_POOL if k is None else k)
    monkeypatch.setattr(splits, "NULL_POOL", 16)  # the default size is NULL_POOL (here fewer than the set spares)
    assert len(data.null_pool(0)[0]) == 16 and not set(data.null_pool(0)[0]) & members
    assert data.null_pool(0, 16)[0] == data.null_pool(1, 16)[0]  # seeded (members of every trial excluded)
    assert TextData(cfg).null_pool(0, 16)[0] == data.null_pool(0, 16)[0]


# ------------------------------------------------------------------------------------------- pipeline: victims
def test_every_client_is_attacked_on_its_own_upload(tmp_path, monkeypatch, one_thread):
    """``metrics.attack_clients: all``: the view of victim v holds v's upload first (every round), so each client's
    evidence is computed from its own upload: PEFTLeak recovers every client's image exactly."""
    from gradleak.attacks.peftleak.attack import PEFTLeak
    from gradleak.fl.engines import builtin as protocol
    from gradleak.run import run_config

    outcomes, views = [], []
    real_rounds, real_rec = protocol.run_rounds, PEFTLeak.reconstruct

    def keep(*a, **k):
        outcomes.append(real_rounds(*a, **k))
        return outcomes[-1]

    def spy(self, view):
        views.append(view)
        return real_rec(self, view)

    monkeypatch.setattr(protocol, "run_rounds", keep)
    monkeypatch.setattr(PEFTLeak, "reconstruct", spy)
    raw = {"experiment": "image", "seed": 0, "data": {"name": "cifar-samples", "batch_size": 1, "image_size": 16},
           "model": {"name": "vit-tiny", "layers": 1}, "peft": {"kind": "adapters", "bottleneck": 8},
           "metrics": {"feature_distance": False, "null": False, "attack_clients": "all"},
           "attack": {"name": "peftleak"}, "threat": {"preset": "malicious", "public_data": True},
           "fl": {"clients": 2, "rounds": 1}}
    res = run_config(raw, tmp_path)
    (out,) = outcomes
    assert len(views) == 2
    for v, view in enumerate(views):
        assert len(view.rounds) == len(out.rounds)
        for seen, sent in zip(view.rounds, out.rounds):
            assert seen[0].client_id == sent[v].client_id == v
            assert all(torch.equal(seen[0].tensors[n], sent[v].tensors[n]) for n in sent[v].tensors)
        assert view.updates[0].client_id == v
    per = res["details"]["per_client"]
    assert [p["client"] for p in per] == [0, 1]
    cfg = _validate(raw)
    for p in per:
        m = p["metrics"]
        assert m["patches_exact"] == m["num_true_patches"] > 0, p["client"]
        assert m["psnr_max"] >= cfg.metrics.psnr_threshold_db, p["client"]  # the exact level's PSNR bar


# ------------------------------------------------------------------------------------------- round engine
def test_a_training_time_local_step_still_goes_through_every_update_defense():
    """``local_update`` replaces the client's training step, not its update defenses: each upload is the step's
    output transformed by every defense with the client's context, as the plain path would do."""
    from gradleak.defenses import build_defenses
    from gradleak.fl.core import Client
    from gradleak.fl.engines.builtin import run_rounds

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3).double()
    clients = [Client(i, torch.randn(4, 6, dtype=torch.float64), torch.randint(0, 3, (4,))) for i in range(2)]
    defenses = build_defenses([{"name": "clipping", "params": {"max_norm": 1e-3}},
                               {"name": "gaussian_noise", "params": {"std": 0.5}}], seed=3)
    raw_steps = []

    def step(c, local, *, seed, algorithm, lr, round_index, epochs, batch_size):
        u = c.local_update(local, algorithm=algorithm, lr=lr, seed=seed, in_place=True)  # no defense here
        raw_steps.append((round_index, c.client_id, seed, lr, u))
        return u

    kw = dict(rounds=2, algorithm="fedsgd", lr=0.1, defenses=defenses, seed=5)
    out = run_rounds(copy.deepcopy(model), clients, local_update=step, **kw)
    plain = run_rounds(copy.deepcopy(model), clients, **kw)
    assert [len(r) for r in out.rounds] == [2, 2] and len(raw_steps) == 4
    for r, c, seed, lr, u in raw_steps:
        sent = out.rounds[r][c]
        expected = u
        for d in defenses:
            expected = d.apply(expected, {"client_id": c, "seed": seed, "lr": lr})
        assert torch.allclose(sent.flat(), expected.flat(), rtol=0, atol=1e-12)
        assert not torch.allclose(sent.flat(), u.flat())  # the raw step never leaves the client
        assert torch.allclose(sent.flat(), plain.rounds[r][c].flat(), rtol=0, atol=1e-12)  # as the plain path


# ------------------------------------------------------------------------------------------- advise
ADVISE_TEXT = {"experiment": "text", "seed": 0, "model": {"name": "minilm", "layers": 2},
               "peft": {"kind": "adapters", "reduction_factor": 2}, "data": {"name": "rt-sentences", "batch_size": 2},
               "fl": {"algorithm": "fedsgd", "rounds": 1}, "threat": {"preset": "honest-but-curious"}}
LEAKS = {"attacks": [{"name": "utr", "level": "partial"}, {"name": "dlg", "level": "none"}]}


def _stopping_probe(raw, out_dir, only, device, workers, utility_from):
    return {"verdict": "no_leak_found", "accuracy": 0.5,
            "attacks": {a: {"level": "none", "metric": "m", "value": 0.1, "null_p99": 0.5, "null_median": 0.4}
                        for a in only}}


@pytest.mark.parametrize("costs", [{"gaussian_noise": 0.30, "clipping": 0.05, "topk_pruning": 0.15},
                                   {"gaussian_noise": 0.02, "clipping": 0.40, "topk_pruning": 0.10}])
def test_recommendations_are_ranked_cheapest_first(tmp_path, monkeypatch, costs):
    """Every candidate stops the leak; the ranking follows the measured accuracy cost (baseline − accuracy with the
    defense) upwards, and the recommendation is the cheapest."""
    from gradleak.run import advise as mod

    monkeypatch.setattr("gradleak.run.advise_probes.probe", _stopping_probe)

    def utility(raw, attacks, rounds, device, norms, accuracy_start=None):
        names = [d["name"] for d in raw.get("defenses") or []]
        acc = 0.8 - (costs[names[0]] if names else 0.0)
        return {"accuracy": acc, "accuracy_start": 0.5, "accuracy_curve": [0.5, acc], "rounds": rounds}

    monkeypatch.setattr("gradleak.run.advise_utility.utility_job", utility)
    adv = mod.advise(ADVISE_TEXT, tmp_path, LEAKS, candidates=list(costs), steps=1, log=lambda m: None)
    by = {r["defense"]: r for r in adv["rows"]}
    assert set(by) == set(costs) and all(by[d]["status"] == "stopped" for d in costs)
    for d, c in costs.items():
        assert by[d]["cost"] == pytest.approx(c)
    ranked = [by[d]["cost"] for d in adv["ranking"]]
    assert sorted(adv["ranking"]) == sorted(costs) and ranked == sorted(ranked)
    assert adv["recommendation"]["defense"] == min(costs, key=costs.get)
    assert adv["recommendation"]["cost"] == pytest.approx(min(costs.values()))


def test_only_a_measured_none_or_the_gates_hidden_update_stops_an_attack():
    from gradleak.run.advise_probes import GATE_STOP, outcome, stopped

    attacks = ["utr", "lamp"]

    def row(**levels):
        return {"attacks": {a: lv for a, lv in levels.items()}}

    none = {"level": "none"}
    assert outcome(row(utr=none, lamp=none), attacks) == "stopped" and stopped(row(utr=none, lamp=none), attacks)
    gate = {"level": None, "reason": f"{GATE_STOP}: attack 'utr' requires that the server sees each client's update"}
    assert stopped(row(utr=gate, lamp=none), attacks)
    for bad in ({"level": "undefined"}, {"level": None, "reason": "model.name: not applicable"}, {"level": None}, {}):
        r = row(utr=bad, lamp=none)
        assert outcome(r, attacks) == "unmeasured" and not stopped(r, attacks), bad
    assert outcome(row(utr=none), attacks) == "unmeasured"  # an attack missing from the probe
    assert outcome({**row(utr=none, lamp=none), "error": "RuntimeError: boom"}, attacks) == "unmeasured"
    assert not stopped({"error": "RuntimeError: boom"}, attacks)
    from gradleak.evaluation.levels import LEAKING

    for lv in LEAKING:  # any leaking level is a leak, whatever the other attack measured
        assert outcome(row(utr={"level": lv}, lamp=none), attacks) == "leaks", lv
        assert outcome(row(utr={"level": "undefined"}, lamp={"level": lv}), attacks) == "leaks", lv


@pytest.mark.parametrize("failure", ["raises", "undefined", "not_run"])
def test_a_failed_or_unmeasured_probe_is_not_a_stop(tmp_path, monkeypatch, failure):
    """The strong end stops the leak; every weaker probe fails (crashes, measures nothing, or is refused for a
    reason other than a hidden update): the strength found stays the strong end, the one measured stop."""
    from gradleak.run import advise as mod

    from gradleak.run.advise_candidates import CANDIDATE_BY_NAME

    strong = CANDIDATE_BY_NAME["gaussian_noise"]["strong"]
    calls = []

    def probe(raw, out_dir, only, device, workers, utility_from):
        std = next(d["params"]["std"] for d in raw.get("defenses") or [] if d["name"] == "gaussian_noise") \
            if raw.get("defenses") else None
        calls.append(std)
        if std is None:  # the baseline: the attack leaks
            return {"verdict": "leaks", "attacks": {a: {"level": "partial"} for a in only}}
        if std == strong:
            return _stopping_probe(raw, out_dir, only, device, workers, utility_from)
        if failure == "raises":
            raise RuntimeError("the probe crashed")
        lv = {"level": "undefined"} if failure == "undefined" else {"level": None, "reason": "data.name: too few"}
        return {"verdict": "undefined", "attacks": {a: lv for a in only}}

    monkeypatch.setattr("gradleak.run.advise_probes.probe", probe)
    monkeypatch.setattr("gradleak.run.advise_utility.utility_job", lambda raw, attacks, rounds, device, norms, accuracy_start=None: {
        "accuracy": 0.7, "accuracy_start": 0.5, "accuracy_curve": [0.5, 0.7], "rounds": rounds})
    adv = mod.advise(ADVISE_TEXT, tmp_path, LEAKS, candidates=["gaussian_noise"], steps=3, log=lambda m: None)
    (row,) = adv["rows"]
    assert len([c for c in calls if c is not None and c != strong]) >= 2  # the bisection did probe weaker strengths
    assert row["status"] == "stopped" and row["strength"] == strong
    assert row["interval"][1] == strong and row["interval"][0] < strong
    assert adv["recommendation"]["strength"] == strong


def test_a_failed_strong_end_recommends_nothing(tmp_path, monkeypatch):
    from gradleak.run import advise as mod

    def probe(raw, out_dir, only, device, workers, utility_from):
        if not raw.get("defenses"):
            return {"verdict": "leaks", "attacks": {a: {"level": "partial"} for a in only}}
        raise RuntimeError("the probe crashed")

    monkeypatch.setattr("gradleak.run.advise_probes.probe", probe)
    monkeypatch.setattr("gradleak.run.advise_utility.utility_job", lambda raw, attacks, rounds, device, norms, accuracy_start=None: {
        "accuracy": 0.7, "accuracy_start": 0.5, "rounds": rounds})
    adv = mod.advise(ADVISE_TEXT, tmp_path, LEAKS, candidates=["gaussian_noise"], steps=2, log=lambda m: None)
    (row,) = adv["rows"]
    assert row["status"] == "failed" and "strength" not in row and adv["recommendation"] is None
    assert adv["ranking"] == []


# ------------------------------------------------------------------------------------------- audit
AUDIT_TINY = {"experiment": "image", "seed": 0, "data": {"name": "cifar-samples", "batch_size": 2, "image_size": 16},
              "model": {"name": "vit-tiny", "layers": 1}, "peft": {"kind": "adapters", "bottleneck": 8},
              "metrics": {"feature_distance": False}, "threat": {"preset": "honest-but-curious"}}
LEAKING_IMAGES = {"images_above_threshold": 2.0, "images_total": 2.0, "psnr_max": 40.0, "psnr_max_null_p99": 12.0,
                  "ssim_max": 0.9, "ssim_max_null_p99": 0.3}
NOTHING = {"images_above_threshold": 0.0, "images_total": 2.0, "psnr_max": 9.0, "psnr_max_null_p99": 12.0,
           "ssim_max": 0.1, "ssim_max_null_p99": 0.3}


def _fake_runs(monkeypatch, outcome_of):
    """``run_config`` faked per attack: a metrics dict, or an exception to raise."""

    def fake(cand, out, device=None):
        what = outcome_of[cand["attack"]["name"]]
        if isinstance(what, BaseException):
            raise what
        return {"metrics": dict(what), "artifacts": []}

    monkeypatch.setattr("gradleak.run.runner.run_config", fake)


def test_a_crashed_attack_is_undefined_never_none(tmp_path, monkeypatch):
    """A crash measured nothing: its entry is ``undefined`` (with the error), it is listed as such, and an audit
    whose every attack crashed is ``undefined`` -- never the green ``no_leak_found``."""
    from gradleak.run.audit import run_audit

    _fake_runs(monkeypatch, {"dlg": RuntimeError("out of memory"), "ig": RuntimeError("segfault")})
    res = run_audit(AUDIT_TINY, tmp_path / "all", only=["dlg", "ig"], log=lambda m: None)
    by = {a["name"]: a for a in res["attacks"]}
    for name in ("dlg", "ig"):
        assert by[name]["level"] == "undefined" and by[name]["success"] is False
        assert "failed" in by[name] and "the run failed" in by[name]["reason"]
    assert res["verdict"] == "undefined" and res["headline"].startswith("UNDEFINED")
    assert sorted(u.split(":")[0] for u in res["undefined"]) == ["dlg", "ig"]
    # one crashed, one measured nothing: no leak found, but the crashed one is still undefined and said so
    _fake_runs(monkeypatch, {"dlg": RuntimeError("out of memory"), "ig": NOTHING})
    res = run_audit(AUDIT_TINY, tmp_path / "one", only=["dlg", "ig"], log=lambda m: None)
    by = {a["name"]: a for a in res["attacks"]}
    assert by["ig"]["level"] == "none" and by["dlg"]["level"] == "undefined"
    assert res["verdict"] == "no_leak_found"
    assert [u.split(":")[0] for u in res["undefined"]] == ["dlg"]
    assert "1 undefined" in res["headline"] and "dlg" in res["headline"].split("undefined")[-1]
    assert "1 attack(s) measured" in res["headline"]


def _banner_rgb(page: str) -> tuple[int, int, int]:
    m = re.search(r"\.banner\{[^}]*background:#([0-9a-fA-F]{6})", page)
    assert m, "no banner colour in the report"
    h = m.group(1)
    return int(h[0:2], 16), int(h[2:4], 16), int(h[4:6], 16)


def test_the_banner_is_red_for_a_leak_and_green_only_when_no_leak_was_found(tmp_path, monkeypatch):
    from gradleak.run.audit import run_audit

    colours = {}
    for case, outcome_of in {"leaks": {"dlg": NOTHING, "ig": LEAKING_IMAGES},
                             "no_leak_found": {"dlg": NOTHING, "ig": NOTHING},
                             "undefined": {"dlg": RuntimeError("x"), "ig": RuntimeError("y")}}.items():
        _fake_runs(monkeypatch, outcome_of)
        res = run_audit(AUDIT_TINY, tmp_path / case, only=["dlg", "ig"], log=lambda m: None)
        assert res["verdict"] == case
        colours[case] = _banner_rgb((tmp_path / case / "report.html").read_text())
    r, g, b = colours["leaks"]
    assert r > g and r > b, f"a leak's banner is not red: {colours['leaks']}"
    r, g, b = colours["no_leak_found"]
    assert g > r and g > b, f"no_leak_found's banner is not green: {colours['no_leak_found']}"
    r, g, b = colours["undefined"]
    assert not (g > r and g > b), "an audit that measured nothing is shown green"
    assert len(set(colours.values())) == 3


# ------------------------------------------------------------------------------------------- secure aggregation gate
PEFTLEAK_SECURE = {"experiment": "image", "seed": 0,
                   "data": {"name": "cifar-samples", "batch_size": 1, "image_size": 16},
                   "model": {"name": "vit-tiny", "layers": 1}, "peft": {"kind": "adapters", "bottleneck": 8},
                   "metrics": {"feature_distance": False}, "attack": {"name": "peftleak"},
                   "threat": {"preset": "malicious", "public_data": True},
                   "fl": {"secure_aggregation": True, "rounds": 1}}


def _upd(seed: int, client: int):
    from gradleak.fl.core import Update

    g = torch.Generator().manual_seed(seed)
    return Update({"w": torch.randn(4, 3, generator=g, dtype=torch.float64)}, 2, client)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_secure_aggregation_exposure_follows_the_client_count(n):
    """The gate's resolution: over one client the sum is that client's update (exposed, and said why); over 2+
    it hides every update; without a client count (dropped) it cannot know, and hides."""
    from gradleak.fl.core import secure_aggregate
    from gradleak.fl.threat import ThreatConfig, build_view

    dropped = ThreatConfig().resolve(secure_aggregation=True)
    assert dropped.individual_updates is False and dropped.exposure is None
    tm = ThreatConfig().resolve(secure_aggregation=True, clients=n)
    assert tm.individual_updates is (n == 1)
    assert (tm.exposure is not None) is (n == 1)
    ups = [_upd(10 * n + c, c) for c in range(n)]
    view = build_view(model=torch.nn.Linear(1, 1), rounds=[ups], round_states=[{}], threat=tm,
                      secure_sum=[secure_aggregate(ups, seed=1)], knowledge={}, always_public={})
    individual = [any(torch.allclose(s.tensors["w"], u.tensors["w"]) for s in view.updates) for u in ups]
    if n == 1:
        assert individual == [True] and view.updates[0].client_id == 0  # the client's own update
    else:
        assert not any(individual) and len(view.updates) == 1 and view.updates[0].client_id == -1


@pytest.mark.parametrize("n", [1, 2, 4])
def test_the_client_count_of_the_gate_comes_from_the_config(n, monkeypatch):
    """``fl.clients`` reaches the resolution: the config's threat model is exposed over one client only, and an
    attack that needs individual updates (PEFTLeak) passes the gate over one client and is refused over 2+."""
    from gradleak.fl.threat import ThreatConfig

    asked = []
    real = ThreatConfig.resolve

    def spy(self, secure_aggregation=False, clients=None):
        asked.append(clients)
        return real(self, secure_aggregation, clients=clients)

    monkeypatch.setattr(ThreatConfig, "resolve", spy)
    raw = {**PEFTLEAK_SECURE, "fl": {**PEFTLEAK_SECURE["fl"], "clients": n}}
    if n == 1:
        cfg = _validate(raw)
        tm = cfg.threat_model
        assert tm.individual_updates is True and tm.exposure and "one client" in tm.exposure
        assert any("one client" in line for line in tm.describe())
    else:
        with pytest.raises(BadInput) as err:
            _validate(raw)
        assert err.value.field == "threat.individual_updates"
        cfg = _validate({**raw, "attack": {"name": "inverting_gradients", "steps": 1, "labels": "idlg"},
                         "threat": {"preset": "honest-but-curious"}})
        assert cfg.threat_model.individual_updates is False and cfg.threat_model.exposure is None
    assert asked and set(asked) == {n}


# ------------------------------------------------------------------------------------------- the small pieces
# The functions the pieces above are made of, pinned one by one (fast: they are what ``make mutation`` mutates).
def test_victim_rounds_puts_the_victims_upload_first_in_every_round_and_keeps_the_rest():
    from gradleak.run.pipeline import victim_rounds

    rounds = [["a0", "a1", "a2"], ["b0", "b1", "b2"]]
    assert victim_rounds(rounds, 0) is rounds  # client 0: the rounds as observed
    assert victim_rounds(rounds, 1) == [["a1", "a2", "a0"], ["b1", "b2", "b0"]]
    assert victim_rounds(rounds, 2) == [["a2", "a0", "a1"], ["b2", "b0", "b1"]]
    for v in range(3):  # nothing lost, nothing duplicated
        assert all(sorted(r) == sorted(o) for r, o in zip(victim_rounds(rounds, v), rounds))


@pytest.mark.parametrize("attack_clients, individual, n, kind, expected", [
    ("all", True, 3, "images", [0, 1, 2]),
    ("all", True, 2, "token_sequences", [0, 1]),
    ("all", True, 1, "images", [0]),          # one client: itself
    ("all", False, 3, "images", [0]),         # secure aggregation: the sum, attacked once
    ("first", True, 3, "images", [0]),        # the run asks for the first client only
    ("all", True, 3, "membership", [0]),      # membership is graded over all candidates at once
    ("all", True, 3, "leakage", [0]),         # the leakage unit grades every client in one evaluation
])
def test_attacked_clients_are_every_client_only_when_each_upload_is_seen(attack_clients, individual, n, kind,
                                                                         expected):
    from types import SimpleNamespace

    from gradleak.evaluation import unit
    from gradleak.run.pipeline import attacked_clients

    if kind in ("membership", "leakage"):
        assert not unit(kind).per_client, "the case assumes membership is graded over all candidates"
    else:
        assert unit(kind).per_client, f"the case assumes {kind} is graded per client"
    cfg = SimpleNamespace(metrics=SimpleNamespace(attack_clients=attack_clients))
    assert attacked_clients(n, cfg, SimpleNamespace(individual_updates=individual), kind) == expected


def _adv_row(defense, cost, status="stopped", **kw):
    return {"defense": defense, "cost": cost, "status": status, "strength": 1.0, **kw}


def test_ranked_orders_by_cost_then_finished_then_a_meaningful_guarantee():
    from gradleak.run.advise_options import MEANINGFUL_EPSILON, STANDARD
    from gradleak.run.advise_report import hollow_dp, ranked

    rows = [_adv_row("clipping", 0.30), _adv_row("gaussian_noise", 0.10), _adv_row("topk_pruning", 0.20),
            {"defense": "quantization", "status": "failed"}, {"defense": "fisguard", "status": "stopped"},
            _adv_row("secure_aggregation", 0.05, status="leaks")]
    assert [r["defense"] for r in ranked(rows)] == ["gaussian_noise", "topk_pruning", "clipping"]
    # a strength not checked against every tested attack is never ranked, however cheap
    rows.append(_adv_row("dp_gaussian", 0.0, status="unfinished", unverified=True))
    assert [r["defense"] for r in ranked(rows)] == ["gaussian_noise", "topk_pruning", "clipping"]
    # a diverged defense ranks after every trainable one, even at a lower cost; an unmeasured cost last among these
    rows = [_adv_row("clipping", 0.30), _adv_row("gaussian_noise", 0.01, diverged={"round": 1, "lr": 1.0}),
            _adv_row("topk_pruning", None)]
    assert [r["defense"] for r in ranked(rows)] == ["clipping", "topk_pruning", "gaussian_noise"]
    # at equal cost: a finished search before an unfinished one; a meaningful epsilon before a hollow one
    rows = [_adv_row("clipping", 0.1, status="unfinished"), _adv_row("topk_pruning", 0.1)]
    assert [r["defense"] for r in ranked(rows)] == ["topk_pruning", "clipping"]
    good = _adv_row("dpsgd", 0.1, epsilon=MEANINGFUL_EPSILON)
    hollow = _adv_row("dp_gaussian", 0.1, epsilon=MEANINGFUL_EPSILON * 10)
    assert hollow_dp(hollow) and not hollow_dp(good) and hollow_dp(_adv_row("dpsgd", 0.1))
    assert not hollow_dp(_adv_row("clipping", 0.1)) and hollow_dp(_adv_row("x", 0.1, is_dp=True))
    assert [r["defense"] for r in ranked([hollow, good])] == ["dpsgd", "dp_gaussian"]
    # every tie broken by the candidate order, or the row's own tie-break
    a, b = sorted(["clipping", "topk_pruning"], key=STANDARD.index)
    assert [r["defense"] for r in ranked([_adv_row(b, 0.1), _adv_row(a, 0.1)])] == [a, b]
    assert [r["defense"] for r in ranked([_adv_row(a, 0.1, tie_break=9), _adv_row(b, 0.1, tie_break=1)])] == [b, a]


def test_record_failures_never_grades_a_crash_none():
    from gradleak.run.audit import record_failures

    said = []
    e = {"name": "dlg"}
    assert record_failures(e, [{"error": "RuntimeError: boom"}], "images", said.append) is True
    assert e["level"] == "undefined" and e["success"] is False and e["undefined"] is True and e["value"] is None
    assert e["failed"] == "RuntimeError: boom" and e["reason"] == "the run failed: RuntimeError: boom"
    assert e["rule"] == "the run failed: nothing was measured"  # the rule the report shows beside the level
    assert e["metric"] and said and "FAILED" in said[0] and "dlg" in said[0]
    e = {"name": "dlg"}  # one crashed, one measured: the crash is recorded, the measured run is judged
    assert record_failures(e, [{"error": "E"}, {"metrics": {}}], "images", said.append) is False
    assert e == {"name": "dlg", "failed": "E"}
    e = {"name": "dlg"}  # nothing at all came back: undefined, said so
    assert record_failures(e, [], "images", said.append) is True and e["reason"] == "the run failed: no result"
    e = {"name": "dlg", "applicable": True}  # refused once the data are known: not applicable, with the reason
    assert record_failures(e, [{"bad_input": "data.x: no"}], "images", said.append) is True
    assert e["applicable"] is False and e["applicable_under"] is None and e["reason"] == "data.x: no"
    assert "level" not in e
    e = {"name": "dlg"}  # refused in one run, measured in another: judged
    assert record_failures(e, [{"bad_input": "x"}, {"metrics": {}}], "images", said.append) is False
    assert e == {"name": "dlg"}


def test_banner_colour_is_green_only_for_no_leak_found():
    from gradleak.run.audit_report import banner_colour

    def rgb(h):
        return int(h[1:3], 16), int(h[3:5], 16), int(h[5:7], 16)

    r, g, b = rgb(banner_colour("leaks"))
    assert r > g and r > b
    r, g, b = rgb(banner_colour("leaks_stronger_server"))
    assert r > b and g > b and r > g  # amber
    r, g, b = rgb(banner_colour("no_leak_found"))
    assert g > r and g > b
    for v in ("undefined", "something new", ""):
        r, g, b = rgb(banner_colour(v))
        assert r == g == b, v  # grey: never green over what was not measured
    assert len({banner_colour(v) for v in ("leaks", "leaks_stronger_server", "no_leak_found", "undefined")}) == 4


# ------------------------------------------------------------------------------------------- null pool: the edges
def _tiny_images(batch_size: int, clients: int):
    return _validate({**TINY_IMAGES, "data": {**TINY_IMAGES["data"], "batch_size": batch_size},
                      "fl": {"clients": clients}})


@pytest.mark.parametrize("batch_size, clients, trial", [(20, 2, 0), (20, 2, 1), (13, 3, 1)])
def test_a_private_set_that_spares_no_image_falls_back_to_the_public_draw(batch_size, clients, trial):
    """cifar-samples holds 40 images: when the clients use all of them (or all but the one a permuted draw leaves
    out), the nulls come from the public set's documented draw (seed + 2000), never from an empty or private pool."""
    from gradleak.data.splits import ImageData, _public_name, load_images

    cfg = _tiny_images(batch_size, clients)
    data = ImageData(cfg)
    chunks = data.clients(trial, cfg.model.num_classes)
    k = 8
    pool, source = data.null_pool(trial, k)
    assert "spares no image" in source and _public_name(cfg) in source
    want, _ = load_images(_public_name(cfg), k, cfg.data.image_size, cfg.data.seed + 2000, "data.public",
                          channels=cfg.image_channels)
    assert pool.shape == want.shape and torch.equal(pool, want)
    for x, _ in chunks:
        assert _holds(pool, x) == []


@pytest.mark.parametrize("trial, expected", [(0, 10), (1, 9)])
def test_the_null_pool_of_a_small_private_set_is_what_the_draw_spares(trial, expected):
    """30 of cifar-samples' 40 images go to the clients; 20 nulls are asked for: the pool holds the 10 images the
    unpermuted draw spares (trial 0 of seed 0), or 9 of a permuted one (a permutation of 39 of the 40)."""
    from gradleak.data.splits import ImageData

    cfg = _tiny_images(15, 2)
    data = ImageData(cfg)
    chunks = data.clients(trial, cfg.model.num_classes)
    pool, source = data.null_pool(trial, 20)
    assert "no client holds" in source and len(pool) == expected
    for x, _ in chunks:
        assert _holds(pool, x) == []


def test_the_null_pool_defaults_to_null_pool_images():
    from gradleak.data.splits import NULL_POOL, ImageData

    cfg = _validate({**TINY_IMAGES, "data": {**TINY_IMAGES["data"], "name": "natural-crops"}})
    data = ImageData(cfg)
    data.clients(0, cfg.model.num_classes)
    pool, _ = data.null_pool(0)
    assert len(pool) == NULL_POOL


@pytest.mark.parametrize("trial", [0, 1])
def test_the_test_chunk_keeps_its_own_labels(trial):
    """The held-out test images come after the clients', validation and prior chunks of the draw, each with its own
    label (a shifted label slice would score the accuracy against other images' labels)."""
    from gradleak.data.splits import ImageData, fold_labels

    cfg = _leakage_cfg("cifar-samples")
    data = ImageData(cfg)
    data.clients(trial, cfg.model.num_classes)
    x, y = data.test(cfg.model.num_classes)
    sizes, val, prior = data._layout()
    b = sum(sizes) + val * len(sizes) + prior
    imgs, labels = data._load(trial, b + data._test_size())
    assert torch.equal(x, imgs[b:b + len(x)]) and len(x) == cfg.data.test_size
    assert torch.equal(y, fold_labels(labels[b:b + len(x)], cfg.model.num_classes, cfg.data.name, False))


def test_a_later_trial_draws_a_permutation_even_when_seed_plus_offset_would_cancel():
    """Trial t draws with seed + 7919·t. Data seed 7919 in trial 1 is the case where a wrong sign would give seed 0,
    the unpermuted draw, and take one image more than a permuted draw can spare (9, not 10, of the 10 left over)."""
    from gradleak.data.splits import ImageData

    cfg = _validate({**TINY_IMAGES, "data": {**TINY_IMAGES["data"], "batch_size": 15, "seed": 7919},
                     "fl": {"clients": 2}})
    data = ImageData(cfg)
    chunks = data.clients(1, cfg.model.num_classes)
    pool, source = data.null_pool(1, 20)
    assert "no client holds" in source and len(pool) == 9
    for x, _ in chunks:
        assert _holds(pool, x) == []


def test_a_grey_models_fallback_nulls_are_grey():
    """The public fallback pool has the model's input channels (a one-channel model scores one-channel nulls)."""
    from gradleak.data.splits import ImageData

    cfg = _validate({**TINY_IMAGES, "data": {**TINY_IMAGES["data"], "batch_size": 20},
                     "model": {"name": "resnet18", "num_channels": 1}, "peft": {"kind": "none"}, "fl": {"clients": 2}})
    data = ImageData(cfg)
    chunks = data.clients(0, cfg.model.num_classes)
    pool, source = data.null_pool(0, 4)
    assert "spares no image" in source
    assert pool.shape[1] == 1 == chunks[0][0].shape[1]


# ------------------------------------------------------------------------------------------- the banner's words
def _entry(name, level, applicable=True, **kw):
    return {"name": name, "level": level, "applicable": applicable, "rule": f"{level} rule",
            "metric": "psnr_max", "value": 30.0, "null_p99": 12.0, "p_value": 0.001,
            "threat_words": "an honest-but-curious server", **kw}


def test_the_banner_names_the_worst_leak_first_with_its_count_client_and_threat():
    """Found by mutation (verdict_and_headline: the leaking entries' order, the exact count, the client, the threat
    dropped): the banner names the most leaking attack, how many private samples were exact, whose, and under which
    server."""
    from gradleak.run.audit import verdict_and_headline

    es = [_entry("dlg", "partial", worst_client=1, value=14.0),
          _entry("peftleak", "exact", worst_client=3, n_success=2, n_total=4, unit="images"),
          _entry("ig", "strong", worst_client=0)]
    for order in (es, es[::-1], [es[2], es[0], es[1]]):
        v, text = verdict_and_headline(order)
        assert v == "leaks" and text.startswith("LEAKS: EXACT leakage by peftleak, client 3 under an honest-but-curious "
                                                "server: exact rule -- psnr_max = 30")
        assert "; 2 of 4 private images exact" in text
    v, text = verdict_and_headline([_entry("dlg", "partial", worst_client=0, n_success=1, n_total=2)])
    assert "1 of 2 private samples exact" in text  # the unit defaults to samples
    bare = _entry("dlg", "partial", threat="malicious")
    del bare["threat_words"]  # an entry without the words: the threat's name
    v, text = verdict_and_headline([bare])
    assert "dlg under malicious:" in text and "client" not in text.split(" under ")[0]


def test_a_stronger_server_leak_never_reads_as_no_leak():
    from gradleak.run.audit import verdict_and_headline

    es = [_entry("peftleak", "exact", applicable=False, worst_client=0), _entry("dlg", "none"),
          _entry("ig", "partial", applicable=False, worst_client=1)]
    v, text = verdict_and_headline(es, ["utr"])
    assert v == "leaks_stronger_server"
    assert text.startswith("LEAKS ONLY UNDER A STRONGER SERVER: EXACT leakage by peftleak, client 0")
    assert text.endswith("; 1 applicable attack(s) not run (--only): utr")


def test_the_no_leak_banner_counts_what_measured_none_and_names_what_was_left_out():
    from gradleak.run.audit import verdict_and_headline

    es = [_entry("dlg", "none", variants=[{}, {"x": 1}], per_client=[{}, {}]), _entry("ig", "none"),
          _entry("dager", "undefined", reason="no tokens"), _entry("lamp", "undefined", reason="refused")]
    v, text = verdict_and_headline(es, ["utr", "april"])
    assert v == "no_leak_found"
    assert text == ("NO LEAK FOUND: 2 attack(s) measured at full strength, none above its null -- dlg (2 setting(s), 2 "
                    "client(s)), ig (1 setting(s), 1 client(s)); 2 applicable attack(s) not run (--only): utr, april "
                    "(evidence, not proof); 2 undefined (measured nothing): dager, lamp")
    v, text = verdict_and_headline([_entry("dager", "undefined", reason="no tokens"),
                                    _entry("lamp", "undefined", rule="nothing measured")], ["utr"])
    assert v == "undefined"
    assert text == ("UNDEFINED: no attack measured anything (dager: no tokens; lamp: nothing measured) -- this is not "
                    "evidence of safety; 1 applicable attack(s) not run (--only): utr")


def test_a_leak_banner_adds_nothing_it_was_not_given():
    """No count without exact samples, no left-out clause without --only (found by mutation: both empty strings)."""
    from gradleak.run.audit import verdict_and_headline

    v, text = verdict_and_headline([_entry("ig", "strong", worst_client=2)])
    assert text == ("LEAKS: STRONG leakage by ig, client 2 under an honest-but-curious server: strong rule -- "
                    "psnr_max = 30 against a null 99th percentile of 12 (p = 0.001)")


# ------------------------------------------------------------------------------------------- per-process reuse
def test_a_kept_image_null_is_the_null_drawn_again_and_callers_cannot_change_it():
    from gradleak.evaluation import nulls

    g = torch.Generator().manual_seed(0)
    orig, pool = torch.rand(3, 3, 8, 8, generator=g), torch.rand(20, 3, 8, 8, generator=g)
    nulls._IMAGE_NULLS.clear()
    first = nulls.image_null(orig, pool, draws=50, seed=3)
    fresh = nulls._image_null(orig, pool, draws=50, seed=3)
    assert all(np.array_equal(first[k], fresh[k]) for k in fresh)
    first["psnr"][:] = -1  # a caller's change stays with the caller
    again = nulls.image_null(orig, pool, draws=50, seed=3)
    assert np.array_equal(again["psnr"], fresh["psnr"]) and len(nulls._IMAGE_NULLS) == 1
    other = nulls.image_null(orig, pool[1:], draws=50, seed=3)  # another pool: another key, another null
    assert len(nulls._IMAGE_NULLS) == 2 and not np.array_equal(other["psnr"], fresh["psnr"])
    assert not np.array_equal(nulls.image_null(orig, pool, draws=50, seed=4)["psnr"], fresh["psnr"])


def test_a_shared_image_set_is_read_never_written():
    from gradleak.data.splits import _shared_set, load_images

    a, la = load_images("cifar-samples", 5, 16, 0, "data.name")
    a.add_(1.0)
    la.add_(7)
    b, lb = load_images("cifar-samples", 5, 16, 0, "data.name")
    assert float(b.max()) <= 1.0 and not torch.equal(la, lb)
    ds = _shared_set("cifar-samples", ())
    assert float(ds.images.max()) <= 1.0
