"""The text modality: sentences tokenised by the model's tokenizer; classification or next-token accuracy."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from gradleak.errors import BadInput
from gradleak.modalities import MODALITIES, Modality, register_experiment


def pad_cat(encs: list[dict], tok) -> dict[str, torch.Tensor]:
    """Tokenised batches concatenated, padded to the longest."""
    if len(encs) == 1:
        return encs[0]
    L = max(e["input_ids"].shape[1] for e in encs)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.cat([torch.nn.functional.pad(e["input_ids"], (0, L - e["input_ids"].shape[1]), value=pad) for e in encs])
    mask = torch.cat([torch.nn.functional.pad(e["attention_mask"], (0, L - e["attention_mask"].shape[1])) for e in encs])
    return {"input_ids": ids, "attention_mask": mask}


@MODALITIES.register("text", "sentences through the model's tokenizer; classification or next-token accuracy")
class TextModality(Modality):
    name = "text"
    data_fields = frozenset({"text_column", "label_column", "split", "subset", "limit", "max_length", "nonmembers",
                             "samples_per_client"})
    model_fields = frozenset({"task"})
    default_layers = 2  # the text models keep their first model.layers layers (default 2)

    def check_peft(self, cfg) -> None:
        """Text adapters are sized by ``peft.reduction_factor`` (hidden size / factor), never by a bottleneck."""
        if cfg.peft.kind == "adapters" and "bottleneck" in cfg.peft.model_fields_set:
            raise BadInput("peft.bottleneck", "text adapters are sized by peft.reduction_factor.",
                           "use e.g. --set peft.reduction_factor=2.")

    def data(self, cfg) -> Any:
        from gradleak.data.splits import TextData

        return TextData(cfg)

    def attack_public(self, cfg, data, threat) -> dict[str, Any]:
        """Under ``threat.public_data``: sentences of the same dataset that no client holds in any trial, in the
        null pool's seeded order (``public_texts``; the learned word-bag decoder's training and null data)."""
        if not threat.public_data:
            return {}
        texts, _ = data.null_pool(0, k=1 << 30)
        return {"public_texts": texts}

    def encode(self, handle, x, cfg, dev):
        enc = handle.text_model.encode(x, cfg.data.max_length)
        return (torch.stack([enc["input_ids"], enc["attention_mask"]], 1).to(dev), enc,
                enc["attention_mask"].sum(1).tolist())

    def truth(self, handle, kept, raws, lengths, labels, threat, cfg, knowledge) -> dict:
        texts = [s for x in raws for s in x]  # every client's sentences, in client order
        lengths = lengths[: cfg.data.batch_size] if threat.individual_updates else lengths
        knowledge["knows_lengths"] = {"lengths": [int(v) for v in lengths]}
        return {"inputs": pad_cat(kept, handle.tokenizer), "labels": labels,
                "texts": texts[: len(labels)] if threat.individual_updates else texts}

    def always_public(self, handle, cfg) -> dict[str, Any]:
        return {"tokenizer": handle.tokenizer, "model_kind": handle.kind, "model_task": handle.info.get("task")}

    def loss_with_options(self, handle, options: dict[str, Any]):
        """The text clients' loss with a training-time defense's options (label smoothing, ...)."""
        from gradleak.models.text import text_loss

        return text_loss(handle.kind, task=handle.info.get("task"), **options)

    def accuracy(self, handle, model, cfg, test, dev) -> dict[str, float]:
        """Accuracy on held-out ``test`` texts: the classification accuracy (bidirectional models) or the next-token
        accuracy (causal LMs, whose clients train the LM loss)."""
        texts, labels = test
        correct = total = 0
        with torch.no_grad():
            for a in range(0, len(texts), 64):
                enc = handle.text_model.encode(texts[a:a + 64], cfg.data.max_length)
                ids, mask = enc["input_ids"].to(dev), enc["attention_mask"].to(dev)
                out = model(input_ids=ids, attention_mask=mask).logits
                if handle.info.get("task") == "lm":
                    pred, gold, m = out[:, :-1].argmax(-1), ids[:, 1:], mask[:, 1:].bool()
                    correct += int((pred == gold)[m].sum())
                    total += int(m.sum())
                else:
                    correct += int((out.argmax(-1).cpu() == labels[a:a + 64]).sum())
                    total += len(ids)
        return {"accuracy": correct / max(total, 1), "test_samples": float(len(texts))}

    def timings(self, cfg, infos, t_client, t_rec) -> dict[str, float]:
        """The text benchmarks' names (per trial)."""
        T = cfg.trials
        return {"client_seconds": t_client / T, "attack_seconds": t_rec / T,
                "word_bag_seconds": float(np.mean([i.get("word_bag_seconds", float("nan")) for i in infos])),
                "sentence_seconds": float(np.mean([i.get("sentence_seconds", float("nan")) for i in infos])),
                "seconds_per_sentence": t_rec / T / max(1, cfg.data.batch_size)}

    def details(self, cfg, evals, infos) -> dict[str, Any]:
        from gradleak.modalities import jsonable

        return {"trials": [{"references": [r["reference"] for r in e.rows if r["verified"] != "-"],
                            "reconstructions": [r["reconstruction"] for r in e.rows],
                            "metrics": e.metrics, "info": jsonable({k: v for k, v in i.items() if k != "word_bag"})}
                           for e, i in zip(evals, infos)]}

    def bottleneck(self, cfg, handle) -> int | None:
        return handle.hidden_size // cfg.peft.reduction_factor

    def training_pool(self, cfg) -> int | None:
        return len(self.data(cfg).ds)

    def has_batchnorm(self, cfg) -> bool:
        return False

    def weight_files(self, cfg) -> list[dict]:
        """The text model's weights: a local folder's files, or a hub id's file in the local HF cache."""
        from pathlib import Path

        from gradleak.models.text import hf_weight_files, resolve_model

        name = cfg.model.name
        path, _ = resolve_model(name, cfg.model.layers or self.default_layers)
        if isinstance(path, Path) or Path(str(path)).is_dir():
            files = hf_weight_files(Path(path))
            return [{"role": f"model {name}", "path": f} for f in files] or [
                {"role": f"model {name}", "path": str(path), "error": "no weights file found in the model folder"}]
        try:  # a hub id: the file of the local HF cache, when there is one
            from huggingface_hub import try_to_load_from_cache

            for fname in ("model.safetensors", "pytorch_model.bin"):
                hit = try_to_load_from_cache(str(path), fname)
                if isinstance(hit, str):
                    return [{"role": f"model {name}", "path": hit}]
        except Exception:  # noqa: BLE001
            pass
        return [{"role": f"model {name}", "path": str(path), "error": "a hub id without a file in the local HF cache"}]


register_experiment("utr", "text: UTR preset (MiniLM, 2 layers, adapters rf=2, honest-but-curious server)", "text",
                    {"data": {"name": "rt-sentences", "batch_size": 8},
                     "model": {"name": "minilm", "layers": 2, "num_classes": 2}, "peft": {"kind": "adapters"},
                     "fl": {"lr": 0.05}, "attack": {"name": "utr"}, "threat": {"preset": "honest-but-curious"}})
register_experiment("text", "text: any text attack; give model/peft/attack/threat yourself (defaults: MiniLM 2 layers, "
                    "adapters)", "text",
                    {"data": {"name": "rt-sentences", "batch_size": 8},
                     "model": {"name": "minilm", "layers": 2, "num_classes": 2}, "fl": {"lr": 0.05}})
