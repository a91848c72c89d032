"""Experiment configs, the runner and sweeps. Importing this registers every experiment."""

from gradleak.experiments.runner import run_config, run_file, validate

__all__ = ["run_config", "run_file", "validate"]

# Experiments register themselves on import; each module is optional so one broken extra cannot
# stop the others from loading.
import importlib as _importlib

for _mod in ("gradleak.experiments.peftleak", "gradleak.experiments.utr"):
    try:
        _importlib.import_module(_mod)
    except ModuleNotFoundError as _err:  # only a module that does not exist yet is skipped
        if _err.name != _mod:
            raise
