"""Experiment configs (docs/DESIGN.md §2): YAML and ``--set`` loading (:mod:`~gradleak.config.loading`) and the validated
sections (:mod:`~gradleak.config.schema`). The experiment presets and each modality's rules of the config come from
the modality plug-ins (:mod:`gradleak.modalities`), so this package names no modality."""

from gradleak.config import schema as _schema  # noqa: F401  (the sections, and the engines' sections they mount)
