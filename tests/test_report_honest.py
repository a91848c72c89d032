"""The audit's report never misleads (docs/ARCHITECTURE.md, "gradleak audit"): the banner names the metric that
decided the level with its own null; the setup lists every declared defense; secure aggregation's evidence is the sum
of the clients; a warning stays with its client and setting; an ``--only`` audit says what it left out; the files
holding private data are owner-only from creation; the threat gate names every missing grant at once.

Most tests fake the runs (validation of the shipped text audit config only: seconds); one runs a tiny real audit."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import pytest
import yaml

from gradleak.errors import BadInput

ROOT = Path(__file__).resolve().parents[1]
TEXT_AUDIT = ROOT / "configs" / "audit" / "text_adapters.yaml"
LSQ = "lora_span: under-determined setting; the image is a least-squares guess, not an exact recovery"


def _raw(**over) -> dict:
    raw = yaml.safe_load(TEXT_AUDIT.read_text())
    for k, v in over.items():
        raw[k] = {**(raw.get(k) or {}), **v} if isinstance(v, dict) and isinstance(raw.get(k), dict) else v
    return raw


def _text_metrics(*, exact=0, r1=0.0, r1_p99=21.28, r1_p=1.0, bag=80.0, bag_p99=30.0, bag_p=0.001) -> dict:
    return {"rouge1_f1": r1, "rouge1_f1_null_p99": r1_p99, "rouge1_f1_null_median": 10.0, "rouge1_f1_p_value": r1_p,
            "rouge2_f1": 0.0, "rouge2_f1_null_p99": 5.0, "rouge2_f1_p_value": 1.0,
            "word_bag_recall": bag, "word_bag_recall_null_p99": bag_p99, "word_bag_recall_p_value": bag_p,
            "sentences_exact": exact, "sentences_total": 2}


def _fake(monkeypatch, by_attack: dict):
    """Fake every run: ``by_attack[name](cand)`` gives the run's result (absent: nothing above the null)."""
    def fake_run(cand, out, device=None):
        f = by_attack.get(cand["attack"]["name"])
        if f is not None:
            return f(cand)
        return {"metrics": _text_metrics(bag=10.0, bag_p=0.5), "artifacts": [], "details": {}}

    monkeypatch.setattr("gradleak.run.runner.run_config", fake_run)


def _page_text(path: Path) -> str:
    import html

    return html.unescape(re.sub(r"<[^>]+>", " ", path.read_text()))


# --------------------------------------------------------------------- 1. the metric that decided the level

def test_word_bag_partial_names_word_bag_recall_and_its_null_not_the_headline(tmp_path, monkeypatch):
    from gradleak.run.audit import run_audit
    from gradleak.run.audit_report import console_rows

    _fake(monkeypatch, {"utr": lambda cand: {"metrics": _text_metrics(), "artifacts": [], "details": {}}})
    res = run_audit(_raw(), tmp_path, only=["utr"], log=lambda m: None)
    (a,) = res["attacks"]
    assert a["level"] == "partial" and a["rule"].startswith("word-bag recall")
    assert a["decided_by"] == {"metric": "word_bag_recall", "value": 80.0, "null_p99": 30.0, "p_value": 0.001,
                               "bar": 30.0}
    banner = res["headline"]
    assert "word_bag_recall = 80 against a null 99th percentile of 30 (p = 0.001)" in banner, banner
    assert "rouge1_f1 = 0 against" not in banner and "21.28" not in banner
    (row,) = [r for r in console_rows(res) if r[0] == "utr"]
    assert row[3] == "word_bag_recall = 80 (30)"
    page = _page_text(tmp_path / "report.html")
    assert "word_bag_recall = 80; headline rouge1_f1 = 0" in page  # the attack row: deciding measure first
    assert "Decided by: word_bag_recall = 80 against a null 99th percentile of 30 (p = 0.001)" in page


def test_decided_by_follows_each_route_of_the_text_rule():
    from types import SimpleNamespace

    from gradleak.run.audit import judge

    cfg = SimpleNamespace(metrics=SimpleNamespace(psnr_threshold_db=30.0))
    r1_route = judge("token_sequences", _text_metrics(bag=10.0, bag_p=0.5, r1=40.0, r1_p=0.001), cfg)
    assert r1_route.level == "partial" and r1_route.decided_by["metric"] == "rouge1_f1"
    assert r1_route.decided_by["null_p99"] == 21.28
    none = judge("token_sequences", _text_metrics(bag=10.0, bag_p=0.5), cfg)
    assert none.level == "none" and none.decided_by["metric"] == "word_bag_recall"
    exact = judge("token_sequences", _text_metrics(exact=2, r1=100.0, r1_p=0.001), cfg)
    assert exact.level == "exact" and exact.decided_by["metric"] == "sentences_exact"
    img = judge("images", {"psnr_max": 20.0, "psnr_max_null_p99": 12.0, "ssim_max": 0.6, "ssim_max_null_p99": 0.3,
                           "ssim_max_p_value": 0.002}, cfg)
    assert img.level == "strong" and img.decided_by["metric"] == "ssim_max"
    assert img.decided_by["null_p99"] == 0.3


# --------------------------------------------------------------------- 2-3. every declared defense; the sum of N clients

def test_setup_lists_every_declared_defense_and_secure_aggregation_credits_the_sum(tmp_path, monkeypatch):
    from gradleak.run.audit import run_audit

    _fake(monkeypatch, {"utr": lambda cand: {"metrics": _text_metrics(exact=1, r1=100.0, r1_p=0.001),
                                             "artifacts": [], "details": {}}})
    raw = _raw(fl={"clients": 3, "secure_aggregation": True},
               defense={"name": "dpsgd", "noise_multiplier": 1.0, "max_grad_norm": 1.0},
               defenses=[{"name": "clipping", "params": {"max_norm": 1.0}}])
    res = run_audit(raw, tmp_path, only=["utr"], log=lambda m: None)
    setup = "\n".join(res["setup"])
    assert "training defense dpsgd" in setup and '"noise_multiplier": 1.0' in setup
    assert "defense clipping" in setup and "no update defense" not in setup
    assert "declared defenses: clipping (update), dpsgd (training), secure aggregation over 3 client(s)" in setup
    (a,) = res["attacks"]
    assert a["worst_client"] == "the sum of 3 clients"
    assert [c["client"] for c in a["per_client"]] == ["the sum of 3 clients"]
    assert "by utr, the sum of 3 clients under" in res["headline"] and "client 0" not in res["headline"]
    saved = json.loads((tmp_path / "audit.json").read_text())
    assert saved["attacks"][0]["worst_client"] == "the sum of 3 clients"
    page = _page_text(tmp_path / "report.html")
    assert "training defense dpsgd" in page and "the evidence is the sum of 3 clients" in page
    assert "client 0" not in page


def test_no_declared_defense_says_so():
    from gradleak.run.audit import candidate, describe_setup
    from gradleak.run.runner import validate

    _, cfg = validate(candidate(_raw(), "utr"))
    assert describe_setup(cfg)[-1] == "declared defenses: none"


# --------------------------------------------------------------------- 4. warnings stay with their client and setting

def test_warnings_of_other_clients_and_settings_stay_off_the_evidence(tmp_path, monkeypatch):
    from gradleak.run import audit as mod

    other = "client 1: unverified text is a best guess"

    def utr(cand):
        variant = cand["attack"].get("noise") == "estimate"
        c0 = _text_metrics(bag=85.0) if variant else _text_metrics(exact=2, r1=100.0, r1_p=0.001)
        c1 = _text_metrics(bag=10.0, bag_p=0.5)
        per = [{"trial": 0, "client": 0, "metrics": c0, "warnings": [LSQ] if variant else []},
               {"trial": 0, "client": 1, "metrics": c1, "warnings": [] if variant else [other]}]
        return {"metrics": c0, "artifacts": [], "details": {"per_client": per,
                                                            "warnings": [LSQ] if variant else [other]}}

    _fake(monkeypatch, {"utr": utr})
    monkeypatch.setattr(mod, "full_strength_variants", lambda *a, **k: [{}, {"noise": "estimate"}])
    res = mod.run_audit(_raw(fl={"clients": 2}), tmp_path, only=["utr"], log=lambda m: None)
    (a,) = res["attacks"]
    assert a["level"] == "exact" and a["worst_client"] == 0 and a.get("worst_variant") == "as configured"
    assert not a.get("warnings") and LSQ not in (a.get("reason") or "") and other not in (a.get("reason") or "")
    assert {(w["variant"] if isinstance(w["variant"], str) else "estimate", w["client"], w["warning"])
            for w in a["run_warnings"]} == {("as configured", 1, other), ("estimate", 0, LSQ)}
    assert [c["warnings"] for c in a["per_client"]] == [[], [other]]  # the evidence run: each client its own
    page = (tmp_path / "report.html").read_text()
    assert 'class="warning"' not in page  # no warning paragraph on the exact evidence
    assert "least-squares" not in page


def test_the_pipeline_records_each_clients_warning():
    from types import SimpleNamespace

    from gradleak.run.pipeline import _results

    evals = [SimpleNamespace(trial=0, client=c, metrics={"x": 1.0}, figures=[], artifacts=[], notes=[], tables=[],
                             rows=[]) for c in (0, 1)]
    cfg = SimpleNamespace(attack=SimpleNamespace(name="a"), attack_cfg=SimpleNamespace(model_dump=lambda mode: {}),
                          attack_cls=SimpleNamespace(requires=lambda c: {}),
                          threat_model=SimpleNamespace(describe=lambda: [], as_dict=lambda: {}),
                          metrics=SimpleNamespace(feature_distance=False))
    handle = SimpleNamespace(name="m", kind="bidirectional", hidden_size=8, modality="image")
    out = _results(cfg, handle, evals, [{}, {"warning": LSQ}], {}, {})
    assert [p["warnings"] for p in out["details"]["per_client"]] == [[], [LSQ]]


# --------------------------------------------------------------------- 5. --only says what it left out

def test_only_audit_names_the_applicable_attacks_it_left_out(tmp_path, monkeypatch):
    from gradleak.run.audit import left_out_split, run_audit
    from gradleak.run.audit_report import console_rows

    _fake(monkeypatch, {})
    res = run_audit(_raw(), tmp_path, only=["utr"], log=lambda m: None)
    assert res["verdict"] == "no_leak_found"
    split = left_out_split(res["config"], ["utr"])
    applicable = [x["name"] for x in split["applicable"]]
    refused = {x["name"]: x for x in split["not_applicable"]}
    assert applicable and res["left_out"] == json.loads(json.dumps(split))
    assert sorted(applicable + list(refused)) == sorted(res["left_out_by_only"])
    assert "lamp" in refused and "threat.knows_lengths" in refused["lamp"]["reason"]  # a deployment fact
    assert "peftleak" in refused and refused["peftleak"]["modality"] == "image"     # never applies to text
    assert not set(applicable) & {"lamp", "peftleak", "ig", "dlg"}
    assert [t.split(":")[0] for t in res["not_tested"]] == applicable
    assert all("left out by --only" in t for t in res["not_tested"])
    assert any(t.startswith("lamp: ") for t in res["not_applicable"])
    banner = res["headline"]
    assert f"; {len(applicable)} applicable attack(s) not run (--only): {', '.join(applicable)}" in banner, banner
    rows = {r[0]: r for r in console_rows(res)}
    assert f"{len(applicable)} applicable, not run" in rows
    img = [k for k in rows if k.endswith("image attacks")]
    assert img and "peftleak" in rows[img[0]][-1] and "not applicable" in rows[img[0]][-1]
    na = [k for k in rows if k.endswith(" not applicable")]
    assert na and "lamp: " in rows[na[0]][-1] and "Fix:" not in rows[na[0]][-1]
    page = _page_text(tmp_path / "report.html")
    assert "applicable to this setup, not run (left out by --only): " + ", ".join(applicable) in page
    assert "not applicable to this setup (and left out by --only): " in page and "not tested: nothing" not in page


def test_an_audit_without_only_has_nothing_left_out(tmp_path, monkeypatch):
    from gradleak.run.audit import run_audit

    _fake(monkeypatch, {})
    res = run_audit(_raw(), tmp_path, log=lambda m: None)
    assert res["not_tested"] == [] and res["left_out_by_only"] == [] and "--only" not in res["headline"]
    assert any(t.startswith("lamp: threat.knows_lengths") for t in res["not_applicable"])
    page = _page_text(tmp_path / "report.html")  # what to do next: both grants LAMP needs, at once
    assert "--set threat.knows_lengths=true --set threat.knows_labels=true" in page


# --------------------------------------------------------------------- 6. private data: owner-only from creation

def test_every_registered_private_file_is_created_owner_only(tmp_path, monkeypatch):
    from gradleak.report import images
    from gradleak.report.html import write_atomic
    from gradleak.run.results import append_jsonl, write_json_atomic

    for name in ("report_data.json", "results.json", "audit.json", "report.html", "reconstruction.json",
                 "ground_truth.png", "reconstruction_trial1.png"):
        assert images.artifact_mode(name) == 0o600, name
    assert images.artifact_mode("tsne.png") == 0o644
    seen = []
    real = os.replace

    def spy(src, dst):
        seen.append((Path(dst).name, stat.S_IMODE(os.stat(src).st_mode)))
        real(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    chmods = []
    real_chmod = os.chmod
    monkeypatch.setattr(os, "chmod", lambda p, m, **k: (chmods.append((Path(p).name, m)), real_chmod(p, m, **k)))
    write_atomic(tmp_path / "report_data.json", '{"texts": ["a private sentence"]}')
    write_json_atomic(tmp_path / "results.json", {"x": 1})
    append_jsonl(tmp_path / "runs.jsonl", {"x": 1})
    write_atomic(tmp_path / "summary.html", "public")
    assert dict(seen) == {"report_data.json": 0o600, "results.json": 0o600, "runs.jsonl": 0o600,
                          "summary.html": 0o644}
    assert not [c for c in chmods if not c[0].startswith(".summary.html")]  # the private ones: never chmod-ed


def _members(raw: dict) -> list[str]:
    """The clients' private sentences of the audited run, read from its data split as the pipeline does."""
    from gradleak.data.splits import TextData
    from gradleak.run.audit import candidate
    from gradleak.run.runner import validate

    _, cfg = validate(candidate(raw, "utr"))
    return [t for trial in range(cfg.trials) for texts, _ in TextData(cfg).clients(trial, cfg.model.num_classes)
            for t in texts]


def _letters(s: str) -> str:
    """Only the letters and digits, lower-cased: a sentence matches however a file spaced, escaped or re-tokenised it
    (the reports hold the tokenizer's decoding: "comics - - even", "audience ' s")."""
    return re.sub(r"[^0-9a-z]", "", s.lower())


def _texts(data: bytes) -> list[str]:
    """A file's text as a reader sees it: HTML entities decoded, and every string of a JSON (or JSON-lines) file."""
    import html

    text = data.decode("utf-8", "replace")
    out = [html.unescape(text)]

    def strings(o):
        if isinstance(o, str):
            yield o
        elif isinstance(o, dict):
            for k, v in o.items():
                yield from strings(k)
                yield from strings(v)
        elif isinstance(o, list):
            for v in o:
                yield from strings(v)

    for chunk in [text] + text.splitlines():
        try:
            out += list(strings(json.loads(chunk)))
        except ValueError:
            continue
    return out


@pytest.mark.timeout(300)
def test_a_real_audit_leaves_no_private_sentence_in_a_file_others_can_read(tmp_path, one_thread):
    """A tiny real text audit (UTR on a 2-layer MiniLM with adapters, the fastest text audit: seconds): every file of
    the output folder that group or others can read is free of the members' sentences; the files that hold them are
    0600."""
    from gradleak.run.audit import run_audit

    raw = {"experiment": "text", "seed": 0, "model": {"name": "minilm", "layers": 2},
           "peft": {"kind": "adapters", "reduction_factor": 2}, "data": {"name": "rt-sentences", "batch_size": 2},
           "fl": {"algorithm": "fedsgd", "rounds": 1}, "threat": {"preset": "honest-but-curious"}}
    out = tmp_path / "audit"
    res = run_audit(raw, out, only=["utr"], log=lambda m: None)
    assert res["attacks"][0]["level"] == "exact"  # UTR recovers them: the files below do hold the sentences
    members = _members(raw)
    assert len(members) == 2
    holding, readable = [], []
    for p in sorted(out.rglob("*")):
        if not p.is_file():
            continue
        text = "\n".join(_letters(t) for t in _texts(p.read_bytes()))
        has = any(_letters(m) in text for m in members)
        if has:
            holding.append(p.relative_to(out).as_posix())
        if stat.S_IMODE(p.stat().st_mode) & 0o077:
            readable.append(p.relative_to(out).as_posix())
            assert not has, f"{p.relative_to(out)} is readable by others and holds a private sentence"
    assert {"audit.json", "attacks/utr/report_data.json", "attacks/utr/results.json"} <= set(holding), holding
    for rel in holding:
        assert stat.S_IMODE((out / rel).stat().st_mode) == 0o600, rel


# --------------------------------------------------------------------- 7. the gate names every missing grant

def _apply_hint(err: BadInput) -> list[str]:
    return [f"{k}={v}" for k, v in re.findall(r"--set (threat\.\w+)=(\w+)", err.fix)] + \
        [f"threat.preset={v}" for v in re.findall(r"set threat\.preset=([\w-]+)", err.fix)][:1]


def test_following_lamps_hint_once_makes_the_config_validate():
    from gradleak.run.runner import validate

    raw = {**{k: v for k, v in _raw().items() if k != "audit"}, "attack": {"name": "lamp"}}
    with pytest.raises(BadInput) as e:
        validate(raw)
    err = e.value
    assert err.field == "threat.knows_lengths"
    assert "threat.knows_lengths" in str(err) and "threat.knows_labels" in str(err)
    sets = _apply_hint(err)
    assert sorted(sets) == ["threat.knows_labels=true", "threat.knows_lengths=true"]
    validate(raw, sets)  # one pass of the hint: accepted


def test_the_gate_names_a_server_capability_and_a_fact_together():
    from dataclasses import replace

    from gradleak.fl.threat import ThreatModel, check_requirements

    tm = replace(ThreatModel(), knows_labels=False)
    with pytest.raises(BadInput) as e:
        check_requirements("atk", {"malicious": True, "prescribes_architecture": True, "knows_labels": True}, tm)
    fix = e.value.fix
    assert "threat.preset=malicious" in fix and "--set threat.knows_labels=true" in fix
    assert "prescribes-architecture" not in fix  # the malicious preset grants it
    assert e.value.field == "threat.malicious"
    with pytest.raises(BadInput) as one:  # one missing flag: the message as before
        check_requirements("atk", {"knows_labels": True}, tm)
    assert one.value.fix == "grant it with --set threat.knows_labels=true if your deployment leaks it, or pick another attack."
