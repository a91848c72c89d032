"""The leakage experiment's report (paper 003): t-SNE embedding, the per-client per-round table and its
verdicts from a results dict alone, the PNG writers, and the report.html section. No model is loaded."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from gradleak.errors import BadInput
from gradleak.metrics.leakage import tsne_embedding
from gradleak.report import render_html, write_report
from gradleak.report.leakage import (LEAKS, UNDEFINED, WITHHELD, WITHIN, is_leakage, leakage_markdown, leakage_rows,
                                     save_reconstruction_grid, save_tsne_plot)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_tsne_is_deterministic_and_keeps_group_shapes(one_thread):
    g = torch.Generator().manual_seed(0)
    groups = {"client 0 training": torch.randn(9, 16, generator=g), "client 1 training": torch.randn(4, 16, generator=g) + 3,
              "client 1 reconstruction (round 2)": torch.randn(3, 16, generator=g), "empty": torch.zeros(0, 16)}
    a, b = tsne_embedding(groups, seed=3), tsne_embedding(groups, seed=3)
    assert list(a) == list(groups)
    assert {k: v.shape for k, v in a.items()} == {k: (len(v), 2) for k, v in groups.items()}
    assert all(v.dtype == np.float64 and np.isfinite(v).all() for v in a.values())
    assert all(np.array_equal(a[k], b[k]) for k in a)
    # perplexity above the sample count is clipped (scikit-learn would refuse it); tiny inputs still work
    small = tsne_embedding({"x": torch.randn(3, 4, generator=g)}, perplexity=50)
    assert small["x"].shape == (3, 2) and np.isfinite(small["x"]).all()
    assert tsne_embedding({"x": torch.ones(1, 4)})["x"].tolist() == [[0.0, 0.0]]
    with pytest.raises(BadInput):
        tsne_embedding({"a": torch.randn(3, 4), "b": torch.randn(3, 5)})


def _results():
    """A leakage results dict as `gradleak run` writes it (two rounds of three clients, one withheld update)."""
    m = {}

    def put(c, r, ssim, prior, mean, low, high, iip=None, cos=None, **extra):
        vals = {"ssim": ssim, "ssim_prior": prior, "rdlv": mean, "rdlv_low": low, "rdlv_high": high, **extra}
        if iip is not None:
            vals.update({"iip": iip, "iip_matched_cosine": cos})
        m.update({f"{k}_client{c}_round{r}": v for k, v in vals.items()})

    put(0, 2, 0.17, 0.18, -0.01, -0.26, 0.25, 0.0, math.nan, images=8, local_steps=2)
    put(1, 2, 0.30, 0.09, 2.07, 0.10, 6.0, 0.5, 0.97, images=4, local_steps=1)  # lower bound > 0: leaks
    put(2, 2, 0.45, 0.37, 0.22, 0.22, 0.22, 1.0, 0.99, images=1, local_steps=1)  # one image: [v, v], v > 0
    put(2, 1, 0.30, 0.37, -0.19, -0.19, -0.19, 0.0, math.nan, images=1, local_steps=1)
    put(0, 1, 0.18, 0.18, 0.0, 0.0, 0.0, 0.0, math.nan, images=8, local_steps=0, withheld=1.0)
    put(1, 1, 0.0, -0.1, math.nan, math.nan, math.nan, 0.0, math.nan)  # prior SSIM ≤ 0: undefined
    m.update({"rdlv_client1": 2.07, "rdlv_low_client1": 0.10, "high_risk_client": 2.0})  # aliases are not rows
    return {"name": "leak", "experiment": "leakage", "metrics": m, "config": {"fl": {"client_images": [8, 4, 1]}}}


def test_table_rows_from_a_results_dict_give_the_verdicts():
    res = _results()
    rows = leakage_rows(res)
    assert [(r["client"], r["round"]) for r in rows] == [(0, 1), (0, 2), (1, 1), (1, 2), (2, 1), (2, 2)]
    by = {(r["client"], r["round"]): r for r in rows}
    assert by[1, 2]["verdict"] == LEAKS == "leaks beyond the prior"
    assert by[2, 2]["verdict"] == LEAKS
    assert by[0, 2]["verdict"] == WITHIN == "within the prior"  # mean ≈ 0 but the interval straddles 0
    assert by[2, 1]["verdict"] == WITHIN
    assert by[0, 1]["verdict"] == WITHHELD and by[0, 1]["local_steps"] == 0
    assert by[1, 1]["verdict"] == UNDEFINED
    r = by[1, 2]
    assert (r["images"], r["local_steps"], r["ssim"], r["ssim_prior"], r["iip"], r["iip_matched_cosine"]) == \
        (4, 1, 0.30, 0.09, 0.5, 0.97)
    assert r["rdlv_interval"] == "+2.07 [+0.1, +6]"
    assert by[1, 1]["images"] == 4 and by[1, 1]["local_steps"] is None  # images from the config, steps unknown
    md = leakage_markdown(res)
    assert md.count("\n") == len(rows) + 1 and "RDLV [low, high]" in md and "leaks beyond the prior" in md
    assert is_leakage(res) and not is_leakage({"metrics": {"rdlv_client0": 1.0, "psnr": 3.0}})
    assert leakage_rows({"metrics": {"psnr": 20.0}}) == [] and leakage_markdown({}) == ""


def test_reconstruction_grid_png_puts_the_prior_first(tmp_path):
    orig = torch.zeros(3, 1, 4, 4)
    rec = torch.ones(3, 1, 4, 4)
    prior = torch.full((1, 4, 4), 0.5)
    p = save_reconstruction_grid(orig, rec, prior, tmp_path / "reconstructions_client0_round1.png",
                                 order=torch.tensor([2, 0, 1]), upscale=1)
    assert p.read_bytes()[:8] == PNG_MAGIC
    img = np.asarray(Image.open(p))
    assert img.shape == (2 * 5 + 1, 4 * 5 + 1, 3)  # 2 rows × (prior + 3) columns, 1 px padding
    cell = lambda row, col: img[1 + 5 * row:5 + 5 * row, 1 + 5 * col:5 + 5 * col]  # noqa: E731
    assert (cell(0, 0) == 128).all() and (cell(1, 0) == 128).all()  # the prior, both rows
    assert (cell(0, 1) == 0).all() and (cell(1, 1) == 255).all()  # original above its reconstruction
    rgb = save_reconstruction_grid(torch.rand(20, 3, 8, 8), torch.rand(20, 3, 8, 8), torch.rand(3, 8, 8),
                                   tmp_path / "rgb.png", max_images=16, upscale=2)
    assert Image.open(rgb).size == ((17 * 9 + 1) * 2, (2 * 9 + 1) * 2)
    assert not list(tmp_path.glob("*.tmp"))


def test_tsne_plot_png(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    emb = {"client 0 training": np.random.default_rng(0).normal(size=(5, 2)),
           "client 0 reconstruction (round 1)": np.zeros((1, 2)), "other": np.ones((2, 2)), "none": np.zeros((0, 2))}
    meta = {"client 0 training": {"client": 0, "reconstruction": False},
            "client 0 reconstruction (round 1)": {"client": 0, "reconstruction": True}}
    p = save_tsne_plot(emb, tmp_path / "tsne.png", meta)
    assert p == tmp_path / "tsne.png" and p.read_bytes()[:8] == PNG_MAGIC
    assert Image.open(p).size == (640, 520)
    assert not list(tmp_path.glob("*.tmp"))
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # matplotlib missing: skipped, nothing written
    assert save_tsne_plot(emb, tmp_path / "none.png", meta) is None and not (tmp_path / "none.png").exists()


def test_report_html_has_the_leakage_table_then_its_figures(tmp_path):
    res = _results()
    save_reconstruction_grid(torch.rand(2, 1, 4, 4), torch.rand(2, 1, 4, 4), torch.rand(1, 4, 4),
                             tmp_path / "reconstructions_client1_round2.png")
    save_reconstruction_grid(torch.rand(1, 1, 4, 4), torch.rand(1, 1, 4, 4), torch.rand(1, 4, 4), tmp_path / "other.png")
    extra = {"figures": [{"title": "client 1, round 2", "path": "reconstructions_client1_round2.png"},
                         {"title": "something else", "path": "other.png"}],
             "figure_rows": [[0, 1]], "tables": [], "notes": []}
    html = write_report(res, tmp_path, extra).read_text()
    section = html.split("<h2>Leakage per client and round</h2>")[1]
    # the answer first, then the reconstructions (the leakage table and its figures, then Figures), the metrics below
    assert html.index("<h2>Leakage per client and round</h2>") < html.index("<h2>Figures</h2>") < html.index("<h2>Metrics</h2>")
    for word in ("local steps", "RDLV [low, high]", "matched cosine", "leaks beyond the prior", "within the prior",
                 "withheld (nothing sent)"):
        assert word in section, word
    table, after = section.split("</table>", 1)
    assert table.count("<tr>") == 1 + 6
    assert after.index("client 1, round 2") < after.index("<h2>Figures</h2>")
    assert html.count("data:image/png;base64,") == 2  # the leakage PNG is not repeated under Figures
    # rebuilt from results.json alone (no report_data.json): the PNGs in the directory are found
    alone = render_html(res, tmp_path, {})
    assert "reconstructions client1 round2" in alone and alone.count("data:image/png;base64,") == 1
    # other runs: no leakage section
    assert "Leakage per client" not in render_html({"name": "x", "metrics": {"psnr": 20.0}}, tmp_path, {})
