"""Results contract (docs/DESIGN.md §4): ``results.json`` written atomically; the cell loop (:mod:`gradleak.run.cells`)
appends to a JSONL and reads back the latest row of every cell."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any


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
    """``obj`` as JSON at ``path`` through a temporary file and a rename. Created owner-only (0600,
    :func:`gradleak.report.images.new_private_file`) and left so: results.json and audit.json hold the private
    sentences (:data:`gradleak.report.images.PRIVATE_ARTIFACTS`, the one register), and no JSON of a run is ever
    opened to others."""
    from gradleak.report.images import new_private_file

    path = Path(path)
    fd, tmp = new_private_file(path)
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=2, default=_default, allow_nan=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def append_jsonl(path: str | Path, obj: Any) -> None:
    """Append one line atomically (single write + fsync of a line shorter than the pipe buffer is not
    guaranteed atomic, so we rewrite the file through a temp file: an interrupted write loses nothing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    old = path.read_text() if path.exists() else ""
    if old and not old.endswith("\n"):
        old = old.rsplit("\n", 1)[0] + "\n" if "\n" in old else ""
    from gradleak.report.images import new_private_file

    fd, tmp = new_private_file(path)  # owner-only, as write_json_atomic
    with os.fdopen(fd, "w") as f:
        f.write(old + json.dumps(obj, default=_default) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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

