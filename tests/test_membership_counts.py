"""Membership results on small samples (gradleak.evaluation.membership): the TPR at 1 % FPR is graded only where the
non-members resolve a 1 % FPR (>= 100), the level otherwise rests on the AUC against its null, and the members /
non-members counts stand beside every membership result (audit entry, banner, console row, report, answer)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gradleak.evaluation.levels import grade


def _evaluate(tmp_path: Path, members: int, nonmembers: int, separated: bool = True, seed: int = 0) -> dict:
    """The membership unit on scores where every member outscores every non-member (``separated``) or on pure
    chance scores, with the null drawn as the pipeline draws it."""
    from gradleak.attacks.base import Reconstruction
    from gradleak.evaluation import Truth, evaluate

    rng = np.random.default_rng(seed)
    labels = [True] * members + [False] * nonmembers
    scores = rng.normal(size=members + nonmembers)
    if separated:
        scores[:members] += 100.0
    cfg = SimpleNamespace(seed=seed, metrics=SimpleNamespace(null=True, null_draws=1000, figures=False,
                                                             psnr_threshold_db=30.0))
    tr = Truth("text", None, torch.zeros(1), membership={0: labels})
    return evaluate("membership", tr, Reconstruction({"scores": {0: list(scores)}}), cfg, tmp_path, 0).metrics


def test_sixteen_non_members_grade_no_tpr_and_say_why(tmp_path):
    m = _evaluate(tmp_path, members=16, nonmembers=16)
    assert m["tpr_at_1pct_fpr"] == 1.0 and m["tpr_at_1pct_fpr"] > m["tpr_at_1pct_fpr_null_p99"]  # what read strong
    g = grade("membership", m)
    assert g["level"] == "partial"  # the signal is beyond its null: still leakage, never green
    assert "needs >= 100 non-members, has 16" in g["rule"]
    assert g["evidence"]["tpr_at_1pct_fpr_graded"] is False


def test_two_hundred_non_members_grade_the_tpr(tmp_path):
    m = _evaluate(tmp_path, members=16, nonmembers=200)
    g = grade("membership", m)
    assert g["level"] == "strong" and g["evidence"]["tpr_at_1pct_fpr_graded"] is True
    assert "not graded" not in g["rule"]


def test_chance_scores_on_few_non_members_stay_none(tmp_path):
    hits = sum(grade("membership", _evaluate(tmp_path, 16, 16, separated=False, seed=s))["level"] != "none"
               for s in range(20))
    assert hits <= 1, hits


def _entry(tmp_path, members, nonmembers):
    from gradleak.run.audit import judge

    m = _evaluate(tmp_path, members=members, nonmembers=nonmembers)
    cfg = SimpleNamespace(metrics=SimpleNamespace(psnr_threshold_db=30.0))
    j = judge("membership", m, cfg)
    return {"name": "projres", "applicable": False, "applicable_under": "upgraded", "threat": "honest-but-curious",
            "worst_client": 0, **j.as_dict()}


@pytest.mark.parametrize("members, nonmembers", [(2, 16), (2, 48), (16, 200)])
def test_the_counts_stand_beside_every_membership_result(tmp_path, members, nonmembers):
    from gradleak.run.audit import client_row, verdict_and_headline
    from gradleak.run.audit_report import console_rows, evidence_words, write_audit_report

    words = f"{members} members vs {nonmembers} non-members"
    e = _entry(tmp_path, members, nonmembers)
    assert e["members"] == members and e["nonmembers"] == nonmembers and e["sample"] == words  # audit.json
    assert client_row(0, e)["sample"] == words
    assert words in evidence_words(e)
    _, banner = verdict_and_headline([e])
    assert words in banner
    result = {"attacks": [e], "modality": "text"}
    row = next(r for r in console_rows(result) if r[0] == "projres")
    assert words in row[3]
    result.update({"verdict": "leaks_stronger_server", "headline": banner, "levels": {
        "null": "x", "psnr_db": 30.0, "rules": {}}, "setup": [], "threat": [], "command": "c", "config_hash": "h",
        "seed": 0, "environment": {}})
    page = write_audit_report(result, tmp_path).read_text()
    assert page.count(words) >= 3  # the banner, the attacks table, the evidence
