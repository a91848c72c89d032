"""A probe (not a benchmark table): exact per-pair signals from the embedding adapter's up AND down gradients.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/probes/utr_pair_probe.py [--batch 16] [--rf 1] [--seed 0]

Stage 1 places tokens by a support test, which cannot place a token that occurs many times: [SEP] occurs once per
sentence, so the union of its masks covers almost every neuron and it passes at most positions (MiniLM rf = 1
B = 16 seed 0: 22 [SEP] positions read for 14 true lengths, 61 false pairs in all). The stage-2 length logic then
starts from wrong lengths. The upload holds more than the down-projection gradient the support test reads:

* up-projection: G_up = sum_l delta_l h_l^T (+ bias sum_l delta_l), where h_l = ReLU(W_down f_l + b) is known for
  every candidate pair l (f_l = the frozen embedding output of (token, position)). So Delta = Delta0 + N C, with
  N the null space of [H, 1]^T: n - rank unknown directions per hidden coordinate, n the candidate pairs;
* down-projection: G_down = sum_l (D_l W_up^T delta_l) f_l^T (+ bias), with D_l the pair's known ReLU mask. For
  neuron j only the pairs active there enter, and u_lj = (W_up^T delta_l)_j = (Delta0 W_up)_lj + (N c_j)_l,
  c_j = C W_up[:, j]: one small least-squares problem per neuron (d + 1 equations, n - rank unknowns), valid
  at any reduction factor.

The solve now runs in stage 1 (``gradleak.attacks.utr_pairs.refine_pairs``); this probe starts from the support
test's pairs (``word_bag(...)["support_pairs"]``) and reports the norms of true and false pairs, [SEP] per read
position, and the match with the value test's coefficient route for once-placed tokens
(``gradleak.attacks.utr_values``). Writes ``runs/utr_pair_probe.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _probe import ROOT  # noqa: E402 -- puts src/ on the path

import torch  # noqa: E402

from _probe import minilm_rt_update  # noqa: E402
from gradleak.attacks.common.text import collect_grads  # noqa: E402
from gradleak.attacks.utr import UTRAttack  # noqa: E402
from gradleak.attacks.common.pair_signals import refine_pairs  # noqa: E402
from gradleak.attacks.utr.values import TokenGradientTest  # noqa: E402
from gradleak.run.results import write_json_atomic  # noqa: E402
from gradleak.fl.core import ServerView  # noqa: E402
from gradleak.peft.text_adapters import PREFIX, adapter_param  # noqa: E402

f64 = torch.float64


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rf", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--drop", type=float, default=0.05, help="drop pairs below this x the median norm, re-solve")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "utr_pair_probe.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    tm, _, upd, truth = minilm_rt_update(args.batch, args.rf, args.seed)
    view = ServerView(tm.model, [upd], public={"tokenizer": tm.tokenizer, "batch_size": args.batch})
    bag = UTRAttack().word_bag(view)
    pairs = bag["support_pairs"] or bag["pairs"]  # the support test's pairs, before the exact solve cleans them
    true_pairs: dict[int, set[int]] = {}
    for t in truth:
        for p, v in enumerate(t):
            true_pairs.setdefault(v, set()).add(p)
    t0 = time.perf_counter()
    emb = tm.model.base_model.embeddings
    ad = getattr(tm.model, PREFIX)["embedding"]
    L = [(v, p) for v in sorted(pairs) for p in sorted(pairs[v])]
    true = torch.tensor([p in true_pairs.get(v, ()) for v, p in L])
    parts = ("down.weight", "down.bias", "up.weight", "up.bias")
    grads = {k: upd.tensors[adapter_param("embedding", k)] for k in parts}
    out = refine_pairs(emb, ad, grads, pairs, drops=(args.drop,))
    if out is None:
        print("the up + down equations do not fit the support test's pairs (a true pair missed)")
        return 1
    _, signals, info = out
    U = torch.stack([signals.get(k, torch.zeros(ad.down.weight.shape[0], dtype=f64)) for k in L])
    nrm = U.norm(dim=1)
    rel = nrm / nrm.max()
    rounds = info["rounds"]
    for r in rounds:
        print(f"pairs {r['pairs']}, null dim {r['null_dim']}, underdetermined neurons "
              f"{r['neurons_underdetermined']}, fit residual (median) {r['fit_median']:.1e}")
    kept = nrm > 0
    print(f"kept {int(kept.sum())} pairs, true {int((kept & true).sum())} of {int(true.sum())}, false "
          f"{int((kept & ~true).sum())}")
    secs = time.perf_counter() - t0
    vt = TokenGradientTest(tm.model, collect_grads(view, adapter_param("embedding"))[0], true_pairs)
    diffs = [float((U[i] - vt.obs[k]).norm() / vt.obs[k].norm()) for i, k in enumerate(L) if k in vt.obs]
    sep = tm.tokenizer.sep_token_id
    seps = [{"position": p, "norm": float(rel[i]), "true": bool(true[i])} for i, (v, p) in enumerate(L) if v == sep]
    sep_true = [s["norm"] for s in seps if s["true"]]
    sep_false = [s["norm"] for s in seps if not s["true"]]
    print(f"[SEP]: {len(sep_true)} true positions, norm >= {min(sep_true):.2e}; {len(sep_false)} false, norm <= "
          f"{max(sep_false, default=0):.2e}")
    print(f"once-placed tokens: {len(diffs)} pairs, max relative difference to the value test's signals "
          f"{max(diffs, default=float('nan')):.1e}; {secs:.1f} s")
    res = {"batch": args.batch, "rf": args.rf, "seed": args.seed, "layer_states": sum(len(t) for t in truth),
           "pairs_read": len(L), "true_pairs": int(true.sum()), "rounds": rounds, "sep": seps,
           "value_test_pairs": len(diffs), "value_test_max_diff": max(diffs, default=None), "seconds": secs}
    write_json_atomic(args.out, res)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
