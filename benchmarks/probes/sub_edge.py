"""Probe (DESIGN §6): UTR's sub-edge word-bag test on the text audit's upload under top-k pruning and DP-SGD
below the noise edge, each cell graded against its null.

Cells: ``configs/audit/text_adapters.yaml`` (MiniLM, 2 layers, adapters rf = 2, fortunes-topics, B = 2), UTR as
configured (extended search, sparsity-aware word bag, the sub-edge test on), ``seed`` and ``data.seed`` set together
(0: tuned, 11: held out -- no tuned run draws its sentences): top-k pruning r in {90, 95, 99} %, global and per
tensor; DP-SGD sigma in {1e-4 (a reference: its spectrum has directions above the edge), 1e-3, 3e-3, 1e-2} (C = 1:
per-coordinate noise sigma C / B on the upload).

Per cell, beside the run's own level (the evaluation's: word-bag recall against random public bags of the same
size, ROUGE against random public sentences):

* the test's truth-free numbers (``sub_edge_*`` metrics: the strongest token's log10 p-value against the chi-square
  law of the noise alone, how many tokens pass the Bonferroni cut, the bag's size);
* the **enrichment**: the batch's distinct tokens T among the attack's top-|T| tokens (``sub_edge_top``: the
  pursuit's tokens in the order taken, then the others by energy), over chance
  (hits / |T|) / (|T| / V), and its **null**: the same count for the tokens of B random public sentences (sentences
  no client holds: the evaluation's null pool) through the same ranking, 1000 draws; p-value and 99th percentile;
* a computed label: ``leaks`` (the run's level >= partial), ``information present, missed`` (enrichment beyond the
  null's p99 with p < 0.01 while the level is none), ``information absent at this test's power`` (neither),
  ``undetermined`` (no ranking: a top-k pruning that removed the embedding adapter's matrix leaves no noise level).

The null is stringent on purpose: random public sentences share the batch's common tokens (".", "the", ","), so
an energy ranking that only favours common tokens is at chance; the enrichment must be specific to the batch. Under
top-k pruning the noise level is the pruning error's estimate and the chi-square law is approximate: there the
ranking is graded by this null alone (UTR reports no ``subedge_p_value``).

``python benchmarks/probes/sub_edge.py --out benchmarks/out`` (about 15-25 s a cell on 2 shared cores; resumable:
cells already in ``<out>/sub_edge_probe.jsonl`` are skipped; ``--seeds 0`` for the tuned seed alone).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _bench import revision  # noqa: E402

REV = revision()  # the code revision every row records (benchmarks/_bench.revision: +dirty when src/ differs)

TEXT = ROOT / "configs/audit/text_adapters.yaml"
SEEDS = {0: "tuned", 11: "held out"}
PRUNE = (0.9, 0.95, 0.99)
SIGMAS = (1e-4, 1e-3, 3e-3, 1e-2)
DRAWS = 1000


def cells(seeds):
    for seed in seeds:
        for r in PRUNE:
            for scope in ("global", "per_tensor"):
                yield (f"topk{r:g}-{scope}|seed{seed}", seed, f"top-k {100 * r:g} % {scope}",
                       {"defenses": [{"name": "topk_pruning", "params": {"prune_fraction": r,
                                                                          "per_tensor": scope == "per_tensor"}}]})
        for s in SIGMAS:
            yield (f"dpsgd{s:g}|seed{seed}", seed, f"DP-SGD sigma {s:g}, C 1",
                   {"defense": {"name": "dpsgd", "noise_multiplier": s, "max_grad_norm": 1.0}})


def enrichment_null(top: list[int], true: set[int], pool_sets: list[set[int]], B: int, V: int, seed: int):
    """Enrichment of ``true`` among the top-|true| of ``top`` and its null over random public token sets (the
    tokens of B random pool sentences), ``DRAWS`` draws."""
    def enr(tokens: set[int]) -> float:
        k = len(tokens)
        if not k:
            return float("nan")
        hits = len(set(top[:k]) & tokens)
        return (hits / k) / (k / V)

    rng = np.random.default_rng(seed)
    null = []
    for _ in range(DRAWS):
        pick = rng.choice(len(pool_sets), size=B, replace=False)
        null.append(enr(set().union(*(pool_sets[i] for i in pick))))
    null = np.array([x for x in null if np.isfinite(x)])
    value = enr(true)
    k = len(true)
    return {"enrichment": value, "enrichment_hits": len(set(top[:k]) & true), "enrichment_k": k,
            "enrichment_null_median": float(np.median(null)), "enrichment_null_p99": float(np.quantile(null, 0.99)),
            "enrichment_p_value": float((1 + (null >= value).sum()) / (1 + len(null)))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "probe_sub_edge")
    ap.add_argument("--seeds", type=int, nargs="*", default=list(SEEDS))
    args = ap.parse_args()
    from gradleak.config.loading import load_yaml
    from gradleak.data.splits import TextData
    from gradleak.evaluation.base import unit
    from gradleak.run.runner import run_config, validate

    out = args.out if args.out.is_absolute() else Path.cwd() / args.out
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "sub_edge_probe.jsonl"
    done = {json.loads(line)["cell"] for line in jsonl.read_text().splitlines()} if jsonl.exists() else set()
    tok = None
    for cid, seed, label, extra in cells(args.seeds):
        if cid in done:
            continue
        raw = load_yaml(TEXT)
        raw.pop("audit", None)
        raw.update({"seed": seed, "attack": {"name": "utr"}, "defenses": [], **extra})
        raw["data"]["seed"] = seed
        t0 = time.perf_counter()
        res = run_config(raw, ROOT / "runs" / "probe_sub_edge" / cid.replace("|", "_"))
        wall = time.perf_counter() - t0
        _, cfg = validate(raw)
        data = TextData(cfg)
        if tok is None:
            from gradleak.models.text import load_text_model

            tok = load_text_model(cfg.model.name, cfg.model.layers).tokenizer
        special = set(tok.all_special_ids)
        trial = res["details"]["trials"][0]
        info = trial.get("info", {})
        true = {v for s in trial["references"] for v in tok(s)["input_ids"]} - special
        pool, _ = data.null_pool(0)
        pool_sets = [set(tok(s)["input_ids"]) - special for s in pool]
        m = res["metrics"]
        row = {"cell": cid, "seed": seed, "split": SEEDS.get(seed, "held out"), "defense": label,
               "B": cfg.data.batch_size, "level": unit("token_sequences").grade(m, 0.0)["level"],
               "metrics": {k: m[k] for k in m if k.startswith(("word_bag", "rouge1_f1", "sentences_exact",
                                                                  "sub_edge", "subedge", "spectral_margin"))},
               "sub_edge_signal_present": info.get("sub_edge_signal_present"),
               "sub_edge_noise": info.get("sub_edge_noise"), "word_bag_source": info.get("word_bag_source"),
               "information_absent_flag": info.get("information_absent", False),
               "wall_seconds": round(wall, 1), "revision": REV}
        top = info.get("sub_edge_top") or []
        if top:
            row.update(enrichment_null(top, true, pool_sets, cfg.data.batch_size, tok.vocab_size, seed + 23))
        present = bool(top) and row["enrichment"] > row["enrichment_null_p99"] and row["enrichment_p_value"] < 0.01
        row["label"] = ("leaks" if row["level"] in ("partial", "strong", "exact") else
                        "information present, missed" if present else
                        "information absent at this test's power" if top else
                        "undetermined (no sub-edge ranking: the upload left no noise level to test against)")
        with jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps({k: row[k] for k in ("cell", "level", "label", "wall_seconds")}
                         | {k: row.get(k) for k in ("enrichment", "enrichment_null_p99", "enrichment_p_value")}),
              flush=True)


if __name__ == "__main__":
    main()
