"""The ``token_sequences`` unit: text attacks' recovered sentences (docs/DESIGN.md §2).

Scores: ROUGE-1/2/L recall (the papers' metric) *and* F1 (extra output is penalised), exact sentences, word-bag
precision/recall, sentences returned / verified, and the capacity measures computed from the truth (unique tokens,
layer states). Null: N random sentences no client holds (ROUGE F1, the same matching), a random word bag of the
attack's size, and the attack's own bag in random order. Levels: exact = a private sentence word for word; strong =
ROUGE-2 F1 beyond the bar and >= 50; partial = word-bag recall (or ROUGE-1 F1) beyond its null.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from gradleak.evaluation.base import Evaluation, EvaluationUnit, Truth, attach_null, register
from gradleak.evaluation.levels import STRONG_ROUGE2, bar, beyond, graded, number


def evaluate_tokens(truth: Truth, rec, cfg, out_dir: Path, trial: int) -> Evaluation:
    from gradleak.metrics.text import match_sentences, rouge_f1_scores, rouge_scores, word_bag_scores

    tok = truth.tokenizer
    ids, mask = truth.inputs["input_ids"], truth.inputs["attention_mask"].bool()
    refs = [tok.decode(i[m], skip_special_tokens=True).strip() for i, m in zip(ids, mask)]
    recs = [tok.decode(s, skip_special_tokens=True).strip() for s in rec.data]
    out = dict(rouge_scores(refs, recs))
    out.update(rouge_f1_scores(refs, recs))
    if truth.model_kind == "causal":  # the final EOS gets no gradient under the LM loss: it is not part of what leaks
        last = mask.sum(1) - 1
        vis = mask.clone()
        vis[torch.arange(len(ids)), last] = False
        true_tokens = set(ids[vis].tolist())
        vectors = len(true_tokens)
        lens = mask.sum(1).tolist()  # distinct layer states = distinct prefixes that receive a gradient
        states = len({tuple(ids[i, :k + 1].tolist()) for i in range(len(ids)) for k in range(int(lens[i]) - 1)})
    else:
        true_tokens = set(ids[mask].tolist())
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        vectors = len(set(zip(ids[mask].tolist(), pos[mask].tolist())))
        states = int(mask.sum())  # every token's layer state differs (the whole sentence is its context)
    bag = set(rec.info.get("word_bag", []))
    if "word_bag" in rec.info:
        out.update(word_bag_scores(true_tokens, bag))
    verified = list(rec.info.get("verified", [False] * len(recs)))
    n_verified = int(sum(bool(v) for v in verified))
    out.update({
        "unique_tokens": len(true_tokens),
        "unique_token_vectors": vectors,
        "layer_states": states,
        "bottleneck": truth.bottleneck if truth.bottleneck is not None else float("nan"),
        "total_tokens": int(mask.sum()),
        "recovered_tokens": int(sum(len(s) for s in rec.data)),
        "word_bag_size": len(bag),
        "sentences_returned": len(recs),
        "sentences_total": len(refs),
        "sentences_verified": n_verified,
        # a batch is flagged unless the attack verified one sentence per private sentence
        "unverified_batch": float(n_verified < len(refs)),
        "capacity_exhausted": float(bool(rec.info.get("capacity_exhausted", False))),
        "attack_failed": float(bool(rec.info.get("failure"))),
        "search_truncated": float(bool(rec.info.get("search_truncated"))),
    })
    matched = match_sentences(refs, recs)
    rows = []
    for ref, j in zip(refs, matched):
        r = recs[j] if j is not None else ""
        rows.append({"trial": trial, "reference": ref, "reconstruction": r,
                     "verified": "yes" if (j is not None and j < len(verified) and verified[j]) else "no",
                     "exact": "yes" if ref.lower().split() == r.lower().split() else "no"})
    out["sentences_exact"] = sum(r["exact"] == "yes" for r in rows)  # private sentences recovered word for word
    used = {m for m in matched if m is not None}
    extra = [recs[j] for j in range(len(recs)) if j not in used]
    for r in extra:
        rows.append({"trial": trial, "reference": "(none: extra output)", "reconstruction": r, "verified": "-", "exact": "no"})
    notes = []
    if cfg.metrics.null and truth.null_pool:
        _null_text(truth, refs, recs, true_tokens, bag, out, cfg, notes, rec.info.get("sub_edge_top"),
                   rec.info.get("null_word_bags"))
    if n_verified < len(refs):
        notes.append(f"trial {trial}: {n_verified} of {len(refs)} sentences verified by the attack — "
                     "unverified text is a best guess, not a proven reconstruction.")
    return Evaluation(out, rows=rows, notes=notes)


def _null_text(truth: Truth, refs: list[str], recs: list[str], true_tokens: set, bag: set, out: dict, cfg,
               notes: list, ranking=None, null_bags=None) -> None:
    """The text nulls: N random public sentences (ROUGE F1, the same matching), a random word bag of the attack's
    size from the public sentences' tokens (word-bag recall), the attack's own bag in random order (ROUGE), and a
    sub-edge ranking (``ranking``) against random public tokens through it (:func:`_sub_edge_enrichment`).

    ``null_bags``: the bags a learned decoder (:mod:`gradleak.attacks.learned_wordbag`) gives random public batches
    through the same simulation and defenses; then the word-bag null is, draw for draw, the larger of the random
    bag's recall and a decoder bag's recall (``word_bag_recall_random_bag_null_p99`` and
    ``word_bag_recall_decoder_null_p99`` each alone), so a decoder that learned only the public prior is at chance."""
    from gradleak.evaluation.nulls import bag_order_null, text_null, word_bag_null

    tok, pool = truth.tokenizer, list(truth.null_pool)
    draws, seed = cfg.metrics.null_draws, cfg.seed + 23
    nul = text_null(refs, pool, n=len(recs) or len(refs), draws=draws, seed=seed)
    for k in ("rouge1_f1", "rouge2_f1"):
        attach_null(out, k, nul[k])
    special = set(getattr(tok, "all_special_ids", []) or [])
    token_pool = [t for sent in pool for t in set(tok(sent, add_special_tokens=False)["input_ids"]) if t not in special]
    what = f"{draws} draws of {len(recs) or len(refs)} random sentences of {truth.null_source} ({len(pool)} in the pool)"
    if "word_bag_recall" in out:
        wb_null = word_bag_null(true_tokens, len(bag), token_pool, draws=draws, seed=seed)
        if null_bags:
            dec = np.array([100.0 * len(true_tokens & set(b)) / len(true_tokens) if true_tokens else float("nan")
                            for b in null_bags])
            out["word_bag_recall_random_bag_null_p99"] = float(np.nanquantile(wb_null, 0.99))
            out["word_bag_recall_decoder_null_p99"] = float(np.nanquantile(dec, 0.99))
            pick = np.random.default_rng(seed + 1).choice(len(dec), size=len(wb_null), replace=len(dec) < len(wb_null))
            wb_null = np.fmax(wb_null, dec[pick])
        attach_null(out, "word_bag_recall", wb_null)
        words = []
        for t in sorted(bag):
            w = tok.convert_ids_to_tokens(int(t))
            w = str(w).replace("##", "").replace("\u0120", " ").replace("\u2581", " ").strip()
            if w and int(t) not in special:
                words.append(w)
        lengths = [len(r.split()) for r in refs]
        bo = bag_order_null(refs, words, lengths, draws=200, seed=seed)
        for k in ("rouge1_f1", "rouge2_f1"):
            vals = bo[k][np.isfinite(bo[k])] if len(bo[k]) else bo[k]
            out[f"{k}_bag_order"] = float(np.quantile(vals, 0.99)) if len(vals) else float("nan")
        what += (f"; word bag: {draws} random bags of {len(bag)} tokens from the pool's tokens (weighted by how many "
                 "sentences hold each); *_bag_order: the 99th percentile of the attack's own bag in random order")
        if null_bags:
            what += (f"; each word-bag draw the larger of that and the recall of one of {len(null_bags)} bags the same "
                     "decoder gives random public batches")
    if ranking:
        _sub_edge_enrichment(list(ranking), true_tokens - special, pool, tok, special, max(len(refs), 1), out, draws,
                             seed, int(getattr(tok, "vocab_size", 0) or len(tok)))
        what += ("; sub-edge ranking: the batch's tokens among its top |T| over chance against the tokens of "
                 f"{max(len(refs), 1)} random pool sentences through the same ranking, {draws} draws")
    notes.append("null: " + what + ".")


def _sub_edge_enrichment(top: list[int], true: set[int], pool: list[str], tok, special: set, B: int, out: dict,
                         draws: int, seed: int, vocabulary: int) -> None:
    """The sub-edge test's ranking (UTR's ``sub_edge_top``: the pursuit's tokens in the order taken, then the rest
    by energy; :mod:`gradleak.attacks.common.sub_edge`) graded against its null, whatever the noise law (the one
    grade a top-k pruned upload's ranking has: its error is not Gaussian): ``sub_edge_enrichment`` = the batch's
    distinct tokens T among the top |T| over chance, (hits / |T|) / (|T| / V); the null = the same number for the
    tokens of B random pool sentences (sentences no client holds) through the same ranking, ``draws`` draws;
    ``sub_edge_enrichment_p_value`` = (1 + #null >= value) / (1 + draws) (:func:`attach_null`)."""
    def enrichment(ranked: list[int], tokens: set[int], V: int) -> float:  # as gradleak.attacks.common.sub_edge's
        hits = sum(int(v) in tokens for v in ranked)
        return (hits / len(ranked)) / (len(tokens) / float(V)) if ranked and tokens else float("nan")

    sets = [set(tok(sent)["input_ids"]) - special for sent in pool]
    sets = [x for x in sets if x]
    if not true or not sets:
        return
    out["sub_edge_enrichment"] = enrichment(list(top[:len(true)]), true, vocabulary)
    rng = np.random.default_rng(seed)
    null = np.full(draws, np.nan)
    for d in range(draws):
        pick = rng.choice(len(sets), size=min(B, len(sets)), replace=False)
        t = set().union(*(sets[i] for i in pick))
        null[d] = enrichment(list(top[:len(t)]), t, vocabulary)
    attach_null(out, "sub_edge_enrichment", null)


def _partial_routes(m: Mapping[str, Any]) -> tuple[bool, bool | None, bool]:
    """``(has_bag, part, r1)``: whether the attack returned a word bag (its null exists), and the two routes to
    ``partial`` -- the bag's recall (without a bag: ROUGE-1 F1; None when it or its null is missing) and ROUGE-1 F1.
    With a bag each route is tested at half the 1 % (Bonferroni: p < 0.005 as well as beyond the 99th percentile)."""
    has_bag = not math.isnan(number(m, "word_bag_recall_null_p99"))
    part = beyond(m, "word_bag_recall" if has_bag else "rouge1_f1")
    if part is None or not has_bag:
        return has_bag, part, False

    def strict(key):
        p = number(m, f"{key}_p_value")
        return bool(beyond(m, key)) and (math.isnan(p) or p < 0.005)
    return has_bag, strict("word_bag_recall"), strict("rouge1_f1")


def decided_by_tokens(m: Mapping[str, Any], level: str) -> str | None:
    """The metric whose test gave :func:`grade_tokens` its level: the exact-sentence count, ROUGE-2 F1 (strong), the
    partial route that passed (word-bag recall first, as the rule names it) or the one that failed (none)."""
    if level == "exact":
        return "sentences_exact"
    if level == "strong":
        return "rouge2_f1"
    has_bag, part, _ = _partial_routes(m)
    if level == "partial":
        return "word_bag_recall" if part and has_bag else "rouge1_f1"
    if level == "undefined" and number(m, "attack_failed") >= 1:
        return None
    return "word_bag_recall" if has_bag else "rouge1_f1"


def grade_tokens(m: Mapping[str, Any], thr: float = 30.0) -> dict:
    del thr
    ev = {"rouge1_f1": number(m, "rouge1_f1"), "rouge2_f1": number(m, "rouge2_f1"),
          "word_bag_recall": number(m, "word_bag_recall"), "sentences_exact": number(m, "sentences_exact"),
          "rouge2_f1_bar": bar(m, "rouge2_f1", ("bag_order",)), "rouge1_f1_bar": bar(m, "rouge1_f1"),
          "word_bag_recall_bar": bar(m, "word_bag_recall")}
    if number(m, "attack_failed") >= 1:  # e.g. DAGER on an adapters-only upload: no attention-layer gradient to test
        return graded("undefined", "not applicable: the attack found nothing it can use in this update (its "
                      "results.json says why, e.g. DAGER without attention-layer gradients): nothing was measured", **ev)
    has_bag, part, r1 = _partial_routes(m)
    part_key = "word_bag_recall" if has_bag else "rouge1_f1"
    if part is None:
        return graded("undefined", f"{part_key} or its null is missing / NaN", **ev)
    if number(m, "sentences_exact") >= 1:
        return graded("exact", "a private sentence reconstructed word for word", **ev)
    if beyond(m, "rouge2_f1", ("bag_order",)) and number(m, "rouge2_f1") >= STRONG_ROUGE2:
        return graded("strong", f"ROUGE-2 F1 beyond the null (and the word bag in random order) and >= {STRONG_ROUGE2:g}",
                    **ev)
    if part or r1:
        which = "word-bag recall" if part and has_bag else "ROUGE-1 F1"  # without a bag, `part` is ROUGE-1's test
        return graded("partial", f"{which} beyond the null's 99th percentile: the private words leak", **ev)
    return graded("none", f"{'word-bag recall' if has_bag else 'ROUGE-1 F1'} not beyond the null", **ev)



def _audit_fields(m: Mapping[str, Any]) -> dict:
    return {"n_success": int(m.get("sentences_exact", 0) or 0), "n_total": int(m.get("sentences_total", 0) or 0),
            "unit": "sentences"}


RULES = ("exact: a sentence word for word / strong: ROUGE-2 F1 beyond the null (and the word bag in random order) "
         "and >= 50 / partial: word-bag recall (or ROUGE-1 F1) beyond the null")

UNIT = register(EvaluationUnit("token_sequences", evaluate_tokens, headline="rouge1_f1", grade=grade_tokens,
                               sweep_metric="rouge1", per_client=True, audit_fields=_audit_fields,
                               decided_by=decided_by_tokens, rules=RULES, counts_batch_samples=True),
                "text: ROUGE recall and F1, exact sentences, word bag, verified sentences")
