"""A user's own federation, first time. ``gradleak audit`` on a 50-sentence CSV with the shipped
``configs/audit/text_lora.yaml`` copied, and the realistic mistakes: each gives its own message on the console and
exit 2, nothing is left in ``--out``, and ``--only`` never turns a config error into exit 0 (before, every one of
them ended on APRIL's "attacks image data, but this experiment's data are text"). Unknown keys name the key meant
(HF peft's ``target_modules`` / ``r``, a misspelt ``lora_rnak``). The CI gate: an attack that cannot apply to the
architecture (DAGER on a frozen backbone with adapters) is not applicable before it runs, so a defended adapters
config whose measured attacks are all ``none`` passes ``--fail-on partial``; a crashed attack still fails it."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from gradleak.cli import app

ROOT = Path(__file__).resolve().parents[1]
TEXT_LORA = ROOT / "configs" / "audit" / "text_lora.yaml"
TEXT_ADAPTERS = ROOT / "configs" / "audit" / "text_adapters.yaml"
runner = CliRunner()
APRIL = "attacks image data"  # the message every one of these mistakes ended on before


@pytest.fixture(scope="module")
def own_csv(tmp_path_factory) -> Path:
    """50 real sentences (25 negative, 25 positive) of the offline Rotten Tomatoes asset as a user's CSV."""
    from gradleak.data.text import rt_sentences

    ds = rt_sentences()
    by = {0: [], 1: []}
    for t, lab in zip(ds.texts, ds.labels):
        if len(by[int(lab)]) < 25:
            by[int(lab)].append(t)
    path = tmp_path_factory.mktemp("own") / "mine.csv"
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["sentence", "label"])
        for a, b in zip(by[0], by[1]):
            w.writerow([a, 0])
            w.writerow([b, 1])
    return path


def _copied(csv_path: Path, **data) -> dict:
    """``configs/audit/text_lora.yaml`` as a user copies it for their CSV: the data section pointed at the file
    (its ``test_size: 400`` / ``nonmembers: 48`` kept unless ``data`` overrides them), two classes."""
    raw = yaml.safe_load(TEXT_LORA.read_text())
    raw["data"] = {**raw["data"], "name": "csv", "path": str(csv_path), "text_column": "sentence",
                   "label_column": "label", **data}
    raw["model"]["num_classes"] = 2
    raw.pop("audit", None)
    return raw


def _audit(tmp_path: Path, raw: dict, *args: str):
    cfg = tmp_path / "mine.yaml"
    cfg.write_text(yaml.safe_dump(raw, sort_keys=False))
    out = tmp_path / "out"
    res = runner.invoke(app, ["audit", str(cfg), "--out", str(out), "--workers", "1", *args])
    return res, out


def _fits(raw: dict) -> dict:
    """The copied config with splits that fit 50 sentences."""
    raw["data"].update(test_size=10, nonmembers=8)
    return raw


def _mistakes(csv_path: Path) -> dict[str, tuple[dict, list[str]]]:
    """Each mistake: the config, and what its own message must say."""
    out = {"oversized split (the copied test_size 400, nonmembers 48)":
           (_copied(csv_path), ["data.test_size", "= 450 is more than the 50 texts of 'csv'",
                                "data.test_size: 0"])}
    raw = _fits(_copied(csv_path, text_column="text"))
    out["wrong CSV column"] = (raw, ["data.text_column", "column 'text' is not in the header",
                                     "['sentence', 'label']"])
    raw = _fits(_copied(csv_path))
    raw["defenses"] = [{"name": "gausian_noise", "params": {"std": 0.1}}]
    out["misspelt defense"] = (raw, ["defenses[0].name", "unknown defense 'gausian_noise'", "gaussian_noise"])
    raw = _fits(_copied(csv_path))
    raw["peft"]["lora_targets"] = ["q_proj", "v_proj"]
    out["LoRA targets of another model"] = (raw, ["peft.lora_targets", "no linear module is named 'q_proj'",
                                                  "this model names them [query, value]"])
    raw = _fits(_copied(csv_path))
    raw["peft"]["lora_rnak"] = raw["peft"].pop("lora_rank")
    out["misspelt key"] = (raw, ["peft.lora_rnak", "did you mean peft.lora_rank?"])
    raw = _fits(_copied(csv_path))
    raw["peft"]["target_modules"] = ["query", "value"]
    out["HF peft's target_modules"] = (raw, ["peft.target_modules", "peft.lora_targets"])
    raw = _fits(_copied(csv_path))
    raw["peft"]["r"] = raw["peft"].pop("lora_rank")
    out["HF peft's r"] = (raw, ["peft.r", "peft.lora_rank"])
    return out


MISTAKES = ["oversized split (the copied test_size 400, nonmembers 48)", "wrong CSV column", "misspelt defense",
            "LoRA targets of another model", "misspelt key", "HF peft's target_modules", "HF peft's r"]


@pytest.mark.parametrize("mistake", MISTAKES)
def test_each_mistake_gives_its_own_message_exit_2_and_nothing_in_out(tmp_path, own_csv, mistake):
    raw, words = _mistakes(own_csv)[mistake]
    res, out = _audit(tmp_path, raw)
    assert res.exit_code == 2, res.output
    error = res.output[res.output.index("error: "):]
    for w in words:
        assert w in " ".join(error.split()), (w, error)
    assert APRIL not in res.output
    assert not out.exists()  # no DIR/attacks/* left behind by a failed audit


def test_only_never_turns_a_config_error_into_exit_0(tmp_path, own_csv):
    """Before: ``--only dager`` on the wrong column ran DAGER, which was refused, and the audit ended
    ``UNDEFINED: no attack measured anything ()`` with exit 0 (and exit 3 under the gate). Now: exit 2, the
    column named, with and without ``--fail-on``."""
    raw, _ = _mistakes(own_csv)["wrong CSV column"]
    for extra in ([], ["--fail-on", "partial"]):
        res, out = _audit(tmp_path, raw, "--only", "dager", *extra)
        assert res.exit_code == 2, res.output
        assert "data.text_column: column 'text' is not in the header" in res.output
        assert "UNDEFINED" not in res.output and not out.exists()


def test_a_reused_out_keeps_no_leftover_and_the_refusals_say_why(tmp_path, own_csv):
    """A failed audit into a folder that exists: no ledger or run folder stays; each refused run's line gives its
    reason on the console (it said ``refused (0 s)``)."""
    raw, _ = _mistakes(own_csv)["oversized split (the copied test_size 400, nonmembers 48)"]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("the user's own file")
    res, out = _audit(tmp_path, raw)
    assert res.exit_code == 2
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]
    refused = [line for line in res.output.splitlines() if ": refused -- " in line]
    # utr, projres, projres_adaptive and learned_wordbag: each refused run says why
    assert len(refused) == 4 and all("450 is more than the 50 texts" in line for line in refused)


def test_attacks_refused_for_different_reasons_are_each_listed(tmp_path, own_csv):
    """No shared setup error: each attack meant for this setup is listed with its own reason (the attacks for
    image data are not: they never concerned a text setup)."""
    from gradleak.errors import BadInput
    from gradleak.run.audit import plan_audit

    raw = _fits(_copied(own_csv))
    with pytest.raises(BadInput) as err:
        plan_audit(raw, ["audit.params.dager.eps_bag=-1"], ["dager", "lamp", "april"])
    text = str(err.value)
    assert err.value.field == "audit" and "each was refused" in text
    lines = [line.strip() for line in text.splitlines()[1:]]
    assert len(lines) == 3 and [line.split(":")[0] for line in lines] == ["dager", "lamp", "Fix"]
    assert lines[0].startswith("dager: attack.eps_bag: Input should be greater than 0")
    assert lines[1].startswith("lamp: threat.knows_lengths:") and APRIL not in text
    with pytest.raises(BadInput, match=APRIL):  # an image attack alone on text: its own refusal is the answer
        plan_audit(raw, [], ["april"])


def test_unknown_keys_name_the_key_meant_in_the_file_and_in_set():
    from gradleak.errors import BadInput
    from gradleak.run.runner import validate

    raw = yaml.safe_load(TEXT_LORA.read_text())
    cases = {("peft", "lora_rnak"): "did you mean peft.lora_rank?",
             ("peft", "target_modules"): "gradleak's name for it is peft.lora_targets (HF peft calls it target_modules).",
             ("peft", "r"): "gradleak's name for it is peft.lora_rank (HF peft calls it r).",
             ("data", "batchsize"): "did you mean data.batch_size?", (None, "seeed"): "did you mean seed?"}
    for (section, key), fix in cases.items():
        bad = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
        (bad[section] if section else bad)[key] = 4
        with pytest.raises(BadInput) as err:
            validate({**bad, "attack": {"name": "dager"}})
        assert err.value.field == (f"{section}.{key}" if section else key) and err.value.fix == fix, str(err.value)
        with pytest.raises(BadInput) as err:
            validate({**raw, "attack": {"name": "dager"}}, [f"{section + '.' if section else ''}{key}=4"])
        assert err.value.fix == fix
    with pytest.raises(BadInput, match="did you mean 'dager'"):
        validate({**raw, "attack": {"name": "dagr"}})


def _fake_runs(monkeypatch, crash: str | None = None):
    """Every attack run faked at level ``none`` (its metrics at chance, beside their nulls); ``crash``: that
    attack's run raises. Returns the attacks that ran."""
    ran = []

    def fake_run(cand, out, device=None):
        name = cand["attack"]["name"]
        ran.append(name)
        if name == crash:
            raise RuntimeError("a bug in the attack")
        if name.startswith("projres"):
            m = {"auc": 0.52, "auc_distance": 0.02, "auc_distance_null_p99": 0.3, "auc_null_p99": 0.8,
                 "tpr_at_1pct_fpr": 0.0, "tpr_at_1pct_fpr_null_p99": 0.5, "members": 2, "nonmembers": 48}
        else:
            m = {"rouge1_f1": 5.0, "rouge1_f1_null_p99": 23.9, "rouge1_f1_null_median": 10.0,
                 "word_bag_recall": 0.0, "word_bag_recall_null_p99": 0.3}
        return {"metrics": m, "artifacts": [], "details": {}}

    monkeypatch.setattr("gradleak.run.runner.run_config", fake_run)
    return ran


DEFENDED = ["--set", "defenses=[{name: gaussian_noise, params: {std: 0.1, per_coordinate: true}}]"]
#: noise that stops UTR on this config, its sub-edge word-bag test included (at std 0.1 that test still finds the
#: batch's tokens: UTR partial, measured); at 3.0 no direction stands above the edge and no token passes the cut
STOPPED = ["--set", "defenses=[{name: gaussian_noise, params: {std: 3.0, per_coordinate: true}}]"]


def test_the_gate_passes_a_defended_adapters_config_whose_measured_attacks_are_none(tmp_path, monkeypatch):
    """DAGER cannot apply to a frozen backbone (it reads attention-query gradients; only adapters train): it is
    not applicable, decided from the model before anything runs, so the gate reads the attacks that measured --
    all ``none`` here -- and passes (before: DAGER ended ``undefined`` and the gate said it could not be
    evaluated, exit 3)."""
    ran = _fake_runs(monkeypatch)
    out = tmp_path / "out"
    res = runner.invoke(app, ["audit", str(TEXT_ADAPTERS), "--out", str(out), "--workers", "1", *DEFENDED,
                              "--fail-on", "partial"])
    assert res.exit_code == 0, res.output
    assert "dager" not in ran and sorted(set(ran)) == ["learned_wordbag", "projres", "projres_adaptive", "utr"]
    audit = json.loads((out / "audit.json").read_text())
    dager = next(a for a in audit["attacks"] if a["name"] == "dager")
    assert "level" not in dager and not dager["applicable"]
    assert "not applicable to this architecture" in dager["reason"] and "frozen" in dager["reason"]
    assert {a["level"] for a in audit["attacks"] if "level" in a} == {"none"}
    assert audit["verdict"] == "no_leak_found"
    assert "gate --fail-on partial: pass -- worst level none" in " ".join(res.output.split())


def test_the_gate_still_fails_on_a_crashed_attack(tmp_path, monkeypatch):
    _fake_runs(monkeypatch, crash="utr")
    res = runner.invoke(app, ["audit", str(TEXT_ADAPTERS), "--out", str(tmp_path / "out"), "--workers", "1",
                              *DEFENDED, "--fail-on", "partial"])
    assert res.exit_code == 3, res.output
    text = " ".join(res.output.split())
    assert "the gate could not be evaluated: 1 attack(s) undefined or failed (utr: RuntimeError: a bug in the attack)" \
        in text


def test_the_gate_passes_for_real_with_dager_not_run_on_adapters(tmp_path):
    """End to end, nothing faked: the shipped adapters audit under per-coordinate noise, UTR and DAGER asked for:
    UTR measures ``none``, DAGER is not applicable (not run), the gate passes."""
    res = runner.invoke(app, ["audit", str(TEXT_ADAPTERS), "--out", str(tmp_path / "out"), "--workers", "1",
                              "--only", "utr,dager", "--set", "data.batch_size=2", "--set", "data.test_size=50",
                              *STOPPED, "--fail-on", "partial"])
    assert res.exit_code == 0, res.output
    audit = json.loads((tmp_path / "out" / "audit.json").read_text())
    levels = {a["name"]: a.get("level") for a in audit["attacks"]}
    assert levels == {"dager": None, "utr": "none"}
    assert not (tmp_path / "out" / "attacks" / "dager").exists()


def test_the_framework_audits_decide_applicability_from_the_model_too(tmp_path):
    """One decision for every audit (docs/DESIGN.md §7): a Flower / NVFlare round audit of an adapters federation
    does not run DAGER either; asked for DAGER alone, it names why."""
    from gradleak.errors import BadInput
    from gradleak.run.round_audit import RoundAudit

    config = {**yaml.safe_load(TEXT_ADAPTERS.read_text()), "attack": {"name": "utr"}}  # the setting the app models
    audit = RoundAudit(config, tmp_path, attacks=["dager", "utr"], log=lambda m: None)
    assert [name for name, _ in audit.plans] == ["utr"]
    (dager,) = audit.not_run
    assert dager["name"] == "dager" and "not applicable to this architecture" in dager["reason"]
    with pytest.raises(BadInput, match="frozen"):
        RoundAudit(config, tmp_path, attacks=["dager"], log=lambda m: None)


def test_runs_refused_for_different_reasons_are_listed_and_out_is_cleaned(tmp_path, monkeypatch):
    """Every planned run refused once its data and model were known, for different reasons: each attack on its own
    line (a ledger row of an older audit, text only, is read back the same way), exit 2 and no leftover."""
    from gradleak.errors import BadInput
    from gradleak.run import audit as mod

    why = {"utr": ("data.max_length", "is too short for these sentences.", "raise it."),
           "projres": ("data.nonmembers", "8 non-members do not fit.", "lower it.")}

    def fake_run_one(name, cand, out, dev):
        field, problem, fix = why[cand["attack"]["name"]]
        res = {"bad_input": str(BadInput(field, problem, fix)), "seconds": 0.0}
        if name.startswith("utr"):
            res["bad_input_parts"] = [field, problem, fix]
        return res

    monkeypatch.setattr(mod, "_run_one", fake_run_one)
    raw = yaml.safe_load(TEXT_ADAPTERS.read_text())
    out = tmp_path / "out"
    with pytest.raises(BadInput) as err:
        mod.run_audit(raw, out, ["data.test_size=50"], only=["projres", "utr"], log=lambda m: None)
    assert err.value.field == "audit" and str(err.value).splitlines()[1:3] == [
        "  projres: data.nonmembers: 8 non-members do not fit. Fix: lower it.",
        "  utr: data.max_length: is too short for these sentences. Fix: raise it."]
    assert not out.exists()
    assert mod.refusal({"bad_input": "data.nonmembers: 8 non-members do not fit. Fix: lower it."}).field \
        == "data.nonmembers"
    assert mod.refusal({"metrics": {}}) is None
