"""Experiment configs (docs/DESIGN.md §2): YAML and ``--set`` loading (:mod:`~gradleak.config.loading`) and the validated
sections and presets (:mod:`~gradleak.config.schema`, which registers the experiment presets on import)."""

from gradleak.config import schema as _schema  # noqa: F401  (registers the experiment presets)
