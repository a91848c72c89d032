"""The first layer of a BERT encoder for explicit sentences, evaluated only where a move changes it (the speed of
:class:`~gradleak.attacks.common.encoder_search.EncoderChainSearch`; beyond the paper).

Layer-1 states come from per-(token, position) precomputed query/key/value vectors, and only at the few query
positions a move can change -- a splice costs a handful of attention rows instead of a whole forward pass. Its output
equals the HF layer (tested to 1e-5).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from gradleak.peft.text_adapters import PREFIX


class BertFirstLayer:
    """Layer-0 output of a BERT encoder (embeddings -> embedding adapter -> layer 0) for explicit sentences,
    evaluated only at chosen query positions, from cached per-(token, position) projections."""

    def __init__(self, model: nn.Module, token_type: int = 0):
        base = model.base_model
        emb = base.embeddings
        self.layer = base.encoder.layer[0]
        self.adapter = getattr(model, PREFIX)["embedding"] if "embedding" in getattr(model, PREFIX, {}) else None
        att = self.layer.attention.self
        self.heads = att.num_attention_heads
        self.dh = att.attention_head_size
        self.dtype = emb.word_embeddings.weight.dtype
        self._emb = emb
        self._type = token_type
        self._cache: dict[tuple[int, int], int] = {}
        d = emb.word_embeddings.weight.shape[1]
        self.H0 = torch.zeros(0, d, dtype=self.dtype)
        self.Q = torch.zeros(0, d, dtype=self.dtype)
        self.K = torch.zeros(0, d, dtype=self.dtype)
        self.V = torch.zeros(0, d, dtype=self.dtype)

    @torch.no_grad()
    def index(self, tokens: torch.Tensor) -> torch.Tensor:
        """Row index of every (token, position) of ``tokens`` (N, L) in the projection cache (adds new pairs)."""
        N, L = tokens.shape
        pos = torch.arange(L).expand(N, L)
        keys = list(zip(tokens.flatten().tolist(), pos.flatten().tolist()))
        new = [k for k in dict.fromkeys(keys) if k not in self._cache]
        if new:
            t = torch.tensor([k[0] for k in new])
            p = torch.tensor([k[1] for k in new])
            emb = self._emb
            x = emb.word_embeddings(t) + emb.position_embeddings(p) + emb.token_type_embeddings(
                torch.full_like(t, self._type))
            x = emb.LayerNorm(x)
            if self.adapter is not None:
                x = self.adapter(x)
            att = self.layer.attention.self
            base = len(self.H0)
            self.H0 = torch.cat([self.H0, x])
            self.Q = torch.cat([self.Q, att.query(x)])
            self.K = torch.cat([self.K, att.key(x)])
            self.V = torch.cat([self.V, att.value(x)])
            for i, k in enumerate(new):
                self._cache[k] = base + i
        return torch.tensor([self._cache[k] for k in keys]).view(N, L)

    @torch.no_grad()
    def states(self, tokens: torch.Tensor, lengths: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
        """Layer-0 outputs (N, w, d) at positions ``query`` (N, w) of sentences ``tokens`` (N, L) whose last valid
        index is ``lengths`` (the [SEP]); keys beyond it are masked, as in a padded batch."""
        idx = self.index(tokens)
        N, L = tokens.shape
        w = query.shape[1]
        K = self.K[idx].view(N, L, self.heads, self.dh).transpose(1, 2)  # (N, h, L, dh)
        V = self.V[idx].view(N, L, self.heads, self.dh).transpose(1, 2)
        qi = idx.gather(1, query)
        Qw = self.Q[qi].view(N, w, self.heads, self.dh).transpose(1, 2)  # (N, h, w, dh)
        scores = Qw @ K.transpose(-1, -2) / math.sqrt(self.dh)
        keymask = torch.arange(L)[None, :] > lengths[:, None]
        scores = scores.masked_fill(keymask[:, None, None, :], float("-inf"))
        ctx = (scores.softmax(-1) @ V).transpose(1, 2).reshape(N, w, -1)
        lay = self.layer
        h0 = self.H0[qi]
        a = lay.attention.output.LayerNorm(lay.attention.output.dense(ctx) + h0)
        return lay.output.LayerNorm(lay.output.dense(lay.intermediate(a)) + a)

