"""UTR stage 2 past the first-layer limit: each candidate sentence tested on the gradient *values* (beyond the paper).

The subspace tests of :mod:`gradleak.attacks.common.encoder_search` read only the row space of the first layer
adapter's gradient. Once the batch has more layer states than the bottleneck has rows, no single sentence can be
tested there (a set of chains is testable only once it holds more than N - b of the N states). The values of the
embedding adapter's gradient keep a per-sentence test at any batch size the stage-1 decomposition handles:

* stage 1 writes the embedding adapter's down-projection gradient in the basis {a_v, b_p, beta} of the LayerNorm
  (``bert_pair_decompose``): the coefficient row of token v is A_v = sum over the batch states l holding v of
  delta_l / s_l (delta_l: the b-vector that state's backward signal leaves at the bottleneck, ReLU mask included;
  s_l: its LayerNorm scale, known from the pair). For a token that occurs once in the batch (most content words)
  A_v s_l *is* one state's delta_l, exactly;
* the server sent the model, so for a complete candidate sentence it computes every position's delta with one
  forward and backward pass. A 2-class head's gradient is (p_1 - y) grad(logit_1 - logit_0) / B: whatever the
  label, one scalar per sentence (C - 1 scalars for C classes), fitted by least squares;
* a right sentence matches at every once-occurring token's position (measured, MiniLM rf=2 B=8 seed 0, 255 states
  in 192 rows: relative residual <= 1.9e-6 for all 8 sentences, 8-21 positions each); one wrong token anywhere moves
  every position's delta (backward through attention): >= 0.03 at every tested position, ~1 at the wrong one.

So the test needs only T + P + 1 <= hidden size (stage 1's own condition), not the bottleneck: it accepts chains one
at a time (they are then peeled out of the first layer subspace, whose test becomes exact once the rest fits) and
grades wrong ones by how far their deltas are off, which guides point moves and splices of the chains left.
Only a one-step gradient of the batch (FedSGD, the paper's setting) has this form; local training breaks it, and
then true chains fail the test and the subspace tests decide alone.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from gradleak.attacks.common.text import hooked_with_grads
from gradleak.peft.text_adapters import PREFIX


def pad_right(sents: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists as a right-padded (N, L) id tensor and its attention mask (how the client batches them)."""
    L = max(len(s) for s in sents)
    ids = torch.full((len(sents), L), int(pad), dtype=torch.long)
    am = torch.zeros_like(ids)
    for i, s in enumerate(sents):
        ids[i, :len(s)] = torch.tensor(s)
        am[i, :len(s)] = 1
    return ids, am


class TokenGradientTest:
    """Exact per-sentence test from the embedding adapter's down-projection gradient (module docstring).

    ``grad``: that gradient (b, n) of the attacked update (one round); ``pairs``: stage 1's token -> positions;
    ``num_labels``: classes of the head (default: the model's ``config.num_labels``); ``signals``: every pair's
    exact bottleneck signal (:func:`gradleak.attacks.common.pair_signals.refine_pairs`), which tests every position, not
    only those of once-placed tokens."""

    def __init__(self, model: nn.Module, grad: torch.Tensor, pairs: dict[int, set[int]], token_type: int = 0,
                 num_labels: int | None = None, chunk: int = 64,
                 signals: dict[tuple[int, int], torch.Tensor] | None = None):
        f64 = torch.float64
        self.model, self.chunk = model, int(chunk)
        self.adapter = getattr(model, PREFIX)["embedding"]
        emb = model.base_model.embeddings
        self.tokens = sorted(int(v) for v in pairs if pairs[v])
        self.P = 1 + max((int(p) for ps in pairs.values() for p in ps), default=0)
        n = emb.word_embeddings.weight.shape[1]
        self.usable = bool(self.tokens) and len(self.tokens) + self.P + 1 <= n
        self.num_labels = int(num_labels or getattr(getattr(model, "config", None), "num_labels", 2) or 2)
        self.evaluations = 0
        self.obs: dict[tuple[int, int], torch.Tensor] = {}  # (token, position) of a once-placed token -> its delta
        self.fit_residual = float("nan")
        self.exact_signals = False
        if not self.usable:
            return
        if signals:
            self.obs = {(int(v), int(p)): u.to(f64) for (v, p), u in signals.items() if float(u.norm()) > 0}
            self.fit_residual = 0.0
            self.exact_signals = True
            self.usable = bool(self.obs)
            return
        toks = torch.tensor(self.tokens)
        E = emb.word_embeddings.weight.detach().to(f64)[toks]
        Pm = emb.position_embeddings.weight.detach().to(f64)[: self.P] \
            + emb.token_type_embeddings.weight.detach().to(f64)[token_type]
        ln = emb.LayerNorm
        g = ln.weight.detach().to(f64)
        M = torch.cat([(E - E.mean(1, keepdim=True)) * g, (Pm - Pm.mean(1, keepdim=True)) * g,
                       ln.bias.detach().to(f64)[None]], 0)  # (T + P + 1, n)
        G = grad.detach().to(f64).reshape(-1, n)
        X = torch.linalg.lstsq(M.T, G.T).solution  # (T + P + 1, b)
        self.fit_residual = float((M.T @ X - G.T).norm() / G.norm().clamp_min(1e-300))
        for k, v in enumerate(self.tokens):
            if len(pairs[v]) != 1:
                continue
            p = int(next(iter(pairs[v])))
            x = E[k] + Pm[p]
            s = float((x.var(unbiased=False) + ln.eps).sqrt())  # the pair's LayerNorm scale
            self.obs[(v, p)] = X[k] * s
        self.usable = bool(self.obs)

    # ------------------------------------------------------------------ candidate deltas
    def deltas(self, sents: list[list[int]], adapter: nn.Module | None = None, inputs: list | None = None
               ) -> list[torch.Tensor]:
        """Per position (L_s, C - 1, b) float64 bottleneck signals of each sentence (complete token lists, [CLS] ...
        [SEP]) for the head's C - 1 independent logit differences, one batched forward/backward per chunk, at the
        embedding adapter (default) or ``adapter``; ``inputs`` receives each sentence's (L_s, n) adapter inputs."""
        out: list[torch.Tensor] = []
        down = (adapter or self.adapter).down
        pad = int(getattr(getattr(self.model, "config", None), "pad_token_id", 0) or 0)
        cap: dict[str, torch.Tensor] = {}

        def hook(_m, i, o):
            o.retain_grad()
            cap["z"], cap["x"] = o, i[0].detach()

        try:
            with hooked_with_grads(down, hook, (down.weight, down.bias)):
                for a in range(0, len(sents), self.chunk):
                    part = sents[a:a + self.chunk]
                    ids, am = pad_right(part, pad)
                    logits = self.model(input_ids=ids, attention_mask=am).logits
                    cols = []
                    for c in range(1, self.num_labels):
                        cap["z"].grad = None
                        (logits[:, c] - logits[:, 0]).sum().backward(retain_graph=c < self.num_labels - 1)
                        cols.append(cap["z"].grad.detach().to(torch.float64))
                    d = torch.stack(cols, 2)  # (N, L, C - 1, b)
                    out += [d[i, :len(s)] for i, s in enumerate(part)]
                    if inputs is not None:
                        inputs += [cap["x"][i, :len(s)].to(torch.float64) for i, s in enumerate(part)]
                    self.evaluations += len(part)
        finally:
            for p in (down.weight, down.bias):
                p.grad = None
        return out

    def contribution(self, sents: list[list[int]], adapter: nn.Module,
                     blocked: list[set[tuple[int, int]]] | None = None) -> torch.Tensor:
        """The sentences' exact share of ``adapter``'s down-projection gradient in the upload, (b, n) float64: each
        sentence's sum_t delta_t x_t^T per logit difference, weighted by the coefficients the value test fits (the
        label scale; ``blocked`` as in :meth:`score`). Subtracting it from the upload leaves the other sentences'
        gradient alone."""
        coefs: list = []
        self.score(sents, blocked, coefs=coefs)
        xs: list = []
        ds = self.deltas(sents, adapter, xs)
        total = torch.zeros(ds[0].shape[-1], xs[0].shape[-1], dtype=torch.float64)
        for d, x, c in zip(ds, xs, coefs):
            if c is None:
                raise ValueError("a sentence without a tested position has no fitted label scale")
            total += torch.einsum("lcb,c,ln->bn", d, c, x)
        return total

    # ------------------------------------------------------------------ the test
    def score(self, sents: list[list[int]], blocked: list[set[tuple[int, int]]] | None = None,
              profile: list | None = None, coefs: list | None = None) -> list[tuple[float, float, int]]:
        """(max, mean, number) of the relative residuals ||obs - delta c|| / ||obs|| over each sentence's tested
        positions: those holding a once-placed token, except the (token, position) pairs in ``blocked[i]`` (held by
        another chain too: a shared pair sums two deltas). A sentence with no tested position gets (inf, inf, 0).
        ``profile``: a list that receives, per sentence, the (position, residual) pairs; ``coefs``: the fitted
        (C - 1,) coefficients (None without a tested position)."""
        res: list[tuple[float, float, int]] = [(math.inf, math.inf, 0)] * len(sents)
        if profile is not None:
            profile[:] = [[] for _ in sents]
        if coefs is not None:
            coefs[:] = [None for _ in sents]
        pos = [[(p, (v, p)) for p, v in enumerate(s) if (v, p) in self.obs
                and (blocked is None or (v, p) not in blocked[i])] for i, s in enumerate(sents)]
        todo = [i for i in range(len(sents)) if pos[i]]
        if not todo:
            return res
        for i, dt in zip(todo, self.deltas([sents[i] for i in todo])):
            obs = torch.stack([self.obs[k] for _, k in pos[i]])  # (m, b)
            pred = dt[[p for p, _ in pos[i]]]  # (m, C - 1, b)
            A = pred.permute(0, 2, 1).reshape(-1, pred.shape[1])  # (m b, C - 1)
            coef = torch.linalg.lstsq(A, obs.reshape(-1, 1)).solution
            r = (obs - (A @ coef).view_as(obs)).norm(dim=1) / obs.norm(dim=1).clamp_min(1e-300)
            res[i] = (float(r.max()), float(r.mean()), len(pos[i]))
            if profile is not None:
                profile[i] = [(p, float(x)) for (p, _), x in zip(pos[i], r)]
            if coefs is not None:
                coefs[i] = coef[:, 0]
        return res

    @staticmethod
    def held_by_others(chains: list[list[int]], skip: tuple[int, ...] = ()) -> list[set[tuple[int, int]]]:
        """For each chain i, the (token, position) pairs of every other chain (not i, not those in ``skip``)."""
        count: dict[tuple[int, int], int] = {}
        own = [{(v, p) for p, v in enumerate(s)} for s in chains]
        for i, ks in enumerate(own):
            if i in skip:
                continue
            for k in ks:
                count[k] = count.get(k, 0) + 1
        out = []
        for i, ks in enumerate(own):
            mine = ks if i not in skip else set()
            out.append({k for k, c in count.items() if c - (k in mine) > 0})
        return out

    def passing(self, chains: list[list[int]], eps: float, todo: list[int] | None = None) -> list[bool]:
        """For each chain of ``todo`` (default all): whether its every tested position matches within ``eps``
        (pairs another chain of ``chains`` holds are not tested)."""
        todo = list(range(len(chains))) if todo is None else list(todo)
        blocked = self.held_by_others(chains)
        res = self.score([chains[i] for i in todo], [blocked[i] for i in todo])
        return [n > 0 and mx < eps for mx, _, n in res]
