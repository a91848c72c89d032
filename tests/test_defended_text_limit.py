"""The defended table's text cells (benchmarks/defended.py): the sub-edge state read from the enrichment's empirical
p-value where there is no chi-square one (a top-k pruned upload), an all-zero embedding adapter at chance, and each
noisy text row joined to its oracle ceiling by (model, B, seed, K)."""

from __future__ import annotations


import pytest
from conftest import bench_module

@pytest.fixture(scope="module")
def d():
    return bench_module("defended")


def text_row(model=None, B=2, seed=0, level="none", **metrics):
    m = {(k if k.startswith(("subedge", "sub_edge")) else f"{k}_embedding_adapter"): v for k, v in metrics.items()}
    r = {"cell": f"text|{model + '|' if model else ''}topk0.9-per_tensor-plain|B{B}|seed{seed}", "part": "text",
         "B": B, "seed": seed, "split": "tuned", "defense": "top-k 90 % per_tensor", "level": level,
         "variant": {"sparsity_aware": False}, "metrics": m}
    if model:
        r["model"] = model
    return r


def test_the_enrichment_p_value_is_read_where_there_is_no_chi_square_one(d):
    r = text_row(directions_above_edge=0.0, margin_strongest=0.9, sub_edge_enrichment=461.0,
                 sub_edge_enrichment_null_p99=565.0, sub_edge_enrichment_p_value=0.049)
    assert d.subedge_state(r) == ("chance", "sub-edge enrichment p 0.049")
    assert d.cell_label(r) == "information absent"
    r["metrics"]["sub_edge_enrichment_p_value"] = 0.001
    assert d.subedge_state(r)[0] == "beyond"
    assert d.cell_label(r) == "information present, missed"
    # the chi-square p-value, where the noise is Gaussian, is read first
    r["metrics"]["subedge_p_value"] = 0.4
    assert d.subedge_state(r) == ("chance", "sub-edge p 0.4")
    assert "enrichment p 0.001" in d.subedge_cell(r["metrics"])


def test_an_all_zero_embedding_adapter_is_at_chance_for_both_tests(d):
    r = text_row(directions_above_edge=0.0, margin_strongest=0.0, drowning_noise_std_all=0.0)
    assert d.subedge_state(r)[0] == "chance" and d.ceiling_state(r)[0] == "chance"
    assert d.cell_label(r) == "information absent"
    r = text_row(directions_above_edge=0.0, margin_strongest=0.5, drowning_noise_std_all=1e-3)  # something uploaded
    assert d.cell_label(r) == "undetermined (no sub-edge test)"


def test_text_rows_get_the_ceiling_of_their_model_batch_seed_and_k(d):
    a = text_row(directions_above_edge=3.0, margin_strongest=2.2, sub_edge_enrichment_p_value=0.3)
    b = text_row(model="minilm-L6", B=4, directions_above_edge=3.0, margin_strongest=2.2,
                 sub_edge_enrichment_p_value=0.3)
    c = text_row(seed=11, directions_above_edge=3.0, margin_strongest=2.2, sub_edge_enrichment_p_value=0.3)
    ceil = {"cell": d.text_ceiling_id(None, 2, 0, 3), "part": "text-ceiling", "seed": 0, "B": 2, "K": 3,
            "level": "partial", "metrics": {"word_bag_recall": 14.6, "word_bag_recall_null_p99": 9.8}}
    ceil6 = {"cell": d.text_ceiling_id("minilm-L6", 4, 0, 3), "part": "text-ceiling", "seed": 0, "B": 4, "K": 3,
             "model": "minilm-L6", "level": "none", "metrics": {"word_bag_recall": 2.0, "word_bag_recall_null_p99": 5.0}}
    out = {r["cell"]: r for r in d.with_ceilings([a, b, c, ceil, ceil6])}
    assert out[a["cell"]]["ceiling"]["cell"] == ceil["cell"]
    assert out[a["cell"]]["label"] == "information present, missed"
    assert out[b["cell"]]["ceiling"]["cell"] == ceil6["cell"]
    assert out[b["cell"]]["label"] == "information absent"  # ceiling and enrichment both at chance
    assert "ceiling" not in out[c["cell"]]  # seed 11 has no ceiling run: not borrowed
    assert out[c["cell"]]["label"] == "undetermined (no oracle ceiling)"
    assert d.limit_cells(out[a["cell"]]).endswith("partial: 14.6 (9.8)")
    # the ceilings to run: the K of the rows at level none, per (model, B, seed)
    assert d.text_ceiling_ks([a, b, c, {**a, "cell": "x", "level": "partial"}]) == {
        (None, 2, 0): {3}, ("minilm-L6", 4, 0): {3}, (None, 2, 11): {3}}
