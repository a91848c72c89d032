"""One-off: the commit that added each benchmark row written before rows recorded their code revision.

Rows written now record ``revision`` (``benchmarks/_bench.revision``: ``git rev-parse --short HEAD``, ``+dirty`` when
src/ differed) when they are written, in every benchmark's cell-writing path. Older rows in ``benchmarks/out/*.jsonl`` (and
the rows of ``benchmarks/out/nulls.json``) have none, and no revision is invented for them. What git can tell is the
commit that added the row to the repository: this script finds it and stores its short hash as
``revision_committed_with``. The code that produced such a row is that commit's or an earlier one (a row is measured,
then committed with -- or after -- the code that measured it); the tables show it as ``committed with <hash>``.

How: ``git blame`` (``--line-porcelain``, which follows renames and merges) gives the commit that last changed the
row's line; when a parent of that commit still holds the same run -- every field of the older row equal in the current
one, NaN equal to NaN: a later commit that only added fields or re-serialised the line did not produce the row -- the
blame is taken again in that parent, until the commit that brought the run in. (On the rows of this repository that
never happened: the blamed commit is the answer for every line; the last column of the output counts the exceptions.)
nulls.json is one JSON list, no line per row: there the last commit that changed the file, followed back the same way.
A row that no commit holds (written but not committed) gets ``"revision": null`` (shown as not recorded).
The single-result files the tables also read (``RESULTS``: the intrinsic-dimension and anchor-probe results, the
ProjRes overhead and leakage speed measurements, the PEFTLeak IG baseline, the anchor study's pretraining record) get
the field at their top level (per entry for the pretraining record): the last commit that changed the file, when the
working copy is that commit's.

Nothing else in a row changes: a JSONL line gains the field at its end (the rest of the line byte for byte; checked by
parsing it back), nulls.json is rewritten with the same ``json.dumps(rows, indent=1)`` that wrote it (checked to
round-trip byte-identically first). Rows that already carry ``revision`` or ``revision_committed_with`` are left
alone, so a second run changes nothing. Read-only git (``log``, ``show``, ``blame``, ``rev-list``, ``rev-parse``).

    python scripts/revisions_from_blame.py            # annotate benchmarks/out, print per-file counts
    python scripts/revisions_from_blame.py --dry-run  # counts only
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"
FIELD = "revision_committed_with"
JSON_ROWS = ("nulls.json",)  # row files that are one JSON list (json.dumps(rows, indent=1)), not JSONL
#: single results (write_json_atomic: json.dumps(obj, indent=2)) that tables read beside the rows: the field goes at
#: the top level, or into each entry for a file that is a mapping of settings
RESULTS = {"lora_vit_intrinsic.json": "top", "lora_vit_anchor_probe.json": "top", "projres_overhead.json": "top",
           "leakage_speed.json": "top", "peftleak_baseline.json": "top", "anchor_pretrain.json": "entries"}


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def parse(text: str, name: str) -> list[dict]:
    if name in JSON_ROWS:
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def same(a, b) -> bool:
    """Equal as stored (NaN equals NaN: a row's NaN is the same value in both versions)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def same_run(new: dict, old: dict) -> bool:
    """``old`` is ``new`` before later commits added fields: every field of ``old`` equal in ``new``."""
    return all(k in new and same(new[k], old[k]) for k in old)


@lru_cache(maxsize=None)
def blame(commit: str, name: str) -> tuple[tuple[str, str], ...]:
    """``git blame --line-porcelain <commit> -- name``: (commit, file name there) of every line of that version."""
    out, cur, lines = git("blame", "--line-porcelain", commit, "--", name), None, []
    for ln in out.splitlines():
        head = ln.split()
        if cur is None and len(head) >= 3 and len(head[0]) == 40:
            cur = head[0]
        elif ln.startswith("filename "):
            lines.append((cur, ln[len("filename "):]))
        elif ln.startswith("\t"):
            cur = None
    return tuple(lines)


@lru_cache(maxsize=None)
def rows_at(commit: str, name: str, kind: str) -> tuple[dict, ...] | None:
    try:
        return tuple(parse(git("show", f"{commit}:{name}"), kind))
    except (subprocess.CalledProcessError, json.JSONDecodeError):  # not in that commit, or not rows there
        return None


def origin(row: dict, line: int, path: Path) -> str | None:
    """``git blame``'s commit for the row's line, followed back while a parent of that commit holds the same run."""
    commit, name = blame("HEAD", str(path.relative_to(ROOT)))[line]
    while True:
        parents = git("rev-list", "--parents", "-n", "1", commit).split()[1:]
        back = None
        for p in parents:
            old = rows_at(p, name, path.name)
            hit = [i for i, o in enumerate(old or ()) if same_run(row, o)]
            if hit:
                back = (p, hit[-1])
                break
        if back is None:
            return commit
        commit, name = blame(back[0], name)[back[1]]


def origin_json(row: dict, path: Path) -> str | None:
    """A row of a JSON-list file (no line of its own): the commit that last changed the file, followed back the same
    way (while a parent holds the same row)."""
    name = str(path.relative_to(ROOT))
    commit = git("log", "-n", "1", "--format=%H", "--", name).strip()
    if not commit or not any(same_run(row, o) for o in rows_at(commit, name, path.name) or ()):
        return None
    while True:
        parents = git("rev-list", "--parents", "-n", "1", commit).split()[1:]
        older = [p for p in parents if any(same_run(row, o) for o in rows_at(p, name, path.name) or ())]
        if not older:
            return commit
        commit = git("log", "-n", "1", "--format=%H", older[0], "--", name).strip()


def annotate(path: Path, dry_run: bool) -> tuple[int, int, int, int]:
    """(rows already with a revision, rows given revision_committed_with, rows given revision null, rows whose commit
    is older than git blame's for their line)."""
    text = path.read_text()
    rows = parse(text, path.name)
    json_rows = path.name in JSON_ROWS
    short: dict[str, str] = {}
    kept = added = nulls = past_blame = 0
    labels: list[str | None] = []
    for i, r in enumerate(rows):
        if "revision" in r or FIELD in r:
            kept += 1
            labels.append(None)
            continue
        c = origin_json(r, path) if json_rows else origin(r, i, path)
        if c is None or set(c) == {"0"}:  # no committed version holds it
            nulls += 1
            labels.append("")
            continue
        if not json_rows and c != blame("HEAD", str(path.relative_to(ROOT)))[i][0]:
            past_blame += 1
        short.setdefault(c, git("rev-parse", "--short", c).strip())
        added += 1
        labels.append(short[c])
    if dry_run or not (added or nulls):
        return kept, added, nulls, past_blame
    if json_rows:
        if json.dumps(rows, indent=1, default=str) != text:
            sys.exit(f"{path}: json.dumps(rows, indent=1) does not reproduce the file; not rewriting it")
        new = [r if lab is None else {**r, **({FIELD: lab} if lab else {"revision": None})} for r, lab in zip(rows, labels)]
        path.write_text(json.dumps(new, indent=1, default=str))
        return kept, added, nulls, past_blame
    lines = text.splitlines(keepends=True)
    body = [i for i, ln in enumerate(lines) if ln.strip()]
    assert len(body) == len(rows) == len(lines)
    for i, r, lab in zip(body, rows, labels):
        if lab is None:
            continue
        ln = lines[i].rstrip("\n")
        assert ln.endswith("}"), (path, i)
        extra = {FIELD: lab} if lab else {"revision": None}
        new = ln[:-1] + "".join(f", {json.dumps(k)}: {json.dumps(v)}" for k, v in extra.items()) + "}"
        assert json.loads(new) == {**r, **extra} or same(json.loads(new), {**r, **extra}), (path, i)  # nothing else changed
        lines[i] = new + ("\n" if lines[i].endswith("\n") else "")
    path.write_text("".join(lines))
    return kept, added, nulls, past_blame


def annotate_result(path: Path, dry_run: bool) -> tuple[int, int, int, int]:
    """A single-result file: the commit that added its present content (the last commit that changed the file, as
    long as the working copy is that commit's: else not recorded)."""
    name = str(path.relative_to(ROOT))
    text = path.read_text()
    obj = json.loads(text)
    targets = [obj] if RESULTS[path.name] == "top" else list(obj.values())
    todo = [t for t in targets if "revision" not in t and FIELD not in t]
    if not todo:
        return len(targets), 0, 0, 0
    commit = git("log", "-n", "1", "--format=%H", "--", name).strip()
    same_file = bool(commit) and git("show", f"{commit}:{name}") == text
    if dry_run:
        return len(targets) - len(todo), len(todo) if same_file else 0, 0 if same_file else len(todo), 0
    if json.dumps(obj, indent=2) != text:
        sys.exit(f"{path}: json.dumps(obj, indent=2) does not reproduce the file; not rewriting it")
    for t in todo:
        t.update({FIELD: git("rev-parse", "--short", commit).strip()} if same_file else {"revision": None})
    path.write_text(json.dumps(obj, indent=2))
    return len(targets) - len(todo), len(todo) if same_file else 0, 0 if same_file else len(todo), 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="count only, write nothing")
    args = ap.parse_args(argv)
    files = sorted(OUT.glob("*.jsonl")) + [OUT / n for n in JSON_ROWS]
    print("file | rows with revision | revision_committed_with added | revision null | of them older than git blame's")
    for path in files:
        kept, added, nulls, past = annotate(path, args.dry_run)
        print(f"{path.relative_to(ROOT)} | {kept} | {added} | {nulls} | {past}")
    for path in (OUT / n for n in RESULTS):
        kept, added, nulls, past = annotate_result(path, args.dry_run)
        print(f"{path.relative_to(ROOT)} (single result) | {kept} | {added} | {nulls} | –")
    return 0


if __name__ == "__main__":
    sys.exit(main())
