"""The ``utr`` experiment: text batch -> frozen LM + adapters (or LoRA) -> FL round(s) -> ServerView -> attack.

Config (``configs/utr/minilm_rt.yaml``)::

    experiment: utr
    seed: 0
    model: {name: minilm, num_layers: 2}
    peft: {kind: adapters, reduction_factor: 2}
    data: {name: rt-sentences, batch_size: 8}
    attack: {name: utr, params: {}}

Results: ``metrics.rouge1`` / ``rouge2`` / ``rougeL`` (recall, 0-100), ``exact_sentence_rate``,
``word_bag_precision`` / ``word_bag_recall``, ``capacity_exhausted`` (0/1), ``unique_token_vectors`` (distinct
embedding-adapter inputs: tokens for RoPE models, (token, position) pairs for BERT), ``layer_states`` (distinct
first-layer-adapter inputs: every token for BERT, every distinct prefix for causal LMs), ``bottleneck``;
``timings.word_bag_seconds``, ``sentence_seconds``, ``attack_seconds``, ``seconds_per_sentence``.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Optional

import numpy as np
import torch
from pydantic import Field

from gradleak.errors import BadInput
from gradleak.experiments.config import Strict
from gradleak.registry import ATTACKS, EXPERIMENTS


class ModelCfg(Strict):
    name: str = "minilm"
    num_layers: int = 2
    dtype: Literal["float32", "float64"] = "float32"


class PeftCfg(Strict):
    kind: Literal["adapters", "lora", "none"] = "adapters"
    reduction_factor: int = 2
    embedding_adapter: bool = True
    layer_adapters: Optional[list[int]] = None  # default: after every kept layer
    init_std: float = 0.02
    lora_rank: int = 128
    lora_targets: Optional[list[str]] = None  # default: query + key projections (DAGER's span checks)
    lora_layers: Optional[list[int]] = None


class DataCfg(Strict):
    name: str = "rt-sentences"
    batch_size: int = 8
    path: Optional[str] = None
    text_column: Optional[str] = None
    label_column: Optional[str] = None
    split: str = "train"
    subset: Optional[str] = None
    limit: Optional[int] = None
    max_length: Optional[int] = None


class FLCfg(Strict):
    algorithm: Literal["fedsgd", "fedavg"] = "fedsgd"
    rounds: int = 1
    lr: float = 0.05
    local_epochs: int = 1
    local_batch_size: Optional[int] = None


class AttackCfg(Strict):
    name: str = "utr"
    params: dict[str, Any] = Field(default_factory=dict)


class DefenseEntry(Strict):
    name: str
    params: dict[str, Any] = Field(default_factory=dict)


class UTRConfig(Strict):
    experiment: Literal["utr"] = "utr"
    name: Optional[str] = None
    seed: int = 0
    device: str = "cpu"
    threads: Optional[int] = None
    trials: int = 1
    model: ModelCfg = Field(default_factory=ModelCfg)
    peft: PeftCfg = Field(default_factory=PeftCfg)
    data: DataCfg = Field(default_factory=DataCfg)
    fl: FLCfg = Field(default_factory=FLCfg)
    attack: AttackCfg = Field(default_factory=AttackCfg)
    defenses: list[DefenseEntry] = Field(default_factory=list)

    def check(self) -> None:
        if self.data.batch_size < 1:
            raise BadInput("data.batch_size", f"must be >= 1, got {self.data.batch_size}.", "use e.g. 8.")
        if self.trials < 1:
            raise BadInput("trials", f"must be >= 1, got {self.trials}.", "use 1 or more.")
        if self.fl.rounds < 1:
            raise BadInput("fl.rounds", f"must be >= 1, got {self.fl.rounds}.", "use 1 (the paper) or more.")
        if self.model.num_layers < 1:
            raise BadInput("model.num_layers", f"must be >= 1, got {self.model.num_layers}.", "use 2 (the paper).")
        if self.attack.name not in ATTACKS:
            ATTACKS.get(self.attack.name, field="attack.name")


# ----------------------------------------------------------------------------------------------- building blocks


def build_model(cfg: UTRConfig):
    """Load the frozen model and attach the trainable modules the config asks for."""
    from gradleak.models.text import load_text_model
    from gradleak.peft.text_adapters import add_text_adapters

    dtype = torch.float64 if cfg.model.dtype == "float64" else torch.float32
    tm = load_text_model(cfg.model.name, cfg.model.num_layers, seed=cfg.seed, dtype=dtype)
    if cfg.peft.kind == "adapters":
        add_text_adapters(tm.model, tm.layers(), tm.hidden_size, cfg.peft.reduction_factor,
                          embedding=cfg.peft.embedding_adapter, layer_ids=cfg.peft.layer_adapters,
                          init_std=cfg.peft.init_std, seed=cfg.seed)
    elif cfg.peft.kind == "lora":
        add_lora(tm, cfg.peft, cfg.seed)
    return tm


def add_lora(tm, pcfg: PeftCfg, seed: int) -> None:
    """LoRA (HF peft, injected in place) on the attention query projection; B initialised non-zero, as after
    some rounds of training (with B = 0 the gradient of A vanishes)."""
    from peft import LoraConfig, inject_adapter_in_model

    targets = pcfg.lora_targets or (["q_proj", "k_proj"] if tm.kind == "causal" else ["query", "key"])
    layers = pcfg.lora_layers if pcfg.lora_layers is not None else list(range(tm.num_layers))
    conf = LoraConfig(r=pcfg.lora_rank, lora_alpha=pcfg.lora_rank, target_modules=targets,
                      layers_to_transform=layers, lora_dropout=0.0, bias="none")
    inject_adapter_in_model(conf, tm.model)
    g = torch.Generator().manual_seed(seed + 31)
    for n, p in tm.model.named_parameters():
        if "lora_" in n:
            p.requires_grad_(True)
            if "lora_B" in n:
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.02)


def run_trial(tm, cfg: UTRConfig, texts: list[str], labels: np.ndarray, attack, defenses: list) -> dict[str, Any]:
    """One client batch: local update(s), server view, attack, metrics."""
    from gradleak.fl.core import Client, ServerView
    from gradleak.metrics.text import rouge_scores, word_bag_scores
    from gradleak.models.text import text_loss

    enc = tm.encode(texts, cfg.data.max_length)
    inputs = torch.stack([enc["input_ids"], enc["attention_mask"]], 1)
    client = Client(0, inputs, torch.as_tensor(labels, dtype=torch.long), loss_fn=text_loss(tm.kind))
    model = tm.model
    rounds, states = [], []
    t0 = time.perf_counter()
    for r in range(cfg.fl.rounds):
        if rounds:  # the server applies the previous round's update (SGD on the trainable modules)
            prev = rounds[-1][0]
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if n in prev.tensors:
                        p.sub_(cfg.fl.lr * prev.tensors[n].to(p.dtype))
        states.append({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})
        upd = client.local_update(model, algorithm=cfg.fl.algorithm, epochs=cfg.fl.local_epochs, lr=cfg.fl.lr,
                                  batch_size=cfg.fl.local_batch_size, defenses=defenses, seed=cfg.seed + r)
        rounds.append([upd])
    client_seconds = time.perf_counter() - t0
    public = {"tokenizer": tm.tokenizer, "batch_size": len(texts), "model_kind": tm.kind}
    if getattr(attack, "needs_lengths", False):  # LAMP's threat model: sequence lengths (and labels) are known
        public["lengths"] = enc["attention_mask"].sum(1).tolist()
        public["labels"] = torch.as_tensor(labels).tolist()
    view = ServerView(model, [upd], public=public, rounds=rounds, round_states=states)
    t1 = time.perf_counter()
    rec = attack.reconstruct(view)
    attack_seconds = time.perf_counter() - t1
    tok = tm.tokenizer
    refs = [tok.decode(ids[m.bool()], skip_special_tokens=True).strip()
            for ids, m in zip(enc["input_ids"], enc["attention_mask"])]
    recs = [tok.decode(s, skip_special_tokens=True).strip() for s in rec.data]
    scores = rouge_scores(refs, recs)
    mask = enc["attention_mask"].bool()
    ids = enc["input_ids"]
    if tm.kind == "causal":
        # the final EOS gets no gradient under the LM loss: it is not part of what leaks
        last = mask.sum(1) - 1
        vis = mask.clone()
        vis[torch.arange(len(ids)), last] = False
        true_tokens = set(ids[vis].tolist())
        vectors = len(true_tokens)
        lens = mask.sum(1).tolist()  # distinct layer states = distinct prefixes that receive a gradient
        states = len({tuple(ids[i, :k + 1].tolist()) for i in range(len(ids)) for k in range(int(lens[i]) - 1)})
    else:
        true_tokens = set(ids[mask].tolist())
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        vectors = len(set(zip(ids[mask].tolist(), pos[mask].tolist())))
        states = int(mask.sum())  # every token's layer state differs (the whole sentence is its context)
    bag = set(rec.info.get("word_bag", []))
    out = {**scores, **(word_bag_scores(true_tokens, bag) if "word_bag" in rec.info else {})}
    bottleneck = tm.hidden_size // cfg.peft.reduction_factor if cfg.peft.kind == "adapters" else cfg.peft.lora_rank
    out.update({
        "unique_tokens": len(true_tokens),
        "unique_token_vectors": vectors,
        "layer_states": states,
        "bottleneck": bottleneck,
        "total_tokens": int(mask.sum()),
        "recovered_tokens": int(sum(len(s) for s in rec.data)),
        "word_bag_size": len(bag),
        "capacity_exhausted": float(bool(rec.info.get("capacity_exhausted", False))),
        "attack_failed": float(bool(rec.info.get("failure"))),
        "search_truncated": float(bool(rec.info.get("search_truncated"))),
    })
    timings = {"client_seconds": client_seconds, "attack_seconds": attack_seconds,
               "word_bag_seconds": float(rec.info.get("word_bag_seconds", float("nan"))),
               "sentence_seconds": float(rec.info.get("sentence_seconds", float("nan"))),
               "seconds_per_sentence": attack_seconds / max(1, len(texts))}
    info = {k: v for k, v in rec.info.items() if k != "word_bag"}
    return {"metrics": out, "timings": timings, "references": refs, "reconstructions": recs,
            "matched": _pair(refs, recs), "info": info}


def _pair(refs: list[str], recs: list[str]) -> list[str]:
    from gradleak.metrics.text import match_sentences

    return [recs[j] if j is not None else "" for j in match_sentences(refs, recs)]


@EXPERIMENTS.register("utr", "UTR text reconstruction from adapter gradients (and DAGER / LAMP baselines)")
class UTRExperiment:
    Config = UTRConfig

    def run(self, cfg: UTRConfig, ctx) -> dict[str, Any]:
        from gradleak.data.text import load_text
        from gradleak.defenses.update import build_defenses

        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        t0 = time.perf_counter()
        tm = build_model(cfg)
        load_seconds = time.perf_counter() - t0
        kwargs = {k: v for k, v in {"path": cfg.data.path, "text_column": cfg.data.text_column,
                                    "label_column": cfg.data.label_column, "limit": cfg.data.limit}.items()
                  if v is not None}
        if cfg.data.name == "hf":
            kwargs.update(split=cfg.data.split, subset=cfg.data.subset)
        ds = load_text(cfg.data.name, **kwargs)
        defenses = build_defenses([d.model_dump() for d in cfg.defenses], seed=cfg.seed)
        attack_cls = ATTACKS.get(cfg.attack.name, field="attack.name")
        try:
            attack = attack_cls(**cfg.attack.params)
        except TypeError as err:
            raise BadInput("attack.params", f"bad parameters for '{cfg.attack.name}': {err}.",
                           f"see the docstring of {attack_cls.__name__}.") from None
        trials = []
        for t in ctx.track(range(cfg.trials), description=f"utr {cfg.attack.name} B={cfg.data.batch_size}",
                           total=cfg.trials):
            texts, labels = ds.batch(cfg.data.batch_size, seed=cfg.seed, offset=t * cfg.data.batch_size)
            trials.append(run_trial(tm, cfg, texts, labels, attack, defenses))
        keys = trials[0]["metrics"].keys()
        metrics = {k: float(np.mean([tr["metrics"][k] for tr in trials])) for k in keys}
        timings = {k: float(np.mean([tr["timings"][k] for tr in trials])) for k in trials[0]["timings"]}
        timings["model_load_seconds"] = load_seconds
        rows = []
        for ti, tr in enumerate(trials):
            for ref, rec in zip(tr["references"], tr["matched"]):
                rows.append({"trial": ti, "reference": ref, "reconstruction": rec,
                             "exact": "yes" if ref.lower().split() == rec.lower().split() else "no"})
        warnings = [tr["info"].get("warning") for tr in trials if tr["info"].get("warning")]
        report = {"tables": [
            {"title": f"{cfg.attack.name.upper()} on {tm.name}: reference vs reconstructed sentences",
             "columns": ["trial", "reference", "reconstruction", "exact"], "rows": rows[:200]},
            {"title": "Metrics", "columns": ["metric", "value"],
             "rows": [{"metric": k, "value": round(v, 4)} for k, v in metrics.items()]},
        ]}
        if warnings:
            report["tables"].append({"title": "Warnings", "columns": ["warning"],
                                     "rows": [{"warning": w} for w in warnings]})
        details = {"model": tm.name, "model_kind": tm.kind, "hidden_size": tm.hidden_size,
                   "trials": [{"references": tr["references"], "reconstructions": tr["reconstructions"],
                               "metrics": tr["metrics"], "info": tr["info"]} for tr in trials],
                   "warnings": warnings}
        return {"metrics": metrics, "timings": timings, "artifacts": [], "details": details, "report": report}
