"""Stage 2 for bidirectional encoders (BERT family): sentences as chains over exact (token, position) pairs (UTR's
search; DAGER runs it with its own probe).

Stage 1 (``bert_pair_decompose``) gives, for every position q, the set of tokens some batch sentence holds there,
and the [SEP] positions give the sentence lengths. What is left is an *assignment* problem: which token at q
belongs to which sentence. We keep B chains (one per sentence, B = the batch size the server configured) and
solve it with the first layer adapter's subspace S_LA = span{h_1 of the batch}:

1. lengths (:class:`~gradleak.attacks.common.chain_lengths.ChainLengths`): one chain per [SEP] position; when B
   exceeds the number of distinct lengths, the extra chains take the length that the per-position token counts
   force (a position holding c tokens is covered by >= c chains);
2. left-to-right construction: at position q every chain covering q takes one candidate token by a Hungarian
   assignment (each candidate used at least once when there are fewer candidates than chains) whose cost is the
   S_LA residual of the chain's states around q, the unknown right part filled with [MASK];
3. splice sweeps: at every cut q, the left parts of the chains are re-matched to their right parts (Hungarian
   over all B x B splices); additive terms that depend on one side only cancel in a perfect matching, so the
   matching follows the cross-cut interaction, which is what tells the sentences apart;
4. acceptance: a chain is a recovered sentence only when *every* position's state lies in S_LA (relative
   residual < ``eps``), checked with the real model. A chain with no token ([CLS] [SEP]) is never accepted while
   stage 1's bag holds tokens no chain places (:meth:`EncoderChainSearch._vacuous`): its two states say nothing
   about the batch, and at a noise tolerance (up to 0.5) they pass; the bag says some sentence holds those tokens.

Saturated S_LA (beyond the paper): with more layer states N than bottleneck rows b, no single state lies in S_LA,
but S_LA lies inside span{all states}. A set of chains whose m states are all right meets S_LA in
k = b + m - N dimensions and a wrong set in none, so the k smallest principal angles test pairs and triples of
chains exactly. Accepted chains are projected out of S_LA (*peeled*): what is left is spanned by the remaining
chains' projected states, of dimension min(b, N - m), and once that fits, the per-position test is exact again.
Chain lengths the [SEP] positions leave open (B above the number of distinct lengths) are tried as hypotheses.

Value test (beyond the paper): the subset tests need more than N - b right states at once; the
embedding adapter's gradient *values* test one chain at a time (:mod:`gradleak.attacks.utr.values`). With it, chains
are accepted (and peeled) one by one, and when the subspace moves stall on a few chains, moves graded by the value
residuals repair them: point moves near the largest residuals, length moves to any [SEP] position stage 1 read (a
false [SEP] pair no longer needs a length hypothesis of its own), splices. Once the accepted chains leave fewer
states than bottleneck rows, they are peeled by subtracting their exact share of the first layer adapter's gradient
(``layer_grad``), which leaves an exact subspace however many states the batch had (the projection needs all states
to fit the hidden size).

Speed (beyond the paper): layer-1 states are computed by :class:`~gradleak.attacks.common.bert_layer.BertFirstLayer`
from per-(token, position) precomputed query/key/value vectors, and only at the few query positions a move can change
-- a splice costs a handful of attention rows instead of a whole forward pass. Its output equals the HF layer (tested
to 1e-5).
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torch import nn

from gradleak.attacks.common.bert_layer import BertFirstLayer
from gradleak.attacks.common.chain_lengths import ChainLengths
from gradleak.peft.text_adapters import PREFIX, capture_inputs


class EncoderChainSearch(ChainLengths):
    """Assign the stage-1 (token, position) pairs to B sentences (module docstring)."""

    def __init__(self, model: nn.Module, probe_name: str, sub, eps: float, cls: int, sep: int, mask: int,
                 pairs: dict[int, set[int]], batch_size: int | None = None, sweeps: int = 8, window: int = 2,
                 time_budget: float = float("inf"), progress=None, probe_fn=None, joint: bool = False,
                 max_peel_sweeps: int = 60, value_test=None, value_live_max: int = 4,
                 layer_grad: torch.Tensor | None = None, soft_rank: float | None = None):
        self.joint, self.max_peel_sweeps = bool(joint), int(max_peel_sweeps)
        # saturated S_LA: chains tested one at a time on the embedding adapter's gradient values
        # (gradleak.attacks.utr.values.TokenGradientTest), and moved by that test's residuals when few are left
        self.value_test = value_test if value_test is not None and value_test.usable else None
        self.value_live_max = int(value_live_max)
        self.value_accepted = self.value_moves = self._stale = 0
        # the probed adapter's observed down-projection gradient: with the value test, accepted chains are peeled by
        # subtracting their exact contributions from it (valid at any number of states, unlike the projection)
        self.layer_grad = None if layer_grad is None else layer_grad.detach().to(torch.float64).reshape(
            -1, layer_grad.shape[-1])
        # past the bottleneck: grade by the upload's strongest directions (soft_rank x its rows; see _soft_basis)
        self.soft_rank = None if soft_rank is None else float(soft_rank)
        self.probe_fn = probe_fn  # (model, ids) -> layer states; default: the input of adapter ``probe_name``
        self.model, self.probe_name, self.sub, self.eps = model, probe_name, sub, float(eps)
        self.cls, self.sep, self.mask = cls, sep, mask
        self.sweeps, self.window = int(sweeps), int(window)
        self.soft_bonus = 0.1  # ~ the local residual rise of one wrong token
        self.time_budget = float(time_budget)
        self.progress = progress
        self.by_pos: dict[int, list[int]] = {}
        for v, ps in pairs.items():
            for p in ps:
                if v not in (cls, sep):
                    self.by_pos.setdefault(int(p), []).append(int(v))
        for p in self.by_pos:
            self.by_pos[p].sort()
        self.bag = sorted({int(v) for v in pairs if v not in (cls, sep)})
        self.seps = sorted(int(p) for p in pairs.get(sep, set()) if p >= 1)
        self.seps_read = list(self.seps)  # every [SEP] position stage 1 read (_lengths may drop some as false)
        self.sep_dev = self._sep_deviation()
        self.lengths = self._lengths(batch_size)
        self.layer = BertFirstLayer(model)
        self._reset_peel()
        self.evals = 0
        self.forwards = 0


    # ------------------------------------------------------------------ acceptance guard
    def unplaced(self, chains: list[list[int]]) -> list[int]:
        """Stage 1's bag tokens that no chain holds."""
        held = {int(v) for c in chains for v in c}
        return [v for v in self.bag if v not in held]

    def _vacuous(self, chain: list[int], chains: list[list[int]]) -> bool:
        """True for a chain with no token ([CLS] [SEP], a length-1 chain) while the bag holds tokens no chain places.
        Such a chain passes the per-position test vacuously -- its two states lie near every sentence's ends, and
        at a noise tolerance (the sentence layer's cap 0.5) nothing separates them -- so it must never count as a
        recovered sentence: the bag's unplaced tokens belong to some sentence of the batch (measured, MiniLM
        B = 4 DP-SGD sigma 1e-6 seed 12: stage 1 read [SEP] only at position 1, four empty chains were accepted
        as "verified 4" and ROUGE-1 was 0 at a word bag of 100 %)."""
        return len(chain) <= 2 and bool(self.unplaced(chains))

    # ------------------------------------------------------------------ scoring
    def _res(self, h: torch.Tensor) -> torch.Tensor:
        if self._F.shape[1]:
            h = h - (h @ self._F) @ self._F.T
        coef = h @ self._basis
        perp = h - coef @ self._basis.T
        return (perp.norm(dim=-1) / h.norm(dim=-1).clamp_min(1e-30)).double()

    def _res64(self, h: torch.Tensor) -> torch.Tensor:
        """Float64 relative residual of states ``h`` outside S_LA, the peeled directions projected out."""
        h = h.to(torch.float64)
        h = h - (h @ self._F64) @ self._F64.T
        perp = h - (h @ self._B64) @ self._B64.T
        return perp.norm(dim=-1) / h.norm(dim=-1).clamp_min(1e-300)

    def _window_cost(self, sents: list[list[int]], lo: int, hi: int) -> torch.Tensor:
        """Summed residual over positions lo..hi (clipped to each sentence) for sentences of any lengths."""
        qs = torch.arange(lo, hi + 1)[None, :].expand(len(sents), -1)
        return self._cost_at(sents, qs)

    def _cost_at(self, sents: list[list[int]], qs: torch.Tensor, chunk: int = 512) -> torch.Tensor:
        """Summed residual at positions ``qs`` (N, w) of each sentence (positions past its [SEP] ignored)."""
        out = []
        for a in range(0, len(sents), chunk):
            part, q = sents[a:a + chunk], qs[a:a + chunk]
            toks, lengths = self._pad(part)
            valid = (q <= lengths[:, None]) & (q >= 0)
            qq = torch.minimum(q.clamp_min(0), lengths[:, None])
            h = self.layer.states(toks, lengths, qq)
            out.append((self._res(h).clamp_max(1.0) * valid).sum(1))
            self.evals += len(part)
        return torch.cat(out)

    def _pad(self, sents: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Sentences of any lengths as one (N, L) tensor ([SEP]-padded; keys past each [SEP] are masked) and the
        index of each sentence's [SEP]."""
        toks = torch.full((len(sents), max(len(x) for x in sents)), self.sep, dtype=torch.long)
        for i, x in enumerate(sents):
            toks[i, :len(x)] = torch.tensor(x)
        return toks, torch.tensor([len(x) - 1 for x in sents])

    def _full_residuals(self, sents: list[list[int]]) -> list[torch.Tensor]:
        """Exact per-position residuals from the real model (acceptance test)."""
        out = []
        for s in sents:
            ids = torch.tensor([s])
            with torch.no_grad():
                if self.probe_fn is not None:
                    h = self.probe_fn(self.model, ids)[0]
                else:
                    cap = capture_inputs(self.model, [self.probe_name], stop=True)
                    with cap:
                        self.model(input_ids=ids, attention_mask=torch.ones_like(ids))
                    h = cap.records[-1][-1][0]
            self.forwards += 1
            out.append(self._res64(h))
        return out

    # ------------------------------------------------------------------ moves
    @staticmethod
    def _assign(cost: np.ndarray, must: list[int] | None = None, bonus: float | None = None) -> list[int]:
        """Row -> column assignment minimising ``cost`` (rows = chains, columns = candidate tokens). Columns in
        ``must`` are each used at least once (when there are enough rows); any column may be reused when there
        are more rows than ``must`` columns (a token shared by several sentences at that position). ``bonus`` makes
        the constraint soft (stage 1 may keep a false pair; its token must not be forced into a sentence)."""
        n, c = cost.shape
        must = list(range(c)) if must is None else list(must)
        extra = n if bonus is not None else max(0, n - len(must))  # soft: any column may serve every row
        if not extra:
            if c == len(must):
                r, col = linear_sum_assignment(cost)
                return [int(j) for _, j in sorted(zip(r, col))]
            r, col = linear_sum_assignment(cost[:, must])
            return [int(must[j]) for _, j in sorted(zip(r, col))]
        big = 1e3 + float(np.abs(cost).max()) * (n + 1) if bonus is None else float(bonus)
        blocks = [cost[:, must] - big] + [cost] * extra  # the bonus copy of each must-column is taken first
        r, col = linear_sum_assignment(np.concatenate(blocks, 1))
        out = {}
        for i, j in zip(r, col):
            out[int(i)] = int(must[j]) if j < len(must) else int((j - len(must)) % c)
        return [out[i] for i in range(n)]

    def _construct(self) -> list[list[int]]:
        """Left-to-right: at each position assign the candidates to the chains covering it."""
        chains = [[self.cls] for _ in self.lengths]
        maxlen = max(self.lengths)
        for q in range(1, maxlen):
            live = [i for i, ell in enumerate(self.lengths) if ell > q]
            cands = self.by_pos.get(q) or self.bag or [self.mask]  # a position no pair explains: any bag token
            sents = [chains[i] + [v] + [self.mask] * (self.lengths[i] - q - 1) + [self.sep]
                     for i in live for v in cands]
            cost = self._window_cost(sents, max(1, q - self.window), q).view(len(live), len(cands)).numpy()
            pick = self._assign(cost)
            for k, i in enumerate(live):
                chains[i].append(cands[pick[k]])
        for i, ell in enumerate(self.lengths):
            chains[i] = chains[i][:ell] + [self.sep]
        return chains

    def _splice_sweep(self, chains: list[list[int]], frozen: set[int]) -> bool:
        """One left-to-right pass of cut re-matching over the chains not yet accepted. Returns True if changed."""
        changed = False
        maxlen = max(len(chains[i]) for i in range(len(chains)) if i not in frozen) - 1
        for q in range(2, maxlen + 1):
            live = [i for i in range(len(chains)) if i not in frozen and len(chains[i]) - 1 >= q]
            if len(live) < 2:
                continue
            sents = [chains[i][:q] + chains[j][q:] for i in live for j in live]
            cost = self._window_cost(sents, max(1, q - self.window), q + self.window - 1)
            cost = cost.view(len(live), len(live)).numpy()
            r, c = linear_sum_assignment(cost)
            if any(a != b for a, b in zip(r, c)):
                tails = {live[a]: chains[live[b]][q:] for a, b in zip(r, c)}
                for i, t in tails.items():
                    chains[i] = chains[i][:q] + t
                changed = True
        return changed

    def _reassign(self, chains: list[list[int]], frozen: set[int], free: bool = False) -> bool:
        """Point moves: at each position re-assign the candidate tokens to the chains not yet accepted (Hungarian
        on the residuals around that position, everything else of each chain kept). Tokens no accepted chain
        uses there must stay in use (``free``: no such constraint -- the last resort against a false stage-1 pair)."""
        changed = False
        maxlen = max(len(c) for c in chains) - 1
        for q in range(1, maxlen):
            live = [i for i in range(len(chains)) if i not in frozen and len(chains[i]) - 1 > q]
            cands = self.by_pos.get(q) or []
            if not live or len(cands) < 2:
                continue
            used = {chains[i][q] for i in frozen if len(chains[i]) - 1 > q}
            must = [] if free else [k for k, v in enumerate(cands) if v not in used]
            sents = []
            for i in live:
                for v in cands:
                    s = list(chains[i])
                    s[q] = v
                    sents.append(s)
            cost = self._window_cost(sents, max(1, q - self.window), q + self.window)
            pick = self._assign(cost.view(len(live), len(cands)).numpy(), must, bonus=self.soft_bonus)
            for k, i in enumerate(live):
                v = cands[pick[k]]
                if chains[i][q] != v:
                    chains[i][q] = v
                    changed = True
        return changed

    def _moves(self, chains: list[list[int]], accepted: set[int]) -> bool:
        """One round of moves on the chains not yet accepted: point moves, splices, segment swaps (when few chains
        are left or nothing else moved), then unconstrained point moves as the last resort. True if changed."""
        if (self.value_test is not None and self._stale >= 2
                and 0 < len(chains) - len(accepted) <= self.value_live_max):
            # the subspace moves stalled on few chains: moves graded by the value test
            if self._value_moves(chains, accepted):
                return True
        moved = self._reassign(chains, accepted)
        moved = self._splice_sweep(chains, accepted) or moved
        if not moved or len(chains) - len(accepted) <= 3:
            moved = self._segment_swap(chains, accepted) or moved
        if not moved:
            moved = self._reassign(chains, accepted, free=True)
        return moved

    def _sweep(self, chains: list[list[int]], accepted: set[int], info: dict[str, Any], t0: float,
               sweeps: int) -> bool | None:
        """The moves of one sweep, after that sweep's acceptance: None when every chain is accepted or the time
        budget is spent (then ``info["search_truncated"]``), else whether anything moved."""
        if len(accepted) == len(chains):
            return None
        if time.perf_counter() - t0 > self.time_budget:
            info["search_truncated"] = True
            return None
        moved = self._moves(chains, accepted)
        if self.progress:
            self.progress(sweeps, len(accepted), len(chains))
        return moved

    def _value_cost(self, sents: list[list[int]], blocked: list[set], profile: list | None = None) -> list[float]:
        """Mean value-test residual of each sentence (:mod:`gradleak.attacks.utr.values`); 10 for a sentence with no
        tested position."""
        return [m if n else 10.0 for _, m, n in self.value_test.score(sents, blocked, profile)]

    def _value_moves(self, chains: list[list[int]], frozen: set[int], gain: float = 0.9, near: int = 2,
                     peaks: int = 3) -> bool:
        """Moves graded by the value test, for the chains not yet accepted: point moves (one position's token
        replaced by another stage-1 candidate there), first at the positions next to each chain's largest residuals
        (a wrong token moves every position's delta, its neighbours' most: measured peaks within 2 positions), then
        anywhere -- after a chain's length moved to another read [SEP] position (cut, or extended by the tokens no
        other chain holds there), the cheapest family; then splices of two chains (tails exchanged at a cut, which
        also exchanges their lengths). The best move of each chain is applied when it lowers the chain's mean residual by more than
        a tenth (a right chain drops to the float floor, a wrong one stays >= 0.03). True if anything moved."""
        live = [i for i in range(len(chains)) if i not in frozen]
        blocked = self.value_test.held_by_others(chains)
        prof: list = []
        cur = dict(zip(live, self._value_cost([chains[i] for i in live], [blocked[i] for i in live], prof)))
        hot = {}
        for i, pr in zip(live, prof):
            top = [p for p, _ in sorted(pr, key=lambda t: -t[1])[:peaks]]
            hot[i] = {q for p in top for q in range(p - near, p + near + 1)}
        for family in (lambda: self._length_moves(chains, live, frozen, blocked),
                       lambda: self._point_moves(chains, live, blocked, lambda i, q: q in hot[i]),
                       lambda: self._point_moves(chains, live, blocked, lambda i, q: q not in hot[i]),
                       lambda: self._splice_moves(chains, live)):
            cands, owner, blk = family()
            if not cands:
                continue
            best = self._best_moves(cands, owner, self._value_cost(cands, blk), cur, gain)
            if not best:
                continue
            self._apply_moves(chains, best, cur)
            return True
        return False

    def _point_moves(self, chains: list[list[int]], live: list[int], blocked: list, where) -> tuple[list, list, list]:
        """Point moves of :meth:`_value_moves` at the positions ``where(i, q)`` accepts: chain ``i``'s token at ``q``
        replaced by another stage-1 candidate there. (candidates, owners ``(i,)``, blocked pairs)."""
        cands, owner, blk = [], [], []
        for i in live:
            c = chains[i]
            for q in range(1, len(c) - 1):
                if where(i, q):
                    for v in self.by_pos.get(q, ()):
                        if v != c[q]:
                            cands.append(c[:q] + [v] + c[q + 1:])
                            owner.append((i,))
                            blk.append(blocked[i])
        return cands, owner, blk

    def _length_moves(self, chains: list[list[int]], live: list[int], frozen: set[int],
                      blocked: list) -> tuple[list, list, list]:
        """Length moves of :meth:`_value_moves`: a chain moved to another read [SEP] position -- cut, or extended by
        the leftover tokens (at each new position a token no other chain holds there, else no accepted one)."""
        cands, owner, blk = [], [], []
        for i in live:
            c = chains[i]
            for ell in self.seps_read:
                if ell == len(c) - 1:
                    continue
                if ell < len(c) - 1:
                    new = c[:ell] + [self.sep]
                else:
                    fill = []
                    for q in range(len(c) - 1, ell):  # a token no other chain holds there, else no accepted one
                        opts = self.by_pos.get(q) or [self.mask]
                        held = {chains[j][q] for j in range(len(chains)) if j != i and len(chains[j]) - 1 > q}
                        acc = {chains[j][q] for j in frozen if len(chains[j]) - 1 > q}
                        fill.append(next((v for v in opts if v not in held),
                                         next((v for v in opts if v not in acc), opts[0])))
                    new = c[:-1] + fill + [self.sep]
                cands.append(new)
                owner.append((i,))
                blk.append(blocked[i])
        return cands, owner, blk

    def _splice_moves(self, chains: list[list[int]], live: list[int]) -> tuple[list, list, list]:
        """Splices of :meth:`_value_moves`: two live chains' tails exchanged at a cut (their lengths with them);
        each pair of candidates is owned by ``(i, j, 0)`` and ``(i, j, 1)`` and blocks the other's pairs."""
        cands, owner, blk = [], [], []
        for x in range(len(live)):
            for y in range(x + 1, len(live)):
                i, j = live[x], live[y]
                rest = self.value_test.held_by_others(chains, skip=(i, j))[i]
                for q in range(2, min(len(chains[i]), len(chains[j]))):
                    a, b = chains[i][:q] + chains[j][q:], chains[j][:q] + chains[i][q:]
                    if a == chains[i]:
                        continue
                    pa, pb = {(v, p) for p, v in enumerate(a)}, {(v, p) for p, v in enumerate(b)}
                    cands += [a, b]
                    owner += [(i, j, 0), (i, j, 1)]
                    blk += [rest | pb, rest | pa]
        return cands, owner, blk

    @staticmethod
    def _best_moves(cands: list, owner: list, cost: list, cur: dict, gain: float) -> dict[tuple, tuple[float, list]]:
        """The best move of each chain (or spliced pair) whose cost is below ``gain`` times its current one:
        move key -> (new total cost, new chains)."""
        best: dict[tuple, tuple[float, list]] = {}
        k = 0
        while k < len(cands):
            o = owner[k]
            if len(o) == 1:
                i = o[0]
                if cost[k] < gain * cur[i] and cost[k] < best.get((i,), (math.inf,))[0]:
                    best[(i,)] = (cost[k], [cands[k]])
                k += 1
            else:
                i, j, _ = o
                tot = cost[k] + cost[k + 1]
                if tot < gain * (cur[i] + cur[j]) and tot < best.get((i, j), (math.inf,))[0]:
                    best[(i, j)] = (tot, [cands[k], cands[k + 1]])
                k += 2
        return best

    def _apply_moves(self, chains: list[list[int]], best: dict[tuple, tuple[float, list]], cur: dict) -> None:
        """Applies the moves of :meth:`_best_moves`, the largest improvements first, each chain moved at most once."""
        done: set[int] = set()
        for key, (tot, new) in sorted(best.items(), key=lambda kv: kv[1][0] - sum(cur[i] for i in kv[0])):
            if done & set(key):
                continue
            for i, c in zip(key, new):
                chains[i] = c
            done |= set(key)
        self.value_moves += len(done)

    def _segment_swap(self, chains: list[list[int]], frozen: set[int]) -> bool:
        """Two chains that exchanged a middle segment [a, b) need two cuts at once (a single cut only moves the
        wrong join). For every pair of unaccepted chains, score every segment exchange by the residuals at both
        joins of both chains and apply the best one when it beats the current joins."""
        changed = False
        todo = [i for i in range(len(chains)) if i not in frozen]
        for x in range(len(todo)):
            for y in range(x + 1, len(todo)):
                i, j = todo[x], todo[y]
                A, Bc = chains[i], chains[j]
                m = min(len(A), len(Bc)) - 1  # last index both hold (the shorter one's [SEP])
                segs = [(a, b) for a in range(1, m) for b in range(a + 1, m)]
                if not segs:
                    continue
                sents, qs = [], []
                for a, b in segs:
                    sents.append(A[:a] + Bc[a:b] + A[b:])
                    sents.append(Bc[:a] + A[a:b] + Bc[b:])
                    qs += [[a - 1, a, b - 1, b]] * 2
                cost = self._cost_at(sents, torch.tensor(qs)).view(-1, 2).sum(1)
                ra, rb = (self._res(self.layer.states(torch.tensor([c]), torch.tensor([len(c) - 1]),
                                                      torch.arange(len(c))[None]))[0].clamp_max(1.0) for c in (A, Bc))
                base = torch.stack([ra[a - 1] + ra[a] + ra[b - 1] + ra[b] + rb[a - 1] + rb[a] + rb[b - 1] + rb[b]
                                    for a, b in segs])
                gain = base - cost
                k = int(gain.argmax())
                if float(gain[k]) > 0.5 * float(base[k]) and float(gain[k]) > 0:
                    a, b = segs[k]
                    chains[i], chains[j] = A[:a] + Bc[a:b] + A[b:], Bc[:a] + A[a:b] + Bc[b:]
                    changed = True
        return changed

    # ------------------------------------------------------------------ whole-batch helpers (S_LA saturated)
    def _states_full(self, sents: list[list[int]]) -> list[torch.Tensor]:
        toks, lengths = self._pad(sents)
        N, L = toks.shape
        h = self.layer.states(toks, lengths, torch.arange(L)[None].expand(N, L).contiguous()).double()
        self.evals += N
        return [h[i, :len(x)] for i, x in enumerate(sents)]

    @staticmethod
    def _orth(M: torch.Tensor, rtol: float = 1e-6) -> torch.Tensor:
        """Orthonormal basis (n, k) of the rows of M."""
        if M.numel() == 0:
            return M.new_zeros(M.shape[-1], 0)
        _, sv, vh = torch.linalg.svd(M, full_matrices=False)
        return vh[: int((sv > rtol * sv[0]).sum())].T

    def _joint_residual(self, states: list[torch.Tensor]) -> float:
        """Part of S_LA outside span{states of all chains}: 0 exactly when the chains are the batch."""
        Q = self._orth(torch.cat(states))
        S = self.sub.basis
        return float((S - Q @ (Q.T @ S)).norm() ** 2 / S.shape[1])

    # ------------------------------------------------------------------ peel mode (S_LA saturated)
    def _reset_peel(self) -> None:
        """Nothing peeled: _F64 (basis of the accepted chains' states) empty, _B64 = S_LA (float32 copies for the
        search's residuals)."""
        self._F64 = torch.zeros(self.sub.basis.shape[0], 0, dtype=torch.float64)
        states = sum(ell + 1 for ell in self.lengths)
        soft = self._soft_basis(self.layer_grad, states) if self.layer_grad is not None else None
        self._B64 = self.sub.basis if soft is None else soft
        self._F, self._basis = self._F64.to(self.layer.dtype), self._B64.to(self.layer.dtype)

    def _soft_basis(self, grad: torch.Tensor, states: int) -> torch.Tensor | None:
        """Past the bottleneck (``states`` above the rows of ``grad``) the row space is everything and grades
        nothing, but the states' shares of the gradient differ by orders of magnitude: the top ``soft_rank`` x rows
        right singular vectors still hold most of every true state, and a changed token's state falls outside
        (measured, MiniLM rf = 1 B = 16, 484 / 419 states in 384 rows, the state at a changed position against the
        true one: AUC 0.94 / 0.99 at 370 directions). None when not past the bottleneck or without ``soft_rank``
        (and without the value test, which alone verifies chains graded this way)."""
        if self.soft_rank is None or self.value_test is None or states <= min(grad.shape):
            return None
        _, _, vh = torch.linalg.svd(grad, full_matrices=False)
        k = max(1, min(len(vh), int(round(self.soft_rank * min(grad.shape)))))
        return vh[:k].T.contiguous()

    def _peel(self, chains: list[list[int]], accepted: set[int]) -> None:
        """Project the accepted chains' states out of S_LA. With F of them known, S_LA projected orthogonally to
        span(F) is spanned by the projected states of the *other* chains, and its dimension is
        min(bottleneck, N - |F|): once the remaining states fit it, the per-position membership test is exact
        again for the remaining chains (beyond the paper: peeling turns a saturated subspace into a clean one)."""
        remaining = sum(len(chains[i]) for i in range(len(chains)) if i not in accepted)
        if (self.value_test is not None and self.layer_grad is not None and self.probe_fn is None
                and (remaining < min(self.layer_grad.shape) or self.soft_rank is not None)):
            # the subtraction leaves an exact subspace only below the bottleneck; above it the rest's row space is
            # the whole bottleneck's worth and grades nothing: with soft_rank its strongest directions grade (see
            # _soft_basis), without it the projection keeps the search going until then
            return self._peel_values(chains, accepted)
        st = torch.cat(self._states_full([chains[i] for i in sorted(accepted)]))
        F = self._orth(st, 1e-9)
        R = self.sub.basis
        Rp = R - F @ (F.T @ R)
        _, sv, vh = torch.linalg.svd(Rp.T, full_matrices=False)
        # R meets span(F) in b + |F| - N directions, so dim(Rp) = min(b, N - |F|). The float32 noise blurs the
        # weakest of R's directions, so there is no clean gap to read it from: take the dimension the chain lengths
        # imply (wrong lengths then fail the tests, and _run_hypotheses tries the others)
        remaining = sum(len(chains[i]) for i in range(len(chains)) if i not in accepted)
        r = min(R.shape[1], remaining, len(sv))
        self._F64, self._B64 = F, vh[:r].T.contiguous()
        self._F, self._basis = F.to(self.layer.dtype), self._B64.to(self.layer.dtype)
        self._exact = remaining <= r < R.shape[0] - F.shape[1]

    def _peel_values(self, chains: list[list[int]], accepted: set[int]) -> None:
        """Peel by subtraction: the accepted chains' exact share of the probed adapter's gradient (their backward
        signals and inputs, weighted by the label scales the value test fitted) is subtracted from the upload. What
        is left is the other chains' gradient, whose row space is spanned by their states alone: once they number
        fewer than the bottleneck rows, the per-position test is exact again, however many states the batch had
        (measured, MiniLM rf = 1 B = 16, 484 states in 384 dimensions: 4 sentences subtracted leave 363 states and
        a singular-value gap of 70x right at 363; all 16 leave 1.6e-6 of the upload)."""
        acc = sorted(accepted)
        blocked = self.value_test.held_by_others(chains)
        adapter = getattr(self.model, PREFIX)[self.probe_name]
        rest = self.layer_grad - self.value_test.contribution([chains[i] for i in acc], adapter,
                                                              [blocked[i] for i in acc])
        remaining = sum(len(chains[i]) for i in range(len(chains)) if i not in accepted)
        soft = self._soft_basis(rest, remaining)  # still past the bottleneck: the rest's strongest directions
        if soft is None:
            _, sv, vh = torch.linalg.svd(rest, full_matrices=False)
            soft = vh[:min(remaining, len(sv))].T.contiguous()
        self._F64 = torch.zeros(self.sub.basis.shape[0], 0, dtype=torch.float64)
        self._B64 = soft
        self._F, self._basis = self._F64.to(self.layer.dtype), self._B64.to(self.layer.dtype)
        self._exact = remaining < min(rest.shape)

    def _accept_peel(self, chains: list[list[int]], accepted: set[int]) -> set[int]:
        """Chains that pass. When the projected problem has room, the per-position test (exact). Otherwise subsets
        of chains: if the chains in S are sentences of the batch, span{their states} meets S_LA in at least
        k = r + m_S - N dimensions (r = dim S_LA, m_S their states, N all remaining states; projected orthogonally
        to the peeled chains), while wrong chains meet it in none (generic, r + m_S <= hidden size). So the k
        smallest principal angles vanish exactly -- an exact test of a pair or triple of chains in a saturated
        subspace (measured, MiniLM rf=2 B=8: true pairs ~1e-12, one wrong token ~3e-5 mean squared sine)."""
        from itertools import combinations

        todo = [i for i in range(len(chains)) if i not in accepted]
        if not todo:
            return set()
        void = {i for i in todo if self._vacuous(chains[i], chains)}  # never accepted (their states still count)
        if self.value_test is not None:  # exact per chain at any saturation (gradleak.attacks.utr.values)
            ok = {i for i, good in zip(todo, self.value_test.passing(chains, self.eps, todo))
                  if good and i not in void}
            if ok:
                self.value_accepted += len(ok)
                return ok
        if self._exact:
            res = self._full_residuals([chains[i] for i in todo])
            return {i for i, r in zip(todo, res) if float(r.max()) < self.eps and i not in void}
        if sum(len(c) for c in chains) >= self.sub.dim:  # more states than the hidden size: no subspace test
            return set()
        st = self._states_full([chains[i] for i in todo])
        st = [h - (h @ self._F64) @ self._F64.T for h in st]
        total = sum(len(h) for h in st)
        r = self._B64.shape[1]
        ok: set[int] = set()
        for size in (1, 2, 3):
            for S in combinations(range(len(todo)), size):
                m = sum(len(st[x]) for x in S)
                k = r + m - total
                if k < 2 or m + r > self.sub.dim - self._F64.shape[1]:
                    continue
                Q = self._orth(torch.cat([st[x] for x in S]), 1e-9)
                sin2 = (1 - torch.linalg.svdvals(Q.T @ self._B64).clamp(max=1) ** 2).sort().values
                self.subset_tests += 1
                if float(sin2[:k].mean()) < self.eps ** 2:
                    ok |= {todo[x] for x in S}
            if ok - void:
                break
        return ok - void

    def _run_peel(self, chains: list[list[int]], info: dict[str, Any], t0: float,
                  stale_limit: int = 6) -> tuple[list[list[int]], dict]:
        """S_LA saturated (more layer states than bottleneck rows, fewer than the hidden size): the usual moves,
        subsets of chains accepted by the principal-angle test and peeled out of S_LA, the per-position test once the
        rest fits; finally the whole batch against the unprojected S_LA (S_LA inside the span of all states)."""
        accepted: set[int] = set()
        self._exact = False
        self.subset_tests = 0
        self.value_moves = self.value_accepted = 0
        stale, sweeps = 0, 0
        for sweeps in range(1, self.max_peel_sweeps + 1):
            new = self._accept_peel(chains, accepted)
            if new:
                accepted |= new
                stale = 0
                if len(accepted) < len(chains):
                    self._peel(chains, accepted)
            else:
                stale += 1
            self._stale = stale
            moved = self._sweep(chains, accepted, info, t0, sweeps)
            if moved is None:
                break
            if (not moved and stale >= 3) or stale >= stale_limit:
                break
        joint = self._joint_residual(self._states_full(chains))
        # accepted chains passed exact tests (a wrong length hypothesis makes true chains fail, never wrong ones
        # pass); when every chain is accepted the joint test must agree, else nothing is claimed
        verified = 0 if len(accepted) == len(chains) and joint >= self.eps ** 2 else len(accepted)
        order = sorted(accepted) + [i for i in range(len(chains)) if i not in accepted]
        info.update({"forward_passes": self.forwards, "layer_evaluations": self.evals, "sweeps": sweeps,
                     "joint_residual": joint, "subset_tests": self.subset_tests,
                     "value_accepted": self.value_accepted, "value_moves": self.value_moves,
                     "verified_sentences": verified, "unverified_sentences": len(chains) - verified,
                     "unplaced_bag_tokens": len(self.unplaced(chains))})
        return [chains[i][1:-1] for i in order], info

    def _run_hypotheses(self, info: dict[str, Any], t0: float) -> tuple[list[list[int]], dict[str, Any]]:
        """Peel search over the length hypotheses: a short run each (a wrong hypothesis stalls quickly), then the
        two most verified ones again with the full sweep budget, until one is verified or time runs out."""
        hyps = [(h, None) for h in self._length_hypotheses()]
        scored, best, tried, out_of_time = [], None, 0, False
        for stale_limit, pool in ((6, hyps), (self.max_peel_sweeps, None)):
            if pool is None:  # the second pass goes on from where the first one stalled
                pool = [(h, c) for _, _, h, c in sorted(scored, key=lambda x: x[:2], reverse=True)[:2]]
            for lengths, start in pool:
                if tried and time.perf_counter() - t0 > self.time_budget:  # the inferred lengths always run
                    out_of_time = True
                    break
                self.lengths = lengths
                self._reset_peel()
                chains = [list(c) for c in start] if start is not None else self._construct()
                out, inf = self._run_peel(chains, dict(info), t0, stale_limit)
                tried += 1
                key = (inf["verified_sentences"], -inf["joint_residual"])
                scored.append((*key, lengths, [list(c) for c in chains]))
                if best is None or key > best[0]:
                    best = (key, out, inf)
                if inf["verified_sentences"] == len(lengths):
                    best[2]["length_hypotheses_tried"] = tried
                    return best[1], best[2]
        best[2]["length_hypotheses_tried"] = tried
        # the budget cut the hypotheses (or a run's sweeps): reported, whichever run's chains are returned
        best[2]["search_truncated"] = bool(best[2].get("search_truncated") or out_of_time
                                           or time.perf_counter() - t0 > self.time_budget)
        return best[1], best[2]

    # ------------------------------------------------------------------ driver
    def run(self) -> tuple[list[list[int]], dict[str, Any]]:
        t0 = time.perf_counter()
        info: dict[str, Any] = {"length_classes": len(self.seps), "chains": len(self.lengths),
                                "search_truncated": False}
        if not self.lengths:
            return [], {**info, "forward_passes": 0, "layer_evaluations": 0}
        if (not self.joint and self.value_test is not None
                and sum(self.lengths) + len(self.lengths) >= 0.9 * min(self.sub.rows, self.sub.dim)):
            # the chains' states fill the bottleneck although the float32 rank reads lower (news B=8: 192-212
            # states, rank 166-172 of 192): no per-position test can pass, so the peel search with the value test
            self.joint = True
        if self.joint and (sum(self.lengths) + len(self.lengths) < self.sub.dim or self.value_test is not None):
            return self._run_hypotheses(info, t0)
        if self.joint:  # more layer states than the hidden size: nothing can be verified, one best-effort sweep
            self.sweeps = 1
            out, inf = self._run_plain(dict(info), t0)
            return out, inf
        # a chain that fails its test may come from a wrong length multiset: try the others until every chain
        # passes (cheap below the bottleneck: a run is a few forward passes)
        best, tried = None, 0

        def hypotheses():  # the alternatives are enumerated only when the inferred lengths fail
            base = list(self.lengths)
            yield base
            yield from self._length_hypotheses()[1:]

        for lengths in hypotheses():
            if tried and time.perf_counter() - t0 > self.time_budget:
                best[1]["search_truncated"] = True  # hypotheses left untried
                break
            self.lengths = lengths
            out, inf = self._run_plain(dict(info), t0)
            tried += 1
            if best is None or inf["verified_sentences"] > best[1]["verified_sentences"]:
                best = (out, inf)
            if inf["verified_sentences"] == len(lengths):
                break
        best[1]["length_hypotheses_tried"] = tried
        best[1].update({"forward_passes": self.forwards, "layer_evaluations": self.evals})
        return best

    def _accept_exact(self, chains: list[list[int]], accepted: set[int]) -> None:
        """Add to ``accepted`` the other chains whose every position passes the per-position test."""
        todo = [i for i in range(len(chains)) if i not in accepted and not self._vacuous(chains[i], chains)]
        if not todo:
            return
        for i, r in zip(todo, self._full_residuals([chains[i] for i in todo])):
            if float(r.max()) < self.eps:
                accepted.add(i)

    def _run_plain(self, info: dict[str, Any], t0: float) -> tuple[list[list[int]], dict[str, Any]]:
        """Construction, sweeps and the per-position acceptance test for the current ``self.lengths``."""
        chains = self._construct()
        accepted: set[int] = set()
        sweeps = 0
        for sweeps in range(1, self.sweeps + 1):
            self._accept_exact(chains, accepted)
            moved = self._sweep(chains, accepted, info, t0, sweeps)
            if moved is None:
                break
            if not moved:
                break
        else:
            self._accept_exact(chains, accepted)
        rounds = 0
        while (self.value_test is not None and 0 < len(chains) - len(accepted) <= self.value_live_max
               and rounds < 6 and time.perf_counter() - t0 <= self.time_budget):
            # chains the moves left wrong (often a false [SEP] length): value-graded moves, the exact test after each
            rounds += 1
            if not self._value_moves(chains, accepted):
                break
            self._accept_exact(chains, accepted)
        # verified sentences first, then the best unverified chains (partial text still leaks; flagged in info)
        out = [chains[i][1:-1] for i in sorted(accepted)]
        rest = [chains[i][1:-1] for i in range(len(chains)) if i not in accepted]
        info.update({"forward_passes": self.forwards, "layer_evaluations": self.evals, "sweeps": sweeps,
                     "verified_sentences": len(out), "unverified_sentences": len(rest),
                     "value_moves": self.value_moves, "unplaced_bag_tokens": len(self.unplaced(chains))})
        return out + rest, info
