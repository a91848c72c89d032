"""The live framework audits (Flower's ``FlowerAudit``, NVFlare's ``NVFlareAudit`` filter) write the report
``gradleak audit`` writes and speak its words (docs/DESIGN.md §7): ``OUT/round_<r>/report.html`` by the audit's own
renderer, ``gradleak report`` on a round's ``audit.json``, the console answer first in the CLI's level words (never
``SUCCESS``), and one line per Flower log event in the example."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gradleak.cli import app as cli_app

ROOT = Path(__file__).resolve().parents[1]
FLOWER_TEXT = ROOT / "examples" / "flower" / "text_adapters.yaml"
NVFLARE_TEXT = ROOT / "examples" / "nvflare" / "text_adapters.yaml"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
runner = CliRunner()


def _attack_rows(page: str) -> dict[str, list[str]]:
    """The report's attacks table (``id="attacks"``): each row's cells as text, by attack name."""
    table = page.split('<table id="attacks">', 1)[1].split("</table>", 1)[0]
    rows = {}
    for tr in re.findall(r"<tr>(.*?)</tr>", table, flags=re.S):
        cells = [html.unescape(c) for c in re.findall(r"<td>(.*?)</td>", tr, flags=re.S)]
        if cells:
            rows[cells[0]] = cells
    return rows


def _check_round_report(rdir: Path) -> dict:
    """The round's report.html opens with the audit.json's answer (the banner) and gives every attack that ran its
    level in the attacks table, as ``gradleak audit``'s page does; returns the audit.json."""
    res = json.loads((rdir / "audit.json").read_text())
    page = (rdir / "report.html").read_text()
    banner = re.search(r'<div class="banner" id="verdict">(.*?)</div>', page, flags=re.S)
    assert banner is not None and html.unescape(banner.group(1)) == res["headline"]
    assert page.index('id="verdict"') < page.index('id="attacks"')
    rows = _attack_rows(page)
    ran = [a for a in res["attacks"] if "level" in a]
    assert ran
    for a in ran:
        assert rows[a["name"]][3] == a["level"], (a["name"], rows[a["name"]])
    assert "SUCCESS" not in page
    return res


def _browser_check(report: Path) -> None:
    """The page in headless Chromium (scripts/check_report_in_browser.py): every image decoded, the banner, the
    attacks table and "What to do next" shown."""
    if not any(shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome")):
        pytest.skip("no Chromium here (apt-get install chromium): the report was checked as text only")
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from check_report_in_browser import check
    finally:
        sys.path.pop(0)
    assert check(report, images_required=False) == []


@pytest.mark.timeout(600)  # a budget for a hung federation, not a speed claim
def test_the_flower_example_writes_the_audit_report_and_speaks_the_cli_words(tmp_path):
    """The Flower example as a user runs it (its own process, so its logging is the process's own): the round's
    report.html is ``gradleak audit``'s page (the answer banner, each attack's level), ``gradleak report`` rebuilds it
    from the round's audit.json (the file or its folder), the console gives the answer before the table and never
    says SUCCESS, and each Flower log line is printed once."""
    out = tmp_path / "flower"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "160",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "flower" / "app.py"), str(FLOWER_TEXT),
                           "--out", str(out), "--rounds", "1", "--attacks", "utr"],
                          capture_output=True, text=True, env=env, timeout=580, cwd=ROOT)
    console = ANSI.sub("", proc.stdout + proc.stderr)
    assert proc.returncode == 0, console[-4000:]
    res = _check_round_report(out / "round_1")
    assert res["verdict"] == "leaks" and "6 of 6" in res["headline"]
    utr = next(a for a in res["attacks"] if a["name"] == "utr")
    assert utr["level"] == "exact"
    # the CLI's words: the level in upper case on the attack's line, never SUCCESS / no success
    assert "SUCCESS" not in console and "no success" not in console
    assert "[flower audit] round 1 utr: EXACT (rouge1_f1 = 100" in console
    # answer first: the verdict's sentence (with its null) before the table, the table's level column, the report
    answer = console.index(f"[flower audit] round 1: {res['headline'][:60]}")
    assert "against a null 99th percentile of" in res["headline"]
    table = console.index("┃ attack")
    assert answer < table < console.index(f"report: {out / 'round_1' / 'report.html'}")
    assert re.search(r"│ utr\s+│ yes\s+│ exact\s+│", console)
    # one line per Flower log event (Flower's own handler; nothing of gradleak's configures the root logger)
    for event in ("[ROUND 1/1]", "Strategy execution finished", "aggregate_train: Received 3 results"):
        assert sum(event in line for line in console.splitlines()) == 1, event
    # gradleak report on the round's audit.json (the file, then its folder) rebuilds the same page
    report = out / "round_1" / "report.html"
    first = report.read_text()
    report.unlink()
    r = runner.invoke(cli_app, ["report", str(out / "round_1" / "audit.json")])
    assert r.exit_code == 0, r.output
    assert report.read_text() == first
    report.unlink()
    r = runner.invoke(cli_app, ["report", str(out / "round_1")])
    assert r.exit_code == 0 and report.read_text() == first
    _browser_check(report)


def test_flower_without_ground_truth_says_undefined_in_the_cli_words(tmp_path, monkeypatch):
    """A real deployment's audit (no ground truth on the server), on the example federation in process: every attack
    that ran is ``undefined`` in audit.json, on the console and in the report (never ``no success``), and the verdict
    is the CLI's ``undefined`` -- not evidence of safety."""
    import importlib

    from gradleak.integrations.flower import FlowerAudit

    sys.path.insert(0, str(ROOT / "examples" / "flower"))
    try:
        example = importlib.import_module("app")
    finally:
        sys.path.pop(0)
    lines: list[str] = []

    def deployed(config, out, truth=None, **kw):  # the example's audit as a deployment builds it: no truth
        return FlowerAudit(config, out, log=lines.append, **kw)

    monkeypatch.setattr(example, "FlowerAudit", deployed)
    out = tmp_path / "deployed"
    example.run(str(FLOWER_TEXT), str(out), rounds=1, attacks=["utr"])
    res = _check_round_report(out / "round_1")
    utr = next(a for a in res["attacks"] if a["name"] == "utr")
    assert utr["level"] == "undefined" and utr["success"] is None and "no ground truth" in utr["rule"]
    assert [c["level"] for c in utr["per_client"]] == ["undefined"] * 3
    assert res["verdict"] == "undefined" and res["headline"].startswith("UNDEFINED:")
    assert "not evidence of safety" in res["headline"]
    console = "\n".join(lines)
    assert "[flower audit] round 1 utr: UNDEFINED (no ground truth on the server" in console
    assert "SUCCESS" not in console and "no success" not in console
    assert console.index("[flower audit] round 1: UNDEFINED") < console.index("┃ attack")
    saved = list((out / "round_1" / "utr").glob("client_*/reconstruction.json"))
    assert len(saved) == 3  # the reconstructions, for a person to inspect


@pytest.mark.timeout(600)
def test_an_image_round_report_shows_each_client_original_beside_its_reconstruction(tmp_path):
    """The ViT + LoRA Flower example (3 clients, one private image each), in process: the round's report has one row
    per attacked client, labelled with that client's level, holding that client's own original and reconstruction
    (the PNGs under round_1/lora_span/client_<c>/), and every image decodes in a browser."""
    import importlib

    sys.path.insert(0, str(ROOT / "examples" / "flower"))
    try:
        example = importlib.import_module("app")
    finally:
        sys.path.pop(0)
    out = tmp_path / "vit"
    example.run(str(ROOT / "examples" / "flower" / "vit_lora.yaml"), str(out), rounds=1, attacks=["lora_span"])
    res = _check_round_report(out / "round_1")
    entry = next(a for a in res["attacks"] if a["name"] == "lora_span")
    page = (out / "round_1" / "report.html").read_text()
    for c in entry["per_client"]:
        row = re.search(rf'<div class="client-row" data-client="{c["client"]}" data-level="{c["level"]}">(.*?)'
                        r'</div></div>', page, flags=re.S)
        assert row is not None, c
        srcs = dict((role, src) for src, role in re.findall(r'<img src="([^"]+)"[^>]*data-role="(\w+)"', row.group(1)))
        # the entry's clients are its most leaking full-strength variant's: lora_span/[variant<k>/]client_<c>/
        folders = ["lora_span"] + [f"lora_span/variant{k}" for k in range(1, len(entry.get("variants") or [{}]))]
        assert entry["out"] in folders
        assert srcs == {"original": f"{entry['out']}/client_{c['client']}/ground_truth.png",
                        "reconstruction": f"{entry['out']}/client_{c['client']}/reconstruction.png"}
        assert all((out / "round_1" / src).is_file() for src in srcs.values())
    assert "full report of this attack" not in page  # a round audit's attack has no page of its own
    _browser_check(out / "round_1" / "report.html")


@pytest.mark.timeout(600)
def test_the_nvflare_example_writes_the_audit_report_and_speaks_the_cli_words(tmp_path, capsys):
    """The NVFlare example job's components in process (controller, executor, the audit filter on both chains): after
    each client's result the round's report.html is ``gradleak audit``'s page of the round so far; the console gives
    each client's level, then the answer before the table, never SUCCESS; ``gradleak report`` rebuilds the page."""
    import importlib

    sys.path.insert(0, str(ROOT / "examples" / "nvflare"))
    try:
        job = importlib.import_module("job")
    finally:
        sys.path.pop(0)
    out = tmp_path / "nvflare"
    r = job.run(str(NVFLARE_TEXT), str(out), rounds=1, attacks=["utr"], runtime="inprocess")
    assert r["rounds"][0]["verdict"] == "leaks" and r["rounds"][0]["clients"] == [0, 1, 2]
    res = _check_round_report(out / "round_1")
    utr = next(a for a in res["attacks"] if a["name"] == "utr")
    assert utr["level"] == "exact" and utr["n_success"] == utr["n_total"] == 6
    console = capsys.readouterr().out
    assert "SUCCESS" not in console and "no success" not in console
    for c in (0, 1, 2):
        assert f"[nvflare audit] round 1 client {c} (" in console and "): level exact" in console
    last = console.rindex("[nvflare audit] round 1: LEAKS: EXACT leakage by utr")
    assert last < console.rindex("┃ attack") < console.rindex(f"report: {out / 'round_1' / 'report.html'}")
    report = out / "round_1" / "report.html"
    first = report.read_text()
    report.unlink()
    rr = runner.invoke(cli_app, ["report", str(out / "round_1" / "audit.json")])
    assert rr.exit_code == 0, rr.output
    assert report.read_text() == first


def test_gradleak_report_names_what_it_cannot_read(tmp_path):
    """``gradleak report`` on a file that is neither results.json nor audit.json, and on a round audit.json written
    before round audits carried the report's fields: exit 2, the argument named, what to do."""
    other = tmp_path / "notes.txt"
    other.write_text("x")
    r = runner.invoke(cli_app, ["report", str(other)])
    assert r.exit_code == 2 and "DIR" in r.output and "results.json" in r.output
    old = tmp_path / "round_1"
    old.mkdir()
    (old / "audit.json").write_text(json.dumps({"server_round": 1, "verdict": "leaks", "headline": "LEAKS: ...",
                                                "attacks": []}))
    r = runner.invoke(cli_app, ["report", str(old / "audit.json")])
    assert r.exit_code == 2 and "framework round audit" in r.output and "FlowerAudit" in r.output
    assert not (old / "report.html").exists()


def test_rouge_scoring_leaves_the_root_logger_alone():
    """Scoring ROUGE must not configure the process's root logger (rouge-score logs through absl, whose first call
    adds a root handler): a Flower server that scores text would then print each of Flower's log lines twice."""
    code = ("import logging; from gradleak.metrics.text import rouge_scores; "
            "rouge_scores(['the cat sat'], ['the cat sat']); "
            "print(len(logging.getLogger().handlers))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH", ""))
                                                       if p)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "0"
