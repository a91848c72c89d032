"""gradleak.atomic: the one atomic write (a temporary file in the folder, then one rename)."""

from __future__ import annotations

import os

import pytest

from gradleak.atomic import atomic_path, write_text_atomic


def test_a_finished_write_replaces_the_file_with_the_mode_asked(tmp_path):
    p = tmp_path / "sub" / "f.md"
    write_text_atomic(p, "one")
    write_text_atomic(p, "two", mode=0o644)
    assert p.read_text() == "two" and (os.stat(p).st_mode & 0o777) == 0o644
    assert sorted(x.name for x in p.parent.iterdir()) == ["f.md"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    p = tmp_path / "f.bin"
    write_text_atomic(p, "old")
    with pytest.raises(RuntimeError):
        with atomic_path(p) as tmp:
            with open(tmp, "w") as f:
                f.write("half")
            raise RuntimeError("killed half-way")
    assert p.read_text() == "old" and sorted(x.name for x in tmp_path.iterdir()) == ["f.bin"]
