"""The leakage experiment's report parts (Hatamizadeh et al. 2022 §III-C–F: SSIM, RDLV, IIP, t-SNE).

* :func:`leakage_rows` — the per-client, per-round table built from a results dict alone (``results["metrics"]``
  names ``ssim_client{c}_round{r}``, ``rdlv_low_client{c}_round{r}``, …; see
  :func:`gradleak.evaluation.leakage.evaluate_leakage`), with the verdict "leaks beyond the prior" when the
  lower bound of the RDLV's 95 % interval is > 0 (the paper's "leaks beyond the confidence interval");
* :func:`save_reconstruction_grid` — one PNG per attacked (client, round): the prior in the first column, then
  each original (top row) above its best-matching reconstruction (bottom row);
* :func:`save_tsne_plot` — the t-SNE map (:func:`gradleak.metrics.leakage.tsne_embedding`) as a PNG, coloured by
  client, training images as dots and reconstructions as crosses (matplotlib, Agg canvas, no pyplot state);
  returns ``None`` when matplotlib is missing;
* :func:`leakage_markdown` — the same table as Markdown.

All PNGs are written atomically (temp file + ``os.replace``).
"""

from __future__ import annotations

import math
import re
import textwrap
from pathlib import Path
from typing import Any

import torch

from gradleak.report.images import save_image_grid
from gradleak.report.markdown import markdown_table

LEAKS = "leaks beyond the prior"
WITHIN = "within the prior"
UNDEFINED = "undefined (prior SSIM ≤ 0)"
WITHHELD = "withheld (nothing sent)"

COLUMNS = ["client", "round", "images", "local_steps", "ssim", "ssim_prior", "rdlv_interval", "iip",
           "iip_matched_cosine", "verdict"]
HEADERS = ["client", "round", "images", "local steps", "SSIM", "SSIM prior", "RDLV [low, high]", "IIP",
           "matched cosine", "verdict"]
TABLE_TITLE = "Leakage per client and round"

_KEY = re.compile(r"^rdlv_client(\d+)_round(\d+)$")
FIGURE_NAME = re.compile(r"^(reconstructions_client\d+_round\d+|tsne)(_trial\d+)?\.png$")


def _num(v: Any) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _fmt(v: float | None, digits: int = 3) -> str:
    if v is None:
        return "–"
    if math.isnan(v):
        return "NaN"
    return f"{v:+.{digits}g}" if abs(v) < 1e4 else f"{v:+.3e}"


def verdict(rdlv_low: float | None) -> str:
    """``"leaks beyond the prior"`` when the RDLV's lower bound is > 0, ``"within the prior"`` otherwise;
    undefined (NaN / missing: every original had SSIM(prior, x) ≤ 0) is said so."""
    v = _num(rdlv_low)
    if v is None or math.isnan(v):
        return UNDEFINED
    return LEAKS if v > 0 else WITHIN


def is_leakage(results: dict) -> bool:
    """Whether the results hold per-client, per-round leakage metrics."""
    return any(_KEY.match(k) for k in (results.get("metrics") or {}))


def _config_images(results: dict) -> list | None:
    fl = ((results.get("config") or {}).get("fl") or {})
    images = fl.get("client_images")
    return list(images) if isinstance(images, (list, tuple)) else None


def leakage_rows(results: dict) -> list[dict]:
    """One row per attacked (client, round) found in ``results["metrics"]``, sorted by client then round.

    Each row holds ``client``, ``round``, ``images`` (``images_client{c}_round{r}``, else the config's
    ``fl.client_images[c]``), ``local_steps`` (``local_steps_client{c}_round{r}``), ``ssim``, ``ssim_prior``,
    ``rdlv``, ``rdlv_low``, ``rdlv_high``, ``rdlv_interval`` (text "mean [low, high]"), ``iip``,
    ``iip_matched_cosine`` (``None`` where not measured) and ``verdict`` (:func:`verdict` of ``rdlv_low``; "withheld
    (nothing sent)" where ``withheld_client{c}_round{r}`` is set: the client sent no update that round).
    """
    m = results.get("metrics") or {}
    cfg_images = _config_images(results)
    pairs = sorted({(int(g.group(1)), int(g.group(2))) for k in m for g in [_KEY.match(k)] if g})
    rows = []
    for c, r in pairs:
        get = lambda name: _num(m.get(f"{name}_client{c}_round{r}"))  # noqa: E731
        images = get("images")
        if images is None and cfg_images is not None and c < len(cfg_images):
            images = _num(cfg_images[c])
        steps = get("local_steps")
        row = {"client": c, "round": r,
               "images": int(images) if images is not None and math.isfinite(images) else None,
               "local_steps": int(steps) if steps is not None and math.isfinite(steps) else None,
               "ssim": get("ssim"), "ssim_prior": get("ssim_prior"),
               "rdlv": get("rdlv"), "rdlv_low": get("rdlv_low"), "rdlv_high": get("rdlv_high"),
               "iip": get("iip"), "iip_matched_cosine": get("iip_matched_cosine")}
        row["rdlv_interval"] = f"{_fmt(row['rdlv'])} [{_fmt(row['rdlv_low'])}, {_fmt(row['rdlv_high'])}]"
        row["verdict"] = WITHHELD if (get("withheld") or 0) > 0 else verdict(row["rdlv_low"])
        rows.append(row)
    return rows


def leakage_table(results: dict) -> dict | None:
    """The table in the report's ``{"title", "columns", "headers", "rows"}`` form, or ``None`` (not a leakage run)."""
    rows = leakage_rows(results)
    if not rows:
        return None
    return {"title": TABLE_TITLE, "columns": COLUMNS, "headers": HEADERS, "rows": rows}


def leakage_markdown(results: dict) -> str:
    """The per-client, per-round table as Markdown ("" for a run without leakage metrics)."""
    rows = leakage_rows(results)
    return markdown_table(rows, COLUMNS, HEADERS) if rows else ""


# ------------------------------------------------------------------------------------------------ figures

def save_reconstruction_grid(originals: torch.Tensor, reconstructions: torch.Tensor, prior: torch.Tensor,
                             path: str | Path, order: torch.Tensor | None = None, max_images: int = 16,
                             upscale: int | None = None) -> Path:
    """PNG grid: column 0 the prior (both rows), then original i (top) above reconstruction ``order[i]`` (bottom).

    ``originals`` K×C×H×W, ``reconstructions`` N×C×H×W, ``prior`` C×H×W (or 1×C×H×W / one per original: the
    first is shown), all in [0, 1]; ``order``: the reconstruction matched to each original (default: i ↔ i,
    K ≤ N). At most ``max_images`` originals are shown. Written atomically; returns the path.
    """
    orig = torch.as_tensor(originals).detach().to("cpu", torch.float32)
    rec = torch.as_tensor(reconstructions).detach().to("cpu", torch.float32)
    pri = torch.as_tensor(prior).detach().to("cpu", torch.float32)
    pri = pri.reshape(-1, *orig.shape[1:])[:1] if pri.ndim == 4 else pri.reshape(1, *orig.shape[1:])
    show = min(len(orig), max_images)
    idx = torch.arange(show) if order is None else torch.as_tensor(order).reshape(-1)[:show].long()
    if rec.shape[1:] != orig.shape[1:]:
        raise ValueError(f"reconstructions {tuple(rec.shape[1:])} and originals {tuple(orig.shape[1:])} differ in shape")
    top = torch.cat([pri, orig[:show]])
    bottom = torch.cat([pri, rec[idx]])
    side = orig.shape[-1]
    return save_image_grid(torch.cat([top, bottom]), path, nrow=show + 1,
                           upscale=upscale if upscale is not None else max(1, 96 // max(1, side)))


def save_tsne_plot(embedding: dict, path: str | Path, meta: dict[str, dict] | None = None,
                   title: str = "t-SNE of image features") -> Path | None:
    """Scatter plot of a t-SNE map (group name → N×2) as a PNG; ``None`` (nothing written) without matplotlib.

    ``meta``: group name → ``{"client": int, "reconstruction": bool}``; colour = client, dots = training
    images, crosses = reconstructions. Groups without meta are drawn in grey dots.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    import numpy as np

    meta = meta or {}
    fig = Figure(figsize=(6.4, 5.2), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    palette = [f"C{i}" for i in range(10)]
    for name, pts in embedding.items():
        pts = np.asarray(pts, dtype=float).reshape(-1, 2)
        if not len(pts):
            continue
        info = meta.get(name, {})
        c = info.get("client")
        colour = palette[int(c) % len(palette)] if c is not None else "0.5"
        if info.get("reconstruction"):
            ax.scatter(pts[:, 0], pts[:, 1], marker="X", s=90, c=colour, edgecolors="black", linewidths=0.8,
                       label=name, zorder=3)
        else:
            ax.scatter(pts[:, 0], pts[:, 1], marker="o", s=28, c=colour, alpha=0.75, label=name, zorder=2)
    ax.set_title(textwrap.fill(title, 72), fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.legend(fontsize=7, loc="best", framealpha=0.8)
    fig.tight_layout()
    from gradleak.report.images import save_png_atomically

    return save_png_atomically(path, lambda tmp: fig.savefig(tmp, format="png"))


__all__ = ["leakage_rows", "leakage_table", "leakage_markdown", "verdict", "is_leakage", "save_reconstruction_grid",
           "save_tsne_plot", "COLUMNS", "HEADERS", "TABLE_TITLE", "FIGURE_NAME", "LEAKS", "WITHIN", "UNDEFINED",
           "WITHHELD"]
