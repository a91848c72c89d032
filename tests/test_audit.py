"""gradleak audit (issue 12): every registered attack appears, the gate decides applicability, the verdict rule,
audit.json / report.html, bad input."""

from __future__ import annotations

import json

import pytest

from gradleak.errors import BadInput

TINY = {"experiment": "image", "seed": 0, "data": {"name": "cifar-samples", "batch_size": 2, "image_size": 16},
        "model": {"name": "vit-tiny", "layers": 1}, "peft": {"kind": "adapters", "bottleneck": 8},
        "metrics": {"feature_distance": False}, "threat": {"preset": "honest-but-curious"},
        "audit": {"params": {"dlg": {"steps": 2}}}}


def test_audit_end_to_end_tiny_vit_leaks_only_under_a_malicious_server(tmp_path):
    """A real audit on a tiny ViT + adapters: DLG (2 steps) runs under the configured honest server and fails;
    PEFTLeak is refused there but runs under the malicious upgrade and recovers the images exactly; UTR and
    lora_span are not applicable (modality, PEFT kind) with the gate's reason."""
    from gradleak.run.audit import run_audit

    res = run_audit(TINY, tmp_path, only=["dlg", "peftleak", "utr", "lora_span"], log=lambda m: None,
                    workers=2)  # the CLI default: a process pool
    by = {a["name"]: a for a in res["attacks"]}
    assert set(by) == {"dlg", "peftleak", "utr", "lora_span"}
    assert by["dlg"]["applicable"] and by["dlg"]["success"] is False
    assert not by["peftleak"]["applicable"] and by["peftleak"]["applicable_under"] == "upgraded"
    assert by["peftleak"]["threat"] == "malicious" and by["peftleak"]["success"]
    assert by["peftleak"]["n_success"] == by["peftleak"]["n_total"] == 8  # 2 images x 4 patches, all exact
    assert "text" in by["utr"]["reason"] and "lora" in by["lora_span"]["reason"]
    assert by["peftleak"]["level"] == "exact" and by["dlg"]["level"] == "none"  # DLG at 2 steps: below its null
    assert by["dlg"]["value"] < by["dlg"]["null_p99"] and by["peftleak"]["p_value"] < 0.01
    assert res["verdict"] == "leaks_stronger_server"
    assert res["headline"].startswith("LEAKS ONLY UNDER A STRONGER SERVER: EXACT leakage by peftleak, client 0 under "
                                      "a malicious server")
    assert "8 of 8 private image patches exact" in res["headline"]
    saved = json.loads((tmp_path / "audit.json").read_text())
    assert saved["verdict"] == res["verdict"] and len(saved["attacks"]) == 4
    page = (tmp_path / "report.html").read_text()
    assert 'id="verdict"' in page and "peftleak" in page and "attacks/peftleak/" in page
    assert (tmp_path / "attacks" / "peftleak" / "results.json").exists()
    # the same page in a real browser (headless Chromium) when the machine has one
    import shutil
    import sys
    from pathlib import Path

    if not any(shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome")):
        pytest.skip("no Chromium here (apt-get install chromium): the report was checked as text only")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from check_report_in_browser import check

    assert check(tmp_path / "report.html") == []


def test_every_registered_attack_appears_and_the_verdict_follows_the_configured_threat(tmp_path, monkeypatch):
    """With the runs faked, the audit still walks the whole registry: one entry per attack, each either run or
    refused with a reason; a success under the configured threat gives `leaks`."""
    from gradleak.run import audit as mod
    from gradleak.registry import ATTACKS, load_all

    load_all()
    calls = []

    def fake_run(cand, out, device=None):
        calls.append(cand["attack"]["name"])
        ok = cand["attack"]["name"] == "ig"
        return {"metrics": {"images_above_threshold": 2.0 if ok else 0.0, "images_total": 2.0,
                            "psnr_max": 40.0 if ok else 9.0, "psnr_max_null_p99": 12.0, "ssim_max": 0.9 if ok else 0.1,
                            "ssim_max_null_p99": 0.3}, "artifacts": []}

    monkeypatch.setattr("gradleak.run.runner.run_config", fake_run)
    res = mod.run_audit(TINY, tmp_path, log=lambda m: None)
    assert [a["name"] for a in res["attacks"]] == ATTACKS.names()
    for a in res["attacks"]:
        assert ("success" in a) or a.get("reason"), a
    assert "ig" in calls and "utr" not in calls
    assert res["verdict"] == "leaks" and "EXACT leakage by ig" in res["headline"]
    assert "an honest-but-curious server" in res["headline"]


def test_audit_bad_input(tmp_path):
    from gradleak.run.audit import run_audit

    with pytest.raises(BadInput, match="--only.*choose from"):
        run_audit(TINY, tmp_path, only=["nope"], log=lambda m: None)
    bad = {**TINY, "model": {"name": "vit-tiny", "layers": 1, "colour": 3}}
    with pytest.raises(BadInput, match="colour"):
        run_audit(bad, tmp_path, only=["dlg"], log=lambda m: None)


def test_audit_over_seeds_reports_the_worst_run_with_median_and_spread(tmp_path):
    """audit.seeds: every attack runs once per seed; the entry keeps the most leaking run as its evidence and
    reports the median and range of its headline metric."""
    from gradleak.run.audit import run_audit

    raw = {**TINY, "audit": {"seeds": [0, 1, 2], "params": {"dlg": {"steps": 2}}}}
    res = run_audit(raw, tmp_path, only=["dlg"], log=lambda m: None)
    (a,) = res["attacks"]
    per = [p["value"] for p in a["per_seed"]]
    assert [p["seed"] for p in a["per_seed"]] == [0, 1, 2] and len(set(per)) > 1  # the seeds differ
    assert a["value"] == max(per) and a["spread"] == [min(per), max(per)] and a["median"] == sorted(per)[1]
    assert a["out"] == f"attacks/dlg/seed{a['worst_seed']}"
    assert (tmp_path / "attacks" / "dlg" / "seed1" / "results.json").exists()
    with pytest.raises(BadInput, match="audit.seeds"):
        run_audit({**TINY, "audit": {"seeds": ["a"]}}, tmp_path, only=["dlg"], log=lambda m: None)


def test_audit_grid_gives_a_verdict_per_cell_and_resumes(tmp_path):
    """An audit config with grid: one audit per cell (here the server's capability), each with its own verdict;
    a rerun reuses the cells that finished."""
    from gradleak.run.audit import run_audit_grid

    raw = {**TINY, "threat": {"preset": "honest-but-curious", "public_data": True},
           "grid": {"threat.preset": ["honest-but-curious", "malicious"]}}
    logs = []
    s1 = run_audit_grid(raw, tmp_path, only=["dlg", "peftleak"], log=logs.append)
    verdicts = {r["assign"]["threat.preset"]: r["verdict"] for r in s1["cells"]}
    assert verdicts["malicious"] == "leaks" and verdicts["honest-but-curious"] in ("leaks_stronger_server", "leaks")
    assert json.loads((tmp_path / "audit_grid.json").read_text())["cells"] == s1["cells"]
    logs.clear()
    s2 = run_audit_grid(raw, tmp_path, only=["dlg", "peftleak"], log=logs.append)
    assert s2["cells"] == s1["cells"] and all("done before" in m for m in logs)
