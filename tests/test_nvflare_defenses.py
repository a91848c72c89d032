"""NVFlare's own privacy filters as registered defenses, and run/ naming no defense (DESIGN §7)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("nvflare")

from nvflare.apis.dxo import DXO, DataKind, MetaKey  # noqa: E402
from nvflare.apis.fl_context import FLContext  # noqa: E402
from nvflare.apis.shareable import Shareable  # noqa: E402

from gradleak.defenses import build_defenses  # noqa: E402
from gradleak.defenses.nvflare import numpy_seed  # noqa: E402
from gradleak.errors import BadInput  # noqa: E402
from gradleak.fl.core import Update  # noqa: E402

LR = 0.05


def _update(steps: int = 1, client: int = 1) -> Update:
    g = torch.Generator().manual_seed(7)
    return Update({"enc.adapter.weight": torch.randn(12, 9, generator=g, dtype=torch.float64) * 1e-3,
                   "enc.adapter.bias": torch.randn(9, generator=g, dtype=torch.float64) * 1e-3,
                   "head.weight": torch.randn(4, 9, generator=g, dtype=torch.float64) * 1e-2},
                  num_samples=2, client_id=client, kind="gradient" if steps == 1 else "pseudo_gradient",
                  local_steps=steps)


def _direct(flt, update: Update) -> dict:
    """The NVFlare filter applied to the upload's Δw = -lr × upload as a WEIGHT_DIFF DXO, built here by hand."""
    dxo = DXO(data_kind=DataKind.WEIGHT_DIFF, data={k: t.numpy() * -LR for k, t in update.tensors.items()},
              meta={MetaKey.NUM_STEPS_CURRENT_ROUND: update.local_steps})
    out = flt.process_dxo(dxo, Shareable(), FLContext())
    return out.data


def _ours(update: Update, name: str, params: dict, seed: int = 3, ctx: dict | None = None) -> tuple[Update, object]:
    d = build_defenses([{"name": name, "params": params}], seed=seed)[0]
    return d.apply(update, ctx or {"client_id": update.client_id, "seed": 11, "lr": LR}), d


@pytest.mark.parametrize("steps", [1, 3])
def test_percentile_equals_nvflare_percentile_privacy(steps):
    from nvflare.app_common.filters.percentile_privacy import PercentilePrivacy

    u = _update(steps)
    out, _ = _ours(u, "nvflare_percentile", {"percentile": 80, "gamma": 0.004})
    ref = _direct(PercentilePrivacy(percentile=80, gamma=0.004), u)
    assert set(ref) == set(out.tensors)
    for k, v in ref.items():
        np.testing.assert_allclose(out.tensors[k].numpy() * -LR, v, rtol=1e-12, atol=0)
    kept = sum(int((t != 0).sum()) for t in out.tensors.values()) / sum(t.numel() for t in u.tensors.values())
    assert 0.15 < kept <= 0.21  # the top 20 % of the entries (ties aside)


def test_svt_equals_nvflare_svt_privacy_same_seed():
    from nvflare.app_common.filters.svt_privacy import SVTPrivacy

    u = _update()
    ctx = {"client_id": 1, "seed": 11, "lr": LR}
    np.random.seed(123)
    before = np.random.get_state()[1].copy()
    out, _ = _ours(u, "nvflare_svt", {"fraction": 0.3, "noise_var": 1.0}, seed=3, ctx=ctx)
    assert np.array_equal(np.random.get_state()[1], before)  # NumPy's global generator is restored
    np.random.seed(numpy_seed(ctx, 3))
    ref = _direct(SVTPrivacy(fraction=0.3, noise_var=1.0), u)
    for k, v in ref.items():
        np.testing.assert_allclose(out.tensors[k].numpy() * -LR, v, rtol=1e-12, atol=0)
    assert any(float(t.abs().sum()) > 0 for t in out.tensors.values())
    again, _ = _ours(u, "nvflare_svt", {"fraction": 0.3, "noise_var": 1.0}, seed=3, ctx=ctx)
    assert all(torch.equal(again.tensors[k], out.tensors[k]) for k in u.tensors)  # seeded: reproducible
    other, _ = _ours(u, "nvflare_svt", {"fraction": 0.3, "noise_var": 1.0}, seed=3, ctx={**ctx, "seed": 12})
    assert not all(torch.equal(other.tensors[k], out.tensors[k]) for k in u.tensors)  # a new round: new noise


@pytest.mark.parametrize("exclude", [["head.weight"], "adapter"])
def test_exclude_equals_nvflare_exclude_vars(exclude):
    from nvflare.app_common.filters.exclude_vars import ExcludeVars

    u = _update()
    out, _ = _ours(u, "nvflare_exclude", {"exclude_vars": exclude})
    ref = _direct(ExcludeVars(exclude_vars=exclude), u)
    assert set(ref) < set(u.tensors)
    for k, t in out.tensors.items():
        if k in ref:
            np.testing.assert_allclose(t.numpy() * -LR, ref[k], rtol=1e-12, atol=0)
        else:  # removed by NVFlare: a zero tensor in gradleak's upload (every client excludes it)
            assert float(t.abs().sum()) == 0.0


def test_svt_epsilon_as_nvflare_counts_it():
    u = _update()
    d = build_defenses([{"name": "nvflare_svt", "params": {"fraction": 0.25, "epsilon": 0.5, "noise_var": 0.2}}])[0]
    for rnd in range(3):  # client 1: three rounds; client 2: one
        d.apply(u, {"client_id": 1, "seed": rnd, "lr": LR})
    d.apply(Update(u.tensors, 2, 2), {"client_id": 2, "seed": 0, "lr": LR})
    entries = sum(t.numel() for t in u.tensors.values())
    per_round = 0.5 + int(np.ceil(entries * 0.25)) * 0.2  # epsilon + n_upload × noise_var
    assert d.epsilon_per_call(entries) == pytest.approx(per_round)
    rep = d.report([])
    assert rep["dp_epsilon"] == pytest.approx(3 * per_round)  # per round × rounds, the worst client
    assert rep["nvflare_svt_epsilon_client2"] == pytest.approx(per_round)
    assert rep["nvflare_svt_epsilon_per_round"] == pytest.approx(per_round)
    assert rep["dp_epsilon"] == pytest.approx(d.filters[1].get_privacy_spent())  # NVFlare's own accountant
    assert type(d).advice_epsilon(0.2, 3, rep["dp_epsilon"], 1e-5, None) == rep["dp_epsilon"]


def test_advice_brackets_and_what_the_server_is_told():
    from gradleak.defenses.declared import as_declared
    from gradleak.registry import DEFENSES
    from gradleak.run.advise_options import CANDIDATES, STANDARD, advise_section

    by_key = {c.get("key", c["name"]): c for c in CANDIDATES}
    assert by_key["nvflare_percentile"]["param"] == "percentile" and by_key["nvflare_percentile"]["stage"] == "update"
    assert by_key["nvflare_svt"]["param"] == "noise_var" and by_key["nvflare_svt"]["stage"] == "training"
    assert "nvflare_exclude" not in by_key and not DEFENSES.get("nvflare_exclude").advice
    assert set(STANDARD) == set(by_key) and STANDARD[:3] == ("dp_gaussian", "dpsgd", "secure_aggregation")
    assert DEFENSES.get("nvflare_svt").is_dp and not DEFENSES.get("nvflare_percentile").is_dp
    assert advise_section({"candidates": ["nvflare_percentile", "nvflare_svt"]})["candidates"] == [
        "nvflare_percentile", "nvflare_svt"]
    p = as_declared([{"name": "nvflare_percentile", "params": {"percentile": 90}}])
    assert p.sparsity == {"keep_fraction": pytest.approx(0.1), "scope": "global"} and not p.adds_noise
    s = as_declared([{"name": "nvflare_svt", "params": {}}])
    assert s.noise_unknown and s.sparsity["keep_fraction"] == 0.1


def test_missing_nvflare_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvflare", None)
    with pytest.raises(BadInput) as err:
        build_defenses([{"name": "nvflare_percentile", "params": {}}])
    assert "nvflare" in str(err.value) and "extra" in str(err.value)


def test_bad_parameters_are_refused():
    with pytest.raises(BadInput, match="percentile"):
        build_defenses([{"name": "nvflare_percentile", "params": {"percentile": 120}}])
    with pytest.raises(BadInput, match="fraction"):
        build_defenses([{"name": "nvflare_svt", "params": {"fraction": 0}}])


def test_run_names_no_dp_defense():
    """DESIGN §7: run/ never branches on a defense name; the DP defenses' specifics live in their classes."""
    pat = re.compile(r"\"(dpsgd|dp_gaussian)\"|isinstance\([^)]*(DPSGD|DPGaussian)")
    run = Path(__file__).resolve().parents[1] / "src" / "gradleak" / "run"
    hits = [f"{p.name}:{i}" for p in sorted(run.glob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if pat.search(line)]
    assert hits == []


def test_dp_hooks_say_what_run_used_to():
    from gradleak.defenses.base import is_dp_defense
    from gradleak.registry import DEFENSES

    dpg = DEFENSES.get("dp_gaussian")
    assert "central DP" in dpg.describe({"where": "server"}) and dpg.describe({"where": "client"}) == ""
    assert is_dp_defense("dp_gaussian") and is_dp_defense("dpsgd") and not is_dp_defense("clipping")
    assert not is_dp_defense("secure_aggregation")
    claims = build_defenses([{"name": "dp_gaussian", "params": {"noise_multiplier": 1.0, "where": "server"}}])[0] \
        .dp_claims(None, lambda z, n, d: z * n, 1e-5)
    assert [set(c) for c in claims] == [{"name", "where", "clip", "covers", "delta", "claim"}]
    assert claims[0]["covers"] == ["final_model", "every_round"] and claims[0]["claim"](4, {})[0] == 4.0
    assert DEFENSES.get("dpsgd").clip_fit[0] == "max_grad_norm" and dpg.clip_fit[1] == "update_norms"


def test_the_advice_table_prints_svts_own_delta():
    """SVT's ε is pure DP as NVFlare counts it: the advice row carries δ = 0 and the table prints it (a DP-Gaussian row
    keeps the advice's δ)."""
    from gradleak.registry import DEFENSES
    from gradleak.run.audit_report import advice_rows

    row = {"defense": "nvflare_svt", "parameter": "noise_var", "strength": 1.33, "bracket": [100, 0.001],
           "levels": {"utr": "none"}, "accuracy": 0.2, "cost": 0.5, "epsilon": 59270.0, "epsilon_delta": 0.0,
           "status": "stopped"}
    gauss = {**row, "defense": "dp_gaussian", "epsilon": 19.0}
    gauss.pop("epsilon_delta")
    cells = {r[0]: r for r in advice_rows({"rows": [row, gauss], "delta": 1e-5, "baseline": {"accuracy": 0.7}})}
    assert "(δ = 0;" in " ".join(cells["nvflare_svt"]) and "(δ = 1e-05;" in " ".join(cells["dp_gaussian"])
    assert DEFENSES.get("nvflare_svt").epsilon_delta == 0.0 and DEFENSES.get("dp_gaussian").epsilon_delta is None
