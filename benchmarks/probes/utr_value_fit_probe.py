"""UTR's value test, a probe (not a benchmark table): how the gradient *values* grade a candidate batch.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/probes/utr_value_fit_probe.py [--batch 4] [--seed 0]

The server sent the model, so it can recompute any candidate sentence's exact contribution to the upload. For a
2-class head, ``grad CE(x, y) = (p_1 - y) grad(logit_1 - logit_0)``: whatever the label, one sentence's gradient is
a multiple of one known column, and the upload of a right batch is a least-squares combination of its B columns
(relative residual at the float32 floor). This script measures that residual for the true batch of the default
client (MiniLM rf = 2, rt-sentences), for one swap of two sentences' tokens at one position, one changed token,
one sentence shuffled -- over every uploaded tensor and over the embedding adapter alone -- and then runs a descent
over swaps (the moves that keep stage 1's exact (token, position) pairs) from 3, 10 and 30 random swaps of the
truth. Writes ``runs/utr_value_fit_probe.json``. The finding it records: the residual grades errors only weakly
(one swap 0.053, a whole sentence shuffled 0.079) and the descent stalls on wrong batches below a single
swap's residual, so a local search on these values alone does not take stage 2 past the first-layer limit.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _probe import ROOT  # noqa: E402 -- puts src/ on the path

import torch  # noqa: E402
from torch import nn  # noqa: E402

from _probe import minilm_rt_update  # noqa: E402
from gradleak.run.results import write_json_atomic  # noqa: E402


class GradientValueFit:
    """Least-squares fit of an uploaded gradient by per-sentence columns (bidirectional classifiers).

    ``model``: the model the server sent (its trainable parameters are the uploaded tensors' names);
    ``tensors``: the upload (name -> tensor); ``names``: the tensors fitted (default: every uploaded one)."""

    def __init__(self, model: nn.Module, tensors: dict[str, torch.Tensor], names: list[str] | None = None,
                 num_labels: int | None = None):
        params = dict(model.named_parameters())
        self.names = [n for n in (names or list(tensors)) if n in params]
        if not self.names:
            raise ValueError("no uploaded tensor is a parameter of the model")
        self.model, self.params = model, [params[n] for n in self.names]
        self.g = torch.cat([tensors[n].detach().reshape(-1).to(torch.float64) for n in self.names])
        self.gn = float(self.g.norm())
        self.num_labels = int(num_labels or getattr(getattr(model, "config", None), "num_labels", 2) or 2)
        self.cache: dict[tuple[int, ...], torch.Tensor] = {}
        self.evaluations = 0

    def columns(self, chain: list[int] | tuple[int, ...]) -> torch.Tensor:
        """(D, C - 1) float32: the directions one sentence's gradient can take, whatever its label."""
        key = tuple(int(t) for t in chain)
        col = self.cache.get(key)
        if col is not None:
            return col
        ids = torch.tensor([key])
        with torch.enable_grad():
            logits = self.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0]
            outs = []
            C = self.num_labels
            for c in range(1, C):
                target = logits[c] - logits[0]
                gs = torch.autograd.grad(target, self.params, retain_graph=c < C - 1, allow_unused=True)
                outs.append(torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1)
                                       for g, p in zip(gs, self.params)]).detach().float())
        self.evaluations += 1
        col = torch.stack(outs, 1)
        if len(self.cache) > 256:  # columns are D floats each: keep the cache bounded
            self.cache.pop(next(iter(self.cache)))
        self.cache[key] = col
        return col

    def residual(self, chains: list[list[int]], cols: list[torch.Tensor] | None = None) -> float:
        """Relative residual of the least-squares fit of the upload by the chains' columns."""
        V = torch.cat(cols if cols is not None else [self.columns(c) for c in chains], 1).to(torch.float64)
        gram = V.T @ V
        rhs = V.T @ self.g
        try:
            coef = torch.linalg.solve(gram + 1e-30 * torch.eye(len(gram), dtype=gram.dtype), rhs)
        except RuntimeError:
            coef = torch.linalg.lstsq(V, self.g[:, None]).solution[:, 0]
        return float((self.g - V @ coef).norm()) / max(self.gn, 1e-300)

    def refine(self, chains: list[list[int]], tol: float = 1e-4, time_budget: float = 120.0,
               frozen: set[int] | None = None, progress: Callable[[int, float], Any] | None = None
               ) -> tuple[list[list[int]], dict[str, Any]]:
        """Descent on the residual by swapping two chains' tokens at one position ([CLS] and each chain's
        [SEP] stay). Returns the chains and ``{"fit_residual", "fit_sweeps", "fit_swaps", "fit_verified"}``."""
        t0 = time.perf_counter()
        chains = [list(c) for c in chains]
        frozen = frozen or set()
        cols = [self.columns(c) for c in chains]
        best = self.residual(chains, cols)
        swaps = sweeps = 0
        maxlen = max(len(c) for c in chains)
        while best >= tol and time.perf_counter() - t0 < time_budget:
            sweeps += 1
            improved = False
            for p in range(1, maxlen - 1):
                live = [i for i, c in enumerate(chains) if p < len(c) - 1 and i not in frozen]
                cand = None
                for ai, a in enumerate(live):
                    for b in live[ai + 1:]:
                        if chains[a][p] == chains[b][p]:
                            continue
                        ca, cb = list(chains[a]), list(chains[b])
                        ca[p], cb[p] = cb[p], ca[p]
                        trial = list(cols)
                        trial[a], trial[b] = self.columns(ca), self.columns(cb)
                        r = self.residual(chains, trial)
                        if r < best * (1 - 1e-9) and (cand is None or r < cand[0]):
                            cand = (r, a, b, ca, cb, trial)
                    if time.perf_counter() - t0 > time_budget:
                        break
                if cand is not None:
                    best, a, b, ca, cb, cols = cand
                    chains[a], chains[b] = ca, cb
                    swaps += 1
                    improved = True
                    if best < tol:
                        break
                if time.perf_counter() - t0 > time_budget:
                    break
            if progress is not None:
                progress(sweeps, best)
            if not improved:
                break
        return chains, {"fit_residual": best, "fit_sweeps": sweeps, "fit_swaps": swaps, "fit_verified": best < tol,
                        "fit_evaluations": self.evaluations, "fit_seconds": time.perf_counter() - t0,
                        "fit_truncated": best >= tol and time.perf_counter() - t0 >= time_budget}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "utr_value_fit_probe.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    B = args.batch
    tm, _, upd, truth = minilm_rt_update(B, 2, args.seed)
    swap = [list(t) for t in truth]
    swap[0][3], swap[1][3] = swap[1][3], swap[0][3]
    one = [list(t) for t in truth]
    one[0][3] = one[0][4]
    shuf = [list(t) for t in truth]
    shuf[0] = [shuf[0][0]] + random.Random(0).sample(shuf[0][1:-1], len(shuf[0]) - 2) + [shuf[0][-1]]
    res: dict[str, Any] = {"batch": B, "seed": args.seed, "residuals": {}, "descent": []}
    for label, names in (("all uploaded tensors", None), ("embedding adapter", [n for n in upd.tensors if "embedding" in n])):
        fit = GradientValueFit(tm.model, upd.tensors, names=names)
        row = {k: fit.residual(v) for k, v in (("truth", truth), ("one swap", swap), ("one token changed", one),
                                              ("one sentence shuffled", shuf))}
        res["residuals"][label] = row
        print(label + ": " + ", ".join(f"{k} {v:.3g}" for k, v in row.items()), flush=True)
    rnd = random.Random(1)
    exact = lambda chs: sum(tuple(c) in {tuple(t) for t in truth} for c in chs)  # noqa: E731
    for n in (3, 10, 30):
        ch = [list(t) for t in truth]
        for _ in range(n):
            a, b = rnd.sample(range(B), 2)
            p = rnd.randrange(1, min(len(ch[a]), len(ch[b])) - 1)
            ch[a][p], ch[b][p] = ch[b][p], ch[a][p]
        out, info = GradientValueFit(tm.model, upd.tensors).refine(ch, time_budget=300)
        row = {"random_swaps": n, "exact_before": exact(ch), "exact_after": exact(out), **info}
        res["descent"].append(row)
        print(f"descent from {n} random swaps: exact sentences {row['exact_before']} -> {row['exact_after']} of {B}, "
              f"residual {info['fit_residual']:.3g} after {info['fit_swaps']} swaps ({info['fit_seconds']:.0f} s)",
              flush=True)
    write_json_atomic(args.out, res)
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
