"""``gradleak list``: one registry at a time, by modality, a model's LoRA targets, and fast.

The registries are read from a catalog cached per source digest (``gradleak.cli.load_catalog``): a warm call imports
no torch and prints in well under a second.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from gradleak.cli import app

runner = CliRunner()


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADLEAK_CACHE", str(tmp_path))
    return tmp_path


def _list(*args: str) -> str:
    res = runner.invoke(app, ["list", *args])
    assert res.exit_code == 0, res.output
    return res.output


def test_list_filters_by_registry_and_modality(cache):
    full = _list()
    assert list(cache.glob("catalog-*.json")), "the catalog is cached"
    assert _list() == full  # read back from the cache: the same lines
    attacks = _list("attacks")
    assert "attacks (attack.name)" in attacks and "datasets" not in attacks and "peftleak —" in attacks
    text = _list("attacks", "--modality", "text")
    assert "utr —" in text and "dager —" in text and "peftleak —" not in text and "lora_span —" not in text
    assert "threat requires" in text  # each attack keeps its details
    data = _list("data", "--modality", "image")
    assert "image-folder —" in data and "npz —" in data and "csv —" not in data and "rt-sentences" not in data
    text_data = _list("data", "--modality", "text")
    assert "csv —" in text_data and "tsv —" in text_data and "cifar-samples" not in text_data
    defenses = _list("defenses")
    assert "update defenses" in defenses and "training defenses" in defenses and "gaussian_noise —" in defenses
    assert "dpsgd —" in defenses and "attacks (attack.name)" not in defenses
    models = _list("models", "--modality", "text")
    assert "minilm —" in models and "smollm2 —" in models and "vit-b16" not in models


def test_list_names_a_models_lora_targets(cache):
    out = _list("--model", "vit-tiny")
    assert "linear modules: dense, head, key, query, value" in out and "default: query, value" in out
    assert "attacks (attack.name)" not in out
    res = runner.invoke(app, ["list", "--model", "no-such-model"])
    assert res.exit_code == 2 and "unknown model 'no-such-model'" in res.output


def test_list_refuses_an_unknown_registry_or_modality(cache):
    res = runner.invoke(app, ["list", "atacks"])
    assert res.exit_code == 2 and "did you mean 'attacks'" in res.output
    res = runner.invoke(app, ["list", "--modality", "audio"])
    assert res.exit_code == 2 and "use image or text" in res.output


def test_warm_list_is_fast_and_imports_no_torch(cache):
    _list()  # warm the cache
    t0 = time.perf_counter()
    _list("attacks")
    _list()
    assert time.perf_counter() - t0 < 2.0  # both; measured 0.1 s on a loaded 2-core machine
    code = ("import sys; from typer.testing import CliRunner; from gradleak.cli import app; "
            "r = CliRunner().invoke(app, ['list']); assert r.exit_code == 0, r.output; "
            "assert 'torch' not in sys.modules, 'torch imported'; assert 'lora_rank' in r.output")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "GRADLEAK_CACHE": str(cache)})
    assert res.returncode == 0, res.stderr[-2000:]
