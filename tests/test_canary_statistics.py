"""The DP check's streamed canary statistics (gradleak.run.canary_statistics.CanaryStatistics) and its per-tensor
noise tests (gradleak.evaluation.empirical_epsilon.tensor_tests; docs/DESIGN.md §6): the running sums equal the batch statistics,
the memory held does not grow with the rounds, the per-tensor ratios follow their F null, and a tensor the noise
misses is caught where the isotropic cosine is not."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gradleak.evaluation.empirical_epsilon import simulated_tensor_statistics, tensor_ratios, tensor_tests
from gradleak.fl.canaries import direction
from gradleak.run.canary_statistics import CanaryStatistics

SHAPES = [("a", torch.Size([6, 5])), ("b", torch.Size([20])), ("c", torch.Size([4, 4])), ("d", torch.Size([3]))]
DIM = sum(int(s.numel()) for _, s in SHAPES)
SIZES = [int(s.numel()) for _, s in SHAPES]


def _split(x: torch.Tensor) -> dict[str, torch.Tensor]:
    out, i = {}, 0
    for name, shape in SHAPES:
        k = int(shape.numel())
        out[name] = x[i:i + k].reshape(shape)
        i += k
    return out


def _federation(k: int, rounds: int, seed: int = 0, sigma: float = 0.3, unnoised: str | None = None):
    """Per round: the aggregate step and every canary's upload (C v + N(0, σ²) on every tensor but ``unnoised``)."""
    g = torch.Generator().manual_seed(seed)
    units = [direction(SHAPES, seed, j) for j in range(k)]
    out = []
    for _ in range(rounds):
        ups = {}
        for j in range(k):
            noise = sigma * torch.randn(DIM, generator=g, dtype=torch.float64)
            if unnoised is not None:
                i = sum(SIZES[:[n for n, _ in SHAPES].index(unnoised)])
                noise[i:i + int(dict(SHAPES)[unnoised].numel())] = 0.0
            ups[100 + j] = _split(units[j] + noise)
        step = torch.randn(DIM, generator=g, dtype=torch.float64)
        out.append((step, ups))
    return units, out


def test_the_streamed_statistics_equal_the_batch_ones():
    """Running count, mean, M2, smallest and largest of each canary's per-tensor ratio, its summed energies, and the
    largest cosines: the same as computed from every upload kept (a batch over the rounds)."""
    k, rounds = 5, 4
    units, fed = _federation(k, rounds)
    st = CanaryStatistics(k, SHAPES, lambda j: units[j], first_id=100, tensors=True)
    final = sum(step for step, _ in fed)
    for r, (step, ups) in enumerate(fed):
        st.add_round(step, ups, final=final if r == rounds - 1 else None)
    got = st.finish(final)
    late = CanaryStatistics(k, SHAPES, lambda j: units[j], first_id=100, tensors=True)
    for step, ups in fed:
        late.add_round(step, ups)
    assert late.finish(final)["final_model"] == pytest.approx(got["final_model"], rel=1e-12)  # handed late: the same
    df = np.array(SIZES, float) - 1
    for j in range(k):
        v = units[j].numpy()
        ratios, energies, rests, cos_up, cos_step = [], [], [], [], []
        for step, ups in fed:
            u = torch.cat([ups[100 + j][n].reshape(-1) for n, _ in SHAPES]).numpy()
            parts = np.split(u, np.cumsum(SIZES)[:-1])
            vparts = np.split(v, np.cumsum(SIZES)[:-1])
            across = np.array([p @ p - (p @ q) ** 2 / (q @ q) for p, q in zip(parts, vparts)])
            rest = across.sum() - across
            ratios.append((across / df) / (rest / (df.sum() - df)))
            energies.append(across)
            rests.append(rest)
            cos_up.append(u @ v / np.linalg.norm(u))
            cos_step.append(step.numpy() @ v / np.linalg.norm(step.numpy()))
        ratios = np.array(ratios)
        run = st.upload_tensors
        assert run.count[j] == pytest.approx(np.full(len(SHAPES), rounds))
        assert run.mean[j] == pytest.approx(ratios.mean(0), rel=1e-12)
        assert run.m2[j] == pytest.approx(((ratios - ratios.mean(0)) ** 2).sum(0), rel=1e-9)
        assert run.min[j] == pytest.approx(ratios.min(0)) and run.max[j] == pytest.approx(ratios.max(0))
        assert run.energy[j] == pytest.approx(np.sum(energies, 0)) and run.rest[j] == pytest.approx(np.sum(rests, 0))
        assert got["each_upload"][j] == pytest.approx(max(cos_up))
        assert got["every_round"][j] == pytest.approx(max(cos_step))
        assert got["final_model"][j] == pytest.approx(final.numpy() @ v / np.linalg.norm(final.numpy()))
    assert got["maxima"] == {"final_model": 1, "every_round": rounds, "each_upload": rounds}
    summary = got["tensors"]["each_upload"]
    assert summary["vectors"] == k * rounds and summary["df"] == df.tolist()
    assert summary["min_ratio"] == pytest.approx(st.upload_tensors.min.min(0).tolist())


def test_the_memory_held_does_not_grow_with_the_rounds():
    """O(canaries × tensors) + one flat vector (the canaries' sum): the same bytes after 2 rounds and after 20, and no
    list of rounds kept."""
    k = 6
    units, fed = _federation(k, 20, seed=1)
    held = {}
    for rounds in (2, 20):
        st = CanaryStatistics(k, SHAPES, lambda j: units[j], first_id=100, tensors=True, signal_bound=1.0)
        for step, ups in fed[:rounds]:
            st.add_round(step, ups)
        held[rounds] = st.state_bytes()
        assert not any(isinstance(v, list) and len(v) >= rounds for v in vars(st).values() if v is not st.shapes)
    assert held[2] == held[20]
    assert held[20] * 10 < 20 * k * DIM * 8  # a tenth of the uploads a batch over 20 rounds would keep


def test_the_per_tensor_ratios_follow_their_null():
    """Correct noise: the tests' p-values are uniform (rejections at α = 0.05 in 300 federations: within the binomial
    99.9 % range); one tensor un-noised: rejected in every one, though the canaries' cosines barely move."""
    from scipy.stats import binom

    k, alpha = 8, 0.05
    hits = {"tensor_variance": 0, "tensor_tail": 0}
    for s in range(300):
        units, fed = _federation(k, 1, seed=10 + s)
        st = CanaryStatistics(k, SHAPES, lambda j: units[j], first_id=100, tensors=True)
        st.add_round(*fed[0])
        tests = tensor_tests(st.finish(fed[0][0])["tensors"]["each_upload"], alpha=alpha)
        for t in hits:
            hits[t] += tests[t]["rejects"]
    lo, hi = binom.ppf(0.0005, 300, alpha), binom.ppf(0.9995, 300, alpha)
    assert all(lo <= h <= hi for h in hits.values()), hits
    units, fed = _federation(k, 1, seed=5, unnoised="b")
    st = CanaryStatistics(k, SHAPES, lambda j: units[j], first_id=100, tensors=True)
    st.add_round(*fed[0])
    tests = tensor_tests(st.finish(fed[0][0])["tensors"]["each_upload"], alpha=1e-6)
    assert tests["tensor_variance"]["rejects"] and tests["tensor_variance"]["tensor"] == "b"
    assert tests["tensor_tail"]["rejects"]


def test_the_signal_bound_keeps_a_concentrated_signal_from_faking_a_quiet_tensor():
    """An aggregate whose real client's clipped update sits in one tensor (norm 1, noise 0.01 per coordinate): without
    the bound the other tensors look under-noised; with the bound (the signal's norm) none is."""
    rng = np.random.default_rng(0)
    sizes = np.array([400.0, 300.0, 300.0])
    e = 1e-4 * rng.chisquare(sizes)
    e[0] += 1.0  # the signal, in tensor 0
    bare, _ = tensor_ratios(e, sizes)
    bounded, _ = tensor_ratios(e, sizes, bound=1.0)
    from scipy.special import fdtr

    rest = sizes.sum() - sizes
    assert fdtr(sizes[1], rest[1], bare[1]) < 1e-10
    assert all(fdtr(sizes[i], rest[i], bounded[i]) > 1e-3 for i in (1, 2))


@pytest.mark.parametrize("aggregate", [False, True])
def test_the_simulated_summaries_are_the_streamed_ones(aggregate):
    """simulated_tensor_statistics (what benchmarks/dp_check.py's sim cells draw) against the statistics streamed from
    vectors: the same distribution of the worst tensor's p-value (two-sample KS, p > 0.001 over 150 draws each)."""
    from scipy.stats import ks_2samp

    k, sigma = 8, 0.3
    ps_sim, ps_vec = [], []
    for s in range(150):
        rng = np.random.default_rng(s)
        if aggregate:
            t = simulated_tensor_statistics(rng, SIZES, sigma / math.sqrt(1.0), aggregate_of=k, central=True,
                                            clip=1e-9)
        else:
            t = simulated_tensor_statistics(rng, SIZES, sigma, canaries=k)
        ps_sim.append(tensor_tests(t, alpha=0.05)["tensor_variance"]["p_value"])
        units, fed = _federation(k, 1, seed=1000 + s, sigma=sigma)
        st = CanaryStatistics(k, SHAPES, lambda j: units[j], first_id=100, tensors=True)
        step = sigma * torch.randn(DIM, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
        st.add_round(step, fed[0][1])
        got = st.finish(step)["tensors"]["final_model" if aggregate else "each_upload"]
        ps_vec.append(tensor_tests(got, alpha=0.05)["tensor_variance"]["p_value"])
    assert ks_2samp(ps_sim, ps_vec).pvalue > 1e-3
