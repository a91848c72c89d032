"""PEFTLeak's baseline (SPEC §1.9, PEFTLeak §4 / Figs 8, 10, 11): Inverting Gradients on adapter gradients.

Setting: ViT-B/16 (12 blocks, D = 768) with Houlsby bottleneck adapters r = 64 after MSA and MLP in every
block (PEFTLeak Fig. 2), trainable adapters + head, everything else frozen; an *honest* server (no
poisoning); real 32×32 CIFAR images (``cifar-samples``: 20 CIFAR-10 + 20 CIFAR-100, 110 classes, so the
head has 110 outputs); FedSGD (one gradient of the mean cross-entropy on the private batch);
B ∈ {1, 8, 32}; labels granted to the server (IG's assumption, the strongest form of the baseline).

Deviation, stated: PEFTLeak fine-tunes a *pretrained* ViT-B/16. No pretrained ViT-B/16 exists offline
here, so the backbone is randomly initialised (``vit("vit-b16", seed=0)``). Adapters start in the Houlsby
near-identity init (up-projection zero), so in this first round the down-projection gradients are exactly
zero and the observed update is the up-projections + head.

Usage::

    python benchmarks/peftleak_baseline.py            # full: 2000 steps at B=1, 1000 at B=8, 250 at B=32
    python benchmarks/peftleak_baseline.py --quick    # ~2 minutes on 1–2 CPU cores
    python benchmarks/peftleak_baseline.py --steps 4000 --batch-sizes 1 8 --threads 8 --device cuda

Writes ``benchmarks/out/peftleak_baseline.json`` (mean/std PSNR and SSIM per B, per-image values,
matching losses, timings) and ``benchmarks/out/peftleak_baseline_B{B}.png`` (originals on top,
reconstructions below, 8 per row).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from gradleak.attacks.optimization import InvertingGradients
from gradleak.data import load
from gradleak.fl.core import Client, ServerView
from gradleak.metrics import psnr, ssim
from gradleak.models.vit import vit
from gradleak.peft.adapters import add_vit_adapters
from gradleak.report import save_image_grid

OUT = Path(__file__).resolve().parent / "out"
# fraction of the B=1 step budget spent at larger B (one step costs ~1.5x at B=8, ~5x at B=32 on CPU)
STEP_FRACTION = {1: 1.0, 8: 0.5, 32: 0.125}


def steps_for(batch: int, base: int) -> int:
    frac = STEP_FRACTION.get(batch, max(0.05, 1.0 / batch))
    return max(1, int(round(base * frac)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="~2-minute version (80 steps at B=1, scaled down for larger B)")
    ap.add_argument("--steps", type=int, default=None, help="Adam steps at B=1 (default 2000; 80 with --quick); "
                    "B=8 gets 1/2, B=32 gets 1/8 of it")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--adapter-r", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--tv-weight", type=float, default=1e-4)
    ap.add_argument("--restarts", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 is fastest on a loaded 2-core box)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    base_steps = args.steps if args.steps is not None else (80 if args.quick else 2000)

    data = load("cifar-samples")
    if max(args.batch_sizes) > len(data):
        ap.error(f"cifar-samples holds {len(data)} images; the largest batch size must not exceed that")
    model = vit("vit-b16", image_size=32, num_classes=data.num_classes, seed=args.seed).to(args.device)
    add_vit_adapters(model, args.adapter_r)
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

    results: dict[str, dict] = {}
    args.out.mkdir(parents=True, exist_ok=True)
    for batch in args.batch_sizes:
        steps = steps_for(batch, base_steps)
        truth = data.images[:batch].to(args.device)
        labels = data.labels[:batch].to(args.device)
        update = Client(0, truth * 2 - 1, labels).local_update(model)  # the client's private side
        view = ServerView(model=model, updates=[update], public={"batch_size": batch, "labels": labels.cpu()})

        def progress(p: dict, batch=batch) -> None:
            print(f"  B={batch} restart {p['restart']} step {p['step']:5d}/{p['steps']} "
                  f"1-cos={p['matching_loss']:.4f} lr={p['lr']:.4f}", flush=True)

        attack = InvertingGradients(steps=steps, lr=args.lr, tv_weight=args.tv_weight, restarts=args.restarts,
                                    labels="known", seed=args.seed, image_shape=(3, 32, 32), progress=progress)
        t0 = time.perf_counter()
        rec = attack.reconstruct(view)
        seconds = time.perf_counter() - t0
        x = rec.data["images"].cpu()
        gt = truth.cpu()
        p, s = psnr(x, gt), ssim(x, gt)
        gray = torch.full_like(gt, 0.5)
        png = save_image_grid(torch.cat([gt, x]), args.out / f"peftleak_baseline_B{batch}.png", nrow=8)
        results[str(batch)] = {
            "steps": steps,
            "psnr_mean": float(p.mean()), "psnr_std": float(p.std()) if batch > 1 else 0.0,
            "ssim_mean": float(s.mean()), "ssim_std": float(s.std()) if batch > 1 else 0.0,
            "psnr_per_image": [float(v) for v in p], "ssim_per_image": [float(v) for v in s],
            "reference_gray_image_psnr_mean": float(psnr(gray, gt).mean()),
            "initial_matching_loss": rec.info["initial_matching_loss"],
            "final_matching_loss": rec.info["final_matching_loss"],
            "matched_values": rec.info["num_matched_values"],
            "seconds": seconds, "seconds_per_step": seconds / (steps * args.restarts),
            "image_grid": str(png.relative_to(args.out.parent) if png.is_relative_to(args.out.parent) else png),
        }
        print(f"B={batch}: steps={steps} PSNR={p.mean():.2f} dB SSIM={s.mean():.3f} "
              f"1-cos {rec.info['initial_matching_loss']:.4f} -> {rec.info['final_matching_loss']:.4f} "
              f"({seconds:.0f} s)", flush=True)

    report = {
        "name": "peftleak_baseline_inverting_gradients",
        "setting": {"model": "vit-b16", "image_size": 32, "adapter_r": args.adapter_r, "adapters": "houlsby, after MSA and MLP, 24 slots",
                    "trainable_parameters": n_trainable, "backbone": "random init (seed %d): no pretrained ViT-B/16 offline" % args.seed,
                    "server": "honest", "fl": "fedsgd, mean cross-entropy", "data": "cifar-samples (first B images)",
                    "num_classes": data.num_classes, "labels": "granted (known)"},
        "attack": {"name": "inverting_gradients", "lr": args.lr, "tv_weight": args.tv_weight, "restarts": args.restarts,
                   "signed": True, "box": "clamp", "similarity": "global", "schedule": "cosine", "base_steps": base_steps},
        "quick": bool(args.quick),
        "metrics_by_batch_size": results,
        "paper_claim": "PEFTLeak §4 / Figs 8, 10, 11: the IG baseline recovers no recognisable image from adapter gradients",
        "environment": {"python": sys.version.split()[0], "torch": torch.__version__, "platform": platform.platform(),
                        "threads": torch.get_num_threads(), "device": args.device},
        "command": " ".join(["python", "benchmarks/peftleak_baseline.py", *(argv if argv is not None else sys.argv[1:])]),
    }
    path = args.out / "peftleak_baseline.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
