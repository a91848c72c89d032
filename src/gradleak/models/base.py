"""The handle every model builder returns (:func:`gradleak.models.build`): the model plus what the pipeline needs to
know about it. Re-exported as ``gradleak.models.ModelHandle``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from gradleak.errors import BadInput


@dataclass
class ModelHandle:
    """A model plus what the pipeline needs to know about it."""

    model: Any
    modality: str  # "image" | "text"
    name: str
    kind: str  # "image" | "bidirectional" | "causal"
    hidden_size: int
    num_layers: int
    tokenizer: Any = None
    loss_fn: Callable | None = None
    text_model: Any = None  # gradleak.models.text.TextModel for text
    info: dict = field(default_factory=dict)

    @classmethod
    def from_text_model(cls, tm) -> "ModelHandle":
        """Wrap a :class:`gradleak.models.text.TextModel`."""
        from gradleak.models.text import text_loss

        return cls(tm.model, "text", tm.name, tm.kind, tm.hidden_size, tm.num_layers, tokenizer=tm.tokenizer,
                   loss_fn=text_loss(tm.kind, task=tm.task), text_model=tm, info={**tm.info, "task": tm.task})

    def layers(self):
        """The model's blocks: ViT encoder layers, ResNet stages, or the text model's layers."""
        if self.modality == "image":
            if hasattr(self.model, "vit"):
                return self.model.vit.encoder.layer
            if hasattr(self.model, "resnet"):
                return self.model.resnet.encoder.stages
            raise BadInput("model.name", f"{self.name} exposes neither ViT layers nor ResNet stages.",
                           "use a ViT or resnet18 for per-layer PEFT.")
        return self.text_model.layers()
