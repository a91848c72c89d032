"""Running experiments (docs/DESIGN.md §2): the one runner (:mod:`~gradleak.run.pipeline`), results
(:mod:`~gradleak.run.results`), the one resumable cell loop (:mod:`~gradleak.run.cells`), sweeps
(:mod:`~gradleak.run.sweep`) and the audit (:mod:`~gradleak.run.audit`)."""

from gradleak.run.runner import run_config, run_file, validate

__all__ = ["run_config", "run_file", "validate"]
