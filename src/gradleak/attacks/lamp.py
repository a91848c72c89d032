"""LAMP-style baseline (Balunovic et al. 2022), as UTR compares against it (SPEC §3.5).

Optimises continuous input embeddings x (B x L x n, lengths and labels known -- LAMP's threat model, granted
through ``view.public["lengths"]`` / ``["labels"]``) so that the gradient of the client loss w.r.t. the
trainable modules matches the observed update in cosine distance, with an embedding-norm regulariser.
Every ``discrete_every`` steps it alternates with a discrete step: project to the nearest vocabulary tokens
and try random swaps of adjacent tokens, keeping the candidate with the lowest gradient distance plus
``lm_weight`` x the LM's own negative log-likelihood (causal models; for encoders, without an LM head, only
the gradient term). Defaults are small (CPU budget), so this is a weak-but-honest baseline.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from pydantic import Field

from gradleak.attacks.base import AttackBase, AttackConfig, Reconstruction, ThreatModel
from gradleak.attacks.utr import is_causal, specials
from gradleak.errors import BadInput
from gradleak.fl.core import ServerView
from gradleak.registry import ATTACKS


class LAMPConfig(AttackConfig):
    steps: int = Field(200, ge=1, description="continuous optimisation steps")
    lr: float = Field(0.01, gt=0, description="Adam step size")
    discrete_every: int = Field(50, ge=1, description="steps between discrete (token swap) steps")
    swaps: int = Field(16, ge=0, description="random adjacent swaps tried per discrete step")
    lm_weight: float = Field(0.2, ge=0, description="weight of the LM negative log-likelihood (causal models)")
    norm_weight: float = Field(0.01, ge=0, description="embedding-norm regulariser")


@ATTACKS.register("lamp", "LAMP-style optimisation: cosine gradient matching on embeddings + LM prior")
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

    def __init__(self, steps: int = 200, lr: float = 0.01, discrete_every: int = 50, swaps: int = 16,
                 lm_weight: float = 0.2, norm_weight: float = 0.01, seed: int = 0):
        self.steps, self.lr, self.discrete_every, self.swaps = steps, lr, discrete_every, swaps
        self.lm_weight, self.norm_weight, self.seed = lm_weight, norm_weight, seed

    def prepare(self, model: nn.Module, threat: ThreatModel) -> nn.Module:
        return model

    def reconstruct(self, view: ServerView) -> Reconstruction:
        lengths = view.public.get("lengths")
        if not lengths:
            raise BadInput("view.public.lengths", "LAMP needs the sequence lengths (its threat model).",
                           "grant them with threat.knows_lengths=true (LAMP's threat model).")
        t0 = time.perf_counter()
        model, tok = view.model, view.public["tokenizer"]
        causal = is_causal(model)
        sp = specials(tok, causal)
        names = list(view.updates[0].tensors)
        params = dict(model.named_parameters())
        target = [view.updates[0].tensors[n].double() for n in names]
        plist = [params[n] for n in names]
        B, L = len(lengths), max(lengths)
        mask = torch.zeros(B, L, dtype=torch.long)
        for i, n in enumerate(lengths):
            mask[i, :n] = 1
        labels = torch.tensor(view.public.get("labels") or [0] * B)
        E = model.get_input_embeddings().weight.detach()
        g = torch.Generator().manual_seed(self.seed)
        x = (torch.randn(B, L, E.shape[1], generator=g) * E.std()).requires_grad_(True)
        first, last = (sp["bos"], sp["eos"]) if causal else (sp["cls"], sp["sep"])
        fixed = torch.zeros(B, L, dtype=torch.bool)
        fixed[:, 0] = True
        ends = torch.tensor(lengths) - 1
        fixed[torch.arange(B), ends] = True

        def embed_ids(ids):
            return E[ids]

        def with_specials(xx):
            ids = torch.full((B, L), first)
            ids[torch.arange(B), ends] = last
            return torch.where(fixed[..., None], embed_ids(ids), xx)

        def loss_of(xx):
            xx = with_specials(xx)
            if causal:
                out = model(inputs_embeds=xx, attention_mask=mask)
                logits = out.logits[:, :-1]
                lab = self._ids_or_soft(xx, E)[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
                return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), lab.reshape(-1),
                                                   ignore_index=-100)
            out = model(inputs_embeds=xx, attention_mask=mask)
            return nn.functional.cross_entropy(out.logits, labels)

        def grad_dist(xx, create_graph):
            loss = loss_of(xx)
            gs = torch.autograd.grad(loss, plist, create_graph=create_graph, allow_unused=True)
            num, n1, n2 = 0.0, 0.0, 0.0
            for gg, tt in zip(gs, target):
                if gg is None:
                    continue
                gg = gg.double()
                num = num + (gg * tt).sum()
                n1 = n1 + (gg * gg).sum()
                n2 = n2 + (tt * tt).sum()
            return 1 - num / (n1.sqrt() * n2.sqrt() + 1e-30)

        opt = torch.optim.Adam([x], lr=self.lr)
        for step in range(self.steps):
            opt.zero_grad()
            d = grad_dist(x, True) + self.norm_weight * (x.norm(dim=-1) - E.norm(dim=-1).mean()).pow(2).mean()
            d.backward()
            opt.step()
            if (step + 1) % self.discrete_every == 0:
                with torch.no_grad():
                    ids = self._nearest(x, E)
                    x.copy_(self._discrete_step(ids, mask, fixed, E, grad_dist, model, causal, g))
        ids = self._nearest(with_specials(x.detach()), E)
        sents = [ids[i, 1:lengths[i] - 1].tolist() for i in range(B)]
        return Reconstruction(data=sents, info={"steps": self.steps, "attack_seconds": time.perf_counter() - t0,
                                                "word_bag_seconds": 0.0, "sentence_seconds": time.perf_counter() - t0,
                                                # optimisation output: nothing is verified
                                                "verified": [False] * B, "verified_sentences": 0,
                                                "unverified_sentences": B})

    @staticmethod
    def _ids_or_soft(xx, E):
        return (nn.functional.normalize(xx.detach(), dim=-1) @ nn.functional.normalize(E, dim=-1).T).argmax(-1)

    @staticmethod
    def _nearest(x, E):
        return (nn.functional.normalize(x.detach(), dim=-1) @ nn.functional.normalize(E, dim=-1).T).argmax(-1)

    def _discrete_step(self, ids, mask, fixed, E, grad_dist, model, causal, g):
        """Random adjacent swaps of the projected tokens; keep the best by gradient distance (+ LM NLL)."""
        best_ids = ids.clone()

        def score(cand):
            with torch.enable_grad():
                d = float(grad_dist(E[cand].clone().requires_grad_(False), False))
            if causal and self.lm_weight > 0:
                with torch.no_grad():
                    lab = cand.masked_fill(mask == 0, -100)
                    d += self.lm_weight * float(model(input_ids=cand, attention_mask=mask, labels=lab).loss)
            return d

        best = score(best_ids)
        B, L = ids.shape
        for _ in range(self.swaps):
            cand = best_ids.clone()
            for i in range(B):
                n = int(mask[i].sum())
                if n > 3:
                    j = int(torch.randint(1, n - 2, (1,), generator=g))
                    cand[i, j], cand[i, j + 1] = cand[i, j + 1].clone(), cand[i, j].clone()
            s = score(cand)
            if s < best:
                best, best_ids = s, cand
        return E[best_ids].clone()
