"""Probes of the leakage study's foundations (paper 003; not the leakage benchmark itself; that is ``benchmarks/leakage.py``).

    OMP_NUM_THREADS=1 python benchmarks/probes/bn_probes.py speed B K [l2|cosine]   # iteration cost / forward+backward
    OMP_NUM_THREADS=1 python benchmarks/probes/bn_probes.py bnstats                 # K-step BN inference on ResNet-18
    OMP_NUM_THREADS=1 python benchmarks/probes/bn_probes.py negvar                  # per-tensor noise → negative BN variances
    OMP_NUM_THREADS=1 python benchmarks/probes/bn_probes.py invert ITERS VARIANT    # 1-image, 1-step client; VARIANT:
                                                                             # full | bn_only | match_only | priors_only

All on ResNet-18 (``gradleak.models.resnet``), 64×64 grey Fashion-MNIST (bilinear upsampling of 28 px), one
CPU thread, float32. The "global checkpoint" is a ResNet-18 trained briefly by plain SGD on other images of
the same split (no pretrained ResNet exists offline).
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _probe import ROOT  # noqa: E402 -- puts src/ on the path

import torch  # noqa: E402

from gradleak.attacks.bn_inversion import ObjectiveWeights, inversion_objective, measure_iteration_cost  # noqa: E402
from gradleak.attacks.common.simulation import simulate_local_training  # noqa: E402
from gradleak.attacks.common.bn_stats import (BatchStatsRecorder, combined_candidate_stats, infer_bn_targets,  # noqa: E402
                                       single_step_batch_stats)
from gradleak.models.resnet import resnet18  # noqa: E402


def fmnist64(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    from gradleak.data import load

    ds = load("fashion-mnist", split="train", n=n)
    x = torch.nn.functional.interpolate(ds.images[:, :1], size=64, mode="bilinear", align_corners=False).clamp(0, 1)
    return x, torch.as_tensor(ds.labels)


def checkpoint(x: torch.Tensor, y: torch.Tensor, n: int, batch: int, lr: float) -> torch.nn.Module:
    m = resnet18(image_size=64).train()
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    for i in range(0, n, batch):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x[i:i + batch] * 2 - 1).logits, y[i:i + batch]).backward()
        opt.step()
    return m


def speed(batch: int, steps: int, form: str = "l2") -> None:
    m = resnet18(image_size=64)
    g = torch.Generator().manual_seed(0)
    x = torch.rand(batch * steps, 1, 64, 64, generator=g) * 2 - 1
    y = torch.randint(0, 10, (batch * steps,), generator=g)
    r = measure_iteration_cost(m, x, y, steps=steps, repeats=7, matching=form)
    print(batch, steps, form, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()})


def bnstats() -> None:
    x, y = fmnist64(600)
    m = checkpoint(x, y, 512, 8, 0.01)
    old = {k: v.clone() for k, v in m.state_dict().items()}
    rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())  # noqa: E731
    for k_steps in (1, 2, 4, 8):
        c = copy.deepcopy(m)
        c.load_state_dict(old)
        rec = BatchStatsRecorder(c)
        opt = torch.optim.SGD(c.parameters(), lr=0.01)
        with rec:
            for k in range(k_steps):  # B = 1 per step
                rec.new_step()
                opt.zero_grad()
                torch.nn.functional.cross_entropy(c(x[512 + k:513 + k] * 2 - 1).logits, y[512 + k:513 + k]).backward()
                opt.step()
        new = c.state_dict()
        targets = infer_bn_targets(c, old, new)
        steps = [{n: (a.detach(), b.detach()) for n, (a, b) in s.items()} for s in rec.steps]
        comb = combined_candidate_stats(steps, {n: t.weights for n, t in targets.items()})
        ce, sm, sv = [], [], []
        for n, t in targets.items():
            ce.append(max(rel(comb[n][0], t.mean), rel(comb[n][1], t.var)))
            sm.append(rel(single_step_batch_stats(old[n + ".running_mean"], new[n + ".running_mean"], 0.1), t.mean))
            sv.append(rel(single_step_batch_stats(old[n + ".running_var"], new[n + ".running_var"], 0.1), t.var))
        med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
        print(f"K={k_steps}: combination max rel err over {len(targets)} layers {max(ce):.2e}; single-step formula "
              f"rel err mean: median {med(sm):.3f} [{min(sm):.3f}, {max(sm):.3f}], var: median {med(sv):.3f} "
              f"[{min(sv):.3f}, {max(sv):.3f}]")


def invert(iters: int, variant: str) -> None:
    from gradleak.metrics.leakage import rdlv

    x, y = fmnist64(2000)
    m = checkpoint(x, y, 1024, 16, 0.05)
    old = {k: v.clone() for k, v in m.state_dict().items()}
    secret, label = x[1500:1501], y[1500:1501]
    client = copy.deepcopy(m)
    opt = torch.optim.SGD(client.parameters(), lr=0.05)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(client(secret * 2 - 1).logits, label).backward()
    opt.step()
    observed = {n: (old[n] - client.state_dict()[n]).double() / 0.05 for n, _ in m.named_parameters()}
    targets = infer_bn_targets(m, old, client.state_dict())
    prior = x[1024:1500].mean(0)  # mean image of other images of the split
    w = {"full": ObjectiveWeights(matching=1.0, bn=0.1), "bn_only": ObjectiveWeights(matching=0.0, bn=0.1),
         "match_only": ObjectiveWeights(matching=1.0, bn=0.0), "priors_only": ObjectiveWeights(matching=0.0, bn=0.0)}[variant]
    g = torch.Generator().manual_seed(0)
    v = (prior[None] * 2 - 1 + 0.1 * torch.randn(1, 1, 64, 64, generator=g)).requires_grad_(True)
    z = torch.zeros(1, 10, requires_grad=True)
    adam = torch.optim.Adam([v, z], lr=0.05)
    t0 = time.time()
    terms = {}
    for _ in range(iters):
        adam.zero_grad()
        sim = simulate_local_training(m, v, torch.softmax(z, 1), lr=0.05)
        terms = inversion_objective(sim, observed, targets, v, w, matching="cosine")
        gv, gz = torch.autograd.grad(terms["total"], [v, z], allow_unused=True)
        v.grad, z.grad = gv, (gz if gz is not None else torch.zeros_like(z))
        adam.step()
        with torch.no_grad():
            v.clamp_(-1, 1)
    rec = ((v.detach() + 1) / 2).clamp(0, 1)
    r = rdlv(rec, secret, prior)
    print(variant, iters, f"{time.time() - t0:.0f}s", "SSIM rec", round(float(r.ssim_reconstruction[0]), 3), "prior",
          round(float(r.ssim_prior[0]), 3), "RDLV", round(r.mean, 3), "label", int(z.argmax()), "true", int(label),
          "match", round(float(terms["matching"].detach()), 4), "bn", round(float(terms["bn"].detach()), 3))


def negvar() -> None:
    """Per-tensor percentile noise on the BN buffer changes makes running variances negative (the model then
    outputs NaN: chance accuracy); the global reading does not (its p95 is set by the weights)."""
    from gradleak.defenses.update import PercentileNoise
    from gradleak.run import validate
    from gradleak.config.loading import load_yaml
    from gradleak.fl.core import Client, default_classification_loss
    from gradleak.models import build

    _, cfg = validate(load_yaml(ROOT / "configs" / "leakage" / "fmnist_resnet18.yaml"), [])
    m = build(cfg.model, "image", image_size=40, seed=0, dtype="float32", num_channels=1).model  # pretrained (cached)
    for p in m.parameters():
        p.requires_grad_(True)
    from gradleak.data import load

    ds = load("fashion-mnist")
    x = torch.nn.functional.interpolate(ds.images[:8].float(), size=40, mode="bilinear", antialias=True) * 2 - 1
    m.train()
    upd = Client(0, x, ds.labels[:8].long(), loss_fn=default_classification_loss).local_update(
        copy.deepcopy(m), algorithm="fedavg", lr=0.01, batch_size=4)
    rv = {n: b for n, b in m.named_buffers() if n.endswith("running_var")}
    for s0, per_tensor in ((1, True), (10, True), (1000, False), (5000, False)):
        u = PercentileNoise(s0, per_tensor=per_tensor, seed=0).apply(upd, {"client_id": 0, "seed": 0, "lr": 0.01})
        neg = sum(int(((rv[n] + u.buffers[n].float()) < 0).sum()) for n in rv)
        print(f"sigma0={s0} per_tensor={per_tensor}: {neg}/{sum(v.numel() for v in rv.values())} running variances "
              "negative after one noised 8-image update", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "speed":
        speed(int(args[0]), int(args[1]), *(args[2:3]))
    elif cmd == "bnstats":
        bnstats()
    elif cmd == "invert":
        invert(int(args[0]), args[1])
    elif cmd == "negvar":
        negvar()
    else:
        raise SystemExit(__doc__)
