"""docs/PAPERS.md's side-by-side table is what ``benchmarks/papers.py --report-only`` makes of the stored rows: it
regenerates byte-identically from ``benchmarks/out``, its status column is computed from the rows (editing a stored
number changes it), and every paper number in it is a constant of the generator with its citation."""

from __future__ import annotations

import importlib
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
OUT = BENCH / "out"
DOC = ROOT / "docs" / "PAPERS.md"


def _papers():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module("papers")


def _block(text: str, key: str) -> str:
    m = re.search(rf"<!-- BEGIN {key} -->\n.*?<!-- END {key} -->", text, re.S)
    assert m, f"docs/PAPERS.md has no '{key}' section: run python benchmarks/papers.py --report-only"
    return m.group(0)


def test_section_regenerates_byte_identically():
    papers = _papers()
    body, _ = papers.build(OUT)
    want = f"<!-- BEGIN {papers.KEY} -->\n## {papers.TITLE}\n\n" + body.rstrip() + f"\n<!-- END {papers.KEY} -->"
    assert _block(DOC.read_text(), papers.KEY) == want, \
        "docs/PAPERS.md's table is stale: run python benchmarks/papers.py --report-only"


def test_every_headline_has_a_citation_and_a_row_in_the_table():
    papers = _papers()
    body, rows = papers.build(OUT)
    assert len(rows) == len(papers.HEADLINES) >= 5
    assert {h.paper for h in papers.HEADLINES} == {"PEFTLeak", "LoRA-ViT paper", "UTR paper",
                                                  "Hatamizadeh et al. 2022", "FISGuard paper"}
    for h in papers.HEADLINES:
        assert re.search(r"(Sec\.|Table|Fig\.|eq\.)", h.cite), h.number
        assert f"{h.number} ({h.cite})" in body
    table = [ln for ln in body.splitlines() if ln.startswith("| ") and not ln.startswith("| paper ")]
    assert len(table) == len(rows) and all(ln.count("|") == 9 for ln in table), "a cell holds a stray '|'"


def _copy_out(tmp_path: Path) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    for name in ("nulls.json", "leakage.jsonl", "peftleak.jsonl", "utr.jsonl", "projres.jsonl"):
        shutil.copy(OUT / name, out / name)
    return out


def _status(papers, out: Path, number: str) -> tuple[str, float | None]:
    _, rows = papers.build(out)
    (r,) = [r for r in rows if r["headline"].number == number]
    return r["status"], r["ours"]


def _edit_jsonl(path: Path, cell: str, edit) -> None:
    lines = path.read_text().splitlines()
    last = max(i for i, ln in enumerate(lines) if ln.strip() and json.loads(ln).get("cell") == cell)
    r = json.loads(lines[last])
    edit(r)
    lines[last] = json.dumps(r)
    path.write_text("\n".join(lines) + "\n")


def test_status_follows_the_stored_numbers(tmp_path):
    """Edit a stored row and the status moves: computed from the rows, never typed."""
    papers = _papers()
    out = _copy_out(tmp_path)
    cifar = "patches recovered, CIFAR-100, B = 32, r = 64"
    assert _status(papers, out, cifar) == (papers.MATCHED, pytest.approx(84.375))

    def rate(v):
        return lambda r: r["metrics"].__setitem__("patch_recovery_rate", v)

    _edit_jsonl(out / "peftleak.jsonl", "t1-cifar-B32-paper-s0", rate(0.5))
    assert _status(papers, out, cifar) == (papers.NOT_REPRODUCED, pytest.approx(50.0))
    _edit_jsonl(out / "peftleak.jsonl", "t1-cifar-B32-paper-s0", rate(1.0))
    assert _status(papers, out, cifar)[0] == papers.BEATEN
    _edit_jsonl(out / "peftleak.jsonl", "t1-cifar-B32-paper-s0", lambda r: r["metrics"].pop("patch_recovery_rate"))
    assert _status(papers, out, cifar) == (papers.NOT_MEASURED, None)

    # a bound the paper states (DP sigma = 2 holds UTR below 2 %): a leak beyond the null breaks it
    dp = "ROUGE-1 under DP, sigma = 2.0 (clip 1.0)"
    assert _status(papers, out, dp)[0] == papers.MATCHED
    _edit_jsonl(out / "utr.jsonl", "t3/minilm/dp2.0", lambda r: r["metrics"].__setitem__("rouge1_f1", 60.0))
    assert _status(papers, out, dp) == (papers.NOT_REPRODUCED, 60.0)

    # the null moves the status too: FISGuard at chance is read against abs(AUC - 0.5)'s null
    fis = "FISGuard holds ProjRes at chance (AUC ~ 0.5)"
    _edit_jsonl(out / "projres.jsonl", "minilm/adapter/projres/fisguard-r16-head",
                lambda r: r["metrics"].__setitem__("auc", 0.51))
    assert _status(papers, out, fis) == (papers.MATCHED, pytest.approx(0.01))
    nulls = json.loads((out / "nulls.json").read_text())
    for e in nulls:
        if e.get("cell") == "minilm/adapter/projres/fisguard-r16-head":
            e["auc_distance"]["null_p99"] = 0.005
    (out / "nulls.json").write_text(json.dumps(nulls))
    assert _status(papers, out, fis)[0] == papers.NOT_REPRODUCED


@pytest.mark.parametrize("claim,value,ours,null,want", [
    ("value", 85.9, 84.0, 1.0, "matched"), ("value", 85.9, 95.0, 1.0, "beaten"),
    ("value", 85.9, 50.0, 1.0, "not reproduced (a finding)"), ("value", 85.9, 90.0, 95.0, "not reproduced (a finding)"),
    ("at_most", 2.0, 0.0, 20.0, "matched"), ("at_most", 2.0, 10.0, 20.0, "matched"),
    ("at_most", 2.0, 30.0, 20.0, "not reproduced (a finding)"),
    ("leak", None, 3.0, 2.0, "matched"), ("leak", None, 1.0, 2.0, "not reproduced (a finding)"),
    ("chance", None, 1.0, 2.0, "matched"), ("chance", None, 3.0, 2.0, "not reproduced (a finding)"),
    ("value", 85.9, None, 1.0, "not measured"), ("value", 85.9, 84.0, None, "not measured"),
])
def test_status_rules(claim, value, ours, null, want):
    papers = _papers()
    h = papers.Headline("P", "n", "Table 1", value, "x", claim, 5.0 if claim == "value" else 0.0, "s", "nulls", "c",
                        "m", why_missing="because")
    assert papers.status(h, ours, null)[0] == want


def test_bad_source_is_named():
    papers = _papers()
    h = papers.Headline("P", "n", "Table 1", 1.0, "x", "value", 0.0, "s", "elsewhere", "c", "m")
    with pytest.raises(ValueError, match="source 'elsewhere'"):
        papers.measure(h, papers.load(OUT))
