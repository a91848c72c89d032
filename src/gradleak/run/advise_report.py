"""The judging and the words of ``gradleak audit --advise``: which rows can be recommended and in what order
(:func:`ranked`), the recommendation and its sentence, the note on the costs (:func:`conclude`), and the
privacy-utility plot's data (:func:`plot_panels`; drawn by :func:`gradleak.report.plots.save_privacy_utility_plot`).

The ranking (docs/DESIGN.md §6): never a strength that was not checked against every tested attack; a defense the
model trains under before one it diverges under; then the lowest accuracy cost; a finished search before an unfinished
one; a meaningful DP guarantee (epsilon at most :data:`~gradleak.run.advise_options.MEANINGFUL_EPSILON`) before a
hollow one (:func:`hollow_dp`); then the candidate's tie-break, the most standard first
(:data:`~gradleak.run.advise_options.STANDARD`).
"""

from __future__ import annotations

import math

from gradleak.run.advise_candidates import CANDIDATE_BY_NAME, fmt
from gradleak.run.advise_options import DELTA, MEANINGFUL_EPSILON, STANDARD
from gradleak.run.advise_utility import improves


def hollow_dp(r: dict) -> bool:
    """A DP row whose epsilon guarantees nothing: absolute noise under a DP name (no epsilon, or above
    ``MEANINGFUL_EPSILON``)."""
    e = r.get("epsilon")
    from gradleak.defenses.base import is_dp_defense

    return bool(is_dp_defense(r["defense"]) or r.get("is_dp")) and not (
        isinstance(e, (int, float)) and e <= MEANINGFUL_EPSILON)


def ranked(rows: list[dict]) -> list[dict]:
    """The candidates that can be recommended (a strength found: ``stopped``, or ``unfinished`` with its best so far;
    never one whose strength was not checked against every tested attack, ``unverified``), best first: a defense the model trains under before one it diverges under; then the lowest accuracy cost (an
    unmeasured cost last); a finished search before an unfinished one; a meaningful DP guarantee before a hollow one;
    then the candidate's tie-break (its place in ``STANDARD``)."""
    ok = [r for r in rows if r.get("status") in ("stopped", "unfinished") and "strength" in r
          and not r.get("unverified")]
    return sorted(ok, key=lambda r: (bool(r.get("diverged")),
                                     r.get("cost") if isinstance(r.get("cost"), (int, float)) else math.inf,
                                     r["status"] != "stopped", hollow_dp(r),
                                     r["tie_break"] if "tie_break" in r else STANDARD.index(r["defense"])))


def cost_note(baseline: dict, utility_rounds: int) -> str | None:
    """What every cost compares against when the undefended training says nothing: it diverged, or its accuracy did
    not rise over the utility rounds; None otherwise."""
    b = baseline
    if b.get("diverged"):
        return (f"the undefended model's own training diverged (a NaN/inf upload in round "
                f"{b['diverged']['round']} at lr {fmt(b['diverged']['lr'])}): every cost compares "
                "against a diverged run (lower fl.lr or its schedule)")
    if not improves(b):
        return (f"the undefended model's test accuracy does not rise over the {utility_rounds} utility "
                f"round(s) ({fmt(b.get('accuracy_start'))} before, {fmt(b.get('accuracy'))} after), so "
                "the costs measure no lost learning (raise audit.utility_rounds, or audit a setup "
                "whose undefended model learns in that many rounds)")
    return None


def recommendation_sentence(advice: dict, best: dict, utility_rounds: int) -> str:
    """The sentence of the recommendation ``best``: the strength, what it stops and was tested against, its cost
    (with its sampling error when the cost is within it), the rounds, the DP epsilon and the ``--set`` overrides."""
    cost = best.get("cost")
    measured = isinstance(cost, (int, float))
    return (
        f"Recommended: {best['defense']} with {best['parameter']} = {fmt(best['strength'])} ({best['what']}): "
        f"the weakest strength probed that brings {', '.join(advice['attacks'])} back to its null (tested against "
        f"every attack the audit measured: {', '.join(advice['tested_against'])}), at an accuracy cost of "
        + (f"{cost * 100:+.1f} points ({fmt(advice['baseline']['accuracy'])} -> {fmt(best.get('accuracy'))}"
           + (f"; within twice the test set's sampling error of {best['cost_se'] * 100:.1f} points: not "
              "distinguishable from no cost" if abs(cost) < 2 * best.get("cost_se", 0) else "") + ")"
           if measured else "(not measured)")
        + (f" after {utility_rounds} training round(s)" if measured else "")
        + (f", epsilon = {fmt(best['epsilon'])} at delta = {DELTA:g} over those rounds"
           if isinstance(best.get("epsilon"), float) else "")
        + ". Set it with " + " ".join(f"--set '{s}'" for s in best["set"]) + ".")


def conclude(advice: dict, ok: list[dict], utility_rounds: int) -> None:
    """The advice's ranking, cost note, recommendation (the first of ``ok``, the ranked rows) and sentence."""
    advice["ranking"] = [r["defense"] for r in ok]
    note = cost_note(advice["baseline"], utility_rounds)
    if note is not None:
        advice["cost_note"] = note
    if ok:
        best = ok[0]
        advice["recommendation"] = {"defense": best["defense"], "parameter": best["parameter"],
                                    "strength": best["strength"], "set": best["set"], "cost": best.get("cost"),
                                    "accuracy": best.get("accuracy"), "epsilon": best.get("epsilon")}
        advice["sentence"] = recommendation_sentence(advice, best, utility_rounds)
    else:
        advice["sentence"] = ("No candidate stopped every leaking attack within its bracket"
                              + (" (some were not finished within the budget)" if advice["unfinished"] else "") + ".")


def plot_panels(advice: dict) -> list[dict]:
    """The privacy-utility plot's data: per searched defense, each probe's strength with each leaking attack's
    headline (and its null median / p99) and, at the strength found, the utility run's accuracy; the baseline
    accuracy beside it."""
    panels = []
    for r in advice.get("rows") or []:
        pts = []
        for value, cid in r.get("probes") or []:
            p = (advice.get("probes") or {}).get(cid) or {}
            if "error" in p:
                continue
            u = (advice.get("utility") or {}).get("utility:" + cid) or {}  # trained at the strength found only
            pts.append({"x": value, "accuracy": u.get("accuracy"),
                        "attacks": {a: {k: ((p.get("attacks") or {}).get(a) or {}).get(k)
                                        for k in ("value", "null_median", "null_p99", "metric", "level")}
                                    for a in advice["attacks"]}})
        if pts:
            pts.sort(key=lambda t: t["x"])
            panels.append({"title": f"{r['defense']} ({r['parameter']})", "points": pts,
                           "log": (r.get("scale") or CANDIDATE_BY_NAME[r["defense"]]["scale"]) not in ("log1m", "lin"),
                           "found": r.get("strength"), "baseline_accuracy": (advice.get("baseline") or {}).get("accuracy")})
    return panels
