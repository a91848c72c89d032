"""Graded leakage levels (docs/DESIGN.md §6): the levels, the bar a score must clear, and the verdict. The rules of
each reconstruction kind live in its evaluation unit (``grade_*`` in :mod:`gradleak.evaluation.images`,
``patches``, ``text``, ``membership``, ``leakage``); this table is their summary.

``grade(kind, metrics, psnr_threshold_db)`` reads one attacked client's metrics -- a plain dict, as the evaluator
writes them: each headline ``m`` with ``m_null_p99`` (and for images the trivial references ``m_mean_public`` /
``m_grey``) -- and returns ``{"level", "rule", "evidence"}``:

=================  ======================================  =========================================  ===========================================
kind               exact                                   strong                                     partial
=================  ======================================  =========================================  ===========================================
images             an image at PSNR >= threshold (30 dB)   best-image SSIM beyond the bar and >= 0.5  best-image PSNR beyond the bar
patches            a patch recovered at PSNR >= threshold  as images                                  as images
                   (median of the recovered >= threshold)
token_sequences    a private sentence word for word        ROUGE-2 F1 beyond the bar and >= 50        word-bag recall beyond its null (an attack
                                                                                                      without a bag: ROUGE-1 F1 beyond its null)
membership         (none: nothing is reconstructed)        TPR at 1 % FPR >= 0.1 and beyond its null  |AUC - 0.5| beyond its null (either side:
                                                           with >= 100 non-members (fewer cannot      an inverted signal leaks too); with fewer
                                                           resolve a 1 % FPR: never strong)           non-members, or: TPR at FPR 0 >= 0.1 and
                                                                                                      beyond its null
leakage            a best-matched reconstruction at        its SSIM beyond the null and >= 0.5        RDLV beyond its null (rdlv_excess > 0)
                   PSNR >= threshold
=================  ======================================  =========================================  ===========================================

"Beyond the null" is strictly above the null's 99th percentile (text with a word bag has two routes to ``partial``,
the bag and ROUGE-1 F1: each must also have p < 0.005, so chance reaches ``partial`` at most 1 % of the time); "the bar" is the larger of that and the trivial
references (the mean public image, the grey image and the best flat image -- each original's mean colour -- for
images; the attack's own word bag in random order for
ROUGE-2), because a blur at the mean image or the right words in the wrong order show no private *sample*.
``undefined``: the level's metric is NaN or has no null (nothing measurable: e.g. no non-members) -- never
counted as "ran". ``none``: measured, nothing beyond its null.

The verdict (:func:`verdict_of`) is the worst level under the configured threat: ``leaks`` when an attack
reaches ``partial`` or more under it, ``leaks_stronger_server`` when only an upgraded server's attack does,
``no_leak_found`` when at least one attack measured ``none`` and none leaks, ``undefined`` when no attack measured
anything (never green over an audit that saw nothing).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

#: weakest first; ``undefined`` sorts below ``none`` (it is not evidence either way)
LEVELS = ("undefined", "none", "partial", "strong", "exact")
LEAKING = ("partial", "strong", "exact")
STRONG_SSIM = 0.5
STRONG_ROUGE2 = 50.0
STRONG_TPR = 0.1


def level_rank(level: str) -> int:
    return LEVELS.index(level)


def number(m: Mapping[str, Any], key: str) -> float:
    v = m.get(key)
    try:
        v = float(v)
    except (TypeError, ValueError):
        return math.nan
    return v


def bar(m: Mapping[str, Any], key: str, references: tuple[str, ...] = ()) -> float:
    """The bar ``m[key]`` must clear: the null's 99th percentile, raised to any trivial reference's score."""
    vals = [number(m, f"{key}_null_p99")] + [number(m, f"{key}_{r}") for r in references]
    vals = [v for v in vals if not math.isnan(v)]
    return max(vals) if vals else math.nan


def beyond(m: Mapping[str, Any], key: str, references: tuple[str, ...] = ()) -> bool | None:
    """Whether ``m[key]`` is strictly above its bar; None when the value or its null is missing/NaN."""
    v, b = number(m, key), bar(m, key, references)
    if math.isnan(v) or math.isnan(b):
        return None
    return v > b


def graded(level: str, rule: str, **evidence) -> dict:
    return {"level": level, "rule": rule, "evidence": {k: v for k, v in evidence.items() if v is not None}}


def grade(kind: str, metrics: Mapping[str, Any], psnr_threshold_db: float = 30.0) -> dict:
    """The level of one attacked client's metrics (module docstring); an unknown kind is ``undefined``."""
    from gradleak.evaluation.base import EVALUATORS

    if kind not in EVALUATORS:
        return graded("undefined", f"no level rule for the reconstruction kind '{kind}'")
    return EVALUATORS.get(kind).grade(metrics, psnr_threshold_db)


def verdict_of(entries: list[dict]) -> str:
    """``leaks`` / ``leaks_stronger_server`` / ``no_leak_found`` from audit entries (``level``, ``applicable``)."""
    leaking = [e for e in entries if e.get("level") in LEAKING]
    if any(e.get("applicable") for e in leaking):
        return "leaks"
    if leaking:
        return "leaks_stronger_server"
    if not any(e.get("level") == "none" for e in entries):
        return "undefined"  # nothing was measured: no green banner over an audit that saw nothing
    return "no_leak_found"


def leak_rank(j: dict) -> tuple:
    """Order judged runs by how much they leak (level, samples reconstructed, p-value low first, headline value;
    nan last): the worst case for the client is the evidence."""
    v = j.get("value")
    p = j.get("p_value")
    return (level_rank(j.get("level", "undefined")), j.get("n_success") or 0,
            -p if isinstance(p, (int, float)) and p == p else -2.0,
            v if isinstance(v, (int, float)) and v == v else -1e300)
