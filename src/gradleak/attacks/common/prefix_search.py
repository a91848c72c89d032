"""Prefix-wise sentence search for causal LMs (UTR paper Sec. 4.3, "Impact of LLM Architecture"; DAGER's stage 2 with its own probe).

A token's layer state in a causal model depends only on its prefix, so starting from BOS we extend each prefix by
every word-bag token in one batched forward pass (KV cache of the prefix, stopping after the probed layer) and keep
the extensions whose newest state lies in the layer's gradient subspace. Several passing extensions mean several batch
sentences share the prefix: the search branches (a trie), which *separates the sentences*. A sentence ends when no
extension passes (the final EOS gets no gradient under the LM loss, so it is invisible; open point A3.6, docs/PAPERS.md).

Filters (open point A3.1 in docs/PAPERS.md, not specified in the paper): EICW rejects an extension equal to the previous token unless nothing
else passes (real text does repeat tokens: "very very", "..."). When more extensions pass than ``max_branches``, the
causal LM's own next-token log-probability ranks them and prunes the tail (``lm_prior``). Membership, not the prior,
decides acceptance, so the prior never introduces wrong text. A causal backbone with a classification head (no LM
head: its logits are over the classes) has no prior: the tail is then pruned by the membership residual alone, and
``info["lm_prior"]`` says so.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from gradleak.attacks.common.subspace import Subspace
from gradleak.attacks.common.text import has_lm_head
from gradleak.peft.text_adapters import capture_inputs


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
    """Prefix-wise search for causal LMs (UTR paper Sec. 4.3) against a layer subspace probed at adapter ``probe``."""

    def __init__(self, model: nn.Module, probe_names: list[str], sub: Subspace, eps: float, bos: int,
                 candidates: torch.Tensor, max_len: int = 128, max_branches: int = 8, max_sentences: int = 512,
                 eicw: bool = True, lm_prior: bool = True, probe_fn=None, time_budget: float = float("inf")):
        self.time_budget = float(time_budget)
        self.model, self.probe_names, self.sub, self.eps = model, probe_names, sub, eps
        self.adaptive = bool(getattr(sub, "noise_edge", 0.0))  # noise mode: per-prefix tolerance (see run)
        self.bos, self.cands = bos, candidates
        self.max_len, self.max_branches, self.max_sentences = max_len, max_branches, max_sentences
        self.eicw = eicw
        # the prior needs next-token logits: a classifier's head has none (its logits are over the classes)
        self.lm_prior = bool(lm_prior) and has_lm_head(model)
        self.lm_prior_note = ("on" if self.lm_prior else "off" if not lm_prior else
                              "off: the model has no LM head (classifier), extensions past max_branches are ranked by "
                              "their membership residual")
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
        return sentences, {"forward_passes": self.forwards, "pruned_branches": pruned, "search_truncated": truncated,
                           "lm_prior": self.lm_prior_note}

