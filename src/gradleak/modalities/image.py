"""The image modality: images in [0, 1] (the model reads them in [-1, 1]), classification accuracy."""

from __future__ import annotations

from typing import Any

import torch

from gradleak.errors import BadInput
from gradleak.modalities import MODALITIES, Modality, register_experiment

#: image models whose builder takes model.num_channels (the ViTs are built for RGB)
CHANNEL_MODELS = {"resnet18"}


@MODALITIES.register("image", "images in [0, 1] (the model reads [-1, 1]); classification accuracy")
class ImageModality(Modality):
    name = "image"
    split_decided_by = "data_seed"  # images are drawn with data.seed (+ 7919 × trial)
    data_fields = frozenset({"image_size", "public", "public_size", "resize", "validation_size", "prior_size"})
    model_fields = frozenset({"patch_size", "hidden_size", "heads", "adapter_bottleneck", "init_weights", "num_channels"})

    def check_architecture(self, cfg) -> None:
        """A ViT preset's patch size divides the image side, and its heads divide its hidden size."""
        from gradleak.models.vit import PRESETS  # one table of ViT sizes (torch only, no transformers)

        preset = PRESETS.get(cfg.model.name, PRESETS["vit-b16"])
        patch = cfg.model.patch_size or preset["patch_size"]
        if cfg.model.name in PRESETS and cfg.data.image_size % patch:
            raise BadInput("data.image_size", f"image size {cfg.data.image_size} is not divisible by the patch size {patch}.",
                           f"use a multiple of {patch} (e.g. {max(1, round(cfg.data.image_size / patch)) * patch}) "
                           "or change model.patch_size.")
        hidden = cfg.model.hidden_size or preset["hidden_size"]
        heads = cfg.model.heads or preset["num_attention_heads"]
        if hidden % heads:
            raise BadInput("model.heads" if cfg.model.heads else "model.hidden_size",
                           f"hidden size {hidden} is not divisible by {heads} heads.",
                           "choose a head count that divides the hidden size.")

    def check_training(self, cfg) -> None:
        """Image clients may hold different image counts (``fl.client_images``); the model's input channels, full
        fine-tuning, BatchNorm in train mode on the smallest local batch, and central pretraining are checked."""
        if cfg.model.num_channels not in (None, 3) and cfg.model.name not in CHANNEL_MODELS:
            raise BadInput("model.num_channels", f"'{cfg.model.name}' is built for 3-channel (RGB) images.",
                           f"remove model.num_channels, or use a model that takes other channel counts "
                           f"({', '.join(sorted(CHANNEL_MODELS))}).")
        if cfg.model.train_all and cfg.peft.kind != "none":
            raise BadInput("model.train_all", f"trains every parameter, which conflicts with peft.kind={cfg.peft.kind}.",
                           "set peft.kind=none with model.train_all=true (full fine-tuning), or remove model.train_all.")
        if cfg.model.name == "resnet18" and cfg.model.norm == "batch":  # train-mode BN: > 1 value per channel
            from gradleak.models.resnet import check_train_bn_input

            smallest = min(min(c["batch_size"], c["images"] % c["batch_size"] or c["batch_size"])
                           for c in cfg.client_plan())
            check_train_bn_input(cfg.data.image_size, cfg.data.image_size, smallest, field="data.image_size")
        if cfg.model.pretrain is not None:
            self._check_pretrain(cfg)

    @staticmethod
    def _check_pretrain(cfg) -> None:
        """``model.pretrain``: a model we can pretrain, on images the clients never draw."""
        pt = cfg.model.pretrain
        from gradleak.models import VIT_PRESETS

        if cfg.model.name != "resnet18" and cfg.model.name not in VIT_PRESETS:
            raise BadInput("model.pretrain", f"central pretraining is implemented for resnet18 and the random-init "
                           f"ViT presets ({', '.join(VIT_PRESETS)}), not '{cfg.model.name}'.",
                           "remove model.pretrain (vit-s14-pretrained is pretrained already).")
        from gradleak.data.sources import source_families

        if (source_families(pt.data) & source_families(cfg.data.name)) and (pt.data != cfg.data.name
                                                                             or pt.split == "train"):
            raise BadInput("model.pretrain.split", f"pretraining on '{pt.data}/{pt.split}' would share images with "
                           f"the clients' '{cfg.data.name}' (they draw from its train split).",
                           f"pretrain on another split (model.pretrain.split=test with data {cfg.data.name}) or "
                           "on a dataset that shares no source image with data.name.")

    def check_public_data(self, cfg) -> None:
        """The public set a server is granted (``data.public``) shares no source image with the private one."""
        if cfg.threat_model.public_data and cfg.data.public is not None:
            from gradleak.data import check_disjoint

            check_disjoint(cfg.data.name, cfg.data.public)

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


register_experiment("peftleak", "images: PEFTLeak preset (ViT-B/16 + adapters r=64, B=32, malicious server with public "
                    "data)", "image",
                    {"data": {"name": "cifar-samples", "batch_size": 32}, "model": {"name": "vit-b16"}, "fl": {"lr": 1e-3},
                     "attack": {"name": "peftleak"}, "threat": {"preset": "malicious", "public_data": True}})
register_experiment("image", "images: any image attack; give model/peft/attack/threat yourself (defaults: ViT-B/16, "
                    "adapters)", "image",
                    {"data": {"name": "cifar-samples", "batch_size": 8}, "model": {"name": "vit-b16"}, "fl": {"lr": 1e-3}})
register_experiment("leakage", "images: leakage quantification (Hatamizadeh et al. 2022): grey ResNet-18 trained in full "
                    "by FedAvg with BN statistics, attack bn_inversion, RDLV / IIP per client", "image",
                    {"data": {"name": "fashion-mnist", "batch_size": 8, "image_size": 64}, "peft": {"kind": "none"},
                     "model": {"name": "resnet18", "num_channels": 1, "train_all": True},
                     "fl": {"algorithm": "fedavg", "lr": 0.01}, "attack": {"name": "bn_inversion"},
                     "threat": {"preset": "honest-but-curious", "public_data": True}})
