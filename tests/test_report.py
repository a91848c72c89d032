"""gradleak.report: self-contained HTML with embedded figures, report_data.json, grey NaN pixels."""

from __future__ import annotations

import base64
import json
import math

import numpy as np
import torch
from PIL import Image

from gradleak.report import markdown_table, rebuild_report, save_image_grid, update_section, write_report


def _results():
    return {"name": "peftleak-cifar-b32", "experiment": "peftleak",
            "config": {"data": {"name": "cifar-samples", "batch_size": 32}, "seed": 0},
            "metrics": {"patch_recovery_rate": 0.83, "ssim_mean": 0.88, "psnr_mean": math.inf, "lpips_mean": None},
            "timings": {"attack_seconds": 1.5, "total_seconds": 2.0},
            "environment": {"python": "3.11", "torch": "2.13.0"}, "artifacts": ["truth.png"]}


def test_save_image_grid_nan_is_grey(tmp_path):
    x = torch.zeros(3, 3, 4, 4)
    x[1] = 1.0
    x[2] = float("nan")
    p = save_image_grid(x, tmp_path / "g.png", nrow=3, upscale=2, padding=1)
    img = np.asarray(Image.open(p))
    assert img.shape == ((4 + 2) * 2, (3 * 5 + 1) * 2, 3)
    cell = lambda i: img[2:10, (1 + 5 * i) * 2:(1 + 5 * i) * 2 + 8]  # noqa: E731
    assert (cell(0) == 0).all() and (cell(1) == 255).all()
    assert (cell(2) == 128).all()  # NaN -> grey 0.5
    grey = save_image_grid(torch.rand(2, 1, 32, 32), tmp_path / "grey.png", upscale=4)
    assert Image.open(grey).size == ((2 * 33 + 1) * 4, 34 * 4)


def test_write_report_embeds_figures_and_tables(tmp_path):
    save_image_grid(torch.rand(4, 3, 8, 8), tmp_path / "truth.png")
    save_image_grid(torch.full((4, 3, 8, 8), float("nan")), tmp_path / "recon.png")
    extra = {"figures": [{"title": "ground truth", "path": "truth.png", "caption": "client batch"},
                         {"title": "reconstruction", "path": "recon.png", "caption": "grey = not recovered"},
                         {"title": "lost", "path": "missing.png"}],
             "figure_rows": [["ground truth", "reconstruction"]],
             "tables": [{"title": "Per-image metrics", "columns": ["image", "ssim"],
                         "rows": [{"image": 0, "ssim": 0.91}, {"image": 1, "ssim": 0.5}]}],
             "notes": ["feature distance on ViT-S/14 <offline>"]}
    html_path = write_report(_results(), tmp_path, extra)
    html = html_path.read_text()
    assert html_path == tmp_path / "report.html"
    for word in ("peftleak-cifar-b32", "patch_recovery_rate", "ssim_mean", "attack_seconds", "Per-image metrics",
                 "batch_size: 32", "client batch", "∞", "&lt;offline&gt;", "image missing: missing.png"):
        assert word in html, word
    assert html.count("data:image/png;base64,") == 2
    src = html.split("data:image/png;base64,")[1].split('"')[0]
    assert base64.b64decode(src) == (tmp_path / "truth.png").read_bytes()
    # ground truth and reconstruction share one row
    row = html.split('<div class="row">')[1].split("</div>")[0]
    assert "ground truth" in row and "reconstruction" in row
    assert json.loads((tmp_path / "report_data.json").read_text()) == extra
    assert not list(tmp_path.glob("*.tmp"))
    (tmp_path / "results.json").write_text(json.dumps(_results(), allow_nan=True))
    (tmp_path / "report.html").unlink()
    assert "patch_recovery_rate" in rebuild_report(tmp_path).read_text()


def test_write_report_minimal(tmp_path):
    p = write_report({"name": "x", "metrics": {}}, tmp_path / "new", {})
    assert "No metrics" in p.read_text()


def test_markdown_reexports(tmp_path):
    assert "| a |" in markdown_table([{"a": 1}], ["a"])
    update_section(tmp_path / "R.md", "k", "body")
    assert "body" in (tmp_path / "R.md").read_text()


def test_run_report_opens_with_the_runs_warnings(tmp_path):
    """An attack's warning (e.g. lora_span on an under-determined setting) is a box under the title, from
    results.json alone (so `gradleak report` keeps it), not a table at the page's end."""
    from html.parser import HTMLParser

    w = "lora_span: under-determined setting, the rank condition fails (batch of 2)"
    res = {**_results(), "details": {"warnings": [w]}}
    extra = {"tables": [{"title": "Warnings", "columns": ["warning"], "rows": [{"warning": w}]}]}
    page = write_report(res, tmp_path, extra).read_text()

    class P(HTMLParser):
        box, depth, h2 = "", 0, []

        def handle_starttag(self, tag, attrs):
            if dict(attrs).get("id") == "warnings" or self.depth:
                self.depth += tag == "div"

        def handle_endtag(self, tag):
            if self.depth and tag == "div":
                self.depth -= 1

        def handle_data(self, data):
            if self.depth:
                self.box += data
            if self.lasttag == "h2":
                self.h2.append(data)

    p = P()
    p.feed(page)
    assert w in p.box and "Warnings" not in p.h2
    assert page.index('id="warnings"') < page.index("<h2>Metrics</h2>")
