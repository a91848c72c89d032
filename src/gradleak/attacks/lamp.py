"""LAMP (Balunovic et al., NeurIPS 2022), the optimisation baseline UTR compares against (UTR paper Sec. 5.1).

LAMP's threat model: the server knows every sequence's length and the labels (granted through
``view.public["lengths"]`` / ``["labels"]``). It alternates two steps on the B x L input embeddings x:

* **continuous**: Adam on ``rec(x) + norm_weight * (mean_l ||x_l|| - mean_v ||E_v||)^2``, where rec is LAMP's
  cosine loss -- ``1 - cos(grad(x), observed)`` per uploaded tensor, averaged over tensors -- with step decay of
  the learning rate (``lr_decay`` every ``decay_every`` steps);
* **discrete** (every ``discrete_every`` steps after a ``burn_in`` fraction): project x to the nearest tokens and,
  per sentence, draw ``candidates`` rearrangements -- swap two tokens, move one token, move a span, move a prefix
  to the end -- scored by ``rec + lm_weight * NLL_LM`` (the auxiliary LM's mean token negative log-likelihood);
  the best replaces the sentence when it beats the current one.

Starts: the best of ``init_candidates`` random embeddings by rec, optimised ``restarts`` times from different
seeds; the best *iterate* by rec of its projected tokens is returned (not the last one).

Deviations, stated: LAMP's BERT prior is a GPT-2 trained with BERT's vocabulary, which is not available offline;
``lm="smollm2"`` scores a BERT candidate by re-tokenising its text for the offline SmolLM2-135M (causal models use
themselves). The LM scores only the ``lm_screen`` candidates best by rec (the LM costs ~0.1 s per candidate on a
CPU core, the rec term ~0.01 s). ``bag_only`` restricts the projection and the candidates' tokens to UTR's exact
word bag (a second row: LAMP given stage 1).
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Literal

import torch
from torch import nn

from pydantic import Field

from gradleak.attacks.base import AttackBase, AttackConfig, Reconstruction, ThreatModel
from gradleak.attacks.common.parameters import set_config_fields
from gradleak.attacks.common.text import SpanTestConfig, has_lm_head, is_causal, specials
from gradleak.attacks.common.word_bag import word_bag
from gradleak.errors import BadInput
from gradleak.fl.core import ServerView
from gradleak.registry import ATTACKS


class LAMPConfig(AttackConfig):
    steps: int = Field(2000, ge=1, description="continuous optimisation steps per restart")
    lr: float = Field(0.01, gt=0, description="Adam step size")
    lr_decay: float = Field(0.89, gt=0, le=1, description="step decay factor of the learning rate")
    decay_every: int = Field(50, ge=1, description="steps between learning-rate decays")
    discrete_every: int = Field(75, ge=1, description="steps between discrete steps")
    burn_in: float = Field(0.1, ge=0, lt=1, description="fraction of the steps before the first discrete step")
    candidates: int = Field(200, ge=0, description="rearrangements scored per sentence and discrete step")
    lm_weight: float = Field(0.2, ge=0, description="weight of the auxiliary LM's NLL in the discrete step")
    lm: Literal["auto", "smollm2", "self", "none"] = Field(
        "auto", description="auxiliary LM: auto / smollm2 = the offline SmolLM2-135M (all 30 layers; BERT "
        "candidates re-tokenised), self = the attacked causal model itself, none")
    lm_screen: int = Field(20, ge=1, description="candidates (best by the gradient term) the LM scores")
    norm_weight: float = Field(1.0, ge=0, description="embedding-norm regulariser")
    init_candidates: int = Field(100, ge=1, description="random inits, the best by the gradient term is optimised")
    restarts: int = Field(1, ge=1, description="independent optimisations; the best by the gradient term is kept")
    bag_only: bool = Field(False, description="project to UTR's word bag only (needs an embedding adapter)")


@ATTACKS.register("lamp", "LAMP: cosine gradient matching on embeddings + discrete rearrangements with an LM prior")
class LAMPAttack(AttackBase):
    """LAMP's threat model: the server knows every sequence's length and the labels (``requires``)."""

    name = "lamp"
    Config = LAMPConfig
    modality = "text"
    reconstruction = "token_sequences"
    devices = ("cpu",)

    @classmethod
    def requires(cls, cfg=None) -> dict[str, bool]:
        return {"knows_lengths": True, "knows_labels": True}

    @classmethod
    def from_config(cls, cfg, ctx):
        return cls(**cfg.model_dump(), seed=ctx.seed)

    def __init__(self, seed: int = 0, **params):
        """``params``: fields of :class:`LAMPConfig`, whose defaults and constraints apply; ``seed``: the run's."""
        set_config_fields(self, params)
        self.seed = int(seed)

    def prepare(self, model: nn.Module, threat: ThreatModel) -> nn.Module:
        return model

    # ------------------------------------------------------------------ the auxiliary LM
    def _aux_lm(self, model, tok, causal):
        """``causal``: the attacked model is a causal LM (a decoder with an LM head; a classifier head has no
        next-token logits, so it cannot be its own prior)."""
        if self.lm_weight == 0 or self.lm == "none":
            return None
        if causal and self.lm == "self":
            def nll(ids_list):
                out = []
                with torch.no_grad():
                    for ids in ids_list:
                        t = torch.tensor([ids])
                        out.append(float(model(input_ids=t, labels=t).loss) if len(ids) > 1 else 0.0)
                return out
            return nll
        if self.lm == "self":
            raise BadInput("attack.params.lm", "'self' needs a causal LM; this one is bidirectional or a "
                           "classifier (no LM head).",
                           "use lm: smollm2 (re-tokenised prior) or lm: none.")
        from gradleak.models.text import load_text_model

        aux = load_text_model("smollm2", num_layers=30, task="lm")  # all 30 layers: the real LM
        aux.model.eval()

        def nll(ids_list):
            out = []
            with torch.no_grad():
                for ids in ids_list:
                    text = tok.decode(ids, skip_special_tokens=True)
                    t = aux.tokenizer(text, return_tensors="pt")["input_ids"]
                    out.append(float(aux.model(input_ids=t, labels=t).loss) if t.shape[1] > 1 else 0.0)
            return out
        return nll

    # ------------------------------------------------------------------ the attack
    def reconstruct(self, view: ServerView) -> Reconstruction:
        lengths = view.public.get("lengths")
        if not lengths:
            raise BadInput("view.public.lengths", "LAMP needs the sequence lengths (its threat model).",
                           "grant them with threat.knows_lengths=true (LAMP's threat model).")
        t0 = time.perf_counter()
        pb = self._problem(view, lengths)
        rec = self._gradient_loss(pb)

        def rec_ids(ids):
            with torch.enable_grad():
                return float(rec(pb.E[ids].clone(), False))

        best = (float("inf"), None)
        gen = torch.Generator().manual_seed(self.seed)
        stats = {"discrete_steps": 0, "accepted_candidates": 0, "lm_scored": 0}
        for restart in range(self.restarts):
            x0 = self._initial_embeddings(pb, rec, gen, stats)
            best = self._optimise(pb, x0, rec, rec_ids, gen, stats, best)
        B = pb.B
        ids = best[1]
        sents = [ids[i, 1:lengths[i] - 1].tolist() for i in range(B)]
        secs = time.perf_counter() - t0
        return Reconstruction(data=sents, info={"steps": self.steps, "restarts": self.restarts, "best_rec": best[0],
                                                "vocabulary": len(pb.vocab), **stats, "attack_seconds": secs,
                                                "word_bag_seconds": 0.0, "sentence_seconds": secs,
                                                # optimisation output: nothing is verified
                                                "verified": [False] * B, "verified_sentences": 0,
                                                "unverified_sentences": B})

    def _problem(self, view: ServerView, lengths: list[int]) -> SimpleNamespace:
        """What the optimisation works on: the uploaded tensors (the non-zero ones) and their parameters, the batch's
        attention mask from the granted ``lengths``, the labels, the vocabulary searched and its normalised
        embeddings, the positions fixed to special tokens ([CLS] ... [SEP] / BOS ... EOS, padding), the client's
        loss (the LM loss only under an LM head) and the auxiliary LM that scores candidates."""
        model, tok = view.model, view.public["tokenizer"]
        causal = is_causal(model)
        sp = specials(tok, causal)
        params = dict(model.named_parameters())
        names = [n for n in view.updates[0].tensors if n in params and float(view.updates[0].tensors[n].norm()) > 0]
        target = [view.updates[0].tensors[n].detach().double() for n in names]
        plist = [params[n] for n in names]
        B, L = len(lengths), max(lengths)
        mask = torch.zeros(B, L, dtype=torch.long)
        for i, n in enumerate(lengths):
            mask[i, :n] = 1
        labels = torch.tensor(view.public.get("labels") or [0] * B)
        E = model.get_input_embeddings().weight.detach()
        vocab = self._vocabulary(view, E, sp, causal)
        Ev = nn.functional.normalize(E[vocab], dim=-1)
        first, last = (sp["bos"], sp.get("eos")) if causal else (sp["cls"], sp["sep"])
        ends = torch.tensor(lengths) - 1
        fixed = torch.zeros(B, L, dtype=torch.bool)
        fixed[:, 0] = True
        fixed[torch.arange(B), ends] = True  # [CLS] ... [SEP] / BOS ... EOS
        fixed |= mask == 0
        spec_ids = torch.full((B, L), sp["pad"] if sp.get("pad") is not None else first)
        spec_ids[:, 0] = first
        spec_ids[torch.arange(B), ends] = last
        emb_norm = float(E[vocab].norm(dim=-1).mean())
        # the client's loss: the LM loss only under an LM head; a causal backbone with a classification head
        # (a Llama sequence classifier) trains on the labels like a bidirectional one
        lm_loss = causal and has_lm_head(model)
        aux = self._aux_lm(model, tok, lm_loss)
        return SimpleNamespace(model=model, tok=tok, plist=plist, target=target, B=B, L=L, mask=mask, labels=labels,
                               E=E, vocab=vocab, Ev=Ev, fixed=fixed, spec_ids=spec_ids, emb_norm=emb_norm,
                               lm_loss=lm_loss, aux=aux)

    def _gradient_loss(self, pb: SimpleNamespace):
        """``rec(x, create_graph)``: LAMP's cosine loss of the embeddings ``x`` (specials in place): 1 - cos per
        uploaded tensor between the client's loss gradient and the upload, averaged over the tensors."""
        model, E, vocab, Ev, mask = pb.model, pb.E, pb.vocab, pb.Ev, pb.mask

        def with_specials(xx):
            return torch.where(pb.fixed[..., None], E[pb.spec_ids], xx)

        def loss_of(xx):
            xx = with_specials(xx)
            out = model(inputs_embeds=xx, attention_mask=mask)
            if pb.lm_loss:
                logits = out.logits[:, :-1]
                lab = self._project(xx.detach(), E, vocab, Ev)[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
                return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), lab.reshape(-1),
                                                   ignore_index=-100)
            return nn.functional.cross_entropy(out.logits, pb.labels)

        def rec(xx, create_graph):
            """LAMP's cosine loss: 1 - cos per uploaded tensor, averaged over the tensors."""
            gs = torch.autograd.grad(loss_of(xx), pb.plist, create_graph=create_graph, allow_unused=True)
            terms = []
            for gg, tt in zip(gs, pb.target):
                if gg is None:
                    continue
                gg = gg.double()
                terms.append(1 - (gg * tt).sum() / (gg.norm() * tt.norm() + 1e-30))
            return torch.stack(terms).mean()

        return rec

    def _initial_embeddings(self, pb: SimpleNamespace, rec, gen: torch.Generator, stats: dict) -> torch.Tensor:
        """One restart's start: the best of ``init_candidates`` random embeddings (by the gradient term); the first
        restart's best term is recorded as ``init_rec``."""
        E, vocab = pb.E, pb.vocab
        x0, d0 = None, float("inf")
        for _ in range(self.init_candidates):
            cand = torch.randn(pb.B, pb.L, E.shape[1], generator=gen) * E[vocab].std()
            with torch.enable_grad():
                d = float(rec(cand, False))
            if d < d0:
                x0, d0 = cand, d
        stats.setdefault("init_rec", d0)
        return x0

    def _optimise(self, pb: SimpleNamespace, x0: torch.Tensor, rec, rec_ids, gen: torch.Generator, stats: dict,
                  best: tuple) -> tuple:
        """One restart: Adam on the embeddings (gradient term + embedding-norm regulariser, step decay), projected
        onto tokens every ``discrete_every`` steps after the burn-in (and at the last step), with LAMP's discrete
        step on the projection in between; returns the best (term, token ids) so far."""
        E, vocab, Ev, fixed, spec_ids = pb.E, pb.vocab, pb.Ev, pb.fixed, pb.spec_ids
        x = x0.clone().requires_grad_(True)
        opt = torch.optim.Adam([x], lr=self.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=self.decay_every, gamma=self.lr_decay)
        start = int(self.burn_in * self.steps)
        for step in range(self.steps):
            opt.zero_grad()
            reg = (x.norm(dim=-1)[~fixed].mean() - pb.emb_norm).pow(2)
            d = rec(x, True) + self.norm_weight * reg
            d.backward()
            opt.step()
            sched.step()
            last_step = step == self.steps - 1
            if (step + 1 >= start and (step + 1 - start) % self.discrete_every == 0) or last_step:
                with torch.no_grad():
                    ids = torch.where(fixed, spec_ids, self._project(x.detach(), E, vocab, Ev))
                if self.candidates and not last_step:
                    ids = self._discrete_step(ids, pb.mask, fixed, vocab, rec_ids, pb.aux, pb.tok, gen, stats)
                    with torch.no_grad():
                        x.copy_(torch.where(fixed[..., None], x, E[ids]))
                    stats["discrete_steps"] += 1
                r = rec_ids(ids)
                if r < best[0]:
                    best = (r, ids.clone())
        return best

    def _vocabulary(self, view, E, sp, causal) -> torch.Tensor:
        """Token ids the projection may use: the whole vocabulary minus specials, or UTR's word bag (its stage 1 at
        the span-test defaults, exact tests, every observed round stacked, as UTR runs it with ``noise: none``)."""
        drop = {v for k, v in sp.items() if v is not None}
        if self.bag_only:
            try:
                toks = word_bag(view, SpanTestConfig(), all_rounds=True)["tokens"]
            except BadInput as err:
                raise BadInput("attack.params.bag_only", f"the word bag needs an embedding adapter ({err.problem})",
                               "use peft.kind=adapters, or bag_only: false.") from None
            keep = [t for t in toks if t not in drop]
            if keep:
                return torch.tensor(sorted(keep))
        return torch.tensor([v for v in range(E.shape[0]) if v not in drop])

    @staticmethod
    def _project(x, E, vocab, Ev):
        """Nearest token by cosine similarity, among ``vocab``."""
        return vocab[(nn.functional.normalize(x, dim=-1) @ Ev.T).argmax(-1)]

    def _discrete_step(self, ids, mask, fixed, vocab, rec_ids, aux, tok, gen, stats):
        """Per sentence: ``candidates`` rearrangements of its free tokens; keep the best by rec + lm_weight NLL."""
        ids = ids.clone()
        B = ids.shape[0]

        def rnd(n):
            return int(torch.randint(0, n, (1,), generator=gen))

        for i in range(B):
            free = [p for p in range(ids.shape[1]) if not fixed[i, p]]
            if len(free) < 2:
                continue
            cur = [int(ids[i, p]) for p in free]
            cands = []
            for _ in range(self.candidates):
                c = list(cur)
                kind, n = rnd(4), len(c)
                if kind == 0:  # swap two tokens
                    a, b = rnd(n), rnd(n)
                    c[a], c[b] = c[b], c[a]
                elif kind == 1:  # move one token
                    t = c.pop(rnd(n))
                    c.insert(rnd(n), t)
                elif kind == 2 and n > 2:  # move a span
                    a = rnd(n - 1)
                    b = a + 1 + rnd(min(n - a - 1, 5))
                    span, rest = c[a:b], c[:a] + c[b:]
                    k = rnd(len(rest) + 1)
                    c = rest[:k] + span + rest[k:]
                else:  # move a prefix to the end
                    k = 1 + rnd(n - 1)
                    c = c[k:] + c[:k]
                if c != cur:
                    cands.append(c)
            if not cands:
                continue

            def full(c):
                out = ids.clone()
                out[i, torch.tensor(free)] = torch.tensor(c)
                return out

            scored = sorted(((rec_ids(full(c)), c) for c in cands), key=lambda t: t[0])[: self.lm_screen]
            pool = [(rec_ids(ids), cur)] + scored
            if aux is not None:
                n_i = int(mask[i].sum())
                nll = aux([[int(t) for t in full(c)[i, :n_i]] for _, c in pool])
                stats["lm_scored"] += len(pool)
                pool = [(r + self.lm_weight * s, c) for (r, c), s in zip(pool, nll)]
            best = min(pool, key=lambda t: t[0])
            if best[1] is not cur:
                ids = full(best[1])
                stats["accepted_candidates"] += 1
        return ids
