"""docs/REPRODUCTION.md is what the benchmarks' ``--report-only`` makes of the committed rows: every
section regenerates byte-identically from ``benchmarks/out``, every table row names the code revision behind it, and
every stored row carries its revision (recorded when written, or recovered from git by
``scripts/revisions_from_blame.py``).

The report functions run in this process on the committed rows (no attack runs): each script's ``main`` with
``--out benchmarks/out --report-only``, with the docs writer replaced by a recorder and every file write turned into a
check that the file would come out byte-identical (so nothing under the repository is written)."""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
OUT = BENCH / "out"
DOC = ROOT / "docs" / "REPRODUCTION.md"

#: every benchmark with a docs section, and the sections its --report-only writes
SECTIONS = {
    "nulls": ["nulls"], "peftleak": ["peftleak"], "utr": ["utr"], "projres": ["projres"],
    "lora_vit": ["lora_vit", "lora_vit_intrinsic", "lora_vit_anchor_probe", "lora_vit_opt_cpu"],
    "leakage": ["leakage"], "anchor": ["anchor"], "flower_dp": ["flower_dp"], "flower_utility": ["flower_utility"],
    "advise": ["advise"], "defended": ["defended"], "optnoise": ["optnoise"], "dp_check": ["dp_check"],
    "info_limit": ["info_limit"], "postprocessing": ["postprocessing"], "learned": ["learned"],
}
#: one table cell of the revision column: short hashes (``+dirty``), ``committed with <hash>[, <hash>]``, ``not
#: recorded``, ``–`` (no row), joined by ``; `` (an aggregate); advise's before/after table: ``<label> → <label>``
_ONE = r"(?:[0-9a-f]{7,40}(?:\+dirty)?|committed with [0-9a-f]{7,40}(?:, [0-9a-f]{7,40})*|not recorded|–)"
REVISION_CELL = re.compile(rf"^{_ONE}(?:; {_ONE})*(?: → {_ONE}(?:; {_ONE})*)?$")


def _module(name: str):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


def _doc_blocks(text: str) -> dict[str, str]:
    return {m.group(1): m.group(0) for m in re.finditer(r"<!-- BEGIN (\S+) -->\n.*?<!-- END \1 -->", text, re.S)}


@pytest.fixture(scope="module")
def regenerated():
    """{section: (block as update_section would write it)}, plus the files a report would have changed."""
    import torch

    import gradleak.report.markdown as markdown
    import gradleak.run.results as results

    blocks: dict[str, str] = {}
    changed: list[str] = []

    def record(path, key, body, title=None):
        assert Path(path) == DOC
        blocks[key] = f"<!-- BEGIN {key} -->\n" + (f"## {title}\n\n" if title else "") + body.rstrip() + f"\n<!-- END {key} -->"

    def compare(path: Path, text: str) -> None:
        path = Path(path)
        if not path.is_file() or path.read_text() != text:
            changed.append(str(path))

    def write_text(self, data, *args, **kwargs):
        compare(self, data)
        return len(data)

    def write_json(path, obj):
        compare(path, json.dumps(obj, indent=2, default=results._default, allow_nan=True))

    def save_figure(fig, path):
        import matplotlib.pyplot as plt

        plt.close(fig)
        return Path(os.path.relpath(path, DOC.parent)).as_posix()

    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(markdown, "update_section", record)
        mp.setattr(Path, "write_text", write_text)
        for script in SECTIONS:
            mod = _module(script)
            for name, fake in (("write_json_atomic", write_json), ("save_figure", save_figure)):
                if hasattr(mod, name):
                    mp.setattr(mod, name, fake)
            argv = ["--out", str(OUT), "--report-only"]
            mp.setattr(sys, "argv", [f"{script}.py", *argv])
            if script in ("defended", "dp_check", "optnoise"):  # main() reads sys.argv
                mod.main()
            else:
                mod.main(argv)
    torch.set_num_threads(threads)
    return blocks, changed


def test_every_section_regenerates_byte_identically(regenerated):
    blocks, changed = regenerated
    doc = _doc_blocks(DOC.read_text())
    assert set(blocks) == {s for secs in SECTIONS.values() for s in secs} == set(doc)
    for key, block in blocks.items():
        assert block == doc[key], f"docs/REPRODUCTION.md section '{key}' differs from its --report-only regeneration"
    assert not changed, f"--report-only would rewrite these files differently: {changed}"


def _tables(block: str):
    lines = block.splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.startswith("|") and re.fullmatch(r"\|(---\|)+", lines[i + 1]):
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append(row)
            yield line, rows


def test_every_table_row_names_its_revision(regenerated):
    blocks, _ = regenerated
    n = 0
    for key, block in blocks.items():
        for header, rows in _tables(block):
            head = [h.strip() for h in header.strip("|").split("|")]
            assert head[-1].startswith("revision"), (key, header)
            for row in rows:
                cell = row.rstrip().rstrip("|").rsplit("|", 1)[-1].strip()
                assert REVISION_CELL.match(cell), (key, row[-160:])
                n += 1
    assert n > 800  # every table of the doc, not a few


def _rows(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return json.loads(path.read_text())


@pytest.mark.parametrize("path", sorted(OUT.glob("*.jsonl")) + [OUT / "nulls.json"], ids=lambda p: p.name)
def test_every_stored_row_carries_its_revision(path):
    """Recorded when written (``revision``), or the commit that added it (``revision_committed_with``, never both);
    ``"revision": null`` would say that neither is known."""
    for r in _rows(path):
        assert "revision" in r or re.fullmatch(r"[0-9a-f]{7,40}", r.get("revision_committed_with", "")), r.get("cell")
        assert not ("revision" in r and "revision_committed_with" in r), r.get("cell")


@pytest.mark.parametrize("name", ["lora_vit_intrinsic", "lora_vit_anchor_probe", "projres_overhead", "leakage_speed",
                                  "peftleak_baseline", "anchor_pretrain"])
def test_every_single_result_carries_its_revision(name):
    """The single-result files the tables read beside the rows (per setting for the pretraining record)."""
    obj = json.loads((OUT / f"{name}.json").read_text())
    for r in obj.values() if name == "anchor_pretrain" else [obj]:
        assert "revision" in r or re.fullmatch(r"[0-9a-f]{7,40}", r.get("revision_committed_with", ""))


def test_revision_label():
    label = _module("_bench").revision_label
    assert label(None) == "–" and label([]) == "–" and label([None]) == "–"
    assert label({"revision": "abc1234"}) == "abc1234"
    assert label({"revision_committed_with": "abc1234"}) == "committed with abc1234"
    assert label({"revision": None}) == "not recorded" and label({}) == "not recorded"
    assert label([{"revision": "fff0000+dirty"}, {"revision_committed_with": "bbb1111"}, {},
                  {"revision_committed_with": "aaa2222"}, {"revision": "fff0000+dirty"}]) == \
        "fff0000+dirty; committed with aaa2222, bbb1111; not recorded"


def _grid(name: str, mod) -> list:
    return {"leakage": lambda: mod.cells()[:2], "lora_vit": lambda: mod.grid(12)[:2],
            "peftleak": lambda: mod.cells(True)[:2], "anchor": lambda: mod.grid("G")[:2]}[name]()


@pytest.mark.parametrize("name", ["leakage", "lora_vit", "peftleak", "anchor"])
def test_new_rows_record_the_revision(name, tmp_path, monkeypatch):
    """A cell's row starts with the code revision that writes it (finished or failed: the loop keeps the leading
    fields), through the benchmark's own cell-writing path; the cells are captured, not run."""
    mod = _module(name)
    seen: list[dict] = []
    monkeypatch.setattr(mod, "run_bench_cells", lambda jsonl, cells, fill, **kw: seen.extend(r for r, _, _ in cells))
    run = {"leakage": lambda c: mod.run_cells(c, tmp_path), "lora_vit": lambda c: mod.run_cells(c, tmp_path),
           "peftleak": lambda c: mod.run_cells(c, None, tmp_path), "anchor": lambda c: mod.run(c, tmp_path, "cpu")}
    run[name](_grid(name, mod))
    rev = _module("_bench").revision()
    assert len(seen) == 2 and all(r["revision"] == rev for r in seen)


def test_holm_adjusts_a_family_step_down_and_never_below_the_raw_p():
    """Holm's method (benchmarks/_bench.holm), the anchor study's multiple-test correction: the smallest p times m,
    the next times m - 1, kept monotone, capped at 1; with one test it is the test."""
    holm = _module("_bench").holm
    adj = holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.5})
    assert adj == pytest.approx({"a": 0.04, "c": 0.09, "b": 0.09, "d": 0.5})  # b: max(0.09, 2 * 0.04 = 0.08)
    assert holm({"x": 0.02}) == {"x": 0.02} and holm({}) == {}
    assert holm({"a": 0.4, "b": 0.6}) == pytest.approx({"a": 0.8, "b": 0.8})  # monotone: b never below a
    assert holm({"a": 0.6, "b": 0.7}) == {"a": 1.0, "b": 1.0}


def test_the_best_of_k_runs_null_is_each_victims_null_maxed_and_the_trivial_bar_counts():
    """The LoRA-ViT optimisation rows grade the best of k B = 1 runs, each seed its own victim: their null is, per
    draw, the best over the k victims' own null draws, and the PSNR bar is also the trivial images' best over them
    (the audit's best-image rule). k = 1 is the audit's null of that one victim."""
    import numpy as np

    from gradleak.evaluation.nulls import image_null, reference_images

    n = _module("nulls")
    cmd = ("gradleak run configs/lora_vit/cifar_b1.yaml --out D --set attack.name=ig --set attack.anchor=false "
           "--set data.seed=0 --set seed=0")
    one = n.best_of_runs_null(cmd, 1, {"psnr": 30.0, "ssim": 0.5})
    x, pool, _ = n._image_pool(n.config_from_command(cmd))
    own = image_null(x, pool, n=1, match="hungarian", draws=n.DRAWS, seed=17)
    assert one["psnr"]["null_p99"] == pytest.approx(float(np.quantile(own["psnr_max"], 0.99)))
    ref = reference_images(x, pool)
    assert one["psnr"]["trivial_bar"] == pytest.approx(max(ref[f"psnr_max_{r}"] for r in ("grey", "flat", "mean_public")))
    three = n.best_of_runs_null(cmd, 3, {"psnr": 30.0, "ssim": 0.5})
    assert three["psnr"]["null_p99"] >= one["psnr"]["null_p99"] and three["psnr"]["trivial_bar"] >= one["psnr"]["trivial_bar"]
    assert three["psnr"]["beyond_null"] is True  # 30 dB clears both bars
    q = three["psnr"]
    assert q["trivial_bar"] > q["null_p99"]  # on these CIFAR victims a flat image beats the random-image null
    between = n.best_of_runs_null(cmd, 3, {"psnr": (q["null_p99"] + q["trivial_bar"]) / 2, "ssim": 0.0})
    assert between["psnr"]["beyond_null"] is False  # above the null but below the trivial images: chance
