"""ProjRes's information limit and oracle ceiling (gradleak.attacks.projres, module docstring): at full rank the
ceiling (each layer's row space cut to its K strongest directions) is ProjRes on the noise-free upload; K = 0 leaves
nothing to rank; under declared noise every layer carries a finite limit."""

from __future__ import annotations

import json
import math

import pytest

from gradleak.errors import BadInput

SMALL = {"experiment": "text", "seed": 0, "model": {"name": "minilm", "layers": 2},
         "peft": {"kind": "adapter", "reduction_factor": 2},
         "data": {"name": "rt-sentences", "batch_size": 4, "nonmembers": 12, "test_size": 0},
         "fl": {"clients": 1, "rounds": 1, "lr": 0.05},
         "threat": {"preset": "honest-but-curious", "public_data": True},
         "metrics": {"null_draws": 200, "figures": False}}


def _run(tmp_path, name, attack, defenses=()):
    from gradleak.run import run_config

    raw = json.loads(json.dumps(SMALL))
    raw["attack"] = {"name": "projres", **attack}
    raw["defenses"] = list(defenses)
    return run_config(raw, tmp_path / name)


def _scores(res):
    return json.dumps([res["metrics"]["auc"], res["metrics"].get("auc_null_p99")])


@pytest.mark.timeout(600)
def test_at_full_rank_the_ceiling_is_projres_on_the_noise_free_upload(tmp_path):
    plain = _run(tmp_path, "plain", {})
    full = _run(tmp_path, "full", {"directions": 10 ** 6})
    assert _scores(full) == _scores(plain)
    assert full["metrics"]["auc"] > 0.9  # the undefended upload: the members stand out
    zero = _run(tmp_path, "zero", {"directions": 0})
    assert zero["metrics"]["auc"] == 0.5  # no direction: every residual 1, every candidate tied


@pytest.mark.timeout(600)
def test_every_layer_carries_a_finite_limit_under_declared_noise(tmp_path):
    res = _run(tmp_path, "noisy", {}, [{"name": "gaussian_noise", "params": {"std": 0.3}}])
    m = res["metrics"]
    layers = [k for k in m if k.startswith("directions_above_edge_projres_layer")]
    assert len(layers) >= 2
    for i in range(len(layers)):
        for key in ("directions_above_edge", "margin_strongest", "drowning_noise_std_all"):
            v = m[f"{key}_projres_layer{i}"]
            assert isinstance(v, float) and math.isfinite(v)
    assert m["directions_above_edge_projres"] == sum(m[f"directions_above_edge_projres_layer{i}"]
                                                     for i in range(len(layers)))
    assert m["margin_strongest_projres"] == max(m[f"margin_strongest_projres_layer{i}"] for i in range(len(layers)))
    assert (m["directions_above_edge_projres"] == 0) == (m["margin_strongest_projres"] <= 1.05)


def test_the_ceiling_is_refused_on_a_noisy_score_and_with_the_wrong_count():
    from gradleak.attacks.projres import ProjRes

    with pytest.raises(BadInput, match="attack.directions"):
        ProjRes(noise="public", directions=3)._directions(["a", "b"])
    with pytest.raises(BadInput, match="2 scored layers"):
        ProjRes(directions=[1, 2, 3])._directions(["a", "b"])
    assert ProjRes(directions=[1, 0])._directions(["a", "b"]) == {"a": 1, "b": 0}
    assert ProjRes(directions=4)._directions(["a", "b"]) == {"a": 4, "b": 4}
