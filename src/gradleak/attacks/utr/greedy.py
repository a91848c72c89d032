"""UTR's stage 2 as published (``search: paper``; UTR paper Sec. 4.3): the greedy constructive search.

The paper extends partial sentences one token at a time with word-bag tokens, applies its Boolean filters after each
extension, runs the candidate through the frozen model and accepts it when the hidden states entering the first layer
adapter lie in S_LA within ε; it keeps the accepted extension (greedy) and stops when no extension passes. Algorithm 1
and the filters' implementations are in an appendix the paper does not contain (open point A3.1 of docs/PAPERS.md), so the open points are
decided here, each as the plainest reading of the text:

* **Beam width 1** (A3.8: "greedy"): one partial sentence per run; among the extensions that pass, the one with the
  smallest relative residual is kept (tie-break: residual, then token id). No backtracking, no branching, no trie.
* **Filters** (A3.1): EICW as published -- an extension equal to the previous token is rejected, always (our extended
  search only prefers a non-repeat). CG (grammar) and CS (semantics) need a grammar checker and a semantic scorer the
  paper does not name; none is available offline, so they are **not applied** (our extended search's LM-prior ranking
  is not used either: it is ours, not the paper's).
* **Separating the B sentences** (A3.8): every extension of the empty sentence that passes is a batch sentence's first
  token (stage 1 places the first tokens), and each starts one greedy run, in residual order, at most B runs when the
  server knows B. Sentences that share their first token therefore share one run: the greedy search returns one of
  them (the extended search branches there).
* **Causal models** (GPT-2, Qwen; prefix-wise, §4.3 "Impact of LLM Architecture"): a token's state depends only on its
  prefix, so the candidate's newest state is the test; a run ends when no bag token passes (the final EOS gets no
  gradient under the LM loss, A3.6) or at ``max_len``.
* **Bidirectional models** (BERT; "the complete text in a single step"): every state depends on the whole sentence,
  so a partial sentence's states cannot pass, only the complete one's. The growing candidate is tested as a sentence
  of its own, ``[CLS] prefix t [SEP]``, through the real model: the candidate whose states *all* pass is the complete
  sentence (accepted, verified); otherwise the extension kept is the one whose candidate has the smallest mean
  residual (the greedy step). Stage 1 tests f_0 per (token, position) (A3.4: BERT's f_0 holds the position), so the
  extensions at position p are the bag tokens whose pair (t, p) passed; a run that reaches the last position stage 1
  placed without a complete candidate returns its last candidate, unverified.
* **What is off** (beyond the paper, on only with ``search: extended``): stacking every round's gradients
  (``all_rounds``), exact pairs from the gradient's coefficients and the up + down pair signals, the value test,
  soft rank, peeling, the breadth-first trie, the Hungarian chain assignment and its moves.
* **A3.5** (which layers, which loss): the pipeline's; the same truncated 2-layer model and adapters as the extended
  search, so the two rows differ only in the method.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from gradleak.attacks.common.prefix_search import CausalPrefixSearch
from gradleak.attacks.common.subspace import Subspace
from gradleak.peft.text_adapters import capture_inputs

#: what ``info["method"]`` says for each search
METHOD = {"paper": "UTR (paper)",
          "extended": "UTR (ours: + all rounds + exact pairs + value test + soft rank + peeling + trie / chain search)"}


class GreedyCausalSearch(CausalPrefixSearch):
    """The published greedy search on a causal LM (module docstring): beam width 1, strict EICW, no CG/CS."""

    def __init__(self, model: nn.Module, probe_name: str, sub: Subspace, eps: float, bos: int,
                 candidates: torch.Tensor, batch_size: int | None, max_len: int = 128, eicw: bool = True,
                 time_budget: float = float("inf")):
        super().__init__(model, [probe_name], sub, eps, bos, candidates, max_len=max_len, eicw=eicw, lm_prior=False,
                         time_budget=time_budget)
        self.batch_size = batch_size

    def passing(self, prefix: list[int]) -> list[int]:
        """The bag tokens whose extension of ``prefix`` has its newest state in S_LA within ε, best first (EICW:
        the previous token is never a passing extension)."""
        r = self.sub.residual(self._newest_states([prefix], self.cands))[0]
        ok = (r < self.eps).nonzero().flatten()
        toks = [int(self.cands[i]) for i in sorted(ok.tolist(), key=lambda i: (float(r[i]), int(self.cands[i])))]
        return [t for t in toks if not (self.eicw and len(prefix) > 1 and t == prefix[-1])]

    def run(self) -> tuple[list[list[int]], dict[str, Any]]:
        t0, truncated = time.perf_counter(), False
        starts = self.passing([self.bos])
        if self.batch_size:
            starts = starts[:int(self.batch_size)]
        sentences = []
        for first in starts:
            prefix = [self.bos, first]
            while len(prefix) < self.max_len:
                if time.perf_counter() - t0 > self.time_budget:
                    truncated = True
                    break
                nxt = self.passing(prefix)
                if not nxt:
                    break
                prefix.append(nxt[0])  # greedy: keep the best passing extension, never revisit
            sentences.append(prefix[1:])
            if truncated:
                break
        return sentences, {"forward_passes": self.forwards, "search_truncated": truncated,
                           "greedy_runs": len(sentences), "greedy_starts": len(starts)}


class GreedyEncoderSearch:
    """The published greedy search on a bidirectional encoder (module docstring): the growing candidate
    ``[CLS] prefix t [SEP]`` tested whole through the real model, beam width 1, strict EICW, no CG/CS."""

    def __init__(self, model: nn.Module, probe_name: str, sub: Subspace, eps: float, cls: int, sep: int,
                 pad: int | None, pairs: dict[int, set[int]], batch_size: int | None, eicw: bool = True,
                 time_budget: float = float("inf")):
        self.model, self.probe_name, self.sub, self.eps = model, probe_name, sub, float(eps)
        self.cls, self.sep, self.batch_size, self.eicw = cls, sep, batch_size, eicw
        self.time_budget = float(time_budget)
        special = {cls, sep, pad}
        self.last = max((p for ps in pairs.values() for p in ps), default=0)  # the last position stage 1 placed
        self.at = {q: sorted(t for t, ps in pairs.items() if q in ps and t not in special)
                   for q in range(1, self.last + 1)}
        self.forwards = 0

    def residuals(self, cands: list[list[int]]) -> torch.Tensor:
        """Per-position relative residuals (N, L) of complete candidates (all of one length) in S_LA."""
        ids = torch.tensor(cands)
        with torch.no_grad():
            cap = capture_inputs(self.model, [self.probe_name], stop=True)
            with cap:
                self.model(input_ids=ids, attention_mask=torch.ones_like(ids))
        self.forwards += 1
        return self.sub.residual(cap.records[-1][-1])

    def step(self, prefix: list[int]) -> tuple[list[int], bool] | None:
        """The kept candidate ``prefix + [t, SEP]`` and whether it is complete (every state passes); None when no
        token is left to extend with."""
        toks = [t for t in self.at.get(len(prefix), []) if not (self.eicw and len(prefix) > 1 and t == prefix[-1])]
        if not toks:
            return None
        cands = [prefix + [t, self.sep] for t in toks]
        r = self.residuals(cands)
        worst, mean = r.max(1).values, r.mean(1)
        done = (worst < self.eps).nonzero().flatten().tolist()
        pool = done or list(range(len(toks)))
        best = min(pool, key=lambda i: (float(mean[i]), toks[i]))
        return cands[best], bool(done)

    def run(self) -> tuple[list[list[int]], dict[str, Any]]:
        t0, truncated = time.perf_counter(), False
        firsts = self.at.get(1, [])
        if firsts and self.batch_size and len(firsts) > int(self.batch_size):  # rank the starts by their candidate
            r = self.residuals([[self.cls, t, self.sep] for t in firsts]).mean(1)
            firsts = [firsts[i] for i in r.argsort().tolist()[:int(self.batch_size)]]
        verified, unverified = [], []
        for first in firsts:
            prefix, cand, done = [self.cls, first], [self.cls, first, self.sep], False
            if self.residuals([cand]).max() < self.eps:
                verified.append(cand)
                continue
            while len(prefix) <= self.last - 1:
                if time.perf_counter() - t0 > self.time_budget:
                    truncated = True
                    break
                kept = self.step(prefix)
                if kept is None:
                    break
                cand, done = kept
                if done:
                    break
                prefix = cand[:-1]
            (verified if done else unverified).append(cand)
            if truncated:
                break
        return [c[1:-1] for c in verified + unverified], {"forward_passes": self.forwards, "search_truncated": truncated,
                                       "verified_sentences": len(verified), "greedy_runs": len(verified) + len(
                                           unverified), "greedy_starts": len(firsts)}
