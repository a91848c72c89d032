"""Text-model helpers every span-based text attack shares (UTR, DAGER, LAMP): model kind, special tokens, the
attacked update's gradients, the batch-size cap on the output, and the span-test parameters."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator

import torch
from pydantic import Field
from torch import nn

from gradleak.attacks.base import AttackConfig
from gradleak.errors import BadInput
from gradleak.fl.core import ServerView


def is_causal(model: nn.Module) -> bool:
    """Whether the model's backbone is causal (a decoder: a token's states depend only on its prefix), whatever its
    head: an LM head, or a sequence-classification head (``*ForSequenceClassification`` on Llama, mean-pooled or
    not). Read off the config (:func:`gradleak.models.text.is_decoder_config`), not the head: a Llama classifier
    has no ``lm_head`` but is causal all the same."""
    from gradleak.models.text import is_decoder_config

    return (has_lm_head(model) or "CausalLM" in type(model).__name__
            or is_decoder_config(getattr(model, "config", None)))


def has_lm_head(model: nn.Module) -> bool:
    """Whether the model's output is next-token logits over the vocabulary (an LM head; the client then trains with
    the LM loss), as opposed to a task head (sequence classification: logits over the classes)."""
    if hasattr(model, "lm_head"):
        return True
    get = getattr(model, "get_output_embeddings", None)
    try:
        return callable(get) and get() is not None
    except (AttributeError, NotImplementedError):
        return False


def model_layers(model: nn.Module) -> nn.ModuleList:
    from gradleak.models.text import text_layers

    return text_layers(model)


def collect_grads(view: ServerView, param: str, all_rounds: bool = False) -> list[torch.Tensor]:
    """The attacked update's gradients of one parameter: the latest round's, or every observed round's (the same
    client: the first update of each round; the sum under secure aggregation). Other clients' updates are not
    stacked in: their tokens would join the victim's word bag (a 2-client run reconstructed a mix of both batches)."""
    groups = view.rounds if (all_rounds and view.rounds) else [view.updates]
    out = []
    for ups in groups:
        for u in ups[:1]:
            if param not in u.tensors:
                present = sorted({k.rsplit(".", 2)[0] for k in u.tensors})[:8]
                raise BadInput("update", f"the observed update has no '{param}' (it holds {present}...).",
                               "attach the embedding and first-layer adapters (peft.kind=adapters) so clients "
                               "train and upload them.")
            out.append(u.tensors[param])
    return out


def specials(tokenizer, causal: bool) -> dict[str, int]:
    if causal:
        from gradleak.models.text import causal_specials

        bos, eos = causal_specials(tokenizer)
        return {"bos": bos, "eos": eos, "pad": tokenizer.pad_token_id}
    return {"cls": tokenizer.cls_token_id, "sep": tokenizer.sep_token_id, "pad": tokenizer.pad_token_id,
            "mask": tokenizer.mask_token_id}


def cap_to_batch(sents: list[list[int]], info: dict[str, Any], batch_size: int | None, causal: bool) -> list[list[int]]:
    """Order verified sentences first and return at most ``batch_size`` of them (when the server knows B).

    Verified = passed the membership test at every position: the encoder search reports how many of its
    (verified-first) chains passed; every sentence the causal trie search completes passed at each prefix,
    which proves it only while the subspace is not saturated and the search did not run out of time.
    ``info["verified"]`` gets one flag per returned sentence.
    """
    if causal and info.get("value_verified"):  # the value test checked every sentence (verified ones first)
        k = int(info.get("verified_sentences", 0) or 0)
        flags = [i < k for i in range(len(sents))]
    elif causal:
        proven = not info.get("search_truncated", False) and not info.get("capacity_exhausted", False)
        flags = [proven] * len(sents)
        if batch_size and len(sents) > batch_size:  # spurious branches die early: keep the longest
            order = sorted(range(len(sents)), key=lambda i: -len(sents[i]))[:batch_size]
            sents = [sents[i] for i in sorted(order)]
            flags = flags[:len(sents)]
    else:
        k = int(info.get("verified_sentences", 0) or 0)
        flags = [i < k for i in range(len(sents))]
    if batch_size and len(sents) > batch_size:
        sents, flags = sents[:batch_size], flags[:batch_size]
    info["verified"] = flags
    info["verified_sentences"] = int(sum(flags))
    info["unverified_sentences"] = len(sents) - int(sum(flags))
    return sents


class SpanTestConfig(AttackConfig):
    """Parameters every subspace-membership text attack shares (UTR, DAGER)."""

    eps_bag: float = Field(1e-3, gt=0, lt=1, description="token membership tolerance (relative residual)")
    eps_sentence: float = Field(1e-3, gt=0, lt=1, description="sentence membership tolerance (relative residual)")
    rank_rtol: float = Field(1e-5, gt=0, lt=1, description="relative singular-value cut-off of the SVD")
    max_positions: int = Field(128, ge=1, description="positions tested for absolute-position models")
    max_len: int = Field(128, ge=2, description="longest sentence the causal search builds")
    screen_tol: float = Field(0.05, gt=0, lt=1, description="coarse screen of (token, position) pairs")


def declared_noise_std(view, mode, grads: list[torch.Tensor], tensor: str | None = None) -> float | None:
    """Per-coordinate std of the noise on the observed uploads for a span test's ``noise`` mode: ``'none'`` -> None
    (exact tests); a float -> that std; ``'estimate'`` -> read off the spectrum of ``grads`` (Gavish-Donoho);
    ``'public'`` -> what every declared defense implies (:mod:`gradleak.defenses.declared`: the update list,
    DP-SGD's training, secure aggregation, a framework's DP) plus a weight reply's rounding (Flower), or None when
    nothing declared adds noise of a known scale. ``tensor``: the name of the uploaded tensor ``grads`` are of
    (stochastic rounding's noise is read off that tensor's step)."""
    from gradleak.attacks.common.subspace import estimate_noise_std
    from gradleak.defenses.declared import view_noise_std

    if mode == "none":
        return None
    if isinstance(mode, (int, float)) and not isinstance(mode, bool):
        return float(mode)
    if mode == "estimate":
        return estimate_noise_std(grads)
    rounding = float(view.public.get("upload_rounding_std") or 0.0)  # a weight reply's rounding (Flower)
    std = view_noise_std(view, tensor=tensor)
    if std is None:
        return rounding if rounding > 0 else None
    return (std ** 2 + rounding ** 2) ** 0.5


@contextlib.contextmanager
def hooked_with_grads(module: nn.Module, hook: Callable, params: Iterable[nn.Parameter]) -> Iterator[None]:
    """``hook`` on ``module``'s forward and gradients on for ``params`` and autograd, for the block; both restored
    after (the hook removed, each parameter's ``requires_grad`` as it was)."""
    flags = [(p, p.requires_grad) for p in params]
    h = module.register_forward_hook(hook)
    try:
        for p, _ in flags:
            p.requires_grad_(True)
        with torch.enable_grad():
            yield
    finally:
        h.remove()
        for p, f in flags:
            p.requires_grad_(f)
