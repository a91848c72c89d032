"""BERT-family (token, position) pairs against a gradient subspace: UTR's stage 1 on absolute-position encoders
(UTR paper Sec. 4.2), shared with DAGER's layer-0 check.

f_0(v, p) = LN(E[v] + P[p] + T[type]) is the frozen embedding output of token v at position p. We never materialise
the V x P x n tensor: the LayerNorm is affine in the centred sum, so ``||f||^2`` and ``||Q^T f||^2`` expand into
V x P matrices built from three matmuls (:func:`bert_pair_residuals`). The test yields the token bag and the maximal
length; it cannot place tokens once the batch has T + P + 1 distinct pairs (then every bag token passes at every seen
position). :func:`bert_pair_decompose` recovers the exact pairs from the gradient's coefficients and the ReLU masks
(beyond the paper); :func:`bert_augmented_bag` reads the bag past the bottleneck.
"""

from __future__ import annotations

import torch
from torch import nn

from gradleak.attacks.common.pair_signals import pair_inputs
from gradleak.attacks.common.subspace import Subspace, gap_index, stack_rows


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
    """Exact (token, position) pairs from the embedding adapter's gradient (beyond the paper; open point A3.4, docs/PAPERS.md).

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
    M, E, Pm = embedding_basis(embeddings, tokens, P, token_type)  # (T+P+1, n)
    ln = embeddings.LayerNorm
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



def embedding_basis(embeddings: nn.Module, tokens: list[int], num_positions: int,
                    token_type: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The known basis a BERT embedding layer's output lies in, float64 (T + P + 1, n): each token's LayerNorm-scaled
    centred word embedding, each position's (position + token-type embedding, centred, scaled), and the LayerNorm
    bias -- the rows :func:`bert_pair_decompose` and :func:`bert_pair_ranked` write an adapter's gradient in; with the
    tokens' and positions' raw embeddings (float64), which both feed the layer again to get each pair's ReLU mask."""
    f64 = torch.float64
    E = embeddings.word_embeddings.weight.detach().to(f64)[torch.tensor(tokens)]
    Pm = embeddings.position_embeddings.weight.detach().to(f64)[:int(num_positions)] \
        + embeddings.token_type_embeddings.weight.detach().to(f64)[token_type]
    ln = embeddings.LayerNorm
    g = ln.weight.detach().to(f64)
    return torch.cat([(E - E.mean(1, keepdim=True)) * g, (Pm - Pm.mean(1, keepdim=True)) * g,
                      ln.bias.detach().to(f64)[None]], 0), E, Pm


def bert_pair_ranked(embeddings: nn.Module, adapter: nn.Module, grads: list[torch.Tensor], tokens: list[int],
                     num_positions: int, noise_std: float, sep: int, cls: int | None = None, per_token: int = 2,
                     sep_positions: int = 4, z: float = 2.0, reach_z: float = 5.0,
                     token_type: int = 0) -> tuple[dict[int, set[int]], int] | None:
    """Stage 1's (token, position) pairs read by *rank* on a clipped noisy upload (beyond the paper; the fallback
    of UTR's sentence search under DP-SGD, :meth:`gradleak.attacks.utr.UTRAttack._ranked_reading`). Returns (pairs, the last reached position), or None
    when the basis is too large for the hidden size or no position stands above the noise.

    Why. :func:`bert_pair_decompose` keeps a pair when its ReLU mask breaks the supports of the coefficient rows
    A_v, B_p on at most a tenth of its active neurons, a coefficient counting as nonzero 3 standard errors above
    zero. Under DP-SGD (Abadi et al. 2016) each sentence enters the upload as c_i g_i / B with c_i = min(1, C /
    ||g_i||) while the noise std stays sigma C / B, so every coefficient shrinks by c_i against the same standard
    errors and most true coefficients fall under the cut: true pairs break their supports as often as false ones
    (measured, MiniLM B = 4, DP-SGD sigma 1e-6, seed 12, c_i ~ 0.19: violation fraction median 0.20 for the true
    pairs, 0.21 for the false; no position passes the tenth, each token falls back to its fewest violations, and 43
    of 71 bag tokens and [SEP] land at position 1 -- four empty chains).

    What survives. (i) How far the batch reaches: under noise alone ||B_p||^2 / se_p^2 is chi-square with m (the
    stacked rows) degrees of freedom, so a position is reached when it stands ``reach_z`` standard deviations above
    m (measured on that upload: 15.6 to 13,000 x m at positions 1-55, 0.86-1.12 x m at 56-63) -- the last reached position
    is the longest sentence's [SEP]. (ii) The order of a token's positions by its violation fraction at a
    ``z``-standard-error cut (2: the true position is a token's best for 61 of the 104 true pairs, one of its two
    best for 77; at 3: best for 50). So every bag token is placed at its ``per_token`` best positions in 1 .. last - 1,
    and [SEP] at the last reached position and its ``sep_positions`` best others in 2 .. last - 1 (a [SEP] at 1 is
    an empty sentence, which a non-empty bag rules out); the chain search picks among them and the clipped-sum test
    (:mod:`gradleak.attacks.utr.clipped`) grades the result. ``cls``: [CLS], at position 0 of every sentence, joins
    the basis whether or not stage 1 read it (left out, its share of the upload lands on the position rows and
    every position reads as reached)."""
    f64 = torch.float64
    toks_l = sorted({int(v) for v in tokens} | {int(sep)} | ({int(cls)} if cls is not None else set()))
    T, P = len(toks_l), int(num_positions)
    n = embeddings.word_embeddings.weight.shape[1]
    if T == 0 or P < 3 or T + P + 1 > n or not noise_std:
        return None
    toks = torch.tensor(toks_l)
    M, E, Pm = embedding_basis(embeddings, toks_l, P, token_type)  # (T+P+1, n), as in bert_pair_decompose
    ln = embeddings.LayerNorm
    G = stack_rows(grads)
    X = torch.linalg.lstsq(M.T, G.T).solution
    XA, XB = X[:T], X[T:T + P]
    se = float(noise_std) * torch.linalg.inv(M @ M.T).diagonal().clamp_min(0).sqrt()[:, None]
    m = XB.shape[1]
    chi = (XB ** 2).sum(1) / se[T:T + P, 0].clamp_min(1e-300) ** 2
    reached = (chi > m + reach_z * (2 * m) ** 0.5).nonzero().flatten().tolist()
    last = max(reached, default=0)
    if last < 2:
        return None
    L = last + 1
    sA, sB = XA.abs() > z * se[:T], XB[:L].abs() > z * se[T:T + L]
    W = adapter.down.weight.detach()
    b = adapter.down.bias.detach()
    reps = G.shape[0] // W.shape[0]
    pairs: dict[int, set[int]] = {}
    with torch.no_grad():
        x = (E[:, None, :] + Pm[None, :L]).to(W.dtype)
        f = torch.nn.functional.layer_norm(x, (n,), ln.weight, ln.bias, ln.eps)
        mask = (f @ W.T + b > 0).repeat(1, 1, reps)
        viol = (mask & ~sA[:, None, :]).sum(-1) + (mask & ~sB[None]).sum(-1)
        frac = viol.to(f64) / mask.sum(-1).clamp_min(1)
    for i, v in enumerate(toks_l):
        if v == int(sep):
            order = [p for p in frac[i].argsort().tolist() if 2 <= p < last]
            pairs[v] = set(order[:max(0, int(sep_positions))]) | {last}
        elif cls is not None and v == int(cls):
            pairs[v] = {0}
        else:
            pairs[v] = {int(p) + 1 for p in frac[i, 1:last].argsort()[:max(1, int(per_token))].tolist()}
    return pairs, last
