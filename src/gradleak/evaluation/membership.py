"""The ``membership`` unit: membership-inference scores (ProjRes; docs/DESIGN.md §2).

Scores: ROC AUC, TPR at 1 % / 0.1 % FPR, per-layer AUC (with a defense's per-layer guarantee,
:func:`split_by_guarantee`). Null: random member sets of the same size (label permutations), a bootstrap 95 %
interval of the AUC and the exact binomial interval of the TPR. Levels: no exact (nothing is reconstructed); strong =
TPR at 1 % FPR >= 0.1 and beyond its null; partial = |AUC - 0.5| beyond its null (an inverted signal leaks too).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from gradleak.evaluation.base import Evaluation, EvaluationUnit, Truth, attach_null, register
from gradleak.evaluation.levels import STRONG_TPR, bar, beyond, graded, number
from gradleak.evaluation.nulls import roc_summary


def evaluate_membership(truth: Truth, rec, cfg, out_dir: Path, trial: int) -> Evaluation:
    scores = rec.data["scores"]
    labels, flat = [], []
    scored = {ci: lab for ci, lab in (truth.membership or {}).items() if ci in scores}  # an attack may score a subset
    for ci, lab in scored.items():
        labels += [int(v) for v in lab]
        flat += list(scores[ci])
    m = roc_summary(labels, flat)
    m["members"] = float(sum(labels))
    m["nonmembers"] = float(len(labels) - sum(labels))
    if cfg.metrics.null:  # random member sets (label permutations); bootstrap / exact binomial intervals
        from gradleak.evaluation.nulls import membership_null

        nul = membership_null(labels, flat, draws=cfg.metrics.null_draws, seed=cfg.seed + 29)
        m["auc_distance"] = abs(m["auc"] - 0.5)
        attach_null(m, "auc", nul["auc"])
        attach_null(m, "auc_distance", np.abs(nul["auc"] - 0.5))
        attach_null(m, "tpr_at_1pct_fpr", nul["tpr_at_1pct_fpr"])
        m["auc_low"], m["auc_high"] = nul["auc_interval"]
        m["tpr_at_1pct_fpr_low"], m["tpr_at_1pct_fpr_high"] = nul["tpr_interval"]
    per_layer = []
    for name, by_client in (rec.info.get("layer_scores") or {}).items():
        ls = [v for ci in scored for v in by_client[ci]]
        auc = roc_summary(labels, ls)["auc"]
        per_layer.append({"layer": name, "auc": round(auc, 4),
                          "rank": rec.info.get("rank_per_layer", {}).get(name),
                          "input_width": rec.info.get("input_width_per_layer", {}).get(name)})
    if per_layer:
        m["auc_best_layer"] = max(r["auc"] for r in per_layer)  # oracle choice (uses the truth): diagnostic only
    notes = [f"{int(m['members'])} members vs {int(m['nonmembers'])} non-members pooled over the observed clients; "
             "auc_best_layer picks the layer with the truth (an upper bound, not an attack)."]
    if m["nonmembers"] < 1000:
        notes.append(f"only {int(m['nonmembers'])} non-members: TPR at 0.1 % FPR is not resolved below 1,000.")
    tables = [{"title": "ProjRes AUC per layer", "columns": ["layer", "auc", "rank", "input_width"], "rows": per_layer}]
    figs, arts = _roc_figure(labels, flat, out_dir, trial, m) if getattr(cfg.metrics, "figures", True) else ([], [])
    return Evaluation(m, figures=figs, tables=tables, notes=notes, artifacts=arts)


def _roc_figure(labels, scores, out_dir: Path, trial: int, m: dict) -> tuple[list[dict], list[str]]:
    """The ROC curve on log-log axes (the low-FPR regime is what matters for membership), as ``roc*.png``."""
    if len(set(labels)) < 2:
        return [], []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from sklearn.metrics import roc_curve

    fpr, tpr, _ = roc_curve(labels, scores)
    name = "roc.png" if trial == 0 else f"roc_trial{trial}.png"
    fig, ax = plt.subplots(figsize=(4.5, 4))
    lo = 1.0 / max(1, len(labels) - sum(labels))
    ax.plot(fpr.clip(lo), tpr.clip(lo), label=f"attack (AUC {m['auc']:.3f})")
    ax.plot([lo, 1], [lo, 1], "--", color="grey", label="chance")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("false-positive rate")
    ax.set_ylabel("true-positive rate")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    from gradleak.report.images import save_png_atomically

    save_png_atomically(out_dir / name, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)
    return [{"title": "ROC (log axes)", "path": name,
             "caption": f"TPR at 1 % FPR {m.get('tpr_at_1pct_fpr', float('nan')):.3g}"}], [name]


def split_by_guarantee(ev: Evaluation, condition: dict[str, bool]) -> None:
    """Annotate the per-layer AUC table with a defense's per-layer guarantee (FISGuard: rank(G_U) = r in every
    observed update) and add the largest per-layer AUC among the layers where it holds, where it fails, and among
    the unprotected layers (``auc_max_guarantee_holds`` / ``_fails`` / ``auc_max_unprotected``, each with its layer
    count ``layers_guarantee_holds`` / ... ; a group without layers has count 0 and no AUC key)."""
    table = next((t for t in ev.tables if t.get("title") == "ProjRes AUC per layer"), None)
    if table is None or not condition:
        return
    groups: dict[str, list[float]] = {"holds": [], "fails": [], "unprotected": []}
    for row in table["rows"]:
        state = condition.get(row["layer"])
        row["guarantee"] = "unprotected" if state is None else ("holds" if state else "fails")
        groups[row["guarantee"]].append(row["auc"])
    table["columns"] = table["columns"] + ["guarantee"]
    for g, aucs in groups.items():
        key = "auc_max_unprotected" if g == "unprotected" else f"auc_max_guarantee_{g}"
        if aucs:
            ev.metrics[key] = max(aucs)
        ev.metrics[f"layers_{'unprotected' if g == 'unprotected' else 'guarantee_' + g}"] = float(len(aucs))
    failing = [r["layer"] for r in table["rows"] if r["guarantee"] == "fails"]
    if failing:
        ev.notes.append("the defense's guarantee does not hold (rank(G_U) < r) on " + ", ".join(failing)
                        + ": these layers are not protected against ProjRes.")


def grade_membership(m: Mapping[str, Any], thr: float = 30.0) -> dict:
    del thr
    auc = number(m, "auc")
    ev = {"auc": auc, "auc_interval": [number(m, "auc_low"), number(m, "auc_high")],
          "tpr_at_1pct_fpr": number(m, "tpr_at_1pct_fpr"), "tpr_at_1pct_fpr_bar": bar(m, "tpr_at_1pct_fpr"),
          "auc_distance_bar": bar(m, "auc_distance"), "members": number(m, "members"), "nonmembers": number(m, "nonmembers")}
    d = beyond(m, "auc_distance")
    if d is None or math.isnan(auc):
        return graded("undefined", "AUC undefined (needs members and non-members among the candidates)", **ev)
    t = beyond(m, "tpr_at_1pct_fpr")
    if t and number(m, "tpr_at_1pct_fpr") >= STRONG_TPR:
        return graded("strong", f"TPR at 1 % FPR >= {STRONG_TPR:g} and beyond the null", **ev)
    if d:
        side = "above" if auc > 0.5 else "below (an inverted signal)"
        return graded("partial", f"AUC {side} 0.5 beyond the null's 99th percentile of |AUC - 0.5|", **ev)
    return graded("none", "|AUC - 0.5| not beyond the null", **ev)



def _audit_fields(m: Mapping[str, Any]) -> dict:
    return {"tpr_at_1pct_fpr": m.get("tpr_at_1pct_fpr"), "auc_interval": [m.get("auc_low"), m.get("auc_high")]}


UNIT = register(EvaluationUnit("membership", evaluate_membership, headline="auc", grade=grade_membership,
                               sweep_metric="auc", audit_fields=_audit_fields,
                               decided_by=lambda m, level: "tpr_at_1pct_fpr" if level == "strong" else "auc_distance"),
                "membership scores: ROC AUC, TPR at 1 % / 0.1 % FPR, per layer")
