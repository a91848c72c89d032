"""The sub-edge word-bag test: every vocabulary token scored by the energy of its embedding-adapter direction in a
noisy upload, against the chi-square law of the noise alone (beyond the UTR paper, Sec. 4.2; docs/DESIGN.md §6).

Why. UTR's stage 1 (UTR paper Sec. 4.2; :mod:`gradleak.attacks.common.word_bag`) reads the word bag off the row
space of the embedding adapter's down-projection gradient G (b x n): every row is sum_l delta_jl f_0(x_l). Under
noise the row space is estimated from the singular directions above the noise edge sigma (sqrt(b) + sqrt(n))
(:func:`gradleak.attacks.common.subspace.noisy_subspace`), and below the edge a spectral test of G alone cannot tell
a direction from noise. But the server does not test G alone: it knows every candidate direction, the V token
embeddings. For a unit direction f, ``G f`` is N(0, sigma^2 I_b) under the noise alone, so

    q(f) = ||G f||^2 / sigma^2  ~  chi-square with b degrees of freedom,

while a token of the batch adds ||delta||^2 (f . x_l)^2 to it. A direction of singular value s stands out once
s^2 exceeds the chi-square's spread sigma^2 sqrt(2 b) by a few standard deviations -- s ~ 0.3 x the edge at b = 192,
n = 384 (the edge is sigma (13.9 + 19.6); sqrt(2 b) = 19.6, so z = 4 needs s ~ 8.9 sigma) -- far below the edge the
spectral test needs. The known dictionary is what buys this.

The statistic. Token directions: the embedding row E[v] for position-free models (RoPE: the adapter's input is
E[v]); for BERT the LayerNorm's token part a_v = (E[v] - mean E[v]) * gamma of LN(E[v] + P[p] + T[0]) = (a_v + b_p) / s
+ beta (:mod:`gradleak.attacks.common.bert_pairs`), with the directions every sentence shares -- the bias beta and the
first ``nuisance_positions`` position terms b_p -- projected out first (they carry most of the upload's energy and
would leak into every token's score through its overlap with them), and so is the vocabulary's mean direction
(:func:`unit_directions`: every token shares it, so it too would carry every batch token's energy into every
score). Each direction is normalised, so q(v) is exactly chi-square(b) under noise alone whatever the vocabulary's
geometry.

The decision:

* **against the noise alone** -- token v is significant when its chi-square upper-tail p-value is below alpha / V
  (Bonferroni over the vocabulary: valid whatever the tokens' correlations, so the false-positive rate of "some
  token is significant" on noise alone is at most alpha = 0.2 % (:data:`ALPHA`); tested over 400 draws in
  tests/test_sub_edge.py: 0 of 400);
* **which tokens** (:func:`pursuit`) -- once a signal exists every token's energy moves with its overlap with the
  batch's tokens (measured, MiniLM B = 2 DP-SGD sigma 1e-4: 27,237 of 30,522 tokens pass the cut on their own
  energy, while the 39 batch tokens hold ranks 1-39). So tokens are taken greedily, each orthogonalised against
  those already taken (orthogonal matching pursuit over the dictionary), while the best one still passes the
  same cut: a neighbour of a taken token ("reasons" after "reason") keeps only its orthogonal part, which the
  batch does not hold. [CLS] / [SEP] and BERT's later position terms are candidates too (every sentence holds
  them; they carry energy a test must explain) but are not reported. Measured on that upload: 39 tokens taken, 39
  true. (A first version took every token above the vocabulary's bulk, median + 6 robust sd, as
  :func:`gradleak.attacks.common.subspace.pruned_membership` does: 192 tokens there, 39 true.)

The bag is the tokens taken, in the order taken, at most ``max_tokens``. It is graded by the evaluation as any word
bag: its recall against random bags of the same size drawn from public sentences' tokens (the null: random public
tokens through the same test; :func:`gradleak.evaluation.nulls.word_bag_null`) -- partial when beyond the null's
99th percentile; the enrichment is the bag's precision over the chance rate (|true tokens| / V), the true tokens
among the top k over chance. An empty bag is the computed "information absent" reading at this test's power.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

f64 = torch.float64


def chi2_sf(x: torch.Tensor, dof: int) -> torch.Tensor:
    """Upper-tail probability of chi-square(dof) at ``x`` (float64; scipy's regularised incomplete gamma)."""
    from scipy.special import gammaincc

    return torch.as_tensor(gammaincc(dof / 2.0, x.detach().to(f64).clamp_min(0).numpy() / 2.0), dtype=f64)


def chi2_log_sf(x: torch.Tensor, dof: int) -> torch.Tensor:
    """log of :func:`chi2_sf` without underflow far in the tail (scipy's ``chi2.logsf``)."""
    from scipy.stats import chi2

    return torch.as_tensor(chi2.logsf(x.detach().to(f64).clamp_min(0).numpy(), dof), dtype=f64)


def common_modes_of(A: torch.Tensor, common_modes: int = 1) -> torch.Tensor:
    """(n, m) orthonormal basis of the vocabulary's ``common_modes`` leading shared directions: the mean direction of
    the normalised rows first, then the top principal directions of what is left."""
    A = A.to(f64)
    A = A / A.norm(dim=1, keepdim=True).clamp_min(1e-300)
    if common_modes <= 0:
        return torch.zeros(A.shape[1], 0, dtype=f64)
    m = A.mean(0)
    Q = (m / m.norm().clamp_min(1e-300))[:, None]
    if common_modes > 1:
        R = A - (A @ Q) @ Q.T
        _, _, vh = torch.linalg.svd(R[:: max(1, len(R) // 8192)], full_matrices=False)
        Q = torch.cat([Q, vh[:common_modes - 1].T], 1)
    return Q


def unit_directions(A: torch.Tensor, common_modes: int = 1, basis: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rows of ``A`` with the vocabulary's ``common_modes`` leading shared directions (:func:`common_modes_of`, or
    the given ``basis``) projected out, normalised: a direction every token shares would carry the energy of every
    batch token into every token's score ("all-but-the-top", Mu & Viswanath 2018)."""
    A = A.to(f64)
    A = A / A.norm(dim=1, keepdim=True).clamp_min(1e-300)
    Q = common_modes_of(A, common_modes) if basis is None else basis
    if Q.shape[1]:
        A = A - (A @ Q) @ Q.T
    return A / A.norm(dim=1, keepdim=True).clamp_min(1e-300)


def token_directions(model: Any, nuisance_positions: int = 16, common_modes: int = 1,
                     positions: int = 128) -> tuple[torch.Tensor, str, torch.Tensor]:
    """(V, n) float64 unit token directions of the embedding adapter's input, a one-line description (module
    docstring) and the (P, n) unit directions the batch's states hold besides their tokens that a test must not
    mistake for tokens: E[v] for position-free models (no such directions); BERT's LayerNorm token part with beta
    and the first ``nuisance_positions`` position terms projected out, then the vocabulary's common modes
    (:func:`unit_directions`), and the position terms b_p of the positions after those, up to ``positions``
    (projected the same way; :func:`pursuit` takes them as free candidates)."""
    base = getattr(model, "base_model", model)
    emb = getattr(base, "embeddings", None)
    extra = None
    if emb is not None and hasattr(emb, "position_embeddings") and hasattr(emb, "LayerNorm"):
        E = emb.word_embeddings.weight.detach().to(f64)
        ln = emb.LayerNorm
        g = ln.weight.detach().to(f64)
        A = (E - E.mean(1, keepdim=True)) * g
        Pall = emb.position_embeddings.weight.detach().to(f64)[:max(int(positions), int(nuisance_positions))]
        tt = getattr(emb, "token_type_embeddings", None)
        if tt is not None and len(Pall):
            Pall = Pall + tt.weight.detach().to(f64)[0]
        Ball = (Pall - Pall.mean(1, keepdim=True)) * g
        k = max(0, int(nuisance_positions))
        N = torch.cat([ln.bias.detach().to(f64)[None], Ball[:k]], 0)
        Q = torch.linalg.qr(N.T).Q  # (n, m)
        A = A - (A @ Q) @ Q.T
        rest = Ball[k:] - (Ball[k:] @ Q) @ Q.T
        extra = rest / rest.norm(dim=1, keepdim=True).clamp_min(1e-300)
        what = f"BERT LayerNorm token part, beta and {k} position terms projected out"
    else:
        A = model.get_input_embeddings().weight.detach().to(f64)
        what = "token embeddings E[v]"
    Qm = common_modes_of(A, common_modes)
    F = unit_directions(A, basis=Qm)
    # the extra candidates orthogonal to every direction the tokens' are orthogonal to: taking one must not bring the
    # energy of those (beta, the first positions, the common modes) into the tokens' scores
    extra = torch.zeros(0, F.shape[1], dtype=f64) if extra is None else unit_directions(extra, basis=Qm)
    return F, what + f", {common_modes} common mode(s) out", extra


def _stack(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.detach().to(f64).reshape(-1, g.shape[-1]) for g in grads], 0)  # (M, n)


def energy_scores(grads: list[torch.Tensor], directions: torch.Tensor, sigma: float) -> tuple[torch.Tensor, int]:
    """q(v) = ||G f_v||^2 / sigma^2 for every unit direction (rows of ``directions``) and the degrees of freedom of
    its chi-square law under noise alone (the stacked rows of ``grads``: each observed round's b rows)."""
    G = _stack(grads)
    proj = directions.to(f64) @ G.T  # (V, M)
    return (proj ** 2).sum(1) / float(sigma) ** 2, int(G.shape[0])


def pursuit(G: torch.Tensor, F: torch.Tensor, sigma: float, ok: torch.Tensor, log_cut: float, cap: int,
            proj: Optional[torch.Tensor] = None, extra: Optional[torch.Tensor] = None,
            report: Optional[torch.Tensor] = None) -> list[int]:
    """Greedy selection of the tokens that explain G (orthogonal matching pursuit over the token dictionary F, unit
    rows): take the token whose direction, orthogonalised against the tokens already taken, carries the most energy
    of G; stop when that energy is within the chi-square law of the noise (its log p-value above ``log_cut``, the
    Bonferroni cut) or at ``cap`` tokens. A token similar to one already taken ("reasons" after "reason") keeps only
    its orthogonal part, which the batch does not hold, so it is not taken for its neighbour's energy; under noise
    alone the first step is the plain test, so the false-positive rate is the test's. ``extra``: directions that
    are candidates too but not tokens (BERT's later position terms: the batch's states hold them, and their energy
    would otherwise be taken as tokens'); taking one projects it out and is not reported, nor is a token outside
    ``report`` (special tokens: every sentence holds [CLS] and [SEP], so they carry energy a test must explain,
    but they say nothing about the private text). ``ok``: the tokens that may be taken at all."""
    from scipy.stats import chi2

    M, V = G.shape[0], F.shape[0]
    R = (F @ G.T) if proj is None else proj.clone()  # (V, M): G P_perp f_v, updated as tokens are taken
    if extra is not None and len(extra):
        F = torch.cat([F, extra.to(f64)], 0)
        R = torch.cat([R, extra.to(f64) @ G.T], 0)
        ok = torch.cat([ok, torch.ones(len(extra), dtype=torch.bool)])
    nrm = torch.ones(F.shape[0], dtype=f64)  # ||P_perp f_v||^2
    avail = ok.clone()
    Q = torch.zeros(F.shape[1], 0, dtype=f64)
    chosen: list[int] = []
    taken = 0
    while len(chosen) < cap and taken < min(F.shape[1], cap + (len(F) - V)):
        # the rows' energies in one pass over R (no (V, M) temporary: this loop is the attack's hot spot)
        q = torch.einsum("vm,vm->v", R, R) / (float(sigma) ** 2 * nrm.clamp_min(1e-12))
        q = torch.where(avail & (nrm > 1e-3), q, torch.full_like(q, -1.0))
        v = int(q.argmax())
        if q[v] <= 0 or float(chi2.logsf(float(q[v]), M)) >= log_cut:
            break
        taken += 1
        if v < V and (report is None or bool(report[v])):
            chosen.append(v)
        avail[v] = False
        r = F[v] - Q @ (Q.T @ F[v])
        u = r / r.norm().clamp_min(1e-300)
        c = F @ u  # (V,)
        R.addr_(c, G @ u, alpha=-1.0)  # R -= c (G u)^T, in place
        nrm -= c ** 2
        Q = torch.cat([Q, u[:, None]], 1)
    return chosen


#: the family-wise level of "some token beyond the noise alone": 0.2 %, so that a sample of >= 200 noise-only draws
#: shows a false-positive rate <= 1 % with high probability (P(>= 5 of 400 | 0.2 %) = 0.0014; at alpha = 1 % itself
#: a 400-draw sample showed 1.5 %, within binomial scatter of the bound)
ALPHA = 0.002


def sub_edge_test(grads: list[torch.Tensor], directions: torch.Tensor, sigma: float, alpha: float = ALPHA,
                  z: float = 6.0, max_tokens: Optional[int] = None, exclude: tuple[int, ...] = (),
                  extra: Optional[torch.Tensor] = None, rank_only: bool = False) -> dict[str, Any]:
    """The test of the module docstring on the embedding adapter's observed gradients ``grads`` with per-coordinate
    noise std ``sigma`` (the declared one, :func:`gradleak.defenses.declared.view_noise_std`). Returns

    * ``tokens`` -- the tokens :func:`pursuit` takes (each beyond the noise alone at the Bonferroni cut once the
      tokens before it are projected out), in the order taken, at most ``max_tokens`` (default: the rows), the
      ``exclude`` ones (special tokens) taken but not reported;
    * ``signal_present`` -- some token beyond the noise alone at alpha (Bonferroni over the V tokens);
    * ``min_log10_p`` -- the strongest token's log10 p-value against the chi-square law (before the correction);
    * ``bulk_threshold`` -- the vocabulary-bulk threshold on q (a diagnostic: how far the strongest tokens stand
      out of the vocabulary's bulk); ``scores`` -- q for every token (V,);
    * ``dof``, ``alpha``, ``z``, ``vocabulary``.

    ``rank_only``: an error that is not Gaussian (top-k pruning: bounded by the kept threshold, ``sigma`` its scale
    t; :meth:`gradleak.defenses.update.TopKPruning.observed_error_variance`), whose chi-square law is no null: the
    pursuit ranks ``max_tokens`` tokens with no stopping cut (its order does not depend on ``sigma``), ``tokens`` is
    that ranking and is never a word bag; it is graded against its null -- random public tokens through the same
    ranking (the evaluation's ``sub_edge_enrichment``, :mod:`gradleak.evaluation.text`; docs/DESIGN.md, the
    information limit) -- not by ``signal_present``."""
    G = _stack(grads)
    F = directions.to(f64)
    proj = F @ G.T
    dof = int(G.shape[0])
    q = (proj ** 2).sum(1) / float(sigma) ** 2
    V = q.shape[0]
    ok = torch.ones(V, dtype=torch.bool)
    for v in exclude:
        if v is not None and 0 <= int(v) < V:
            ok[int(v)] = False
    logp = chi2_log_sf(q, dof)
    cut = math.log(alpha / max(int(ok.sum()), 1))
    sig = ok & (logp < cut)
    med = q[ok].median()
    mad = (q[ok] - med).abs().median().clamp_min(1e-12)
    thr = float(med + z * 1.4826 * mad)
    cap = int(max_tokens) if max_tokens is not None else dof
    # every token may explain energy (the special ones too), only the others are reported
    tokens = pursuit(G, F, sigma, torch.ones(V, dtype=torch.bool), math.inf if rank_only else cut, cap, proj=proj,
                     extra=extra, report=ok) if (rank_only or bool(sig.any())) else []
    return {"tokens": tokens, "signal_present": bool(sig.any()),
            "significant_tokens": int(sig.sum()),
            "min_log10_p": max(float(logp[ok].min()) / math.log(10), -300.0),  # finite in JSON
            "bulk_threshold": thr, "scores": q, "dof": dof, "alpha": alpha, "z": z, "vocabulary": int(ok.sum())}


def enrichment(ranked: list[int], true_tokens: set[int], vocabulary: int) -> float:
    """True tokens among ``ranked`` (a top-k) over chance: (hits / k) / (|true| / V); nan for an empty top-k."""
    if not ranked or not true_tokens:
        return float("nan")
    hits = sum(int(v) in true_tokens for v in ranked)
    return (hits / len(ranked)) / (len(true_tokens) / float(vocabulary))


__all__ = ["ALPHA", "chi2_log_sf", "chi2_sf", "common_modes_of", "energy_scores", "enrichment", "pursuit", "sub_edge_test",
           "token_directions", "unit_directions"]
