"""Text reconstruction metrics (UTR paper Sec. 5.1): ROUGE-1/2/L recall (0-100), exact-sentence rate, word-bag
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
    """rouge-score's scorer with its default tokenizer passed in (the same one it builds itself): built without a
    tokenizer it logs through absl, whose first log call configures the *root* logger (``logging.basicConfig``) of
    the process scoring -- a Flower server, say, whose own logger then prints every line twice."""
    from rouge_score import rouge_scorer, tokenizers

    return rouge_scorer.RougeScorer(list(kinds), use_stemmer=False,
                                    tokenizer=tokenizers.DefaultTokenizer(use_stemmer=False))


def normalize(s: str) -> str:
    return " ".join(s.lower().split())


class RougeTokens(tuple):
    """A sentence as ROUGE sees it: ``(tokens, normalized)`` -- rouge-score's tokens (lower-cased, alphanumeric,
    no stemming) and the lower-cased whitespace-joined text (:func:`normalize`, the exact-sentence test)."""

    @property
    def tokens(self) -> list[str]:
        return self[0]

    @property
    def normalized(self) -> str:
        return self[1]


def tokenize_for_rouge(text) -> RougeTokens:
    """The tokens rouge-score's default tokenizer gives ``text`` (a list of words is taken as already split)."""
    if isinstance(text, RougeTokens):
        return text
    if isinstance(text, (list, tuple)):
        words = [str(w).lower() for w in text]
        return RougeTokens((words, " ".join(words)))
    from rouge_score import tokenize

    return RougeTokens((tokenize.tokenize(text, None), normalize(text)))


def _counts(toks: list[str], n: int):
    from collections import Counter

    return Counter(tuple(toks[i:i + n]) for i in range(len(toks) - n + 1))


def _f1(overlap: int, ref: int, cand: int) -> float:
    if not ref or not cand or not overlap:
        return 0.0
    p, r = overlap / cand, overlap / ref
    return 2 * p * r / (p + r)


def _match_tokenized(refs: list[RougeTokens], cands: list[RougeTokens]) -> list[int | None]:
    if not refs or not cands:
        return [None] * len(refs)
    from scipy.optimize import linear_sum_assignment

    rc = [_counts(r.tokens, 1) for r in refs]
    cc = [_counts(c.tokens, 1) for c in cands]
    w = np.zeros((len(refs), len(cands)))
    for i, r in enumerate(refs):
        for j, c in enumerate(cands):
            w[i, j] = _f1(sum((rc[i] & cc[j]).values()), len(r.tokens), len(c.tokens)) \
                + (1.0 if r.normalized == c.normalized else 0.0)
    rows, cols = linear_sum_assignment(-w)
    out: list[int | None] = [None] * len(refs)
    for i, j in zip(rows, cols):
        out[i] = int(j) if w[i, j] > 0 else None
    return out


def match_sentences(references: Sequence[str], candidates: Sequence[str]) -> list[int | None]:
    """For each reference the index of its matched candidate (or None): a maximum-weight matching on ROUGE-1 F
    (+ 1 for an exact sentence)."""
    return _match_tokenized([tokenize_for_rouge(r) for r in references], [tokenize_for_rouge(c) for c in candidates])


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
    return rouge_f1_tokenized([tokenize_for_rouge(r) for r in references], [tokenize_for_rouge(c) for c in candidates])


def rouge_f1_tokenized(references: Sequence, candidates: Sequence) -> dict[str, float]:
    """:func:`rouge_f1_scores` on sentences already passed through :func:`tokenize_for_rouge` (the nulls score
    thousands of draws with it: tokenizing once is what makes them cheap)."""
    refs = [tokenize_for_rouge(r) for r in references]
    cands = [tokenize_for_rouge(c) for c in candidates]
    if not refs:
        return {}
    match = _match_tokenized(refs, cands)
    out = {}
    for n in (1, 2):
        rc = [_counts(r.tokens, n) for r in refs]
        cc = [_counts(c.tokens, n) for c in cands]
        ref_total = sum(sum(c.values()) for c in rc)
        cand_total = sum(sum(c.values()) for c in cc)
        overlap = sum(sum((rc[i] & cc[j]).values()) for i, j in enumerate(match) if j is not None)
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
