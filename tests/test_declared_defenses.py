"""Every declared defense reaches the attacks (gradleak.defenses.declared): what the server knows of each kind, and
the audit's full-strength tuning of each attack family under each kind (docs/DESIGN.md §6: attack at full strength
under every declared defense)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from gradleak.config.loading import load_yaml
from gradleak.defenses.declared import as_declared, declared_defenses
from gradleak.fl.core import Update
from gradleak.run.runner import validate

TEXT = "configs/audit/text_adapters.yaml"
IMAGE = "configs/audit/vit_lora.yaml"


def _cfg(path: str, attack: str, sets: list[str]):
    raw = load_yaml(path)
    raw.pop("audit", None)
    raw["attack"] = {"name": attack}
    return validate(raw, sets)[1]


def _update(n: int = 4, steps: int = 1) -> Update:
    return Update({"w": torch.ones(3, 5, dtype=torch.float64)}, n, 0, "gradient", steps)


# ------------------------------------------------------------------------------------------- what the server knows

def test_dpsgd_in_the_defense_section_is_declared_noise():
    """A training-time DP-SGD (the config's `defense:`) is noise the server knows: sigma C / B per coordinate of a
    FedSGD upload -- the gap that let a declared DP-SGD pass as undefended."""
    cfg = _cfg(TEXT, "utr", ["defense.name=dpsgd", "defense.noise_multiplier=0.5", "defense.max_grad_norm=2.0"])
    d = declared_defenses(cfg)
    assert d  # the audit runs full-strength variants
    assert d.adds_noise and d.per_sample_clip_norm == 2.0
    assert d.noise_std(_update(n=4)) == pytest.approx(0.5 * 2.0 / 4)
    assert "dpsgd (training)" in d.names


def test_dpsgd_fedavg_pseudo_gradient_sums_its_steps_noise():
    cfg = _cfg(TEXT, "utr", ["defense.name=dpsgd", "defense.noise_multiplier=1.0", "fl.algorithm=fedavg",
                             "fl.local_batch_size=2"])
    d = declared_defenses(cfg)
    # 3 steps of minibatch 2: variance 3 (sigma C / 2)^2
    assert d.noise_std(_update(n=6, steps=3)) == pytest.approx(math.sqrt(3) * 1.0 / 2)


def test_secure_aggregation_averages_the_noise_and_counts_who_is_summed():
    cfg = _cfg(TEXT, "utr", ["fl.clients=4", "fl.secure_aggregation=true",
                             "defenses=[{name: gaussian_noise, params: {std: 0.2}}]"])
    d = declared_defenses(cfg)
    assert d.summed == 4 and d.secure_aggregation
    assert d.noise_std(_update()) == pytest.approx(0.2 / 2)  # the mean of 4: std / sqrt(4)
    assert d.noise_std(_update(), individual=True) == pytest.approx(0.2)


@pytest.mark.parametrize("entry, fact, value", [
    ({"name": "clipping", "params": {"max_norm": 0.5}}, "clip_norm", 0.5),
    ({"name": "dp_gaussian", "params": {"noise_multiplier": 1.0, "max_norm": 0.25}}, "clip_norm", 0.25),
    ({"name": "topk_pruning", "params": {"prune_fraction": 0.9}}, "sparsity", {"keep_fraction": pytest.approx(0.1),
                                                                               "scope": "global"}),
    ({"name": "topk_pruning", "params": {"prune_fraction": 0.99, "per_tensor": True}}, "sparsity",
     {"keep_fraction": pytest.approx(0.01), "scope": "per_tensor"}),
    ({"name": "stochastic_quantization", "params": {"bits": 8}}, "quant_bits", 8),
    ({"name": "percentile_noise", "params": {"sigma0": 1.0}}, "noise_unknown", True),
])
def test_each_update_defense_declares_what_the_server_knows(entry, fact, value):
    d = as_declared([entry])
    assert getattr(d, fact) == value
    assert d


def test_an_update_defense_named_in_the_defense_section_is_declared():
    cfg = _cfg(TEXT, "utr", ["defense.name=percentile_noise", "defense.sigma0=2.0"])
    assert declared_defenses(cfg).noise_unknown


def test_flower_local_dp_is_declared_noise():
    cfg = _cfg(TEXT, "utr", ["fl.engine=flower", "fl.flower.dp=local", "fl.flower.local_epsilon=2.0"])
    d = declared_defenses(cfg)
    std = 1.0 * math.sqrt(2 * math.log(1.25 / 1e-5)) / 2.0 / cfg.fl.lr
    assert d.noise_std(_update()) == pytest.approx(std)


def test_no_declared_defense_is_falsy_and_a_learning_only_defense_changes_no_upload():
    assert not declared_defenses(_cfg(TEXT, "utr", []))
    assert not declared_defenses(_cfg(TEXT, "utr", ["defense.name=l2"]))


def test_pruning_per_tensor_keeps_each_tensors_top_fraction():
    from gradleak.defenses.update import TopKPruning

    u = Update({"small": torch.full((10,), 1e-3, dtype=torch.float64) * torch.arange(1, 11),
                "big": torch.arange(1, 101, dtype=torch.float64)}, 1)
    glob = TopKPruning(0.9).apply(u, {})
    per = TopKPruning(0.9, per_tensor=True).apply(u, {})
    assert int((glob.tensors["small"] != 0).sum()) == 0  # the global top-k removes the small tensor entirely
    assert int((per.tensors["small"] != 0).sum()) == 1 and int((per.tensors["big"] != 0).sum()) == 10


# ------------------------------------------------------------------------------- every kind reaches the tuning

DEFENSE_SETS = {
    "update noise": ["defenses=[{name: gaussian_noise, params: {std: 1.0e-6}}]"],
    "dp-sgd (training)": ["defense.name=dpsgd", "defense.noise_multiplier=1.0e-4"],
    "top-k": ["defenses=[{name: topk_pruning, params: {prune_fraction: 0.9, per_tensor: true}}]"],
    "quantisation": ["defenses=[{name: stochastic_quantization, params: {bits: 16}}]"],
    "percentile noise (defense section)": ["defense.name=percentile_noise", "defense.sigma0=1.0"],
    "secure aggregation": ["fl.clients=2", "fl.secure_aggregation=true"],
}


FAMILIES = [(TEXT, "utr", "noise"), ("configs/audit/text_lora.yaml", "dager", "eps_bag"),
            (IMAGE, "lora_span", "rank_cut"), (IMAGE, "ig", "noise_model"), (IMAGE, "gias", "noise_model")]
#: no noise and no clipping declared: nothing for the optimisation attacks' likelihood or clip model to use
NOTHING_TO_MODEL = ("top-k", "secure aggregation")


@pytest.mark.parametrize("kind, path, attack, key", [
    (kind, *f) for kind in sorted(DEFENSE_SETS) for f in FAMILIES
    if not (f[2] == "noise_model" and kind in NOTHING_TO_MODEL)])
def test_every_declared_defense_kind_reaches_the_attacks_tuning(kind, path, attack, key):
    """The audit's full-strength variants of each exact-attack family appear under every kind of declared defense
    (and not on an undefended setup, where they would only cost time)."""
    from gradleak.run.audit import full_strength_variants

    sets = DEFENSE_SETS[kind]
    from gradleak.run.audit import plan_audit

    def variants(sets_):
        # the audit's own plan: the attack under the configured threat or its smallest server upgrade
        _, _, _, planned, _, _ = plan_audit(load_yaml(path), sets_, [attack])
        (_, cand, cfg, A), = planned
        return full_strength_variants(A, cand, cfg)

    assert any(key in v for v in variants(sets)), (kind, attack)
    assert not any(key in v for v in variants([]) if key != "rank_rtol")


def test_utr_reads_dpsgd_noise_from_the_view():
    """UTR's public noise mode (its default) takes DP-SGD's noise from the declared-defense model in the view."""
    from types import SimpleNamespace

    from gradleak.attacks.utr.attack import UTRAttack

    cfg = _cfg(TEXT, "utr", ["defense.name=dpsgd", "defense.noise_multiplier=1.0e-4"])
    view = SimpleNamespace(public={"declared_defenses": declared_defenses(cfg), "clients": 1},
                           updates=[_update(n=2)], secure_aggregation=False)
    assert UTRAttack().noise_std(view, []) == pytest.approx(1.0e-4 / 2)


def test_a_declared_dpsgd_audit_is_attacked_at_its_noise(tmp_path):
    """End to end: DP-SGD with sigma = 1e-4 declared in `defense:` on the text audit config leaks the private words
    to an honest-but-curious server, and the audit says so (it said `leaks_stronger_server`, UTR `none`, while the
    DP-SGD noise never reached the attack's tuning)."""
    from gradleak.run.audit import run_audit

    raw = load_yaml(TEXT)
    res = run_audit(raw, tmp_path, overrides=["seed=31337", "defense.name=dpsgd", "defense.noise_multiplier=1.0e-4"],
                    only=["utr"], log=lambda m: None)
    utr = next(e for e in res["attacks"] if e["name"] == "utr")
    assert res["verdict"] == "leaks"
    assert utr["level"] in ("partial", "strong", "exact")
    assert utr["evidence"]["word_bag_recall"] > utr["evidence"]["word_bag_recall_bar"]
    # the leakage margin of the attacked layer: the used directions stand above the DP-SGD noise edge
    assert utr["leakage_margin"]["embedding_adapter"]["spectral_margin"] > 1


def test_the_leakage_margin_is_read_per_layer_from_a_runs_metrics():
    from gradleak.run.audit import leakage_margin

    m = leakage_margin({"spectral_margin_embedding_adapter": 3.0, "drowning_noise_std_embedding_adapter": 1e-5,
                        "drowning_noise_std_all_embedding_adapter": 1e-3, "signal_rank_embedding_adapter": 27.0,
                        "rouge1_f1": 50.0})
    assert m == {"embedding_adapter": {"spectral_margin": 3.0, "drowning_noise_std": 1e-5,
                                       "drowning_noise_std_all": 1e-3, "signal_rank": 27.0}}


def test_an_attack_that_cannot_apply_runs_no_variant():
    """DAGER reads attention-query gradients: on an adapters-only upload it is not applicable whatever its
    tolerances, decided from the model before anything runs: not planned, the reason said; on LoRA (the
    query trains) it runs with its full-strength variants."""
    from gradleak.errors import BadInput
    from gradleak.run.audit import full_strength_variants, plan_audit

    _, _, entries, planned, _, _ = plan_audit(load_yaml(TEXT), ["defense.name=dpsgd"], ["dager", "utr"])
    assert [p[0]["name"] for p in planned] == ["utr"]
    dager = next(e for e in entries if e["name"] == "dager")
    assert not dager["applicable"] and "level" not in dager and dager["not_measurable"]
    assert "not applicable to this architecture" in dager["reason"] and "query gradients" in dager["reason"]
    with pytest.raises(BadInput, match="frozen"):  # alone, nothing is left to run: exit 2, the reason named
        plan_audit(load_yaml(TEXT), ["defense.name=dpsgd"], ["dager"])
    _, _, _, planned, _, _ = plan_audit(load_yaml("configs/audit/text_lora.yaml"), ["defense.name=dpsgd"], ["dager"])
    (_, cand, cfg, A), = planned
    assert len(full_strength_variants(A, cand, cfg)) > 1


@pytest.mark.parametrize("kind", NOTHING_TO_MODEL)
def test_the_likelihood_variant_needs_declared_noise_or_clipping(kind):
    """Top-k pruning and secure aggregation add no noise and clip nothing: the optimisation attacks get no
    noise-model variant there (it would be the same attack again)."""
    from gradleak.run.audit import full_strength_variants, plan_audit

    _, _, _, planned, _, _ = plan_audit(load_yaml(IMAGE), DEFENSE_SETS[kind], ["ig"])
    (_, cand, cfg, A), = planned
    assert not any("noise_model" in v for v in full_strength_variants(A, cand, cfg))


@pytest.mark.parametrize("name", ["dlg", "april"])
def test_a_squared_error_attack_gets_the_likelihood_variant_only_where_a_clip_is_declared(name):
    """DLG and APRIL already match by the squared error, the declared Gaussian noise's likelihood: under noise alone
    the variant would be the same run again, step for step, so the audit does not run it; a declared clip (which the
    variant simulates) makes it another attack, and it runs. IG (cosine) gets it under noise alone."""
    from gradleak.run.audit import full_strength_variants, plan_audit

    def variants(name_, sets):
        (_, cand, cfg, A), = plan_audit(load_yaml(IMAGE), sets, [name_])[3]
        return full_strength_variants(A, cand, cfg)

    noise = DEFENSE_SETS["update noise"]
    clipped = ["defenses=[{name: clipping, params: {max_norm: 1.0}}, {name: gaussian_noise, params: {std: 1.0e-6}}]"]
    assert variants(name, noise) == [{}]
    assert {"noise_model": "declared"} in variants(name, clipped)
    assert {"noise_model": "declared"} in variants("ig", noise)


@pytest.mark.parametrize("name", ["ig", "dlg", "april"])
def test_the_declared_noise_model_changes_what_the_attack_matches(name, monkeypatch):
    """``noise_model: declared`` reaches the matching: the squared error (the declared Gaussian noise's
    log-likelihood) replaces the configured similarity, and the declared clipping bound scales the dummy gradient;
    ``off`` matches as configured. (Before, the field was validated but never set on the attack: every declared
    variant matched by cosine.)"""
    from torch import nn

    from gradleak.registry import ATTACKS

    A = ATTACKS.get(name)
    kinds = []
    real = A._distance

    def spy(self, grads, targets, idx, norm, kind):
        kinds.append((kind, [g.detach().clone() for g in grads]))
        return real(self, grads, targets, idx, norm, kind)

    monkeypatch.setattr(A, "_distance", spy)
    torch.manual_seed(0)
    model = nn.Linear(6, 3).double()
    params = [model.weight]
    x, labels = torch.randn(2, 6, dtype=torch.float64), torch.tensor([0, 2])
    targets = [torch.randn(3, 6, dtype=torch.float64)]
    groups, norms = {"main": [0], "pe": []}, {"main": targets[0].norm(), "pe": None}
    out = {}
    for m in ("off", "declared"):
        attack = A(noise_model=m)
        assert attack.noise_model == m
        attack._clip = 1e-3 if m == "declared" else None  # what _setup reads off the declared defenses
        kinds.clear()
        out[m] = attack.matching_terms(model, params, targets, groups, norms, x, labels, create_graph=False)[0]
        (kind, grads), = kinds
        out[m + "_kind"], out[m + "_norm"] = kind, float(grads[0].norm())
    configured = A(noise_model="off").distance
    assert out["declared_kind"] == "l2" and out["off_kind"] == configured
    if name == "ig":
        assert configured == "cosine"  # IG matches by cosine unless the noise is declared
    assert out["declared_norm"] == pytest.approx(1e-3) and out["off_norm"] > 1e-2  # the declared clip applied
    assert float(out["declared"]) != pytest.approx(float(out["off"]))
