"""Shared set-up of the probes in ``benchmarks/probes/`` (investigations behind statements in docs/REPRODUCTION.md,
not table scripts): ``src/`` on the path and the text probes' common batch."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))


def minilm_rt_update(batch: int, rf: int, seed: int):
    """The probes' common case: MiniLM (2 layers) with UTR's adapters at reduction factor ``rf``, one client's
    FedSGD update on ``batch`` Rotten Tomatoes sentences drawn with ``seed``. Returns (text model, encoding,
    update, true token ids of each sentence)."""
    return text_rt_update("minilm", batch, rf, seed)


def text_rt_update(model: str, batch: int, rf: int, seed: int):
    """:func:`minilm_rt_update` for any text model the pipeline loads (``minilm``, ``smollm2``, a local path)."""
    import torch

    from gradleak.data.text import load_text
    from gradleak.fl.core import Client
    from gradleak.models.text import load_text_model, text_loss
    from gradleak.peft.text_adapters import add_text_adapters

    tm = load_text_model(model, 2)
    add_text_adapters(tm.model, tm.layers(), tm.hidden_size, rf)
    texts, labels = load_text("rt-sentences").batch(batch, seed=seed)
    enc = tm.encode(texts)
    x = torch.stack([enc["input_ids"], enc["attention_mask"]], 1)
    upd = Client(0, x, torch.as_tensor(labels) % 2, loss_fn=text_loss(tm.kind)).local_update(tm.model)
    truth = [enc["input_ids"][i][enc["attention_mask"][i].bool()].tolist() for i in range(batch)]
    return tm, enc, upd, truth
