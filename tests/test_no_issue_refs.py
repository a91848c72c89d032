"""The repository explains itself (docs/DESIGN.md §2): code, docs, configs and the generated sections of
docs/REPRODUCTION.md cite the paper's section and equation and our own docs, never an issue number. A reference
like "(issue 28 item 2)" says nothing to a reader of the repository; the rule or fact it stood for is written out
instead (e.g. "held out = data no tuned cell drew", "docs/DESIGN.md §6").

Reads every tracked text file under the user-facing paths (``git ls-files``), so a new file is checked too."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the user-facing paths: the package, the benchmarks and their generated sections, the docs, configs, examples
CHECKED = ("src", "benchmarks", "docs", "README.md", "configs", "examples", "scripts", "tests", "pyproject.toml")
#: "issue 28", "Issue 11 item 1", "issues 26", "issue #41", "issue-9"
ISSUE_REF = re.compile(r"\bissues?[\s#-]*\d+", re.I)
#: config files whose bytes key stored rows (``benchmarks/advise.py`` ``config_sha``): a comment edited here marks
#: the advise rows as measured on another version of the file, so their header comment is rewritten when those rows
#: are next rerun, not before
HASHED = {"configs/audit/text_adapters.yaml", "configs/audit/text_lora.yaml"}
SELF = "tests/test_no_issue_refs.py"


def _tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", *CHECKED], cwd=ROOT, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:  # not a git checkout (an sdist): nothing to list
        pytest.skip(f"git ls-files failed: {e}")
    return [p for p in out.stdout.decode().split("\0") if p]


def find_refs(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every issue-number reference in ``text``."""
    return [(i, line.strip()) for i, line in enumerate(text.splitlines(), 1) if ISSUE_REF.search(line)]


@pytest.mark.parametrize("text, hits", [
    ("the gradient-only arm (issue 28 item 2)", 1),
    ("Issue 11, a probe", 1),
    ("(issues 26 and 41)", 1),
    ("see issue #41", 1),
    ("Probes of the issue-9 foundations", 1),
    ("a line\nnext (ISSUE 3)\n", 1),
    ("held out = data no tuned cell drew (tests/test_heldout_disjoint.py)", 0),
    ("the tissue 3 of DESIGN §6; no issues here", 0),
])
def test_pattern(text, hits):
    assert len(find_refs(text)) == hits


def test_no_issue_numbers():
    files = _tracked()
    assert any(p.startswith("benchmarks/") for p in files) and "docs/REPRODUCTION.md" in files  # the listing works
    bad = []
    for path in files:
        if path == SELF or path in HASHED:
            continue
        p = ROOT / path
        if not p.is_file():  # deleted in the work tree, not yet committed
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # a binary file (figures)
            continue
        bad += [f"{path}:{n}: {line[:160]}" for n, line in find_refs(text)]
    assert not bad, ("issue numbers cited (write out the rule or fact instead, with docs/DESIGN.md §N, a "
                     "docs/REPRODUCTION.md section or the paper's section/equation):\n" + "\n".join(bad))


def test_hashed_configs_are_the_advise_configs():
    """The HASHED exemption holds only configs ``benchmarks/advise.py`` hashes, so it cannot hide another file
    (vit_lora's comment was rewritten with its advice rerun)."""
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import advise
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert HASHED <= {path for path, _ in advise.CONFIGS.values()}
