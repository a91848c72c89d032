"""Experiment configs (:mod:`~gradleak.experiments.schema`), the one runner
(:mod:`~gradleak.experiments.pipeline`), evaluation by reconstruction kind and sweeps."""

from gradleak.experiments.runner import run_config, run_file, validate

__all__ = ["run_config", "run_file", "validate"]

from gradleak.experiments import schema as _schema  # noqa: F401,E402  (registers the experiment presets)
