"""The UTR attack: its configuration, stage 1 (the word bag, :mod:`gradleak.attacks.common.word_bag`) and stage 2
(the sentence search of the model's kind) wired on the server view; the package docstring describes the method."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, Literal, Optional, Union

import torch
from pydantic import Field, field_validator
from torch import nn

from gradleak.attacks.base import AttackBase, Reconstruction, ThreatModel
from gradleak.attacks.common.parameters import set_config_fields
from gradleak.attacks.common.sub_edge import sub_edge_test, token_directions
from gradleak.attacks.common.encoder_search import EncoderChainSearch
from gradleak.attacks.common.prefix_search import CausalPrefixSearch
from gradleak.attacks.common.subspace import (Subspace, estimate_noise_std, is_pruned, spectral_margin,
                                              subspace_from_gradients)
from gradleak.attacks.common.text import (SpanTestConfig, cap_to_batch, collect_grads, declared_noise_std,
                                          has_lm_head, specials)
from gradleak.attacks.common.word_bag import word_bag
from gradleak.attacks.utr.causal import CausalPeelSearch, CausalValueTest
from gradleak.attacks.utr.clipped import ClippedSumSearch, ClippedSumTest
from gradleak.attacks.utr.greedy import METHOD, GreedyCausalSearch, GreedyEncoderSearch
from gradleak.attacks.utr.values import TokenGradientTest
from gradleak.errors import BadInput
from gradleak.fl.core import ServerView
from gradleak.peft.text_adapters import PREFIX, adapter_param
from gradleak.registry import ATTACKS
from gradleak.validation import InfOK

#: the automatic sentence-search budget (``time_budget: null``): BASE + PER_SENTENCE seconds per expected sentence,
#: clamped to [MIN, MAX] (see :func:`auto_time_budget`)
AUTO_BUDGET_BASE, AUTO_BUDGET_PER_SENTENCE, AUTO_BUDGET_MIN, AUTO_BUDGET_MAX = 30.0, 5.0, 60.0, 600.0
#: seconds the clipped-sum search (:mod:`gradleak.attacks.utr.clipped`) may take of stage 2's budget: B + 1 sentences'
#: worth of the automatic rule's per-sentence share, at least 15 s (the text audit's budget; measured MiniLM B = 2,
#: DP-SGD sigma 1e-6, 2 cores at load 6: 8 s where it reaches the noise floor (seed 0), the whole cap where a chain is
#: out of its reach (seed 23: one sentence exact at once, the 31-token other one not finished))
CLIPPED_SUM_MIN_SECONDS = 15.0


def auto_time_budget(sentences: Optional[int]) -> float:
    """Seconds the sentence search may run when ``time_budget`` is null: 30 s + 5 s per expected sentence, at least
    60 s, at most 600 s (the old fixed budget; also the budget when the sentence count is unknown).

    ``sentences``: the sentences the observed upload holds -- the view's public ``batch_size`` (under secure
    aggregation already the sum over the clients, :mod:`gradleak.run.pipeline`), else for a bidirectional model the
    [SEP] positions stage 1 read. A search stops as soon as every expected sentence is verified, so the budget only
    bounds searches that do not succeed (a hopeless space: e.g. a batch past the adapter's capacity). Measured
    (``benchmarks/utr.py``, 2 shared cores): the searches that verified every sentence took at most 74 s at MiniLM
    rf = 1 B = 16, 94 s at SmolLM2 rf = 1 B = 24, 57 s at SmolLM2 B = 8 -- all inside this rule."""
    if not sentences or sentences <= 0:
        return AUTO_BUDGET_MAX
    return min(AUTO_BUDGET_MAX, max(AUTO_BUDGET_MIN, AUTO_BUDGET_BASE + AUTO_BUDGET_PER_SENTENCE * int(sentences)))


def strip_eos(sents: list[list[int]], eos: int | None, lm: bool) -> list[list[int]]:
    """Sentences of a causal search without their final EOS when the model is a classifier (``lm`` False): its head
    pools every position, so the EOS gets a gradient and the search finds it as the sentence's last token; an LM's
    final EOS gets none, so an LM's sentences are left as they are. The result reads as the LM path's (no BOS/EOS)."""
    if lm or eos is None:
        return sents
    return [s[:-1] if s and s[-1] == eos else s for s in sents]


class UTRConfig(SpanTestConfig):
    search: Literal["extended", "paper"] = Field(
        "extended", description="stage 2 and what feeds it: 'paper' = the method as published (span-test word bag, "
        "greedy constructive search, beam width 1, EICW; :mod:`gradleak.attacks.utr.greedy`), with every extension "
        "below off (all_rounds, exact pairs, value_test, soft_rank, peeling); 'extended' = ours (trie / chain "
        "search with those extensions)")
    noise: Union[float, Literal["public", "none", "estimate"]] = Field(
        "public", description="noise on the observed gradients: 'public' = the per-coordinate std the published "
        "update defenses imply (DP / Gaussian noise; exact tests when there is none), 'none' = exact tests, "
        "'estimate' = from the spectrum (Gavish-Donoho median rule), or a known std (float > 0)")

    max_branches: Optional[int] = Field(None, ge=1, description="trie branching cap (default max(8, B))")
    eicw: bool = Field(True, description="consecutive-identical-word filter")
    lm_prior: bool = Field(True, description="rank branches past the cap by the LM")
    all_rounds: bool = Field(True, description="stack the embedding-adapter gradients of every observed round")
    sentence_layer: str = Field("layer_0", description="adapter whose input space tests sentences")
    time_budget: Optional[InfOK] = Field(None, gt=0, description="seconds before the sentence search stops (all of "
                                         "stage 2 together; .inf: no limit); null = automatic from the problem size: "
                                         "30 s + 5 s per expected sentence (the public batch size, summed over the "
                                         "clients under secure aggregation), at least 60 s, at most 600 s. The search "
                                         "stops earlier once every expected sentence is verified")
    value_test: bool = Field(True, description="test candidate sentences on the embedding adapter's gradient values "
                             "(one-step uploads): past the first layer's bottleneck, bidirectional models move chains "
                             "by it, causal models verify sentences, peel them from the upload and search the rest")
    sparsity_aware: bool = Field(True, description="a top-k pruned upload (coordinates exactly zero): read the word "
                                 "bag on the kept support, the pruned entries as an error of the level read off the "
                                 "spectrum, members as the vocabulary's lower outliers (extended search; "
                                 "gradleak.attacks.common.subspace.pruned_membership)")
    clipped_sum: bool = Field(True, description="a noisy one-step upload of a bidirectional classifier: move the "
                              "chain search's sentences by the upload's residual under the clipped-sum model of "
                              "DP-SGD (one label and one scale >= 0 per sentence, fitted) against the chi-square law "
                              "of the declared noise (gradleak.attacks.utr.clipped; extended search)")
    sub_edge: bool = Field(True, description="a noisy or top-k pruned upload: score every vocabulary token by the "
                           "energy of its embedding-adapter direction against the chi-square law of the noise alone "
                           "(gradleak.attacks.common.sub_edge; info sub_edge_*); when stage 1 finds no token, its "
                           "significant tokens are the word bag (extended search)")
    soft_rank: Optional[float] = Field(0.96, gt=0, le=1, description="past the first layer's bottleneck (with the "
                                       "value test): grade chains by this fraction of the upload's strongest "
                                       "directions instead of its whole (saturated) row space; null = off")
    directions: Optional[int] = Field(None, ge=1, description="the oracle ceiling: read the upload through its K "
                                      "strongest directions only -- the embedding adapter's word bag from its K "
                                      "strongest singular directions (the vocabulary's lower outliers, at most K "
                                      "tokens, no positions), the sentence layer's subspace capped at K, no test on "
                                      "the full gradient values; at or above the upload's exact rank nothing is cut "
                                      "(benchmarks/defended.py's text ceilings on the undefended upload)")
    threads: Optional[int] = Field(1, ge=1, le=1024, description="torch threads during the attack (the run's "
                                   "`threads` for the client steps is untouched); default 1: the search is many "
                                   "small float64 products that gain nothing from threads and slow down 3-4x when "
                                   "two threads share a loaded 2-core machine; null = the run's setting")

    @field_validator("noise")
    @classmethod
    def _noise_positive(cls, v):
        if isinstance(v, float) and v <= 0:
            raise ValueError("a noise std must be > 0 (use 'none' for exact tests)")
        return v


@ATTACKS.register("utr", "UTR: word bag from the embedding adapter + sentence search on the first layer adapter")
class UTRAttack(AttackBase):
    """Honest-but-curious server (UTR paper Sec. 3.2): reads only the ServerView (model sent, adapter gradients, tokenizer).

    Parameters: ``search`` -- ``paper`` (the method as published, :mod:`gradleak.attacks.utr.greedy`) or
    ``extended`` (ours; the extensions below apply only here); ``eps_bag`` / ``eps_sentence`` -- membership tolerances (relative residual) for stage 1 / 2;
    ``rank_rtol`` -- relative singular-value cut-off of the SVD; ``max_positions`` -- positions tested for
    absolute-position models; ``max_branches`` -- trie branching cap (LM prior prunes beyond it; default: the
    batch size, at least 8 -- B sentences can branch B ways at the root);
    ``eicw`` -- consecutive-identical-word filter; ``all_rounds`` -- stack the embedding-adapter gradients of every
    observed round (beyond the paper: the bag's capacity grows from d_bottleneck towards d_hidden);
    ``time_budget`` -- seconds after which the sentence search (all of stage 2) stops (``info["search_truncated"]``);
    null: :func:`auto_time_budget` of the expected sentence count (``info["time_budget"]`` reports the one used).
    Every search stops as soon as every expected sentence is verified, whatever its budget.
    """

    name = "utr"
    Config = UTRConfig

    @classmethod
    def audit_variants(cls, params, defenses):
        """Against a declared update defense the published noise level need not be the one the upload carries
        (quantisation; a std too small to matter): the audit also runs the noise read off the upload's spectrum
        ('estimate', measured: stochastic quantisation 16 bits ROUGE-1 50.8 -> 97.9). Exact tests ('none') on a
        noisy upload only exhaust the search's time budget, so they are not a variant. A variant's budget: an
        explicit one, at most 120 s; else the automatic one, left unset (:func:`auto_time_budget`: at most 120 s up to
        18 expected sentences)."""
        from gradleak.defenses.declared import as_declared

        cfg = cls.Config(**params)
        declared = as_declared(defenses)
        budget = {} if cfg.time_budget is None else {"time_budget": min(float(cfg.time_budget), 120.0)}
        out = []
        if declared and cfg.noise != "estimate":
            out.append({"noise": "estimate", **budget})
        if declared.adds_noise and not declared.noise_unknown and cfg.noise != "public":  # the declared level too
            out.append({"noise": "public", **budget})  # (stochastic rounding: each tensor's step² / 6)
        if declared.sparsity and cfg.search == "extended":  # the completion and the plain tests: keep the stronger
            out.append({"sparsity_aware": not cfg.sparsity_aware, **budget})
        return out
    modality = "text"
    peft_kinds = ("adapters",)
    reconstruction = "token_sequences"
    devices = ("cpu",)  # the exact subspace tests run in float64 on the CPU copy of the gradients

    def __init__(self, **params: Any):
        """``params``: fields of :class:`UTRConfig`, whose defaults and constraints apply."""
        set_config_fields(self, params)

    def noise_std(self, view: ServerView, grads: list[torch.Tensor], tensor: str | None = None) -> float | None:
        """Per-coordinate std of the noise on the observed uploads (see ``noise``) of the uploaded tensor ``tensor``
        (``grads`` are its gradients; per-tensor noise such as stochastic rounding is read off it), or None: exact
        tests (:func:`gradleak.attacks.common.text.declared_noise_std`)."""
        return declared_noise_std(view, self.noise, grads, tensor=tensor)

    def sentence_budget(self, batch_size: Optional[int], bag: dict, sp: dict) -> float:
        """Seconds for stage 2: ``time_budget`` when set, else :func:`auto_time_budget` of the expected sentence
        count -- the public ``batch_size`` (the sentences of the observed upload: under secure aggregation the
        clients' summed), else for a bidirectional model the [SEP] positions stage 1 read (a lower bound)."""
        if self.time_budget is not None:
            return float(self.time_budget)
        n = int(batch_size) if batch_size else None
        if n is None and not bag.get("causal") and sp.get("sep") is not None:
            n = len((bag.get("pairs") or {}).get(sp["sep"], ())) or None
        return auto_time_budget(n)

    def prepare(self, model: nn.Module, threat: ThreatModel) -> nn.Module:
        return model  # honest: no model modification (UTR paper Sec. 3.2)

    # -- stage 1
    def word_bag(self, view: ServerView) -> dict[str, Any]:
        """Stage 1 (:func:`gradleak.attacks.common.word_bag.word_bag`) with this attack's parameters and noise
        model."""
        paper = self.search == "paper"
        return word_bag(view, self, self.all_rounds and not paper, noise_std=lambda grads: self.noise_std(view, grads, adapter_param("embedding")),
                        extended=not paper, directions=self.directions)

    def limit_std(self, view: ServerView, bag: dict) -> float | None:
        """The per-coordinate scale of the embedding adapter's information limit (its edge, K and
        ``margin_strongest``, :func:`~gradleak.attacks.common.subspace.spectral_margin`): under a declared top-k
        pruning the declared noise and the pruning's bounded error together (scale t, the kept threshold read off the
        upload: :meth:`gradleak.defenses.update.TopKPruning.observed_error_variance`), in both readings -- not the
        spectrum's Gavish-Donoho estimate, which a matrix with most rows pruned away drives towards 0 (margins of
        1e+64 before); otherwise the noise std stage 1 used."""
        from gradleak.defenses.declared import view_declared, view_error_std

        if view_declared(view).sparsity and self.noise == "public":
            std = view_error_std(view, tensor=adapter_param("embedding"))
            if std:
                return std
        return bag["noise_std"]

    def _sub_edge(self, view: ServerView, bag: dict, sigma: float, pruned: bool) -> dict[str, Any]:
        """The sub-edge word-bag test (:mod:`gradleak.attacks.common.sub_edge`) on the embedding adapter's observed
        gradients at the noise std stage 1 used: the declared one (Gaussian: the chi-square law is exact), or for a
        top-k pruned upload the pruning error's level read off the spectrum (not Gaussian: the law is approximate,
        ``sub_edge_noise`` says so). Special tokens are not scored. Returns the ``sub_edge_*`` info fields, the
        bag under ``sub_edge_bag`` and a ranking of 512 tokens under ``sub_edge_top`` (the bag in the order the
        pursuit took it, then the highest-energy others: the evaluation side can count the batch's tokens among
        the top k against random public tokens through the same ranking). ``pruned``: a top-k pruned upload (either
        reading): the ranking only (``rank_only``: no chi-square cut; ``sigma`` the pruning error's scale), graded by
        the evaluation against its null (``sub_edge_enrichment``)."""
        tok = view.public.get("tokenizer")
        special = tuple(int(v) for v in (getattr(tok, "all_special_ids", None) or []))
        grads = collect_grads(view, adapter_param("embedding"), all_rounds=self.all_rounds)
        D, what, extra = token_directions(view.model)
        # a top-k pruning error is not Gaussian: the pursuit's stopping cut does not hold there (measured: it ran to
        # its cap on every pruned upload), so it ranks 96 tokens (time) with no cut, the ranking is graded against
        # its null by the evaluation, and its tokens are never the word bag
        r = sub_edge_test(grads, D, float(sigma), exclude=special, extra=extra,
                          max_tokens=96 if pruned else None, rank_only=pruned)
        top = r["scores"].clone()
        for v in special:
            if 0 <= v < len(top):
                top[v] = -1.0
        return {"sub_edge_bag": r["tokens"], "sub_edge_signal_present": r["signal_present"],
                "sub_edge_significant_tokens": r["significant_tokens"], "sub_edge_min_log10_p": r["min_log10_p"],
                "sub_edge_bulk_threshold": r["bulk_threshold"], "sub_edge_dof": r["dof"], "sub_edge_alpha": r["alpha"],
                "sub_edge_vocabulary": r["vocabulary"],
                "sub_edge_directions": what,
                "sub_edge_noise": ("top-k pruning error, scale t the kept threshold (not Gaussian: a ranking "
                                   "graded against its null)" if pruned else
                                   "declared Gaussian (chi-square law exact)"),
                "sub_edge_pruned": pruned, "sub_edge_sigma": float(sigma),
                # the ranking: the pursuit's tokens in the order taken, then the rest by their own energy
                "sub_edge_top": (r["tokens"] + [int(v) for v in top.argsort(descending=True)[:512 + len(r["tokens"])]
                                                .tolist() if int(v) not in set(r["tokens"])])[:512]}

    def _clipped_sum(self, view: ServerView, bag: dict, sp: dict, sents: list[list[int]], sinfo: dict[str, Any],
                     budget: float, extra=()) -> tuple[list[list[int]], dict[str, Any]]:
        """A noisy one-step upload of a bidirectional classifier: the chain search's sentences moved by their
        share of the upload under the clipped-sum model (:mod:`gradleak.attacks.utr.clipped`), the noise std the
        word bag used (the declared one, sigma C / B under DP-SGD), the per-sample clip norm from the declared
        defenses. Labels: one label and one scale >= 0 per sentence when the client's loss is the plain
        cross-entropy (no training-time defense, or DP-SGD); C - 1 free coefficients otherwise (label smoothing
        reweights the logits). Skipped (``info["clipped_sum_search"]`` says why) for a multi-step upload, a top-k
        pruned one or an upload without the embedding adapter's down-projection. ``extra``: tokens the sub-edge
        test found beside stage 1's (candidates of the moves)."""
        from gradleak.defenses.declared import view_declared, view_noise_std
        from gradleak.defenses.training import DPSGD, NoDefense

        upd = view.updates[0] if view.updates else None
        if upd is None or upd.kind != "gradient" or int(getattr(upd, "local_steps", 1) or 1) != 1:
            return sents, {**sinfo, "clipped_sum_search": "not tried (not a one-step gradient)"}
        if bag.get("sparsity_aware"):
            return sents, {**sinfo, "clipped_sum_search": "not tried (top-k pruned upload: not Gaussian noise)"}
        if adapter_param("embedding") not in upd.tensors or not sents:
            return sents, {**sinfo, "clipped_sum_search": "not tried (no embedding adapter gradient or no sentences)"}
        declared = view_declared(view)
        if self.noise != "public" and view_noise_std(view) is not None:  # the audit's 'estimate' variant: the
            # declared std's run searches at the exact noise law; this one would repeat it at a biased estimate
            return sents, {**sinfo, "clipped_sum_search": "not tried (the declared noise std is known: the "
                                                          "noise='public' run searches)"}
        plain = declared.training is None or isinstance(declared.training, (DPSGD, NoDefense))
        pad = sp["pad"] if sp["pad"] is not None else 0
        test = ClippedSumTest(view.model, upd.tensors, float(bag["noise_std"]), clip=declared.per_sample_clip_norm,
                              label_model="clipped" if plain else "free", pad=pad)
        seps = sorted(int(q) for q in (bag.get("pairs") or {}).get(sp["sep"], ()))
        cands = sorted(set(bag["tokens"]) | {int(v) for v in extra})  # the sub-edge test's tokens too
        search = ClippedSumSearch(test, cands, sp["cls"], sp["sep"], seps,
                                  batch_size=view.public.get("batch_size"), max_len=self.max_len,
                                  time_budget=budget)
        before = [list(s) for s in sents]
        out, cinfo = search.run(sents)
        info = {**sinfo, **cinfo}
        if cinfo.get("clipped_sum_consistent") and self.noise == "public":  # the batch explains the upload down to
            # the declared noise (an estimated std, biased upwards, stops the search but verifies nothing)
            info["verified_sentences"] = len(out)
        elif out != before[:len(out)]:
            info["verified_sentences"] = 0
        return out, info

    def _ranked_reading(self, view: ServerView, bag: dict, sp: dict, sents: list[list[int]], sinfo: dict[str, Any],
                        sub_la: Subspace, eps_sentence: float, la_saturated: bool, layer_grad: torch.Tensor, left,
                        extra=()) -> tuple[list[list[int]], dict[str, Any]]:
        """A clipped noisy upload (declared per-sample clipping: DP-SGD) whose clipped-sum search did not reach the
        noise (or had no sentence to move): stage 1's pairs read again by rank
        (:func:`~gradleak.attacks.common.bert_pairs.bert_pair_ranked`: the reached positions against their
        chi-square null, each token at its best positions), the chain search and the clipped-sum search on them with
        the rest of stage 2's budget (the chain search at most half of it), and whichever batch explains the upload
        better -- the lower clipped-sum z, a truth-free test (:mod:`gradleak.attacks.utr.clipped`) -- is kept.
        ``info["position_reading"]`` says which; the other's z is reported beside (``clipped_sum_z_other``).
        ``left``: seconds left of stage 2's budget (a function)."""
        from gradleak.attacks.common.bert_pairs import bert_pair_ranked
        from gradleak.defenses.declared import view_declared

        if view_declared(view).per_sample_clip_norm is None or sinfo.get("clipped_sum_consistent"):
            return sents, sinfo
        ran = sinfo.get("clipped_sum_search")
        if ran not in ("ran", "no sentences") or left() < CLIPPED_SUM_MIN_SECONDS:
            return sents, {**sinfo, "position_reading": "stage 1", "ranked_reading": "not tried (" + (
                f"clipped-sum search: {ran}" if ran not in ("ran", "no sentences") else "no budget left") + ")"}
        model = view.model
        emb = model.base_model.embeddings
        npos = min(self.max_positions, emb.position_embeddings.weight.shape[0])
        B = view.public.get("batch_size")
        ranked = bert_pair_ranked(emb, getattr(model, PREFIX)["embedding"],
                                  collect_grads(view, adapter_param("embedding")), bag["tokens"], npos,
                                  bag["noise_std"], sp["sep"], cls=sp["cls"], sep_positions=int(B or 4))
        if ranked is None:
            return sents, {**sinfo, "position_reading": "stage 1",
                           "ranked_reading": "not tried (no position above the noise, or too many for the basis)"}
        pairs, last = ranked
        search = EncoderChainSearch(model, self.sentence_layer, sub_la, eps_sentence, sp["cls"], sp["sep"],
                                    sp["mask"], pairs, B, time_budget=0.5 * left(), joint=la_saturated,
                                    layer_grad=layer_grad, soft_rank=self.soft_rank)
        alt, ainfo = search.run()
        alt, ainfo = self._clipped_sum(view, {**bag, "pairs": pairs}, sp, alt, ainfo, left(), extra=extra)
        inf = float("inf")
        z0 = sinfo.get("clipped_sum_z") if ran == "ran" else None
        z1 = ainfo.get("clipped_sum_z") if ainfo.get("clipped_sum_search") == "ran" else None
        note = {"ranked_reading": "ran", "ranked_pairs": sum(len(p) for p in pairs.values()),
                "ranked_last_position": last, "ranked_sep_positions": sorted(pairs.get(sp["sep"], ()))}
        if (inf if z1 is None else z1) < (inf if z0 is None else z0):
            return alt, {**ainfo, **note, "position_reading": "ranked (clipped upload)", "clipped_sum_z_other": z0,
                         "search_truncated": bool(sinfo.get("search_truncated") or ainfo.get("search_truncated"))}
        return sents, {**sinfo, **note, "position_reading": "stage 1", "clipped_sum_z_other": z1}

    def _causal_peel(self, view: ServerView, bag: dict, sp: dict, cands: torch.Tensor, sents: list[list[int]],
                     sinfo: dict[str, Any], eps_sentence: float,
                     deadline: float = float("inf")) -> tuple[list[list[int]], dict[str, Any]]:
        """Causal models: test the prefix search's sentences on the gradient values, peel the verified ones from the
        upload and search the rest again, soft-graded past the bottleneck (:mod:`gradleak.attacks.utr.causal`).
        Keeps the prefix search's result when the value test cannot be set up (bag wider than the bottleneck).
        ``deadline`` (``time.perf_counter()``): the end of stage 2's budget, shared by the peeling and its strict
        searches (the prefix search's sentences are still tested when it has passed)."""
        model = view.model
        upload = view.updates[0].tensors
        mods = getattr(model, PREFIX)
        names = [self.sentence_layer]  # and the adapter after it, when there is one: a second soft grade
        if self.sentence_layer.startswith("layer_"):
            nxt = f"layer_{int(self.sentence_layer.split('_')[-1]) + 1}"
            names += [nxt] if nxt in mods else []
        keys = tuple(adapter_param(n) for n in names)
        if any(k not in upload for k in keys + (adapter_param("embedding", "up.weight"),)):
            return sents, sinfo
        pad = sp["pad"] if sp["pad"] is not None else sp["bos"]
        lm = has_lm_head(model)
        from gradleak.defenses.declared import view_declared

        clipped = view_declared(view).per_sample_clip_norm is not None  # DP-SGD: a scale per sentence
        test = CausalValueTest(model, upload, bag["tokens"], pad, peel_names=keys, lm=lm, per_sentence_scale=clipped)
        head = (("lm: one scale >= 0 per sentence (DP-SGD's per-sample clipping)" if clipped else
                 "lm: one batch scale (1 / targets)") if lm else
                f"classifier: {test.num_labels - 1} logit-difference coefficients fitted per sentence (label-free)")
        if not test.usable:
            return sents, {**sinfo, "value_test": "unusable", "value_test_head": head}
        B = view.public.get("batch_size")

        def strict(sub: Subspace, c: torch.Tensor) -> list[list[int]]:
            return strip_eos(CausalPrefixSearch(model, [self.sentence_layer], sub, eps_sentence, sp["bos"], c,
                                                max_len=self.max_len,
                                                max_branches=self.max_branches or max(8, int(B or 8)),
                                                max_sentences=max(4 * int(B or 64), 64),
                                                time_budget=max(deadline - time.perf_counter(), 0.0),
                                                eicw=self.eicw, lm_prior=self.lm_prior).run()[0], sp["eos"], lm)

        if not lm:  # the peel search appends EOS to every candidate sentence itself
            cands = cands[cands != sp["eos"]] if bool((cands != sp["eos"]).any()) else cands
        peel = CausalPeelSearch(model, names, test, cands, sp["bos"], sp["eos"], B, eps=eps_sentence,
                                rank_rtol=self.rank_rtol, max_len=self.max_len,
                                time_budget=max(deadline - time.perf_counter(), 0.0), strict_search=strict)
        out, pinfo = peel.run(first=sents)
        info = {**sinfo, **pinfo, "value_verified": True, "value_test_head": head,
                "joint_residual": pinfo["upload_left_after_peeling"],
                "forward_passes": sinfo.get("forward_passes", 0) + pinfo["forward_passes"],
                "search_truncated": bool(sinfo.get("search_truncated")) or pinfo["search_truncated"]}
        kept = min(len(out), int(B)) if B else len(out)  # cap_to_batch keeps the verified ones first
        info["unverified_sentences"] = kept - pinfo["verified_sentences"]
        if pinfo["upload_left_after_peeling"] > 1e-4:  # part of the batch is missing: not verified jointly
            info["joint_residual"] = None
        return out, info

    def reconstruct(self, view: ServerView) -> Reconstruction:
        prev = torch.get_num_threads()
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        try:
            return self._reconstruct(view)
        finally:
            torch.set_num_threads(prev)

    def _reconstruct(self, view: ServerView) -> Reconstruction:
        tok = view.public.get("tokenizer")
        if tok is None:
            raise BadInput("view.public.tokenizer", "the attack needs the (public) tokenizer of the model.",
                           "put the tokenizer into ServerView.public['tokenizer'].")
        bag = self.word_bag(view)
        sub_ea: Subspace = bag["subspace"]
        grads_ea = collect_grads(view, adapter_param("embedding"), all_rounds=self.all_rounds and self.search != "paper")
        limit_std = self.limit_std(view, bag)
        bag, edge_info = self._below_the_edge(view, bag, grads_ea, limit_std)
        t1 = time.perf_counter()
        la = self._sentence_layer(view, bag)
        sp = specials(tok, bag["causal"])
        B = view.public.get("batch_size")
        budget = self.sentence_budget(B, bag, sp)
        deadline = time.perf_counter() + budget  # one budget for all of stage 2 (prefix search and peeling together)
        lm = has_lm_head(view.model)
        sents, sinfo = self._sentences(view, bag, edge_info, sp, la, deadline, lm)
        t2 = time.perf_counter()
        info = {
            "method": METHOD[self.search],
            # a causal backbone with a classification head (no LM head): the client's loss is the classifier's,
            # every position (the final EOS included) receives a gradient, and the value test fits the head's
            # coefficients per sentence (gradleak.attacks.utr.causal)
            "head": "lm" if lm else "classification",
            "word_bag": (sorted(set(bag["tokens"]) | set(edge_info["sub_edge_bag"]))
                         if edge_info.get("word_bag_source") == "stage 1 + sub_edge" else bag["tokens"]),
            **edge_info,
            "word_bag_size": len(bag["tokens"]),
            "word_bag_pairs": sum(len(p) for p in bag["pairs"].values()),
            "rank_embedding_adapter": sub_ea.rank,
            "rank_layer_adapter": la.sub.rank,
            "bottleneck_rows": sub_ea.rows,
            # S_LA holds one vector per distinct layer state (every token of a bidirectional batch, every distinct
            # prefix of a causal one); near its ceiling the float32 noise floor blurs the rank (measured: SmolLM2
            # rf=1 B=32, 776 states in d=576, numerical rank 547) -- flag from 90 % of the ceiling on
            # (BERT past the bottleneck: the augmented bag and the joint batch test verify it; then not exhausted)
            "capacity_exhausted": bool(((sub_ea.saturated and not bag["augmented"]) or not bag["positions_ok"]
                                        or la.saturated)
                                       and not (sinfo.get("joint_residual") is not None
                                                and sinfo.get("unverified_sentences") == 0)),
            "noise_std": bag["noise_std"],
            "noise_edge_embedding_adapter": sub_ea.noise_edge,
            "eps_bag_used": bag["eps_bag"],
            "eps_sentence_used": la.eps,
            "word_bag_seconds": bag["seconds"],
            "word_bag_augmented": bool(bag["augmented"]),
            **{k: v for k, v in bag.items() if k.startswith(("exact_pairs", "sparsity_"))},
            "sentence_seconds": t2 - t1,
            "time_budget": budget,  # the sentence search's, in seconds (automatic when the config's is null)
            "time_budget_auto": self.time_budget is None,
            **sinfo,
        }
        self._regime_warning(info, bag, edge_info, sub_ea, la)
        sents = cap_to_batch(sents, info, view.public.get("batch_size"), bag["causal"])
        if bag["noise_std"]:  # a test at the noise floor's tolerance proves nothing exact: no sentence is "verified"
            info["passed_noise_tolerance"] = info.get("verified_sentences", 0)
            info["verified"] = [False] * len(sents)
            info["verified_sentences"], info["unverified_sentences"] = 0, len(sents)
            info["warning"] = (info.get("warning", "") + f" noisy uploads (per-coordinate std {bag['noise_std']:.3g} from "
                               f"the update defenses): ranks from the noise spectrum's edge, membership at tolerances "
                               f"{bag['eps_bag']:.3g} (tokens) / {la.eps:.3g} (sentences); nothing is verified "
                               "exactly.").strip()
        metrics = self._margin_metrics(info, grads_ea, sub_ea, limit_std, edge_info)
        return Reconstruction(data=sents, info=info, metrics=metrics)

    def _below_the_edge(self, view: ServerView, bag: dict, grads_ea: list[torch.Tensor],
                        limit_std: float | None) -> tuple[dict, dict[str, Any]]:
        """The sub-edge test (``sub_edge``, extended search) under noise or pruning, and what it does to the word
        bag: under pruning nothing (the ranking is graded against its null only); with no token above the edge its
        tokens become the bag (no positions); tokens stage 1 missed join the bag. Returns (bag, the test's info)."""
        edge_info: dict[str, Any] = {}
        pruned = bool(bag.get("sparsity_aware")) or is_pruned(grads_ea)
        if self.sub_edge and self.search == "extended" and bag.get("directions") is None and (
                (pruned and limit_std) or bag["noise_std"]):
            edge_info = self._sub_edge(view, bag, limit_std if pruned and limit_std else bag["noise_std"], pruned)
            if pruned:
                pass  # under pruning the ranking is graded against its null only, never the word bag (_sub_edge)
            elif not bag["tokens"] and edge_info["sub_edge_bag"]:  # nothing above the edge: the sub-edge tokens
                bag = {**bag, "tokens": sorted(edge_info["sub_edge_bag"]),
                       "pairs": {int(v): set() for v in edge_info["sub_edge_bag"]}, "positions_ok": bag["causal"]}
                edge_info["word_bag_source"] = "sub_edge"
            elif set(edge_info["sub_edge_bag"]) - set(bag["tokens"]):
                # tokens stage 1 missed (its row space is cut at the noise edge; the dictionary test reaches below
                # it -- measured, MiniLM B = 2 DP-SGD sigma 1e-4: stage 1 found 2 tokens, the pursuit all 39, no
                # false one): they join the word bag and the clipped-sum search's candidates, not stage 1's pairs
                edge_info["word_bag_source"] = "stage 1 + sub_edge"
        return bag, edge_info

    def _sentence_layer(self, view: ServerView, bag: dict) -> SimpleNamespace:
        """The sentence layer's adapter gradients and their row space S_LA (at its own noise level: the public
        per-tensor noise, or the pruning error's; capped at the oracle ceiling's K directions), the sentence
        tolerance, and whether S_LA is saturated (rank >= 90 % of its ceiling)."""
        grads_la = collect_grads(view, adapter_param(self.sentence_layer), all_rounds=False)
        la_noise = bag["noise_std"]
        if la_noise and self.noise == "public":  # the sentence layer's own tensor (per-tensor noise: its own step)
            la_noise = self.noise_std(view, grads_la, adapter_param(self.sentence_layer))
        if bag.get("sparsity_aware") and is_pruned(grads_la):  # pruned: the error's level, read off
            la_noise = estimate_noise_std(grads_la)
        ceiling = bag.get("directions")  # the oracle ceiling: every subspace capped at the K strongest directions
        sub_la = subspace_from_gradients(grads_la, self.rank_rtol, noise_std=la_noise, max_rank=ceiling)
        return SimpleNamespace(grads=grads_la, sub=sub_la, eps=max(self.eps_sentence, sub_la.tol), ceiling=ceiling,
                               saturated=sub_la.rank >= 0.9 * min(sub_la.rows, sub_la.dim))

    def _sentences(self, view: ServerView, bag: dict, edge_info: dict[str, Any], sp: dict, la: SimpleNamespace,
                   deadline: float, lm: bool) -> tuple[list[list[int]], dict[str, Any]]:
        """Stage 2 within one budget ending at ``deadline``: no sentences for a bag below the edge or past a
        bidirectional model's positional capacity; the paper's greedy searches (``search: paper``); else the
        causal prefix search (and peeling) or the encoder chain search (and, under noise, the clipped-sum search
        and the ranked reading)."""
        model, B, ceiling = view.model, view.public.get("batch_size"), la.ceiling

        def left() -> float:
            return max(deadline - time.perf_counter(), 0.0)

        if edge_info.get("word_bag_source") == "sub_edge":  # a bag below the edge: no positions, no sentences
            return [], {"forward_passes": 0}
        if self.search == "paper":
            return self._paper_sentences(model, bag, sp, la, B, lm, left)
        if bag["causal"]:
            cands = torch.tensor([t for t in bag["tokens"] if t not in (sp["bos"], sp["pad"])] or [sp["bos"]])
            search = CausalPrefixSearch(model, [self.sentence_layer], la.sub, la.eps, sp["bos"], cands,
                                        max_len=self.max_len,
                                        max_branches=self.max_branches or max(8, int(view.public.get("batch_size") or 8)),
                                        max_sentences=max(4 * int(view.public.get("batch_size") or 64), 64),
                                        time_budget=left(),
                                        eicw=self.eicw, lm_prior=self.lm_prior)
            sents, sinfo = search.run()
            sents = strip_eos(sents, sp["eos"], lm)
            if self.value_test and not bag["noise_std"] and ceiling is None:
                sents, sinfo = self._causal_peel(view, bag, sp, cands, sents, sinfo, la.eps, deadline)
            return sents, sinfo
        if not bag["positions_ok"]:
            # bidirectional model past its positional capacity: every bag token passes at every position, a
            # sentence search over that would only burn time -- report the bag, no sentences
            return [], {"forward_passes": 0, "positions_lost": True}
        value_test = None
        if self.value_test and not bag["noise_std"] and ceiling is None:
            value_test = TokenGradientTest(model, collect_grads(view, adapter_param("embedding"))[0],
                                           bag["pairs"], signals=bag["signals"])
        search = EncoderChainSearch(model, self.sentence_layer, la.sub, la.eps, sp["cls"], sp["sep"],
                                    sp["mask"], bag["pairs"], view.public.get("batch_size"),
                                    time_budget=left(),
                                    # S_LA saturated: chains verified in subsets are peeled out of S_LA;
                                    # the whole batch is verified jointly (beyond the paper)
                                    joint=la.saturated, value_test=value_test, layer_grad=la.grads[0],
                                    soft_rank=self.soft_rank)
        sents, sinfo = search.run()
        if self.value_test and self.clipped_sum and bag["noise_std"]:
            cap = max(CLIPPED_SUM_MIN_SECONDS, AUTO_BUDGET_PER_SENTENCE * (int(B or 1) + 1))
            sents, sinfo = self._clipped_sum(view, bag, sp, sents, sinfo, min(left(), cap),
                                             extra=edge_info.get("sub_edge_bag", ()))
            sents, sinfo = self._ranked_reading(view, bag, sp, sents, sinfo, la.sub, la.eps, la.saturated,
                                                la.grads[0], left, extra=edge_info.get("sub_edge_bag", ()))
        return sents, sinfo

    def _paper_sentences(self, model: nn.Module, bag: dict, sp: dict, la: SimpleNamespace, B: Optional[int],
                         lm: bool, left) -> tuple[list[list[int]], dict[str, Any]]:
        """``search: paper``: the UTR paper's greedy sentence search, causal or encoder (UTR paper Sec. 4.3), within the
        budget ``left()`` leaves."""
        if bag["causal"]:
            cands = torch.tensor([t for t in bag["tokens"] if t not in (sp["bos"], sp["pad"])] or [sp["bos"]])
            sents, sinfo = GreedyCausalSearch(model, self.sentence_layer, la.sub, la.eps, sp["bos"], cands, B,
                                              max_len=self.max_len, eicw=self.eicw, time_budget=left()).run()
            return strip_eos(sents, sp["eos"], lm), sinfo
        return GreedyEncoderSearch(model, self.sentence_layer, la.sub, la.eps, sp["cls"], sp["sep"],
                                   sp["pad"], bag["pairs"] if bag["positions_ok"] else {}, B,
                                   eicw=self.eicw, time_budget=left()).run()

    @staticmethod
    def _regime_warning(info: dict[str, Any], bag: dict, edge_info: dict[str, Any], sub_ea: Subspace,
                        la: SimpleNamespace) -> None:
        """The reading's regime into ``info``: a word bag of the sub-edge test only, no signal at all, the oracle
        ceiling, a top-k pruned upload, or an exhausted capacity (each sets ``capacity_exhausted`` and a warning)."""
        ceiling = la.ceiling
        if edge_info.get("word_bag_source") == "sub_edge":
            info["capacity_exhausted"] = False
            info["warning"] = (f"stage 1 found no token ({sub_ea.rank} direction(s) above the noise edge): word bag of "
                               f"the sub-edge test only "
                               f"({len(bag['tokens'])} tokens beyond the chi-square law of the noise alone and the "
                               f"vocabulary's bulk; strongest token p = 10^{edge_info['sub_edge_min_log10_p']:.1f}); "
                               "no sentence search.")
        elif edge_info and not bag["tokens"] and not edge_info["sub_edge_bag"]:
            info["capacity_exhausted"] = False  # nothing found, not too much: computed at the two tests' power
            info["information_absent"] = True
            info["warning"] = (f"no signal direction above the noise edge (rank {sub_ea.rank}) and no token beyond "
                               f"the noise alone (sub-edge test: strongest token p = "
                               f"10^{edge_info['sub_edge_min_log10_p']:.1f} against a Bonferroni cut "
                               f"{edge_info['sub_edge_alpha']:g} / vocabulary): no word bag, no sentences.")
        elif ceiling is not None:  # the oracle ceiling below the exact rank: outliers of K directions, no positions
            info["capacity_exhausted"] = False
            info["directions_used"] = ceiling
            info["warning"] = (f"oracle ceiling: the upload read through its {ceiling} strongest directions only "
                               f"(embedding adapter: {len(bag['tokens'])} tokens below the vocabulary's bulk, "
                               f"threshold {bag['sparsity_threshold']:.3g}; sentence layer capped at {ceiling}).")
        elif bag.get("sparsity_aware"):  # a pruned upload: a word bag read against the vocabulary's bulk, no positions
            info["capacity_exhausted"] = False
            info["warning"] = (f"top-k pruned upload ({100 * bag['sparsity_kept_fraction']:.3g} % of the embedding "
                               f"adapter's coordinates kept): sparsity-aware word bag ({bag['sparsity_reading']}; "
                               f"{len(bag['tokens'])} tokens below the vocabulary's bulk, threshold "
                               f"{bag['sparsity_threshold']:.3g}); "
                               + ("no positions, so no sentence search." if not bag["positions_ok"] else
                                  "sentences searched at the pruning error's level."))
        elif info["capacity_exhausted"]:
            info["warning"] = ("token positions unrecoverable: bag tokens + positions + 1 exceed the hidden size "
                               "(bidirectional model); word bag only. " if not bag["positions_ok"] else "") + (
                               f"gradient subspace saturated (rank {sub_ea.rank}/{la.sub.rank} vs {sub_ea.rows} "
                               "bottleneck rows): the batch holds more distinct token vectors than the adapter "
                               "can store; the word bag and the sentences are unreliable beyond this point.")

    @staticmethod
    def _margin_metrics(info: dict[str, Any], grads_ea: list[torch.Tensor], sub_ea: Subspace,
                        limit_std: float | None, edge_info: dict[str, Any]) -> dict[str, float]:
        """The truth-free metrics: the embedding adapter's leakage margin (also into ``info``) and the sub-edge
        test's numbers."""
        # the leakage margin of the embedding adapter's upload: how far the weakest direction the word bag used stands
        # above the noise edge, and the noise that would drown it (gradleak.attacks.common.subspace.spectral_margin)
        margin = spectral_margin(grads_ea, sub_ea.rank, limit_std)
        info["leakage_margin"] = {"layer": "embedding_adapter", "scale": limit_std, **margin}
        metrics = {f"{k}_embedding_adapter": v for k, v in margin.items()}
        if edge_info:  # the sub-edge test's truth-free numbers (the bag itself is graded as the word bag)
            # subedge_p_value: "some token beyond the noise alone", Bonferroni over the vocabulary (valid whatever
            # the tokens' correlations; under noise alone P(p < a) <= a) -- what benchmarks read at alpha 0.01
            # -- only under declared Gaussian noise: a top-k pruning error is not Gaussian, its law is no null
            if not edge_info.get("sub_edge_pruned"):
                metrics["subedge_p_value"] = min(1.0, edge_info["sub_edge_vocabulary"]
                                                 * 10.0 ** edge_info["sub_edge_min_log10_p"])
            metrics.update({"sub_edge_min_log10_p": edge_info["sub_edge_min_log10_p"],
                            "sub_edge_significant_tokens": float(edge_info["sub_edge_significant_tokens"]),
                            "sub_edge_bag_size": float(len(edge_info["sub_edge_bag"]))})
        return metrics
