"""A run's report leads with the answer: one sentence built from results.json (gradleak.run.answer) -- the headline
metric of the evaluation unit, its chance level and the level of evaluation/levels.py grade() -- then the originals
beside the reconstructions, then the metrics in folded groups. One synthetic results dict per reconstruction kind."""

from __future__ import annotations

import json
import math

import pytest
import torch

from gradleak.evaluation import EVALUATORS
from gradleak.report import save_image_grid, write_report
from gradleak.run.answer import run_answer

MALICIOUS = {"capability": "malicious", "malicious": True, "prescribes_architecture": True, "public_data": True}
HONEST = {"capability": "honest-but-curious", "malicious": False, "prescribes_architecture": False,
          "public_data": False}


def _results(attack: str, metrics: dict, per_client: list | None = None, threat: dict = HONEST) -> dict:
    return {"name": f"{attack}-run", "experiment": "x", "metrics": metrics,
            "config": {"attack": {"name": attack}, "metrics": {"psnr_threshold_db": 30.0}},
            "details": {"attack": {"name": attack}, "threat": threat,
                        "per_client": per_client if per_client is not None else [
                            {"trial": 0, "client": 0, "metrics": metrics}]}}


PATCHES = {"num_true_patches": 128.0, "patches_exact": 128.0, "patch_recovery_rate": 1.0, "psnr_max": 101.97,
           "psnr_max_null_median": 13.5, "psnr_max_null_p99": 14.68, "psnr_max_p_value": 0.000999,
           "psnr_max_flat": 19.28, "psnr_max_grey": 17.6, "psnr_max_mean_public": 16.0, "ssim_max": 1.0,
           "ssim_max_null_p99": 0.37, "psnr_null_p99": 9.59, "nonzero_bins": 574.0}
IMAGES_C0 = {"images_total": 4.0, "images_above_threshold": 0.0, "psnr_max": 10.0, "psnr_max_null_p99": 12.0,
             "psnr_max_null_median": 11.0, "psnr_max_p_value": 0.6, "ssim_max": 0.1, "ssim_max_null_p99": 0.35}
IMAGES_C1 = {**IMAGES_C0, "psnr_max": 14.04, "psnr_max_p_value": 0.001}
TEXT = {"sentences_total": 2.0, "sentences_exact": 2.0, "rouge1_f1": 100.0, "rouge1_f1_null_p99": 25.0,
        "rouge1_f1_null_median": 10.0, "rouge1_f1_p_value": 0.000999, "rouge2_f1": 100.0, "rouge2_f1_null_p99": 5.0,
        "word_bag_recall": 1.0, "word_bag_recall_null_p99": 0.3, "word_bag_recall_p_value": 0.000999}
MEMBERSHIP = {"auc": 0.95, "auc_null_median": 0.5, "auc_null_p99": 0.62, "auc_p_value": 0.000999,
              "auc_distance": 0.45, "auc_distance_null_p99": 0.12, "tpr_at_1pct_fpr": 0.4,
              "tpr_at_1pct_fpr_null_p99": 0.05, "members": 8.0, "nonmembers": 120.0}
LEAKAGE = {"rdlv_client0": 0.05, "rdlv_null_p99_client0": 0.1, "rdlv_null_median_client0": 0.0, "ssim_client0": 0.1,
           "ssim_null_p99_client0": 0.3, "psnr_max_client0": 12.0, "rdlv_excess_client0": -0.05,
           "rdlv_client1": 0.6, "rdlv_null_p99_client1": 0.1, "rdlv_null_median_client1": 0.0,
           "rdlv_p_value_client1": 0.000999, "ssim_client1": 0.4, "ssim_null_p99_client1": 0.3,
           "psnr_max_client1": 18.0, "rdlv_excess_client1": 0.5, "rdlv_high_risk_client": 0.6}

CASES = {  # kind: (attack, results, the answer)
    "patches": ("peftleak", _results("peftleak", PATCHES, threat=MALICIOUS),
                "PEFTLeak recovered 128 of 128 image patches exactly: best-image PSNR 102 dB against chance at "
                "19.3 dB (level exact)."),
    "images": ("ig", _results("ig", IMAGES_C0, [{"trial": 0, "client": 0, "metrics": IMAGES_C0},
                                                {"trial": 0, "client": 1, "metrics": IMAGES_C1}]),
               "IG recovered 0 of 4 images exactly (client 1, the most leaking of 2 attacked): best-image PSNR 14 dB "
               "against chance at 12 dB (level partial)."),
    "token_sequences": ("utr", _results("utr", TEXT), "UTR recovered 2 of 2 sentences exactly: ROUGE-1 F1 100 "
                                                      "against chance at 25 (level exact)."),
    "membership": ("projres", _results("projres", MEMBERSHIP),
                   "ProjRes: ROC AUC 0.95 against chance at 0.62 on 8 members vs 120 non-members (level strong)."),
    "leakage": ("bn_inversion", _results("bn_inversion", LEAKAGE, []),
                "BNInversion (client 1, the most leaking of 2 attacked): RDLV 0.6 against chance at 0.1 "
                "(level partial)."),
}


def test_every_reconstruction_kind_has_a_case():
    assert set(CASES) == set(EVALUATORS.names())


@pytest.mark.parametrize("kind", sorted(CASES))
def test_the_answer_sentence_of_each_kind(kind):
    from gradleak.registry import ATTACKS

    attack, results, sentence = CASES[kind]
    assert ATTACKS.get(attack).reconstruction == kind
    a = run_answer(results)
    assert a["text"] == sentence
    assert a["metric"] == EVALUATORS.get(kind).headline and a["level"] in sentence


def test_the_answer_is_computed_from_the_metrics_not_written():
    """Other numbers, another sentence: fewer patches exact, a higher trivial reference, no null at all."""
    m = {**PATCHES, "patches_exact": 100.0, "psnr_max_flat": 21.0}
    assert run_answer(_results("peftleak", m))["text"] == (
        "PEFTLeak recovered 100 of 128 image patches exactly: best-image PSNR 102 dB against chance at 21 dB "
        "(level exact).")
    few = {**MEMBERSHIP, "nonmembers": 48.0}  # 48 non-members cannot resolve a 1 % FPR: the AUC decides
    assert run_answer(_results("projres", few))["text"] == (
        "ProjRes: ROC AUC 0.95 against chance at 0.62 on 8 members vs 48 non-members (level partial).")
    none = {k: v for k, v in MEMBERSHIP.items() if "null" not in k and "p_value" not in k}
    a = run_answer(_results("projres", none))
    assert a["level"] == "undefined"
    assert a["text"].startswith("ProjRes: ROC AUC 0.95 with no null to compare against on 8 members vs 120 "
                                "non-members (level undefined: ")
    assert run_answer({"name": "x", "metrics": {"psnr": 1.0}}) is None  # no attack named: no sentence
    assert run_answer(_results("not_an_attack", PATCHES)) is None


def test_the_page_leads_with_the_answer_then_the_images_then_folded_metrics(tmp_path):
    save_image_grid(torch.rand(2, 3, 8, 8), tmp_path / "ground_truth.png")
    save_image_grid(torch.rand(2, 3, 8, 8), tmp_path / "reconstruction.png")
    attack, results, sentence = CASES["patches"]
    extra = {"figures": [{"title": "ground truth", "path": "ground_truth.png"},
                         {"title": "reconstruction", "path": "reconstruction.png"}], "figure_rows": [[0, 1]],
             "notes": ["threat model — capability: malicious", "threat model — yes — the server may set the weights "
                       "it sends", "128 patches returned from 1536 bins over 1 round(s)."],
             "answer": run_answer(results)}
    page = write_report(results, tmp_path, extra).read_text()
    at = page.index('id="answer"')
    assert sentence in page and at < page.index("<h2>") and at < page.index("<img")
    assert 'class="answer exact"' in page and "Under a malicious server" in page
    row = page.split('<div class="row">')[1].split("</div>")[0]  # the originals beside the reconstructions
    assert "ground truth" in row and "reconstruction" in row
    assert page.index("<img") < page.index("<h2>Metrics</h2>")
    metrics = page.split("<h2>Metrics</h2>")[1].split("<h2>")[0]
    assert metrics.count("<details") == 4  # answer's numbers (open), scores, chance, threat model: folded
    first = metrics.split("</details>")[0]
    assert "<details open>" in first and "psnr_max_null_p99" in first and "nonzero_bins" not in first
    assert "capability: malicious" in metrics.split('id="threat"')[1] and "threat model —" not in page
    assert "128 patches returned" in page.split("<h2>Metrics</h2>")[0]  # other notes stay under the figures
    assert json.loads((tmp_path / "report_data.json").read_text())["answer"]["text"] == sentence


def test_gradleak_report_rebuilds_the_answer_from_results_json_alone(tmp_path):
    from typer.testing import CliRunner

    from gradleak.cli import app

    _, results, sentence = CASES["token_sequences"]
    (tmp_path / "results.json").write_text(json.dumps(results))
    res = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert res.exit_code == 0, res.output
    page = (tmp_path / "report.html").read_text()
    assert sentence in page and page.index('id="answer"') < page.index("<h2>")
    assert not math.isnan(json.loads((tmp_path / "report_data.json").read_text())["answer"]["chance"])
