"""The ``membership`` unit: membership-inference scores (ProjRes; docs/DESIGN.md §2).

Scores: ROC AUC, TPR at 1 % / 0.1 % FPR, per-layer AUC (with a defense's per-layer guarantee,
:func:`split_by_guarantee`). Null: random member sets of the same size (label permutations), a bootstrap 95 %
interval of the AUC and the exact binomial interval of the TPR. Every result carries its members / non-members
counts (``members``, ``nonmembers``; the audit prints them beside the level).

Levels (docs/DESIGN.md §6: every level beyond its null): no exact (nothing is reconstructed); strong = TPR at 1 % FPR
>= 0.1 and beyond its null, **graded only when the non-members resolve a 1 % FPR** (at least 1 / 0.01 = 100 of them,
:data:`NONMEMBERS_FOR_STRONG`); partial = |AUC - 0.5| beyond its null (an inverted signal leaks too).

Why the TPR needs 100 non-members: the ROC's false-positive rates are k / n0 for n0 non-members, so below 100 the
largest TPR "at FPR <= 1 %" is the TPR at FPR 0 -- the members scored above *every* non-member -- and all a sample of
n0 says about that threshold's true FPR is that it is below the exact binomial bound 1 - 0.05^(1/n0) (17 % for
n0 = 16, 6 % for 48), not that it is 1 %. A ``strong`` read there would claim a low-FPR operating point the sample
cannot show. The level then rests on what the sample does resolve, each against its own null (the same label
permutations), and is ``partial`` at most: the ROC AUC (|AUC - 0.5| beyond its null), the metric the FISGuard paper
evaluates ProjRes by (paper 004, Sec. V-B; Sec. VI: AUC = 1/2 when every residual ties), or the same TPR read as
what it is, the TPR at FPR 0, >= 0.1 and beyond its null (the smallest FPR n0 non-members resolve). These are the
two tests the level always had (the TPR for strong, the AUC for partial), so chance reaches a leaking level no more
often than before; a result that was strong on an unresolved sample stays a leak (``partial``), never green
(docs/DESIGN.md §6). The rule names the count and what it needs ("needs >= 100 non-members, has 16").
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from gradleak.evaluation.base import Evaluation, EvaluationUnit, Truth, attach_null, register
from gradleak.evaluation.levels import STRONG_TPR, bar, beyond, graded, number
from gradleak.evaluation.nulls import roc_summary

#: the false-positive rate the strong level reads the TPR at, and the non-members that resolve it (1 / FPR): with
#: fewer, the TPR "at 1 % FPR" is the TPR at FPR 0 (module docstring) and is not graded
STRONG_FPR = 0.01
NONMEMBERS_FOR_STRONG = 100


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
    if m["nonmembers"] < NONMEMBERS_FOR_STRONG:
        notes.append(f"only {int(m['nonmembers'])} non-members: TPR at 1 % FPR is not resolved below "
                     f"{NONMEMBERS_FOR_STRONG} (it is the TPR at FPR 0) and is not graded; the level rests on the AUC.")
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


def sample_words(m: Mapping[str, Any]) -> str | None:
    """``"2 members vs 48 non-members"`` (the counts a membership result rests on); None where not recorded."""
    n1, n0 = number(m, "members"), number(m, "nonmembers")
    if math.isnan(n1) or math.isnan(n0):
        return None
    return f"{int(n1)} member{'s' if int(n1) != 1 else ''} vs {int(n0)} non-member{'s' if int(n0) != 1 else ''}"


def tpr_not_graded(m: Mapping[str, Any]) -> str | None:
    """Why the TPR at 1 % FPR cannot be graded on this sample (None when it can): fewer non-members than 1 / FPR
    (module docstring), or no count recorded."""
    n0 = number(m, "nonmembers")
    if math.isnan(n0):
        return f"TPR at 1 % FPR not graded: the non-member count is not recorded (needs >= {NONMEMBERS_FOR_STRONG})"
    if n0 < NONMEMBERS_FOR_STRONG:
        return (f"TPR at 1 % FPR not graded: needs >= {NONMEMBERS_FOR_STRONG} non-members, has {int(n0)} "
                f"(a 1 % FPR is 1 of {NONMEMBERS_FOR_STRONG}; raise data.nonmembers, the candidates per client)")
    return None


def grade_membership(m: Mapping[str, Any], thr: float = 30.0) -> dict:
    """The level of one membership result (module docstring): strong only where the non-members resolve a 1 % FPR;
    on fewer the AUC or the TPR at FPR 0 beyond its null is ``partial``, and the rule says why the TPR at 1 % FPR was
    not graded."""
    del thr
    auc = number(m, "auc")
    why_not = tpr_not_graded(m)
    ev = {"auc": auc, "auc_interval": [number(m, "auc_low"), number(m, "auc_high")],
          "tpr_at_1pct_fpr": number(m, "tpr_at_1pct_fpr"), "tpr_at_1pct_fpr_bar": bar(m, "tpr_at_1pct_fpr"),
          "auc_distance_bar": bar(m, "auc_distance"), "members": number(m, "members"), "nonmembers": number(m, "nonmembers"),
          "tpr_at_1pct_fpr_graded": why_not is None, "tpr_at_1pct_fpr_not_graded": why_not}
    d = beyond(m, "auc_distance")
    if d is None or math.isnan(auc):
        return graded("undefined", "AUC undefined (needs members and non-members among the candidates)", **ev)
    tpr = bool(beyond(m, "tpr_at_1pct_fpr")) and number(m, "tpr_at_1pct_fpr") >= STRONG_TPR
    if why_not is None and tpr:
        return graded("strong", f"TPR at 1 % FPR >= {STRONG_TPR:g} and beyond the null", **ev)
    tail = f"; {why_not}" if why_not else ""
    if d:
        side = "above" if auc > 0.5 else "below (an inverted signal)"
        return graded("partial", f"AUC {side} 0.5 beyond the null's 99th percentile of |AUC - 0.5|{tail}", **ev)
    if tpr:  # unresolved (else strong above): the TPR at FPR 0, beyond its null -- a leak, not a 1 % FPR claim
        return graded("partial", f"TPR at FPR 0 (members above every non-member) >= {STRONG_TPR:g} and beyond the "
                                 f"null{tail}", **ev)
    return graded("none", f"|AUC - 0.5| not beyond the null{tail}", **ev)


def decided_by(m: Mapping[str, Any], level: str) -> str:
    """The metric whose test decided :func:`grade_membership`'s level: the TPR for strong and for a partial that the
    AUC did not reach, else the AUC's distance from 0.5."""
    if level == "strong" or (level == "partial" and not beyond(m, "auc_distance")):
        return "tpr_at_1pct_fpr"
    return "auc_distance"


def _audit_fields(m: Mapping[str, Any]) -> dict:
    """The audit entry's counts (``members``, ``nonmembers``, ``sample``: the words printed beside the level) and
    the TPR with whether it was graded."""
    out = {"tpr_at_1pct_fpr": m.get("tpr_at_1pct_fpr"), "auc_interval": [m.get("auc_low"), m.get("auc_high")],
           "members": m.get("members"), "nonmembers": m.get("nonmembers"),
           "tpr_at_1pct_fpr_graded": tpr_not_graded(m) is None}
    words = sample_words(m)
    if words:
        out["sample"] = words
    return out


def draw_candidates(data, trial, batches, threat, cfg):
    """Per observed update: the server's candidates (the client's members + disjoint non-members, shuffled)
    and, for the evaluation only, which of them are members."""
    import random

    rng = random.Random(cfg.seed * 7919 + trial)
    observed = range(len(batches)) if threat.individual_updates else [None]
    cands, member = {}, {}
    for i, ci in enumerate(observed):
        if ci is None:  # the secure-aggregation sum: every client's samples are members of it
            mem = [t for b in batches for t in b[0]]
            non = [t for c in range(len(batches)) for t in data.nonmembers(trial, c)]
        else:
            mem, non = list(batches[ci][0]), data.nonmembers(trial, ci)
        pairs = [(t, True) for t in mem] + [(t, False) for t in non]
        rng.shuffle(pairs)
        cands[i] = [t for t, _ in pairs]
        member[i] = [m for _, m in pairs]
    return cands, member


def membership_truth(data, trial, batches, threat, cfg) -> tuple[dict, dict]:
    """The unit's ``truth_fields``: the candidates (:func:`draw_candidates`) are public knowledge the server is
    granted (``public_data.candidates``); which of them are members goes to the evaluation alone."""
    cands, member = draw_candidates(data, trial, batches, threat, cfg)
    return {"public_data": {"candidates": cands}}, {"membership": member}


def undefined_hint(m: Mapping[str, Any]) -> str:
    """What an undefined membership level lacks: without non-member candidates nothing can be told apart."""
    return "" if (m.get("nonmembers") or 0) else " -- no non-member candidates: set data.nonmembers (e.g. 100)"


RULES = ("strong: TPR at 1 % FPR >= 0.1 and beyond the null, graded only with >= 100 non-members (fewer cannot "
         "resolve a 1 % FPR) / partial: |AUC - 0.5| beyond the null, or with fewer non-members the TPR at FPR 0 >= "
         "0.1 and beyond the null")

UNIT = register(EvaluationUnit("membership", evaluate_membership, headline="auc", grade=grade_membership,
                               sweep_metric="auc", audit_fields=_audit_fields,
                               decided_by=decided_by, rules=RULES, draws_null_pool=False,
                               truth_fields=membership_truth, undefined_hint=undefined_hint),
                "membership scores: ROC AUC, TPR at 1 % / 0.1 % FPR, per layer")
