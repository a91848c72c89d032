"""One atomic write for every file gradleak keeps (results, reports, caches, weights): the content goes to a temporary
file in the target's folder, which replaces the target in one rename, so a reader (or a run killed half-way) sees the
old file or the new one, never a part. A failed write leaves no temporary file behind."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_path(path: str | Path, *, mode: int | None = None, suffix: str = ".tmp") -> Iterator[str]:
    """Yield a temporary path next to ``path`` to write to; on a clean exit it replaces ``path`` (after
    ``chmod(mode)`` when given: mkstemp creates files 0600), on an error it is removed and the error raised. The
    folder is created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(fd)
    try:
        yield tmp
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str, *, mode: int | None = None) -> None:
    """``text`` at ``path``, atomically (:func:`atomic_path`)."""
    with atomic_path(path, mode=mode) as tmp, open(tmp, "w") as f:
        f.write(text)
