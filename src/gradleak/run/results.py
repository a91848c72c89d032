"""Results contract (docs/DESIGN.md §4): ``results.json`` written atomically; the cell loop (:mod:`gradleak.run.cells`)
appends to a JSONL and reads back the latest row of every cell."""

from __future__ import annotations

import contextlib
import json
import os
import platform
from pathlib import Path
from typing import Any, Iterable, Iterator

from gradleak.atomic import atomic_open, write_text_atomic


def environment() -> dict[str, Any]:
    import torch

    env = {"python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
           "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except Exception:  # pragma: no cover - transformers is a hard dependency
        pass
    from gradleak import __version__

    env["gradleak"] = __version__
    return env


def _default(o: Any) -> Any:
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except Exception:  # pragma: no cover
        pass
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o)}")


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """``obj`` as JSON at ``path`` through a temporary file and a rename (:func:`gradleak.atomic.atomic_open`). Created
    owner-only (0600) and left so: results.json and audit.json hold the private sentences
    (:data:`gradleak.report.images.PRIVATE_ARTIFACTS`, the one register), and no JSON of a run is ever opened to
    others."""
    with atomic_open(path) as f:
        json.dump(obj, f, indent=2, default=_default, allow_nan=True)


@contextlib.contextmanager
def jsonl_lock(path: str | Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the JSONL's folder while the JSONL is read and rewritten: processes that share
    one JSONL (a benchmark lane split over ``--part`` processes) never rewrite it over each other's rows. The folder
    is locked, not a lock file, so no file is left beside the results. A platform without ``fcntl`` gets no lock
    (one process per JSONL there)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover -- not POSIX
        yield
        return
    folder = Path(path).parent
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _rewrite(path: Path, text: str) -> None:
    write_text_atomic(path, text)  # owner-only, as write_json_atomic


def append_jsonl(path: str | Path, obj: Any) -> None:
    """Append one line atomically (single write + fsync of a line shorter than the pipe buffer is not
    guaranteed atomic, so we rewrite the file through a temp file: an interrupted write loses nothing), under
    :func:`jsonl_lock`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with jsonl_lock(path):
        old = path.read_text() if path.exists() else ""
        if old and not old.endswith("\n"):
            old = old.rsplit("\n", 1)[0] + "\n" if "\n" in old else ""
        _rewrite(path, old + json.dumps(obj, default=_default) + "\n")


def write_jsonl_atomic(path: str | Path, rows: Iterable[Any]) -> None:
    """``rows`` as the JSONL at ``path``, one line each as :func:`append_jsonl` writes it, in one atomic rewrite under
    :func:`jsonl_lock`."""
    path = Path(path)
    with jsonl_lock(path):
        _rewrite(path, "".join(json.dumps(r, default=_default) + "\n" for r in rows))


def history_path(path: str | Path) -> Path:
    """Where :func:`supersede_rows` keeps the rows a JSONL's reruns superseded: ``<name>.history.jsonl``."""
    path = Path(path)
    return path.with_name(path.name[:-len(".jsonl")] + ".history.jsonl" if path.name.endswith(".jsonl")
                          else path.name + ".history")


def supersede_rows(path: str | Path, key: str = "cell") -> int:
    """A rerun of a cell replaces its row: ``path`` keeps the latest row of every cell, in the order the cells first
    appear (what :func:`latest_by_cell` reads, unchanged), and every row it superseded (an earlier run, a failed try)
    or that names no cell moves to :func:`history_path`, appended in its order (the tuning history, kept). Returns how
    many rows moved; a JSONL with one row per cell is left untouched."""
    path = Path(path)
    if not path.exists():
        return 0
    with jsonl_lock(path):
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
        latest: dict[str, int] = {}  # cell -> its last line; the dict keeps the order the cells first appear
        for i, ln in enumerate(lines):
            try:
                r = json.loads(ln)
            except json.JSONDecodeError:
                continue
            if isinstance(r, dict) and key in r:
                latest[str(r[key])] = i
        keep = list(latest.values())
        kept = set(keep)
        moved = [ln for i, ln in enumerate(lines) if i not in kept]
        if not moved:
            return 0
        hist = history_path(path)
        old = hist.read_text() if hist.exists() else ""
        if old and not old.endswith("\n"):
            old += "\n"
        _rewrite(hist, old + "".join(ln + "\n" for ln in moved))  # the history first: a kill between loses no row
        _rewrite(path, "".join(lines[i] + "\n" for i in keep))
        return len(moved)


def read_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def latest_by_cell(path: str | Path, key: str = "cell") -> dict[str, dict]:
    """The latest row of every cell of an append-only JSONL (in the order cells first appear)."""
    by: dict[str, dict] = {}
    for r in read_jsonl(path):
        if key in r:
            by[r[key]] = r
    return by

