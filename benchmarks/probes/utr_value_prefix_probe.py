"""UTR's value test, a probe (not a benchmark table): can the value test grade *incomplete* sentences?

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/probes/utr_value_prefix_probe.py [--batch 16] [--rf 1] [--seed 0]

The value test (``gradleak.attacks.utr_values``) checks a complete candidate sentence: a once-occurring token's
observed bottleneck signal against the one the candidate's forward/backward gives. A left-to-right construction
would need it on prefixes, with the unknown right part filled by [MASK]. For every batch sentence and every
position q holding a tested token, this measures the residual at q for the true prefix (positions > q masked, the
true length kept) and for the same prefix with the previous token replaced by another sentence's token there.
Writes ``runs/utr_value_prefix_probe.json``. Finding (MiniLM rf = 1 B = 16 seed 0): median 0.60 for true prefixes
against 0.70 with one wrong previous token -- the masked suffix moves the signal as much as a wrong token does, so
the test needs complete sentences and cannot drive a construction.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _probe import ROOT  # noqa: E402 -- puts src/ on the path

import torch  # noqa: E402

from _probe import minilm_rt_update  # noqa: E402
from gradleak.attacks.common.text import collect_grads  # noqa: E402
from gradleak.attacks.utr import UTRAttack  # noqa: E402
from gradleak.attacks.utr.values import TokenGradientTest  # noqa: E402
from gradleak.run.results import write_json_atomic  # noqa: E402
from gradleak.fl.core import ServerView  # noqa: E402
from gradleak.peft.text_adapters import adapter_param  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rf", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "utr_value_prefix_probe.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    B = args.batch
    tm, _, upd, truth = minilm_rt_update(B, args.rf, args.seed)
    view = ServerView(tm.model, [upd], public={"tokenizer": tm.tokenizer, "batch_size": B})
    bag = UTRAttack().word_bag(view)
    vt = TokenGradientTest(tm.model, collect_grads(view, adapter_param("embedding"))[0], bag["pairs"])
    mask = tm.tokenizer.mask_token_id
    blocked = vt.held_by_others(truth)

    def at(sent, s, q):
        prof: list = []
        vt.score([sent], [blocked[s]], profile=prof)
        return dict(prof[0]).get(q)

    true_r, wrong_r = [], []
    for s, t in enumerate(truth):
        for q in range(2, len(t) - 1):
            if (t[q], q) not in vt.obs or (t[q], q) in blocked[s]:
                continue
            pre = t[:q + 1] + [mask] * (len(t) - q - 2) + [t[-1]]
            r = at(pre, s, q)
            if r is None:
                continue
            true_r.append(r)
            other = next((truth[o][q - 1] for o in range(B)
                          if o != s and len(truth[o]) > q and truth[o][q - 1] != t[q - 1]), None)
            if other is not None:
                w = list(pre)
                w[q - 1] = other
                r2 = at(w, s, q)
                if r2 is not None:
                    wrong_r.append(r2)
    res = {"batch": B, "rf": args.rf, "seed": args.seed, "layer_states": sum(len(t) for t in truth),
           "true_prefix": {"n": len(true_r), "median": statistics.median(true_r), "max": max(true_r)},
           "wrong_previous_token": {"n": len(wrong_r), "median": statistics.median(wrong_r), "min": min(wrong_r)}}
    print(f"true prefix + [MASK] suffix: median {res['true_prefix']['median']:.3f} (n {len(true_r)}); "
          f"one wrong previous token: median {res['wrong_previous_token']['median']:.3f} (n {len(wrong_r)})")
    write_json_atomic(args.out, res)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
