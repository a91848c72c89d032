"""Text reconstruction metrics (SPEC §3.5): ROUGE-1/2/L recall (0-100), exact-sentence rate, word-bag
precision/recall. Pure functions of strings / token ids.

ROUGE follows the paper's definition -- recall, matched n-grams / reference n-grams -- computed with
``rouge-score`` (lower-cased, alphanumeric tokens). Reconstructed sentences are paired with references by a
maximum-weight matching on ROUGE-1 F (Hungarian, scipy), so order within the batch does not matter and a
reconstruction cannot be credited to two references. References with no partner score 0.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from gradleak.registry import METRICS


def _scorer(kinds=("rouge1", "rouge2", "rougeL")):
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(list(kinds), use_stemmer=False)


def normalize(s: str) -> str:
    return " ".join(s.lower().split())


def match_sentences(references: Sequence[str], candidates: Sequence[str]) -> list[int | None]:
    """For each reference the index of its matched candidate (or None)."""
    if not references or not candidates:
        return [None] * len(references)
    from scipy.optimize import linear_sum_assignment

    sc = _scorer(("rouge1",))
    w = np.zeros((len(references), len(candidates)))
    for i, r in enumerate(references):
        for j, c in enumerate(candidates):
            w[i, j] = sc.score(r, c)["rouge1"].fmeasure + (1.0 if normalize(r) == normalize(c) else 0.0)
    rows, cols = linear_sum_assignment(-w)
    out: list[int | None] = [None] * len(references)
    for i, j in zip(rows, cols):
        out[i] = int(j) if w[i, j] > 0 else None
    return out


def rouge_scores(references: Sequence[str], candidates: Sequence[str]) -> dict[str, float]:
    """Mean ROUGE-1/2/L recall and F over references (0-100) plus the exact-sentence rate (0-100)."""
    if not references:
        return {}
    sc = _scorer()
    match = match_sentences(references, candidates)
    acc = {k: [] for k in ("rouge1", "rouge2", "rougeL", "rouge1_f", "rouge2_f", "rougeL_f")}
    exact = 0
    for r, j in zip(references, match):
        c = candidates[j] if j is not None else ""
        s = sc.score(r, c)
        for k in ("rouge1", "rouge2", "rougeL"):
            acc[k].append(100.0 * s[k].recall)
            acc[f"{k}_f"].append(100.0 * s[k].fmeasure)
        exact += int(j is not None and normalize(r) == normalize(c))
    out = {k: float(np.mean(v)) for k, v in acc.items()}
    out["exact_sentence_rate"] = 100.0 * exact / len(references)
    return out


def _ngrams(text: str, n: int):
    from collections import Counter

    from rouge_score import tokenize

    toks = tokenize.tokenize(text, None)
    return Counter(tuple(toks[i:i + n]) for i in range(len(toks) - n + 1))


def rouge_f1_scores(references: Sequence[str], candidates: Sequence[str]) -> dict[str, float]:
    """Batch-level ROUGE-1/2 F1 (0-100) that penalises extra output.

    Recall = matched n-grams / all reference n-grams; precision = matched n-grams / all n-grams of *every*
    returned sentence (an unmatched candidate adds n-grams and no overlap; extra words inside a matched
    sentence lower precision too). Overlaps are clipped counts of the pairs of :func:`match_sentences`.
    Six sentences returned for two references, or "suits of like design on of the" for "suits of like
    design", score below 100 here while their recall stays 100.
    """
    if not references:
        return {}
    match = match_sentences(references, candidates)
    out = {}
    for n in (1, 2):
        ref_total = sum(sum(_ngrams(r, n).values()) for r in references)
        cand_total = sum(sum(_ngrams(c, n).values()) for c in candidates)
        overlap = 0
        for r, j in zip(references, match):
            if j is not None:
                overlap += sum((_ngrams(r, n) & _ngrams(candidates[j], n)).values())
        rec = overlap / ref_total if ref_total else 0.0
        prec = overlap / cand_total if cand_total else 0.0
        out[f"rouge{n}_f1"] = 100.0 * (2 * prec * rec / (prec + rec) if prec + rec > 0 else 0.0)
    return out


def word_bag_scores(true_tokens: set[int], bag: set[int]) -> dict[str, float]:
    """Precision / recall (0-100) of the recovered token set against the batch's (visible) tokens."""
    tp = len(true_tokens & bag)
    return {"word_bag_precision": 100.0 * tp / len(bag) if bag else 0.0,
            "word_bag_recall": 100.0 * tp / len(true_tokens) if true_tokens else 0.0}


@METRICS.register("rouge1", "ROUGE-1 recall (0-100), references matched to reconstructions")
def rouge1(references: Sequence[str], candidates: Sequence[str]) -> float:
    return rouge_scores(references, candidates)["rouge1"]


@METRICS.register("rouge2", "ROUGE-2 recall (0-100), references matched to reconstructions")
def rouge2(references: Sequence[str], candidates: Sequence[str]) -> float:
    return rouge_scores(references, candidates)["rouge2"]


@METRICS.register("rougeL", "ROUGE-L recall (0-100), references matched to reconstructions")
def rougeL(references: Sequence[str], candidates: Sequence[str]) -> float:  # noqa: N802 - metric name
    return rouge_scores(references, candidates)["rougeL"]


@METRICS.register("exact_sentence_rate", "share of reference sentences reconstructed exactly (0-100)")
def exact_sentence_rate(references: Sequence[str], candidates: Sequence[str]) -> float:
    return rouge_scores(references, candidates)["exact_sentence_rate"]


@METRICS.register("word_bag_recall", "share of the batch's distinct tokens found in the word bag (0-100)")
def word_bag_recall(true_tokens: set[int], bag: set[int]) -> float:
    return word_bag_scores(true_tokens, bag)["word_bag_recall"]


@METRICS.register("word_bag_precision", "share of word-bag tokens that occur in the batch (0-100)")
def word_bag_precision(true_tokens: set[int], bag: set[int]) -> float:
    return word_bag_scores(true_tokens, bag)["word_bag_precision"]
