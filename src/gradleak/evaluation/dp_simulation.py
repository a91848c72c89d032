"""Simulated canary statistics of one round of DP-Gaussian, correct or broken, drawn exactly in distribution without
the vectors, and the simulated check judged as the real one is (:func:`gradleak.evaluation.dp_verdict.judge`), for the
tests and ``benchmarks/dp_check.py`` (docs/DESIGN.md §6). Part of :mod:`gradleak.evaluation.empirical_epsilon`."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from gradleak.evaluation.dp_claim_tests import tensor_ratios
from gradleak.evaluation.dp_verdict import judge


def simulated_statistics(rng: np.random.Generator, canaries: int, dim: int, noise_multiplier: float, *,
                         unnoised: int = 0, noise_scale: float = 1.0, aggregate_of: int = 0,
                         central: bool = False, unnoised_tensor: int = 0, tensor_sizes: Sequence[int] = (),
                         clip_scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Canary statistics of one round of DP-Gaussian (clip C, noise multiplier z), drawn without the vectors (for
    the tests and ``benchmarks/dp_check.py``). Returns (seen, unseen).

    * ``aggregate_of`` = 0: ``each_upload`` under local noise, exact in distribution: a seen canary's cosine with its
      own upload C v + σ n is (μ + g) / ((μ + g)² + χ²_{dim−1})^½, μ = C / σ, g ~ N(0, 1).
    * ``aggregate_of`` = K: the cosine with the sum of K clipped uploads (the canaries among them) and their noise --
      one N(0, (zC)² I) on the sum when ``central``, one per noised upload otherwise (``final_model`` / ``every_round``
      after one round). Canary j's own part C v_j is split off: cos = (1 + r c) / (1 + 2 r c + r²)^½ with c the
      cosine of v_j with the rest and r = ‖rest‖ / C, ‖rest‖² drawn once per check as (K − 1) C² + σ² χ²_dim · (noised
      uploads); exact but for that shared norm (the cross terms between canaries are a relative 1/√dim).
    * A never-inserted canary's cosine with anything released is the exact sphere null, 2 · Beta((dim − 1)/2,
      (dim − 1)/2) − 1 (:func:`sphere_tail`), and so is c above.

    Breakages: the first ``unnoised`` seen uploads clipped but not noised; ``noise_scale`` > 1: noise ``noise_scale``
    times too small on every upload (or on the sum). Breakages of the mechanism's code (:func:`_broken_statistics`,
    one at a time): ``unnoised_tensor`` = m, one tensor of m coordinates left un-noised on every upload (the noise
    loop misses it); ``tensor_sizes``: each of these tensors clipped to C separately where the claim clips the whole
    update (the upload's norm up to C·√T); ``clip_scale`` = s: the clipped upload has norm s·C where the noise is
    calibrated to C (clipping Δw at C while the noise is calibrated to the upload Δw / lr: s = 1 / lr)."""
    if unnoised_tensor or len(tensor_sizes) or clip_scale != 1.0:
        return _broken_statistics(rng, canaries, dim, noise_multiplier / noise_scale, aggregate_of=aggregate_of,
                                  central=central, unnoised_tensor=unnoised_tensor, tensor_sizes=tensor_sizes,
                                  clip_scale=clip_scale)
    sigma = noise_multiplier / noise_scale  # in units of C
    a = 0.5 * (dim - 1)
    unseen = 2.0 * rng.beta(a, a, canaries) - 1.0
    if aggregate_of:
        noises = 1 if central else max(aggregate_of - unnoised, 0)
        r = math.sqrt(aggregate_of - 1 + sigma * sigma * rng.chisquare(dim) * noises)
        c = 2.0 * rng.beta(a, a, canaries) - 1.0
        return (1 + r * c) / np.sqrt(1 + 2 * r * c + r * r), unseen
    g = rng.standard_normal(canaries)
    chi = rng.chisquare(dim - 1, canaries)
    if sigma > 0:
        mu = 1.0 / sigma
        seen = (mu + g) / np.sqrt((mu + g) ** 2 + chi)
    else:
        seen = np.ones(canaries)
    seen[:unnoised] = 1.0
    return seen, unseen



def _broken_statistics(rng: np.random.Generator, canaries: int, dim: int, sigma: float, *, aggregate_of: int,
                       central: bool, unnoised_tensor: int, tensor_sizes: Sequence[int],
                       clip_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """:func:`simulated_statistics` of a mechanism whose code is broken (noise std ``sigma`` in units of C). A seen
    canary v (unit, isotropic; its upload scaled far beyond C, so every part is clipped) uploads its clipped part w
    plus noise n: cos(v, w + n) with w = a v + β e (e ⟂ v, ‖w‖² = a² + β²) and n on the d' noised coordinates, of
    which a share 1 − b lies along v's noised part. Drawn exactly: v's mass on a tensor of m coordinates is
    Beta(m/2, (dim − m)/2) (b, un-noised tensor), on each of several tensors a normalised χ² draw (per-tensor clipping:
    each part clipped to C, a = Σ_t ‖v_t‖, ‖w‖² = T), and n's parts along v and e are N(0, σ²) draws with the rest
    σ² χ²_{d' − 2}. Correct clipping at C is a = 1, β = 0; ``clip_scale`` s: a = s.

    ``aggregate_of`` = K: the cosine with the sum of K such uploads (the others' clipped parts, norm² (K − 1) ‖w‖²,
    and the noise: one draw on the sum when ``central``, one per upload otherwise, on the d' noised coordinates), as
    :func:`simulated_statistics` draws it: exact but for the shared norm of the rest and the cross terms between
    canaries (a relative 1/√dim); the rest's cosine with v is a sphere draw on the noised coordinates times √(1 − b)."""
    if sum((bool(unnoised_tensor), bool(len(tensor_sizes)), clip_scale != 1.0)) > 1:
        raise ValueError("one breakage of the mechanism's code at a time: unnoised_tensor, tensor_sizes or clip_scale")
    if not 0 <= unnoised_tensor <= dim - 3:
        raise ValueError(f"unnoised_tensor must be in [0, dim - 3] ({dim - 3}), got {unnoised_tensor}")
    a_ = 0.5 * (dim - 1)
    unseen = 2.0 * rng.beta(a_, a_, canaries) - 1.0
    noised = dim - int(unnoised_tensor)
    if unnoised_tensor:
        b = rng.beta(0.5 * unnoised_tensor, 0.5 * noised, canaries)
    else:
        b = np.zeros(canaries)
    if len(tensor_sizes):
        sizes = np.asarray(tensor_sizes, dtype=float)
        if int(sizes.sum()) != dim:
            raise ValueError(f"tensor_sizes must sum to dim ({dim}), got {int(sizes.sum())}")
        parts = rng.chisquare(sizes[None, :], (canaries, len(sizes)))
        a = np.sqrt(parts / parts.sum(axis=1, keepdims=True)).sum(axis=1)
        norm2 = np.full(canaries, float(len(sizes)))
    else:
        a = np.full(canaries, float(clip_scale))
        norm2 = a * a
    beta = np.sqrt(np.maximum(norm2 - a * a, 0.0))
    if aggregate_of:
        noises = 1 if central else aggregate_of
        r = np.sqrt((aggregate_of - 1) * norm2 + sigma * sigma * rng.chisquare(noised) * noises)
        an = 0.5 * (noised - 1)
        c = np.sqrt(1.0 - b) * (2.0 * rng.beta(an, an, canaries) - 1.0)
        c2 = 2.0 * rng.beta(a_, a_, canaries) - 1.0  # the rest along e
        return (a + r * c) / np.sqrt(norm2 + 2 * r * (a * c + beta * c2) + r * r), unseen
    g1, g2 = rng.standard_normal(canaries), rng.standard_normal(canaries)
    rest = rng.chisquare(noised - 2, canaries)
    along = a + sigma * np.sqrt(1.0 - b) * g1
    # n's part along v is σ √(1 − b) g1; its noised-coordinate remainder (σ² b' g1² + rest) is drawn as σ² (g1² (b)
    # + χ²_{d' − 2}) -- v's un-noised share carries no noise
    across = (beta + sigma * g2) ** 2 + sigma * sigma * (b * g1 * g1 + rest)
    return along / np.sqrt(along * along + across), unseen


#: the text audit's trainable tensors (``configs/audit/text_adapters.yaml``: MiniLM's classifier weight and bias, then
#: the bottleneck adapters of the embedding and layers 0, 1: down weight, down bias, up weight, up bias), in order
TEXT_AUDIT_TENSORS = (1536, 4) + (73728, 192, 73728, 384) * 3


def simulated_tensor_statistics(rng: np.random.Generator, sizes: Sequence[int], sigma: float, *, canaries: int = 0,
                                aggregate_of: int = 0, central: bool = False, unnoised: int = 0,
                                unnoised_tensor: int = 0, clip: float = 1.0) -> dict:
    """The per-tensor noise summary (:func:`tensor_tests`) of one simulated round of DP-Gaussian (noise std ``sigma``
    in units of the clip C), drawn exactly in distribution without the vectors, as
    :class:`gradleak.run.canary_statistics.CanaryStatistics` computes it from real ones.

    * ``canaries`` = k (each upload): canary j's upload is its clipped part (along its direction v, in every tensor)
      plus the noise; each tensor's energy across v's part is σ² χ²(m_t − 1) for k independent uploads; a tensor the
      noise misses (``unnoised_tensor`` = m: the first tensor of m coordinates) holds none; the first ``unnoised``
      uploads are not noised at all (their energies are the float rounding of the clipped upload: drawn as an
      isotropic 1e-16·C, so their ratios are the null's).
    * ``aggregate_of`` = K (the aggregate of K uploads, one real client among them): the canaries' part is taken off
      (their common coefficient, fitted), the rest is the noise -- N(0, σ²) per coordinate on the sum when
      ``central``, K − ``unnoised`` noised uploads' otherwise, none on the un-noised tensor -- plus the real client's
      clipped update (norm ``clip``·C, an isotropic direction), whose norm bounds the signal left
      (:func:`tensor_ratios`' ``bound``). Exact but for the one degree of freedom the fitted coefficient takes."""
    m = np.asarray(sizes, dtype=float)
    t_un = next((i for i, s in enumerate(sizes) if int(s) == int(unnoised_tensor)), None) if unnoised_tensor else None
    if unnoised_tensor and t_un is None:
        raise ValueError(f"unnoised_tensor = {unnoised_tensor} is none of the tensors' sizes {list(sizes)}")
    noised = np.ones(len(m))
    if t_un is not None:
        noised[t_un] = 0.0
    if aggregate_of:
        var = sigma * sigma * (1 if central else max(aggregate_of - unnoised, 0))
        share = rng.chisquare(m)
        share = share / share.sum()
        sig = clip * np.sqrt(share)  # the real client's clipped update, on each tensor
        g = rng.standard_normal(len(m))
        e = noised * ((sig + math.sqrt(var) * g) ** 2 + var * rng.chisquare(np.maximum(m - 1, 1))) \
            + (1 - noised) * sig ** 2
        ratio, rest = tensor_ratios(e, m, bound=clip)
        df = m
        pooled = ratio
        return {"names": [f"t{i}" for i in range(len(m))], "df": df.tolist(), "vectors": 1,
                "pooled_ratio": pooled.tolist(), "min_ratio": ratio.tolist()}
    df = m - 1
    scale = np.full(canaries, sigma * sigma)
    scale[:unnoised] = 1e-32
    e = scale[:, None] * rng.chisquare(np.maximum(df, 1), (canaries, len(m))) * np.where(df > 0, 1.0, 0.0)
    if t_un is not None:
        e[:, t_un] = 0.0
    ratio, rest = tensor_ratios(e, df)
    rest_df = df.sum() - df
    with np.errstate(divide="ignore", invalid="ignore"):
        pooled = (e.sum(axis=0) / np.where(df > 0, df, 1)) / (rest.sum(axis=0) / np.where(rest_df > 0, rest_df, 1))
    pooled = np.where(rest.sum(axis=0) > 0, pooled, np.where(e.sum(axis=0) > 0, np.inf, 1.0))
    return {"names": [f"t{i}" for i in range(len(m))], "df": df.tolist(), "vectors": int(canaries),
            "pooled_ratio": pooled.tolist(), "min_ratio": ratio.min(axis=0).tolist()}


def simulated_check(seed: int, *, noise_multiplier: float = 1.0, central: bool = False, canaries: int = 100,
                    dim: int = 445_636, delta: float = 1e-5, unnoised: int = 0,
                    noise_scale: float = 1.0, claim: float | None = None, tensors: Sequence[int] | None = None,
                    **broken_code) -> tuple[str, list[dict]]:
    """One simulated check of one round of DP-Gaussian, judged as :func:`gradleak.run.dp_check.dp_check` judges
    (:func:`judge`): the threat models the mechanism covers (local noise: final model = every round, and each
    upload; central: final model = every round), ``canaries`` + 1 uploads, the claim the accountant makes (RDP, as
    ``dp_gaussian`` claims), statistics from :func:`simulated_statistics` with the breakage asked for. Defaults: the
    text audit's size (``configs/audit/text_adapters.yaml``: 445,636 trainable coordinates). ``claim``: another
    accountant's claimed ε for the same mechanism (DP-SGD's Opacus accountant, ``LocalDpMod``'s); ``broken_code``:
    :func:`simulated_statistics`' breakages of the mechanism's code (``unnoised_tensor``, ``tensor_sizes``,
    ``clip_scale``). ``tensors``: the trainable tensors' sizes (default: the text audit's 14,
    :data:`TEXT_AUDIT_TENSORS`, at its dimension; one tensor otherwise), whose noise summaries
    (:func:`simulated_tensor_statistics`) the per-tensor tests read. Returns (verdict, measurements)."""
    from gradleak.accounting import gaussian_rdp_epsilon

    rng = np.random.default_rng(seed)
    if claim is None:
        claim = gaussian_rdp_epsilon(noise_multiplier, 1, delta)
    if tensors is None:
        tensors = TEXT_AUDIT_TENSORS if dim == sum(TEXT_AUDIT_TENSORS) else (dim,)
    broken = {"unnoised": unnoised, "noise_scale": noise_scale, **broken_code}
    agg, agg_u = simulated_statistics(rng, canaries, dim, noise_multiplier, aggregate_of=canaries + 1, central=central,
                                      **broken)
    trng = np.random.default_rng([seed, 1])  # the tensors' draws: the cosines above stay those of the seed
    un_t = broken_code.get("unnoised_tensor", 0)
    sigma = noise_multiplier / noise_scale
    clip = float(broken_code.get("clip_scale", 1.0))
    stats = {"final_model": {"seen": agg, "unseen": agg_u, "claimed_epsilon": claim,
                             "tensors": simulated_tensor_statistics(trng, tensors, sigma, aggregate_of=canaries + 1,
                                                                    central=central, unnoised=unnoised,
                                                                    unnoised_tensor=un_t, clip=clip)}}
    stats["every_round"] = dict(stats["final_model"])
    if not central:
        s, u = simulated_statistics(rng, canaries, dim, noise_multiplier, **broken)
        stats["each_upload"] = {"seen": s, "unseen": u, "claimed_epsilon": claim,
                                "tensors": simulated_tensor_statistics(trng, tensors, sigma, canaries=canaries,
                                                                       unnoised=unnoised, unnoised_tensor=un_t)}
    verdict, _, measured = judge(stats, claim, delta, dim=dim, seed=seed)
    return verdict, measured
