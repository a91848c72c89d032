"""docs/CONFIG.md is ``gradleak config-reference``'s output: every config key with its type, default
and description, generated from the schema. After a schema change: ``gradleak config-reference > docs/CONFIG.md``."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from gradleak.cli import app

DOC = Path(__file__).resolve().parents[1] / "docs" / "CONFIG.md"


def test_config_md_is_the_generated_reference():
    res = CliRunner().invoke(app, ["config-reference"])
    assert res.exit_code == 0, res.output
    assert DOC.read_text() == res.stdout, "docs/CONFIG.md is stale: run `gradleak config-reference > docs/CONFIG.md`"


def test_reference_names_every_size_field_with_its_default_and_purpose():
    from gradleak.config.reference import config_reference
    from gradleak.config.schema import DataConfig

    ref = config_reference()
    for key in DataConfig.model_fields:
        assert f"| `data.{key}` |" in ref
    line = next(r for r in ref.splitlines() if r.startswith("| `data.nonmembers` |"))
    assert "| `0` |" in line and "non-member" in line
    for key in ("fl.clients", "peft.lora_targets", "threat.preset", "fl.flower.dp", "metrics.null_draws"):
        assert f"| `{key}` |" in ref
