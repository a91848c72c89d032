"""The post-processing rule's benchmark (benchmarks/postprocessing.py): its reading is computed from the rows, and
its cells are the ones the rule concerns (update defenses only, >= 20 defended cells)."""

from __future__ import annotations

from conftest import bench_module


def _row(cell, seed, levels):
    return {"cell": cell, "defense": cell.split("|")[0], "seed": seed, "revision": "abc1234",
            "attacks": {a: {"level": lv, "value": 11.0, "null_p99": 15.0, "p_value": 0.4} for a, lv in levels.items()}}


def test_the_reading_counts_the_pairs_that_test_the_rule_and_names_a_break():
    pp = bench_module("postprocessing")
    raw = _row("raw|s0", 0, {"april": "none", "dlg": "none", "gradvit": "partial", "ig": "none"})
    held = _row("top-k 90 %|s0", 0, {"april": "none", "dlg": "none", "gradvit": "partial", "ig": "none"})
    text = pp.reading([raw, held])
    assert text.startswith("3 (cell, attack) pairs over 1 defended cells") and "held in every pair" in text
    broke = _row("quantisation 4 bits|s0", 0, {"april": "none", "dlg": "none", "gradvit": "none", "ig": "partial"})
    text = pp.reading([raw, held, broke])
    assert "6 (cell, attack) pairs over 2 defended cells" in text and "1 rose above none" in text
    assert "ig under quantisation 4 bits (seed 0): partial" in text
    undefined = _row("top-k 99 %|s0", 0, {"april": None, "dlg": "none", "gradvit": "none", "ig": "none"})
    assert "1 more did not measure" in pp.reading([raw, undefined])
    assert pp.reading([raw]) == "No pair measured yet: the rule is untested here."


def test_the_cells_are_update_defenses_only_and_at_least_twenty():
    pp = bench_module("postprocessing")
    from gradleak.defenses.base import defense_class

    defended = [c for c in pp.cells() if c["defenses"]]
    assert len(defended) >= 20
    assert all(defense_class(d["name"]).stage == "update" for c in defended for d in c["defenses"])
    assert {c["seed"] for c in pp.cells() if not c["defenses"]} == set(pp.SEEDS)
