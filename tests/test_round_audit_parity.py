"""One config through ``gradleak audit`` (:func:`gradleak.run.audit.run_audit`) and through the framework round audit
(:class:`gradleak.run.round_audit.RoundAudit`) on the federation's recorded round, once per round engine: the
builtin engine's round, a Flower federation audited by :class:`gradleak.integrations.flower.FlowerAudit` on its
``GradleakStrategy``, and an NVFlare federation audited by the server's result filter
(:class:`gradleak.integrations.nvflare.NVFlareAudit`, each client on its own upload). Both sides must measure the same
attacks, at the same levels, with the same headline values and the same verdict (docs/DESIGN.md §7): GradViT and the
BN inversion run under the server upgrade they need (public data a server can hold), as ``gradleak audit`` runs them,
and lora_span at full strength (its variants).

The federation is tiny (ViT-Tiny/8 at 16 px, LoRA r = 8, two clients of one CIFAR image each, one FedAvg round;
float64 pinned, so every attack sees the model in the dtype the federation trains in) and the attacks few-step
(``audit.params``): the levels are what the tiny runs measure, the same on both sides, not a claim about the attacks.
Attacks that poison the weights the server sends (PEFTLeak) cannot run on a recorded honest round: a round audit lists
them as not run; none is in this set."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
ATTACKS = ["bn_inversion", "gradvit", "ig", "lora_span"]
CONFIG = {
    "experiment": "image", "name": "round-audit-parity", "seed": 0, "device": "cpu",
    "data": {"name": "cifar-samples", "batch_size": 1, "image_size": 16, "public": "natural-crops", "prior_size": 4,
             "public_size": 8},
    "model": {"name": "vit-tiny", "num_classes": 110, "patch_size": 8, "pooling": "mean", "dtype": "float64"},
    "peft": {"kind": "lora", "lora_rank": 8, "lora_targets": ["query", "value"]},
    "fl": {"algorithm": "fedavg", "clients": 2, "rounds": 1, "lr": 0.01},
    "threat": {"preset": "honest-but-curious"},
    "defenses": [],
    "attack": {"name": "ig"},  # the setting the federation models (its model's dtype is pinned above)
    "audit": {"params": {"gradvit": {"steps": 3, "restarts": 1, "feature_image_size": 14, "feature_public_images": 4},
                         "ig": {"steps": 3, "restarts": 1},
                         "bn_inversion": {"iterations": 3, "warmup": 1, "ablation": "gradient_only"}}},
}
#: what is compared per attack: the gate's word, the level, the headline metric and value, the worst client, and every
#: client's row (its level, value, null and counts). The entry's own counts differ by design: a round audit's are the
#: round's (summed over its clients: "6 of 6 sentences"), gradleak audit's the evidence client's
KEYS = ("applicable", "applicable_under", "level", "metric", "value", "null_p99", "p_value", "decided_by",
        "worst_client")
ROW_KEYS = ("client", "level", "value", "null_p99", "p_value", "n_success", "n_total")


def _quiet(_m):
    return None


def _config(tmp_path, engine: str) -> str:
    raw = copy.deepcopy(CONFIG)
    raw["fl"]["engine"] = engine
    path = tmp_path / f"parity_{engine}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return str(path)


def _measured(result: dict) -> dict[str, dict]:
    """``{attack: (the compared keys)}`` of every attack an audit measured (a level of its own)."""
    return {e["name"]: {**{k: e.get(k) for k in KEYS},
                        "rows": [tuple(r.get(k) for k in ROW_KEYS) for r in e.get("per_client") or []]}
            for e in result["attacks"] if e.get("level") is not None}


def _same(cli: dict, rnd: dict, engine: str, attacks=ATTACKS, upgraded=("bn_inversion", "gradvit")) -> None:
    a, b = _measured(cli), _measured(rnd)
    assert set(a) == set(b) == set(attacks), (engine, sorted(a), sorted(b))  # every attack measured on both sides
    for name in attacks:
        assert a[name]["rows"] and len(a[name]["rows"]) == len(b[name]["rows"]), (engine, name)
        pairs = [(k, a[name][k], b[name][k]) for k in KEYS]
        pairs += [(f"client row {i} {k}", x, y) for i, (ra, rb) in enumerate(zip(a[name]["rows"], b[name]["rows"]))
                  for k, x, y in zip(ROW_KEYS, ra, rb)]
        for k, x, y in pairs:
            if isinstance(x, float) and isinstance(y, float):
                assert math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-9) or (x != x and y != y), (engine, name, k, x, y)
            else:
                assert x == y, (engine, name, k, x, y)
    assert {n for n in attacks if a[n]["applicable_under"] == "upgraded"} == set(upgraded), engine
    assert cli["verdict"] == rnd["verdict"], engine


def _cli(path: str, tmp_path, attacks=ATTACKS) -> dict:
    from gradleak.config.loading import load_yaml
    from gradleak.run.audit import run_audit

    return run_audit(load_yaml(path), tmp_path / "cli", [], only=attacks, log=_quiet)


def _builtin_round(path: str):
    """The builtin engine's round of the config's federation, as the pipeline runs it, recorded as a framework
    records it (what the server sent, each client's reply and update), and every client's private batch."""
    from gradleak.fl.engines.builtin import run_rounds
    from gradleak.fl.recorded import ClientReply, RecordedRound
    from gradleak.modalities import modality_of
    from gradleak.run.pipeline import build_handle, clients_and_truth, round_defenses_and_loss
    from gradleak.run.round_audit import validated_config

    cfg = validated_config(path)
    handle, _ = build_handle(cfg)
    batches = modality_of(cfg).data(cfg).clients(0, cfg.model.num_classes)
    defenses, loss_fn = round_defenses_and_loss(cfg, handle, handle.model)
    clients, _ = clients_and_truth(handle, batches, loss_fn, torch.device("cpu"), cfg.threat_model, cfg)
    out = run_rounds(handle.model, clients, rounds=1, algorithm=cfg.fl.algorithm, lr=cfg.fl.lr,
                     local_epochs=cfg.fl.local_epochs, local_batch_size=cfg.fl.local_batch_size, defenses=defenses,
                     seed=cfg.seed, client_settings=cfg.client_plan(), lr_at=cfg.fl.lr_at)
    ups = out.rounds[0]
    replies = [ClientReply(u.client_id + 1, u.client_id, {}, u.num_samples, {}) for u in ups]
    return RecordedRound(1, out.round_states[0], replies, ups), batches


def test_builtin_round_audit_measures_what_gradleak_audit_measures(tmp_path):
    from gradleak.run.round_audit import RoundAudit

    path = _config(tmp_path, "builtin")
    cli = _cli(path, tmp_path)
    rec, batches = _builtin_round(path)
    rnd = RoundAudit(path, tmp_path / "round", attacks=ATTACKS, truth=lambda _r: batches, log=_quiet)(rec)
    _same(cli, rnd, "builtin")
    lora = next(e for e in rnd["attacks"] if e["name"] == "lora_span")
    assert len(lora["variants"]) > 1 and len(lora["per_variant"]) == len(lora["variants"])  # at full strength
    for e in _measured(rnd).values():  # every client of the round graded (the leakage kind's too)
        assert len(e["rows"]) == CONFIG["fl"]["clients"]


def test_text_round_audit_measures_what_gradleak_audit_measures(tmp_path):
    """The shipped text audit (MiniLM + adapters, two clients of two real quotes): UTR on each client's upload and
    ProjRes under the public-data upgrade it needs (the round audit builds the same member / non-member candidates
    as the pipeline), on the builtin engine's recorded round."""
    from gradleak.run.round_audit import RoundAudit

    raw = yaml.safe_load((ROOT / "configs" / "audit" / "text_adapters.yaml").read_text())
    raw["attack"] = {"name": "utr"}  # the setting the federation models
    raw["fl"]["clients"] = 2
    path = tmp_path / "text.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    attacks = ["projres", "utr"]
    cli = _cli(str(path), tmp_path, attacks)
    rec, batches = _builtin_round(str(path))
    rnd = RoundAudit(str(path), tmp_path / "round", attacks=attacks, truth=lambda _r: batches, log=_quiet)(rec)
    _same(cli, rnd, "builtin (text)", attacks, upgraded=("projres",))


def test_flower_audit_measures_what_gradleak_audit_measures(tmp_path):
    pytest.importorskip("flwr")
    import json

    import importlib
    import sys

    path = _config(tmp_path, "flower")
    cli = _cli(path, tmp_path)
    sys.path.insert(0, str(ROOT / "examples" / "flower"))
    try:
        app = importlib.import_module("app")  # the example Flower app: FlowerAudit on its GradleakStrategy
    finally:
        sys.path.pop(0)
    app.run(path, str(tmp_path / "flower"), rounds=1, attacks=ATTACKS)
    rnd = json.loads((tmp_path / "flower" / "round_1" / "audit.json").read_text())
    _same(cli, rnd, "flower")


def test_nvflare_filter_measures_what_gradleak_audit_measures(tmp_path):
    pytest.importorskip("nvflare")
    import json

    from gradleak.fl.engines import nvflare_bridge as nvb
    from gradleak.integrations import nvflare as gln

    path = _config(tmp_path, "nvflare")
    cli = _cli(path, tmp_path)
    server, _ = gln.server_rounds_of_config(path)
    audit = gln.NVFlareAudit(path, str(tmp_path / "nvflare"), attacks=ATTACKS, quiet=True)
    nvb.run_inprocess(server, gln.executor_for(path), 2, 1, task_data_filters=[audit], task_result_filters=[audit])
    rnd = json.loads((tmp_path / "nvflare" / "round_1" / "audit.json").read_text())
    assert rnd["clients"] == [0, 1]
    _same(cli, rnd, "nvflare")
