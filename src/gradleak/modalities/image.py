"""The image modality: images in [0, 1] (the model reads them in [-1, 1]), classification accuracy."""

from __future__ import annotations

from typing import Any

import torch

from gradleak.modalities import MODALITIES, Modality


@MODALITIES.register("image", "images in [0, 1] (the model reads [-1, 1]); classification accuracy")
class ImageModality(Modality):
    name = "image"
    split_decided_by = "data_seed"  # images are drawn with data.seed (+ 7919 × trial)

    def data(self, cfg) -> Any:
        from gradleak.data.splits import ImageData

        return ImageData(cfg)

    def attack_public(self, cfg, data, threat) -> dict[str, Any]:
        return {"public_images": data.public()} if threat.public_data else {}

    def trial_knowledge(self, cfg, data, knowledge: dict) -> None:
        if data.wants_prior and data.prior_image() is not None:
            knowledge.setdefault("public_data", {})["prior_image"] = data.prior_image()
            knowledge["public_data"]["prior_images"] = data.prior_images()  # the held-out images themselves

    def build_kwargs(self, cfg) -> dict[str, Any]:
        return {"num_channels": cfg.image_channels}

    def encode(self, handle, x, cfg, dev):
        return (x.to(next(handle.model.parameters()).dtype) * 2 - 1).to(dev), x, []

    def truth(self, handle, kept, raws, lengths, labels, threat, cfg, knowledge) -> dict:
        return {"inputs": torch.cat(kept), "labels": labels}

    def always_public(self, handle, cfg) -> dict[str, Any]:
        return {"image_shape": (cfg.image_channels, cfg.data.image_size, cfg.data.image_size),
                "num_classes": cfg.model.num_classes}

    def eval_mode_for_release(self) -> bool:
        return True  # running statistics (BatchNorm), as a released model is used

    def accuracy(self, handle, model, cfg, test, dev) -> dict[str, float]:
        """Accuracy on held-out ``test`` images, in eval mode (the model's mode restored after)."""
        x, y = test
        was = model.training
        model.eval()
        correct = 0
        try:
            with torch.no_grad():
                dtype = next(model.parameters()).dtype
                for a in range(0, len(x), 256):
                    out = model((x[a:a + 256].to(dtype) * 2 - 1).to(dev))
                    logits = out.logits if hasattr(out, "logits") else out
                    correct += int((logits.argmax(-1).cpu() == y[a:a + 256]).sum())
        finally:
            model.train(was)
        return {"accuracy": correct / max(len(x), 1), "test_samples": float(len(x))}

    def details(self, cfg, evals, infos) -> dict[str, Any]:
        from gradleak.metrics import lpips_status
        from gradleak.models.features import BACKBONE_NAME

        from gradleak.modalities import jsonable

        return {"feature_distance_backbone": BACKBONE_NAME if cfg.metrics.feature_distance else None,
                "lpips": lpips_status()[1], "attack_info": jsonable(infos[0])}

    def fixed_size(self, cfg) -> int | None:
        from gradleak.data.splits import fixed_image_count

        return fixed_image_count(cfg)

    def training_pool(self, cfg) -> int | None:
        total = self.fixed_size(cfg)
        other = cfg.data.validation_size * cfg.fl.clients + (cfg.data.prior_size if cfg.attack_cls.uses_prior else 0)
        return None if total is None else total - 1 - other

    def has_batchnorm(self, cfg) -> bool:
        return cfg.model.name == "resnet18" and cfg.model.norm == "batch"

    def metric_files(self, cfg) -> list[dict]:
        if not cfg.metrics.feature_distance:
            return []
        from gradleak.models.features import onnx_path

        return [{"role": "feature_distance backbone (ViT-S/14 source ONNX)", "path": onnx_path()}]
