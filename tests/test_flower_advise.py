"""FlowerAudit(..., advise=True): the advice search for the federation a Flower server watches,
with Flower's DP mechanisms as candidates in their real semantics; the recommended Flower setting, applied in the
Flower app, gives no leak in a plain FlowerAudit. ``pytest -k flower_advise``."""

from __future__ import annotations

import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch

flwr = pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import ServerApp  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from gradleak.errors import BadInput  # noqa: E402
from gradleak.fl.core import Update  # noqa: E402
from gradleak.integrations import flower as glf  # noqa: E402
from gradleak.integrations import flower_advise as fa  # noqa: E402

TEXT = {"experiment": "text", "seed": 0, "model": {"name": "minilm", "layers": 2},
        "peft": {"kind": "adapters", "reduction_factor": 2}, "data": {"name": "rt-sentences", "batch_size": 2},
        "fl": {"algorithm": "fedsgd", "rounds": 1, "clients": 2, "lr": 0.05},
        "threat": {"preset": "honest-but-curious"}, "attack": {"name": "utr"}}
FLOWER = ["LocalDpMod", "DifferentialPrivacyClientSideFixedClipping", "DifferentialPrivacyServerSideFixedClipping"]


# ------------------------------------------------------------------------------------------------ a plain Flower app

def _text_federation(raw: dict, audit, *, mods=(), strategy_wrap=None):
    """A Flower app as a user writes it around the gradleak config's model: each client takes one SGD step on its
    private sentences and replies with its new weights (float64, so (sent - new) / lr is its gradient to 1e-15)."""
    from gradleak.data.splits import TextData

    handle, cfg = glf.build_model(raw)
    parts = TextData(cfg).clients(0, cfg.model.num_classes)
    model = handle.model
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    capp = ClientApp(mods=list(mods))

    @capp.train()
    def train(msg, ctx):
        pid = int(ctx.node_config["partition-id"])
        x, y = parts[pid]
        sent = glf.to_tensors(msg.content["arrays"])
        params = dict(model.named_parameters())
        with torch.no_grad():
            for k, v in sent.items():
                params[k].copy_(v.to(params[k].dtype))
        lr = float(msg.content["config"]["lr"])
        model.zero_grad()
        enc = handle.text_model.encode(list(x), cfg.data.max_length)
        handle.loss_fn(model, torch.stack([enc["input_ids"], enc["attention_mask"]], 1), y).backward()
        new = {n: sent[n].double() - lr * params[n].grad.detach().double() for n in names}
        return Message(RecordDict({"arrays": glf.to_arrays(new),
                                   "metrics": MetricRecord({"num-examples": len(y), "partition-id": pid})}),
                       reply_to=msg)

    sapp = ServerApp()
    n = cfg.fl.clients

    @sapp.main()
    def main(grid, ctx):
        inner = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=n, min_train_nodes=n)
        s = glf.GradleakStrategy(strategy_wrap(inner) if strategy_wrap else inner, lr=cfg.fl.lr,
                                 algorithm=cfg.fl.algorithm, on_round=audit)
        s.start(grid=grid, initial_arrays=glf.to_arrays({k: model.get_parameter(k).detach() for k in names}),
                num_rounds=cfg.fl.rounds, train_config=ConfigRecord({"lr": cfg.fl.lr}))

    glf.run_inprocess(sapp, capp, n)
    return [(x, y) for x, y in parts]


def _truth(raw):
    from gradleak.data.splits import TextData

    cfg = glf.build_model(raw)[1]
    parts = list(TextData(cfg).clients(0, cfg.model.num_classes))
    return lambda _r: parts


@pytest.mark.slow
@pytest.mark.timeout(3600)  # two Flower runs, two audits and ~6 probe audits; a busy shared box is slow
def test_flower_advise_recommends_a_flower_setting_that_applied_gives_no_leak(tmp_path, one_thread):
    """UTR reads every client's update of a plain Flower federation (MiniLM + adapters, 2 clients): the advice
    searches Flower's three DP mechanisms; the central wrappers leave every update readable by the server (not
    stopped at sigma = 10), LocalDpMod stops it; its recommended setting, put in the ClientApp's mods, gives
    no_leak_found in a plain FlowerAudit of the same federation."""
    from flwr.clientapp.mod import LocalDpMod

    out = tmp_path / "advised"
    audit = glf.FlowerAudit(TEXT, out, attacks=["utr"], truth=_truth(TEXT), log=lambda m: None,
                            advise={"candidates": FLOWER, "steps": 1})
    _text_federation(TEXT, audit)
    res = json.loads((out / "round_1" / "audit.json").read_text())
    assert res["verdict"] == "leaks"
    adv = res["advice"]
    assert adv["attacks"] == ["utr"] and adv["server_round"] == 1 and "round 1" in adv["basis"]
    rows = {r["defense"]: r for r in adv["rows"]}
    assert set(rows) == set(FLOWER)
    for name in FLOWER[1:]:  # the central wrappers: the server receives the update before the noise
        r = rows[name]
        assert r["status"] == "not_stopped" and r["levels"]["utr"] in ("partial", "strong", "exact"), r
        assert "the server receives" in r["note"] and r["flower"]["class"] == name
        assert isinstance(r["epsilon"], float) and r["epsilon"] < 10  # the released model's epsilon at sigma = 10
    local = rows["LocalDpMod"]
    assert local["status"] == "stopped" and local["levels"] == {"utr": "none"}
    assert local["bracket"][1] == fa.LOCAL_STRONG_EPSILON and local["bracket"][0] > local["bracket"][1]
    assert local["flower"]["params"]["epsilon"] == local["strength"]
    assert local["flower"]["params"]["clipping_norm"] == adv["clipping_norm"]["value"]
    rec = adv["recommendation"]
    assert rec["defense"] == "LocalDpMod" and rec["flower"]["class"] == "LocalDpMod"
    assert "LocalDpMod(clipping_norm=" in adv["sentence"]
    assert (out / "round_1" / "advice.html").read_text().count('id="recommendation"') == 1
    assert (out / "round_1" / "advice.png").stat().st_size > 1000
    summary = json.loads((out / "flower_audit.json").read_text())["rounds"][0]
    assert summary["advice"]["recommendation"]["defense"] == "LocalDpMod"
    # the round trip: Flower's LocalDpMod at the recommended setting in the ClientApp, a plain FlowerAudit
    plain = glf.FlowerAudit(TEXT, tmp_path / "plain", attacks=["utr"], truth=_truth(TEXT), log=lambda m: None)
    _text_federation(TEXT, plain, mods=[LocalDpMod(**rec["flower"]["params"])])
    again = json.loads((tmp_path / "plain" / "round_1" / "audit.json").read_text())
    assert again["verdict"] == "no_leak_found", again["headline"]
    assert "advice" not in again


# ------------------------------------------------------------------------------------------------ the mapping, exactly

def _linear_federation(g: dict, lr: float, *, mods=(), strategy_wrap=None, n=2):
    """Clients whose update is the fixed ``g`` (client 0; the others ``g`` with its rows rolled, so no two replies
    are identical) in float64 weight replies; returns the recorded round."""
    holder = {}
    capp = ClientApp(mods=list(mods))

    @capp.train()
    def train(msg, ctx):
        sent = glf.to_tensors(msg.content["arrays"])
        pid = int(ctx.node_config["partition-id"])
        new = {k: sent[k].double() - lr * g[k].roll(pid, 0) for k in sent}
        return Message(RecordDict({"arrays": glf.to_arrays(new),
                                   "metrics": MetricRecord({"num-examples": 1, "partition-id": pid})}),
                       reply_to=msg)

    sapp = ServerApp()

    @sapp.main()
    def main(grid, ctx):
        inner = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=n, min_train_nodes=n)
        s = glf.GradleakStrategy(strategy_wrap(inner) if strategy_wrap else inner, lr=lr)
        holder["s"] = s
        s.start(grid=grid, initial_arrays=ArrayRecord({k: torch.zeros_like(v) for k, v in g.items()}), num_rounds=1,
                train_config=ConfigRecord({"lr": lr}))

    glf.run_inprocess(sapp, capp, n)
    return holder["s"].rounds[0]


def _candidates(clip, lr, n=2):
    return {c["name"]: c for c in fa.flower_candidates({}, clip=clip, lr=lr, clients=n, coordinates=40_000,
                                                       delta=1e-5, clip_note="given")}


def _mapped(spec, value, g):
    """The gradleak defense a Flower candidate maps to, applied to the update ``g``."""
    from gradleak.defenses import build_defenses

    (d,) = build_defenses(spec["configure"]({}, value)["defenses"], seed=3)
    return d, d.apply(Update(dict(g), 1, 0), {"client_id": 0, "seed": 3})


def test_flower_local_dp_mod_is_the_mapped_dp_gaussian():
    """Flower's LocalDpMod (clip Δw, then N(0, s²) per coordinate) equals its mapped gradleak defense: the same
    clipped update, the same noise std (40 000 coordinates, within 3 %)."""
    from flwr.clientapp.mod import LocalDpMod

    lr, clip = 0.1, 0.02
    g = {"w": torch.randn(200, 200, dtype=torch.float64, generator=torch.Generator().manual_seed(0))}
    spec = _candidates(clip, lr)["LocalDpMod"]
    for eps, big in ((1e12, False), (5e4, True)):
        mod = LocalDpMod(clipping_norm=clip, sensitivity=clip, epsilon=eps, delta=1e-5)
        rec = _linear_federation(g, lr, mods=[mod])
        assert rec.updates[0].client_id == 0
        seen = rec.updates[0].tensors["w"]
        d, ours = _mapped(spec, eps, g)
        clipped = g["w"] * (clip / lr) / float(g["w"].norm())
        assert d.where == "client" and d.max_norm == pytest.approx(clip / lr)
        if not big:  # noise std ~1e-12: the clipped update, as the mapped defense clips it
            assert torch.allclose(seen, clipped, atol=1e-9) and torch.allclose(ours.tensors["w"], clipped, atol=1e-9)
        else:
            flower_std, our_std = float((seen - clipped).std()), float((ours.tensors["w"] - clipped).std())
            want = clip * math.sqrt(2 * math.log(1.25 / 1e-5)) / eps / lr  # LocalDpMod's std on Δw, over lr
            assert flower_std == pytest.approx(want, rel=0.03) and our_std == pytest.approx(want, rel=0.03)


def test_flower_client_side_fixed_clipping_is_the_mapped_dp_gaussian_on_the_server():
    """DifferentialPrivacyClientSideFixedClipping + fixedclipping_mod: the server receives exactly what the mapped
    gradleak defense (dp_gaussian where: server) uploads -- the clipped update, no noise."""
    from flwr.clientapp.mod import fixedclipping_mod
    from flwr.serverapp.strategy import DifferentialPrivacyClientSideFixedClipping

    lr, clip = 0.1, 0.02
    g = {"w": torch.randn(30, 20, dtype=torch.float64, generator=torch.Generator().manual_seed(1))}
    spec = _candidates(clip, lr)["DifferentialPrivacyClientSideFixedClipping"]
    rec = _linear_federation(g, lr, mods=[fixedclipping_mod], strategy_wrap=lambda s: DifferentialPrivacyClientSideFixedClipping(
        s, noise_multiplier=2.0, clipping_norm=clip, num_sampled_clients=2))
    d, ours = _mapped(spec, 2.0, g)
    assert d.server_side and d.noise_multiplier == 2.0
    assert not rec.aggregated
    u = rec.updates[0]
    assert u.client_id == 0 and torch.allclose(u.tensors["w"], ours.tensors["w"], atol=1e-12)


def test_flower_candidates_config_set_and_starting_point():
    """Server-side clipping runs Flower's own wrapper (fl.engine flower, float64 weight replies); a configured Flower
    DP mechanism is the search's weak end and its clipping norm is kept; the settings name Flower's classes."""
    from gradleak.run.advise_candidates import set_strings, starting_point

    raw = copy.deepcopy(TEXT)
    raw["fl"]["flower"] = {"reply": "update"}
    c = {s["name"]: s for s in fa.flower_candidates(raw, clip=0.01, lr=0.05, clients=2, coordinates=100, delta=1e-5,
                                                    clip_note="fitted")}
    server = c["DifferentialPrivacyServerSideFixedClipping"]["configure"](raw, 10.0)
    assert server["fl"]["engine"] == "flower" and server["fl"]["flower"] == {
        "reply": "weights", "dp": "server-fixed", "noise_multiplier": 10.0, "clipping_norm": 0.01}
    assert set(set_strings(raw, c["DifferentialPrivacyServerSideFixedClipping"], 10.0)) == {
        "fl.flower.reply=weights", "fl.flower.dp=server-fixed", "fl.flower.noise_multiplier=10.0",
        "fl.flower.clipping_norm=0.01", "fl.engine=flower"}
    local = c["LocalDpMod"]["configure"](raw, 2.0)["defenses"]
    assert local == [{"name": "dp_gaussian", "params": {"noise_multiplier": pytest.approx(fa.z_of_epsilon(2.0, 1e-5), rel=1e-5),
                                                        "max_norm": pytest.approx(0.2), "where": "client"}}]
    assert starting_point(raw, c["LocalDpMod"]) is None
    cfg = copy.deepcopy(raw)
    cfg["fl"]["flower"].update({"dp": "local", "local_epsilon": 3.0, "clipping_norm": 0.5, "local_sensitivity": 1.0})
    c2 = {s["name"]: s for s in fa.flower_candidates(cfg, clip=0.01, lr=0.05, clients=2, coordinates=100, delta=1e-5,
                                                     clip_note="fitted")}
    assert starting_point(cfg, c2["LocalDpMod"]) == 3.0 and c2["LocalDpMod"]["fixed"]["clipping_norm"] == 0.5
    probe = c2["LocalDpMod"]["configure"](cfg, 3.0)
    assert probe["fl"]["flower"]["dp"] == "none"  # the configured Flower DP is replaced by its mapping, not doubled
    assert probe["defenses"][0]["params"]["noise_multiplier"] == pytest.approx(fa.z_of_epsilon(3.0, 1e-5) * 1.0 / 0.5,
                                                                               rel=1e-5)
    row = {"defense": "LocalDpMod", "strength": 3.0, "fixed": c2["LocalDpMod"]["fixed"], **c2["LocalDpMod"]["row"]}
    s = fa.flower_setting(row, "fedsgd", 0.05, 1e-5)
    assert s["code"] == "ClientApp(mods=[LocalDpMod(clipping_norm=0.5, sensitivity=1, epsilon=3, delta=1e-05)])"
    plain = fa.flower_setting({"stage": "update", "config": {"defenses": [{"name": "clipping", "params": {"max_norm": 1}}]}},
                              "fedsgd", 0.05, 1e-5)
    assert plain["code"].startswith("ClientApp(mods=[defense_mod(")


# ------------------------------------------------------------------------------------------------ the flow (probes faked)

def _fake_probe(calls):
    """UTR stops when the noise on each upload reaches std 1e-3 (update units); the server-side wrapper leaves the
    raw update (leaks); the accuracy does not move (every cost 0: the tie-break decides)."""

    def probe(raw, out_dir, only, device, workers, utility_from):
        calls.append(raw)
        std = sum(d["params"]["noise_multiplier"] * d["params"]["max_norm"] if d["name"] == "dp_gaussian"
                  else d["params"]["std"] for d in raw.get("defenses") or []
                  if d["params"].get("where") == "client" or d["name"] == "gaussian_noise")
        level = "none" if std >= 1e-3 else "exact"
        return {"verdict": "leaks" if level != "none" else "no_leak_found", "accuracy": 0.8,
                "attacks": {a: {"level": level, "metric": "rouge1", "value": 100.0 if level != "none" else 10.0,
                                "null_p99": 25.0, "null_median": 12.0} for a in only}}

    return probe


def test_flower_advice_flow_rows_recommendation_and_when_to_search_again(tmp_path, monkeypatch):
    """The advice of a leaking round: Flower's three classes among gradleak's candidates, each row with the Flower
    setting; at equal cost the CLI's tie-break (a DP row with a hollow epsilon after plain noise); a later round
    leaking through the same attack is not searched again, one leaking through a new attack is."""
    from gradleak.fl.engines.flower_bridge import RecordedRound
    from gradleak.run.runner import validate

    import gradleak.report.plots as plots

    calls, plotted = [], []
    monkeypatch.setattr("gradleak.run.advise_probes.probe", _fake_probe(calls))
    monkeypatch.setattr(plots, "save_privacy_utility_plot", lambda panels, path: plotted.append(panels))  # (slow test)
    logs = []
    audit = SimpleNamespace(raw=copy.deepcopy(TEXT), cfg=validate(copy.deepcopy(TEXT))[1], truth=lambda r: [],
                            out=tmp_path, device="cpu", log=logs.append, plans=[("utr", None)], advice_covered=None,
                            advise_opts=fa.advise_options({"candidates": FLOWER + ["gaussian_noise_absolute"], "steps": 2},
                                                          None) | {"workers": 1})
    g = torch.full((100,), 0.1, dtype=torch.float64)  # ‖g‖ = 1, ‖Δw‖ = lr = 0.05
    rec = RecordedRound(1, {}, [], [Update({"w": g}, 2, 0), Update({"w": 2 * g}, 2, 1)])
    result = {"attacks": [{"name": "utr", "level": "exact"}]}
    adv = fa.round_advice(audit, rec, result, tmp_path / "round_1")
    assert adv["clipping_norm"]["value"] == pytest.approx(0.075)  # the median of 0.05 and 0.1
    rows = {r["defense"]: r for r in adv["rows"]}
    assert set(rows) == set(FLOWER) | {"gaussian_noise_absolute"}
    assert rows["DifferentialPrivacyServerSideFixedClipping"]["status"] == "not_stopped"
    assert rows["DifferentialPrivacyClientSideFixedClipping"]["status"] == "not_stopped"
    assert rows["LocalDpMod"]["status"] == "stopped" and rows["LocalDpMod"]["flower"]["class"] == "LocalDpMod"
    assert rows["gaussian_noise_absolute"]["flower"]["code"].startswith("ClientApp(mods=[defense_mod(")
    server_probe = next(c for c in calls if (c.get("fl") or {}).get("engine") == "flower")
    assert server_probe["fl"]["flower"]["dp"] == "server-fixed"
    # equal cost: LocalDpMod stops only at an epsilon that guarantees nothing, so plain noise ranks first (the CLI's
    # rule); the central wrappers, not stopping, are not ranked
    assert rows["LocalDpMod"]["epsilon"] > 10 and adv["ranking"] == ["gaussian_noise_absolute", "LocalDpMod"]
    assert adv["recommendation"]["defense"] == "gaussian_noise_absolute" and "In the Flower app: ClientApp(mods=[" \
        "defense_mod(" in adv["sentence"]
    assert (tmp_path / "round_1" / "advice.html").is_file() and adv["plot"] == "advice.png"
    assert {p["title"].split(" (")[0] for p in plotted[0]} >= {"LocalDpMod", "gaussian_noise_absolute"}
    n = len(calls)
    assert fa.round_advice(audit, rec, result, tmp_path / "round_2") is None and len(calls) == n  # covered
    result2 = {"attacks": [{"name": "utr", "level": "exact"}, {"name": "dager", "level": "partial"}]}
    adv2 = fa.round_advice(audit, RecordedRound(2, {}, [], rec.updates), result2, tmp_path / "round_2")
    assert adv2["attacks"] == ["utr", "dager"] and len(calls) > n


def test_flower_advise_bad_input_is_named():
    with pytest.raises(BadInput, match="advise.candidates"):
        fa.advise_options({"candidates": ["LocalDP"]}, None)
    with pytest.raises(BadInput, match="budget"):
        fa.advise_options(False, 60)
    with pytest.raises(BadInput, match="advise.steps"):
        fa.advise_options({"steps": -1}, None)
    assert fa.advise_options({"candidates": ["LocalDpMod", "clipping"]}, 30) == {
        "candidates": ["LocalDpMod", "clipping"], "steps": 3, "batches": 3, "budget": 30.0}
