"""UTR stage 1, exact: each candidate (token, position) pair's own bottleneck signal (beyond the paper).

Stage 1 places tokens by a support test (:func:`gradleak.attacks.common.bert_pairs.bert_pair_decompose`): a pair
passes when its ReLU mask lies inside the supports of its token's and its position's coefficient rows. A token that
occurs in most sentences ([SEP], "the", "a", ".") has a support that covers almost every neuron, so it passes at
positions no sentence holds (measured, MiniLM rf = 1 B = 16 seed 0: 22 [SEP] positions read for 14 true lengths, 61
false pairs in all), and the sentence search then starts from wrong lengths. The upload holds more than the
down-projection gradient that test reads. Write f_l for the frozen embedding output of pair l (known for every
candidate), h_l = ReLU(W_down f_l + b_down) (known), D_l its ReLU mask, and delta_l the d-vector of the loss gradient
at the adapter's output (unknown):

* up-projection: G_up = sum_l delta_l h_l^T and g_up = sum_l delta_l, i.e. [H, 1]^T Delta = [G_up, g_up]^T. So
  Delta = Delta0 + N C with N an orthonormal basis of the null space of [H, 1]^T (n - rank directions, n the
  candidate pairs) and C unknown;
* down-projection: G_down = sum_l u_l f_l^T and g_down = sum_l u_l with u_l = D_l * (W_up^T delta_l), the pair's
  bottleneck signal. Neuron j sees only the pairs active there, and u_lj = (Delta0 W_up)_lj + (N c_j)_l with
  c_j = C W_up[:, j]: per neuron, d + 1 equations in n - rank unknowns, solved by least squares.

The solution is every candidate pair's exact bottleneck signal: the sum over the batch states that hold it (one
state's for most pairs), and zero for a pair no sentence holds. Pairs whose signal stands far below the others
are dropped and the rest solved again; a drop is kept only if the down-projection equations still fit (dropping a
true pair leaves its share unexplained, and the fit residual jumps from the float32 floor). The equations hold
for the gradient of one step over the batch (FedSGD); after several local steps, or under pruning, they do not
fit, and :func:`refine_pairs` then returns None (the caller keeps the support test's pairs).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

f64 = torch.float64


def pair_inputs(embeddings: nn.Module, tokens: torch.Tensor, positions: torch.Tensor,
                token_type: int = 0) -> torch.Tensor:
    """Float64 frozen embedding outputs f(v, p) = LN(E[v] + P[p] + T[type]) of explicit (token, position) pairs."""
    x = embeddings.word_embeddings.weight.detach().to(f64)[tokens] \
        + embeddings.position_embeddings.weight.detach().to(f64)[positions] \
        + embeddings.token_type_embeddings.weight.detach().to(f64)[token_type]
    ln = embeddings.LayerNorm
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), ln.weight.detach().to(f64), ln.bias.detach().to(f64),
                                          ln.eps)


def pair_signals(F: torch.Tensor, adapter: nn.Module, grads: dict[str, torch.Tensor], chunk: int = 32
                 ) -> tuple[torch.Tensor, dict[str, Any]]:
    """(n, b) bottleneck signals of the n candidate pairs with adapter inputs ``F`` (module docstring), and
    diagnostics: the null space's dimension and the down-projection fit's relative residual (max, median over the
    neurons). ``grads`` holds the adapter's uploaded 'down.weight', 'down.bias', 'up.weight', 'up.bias'."""
    Wd, bd, Wu = (w.detach().to(f64) for w in (adapter.down.weight, adapter.down.bias, adapter.up.weight))
    n, b = F.shape[0], Wd.shape[0]
    Z = F @ Wd.T + bd
    D = (Z > 0).to(f64)
    Ht = torch.cat([torch.relu(Z), torch.ones(n, 1, dtype=f64)], 1)  # (n, b + 1)
    Yu = torch.cat([grads["up.weight"].to(f64), grads["up.bias"].to(f64)[:, None]], 1)  # (d, b + 1) = Delta^T Ht
    Uh, Sh, Vh = torch.linalg.svd(Ht, full_matrices=True)
    rk = int((Sh > 1e-10 * Sh[0]).sum())
    delta0 = Uh[:, :rk] @ ((Vh[:rk] @ Yu.T) / Sh[:rk, None])  # (n, d): the minimum-norm Ht^T Delta0 = Yu^T
    N = Uh[:, rk:]  # (n, m)
    U0 = delta0 @ Wu  # (n, b)
    Ft = torch.cat([F, torch.ones(n, 1, dtype=f64)], 1)  # (n, d + 1)
    Yd = torch.cat([grads["down.weight"].to(f64), grads["down.bias"].to(f64)[:, None]], 1)  # (b, d + 1)
    rhs = Yd - (D * U0).T @ Ft  # (b, d + 1): the down equations' part Delta0 leaves
    U = U0.clone()
    res = torch.zeros(b, dtype=f64)
    m = N.shape[1]
    short = 0
    if m:
        for a in range(0, b, chunk):
            j = slice(a, a + chunk)
            Mj = torch.einsum("lk,jl,lm->jkm", Ft, D.T[j], N)  # (c, d + 1, m)
            sol = torch.linalg.lstsq(Mj, rhs[j, :, None], rcond=1e-10, driver="gelsy")  # QR with pivoting
            c = sol.solution
            short += int((sol.rank < m).sum())
            U[:, j] += (N @ c[..., 0].T)
            res[j] = (Mj @ c)[..., 0].sub_(rhs[j]).norm(dim=1)
    else:
        res = rhs.norm(dim=1)
    U *= D
    rel = res / Yd.norm(dim=1).clamp_min(1e-300)
    active = Yd.norm(dim=1) > 0
    rel = rel[active] if bool(active.any()) else rel
    return U, {"null_dim": m, "neurons_underdetermined": short, "fit_max": float(rel.max()),
               "fit_median": float(rel.median())}


def refine_pairs(embeddings: nn.Module, adapter: nn.Module, grads: dict[str, torch.Tensor],
                 pairs: dict[int, set[int]], drops: tuple[float, ...] = (0.2, 0.05), fit_tol: float = 1e-3,
                 rounds: int = 12,
                 token_type: int = 0) -> tuple[dict[int, set[int]], dict[tuple[int, int], torch.Tensor],
                                               dict[str, Any]] | None:
    """Stage 1's candidate pairs cleaned by their exact signals (module docstring): (pairs, signals, info), with
    signals[(v, p)] the (b,) float64 bottleneck signal of every kept pair. None when the equations do not fit the
    candidates (median relative residual above ``fit_tol``: not a one-step upload, or a true pair is missing).

    Each round drops the pairs below ``drops[0]`` x the median signal norm and solves again. A round whose fit gets
    worse than ``fit_tol`` or 100x the previous round's median residual (a true pair dropped) is undone and the
    next, gentler factor of ``drops`` tried; the loop stops when no pair falls below the factor, or none is left."""
    L = [(int(v), int(p)) for v in sorted(pairs) for p in sorted(pairs[v])]
    if not L:
        return None
    F = pair_inputs(embeddings, torch.tensor([v for v, _ in L]), torch.tensor([p for _, p in L]), token_type)
    keep = torch.ones(len(L), dtype=torch.bool)
    U, st = pair_signals(F, adapter, grads)
    if not st["fit_median"] < fit_tol:
        return None
    log = [{"pairs": len(L), **st}]
    k = 0
    for _ in range(rounds):
        if k >= len(drops):
            break
        nrm = U.norm(dim=1)
        new = keep.clone()
        new[keep] = nrm > drops[k] * nrm.median()
        if bool((new == keep).all()):
            k += 1
            continue
        U2, st2 = pair_signals(F[new], adapter, grads)
        if not (st2["fit_median"] < fit_tol and st2["fit_median"] < 100 * max(st["fit_median"], 1e-12)):
            log.append({"pairs": int(new.sum()), **st2, "undone": True})
            k += 1
            continue
        keep, U, st = new, U2, st2
        log.append({"pairs": int(keep.sum()), **st})
    kept = [L[i] for i in keep.nonzero().flatten().tolist()]
    out: dict[int, set[int]] = {}
    for v, p in kept:
        out.setdefault(v, set()).add(p)
    signals = {pair: U[i] for i, pair in enumerate(kept)}
    return out, signals, {"rounds": log, "pairs_dropped": len(L) - len(kept), "fit_median": st["fit_median"]}
