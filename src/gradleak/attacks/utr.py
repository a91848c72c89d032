"""UTR: exact text reconstruction from the adapter gradients of a frozen LM (SPEC §3, paper 002).

Stage 1 (word bag, SPEC §3.3): every row j of the embedding adapter's down-projection gradient is
``sum_l delta_jl f_0(x_l)`` (§3.2), so the row space S_EA of the stacked gradient is span{f_0 of the batch's
tokens}. We build an orthonormal basis by SVD (float64, relative singular-value cut-off ``rank_rtol``) and test
*every* vocabulary token at once: relative residual ``||f - P f|| / ||f||`` < ``eps_bag``.

* RoPE / position-free models (Llama): f_0(v) = E[v], one (V x n) projection.
* BERT (absolute positions, token types, LayerNorm): f_0(v, p) = LN(E[v] + P[p] + T[0]). We never materialise
  the V x P x n tensor: the LayerNorm is affine in the centred sum, so ``||f||^2`` and ``||Q^T f||^2`` expand into
  V x P matrices built from three matmuls (see :func:`bert_pair_residuals`). The test yields the token bag and
  the maximal length; it cannot place tokens once the batch has T + P + 1 distinct pairs (then every bag token
  passes at every seen position). :func:`bert_pair_decompose` recovers the exact pairs from the gradient's
  coefficients and the ReLU masks (beyond the paper); the positions of [SEP] give the sentence lengths. When the
  upload holds the adapter's up-projection, :mod:`gradleak.attacks.utr_pairs` solves every candidate pair's exact
  bottleneck signal from the up + down equations and drops the pairs no sentence holds (the support test keeps
  false pairs for tokens most sentences share, such as [SEP]).

Stage 2 (sentences, SPEC §3.4) uses the first layer adapter's subspace S_LA = span{h_1 of the batch}:

* causal models (prefix-wise): a token's layer-1 state depends only on its prefix, so starting from BOS we
  extend each prefix by every word-bag token in one batched forward pass (KV cache of the prefix, stopping
  after layer 1) and keep the extensions whose newest state lies in S_LA. Several passing extensions mean
  several batch sentences share the prefix: the search branches (a trie), which *separates the sentences*.
  A sentence ends when no extension passes (the final EOS gets no gradient under the LM loss, so it is
  invisible, SPEC A3.6). With ``value_test`` (one-step uploads), :mod:`gradleak.attacks.utr_causal` then tests
  every complete sentence on the embedding adapter's gradient values, peels the verified ones from the upload and
  searches the rest again -- soft-graded by the upload's strongest directions while the states left still fill
  the bottleneck, strictly once they fit (beyond the paper).
* bidirectional models (whole sentence): the exact (token, position) pairs and [SEP] positions of stage 1 turn
  the search into assigning each position's tokens to B sentences; :mod:`gradleak.attacks.utr_encoder` solves it
  with Hungarian assignments scored by S_LA residuals (construction, point moves, splices, segment swaps) and
  accepts a sentence only when every position passes the membership test (``eps_sentence``). Past the first
  layer's bottleneck (more layer states than rows), :mod:`gradleak.attacks.utr_values` tests each candidate sentence
  on the embedding adapter's gradient values instead (``value_test``; exact for one-step uploads), and grades
  chains by the upload's strongest directions (``soft_rank``).

Filters (SPEC A3.1, not specified in the paper): EICW rejects an extension equal to the previous token unless
nothing else passes (real text does repeat tokens: "very very", "..."). CG/CS -- there is no grammar service
offline -- are built on the LM itself: when more extensions pass than ``max_branches``, the causal LM's own
next-token log-probability ranks them and prunes the tail (``lm_prior``); for the encoder the tie-break is the
EICW rule. Membership, not the prior, decides acceptance, so the prior never introduces wrong text.

Capacity (Theorems 4.1/4.2): rank(S) <= d_bottleneck. When the numerical rank reaches the bottleneck width the
subspace is saturated and the word bag cannot be trusted: ``info["capacity_exhausted"]`` says so and the
attack still returns what it found (never fails silently).

Open decisions recorded (SPEC A3.2/A3.3): S from raw gradient rows (not row/bias ratios: same span, better
conditioned); relative residuals; rank cut-off relative to the largest singular value.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from typing import Literal, Optional, Union

from pydantic import Field, field_validator

from gradleak.attacks.base import AttackBase, AttackConfig, Reconstruction, ThreatModel
from gradleak.errors import BadInput
from gradleak.fl.core import ServerView
from gradleak.peft.text_adapters import PREFIX, adapter_param, capture_inputs
from gradleak.registry import ATTACKS

# ----------------------------------------------------------------------------------------------- linear algebra


@dataclass
class Subspace:
    basis: torch.Tensor  # (n, r) orthonormal, float64
    singular_values: torch.Tensor
    rank: int
    rows: int  # number of gradient rows stacked (the bottleneck width per observed update)
    dim: int  # ambient dimension n
    noise_edge: float = 0.0  # noise mode: the edge sigma (sqrt(rows) + sqrt(n)) of the noise spectrum (0: exact mode)
    tol: float = 0.0  # noise mode: the membership tolerance the noise floor implies (edge / weakest kept value)

    @property
    def saturated(self) -> bool:
        """True when the rank reached the bottleneck width (or the ambient dimension): capacity exhausted."""
        return self.rank >= min(self.rows, self.dim)

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        """Relative residual ||x - P x|| / ||x|| along the last dimension (float64)."""
        x = x.to(torch.float64)
        coef = x @ self.basis
        perp = x - coef @ self.basis.T
        return perp.norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-300)


def gap_index(desc: torch.Tensor, ratio: float = 20.0, below: float = 1.0, largest: bool = False) -> int | None:
    """Index i of a drop desc[i] / desc[i+1] > ``ratio`` in a descending sequence (values after the drop below
    ``below`` * desc[0]): the first such drop, or the largest one with ``largest``. None if there is none."""
    if len(desc) < 2:
        return None
    drop = desc[:-1] / desc[1:].clamp_min(1e-300)
    ok = (drop > ratio) & (desc[1:] < below * desc[0])
    if not bool(ok.any()):
        return None
    return int(torch.where(ok, drop, torch.zeros_like(drop)).argmax()) if largest else int(ok.nonzero()[0])


def stack_rows(grads: list[torch.Tensor]) -> torch.Tensor:
    """The (sum m_i, n) float64 matrix of the stacked gradient rows."""
    return torch.cat([g.detach().to(torch.float64).reshape(-1, g.shape[-1]) for g in grads], 0)


def noisy_subspace(grads: list[torch.Tensor], noise_std: float, margin: float = 1.05,
                   max_rank: int | None = None) -> Subspace:
    """Signal subspace of gradients observed through i.i.d. N(0, noise_std^2) noise on every coordinate.

    The singular values of an M x n matrix of such noise stay below the edge noise_std (sqrt(M) + sqrt(n))
    (Bai-Yin; the Marchenko-Pastur bulk's end), so a direction is signal only when its singular value stands above
    ``margin`` x the edge; below it no test of this matrix can tell it from noise. Rows are *not* normalised (that
    would scale the noise row by row). The tolerance a true member needs grows as the kept directions approach the
    edge: by Wedin's sin-theta bound the estimated basis is off by about edge / s for a direction of singular value
    s, so ``tol`` = edge / s_r (s_r the weakest kept value), capped at 0.5."""
    rows = stack_rows(grads)
    M, n = rows.shape
    _, s, vh = torch.linalg.svd(rows, full_matrices=False)
    edge = float(noise_std) * (M ** 0.5 + n ** 0.5)
    r = int((s > margin * edge).sum())
    if max_rank is not None:
        r = min(r, max_rank)
    tol = min(0.5, edge / float(s[r - 1])) if r else 0.5
    return Subspace(vh[:r].T.contiguous(), s, r, sum(g.shape[0] for g in grads), n, noise_edge=edge, tol=tol)


def subspace_from_gradients(grads: list[torch.Tensor], rank_rtol: float = 1e-5, max_rank: int | None = None,
                            noise_std: float | None = None) -> Subspace:
    """Orthonormal basis of the row space of the stacked (m_i x n) gradients, by SVD in float64.

    ``noise_std`` (> 0): the observed coordinates carry i.i.d. Gaussian noise of that std (a DP / noise defense);
    the rank then comes from the noise spectrum's edge (:func:`noisy_subspace`), not from the float32 gap rule."""
    if noise_std:
        return noisy_subspace(grads, noise_std, max_rank=max_rank)
    rows = stack_rows(grads)
    rows = rows[rows.abs().sum(1) > 0]
    n = rows.shape[1] if rows.ndim == 2 else grads[0].shape[-1]
    if rows.numel() == 0:
        return Subspace(torch.zeros(n, 0, dtype=torch.float64), torch.zeros(0, dtype=torch.float64), 0,
                        sum(g.shape[0] for g in grads), n)
    # Scale rows to unit norm: rank decisions then do not depend on how strongly each neuron fired.
    rows = rows / rows.norm(dim=1, keepdim=True)
    _, s, vh = torch.linalg.svd(rows, full_matrices=False)
    r = int((s > rank_rtol * s[0]).sum())
    # Numerical rank by the noise-floor gap: float32 gradients put the true directions' weakest singular values
    # (tokens with small upstream gradients) within 1e-5 of the largest, and the noise floor ~10^2 below them.
    # The largest drop of more than 20x between consecutive values below 1e-3 * s[0] marks the rank -- the largest,
    # not the first: weak true directions can step down too (measured, MiniLM rf=2 WordNet B=4 seed 4242, 35
    # layer states: 1.1e-2 -> 4.1e-4 (27.8x) at 32, then the noise floor 1.05e-4 -> 1.3e-8 (7932x) at 35; the
    # first drop cut the rank to 32 and no true sentence verified)
    if len(s) > 1 and float(s[0]) > 0:
        k = gap_index(s, below=1e-3, largest=True)
        if k is not None:
            r = k + 1
    r = max(r, 1)
    if max_rank is not None:
        r = min(r, max_rank)
    return Subspace(vh[:r].T.contiguous(), s, r, sum(g.shape[0] for g in grads), n)


def _mp_median(beta: float) -> float:
    """Median of the Marchenko-Pastur law with aspect ratio beta in (0, 1] (unit variance), by quadrature."""
    import numpy as np

    a, b = (1 - beta ** 0.5) ** 2, (1 + beta ** 0.5) ** 2
    x = np.linspace(a, b, 20001)[1:-1]
    f = np.sqrt((b - x) * (x - a)) / (2 * np.pi * beta * x)
    cdf = np.cumsum(f) * (x[1] - x[0])
    return float(x[np.searchsorted(cdf, 0.5 * cdf[-1])])


def estimate_noise_std(grads: list[torch.Tensor]) -> float:
    """Per-coordinate noise std of stacked gradients from their median singular value (Gavish-Donoho 2014):
    sigma = s_med / sqrt(N mu_beta) for an M x N (M <= N) matrix; biased upwards when the signal's rank is a
    sizeable fraction of M."""
    rows = stack_rows(grads)
    M, N = sorted(rows.shape)
    s = torch.linalg.svdvals(rows)
    return float(s.median()) / (N * _mp_median(M / N)) ** 0.5


def bert_pair_residuals(embeddings: nn.Module, sub: Subspace, num_positions: int, token_type: int = 0,
                        chunk: int = 32, dtype: torch.dtype = torch.float32, stop_after: int | None = None,
                        screen: float = 0.05) -> torch.Tensor:
    """Relative residual of f_0(v, p) = LN(E[v] + P[p] + T[type]) for all tokens v and positions p < num_positions.

    With c = centring and u = gamma * c(x): f = u / s + beta, s = sqrt(var(x) + eps), and every squared norm
    splits into a token term, a position term and a V x P cross term. Each quadratic is one matmul of augmented
    vectors ([a, |a|^2/2, 1] . [b, 1, |b|^2/2] = a.b + (|a|^2 + |b|^2)/2). Returns (V, P'); positions are
    scanned in chunks and the scan stops early once ``stop_after`` pairs passed ``screen`` (all of S explained).
    Computed in ``dtype`` (float32: a fast screen, error ~1e-3 relative); confirm the survivors exactly in
    float64 with :func:`bert_pair_exact`.
    """
    f64 = torch.float64
    # token side in ``dtype`` (V x n is the big operand), position side and constants in float64
    E = embeddings.word_embeddings.weight.detach().to(dtype)
    Pm = embeddings.position_embeddings.weight.detach().to(f64)[:num_positions]
    T = embeddings.token_type_embeddings.weight.detach().to(f64)[token_type]
    ln = embeddings.LayerNorm
    gamma = ln.weight.detach().to(f64)
    beta = ln.bias.detach().to(f64)
    eps = float(ln.eps)
    n = E.shape[1]
    Q = sub.basis
    Qd, gd, bd = Q.to(dtype), gamma.to(dtype), beta.to(dtype)
    Ec = E - E.mean(-1, keepdim=True)
    Pc = (Pm + T) - (Pm + T).mean(-1, keepdim=True)
    b_perp = beta - Q @ (Q.T @ beta)
    Ue = Ec * gd
    Ue_perp = Ue - (Ue @ Qd) @ Qd.T
    Up = Pc * gamma
    Up_perp = Up - (Up @ Q) @ Q.T
    V = E.shape[0]
    ones_v = torch.ones(V, 1, dtype=dtype)

    def aug_tok(a):  # token side [a, |a|^2/2, 1]
        return torch.cat([a, (a * a).sum(1, keepdim=True) / 2, ones_v], 1)

    def aug_pos(a, b):  # position side [b, 1, |b|^2/2]
        return torch.cat([a, torch.ones(a.shape[0], 1, dtype=f64), (a * b).sum(1, keepdim=True) / 2], 1).to(dtype)

    t_var, t_res, t_nrm = aug_tok(Ec), aug_tok(Ue_perp), aug_tok(Ue)
    t_lin = torch.cat([Ue_perp @ b_perp.to(dtype)[:, None], Ue @ bd[:, None], ones_v], 1)
    p_var, p_res, p_nrm = aug_pos(Pc, Pc), aug_pos(Up_perp, Up_perp), aug_pos(Up, Up)
    p_lin = torch.stack([torch.ones(len(Pc), dtype=f64), Up_perp @ b_perp, Up @ beta], 1)
    bb, beta2 = float(b_perp @ b_perp), float(beta @ beta)
    out = []
    found = 0
    for a in range(0, Pc.shape[0], chunk):
        sl = slice(a, a + chunk)
        inv_s2 = torch.reciprocal((t_var @ p_var[sl].T).mul_(2.0 / n).add_(eps))
        inv_s = inv_s2.sqrt()
        # linear terms: (u_perp . b_perp) and (u . beta) for token + position parts
        lin_res = t_lin[:, :1] + p_lin[sl, 1].to(dtype)[None] * t_lin[:, 2:]
        lin_nrm = t_lin[:, 1:2] + p_lin[sl, 2].to(dtype)[None]
        res2 = (t_res @ p_res[sl].T).mul_(2).mul_(inv_s2).add_(lin_res.mul_(inv_s).mul_(2)).add_(bb)
        ff = (t_nrm @ p_nrm[sl].T).mul_(2).mul_(inv_s2).add_(lin_nrm.mul_(inv_s).mul_(2)).add_(beta2)
        r = res2.clamp_min_(0).div_(ff.clamp_min_(1e-30)).sqrt_()
        out.append(r)
        found += int((r < screen).sum())
        if stop_after is not None and found >= stop_after and a + chunk < Pc.shape[0]:
            # one more chunk beyond the last hit is cheap insurance against borderline ranks
            if not bool((r < screen).any()):
                break
    return torch.cat(out, 1)


def bert_pair_exact(embeddings: nn.Module, sub: Subspace, tokens: torch.Tensor, positions: torch.Tensor,
                    token_type: int = 0) -> torch.Tensor:
    """Exact float64 relative residuals of explicit f_0(v, p) vectors for the given (token, position) pairs."""
    from gradleak.attacks.utr_pairs import pair_inputs

    return sub.residual(pair_inputs(embeddings, tokens, positions, token_type))


def bert_augmented_bag(embeddings: nn.Module, sub: Subspace, num_positions: int, eps: float,
                       token_type: int = 0) -> tuple[list[int], torch.Tensor]:
    """Word bag of a BERT batch whose (token, position) vectors overflow the bottleneck (beyond the paper).

    With a_v = gamma*c(E[v]) and b_p = gamma*c(P[p] + T), f_0(v, p) = (a_v + b_p) / s_vp + beta. The gradient's
    row space S is m-dimensional inside span{a_v (bag), b_p, beta}; adding the *known* directions b_p (p < P)
    and beta gives back every bag direction a_v as long as the bag has at most m tokens (the coefficient rows
    A_v of the bag tokens are then independent), however many (token, position) pairs there are. So a token is
    in the bag iff a_v lies in S + span{b_p, beta}: one V x n projection. Returns (tokens, residuals)."""
    f64 = torch.float64
    E = embeddings.word_embeddings.weight.detach().to(f64)
    Pm = embeddings.position_embeddings.weight.detach().to(f64)[:num_positions] \
        + embeddings.token_type_embeddings.weight.detach().to(f64)[token_type]
    ln = embeddings.LayerNorm
    g = ln.weight.detach().to(f64)
    A = (E - E.mean(1, keepdim=True)) * g
    Bp = (Pm - Pm.mean(1, keepdim=True)) * g
    aug = torch.cat([sub.basis.T, Bp / Bp.norm(dim=1, keepdim=True), ln.bias.detach().to(f64)[None]
                     / ln.bias.detach().to(f64).norm().clamp_min(1e-300)], 0)
    _, sv, vh = torch.linalg.svd(aug, full_matrices=False)
    Q = vh[: int((sv > 1e-8 * sv[0]).sum())].T
    res = (A - (A @ Q) @ Q.T).norm(dim=1) / A.norm(dim=1).clamp_min(1e-300)
    return (res < eps).nonzero().flatten().tolist(), res


def bert_pair_decompose(embeddings: nn.Module, adapter: nn.Module, grads: list[torch.Tensor], tokens: list[int],
                        num_positions: int, token_type: int = 0, tol: float = 1e-6,
                        max_violations: int = 0, noise_std: float | None = None) -> dict[int, set[int]] | None:
    """Exact (token, position) pairs from the embedding adapter's gradient (beyond the paper, SPEC A3.4).

    Why the span test alone cannot place tokens: f_0(v, p) = (a_v + b_p) / s_vp + beta with a_v = gamma*c(E[v]),
    b_p = gamma*c(P[p] + T), so span{f_0 of the batch} lies in span{a_v (v in bag), b_p (p < P), beta}, of
    dimension T + P + 1. Once the batch has that many distinct pairs, *every* combination (v, p) of bag tokens
    and seen positions is in the span: positions are lost, only the token bag and the maximal length survive.

    The gradient itself keeps them: dL/dW_down = sum_l delta_l f_l^T, so writing G in the (known, linearly
    independent as long as T + P + 1 <= n) basis {a_v, b_p, beta} gives coefficient vectors
    A_v = sum_{l: v_l = v} delta_l / s_l and B_p = sum_{l: p_l = p} delta_l / s_l. delta_l vanishes on the
    bottleneck neurons the ReLU switched off for pair l, and that mask is computable for every candidate pair
    (we know W_down, b_down). A true pair's active mask lies inside supp(A_v) and supp(B_p); a false one breaks
    it on many neurons (measured on RT at B=8, MiniLM rf=1, seeds 0/1/2/4: at tol 1e-6 and no violation allowed 0 true pairs missed and 2/1/7/2 false pairs kept; at 1e-5, 0/0/5/1 missed; one violation allowed keeps 11-17 false pairs). This needs only
    T + P + 1 <= n (not <= the bottleneck width). Returns None when the basis is too large for the hidden size.

    ``noise_std``: the gradient carries i.i.d. N(0, noise_std^2) noise; a coefficient is then nonzero only when it
    stands 3 standard errors (noise_std sqrt([(M M^T)^-1]_ii)) above zero, and a position is reached only when
    its coefficient row's norm does (instead of the float32 relative cut ``tol`` and the norm gap).
    """
    f64 = torch.float64
    T, P = len(tokens), int(num_positions)
    n = embeddings.word_embeddings.weight.shape[1]
    if T == 0 or P == 0 or T + P + 1 > n:
        return None
    toks = torch.tensor(tokens)
    E = embeddings.word_embeddings.weight.detach().to(f64)[toks]
    Pm = embeddings.position_embeddings.weight.detach().to(f64)[:P] \
        + embeddings.token_type_embeddings.weight.detach().to(f64)[token_type]
    ln = embeddings.LayerNorm
    g = ln.weight.detach().to(f64)
    M = torch.cat([(E - E.mean(1, keepdim=True)) * g, (Pm - Pm.mean(1, keepdim=True)) * g,
                   ln.bias.detach().to(f64)[None]], 0)  # (T+P+1, n)
    G = stack_rows(grads)  # (m_total, n)
    X = torch.linalg.lstsq(M.T, G.T).solution  # (T+P+1, m_total)
    XA, XB = X[:T], X[T:T + P]
    if noise_std:
        se = noise_std * torch.linalg.inv(M @ M.T).diagonal().clamp_min(0).sqrt()[:, None]  # standard errors
        sA, sB = XA.abs() > 3 * se[:T], XB.abs() > 3 * se[T:T + P]
        nb = XB.norm(dim=1)
        sB[nb < 3 * se[T:T + P, 0] * XB.shape[1] ** 0.5] = False  # rows at the noise level: position not reached
    else:
        sA = XA.abs() > tol * XA.abs().amax(1, keepdim=True).clamp_min(1e-300)
        sB = XB.abs() > tol * XB.abs().amax(1, keepdim=True).clamp_min(1e-300)
        # positions no sentence reaches have B_p ~ 0 (noise): cut at the largest drop (> 20x) of the sorted norms
        nb = XB.norm(dim=1)
        srt = nb.sort(descending=True).values
        k = gap_index(srt, largest=True)
        if k is not None:
            sB[nb < srt[k]] = False
    W = adapter.down.weight.detach()
    b = adapter.down.bias.detach()
    reps = G.shape[0] // W.shape[0]
    pairs: dict[int, set[int]] = {}
    with torch.no_grad():
        for i0 in range(0, T, 64):  # chunks of tokens: (t, P, m) masks
            x = (E[i0:i0 + 64, None, :] + Pm[None]).to(W.dtype)
            f = torch.nn.functional.layer_norm(x, (n,), ln.weight, ln.bias, ln.eps)
            mask = (f @ W.T + b > 0).repeat(1, 1, reps)
            viol = (mask & ~sA[i0:i0 + 64, None, :]).sum(-1) + (mask & ~sB[None]).sum(-1)
            # under noise the supports are estimates: allow a tenth of the pair's active neurons to break them
            # (measured, MiniLM rf=2 B=2 seed 0, NSR 1e-4: 0 violations allowed loses 12 of 70 true pairs, all
            # of tokens that repeat ("the", "-"); a tenth loses 2 and admits no false pair; a fifth admits 10)
            allowed = (0.1 * mask.sum(-1)).floor() if noise_std else torch.full_like(viol, max_violations)
            best = viol.argmin(1)
            for k in range(viol.shape[0]):
                ok = (viol[k] <= allowed[k]).nonzero().flatten().tolist() or [int(best[k])]
                pairs[int(toks[i0 + k])] = set(ok)
    return pairs


# ----------------------------------------------------------------------------------------------- helpers


def is_causal(model: nn.Module) -> bool:
    return hasattr(model, "lm_head") or "CausalLM" in type(model).__name__


def model_layers(model: nn.Module) -> nn.ModuleList:
    from gradleak.models.text import text_layers

    return text_layers(model)


def collect_grads(view: ServerView, param: str, all_rounds: bool = False) -> list[torch.Tensor]:
    """The attacked update's gradients of one parameter: the latest round's, or every observed round's (the same
    client: the first update of each round; the sum under secure aggregation). Other clients' updates are not
    stacked in: their tokens would join the victim's word bag (a 2-client run reconstructed a mix of both batches)."""
    groups = view.rounds if (all_rounds and view.rounds) else [view.updates]
    out = []
    for ups in groups:
        for u in ups[:1]:
            if param not in u.tensors:
                present = sorted({k.rsplit(".", 2)[0] for k in u.tensors})[:8]
                raise BadInput("update", f"the observed update has no '{param}' (it holds {present}...).",
                               "attach the embedding and first-layer adapters (peft.kind=adapters) so clients "
                               "train and upload them.")
            out.append(u.tensors[param])
    return out


def specials(tokenizer, causal: bool) -> dict[str, int]:
    if causal:
        from gradleak.models.text import causal_specials

        bos, eos = causal_specials(tokenizer)
        return {"bos": bos, "eos": eos, "pad": tokenizer.pad_token_id}
    return {"cls": tokenizer.cls_token_id, "sep": tokenizer.sep_token_id, "pad": tokenizer.pad_token_id,
            "mask": tokenizer.mask_token_id}


# ----------------------------------------------------------------------------------------------- stage 2 search


def extension_inputs(base: nn.Module, prefixes: list[list[int]], cands: torch.Tensor):
    """Inputs of one forward over every one-token extension ``prefix + [c]`` (prefixes all of one length): the
    candidate ids (P*C, 1), the prefixes' KV cache repeated per candidate, and the new position. One forward of the
    prefixes builds the cache (call under ``torch.no_grad``)."""
    from transformers import DynamicCache

    P, C = len(prefixes), len(cands)
    out = base(input_ids=torch.tensor(prefixes), use_cache=True)
    legacy = out.past_key_values.to_legacy_cache() if hasattr(out.past_key_values, "to_legacy_cache") \
        else out.past_key_values
    cache = DynamicCache.from_legacy_cache(tuple(
        (kk.repeat_interleave(C, 0), vv.repeat_interleave(C, 0)) for kk, vv in legacy))
    return cands.repeat(P)[:, None], cache, torch.full((P * C, 1), len(prefixes[0]), dtype=torch.long)


class CausalPrefixSearch:
    """Prefix-wise search for causal LMs (SPEC §3.4 item 4) against a layer subspace probed at adapter ``probe``."""

    def __init__(self, model: nn.Module, probe_names: list[str], sub: Subspace, eps: float, bos: int,
                 candidates: torch.Tensor, max_len: int = 128, max_branches: int = 8, max_sentences: int = 512,
                 eicw: bool = True, lm_prior: bool = True, probe_fn=None, time_budget: float = float("inf")):
        self.time_budget = float(time_budget)
        self.model, self.probe_names, self.sub, self.eps = model, probe_names, sub, eps
        self.adaptive = bool(getattr(sub, "noise_edge", 0.0))  # noise mode: per-prefix tolerance (see run)
        self.bos, self.cands = bos, candidates
        self.max_len, self.max_branches, self.max_sentences = max_len, max_branches, max_sentences
        self.eicw, self.lm_prior = eicw, lm_prior
        self.probe_fn = probe_fn
        self.forwards = 0

    def _newest_states(self, prefixes: list[list[int]], cands: torch.Tensor) -> torch.Tensor:
        """Layer states of ``prefix + [c]`` at the newest position for every prefix (all of one length) and every
        candidate c: one forward of the prefixes builds the KV cache, one forward of all P x C one-token
        extensions (cache repeated per candidate) gives the states. Returns (P, C, d)."""
        model = self.model
        base = model.model if hasattr(model, "model") else model.base_model
        P, C = len(prefixes), len(cands)
        with torch.no_grad():
            ids, cache, pos = extension_inputs(base, prefixes, cands)
            if self.probe_fn is not None:
                h = self.probe_fn(base, ids, cache, pos)
            else:
                cap = capture_inputs(model, self.probe_names, stop=True)
                with cap:
                    base(input_ids=ids, past_key_values=cache, position_ids=pos, use_cache=True)
                h = cap.records[-1][-1]
        self.forwards += 2
        return h[:, -1].reshape(P, C, -1)

    def _lm_rank(self, prefix: list[int], toks: list[int]) -> list[int]:
        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor([prefix])).logits[0, -1]
        lp = torch.log_softmax(logits.double(), -1)
        return sorted(toks, key=lambda t: -float(lp[t]))

    def run(self) -> tuple[list[list[int]], dict[str, Any]]:
        """Breadth-first over the trie of prefixes: every level extends all live prefixes at once."""
        sentences: list[list[int]] = []
        frontier = [[self.bos]]
        pruned = 0
        chunk = max(1, 4096 // max(1, len(self.cands)))  # prefixes per forward (bounds the repeated cache)
        t0, truncated = time.perf_counter(), False
        floor: list[float] = []  # noise mode: residuals of accepted extensions (the true members' noise floor)
        while frontier and len(sentences) < self.max_sentences:
            if time.perf_counter() - t0 > self.time_budget:  # a loose tolerance lets the trie explode
                sentences += [p[1:] for p in frontier[:self.max_sentences - len(sentences)]]
                truncated = True
                break
            if len(frontier[0]) >= self.max_len:
                sentences += [p[1:] for p in frontier]
                break
            nxt: list[list[int]] = []
            for a in range(0, len(frontier), chunk):
                part = frontier[a:a + chunk]
                res = self.sub.residual(self._newest_states(part, self.cands))  # (P, C)
                for prefix, r in zip(part, res):
                    eps = self.eps
                    if self.adaptive:
                        # noisy uploads: a true extension must beat half the prefix's median candidate (mostly
                        # non-members) and stay within 10x of the residual true extensions had so far (measured,
                        # SmolLM2 rf=2 B=2 seed 0, NSR 1e-4: true extensions 2e-4..5e-4 at every step, the best
                        # false one 0.01..0.1, while the edge's tolerance is 0.069)
                        if not floor:
                            floor.append(float(r.min()))
                        eps = min(eps, 10.0 * float(torch.tensor(floor).median()))
                        if len(r) >= 8:
                            eps = min(eps, 0.5 * float(r.median()))
                    ok = (r < eps).nonzero().flatten()
                    if self.adaptive and len(ok):
                        floor.extend(float(x) for x in r[ok][:1])
                    passing = [int(self.cands[i]) for i in ok[r[ok].argsort()].tolist()]
                    if self.eicw and len(passing) > 1:
                        non_rep = [t for t in passing if t != prefix[-1]]
                        passing = non_rep or passing
                    if not passing:
                        if len(prefix) > 1:
                            sentences.append(prefix[1:])
                        continue
                    if len(passing) > self.max_branches:
                        ranked = self._lm_rank(prefix, passing) if self.lm_prior else passing
                        pruned += len(passing) - self.max_branches
                        passing = ranked[:self.max_branches]
                    nxt.extend(prefix + [t] for t in passing)
            frontier = nxt[:max(0, self.max_sentences * self.max_branches)]
        return sentences, {"forward_passes": self.forwards, "pruned_branches": pruned, "search_truncated": truncated}


# ----------------------------------------------------------------------------------------------- the attack


def cap_to_batch(sents: list[list[int]], info: dict[str, Any], batch_size: int | None, causal: bool) -> list[list[int]]:
    """Order verified sentences first and return at most ``batch_size`` of them (when the server knows B).

    Verified = passed the membership test at every position: the encoder search reports how many of its
    (verified-first) chains passed; every sentence the causal trie search completes passed at each prefix,
    which proves it only while the subspace is not saturated and the search did not run out of time.
    ``info["verified"]`` gets one flag per returned sentence.
    """
    if causal and info.get("value_verified"):  # the value test checked every sentence (verified ones first)
        k = int(info.get("verified_sentences", 0) or 0)
        flags = [i < k for i in range(len(sents))]
    elif causal:
        proven = not info.get("search_truncated", False) and not info.get("capacity_exhausted", False)
        flags = [proven] * len(sents)
        if batch_size and len(sents) > batch_size:  # spurious branches die early: keep the longest
            order = sorted(range(len(sents)), key=lambda i: -len(sents[i]))[:batch_size]
            sents = [sents[i] for i in sorted(order)]
            flags = flags[:len(sents)]
    else:
        k = int(info.get("verified_sentences", 0) or 0)
        flags = [i < k for i in range(len(sents))]
    if batch_size and len(sents) > batch_size:
        sents, flags = sents[:batch_size], flags[:batch_size]
    info["verified"] = flags
    info["verified_sentences"] = int(sum(flags))
    info["unverified_sentences"] = len(sents) - int(sum(flags))
    return sents



class SpanTestConfig(AttackConfig):
    """Parameters every subspace-membership text attack shares (UTR, DAGER)."""

    eps_bag: float = Field(1e-3, gt=0, lt=1, description="token membership tolerance (relative residual)")
    eps_sentence: float = Field(1e-3, gt=0, lt=1, description="sentence membership tolerance (relative residual)")
    rank_rtol: float = Field(1e-5, gt=0, lt=1, description="relative singular-value cut-off of the SVD")
    max_positions: int = Field(128, ge=1, description="positions tested for absolute-position models")
    max_len: int = Field(128, ge=2, description="longest sentence the causal search builds")
    screen_tol: float = Field(0.05, gt=0, lt=1, description="coarse screen of (token, position) pairs")


class UTRConfig(SpanTestConfig):
    noise: Union[float, Literal["public", "none", "estimate"]] = Field(
        "public", description="noise on the observed gradients: 'public' = the per-coordinate std the published "
        "update defenses imply (DP / Gaussian noise; exact tests when there is none), 'none' = exact tests, "
        "'estimate' = from the spectrum (Gavish-Donoho median rule), or a known std (float > 0)")

    max_branches: Optional[int] = Field(None, ge=1, description="trie branching cap (default max(8, B))")
    eicw: bool = Field(True, description="consecutive-identical-word filter")
    lm_prior: bool = Field(True, description="rank branches past the cap by the LM")
    all_rounds: bool = Field(True, description="stack the embedding-adapter gradients of every observed round")
    sentence_layer: str = Field("layer_0", description="adapter whose input space tests sentences")
    time_budget: float = Field(600.0, gt=0, description="seconds before the sentence search stops")
    value_test: bool = Field(True, description="test candidate sentences on the embedding adapter's gradient values "
                             "(one-step uploads): past the first layer's bottleneck, bidirectional models move chains "
                             "by it, causal models verify sentences, peel them from the upload and search the rest")
    soft_rank: Optional[float] = Field(0.96, gt=0, le=1, description="past the first layer's bottleneck (with the "
                                       "value test): grade chains by this fraction of the upload's strongest "
                                       "directions instead of its whole (saturated) row space; null = off")
    threads: Optional[int] = Field(1, ge=1, le=1024, description="torch threads during the attack (the run's "
                                   "`threads` for the client steps is untouched); default 1: the search is many "
                                   "small float64 products that gain nothing from threads and slow down 3-4x when "
                                   "two threads share a loaded 2-core machine; null = the run's setting")

    @field_validator("noise")
    @classmethod
    def _noise_positive(cls, v):
        if isinstance(v, float) and v <= 0:
            raise ValueError("a noise std must be > 0 (use 'none' for exact tests)")
        return v


@ATTACKS.register("utr", "UTR: word bag from the embedding adapter + sentence search on the first layer adapter")
class UTRAttack(AttackBase):
    """Honest-but-curious server (SPEC §3.1): reads only the ServerView (model sent, adapter gradients, tokenizer).

    Parameters: ``eps_bag`` / ``eps_sentence`` -- membership tolerances (relative residual) for stage 1 / 2;
    ``rank_rtol`` -- relative singular-value cut-off of the SVD; ``max_positions`` -- positions tested for
    absolute-position models; ``max_branches`` -- trie branching cap (LM prior prunes beyond it; default: the
    batch size, at least 8 -- B sentences can branch B ways at the root);
    ``eicw`` -- consecutive-identical-word filter; ``all_rounds`` -- stack the embedding-adapter gradients of every
    observed round (beyond the paper: the bag's capacity grows from d_bottleneck towards d_hidden);
    ``time_budget`` -- seconds after which the sentence search stops (``info["search_truncated"]``).
    """

    name = "utr"
    Config = UTRConfig

    @classmethod
    def audit_variants(cls, params, defenses):
        """Against a declared update defense the published noise level need not be the one the upload carries
        (quantisation; a std too small to matter): the audit also runs the noise read off the upload's spectrum
        ('estimate', measured: stochastic quantisation 16 bits ROUGE-1 50.8 -> 97.9). Exact tests ('none') on a
        noisy upload only exhaust the search's time budget, so they are not a variant."""
        if defenses and params.get("noise", "public") != "estimate":
            return [{"noise": "estimate", "time_budget": min(float(params.get("time_budget", 600.0)), 120.0)}]
        return []
    modality = "text"
    peft_kinds = ("adapters",)
    reconstruction = "token_sequences"
    devices = ("cpu",)  # the exact subspace tests run in float64 on the CPU copy of the gradients

    def __init__(self, eps_bag: float = 1e-3, eps_sentence: float = 1e-3, rank_rtol: float = 1e-5,
                 max_positions: int = 128, max_len: int = 128, max_branches: int | None = None, eicw: bool = True,
                 lm_prior: bool = True, all_rounds: bool = True, sentence_layer: str = "layer_0",
                 screen_tol: float = 0.05, time_budget: float = 600.0, threads: int | None = 1,
                 noise: float | str = "public", value_test: bool = True, soft_rank: float | None = 0.96):
        self.eps_bag, self.eps_sentence, self.rank_rtol = float(eps_bag), float(eps_sentence), float(rank_rtol)
        self.max_positions, self.max_len = int(max_positions), int(max_len)
        self.max_branches = None if max_branches is None else int(max_branches)
        self.eicw, self.lm_prior, self.all_rounds = bool(eicw), bool(lm_prior), bool(all_rounds)
        self.sentence_layer = sentence_layer
        self.screen_tol = float(screen_tol)
        self.time_budget = float(time_budget)
        self.threads = None if threads is None else int(threads)
        self.noise = noise
        self.value_test = bool(value_test)
        self.soft_rank = None if soft_rank is None else float(soft_rank)

    def noise_std(self, view: ServerView, grads: list[torch.Tensor]) -> float | None:
        """Per-coordinate std of the noise on the observed uploads (see ``noise``), or None: exact tests."""
        if self.noise == "none":
            return None
        if isinstance(self.noise, (int, float)):
            return float(self.noise)
        if self.noise == "estimate":
            return estimate_noise_std(grads)
        from gradleak.defenses.update import coordinate_noise_std

        specs = view.public.get("update_defenses") or []
        rounding = float(view.public.get("upload_rounding_std") or 0.0)  # a weight reply's rounding (Flower)
        if not specs or not view.updates:
            return rounding if rounding > 0 else None
        std = coordinate_noise_std(specs, view.updates[0], aggregate_of=int(view.public.get("clients") or 1),
                                   individual=not view.secure_aggregation)
        if std is None:
            return rounding if rounding > 0 else None
        return (std ** 2 + rounding ** 2) ** 0.5

    def prepare(self, model: nn.Module, threat: ThreatModel) -> nn.Module:
        return model  # honest: no model modification (SPEC §3.1)

    # -- stage 1
    def exact_pairs(self, view: ServerView, pairs: dict[int, set[int]], tokens: list[int], npos: int,
                    sigma: float | None = None) -> tuple[dict[int, set[int]], dict | None, dict[str, Any]]:
        """Stage 1's pairs cleaned by every candidate's exact bottleneck signal (:mod:`gradleak.attacks.utr_pairs`):
        needs the embedding adapter's up-projection in the upload; when the support test's pairs do not fit the
        equations (a true pair missed), the candidates of one allowed support violation are solved instead.
        Under noise the equations hold only approximately: not tried. Returns (pairs, signals or None, info)."""
        from gradleak.attacks.utr_pairs import refine_pairs

        if sigma:
            return pairs, None, {"exact_pairs": "not tried (noisy upload)"}
        model = view.model
        up = view.updates[0].tensors if view.updates else {}
        parts = ("down.weight", "down.bias", "up.weight", "up.bias")
        if not pairs or any(adapter_param("embedding", k) not in up for k in parts):
            return pairs, None, {"exact_pairs": "not tried (no up-projection in the upload)"}
        grads = {k: collect_grads(view, adapter_param("embedding", k))[0] for k in parts}
        emb, ad = model.base_model.embeddings, getattr(model, PREFIX)["embedding"]
        ref = refine_pairs(emb, ad, grads, pairs)
        tried = 0
        if ref is None:
            tried = 1
            wide = bert_pair_decompose(emb, ad, [grads["down.weight"]], tokens, npos, max_violations=1)
            ref = refine_pairs(emb, ad, grads, wide) if wide is not None else None
        if ref is None:
            return pairs, None, {"exact_pairs": "no fit (not a one-step upload?)"}
        clean, signals, info = ref
        return clean, signals, {"exact_pairs": "ok", "exact_pairs_violations_allowed": tried,
                                "exact_pairs_dropped": sum(len(p) for p in pairs.values()) - sum(
                                    len(p) for p in clean.values()),
                                "exact_pairs_fit": info["fit_median"]}

    def word_bag(self, view: ServerView) -> dict[str, Any]:
        model = view.model
        if not hasattr(model, PREFIX) or "embedding" not in getattr(model, PREFIX):
            raise BadInput("peft", "the model the server sent has no embedding adapter.",
                           "use peft.kind=adapters with the embedding adapter enabled.")
        t0 = time.perf_counter()
        grads = collect_grads(view, adapter_param("embedding"), all_rounds=self.all_rounds)
        sigma = self.noise_std(view, grads)
        sub = subspace_from_gradients(grads, self.rank_rtol, noise_std=sigma)
        eps_bag = max(self.eps_bag, sub.tol)  # noise mode: the tolerance the noise floor implies
        causal = is_causal(model)
        if causal:
            E = model.get_input_embeddings().weight.detach()
            res = sub.residual(E)
            tokens = (res < eps_bag).nonzero().flatten().tolist()
            if sigma and len(tokens) > sub.rank:  # noise: one direction per distinct token, keep the best `rank`
                tokens = sorted(res.argsort()[: sub.rank].tolist())
            pairs = {int(v): set() for v in tokens}
            min_res = res
            positions_ok, augmented = True, False
            signals, exact_info, support = None, {}, None
        else:
            emb = model.base_model.embeddings
            npos = min(self.max_positions, emb.position_embeddings.weight.shape[0])
            positions_ok, augmented = True, False
            pairs, tokens, min_res = {}, [], None
            signals, exact_info, support = None, {}, None
            # Near or at the bottleneck (BERT pairs fill S), test tokens against S + span{b_p, beta} instead; under
            # noise too: distinct tokens' a_v stand far apart (random tokens' residual ~0.4), while a pair's nearest
            # false pair (the same token at the next position) is a few degrees away and drowns first (measured,
            # MiniLM rf=2 B=2 seed 0, per-coordinate noise-to-signal 1e-3: true tokens <= 0.061 against >= 0.409;
            # pairs: true up to 0.073, 435 false pairs below that)
            if sigma and sub.rank + npos + 1 < sub.dim:
                _, min_res = bert_augmented_bag(emb, sub, npos, eps_bag)
                floor = float(min_res.kthvalue(max(1, len(min_res) // 100)).values)  # non-members' lower tail
                eps_bag = min(eps_bag, 0.5 * floor)
                cand = [v for v in (min_res < eps_bag).nonzero().flatten().tolist() if v != model.config.pad_token_id]
                dec = bert_pair_decompose(emb, getattr(model, PREFIX)["embedding"],
                                          collect_grads(view, adapter_param("embedding")), cand, npos,
                                          noise_std=sigma) if cand else None
                if dec is not None:
                    pairs = {v: ps for v, ps in dec.items() if ps}
                    tokens, augmented = sorted(pairs), True
                else:
                    positions_ok = False
            elif sub.rank >= 0.8 * sub.rows and sub.rows < sub.dim and sub.rank + npos + 1 < sub.dim:
                cand, min_res = bert_augmented_bag(emb, sub, npos, eps_bag)
                cand = [v for v in cand if v != model.config.pad_token_id]
                dec = None
                if 0 < len(cand) < sub.rows:
                    dec = bert_pair_decompose(emb, getattr(model, PREFIX)["embedding"],
                                              collect_grads(view, adapter_param("embedding")), cand, npos,
                                              noise_std=sigma)
                if dec is not None:
                    pairs = {v: ps for v, ps in dec.items() if ps}
                    support = pairs
                    pairs, signals, exact_info = self.exact_pairs(view, pairs, cand, npos, sigma)
                    tokens, augmented = sorted(pairs), True
                else:
                    positions_ok = False
            else:
                screen = min(0.9, max(self.screen_tol, 10 * eps_bag))
                R = bert_pair_residuals(emb, sub, npos, stop_after=None if sigma else sub.rank, screen=screen)
                vv, pp = (R < screen).nonzero(as_tuple=True)
                if len(vv) > 200_000:  # saturated subspace: everything passes the screen; keep the best ones
                    keep = R[vv, pp].argsort()[:200_000]
                    vv, pp = vv[keep], pp[keep]
                exact = bert_pair_exact(emb, sub, vv, pp)
                ok = exact < eps_bag
                if sigma and int(ok.sum()) > sub.rank:  # noise: one direction per distinct pair, keep the best
                    ok = torch.zeros_like(ok)
                    ok[exact.argsort()[: sub.rank]] = True
                for v, p in zip(vv[ok].tolist(), pp[ok].tolist()):
                    pairs.setdefault(int(v), set()).add(int(p))
                tokens = sorted(pairs)
                min_res = R.min(1).values.double()
                if pairs and not sub.saturated:
                    npos_seen = 1 + max(p for ps in pairs.values() for p in ps)
                    dec = bert_pair_decompose(emb, getattr(model, PREFIX)["embedding"],
                                              collect_grads(view, adapter_param("embedding")), tokens, npos_seen,
                                              noise_std=sigma)
                    if dec is not None:
                        pairs = dec
                        support = pairs
                        pairs, signals, exact_info = self.exact_pairs(view, pairs, tokens, npos_seen, sigma)
                    else:  # T + P + 1 > n: the bag is right but tokens cannot be placed (capacity for positions)
                        positions_ok = False
                elif sub.saturated:
                    pairs, tokens, positions_ok = {}, [], False
        secs = time.perf_counter() - t0
        return {"tokens": tokens, "pairs": pairs, "subspace": sub, "seconds": secs, "min_residual": min_res,
                "causal": causal, "positions_ok": positions_ok, "augmented": augmented, "noise_std": sigma,
                "eps_bag": eps_bag, "signals": signals, "support_pairs": support, **exact_info}

    def _causal_peel(self, view: ServerView, bag: dict, sp: dict, cands: torch.Tensor, sents: list[list[int]],
                     sinfo: dict[str, Any], eps_sentence: float) -> tuple[list[list[int]], dict[str, Any]]:
        """Causal models: test the prefix search's sentences on the gradient values, peel the verified ones from the
        upload and search the rest again, soft-graded past the bottleneck (:mod:`gradleak.attacks.utr_causal`).
        Keeps the prefix search's result when the value test cannot be set up (bag wider than the bottleneck)."""
        from gradleak.attacks.utr_causal import CausalPeelSearch, CausalValueTest

        model = view.model
        upload = view.updates[0].tensors
        mods = getattr(model, PREFIX)
        names = [self.sentence_layer]  # and the adapter after it, when there is one: a second soft grade
        if self.sentence_layer.startswith("layer_"):
            nxt = f"layer_{int(self.sentence_layer.split('_')[-1]) + 1}"
            names += [nxt] if nxt in mods else []
        keys = tuple(adapter_param(n) for n in names)
        if any(k not in upload for k in keys + (adapter_param("embedding", "up.weight"),)):
            return sents, sinfo
        pad = sp["pad"] if sp["pad"] is not None else sp["bos"]
        test = CausalValueTest(model, upload, bag["tokens"], pad, peel_names=keys)
        if not test.usable:
            return sents, {**sinfo, "value_test": "unusable"}
        B = view.public.get("batch_size")

        def strict(sub: Subspace, c: torch.Tensor) -> list[list[int]]:
            return CausalPrefixSearch(model, [self.sentence_layer], sub, eps_sentence, sp["bos"], c,
                                      max_len=self.max_len, max_branches=self.max_branches or max(8, int(B or 8)),
                                      max_sentences=max(4 * int(B or 64), 64), time_budget=self.time_budget,
                                      eicw=self.eicw, lm_prior=self.lm_prior).run()[0]

        peel = CausalPeelSearch(model, names, test, cands, sp["bos"], sp["eos"], B, eps=eps_sentence,
                                rank_rtol=self.rank_rtol, max_len=self.max_len, time_budget=self.time_budget,
                                strict_search=strict)
        out, pinfo = peel.run(first=sents)
        info = {**sinfo, **pinfo, "value_verified": True, "joint_residual": pinfo["upload_left_after_peeling"],
                "forward_passes": sinfo.get("forward_passes", 0) + pinfo["forward_passes"],
                "search_truncated": bool(sinfo.get("search_truncated")) or pinfo["search_truncated"]}
        kept = min(len(out), int(B)) if B else len(out)  # cap_to_batch keeps the verified ones first
        info["unverified_sentences"] = kept - pinfo["verified_sentences"]
        if pinfo["upload_left_after_peeling"] > 1e-4:  # part of the batch is missing: not verified jointly
            info["joint_residual"] = None
        return out, info

    def reconstruct(self, view: ServerView) -> Reconstruction:
        prev = torch.get_num_threads()
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        try:
            return self._reconstruct(view)
        finally:
            torch.set_num_threads(prev)

    def _reconstruct(self, view: ServerView) -> Reconstruction:
        tok = view.public.get("tokenizer")
        if tok is None:
            raise BadInput("view.public.tokenizer", "the attack needs the (public) tokenizer of the model.",
                           "put the tokenizer into ServerView.public['tokenizer'].")
        bag = self.word_bag(view)
        sub_ea: Subspace = bag["subspace"]
        model = view.model
        t1 = time.perf_counter()
        grads_la = collect_grads(view, adapter_param(self.sentence_layer), all_rounds=False)
        sub_la = subspace_from_gradients(grads_la, self.rank_rtol, noise_std=bag["noise_std"])
        eps_sentence = max(self.eps_sentence, sub_la.tol)
        sp = specials(tok, bag["causal"])
        la_saturated = sub_la.rank >= 0.9 * min(sub_la.rows, sub_la.dim)
        if bag["causal"]:
            cands = torch.tensor([t for t in bag["tokens"] if t not in (sp["bos"], sp["pad"])] or [sp["bos"]])
            search = CausalPrefixSearch(model, [self.sentence_layer], sub_la, eps_sentence, sp["bos"], cands,
                                        max_len=self.max_len,
                                        max_branches=self.max_branches or max(8, int(view.public.get("batch_size") or 8)),
                                        max_sentences=max(4 * int(view.public.get("batch_size") or 64), 64),
                                        time_budget=self.time_budget,
                                        eicw=self.eicw, lm_prior=self.lm_prior)
            sents, sinfo = search.run()
            if self.value_test and not bag["noise_std"]:
                sents, sinfo = self._causal_peel(view, bag, sp, cands, sents, sinfo, eps_sentence)
        elif not bag["positions_ok"]:
            # bidirectional model past its positional capacity: every bag token passes at every position, a
            # sentence search over that would only burn time -- report the bag, no sentences
            sents, sinfo = [], {"forward_passes": 0, "positions_lost": True}
        else:
            from gradleak.attacks.utr_encoder import EncoderChainSearch

            value_test = None
            if self.value_test and not bag["noise_std"]:
                from gradleak.attacks.utr_values import TokenGradientTest

                value_test = TokenGradientTest(model, collect_grads(view, adapter_param("embedding"))[0],
                                               bag["pairs"], signals=bag["signals"])
            search = EncoderChainSearch(model, self.sentence_layer, sub_la, eps_sentence, sp["cls"], sp["sep"],
                                        sp["mask"], bag["pairs"], view.public.get("batch_size"),
                                        time_budget=self.time_budget,
                                        # S_LA saturated: chains verified in subsets are peeled out of S_LA;
                                        # the whole batch is verified jointly (beyond the paper)
                                        joint=la_saturated, value_test=value_test, layer_grad=grads_la[0],
                                        soft_rank=self.soft_rank)
            sents, sinfo = search.run()
        t2 = time.perf_counter()
        info = {
            "word_bag": bag["tokens"],
            "word_bag_size": len(bag["tokens"]),
            "word_bag_pairs": sum(len(p) for p in bag["pairs"].values()),
            "rank_embedding_adapter": sub_ea.rank,
            "rank_layer_adapter": sub_la.rank,
            "bottleneck_rows": sub_ea.rows,
            # S_LA holds one vector per distinct layer state (every token of a bidirectional batch, every distinct
            # prefix of a causal one); near its ceiling the float32 noise floor blurs the rank (measured: SmolLM2
            # rf=1 B=32, 776 states in d=576, numerical rank 547) -- flag from 90 % of the ceiling on
            # (BERT past the bottleneck: the augmented bag and the joint batch test verify it; then not exhausted)
            "capacity_exhausted": bool(((sub_ea.saturated and not bag["augmented"]) or not bag["positions_ok"]
                                        or la_saturated)
                                       and not (sinfo.get("joint_residual") is not None
                                                and sinfo.get("unverified_sentences") == 0)),
            "noise_std": bag["noise_std"],
            "noise_edge_embedding_adapter": sub_ea.noise_edge,
            "eps_bag_used": bag["eps_bag"],
            "eps_sentence_used": eps_sentence,
            "word_bag_seconds": bag["seconds"],
            "word_bag_augmented": bool(bag["augmented"]),
            **{k: v for k, v in bag.items() if k.startswith("exact_pairs")},
            "sentence_seconds": t2 - t1,
            **sinfo,
        }
        if info["capacity_exhausted"]:
            info["warning"] = ("token positions unrecoverable: bag tokens + positions + 1 exceed the hidden size "
                               "(bidirectional model); word bag only. " if not bag["positions_ok"] else "") + (
                               f"gradient subspace saturated (rank {sub_ea.rank}/{sub_la.rank} vs {sub_ea.rows} "
                               "bottleneck rows): the batch holds more distinct token vectors than the adapter "
                               "can store; the word bag and the sentences are unreliable beyond this point.")
        sents = cap_to_batch(sents, info, view.public.get("batch_size"), bag["causal"])
        if bag["noise_std"]:  # a test at the noise floor's tolerance proves nothing exact: no sentence is "verified"
            info["passed_noise_tolerance"] = info.get("verified_sentences", 0)
            info["verified"] = [False] * len(sents)
            info["verified_sentences"], info["unverified_sentences"] = 0, len(sents)
            info["warning"] = (info.get("warning", "") + f" noisy uploads (per-coordinate std {bag['noise_std']:.3g} from "
                               f"the update defenses): ranks from the noise spectrum's edge, membership at tolerances "
                               f"{bag['eps_bag']:.3g} (tokens) / {eps_sentence:.3g} (sentences); nothing is verified "
                               "exactly.").strip()
        return Reconstruction(data=sents, info=info)
