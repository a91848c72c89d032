"""The one resumable cell loop: one "done" rule (the latest row has no "error"), failed cells retried in the
run and on the next one, rows appended in the parent as they finish, the benchmarks' row helper."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradleak.errors import BadInput
from gradleak.run.cells import Cell, cell_dir_name, done_cells, error_text, run_cells

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _row(cell, value, err, seconds):
    r = {"cell": cell.id}
    if err is not None:
        r["error"] = error_text(err)
    else:
        r["value"] = value
    return r


def _quiet(_msg):
    return None


def test_done_rule_skips_finished_cells_and_reruns_failed_ones(tmp_path):
    jsonl = tmp_path / "r.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in [
        {"cell": "a", "value": 1}, {"cell": "b", "error": "RuntimeError: x"}, {"cell": "c", "value": 3},
        {"cell": "c", "error": "RuntimeError: later"}]) + "\n")
    assert done_cells(jsonl) == {"a"}  # c's latest row failed: not done
    calls = []

    def job(x):
        calls.append(x)
        return x * 10

    latest = run_cells([Cell(c, job, (i,)) for i, c in enumerate("abcd")], jsonl, _row, log=_quiet)
    assert calls == [1, 2, 3]
    assert list(latest) == ["a", "b", "c", "d"] and latest["b"] == {"cell": "b", "value": 10}
    assert [r["cell"] for r in _rows(jsonl)] == ["a", "b", "c", "c", "b", "c", "d"]  # append-only
    calls.clear()
    run_cells([Cell(c, job, (i,)) for i, c in enumerate("abcd")], jsonl, _row, log=_quiet)
    assert calls == []  # nothing left to do


def test_a_failed_cell_is_retried_once_in_the_run_and_never_counts_as_done(tmp_path):
    jsonl = tmp_path / "r.jsonl"
    tries = {"n": 0}

    def flaky():
        tries["n"] += 1
        raise RuntimeError(f"try {tries['n']}")

    logs = []
    latest = run_cells([Cell("ok", int, ("4",)), Cell("bad", flaky)], jsonl, _row, log=logs.append)
    assert tries["n"] == 2 and latest["bad"]["error"] == "RuntimeError: try 2" and latest["ok"]["value"] == 4
    assert any("FAILED RuntimeError: try 1" in m for m in logs) and any("retrying 1" in m for m in logs)
    assert done_cells(jsonl) == {"ok"}
    run_cells([Cell("ok", int, ("4",)), Cell("bad", flaky)], jsonl, _row, retries=0, log=_quiet)
    assert tries["n"] == 3  # the next run tries it again


def test_a_row_with_error_is_a_failure_too_and_redo_reruns_everything(tmp_path):
    jsonl = tmp_path / "r.jsonl"
    seen = []

    def row(cell, value, err, seconds):
        seen.append(cell.id)
        return {"cell": cell.id, **value}

    run_cells([Cell("x", dict, (), None)], jsonl, lambda c, v, e, s: {"cell": c.id, "error": "no result"}, retries=0,
              log=_quiet)
    assert done_cells(jsonl) == set()
    run_cells([Cell("x", dict, ()), Cell("y", dict, ())], jsonl, row, log=_quiet)
    assert seen == ["x", "y"] and done_cells(jsonl) == {"x", "y"}
    run_cells([Cell("x", dict, ()), Cell("y", dict, ())], jsonl, row, redo=True, log=_quiet)
    assert seen == ["x", "y", "x", "y"]


def test_several_rows_per_cell_under_another_key_and_fatal_errors(tmp_path):
    jsonl = tmp_path / "r.jsonl"

    def arm(name):
        return [{"cell": f"{name}|{r}", "arm": name, "round": r} for r in range(3)]

    run_cells([Cell("p", arm, ("p",)), Cell("q", arm, ("q",))], jsonl, lambda c, v, e, s: v, key="arm", log=_quiet)
    assert [r["cell"] for r in _rows(jsonl)] == ["p|0", "p|1", "p|2", "q|0", "q|1", "q|2"]
    assert done_cells(jsonl, key="arm") == {"p", "q"}

    def refuse():
        raise BadInput("x", "refused.", "fix it.")

    with pytest.raises(BadInput, match="refused"):
        run_cells([Cell("z", refuse)], jsonl, _row, fatal=(BadInput,), log=_quiet)
    assert len(_rows(jsonl)) == 6  # a fatal error writes no row
    with pytest.raises(ValueError, match="a row of cell 'w'"):
        run_cells([Cell("w", dict)], jsonl, lambda c, v, e, s: {"cell": "other"}, log=_quiet)


def test_rows_are_written_as_before_and_the_pool_executor_agrees(tmp_path):
    """A row is ``json.dumps(row)`` plus a newline (the format of benchmarks/out/*.jsonl); the local pool gives the
    rows the in-process loop gives."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    cells = [Cell(f"c{i}", pow, (i, 2)) for i in range(3)]
    run_cells(cells, a, _row, log=_quiet)
    run_cells(cells, b, _row, executor="local", workers=2, log=_quiet)
    assert a.read_text() == "".join(json.dumps({"cell": f"c{i}", "value": i * i}) + "\n" for i in range(3))
    assert sorted(a.read_text().splitlines()) == sorted(b.read_text().splitlines())
    with pytest.raises(BadInput, match="unknown executor"):
        run_cells(cells, a, _row, executor="threads", log=_quiet)
    assert cell_dir_name("seed=1,x=\"a/b\"").startswith("seed=1_x=_a_b_-")


@pytest.mark.parametrize("executor", ["inline", "local"])
def test_skip_holds_back_cells_not_yet_started_which_are_not_done_and_not_retried(tmp_path, executor):
    """``skip``: once it says so (a spent budget), every cell not yet started is held back -- its row records
    NotStarted, it is not retried in this call, and it is not done, so the next call runs it. A started cell
    finishes. (The local pool is handed a job only when a worker is free, so there too nothing queued has started.)"""
    import time

    jsonl = tmp_path / "r.jsonl"
    cells = [Cell("first", time.sleep, (0.5,))] + [Cell(f"c{i}", time.sleep, (0.3,)) for i in range(3)]
    t0 = time.perf_counter()

    def skip(c):  # the budget is spent while the first cell runs
        return c.id != "first" and time.perf_counter() - t0 > 0.2

    latest = run_cells(cells, jsonl, _row, executor=executor, workers=1, log=_quiet, skip=skip)
    assert "error" not in latest["first"]
    held = [c for c in ("c0", "c1", "c2") if latest[c].get("error", "").startswith("NotStarted")]
    assert held == ["c0", "c1", "c2"]
    assert len(_rows(jsonl)) == 4  # no retry
    assert done_cells(jsonl) == {"first"} | {c for c in ("c0", "c1", "c2") if c not in held}
    again = run_cells(cells, jsonl, _row, executor=executor, workers=1, log=_quiet)
    assert all("error" not in again[c] for c in ("c0", "c1", "c2"))


def test_the_pool_stays_warm_between_calls_and_a_dead_worker_is_replaced():
    """Two calls reuse the same spawned worker (imports and per-process caches paid once: an --advise search's
    probes); a worker that dies fails its own job only, and the next call gets a fresh pool that works."""
    import os

    from gradleak.run import cells

    pid1 = [v for _, v in cells.pool_results(os.getpid, [()], 1)]
    pid2 = [v for _, v in cells.pool_results(os.getpid, [()], 1)]
    assert pid1 == pid2 and pid1[0] != os.getpid()
    died = [v for _, v in cells.pool_results(os._exit, [(3,)], 1)]
    assert isinstance(died[0], BaseException)  # BrokenProcessPool, recorded by the caller as the cell's error
    pid3 = [v for _, v in cells.pool_results(os.getpid, [()], 1)]
    assert isinstance(pid3[0], int) and pid3 != pid1


def test_the_benchmarks_row_helper(tmp_path, monkeypatch):
    """``_bench.run_cells``: the row's leading fields, what ``fill`` copies, ``error`` (+ error_fields) on failure,
    ``wall_seconds`` last; the published rows' shapes."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import _bench

    jsonl = tmp_path / "b.jsonl"

    def job(x):
        if x < 0:
            raise ValueError("negative")
        return {"metrics": {"m": x}}

    def fill(res, row):
        row.update(metrics=res["metrics"])
        return f"m {res['metrics']['m']}"

    cells = [({"cell": "p", "table": "t"}, job, (2,)), ({"cell": "n", "table": "t"}, job, (-1,))]
    latest = _bench.run_cells(jsonl, cells, fill, label="t")
    assert list(latest["p"]) == ["cell", "table", "metrics", "wall_seconds"]
    assert list(latest["n"]) == ["cell", "table", "error", "wall_seconds"] and latest["n"]["error"] == "ValueError: negative"
    from gradleak.run.results import history_path

    # n retried once in the run: its first try is superseded (kept in the history), one row per cell stays
    assert [r["cell"] for r in _rows(jsonl)] == ["p", "n"] and [r["cell"] for r in _rows(history_path(jsonl))] == ["n"]
    latest = _bench.run_cells(jsonl, cells, fill, label="t", wall_seconds=False,
                              error_fields={"metrics": {"rouge1": 0.0}, "timings": {}})
    assert latest["n"] == {"cell": "n", "table": "t", "error": "ValueError: negative", "metrics": {"rouge1": 0.0},
                           "timings": {}}
    assert [r["cell"] for r in _rows(jsonl)] == ["p", "n"] and _rows(jsonl)[1] == latest["n"]
    assert len(_rows(history_path(jsonl))) == 3  # p was done: not rerun; n's three earlier tries


@pytest.mark.parametrize("name", ["leakage", "peftleak", "projres", "utr", "lora_vit", "flower_dp", "flower_utility"])
def test_published_jsonl_rows_have_the_loop_key(name):
    """Resuming benchmarks/out must skip its finished cells: every published row carries the id the loop reads."""
    key = "arm" if name == "flower_utility" else "cell"
    rows = _rows(BENCHMARKS / "out" / f"{name}.jsonl")
    assert rows and all(key in r for r in rows) and done_cells(BENCHMARKS / "out" / f"{name}.jsonl", key)


def test_a_rerun_replaces_its_cells_row_and_the_superseded_rows_are_kept_as_history(tmp_path):
    """The JSONL keeps one row per cell, the latest, in the order the cells first appear (what the reports
    read is unchanged); earlier runs and failed tries move to ``<name>.history.jsonl`` in their order. The benchmarks'
    row helper does it after every run (``--rerun`` included)."""
    from gradleak.run.results import append_jsonl, history_path, latest_by_cell, supersede_rows

    j = tmp_path / "b.jsonl"
    for r in ({"cell": "a", "v": 1}, {"cell": "b", "error": "x"}, {"cell": "a", "v": 2}, {"note": "no cell"},
              {"cell": "c", "v": 5}, {"cell": "b", "v": 3}):
        append_jsonl(j, r)
    before = latest_by_cell(j)
    assert supersede_rows(j) == 3
    assert _rows(j) == [{"cell": "a", "v": 2}, {"cell": "b", "v": 3}, {"cell": "c", "v": 5}]
    assert latest_by_cell(j) == before and list(latest_by_cell(j)) == list(before)
    assert history_path(j) == tmp_path / "b.history.jsonl"
    assert _rows(history_path(j)) == [{"cell": "a", "v": 1}, {"cell": "b", "error": "x"}, {"note": "no cell"}]
    assert supersede_rows(j) == 0 and supersede_rows(tmp_path / "none.jsonl") == 0  # idempotent; no file, no-op
    append_jsonl(j, {"cell": "a", "v": 9})
    assert supersede_rows(j) == 1 and _rows(history_path(j))[-1] == {"cell": "a", "v": 2}  # appended, in order
    assert [r["v"] for r in _rows(j)] == [9, 3, 5]

    # the benchmarks' helper: a --rerun leaves one row per cell, the old one in the history
    import sys
    sys.path.insert(0, str(BENCHMARKS))
    from _bench import run_cells as bench_cells

    k = tmp_path / "bench.jsonl"
    cells = [({"cell": "x"}, lambda: 1, ()), ({"cell": "y"}, lambda: 2, ())]
    bench_cells(k, cells, lambda res, row: row.update(v=res) or "ok", label="t", wall_seconds=False)
    bench_cells(k, cells[:1], lambda res, row: row.update(v=10 * res) or "ok", label="t", redo=True,
                wall_seconds=False)
    assert _rows(k) == [{"cell": "x", "v": 10}, {"cell": "y", "v": 2}]
    assert _rows(history_path(k)) == [{"cell": "x", "v": 1}]


def test_processes_sharing_a_jsonl_lose_no_row(tmp_path):
    """``append_jsonl`` rewrites the file under ``jsonl_lock``: two processes appending to one JSONL at once (a lane
    split over ``--part`` processes) keep every row."""
    import subprocess
    import sys

    j = tmp_path / "shared.jsonl"
    code = ("import sys\nfrom gradleak.run.results import append_jsonl\n"
            "for i in range(400):\n    append_jsonl(sys.argv[1], {'cell': sys.argv[2] + str(i)})\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(j), tag]) for tag in ("p", "q")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert sorted(r["cell"] for r in _rows(j)) == sorted(f"{t}{i}" for t in "pq" for i in range(400))
