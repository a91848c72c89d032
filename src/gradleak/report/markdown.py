"""Markdown tables and the section updater benchmarks use for ``docs/REPRODUCTION.md``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence


def fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}g}" if abs(v) < 1e4 else f"{v:.3e}"
    return str(v)


def markdown_table(rows: Sequence[dict], columns: Sequence[str], headers: Sequence[str] | None = None) -> str:
    headers = list(headers or columns)
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def update_section(path: str | Path, key: str, body: str, title: str | None = None) -> None:
    """Replace (or append) the block between ``<!-- BEGIN key -->`` and ``<!-- END key -->``, atomically."""
    path = Path(path)
    text = path.read_text() if path.exists() else "# Reproduction: our numbers next to the papers'\n"
    begin, end = f"<!-- BEGIN {key} -->", f"<!-- END {key} -->"
    block = f"{begin}\n" + (f"## {title}\n\n" if title else "") + body.rstrip() + f"\n{end}"
    if begin in text and end in text:
        pre, rest = text.split(begin, 1)
        _, post = rest.split(end, 1)
        text = pre + block + post
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    from gradleak.atomic import write_text_atomic

    write_text_atomic(path, text, mode=0o644)
