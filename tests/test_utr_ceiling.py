"""UTR's oracle ceiling (``attack.directions: K``; benchmarks/defended.py's text ceilings): at full rank it is the plain
attack on the noise-free upload; below it the word bag is read through the K strongest directions only. The sub-edge
ranking of a pruned upload is graded against its null (the evaluation's ``sub_edge_enrichment``)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _run(tmp_path, name, **attack):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    from defended import TEXT, base

    from gradleak.run.audit import judge
    from gradleak.run.runner import run_config, validate

    raw = base(TEXT, {"name": "utr", "time_budget": 60.0, **attack}, 0)
    raw["data"]["batch_size"] = 2
    raw["defenses"] = []
    res = run_config(copy.deepcopy(raw), str(tmp_path / name))
    _, cfg = validate(copy.deepcopy(raw))
    return res, judge(cfg.attack_cls.reconstruction, res["metrics"], cfg).as_dict()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ceiling")
    return {"plain": _run(tmp, "plain"), "all": _run(tmp, "all", directions=100_000),
            "k6": _run(tmp, "k6", directions=6)}


def test_at_full_rank_the_ceiling_is_the_plain_attack_on_the_noise_free_upload(runs):
    (plain, jp), (full, jf) = runs["plain"], runs["all"]
    assert jf["level"] == jp["level"] == "exact"
    for k in ("word_bag_recall", "word_bag_size", "rouge1_f1", "sentences_exact", "word_bag_recall_null_p99"):
        assert full["metrics"][k] == plain["metrics"][k], k


def test_below_full_rank_the_word_bag_is_read_through_k_directions(runs):
    (plain, _), (k6, j6) = runs["plain"], runs["k6"]
    assert k6["metrics"]["word_bag_size"] <= 6 < plain["metrics"]["word_bag_size"]
    assert k6["metrics"]["sentences_exact"] == 0  # no positions: no sentence search through 6 directions
    assert j6["level"] in ("none", "partial")  # graded by the same null as every word bag
    assert k6["metrics"]["word_bag_recall_null_p99"] == k6["metrics"]["word_bag_recall_null_p99"]  # a null exists


def test_a_ranking_without_a_cut_under_pruning_and_the_chi_square_cut_unchanged():
    from gradleak.attacks.common.sub_edge import sub_edge_test, unit_directions

    gen = torch.Generator().manual_seed(5)
    b, n, V, sigma = 32, 64, 500, 1e-3
    D = unit_directions(torch.randn(V, n, generator=gen, dtype=torch.float64))
    G = sigma * torch.randn(b, n, generator=gen, dtype=torch.float64)
    plain = sub_edge_test([G], D, sigma)
    ranked = sub_edge_test([G], D, sigma, max_tokens=20, rank_only=True)
    assert not plain["signal_present"] and plain["tokens"] == []  # noise alone: nothing past the cut
    assert len(ranked["tokens"]) == 20  # a ranking, whatever the law (never a word bag: UTR marks it pruned)
    assert ranked["signal_present"] == plain["signal_present"]
    # the ranking does not depend on the scale: sigma only scales every score
    assert sub_edge_test([G], D, 10 * sigma, max_tokens=20, rank_only=True)["tokens"] == ranked["tokens"]


class _Tok:
    """Token ids = word numbers; 0 and 1 are the special tokens."""
    all_special_ids = [0, 1]
    vocab_size = 1000

    def __call__(self, sent, add_special_tokens=True):
        ids = [int(w) for w in sent.split()]
        return {"input_ids": ([0] if add_special_tokens else []) + ids + ([1] if add_special_tokens else [])}


def test_the_enrichment_of_a_ranking_against_random_public_tokens():
    from gradleak.evaluation.text import _sub_edge_enrichment

    rng = torch.Generator().manual_seed(0)
    pool = [" ".join(str(int(v)) for v in torch.randint(2, 1000, (8,), generator=rng)) for _ in range(200)]
    true = {5, 17, 300, 301, 302, 999}
    good = sorted(true) + [v for v in range(2, 1000) if v not in true]
    out = {}
    _sub_edge_enrichment(good, true, pool, _Tok(), {0, 1}, 2, out, 500, 0, 1000)
    assert out["sub_edge_enrichment"] == pytest.approx(1000 / len(true))  # every true token on top
    assert out["sub_edge_enrichment_p_value"] == pytest.approx(1 / 501)  # no null draw reaches it
    assert out["sub_edge_enrichment"] > out["sub_edge_enrichment_null_p99"]
    bad = [v for v in range(2, 1000) if v not in true] + sorted(true)  # the batch's tokens ranked last
    out = {}
    _sub_edge_enrichment(bad, true, pool, _Tok(), {0, 1}, 2, out, 500, 0, 1000)
    assert out["sub_edge_enrichment"] == 0.0 and out["sub_edge_enrichment_p_value"] > 0.5
