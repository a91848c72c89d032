"""The defended tables' labels are computed from each row's numbers: ``benchmarks/defended.py``
``cell_label`` on hand-made rows, the ceiling joined by seed and K, and no hand-written conclusion about a cell left in
the script."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import bench_module

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"

@pytest.fixture(scope="module")
def d():
    return bench_module("defended")


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
    # a run ceiling at chance: for an image cell that is the whole evidence (the sub-edge test is UTR's word bag)
    r = {**row(directions_above_edge=15.0, margin_strongest=4.0), "ceiling": {"K": 15, "level": "none"}}
    assert d.cell_label(r) == "information absent"
    # ... while a text cell with the same ceiling still needs its sub-edge test
    t = {**row(part="text", directions_above_edge=15.0, margin_strongest=4.0), "ceiling": {"K": 15, "level": "none"}}
    assert d.cell_label(t) == "undetermined (no sub-edge test)"


def test_present_but_missed_when_the_ceiling_or_the_sub_edge_test_is_beyond_its_null(d):
    r = {**row(directions_above_edge=15.0, margin_strongest=4.0), "ceiling": {"K": 15, "level": "partial"}}
    assert d.cell_label(r) == "information present, missed"
    assert d.cell_label(row(part="text", subedge_p_value=0.001)) == "information present, missed"
    assert d.cell_label(row(part="text", subedge_p_value=0.001, directions_above_edge=0.0)) == \
        "information present, missed"
    assert d.cell_label(row(level="undefined")) == "undetermined (level undefined; no oracle ceiling)"
    assert d.cell_label(row(part="text", level="undefined")) == \
        "undetermined (level undefined; no oracle ceiling; no sub-edge test)"
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
    assert out["image|noise10x-gap|seed11"]["label"] == "undetermined (no oracle ceiling)"
    assert d.ceiling_ks([noisy, other, ceil, row(directions_above_edge=0.0)]) == {0: {15}, 11: {15}}
    # the Reading counts the labels, and the table shows K, the strongest margin and the ceiling
    text = d.table([noisy, other, ceil])
    assert "1 information present, missed, 1 undetermined (of 2)" in text
    assert "| 15 | 4 (–) | strong: 30.0 (13.0) | information present, missed |" in text


def test_the_sub_edge_test_is_asked_only_of_the_text_parts(d):
    """The sub-edge test is UTR's word bag below the edge: a text cell at level none needs it beside a ceiling at
    chance; for image and PEFTLeak cells a ceiling at chance is enough for 'information absent', a ceiling beyond its
    null still reads 'information present, missed', and no ceiling stays undetermined (ProjRes needs its scores on the
    same upload: tests/test_defended_projres.py)."""
    chance, beyond = {"K": 3, "level": "none"}, {"K": 3, "level": "strong"}
    for part in ("image", "peftleak"):
        assert not d.needs_subedge({"part": part})
        assert d.cell_label({**row(part=part), "ceiling": chance}) == "information absent", part
        assert d.cell_label({**row(part=part), "ceiling": beyond}) == "information present, missed", part
        assert d.cell_label(row(part=part)) == "undetermined (no oracle ceiling)", part
    assert d.needs_subedge({"part": "text"})
    assert d.cell_label({**row(part="text"), "ceiling": chance}) == "undetermined (no sub-edge test)"
    assert d.cell_label({**row(part="text", subedge_p_value=0.4), "ceiling": chance}) == "information absent"
    # PEFTLeak: no bin above the edge is a ceiling at chance by construction
    pl = {**row(part="peftleak"), "metrics": {"directions_above_edge_adapter_bins": 0.0,
                                              "margin_strongest_adapter_bins": 0.97}}
    assert d.ceiling_state(pl) == ("chance", "K = 0 (no bin above the noise edge)")
    assert d.cell_label(pl) == "information absent"


def test_peftleak_rows_are_joined_to_their_ceiling_and_show_the_signal_scale(d):
    def pl(cell, defense, level, seed=0, **m):
        return {"cell": cell, "part": "peftleak", "attack": "peftleak", "seed": seed, "split": "tuned", "B": 16,
                "defense": defense, "level": level, "variant": {"noise": "none"} if defense != "none" else "as configured",
                "metrics": {f"{k}_adapter_bins": v for k, v in m.items()}}

    undefended = pl("peftleak|none|B16|seed0", "none", "exact", drowning_noise_std_all=2.5e-14,
                    drowning_noise_std_median=3.1e-15)
    noisy = pl("peftleak|noise1e-14-none|B16|seed0", "Gaussian std 1e-14", "none", directions_above_edge=40.0,
               margin_strongest=2.5, spectral_margin=1.01)
    drowned = pl("peftleak|noise1e-13-none|B16|seed0", "Gaussian std 1e-13", "none", directions_above_edge=0.0,
                 margin_strongest=0.96)
    ceil = {"cell": "peftleak|ceiling-K40|B16|seed0", "part": "peftleak-ceiling", "seed": 0, "split": "tuned",
            "B": 16, "K": 40, "defense": "none (oracle)", "level": "partial", "variant": {"keep_bins": 40},
            "metrics": {"psnr_max": 21.0, "psnr_max_null_p99": 14.7, "patch_recovery_rate": 0.25, "bins_kept": 40}}
    assert d.peftleak_ceiling_ks([undefended, noisy, drowned, ceil]) == {0: {40}}
    out = {r["cell"]: r for r in d.with_ceilings([undefended, noisy, drowned, ceil])}
    assert out[noisy["cell"]]["ceiling"]["patch_recovery_rate"] == 0.25
    assert out[noisy["cell"]]["label"] == "information present, missed"
    assert out[drowned["cell"]]["label"] == "information absent"
    text = d.table([undefended, noisy, drowned, ceil])
    assert "| 40 | 2.5 (1.01) | partial: 21.0 (14.7), patches 0.250 | information present, missed |" in text
    assert "| Gaussian std 1e-13 | 2.5e-14 / 3.1e-15 |" in text  # the signal scale beside the std
    assert "| 0 | 0.96 (–) | chance by construction | information absent |" in text
    assert "1 information present, missed, 1 information absent (of 2)" in text


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
