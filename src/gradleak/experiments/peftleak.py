"""The ``peftleak`` experiment: poison a ViT + adapters, run the client's FedSGD/FedAvg rounds on a real
batch, recover patches from the observed adapter updates, score and report.

Timings: ``attack_to_client_step_ratio`` = (public statistics + poisoning + planning + per-round
adapters + reconstruction) / (the client's local training over the same rounds), measured in the same
run so machine noise cancels.
"""

from __future__ import annotations

import math
import time
from typing import Literal, Optional

import torch
from pydantic import Field

from gradleak.attacks.base import ThreatModel
from gradleak.attacks.peftleak import PEFTLeak, image_to_patches, patches_to_image, upsample_patch
from gradleak.data import load
from gradleak.defenses.update import DefenseConfig, build_defenses
from gradleak.errors import BadInput
from gradleak.experiments.config import Strict
from gradleak.experiments.runner import RunContext
from gradleak.fl.core import Client, ServerView
from gradleak.metrics import BACKBONE_NAME, lpips_status
from gradleak.metrics.patches import assemble_images, patch_recovery
from gradleak.models.vit import vit
from gradleak.peft.adapters import add_vit_adapters
from gradleak.registry import EXPERIMENTS


class DataConfig(Strict):
    name: str = "cifar-samples"
    batch_size: int = Field(32, gt=0)
    image_size: int = Field(32, gt=0)
    public: str = "natural-crops"
    public_size: int = Field(2000, gt=0)
    seed: int = 0
    path: Optional[str] = None  # for data.name = image-folder | npz (users' own CIFAR-10, TinyImageNet, ...)


class ModelConfig(Strict):
    name: str = "vit-b16"
    patch_size: Optional[int] = None
    layers: Optional[int] = None
    hidden_size: Optional[int] = None
    heads: Optional[int] = None
    adapter_bottleneck: int = 64
    num_classes: int = Field(10, gt=1)
    pooling: Literal["mean", "cls"] = "mean"


class AttackConfig(Strict):
    design: Literal["paper", "improved"] = "improved"
    sigma: float = 10.0
    pe_distribution: Literal["gaussian", "laplacian"] = "gaussian"
    adapters_per_position: Optional[int] = None
    positions_per_round: Optional[int] = None
    max_rounds: Optional[int] = None
    low_resolution: bool = False
    peel: bool = True
    quantiles: Literal["gaussian", "empirical"] = "gaussian"  # paper design's bin edges
    fedavg_aware: Optional[bool] = None  # default: on when fl.algorithm = fedavg
    up_scale: float = 1e-12


class FLConfig(Strict):
    algorithm: Literal["fedsgd", "fedavg"] = "fedsgd"
    local_epochs: int = Field(1, gt=0)
    local_batch_size: Optional[int] = None
    lr: float = Field(1e-3, gt=0)


class MetricsConfig(Strict):
    psnr_threshold_db: float = 30.0
    feature_distance: bool = True  # 1 − cos of ViT-S/14 features (offline); LPIPS is added when its weights exist


class PEFTLeakExperimentConfig(Strict):
    experiment: Literal["peftleak"] = "peftleak"
    name: str = "peftleak"
    seed: int = 0
    device: str = "cpu"
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    attack: AttackConfig = AttackConfig()
    fl: FLConfig = FLConfig()
    defenses: list[DefenseConfig] = []
    metrics: MetricsConfig = MetricsConfig()

    def check(self) -> None:
        if self.attack.sigma <= 0:
            raise BadInput("attack.sigma", f"σ must be > 0, got {self.attack.sigma}.", "use e.g. 10 (the paper's).")
        if self.model.adapter_bottleneck <= 0:
            raise BadInput("model.adapter_bottleneck", f"r must be > 0, got {self.model.adapter_bottleneck}.",
                           "use e.g. 64 (the paper's).")
        patch = self.model.patch_size or {"vit-b32": 32, "vit-tiny": 8}.get(self.model.name, 16)
        if self.data.image_size % patch:
            raise BadInput("data.image_size", f"image size {self.data.image_size} is not divisible by the patch size {patch}.",
                           f"use a multiple of {patch} (e.g. {max(1, round(self.data.image_size / patch)) * patch}) or change model.patch_size.")


GENERATED = ("natural-crops", "public-natural")


def _load_images(name: str, n: int, size: int, seed: int, field: str, path: str | None = None):
    """Load n images at size×size. Generated sets (crops) use ``seed``; a fixed set returns its first n
    images for seed 0 and a seeded random subset of n otherwise (several batches from one small set)."""
    kwargs: dict = {"n": n} if name in GENERATED else {}
    if name in GENERATED or name == "imagenet-samples":
        kwargs["size"] = size
    if name in GENERATED:
        kwargs["seed"] = seed
    if path is not None:
        kwargs["path"] = path
    ds = load(name, **kwargs)
    imgs, labels = ds.images, ds.labels
    if name not in GENERATED and seed != 0 and len(imgs) > n:
        perm = torch.randperm(len(imgs), generator=torch.Generator().manual_seed(seed))[:n]
        imgs, labels = imgs[perm], labels[perm]
    if len(imgs) < n:
        raise BadInput(field, f"'{name}' has only {len(imgs)} images but {n} were asked for.",
                       "lower the batch size or use natural-crops (any number of images).")
    if imgs.shape[-1] != size or imgs.shape[-2] != size:
        imgs = torch.nn.functional.interpolate(imgs, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    if imgs.shape[1] == 1:
        imgs = imgs.expand(-1, 3, -1, -1)
    return imgs[:n].clamp(0, 1), labels[:n]


@EXPERIMENTS.register("peftleak", "PEFTLeak: malicious server recovers image patches from ViT adapter gradients")
class PEFTLeakExperiment:
    Config = PEFTLeakExperimentConfig

    def run(self, cfg: PEFTLeakExperimentConfig, ctx: RunContext) -> dict:
        dev = ctx.device
        B, S = cfg.data.batch_size, cfg.data.image_size
        private, labels = _load_images(cfg.data.name, B, S, cfg.data.seed, "data.name", cfg.data.path)
        public, _ = _load_images(cfg.data.public, cfg.data.public_size, S, cfg.data.seed + 1000, "data.public")
        model = vit(cfg.model.name, image_size=S, patch_size=cfg.model.patch_size, num_classes=cfg.model.num_classes,
                    pooling=cfg.model.pooling, layers=cfg.model.layers, hidden_size=cfg.model.hidden_size,
                    heads=cfg.model.heads, dtype=torch.float64, seed=cfg.seed, init_weights=False)
        add_vit_adapters(model, cfg.model.adapter_bottleneck)
        a = cfg.attack
        attack = PEFTLeak(public_images=public, design=a.design, sigma=a.sigma, pe_distribution=a.pe_distribution,
                          up_scale=a.up_scale, adapters_per_position=a.adapters_per_position,
                          positions_per_round=a.positions_per_round, low_resolution=a.low_resolution,
                          peel=a.peel, quantiles=a.quantiles, seed=cfg.seed, expected_batch_size=B,
                          fedavg_aware=(cfg.fl.algorithm == "fedavg") if a.fedavg_aware is None else a.fedavg_aware)
        t0 = time.perf_counter()
        model = attack.prepare(model, ThreatModel(malicious=True, public_data=True))
        t_prepare = time.perf_counter() - t0
        model.to(dev)
        x = (private.to(torch.float64) * 2 - 1).to(dev)
        y = (labels % cfg.model.num_classes).to(dev)
        client = Client(0, x, y)
        defenses = build_defenses(cfg.defenses, seed=cfg.seed)
        n_rounds = attack.num_rounds if a.max_rounds is None else min(a.max_rounds, attack.num_rounds)
        rounds, states = [], []
        t_client = t_state = 0.0
        for k in ctx.track(range(n_rounds), description="FL rounds (client steps)", total=n_rounds):
            t0 = time.perf_counter()
            st = attack.adapter_state(k)
            t_state += time.perf_counter() - t0
            model.load_state_dict({n: v.to(dev) for n, v in st.items()}, strict=False)
            t0 = time.perf_counter()
            upd = client.local_update(model, algorithm=cfg.fl.algorithm, epochs=cfg.fl.local_epochs, lr=cfg.fl.lr,
                                      batch_size=cfg.fl.local_batch_size, defenses=defenses, seed=cfg.seed + k)
            t_client += time.perf_counter() - t0
            rounds.append([upd.map(lambda _, v: v.detach().cpu())])
            states.append(st)
        view = ServerView(model=model, updates=rounds[-1], rounds=rounds, round_states=states,
                          public={"batch_size": B})
        t0 = time.perf_counter()
        rec = attack.reconstruct(view)
        t_rec = time.perf_counter() - t0

        # ---- metrics (the only place the truth is used)
        k = attack.reduce
        truth_cmp = image_to_patches(x.cpu(), attack.P, k)
        d = rec.data
        m = patch_recovery(truth_cmp, d["patches"], d["positions"], d["groups"], cfg.metrics.psnr_threshold_db)
        assignment = m.pop("assignment")
        placed = assemble_images(d["patches"], d["positions"], d["groups"], assignment, B, attack.N, truth_cmp.shape[-1])
        if k > 1:
            flat = placed.reshape(B * attack.N, -1)
            placed = upsample_patch(flat, attack.C, attack.P, k).reshape(B, attack.N, -1)
        recon = torch.stack([patches_to_image(placed[i], attack.C, S, attack.P) for i in range(B)])
        recon01 = (recon + 1) / 2
        truth01 = private.to(torch.float64).cpu()
        metrics = {k2: (float(v) if isinstance(v, (int, float)) else v) for k2, v in m.items()}
        metrics.update(self._image_metrics(truth01, recon01, truth_cmp, placed if k == 1 else None, cfg))
        attacked = sorted({sp.position for plan in attack.plans[:n_rounds] for sp in plan.slots})
        if len(attacked) < attack.N:  # fewer rounds than the plan needs: score the positions attacked
            keep = torch.isin(d["positions"], torch.tensor(attacked))
            remap = torch.zeros(attack.N + 1, dtype=torch.long)
            remap[torch.tensor(attacked)] = torch.arange(1, len(attacked) + 1)
            sub = patch_recovery(truth_cmp[:, torch.tensor(attacked) - 1], d["patches"][keep], remap[d["positions"][keep]],
                                 d["groups"][keep], cfg.metrics.psnr_threshold_db)
            metrics["patch_recovery_rate_attacked_positions"] = sub["patch_recovery_rate"]
            metrics["isolated_patch_rate_attacked_positions"] = sub["isolated_patch_rate"]
        metrics["attacked_positions"] = len(attacked)
        metrics["rounds_used"] = n_rounds
        metrics["adapters_per_position"] = attack.K
        metrics["hash_directions_per_position"] = attack.K if attack.multi_direction else 1
        metrics["positions_per_round"] = attack.ppr
        metrics["rounds_needed_all_positions"] = attack.num_rounds
        attack_time = t_prepare + t_state + t_rec
        timings = {"attack_prepare_seconds": t_prepare, "attack_adapter_state_seconds": t_state,
                   "attack_reconstruct_seconds": t_rec, "attack_total_seconds": attack_time,
                   "client_step_seconds": t_client,
                   "attack_to_client_step_ratio": attack_time / max(t_client, 1e-12)}
        # ---- report artefacts
        from gradleak.report import save_image_grid

        nrow = min(8, B)
        show = min(B, 64)
        save_image_grid(truth01[:show], ctx.out_dir / "ground_truth.png", nrow=nrow, upscale=max(1, 128 // S))
        save_image_grid(recon01[:show], ctx.out_dir / "reconstruction.png", nrow=nrow, upscale=max(1, 128 // S))
        report = {
            "figures": [
                {"title": "ground truth (client's private batch)", "path": "ground_truth.png", "caption": f"first {show} of {B}"},
                {"title": f"PEFTLeak reconstruction ({a.design} design)", "path": "reconstruction.png",
                 "caption": "grey = patch not recovered; images placed by the attacker's grouping"},
            ],
            "figure_rows": [[0, 1]],
            "notes": [f"{rec.info['unique_patches']} patches returned from {rec.info['bins']} bins over {n_rounds} round(s); "
                      f"{attack.K} adapters per position, {attack.ppr} positions per round.",
                      "A true patch counts as recovered only if a patch at its image and position has PSNR ≥ "
                      f"{cfg.metrics.psnr_threshold_db:g} dB (gradleak.metrics.patches)."],
        }
        return {"metrics": metrics, "timings": timings, "artifacts": ["ground_truth.png", "reconstruction.png"],
                "details": {"attack_info": rec.info,
                            "feature_distance_backbone": BACKBONE_NAME if cfg.metrics.feature_distance else None,
                            "lpips": lpips_status()[1]},
                "report": report}

    @staticmethod
    def _image_metrics(truth01, recon01, truth_cmp, placed, cfg) -> dict:
        from gradleak.metrics import psnr, ssim

        out = {}
        filled = torch.where(torch.isnan(recon01), torch.full_like(recon01, 0.5), recon01)
        out["image_psnr_mean"] = float(psnr(filled, truth01).mean())
        out["image_ssim_mean"] = float(ssim(filled, truth01).mean())
        out["image_mse_mean"] = float(((filled - truth01) ** 2).mean())
        if placed is not None:
            ok = ~torch.isnan(placed[..., 0])
            if ok.any():
                rp, tp = (placed[ok] + 1) / 2, (truth_cmp[ok] + 1) / 2
                out["recovered_patch_mse_mean"] = float(((rp - tp) ** 2).mean())
                C = truth01.shape[1]
                side = int(math.isqrt(rp.shape[1] // C))
                out["recovered_patch_ssim_mean"] = float(ssim(rp.reshape(-1, C, side, side).float(),
                                                               tp.reshape(-1, C, side, side).float()).mean())
        if cfg.metrics.feature_distance:
            from gradleak.metrics import feature_distance

            out["feature_distance_mean"] = float(feature_distance(filled.float(), truth01.float()).mean())
        from gradleak.metrics import lpips

        lp = lpips(filled.float(), truth01.float())  # None unless the user supplied AlexNet-LPIPS weights
        if lp is not None:
            out["lpips_mean"] = float(lp.mean())
        return out
