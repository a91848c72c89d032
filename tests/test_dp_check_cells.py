"""benchmarks/dp_check.py measures each check once: no two cells of its grid run the same config with the same
breakage, no two rows the section shows hold the same measurement (the same ε, interval and 99.9 % lower end of a
threat model: DP-SGD's canaries at a seed where ``dp_gaussian client z=1`` runs are that cell's draw again, the
module docstring), and its table shows each (mechanism, seed) once. Reads the committed rows; runs no check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import bench_module

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"

@pytest.fixture(scope="module")
def d():
    return bench_module("dp_check")


def _checks(d) -> list[tuple[dict, tuple]]:
    return [(row, args) for row, job, args in d.cells("", Path("unused"), timing=True) if job is d.check]


def _key(x) -> str:
    return "None" if x is None else f"{float(x):.9g}"


def measurement_twice(rows: list[dict]) -> list[tuple[str, str, str]]:
    """(threat model, row, earlier row) for each threat-model measurement a row shares with an earlier one."""
    seen: dict[tuple, str] = {}
    twice = []
    for r in rows:
        for t, m in (r.get("measured") or {}).items():
            key = (t, _key(m.get("epsilon")), *map(_key, m.get("interval") or ()), _key(m.get("strict_lower")))
            if key in seen:
                twice.append((t, r["cell"], seen[key]))
            seen.setdefault(key, r["cell"])
    return twice


def table_pairs(text: str) -> list[tuple[str, str]]:
    """The first two columns of every data line of the section's tables (mechanism and seed, or mechanism and
    breakage for the simulated ones)."""
    return [tuple(c.strip() for c in line.split("|")[1:3]) for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| mechanism ")]


def test_every_cell_id_and_every_check_config_once(d):
    from gradleak.run import validate

    ids = d.cell_ids()
    assert len(ids) == len(set(ids))
    seen: dict[str, str] = {}
    for row, args in _checks(d):
        _, cfg = validate(d.cell_config(*args[:2]))
        key = json.dumps([cfg.model_dump(), list(args[2:])], sort_keys=True, default=str)
        assert key not in seen, f"{row['cell']} runs the config {seen.get(key)} runs"
        seen[key] = row["cell"]
    # DP-SGD runs where no dp_gaussian client z=1 cell runs (module docstring)
    client = {s for row, args in _checks(d) if row["mechanism"] == "dp_gaussian client z=1" for s in [row["seed"]]}
    assert client and not client & set(d.seeds_of("dpsgd z=1"))


def test_the_section_shows_no_measurement_twice(d):
    rows = d.latest_rows(BENCH / "out" / "dp_check.jsonl")
    shown, gone = d.in_grid(rows)
    checks = [r for r in shown if "measured" in r]
    assert {r["cell"] for r in checks} == {row["cell"] for row, _ in _checks(d)}  # every check of the grid, measured
    assert measurement_twice(checks) == []
    pairs = table_pairs(d.table(rows))
    assert pairs and len(pairs) == len(set(pairs))
    # the rows the grid no longer builds stay in the JSONL, named in the section, not shown
    assert not {r["cell"] for r in shown} & set(gone)
    assert all(cell in d.table(rows) for cell in gone)


def test_the_checks_fail_on_a_duplicate(d):
    """The two checks above can fail: a copied row is a measurement twice, and a table of it shows its pair twice."""
    rows = [r for r in d.in_grid(d.latest_rows(BENCH / "out" / "dp_check.jsonl"))[0] if "measured" in r]
    copy = {**rows[0], "cell": rows[0]["mechanism"] + " again|seed" + str(rows[0]["seed"])}
    assert measurement_twice(rows + [copy]) == [(t, copy["cell"], rows[0]["cell"]) for t in rows[0]["measured"]]
    twice = "| a | 0 (shipped) | x |\n| a | 0 (shipped) | y |\n| a | 1 (held out) | z |"
    assert len(set(table_pairs(twice))) < len(table_pairs(twice))
