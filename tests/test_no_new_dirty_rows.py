"""No live benchmark row from uncommitted code in benchmarks/out.

A row whose ``revision`` ends in ``+dirty`` was written while src/ differed from the commit it names
(``benchmarks/_bench.revision``): no commit holds the code behind it, so no reader may take it. Every live JSONL
(``benchmarks/out/*.jsonl`` but the ``*.history.jsonl`` files) must hold none: commit src/ first, then write the rows
from a clean worktree of that commit. A dirty row leaves a live file only with a reason,
through ``scripts/retire_dirty_rows.py``: superseded by a later row of the same cell from committed code, or retired
with what its rerun costs; either way it is kept in ``<name>.history.jsonl`` with ``superseded_reason``."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"
LIVE = sorted(p for p in OUT.glob("*.jsonl") if not p.name.endswith(".history.jsonl"))


def _retire_module():
    spec = importlib.util.spec_from_file_location("retire_dirty_rows", ROOT / "scripts" / "retire_dirty_rows.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def dirty_rows(path: Path) -> Counter:
    """``{revision: rows}`` of the ``+dirty`` rows of one JSONL file."""
    found: Counter = Counter()
    for line in path.read_text().splitlines():
        if line.strip():
            rev = str(json.loads(line).get("revision") or "")
            if rev.endswith("+dirty"):
                found[rev] += 1
    return found


def test_live_files_are_listed():
    assert LIVE and all(not p.name.endswith(".history.jsonl") for p in LIVE)


@pytest.mark.parametrize("path", LIVE, ids=lambda p: p.name)
def test_no_dirty_row(path):
    found = dirty_rows(path)
    assert not found, (f"{path.name}: {dict(found)} row(s) written from uncommitted code -- commit src/ first, then "
                       "write the rows from a clean worktree; a stored one leaves only through "
                       "scripts/retire_dirty_rows.py (superseded, or retired with its rerun's cost)")


def test_the_check_catches_a_dirty_row(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text(json.dumps({"cell": "a", "revision": "abc1234"}) + "\n"
                 + json.dumps({"cell": "b", "revision": "abc1234+dirty"}) + "\n"
                 + json.dumps({"cell": "c", "revision_committed_with": "abc1234"}) + "\n")
    assert dirty_rows(p) == {"abc1234+dirty": 1}
    with pytest.raises(AssertionError, match="written from uncommitted code"):
        test_no_dirty_row(p)


def test_retire_moves_superseded_dirty_rows_with_a_reason_and_keeps_the_order(tmp_path):
    mod = _retire_module()
    p = tmp_path / "b.jsonl"
    rows = [{"cell": "a", "v": 1, "revision": "1111111+dirty"},   # superseded by the later clean a
            {"cell": "b", "v": 1, "revision": "1111111"},
            {"cell": "c", "v": 1, "revision": "2222222+dirty"},   # no committed row replaces it
            {"cell": "d", "v": 2, "revision": "3333333"},
            {"cell": "d", "v": 1, "revision": "4444444+dirty"},   # latest of its cell: a clean row before is no rerun
            {"cell": "a", "v": 2, "revision": "5555555"}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = p.read_text()
    assert len(mod.retire(p)) == 1 and p.read_text() == before  # report only: nothing moves
    moved = mod.retire(p, apply=True)
    assert [r["cell"] for r, _ in moved] == ["a"]
    live = [json.loads(ln) for ln in p.read_text().splitlines()]
    assert [(r["cell"], r["v"]) for r in live] == [("a", 2), ("b", 1), ("c", 1), ("d", 2), ("d", 1)]
    hist = [json.loads(ln) for ln in (tmp_path / "b.history.jsonl").read_text().splitlines()]
    assert hist == [dict(rows[0], superseded_reason="written from uncommitted code (1111111+dirty); superseded by "
                                                    "this cell's row from committed code (5555555)")]
    with pytest.raises(SystemExit, match="--why"):
        mod.retire(p, retire=["c"], apply=True)
    mod.retire(p, retire=["c", "d"], why="2 cells, 10 min of one core", apply=True)
    assert [r["cell"] for r in (json.loads(ln) for ln in p.read_text().splitlines())] == ["a", "b", "d"]
    hist = [json.loads(ln) for ln in (tmp_path / "b.history.jsonl").read_text().splitlines()]
    assert [(r["cell"], r["superseded_reason"]) for r in hist[1:]] == [
        ("c", "written from uncommitted code (2222222+dirty); not rerun: 2 cells, 10 min of one core"),
        ("d", "written from uncommitted code (4444444+dirty); not rerun: 2 cells, 10 min of one core")]
    assert dirty_rows(p) == {}
