"""PEFTLeak's baseline (SPEC §1.9, PEFTLeak §4 / Figs 8, 10, 11): Inverting Gradients on adapter gradients.

Each batch size is one run of ``configs/peftleak/ig_baseline.yaml`` through the experiment pipeline
(``gradleak.run.run_config``, the code path of ``gradleak run``), with ``--set`` overrides for the
flags below, into ``<out>/B{B}/`` (``results.json``, ``report.html``, ``ground_truth.png``,
``reconstruction.png``).

Setting (from the config): ViT-B/16 (12 blocks, D = 768) with Houlsby bottleneck adapters
(``peft.bottleneck`` = ``--adapter-r``, default 64) after MSA and MLP in every block (PEFTLeak Fig. 2),
trainable adapters + head, everything else frozen; an *honest-but-curious* server (no poisoning) that is
granted the labels (``threat.knows_labels``: IG's assumption, the strongest form of the baseline); real
32×32 CIFAR images (``cifar-samples``: 20 CIFAR-10 + 20 CIFAR-100, the first B of them; labels mod
``model.num_classes``); FedSGD (one gradient of the mean cross-entropy on the private batch); B ∈ {1, 8, 32}.

Evaluation: the pipeline matches the reconstructions to the private images *order-free* (Hungarian
assignment on MSE) before computing PSNR/SSIM, so a reconstruction of the right image in the wrong slot
counts; ``reference_gray_image_psnr_mean`` is the PSNR a plain grey image scores on the same batch.

Deviation, stated: PEFTLeak fine-tunes a *pretrained* ViT-B/16. No pretrained ViT-B/16 exists offline
here, so the backbone is randomly initialised (seed ``--seed``). Adapters start in the Houlsby
near-identity init (up-projection zero), so in this first round the down-projection gradients are exactly
zero and the observed update is the up-projections + head.

Usage::

    python benchmarks/peftleak_baseline.py            # full: 2000 steps at B=1, 1000 at B=8, 250 at B=32
    python benchmarks/peftleak_baseline.py --quick    # ~2 minutes on 1–2 CPU cores
    python benchmarks/peftleak_baseline.py --steps 4000 --batch-sizes 1 8 --threads 8 --device cuda
    python benchmarks/peftleak_baseline.py --check    # validate the run configs, run nothing

Writes ``<out>/peftleak_baseline.json`` (per B: mean PSNR and SSIM, the grey-image reference, matching
losses, timings, the run directory) and ``<out>/peftleak_baseline_B{B}.png`` (originals on top,
order-matched reconstructions below, 8 per row). ``--out`` defaults to ``runs/bench/peftleak_baseline``
(git-ignored); ``benchmarks/out/peftleak_baseline.json`` is the published reference result (run with
``--quick --threads 1``) that ``benchmarks/peftleak.py`` quotes in docs/REPRODUCTION.md. Per-image
PSNR/SSIM values are no longer stored (the pipeline reports batch means).
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import ROOT, add_out_args, check_configs, display, fmt_num, resolve_out, revision  # noqa: E402

CONFIG = ROOT / "configs" / "peftleak" / "ig_baseline.yaml"
# fraction of the B=1 step budget spent at larger B (one step costs ~1.5x at B=8, ~5x at B=32 on CPU)
STEP_FRACTION = {1: 1.0, 8: 0.5, 32: 0.125}


def steps_for(batch: int, base: int) -> int:
    frac = STEP_FRACTION.get(batch, max(0.05, 1.0 / batch))
    return max(1, int(round(base * frac)))


def overrides_for(args: argparse.Namespace, batch: int, steps: int) -> list[str]:
    ov = [f"data.batch_size={batch}", f"attack.steps={steps}", f"attack.lr={args.lr}",
          f"attack.tv_weight={args.tv_weight}", f"attack.restarts={args.restarts}",
          f"peft.bottleneck={args.adapter_r}", f"seed={args.seed}", f"device={args.device}"]
    if args.threads:
        ov.append(f"threads={args.threads}")
    return ov


def _stage(batch: int):
    @contextlib.contextmanager
    def stage(description: str):
        t0 = time.perf_counter()
        print(f"  B={batch}: {description} ...", flush=True)
        yield
        print(f"  B={batch}: {description} done ({time.perf_counter() - t0:.0f} s)", flush=True)

    return stage


def _combined_grid(run_dir: Path, path: Path) -> Path | None:
    """Originals on top, reconstructions below: the run's two grids stacked into one PNG."""
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - Pillow comes with the report dependencies
        return None
    gt, rc = run_dir / "ground_truth.png", run_dir / "reconstruction.png"
    if not (gt.exists() and rc.exists()):
        return None
    a, b = Image.open(gt).convert("RGB"), Image.open(rc).convert("RGB")
    out = Image.new("RGB", (max(a.width, b.width), a.height + b.height), "white")
    out.paste(a, (0, 0))
    out.paste(b, (0, a.height))
    out.save(path)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="~2-minute version (80 steps at B=1, scaled down for larger B)")
    ap.add_argument("--steps", type=int, default=None, help="Adam steps at B=1 (default 2000; 80 with --quick); "
                    "B=8 gets 1/2, B=32 gets 1/8 of it, other B 1/B (at least 1/20) -> attack.steps")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32], help="-> data.batch_size (at most 40)")
    ap.add_argument("--adapter-r", type=int, default=64, help="adapter bottleneck r -> peft.bottleneck")
    ap.add_argument("--lr", type=float, default=0.1, help="-> attack.lr")
    ap.add_argument("--tv-weight", type=float, default=1e-4, help="-> attack.tv_weight")
    ap.add_argument("--restarts", type=int, default=1, help="-> attack.restarts")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads -> threads (1 is fastest on a loaded 2-core box)")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | auto -> device")
    ap.add_argument("--seed", type=int, default=0, help="backbone init and attack seed -> seed")
    add_out_args(ap, "peftleak_baseline", resumable=False, docs=False)
    args = ap.parse_args(argv)
    args.out = resolve_out(args.out)
    base_steps = args.steps if args.steps is not None else (80 if args.quick else 2000)

    from gradleak.run import run_config, validate
    from gradleak.config.loading import load_yaml
    from gradleak.run.results import write_json_atomic

    raw = load_yaml(CONFIG)
    plan = [(B, steps_for(B, base_steps)) for B in args.batch_sizes]
    if args.check:
        return check_configs((f"B{B}", raw, overrides_for(args, B, s)) for B, s in plan)
    for B, s in plan:  # every config is valid before the first (long) run starts
        _, cfg = validate(raw, overrides_for(args, B, s))
    from gradleak.data import load

    n_images = len(load(cfg.data.name))
    if max(args.batch_sizes) > n_images:
        ap.error(f"{cfg.data.name} holds {n_images} images; the largest batch size must not exceed that")

    results: dict[str, dict] = {}
    cfg_dump: dict = {}
    env: dict = {}
    args.out.mkdir(parents=True, exist_ok=True)
    for batch, steps in plan:
        run_dir = args.out / f"B{batch}"
        print(f"B={batch}: {steps} steps -> {display(run_dir)}", flush=True)
        res = run_config(raw, run_dir, overrides_for(args, batch, steps), device=args.device, stage=_stage(batch))
        m, t = res["metrics"], res["timings"]
        cfg_dump, env = res["config"], res["environment"]
        info = res.get("details", {}).get("attack_info", {})
        seconds = t.get("attack_reconstruct_seconds", float("nan"))
        png = _combined_grid(run_dir, args.out / f"peftleak_baseline_B{batch}.png")
        results[str(batch)] = {
            "steps": steps,
            "psnr_mean": m.get("image_psnr_mean"), "ssim_mean": m.get("image_ssim_mean"),
            "mse_mean": m.get("image_mse_mean"), "feature_distance_mean": m.get("feature_distance_mean"),
            "reference_gray_image_psnr_mean": m.get("reference_gray_image_psnr_mean"),
            "images_above_threshold": m.get("images_above_threshold"),
            "initial_matching_loss": m.get("initial_matching_loss"),
            "final_matching_loss": m.get("final_matching_loss"),
            "matched_values": info.get("num_matched_values"),
            "seconds": seconds, "seconds_per_step": seconds / (steps * args.restarts),
            "client_step_seconds": t.get("client_step_seconds"), "total_seconds": t.get("total_seconds"),
            "run_dir": display(run_dir),
            "image_grid": display(png) if png else None,
        }
        r = results[str(batch)]
        print(f"B={batch}: steps={steps} PSNR={fmt_num(r['psnr_mean'], '.2f')} dB "
              f"(grey image {fmt_num(r['reference_gray_image_psnr_mean'], '.2f')}) SSIM={fmt_num(r['ssim_mean'], '.3f')} "
              f"1-cos {fmt_num(r['initial_matching_loss'], '.4f')} -> {fmt_num(r['final_matching_loss'], '.4f')} "
              f"({fmt_num(seconds, '.0f')} s)", flush=True)

    import torch

    report = {
        "name": "peftleak_baseline_inverting_gradients",
        "config": display(CONFIG),
        "setting": {"model": cfg_dump.get("model", {}).get("name"), "image_size": cfg_dump.get("data", {}).get("image_size"),
                    "adapter_r": args.adapter_r, "adapters": "houlsby, after MSA and MLP, 24 slots",
                    "backbone": "random init (seed %d): no pretrained ViT-B/16 offline" % args.seed,
                    "server": cfg_dump.get("threat", {}).get("preset"), "fl": "fedsgd, mean cross-entropy",
                    "data": f"{cfg_dump.get('data', {}).get('name')} (first B images)",
                    "num_classes": cfg_dump.get("model", {}).get("num_classes"), "labels": "granted (threat.knows_labels)",
                    "matching": "reconstructions matched to the private images order-free (Hungarian on MSE)"},
        "attack": {"name": "inverting_gradients", "lr": args.lr, "tv_weight": args.tv_weight, "restarts": args.restarts,
                   **{k: cfg_dump.get("attack", {}).get(k) for k in ("signed", "box", "similarity", "labels")},
                   "schedule": "cosine", "base_steps": base_steps},
        "quick": bool(args.quick),
        "metrics_by_batch_size": results,
        "paper_claim": "PEFTLeak §4 / Figs 8, 10, 11: the IG baseline recovers no recognisable image from adapter gradients",
        "environment": {"python": sys.version.split()[0], "torch": torch.__version__, "platform": platform.platform(),
                        "threads": env.get("torch_threads", torch.get_num_threads()), "device": env.get("device", args.device)},
        "command": " ".join(["python", "benchmarks/peftleak_baseline.py", *(argv if argv is not None else sys.argv[1:])]),
        "revision": revision(),  # the code revision that measured it
    }
    path = args.out / "peftleak_baseline.json"
    write_json_atomic(path, report)
    print(f"wrote {display(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
