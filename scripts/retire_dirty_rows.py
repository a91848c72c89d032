"""Move rows written from uncommitted code (``revision`` ending in ``+dirty``) out of the live benchmark JSONLs.

A ``+dirty`` row was written while src/ differed from the commit it names, so no commit holds the code behind it
(``benchmarks/_bench.revision``). The readers take the latest row of every cell (``latest_by_cell``), so such a row
leaves the live file in one of two ways, never silently:

* **superseded**: a later row of the same cell, from committed code, exists in the same file. The dirty row moves to
  ``<name>.history.jsonl`` (:func:`gradleak.run.results.history_path`, where ``supersede_rows`` keeps every
  superseded row) with ``superseded_reason`` naming its revision and the revision of the row that replaced it. What
  the readers see does not change.
* **retired, not rerun** (``--retire GLOB --why TEXT``): no committed row replaces it and the rerun was not made; it
  moves to the history with ``superseded_reason`` = its revision + ``TEXT`` (say what the rerun costs). The readers
  then no longer see it: its section shows the cell as not run.

A dirty row that is neither stays where it is, and ``tests/test_no_new_dirty_rows.py`` fails on it.

    python scripts/retire_dirty_rows.py                      # report only: what would move, per file
    python scripts/retire_dirty_rows.py --apply              # move the superseded dirty rows
    python scripts/retire_dirty_rows.py --apply --file anchor.jsonl --retire 'vit4p8/cpu/dinov2/gias*' --why '...'
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from gradleak.run.results import _rewrite, history_path, jsonl_lock  # noqa: E402

OUT = ROOT / "benchmarks" / "out"


def is_dirty(row: dict) -> bool:
    return str(row.get("revision") or "").endswith("+dirty")


def row_revision(row: dict) -> str:
    return str(row.get("revision") or (f"committed with {row['revision_committed_with']}"
                                       if row.get("revision_committed_with") else "not recorded"))


def plan(lines: list[str], key: str, retire: list[str], why: str | None) -> dict[int, str]:
    """``{line index: superseded_reason}`` of the dirty rows of one JSONL that leave it."""
    rows: list[dict | None] = []
    for ln in lines:
        try:
            r = json.loads(ln)
        except json.JSONDecodeError:
            r = None
        rows.append(r if isinstance(r, dict) else None)
    last_clean: dict[str, int] = {}
    for i, r in enumerate(rows):
        if r is not None and key in r and not is_dirty(r):
            last_clean[str(r[key])] = i
    out: dict[int, str] = {}
    for i, r in enumerate(rows):
        if r is None or not is_dirty(r):
            continue
        cell = str(r.get(key))
        later = last_clean.get(cell)
        if later is not None and later > i:
            out[i] = (f"written from uncommitted code ({r['revision']}); superseded by this cell's row from committed "
                      f"code ({row_revision(rows[later])})")
        elif any(fnmatch.fnmatchcase(cell, g) for g in retire):
            if not why:
                raise SystemExit("--retire needs --why: say why the cell was not rerun and what the rerun costs")
            out[i] = f"written from uncommitted code ({r['revision']}); not rerun: {why}"
    return out


def keep_order(lines: list[str], gone: set[int], key: str) -> list[int]:
    """The indices of the lines that stay, each cell's row at the place the cell first appeared (the order
    ``supersede_rows`` keeps, so the sections that list cells in file order list them as before)."""
    first: dict[str, int] = {}
    place: dict[int, int] = {}
    for i, ln in enumerate(lines):
        try:
            r = json.loads(ln)
        except json.JSONDecodeError:
            r = None
        cell = str(r[key]) if isinstance(r, dict) and key in r else None
        if cell is not None:
            first.setdefault(cell, i)
        place[i] = first[cell] if cell is not None else i
    return sorted((i for i in range(len(lines)) if i not in gone), key=lambda i: (place[i], i))


def retire(path: Path, key: str = "cell", retire: list[str] = (), why: str | None = None,
           apply: bool = False) -> list[tuple[dict, str]]:
    """Move the rows :func:`plan` picks from ``path`` to its history file (appended in order, each with
    ``superseded_reason``), under the JSONL lock; returns ``[(row, reason)]``. ``apply=False`` moves nothing."""
    with jsonl_lock(path):
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
        moves = plan(lines, key, list(retire), why)
        moved = []
        for i, reason in moves.items():
            r = json.loads(lines[i])
            r["superseded_reason"] = reason
            moved.append((r, reason))
        if apply and moved:
            hist = history_path(path)
            old = hist.read_text() if hist.exists() else ""
            if old and not old.endswith("\n"):
                old += "\n"
            _rewrite(hist, old + "".join(json.dumps(r) + "\n" for r, _ in moved))  # the history first
            _rewrite(path, "".join(lines[i] + "\n" for i in keep_order(lines, set(moves), key)))
    return moved


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=OUT, help="folder of the live JSONLs (default benchmarks/out)")
    ap.add_argument("--file", action="append", default=None,
                    help="only these JSONL names (repeatable; default: every live *.jsonl, not *.history.jsonl)")
    ap.add_argument("--retire", action="append", default=[], metavar="GLOB",
                    help="also retire the unsuperseded dirty rows whose cell matches GLOB (needs --why)")
    ap.add_argument("--why", default=None, help="why those cells were not rerun, with the rerun's cost")
    ap.add_argument("--apply", action="store_true", help="move the rows (default: report what would move)")
    args = ap.parse_args(argv)
    files = ([args.out / f for f in args.file] if args.file else
             sorted(p for p in args.out.glob("*.jsonl") if not p.name.endswith(".history.jsonl")))
    left = 0
    for path in files:
        if not path.is_file():
            raise SystemExit(f"--file {path.name}: no such JSONL in {args.out}")
        moved = retire(path, retire=args.retire, why=args.why, apply=args.apply)
        dirty = sum(is_dirty(json.loads(ln)) for ln in path.read_text().splitlines() if ln.strip())
        left += dirty
        if moved or dirty:
            verb = "moved" if args.apply else "would move"
            print(f"{path.name}: {verb} {len(moved)} dirty row(s) to {history_path(path).name}; "
                  f"{dirty} dirty row(s) {'left' if args.apply else 'now'}")
            for r, reason in moved:
                print(f"  {r.get('cell')}: {reason}")
    print(f"dirty rows left in the live JSONLs: {left}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
