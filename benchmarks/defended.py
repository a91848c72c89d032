"""The exact attacks under the defenses users deploy: UTR (paper 002 Table 3: pruning and DP) and lora_span (the
LoRA-ViT exact attack) before and after denoising, each beside its null, with the leakage margin of the upload.

Cells (one ``gradleak run`` each, through the one cell loop; resumable; rows carry the code revision):

* **UTR** on ``configs/audit/text_adapters.yaml`` (MiniLM, 2 layers, bottleneck adapters rf = 2, fortunes-topics,
  B = 2 and 4): top-k pruning r in {90, 95, 99, 99.9} % read **globally** (the whole upload's top-k, our default)
  and **per tensor** (each tensor's own top-k, the paper's reading), each with the sparsity-aware word bag
  (:func:`gradleak.attacks.common.subspace.pruned_membership`) and without it (the plain tests); DP-SGD at
  sigma in {1e-6, 1e-4} (C = 1: its noise reaches the attack through the declared-defense model) beside the
  Gaussian upload noise of the same per-coordinate std (sigma 1e-6 also at a second held-out seed, 12); the paper's
  DP-Gaussian sigma = 0.01, C = 1 literally.
* **lora_span** on ``configs/audit/vit_lora.yaml`` (ViT-S/14 pretrained, LoRA r = 128 on block-0 query/value,
  Fashion-MNIST, B = 1): absolute per-coordinate Gaussian noise at {0.01, 0.1, 0.3, 1, 3, 10, 100, 1000} x the
  upload's *drowning std* (the std at which the noise edge reaches the weakest of the N + 1 token directions,
  measured on the undefended upload of the same seed), with the rank cut of the exact solver (``gap``), the two
  denoising cuts (``noise_edge``, ``tokens``) and the measurements solver (``solver: measurements``, every direction
  above the noise edge a linear measurement of the image, data-free prior); per (seed, K) the **oracle ceiling**: the
  measurements solver on the *undefended* upload of the same image restricted to its K strongest directions, K = the
  directions a noisy upload leaves above its edge.

Every cell carries its information limit (directions above the edge, the strongest margin, debiased values) and a
**label computed from its numbers** (:func:`cell_label`): ``leaks``, ``information present, missed``, ``information
absent`` or ``undetermined (what is missing)``; the Reading counts labels, it states no conclusion of its own.

Seeds: 0 is the tuned seed (the tolerances and the z = 6 outlier rule were chosen looking at it); 11 is held out.
Every cell sets ``seed`` and ``data.seed`` to its seed (images follow ``data.seed``, sentences ``seed``), so no held-out
cell draws an image or sentence a tuned cell draws (``tests/test_heldout_disjoint.py``; before, the held-out lora_span
cells set ``seed`` only and reused the tuned image). ``python benchmarks/defended.py --out benchmarks/out --update-docs`` (text part about
10 minutes, image part about 20 minutes, PEFTLeak part about 12 minutes on 2 cores; ``--only text`` / ``--only
models`` / ``--only image`` / ``--only peftleak``).

* **PEFTLeak** (``--only peftleak``) on ``configs/peftleak/cifar_b32.yaml`` (ViT-B/16 poisoned by the malicious
  server, adapters r = 64, CIFAR test images, the improved design) at B = 16: absolute per-coordinate Gaussian upload
  noise at std {1e-22, ..., 1e-13} (the bins' bias differences are ~1e-13 .. 1e-15 at the up-projection scale
  1e-12), with the exact recovery (``noise: none``) and the noise mode (``noise: public``: the declared std;
  :mod:`gradleak.attacks.peftleak.denoise`). Seeds set ``seed`` and ``data.seed`` together: 0 draws CIFAR images
  0-15, held-out 65124 draws images 16-18, 23, 24, 26-28, 30-34, 37-39 (disjoint; found by scanning the seeded
  permutation, checked through the pipeline's own loader); the noise mode was designed on the tiny test ViT
  (images 0-7, tests/test_peftleak_noise.py) and its std ladder chosen on seed 0. B = 16, not the config's 32: two
  disjoint draws of 32 from the 40 shipped images do not exist. The attacked tensor is the adapters' bins
  (:mod:`gradleak.attacks.peftleak.limit`): every cell carries the bins above the noise edge (K), the strongest bin's
  margin over the edge and the signal scale as a noise std (the std at which the expected energy of the strongest /
  median bin of the undefended upload reaches the edge); per (seed, K) the **oracle ceiling** is the exact recovery on the *undefended* upload
  restricted to its K strongest bins (``attack.keep_bins=K``, the rest zeroed and read as unknown).

* **Other models** (``--only models``): MiniLM with all 6 layers and SmolLM2-135M (causal, as a mean-pooled
  classifier), B = 4 and 8, a subset of the defenses (none; top-k 90 % per tensor with and without the sparsity-aware
  word bag, 99 % per tensor and 90 % global with it; DP-SGD 1e-4 and its same-std Gaussian; the paper's DP-Gaussian).

``--cells PATTERN ...`` runs only the selected cells whose id matches one of the shell-style patterns (ids as in the
JSONL, e.g. ``'text|smollm2|none|*'``); the tables are still built from every row of the JSONL. For a subset when the
whole set is too slow for the machine, e.g. SmolLM2's undefended, top-k 90 % per tensor (sparsity-aware) and DP-SGD
1e-4 cells at B = 4: ``--only models --cells 'text|smollm2|none|B4|*' 'text|smollm2|topk0.9-per_tensor-aware|B4|*'
'text|smollm2|dpsgd0.0001|B4|*'``.
"""

from __future__ import annotations

import argparse
import copy
import fnmatch
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import (REVISION_NOTE, ROOT, add_out_args, display, latest_rows, resolve_out, revision, revision_label,  # noqa: E402
                    run_cells, start_fresh, write_section)

TEXT = "configs/audit/text_adapters.yaml"
IMAGE = "configs/audit/vit_lora.yaml"
SEEDS = {0: "tuned", 11: "held out"}
PRUNE = (0.9, 0.95, 0.99, 0.999)
DRAWN = (0.01, 0.1, 0.3, 1.0, 3.0, 10.0, 100.0, 1000.0)
PEFTLEAK = "configs/peftleak/cifar_b32.yaml"
#: data.seed 65124 draws CIFAR images disjoint from seed 0's at B = 16 (module docstring)
PEFTLEAK_SEEDS = {0: "tuned", 65124: "held out"}
PEFTLEAK_B = 16
PEFTLEAK_STDS = (1e-22, 1e-21, 1e-20, 1e-19, 1e-18, 1e-17, 1e-16, 1e-15, 1e-14, 1e-13)



def base(path: str, attack: dict, seed: int) -> dict:
    from gradleak.config.loading import load_yaml

    raw = load_yaml(ROOT / path)
    raw.pop("audit", None)
    raw["attack"] = attack
    raw["seed"] = seed
    raw.setdefault("data", {})["seed"] = seed  # images follow data.seed, sentences follow seed: both the cell's
    return raw


#: a second held-out seed for UTR under DP-SGD sigma 1e-6 beside its matched Gaussian (so it has the tuned seed and
#: two held-out ones); only those cells
DP_SEEDS = {12: "held out"}


def text_cells(args):
    for seed, split in {**SEEDS, **DP_SEEDS}.items():
        for B in (2, 4):
            def cell(cid, label, defenses=None, defense=None, **attack):
                raw = base(TEXT, {"name": "utr", "time_budget": 120.0, **attack}, seed)
                raw["data"]["batch_size"] = B
                raw["defenses"] = defenses or []
                if defense:
                    raw["defense"] = defense
                return ({"cell": f"text|{cid}|B{B}|seed{seed}", "part": "text", "attack": "utr", "defense": label,
                         "B": B, "seed": seed, "split": split, "variant": attack or "as configured"}, raw)

            if seed in DP_SEEDS:
                yield cell("none", "none")
                yield cell("dpsgd1e-06", "DP-SGD sigma 1e-06, C 1",
                           defense={"name": "dpsgd", "noise_multiplier": 1e-6, "max_grad_norm": 1.0})
                yield cell("gauss1e-06", f"Gaussian std {1e-6 / B:g} (DP-SGD's sigma C / B)",
                           [{"name": "gaussian_noise", "params": {"std": 1e-6 / B}}])
                continue
            yield cell("none", "none")
            for r in PRUNE:
                for scope in ("global", "per_tensor"):
                    d = [{"name": "topk_pruning", "params": {"prune_fraction": r, "per_tensor": scope == "per_tensor"}}]
                    yield cell(f"topk{r}-{scope}-aware", f"top-k {100 * r:g} % {scope}", d, sparsity_aware=True)
                    yield cell(f"topk{r}-{scope}-plain", f"top-k {100 * r:g} % {scope}", d, sparsity_aware=False)
            for sigma in (1e-6, 1e-4):
                yield cell(f"dpsgd{sigma:g}", f"DP-SGD sigma {sigma:g}, C 1",
                           defense={"name": "dpsgd", "noise_multiplier": sigma, "max_grad_norm": 1.0})
                yield cell(f"gauss{sigma:g}", f"Gaussian std {sigma / B:g} (DP-SGD's sigma C / B)",
                           [{"name": "gaussian_noise", "params": {"std": sigma / B}}])
            yield cell("dpgauss-paper", "DP-Gaussian sigma 0.01, C 1 (paper's literal setting)",
                       [{"name": "dp_gaussian", "params": {"noise_multiplier": 0.01, "max_norm": 1.0}}])


#: the other models of paper 002's Table 3 reading (a subset of the defenses; B = 4 and 8): MiniLM with all 6 layers,
#: SmolLM2-135M (causal, RoPE) as a classifier with mean pooling
MODELS = {"minilm-L6": {"layers": 6}, "smollm2": {"name": "smollm2", "task": "classification"}}


def model_cells(args):
    for tag, model in MODELS.items():
        for seed, split in SEEDS.items():
            for B in (4, 8):
                def cell(cid, label, defenses=None, defense=None, **attack):
                    raw = base(TEXT, {"name": "utr", **attack}, seed)
                    raw["data"]["batch_size"] = B
                    raw["model"] = {**raw["model"], **model}
                    raw["defenses"] = defenses or []
                    if defense:
                        raw["defense"] = defense
                    return ({"cell": f"text|{tag}|{cid}|B{B}|seed{seed}", "part": "text", "model": tag,
                             "attack": "utr", "defense": label, "B": B, "seed": seed, "split": split,
                             "variant": attack or "as configured"}, raw)

                yield cell("none", "none")
                for r, scope, aware in ((0.9, "per_tensor", True), (0.9, "per_tensor", False),
                                        (0.99, "per_tensor", True), (0.9, "global", True)):
                    d = [{"name": "topk_pruning", "params": {"prune_fraction": r, "per_tensor": scope == "per_tensor"}}]
                    yield cell(f"topk{r}-{scope}-{'aware' if aware else 'plain'}", f"top-k {100 * r:g} % {scope}", d,
                               sparsity_aware=aware)
                yield cell("dpsgd0.0001", "DP-SGD sigma 0.0001, C 1",
                           defense={"name": "dpsgd", "noise_multiplier": 1e-4, "max_grad_norm": 1.0})
                yield cell("gauss0.0001", f"Gaussian std {1e-4 / B:g} (DP-SGD's sigma C / B)",
                           [{"name": "gaussian_noise", "params": {"std": 1e-4 / B}}])
                yield cell("dpgauss-paper", "DP-Gaussian sigma 0.01, C 1 (paper's literal setting)",
                           [{"name": "dp_gaussian", "params": {"noise_multiplier": 0.01, "max_norm": 1.0}}])


def text_ceiling_ks(rows: list[dict]) -> dict[tuple, set[int]]:
    """(model tag or None, B, seed) -> the K values (directions of the embedding adapter above the edge, K >= 1) the
    noisy text rows at level none leave (``directions_above_edge_embedding_adapter``): the text ceilings to run (a
    row >= partial is labelled ``leaks`` whatever its ceiling)."""
    out: dict[tuple, set[int]] = {}
    for r in rows:
        if r.get("part") == "text" and r.get("defense") != "none" and "metrics" in r and r.get("level") not in LEAK:
            k = r["metrics"].get("directions_above_edge_embedding_adapter")
            if k is not None and k == k and k >= 1:
                out.setdefault((r.get("model"), r["B"], r["seed"]), set()).add(int(k))
    return out


def text_ceiling_id(model: str | None, B: int, seed: int, k: int) -> str:
    return f"text|{model + '|' if model else ''}ceiling-K{k}|B{B}|seed{seed}"


def text_ceiling_cells(args, ks: dict[tuple, set[int]]):
    """The text oracle ceilings: UTR on the *undefended* upload of the same batch (model, B, seed) read through its K
    strongest directions (``attack.directions=K``: the embedding adapter's word bag from its K strongest directions,
    the sentence layer capped at K; :class:`gradleak.attacks.utr.attack.UTRConfig`) -- the best a subspace attacker
    does with the directions the defense leaves above its edge. One cell per (model, B, seed, K)."""
    for (tag, B, seed), kset in sorted(ks.items(), key=str):
        for k in sorted(kset):
            raw = base(TEXT, {"name": "utr", "time_budget": 120.0, "directions": k}, seed)
            raw["data"]["batch_size"] = B
            if tag:
                raw["model"] = {**raw["model"], **MODELS[tag]}
            raw["defenses"] = []
            row = {"cell": text_ceiling_id(tag, B, seed, k), "part": "text-ceiling", "attack": "utr",
                   "defense": f"none (oracle ceiling: the undefended upload's {k} strongest directions)", "B": B,
                   "seed": seed, "split": split_of(seed), "variant": {"directions": k}, "K": k}
            if tag:
                row["model"] = tag
            yield row, raw


#: the lora_span solvers on each noisy upload: the exact solver's gap cut and the two denoising cuts of the span
#: solver, and the measurements solver (every direction above the noise edge a linear measurement of the image,
#: :mod:`gradleak.attacks.common.token_measurements`; data-free stationary prior)
IMAGE_VARIANTS = {"gap": {"rank_cut": "gap"}, "noise_edge": {"rank_cut": "noise_edge"},
                  "tokens": {"rank_cut": "tokens"},
                  "measurements": {"solver": "measurements", "rank_cut": "noise_edge", "prior": "stationary"}}
#: the tensor each part's information limit is read on (its metrics' suffix)
TENSOR = {"image": "block0_lora_A", "text": "embedding_adapter", "peftleak": "adapter_bins", "projres": "projres"}


def image_cells(args, drowning: dict[int, float], ceilings: dict[int, set[int]] | None = None):
    """The image cells: per seed the undefended upload, then (once its drowning std is known) each noise level with
    every solver of :data:`IMAGE_VARIANTS`, then (once the noisy uploads' directions above the edge are known:
    ``ceilings`` = seed -> the K values) the oracle ceilings -- the measurements solver on the *undefended* upload of
    the same image, restricted to its K strongest directions (``attack.directions=K``): the best any subspace
    attacker does with the directions the noise leaves. One ceiling cell per (seed, K), shared by the noise levels
    that leave the same K."""
    for seed, split in SEEDS.items():
        def cell(cid, label, defenses=None, part="image", **attack):
            raw = base(IMAGE, {"name": "lora_span", **attack}, seed)
            raw["defenses"] = defenses or []
            return ({"cell": f"image|{cid}|seed{seed}", "part": part, "attack": "lora_span", "defense": label,
                     "B": 1, "seed": seed, "data_seed": seed, "split": split, "variant": attack or "as configured"},
                    raw)

        yield cell("none", "none")
        if seed not in drowning:
            continue
        for f in DRAWN:
            std = f * drowning[seed]
            d = [{"name": "gaussian_noise", "params": {"std": std}}]
            for cut, v in IMAGE_VARIANTS.items():
                cid = f"noise{f:g}x-{cut}"
                yield cell(cid, f"Gaussian std {std:.3g} ({f:g} x drowning std)", d, **v)
        for k in sorted((ceilings or {}).get(seed, ())):
            row, raw = cell(f"ceiling-K{k}", f"none (oracle ceiling: the undefended upload's {k} strongest directions)",
                            part="image-ceiling", solver="measurements", prior="stationary", directions=k)
            row["K"] = k
            yield row, raw


def ceiling_ks(rows: list[dict]) -> dict[int, set[int]]:
    """seed -> the numbers of directions above the noise edge (K >= 1) the noisy image uploads leave, read off their
    rows (``directions_above_edge_block0_lora_A``): the ceilings to run."""
    out: dict[int, set[int]] = {}
    for r in rows:
        if r.get("part") == "image" and r.get("defense") != "none" and "metrics" in r:
            k = r["metrics"].get("directions_above_edge_block0_lora_A")
            if k is not None and k == k and k >= 1:
                out.setdefault(r["seed"], set()).add(int(k))
    return out


def peftleak_cells(args, ceilings: dict[int, set[int]] | None = None):
    """The PEFTLeak cells: per seed the undefended upload and every std of :data:`PEFTLEAK_STDS` with the exact
    recovery and the noise mode; then (``ceilings`` = seed -> the K values the noisy uploads leave above the edge) the
    oracle ceilings -- the exact recovery on the *undefended* upload restricted to its K strongest bins
    (``attack.keep_bins=K``; :mod:`gradleak.attacks.peftleak.limit`), one per (seed, K)."""
    from gradleak.config.loading import load_yaml

    for seed, split in PEFTLEAK_SEEDS.items():
        def cell(cid, label, defenses=None, part="peftleak", **attack):
            raw = load_yaml(ROOT / PEFTLEAK)
            raw["seed"] = seed
            raw["data"]["seed"] = seed
            raw["data"]["batch_size"] = PEFTLEAK_B
            raw["attack"] = {**raw["attack"], **attack}
            raw["defenses"] = defenses or []
            return ({"cell": f"peftleak|{cid}|B{PEFTLEAK_B}|seed{seed}", "part": part, "attack": "peftleak",
                     "defense": label, "B": PEFTLEAK_B, "seed": seed, "split": split,
                     "variant": attack or "as configured"}, raw)

        yield cell("none", "none")
        for std in PEFTLEAK_STDS:
            d = [{"name": "gaussian_noise", "params": {"std": std}}]
            for mode in ("none", "public"):
                yield cell(f"noise{std:g}-{mode}", f"Gaussian std {std:g}", d, noise=mode)
        for k in sorted((ceilings or {}).get(seed, ())):
            row, raw = cell(f"ceiling-K{k}", f"none (oracle ceiling: the undefended upload's {k} strongest bins)",
                            part="peftleak-ceiling", noise="none", keep_bins=k)
            row["K"] = k
            yield row, raw


def peftleak_ceiling_ks(rows: list[dict]) -> dict[int, set[int]]:
    """seed -> the numbers of bins above the noise edge (K >= 1) the noisy PEFTLeak uploads leave, read off their rows
    (``directions_above_edge_adapter_bins``): the ceilings to run."""
    out: dict[int, set[int]] = {}
    for r in rows:
        if r.get("part") == "peftleak" and r.get("defense") != "none" and "metrics" in r:
            k = _num(r["metrics"].get(f"directions_above_edge_{TENSOR['peftleak']}"))
            if k is not None and k >= 1:
                out.setdefault(r["seed"], set()).add(int(k))
    return out


#: ProjRes (paper 004's membership inference) on the text audit's upload under Gaussian upload noise (absolute std,
#: the ladder spans the adapters' noise edge at 1e-3..2e-2 to the task head's at ~0.12-0.3) and DP-SGD: the plain
#: residual beside the two noise-aware scores (``noise: public`` with ``noise_score`` residual / chi2)
PROJRES_STDS = (0.01, 0.1, 0.3, 0.5, 0.7, 1.0)
PROJRES_VARIANTS = {"plain": {"noise": "none"}, "residual": {"noise": "public", "noise_score": "residual"},
                    "chi2": {"noise": "public", "noise_score": "chi2"}}


#: per-layer limit metrics kept for the ProjRes ceilings (``directions_above_edge_projres_layer{i}``, i: the layer's
#: index in the attack's ``info["layers"]``; 7 on the text audit's MiniLM adapters)
PROJRES_LAYERS = 16


def projres_layer_ks(row: dict) -> tuple[int, ...] | None:
    """The directions above the noise edge per scored layer of a ProjRes row (:data:`PROJRES_LAYERS`), None where the
    row does not carry them."""
    m = row.get("metrics") or {}
    ks = []
    for i in range(PROJRES_LAYERS):
        k = _num(m.get(f"directions_above_edge_projres_layer{i}"))
        if k is None:
            break
        ks.append(int(k))
    return tuple(ks) or None


def projres_ceiling_id(seed: int, ks: tuple[int, ...]) -> str:
    """``projres|ceiling-K{sum}|layers{k0-k1-...}|seed{seed}``: the total and the per-layer K, so two uploads with the
    same total over different layers never share a ceiling."""
    return f"projres|ceiling-K{sum(ks)}|layers{'-'.join(str(k) for k in ks)}|seed{seed}"


def projres_ceiling_ks(rows: list[dict]) -> dict[int, set[tuple[int, ...]]]:
    """seed -> the per-layer K vectors (at least one direction above an edge) the noisy ProjRes uploads leave: the
    ceilings to run."""
    out: dict[int, set[tuple[int, ...]]] = {}
    for r in rows:
        if r.get("part") == "projres" and r.get("defense") != "none" and "metrics" in r:
            ks = projres_layer_ks(r)
            if ks and sum(ks) >= 1:
                out.setdefault(r["seed"], set()).add(ks)
    return out


def projres_cells(args, ceilings: dict[int, set[tuple[int, ...]]] | None = None):
    """The ProjRes cells: per seed the undefended upload, each noise of :data:`PROJRES_STDS` and DP-SGD with every
    score of :data:`PROJRES_VARIANTS`; then (``ceilings`` = seed -> the per-layer K vectors the noisy uploads leave)
    the oracle ceilings -- the paper's residual on the *undefended* upload with each layer's row space cut to its K
    strongest directions (``attack.directions``; :mod:`gradleak.attacks.projres`), graded by the same null."""
    for seed, split in SEEDS.items():
        def cell(cid, label, defenses=None, defense=None, part="projres", **attack):
            raw = base(TEXT, {"name": "projres", **attack}, seed)
            raw["threat"] = {**(raw.get("threat") or {}), "public_data": True}  # the candidates (as the audit grants)
            raw["defenses"] = defenses or []
            if defense:
                raw["defense"] = defense
            return ({"cell": f"projres|{cid}|seed{seed}", "part": part, "attack": "projres", "defense": label,
                     "B": raw["data"]["batch_size"], "seed": seed, "split": split,
                     "variant": attack or "as configured"}, raw)

        for ks in sorted((ceilings or {}).get(seed, ())):
            row, raw = cell("ceiling", f"none (oracle ceiling: each layer's {'/'.join(map(str, ks))} strongest "
                            "directions)", part="projres-ceiling", noise="none", directions=list(ks))
            row.update({"cell": projres_ceiling_id(seed, ks), "K": sum(ks), "K_layers": list(ks)})
            yield row, raw
        if ceilings is not None:
            continue
        yield cell("none", "none")
        for std in PROJRES_STDS:
            for name, v in PROJRES_VARIANTS.items():
                yield cell(f"noise{std:g}-{name}", f"Gaussian std {std:g}",
                           [{"name": "gaussian_noise", "params": {"std": std}}], **v)
        for name, v in PROJRES_VARIANTS.items():
            yield cell(f"dpsgd0.01-{name}", "DP-SGD sigma 0.01, C 1",
                       defense={"name": "dpsgd", "noise_multiplier": 0.01, "max_grad_norm": 1.0}, **v)


def run_one(raw: dict, out: str) -> dict:
    from gradleak.run.audit import judge
    from gradleak.run.runner import run_config, validate

    res = run_config(copy.deepcopy(raw), out)
    _, cfg = validate(copy.deepcopy(raw))
    per = (res.get("details") or {}).get("per_client") or [{"metrics": res["metrics"]}]
    j = judge(cfg.attack_cls.reconstruction, per[0]["metrics"], cfg).as_dict()
    return {"metrics": res["metrics"], "judge": j}


#: the information limit of an attacked tensor (gradleak.attacks.common.subspace.spectral_margin), per tensor
LIMIT = ("spectral_margin", "drowning_noise_std", "drowning_noise_std_all", "directions_above_edge",
         "margin_strongest", "debiased_strongest", "debiased_weakest_above_edge")
KEEP = ("word_bag_recall", "word_bag_recall_null_p99", "word_bag_precision", "word_bag_size", "rouge1_f1", "rouge1_f1_null_p99",
        "sentences_exact", "psnr_max", "psnr_max_null_p99", "psnr_max_p_value", "ssim_max", "ssim_max_null_p99",
        "psnr_max_mean_public", "psnr_max_grey", "lora_span_row_space_rank", "lora_span_directions_used",
        "lora_span_noise_std_read",
        *(f"{k}_{t}" for t in TENSOR.values() for k in LIMIT),
        "patch_recovery_rate", "isolated_patch_rate", "recovered_patch_psnr_median", "expected_patch_psnr_median",
        "num_returned_patches", "num_true_patches", "false_positives", "nonzero_bins", "noise_std_used",
        "occupied_bins", "bins_kept", "drowning_noise_std_median_adapter_bins", "bins_tested_adapter_bins",
        "auc", "auc_null_p99", "tpr_at_1pct_fpr", "tpr_at_1pct_fpr_null_p99", "members", "nonmembers",
        *(f"directions_above_edge_projres_layer{i}" for i in range(PROJRES_LAYERS)),
        "subedge_p_value", "sub_edge_min_log10_p", "sub_edge_significant_tokens", "sub_edge_bag_size",
        "sub_edge_enrichment", "sub_edge_enrichment_null_median", "sub_edge_enrichment_null_p99",
        "sub_edge_enrichment_p_value")


def fill(result: dict, row: dict) -> str:
    m = result["metrics"]
    row["metrics"] = {k: m[k] for k in KEEP if k in m}
    row["level"] = result["judge"]["level"]
    row["rule"] = result["judge"]["rule"]
    for k in ("metric", "value", "null_p99"):  # the measure that decided the level, beside its null
        row[f"decided_{k}"] = result["judge"].get(k)
    row["revision"] = REV
    return f"{row['defense']} {row['variant']}: {row['level']}"


REV = revision()

#: levels at or beyond the partial bar (beyond the null)
LEAK = ("partial", "strong", "exact")
#: the computed labels of a cell (:func:`cell_label`); ``undetermined`` carries what is missing in brackets
LABELS = ("leaks", "information present, missed", "information absent", "undetermined")
#: the sub-edge word-bag test's p-values, the first present read (UTR's ``subedge_p_value``: some vocabulary token
#: beyond the noise alone, Bonferroni over the vocabulary, under declared Gaussian noise; else -- a top-k pruned
#: upload, either reading, whose error is not Gaussian -- the empirical p-value of its ranking's enrichment against
#: random public tokens through the same ranking, ``sub_edge_enrichment_p_value`` = (1 + #null >= obs) / (1 + draws))
#: and the alpha they are read at
SUBEDGE_P = ("subedge_p_value", "sub_edge_enrichment_p_value")
SUBEDGE_ALPHA = 0.01


def _num(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and x == x else None


def tensor_of(row: dict) -> str | None:
    """The attacked tensor whose information limit the row's metrics carry (:data:`TENSOR`), None for other parts."""
    part = row.get("part") or ""
    return TENSOR.get("image" if part.startswith("image") else part)


def info_limit(row: dict) -> dict[str, float | None]:
    """The row's information limit on its attacked tensor (:data:`LIMIT`; None where not measured)."""
    t, m = tensor_of(row), row.get("metrics") or {}
    return {k: _num(m.get(f"{k}_{t}")) for k in LIMIT} if t else {}


def ceiling_state(row: dict) -> tuple[str | None, str]:
    """``("beyond" | "chance" | None, why)``: the oracle ceiling of the row's upload. Its own judged level where it
    ran (``row["ceiling"]``: the attack on the undefended upload restricted to what stands above the edge -- for
    lora_span the measurements solver on its K strongest directions, for PEFTLeak the exact recovery on its K
    strongest bins -- graded by the same null); at chance by construction where the tensor holds nothing an attacker
    can tell from the noise -- nothing above the noise edge (K = 0: the strongest singular value, or PEFTLeak's
    strongest bin, under the edge; ``margin_strongest`` <= 1.05, resp. <= 1) or an all-zero upload
    (``drowning_noise_std_all`` = 0); None (not measured) otherwise. The margin at the rank cut (``spectral_margin``)
    is never read: it sits near 1 by construction wherever the cut follows the noise edge."""
    c = row.get("ceiling")
    if c is not None:
        lvl = c.get("level")
        if lvl in LEAK:
            return "beyond", f"ceiling {lvl} (K = {c.get('K')})"
        if lvl == "none":
            return "chance", f"ceiling at chance (K = {c.get('K')})"
        return None, f"ceiling {lvl}"
    lim = info_limit(row)
    if lim.get("drowning_noise_std_all") == 0.0:
        return "chance", "nothing uploaded on the attacked tensor"
    k = lim.get("directions_above_edge")
    if k is not None and k < 1:
        return "chance", f"K = 0 (no {'bin' if row.get('part') == 'peftleak' else 'direction'} above the noise edge)"
    return None, "no oracle ceiling"


def subedge_state(row: dict) -> tuple[str | None, str]:
    """``("beyond" | "chance" | None, why)``: the sub-edge test (UTR's word bag below the noise edge against its null,
    read at :data:`SUBEDGE_ALPHA`; for ProjRes the scores on the same upload, attached by :func:`with_ceilings` as
    ``row["subedge"]``); None where the row has none."""
    if row.get("subedge") is not None:
        return row["subedge"]["state"], row["subedge"]["why"]
    m = row.get("metrics") or {}
    key = next((k for k in SUBEDGE_P if _num(m.get(k)) is not None), None)
    if key is None:
        if row.get("part") == "text" and info_limit(row).get("drowning_noise_std_all") == 0.0:
            return "chance", "sub-edge: nothing uploaded on the embedding adapter (every token's energy 0)"
        return None, "no sub-edge test"
    p = _num(m[key])
    what = "sub-edge p" if key == "subedge_p_value" else "sub-edge enrichment p"
    return ("beyond", f"{what} {p:.3g}") if p < SUBEDGE_ALPHA else ("chance", f"{what} {p:.3g}")


def needs_subedge(row: dict) -> bool:
    """Whether the row's label needs the sub-edge test: UTR's word bag below the noise edge (:data:`SUBEDGE_P`) for
    the text parts; for ProjRes its scores on the same upload (:func:`projres_subedge`: the χ² matched filter reads a
    candidate's known direction below the edge, so K = 0 is no bound on it -- measured: the plain residual reaches
    partial at std 0.3 with K = 0 on every layer); for lora_span and PEFTLeak the oracle ceiling is the whole of the
    evidence."""
    return (row.get("part") or "").startswith("text") or row.get("part") == "projres"


def cell_label(row: dict) -> str:
    """The cell's conclusion, computed from its numbers (docs/DESIGN.md: a conclusion is computed from rows, never
    typed):

    * ``leaks`` -- its level >= partial (beyond the null);
    * ``information present, missed`` -- the level is none while the oracle ceiling or the sub-edge test stands
      beyond its null;
    * ``information absent`` -- the level is none and the ceiling is at chance, and so is the sub-edge test where it
      applies (:func:`needs_subedge`: UTR's text parts; for image, PEFTLeak and ProjRes parts a ceiling at chance
      is enough);
    * ``undetermined (...)`` -- otherwise, naming what is missing (the ceiling, the sub-edge test, a level)."""
    level = row.get("level")
    if "error" in row or level is None:
        return "undetermined (not measured)"
    if level in LEAK:
        return "leaks"
    (ceil, cwhy), (sub, swhy) = ceiling_state(row), subedge_state(row)
    if "beyond" in (ceil, sub):
        return "information present, missed"
    missing = [w for st, w, needed in ((ceil, cwhy, True), (sub, swhy, needs_subedge(row))) if st is None and needed]
    if level != "none":
        missing.insert(0, f"level {level}")
    if not missing:
        return "information absent"
    return f"undetermined ({'; '.join(missing)})"


def label_kind(label: str) -> str:
    """The label without its bracket (one of :data:`LABELS`)."""
    return label.split(" (")[0]


def with_ceilings(rows: list[dict]) -> list[dict]:
    """The rows, each noisy image and PEFTLeak row with its oracle ceiling (``ceiling``: the ceiling cell of its seed
    and K, its level, PSNR and null; PEFTLeak's also its patches recovered) and every row with its computed
    ``label``. Copies; the JSONL is not changed."""
    ok = {r["cell"]: r for r in rows if "metrics" in r}
    out = []
    for r in rows:
        r = dict(r)
        if r.get("part") == "image" and r.get("defense") != "none" and "metrics" in r:
            k = info_limit(r).get("directions_above_edge")
            c = ok.get(f"image|ceiling-K{int(k)}|seed{r['seed']}") if k is not None and k >= 1 else None
            if c is not None:
                cm = c["metrics"]
                r["ceiling"] = {"K": int(k), "level": c["level"], "psnr_max": cm.get("psnr_max"),
                                "psnr_max_null_p99": cm.get("psnr_max_null_p99"), "cell": c["cell"],
                                "revision": c.get("revision")}
        if r.get("part") == "peftleak" and r.get("defense") != "none" and "metrics" in r:
            k = info_limit(r).get("directions_above_edge")
            c = ok.get(f"peftleak|ceiling-K{int(k)}|B{r['B']}|seed{r['seed']}") if k is not None and k >= 1 else None
            if c is not None:
                cm = c["metrics"]
                r["ceiling"] = {"K": int(k), "level": c["level"], "psnr_max": cm.get("psnr_max"),
                                "psnr_max_null_p99": cm.get("psnr_max_null_p99"),
                                "patch_recovery_rate": cm.get("patch_recovery_rate"), "cell": c["cell"],
                                "revision": c.get("revision")}
        if r.get("part") == "text" and r.get("defense") != "none" and "metrics" in r:
            k = info_limit(r).get("directions_above_edge")
            c = ok.get(text_ceiling_id(r.get("model"), r["B"], r["seed"], int(k))) if k is not None and k >= 1 \
                else None
            if c is not None:
                cm = c["metrics"]
                r["ceiling"] = {"K": int(k), "level": c["level"], "word_bag_recall": cm.get("word_bag_recall"),
                                "word_bag_recall_null_p99": cm.get("word_bag_recall_null_p99"), "cell": c["cell"],
                                "revision": c.get("revision")}
        if r.get("part") == "projres" and r.get("defense") != "none" and "metrics" in r:
            ks = projres_layer_ks(r)
            c = ok.get(projres_ceiling_id(r["seed"], ks)) if ks and sum(ks) >= 1 else None
            if c is not None:
                cm = c["metrics"]
                r["ceiling"] = {"K": sum(ks), "level": c["level"], "auc": cm.get("auc"),
                                "auc_null_p99": cm.get("auc_null_p99"), "cell": c["cell"],
                                "revision": c.get("revision")}
            r["subedge"] = dict(zip(("state", "why"), projres_subedge(r, ok)))
        r["label"] = cell_label(r)
        out.append(r)
    return out


def projres_subedge(row: dict, ok: dict[str, dict]) -> tuple[str | None, str]:
    """ProjRes's reading below the noise edge: its three scores (:data:`PROJRES_VARIANTS`) on the same upload (same
    seed and defense: the noise is drawn from the seed, the score is the attack's). Beyond where one of them reaches
    partial (the information is in the upload), at chance where all three were measured at none (the χ² matched
    filter included), None where one is missing."""
    sib = {v: ok.get(f"projres|{row['cell'].split('|')[1].rsplit('-', 1)[0]}-{v}|seed{row['seed']}")
           for v in PROJRES_VARIANTS}
    leak = [f"{v} {s['level']}" for v, s in sib.items() if s is not None and s.get("level") in LEAK]
    if leak:
        return "beyond", "same upload: " + ", ".join(leak)
    if all(s is not None and s.get("level") == "none" for s in sib.values()):
        return "chance", "same upload: " + ", ".join(f"{v} none" for v in sib)
    return None, "same upload: a score not measured"


def fmt(x, spec=".3g"):
    return "–" if x is None else (f"{x:{spec}}" if isinstance(x, (int, float)) else str(x))


def with_null(m: dict, key: str, spec: str) -> str:
    """``m[key]`` beside its null's 99th percentile (``m[key + "_null_p99"]``), both formatted with ``spec``."""
    return f"{fmt(m.get(key), spec)} ({fmt(m.get(key + '_null_p99'), spec)})"


def subedge_cell(m: dict) -> str:
    """The sub-edge test's p-value (the tokens past its Bonferroni cut) and, where the ranking was graded against its
    null, the empirical p-value of its enrichment (the enrichment, its null p99 in brackets: a pruned upload's only
    p-value); ``not run`` where the row has neither."""
    p, n = _num(m.get("subedge_p_value")), _num(m.get("sub_edge_significant_tokens"))
    e, ep = _num(m.get("sub_edge_enrichment")), _num(m.get("sub_edge_enrichment_p_value"))
    enr = (f"enrichment p {fmt(ep, '.3g')}: {fmt(e, '.0f')} ({fmt(_num(m.get('sub_edge_enrichment_null_p99')), '.0f')})"
           if ep is not None else "")
    if p is None:
        return enr or ("not run" if n is None else f"no p-value ({n:g})")
    return f"{'< 0.001' if p < 1e-3 else fmt(p, '.3g')} ({fmt(n, 'g')})" + (f"; {enr}" if enr else "")


def limit_cells(r: dict) -> str:
    """The info-limit cells of a table row: K above the edge | margin strongest (weakest used) | its ceiling."""
    lim, c = info_limit(r), r.get("ceiling")
    k = lim.get("directions_above_edge")
    if not r.get("defense") or r["defense"] == "none":
        margin, kk = "no noise", "all"
    else:
        kk = fmt(k, "g") if k is not None else "–"
        margin = (f"{fmt(lim.get('margin_strongest'), '.3g')} ({fmt(lim.get('spectral_margin'), '.3g')})"
                  if lim.get("margin_strongest") is not None else "not measured")
    key = {"text": "word_bag_recall", "projres": "auc"}.get(r.get("part"), "psnr_max")  # the ceiling's headline
    spec = ".3f" if key == "auc" else ".1f"
    ceil = ("–" if c is None else f"{c['level']}: {fmt(c.get(key), spec)} "
            f"({fmt(c.get(key + '_null_p99'), spec)})")
    if c is not None and c.get("patch_recovery_rate") is not None:  # PEFTLeak's ceiling: its patches recovered too
        ceil += f", patches {fmt(c['patch_recovery_rate'], '.3f')}"
    if c is None and ceiling_state(r)[0] == "chance":
        ceil = "chance by construction"
    return f"{kk} | {margin} | {ceil}"


LIMIT_NOTE = ("**K**: signal directions of the attacked tensor above the noise edge τ(√M + √n) (1.05 ×; τ: the declared "
              "per-coordinate std, or the one read off the upload; under top-k pruning, either reading, the declared "
              "noise and the pruning error's scale t together, t the smallest kept magnitude: every dropped "
              "coordinate is at most t, docs/DESIGN.md's information limit); **margin**: the strongest singular value over the "
              "edge (does not saturate at a cut; ≤ 1.05 means K = 0), the margin at the attack's rank cut in brackets "
              "(near 1 by construction wherever the cut follows the edge: never read as absence); **ceiling**: the "
              "oracle ceiling, the measurements solver on the *undefended* upload of the same image restricted to its "
              "K strongest directions (`attack.directions=K`), its level and best-image PSNR dB (null p99); for UTR "
              "the attack on the undefended upload of the same batch read through its K strongest directions "
              "(`attack.directions=K`), its level and word-bag recall (null p99) -- at "
              "chance by construction where K = 0 or the tensor's upload is all zero; **sub-edge p**: UTR's sub-edge "
              "word-bag test (some vocabulary token's embedding-adapter energy beyond the χ² law of the declared "
              "noise, Bonferroni over the vocabulary), read at α = 0.01, the tokens past its cut in brackets; "
              "`enrichment p`: its ranking graded against its null (the batch's tokens among its top |T| over chance "
              "against the tokens of B random public sentences through the same ranking, empirical p = (1 + #null ≥ "
              "obs) / (1 + draws); enrichment (null p99)), the p-value read where there is no χ² one (a top-k pruned "
              "upload, whose error is not Gaussian); **label**: computed from "
              "these numbers by `cell_label` (benchmarks/defended.py): `leaks` (level ≥ partial), `information "
              "present, missed` (level none, the ceiling or the sub-edge test beyond its null), `information absent` "
              "(the ceiling at chance, and the sub-edge test too where it applies -- UTR's text cells; for lora_span, "
              "PEFTLeak and ProjRes the ceiling alone), `undetermined` (what is missing, named). **PEFTLeak**: its "
              "attacked tensor is the adapters' bins (`gradleak.attacks.peftleak.limit`): K = bins whose energy over "
              "their noise variance passes the χ²_{D+1} edge at 0.01 / bins (the noise mode's own occupancy test), "
              "margin = √(strongest bin's energy / edge) (≤ 1: no bin stands out), the weakest above-edge bin's in "
              "brackets; ceiling = the exact recovery on the *undefended* upload restricted to its K strongest bins "
              "(`attack.keep_bins=K`, the rest zeroed and read as unknown), its level, best-image PSNR dB (null p99) "
              "and patches recovered; **signal scale** = the noise std at which the expected energy (signal plus the "
              "noise's mean) of the strongest / median bin of the seed's undefended upload reaches the edge. **ProjRes**: its attacked tensors are every scored layer's weight "
              "gradient (7 on MiniLM's adapters and task head): K = the directions above each layer's edge summed, "
              "margin = the largest layer's strongest singular value over its edge; ceiling = the paper's residual on "
              "the *undefended* upload with each layer's row space cut to its K strongest directions "
              "(`attack.directions`), its level and AUC (null p99); its sub-edge reading = the three scores on the same "
              "upload (the χ² matched filter tests a candidate's known direction below the edge, so K = 0 does not "
              "bound it): one >= partial is information present.")


def table(rows: list[dict]) -> str:
    rows = with_ceilings(rows)
    lines = [LIMIT_NOTE, ""]
    text = [r for r in rows if r.get("part") == "text" and "metrics" in r]
    if text:
        lines += ["### UTR under pruning and DP (adapters rf = 2, fortunes-topics; MiniLM 2 layers unless the model "
                  "column says otherwise)", "",
                  "Sentences follow `seed` (a seeded permutation of the quotes): held-out seeds draw other quotes "
                  "(tests/test_heldout_disjoint.py).", "",
                  "| model | seed (split) | B | defense | variant | level | word-bag recall (null p99) | ROUGE-1 F1 "
                  "(null p99) | exact sentences | K (emb. adapter) | margin strongest (at cut) | ceiling | sub-edge p "
                  "(tokens past the cut) | label | revision |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in text:
            m = r["metrics"]
            v = r["variant"] if isinstance(r["variant"], str) else ", ".join(f"{k}={w}" for k, w in r["variant"].items()
                                                                             if k != "time_budget") or "as configured"
            lines.append(f"| {r.get('model', 'minilm-L2')} | {r['seed']} ({r['split']}) | {r['B']} | {r['defense']} | "
                         f"{v} | {r['level']} | {with_null(m, 'word_bag_recall', '.1f')} | "
                         f"{with_null(m, 'rouge1_f1', '.1f')} | "
                         f"{fmt(m.get('sentences_exact'), 'g')} | {limit_cells(r)} | "
                         f"{subedge_cell(m)} | {r['label']} | {revision_label(r)} |")
        lines.append("")
        tc = [r for r in rows if r.get("part") == "text-ceiling" and "metrics" in r]
        if tc:
            lines += ["Text oracle ceilings (UTR on the undefended upload of the same batch read through its K strongest "
                      "directions, `attack.directions=K`; the text rows' ceiling column is the word-bag recall (null "
                      "p99)):", "",
                      "| model | seed (split) | B | K | level | word-bag recall (null p99) | word bag size | revision |",
                      "|---|---|---|---|---|---|---|---|"]
            for r in sorted(tc, key=lambda r: (r.get("model") or "", r["seed"], r["B"], r.get("K", 0))):
                m = r["metrics"]
                lines.append(f"| {r.get('model', 'minilm-L2')} | {r['seed']} ({r['split']}) | {r['B']} | {r.get('K')} | "
                             f"{r['level']} | {with_null(m, 'word_bag_recall', '.1f')} | "
                             f"{fmt(m.get('word_bag_size'), 'g')} | {revision_label(r)} |")
            lines.append("")
    img = sorted((r for r in rows if r.get("part") == "image" and "metrics" in r),
                 key=lambda r: (list(SEEDS).index(r["seed"]) if r["seed"] in SEEDS else 99,
                                -1.0 if r["defense"] == "none" else noise_factor(r),
                                list(IMAGE_VARIANTS).index(image_variant(r)) if r["defense"] != "none" else -1))
    if img:
        lines += ["### lora_span under Gaussian upload noise: the span solver's rank cuts and the measurements solver, "
                  "each beside the oracle ceiling (ViT-S/14, LoRA r = 128, Fashion-MNIST, B = 1)", "",
                  "Images follow `data.seed`, set with `seed`: the held-out seed draws an image no tuned cell draws "
                  "(tests/test_heldout_disjoint.py). `measurements`: `attack.solver=measurements "
                  "attack.rank_cut=noise_edge attack.prior=stationary` (every direction above the edge a linear "
                  "measurement of the image, data-free prior).", "",
                  "| seed = data.seed (split) | defense | solver / rank cut | level | PSNR max dB (null p99) | SSIM "
                  "(null p99) | rank used | K | margin strongest (at cut) | ceiling | label | revision |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in img:
            m = r["metrics"]
            lines.append(f"| {r['seed']} ({r['split']}) | {r['defense']} | {image_variant(r)} | {r['level']} | "
                         f"{with_null(m, 'psnr_max', '.1f')} | "
                         f"{with_null(m, 'ssim_max', '.3f')} | "
                         f"{fmt(m.get('lora_span_row_space_rank'), 'g')} | {limit_cells(r)} | {r['label']} | "
                         f"{revision_label(r)} |")
        lines.append("")
        ceil = [r for r in rows if r.get("part") == "image-ceiling" and "metrics" in r]
        if ceil:
            lines += ["Oracle ceilings (the undefended upload, measurements solver, its K strongest directions; "
                      "the prior alone: the mean public / grey image's PSNR):", "",
                      "| seed (split) | K | level | PSNR max dB (null p99) | SSIM (null p99) | prior alone dB (mean "
                      "public / grey) | revision |", "|---|---|---|---|---|---|---|"]
            for r in sorted(ceil, key=lambda r: (r["seed"], r.get("K", 0))):
                m = r["metrics"]
                lines.append(f"| {r['seed']} ({r['split']}) | {r.get('K')} | {r['level']} | "
                             f"{with_null(m, 'psnr_max', '.1f')} | {with_null(m, 'ssim_max', '.3f')} | "
                             f"{fmt(m.get('psnr_max_mean_public'), '.1f')} / {fmt(m.get('psnr_max_grey'), '.1f')} | "
                             f"{revision_label(r)} |")
            lines.append("")
    pl = sorted((r for r in rows if r.get("part") == "peftleak" and "metrics" in r),
                key=lambda r: (list(PEFTLEAK_SEEDS).index(r["seed"]) if r["seed"] in PEFTLEAK_SEEDS else 99,
                               0.0 if r["defense"] == "none" else float(r["defense"].split()[-1]),
                               str(r["variant"])))
    if pl:
        lines += ["### PEFTLeak under Gaussian upload noise, exact recovery vs noise mode (ViT-B/16 + adapters r = 64, "
                  f"CIFAR, B = {PEFTLEAK_B}, improved design)", "",
                  "A patch counts as recovered at PSNR >= 30 dB in its image's group (isolated: anywhere at its "
                  "position). Patch PSNR: median over the returned patches that reach 30 dB (the noise mode's own "
                  "prediction from σ/|Δb| beside it). The level and best-image PSNR/SSIM are judged against the "
                  "null (random held-out CIFAR images) and the mean public, grey and flat images. **Signal scale**: "
                  "the noise std at which the expected energy of the strongest / median bin of the seed's "
                  "undefended upload reaches the edge (well above the first no bin stands above it, at the second "
                  "about half); K, margin and ceiling as in the note "
                  "above (the attacked tensor: the adapters' bins).", "",
                  "| seed (split) | defense | signal scale (strongest / median bin) | recovery | level | patches "
                  "recovered (isolated) | patch PSNR dB (predicted) | returned (below 30 dB) | PSNR max dB (null p99) "
                  "| SSIM max (null p99) | K (bins) | margin strongest (weakest above edge) | ceiling | label | "
                  "revision |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        undefended = {r["seed"]: r["metrics"] for r in pl if r["defense"] == "none"}
        for r in pl:
            m = r["metrics"]
            mode = r["variant"].get("noise", "public") if isinstance(r["variant"], dict) else "public"
            mode = {"none": "exact (none)", "public": "noise mode (public)"}.get(mode, mode)
            if r["defense"] == "none":
                mode = "exact (nothing declared)"
            u = undefended.get(r["seed"], {})
            scale = (f"{fmt(_num(u.get('drowning_noise_std_all_adapter_bins')), '.2g')} / "
                     f"{fmt(_num(u.get('drowning_noise_std_median_adapter_bins')), '.2g')}")
            lines.append(f"| {r['seed']} ({r['split']}) | {r['defense']} | {scale} | {mode} | {r['level']} | "
                         f"{fmt(m.get('patch_recovery_rate'), '.3f')} ({fmt(m.get('isolated_patch_rate'), '.3f')}) | "
                         f"{fmt(m.get('recovered_patch_psnr_median'), '.1f')} "
                         f"({fmt(m.get('expected_patch_psnr_median'), '.1f')}) | "
                         f"{fmt(m.get('num_returned_patches'), 'g')} ({fmt(m.get('false_positives'), 'g')}) | "
                         f"{with_null(m, 'psnr_max', '.1f')} | "
                         f"{with_null(m, 'ssim_max', '.3f')} | {limit_cells(r)} | {r['label']} | "
                         f"{revision_label(r)} |")
        lines.append("")
        pc = [r for r in rows if r.get("part") == "peftleak-ceiling" and "metrics" in r]
        if pc:
            lines += ["PEFTLeak oracle ceilings (the exact recovery on the undefended upload restricted to its K "
                      "strongest bins, `attack.keep_bins=K`; the rest zeroed and read as unknown):", "",
                      "| seed (split) | K (bins kept) | level | patches recovered (isolated) | returned (below 30 dB) | "
                      "PSNR max dB (null p99) | SSIM max (null p99) | revision |", "|---|---|---|---|---|---|---|---|"]
            for r in sorted(pc, key=lambda r: (r["seed"], r.get("K", 0))):
                m = r["metrics"]
                lines.append(f"| {r['seed']} ({r['split']}) | {r.get('K')} ({fmt(m.get('bins_kept'), 'g')}) | "
                             f"{r['level']} | {fmt(m.get('patch_recovery_rate'), '.3f')} "
                             f"({fmt(m.get('isolated_patch_rate'), '.3f')}) | "
                             f"{fmt(m.get('num_returned_patches'), 'g')} ({fmt(m.get('false_positives'), 'g')}) | "
                             f"{with_null(m, 'psnr_max', '.1f')} | {with_null(m, 'ssim_max', '.3f')} | "
                             f"{revision_label(r)} |")
            lines.append("")
    pr = [r for r in rows if r.get("part") == "projres" and "metrics" in r]
    if pr:
        order = {"none": -1.0}
        pr.sort(key=lambda r: (list(SEEDS).index(r["seed"]) if r["seed"] in SEEDS else 99,
                               r["defense"].startswith("DP-SGD"),
                               order.get(r["defense"], float(r["defense"].split()[-1]) if r["defense"].startswith("Gauss")
                                         else 0.0),
                               list(PROJRES_VARIANTS).index(_projres_variant(r))))
        lines += ["### ProjRes under upload noise, the plain residual vs the noise-aware scores (MiniLM 2 layers, "
                  "adapters rf = 2, fortunes-topics, members = the client's batch)", "",
                  "`plain`: the paper's relative residual on the row space at the exactness tolerance; `residual`: the "
                  "residual on the directions above the noise edge σ(√m + √n) (σ declared); `chi2`: each candidate "
                  "direction's projection energy against the χ² law of noise alone, a layer counting only when it "
                  "passes a Bonferroni χ² quantile. The level is decided by TPR at 1 % FPR and |AUC − 0.5| against "
                  "their nulls (members and non-members drawn at random); the TPR at 1 % FPR is graded only with "
                  ">= 100 non-members (fewer cannot resolve a 1 % FPR: it is the TPR at FPR 0, graded partial at most; "
                  "gradleak.evaluation.membership); the audit keeps the strongest of the three.",
                  "", "| seed (split) | defense | score | level | AUC (null p99) | TPR at 1 % FPR (null p99) | members "
                  "/ non-members | K (all layers) | margin strongest (at cut) | ceiling | same upload | label | "
                  "revision |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in pr:
            m = r["metrics"]
            n0 = _num(m.get("nonmembers"))
            tpr = with_null(m, 'tpr_at_1pct_fpr', '.2f') + (" (at FPR 0: not graded)" if n0 is not None and n0 < 100
                                                            else "")
            counts = f"{fmt(m.get('members'), 'g')} / {fmt(m.get('nonmembers'), 'g')}"
            same = r.get("subedge", {}).get("why", "–") if r["defense"] != "none" else "–"
            lines.append(f"| {r['seed']} ({r['split']}) | {r['defense']} | {_projres_variant(r)} | {r['level']} | "
                         f"{with_null(m, 'auc', '.3f')} | {tpr} | {counts} | {limit_cells(r)} | {same} | "
                         f"{r['label']} | {revision_label(r)} |")
        lines.append("")
        ceil = [r for r in rows if r.get("part") == "projres-ceiling" and "metrics" in r]
        if ceil:
            lines += ["ProjRes oracle ceilings (the undefended upload, the paper's residual, each layer's row space cut "
                      "to its K strongest directions):", "",
                      "| seed (split) | K per layer | level | AUC (null p99) | members / non-members | revision |",
                      "|---|---|---|---|---|---|"]
            for r in sorted(ceil, key=lambda r: (r["seed"], r.get("K", 0), r.get("K_layers", []))):
                m = r["metrics"]
                lines.append(f"| {r['seed']} ({r['split']}) | {'/'.join(map(str, r.get('K_layers', [])))} | "
                             f"{r['level']} | {with_null(m, 'auc', '.3f')} | {fmt(m.get('members'), 'g')} / "
                             f"{fmt(m.get('nonmembers'), 'g')} | {revision_label(r)} |")
            lines.append("")
    lines += reading(rows)
    failed = [r for r in rows if "error" in r]
    if failed:
        by: dict[str, list[dict]] = {}
        for r in failed:
            by.setdefault(r.get("model") or r.get("part", "?"), []).append(r)
        for who, rs in by.items():
            lines += [f"Failed cells ({who}, {len(rs)}): the first failed with `{rs[0]['error'][:160]}` "
                      f"({rs[0]['cell']}); not measured, so not counted above.", ""]
    lines.append(f"Code revision(s) of these rows: {revision_label([r for r in rows if 'metrics' in r])}. "
                 f"{REVISION_NOTE} Command: "
                 "`python benchmarks/defended.py --out benchmarks/out --update-docs`.")
    return "\n".join(lines)


def split_of(seed: int) -> str:
    return {**SEEDS, **DP_SEEDS}.get(seed, "?")


def noise_factor(r: dict) -> float:
    """A noisy image cell's noise std over the drowning std (its id: ``image|noise<f>x-<solver>|seed<s>``)."""
    return float(r["cell"].split("|")[1][len("noise"):].split("x-")[0])


def image_variant(r: dict) -> str:
    """A lora_span row's solver: the rank cut of the span solver, or ``measurements``."""
    v = r["variant"] if isinstance(r["variant"], dict) else {}
    return "measurements" if v.get("solver") == "measurements" else v.get("rank_cut", "gap")


def _projres_variant(r: dict) -> str:
    v = r["variant"] if isinstance(r["variant"], dict) else {}
    return next((k for k, pv in PROJRES_VARIANTS.items() if pv == v), "plain")


def label_counts(rs: list[dict]) -> str:
    """``a leaks, b information present, missed, ... of n`` over rows with a computed ``label``, the undetermined
    ones' missing pieces counted in brackets."""
    c = Counter(label_kind(r["label"]) for r in rs)
    why = Counter(r["label"][len("undetermined ("):-1] for r in rs if label_kind(r["label"]) == "undetermined")
    parts = [f"{c[k]} {k}" for k in LABELS if c[k]]
    text = f"{', '.join(parts)} (of {len(rs)})"
    if why:
        text += " -- undetermined: " + "; ".join(f"{n} × {w}" for w, n in why.most_common())
    return text


def reading(rows: list[dict]) -> list[str]:
    """The findings, computed from the rows (each sentence counts what the table shows)."""
    ok = {r["cell"]: r for r in rows if "metrics" in r}
    leak = ("partial", "strong", "exact")

    def count(pred) -> tuple[int, int]:
        sel = [r for r in ok.values() if pred(r)]
        return sum(r["level"] in leak for r in sel), len(sel)

    out = ["**Reading** (every sentence computed from the rows).", ""]
    labelled = [r for r in with_ceilings(list(ok.values())) if r.get("part") in ("text", "image", "projres", "peftleak")
                and r.get("defense") != "none"]
    groups: dict[tuple, list[dict]] = {}
    for r in labelled:
        key = {"text": (0, "UTR" + (f" ({r['model']})" if r.get("model") else " (MiniLM 2 layers)")),
               "image": (1, f"lora_span `{image_variant(r)}`" if r.get("part") == "image" else ""),
               "projres": (2, "ProjRes"), "peftleak": (3, "PEFTLeak")}[r["part"]]
        if r["part"] == "image":
            key = (1, list(IMAGE_VARIANTS).index(image_variant(r)), key[1])
        groups.setdefault(key, []).append(r)
    for key in sorted(groups, key=str):
        out.append(f"- {key[-1]}, defended cells: {label_counts(groups[key])}.")
    if any(r.get("part") == "text" for r in ok.values()):
        for scope in ("per_tensor", "global"):
            for r_ in PRUNE:
                a = count(lambda r: r.get("part") == "text" and r["defense"] == f"top-k {100 * r_:g} % {scope}"
                          and r["variant"] == {"sparsity_aware": True})
                p = count(lambda r: r.get("part") == "text" and r["defense"] == f"top-k {100 * r_:g} % {scope}"
                          and r["variant"] == {"sparsity_aware": False})
                if a[1]:
                    per_model = []
                    for mname in sorted({r.get("model", "minilm") for r in ok.values() if r.get("part") == "text"}):
                        c = count(lambda r: r.get("part") == "text" and r.get("model", "minilm") == mname
                                  and r["defense"] == f"top-k {100 * r_:g} % {scope}"
                                  and r["variant"] == {"sparsity_aware": True})
                        if c[1]:
                            per_model.append(f"{mname} {c[0]} of {c[1]}")
                    out.append(f"- top-k {100 * r_:g} % {scope}: the sparsity-aware word bag leaks (>= partial, "
                               f"beyond its null) in {a[0]} of {a[1]} cells ({', '.join(per_model)}), the plain tests "
                               f"in {p[0]} of {p[1]}.")
        rank = {"none": 0, "partial": 1, "strong": 2, "exact": 3}
        pairs = []  # DP-SGD beside the Gaussian upload noise of its per-coordinate std, same model, seed, B
        for r in ok.values():
            if r.get("part") == "text" and r["defense"].startswith("DP-SGD"):
                g = ok.get(r["cell"].replace("|dpsgd", "|gauss"))
                if g is not None:
                    pairs.append((r, g))
        if pairs:
            same = sum(rank.get(r["level"], -1) >= rank.get(g["level"], -1) for r, g in pairs)
            ks = [(info_limit(r).get("directions_above_edge"), info_limit(g).get("directions_above_edge"))
                  for r, g in pairs]
            fewer = sum(a is not None and b is not None and a < b for a, b in ks)
            known = sum(a is not None and b is not None for a, b in ks)
            out.append(f"- DP-SGD (its noise read from the declared `defense:` section) beside the Gaussian upload "
                       f"noise of its per-coordinate std σC/B (same model, seed, B): DP-SGD's level reaches the "
                       f"Gaussian's in {same} of {len(pairs)} pairs; it leaves fewer directions above the edge in "
                       f"{fewer} of the {known} pairs where both were measured.")
            tiny = sorted(((r.get("model", ""), r["seed"], r["B"], r["level"], g["level"]) for r, g in pairs
                           if "dpsgd1e-06" in r["cell"]), key=str)
            if tiny:
                out.append("- DP-SGD sigma 1e-6 / its matched Gaussian, per (seed, B): " + ", ".join(
                    f"{(m + ' ') if m else ''}seed {sd} ({split_of(sd)}) B {b}: {a} / {g}" for m, sd, b, a, g in tiny)
                    + ".")
        pg = [r for r in ok.values() if r.get("part") == "text" and r["defense"].startswith("DP-Gaussian")]
        if pg:
            ks = sorted({fmt(info_limit(r).get("directions_above_edge"), "g") for r in pg})
            out.append(f"- The paper's literal DP-Gaussian (sigma 0.01, C 1): >= partial in "
                       f"{sum(r['level'] in leak for r in pg)} of {len(pg)} cells; directions of the embedding "
                       f"adapter above the edge: {', '.join(ks)}.")
        zero = [r for r in ok.values() if r.get("part") == "text" and info_limit(r).get("drowning_noise_std_all") == 0.0]
        if zero:
            by = Counter(r["defense"] for r in zero)
            out.append(f"- The embedding adapter's upload is all zero (nothing left on the tensor the word bag reads) in "
                       f"{len(zero)} cells: " + ", ".join(f"{d} {n}" for d, n in sorted(by.items())) + ".")
    if any(r.get("part") == "image" for r in ok.values()):
        for cut in IMAGE_VARIANTS:
            c = count(lambda r: r.get("part") == "image" and r["defense"] != "none" and image_variant(r) == cut)
            if c[1]:
                out.append(f"- lora_span, `{cut}`: >= partial in {c[0]} of {c[1]} noisy cells.")
        gains = []
        for r in ok.values():
            if r.get("part") == "image" and isinstance(r["variant"], dict) and r["variant"] == {"rank_cut": "tokens"}:
                g = ok.get(r["cell"].replace("-tokens|", "-gap|"))
                if g is not None:
                    gains.append(r["metrics"].get("psnr_max", 0) - g["metrics"].get("psnr_max", 0))
        if gains:
            out.append(f"- The token-count cut (truncated SVD) against the exact solver's gap cut on the same upload: "
                       f"PSNR {min(gains):+.1f} to {max(gains):+.1f} dB (median {sorted(gains)[len(gains) // 2]:+.1f}).")
        ceil = [r for r in ok.values() if r.get("part") == "image-ceiling"]
        if ceil:
            ks = sorted(r.get("K", 0) for r in ceil)
            out.append(f"- Oracle ceilings (the undefended upload's K strongest directions, K {ks[0]}-{ks[-1]}): "
                       f">= partial in {sum(r['level'] in leak for r in ceil)} of {len(ceil)}; the weakest "
                       f"{min(r['metrics'].get('psnr_max', float('inf')) for r in ceil):.1f} dB.")
        for seed in sorted({r["seed"] for r in ok.values() if r.get("part") == "image"}):
            noisy = [r for r in ok.values() if r.get("part") == "image" and r["seed"] == seed and r["defense"] != "none"]
            if not noisy:
                continue
            top = []
            for cut in IMAGE_VARIANTS:
                rs = [r for r in noisy if image_variant(r) == cut]
                fs = [noise_factor(r) for r in rs if r["level"] in leak]
                if rs:
                    top.append(f"`{cut}` {max(fs):g}x" if fs else f"`{cut}` at no noise level")
            ks = sorted({(noise_factor(r), info_limit(r).get("directions_above_edge")) for r in noisy
                         if info_limit(r).get("directions_above_edge") is not None})
            out.append(f"- Seed {seed} ({noisy[0]['split']}): the largest noise (x drowning std) still >= partial: "
                       + ", ".join(top) + "." + (" Directions above the edge per noise level: "
                                                 + ", ".join(f"{f:g}x {k:g}" for f, k in ks) + "." if ks else ""))
    pr = [r for r in ok.values() if r.get("part") == "projres" and r["defense"] != "none"]
    if pr:
        rank = {"none": 0, "partial": 1, "strong": 2, "exact": 3, "undefined": -1}
        pairs = {}
        for r in pr:
            pairs.setdefault((r["seed"], r["defense"]), {})[_projres_variant(r)] = rank.get(r["level"], -1)
        raised = [k for k, v in pairs.items() if max(v.get("residual", -1), v.get("chi2", -1)) > v.get("plain", -1)]
        lowered = [k for k, v in pairs.items() if max(v.values()) < v.get("plain", -1)]
        out.append(f"- ProjRes under noise: the best noise-aware score raises the level over the plain residual in "
                   f"{len(raised)} of {len(pairs)} (seed, defense) cells, and the audit's kept level (the strongest "
                   f"of the three) is never below the plain one ({len(lowered)} cells where every noise-aware score "
                   "is weaker than the plain one are covered by running the plain one too).")
        zero = [r for r in pr if info_limit(r).get("directions_above_edge") == 0.0]
        if zero:
            out.append(f"- ProjRes cells whose upload has no direction above any layer's edge (K = 0): {len(zero)}, "
                       f">= partial in {sum(r['level'] in leak for r in zero)} of them (the scores test a candidate's "
                       "known direction, below the edge too).")
        small = [r for r in pr if (_num(r["metrics"].get("nonmembers")) or 1e9) < 100]
        if small:
            n0 = sorted({int(r["metrics"]["nonmembers"]) for r in small})
            out.append(f"- ProjRes's TPR at 1 % FPR is not graded in {len(small)} of {len(pr)} defended cells "
                       f"({', '.join(map(str, n0))} non-members: a 1 % FPR needs 100); their level rests on the AUC "
                       "or the TPR at FPR 0.")
    pc = [r for r in ok.values() if r.get("part") == "projres-ceiling"]
    if pc:
        ks = sorted(r.get("K", 0) for r in pc)
        out.append(f"- ProjRes oracle ceilings (the undefended upload, each layer's K strongest directions, K {ks[0]}-"
                   f"{ks[-1]} over the layers): >= partial in {sum(r['level'] in leak for r in pc)} of {len(pc)}; the "
                   f"weakest AUC {min(r['metrics'].get('auc', float('nan')) for r in pc):.3f}.")
    pl = [r for r in ok.values() if r.get("part") == "peftleak" and isinstance(r["variant"], dict)]
    if pl:
        for mode, words in (("none", "the exact recovery"), ("public", "the noise mode")):
            c = count(lambda r: r.get("part") == "peftleak" and isinstance(r["variant"], dict)
                      and r["variant"].get("noise") == mode)
            rec = [r["metrics"].get("patch_recovery_rate") or 0 for r in pl if r["variant"].get("noise") == mode]
            out.append(f"- PEFTLeak under Gaussian upload noise, {words}: >= partial in {c[0]} of {c[1]} cells; "
                       f"patches recovered in {sum(x > 0 for x in rec)} of {len(rec)}.")
        for split in sorted({r["split"] for r in pl}):
            for mode in ("none", "public"):
                last = [r["metrics"].get("noise_std_used") or float(r["defense"].split()[-1]) for r in pl
                        if r["split"] == split and r["variant"].get("noise") == mode
                        and (r["metrics"].get("patch_recovery_rate") or 0) >= 0.5]
                out.append(f"- {split}, {'exact recovery' if mode == 'none' else 'noise mode'}: half the patches or "
                           f"more recovered up to std {max(last):g}." if last else
                           f"- {split}, {'exact recovery' if mode == 'none' else 'noise mode'}: under half the "
                           "patches recovered at every std.")
        pc = [r for r in ok.values() if r.get("part") == "peftleak-ceiling"]
        if pc:
            ks = sorted(r.get("K", 0) for r in pc)
            out.append(f"- PEFTLeak oracle ceilings (the undefended upload's K strongest bins, K {ks[0]}-{ks[-1]}): "
                       f">= partial in {sum(r['level'] in leak for r in pc)} of {len(pc)}; patches recovered "
                       f"{min(r['metrics'].get('patch_recovery_rate') or 0 for r in pc):.3f}-"
                       f"{max(r['metrics'].get('patch_recovery_rate') or 0 for r in pc):.3f}.")
            for seed in sorted({r["seed"] for r in pl}):
                noisy = [r for r in pl if r["seed"] == seed and info_limit(r).get("directions_above_edge") is not None]
                ks = sorted({(float(r["defense"].split()[-1]), info_limit(r)["directions_above_edge"]) for r in noisy})
                if ks:
                    out.append(f"- PEFTLeak seed {seed} ({noisy[0]['split']}): bins above the edge per std: "
                               + ", ".join(f"{s:g} {k:g}" for s, k in ks) + ".")
    out.append("")
    return out


def selected(args, todo: list) -> list:
    """The cells of ``todo`` that ``--cells`` selects (all without it)."""
    if not args.cells:
        return todo
    return [t for t in todo if any(fnmatch.fnmatchcase(t[0]["cell"], pat) for pat in args.cells)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_args(ap, "defended")
    ap.add_argument("--only", choices=("text", "models", "text-ceilings", "image", "peftleak", "projres"),
                    default=None, help="one part; 'text' and 'models' run their oracle ceilings after their cells, "
                    "'text-ceilings' only the ceilings the JSONL's text rows need")
    ap.add_argument("--cells", nargs="+", metavar="PATTERN", default=None,
                    help="run only the cells whose id matches one of these shell-style patterns (e.g. "
                         "'text|smollm2|none|B4|*'); the tables still read every row of the JSONL")
    ap.add_argument("--redo", action="store_true",
                    help="rerun the selected cells even if the JSONL has them finished (their new rows supersede the "
                         "old ones; other cells are kept), e.g. --only peftleak --cells 'peftleak|*-public|*'")
    args = ap.parse_args()
    args.out = resolve_out(args.out)
    jsonl = args.out / "defended.jsonl"
    if getattr(args, "fresh", False):
        start_fresh(jsonl)
    if not args.report_only:
        todo = []
        if args.only in (None, "text"):
            todo += [(row, run_one, (raw, str(args.out / "defended" / row["cell"].replace("|", "_"))))
                     for row, raw in text_cells(args)]
        if args.only in (None, "models"):
            todo += [(row, run_one, (raw, str(args.out / "defended" / row["cell"].replace("|", "_"))))
                     for row, raw in model_cells(args)]
        if args.only in (None, "image"):
            first = selected(args, [(row, run_one, (raw, str(args.out / "defended" / row["cell"].replace("|", "_"))))
                                    for row, raw in image_cells(args, {})])
            if args.check:
                todo += first
            else:
                run_cells(jsonl, first, fill, label="defended (image, undefended)", redo=args.redo,
                          error_fields={"revision": REV})
            done = {r["seed"]: r["metrics"].get("drowning_noise_std_block0_lora_A") for r in latest_rows(jsonl)
                    if r.get("part") == "image" and r.get("defense") == "none" and "metrics" in r}
            drowning = {k: v for k, v in done.items() if v}
            noisy = [(row, run_one, (raw, str(args.out / "defended" / row["cell"].replace("|", "_"))))
                     for row, raw in image_cells(args, drowning) if row["defense"] != "none"]
            if args.check:
                todo += noisy
            else:  # the ceilings need the noisy uploads' directions above the edge: run those first
                run_cells(jsonl, selected(args, noisy), fill, label="defended (image, noisy)", redo=args.redo,
                          error_fields={"revision": REV})
            todo += [(row, run_one, (raw, str(args.out / "defended" / row["cell"].replace("|", "_"))))
                     for row, raw in image_cells(args, drowning, ceiling_ks(latest_rows(jsonl)))
                     if row["part"] == "image-ceiling"]
        if args.only in (None, "projres"):
            todo += [(row, run_one, (raw, str(args.out / "defended" / row["cell"].replace("|", "_"))))
                     for row, raw in projres_cells(args)]
        if args.only in (None, "peftleak"):
            todo += [(row, run_one, (raw, str(args.out / "defended" / row["cell"].replace("|", "_"))))
                     for row, raw in peftleak_cells(args)]
        todo = selected(args, todo)
        if args.check:
            print(f"{len(todo)} cells")
            return
        run_cells(jsonl, todo, fill, label="defended", redo=args.redo, error_fields={"revision": REV})
        if args.only in (None, "peftleak"):  # PEFTLeak's ceilings need the noisy uploads' K: after them
            ceil = [(row, run_one, (raw, str(args.out / "defended" / row["cell"].replace("|", "_"))))
                    for row, raw in peftleak_cells(args, peftleak_ceiling_ks(latest_rows(jsonl)))
                    if row["part"] == "peftleak-ceiling"]
            run_cells(jsonl, selected(args, ceil), fill, label="defended (PEFTLeak ceilings)", redo=args.redo,
                      error_fields={"revision": REV})
        if args.only in (None, "projres"):  # ProjRes's ceilings need the noisy uploads' per-layer K: after them
            ceil = [(row, run_one, (raw, str(args.out / "defended" / row["cell"].replace("|", "_"))))
                    for row, raw in projres_cells(args, projres_ceiling_ks(latest_rows(jsonl)))]
            run_cells(jsonl, selected(args, ceil), fill, label="defended (ProjRes ceilings)", redo=args.redo,
                      error_fields={"revision": REV})
        if args.only in (None, "text", "models", "text-ceilings"):  # the ceilings need the noisy rows' K: after them
            want = {None: None, "text": False, "models": True, "text-ceilings": None}[args.only]
            ks = {key: v for key, v in text_ceiling_ks(latest_rows(jsonl)).items()
                  if want is None or bool(key[0]) == want}
            ceil = [(row, run_one, (raw, str(args.out / "defended" / row["cell"].replace("|", "_"))))
                    for row, raw in text_ceiling_cells(args, ks)]
            if args.only == "text-ceilings":  # --cells / --redo select among the ceilings themselves
                ceil = selected(args, ceil)
            run_cells(jsonl, ceil, fill, label="defended (text ceilings)",
                      redo=args.redo and args.only == "text-ceilings", error_fields={"revision": REV})
    rows = latest_rows(jsonl)
    (args.out / "defended.json").write_text(json.dumps(rows, indent=1, default=str))
    write_section(args, "defended", table(rows), "The exact attacks under defenses (UTR Table 3, lora_span)",
                  "defended")
    print(f"{len(rows)} rows in {display(jsonl)}")


if __name__ == "__main__":
    main()
