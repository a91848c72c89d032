"""README's result sentences that were once found without a source row, recomputed from the stored rows
(benchmarks/out/*.jsonl): the test fails when one of these README numbers is edited by hand or the rows change
under it. Also the UTR note on per-tensor pruning, generated from the defended rows."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"
README = (ROOT / "README.md").read_text()


def _flat(text: str) -> str:
    """README with its hard line wraps undone (a claim may break across lines)."""
    return " ".join(text.split())


def _rows(name: str) -> dict[str, dict]:
    """The latest row of each cell of ``benchmarks/out/<name>.jsonl``."""
    rows: dict[str, dict] = {}
    for line in (OUT / f"{name}.jsonl").read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            rows[r["cell"]] = r
    return rows


def test_peftleak_paper_design_at_b32_with_the_seeds_and_the_held_out_cell():
    rows = _rows("peftleak")
    rate = lambda cell: 100 * rows[cell]["metrics"]["patch_recovery_rate"]  # noqa: E731
    seeds = [rate(f"t1-cifar-B32-paper-s{k}") for k in range(5)]
    cifar = sum(seeds) / len(seeds)  # Table 1's cifar-B32 cell: the five batches pooled
    tiny = rate("t1-tiny64-B32-paper")
    lo, hi = sorted((cifar, tiny))
    text = _flat(README)
    assert f"paper design (`--set attack.design=paper`): {lo:.1f}–{hi:.1f} % at B = 32" in text
    assert f"CIFAR seeds 0–4, new seeds on the same 40 images, {min(seeds):.1f}–{max(seeds):.1f} %" in text
    held, held_improved = rate("ho-fmnist-B32-paper-s4"), rate("ho-fmnist-B32-improved-s4")
    assert f"on held-out Fashion-MNIST (32 images no tuned cell drew; public statistics from natural crops) " \
           f"{held:.1f} %, against {held_improved:.0f} % for the improved design" in text


def test_dager_on_a_frozen_backbone_is_not_applicable_not_zero():
    rows = [r for c, r in _rows("utr").items() if "/dager_frozen/" in c]
    text = _flat(README)
    assert "DAGER recovers nothing" not in text
    assert f"DAGER is not applicable when the backbone is frozen (an adapters-only upload has no attention-layer " \
           f"gradient: its {len(rows)} cells read n/a, not 0)" in text
    doc = (ROOT / "docs" / "REPRODUCTION.md").read_text()
    assert all(f"`{r['cell']}` (DAGER (adapters)" in doc for r in rows)
    assert doc.count("| n/a — not applicable: adapters-only upload has no attention-layer gradient |") >= len(rows)


def test_dp_at_the_papers_setting_reads_nothing_and_the_ratio_is_the_probes():
    rows = [r for c, r in _rows("defended").items() if c.startswith("text|") and "dpgauss-paper" in c]
    assert rows and all(r["level"] == "none" for r in rows)
    key = "margin_strongest_embedding_adapter"
    measured = [r for r in rows if key in r["metrics"]]
    assert all(r["metrics"]["directions_above_edge_embedding_adapter"] == 0 for r in measured)  # K = 0
    lo, hi = min(r["metrics"][key] for r in measured), max(r["metrics"][key] for r in measured)
    text = _flat(README)
    assert "which the benchmark shows" not in text
    older = len(rows) - len(measured)  # rows from before the margin column, if any
    assert (f"its {len(rows)} benchmark cells recover nothing (no direction above the noise edge: K = 0 in "
            + (f"all {len(rows)} (MiniLM 2 and 6 layers, SmolLM2)" if not older else f"the {len(measured)} measured")
            + f", whose strongest singular value sits at {lo:.2f}–{hi:.2f} of the edge"
            + (f"; {older} older cells predate that column" if older else "") + ")") in text
    assert "probe `benchmarks/probes/utr_noise_probe.py` puts MiniLM's largest singular value at 1.5e-4 of the " \
           "edge (a probe's print, not a stored row)" in text


def test_the_utr_note_on_per_tensor_pruning_follows_the_defended_rows(tmp_path):
    bench = str(ROOT / "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    utr = importlib.import_module("utr")
    assert "no row" in utr.per_tensor_note(tmp_path)  # no defended rows: says so, claims nothing

    def row(cell, level, recall, rouge=0.0, exact=0.0):
        return {"cell": cell, "part": "text", "level": level,
                "metrics": {"word_bag_recall": recall, "rouge1_f1": rouge, "sentences_exact": exact}}

    rows = [row("text|topk0.9-per_tensor-aware|B2|seed0", "partial", 80.0),
            row("text|topk0.9-per_tensor-plain|B2|seed0", "none", 0.0),
            row("text|minilm-L6|topk0.99-per_tensor-aware|B4|seed0", "none", 12.5),
            row("text|topk0.9-global-aware|B2|seed0", "partial", 99.0),  # global: not per tensor
            {"cell": "image|x", "part": "image", "level": "exact", "metrics": {}}]
    (tmp_path / "defended.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    note = utr.per_tensor_note(tmp_path)
    assert "3 cells, top-k 90-99 %, minilm-L2, minilm-L6" in note
    assert ">= partial in 1 of 2 cells (word-bag recall up to 80.0 %), the plain tests in 0 of 1" in note
    assert "ROUGE-1 F1 is at most 0.0 and 0 sentences are exact" in note and note.endswith("and no sentence.")
    doc = (ROOT / "docs" / "REPRODUCTION.md").read_text()
    assert utr.per_tensor_note(OUT) in doc and "(per-tensor, not measured)" not in doc
