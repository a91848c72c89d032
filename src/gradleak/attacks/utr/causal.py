"""UTR stage 2 for causal LMs past the first-layer limit: sentence tests on the gradient values and peeling.

The prefix search of :class:`gradleak.attacks.common.prefix_search.CausalPrefixSearch` tests a prefix by its newest
layer state's residual against the first layer adapter's row space. Once the batch holds more distinct prefixes than
the adapter has rows, that space is numerically everything and the strict test passes nothing (measured: SmolLM2 rf =
1 B = 24, 609 states in 576 rows, ROUGE 0.5). What is left:

* **soft grading.** The states' shares of the upload differ by orders of magnitude, so the top singular directions
  (the numerical rank) still rank a prefix's extensions: the true next token is the best of ~400 bag tokens 78 %
  of the time on layer_0's upload and 86 % with layer_1's residual added (SmolLM2 rf = 1 B = 24 seed 0). Not a test,
  but a search order;
* **an exact test of a complete sentence** (:class:`CausalValueTest`). Under RoPE the embedding adapter's input is
  the token embedding alone, so its up-projection gradient G_up = sum_l g_l a(x_l)^T gives every bag token's summed
  output gradient g_v = sum_{l: x_l = v} g_l by least squares (exact while the bag has at most as many tokens as
  the bottleneck has neurons). The server sent the model, so for a candidate sentence (BOS ... EOS) it computes
  every position's g_l with one forward/backward pass; the LM loss is the mean over the batch's targets, so one
  global scale w = 1 / targets multiplies them. A token that occurs once in the batch matches at the float32 floor
  (relative residual <= 3.1e-6, SmolLM2 rf = 1 B = 24 seed 0); g_l sums the losses of every later position, so one
  wrong token anywhere, or a wrong end, moves it (>= 4.7e-3 there);
* **peeling.** A verified sentence's exact share of every adapter gradient (w times its summed-loss gradient) is
  subtracted from the upload: the rest holds only the other sentences' states, so the soft grading sharpens, more
  tokens become once-occurring in what is left of g_v, and once the states left fit the rows the strict prefix
  search is exact again. When everything is peeled, the upload is explained to the float32 floor (a joint check
  of the whole batch).

**Per-sample clipping** (DP-SGD, a declared per-sample clip norm; ``per_sentence_scale``): the upload is
(1 / B) sum_i c_i g_i with c_i = min(1, C / ||g_i||), so an LM's sentences no longer share one scale; each is fitted
its own scale >= 0 at its tokens (the clipped-sum model of :mod:`gradleak.attacks.utr.clipped`) and peeled at it.

**A causal backbone with a classification head** (a Llama ``*ForSequenceClassification``, mean-pooled or reading
the last token; no LM head). The same test holds with the classifier's loss in place of the LM loss: the
cross-entropy's gradient at a sentence's logits is (p - y) / B, whose entries sum to zero, so the sentence's share
of every gradient is sum_{c >= 1} w_c grad(logit_c - logit_0) with C - 1 coefficients w_c per sentence (its
prediction, label and the batch size). They are fitted by least squares at each tested token, as the bidirectional
value test does (:class:`gradleak.attacks.utr.values.TokenGradientTest`), so the test needs neither the labels nor the
batch size; a verified sentence keeps its fitted coefficients, and peeling subtracts its share at them. The head
pools every position, so the final EOS receives a gradient too (it is a bag token and part of the sentence).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from torch import nn

from gradleak.attacks.common.prefix_search import extension_inputs
from gradleak.attacks.common.subspace import subspace_from_gradients
from gradleak.attacks.common.text import has_lm_head, hooked_with_grads
from gradleak.attacks.utr.values import pad_right
from gradleak.peft.text_adapters import PREFIX, capture_inputs

f64 = torch.float64


def _base(model: nn.Module) -> nn.Module:
    return model.model if hasattr(model, "model") else model.base_model


class CausalValueTest:
    """Exact test of complete candidate sentences of a causal model on the embedding adapter's gradient values.

    ``upload``: parameter name -> tensor of the attacked update (the embedding adapter's ``up.weight`` gradient is
    read; the names in ``peel_names`` are peeled along); ``bag``: stage 1's tokens; ``lm``: whether the client's
    loss is the LM loss (default: the model has an LM head) or its classification head's cross-entropy (module
    docstring: C - 1 coefficients fitted per sentence instead of one batch scale)."""

    def __init__(self, model: nn.Module, upload: dict[str, torch.Tensor], bag: list[int], pad: int,
                 peel_names: tuple[str, ...] = (), chunk: int = 32, lm: bool | None = None,
                 per_sentence_scale: bool = False):
        self.model, self.pad, self.chunk = model, int(pad), int(chunk)
        self.lm = has_lm_head(model) if lm is None else bool(lm)
        self.num_labels = 1 if self.lm else int(getattr(getattr(model, "config", None), "num_labels", 2) or 2)
        #: classifier: each verified sentence's fitted (C - 1,) coefficients, set by the caller that verified it
        self.coefs: dict[tuple[int, ...], torch.Tensor] = {}
        self.adapter = getattr(model, PREFIX)["embedding"]
        self.bag = sorted(int(v) for v in bag)
        self.index = {v: i for i, v in enumerate(self.bag)}
        E = model.get_input_embeddings().weight.detach().to(f64)[self.bag]
        a = self.adapter
        A = torch.relu(E @ a.down.weight.detach().to(f64).T + a.down.bias.detach().to(f64))  # (T, r)
        G = upload[f"{PREFIX}.embedding.up.weight"].detach().to(f64)  # (d, r) = sum_v g_v a_v^T
        self.usable = len(self.bag) <= A.shape[1] and int(torch.linalg.matrix_rank(A)) == len(self.bag)
        X = torch.linalg.lstsq(A.T, G.T).solution if self.usable else torch.zeros(len(self.bag), G.shape[0], dtype=f64)
        self.fit = float((X.T @ A - G).norm() / G.norm().clamp_min(1e-300)) if self.usable else float("inf")
        self.usable = self.usable and self.fit < 1e-4
        self.obs = X  # (T, d): what is left of every bag token's summed output gradient
        self.norms = self.obs.norm(dim=1).clamp_min(1e-300)  # of the full upload: residuals stay relative to it
        self.peel_names = tuple(peel_names)
        self.rest = {n: upload[n].detach().to(f64).clone() for n in self.peel_names}
        self.scale: float | None = None  # LM: 1 / (targets in the batch), fixed by the first verified sentence
        #: DP-SGD's per-sample clipping (a declared per-sample clip norm): each sentence enters the upload at its own
        #: scale c_i / targets, c_i = min(1, C / ||g_i||) -- an LM's sentences get one scale >= 0 each, fitted at
        #: its tokens and kept for peeling (:attr:`coefs`), not one batch scale (gradleak.attacks.utr.clipped)
        self.per_sentence_scale = bool(per_sentence_scale)
        self.evaluations = 0

    # ------------------------------------------------------------------ candidate gradients
    def _objectives(self, ids: torch.Tensor, am: torch.Tensor) -> list[torch.Tensor]:
        """The per-sentence loss components whose gradients a sentence's share combines: the LM loss summed over
        the sentence's targets (one), or the classifier's logit differences logit_c - logit_0, c = 1..C-1; each
        (N,) over the chunk's sentences."""
        logits = self.model(input_ids=ids, attention_mask=am).logits
        if not self.lm:
            return [logits[:, c] - logits[:, 0] for c in range(1, logits.shape[-1])]
        logits = logits[:, :-1]
        tgt = ids[:, 1:].masked_fill(am[:, 1:] == 0, -100)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1),
                                           ignore_index=-100, reduction="none")
        return [loss.view(tgt.shape).sum(1)]

    def _backward(self, sents: list[list[int]], params: list[nn.Parameter] = (),
                  weights: list[torch.Tensor] | None = None):
        """Per sentence {token: (K, d) summed embedding-adapter output gradients, one row per loss component} (LM:
        K = 1, the *summed* token loss; classifier: K = C - 1 logit differences), and the gradients of ``params``
        summed over the sentences of each sentence's components weighted by ``weights[i]`` ((K,); default ones)."""
        out: list[dict[int, torch.Tensor]] = []
        totals = [torch.zeros_like(p, dtype=f64) for p in params]
        rec: list[torch.Tensor] = []

        def hook(_m, _i, o):
            o.retain_grad()
            rec.append(o)

        with hooked_with_grads(self.adapter, hook, params):
            for a in range(0, len(sents), self.chunk):
                part = sents[a:a + self.chunk]
                ids, am = pad_right(part, self.pad)
                rec.clear()
                objs = self._objectives(ids, am)
                K = len(objs)
                cols = [torch.autograd.grad(o.sum(), rec[0], retain_graph=True)[0].detach().to(f64) for o in objs]
                g = torch.stack(cols, 2)  # (N, L, K, d)
                if params:
                    w = (torch.ones(len(part), K) if weights is None
                         else torch.stack([torch.as_tensor(x, dtype=torch.float32).reshape(K)
                                           for x in weights[a:a + self.chunk]]))
                    total = sum((w[:, k].to(o.dtype) * o).sum() for k, o in enumerate(objs))
                    for t, pg in zip(totals, torch.autograd.grad(total, list(params))):
                        t += pg.detach().to(f64)
                for i, s in enumerate(part):
                    per: dict[int, torch.Tensor] = {}
                    for pos, v in enumerate(s):
                        per[v] = per[v] + g[i, pos] if v in per else g[i, pos].clone()
                    out.append(per)
                self.evaluations += len(part)
        return out, totals

    # ------------------------------------------------------------------ the test
    def residuals(self, sents: list[list[int]]) -> list[tuple[float, Any]]:
        """(best relative residual over the sentence's tokens, the coefficients fitted there) per sentence: at each
        token v, || obs_v - g_v(s)^T w || / || obs_v || (what is left of obs_v after peeling). LM: w is one float,
        fitted, or the batch scale once known; classifier: w is the (C - 1,) tensor fitted by least squares. Tokens
        whose occurrences are all peeled are skipped."""
        return self._match(self._backward(sents)[0])

    def _match(self, per: list[dict[int, torch.Tensor]]) -> list[tuple[float, Any]]:
        """:meth:`residuals` for per-sentence token gradients already computed."""
        res = []
        for d in per:
            best, w_best = math.inf, float("nan")
            for v, G in d.items():
                i = self.index.get(v)
                gn = float(G.norm())
                if i is None or gn == 0.0:
                    continue
                o = self.obs[i]
                on = float(o.norm())
                if on < 1e-4 * float(self.norms[i]):  # every occurrence peeled: nothing left to match
                    continue
                if self.lm:
                    g = G[0]
                    w = float(o @ g) / gn ** 2 if self.scale is None else self.scale
                    if self.per_sentence_scale:
                        w = max(w, 0.0)  # a clip factor over the targets: nonnegative
                    r = float((o - w * g).norm()) / on
                else:
                    w = torch.linalg.lstsq(G.T, o[:, None]).solution[:, 0]
                    r = float((o - G.T @ w).norm()) / on
                if r < best:
                    best, w_best = r, w
            res.append((best, w_best))
        return res

    def peel(self, sents: list[list[int]]) -> None:
        """Subtract the sentences' exact shares from g_v and from the peeled gradients: at the batch scale (LM) or
        at each sentence's coefficients fitted when it was verified (classifier, :attr:`coefs`)."""
        if not sents:
            return
        mods = dict(self.model.named_parameters())
        params = [mods[n] for n in self.peel_names]
        if self.lm and not self.per_sentence_scale:
            weights = [torch.tensor([float(self.scale)], dtype=f64)] * len(sents)
        else:
            missing = [s for s in sents if tuple(s) not in self.coefs]
            if missing:
                raise ValueError(f"{len(missing)} sentence(s) to peel have no fitted coefficients (not verified)")
            weights = [torch.as_tensor(self.coefs[tuple(s)], dtype=f64).reshape(-1) for s in sents]
        per, totals = self._backward(sents, params, weights)
        for d, w in zip(per, weights):
            for v, G in d.items():
                if v in self.index:
                    self.obs[self.index[v]] -= G.T @ w
        for n, t in zip(self.peel_names, totals):
            self.rest[n] -= t

    def left(self) -> float:
        """What is left of g_v relative to the upload's (0 once every sentence is peeled)."""
        return float(self.obs.norm() / self.norms.norm())


class CausalPeelSearch:
    """Stage 2 for a causal LM whose first layer adapter is saturated (module docstring): rounds of a soft-graded
    prefix search whose nodes are tested as complete sentences (prefix + EOS) by ``test``; verified sentences are
    peeled and the next round searches what is left, strictly (exact membership) once the states left fit.

    ``probe_names``: the layer adapters whose row spaces grade extensions (their gradients must be among
    ``test.peel_names``, as ``PREFIX.<name>.down.weight``)."""

    def __init__(self, model: nn.Module, probe_names: list[str], test: CausalValueTest, candidates: torch.Tensor,
                 bos: int, eos: int, batch_size: int | None, eps: float = 1e-3, rank_rtol: float = 1e-5,
                 tol: float = 1e-4, max_len: int = 128, branch_ratio: float = 2.0, time_budget: float = float("inf"),
                 strict_search=None):
        self.model, self.names, self.test = model, list(probe_names), test
        self.cands, self.bos, self.eos = candidates, int(bos), int(eos)
        self.B = int(batch_size) if batch_size else None
        self.eps, self.rtol, self.tol, self.max_len = eps, rank_rtol, tol, max_len
        self.branch_ratio, self.time_budget = float(branch_ratio), float(time_budget)
        self.strict_search = strict_search  # callable(sub, cands) -> sentences (the exact prefix search)
        self.forwards = 0

    def _key(self, name: str) -> str:
        return f"{PREFIX}.{name}.down.weight"

    def _states(self, prefixes: list[list[int]]) -> list[torch.Tensor]:
        """Per probe, the (P, C, d) newest states of every prefix (all of one length) extended by every candidate."""
        base = _base(self.model)
        P, C = len(prefixes), len(self.cands)
        with torch.no_grad():
            ids, cache, pos = extension_inputs(base, prefixes, self.cands)
            cap = capture_inputs(self.model, self.names, stop=True)
            with cap:
                base(input_ids=ids, past_key_values=cache, position_ids=pos, use_cache=True)
        self.forwards += 2
        return [r[-1][:, -1].reshape(P, C, -1) for r in cap.records]

    def _bases(self, first) -> list[torch.Tensor]:
        """Soft bases of the rest's uploads, one per probe (``first``: the first probe's subspace, already known)."""
        return [first.basis] + [subspace_from_gradients([self.test.rest[self._key(n)]], self.rtol).basis
                                for n in self.names[1:]]

    def _score(self, prefixes: list[list[int]], bases: list[torch.Tensor]) -> torch.Tensor:
        """(P, C) sum over the probes of log relative residuals against the soft bases (lower = better)."""
        chunk = max(1, 4096 // max(1, len(self.cands)))
        rows = []
        for a in range(0, len(prefixes), chunk):
            hs = self._states(prefixes[a:a + chunk])
            s = 0
            for h, Q in zip(hs, bases):
                h = h.to(f64)
                r = (h - (h @ Q) @ Q.T).norm(dim=-1) / h.norm(dim=-1).clamp_min(1e-300)
                s = s + r.clamp_min(1e-30).log()
            rows.append(s)
        return torch.cat(rows)

    def _verify(self, sents: list[list[int]]) -> list[bool]:
        """Complete sentences (BOS ... EOS) that pass the value test; the first fixes the batch scale."""
        if not sents:
            return []
        per, _ = self.test._backward(sents)
        res = self.test._match(per)
        ok = [r < self.tol for r, _ in res]
        if not self.test.lm or self.test.per_sentence_scale:  # each sentence its own coefficients (classifier;
            # an LM under per-sample clipping), kept for peeling
            for s, (_, w), o in zip(sents, res, ok):
                if o:
                    self.test.coefs[tuple(s)] = w
            return ok
        if self.test.scale is None and any(ok):
            self.test.scale = next(w for (r, w), o in zip(res, ok) if o)
            res = self.test._match(per)  # again at the fixed scale
            ok = [r < self.tol for r, _ in res]
        return ok

    def _soft_round(self, t0: float, found: set[tuple[int, ...]], sub) -> list[list[int]]:
        bases = self._bases(sub)
        frontier, new = [[self.bos]], []
        cap = max(2 * (self.B or 16), 16)
        while frontier and len(frontier[0]) < self.max_len and time.perf_counter() - t0 < self.time_budget:
            sc = self._score(frontier, bases)
            ext: list[tuple[float, list[int]]] = []
            for prefix, row in zip(frontier, sc):
                order = row.argsort()
                best = float(row[order[0]])
                ext.append((best, prefix + [int(self.cands[order[0]])]))
                if len(order) > 1 and float(row[order[1]]) - best < math.log(self.branch_ratio):
                    ext.append((float(row[order[1]]), prefix + [int(self.cands[order[1]])]))
            ext.sort(key=lambda e: e[0])
            nxt = [p for _, p in ext[:cap]]
            full = [p + [self.eos] for p in nxt if tuple(p + [self.eos]) not in found]
            ok = self._verify(full)
            hits = [s for s, o in zip(full, ok) if o]
            new += hits
            found.update(tuple(s) for s in hits)
            hit_prefixes = {tuple(s[:-1]) for s in hits}
            frontier = [p for p in nxt if tuple(p) not in hit_prefixes]
            if hits:  # peel them and let the strict search try what is left
                break
        return new

    def run(self, first: list[list[int]] | None = None) -> tuple[list[list[int]], dict[str, Any]]:
        """Rounds: the strict prefix search on what is left of the upload (``first``: its result on the full
        upload, already computed), its sentences tested and the verified ones peeled; a soft round when the strict
        search has nothing new. Returns verified sentences first, then the last strict round's unverified ones."""
        t0 = time.perf_counter()
        found: set[tuple[int, ...]] = set()
        verified: list[list[int]] = []
        unverified: list[list[int]] = []
        strict_rounds = soft_rounds = 0
        log: list[dict[str, Any]] = []  # per round: kind, seconds, sentences verified
        # ``first`` (already searched) is tested even when the budget is spent: stage 2 shares one budget, and
        # testing sentences in hand costs a backward pass each
        while ((first is not None or time.perf_counter() - t0 < self.time_budget)
               and not (self.B and len(verified) >= self.B)
               and self.test.left() > 1e-4):  # the upload explained: every sentence found
            t1 = time.perf_counter()
            sub = subspace_from_gradients([self.test.rest[self._key(self.names[0])]], self.rtol)
            if first is not None:
                sents, first = first, None
            else:
                sents = self.strict_search(sub, self.cands) if self.strict_search is not None else []
            strict_rounds += 1
            full = [[self.bos] + s + [self.eos] for s in sents if s]
            full = [f for f in full if tuple(f) not in found]
            ok = self._verify(full)
            new = [f for f, o in zip(full, ok) if o]
            unverified = [f for f, o in zip(full, ok) if not o]
            log.append({"round": "strict", "seconds": round(time.perf_counter() - t1, 2), "verified": len(new)})
            if not new and self._saturated(sub):
                t1 = time.perf_counter()
                soft_rounds += 1
                new = self._soft_round(t0, found, sub)
                log.append({"round": "soft", "seconds": round(time.perf_counter() - t1, 2), "verified": len(new)})
            if not new:
                break
            found.update(tuple(f) for f in new)
            verified += new
            self.test.peel(new)
        sents = [f[1:-1] for f in verified] + [f[1:-1] for f in unverified if tuple(f) not in found]
        return sents, {"forward_passes": self.forwards, "strict_rounds": strict_rounds, "soft_rounds": soft_rounds,
                       "verified_sentences": len(verified), "value_test_evaluations": self.test.evaluations,
                       "upload_left_after_peeling": self.test.left(),
                       "search_truncated": time.perf_counter() - t0 >= self.time_budget, "peel_log": log}

    @staticmethod
    def _saturated(sub) -> bool:
        """Whether the rest's states may still fill the probed adapter's rows, so that a strict search that found
        nothing new calls for a soft round. 80 %, not the 90 % of ``la_saturated``: near the ceiling the float32
        floor of the upload blurs the rank (measured: SmolLM2 rf = 1 B = 24 seed 0, 609 states in 576 rows, numerical
        rank 520; with a 90 % threshold the run stopped after one soft round and one peeled sentence, the other 23
        still out of the strict search's reach). Below 80 % a sentence the value test cannot check (no once-used
        token) does not start soft rounds. ``sub``: the rest's subspace at the first probe."""
        return sub.rank >= 0.8 * min(sub.rows, sub.dim)
