"""UTR as published (``search: paper``, :mod:`gradleak.attacks.utr.greedy`) beside our extended search.

Real offline models (MiniLM-L6, SmolLM2-135M, 2 layers, reduction factor 2) on short Rotten Tomatoes sentences. The
cases where the paper's greedy search fails follow from its definition (beam width 1, a strict EICW filter), and the
tests check the mechanism, not only the outcome: which run stopped where, and that the extended search recovers the
same batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gradleak.errors import BadInput
from test_utr import _view, minilm, smollm2  # noqa: F401  (module-scoped fixtures of the UTR tests)

ROOT = Path(__file__).resolve().parents[1]


def _decode(tm, sents):
    return [tm.tokenizer.decode(s, skip_special_tokens=True).strip() for s in sents]


def _refs(tm, texts):
    tok = tm.tokenizer
    return [tok.decode(tok.encode(t), skip_special_tokens=True).strip() for t in texts]


def _run(view, **params):
    from gradleak.attacks.utr import UTRAttack

    return UTRAttack(**params).reconstruct(view)


def test_paper_search_recovers_one_sentence_exactly_on_bert(minilm):
    """B = 1 with no repeated token: one token per position passes stage 1's (token, position) test, and the
    greedy candidate [CLS] prefix t [SEP] is complete (every state in S_LA) exactly at the true sentence."""
    texts = ["a sentimental mess that never rings true ."]
    view, _ = _view(minilm, texts)
    rec = _run(view, search="paper")
    assert _decode(minilm, rec.data) == _refs(minilm, texts)
    assert rec.info["method"] == "UTR (paper)"
    assert rec.info["verified_sentences"] == 1 and rec.info["greedy_runs"] == 1
    # the extensions are off: no exact pairs from the coefficients, no value test
    assert "exact_pairs" not in rec.info and "value_verified" not in rec.info
    ext = _run(view)
    assert ext.info["method"].startswith("UTR (ours") and ext.info["exact_pairs"] == "ok"


def test_paper_search_recovers_one_sentence_exactly_on_a_causal_lm(smollm2):
    texts = ["a sentimental mess that never rings true ."]
    view, _ = _view(smollm2, texts)
    rec = _run(view, search="paper")
    tok = smollm2.tokenizer
    assert [tok.decode(s) for s in rec.data] == [tok.decode(tok.encode(texts[0], add_special_tokens=False))]
    assert rec.info["method"] == "UTR (paper)" and rec.info["greedy_starts"] == 1


def test_paper_greedy_keeps_one_of_two_sentences_that_share_a_first_token(smollm2):
    """Beam width 1 (SPEC A3.8): both sentences start with "a", so the root has one passing extension and one
    greedy run, which follows one sentence where they part; the extended search branches there (a trie)."""
    texts = ["a sentimental mess that never rings true .", "a masterpiece four years in the making ."]
    view, _ = _view(smollm2, texts)
    tok = smollm2.tokenizer
    refs = sorted(tok.decode(tok.encode(t, add_special_tokens=False)) for t in texts)
    paper = _run(view, search="paper")
    assert paper.info["greedy_starts"] == 1
    out = [tok.decode(s) for s in paper.data]
    assert len(out) == 1 and out[0] in refs  # one sentence, word for word: the other one is lost, not garbled
    ours = _run(view)
    assert sorted(tok.decode(s) for s in ours.data) == refs


def test_strict_eicw_stops_the_paper_search_at_a_repeated_token(minilm):
    """". . . a roller-coaster ride" repeats "." (EICW rejects it as published): the greedy run ends after the
    first ".", unverified; with EICW off the same search recovers the sentence, and so does ours."""
    texts = [". . . a roller-coaster ride of a movie"]
    view, _ = _view(minilm, texts)
    ref = _refs(minilm, texts)
    paper = _run(view, search="paper")
    assert _decode(minilm, paper.data) == ["."] and paper.info["verified_sentences"] == 0
    assert _decode(minilm, _run(view, search="paper", eicw=False).data) == ref
    assert _decode(minilm, _run(view).data) == ref


def test_bad_search_value_names_the_field():
    import yaml

    from gradleak.attacks.utr import UTRAttack
    from gradleak.run.runner import validate

    with pytest.raises(BadInput, match="attack.search"):
        UTRAttack(search="beam")
    raw = yaml.safe_load((ROOT / "configs" / "utr" / "minilm_rt.yaml").read_text())
    with pytest.raises(BadInput, match="search"):
        validate(raw, ["attack.params.search=greedy"])
    _, cfg = validate(raw, ["attack.params.search=paper"])
    assert cfg.attack.params["search"] == "paper"
