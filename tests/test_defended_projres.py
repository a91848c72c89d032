"""The ProjRes cells of benchmarks/defended.py: each noisy cell's information limit (K over the scored layers, the
strongest margin), its oracle ceiling joined by seed and per-layer K, its reading on the same upload (the three scores:
the chi2 matched filter reads below the edge), and the label computed from them."""

from __future__ import annotations


import pytest
from conftest import bench_module

@pytest.fixture(scope="module")
def d():
    return bench_module("defended")


def pr(noise="noise0.7", score="plain", level="none", ks=(0, 0, 0), margin=0.98, seed=0):
    m = {f"directions_above_edge_projres_layer{i}": float(k) for i, k in enumerate(ks)}
    m.update({"directions_above_edge_projres": float(sum(ks)), "margin_strongest_projres": margin,
              "drowning_noise_std_all_projres": 0.3, "auc": 0.5, "auc_null_p99": 0.9})
    return {"cell": f"projres|{noise}-{score}|seed{seed}", "part": "projres", "seed": seed, "split": "tuned",
            "defense": "Gaussian std 0.7", "level": level, "variant": {}, "metrics": m}


def labels(d, rows):
    return {r["cell"]: r["label"] for r in d.with_ceilings(rows)}


def test_k_zero_is_no_bound_on_projres_a_sibling_score_that_leaks_is_information_present(d):
    """K = 0 on every layer, plain and residual at none, chi2 partial on the same upload (seed 0, std 0.7 in the
    stored rows): the plain and residual cells read 'information present, missed', never 'absent'."""
    rows = [pr(score="plain"), pr(score="residual"), pr(score="chi2", level="partial")]
    got = labels(d, rows)
    assert got["projres|noise0.7-plain|seed0"] == "information present, missed"
    assert got["projres|noise0.7-residual|seed0"] == "information present, missed"
    assert got["projres|noise0.7-chi2|seed0"] == "leaks"


def test_absent_only_where_k_is_zero_and_every_score_on_the_upload_is_at_chance(d):
    rows = [pr(score=s) for s in ("plain", "residual", "chi2")]
    assert set(labels(d, rows).values()) == {"information absent"}
    # a score missing: undetermined, naming it
    got = labels(d, rows[:2])
    assert got["projres|noise0.7-plain|seed0"] == "undetermined (same upload: a score not measured)"


def test_the_ceiling_is_joined_by_seed_and_per_layer_k(d):
    ks = (3, 0, 1)
    rows = [pr(noise="noise0.1", score=s, ks=ks, margin=4.0) for s in ("plain", "residual", "chi2")]
    ceil = {"cell": d.projres_ceiling_id(0, ks), "part": "projres-ceiling", "seed": 0, "level": "partial",
            "K": 4, "K_layers": list(ks), "metrics": {"auc": 1.0, "auc_null_p99": 0.94}}
    got = d.with_ceilings(rows + [ceil])
    r = got[0]
    assert r["ceiling"]["K"] == 4 and r["ceiling"]["level"] == "partial"
    assert r["label"] == "information present, missed"
    assert d.limit_cells(r) == "4 | 4 (–) | partial: 1.000 (0.940)"
    # another per-layer split with the same total is another ceiling
    other = d.with_ceilings([pr(noise="noise0.1", score=s, ks=(1, 3, 0), margin=4.0) for s in ("plain", "residual",
                                                                                              "chi2")] + [ceil])
    assert "ceiling" not in other[0]
    assert other[0]["label"] == "undetermined (no oracle ceiling)"
    # a ceiling at chance with every score at chance: absent
    at_chance = {**ceil, "level": "none"}
    assert d.with_ceilings(rows + [at_chance])[0]["label"] == "information absent"


def test_the_ceilings_run_for_every_per_layer_k_the_noisy_uploads_leave(d):
    rows = [pr(noise="noise0.01", ks=(5, 2, 1)), pr(noise="noise0.1", ks=(1, 0, 0)), pr(ks=(0, 0, 0)),
            pr(noise="noise0.01", ks=(5, 2, 1), seed=11)]
    ks = d.projres_ceiling_ks(rows)
    assert ks == {0: {(5, 2, 1), (1, 0, 0)}, 11: {(5, 2, 1)}}
    cells = list(d.projres_cells(None, ks))
    assert sorted(r["cell"] for r, _ in cells) == sorted([d.projres_ceiling_id(0, (5, 2, 1)),
                                                           d.projres_ceiling_id(0, (1, 0, 0)),
                                                           d.projres_ceiling_id(11, (5, 2, 1))])
    for row, raw in cells:  # the undefended upload, the exact row space cut per layer
        assert raw["defenses"] == [] and "defense" not in raw
        assert raw["attack"]["noise"] == "none" and raw["attack"]["directions"] == row["K_layers"]
        assert row["part"] == "projres-ceiling"
