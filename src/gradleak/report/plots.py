"""Plots of the audit's advice (``gradleak audit --advise``): privacy against utility along each defense's strength."""

from __future__ import annotations

from pathlib import Path

from gradleak.report.images import save_png_atomically


def _num(v) -> bool:
    return isinstance(v, (int, float)) and v == v


def save_privacy_utility_plot(panels: list[dict], path: str | Path) -> Path:
    """One panel per defense: each attack's headline against the strength, on its null's scale -- (value - null
    median) / (null p99 - null median), so the null band (median to 99th percentile, shaded) is [0, 1] for every
    attack and a point above 1 is beyond the null (a leak) -- the strength found (a vertical line), and the global
    model's test accuracy (dashed, right axis) beside the undefended one (dotted).

    ``panels``: ``[{"title", "log": bool, "found", "baseline_accuracy", "points": [{"x", "accuracy",
    "attacks": {name: {"value", "null_median", "null_p99", "metric"}}}]}]``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(panels)
    cols = min(3, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.4 * rows), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, p in zip(axes.flat, panels):
        pts = p["points"]
        xs = [t["x"] for t in pts]
        names = sorted({a for t in pts for a in t["attacks"]})
        ax.axhspan(0, 1, color="grey", alpha=0.15, label="null band (median to p99)")
        for k, a in enumerate(names):
            c = colours[k % len(colours)]
            v = [(t["x"], t["attacks"][a]) for t in pts if a in t["attacks"]
                 and all(_num(t["attacks"][a].get(f)) for f in ("value", "null_median", "null_p99"))
                 and t["attacks"][a]["null_p99"] > t["attacks"][a]["null_median"]]
            if not v:
                continue
            metric = next((e.get("metric") for _, e in v if e.get("metric")), "headline")
            ax.plot([x for x, _ in v], [(e["value"] - e["null_median"]) / (e["null_p99"] - e["null_median"])
                                        for _, e in v], "o-", color=c, label=f"{a} ({metric})")
        if _num(p.get("found")):
            ax.axvline(p["found"], color="k", lw=0.8, ls="-.", label="weakest that stops")
        if p.get("log") and all(x > 0 for x in xs):
            ax.set_xscale("log")
        ax.set_title(p["title"], fontsize=10)
        ax.set_xlabel("strength")
        ax.set_ylabel("headline, null scale (>1: leaks)")
        acc = [(t["x"], t["accuracy"]) for t in pts if _num(t.get("accuracy"))]
        if acc:
            ax2 = ax.twinx()
            ax2.plot([x for x, _ in acc], [y for _, y in acc], "s--", color="grey", label="test accuracy")
            if _num(p.get("baseline_accuracy")):
                ax2.axhline(p["baseline_accuracy"], color="grey", ls=":", lw=1, label="accuracy, no defense")
            ax2.set_ylim(0, 1)
            ax2.set_ylabel("test accuracy", color="grey")
            h1, l1 = ax.get_legend_handles_labels()
            h2, l2 = ax2.get_legend_handles_labels()
            ax.legend(h1 + h2, l1 + l2, fontsize=6, loc="best")
        else:
            ax.legend(fontsize=6, loc="best")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    try:
        return save_png_atomically(path, lambda tmp: fig.savefig(tmp, format="png", dpi=90))
    finally:
        plt.close(fig)
