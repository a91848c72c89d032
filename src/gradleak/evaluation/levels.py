"""Graded leakage levels, one table of rules per reconstruction kind (issue 26, DESIGN §6).

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
                                                                                                      an inverted signal leaks too)
leakage            a best-matched reconstruction at        its SSIM beyond the null and >= 0.5        RDLV beyond its null (rdlv_excess > 0)
                   PSNR >= threshold
=================  ======================================  =========================================  ===========================================

"Beyond the null" is strictly above the null's 99th percentile (text with a word bag has two routes to ``partial``,
the bag and ROUGE-1 F1: each must also have p < 0.005, so chance reaches ``partial`` at most 1 % of the time); "the bar" is the larger of that and the trivial
references (the mean public image and the grey image for images; the attack's own word bag in random order for
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


def _num(m: Mapping[str, Any], key: str) -> float:
    v = m.get(key)
    try:
        v = float(v)
    except (TypeError, ValueError):
        return math.nan
    return v


def bar(m: Mapping[str, Any], key: str, references: tuple[str, ...] = ()) -> float:
    """The bar ``m[key]`` must clear: the null's 99th percentile, raised to any trivial reference's score."""
    vals = [_num(m, f"{key}_null_p99")] + [_num(m, f"{key}_{r}") for r in references]
    vals = [v for v in vals if not math.isnan(v)]
    return max(vals) if vals else math.nan


def beyond(m: Mapping[str, Any], key: str, references: tuple[str, ...] = ()) -> bool | None:
    """Whether ``m[key]`` is strictly above its bar; None when the value or its null is missing/NaN."""
    v, b = _num(m, key), bar(m, key, references)
    if math.isnan(v) or math.isnan(b):
        return None
    return v > b


def _out(level: str, rule: str, **evidence) -> dict:
    return {"level": level, "rule": rule, "evidence": {k: v for k, v in evidence.items() if v is not None}}


IMAGE_REFS = ("mean_public", "grey")


def _grade_images(m: Mapping[str, Any], thr: float, exact_count: str, exact_words: str) -> dict:
    p = beyond(m, "psnr_max", IMAGE_REFS)
    if p is None:
        return _out("undefined", "best-image PSNR or its null is missing / NaN", psnr_max=_num(m, "psnr_max"))
    ev = {"psnr_max": _num(m, "psnr_max"), "psnr_max_bar": bar(m, "psnr_max", IMAGE_REFS),
          "ssim_max": _num(m, "ssim_max"), "ssim_max_bar": bar(m, "ssim_max", IMAGE_REFS),
          "psnr_max_p_value": _num(m, "psnr_max_p_value")}
    n_exact = _num(m, exact_count)
    if not math.isnan(n_exact) and n_exact >= 1 and p:
        return _out("exact", f"{exact_words} at PSNR >= {thr:g} dB", **ev, n_exact=n_exact)
    s = beyond(m, "ssim_max", IMAGE_REFS)
    if s and _num(m, "ssim_max") >= STRONG_SSIM:
        return _out("strong", f"best-image SSIM beyond the null (and the mean/grey image) and >= {STRONG_SSIM:g}", **ev)
    if p:
        return _out("partial", "best-image PSNR beyond the null's 99th percentile (and the mean/grey image)", **ev)
    return _out("none", "best-image PSNR not beyond the null", **ev)


def grade_images(m: Mapping[str, Any], thr: float = 30.0) -> dict:
    return _grade_images(m, thr, "images_above_threshold", "a private image reconstructed")


def grade_patches(m: Mapping[str, Any], thr: float = 30.0) -> dict:
    return _grade_images(m, thr, "patches_exact", "private image patches recovered (median of the recovered)")


def grade_tokens(m: Mapping[str, Any], thr: float = 30.0) -> dict:
    del thr
    ev = {"rouge1_f1": _num(m, "rouge1_f1"), "rouge2_f1": _num(m, "rouge2_f1"),
          "word_bag_recall": _num(m, "word_bag_recall"), "sentences_exact": _num(m, "sentences_exact"),
          "rouge2_f1_bar": bar(m, "rouge2_f1", ("bag_order",)), "rouge1_f1_bar": bar(m, "rouge1_f1"),
          "word_bag_recall_bar": bar(m, "word_bag_recall")}
    has_bag = not math.isnan(_num(m, "word_bag_recall_null_p99"))
    part_key = "word_bag_recall" if has_bag else "rouge1_f1"
    part = beyond(m, part_key)
    if part is None:
        return _out("undefined", f"{part_key} or its null is missing / NaN", **ev)
    if has_bag:  # two routes to `partial` (the bag, the sentences' words): each at half the 1 % (Bonferroni)
        def strict(key):
            p = _num(m, f"{key}_p_value")
            return bool(beyond(m, key)) and (math.isnan(p) or p < 0.005)
        part = strict("word_bag_recall")
        r1 = strict("rouge1_f1")
    else:
        r1 = False
    if _num(m, "sentences_exact") >= 1:
        return _out("exact", "a private sentence reconstructed word for word", **ev)
    if beyond(m, "rouge2_f1", ("bag_order",)) and _num(m, "rouge2_f1") >= STRONG_ROUGE2:
        return _out("strong", f"ROUGE-2 F1 beyond the null (and the word bag in random order) and >= {STRONG_ROUGE2:g}",
                    **ev)
    if part or r1:
        which = "word-bag recall" if part else "ROUGE-1 F1"
        return _out("partial", f"{which} beyond the null's 99th percentile: the private words leak", **ev)
    return _out("none", f"{'word-bag recall' if has_bag else 'ROUGE-1 F1'} not beyond the null", **ev)


def grade_membership(m: Mapping[str, Any], thr: float = 30.0) -> dict:
    del thr
    auc = _num(m, "auc")
    ev = {"auc": auc, "auc_interval": [_num(m, "auc_low"), _num(m, "auc_high")],
          "tpr_at_1pct_fpr": _num(m, "tpr_at_1pct_fpr"), "tpr_at_1pct_fpr_bar": bar(m, "tpr_at_1pct_fpr"),
          "auc_distance_bar": bar(m, "auc_distance"), "members": _num(m, "members"), "nonmembers": _num(m, "nonmembers")}
    d = beyond(m, "auc_distance")
    if d is None or math.isnan(auc):
        return _out("undefined", "AUC undefined (needs members and non-members among the candidates)", **ev)
    t = beyond(m, "tpr_at_1pct_fpr")
    if t and _num(m, "tpr_at_1pct_fpr") >= STRONG_TPR:
        return _out("strong", f"TPR at 1 % FPR >= {STRONG_TPR:g} and beyond the null", **ev)
    if d:
        side = "above" if auc > 0.5 else "below (an inverted signal)"
        return _out("partial", f"AUC {side} 0.5 beyond the null's 99th percentile of |AUC - 0.5|", **ev)
    return _out("none", "|AUC - 0.5| not beyond the null", **ev)


def grade_leakage(m: Mapping[str, Any], thr: float = 30.0) -> dict:
    """One client's leakage metrics (keys without the client suffix: ``rdlv``, ``rdlv_null_p99``, ``ssim``, ...)."""
    ev = {"rdlv": _num(m, "rdlv"), "rdlv_null_p99": _num(m, "rdlv_null_p99"), "rdlv_excess": _num(m, "rdlv_excess"),
          "rdlv_p_value": _num(m, "rdlv_p_value"), "ssim": _num(m, "ssim"), "ssim_bar": bar(m, "ssim"),
          "psnr_max": _num(m, "psnr_max")}
    r = beyond(m, "rdlv")
    if r is None:
        return _out("undefined", "RDLV or its null is missing / NaN", **ev)
    if _num(m, "psnr_max") >= thr and r:
        return _out("exact", f"a best-matched reconstruction at PSNR >= {thr:g} dB", **ev)
    if beyond(m, "ssim") and _num(m, "ssim") >= STRONG_SSIM:
        return _out("strong", f"SSIM beyond the null and >= {STRONG_SSIM:g}", **ev)
    if r:
        return _out("partial", "RDLV beyond the null's 99th percentile (random held-out images, best of N)", **ev)
    return _out("none", "RDLV not beyond the null", **ev)


GRADERS = {"images": grade_images, "patches": grade_patches, "token_sequences": grade_tokens,
           "membership": grade_membership, "leakage": grade_leakage}


def grade(kind: str, metrics: Mapping[str, Any], psnr_threshold_db: float = 30.0) -> dict:
    """The level of one attacked client's metrics (module docstring); an unknown kind is ``undefined``."""
    g = GRADERS.get(kind)
    if g is None:
        return _out("undefined", f"no level rule for the reconstruction kind '{kind}'")
    return g(metrics, psnr_threshold_db)


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
