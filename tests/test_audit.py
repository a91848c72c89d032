"""gradleak audit: every registered attack appears, the gate decides applicability, the verdict rule,
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


def test_audit_grid_validates_every_cell_before_making_the_folder(tmp_path):
    """A grid whose second cell the audit refuses (a mistyped preset) stops before the output folder exists and
    before the first cell runs."""
    from gradleak.run.audit import run_audit_grid

    raw = {**TINY, "grid": {"threat.preset": ["honest-but-curious", "malicous"]}}
    out = tmp_path / "grid"
    logs = []
    with pytest.raises(BadInput, match="threat"):
        run_audit_grid(raw, out, only=["dlg"], log=logs.append)
    assert not out.exists() and logs == []


# ----------------------------------------------------------------------------------------- the report

from html.parser import HTMLParser  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class _Page(HTMLParser):
    """The parts of an audit report the tests read: sections by id, table rows, images, text by element."""

    def __init__(self, text: str):
        super().__init__()
        self.stack, self.ids, self.rows, self.imgs, self.pairs, self.warnings = [], {}, [], [], [], []
        self._row, self._cell, self._id, self._pair, self._warn = None, None, [], None, None
        self.sections: dict[str, str] = {}
        self._h2 = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "h2":
            self._h2 = ""
        if a.get("id"):
            self.ids[a["id"]] = ""
            self._id.append((tag, a["id"]))
        if tag == "tr":
            self._row = []
        if tag in ("td", "th") and self._row is not None:
            self._cell = ""
        if tag == "div" and a.get("class") == "pair":
            self._pair = []
            self.pairs.append(self._pair)
        if tag == "img":
            self.imgs.append(a)
            if self._pair is not None:
                self._pair.append(a)
        if tag == "p" and a.get("class") == "warning":
            self._warn = ""

    def handle_endtag(self, tag):
        if tag == "h2" and self._h2 is not None:
            self._last_h2, self._h2 = self._h2.strip(), None
            self.sections[self._last_h2] = ""
        if self._id and self._id[-1][0] == tag:
            self._id.pop()
        if tag in ("td", "th") and self._cell is not None:
            self._row.append(self._cell.strip())
            self._cell = None
        if tag == "tr" and self._row is not None:
            self.rows.append(self._row)
            self._row = None
        if tag == "div":
            self._pair = None
        if tag == "p" and self._warn is not None:
            self.warnings.append(self._warn)
            self._warn = None

    def handle_data(self, data):
        for _, i in self._id:
            self.ids[i] += data
        if self._cell is not None:
            self._cell += data
        if self._h2 is not None:
            self._h2 += data
        elif getattr(self, "_last_h2", None):
            self.sections[self._last_h2] += data
        if self._warn is not None:
            self._warn += data


def _fake_text_audit(tmp_path, monkeypatch, only=None, warn="lora-like warning: under-determined"):
    """The shipped text audit config with every run faked (validation only: a few seconds): utr leaks word for
    word and warns, the others measure nothing above their null."""
    import yaml

    from gradleak.run import audit as mod

    def fake_run(cand, out, device=None):
        ok = cand["attack"]["name"] == "utr"
        return {"metrics": {"rouge1_f1": 100.0 if ok else 0.0, "rouge1_f1_null_p99": 23.9,
                            "rouge1_f1_null_median": 10.0}, "artifacts": [],
                "details": {"warnings": [warn] if ok else []}}

    monkeypatch.setattr("gradleak.run.runner.run_config", fake_run)
    raw = yaml.safe_load((ROOT / "configs" / "audit" / "text_adapters.yaml").read_text())
    logs = []
    cmd = mod.audit_command("configs/audit/text_adapters.yaml", tmp_path,
                            ["defenses=[{name: clipping, params: {max_norm: 1.0}}]", "seed=0"], only=only)
    res = mod.run_audit(raw, tmp_path, only=only.split(",") if only else None, log=logs.append, command=cmd)
    return res, _Page((tmp_path / "report.html").read_text()), logs


def test_audit_report_next_steps_grouped_modality_quoted_command_and_warnings(tmp_path, monkeypatch):
    """What to do next (leaking attacks, deployment facts, the defenses this setup accepts; without --advise no
    advice in audit.json); the image attacks of a text audit on one row and one Reproducibility line; the command
    copy-pasteable; the attack's warning shown on the console and in the report."""
    import shlex

    from gradleak.registry import DEFENSES

    res, page, logs = _fake_text_audit(tmp_path, monkeypatch)
    # 1. what to do next: a section with true facts, and no advice in audit.json
    assert "next" in page.ids
    nxt = page.sections["What to do next"]
    assert "utr" in nxt and "Leaking here" in nxt
    assert "threat.knows_lengths" in nxt  # lamp was kept out by a withheld deployment fact
    assert "--advise" in nxt and "does not rank or recommend" in nxt  # advice only when asked for
    names = [d["name"] for d in res["defenses_available"]]
    assert "gaussian_noise" in names and "dpsgd" in names and "rdlv_filter" not in names  # image-only: not for text
    assert set(names) <= set(DEFENSES.names()) and all(n in nxt for n in names)
    saved = json.loads((tmp_path / "audit.json").read_text())
    assert not any(k in saved for k in ("advice", "advise", "recommendation", "ranking"))
    # 2. the image attacks: one row, one Reproducibility line, no "Fix:" per attack
    first = [r[0] for r in page.rows]
    image_attacks = [a["name"] for a in res["attacks"] if a.get("modality") == "image"]
    assert len(image_attacks) >= 5 and not set(image_attacks) & set(first)
    (grouped,) = [r for r in page.rows if r[0] == f"{len(image_attacks)} image attacks"]
    assert "not applicable" in grouped[-1] and all(n in grouped[-1] for n in image_attacks)
    assert "Fix:" not in grouped[-1]
    repro = page.sections["Reproducibility"]
    assert repro.count("Fix: attacks for text") == 0 and f"{len(image_attacks)} image attack(s)" in repro
    assert "lamp: threat.knows_lengths" in repro
    # 4. the command: shell-quoted, it splits back into the arguments
    args = shlex.split(page.ids["command"])
    assert args[args.index("--set") + 1] == "defenses=[{name: clipping, params: {max_norm: 1.0}}]"
    assert args[:3] == ["gradleak", "audit", "configs/audit/text_adapters.yaml"]
    # 8. the attack's warning: on the console and in the report's evidence
    assert any("utr: WARNING: lora-like warning: under-determined" in m for m in logs)
    assert any("under-determined" in w for w in page.warnings)


def test_only_audit_says_what_was_left_out(tmp_path, monkeypatch):
    res, page, _ = _fake_text_audit(tmp_path, monkeypatch, only="utr,dager")
    left = sorted(set(res["left_out_by_only"]))
    assert "projres" in left and "lamp" in left and "utr" not in left and res["only"] == ["utr", "dager"]
    repro = page.sections["Reproducibility"]
    assert "not tested: nothing" not in " ".join(repro.split())
    # the left-out attacks that apply here apart from those that never could (tests/test_report_honest.py)
    applicable = [x["name"] for x in res["left_out"]["applicable"]]
    assert "projres" in applicable and "lamp" not in applicable
    assert "applicable to this setup, not run (left out by --only): " + ", ".join(applicable) in repro
    assert any(r[0] == f"{len(applicable)} applicable, not run" for r in page.rows)


def test_audit_report_images_side_by_side_and_upscaled(tmp_path):
    """An image attack's original and reconstruction in one row, each drawn at an integer nearest-neighbour
    upscale (a 32-pixel image saved at 4x is shown at 12x: 408 px), and gradleak report rebuilds it from
    audit.json."""
    import torch

    from gradleak.report import save_image_grid
    from gradleak.run.audit_report import write_audit_report

    d = tmp_path / "attacks" / "ig"
    save_image_grid(torch.rand(1, 3, 32, 32), d / "reconstruction.png")
    save_image_grid(torch.rand(1, 3, 32, 32), d / "ground_truth.png")
    result = {"verdict": "no_leak_found", "headline": "NO LEAK FOUND", "modality": "image",
              "attacks": [{"name": "ig", "modality": "image", "applicable": True, "level": "none", "rule": "r",
                           "metric": "psnr_max", "value": 9.0, "out": "attacks/ig",
                           "artifacts": ["reconstruction.png", "ground_truth.png"]}],
              "levels": {"null": "n", "psnr_db": 40.0, "rules": {}}, "setup": [], "threat": [], "command": "c",
              "config_hash": "h", "seed": 0, "environment": {}, "not_tested": [], "undefined": [],
              "defenses_available": []}
    page = _Page(write_audit_report(result, tmp_path).read_text())
    (pair,) = page.pairs
    assert [i["src"] for i in pair] == ["attacks/ig/ground_truth.png", "attacks/ig/reconstruction.png"]
    assert [i["width"] for i in pair] == ["408", "408"]  # 34 px * 4 (saved) = 136 px, shown 3x
    assert "image-rendering:pixelated" in (tmp_path / "report.html").read_text()
    assert "not tested: nothing" in " ".join(page.sections["Reproducibility"].split())


def test_worker_silences_only_the_kernel_override_warning(monkeypatch):
    import warnings

    from gradleak.run.audit import _run_one

    def noisy(cand, out, device=None):
        warnings.warn("Warning only once for all operators,  other operators may also be overridden.\n"
                      "  Overriding a previously registered kernel for the same operator and the same dispatch key\n"
                      "  operator: aten::geometric_", UserWarning)
        warnings.warn("something else", UserWarning)
        return {"metrics": {}}

    monkeypatch.setattr("gradleak.run.runner.run_config", noisy)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert "metrics" in _run_one("x", {}, "/tmp/unused", None)
    assert [str(w.message) for w in seen] == ["something else"]


def test_articles_of_the_server_words():
    from gradleak.config.schema import ExperimentConfig  # noqa: F401 -- the message below is built there
    from gradleak.fl.threat import with_article
    from gradleak.run import validate

    assert with_article("honest-but-curious") == "an honest-but-curious"
    assert with_article("malicious") == "a malicious" and with_article("prescribes-architecture").startswith("a p")
    with pytest.raises(BadInput) as err:
        validate({**{k: v for k, v in TINY.items() if k != "audit"}, "attack": {"name": "dlg"},
                  "peft": {"kind": "lora", "layer_pe": True}})
    assert "an honest-but-curious server" in str(err.value) and "a honest" not in str(err.value)


def test_april_without_a_pe_term_is_judged_on_dlgs_run_which_runs_once(tmp_path):
    """APRIL on a client that trains no position table is DLG step for step: the audit runs DLG once and judges APRIL
    on that run (said in its entry and warnings); the value is the one APRIL's own run gives (APRIL audited alone). A
    different APRIL parameter, or a client that trains the PEs (peft.layer_pe), runs APRIL itself."""
    from gradleak.run.audit import RUN_LEDGER, plan_audit, run_audit

    raw = {**TINY, "audit": {"params": {"dlg": {"steps": 2}, "april": {"steps": 2}}}}
    res = run_audit(raw, tmp_path / "both", only=["april", "dlg"], log=lambda m: None)
    by = {a["name"]: a for a in res["attacks"]}
    assert by["april"]["shared_run"]["attack"] == "dlg" and "shared_run" not in by["dlg"]
    assert by["april"]["value"] == by["dlg"]["value"] and by["april"]["level"] == by["dlg"]["level"]
    assert any("judged on DLG's run" in w for w in by["april"]["warnings"]) and by["april"]["seconds"] == 0.0
    ledger = [json.loads(x)["job"] for x in (tmp_path / "both" / RUN_LEDGER).read_text().splitlines()]
    assert ledger == ["dlg@0#0"]  # one run
    alone = run_audit(raw, tmp_path / "alone", only=["april"], log=lambda m: None)["attacks"][0]
    assert "shared_run" not in alone and alone["value"] == by["april"]["value"]  # APRIL's own run: the same value
    other = {**TINY, "audit": {"params": {"dlg": {"steps": 2}, "april": {"steps": 3}}}}
    res = run_audit(other, tmp_path / "other", only=["april", "dlg"], log=lambda m: None)
    assert not any("shared_run" in a for a in res["attacks"])
    # a client that trains the position tables: APRIL's term is there, its own run
    lora = {**TINY, "peft": {"kind": "lora", "lora_rank": 4}}
    pe = {**lora, "peft": {**lora["peft"], "layer_pe": True}, "threat": {"preset": "prescribes-architecture"}}
    planned = plan_audit(pe, [], ["april"])[3]
    (_, _, cfg, A), = planned
    assert A.same_run_as(cfg) is None
    for plain in (TINY, lora):
        (_, _, cfg, A), = plan_audit(plain, [], ["april"])[3]
        assert A.same_run_as(cfg)[0] == "dlg"
