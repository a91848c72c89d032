"""NVFlare integration: fl.engine=nvflare runs the builtin round protocol through NVFlare's executor and
messages (in process and in NVFlare's simulator) with the same uploads; the server's audit filter audits every
client of a round on its own upload, writes round_<r>/audit.json and blocks a leaking upload; the example job runs
in the simulator. ``pytest -k nvflare``."""

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

nvflare = pytest.importorskip("nvflare")  # installed by `make install` (the nvflare extra)

from gradleak.errors import BadInput  # noqa: E402
from gradleak.fl import Client  # noqa: E402
from gradleak.fl.engines import ENGINES, engine_of  # noqa: E402
from gradleak.fl.engines import nvflare_bridge as nvb  # noqa: E402
from gradleak.fl.engines.builtin import run_rounds  # noqa: E402
from gradleak.fl.engines.nvflare import NVFlareConfig, run_rounds_nvflare  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LR = 0.1
TOL = 1e-12  # float64 uploads: (sent − new) / lr is the upload to ~1e-16 here


def _data(n_clients=3, n=5, seed=0):  # the Flower parity tests' federation (tests/test_flower.py)
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n + i, 4, generator=g, dtype=torch.float64), torch.randint(0, 2, (n + i,), generator=g))
            for i in range(n_clients)]


def _net():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2).double()


def _clients(data):
    return [Client(i, x, y) for i, (x, y) in enumerate(data)]


def _kw(algorithm, defenses=True, rounds=3):
    from gradleak.defenses import build_defenses

    built = build_defenses([{"name": "clipping", "params": {"max_norm": 0.5}},
                            {"name": "gaussian_noise", "params": {"std": 0.01}}], seed=5) if defenses else []
    return dict(rounds=rounds, algorithm=algorithm, lr=LR, local_epochs=2, local_batch_size=3, seed=5, defenses=built)


def _assert_same_rounds(ref, got, tol=TOL):
    assert got.kept_rounds == ref.kept_rounds
    worst = 0.0
    for ra, rb in zip(ref.rounds, got.rounds):
        assert [u.client_id for u in rb] == [u.client_id for u in ra]
        for ua, ub in zip(ra, rb):
            assert ua.num_samples == ub.num_samples and ua.kind == ub.kind and ua.local_steps == ub.local_steps
            for k in ua.tensors:
                worst = max(worst, float((ub.tensors[k].double() - ua.tensors[k].double()).abs().max()))
    for sa, sb in zip(ref.round_states, got.round_states):
        for k in sa:
            worst = max(worst, float((sa[k].double() - sb[k].double()).abs().max()))
    assert worst <= tol, worst
    return worst


@pytest.mark.parametrize("algorithm", ["fedsgd", "fedavg"])
def test_nvflare_engine_equals_the_builtin_round_protocol(algorithm):
    """fl.engine=nvflare (in process: FLModel -> Shareable/DXO -> Executor -> FLModel) runs the same rounds as
    gradleak's own protocol: the same uploads to 1e-12 in float64, defenses included, FULL and DIFF replies."""
    data = _data()
    ref = run_rounds(_net(), _clients(data), **_kw(algorithm))
    for reply in ("FULL", "DIFF"):
        got = run_rounds_nvflare(_net(), _clients(data), nvflare=NVFlareConfig(reply=reply), **_kw(algorithm))
        assert got.kept_rounds == [0, 1, 2]
        _assert_same_rounds(ref, got)
        assert torch.allclose(got.model.weight, ref.model.weight, rtol=0, atol=TOL)
    # without defenses, what the server formed is what each client computed (to float64 rounding)
    for reply in ("FULL", "DIFF"):
        got = run_rounds_nvflare(_net(), _clients(data), nvflare=NVFlareConfig(reply=reply),
                                 **_kw(algorithm, defenses=False))
        for r, ups in enumerate(got.rounds):
            for u in ups:
                mine = got.nvflare_computed[(r, u.client_id)]
                for k, v in mine.items():
                    assert u.tensors[k].dtype == torch.float64
                    assert torch.allclose(u.tensors[k], v.double(), rtol=1e-13, atol=1e-15)


def test_nvflare_engine_secure_aggregation_and_withheld_match_builtin():
    data = _data()
    ref = run_rounds(_net(), _clients(data), rounds=2, algorithm="fedsgd", lr=LR, secure_aggregation=True)
    got = run_rounds_nvflare(_net(), _clients(data), rounds=2, algorithm="fedsgd", lr=LR, secure_aggregation=True)
    assert len(got.secure_sums) == 2
    for sa, sb in zip(ref.secure_sums, got.secure_sums):
        assert all(torch.allclose(sa.tensors[k].double(), sb.tensors[k], atol=1e-9) for k in sa.tensors)

    def withhold_client_1(c, model, **kw):  # a training-time step that withholds one client's update (RDLV-like)
        return None if c.client_id == 1 else c.local_update(model, algorithm=kw["algorithm"], lr=kw["lr"],
                                                             seed=kw["seed"], in_place=True)

    ref = run_rounds(_net(), _clients(data), rounds=2, algorithm="fedsgd", lr=LR, local_update=withhold_client_1)
    got = run_rounds_nvflare(_net(), _clients(data), rounds=2, algorithm="fedsgd", lr=LR, local_update=withhold_client_1)
    assert got.withheld == ref.withheld == [(0, 1), (1, 1)]
    _assert_same_rounds(ref, got)


def test_nvflare_engine_through_the_simulator_equals_builtin(tmp_path):
    """runtime simulator: a FedJob (GradleakController + GradleakExecutor) through NVFlare's SimulatorRunner, the
    server and every client in subprocesses (the federation cloudpickled into the workspace): the same uploads."""
    data = _data()
    kw = _kw("fedavg", rounds=2)
    ref = run_rounds(_net(), _clients(data), **kw)
    model = _net()
    got = run_rounds_nvflare(model, _clients(data), nvflare=NVFlareConfig(runtime="simulator", reply="FULL",
                                                                          workspace=str(tmp_path / "ws")), **kw)
    assert got.kept_rounds == [0, 1] and got.model is model
    _assert_same_rounds(ref, got)
    sent_last = got.round_states[-1]["weight"]
    assert torch.equal(model.weight.detach(), sent_last)  # the model object holds what the server sent last


def test_nvflare_engine_is_registered_configured_and_described():
    from gradleak.run.runner import validate

    assert "nvflare" in ENGINES.names()
    from gradleak.config.loading import load_yaml

    raw = load_yaml(str(ROOT / "examples/nvflare/vit_lora.yaml"))
    raw["fl"]["nvflare"] = {"runtime": "simulator", "reply": "DIFF"}
    _, cfg = validate(copy.deepcopy(raw))
    assert cfg.fl.nvflare.reply == "DIFF" and cfg.fl.nvflare.runtime == "simulator"
    eng = engine_of("nvflare")
    line = eng.describe(cfg.fl)
    assert "NVFlare 2.9 simulator" in line and "weight change (DIFF" in line and "\n" not in line
    eng.check(cfg)  # an honest attack runs in the simulator
    with pytest.raises(BadInput, match="fl.nvflare"):
        validate({**copy.deepcopy(raw), "fl": {**raw["fl"], "nvflare": {"reply": "weights"}}})

    class Poisoner:  # an attack that rewrites the weights the server sends: its hook cannot reach the simulator
        rewrites_weights = True

        def server_model(self, r, model):
            return model

    with pytest.raises(BadInput, match="runtime=inprocess"):
        run_rounds_nvflare(_net(), _clients(_data()), rounds=1, algorithm="fedsgd", lr=LR,
                           server_hook=Poisoner().server_model, nvflare=NVFlareConfig(runtime="simulator"))


def test_nvflare_missing_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvflare", None)  # import nvflare -> ImportError
    with pytest.raises(BadInput, match=r"optional `nvflare` extra.*pip install 'gradleak\[nvflare\]'"):
        nvb.require_nvflare()


# ------------------------------------------------------------------------------------------ the audit filter

TEXT = str(ROOT / "examples/nvflare/text_adapters.yaml")


def _example():
    import importlib

    sys.path.insert(0, str(ROOT / "examples" / "nvflare"))
    try:
        return importlib.import_module("job")
    finally:
        sys.path.pop(0)


def test_nvflare_audit_filter_audits_every_client_and_blocks(tmp_path):
    """The server's DXOFilter (on the task-data and task-result chains, in process) audits each client of the round
    on its own upload (UTR: every sentence of every client), writes round_1/audit.json after each result, and with
    block_at raises NVFlare's ContentBlockedException: the server drops every leaking result."""
    from nvflare.apis.filter import ContentBlockedException
    from nvflare.apis.fl_constant import FilterKey, FLContextKey
    from nvflare.apis.fl_context import FLContext

    from gradleak.integrations import nvflare as gln

    server, _ = gln.server_rounds_of_config(TEXT)
    executor = gln.executor_for(TEXT)
    audit = gln.NVFlareAudit(TEXT, str(tmp_path), attacks=["utr"], block_at="exact", quiet=True)
    kept = []

    class Keep:  # a filter before the audit that keeps each result as it arrived
        def process(self, shareable, fl_ctx):
            kept.append(copy.deepcopy(shareable))
            return shareable

        def set_prop(self, *a, **k):
            pass

    nvb.run_inprocess(server, executor, 3, 1, task_data_filters=[audit], task_result_filters=[Keep(), audit])
    assert server.blocked == [(0, 0), (0, 1), (0, 2)]  # every upload leaks exactly: all blocked, none aggregated
    assert server.out.rounds == [[]]
    res = json.loads((tmp_path / "round_1" / "audit.json").read_text())
    assert res["verdict"] == "leaks" and res["clients"] == [0, 1, 2] and res["block_at"] == "exact"
    utr = next(e for e in res["attacks"] if e["name"] == "utr")
    assert [row["client"] for row in utr["per_client"]] == [0, 1, 2]
    assert all(row["level"] == "exact" for row in utr["per_client"])
    assert utr["n_success"] == utr["n_total"] == 6
    assert [b["client"] for b in res["blocked"]] == [0, 1, 2]
    summary = json.loads((tmp_path / "nvflare_audit.json").read_text())
    assert [r["server_round"] for r in summary["rounds"]] == [1]
    # the filter itself raises NVFlare's ContentBlockedException (the server runner turns it into an error reply)
    ctx = FLContext()
    ctx.set_prop(FLContextKey.FILTER_DIRECTION, FilterKey.IN, private=True, sticky=False)
    with pytest.raises(ContentBlockedException, match="leaks at level exact"):
        audit.process(kept[0], ctx)


def test_nvflare_audit_filter_needs_the_sent_model_and_a_known_level(tmp_path):
    from nvflare.apis.fl_constant import FilterKey, FLContextKey
    from nvflare.apis.fl_context import FLContext
    from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
    from nvflare.app_common.utils.fl_model_utils import FLModelUtils

    from gradleak.integrations.nvflare import NVFlareAudit

    with pytest.raises(BadInput, match="block_at"):
        NVFlareAudit(TEXT, str(tmp_path), block_at="high")
    audit = NVFlareAudit(TEXT, str(tmp_path / "fresh"), quiet=True)
    ctx = FLContext()
    ctx.set_prop(FLContextKey.FILTER_DIRECTION, FilterKey.IN, private=True, sticky=False)
    result = FLModelUtils.to_shareable(FLModel(params={"w": torch.zeros(2).numpy()}, params_type=ParamsType.FULL,
                                               current_round=0))
    with pytest.raises(BadInput, match="task-data chain"):
        audit.process(result, ctx)


@pytest.mark.timeout(600)  # a budget for a hung simulator (its subprocesses), not a speed claim
def test_nvflare_example_text_adapters_runs_in_the_simulator(tmp_path):
    """The example job (MiniLM + adapters, 3 clients x 2 real sentences, FedSGD, FULL replies) in NVFlare's simulator
    with the audit filter on the server: every client audited, UTR recovers all 6 sentences."""
    job = _example()
    res = job.run(TEXT, str(tmp_path), rounds=1, attacks=["utr"])
    r = res["rounds"][0]
    assert r["verdict"] == "leaks" and "6 of 6" in r["headline"] and r["clients"] == [0, 1, 2] and not r["blocked"]
    assert (tmp_path / "round_1" / "audit.json").exists()


def test_nvflare_example_vit_lora_is_audited_in_process(tmp_path):
    """The ViT-S/14 + LoRA example (3 clients, one private image each, DIFF replies) through the same components in
    process: lora_span reconstructs every client's image; block_at strong blocks them."""
    job = _example()
    res = job.run(str(ROOT / "examples/nvflare/vit_lora.yaml"), str(tmp_path), rounds=1, attacks=["lora_span"],
                  runtime="inprocess", block_at="strong")
    r = res["rounds"][0]
    assert r["verdict"] == "leaks" and "lora_span" in r["headline"] and r["clients"] == [0, 1, 2]
    assert [b["client"] for b in r["blocked"]] == [0, 1, 2]
    entry = next(a for a in json.loads((tmp_path / "round_1" / "audit.json").read_text())["attacks"]
                 if a["name"] == "lora_span")
    assert entry["n_total"] == 3 and entry["n_success"] >= 2 and len(entry["per_client"]) == 3
