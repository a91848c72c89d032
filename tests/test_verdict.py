"""The verdict and its guards: graded level rules per reconstruction kind, both sides of
every threshold and NaN (plain dicts); the verdict and banner; chance fed to every evaluator as if it were an
attack's output stays below its null; the threat gate's arithmetic; the audit's false-safe cases."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gradleak.evaluation.levels import grade

NAN = float("nan")


# ------------------------------------------------------------------------------------------------ chance is not a leak

def _cfg(draws=1000, **metrics):
    m = dict(psnr_threshold_db=30.0, feature_distance=False, null=True, null_draws=draws, leakage_ssim="gaussian",
             iip=False, high_risk_client=None)
    m.update(metrics)
    return SimpleNamespace(metrics=SimpleNamespace(**m), seed=0)


def _memo(monkeypatch, name):
    """The nulls are deterministic in their inputs: compute each once (the draws below differ only in the fake
    attack output)."""
    import gradleak.evaluation.nulls as nulls

    orig, cache = getattr(nulls, name), {}

    def fp(a):
        if isinstance(a, torch.Tensor):
            return (tuple(a.shape), round(float(a.double().sum()), 6), round(float(a.double().square().sum()), 6))
        if isinstance(a, (list, tuple, set)):
            return (len(a), hash(tuple(sorted(map(str, a)))))
        return a

    def wrapped(*args, **kw):
        key = (tuple(fp(a) for a in args), tuple(sorted((k, fp(v)) for k, v in kw.items())))
        if key not in cache:
            cache[key] = orig(*args, **kw)
        return cache[key]

    monkeypatch.setattr(nulls, name, wrapped)


@pytest.mark.timeout(300)
def test_random_public_images_fed_to_the_evaluators_stay_below_their_null(tmp_path, monkeypatch):
    """Random public images passed to the images, patches-style and leakage evaluators as if an attack had returned
    them: at most 1 % of 200 draws reach `partial` or more (the issue's false alarm: RDLV > 0 for random images)."""
    from gradleak.data import load
    from gradleak.attacks.base import Reconstruction
    from gradleak.evaluation import Truth, evaluate

    for n in ("image_null", "rdlv_null"):
        _memo(monkeypatch, n)
    # 400 image grids would only be written to tmp_path: skip them (the scores do not depend on them)
    monkeypatch.setattr("gradleak.evaluation.images.image_grids", lambda *a, **k: ([], []))
    monkeypatch.setattr("gradleak.report.leakage.save_reconstruction_grid", lambda *a, **k: None)
    crops = load("natural-crops", n=4 + 256 + 200 * 4 + 64, size=24, seed=11).images.float()
    originals, pool, rest = crops[:4], crops[4:260], crops[260:]
    prior = pool[:64].mean(0)
    hits = {"images": 0, "leakage": 0}
    cfg = _cfg()
    for d in range(200):
        fake = rest[4 * d:4 * d + 4]
        tr = Truth("image", originals, torch.zeros(4, dtype=torch.long), null_pool=pool, null_source="crops")
        ev = evaluate("images", tr, Reconstruction({"images": fake}), cfg, tmp_path, d)
        hits["images"] += grade("images", ev.metrics, 30.0)["level"] not in ("none",)
        tr = Truth("image", originals, torch.zeros(4, dtype=torch.long), null_pool=pool, null_source="crops",
                   client_inputs=[originals], client_validation=[originals[:0]], client_steps=[1])
        rec = Reconstruction({"prior": prior, "per_client": [{"client": 0, "round": 0, "images": fake}]})
        ev = evaluate("leakage", tr, rec, cfg, tmp_path, d)
        mets = {k[: -len("_client0")]: v for k, v in ev.metrics.items() if k.endswith("_client0")}
        assert not math.isnan(mets["rdlv_null_p99"])
        hits["leakage"] += grade("leakage", mets, 30.0)["level"] not in ("none",)
    assert hits["images"] <= 2 and hits["leakage"] <= 2, hits


@pytest.mark.timeout(300)
def test_random_public_sentences_and_member_sets_stay_below_their_null(tmp_path, monkeypatch):
    """Random public sentences (with their tokens as the word bag) fed to the text evaluator, and random scores to
    the membership evaluator: at most 1 % of 200 draws reach `partial` or more."""
    from gradleak.attacks.base import Reconstruction
    from gradleak.data.text import load_text
    from gradleak.evaluation import Truth, evaluate
    from transformers import AutoTokenizer

    from gradleak.models.text import resolve_model

    import gradleak.evaluation.nulls as nulls

    for n in ("text_null", "word_bag_null"):
        _memo(monkeypatch, n)
    # the bag-in-random-order reference only raises the ROUGE-2 bar (strong); without it chance is judged harder
    monkeypatch.setattr(nulls, "bag_order_null", lambda *a, **k: {"rouge1_f1": np.array([]), "rouge2_f1": np.array([])})
    tok = AutoTokenizer.from_pretrained(str(resolve_model("minilm", 2)[0]))
    texts = load_text("rt-sentences").texts
    rng = np.random.default_rng(5)
    order = rng.permutation(len(texts))
    private = [texts[i] for i in order[:2]]
    pool = [texts[i] for i in order[2:]]  # every public sentence (rt-sentences has 200): the null's pool
    others = pool  # chance outputs: random public sentences, drawn apart from the null's own seeded draws
    enc = tok(private, padding=True, return_tensors="pt")
    cfg = _cfg()
    hits = 0
    for d in range(200):
        fake = [others[i] for i in rng.choice(len(others), 2, replace=False)]
        ids = [tok(s, add_special_tokens=False)["input_ids"] for s in fake]
        tr = Truth("text", {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]},
                   torch.zeros(2, dtype=torch.long), texts=private, tokenizer=tok, model_kind="bidirectional",
                   null_pool=pool, null_source="rt")
        ev = evaluate("token_sequences", tr, Reconstruction(ids, info={"word_bag": sorted({t for s in ids for t in s})}),
                      cfg, tmp_path, d)
        assert "word_bag_recall_null_p99" in ev.metrics
        hits += grade("token_sequences", ev.metrics)["level"] != "none"
    assert hits <= 2, hits
    labels = [True] * 16 + [False] * 48
    monkeypatch.setattr("gradleak.evaluation.membership._roc_figure", lambda *a, **k: ([], []))  # 200 plots
    hits = 0
    cfg = _cfg(draws=200)
    for d in range(200):
        scores = {0: list(rng.normal(size=64))}
        tr = Truth("text", None, torch.zeros(1), membership={0: labels})
        ev = evaluate("membership", tr, Reconstruction({"scores": scores}), cfg, tmp_path, d)
        hits += grade("membership", ev.metrics)["level"] != "none"
    assert hits <= 2, hits


# ------------------------------------------------------------------------------------------------ the audit's false-safe cases

TEXT = {"experiment": "text", "seed": 0, "model": {"name": "minilm", "layers": 2},
        "peft": {"kind": "adapters", "reduction_factor": 2}, "data": {"name": "rt-sentences", "batch_size": 2,
                                                                     "nonmembers": 30},
        "fl": {"algorithm": "fedsgd", "rounds": 1, "clients": 2}, "threat": {"preset": "honest-but-curious"}}


@pytest.mark.timeout(600)
def test_text_audit_every_client_tiny_noise_is_a_leak_and_nothing_is_lost(tmp_path):
    """The issue's green-over-a-leak cases on the text audit, in one run: DP noise of 1e-9 (near-verbatim sentences)
    gives `leaks` (one sentence per client: UTR's search on two-sentence batches quadrupled this test's time, and the
    batch paths have their own tests in tests/test_utr.py); both clients are attacked (builtin engine); `--only projres,utr` (ProjRes under the public-data
    upgrade) writes audit.json with both results; ProjRes with non-members is measured, not undefined."""
    import json

    from gradleak.run.audit import run_audit

    raw = {**TEXT, "data": {**TEXT["data"], "batch_size": 1},
           "defenses": [{"name": "dp_gaussian", "params": {"noise_multiplier": 1.0e-9, "max_norm": 1.0}}]}
    res = run_audit(raw, tmp_path, only=["projres", "utr"], log=lambda m: None)
    by = {a["name"]: a for a in res["attacks"]}
    assert res["verdict"] == "leaks" and res["headline"].startswith("LEAKS: ")
    assert by["utr"]["level"] in ("partial", "strong", "exact") and by["utr"]["value"] > by["utr"]["null_p99"]
    assert sorted(c["client"] for c in by["utr"]["per_client"]) == [0, 1]
    assert len(by["utr"]["variants"]) == 2  # as configured + the noise read off the upload (a declared defense)
    assert by["projres"]["level"] != "undefined" and by["projres"]["applicable_under"] == "upgraded"
    assert "public data" in by["projres"]["threat_words"]
    saved = json.loads((tmp_path / "audit.json").read_text())
    assert saved["verdict"] == "leaks" and {a["name"] for a in saved["attacks"]} == {"projres", "utr"}


def test_membership_without_non_members_is_undefined_not_ran(tmp_path, monkeypatch):
    """ProjRes that measured nothing (NaN AUC: no non-members) is `undefined`, named with what is missing, and an
    audit where nothing was measured is not green."""
    from gradleak.run.audit import run_audit

    def fake_run(cand, out, device=None):
        return {"metrics": {"auc": NAN, "tpr_at_1pct_fpr": NAN, "members": 2.0, "nonmembers": 0.0}, "artifacts": []}

    monkeypatch.setattr("gradleak.run.runner.run_config", fake_run)
    raw = {**TEXT, "data": {"name": "rt-sentences", "batch_size": 2}, "threat": {"public_data": True}}
    res = run_audit(raw, tmp_path, only=["projres"], log=lambda m: None)
    (a,) = res["attacks"]
    assert a["level"] == "undefined" and "data.nonmembers" in a["reason"]
    assert res["verdict"] == "undefined" and not res["headline"].startswith("NO LEAK")


def test_secure_aggregation_over_one_client_does_not_hide_the_update_from_peftleak(tmp_path):
    """fl.secure_aggregation with one client: PEFTLeak is not refused (the sum of one update is that update) and
    recovers the patches under the malicious upgrade; the setup says why."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_audit import TINY

    from gradleak.run.audit import run_audit

    raw = {**TINY, "fl": {"secure_aggregation": True, "clients": 1}}
    res = run_audit(raw, tmp_path, only=["peftleak"], log=lambda m: None)
    (a,) = res["attacks"]
    assert a["level"] == "exact" and res["verdict"] == "leaks_stronger_server"
    assert any("over one client" in line for line in res["setup"])
    assert any("sum of one update" in line for line in res["threat"])


def test_roc_summary_is_scikit_learns_roc():
    """The nulls' fast ROC (one sort) gives scikit-learn's AUC and TPR at 1 % FPR, ties included."""
    from sklearn.metrics import roc_auc_score, roc_curve

    from gradleak.evaluation.nulls import roc_summary

    rng = np.random.default_rng(0)
    for t in range(200):
        n = int(rng.integers(2, 300))
        y = rng.integers(0, 2, n)
        if y.min() == y.max():
            continue
        s = rng.integers(0, 20, n).astype(float) if t % 2 else rng.normal(size=n) + y * rng.uniform(0, 3)
        fpr, tpr, _ = roc_curve(y, s)
        r = roc_summary(y, s)
        assert r["auc"] == pytest.approx(roc_auc_score(y, s), abs=1e-12)
        assert r["tpr_at_1pct_fpr"] == pytest.approx(float(tpr[fpr <= 0.01].max()) if (fpr <= 0.01).any() else 0.0)


def test_membership_null_rows_match_roc_summary_row_by_row():
    from gradleak.evaluation.nulls import _roc_rows, roc_summary

    rng = np.random.default_rng(3)
    Y = np.stack([rng.permutation([1] * 7 + [0] * 50) for _ in range(50)])
    for S in (rng.normal(size=Y.shape), rng.integers(0, 4, Y.shape).astype(float)):  # ties in long runs too
        auc, tpr = _roc_rows(Y, S)
        for i in range(len(Y)):
            r = roc_summary(Y[i], S[i])
            assert auc[i] == pytest.approx(r["auc"], abs=1e-12) and tpr[i] == pytest.approx(r["tpr_at_1pct_fpr"])


@pytest.mark.parametrize("attack, key, leaking, bad", [
    ("lora_span", "rank_rtol", 1e-4, 0.5),          # the issue: 14.3 dB at the default cut, 56.8 dB at 1e-4
    ("utr", "noise", "estimate", "public"),          # quantisation: ROUGE-1 50.8 at 'public', 97.9 at 'estimate'
])
def test_verdict_does_not_rest_on_a_tolerance(tmp_path, monkeypatch, attack, key, leaking, bad):
    """Under a declared defense the audit also runs each attack's full-strength variants, so the verdict is the
    same whatever value of the key tolerance the config leaves: runs are faked to leak only at `leaking`."""
    from gradleak.run.audit import run_audit

    def fake_run(cand, out, device=None):
        hit = cand["attack"].get(key) == leaking
        if attack == "lora_span":
            m = {"psnr_max": 56.8 if hit else 14.3, "psnr_max_null_p99": 15.0, "ssim_max": 0.99 if hit else 0.1,
                 "ssim_max_null_p99": 0.3, "images_above_threshold": 1.0 if hit else 0.0, "images_total": 1.0}
        else:
            m = {"rouge1_f1": 97.9 if hit else 10.0, "rouge1_f1_null_p99": 24.0, "rouge2_f1": 95.0 if hit else 1.0,
                 "rouge2_f1_null_p99": 5.0, "sentences_exact": 1.0 if hit else 0.0, "sentences_total": 2.0}
        return {"metrics": m, "artifacts": []}

    monkeypatch.setattr("gradleak.run.runner.run_config", fake_run)
    if attack == "lora_span":
        raw = {"experiment": "image", "seed": 0, "data": {"name": "cifar-samples", "batch_size": 1, "image_size": 16},
               "model": {"name": "vit-tiny", "layers": 1}, "peft": {"kind": "lora", "lora_rank": 8},
               "metrics": {"feature_distance": False}}
    else:
        raw = dict(TEXT)
    raw["defenses"] = [{"name": "stochastic_quantization", "params": {"bits": 16}}]
    verdicts = set()
    for value in (bad, leaking):
        res = run_audit({**raw, "audit": {"params": {attack: {key: value}}}}, tmp_path / str(value), only=[attack],
                        log=lambda m: None)
        (a,) = res["attacks"]
        verdicts.add(res["verdict"])
        worst = a.get("worst_variant", "as configured")
        assert a["level"] == "exact" and (worst == "as configured" or worst[key] == leaking)
    assert verdicts == {"leaks"}
