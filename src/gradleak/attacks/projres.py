"""ProjRes membership inference (paper 004, SPEC §5.1) on the gradients of trainable linear layers.

The rows of the gradient G (out × in) of a linear layer are combinations of the layer's inputs on the
client's batch, so a member's input lies in the row space of G and a non-member's (mostly) does not. The
score of a candidate sentence is the *relative projection residual* of its input representations at the
layer, ``‖h − P_row(G) h‖ / ‖h‖`` (P_row(G) = V_k V_kᵀ from the SVD of G), computed by the server with the
model it sent; lower = more likely a member. ``Reconstruction.data["scores"]`` holds ``−residual``
(higher = member) for the evaluator (ROC AUC, TPR at low FPR).

Decisions the summary leaves open (SPEC A5.2), each a parameter:

* ``aggregation`` over a sentence's tokens: ``min`` (default; one token in the span is enough evidence),
  ``mean``, or ``sentence`` (the residual of the mean token representation). Special tokens ([CLS]/[SEP],
  BOS/EOS, padding) are excluded: they occur in every sentence and lie in every batch's span.
* ``layers``: every trainable linear layer whose weight gradient the update carries (adapter down- and
  up-projections, LoRA A and B, the task head) or the names given; ``layer_aggregation`` combines them
  (``min_z``, default: each layer's residuals standardised over the client's candidates, then the minimum —
  a saturated layer, where every candidate lies in the span, has no spread and drops out, and so does a layer
  whose gradient rank is below the batch size when the server knows it (its rows are a mixture that holds no
  single member: e.g. the last BERT layer, where only [CLS] receives gradient); ``min`` of the raw
  residuals lets such a layer tie every candidate at 0; ``mean``). Per-layer scores are kept in
  ``info["layer_scores"]`` so the evaluation can report each layer's AUC.
* Rounds: a member is in the span of its client's gradient in every observed round; the residual is
  combined over rounds by ``round_aggregation`` (``min`` default).
* Rank: singular values above ``rank_rtol`` × the largest count (float32 gradients: 1e-5).
* Candidates come from the server's public knowledge (``view.public["candidates"]``: per observed update,
  the sentences to score); granted under ``threat.public_data``.
"""

from __future__ import annotations

import copy
from typing import Literal, Optional, Union

import torch
from pydantic import Field
from torch import nn

from gradleak.attacks.base import AttackBase, AttackConfig, Reconstruction
from gradleak.errors import BadInput
from gradleak.registry import ATTACKS


class ProjResConfig(AttackConfig):
    aggregation: Literal["min", "mean", "sentence"] = Field("min", description="token aggregation of a sentence's residuals")
    layers: Union[Literal["all"], list[str]] = Field("all", description="'all' trainable linear layers, or parameter-name substrings")
    layer_aggregation: Literal["min_z", "min", "mean"] = Field(
        "min_z", description="combine the layers: min of per-layer standardised residuals (min_z), raw min, or mean")
    round_aggregation: Literal["min", "mean", "last"] = Field("min", description="combine the observed rounds")
    rank_rtol: float = Field(1e-5, gt=0, lt=1, description="relative singular-value cut-off of the gradient's row space")
    batch_size: int = Field(64, ge=1, description="candidates per forward pass")


def row_space(G: torch.Tensor, rtol: float) -> torch.Tensor:
    """Orthonormal basis (in × k) of the row space of G (out × in)."""
    G = G.detach().to(torch.float64)
    if G.abs().max() == 0:
        return G.new_zeros(G.shape[1], 0)
    _, S, Vh = torch.linalg.svd(G, full_matrices=False)
    k = int((S > rtol * S[0]).sum())
    return Vh[:k].T


def relative_residual(h: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """‖h − V Vᵀ h‖ / ‖h‖ along the last dimension (0 for h = 0)."""
    h = h.to(torch.float64)
    if V.shape[1] >= h.shape[-1]:  # the row space is the whole input space: every vector lies in it exactly
        return torch.zeros(h.shape[:-1], dtype=torch.float64)
    r = h - (h @ V) @ V.T if V.shape[1] else h
    return r.norm(dim=-1) / h.norm(dim=-1).clamp_min(1e-300)


class _InputCapture:
    """Forward pre-hooks recording the input of each target linear module."""

    def __init__(self, modules: dict[str, nn.Module]):
        self.modules, self.records, self.handles = modules, {}, []

    def __enter__(self):
        for name, m in self.modules.items():
            self.handles.append(m.register_forward_pre_hook(lambda mod, args, name=name: self.records.__setitem__(name, args[0].detach())))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return False


def target_layers(model: nn.Module, update_keys, wanted) -> dict[str, nn.Module]:
    """Linear modules whose ``.weight`` gradient the update carries (names without ``.weight``)."""
    mods = dict(model.named_modules())
    out = {}
    for k in update_keys:
        if not k.endswith(".weight"):
            continue
        name = k[: -len(".weight")]
        m = mods.get(name)
        if isinstance(m, nn.Linear) and (wanted == "all" or any(w in k for w in wanted)):
            out[name] = m
    return out


@ATTACKS.register("projres", "ProjRes membership inference: projection residual on the observed gradient's row space")
class ProjRes(AttackBase):
    """Honest-but-curious server holding candidate sentences (``threat.public_data``)."""

    name = "projres"
    Config = ProjResConfig
    modality = "text"
    peft_kinds = ("adapters", "lora", "none")
    reconstruction = "membership"
    devices = ("cpu", "cuda")

    def __init__(self, aggregation: str = "min", layers="all", layer_aggregation: str = "min",
                 round_aggregation: str = "min", rank_rtol: float = 1e-5, batch_size: int = 64):
        self.aggregation, self.layers = aggregation, layers
        self.layer_aggregation, self.round_aggregation = layer_aggregation, round_aggregation
        self.rank_rtol, self.batch_size = float(rank_rtol), int(batch_size)

    @classmethod
    def requires(cls, cfg=None) -> dict[str, bool]:
        return {"public_data": True}

    def reconstruct(self, view) -> Reconstruction:
        cands = view.public.get("candidates")
        tok = view.public.get("tokenizer")
        if not cands:
            raise BadInput("threat.public_data", "ProjRes needs candidate samples to score.",
                           "grant threat.public_data=true (the server holds candidates) and set data.nonmembers > 0.")
        keys = list(view.updates[0].tensors)
        targets = target_layers(view.model, keys, self.layers)
        if not targets:
            raise BadInput("attack.layers", f"no trainable linear layer of the update matches {self.layers!r}.",
                           "use layers: all, or substrings of the update's parameter names.")
        model = copy.deepcopy(view.model).eval()
        targets = target_layers(model, keys, self.layers)
        rounds = view.rounds if self.round_aggregation != "last" else view.rounds[-1:]
        states = view.round_states if self.round_aggregation != "last" else view.round_states[-1:]
        per_round: list[dict[int, dict[str, torch.Tensor]]] = []
        ranks: dict[str, list[int]] = {n: [] for n in targets}
        client_rank: dict[int, dict[str, int]] = {}
        for ups, state in zip(rounds, states):
            with torch.no_grad():
                params = dict(model.named_parameters())
                for n, v in state.items():
                    params[n].copy_(v.to(params[n].device, params[n].dtype))
            res: dict[int, dict[str, torch.Tensor]] = {}
            for ci, texts in cands.items():
                upd = ups[ci]
                bases = {n: row_space(upd.tensors[n + ".weight"], self.rank_rtol) for n in targets}
                for n, V in bases.items():
                    ranks[n].append(V.shape[1])
                client_rank[ci] = {n: V.shape[1] for n, V in bases.items()}
                res[ci] = self._score(model, tok, targets, bases, texts, view.public.get("model_kind"))
            per_round.append(res)
        batch = int(view.public.get("batch_size") or 0)
        scores, layer_scores = {}, {n: {} for n in targets}
        for ci in cands:
            stack = {n: torch.stack([r[ci][n] for r in per_round]) for n in targets}  # rounds × candidates
            comb = {n: (s.min(0).values if self.round_aggregation == "min" else s.mean(0)) for n, s in stack.items()}
            for n in targets:
                layer_scores[n][ci] = (-comb[n]).tolist()
            allr = torch.stack(list(comb.values()))  # layers × candidates
            if self.layer_aggregation == "min_z":
                # standardise each layer over this client's candidates (no truth needed): a saturated layer (every
                # candidate in its span) has no spread and drops out; a member stands out in its best layer
                sd = allr.std(1, keepdim=True)
                z = (allr - allr.mean(1, keepdim=True)) / sd.clamp_min(1e-12)
                informative = sd[:, 0] > 1e-9
                if batch:  # a row space of rank < B cannot hold each member: a mixture, uninformative
                    ranks_now = torch.tensor([client_rank[ci][n] for n in comb])
                    if (informative & (ranks_now >= batch)).any():
                        informative &= ranks_now >= batch
                total = z[informative].min(0).values if informative.any() else allr.mean(0)
            else:
                total = allr.min(0).values if self.layer_aggregation == "min" else allr.mean(0)
            scores[ci] = (-total).tolist()
        info = {"layers": list(targets), "rank_per_layer": {n: max(r) if r else 0 for n, r in ranks.items()},
                "input_width_per_layer": {n: m.in_features for n, m in targets.items()},
                "rounds_scored": len(per_round), "layer_scores": layer_scores}
        return Reconstruction({"scores": scores}, info)

    def _score(self, model, tok, targets, bases, texts, kind) -> dict[str, torch.Tensor]:
        """Residual per candidate and layer (aggregated over the candidate's non-special tokens)."""
        from gradleak.models.text import causal_specials

        out = {n: [] for n in targets}
        dev = next(model.parameters()).device
        special = set(tok.all_special_ids)
        for a in range(0, len(texts), self.batch_size):
            part = texts[a:a + self.batch_size]
            if kind == "causal":
                bos, eos = causal_specials(tok)
                seqs = [[bos] + tok.encode(t, add_special_tokens=False) + [eos] for t in part]
                special |= {bos, eos}
            else:
                seqs = [tok.encode(t, add_special_tokens=True) for t in part]
            L = max(len(s) for s in seqs)
            pad = tok.pad_token_id if tok.pad_token_id is not None else 0
            ids = torch.full((len(seqs), L), pad, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, s in enumerate(seqs):
                ids[i, :len(s)] = torch.tensor(s)
                mask[i, :len(s)] = 1
            keep = mask.bool() & ~torch.isin(ids, torch.tensor(sorted(special)))
            with torch.no_grad(), _InputCapture(targets) as cap:
                model(input_ids=ids.to(dev), attention_mask=mask.to(dev))
            for n in targets:
                h = cap.records[n].cpu()
                r = relative_residual(h, bases[n].cpu())
                if h.dim() == 2:  # one vector per sentence (the task head's pooled input)
                    out[n].append(r)
                    continue
                if self.aggregation == "sentence":
                    w = keep.unsqueeze(-1).to(h.dtype)
                    mean = (h * w).sum(1) / w.sum(1).clamp_min(1)
                    out[n].append(relative_residual(mean, bases[n].cpu()))
                elif self.aggregation == "min":
                    out[n].append(torch.where(keep, r, torch.full_like(r, float("inf"))).min(1).values)
                else:
                    out[n].append((r * keep).sum(1) / keep.sum(1).clamp_min(1))
        return {n: torch.cat(v) for n, v in out.items()}
