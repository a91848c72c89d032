"""DAGER-style baseline (Petrov et al. 2024, as re-implemented for UTR's comparison, UTR paper Sec. 5.1).

DAGER checks token embeddings against the span of the gradient of an *attention* projection: the rows of
dL/dW_Q of layer 0 lie in span{inputs of layer 0's query}; the rows of dL/dW_Q of layer 1 in span{inputs of
layer 1's query}. With LoRA on the query projection the same holds for dL/dA (= B^T dL/dW_Q, rank <= r).

DAGER's layers (Petrov et al. 2024): the token filter on the first attention layer (index 0), the sequence check on
the second (index 1) -- :data:`CHECKED_LAYERS`. The paper attacks whole models, so its second check sees every
position's gradient. On a [CLS] classifier whose layer 1 is the *last* kept layer (``model.layers = 2``) only the
[CLS] query reaches the loss there: that layer's query/key gradient spans far fewer directions than the batch has
states from B = 2 on (MiniLM, RT, seed 0: rank 26 for 71 states), and the check cannot verify the batch;
``info["warning"]`` says so. Keep ``model.layers >= 3`` (benchmarks/utr.py runs DAGER on all 6 MiniLM layers).

When the backbone is frozen and only adapters train (UTR's setting), the update holds no attention-layer
gradient at all: the attack has nothing to check against and reports the failure (``info["failure"]``,
empty reconstruction); the evaluation grades that *undefined* -- not applicable, nothing measured -- not 0.

Stage 1 reuses UTR's batched vocabulary projection (BERT: per (token, position) through the embedding LayerNorm,
:mod:`gradleak.attacks.common.bert_pairs`; Llama: the query input is RMSNorm(E[v]) whose direction is g * E[v]).
Stage 2 reuses UTR's searches (:mod:`gradleak.attacks.common.prefix_search`,
:mod:`gradleak.attacks.common.encoder_search`) with the layer-1 query input as the probe (prefix-wise for causal
models, whole sentences for encoders).
"""

from __future__ import annotations

import re
import time
from typing import Literal, Union

import torch
from torch import nn

from pydantic import Field

from gradleak.attacks.base import AttackBase, Reconstruction, ThreatModel
from gradleak.attacks.common.bert_pairs import bert_pair_exact, bert_pair_residuals
from gradleak.attacks.common.parameters import set_config_fields
from gradleak.attacks.common.encoder_search import EncoderChainSearch
from gradleak.attacks.common.prefix_search import CausalPrefixSearch
from gradleak.attacks.common.subspace import subspace_from_gradients
from gradleak.attacks.common.text import (SpanTestConfig, cap_to_batch, declared_noise_std, is_causal, model_layers,
                                         specials)
from gradleak.fl.core import ServerView
from gradleak.peft.text_adapters import StopForward
from gradleak.registry import ATTACKS

#: why DAGER has nothing to measure on an adapters-only upload (the evaluation grades it undefined, not 0)
NOT_APPLICABLE = "adapters-only upload has no attention-layer gradient"
#: DAGER's two span checks: the token filter on the first attention layer, the sequence check on the second
CHECKED_LAYERS = (0, 1)
QUERY_PATTERNS = (r"layers?\.(\d+)\..*(?:query|q_proj)\.(?:lora_A\.[^.]+\.)?weight$",)
# The last kept layer of a [CLS]-classifier only uses the [CLS] query, so its query gradient has rank 1; the key
# projection (same input) sees every position. We stack key and query gradients where the update has them.
KEY_PATTERNS = (r"layers?\.(\d+)\..*(?:key|k_proj)\.(?:lora_A\.[^.]+\.)?weight$",)


def query_grads(update_tensors: dict[str, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Layer index -> gradient whose rows span the query inputs (full W_Q grad, or LoRA A grad)."""
    out: dict[int, torch.Tensor] = {}
    for name, g in update_tensors.items():
        if "lora_B" in name:
            continue
        for pat in QUERY_PATTERNS:
            m = re.search(pat, name)
            if m:
                out[int(m.group(1))] = g
    return out


def _query_module(model: nn.Module, layer: int) -> nn.Module:
    lay = model_layers(model)[layer]
    if hasattr(lay, "attention"):
        return lay.attention.self.query
    return lay.self_attn.q_proj


class _Capture:
    def __init__(self):
        self.x = None

    def __call__(self, module, args):
        self.x = args[0].detach()
        raise StopForward()


def _probe_query_input(model: nn.Module, layer: int, **inputs) -> torch.Tensor:
    cap = _Capture()
    h = _query_module(model, layer).register_forward_pre_hook(cap)
    try:
        with torch.no_grad():
            model(**inputs)
    except StopForward:
        pass
    finally:
        h.remove()
    return cap.x


class DAGERConfig(SpanTestConfig):
    max_branches: int = Field(8, ge=1, description="trie branching cap")
    noise: Union[float, Literal["public", "none", "estimate"]] = Field(
        "public", description="noise on the observed gradients: 'public' = the per-coordinate std every declared "
        "defense implies (exact tests when there is none), 'none' = exact tests, 'estimate' = from the spectrum, or a "
        "known std (float > 0); under noise the ranks come from the noise spectrum's edge and the tolerances from "
        "Wedin's bound (gradleak.attacks.common.subspace.noisy_subspace)")


@ATTACKS.register("dager", "DAGER-style span check on attention (query) gradients; fails with a frozen backbone")
class DAGERAttack(AttackBase):
    name = "dager"
    Config = DAGERConfig

    @classmethod
    def measurable(cls, experiment_cfg) -> bool:
        """DAGER reads the attention query gradients: a setup that trains none (adapters only, or LoRA without a
        query target) uploads nothing it can use."""
        peft = experiment_cfg.peft
        if getattr(experiment_cfg.model, "train_all", False):
            return True
        if peft.kind == "lora":  # the default targets include the query projection
            return peft.lora_targets is None or any(t in ("query", "q_proj") for t in peft.lora_targets)
        return peft.kind not in ("adapters",)

    @classmethod
    def not_measurable_reason(cls, experiment_cfg) -> str:
        peft = experiment_cfg.peft
        if peft.kind == "lora":
            return (f"DAGER reads the attention query gradients, and LoRA on {peft.lora_targets} trains no query "
                    "projection: add query to peft.lora_targets to audit it")
        return (f"DAGER reads the attention query gradients, and with peft.kind={peft.kind} the backbone is frozen "
                "(only the adapters train), so the upload holds none")

    @classmethod
    def audit_variants(cls, params, defenses):
        """Its span checks decide on a relative-residual tolerance that noise can push a true token past: under a
        declared update defense the audit also runs both tolerances 10x looser (capped below 1)."""
        if not defenses:
            return []
        cfg = cls.Config(**params)
        eb, es = float(cfg.eps_bag), float(cfg.eps_sentence)
        out = [{"eps_bag": min(eb * 10, 0.5), "eps_sentence": min(es * 10, 0.5)}]
        if cfg.noise != "estimate":  # the noise read off the upload's spectrum (quantisation, percentile noise)
            out.append({"noise": "estimate"})
        return out
    modality = "text"
    peft_kinds = ("adapters", "lora")
    reconstruction = "token_sequences"
    devices = ("cpu",)

    def __init__(self, **params):
        """``params``: fields of :class:`DAGERConfig`, whose defaults and constraints apply."""
        set_config_fields(self, params)

    def prepare(self, model: nn.Module, threat: ThreatModel) -> nn.Module:
        return model

    def reconstruct(self, view: ServerView) -> Reconstruction:
        grads = query_grads(view.updates[0].tensors)
        if any(layer not in grads for layer in CHECKED_LAYERS):
            return Reconstruction(data=[], info={
                "failure": f"not applicable: {NOT_APPLICABLE} (no query/key gradient of layers {CHECKED_LAYERS}): "
                           "the backbone is frozen and only adapters train, so DAGER's span check has no subspace "
                           "to test against.",
                "word_bag": [], "word_bag_seconds": 0.0, "sentence_seconds": 0.0})
        model, tok = view.model, view.public["tokenizer"]
        causal = is_causal(model)
        t0 = time.perf_counter()
        victim = view.updates[:1]  # the attacked update only: another client's tokens must not join its subspace
        l0, l1 = CHECKED_LAYERS
        g0 = [u.tensors[k] for u in victim for k in u.tensors if k in _names_for(u.tensors, l0)]
        g1 = [u.tensors[k] for u in victim for k in u.tensors if k in _names_for(u.tensors, l1)]
        # under a declared (or estimated) noise: ranks at the noise edge, tolerances from Wedin's bound
        n0, n1 = declared_noise_std(view, self.noise, g0), declared_noise_std(view, self.noise, g1)
        s0 = subspace_from_gradients(g0, self.rank_rtol, noise_std=n0)
        s1 = subspace_from_gradients(g1, self.rank_rtol, noise_std=n1)
        eps_bag, eps_sentence = max(self.eps_bag, s0.tol), max(self.eps_sentence, s1.tol)
        if causal:
            E = model.get_input_embeddings().weight.detach().double()
            norm = model_layers(model)[0].input_layernorm
            res = s0.residual(E * norm.weight.detach().double())
            tokens = (res < eps_bag).nonzero().flatten().tolist()
            pairs = {int(v): set() for v in tokens}
        else:
            emb = model.base_model.embeddings
            screen = max(self.screen_tol, 10 * eps_bag)
            R = bert_pair_residuals(emb, s0, min(self.max_positions, emb.position_embeddings.weight.shape[0]),
                                    stop_after=s0.rank, screen=screen)
            vv, pp = (R < screen).nonzero(as_tuple=True)
            vv, pp = vv[:200_000], pp[:200_000]
            ok = bert_pair_exact(emb, s0, vv, pp) < eps_bag
            pairs = {}
            for v, p in zip(vv[ok].tolist(), pp[ok].tolist()):
                pairs.setdefault(int(v), set()).add(int(p))
            tokens = sorted(pairs)
        t1 = time.perf_counter()
        sp = specials(tok, causal)
        if causal:
            def probe(base, ids, cache, pos):
                return _probe_query_input(base, l1, input_ids=ids, past_key_values=cache, position_ids=pos,
                                          use_cache=True)

            cands = torch.tensor([t for t in tokens if t not in (sp["bos"], sp["pad"])] or [sp["bos"]])
            search = CausalPrefixSearch(model, [], s1, eps_sentence, sp["bos"], cands, max_len=self.max_len,
                                        max_branches=self.max_branches, probe_fn=probe)
            sents, sinfo = search.run()
        else:
            def probe_enc(m, batch):
                return _probe_query_input(m, l1, input_ids=batch, attention_mask=torch.ones_like(batch))

            search = EncoderChainSearch(model, "", s1, eps_sentence, sp["cls"], sp["sep"], sp["mask"], pairs,
                                        view.public.get("batch_size"), probe_fn=probe_enc)
            sents, sinfo = search.run()
        t2 = time.perf_counter()
        depth = len(model_layers(model))
        info = {"word_bag": tokens, "word_bag_size": len(tokens), "rank_layer0": s0.rank, "rank_layer1": s1.rank,
                "checked_layers": list(CHECKED_LAYERS), "model_layers": depth,
                "capacity_exhausted": bool(s0.saturated or s1.saturated), "word_bag_seconds": t1 - t0,
                "noise_std_layer0": n0, "noise_std_layer1": n1, "eps_bag_used": eps_bag, "eps_sentence_used": eps_sentence,
                "sentence_seconds": t2 - t1, **sinfo}
        sents = cap_to_batch(sents, info, view.public.get("batch_size"), causal)
        unverify_repeats(sents, info)
        if not causal and l1 == depth - 1:
            info["warning"] = last_layer_warning(depth, s1.rank)
        return Reconstruction(data=sents, info=info)


def last_layer_warning(depth: int, rank: int) -> str:
    """What a second span check on a [CLS] classifier's last layer cannot do (module docstring)."""
    return (f"dager: the second span check runs on layer {CHECKED_LAYERS[1]}, the last of the model's {depth} layers; "
            f"a [CLS] classifier's last layer gets its gradient through the [CLS] query only (rank {rank} here), so "
            "sentences with more states than that cannot be verified. DAGER as published checks the first two "
            f"attention layers of a deeper model: set model.layers >= {CHECKED_LAYERS[1] + 2}.")


def unverify_repeats(sents: list[list[int]], info: dict) -> None:
    """A copy of an earlier sentence adds no state to the span, so the test cannot tell it from the original: only
    the first copy keeps its ``verified`` flag (a 2-layer run returned one verified sentence twice for a B = 2
    batch of two different sentences)."""
    flags, seen = info.get("verified", []), set()
    for i, s in enumerate(sents):
        if tuple(s) in seen and i < len(flags):
            flags[i] = False
        seen.add(tuple(s))
    info["verified_sentences"] = int(sum(flags))
    info["unverified_sentences"] = len(sents) - int(sum(flags))


def _names_for(tensors: dict[str, torch.Tensor], layer: int) -> set[str]:
    """Gradient names whose rows span layer ``layer``'s attention input: key if present (layer >= 1), else query."""
    def match(patterns):
        out = set()
        for name in tensors:
            if "lora_B" in name:
                continue
            for pat in patterns:
                m = re.search(pat, name)
                if m and int(m.group(1)) == layer:
                    out.add(name)
        return out

    # softmax shift-invariance makes the key gradients sum to zero over positions (rank K-1): stack the query
    # gradient with them to recover the missing direction.
    return match(QUERY_PATTERNS) | (match(KEY_PATTERNS) if layer >= 1 else set())
