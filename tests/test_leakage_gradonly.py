"""benchmarks/leakage.py's gradient-only gate: a conclusion uses the gradient-only arm only when the
tuned arm at least matches the prior, and 'the attack fails without BN accounting' / 'DP-SGD protects through the
GroupNorm it forces' hold only when the BN-aware attack beats the arm by more than the SSIM null's spread. The checks
are read from synthetic cell rows (no model is run)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "leakage.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_leakage_gradonly", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(ssim: float, prior: float = 0.155, null_median: float = 0.084, null_p99: float = 0.61) -> dict:
    """Client 2's metrics as the leakage unit writes them (one image: RDLV = (SSIM − prior) / prior)."""
    m = {"ssim": ssim, "ssim_prior": prior, "rdlv": (ssim - prior) / prior, "rdlv_null_p99": (null_p99 - prior) / prior,
         "rdlv_null_median": (null_median - prior) / prior, "ssim_null_median": null_median, "ssim_null_p99": null_p99,
         "psnr_max": 15.0, "accuracy": 0.8}
    return {"metrics": {f"{k}_client2" if k != "accuracy" else k: v for k, v in m.items()}, "command": "gradleak run X"}


def _rows(bench, arm: float, full: float, groupnorm: float) -> dict:
    c = bench.GRADONLY_CHOSEN
    held = bench.GRADONLY_HELDOUT
    rows = {"null/seed0": _row(full), f"gradonly/tune/{c}": _row(arm), f"gradonly/seed{held}/full": _row(full),
            f"gradonly/seed{held}/tuned": _row(arm), "gradonly/group/none": _row(groupnorm)}
    rows.update({f"gradonly/group/{s}": _row(min(groupnorm, 0.05)) for s in bench.GRADONLY_DP_SIGMAS})
    return rows


def _verdicts(bench, rows: dict) -> dict[str, str]:
    checks: list[list[str]] = []
    _, gsum = bench._gradonly_section(rows, checks)
    bench._dpsgd_tuned(rows, checks, gsum)
    out = {}
    for finding, _, verdict in checks:
        key = "gate" if finding.startswith("Gate") else "bn" if "without BN" in finding else "dp"
        out[key] = verdict
    return out


def test_an_arm_below_the_prior_concludes_nothing(bench):
    v = _verdicts(bench, _rows(bench, arm=0.05, full=0.9, groupnorm=0.05))
    assert v["gate"].startswith("❌")
    assert v["bn"].startswith("⛔") and v["dp"].startswith("⛔")  # not "reproduced", whatever the margin


def test_a_margin_beyond_the_null_spread_holds_and_one_within_it_does_not(bench):
    v = _verdicts(bench, _rows(bench, arm=0.2, full=0.9, groupnorm=0.2))  # margin 0.7 > spread 0.526, GroupNorm at chance
    assert v == {"gate": "✅ passes", "bn": "✅ reproduced", "dp": "✅ reproduced"}
    v = _verdicts(bench, _rows(bench, arm=0.7, full=0.9, groupnorm=0.7))  # margin 0.2 within the spread; GN leaks
    assert v == {"gate": "✅ passes", "bn": "❌ not reproduced", "dp": "❌ not reproduced"}


def test_the_tuned_cells_run_the_chosen_setting_without_a_bn_term(bench):
    cells = {c["cell"]: c["overrides"] for c in bench.cells()}
    chosen = list(dict(bench.GRADONLY_TUNE)[bench.GRADONLY_CHOSEN])
    for cell in (f"gradonly/seed{bench.GRADONLY_HELDOUT}/tuned", "gradonly/group/none",
                 *(f"gradonly/group/{s}" for s in bench.GRADONLY_DP_SIGMAS)):
        assert "attack.ablation=gradient_only" in cells[cell] and all(o in cells[cell] for o in chosen)
    assert all("attack.ablation=gradient_only" in cells[f"gradonly/tune/{n}"] for n, _ in bench.GRADONLY_TUNE)
