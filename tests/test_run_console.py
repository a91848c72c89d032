"""``gradleak run`` answers first. The console opens with the sentence the HTML report opens with
(:func:`gradleak.run.answer.run_answer`) and a short headline table; the full metric table is behind ``--verbose``;
a p-value at the floor of its null's draws (1 / (1 + draws): 0.000999 for 1,000) reads ``p < 0.001``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gradleak.cli import app

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "peftleak" / "cifar_b32.yaml"  # the config `make demo` runs
#: the demo's config on a 1-block ViT-Tiny over 16x16 images: a few seconds, the same attack and data
TINY = ["--set", "model.name=vit-tiny", "--set", "model.layers=1", "--set", "data.image_size=16",
        "--set", "data.batch_size=4", "--set", "data.public_size=300", "--set", "metrics.feature_distance=false"]
runner = CliRunner()


def test_run_prints_the_answer_and_a_short_table_and_every_metric_only_with_verbose(tmp_path):
    from gradleak.run.answer import run_answer

    res = runner.invoke(app, ["run", str(DEMO), "--out", str(tmp_path / "a"), *TINY])
    assert res.exit_code == 0, res.output
    results = json.loads((tmp_path / "a" / "results.json").read_text())
    answer = run_answer(results)
    lines = [line.strip() for line in res.output.splitlines()]
    # the table's top border (its title, "... -> DIR/results.json", wraps where the path is long, e.g. under xdist)
    title = next(i for i, line in enumerate(lines) if line.startswith("┏"))
    # the answer first (before the table), word for word the report's sentence
    assert lines.index(answer["text"]) < title
    assert answer["text"].startswith("PEFTLeak recovered ") and "against chance at" in answer["text"]
    text = " ".join(res.output.split())
    for row in ("level", "best-image PSNR (psnr_max)", "chance (the bar it is tested against)", "p-value", "server"):
        assert row in text, row
    assert f"{answer['level']}" in text and "p-value │ < 0.001" in text  # 1,000 draws, none reached: the floor
    assert "0.000999" not in res.output
    assert "grouping_accuracy" not in res.output and "time: total_seconds" not in res.output
    assert f"all {len(results['metrics'])} metrics: --verbose, or results.json" in text

    res = runner.invoke(app, ["run", str(DEMO), "--out", str(tmp_path / "b"), *TINY, "--verbose"])
    assert res.exit_code == 0, res.output
    assert answer["text"] in [line.strip() for line in res.output.splitlines()]  # seeded: the same answer
    for key in results["metrics"]:
        assert key in res.output, key
    assert "time: total_seconds" in res.output and "psnr_max_p_value │ < 0.001" in " ".join(res.output.split())


@pytest.mark.parametrize("p, shown", [(1 / 1001, "p < 0.001"), (1 / 201, "p < 0.005"), (1 / 501, "p < 0.002"),
                                      (2 / 1001, "p = 0.001998"), (0.001, "p = 0.001"), (0.5, "p = 0.5"),
                                      (1.0, "p = 1"), (float("nan"), "p = n/a"), (None, "p = n/a"),
                                      (1 / 100, "p = 0.01")])
def test_a_p_value_at_its_floor_reads_p_below_the_rounded_floor(p, shown):
    """Only 1 / (1 + draws) with >= 200 draws is a floor (1/100 is a measured p: fewer draws than any null has)."""
    from gradleak.run.answer import fmt_p

    assert fmt_p(p) == shown
    assert fmt_p(p, bare=True) == shown.replace("p = ", "").replace("p < ", "< ")


def test_the_audit_banner_and_the_answer_write_the_floor_as_p_below():
    from gradleak.run.answer import run_answer
    from gradleak.run.audit_report import evidence_words

    words = evidence_words({"metric": "psnr_max", "value": 30.0, "null_p99": 12.0, "p_value": 1 / 1001})
    assert words == "psnr_max = 30 against a null 99th percentile of 12 (p < 0.001)"
    results = {"config": {"attack": {"name": "ig"}, "metrics": {"psnr_threshold_db": 30.0}},
               "metrics": {"psnr_max": 14.0, "psnr_max_null_p99": 12.0, "psnr_max_null_median": 10.0,
                           "psnr_max_p_value": 1 / 1001, "ssim_max": 0.2, "ssim_max_null_p99": 0.3,
                           "psnr_mean": 12.0}}
    answer = run_answer(results)
    assert "(null median 10 dB, p < 0.001)" in answer["chance_words"]


def test_the_run_report_metric_table_writes_the_floor_as_below_too():
    from gradleak.report.html import metric_groups

    groups = metric_groups({"psnr_max": 30.0, "psnr_max_p_value": 1 / 1001, "ssim_max_p_value": 0.0123,
                            "rdlv_p_value_client1": 1 / 201}, ["psnr_max", "psnr_max_p_value"])
    rows = {k: v for g in groups for k, v in g["rows"]}
    assert rows == {"psnr_max": "30", "psnr_max_p_value": "< 0.001", "ssim_max_p_value": "0.0123",
                    "rdlv_p_value_client1": "< 0.005"}
