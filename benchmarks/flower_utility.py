"""Privacy–utility over training through a Flower federation (the LoRA-ViT paper's §6, Fig. 12).

Full FedAvg on a Dirichlet(α = 0.1) non-IID split, through ``fl.engine: flower`` (Flower's ``FedAvg`` in a
``ServerApp``, one ``ClientApp`` node per client, in-process), for Gaussian noise σ ∈ {0, 0.01, 0.1} on every upload
(the paper's "DP σ", added to the update as in its Table 4). Every ``--every`` rounds: the global model's test accuracy
and the attack's success on *every* client's update of that round (``lora_span``, the exact analytic attack
beyond paper 001; each client's reconstruction scored against its own images), plus the paper's kind of attack
(``--second-attack``, default ``ig`` at cpu scale) on the one-image client. One client is the high-risk client of the
leakage study (one private image, so its FedAvg update is one gradient step); the others hold their Dirichlet share.

Setting (CPU scale, stated in the table): the pretrained ViT-S/14 resampled to patch 8 on 32×32 Fashion-MNIST
(grey replicated to RGB, 10 classes), LoRA r = 32 on every block's query + value (+ the head), FedAvg with one local
epoch of batch 8 at lr 0.05. The paper: ViT-S, CIFAR-10, 100 rounds, its optimisation attack (GIAS + anchor).

Resumable: one JSONL row per (arm, measured round) in ``OUT/flower_utility.jsonl``, an arm's rows appended when the
arm is done (the cell loop, :func:`gradleak.run.cells.run_cells`, by ``arm``); a done arm is skipped. Run ``OMP_NUM_THREADS=1 python benchmarks/flower_utility.py --out benchmarks/out --update-docs``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import (REVISION_NOTE, add_out_args, display, latest_rows, resolve_out, revision, revision_label, save_figure,  # noqa: E402
                    start_fresh, write_section)

ARMS = {"no noise": 0.0, "noise σ = 0.01": 0.01, "noise σ = 0.1": 0.1}
PAPER = "no-DP PSNR ≈ 14.6 → 12.1 dB over 100 rounds, ≈ 9.3–10.8 dB under DP (Fig. 12; annotations partly garbled)"


def base_config(args) -> dict:
    return {"experiment": "image", "name": "flower-utility", "seed": args.seed,
            "data": {"name": "fashion-mnist", "batch_size": args.local_batch, "image_size": 32},
            "model": {"name": "vit-s14-pretrained", "patch_size": 8, "num_classes": 10, "pooling": "mean"},
            "peft": {"kind": "lora", "lora_rank": args.rank, "lora_targets": ["query", "value"], "lora_init": "nonzero"},
            "fl": {"algorithm": "fedavg", "rounds": args.rounds, "lr": args.lr, "local_epochs": 1,
                   "local_batch_size": args.local_batch, "clients": args.clients + 1, "engine": "flower"},
            "threat": {"preset": "honest-but-curious"}, "attack": {"name": "lora_span"}}


def split(args, labels):
    """Per-client index lists: a Dirichlet(α) split of the training pool over ``clients`` clients, plus the
    high-risk client (one image) -- client 0."""
    import numpy as np

    from gradleak.fl.core import dirichlet_split

    pool = np.arange(1, args.train)  # image 0 is the high-risk client's
    parts = dirichlet_split(labels[1:args.train].numpy(), args.clients, args.alpha, seed=args.seed)
    parts = [pool[p] for p in parts]
    parts = [p if len(p) else pool[:1] for p in parts]  # an empty share would leave a client with nothing to train
    return [np.array([0])] + parts


def run_arm(args, arm: str, sigma: float) -> list[dict]:
    """One arm of the federation: its rows, one per measured round."""
    import torch

    from gradleak.attacks.base import AttackContext
    from gradleak.defenses import build_defenses
    from gradleak.data.splits import load_images
    from gradleak.evaluation import Truth, evaluate
    from gradleak.run.pipeline import always_public, build_handle, public_protocol
    from gradleak.run.runner import validate
    from gradleak.fl.core import Client, default_classification_loss
    from gradleak.fl.threat import build_view
    from gradleak.fl.engines.flower import run_rounds_flower

    torch.manual_seed(args.seed)
    raw = base_config(args)
    _, cfg = validate(raw)
    handle, _ = build_handle(cfg)
    model = handle.model
    imgs, labels = load_images("fashion-mnist", args.train + args.test, 32, args.seed, "data.name")
    test_x, test_y = imgs[args.train:], labels[args.train:] % 10
    parts = split(args, labels)
    dtype = next(model.parameters()).dtype
    clients = [Client(i, imgs[p].to(dtype) * 2 - 1, labels[p] % 10, default_classification_loss)
               for i, p in enumerate(parts)]
    measured = sorted({0, *range(args.every - 1, args.rounds, args.every), args.rounds - 1})
    defenses = build_defenses([{"name": "gaussian_noise", "params": {"std": sigma}}] if sigma else [], seed=args.seed)
    t0 = time.perf_counter()
    out = run_rounds_flower(model, clients, rounds=args.rounds, algorithm="fedavg", lr=args.lr, local_epochs=1,
                            local_batch_size=args.local_batch, defenses=defenses, seed=args.seed,
                            keep_round=lambda r: r in measured, flower=cfg.fl.flower)
    train_seconds = time.perf_counter() - t0
    A = cfg.attack_cls
    always = always_public(handle, cfg)
    icfg = None
    if args.second_attack:
        _, icfg = validate({**raw, "scale": "cpu", "attack": {"name": args.second_attack}})
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    rows = []
    for k, r in enumerate(out.kept_rounds):
        state = out.round_states[k]
        with torch.no_grad():
            params = dict(model.named_parameters())
            for n in trainable:
                params[n].copy_(state[n])
            model.eval()
            correct = 0
            for a in range(0, len(test_x), 100):
                o = model(test_x[a:a + 100].to(dtype) * 2 - 1)
                correct += int(((o.logits if hasattr(o, "logits") else o).argmax(-1) == test_y[a:a + 100]).sum())
            model.train()
        acc = correct / len(test_x)
        per = []
        t1 = time.perf_counter()
        for i, u in enumerate(out.rounds[k]):
            view = build_view(model=model, rounds=[[u]], round_states=[state], threat=cfg.threat_model, secure_sum=None,
                              knowledge={}, always_public=always)
            attack = A.from_config(cfg.attack_cfg, AttackContext(seed=cfg.seed, device=torch.device("cpu"),
                                                                 threat=cfg.threat_model, fl=public_protocol(cfg),
                                                                 public={"batch_size": u.num_samples}))
            rec = attack.reconstruct(view)
            idx = parts[u.client_id]
            tr = Truth("image", imgs[idx], labels[idx] % 10)
            ev = evaluate(A.reconstruction, tr, rec, cfg, args.out / "flower_utility" / f"{_slug(arm)}_r{r}_c{i}", 0)
            per.append({"client": int(u.client_id), "images": int(len(idx)), "psnr": ev.metrics.get("psnr"),
                        "above": int(ev.metrics.get("images_above_threshold", 0))})
        ig = None
        if args.second_attack:  # the paper's kind of attack (optimisation) on the one-image client's upload
            u = out.rounds[k][0]
            view = build_view(model=model, rounds=[[u]], round_states=[state], threat=cfg.threat_model, secure_sum=None,
                              knowledge={}, always_public=always)
            g = icfg.attack_cls.from_config(icfg.attack_cfg, AttackContext(
                seed=cfg.seed, device=torch.device("cpu"), threat=icfg.threat_model, fl=public_protocol(icfg),
                public={"batch_size": 1}))
            g.prepare(model, icfg.threat_model)
            idx = parts[0]
            ev = evaluate(icfg.attack_cls.reconstruction, Truth("image", imgs[idx], labels[idx] % 10), g.reconstruct(view),
                          icfg, args.out / "flower_utility" / f"{_slug(arm)}_r{r}_{args.second_attack}", 0)
            ig = ev.metrics.get("psnr")
        row = {"cell": f"{arm}|{r}", "arm": arm, "sigma": sigma, "round": r + 1, "accuracy": acc,
               "second_attack": args.second_attack, "second_attack_psnr": ig,
               "high_risk_psnr": per[0]["psnr"], "images_reconstructed": sum(p["above"] for p in per),
               "images_total": sum(p["images"] for p in per), "per_client": per,
               "attack_seconds": time.perf_counter() - t1, "train_seconds_all_rounds": train_seconds,
               "command": f"OMP_NUM_THREADS=1 python benchmarks/flower_utility.py --out {display(args.out)}"
                          + "".join(f" --{k.replace('_', '-')} {v}" for k, v in _knobs(args).items())}
        rows.append(row)
        print(f"[{arm}] round {r + 1}: accuracy {acc:.3f}, high-risk client {per[0]['psnr']:.1f} dB, "
              f"{row['images_reconstructed']}/{row['images_total']} images ≥ 30 dB", flush=True)
    return rows


def _knobs(args) -> dict:
    return {k: getattr(args, k) for k in ("rounds", "every", "clients", "train", "test", "alpha", "lr", "local_batch",
                                          "rank", "seed", "second_attack")}


def _span(rows) -> str:
    vals = [r["second_attack_psnr"] for r in rows if r.get("second_attack_psnr") is not None]
    return f"{min(vals):.1f}–{max(vals):.1f} dB" if vals else "not run"


def _slug(s: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in s)


def report(args, jsonl: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = latest_rows(jsonl)
    if not rows:
        print("no rows yet", flush=True)
        return
    (args.out / "flower_utility.json").write_text(json.dumps(rows, indent=1))
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    for arm in ARMS:
        rs = sorted([r for r in rows if r["arm"] == arm], key=lambda r: r["round"])
        if not rs:
            continue
        x = [r["round"] for r in rs]
        ax[0].plot(x, [100 * r["accuracy"] for r in rs], marker="o", label=arm)
        line = ax[1].plot(x, [r["high_risk_psnr"] for r in rs], marker="o", label=f"{arm}: lora_span")[0]
        if any(r.get("second_attack_psnr") is not None for r in rs):
            ax[1].plot(x, [r.get("second_attack_psnr") for r in rs], marker="s", ls="--", color=line.get_color(),
                       label=f"{arm}: {rs[0].get('second_attack')}")
    ax[0].set(xlabel="round", ylabel="test accuracy (%)", title="utility (model sent that round)")
    ax[1].axhline(30, color="grey", ls=":", lw=1)
    ax[1].set(xlabel="round", ylabel="PSNR (dB)", title="attacks on the one-image client")
    ax[0].legend()
    ax[1].legend(fontsize=7)
    link = save_figure(fig, args.out / "flower_utility.png")
    k = rows[0]["command"]
    setting = __doc__.split("Setting (CPU scale, stated in the table):")[1].split("Resumable")[0].strip()
    lines = [f"Command: `{k}` (resumable). {len(rows)} measured (arm, round) cells. Setting (CPU scale): "
             + setting.replace("\n", " "), "",
             "Round r's accuracy is the model the server sent in round r (round 1: before any aggregate); the PSNR is "
             "lora_span on that round's upload of the one-image client; the last column counts every client's images "
             "reconstructed at ≥ 30 dB (the Dirichlet clients hold " + ", ".join(
                 str(p["images"]) for p in sorted(rows[0]["per_client"], key=lambda p: p["images"])[1:])
             + " images and take several local steps, where lora_span does not apply). " + REVISION_NOTE, "",
             "| arm | round | test accuracy | high-risk client: lora_span | high-risk client: "
             + (rows[0].get("second_attack") or "–") + " (cpu scale) | images ≥ 30 dB (all clients, lora_span) | paper | revision |",
             "|---|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        for r in sorted([r for r in rows if r["arm"] == arm], key=lambda r: r["round"]):
            sec = r.get("second_attack_psnr")
            lines.append(f"| {arm} | {r['round']} | {100 * r['accuracy']:.1f} % | {r['high_risk_psnr']:.1f} dB | "
                         f"{'–' if sec is None else f'{sec:.1f} dB'} | "
                         f"{r['images_reconstructed']} / {r['images_total']} | {PAPER if r['round'] == 1 and arm == 'no noise' else ''} | "
                         f"{revision_label(r)} |")
    fin = {arm: max((r for r in rows if r["arm"] == arm), key=lambda r: r["round"], default=None) for arm in ARMS}
    if all(fin.values()):
        lines += ["", f"Without noise the one-image client's image is recovered exactly in every measured round while the "
                  f"model trains ({100 * fin['no noise']['accuracy']:.1f} % at round {fin['no noise']['round']}); "
                  f"noise σ = 0.01 on the upload stops this exact attack ("
                  f"{fin['noise σ = 0.01']['high_risk_psnr']:.1f} dB) at no cost in accuracy "
                  f"({100 * fin['noise σ = 0.01']['accuracy']:.1f} %), σ = 0.1 at "
                  f"{100 * (fin['no noise']['accuracy'] - fin['noise σ = 0.1']['accuracy']):.1f} points. The paper's "
                  "optimisation attack reaches ≈ 14.6 → 12.1 dB without DP and ≈ 9–11 dB under it (its GIAS + anchor at "
                  "paper scale, CIFAR-10); ours, the second attack column at cpu scale, recovers nothing here with or "
                  "without noise (" + _span(rows) + "); PEFTLeak through Flower (one reconstruction "
                  "round, then the clients train the poisoned weights) is in the section below."]
    lines += ["", f"![privacy–utility over training]({link})"]
    write_section(args, "flower_utility", "\n".join(lines), "Flower: privacy–utility over training",
                  "flower_utility")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_out_args(ap, "flower_utility")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--clients", type=int, default=6, help="Dirichlet clients (plus the one-image client)")
    ap.add_argument("--train", type=int, default=241)
    ap.add_argument("--test", type=int, default=300)
    ap.add_argument("--alpha", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--local-batch", type=int, default=8)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arms", nargs="*", default=list(ARMS))
    ap.add_argument("--second-attack", default="ig", help="an optimisation attack also run on the one-image client's "
                    "upload (the paper's kind; '' for none)")
    args = ap.parse_args(argv)
    args.out = resolve_out(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    jsonl = args.out / "flower_utility.jsonl"
    if args.check:
        from gradleak.run.runner import validate

        validate(base_config(args))
        print("config valid", flush=True)
        return 0
    if getattr(args, "fresh", False):
        start_fresh(jsonl)
    if not args.report_only:
        from gradleak.run.cells import Cell, run_cells

        # one cell per arm, its rows (one per measured round) appended when the arm is done; an error stops the run
        rev = revision()  # every row records the code revision that wrote it
        run_cells([Cell(arm, run_arm, (args, arm, ARMS[arm])) for arm in args.arms], jsonl,
                  lambda cell, rows, err, seconds: [{**r, "revision": rev} for r in rows], key="arm", fatal=(Exception,), label="flower_utility",
                  log=lambda m: print(m, flush=True))
    report(args, jsonl)
    return 0


if __name__ == "__main__":
    sys.exit(main())
