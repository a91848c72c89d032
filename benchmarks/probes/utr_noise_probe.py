"""Where the UTR signal stands against update noise (a probe, not a benchmark table).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/probes/utr_noise_probe.py [--batch 2] [--seed 0] [--rf 2]

The default config's client (``configs/utr/minilm_rt.yaml``: MiniLM, 2 layers, adapters with reduction factor
``--rf``, a batch of ``--batch`` rt-sentences drawn with ``--seed``) computes its FedSGD update. That update goes
through ``dp_gaussian`` (clip to C = 1.0, then N(0, (σC)²) on every coordinate, UTR Table 3) and through
``gaussian_noise`` with ``std = σ·‖update‖/√P`` (a per-coordinate noise-to-signal ratio σ; P = the update's
coordinates). For each σ the script prints the singular values of the embedding adapter's down-projection gradient,
which is the matrix whose row space the word bag reads. It compares them with the edge of the noise spectrum,
σ_coord·(√m + √n) for an m × n matrix of i.i.d. noise (Marchenko–Pastur / Bai–Yin): a direction below the edge
cannot be told from noise by any test of that matrix. Then, for global top-k pruning of the upload, how many of
that matrix's entries survive against the degrees of freedom of its row space. Writes ``runs/utr_noise_probe.json``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _probe import ROOT  # noqa: E402 -- puts src/ on the path

import torch  # noqa: E402

from _probe import minilm_rt_update  # noqa: E402
from gradleak.defenses import build_defenses  # noqa: E402
from gradleak.run.results import write_json_atomic  # noqa: E402

PARAM = "text_adapters.embedding.down.weight"
SIGMAS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rf", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "utr_noise_probe.json")
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    # (RT labels are 0/1: the helper's `% 2` leaves them as they are)
    tm, enc, upd, _ = minilm_rt_update(args.batch, args.rf, args.seed)
    P = sum(t.numel() for t in upd.tensors.values())
    clean = torch.linalg.svdvals(upd.tensors[PARAM].double())
    states = int(enc["attention_mask"].sum())
    res = {"batch": args.batch, "seed": args.seed, "rf": args.rf, "layer_states": states, "update_norm": upd.norm(),
           "update_coordinates": P, "matrix": PARAM, "shape": list(upd.tensors[PARAM].shape),
           "clean_top": float(clean[0]), "clean_at_states": float(clean[min(states, len(clean)) - 1]), "rows": []}
    m, n = res["shape"]
    print(f"{states} layer states, update norm {upd.norm():.3g} (clip 1.0 never binds below 1), {P:,} coordinates; "
          f"{PARAM} {m}×{n}: clean singular values {float(clean[0]):.3g} (top) … {res['clean_at_states']:.3g} "
          f"(index {states - 1})", flush=True)
    for kind in ("dp_gaussian", "relative"):
        for s in SIGMAS:
            spec = ({"name": "dp_gaussian", "params": {"noise_multiplier": s, "max_norm": 1.0}} if kind == "dp_gaussian"
                    else {"name": "gaussian_noise", "params": {"std": s * upd.norm() / math.sqrt(P)}})
            std = s * 1.0 if kind == "dp_gaussian" else s * upd.norm() / math.sqrt(P)
            noisy = build_defenses([spec], seed=args.seed)[0].apply(upd, {"client_id": 0, "seed": 0})
            sv = torch.linalg.svdvals(noisy.tensors[PARAM].double())
            edge = std * (math.sqrt(m) + math.sqrt(n))
            above = int((sv > edge).sum())
            row = {"noise": kind, "sigma": s, "coordinate_std": std, "edge": edge,
                   "clean_top_over_edge": float(clean[0]) / edge, "noisy_values_above_edge": above,
                   "noisy_top": float(sv[0])}
            res["rows"].append(row)
            print(f"{kind:12s} σ = {s:.0e}: coordinate std {std:.3g}, noise edge {edge:.3g}, clean top / edge "
                  f"{row['clean_top_over_edge']:.3g}, noisy values above the edge {above}", flush=True)
    # pruning: global top-k over the whole upload -- what is left of the word bag's matrix
    res["pruning"] = []
    r = min(states, m, n)
    for frac in (0.9, 0.99, 0.999):
        pr = build_defenses([{"name": "topk_pruning", "params": {"prune_fraction": frac}}])[0].apply(upd, {})
        M = pr.tensors[PARAM] != 0
        row = {"prune_fraction": frac, "kept_entries": int(M.sum()), "entries": M.numel(),
               "rows_with_any": int((M.sum(1) > 0).sum()),
               "energy_kept": float(pr.tensors[PARAM].double().norm() ** 2 / upd.tensors[PARAM].double().norm() ** 2),
               "row_space_degrees_of_freedom": r * (m + n - r)}
        res["pruning"].append(row)
        print(f"topk_pruning {frac}: {row['kept_entries']} of {row['entries']} entries of {PARAM} kept "
              f"({row['rows_with_any']} rows touched, {row['energy_kept']:.3g} of its energy) against "
              f"{row['row_space_degrees_of_freedom']:,} degrees of freedom of a rank-{r} row space", flush=True)
    write_json_atomic(args.out, res)
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
