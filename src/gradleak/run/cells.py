"""The one resumable cell loop: sweeps, audit grids and every benchmark run their cells through :func:`run_cells`.

A *cell* is an id and a job (``fn(*args)``). The loop reads the JSONL of earlier rows, skips every cell whose
*latest* row has no ``"error"`` (the one "done" rule), runs the others, turns each outcome into its row(s) with the
caller's ``row`` function and appends them as they finish -- one atomic rewrite of the file per row
(:func:`gradleak.run.results.append_jsonl`), from this (the parent) process only. A failed cell (its row
has ``"error"``) gets ``retries`` more tries in the same run and is run again on the next one; it never counts as
done. A killed run therefore restarts without redoing or duplicating a finished cell.

Executors: ``inline`` (default) -- one cell after another in this process; ``local`` -- a pool of spawned
processes (one torch thread each, one cell per task); ``ray`` -- plain ``ray.remote`` tasks on a cluster (the
``sweeps`` extra), started once per call. Jobs for ``local`` and ``ray`` must be importable at module level.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from gradleak.errors import BadInput

EXECUTORS = ("inline", "local", "ray")


@dataclass(frozen=True)
class Cell:
    """One unit of work: ``fn(*args)`` under ``id``; ``info`` is for the caller's row function (never sent to a
    worker)."""

    id: str
    fn: Callable[..., Any]
    args: tuple = ()
    info: Any = None


#: ``row(cell, value, error, seconds)`` -> the cell's row, or its rows (``error`` is None when ``fn`` returned
#: ``value``; ``seconds``: the job's own run time)
RowFn = Callable[[Cell, Any, "BaseException | None", float], "dict | list[dict]"]


def error_text(err: BaseException) -> str:
    """How a failed cell's row states its error: ``"<type>: <message>"``."""
    return f"{type(err).__name__}: {err}"


def cell_dir_name(cid: str) -> str:
    """A file-system-safe, unique directory name for the cell ``cid`` (readable prefix + a hash of the id)."""
    keep = "".join(ch if ch.isalnum() or ch in "-_.=" else "_" for ch in cid)[:80]
    return f"{keep}-{hashlib.sha1(cid.encode()).hexdigest()[:8]}"


def done_cells(jsonl: str | Path, key: str = "cell") -> set[str]:
    """The cells of ``jsonl`` whose latest row has no ``"error"`` (the one "done" rule)."""
    from gradleak.run.results import latest_by_cell

    return {c for c, r in latest_by_cell(jsonl, key).items() if "error" not in r}


class NotStarted(Exception):
    """A cell that ``skip`` held back before it started (e.g. a spent time budget): recorded like a failure, so it is
    not done and a later run starts it."""

    def __init__(self, msg: str = "held back before it started (the time budget was spent)"):
        super().__init__(msg)


def run_cells(cells: Sequence[Cell], jsonl: str | Path, row: RowFn, *, executor: str = "inline",
              workers: int | None = None, retries: int = 1, redo: bool = False, key: str = "cell",
              fatal: tuple[type[BaseException], ...] = (), label: str = "cells",
              describe: Callable[[dict], str] | None = None, log: Callable[[str], Any] = print,
              skip: Callable[[Cell], bool] | None = None) -> dict[str, dict]:
    """Run (or resume) ``cells`` in their order, appending their rows to ``jsonl``; returns the latest row of every
    cell that has one, in the cells' order.

    ``key``: the row field that holds the cell id (every row ``row`` returns must carry it). ``redo``: run every
    cell, finished or not (its new row becomes the latest). ``fatal``: error types that stop the loop at once
    (raised, no row written) instead of being recorded. ``describe(row)``: the progress line of a finished cell.
    ``skip(cell)``: asked of each cell not yet started, before it starts and again whenever another cell finishes
    (inline and local executors); True holds it back: its row records :class:`NotStarted` (not done) and it is not
    retried in this call."""
    from gradleak.run.results import append_jsonl, latest_by_cell

    if executor not in EXECUTORS:
        raise BadInput("--executor", f"unknown executor '{executor}'.", "use local or ray.")
    jsonl = Path(jsonl)
    done = set() if redo else done_cells(jsonl, key)
    todo = [c for c in cells if c.id not in done]
    log(f"[{label}] {len(cells)} cells: {len(cells) - len(todo)} done before, {len(todo)} to run"
        + ("" if executor == "inline" else f" ({executor} executor)"))
    for attempt in range(1 + max(0, retries)):
        if not todo:
            break
        if attempt:
            log(f"[{label}] retrying {len(todo)} failed cell(s)")
        failed = []
        for k, (cell, value, err, seconds) in enumerate(_execute(todo, executor, workers, skip), 1):
            if err is not None and isinstance(err, fatal):
                raise err
            rows = row(cell, value, err, seconds)
            rows = [rows] if isinstance(rows, dict) else list(rows)
            for r in rows:
                if r.get(key) != cell.id:
                    raise ValueError(f"a row of cell {cell.id!r} has {key}={r.get(key)!r}")
                append_jsonl(jsonl, r)
            last = rows[-1] if rows else {"error": error_text(err) if err is not None else "no row"}
            if isinstance(err, NotStarted):
                msg = f"not started: {err}"
            elif "error" in last:
                failed.append(cell)
                msg = f"FAILED {last['error']}"
            else:
                msg = describe(last) if describe else "done"
            log(f"[{label}] {k}/{len(todo)} {cell.id}: {msg} ({seconds:.0f} s)")
        todo = failed
    latest = latest_by_cell(jsonl, key)
    return {c.id: latest[c.id] for c in cells if c.id in latest}


def timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, BaseException | None, float]:
    """``fn(*args)`` as (value, None, seconds), or (None, the exception, seconds) when it raised (in a worker: errors
    come back as values)."""
    t0 = time.perf_counter()
    try:
        return fn(*args), None, time.perf_counter() - t0
    except Exception as err:  # noqa: BLE001 -- the loop records it
        return None, err, time.perf_counter() - t0


def _execute(todo: list[Cell], executor: str, workers: int | None,
             skip: Callable[[Cell], bool] | None = None) -> Iterator[tuple[Cell, Any, Any, float]]:
    """Yield (cell, value, error, seconds) as cells finish (a cell ``skip`` holds back: a :class:`NotStarted`)."""
    if executor == "inline":
        for cell in todo:
            if skip is not None and skip(cell):
                yield cell, None, NotStarted(), 0.0
                continue
            yield (cell, *timed(cell.fn, *cell.args))
        return
    if executor == "ray":
        yield from _execute_ray(todo, workers)
        return
    jobs = [(cell.fn, *cell.args) for cell in todo]
    hold = None if skip is None else (lambda i: skip(todo[i]))
    for i, payload in pool_results(timed, jobs, workers or min(len(todo), os.cpu_count() or 1), hold=hold):
        if isinstance(payload, BaseException):  # held back, or the worker itself died (or the result did not pickle)
            yield todo[i], None, payload, 0.0
        else:
            yield (todo[i], *payload)


def _execute_ray(todo: list[Cell], workers: int | None) -> Iterator[tuple[Cell, Any, Any, float]]:
    try:
        import ray
    except ImportError:
        raise BadInput("--executor", "the Ray executor needs Ray, which is not installed.",
                       "pip install 'gradleak[sweeps]' (ray>=2.55), or use --executor local.") from None
    started = not ray.is_initialized()
    if started:  # once per call, not per cell
        t0 = time.perf_counter()
        ray.init(num_cpus=workers or None, include_dashboard=False, log_to_driver=False)
        print(f"[cells] ray started in {time.perf_counter() - t0:.1f} s (once for these cells)", flush=True)
    remote = ray.remote(num_cpus=1)(timed)
    refs = {remote.remote(cell.fn, *cell.args): cell for cell in todo}
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        try:
            payload = ray.get(ready[0])
        except Exception as err:  # noqa: BLE001 -- the task itself failed: recorded, retried
            payload = (None, err, 0.0)
        yield (refs[ready[0]], *payload)
    if started:
        ray.shutdown()


def _die_with_parent(parent_pid: int, interval: float = 0.5) -> None:
    """Pool worker initializer: the worker exits as soon as the process that started it is gone (SIGKILL of a sweep
    or an audit leaves no orphaned worker holding memory; its resource tracker then sees EOF and exits too). A daemon
    thread watches the parent pid (a reparented worker's ``getppid`` changes); on Linux ``PR_SET_PDEATHSIG`` is not
    used, since it fires when the *thread* that spawned the worker ends, not the process."""
    import threading

    def watch() -> None:
        import time

        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(interval)

    if os.getppid() != parent_pid:
        os._exit(1)
    threading.Thread(target=watch, name="gradleak-parent-watch", daemon=True).start()


#: the warm worker pools of this process, by size (:func:`pool_results`)
_POOLS: dict[int, Any] = {}


def _shutdown_pools() -> None:
    for pool in list(_POOLS.values()):
        pool.shutdown(wait=False, cancel_futures=True)
    _POOLS.clear()


def _warm_pool(workers: int):
    """The process pool of ``workers`` spawned processes this process keeps between calls (started on first use;
    each worker starts when a job first needs it). A pool whose worker died is replaced."""
    import atexit
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    pool = _POOLS.get(workers)
    if pool is not None and getattr(pool, "_broken", False):
        pool.shutdown(wait=False, cancel_futures=True)
        pool = None
    if pool is None:
        if not _POOLS:
            atexit.register(_shutdown_pools)
        pool = ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"),
                                   initializer=_die_with_parent, initargs=(os.getpid(),))
        _POOLS[workers] = pool
    return pool


def pool_results(fn: Callable, jobs: list[tuple], workers: int, hold: Callable[[int], bool] | None = None):
    """Yield (job index, ``fn(*job)`` or the exception it raised) as jobs finish, from ``workers`` spawned processes
    (``OMP_NUM_THREADS=1`` for them: one torch thread each). ``fn`` must be importable at module level.

    The pool stays warm between calls (:func:`_warm_pool`): an ``--advise`` search's probes, an audit's runs and a
    sweep's cells reuse the workers, which pay the imports (torch, transformers: seconds) and fill their per-process
    caches (image sets, nulls) once. Every job is independent of what ran before it in its worker, as in the
    ``inline`` executor, where all run in one process. An interrupt (or any error of the loop itself) shuts the pool
    down, so no worker outlives a killed run. Jobs are handed to the pool as workers free up (never more than
    ``workers`` at once), so a job not yet handed over has not started: ``hold(i)``, asked of each just before it
    would be, True holds it back (yielded as a :class:`NotStarted`)."""
    from collections import deque
    from concurrent.futures import FIRST_COMPLETED, wait

    env = os.environ.copy()
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned workers
    n = max(1, int(workers))
    pool = None
    try:
        pool = _warm_pool(n)
        waiting, running = deque(range(len(jobs))), {}
        while waiting or running:
            while waiting and len(running) < n:
                i = waiting.popleft()
                if hold is not None and hold(i):
                    yield i, NotStarted()
                    continue
                running[pool.submit(fn, *jobs[i])] = i
            if not running:
                break
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for f in finished:
                i = running.pop(f)
                try:
                    yield i, f.result()
                except Exception as err:  # noqa: BLE001 -- the caller records it
                    yield i, err
    except BaseException:
        _POOLS.pop(n, None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        raise
    finally:
        os.environ.clear()
        os.environ.update(env)
