"""Markdown tables and the section updater benchmarks use for ``docs/REPRODUCTION.md``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence


def fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}g}" if abs(v) < 1e4 else f"{v:.3e}"
    return str(v)


def p_floor_bound(p: Any) -> float | None:
    """The bound to print a p-value at its floor as ``p < bound``: a Monte-Carlo p-value of ``n`` null draws is at
    least ``1 / (1 + n)`` (:mod:`gradleak.evaluation.nulls`: no draw reached the value), which says "below what the
    draws resolve", not a measured 0.000999. The bound is that floor rounded up to one significant digit (0.000999
    -> 0.001, 1/201 -> 0.005), used only where it is strictly above ``p``; None for any other p."""
    if not isinstance(p, (int, float)) or isinstance(p, bool) or not (0 < p < 1):
        return None
    n = 1.0 / p - 1.0
    if round(n) < 199 or abs(n - round(n)) > 1e-6 * n:  # not 1 / (1 + draws) for a null of >= 200 draws
        return None
    exp = math.floor(math.log10(p))
    bound = math.ceil(p / 10 ** exp - 1e-9) * 10 ** exp
    bound = float(f"{bound:.1g}")
    return bound if bound > p else None


def fmt_p(p: Any, bare: bool = False) -> str:
    """A p-value as the console and the reports write it: ``p < 0.001`` at the floor of its null's draws
    (:func:`p_floor_bound`), else ``p = 0.0123`` (four significant digits); ``p = n/a`` when there is none.
    ``bare``: for a table's p column, without the ``p = `` (``< 0.001``, ``0.0123``, ``n/a``)."""
    bound = p_floor_bound(p)
    if bound is not None:
        text = f"p < {bound:g}"
    elif not isinstance(p, (int, float)) or isinstance(p, bool) or p != p:
        text = "p = n/a"
    else:
        text = f"p = {p:.4g}"
    return text.removeprefix("p = ").removeprefix("p ") if bare else text


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
