"""UTR's stage 1: the word bag from the embedding adapter's gradient (UTR paper Sec. 4.2), shared by UTR and
LAMP's ``bag_only`` row (LAMP given stage 1).

Every row j of the embedding adapter's down-projection gradient is ``sum_l delta_jl f_0(x_l)`` (UTR paper Sec. 4.2, 4.4), so the row
space S_EA of the stacked gradient is span{f_0 of the batch's tokens}. We build an orthonormal basis by SVD (float64,
relative singular-value cut-off ``rank_rtol``) and test *every* vocabulary token at once: relative residual
``||f - P f|| / ||f||`` < ``eps_bag``.

* RoPE / position-free models (Llama): f_0(v) = E[v], one (V x n) projection.
* BERT (absolute positions, token types, LayerNorm): f_0(v, p) = LN(E[v] + P[p] + T[0]), tested for all pairs at
  once (:mod:`gradleak.attacks.common.bert_pairs`); :func:`~gradleak.attacks.common.bert_pairs.bert_pair_decompose`
  recovers the exact pairs from the gradient's coefficients and the ReLU masks (beyond the paper); the positions of
  [SEP] give the sentence lengths. When the upload holds the adapter's up-projection, :func:`exact_pairs` solves
  every candidate pair's exact bottleneck signal from the up + down equations
  (:mod:`gradleak.attacks.common.pair_signals`) and drops the pairs no sentence holds (the support test keeps false
  pairs for tokens most sentences share, such as [SEP]).

Capacity (Theorems 4.1/4.2): rank(S) <= d_bottleneck. When the numerical rank reaches the bottleneck width the
subspace is saturated and the word bag cannot be trusted (``Subspace.saturated``).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from gradleak.attacks.common.bert_pairs import (bert_augmented_bag, bert_pair_decompose, bert_pair_exact,
                                                bert_pair_residuals)
from gradleak.attacks.common.pair_signals import refine_pairs
from gradleak.attacks.common.subspace import is_pruned, pruned_membership, subspace_from_gradients
from gradleak.attacks.common.text import SpanTestConfig, collect_grads, is_causal
from gradleak.errors import BadInput
from gradleak.fl.core import ServerView
from gradleak.peft.text_adapters import PREFIX, adapter_param


def exact_pairs(view: ServerView, pairs: dict[int, set[int]], tokens: list[int], npos: int,
                sigma: float | None = None) -> tuple[dict[int, set[int]], dict | None, dict[str, Any]]:
    """Stage 1's pairs cleaned by every candidate's exact bottleneck signal
    (:mod:`gradleak.attacks.common.pair_signals`): needs the embedding adapter's up-projection in the upload; when the
    support test's pairs do not fit the equations (a true pair missed), the candidates of one allowed support
    violation are solved instead.
    Under noise the equations hold only approximately: not tried. Returns (pairs, signals or None, info)."""
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


def word_bag(view: ServerView, cfg: SpanTestConfig | Any, all_rounds: bool,
             noise_std: Callable[[list[torch.Tensor]], float | None] | None = None,
             extended: bool = True, directions: int | None = None) -> dict[str, Any]:
    """UTR's stage 1 (module docstring) on the attacked update: the word bag, its (token, position) pairs on
    absolute-position models, the embedding adapter's subspace and diagnostics. ``cfg``: the span-test parameters
    ``eps_bag``, ``rank_rtol``, ``max_positions``, ``screen_tol`` as attributes (a :class:`SpanTestConfig`, or the
    attack that holds them); ``all_rounds``: stack every observed round's gradients; ``noise_std``: grads -> the
    per-coordinate noise std on them (None, or returning None: exact tests). ``extended=False``: the span test as
    published only (UTR paper Sec. 4.2; on BERT per (token, position), open point A3.4) -- no augmented bag past the bottleneck, no
    pair decomposition, no pair signals (UTR's ``search: paper``). ``directions`` (K): read the upload through its K
    strongest directions only (the oracle ceiling, UTR's ``directions``): below the upload's exact rank the word bag
    is the vocabulary's lower outliers of the residual to those K directions (:func:`_pruned_word_bag` with
    ``rank`` K, at most K tokens, no positions); at or above it nothing is cut (the plain stage 1)."""
    model = view.model
    if not hasattr(model, PREFIX) or "embedding" not in getattr(model, PREFIX):
        raise BadInput("peft", "the model the server sent has no embedding adapter.",
                       "use peft.kind=adapters with the embedding adapter enabled.")
    t0 = time.perf_counter()
    grads = collect_grads(view, adapter_param("embedding"), all_rounds=all_rounds)
    sigma = noise_std(grads) if noise_std is not None else None
    # top-k pruning: the server sees the kept support (the nonzeros); the pruned entries are an error bounded by the
    # smallest kept magnitude, so the upload is read as the signal plus noise of that kind, the token test calibrated
    # against the vocabulary's own bulk (gradleak.attacks.common.subspace.pruned_membership)
    if directions is not None and int(directions) < subspace_from_gradients(grads, cfg.rank_rtol).rank:
        out = _pruned_word_bag(model, grads, cfg, None, t0, rank=int(directions))
        out.update({"sparsity_aware": False, "directions": int(directions)})
        return out
    if extended and getattr(cfg, "sparsity_aware", True) and is_pruned(grads):
        return _pruned_word_bag(model, grads, cfg, sigma, t0)

    sub = subspace_from_gradients(grads, cfg.rank_rtol, noise_std=sigma)
    eps_bag = max(cfg.eps_bag, sub.tol)  # noise mode: the tolerance the noise floor implies
    causal = is_causal(model)
    if causal:
        bag = _causal_bag(model, sub, eps_bag, sigma)
    else:
        bag = _bidirectional_bag(view, model, sub, cfg, eps_bag, sigma, extended)
    secs = time.perf_counter() - t0
    return {"tokens": bag["tokens"], "pairs": bag["pairs"], "subspace": sub, "seconds": secs,
            "min_residual": bag["min_res"], "causal": causal, "positions_ok": bag["positions_ok"],
            "augmented": bag["augmented"], "noise_std": sigma, "eps_bag": bag["eps_bag"], "signals": bag["signals"],
            "support_pairs": bag["support"], **bag["exact_info"]}


def _reading(eps_bag: float, **fields: Any) -> dict[str, Any]:
    """One stage-1 reading of :func:`word_bag` (tokens, pairs, smallest residuals, whether positions were
    recovered, whether the augmented bag was used, pair signals, the exact-pair diagnostics, the support pairs,
    the tolerance used), its fields defaulting to an empty bag with positions."""
    out = {"tokens": [], "pairs": {}, "min_res": None, "positions_ok": True, "augmented": False, "signals": None,
           "exact_info": {}, "support": None, "eps_bag": eps_bag}
    out.update(fields)
    return out


def _causal_bag(model, sub, eps_bag: float, sigma: float | None) -> dict[str, Any]:
    """RoPE / position-free models: f_0(v) = E[v], one (V x n) projection; under noise at most ``rank`` tokens."""
    E = model.get_input_embeddings().weight.detach()
    res = sub.residual(E)
    tokens = (res < eps_bag).nonzero().flatten().tolist()
    if sigma and len(tokens) > sub.rank:  # noise: one direction per distinct token, keep the best `rank`
        tokens = sorted(res.argsort()[: sub.rank].tolist())
    return _reading(eps_bag, tokens=tokens, pairs={int(v): set() for v in tokens}, min_res=res)


def _bidirectional_bag(view: ServerView, model, sub, cfg, eps_bag: float, sigma: float | None,
                       extended: bool) -> dict[str, Any]:
    """BERT (absolute positions): the (token, position) pairs, by the augmented bag under noise or near the
    bottleneck, else by the pair span test."""
    emb = model.base_model.embeddings
    npos = min(cfg.max_positions, emb.position_embeddings.weight.shape[0])
    # Near or at the bottleneck (BERT pairs fill S), test tokens against S + span{b_p, beta} instead; under
    # noise too: distinct tokens' a_v stand far apart (random tokens' residual ~0.4), while a pair's nearest
    # false pair (the same token at the next position) is a few degrees away and drowns first (measured,
    # MiniLM rf=2 B=2 seed 0, per-coordinate noise-to-signal 1e-3: true tokens <= 0.061 against >= 0.409;
    # pairs: true up to 0.073, 435 false pairs below that)
    if extended and sigma and sub.rank + npos + 1 < sub.dim:
        return _noisy_augmented_bag(view, model, emb, sub, npos, eps_bag, sigma)
    if extended and sub.rank >= 0.8 * sub.rows and sub.rows < sub.dim and sub.rank + npos + 1 < sub.dim:
        return _bottleneck_augmented_bag(view, model, emb, sub, npos, eps_bag, sigma)
    return _pair_bag(view, model, emb, sub, cfg, npos, eps_bag, sigma, extended)


def _noisy_augmented_bag(view: ServerView, model, emb, sub, npos: int, eps_bag: float, sigma: float) -> dict[str, Any]:
    """Under noise: the augmented bag at half the non-members' lower tail, its pairs decomposed (positions lost
    when the decomposition fails)."""
    _, min_res = bert_augmented_bag(emb, sub, npos, eps_bag)
    floor = float(min_res.kthvalue(max(1, len(min_res) // 100)).values)  # non-members' lower tail
    eps_bag = min(eps_bag, 0.5 * floor)
    cand = [v for v in (min_res < eps_bag).nonzero().flatten().tolist() if v != model.config.pad_token_id]
    dec = bert_pair_decompose(emb, getattr(model, PREFIX)["embedding"],
                              collect_grads(view, adapter_param("embedding")), cand, npos,
                              noise_std=sigma) if cand else None
    if dec is None:
        return _reading(eps_bag, min_res=min_res, positions_ok=False)
    pairs = {v: ps for v, ps in dec.items() if ps}
    return _reading(eps_bag, tokens=sorted(pairs), pairs=pairs, min_res=min_res, augmented=True)


def _bottleneck_augmented_bag(view: ServerView, model, emb, sub, npos: int, eps_bag: float,
                              sigma: float | None) -> dict[str, Any]:
    """Near the bottleneck: the augmented bag's candidates decomposed into pairs and their exact signals
    (:func:`exact_pairs`); positions lost when the decomposition fails."""
    cand, min_res = bert_augmented_bag(emb, sub, npos, eps_bag)
    cand = [v for v in cand if v != model.config.pad_token_id]
    dec = None
    if 0 < len(cand) < sub.rows:
        dec = bert_pair_decompose(emb, getattr(model, PREFIX)["embedding"],
                                  collect_grads(view, adapter_param("embedding")), cand, npos,
                                  noise_std=sigma)
    if dec is None:
        return _reading(eps_bag, min_res=min_res, positions_ok=False)
    support = {v: ps for v, ps in dec.items() if ps}
    pairs, signals, exact_info = exact_pairs(view, support, cand, npos, sigma)
    return _reading(eps_bag, tokens=sorted(pairs), pairs=pairs, min_res=min_res, augmented=True, signals=signals,
                    exact_info=exact_info, support=support)


def _pair_bag(view: ServerView, model, emb, sub, cfg, npos: int, eps_bag: float, sigma: float | None,
              extended: bool) -> dict[str, Any]:
    """The pair span test: every (token, position) pair screened, then tested exactly; with ``extended`` the pairs
    decomposed and their exact signals solved (positions lost when the decomposition fails); a saturated subspace
    gives no bag."""
    screen = min(0.9, max(cfg.screen_tol, 10 * eps_bag))
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
    pairs: dict[int, set[int]] = {}
    for v, p in zip(vv[ok].tolist(), pp[ok].tolist()):
        pairs.setdefault(int(v), set()).add(int(p))
    tokens = sorted(pairs)
    min_res = R.min(1).values.double()
    if pairs and not sub.saturated and extended:
        npos_seen = 1 + max(p for ps in pairs.values() for p in ps)
        dec = bert_pair_decompose(emb, getattr(model, PREFIX)["embedding"],
                                  collect_grads(view, adapter_param("embedding")), tokens, npos_seen,
                                  noise_std=sigma)
        if dec is None:  # T + P + 1 > n: the bag is right but tokens cannot be placed (capacity for positions)
            return _reading(eps_bag, tokens=tokens, pairs=pairs, min_res=min_res, positions_ok=False)
        pairs, signals, exact_info = exact_pairs(view, dec, tokens, npos_seen, sigma)
        return _reading(eps_bag, tokens=tokens, pairs=pairs, min_res=min_res, signals=signals, exact_info=exact_info,
                        support=dec)
    if sub.saturated:
        return _reading(eps_bag, min_res=min_res, positions_ok=False)
    return _reading(eps_bag, tokens=tokens, pairs=pairs, min_res=min_res)


def _pruned_word_bag(model, grads: list[torch.Tensor], cfg, sigma: float | None, t0: float,
                     rank: int | None = None) -> dict[str, Any]:
    """The word bag of a top-k pruned upload (:func:`~gradleak.attacks.common.subspace.pruned_membership`): every
    vocabulary token's residual to the pruned matrix's signal subspace (BERT: with the known position and LayerNorm
    directions added, as :func:`bert_augmented_bag`), the tokens that stand out of the vocabulary's bulk kept. No
    positions: pruning leaves the pair coefficients unreliable, so the result is a word bag (no sentence search)."""
    causal = is_causal(model)
    emb = None if causal else model.base_model.embeddings
    npos = 0 if causal else min(cfg.max_positions, emb.position_embeddings.weight.shape[0])

    def residuals(sub):
        if causal:
            return sub.residual(model.get_input_embeddings().weight.detach())
        if sub.rank + npos + 1 < sub.dim:
            return bert_augmented_bag(emb, sub, npos, 0.0)[1]
        return bert_pair_residuals(emb, sub, npos, stop_after=None, screen=2.0).min(1).values.double()

    pad = None if causal else model.config.pad_token_id
    tokens, sub, info = pruned_membership(grads, residuals, exclude=[pad] if pad is not None else [], rank=rank)
    return {"tokens": tokens, "pairs": {int(v): set() for v in tokens}, "subspace": sub,
            "seconds": time.perf_counter() - t0, "min_residual": info.pop("residuals"), "causal": causal,
            "positions_ok": causal, "augmented": False, "noise_std": info["sparsity_noise_std"],
            "eps_bag": info["sparsity_threshold"], "signals": None, "support_pairs": None, **info}
