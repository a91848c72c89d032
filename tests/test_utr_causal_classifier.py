"""UTR on a causal (Llama) backbone with a classification head (no LM head), as the defended benchmark uses
SmolLM2-135M: a mean-pooled sequence classifier. Tiny randomly initialised Llama configs, CPU, seeded.

Before the fix UTR took such a model for BERT (``is_causal`` looked for an ``lm_head``) and read
``base_model.embeddings``: AttributeError."""

from __future__ import annotations

import pytest
import torch

VOCAB, HIDDEN, BOS, EOS, PAD = 300, 64, 1, 2, 0


class _Tok:
    """The tokenizer surface UTR reads (its special ids); the tiny model's vocabulary is just ids."""

    bos_token_id, eos_token_id, pad_token_id = BOS, EOS, PAD

    def get_vocab(self):
        return {}


def _tiny_llama(head: str, num_labels: int = 4):
    """A 2-layer Llama (d = 64) with UTR's adapters (rf = 2): ``head`` = 'mean' (sequence classifier, mean-pooled
    like the benchmark's SmolLM2), 'last' (the HF classifier reading the last non-pad token) or 'lm' (LM head).
    Embeddings drawn at unit scale: at Llama's 0.02 init the adapter's bias alone decides its ReLU mask."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    from gradleak.models.text import TextModel, use_mean_pooling
    from gradleak.peft.text_adapters import add_text_adapters

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, pad_token_id=PAD,
                      num_labels=num_labels, attn_implementation="eager")
    model = (LlamaForCausalLM if head == "lm" else LlamaForSequenceClassification)(cfg).eval()
    torch.nn.init.normal_(model.model.embed_tokens.weight.data)
    for p in model.parameters():
        p.requires_grad_(False)
    if head != "lm":
        for p in model.score.parameters():
            p.requires_grad_(True)
    tm = TextModel(model=model, tokenizer=_Tok(), kind="causal", name=f"tiny-llama-{head}", num_layers=2,
                   hidden_size=HIDDEN, max_length=64, task="lm" if head == "lm" else "classification")
    if head == "mean":
        use_mean_pooling(tm)
    add_text_adapters(model, tm.layers(), HIDDEN, 2)
    return tm


def _batch(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 8, (n,), generator=g).tolist()
    return [[BOS] + torch.randint(3, VOCAB, (k,), generator=g).tolist() + [EOS] for k in lengths]


def _view(tm, sents: list[list[int]], labels: list[int]):
    from gradleak.fl.core import Client, ServerView
    from gradleak.models.text import text_loss
    from gradleak.attacks.utr.values import pad_right

    ids, am = pad_right(sents, PAD)
    upd = Client(0, torch.stack([ids, am], 1), torch.tensor(labels),
                 loss_fn=text_loss("causal", task=tm.task)).local_update(tm.model)
    return ServerView(tm.model, [upd], public={"tokenizer": tm.tokenizer, "batch_size": len(sents)}), ids, am


def test_a_llama_classifier_is_causal_and_has_no_lm_head():
    from transformers import BertConfig, BertForSequenceClassification

    from gradleak.attacks.common.text import has_lm_head, is_causal

    for head in ("mean", "last"):
        m = _tiny_llama(head).model
        assert is_causal(m) and not has_lm_head(m)
    lm = _tiny_llama("lm").model
    assert is_causal(lm) and has_lm_head(lm)
    bert = BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1,
                                                    num_attention_heads=2, intermediate_size=64))
    assert not is_causal(bert) and not has_lm_head(bert)


@pytest.mark.parametrize("head", ["mean", "last"])
def test_utr_recovers_a_llama_classifiers_batch(head):
    """The word bag is exactly the batch's tokens (the final EOS included: the classifier pools every position), and
    the prefix search's sentences pass the classifier's value test (head coefficients fitted per sentence), which
    peels them until the upload is explained. Before the fix: AttributeError ('LlamaModel' ... 'embeddings')."""
    from gradleak.attacks.utr import UTRAttack

    tm = _tiny_llama(head)
    sents = _batch(3)
    view, _, _ = _view(tm, sents, [0, 3, 1])
    rec = UTRAttack().reconstruct(view)
    assert set(rec.info["word_bag"]) == {v for s in sents for v in s}
    assert sorted(map(tuple, rec.data)) == sorted(tuple(s[1:-1]) for s in sents)
    assert rec.info["head"] == "classification" and rec.info["lm_prior"].startswith("off")
    assert rec.info["value_verified"] and rec.info["verified"] == [True] * 3
    assert rec.info["value_test_head"].startswith("classifier: 3 ")
    assert rec.info["joint_residual"] < 1e-4 and not rec.info["capacity_exhausted"]


def test_classifier_value_test_fits_the_cross_entropy_coefficients_and_rejects_wrong_sentences():
    """At a true sentence the fitted coefficients are the cross-entropy's (p_c - y_c) / B, c >= 1 (the labels are
    never given to the test); a swapped token or a dropped last word fails by three orders of magnitude; peeling the true
    sentences at their coefficients explains the embedding and layer adapters' uploads."""
    from gradleak.attacks.utr.causal import CausalValueTest
    from gradleak.peft.text_adapters import adapter_param

    tm = _tiny_llama("mean")
    sents, labels = _batch(3, seed=2), [2, 0, 3]
    view, ids, am = _view(tm, sents, labels)
    upload = view.updates[0].tensors
    bag = sorted({v for s in sents for v in s})
    keys = (adapter_param("layer_0"), adapter_param("layer_1"))
    vt = CausalValueTest(tm.model, upload, bag, PAD, peel_names=keys)
    assert not vt.lm and vt.usable and vt.fit < 1e-6
    with torch.no_grad():
        p = torch.softmax(tm.model(input_ids=ids, attention_mask=am).logits.double(), -1)
    res = vt.residuals(sents)
    y = torch.nn.functional.one_hot(torch.tensor(labels), 4).double()
    expected = (p - y)[:, 1:] / len(sents)  # FedSGD: the upload is the mean loss's gradient
    for (r, w), e in zip(res, expected):
        assert r < 1e-4
        assert float((w - e).norm()) < 1e-3 * float(e.norm())
    wrong = []
    for s in sents:
        swapped = list(s)
        swapped[len(s) // 2] = next(v for v in range(3, VOCAB) if v not in bag)
        wrong += [swapped, s[:-2] + s[-1:]]
    # measured: true <= 1.7e-7, wrong >= 3.3e-4 (the LM head on the same tiny model: <= 4e-7 / >= 2.8e-4); the
    # peel search accepts below 1e-4
    assert min(r for r, _ in vt.residuals(wrong)) > max(1e-4, 100 * max(r for r, _ in res))
    for s, (_, w) in zip(sents, res):
        vt.coefs[tuple(s)] = w
    vt.peel(sents)
    assert vt.left() < 1e-4
    assert all(float(vt.rest[k].norm() / upload[k].norm()) < 1e-4 for k in keys)


def test_causal_lm_value_test_keeps_one_batch_scale():
    """The LM path as before: one batch scale, 1 / targets, for every sentence; the EOS stays invisible."""
    from gradleak.attacks.utr import UTRAttack
    from gradleak.attacks.utr.causal import CausalValueTest

    tm = _tiny_llama("lm")
    sents = _batch(3, seed=3)
    view, _, _ = _view(tm, sents, [0, 0, 0])
    vt = CausalValueTest(tm.model, view.updates[0].tensors, sorted({v for s in sents for v in s}), PAD)
    assert vt.lm and vt.usable
    res = vt.residuals(sents)
    assert all(r < 1e-4 for r, _ in res) and all(isinstance(w, float) for _, w in res)
    targets = sum(len(s) - 1 for s in sents)
    assert all(abs(w * targets - 1) < 1e-3 for _, w in res)
    rec = UTRAttack().reconstruct(view)
    assert rec.info["head"] == "lm" and rec.info["value_test_head"].startswith("lm")
    # the final EOS gets no gradient under the LM loss: not in the bag, and the sentences come back without it
    assert set(rec.info["word_bag"]) == {v for s in sents for v in s[:-1]}
    assert sorted(map(tuple, rec.data)) == sorted(tuple(s[1:-1]) for s in sents)
