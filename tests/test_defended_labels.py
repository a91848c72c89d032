"""The defended tables' labels are computed from each row's numbers (issue 51 item 5): ``benchmarks/defended.py``
``cell_label`` on hand-made rows, the ceiling joined by seed and K, and no hand-written conclusion about a cell left in
the script."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def d():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module("defended")


def row(part="image", level="none", defense="Gaussian std 1e-3", **metrics):
    t = {"image": "block0_lora_A", "text": "embedding_adapter"}.get(part, "x")
    return {"cell": f"{part}|c|seed0", "part": part, "seed": 0, "split": "tuned", "defense": defense, "level": level,
            "variant": {"rank_cut": "gap"},
            "metrics": {(k if k.startswith("subedge") else f"{k}_{t}"): v for k, v in metrics.items()}}


def test_a_level_beyond_the_null_leaks_whatever_the_rest(d):
    for level in ("partial", "strong", "exact"):
        assert d.cell_label(row(level=level, directions_above_edge=0.0)) == "leaks"


def test_a_near_one_margin_at_the_cut_never_reads_absent(d):
    """The margin at the rank cut (1.02 here, as the SmolLM2 per-tensor top-k cells) is not evidence of absence: with
    directions above the edge and no ceiling or sub-edge test the cell is undetermined, naming both."""
    r = row(part="text", spectral_margin=1.02, margin_strongest=3.5, directions_above_edge=6.0)
    assert d.cell_label(r) == "undetermined (no oracle ceiling; no sub-edge test)"
    r = row(part="text", spectral_margin=1.02)  # the margin alone, as the old rows: nothing read off it either
    assert d.cell_label(r) == "undetermined (no oracle ceiling; no sub-edge test)"
    # even with the sub-edge test at chance, directions above the edge and no ceiling stay undetermined
    r = row(part="text", spectral_margin=1.02, margin_strongest=3.5, directions_above_edge=6.0, subedge_p_value=0.4)
    assert d.cell_label(r) == "undetermined (no oracle ceiling)"


def test_absent_only_where_ceiling_and_sub_edge_test_are_both_at_chance(d):
    none_above = dict(spectral_margin=0.9, margin_strongest=0.98, directions_above_edge=0.0)
    assert d.ceiling_state(row(part="text", **none_above))[0] == "chance"
    assert d.cell_label(row(part="text", subedge_p_value=0.3, **none_above)) == "information absent"
    assert d.cell_label(row(part="text", **none_above)) == "undetermined (no sub-edge test)"
    # an all-zero tensor (global top-k 99 %): the ceiling is at chance by construction
    zero = row(part="text", drowning_noise_std_all=0.0, drowning_noise_std=0.0)
    assert d.cell_label({**zero, "metrics": {**zero["metrics"], "subedge_p_value": 0.5}}) == "information absent"
    # a run ceiling at chance, and no sub-edge test for images: undetermined, not absent
    r = {**row(directions_above_edge=15.0, margin_strongest=4.0), "ceiling": {"K": 15, "level": "none"}}
    assert d.cell_label(r) == "undetermined (no sub-edge test)"


def test_present_but_missed_when_the_ceiling_or_the_sub_edge_test_is_beyond_its_null(d):
    r = {**row(directions_above_edge=15.0, margin_strongest=4.0), "ceiling": {"K": 15, "level": "partial"}}
    assert d.cell_label(r) == "information present, missed"
    assert d.cell_label(row(part="text", subedge_p_value=0.001)) == "information present, missed"
    assert d.cell_label(row(part="text", subedge_p_value=0.001, directions_above_edge=0.0)) == \
        "information present, missed"
    assert d.cell_label(row(level="undefined")) == "undetermined (level undefined; no oracle ceiling; no sub-edge test)"
    assert d.cell_label({**row(), "error": "boom"}) == "undetermined (not measured)"


def test_with_ceilings_joins_each_noisy_image_row_to_its_seed_and_k(d):
    noisy = {**row(directions_above_edge=15.0, margin_strongest=4.0), "cell": "image|noise10x-gap|seed0"}
    other = {**row(directions_above_edge=15.0), "cell": "image|noise10x-gap|seed11", "seed": 11}
    ceil = {"cell": "image|ceiling-K15|seed0", "part": "image-ceiling", "seed": 0, "split": "tuned",
            "defense": "none (oracle)",
            "level": "strong", "K": 15, "metrics": {"psnr_max": 30.0, "psnr_max_null_p99": 13.0}}
    out = {r["cell"]: r for r in d.with_ceilings([noisy, other, ceil])}
    assert out["image|noise10x-gap|seed0"]["ceiling"]["psnr_max"] == 30.0
    assert out["image|noise10x-gap|seed0"]["label"] == "information present, missed"
    assert "ceiling" not in out["image|noise10x-gap|seed11"]  # seed 11's image has no ceiling run: not borrowed
    assert out["image|noise10x-gap|seed11"]["label"] == "undetermined (no oracle ceiling; no sub-edge test)"
    assert d.ceiling_ks([noisy, other, ceil, row(directions_above_edge=0.0)]) == {0: {15}, 11: {15}}
    # the Reading counts the labels, and the table shows K, the strongest margin and the ceiling
    text = d.table([noisy, other, ceil])
    assert "1 information present, missed, 1 undetermined (of 2)" in text
    assert "| 15 | 4 (–) | strong: 30.0 (13.0) | information present, missed |" in text


def test_no_hand_written_conclusion_about_a_cell_is_left(d):
    src = (BENCH / "defended.py").read_text()
    for phrase in ("information absent in the clipped", "information absent at our upload", "because the information "
                   "is absent", "not a missed test", "strong at 100x", "6 of them are among the lowest"):
        assert phrase not in src, phrase
    # every label the tables print is one of the four computed ones
    assert re.findall(r'return "(leaks|information [a-z, ]+)"', src) == ["leaks", "information present, missed",
                                                                        "information absent"]


def test_an_attack_that_used_no_direction_still_reports_the_tensors_information_limit():
    """UTR under the paper's DP-Gaussian cuts its rank at 0; the tensor's limit (directions above the edge, strongest
    margin, the std that drowns every direction) is still read off its spectrum -- before, the rank-0 case returned a
    sentinel (drowning_noise_std_all = 0) that read like an all-zero upload. An all-zero tensor still reads 0."""
    import torch

    from gradleak.attacks.common.subspace import spectral_margin

    g = torch.Generator().manual_seed(0)
    G = torch.randn(40, 3, generator=g, dtype=torch.float64) @ torch.randn(3, 60, generator=g, dtype=torch.float64)
    std = 1e-3
    noisy = G + std * torch.randn(40, 60, generator=g, dtype=torch.float64)
    m0 = spectral_margin([noisy], 0, std)
    assert m0["signal_rank"] == 0 and m0["directions_above_edge"] == 3 and m0["drowning_noise_std_all"] > 0
    assert m0["margin_strongest"] == spectral_margin([noisy], 3, std)["margin_strongest"] > 1.05
    assert m0["spectral_margin"] != m0["spectral_margin"] and m0["drowning_noise_std"] == 0.0  # no direction used
    z = spectral_margin([torch.zeros(40, 60, dtype=torch.float64)], 0, std)
    assert z["drowning_noise_std_all"] == 0.0 and z["directions_above_edge"] == 0
