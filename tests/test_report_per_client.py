"""The audit report's image evidence, one row per attacked client (docs/DESIGN.md §4, ``DIR/report.html``): each
client's originals beside its OWN reconstructions, the worst (most leaking) client first, each row labelled with
the client, its level and the metric that decided it; under secure aggregation the row is "the sum of N clients".

One real audit (a tiny ViT + adapters, 2 clients, PEFTLeak under a malicious server: ~10 s) gives real per-client
artifacts; the other cases re-render its audit.json or a synthetic one through the same report code."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import stat
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from test_audit import TINY

ROOT = Path(__file__).resolve().parents[1]
#: the pipeline's per-client PNG names, read independently of the code under test: client 0 (trial 0) has no
#: suffix, client c > 0 ``_trial0_client{c}``
OWN_NAME = re.compile(r"^(ground_truth|reconstruction)(?:_trial0_client(\d+))?\.png$")


class _Rows(HTMLParser):
    """The evidence rows of an audit report: ``[{client, level, label, imgs: [attrs]}]`` in page order."""

    def __init__(self, text: str):
        super().__init__()
        self.rows, self._depth, self._label = [], 0, None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "div" and a.get("class") == "client-row":
            self.rows.append({"client": a.get("data-client"), "level": a.get("data-level"), "label": "", "imgs": []})
            self._depth = 1
        elif tag == "div" and self._depth:
            self._depth += 1
        if self._depth and tag == "p" and a.get("class") == "client-label":
            self._label = ""
        if self._depth and tag == "img":
            self.rows[-1]["imgs"].append(a)

    def handle_endtag(self, tag):
        if tag == "div" and self._depth:
            self._depth -= 1
        if tag == "p" and self._label is not None:
            self.rows[-1]["label"], self._label = " ".join(self._label.split()), None

    def handle_data(self, data):
        if self._label is not None:
            self._label += data


def _pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"), dtype=np.float64)


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a - b) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


@pytest.fixture(scope="module")
def audit(tmp_path_factory):
    """A real 2-client image audit: PEFTLeak (malicious server) reads client 0's images exactly, not client 1's."""
    from gradleak.run.audit import run_audit

    out = tmp_path_factory.mktemp("per_client")
    raw = {**TINY, "fl": {"clients": 2}, "threat": {"preset": "malicious"}}
    res = run_audit(raw, out, only=["peftleak"], log=lambda m: None, workers=1)
    return out, res


def _check_rows(out: Path, entry: dict, rows: list[dict]) -> None:
    """One row per graded client, each holding exactly that client's original and reconstruction (file names, data
    attributes), the worst client first and the rest by leak rank."""
    from gradleak.evaluation.levels import leak_rank

    per = entry["per_client"]
    assert sorted(r["client"] for r in rows) == sorted(str(c["client"]) for c in per)  # one row per client
    assert rows[0]["client"] == str(entry["worst_client"])
    by = {str(c["client"]): c for c in per}
    ranks = [leak_rank(by[r["client"]]) for r in rows]
    assert ranks == sorted(ranks, reverse=True)
    for r in rows:
        c = by[r["client"]]
        assert r["level"] == c["level"]
        assert r["label"].startswith(f"client {r['client']} — {c['level'].upper()} — decided by ")
        assert [i["data-role"] for i in r["imgs"]] == ["original", "reconstruction"]
        for img in r["imgs"]:
            assert img["data-client"] == r["client"]
            assert img["src"].startswith(entry["out"] + "/")
            m = OWN_NAME.match(Path(img["src"]).name)
            assert m and int(m.group(2) or 0) == int(r["client"]), img["src"]  # the file is this client's
            assert (out / img["src"]).is_file()


def test_each_client_row_holds_its_own_originals_and_reconstructions(audit):
    out, res = audit
    (a,) = res["attacks"]
    assert [c["client"] for c in a["per_client"]] == [0, 1]
    assert a["worst_client"] == 0 and a["per_client"][0]["level"] == "exact"
    assert a["per_client"][1]["level"] != "exact"
    page = (out / "report.html").read_text()
    rows = _Rows(page).rows
    _check_rows(out, a, rows)
    assert [r["client"] for r in rows] == ["0", "1"]
    assert "decided by patches_exact = 8 of 8; psnr_max = " in rows[0]["label"]  # the exact count, then the null
    assert "decided by psnr_max = " in rows[1]["label"] and "against a null 99th percentile of" in rows[1]["label"]
    assert "<td>client 0</td><td>exact</td><td>psnr_max = " in page  # the per-client table names the metric too
    # the pixels agree: the exact client's reconstruction is its own original; the two clients' originals differ
    img = {(r["client"], i["data-role"]): _pixels(out / i["src"]) for r in rows for i in r["imgs"]}
    assert _psnr(img[("0", "original")], img[("0", "reconstruction")]) > 40
    assert _psnr(img[("1", "original")], img[("0", "reconstruction")]) < 25
    assert _psnr(img[("0", "original")], img[("1", "original")]) < 25
    # the private images and the page embedding them stay owner-only
    for p in [out / "report.html"] + [out / i["src"] for r in rows for i in r["imgs"]]:
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600, p


def test_the_worst_client_comes_first_whatever_its_index(audit, tmp_path):
    """The same real artifacts (copied), the two clients' judgements swapped in audit.json so that client 1 is the
    most leaking though listed second: its row, with its own files, comes first; client 0's follows with client 0's."""
    from gradleak.run.audit_report import write_audit_report

    out, _ = audit
    shutil.copytree(out / "attacks", tmp_path / "attacks")
    result = json.loads((out / "audit.json").read_text())
    a = next(x for x in result["attacks"] if x["name"] == "peftleak")
    c0, c1 = copy.deepcopy(a["per_client"])
    a["per_client"] = [{**c1, "client": 0}, {**c0, "client": 1}]  # client 0 first, as the pipeline lists them
    a["worst_client"] = 1
    rows = _Rows(write_audit_report(result, tmp_path).read_text()).rows
    _check_rows(tmp_path, a, rows)
    assert [r["client"] for r in rows] == ["1", "0"] and rows[0]["level"] == "exact"
    assert [Path(i["src"]).name for i in rows[0]["imgs"]] == ["ground_truth_trial0_client1.png",
                                                              "reconstruction_trial0_client1.png"]
    assert [Path(i["src"]).name for i in rows[1]["imgs"]] == ["ground_truth.png", "reconstruction.png"]


def test_secure_aggregation_row_is_the_sum_of_the_clients(tmp_path):
    """Under secure aggregation the one attacked upload is the sum of N clients: one row, labelled so."""
    import torch

    from gradleak.report import save_image_grid
    from gradleak.run.audit_report import write_audit_report

    d = tmp_path / "attacks" / "ig"
    save_image_grid(torch.rand(4, 3, 16, 16), d / "ground_truth.png", nrow=4)
    save_image_grid(torch.rand(4, 3, 16, 16), d / "reconstruction.png", nrow=4)
    sum_ = "the sum of 2 clients"
    judged = {"level": "partial", "value": 14.0, "null_p99": 12.0, "p_value": 0.001,
              "decided_by": {"metric": "psnr_max", "value": 14.0, "null_p99": 12.0, "p_value": 0.001}}
    result = {"verdict": "leaks", "headline": "LEAKS", "modality": "image",
              "attacks": [{"name": "ig", "modality": "image", "applicable": True, "rule": "r", "metric": "psnr_max",
                           **judged, "out": "attacks/ig", "worst_client": sum_,
                           "per_client": [{"client": sum_, **judged}],
                           "artifacts": ["reconstruction.png", "ground_truth.png"]}],
              "levels": {"null": "n", "psnr_db": 30.0, "rules": {}}, "setup": [], "threat": [], "command": "c",
              "config_hash": "h", "seed": 0, "environment": {}, "not_tested": [], "undefined": [],
              "defenses_available": []}
    path = write_audit_report(result, tmp_path)
    (row,) = _Rows(path.read_text()).rows
    assert row["client"] == sum_ and row["label"].startswith(f"{sum_} — PARTIAL — decided by psnr_max = 14")
    assert [Path(i["src"]).name for i in row["imgs"]] == ["ground_truth.png", "reconstruction.png"]
    assert "client 0" not in path.read_text()
    for p in (path, d / "ground_truth.png", d / "reconstruction.png"):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600


def test_client_labels_map_to_the_pipelines_file_names():
    from gradleak.evaluation.images import grid_owner
    from gradleak.run.audit_report import client_key

    assert grid_owner("ground_truth.png") == ("ground_truth", 0, 0)
    assert grid_owner("reconstruction_trial0_client3.png") == ("reconstruction", 0, 3)
    assert grid_owner("ground_truth_trial2.png") == ("ground_truth", 2, 0)
    assert grid_owner("ground_truth_trial2_client1.png") == ("ground_truth", 2, 1)
    assert grid_owner("tsne.png") is None and grid_owner("reconstructions_client1_round0.png") is None
    assert client_key(3) == (0, 3) and client_key("1@trial2") == (2, 1) and client_key(0) == (0, 0)
    assert client_key("the sum of 4 clients") == (0, 0) and client_key("the sum of 4 clients@trial1") == (1, 0)


def test_the_report_renders_in_a_browser(audit):
    import sys

    if not any(shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome")):
        pytest.skip("no Chromium here (apt-get install chromium): the report was checked as text only")
    sys.path.insert(0, str(ROOT / "scripts"))
    from check_report_in_browser import check

    out, _ = audit
    assert check(out / "report.html") == []
