"""A probe (not a benchmark table): why a causal LM past its first-layer bottleneck stays out of reach.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/probes/utr_causal_probe.py [--batch 32] [--rf 1] [--seed 0]

SmolLM2 (2 layers, RoPE) at rf = 1, B = 32: 767 distinct prefixes (layer states) against 576 bottleneck rows. The
causal prefix search needs a test that a *prefix* passes; this probe measures the three reads of the upload that
could give one, on the pipeline's batch (``_probe.text_rt_update``):

1. **Row space of the first layer adapter (layer_0).** Numerical rank of the upload against the states, and how
   a true next token ranks among every bag token by its state's residual against the top-k right singular
   vectors (the ``soft_rank`` grading that works on BERT).
2. **Embedding adapter values.** Under RoPE its input is the token embedding alone, so its up-projection gradient
   gives every bag token's exact summed output gradient g_v (a least-squares fit, reported). For a token used once
   in the batch that is one position's gradient -- but it sums the losses of *all later positions*: the probe cuts
   the sentence k tokens after the position and reports how much g changes. A prefix cannot be tested on it.
3. **The last adapter (layer_1) is local.** After the last layer only the position's own loss reads its output,
   so its up/down gradients are a sum of terms that each depend on one (prefix, next token) transition and are
   computable by the server (the fit of that model to the upload is reported). A level-by-level search would
   test a transition by its least-squares coefficient on the residual (1 if isolated): reported for the true
   transition at several levels, against the 5-95 % range of the false ones.

Writes ``runs/utr_causal_probe.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _probe import ROOT  # noqa: E402 -- puts src/ on the path

import torch  # noqa: E402

from _probe import text_rt_update  # noqa: E402
from gradleak.attacks.common.prefix_search import CausalPrefixSearch  # noqa: E402
from gradleak.attacks.common.subspace import subspace_from_gradients  # noqa: E402
from gradleak.run.results import write_json_atomic  # noqa: E402
from gradleak.peft.text_adapters import PREFIX, capture_inputs  # noqa: E402

f64 = torch.float64
q = torch.tensor([0.05, 0.5, 0.95], dtype=f64)


def adapter_states(model, truth, name):
    """{prefix: input state of adapter ``name`` at the prefix's last position} for every prefix with a target."""
    out = {}
    with torch.no_grad():
        for t in truth:
            cap = capture_inputs(model, [name], stop=True)
            with cap:
                model.model(input_ids=torch.tensor([t]))
            h = cap.records[-1][-1][0].to(f64)
            for i in range(len(t) - 1):
                out[tuple(t[:i + 1])] = h[i]
    return out


def row_space(tm, upd, truth, bag, n_items, rng):
    G = upd["text_adapters.layer_0.down.weight"]
    sub = subspace_from_gradients([G], 1e-5)
    Vh = torch.linalg.svd(G.to(f64), full_matrices=False).Vh
    cands = torch.tensor(bag)
    search = CausalPrefixSearch(tm.model, ["layer_0"], sub, 1e-3, truth[0][0], cands)
    items = list(dict.fromkeys((tuple(t[:i]), t[i]) for t in truth for i in range(1, len(t) - 1)))
    rng.shuffle(items)
    ks = sorted({sub.rank, int(0.96 * sub.rank), int(0.8 * sub.rank), int(0.5 * sub.rank)})
    ranks = {k: [] for k in ks}
    for prefix, nxt in items[:n_items]:
        h = search._newest_states([list(prefix)], cands)[0].to(f64)
        h = h / h.norm(dim=1, keepdim=True)
        ti = bag.index(nxt)
        for k in ks:
            V = Vh[:k].T
            r = (h - (h @ V) @ V.T).norm(dim=1)
            ranks[k].append(int((r < r[ti]).sum()))
    return {"numerical_rank": sub.rank, "rows": sub.rows, "soft_test": {
        str(k): {"median_rank_of_true": float(torch.tensor(v, dtype=f64).median()),
                 "top1": sum(x == 0 for x in v) / len(v), "top5": sum(x < 5 for x in v) / len(v),
                 "candidates": len(bag), "items": len(v)} for k, v in ranks.items()}}


def embedding_values(tm, upd, truth, bag):
    ad = getattr(tm.model, PREFIX)["embedding"]
    E = tm.model.get_input_embeddings().weight.detach().to(f64)[bag]
    A = torch.relu(E @ ad.down.weight.detach().to(f64).T + ad.down.bias.detach().to(f64))
    Gup = upd["text_adapters.embedding.up.weight"].to(f64)
    Gv = torch.linalg.lstsq(A.T, Gup.T).solution.T
    fit = float((Gv @ A - Gup).norm() / Gup.norm())

    def grads(ids):
        rec = []

        def hook(m, i, o):
            o.retain_grad()
            rec.append(o)

        h = ad.register_forward_hook(hook)
        try:
            x = torch.tensor([ids])
            (tm.model(input_ids=x, labels=x).loss * (len(ids) - 1)).backward()
        finally:
            h.remove()
        return rec[0].grad[0].to(f64)

    t = max(truth, key=len)
    full = grads(t)
    cuts = {}
    for k in (1, 4, 16):
        diffs = []
        for pos in range(1, len(t) - k - 1, 3):
            g = grads(t[:pos + k + 1])
            diffs.append(float((g[pos] - full[pos]).norm() / full[pos].norm()))
        cuts[str(k)] = torch.tensor(diffs, dtype=f64).quantile(q).tolist()
    return {"token_signal_fit": fit, "sentence_length": len(t),
            "relative_change_when_cut_k_tokens_after_the_position_q05_q50_q95": cuts}


def last_adapter(tm, upd, truth, bag, levels):
    model = tm.model
    ad = getattr(model, PREFIX)["layer_1"]
    norm, Wh = model.model.norm, model.lm_head.weight.detach().to(f64)
    gam, eps = norm.weight.detach().to(f64), norm.variance_epsilon
    Wd, bd, Wu, bu = (p.detach().to(f64) for p in (ad.down.weight, ad.down.bias, ad.up.weight, ad.up.bias))
    n_targets = sum(len(t) - 1 for t in truth)
    succ = collections.defaultdict(list)
    for t in truth:
        for i in range(len(t) - 1):
            succ[tuple(t[:i + 1])].append(t[i + 1])
    states = adapter_states(model, truth, "layer_1")
    keys = list(states)
    H = torch.stack([states[k] for k in keys])
    A = torch.relu(H @ Wd.T + bd)
    O = H + A @ Wu.T + bu

    def jt(o, v):  # RMSNorm Jacobian^T (d,) x (k, d)
        rms = torch.sqrt((o ** 2).mean() + eps)
        gv = v * gam
        return gv / rms - o[None] * (gv @ o)[:, None] / (o.numel() * rms ** 3)

    def out_grads(i, targets):  # (len(targets), d): the adapter-output gradient of each candidate transition
        o = O[i]
        rms = torch.sqrt((o ** 2).mean() + eps)
        s = torch.softmax(Wh @ (gam * o / rms), -1)
        return (jt(o, (s @ Wh)[None]) - jt(o, Wh[targets])) / n_targets

    Gt = torch.stack([out_grads(i, succ[k]).sum(0) for i, k in enumerate(keys)])
    D = (A > 0).to(f64) * (Gt @ Wu)
    obs_u = upd["text_adapters.layer_1.up.weight"].to(f64)
    obs_d = upd["text_adapters.layer_1.down.weight"].to(f64)
    fit_u = float((Gt.T @ A - obs_u).norm() / obs_u.norm())
    fit_d = float((D.T @ H - obs_d).norm() / obs_d.norm())
    per_level = {}
    for lev in levels:
        F = [i for i, k in enumerate(keys) if len(k) == lev and len(succ[k]) == 1]
        past = [i for i, k in enumerate(keys) if len(k) < lev]
        if not F:
            continue
        Ru = obs_u - (Gt[past].T @ A[past] if past else 0)
        Rd = obs_d - (D[past].T @ H[past] if past else 0)
        true_b, false_b = [], []
        for i in F:
            g = out_grads(i, bag)
            a, h = A[i], H[i]
            dl = (a > 0).to(f64)[None] * (g @ Wu)
            beta = ((g @ (Ru @ a)) + (dl @ (Rd @ h))) / ((g * g).sum(1) * (a @ a) + (dl * dl).sum(1) * (h @ h))
            ti = bag.index(succ[keys[i]][0])
            true_b.append(float(beta[ti]))
            false_b.extend(beta[torch.arange(len(bag)) != ti].tolist())
        per_level[str(lev)] = {"prefixes": len(F), "true_coefficient_q05_q50_q95": torch.tensor(
            true_b, dtype=f64).quantile(q).tolist(), "false_coefficient_q05_q50_q95": torch.tensor(
            false_b, dtype=f64).quantile(q).tolist()}
    return {"local_model_fit_up": fit_u, "local_model_fit_down": fit_d, "isolation_by_level": per_level}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rf", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--items", type=int, default=60, help="random (prefix, next token) pairs for the soft test")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "utr_causal_probe.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    tm, _, update, truth = text_rt_update("smollm2", args.batch, args.rf, args.seed)
    upd = update.tensors
    bag = sorted({v for t in truth for v in t})
    prefixes = {tuple(t[:i + 1]) for t in truth for i in range(len(t) - 1)}
    res = {"batch": args.batch, "rf": args.rf, "seed": args.seed, "layer_states": len(prefixes),
           "bag_tokens": len(bag), "bottleneck": tm.hidden_size // args.rf}
    print(f"SmolLM2 rf={args.rf} B={args.batch} seed={args.seed}: {len(prefixes)} layer states, "
          f"{res['bottleneck']} bottleneck rows, {len(bag)} bag tokens", flush=True)
    res["row_space"] = row_space(tm, upd, truth, bag, args.items, random.Random(args.seed))
    print("1. layer_0 row space:", res["row_space"], flush=True)
    res["embedding_values"] = embedding_values(tm, upd, truth, bag)
    print("2. embedding adapter values:", res["embedding_values"], flush=True)
    res["last_adapter"] = last_adapter(tm, upd, truth, bag, (2, 5, 10, 20, 30))
    print("3. layer_1 (local):", res["last_adapter"], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out, res)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
