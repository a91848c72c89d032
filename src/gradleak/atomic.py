"""One atomic write for every file gradleak keeps (results, JSONL rewrites, reports, PNGs, caches, weights): the content
goes to a temporary file in the target's folder, is flushed to disk (``fsync``), and replaces the target in one rename
(``os.replace``), so a reader (or a run killed half-way) sees the old file or the new one, never a part. A failed write
leaves the old file as it was and no temporary file behind.

The temporary file is created owner-only (0600, ``mkstemp``) and stays so unless the writer asks for ``mode``: a file
holding the clients' private data is never readable by others, even briefly (docs/DESIGN.md §2; the register of the
private artifacts is :data:`gradleak.report.images.PRIVATE_ARTIFACTS`).

Every writer of a file in ``src/gradleak`` goes through this module (``tests/test_atomic.py`` scans the source):

- :func:`write_text_atomic` / :func:`write_bytes_atomic`: the content in hand;
- :func:`atomic_open`: a writer that needs a file handle (``json.dump``, ``cloudpickle.dump``);
- :func:`atomic_path`: a writer that needs a path (``savefig``, ``torch.save``, ``PIL.Image.save``, safetensors);
- :func:`atomic_dir`: a writer that fills a folder (``save_pretrained``), which replaces the target folder.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import IO, Iterator


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | Path, *, mode: int | None = None, suffix: str = ".tmp") -> Iterator[str]:
    """Yield a temporary path next to ``path`` to write to (created empty, 0600); on a clean exit it is flushed to
    disk and replaces ``path`` (after ``chmod(mode)`` when given), on an error it is removed and the error raised (the
    old ``path`` untouched). The folder is created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(fd)
    try:
        yield tmp
        _fsync(tmp)
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_open(path: str | Path, *, binary: bool = False, mode: int | None = None,
                encoding: str | None = None) -> Iterator[IO]:
    """Yield a file handle (text, or bytes with ``binary``) on a temporary file next to ``path``; on a clean exit the
    handle is closed and the file replaces ``path`` (:func:`atomic_path`, whose ``mode`` it takes)."""
    with atomic_path(path, mode=mode) as tmp, open(tmp, "wb" if binary else "w", encoding=encoding) as f:
        yield f


def write_text_atomic(path: str | Path, text: str, *, mode: int | None = None, encoding: str | None = None) -> None:
    """``text`` at ``path``, atomically (:func:`atomic_path`)."""
    with atomic_open(path, mode=mode, encoding=encoding) as f:
        f.write(text)


def write_bytes_atomic(path: str | Path, data: bytes, *, mode: int | None = None) -> None:
    """``data`` at ``path``, atomically (:func:`atomic_path`)."""
    with atomic_open(path, binary=True, mode=mode) as f:
        f.write(data)


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a new empty folder next to ``path`` to fill (created with the process's umask, as ``mkdir`` does); on a
    clean exit it takes the place of ``path`` (a folder already there is moved aside by one rename, then removed), on
    an error it is removed and the error raised (the old folder untouched). A folder cannot be renamed over a full
    one, so a reader may find no folder between the two renames, never a part of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            os.mkdir(tmp)
            break
        except FileExistsError:
            continue
    old = None
    try:
        yield tmp
        if path.exists() or path.is_symlink():
            old = path.with_name(f".{path.name}.{secrets.token_hex(6)}.old")
            os.replace(path, old)
        os.replace(tmp, path)
    except BaseException:
        if old is not None and not (path.exists() or path.is_symlink()):
            os.replace(old, path)  # the new folder did not take its place: the old one goes back
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
