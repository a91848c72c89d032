"""Top-k pruning's error model (gradleak.defenses.update.TopKPruning.observed_error_variance; docs/DESIGN.md, the
information limit): every dropped coordinate is at most the kept threshold t (read off the upload), the scale t bounds
the dropped error's rms, and the edge t (sqrt(M) + sqrt(n)) it implies gives the embedding adapter a finite margin --
checked on synthetic uploads and against the true dropped error of MiniLM's embedding-adapter gradient."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from gradleak.attacks.common.subspace import spectral_margin
from gradleak.defenses.declared import as_declared, view_error_std, view_noise_std
from gradleak.defenses.update import TopKPruning
from gradleak.fl.core import Update


def _upload(seed: int = 0) -> Update:
    """A gradient-like upload: rank-8 sums of dense token vectors (as a linear layer's gradient rows) and a bias."""
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(96, 8, generator=g, dtype=torch.float64) @ torch.randn(8, 128, generator=g, dtype=torch.float64)
    B = 0.1 * torch.randn(64, 8, generator=g, dtype=torch.float64) @ torch.randn(8, 32, generator=g, dtype=torch.float64)
    return Update({"a": A, "b": B, "bias": torch.randn(96, generator=g, dtype=torch.float64)}, 2, 0, "gradient", 1)


@pytest.mark.parametrize("fraction", [0.5, 0.9, 0.99])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_the_threshold_read_off_the_upload_bounds_every_dropped_coordinate(fraction, per_tensor):
    clean = _upload()
    d = TopKPruning(prune_fraction=fraction, per_tensor=per_tensor)
    pruned = d.apply(clean, {})
    everything = torch.cat([t.reshape(-1).abs() for t in pruned.tensors.values()])
    for name in clean.tensors:
        t = d.kept_threshold(pruned, name)
        kept = (pruned.tensors[name] if per_tensor else everything)
        assert t == float(kept[kept != 0].abs().min())  # the smallest kept magnitude, of the tensor or the upload
        err = clean.tensors[name] - pruned.tensors[name]
        assert float(err.abs().max()) <= t  # every dropped coordinate is bounded by t
        assert float(err.pow(2).mean().sqrt()) <= t  # so is the rms: std t over-states, never under-states, it
        assert d.observed_error_variance(pruned, tensor=name) == pytest.approx(t * t, rel=1e-12)


def test_the_error_is_not_noise_and_is_unknown_where_the_zeros_are_not_the_clients():
    clean = _upload(1)
    entries = [{"name": "topk_pruning", "params": {"prune_fraction": 0.9}}]
    pruned = TopKPruning(prune_fraction=0.9).apply(clean, {})
    view = SimpleNamespace(public={"update_defenses": entries, "clients": 1}, updates=[pruned],
                           secure_aggregation=False)
    assert view_noise_std(view, tensor="a") is None  # the Gaussian tests never read the pruning error
    t = TopKPruning(prune_fraction=0.9).kept_threshold(pruned)
    assert view_error_std(view, tensor="a") == pytest.approx(t)
    # declared Gaussian noise and the pruning error add in variance
    both = SimpleNamespace(public={"update_defenses": entries + [{"name": "gaussian_noise", "params": {"std": 0.3}}],
                                   "clients": 1}, updates=[pruned], secure_aggregation=False)
    assert view_error_std(both, tensor="a") == pytest.approx(math.sqrt(t * t + 0.09))
    # a sum of several clients' pruned uploads: no client's support, no threshold
    assert TopKPruning(prune_fraction=0.9).observed_error_variance(pruned, aggregate_of=3, individual=False) is None
    declared = as_declared(entries)
    declared.clients = 3
    assert declared.error_std(pruned, individual=False, tensor="a") is None
    assert declared.error_std(pruned, individual=True, tensor="a") == pytest.approx(t)
    # noise added after the pruning: the zeros are gone, the threshold cannot be read
    noisy = pruned.map(lambda _, x: x + 1e-3 * torch.randn(x.shape, dtype=x.dtype))
    assert TopKPruning(prune_fraction=0.9).kept_threshold(noisy) is None
    assert TopKPruning(prune_fraction=0.9, per_tensor=True).kept_threshold(pruned) is None  # per tensor: a name


@pytest.fixture(scope="module")
def minilm_upload():
    """The text audit's undefended upload (MiniLM 2 layers, adapters rf = 2, fortunes-topics, B = 2, seed 0), taken
    from the server view the attack receives."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from defended import TEXT, base

    from gradleak.attacks.utr.attack import UTRAttack
    from gradleak.run.runner import run_config

    seen = {}

    class Taken(Exception):
        pass

    def take(self, view):
        seen["tensors"] = {k: v.detach().clone() for k, v in view.updates[0].tensors.items()}
        raise Taken

    raw = base(TEXT, {"name": "utr"}, 0)
    raw["data"]["batch_size"] = 2
    raw["defenses"] = []
    mp = pytest.MonkeyPatch()
    mp.setattr(UTRAttack, "_reconstruct", take)
    try:
        try:
            run_config(raw, str(Path(__import__("tempfile").mkdtemp()) / "run"))
        except Exception:  # the attack stops once it holds the view
            pass
    finally:
        mp.undo()
    assert "tensors" in seen
    return Update(seen["tensors"], 2, 0, "gradient", 1)


@pytest.mark.parametrize("fraction,per_tensor", [(0.9, False), (0.9, True), (0.99, True), (0.999, True)])
def test_against_the_true_dropped_error_of_minilms_embedding_adapter(minilm_upload, fraction, per_tensor):
    """The measured facts the error model's docstring states: rms of the dropped error <= 0.5 t, its largest singular
    value <= 1.5 x the edge t (sqrt(M) + sqrt(n)) (not i.i.d.: it reaches past 1 under per-tensor pruning), and the
    margin finite and sane (no 1e+64, the Gavish-Donoho estimate's on a mostly pruned matrix)."""
    name = "text_adapters.embedding.down.weight"
    d = TopKPruning(prune_fraction=fraction, per_tensor=per_tensor)
    pruned = d.apply(minilm_upload, {})
    t = math.sqrt(d.observed_error_variance(pruned, tensor=name))
    G, P = minilm_upload.tensors[name].double(), pruned.tensors[name].double()
    E = G - P
    M, n = G.shape
    edge = t * (M ** 0.5 + n ** 0.5)
    assert float(E.abs().max()) <= t
    assert float(E.pow(2).mean().sqrt()) <= 0.5 * t
    assert float(torch.linalg.matrix_norm(E, 2)) <= 1.5 * edge
    lim = spectral_margin([P], 1, t)
    assert 0.0 <= lim["margin_strongest"] < 10.0 and math.isfinite(lim["margin_strongest"])
    assert lim["directions_above_edge"] == float((torch.linalg.svdvals(P) > 1.05 * edge).sum())
