"""The null beside every headline of docs/REPRODUCTION.md (docs/DESIGN.md §6): what chance scores on the same metric,
matched the same way, in the same setting as the benchmark cell.

Chance is computed from the cell's own data (its recorded command or config, resolved by the project's loader):
the originals are the attacked client's private samples (client 0, trial 0) and the chance reconstructions are drawn
from the same source's held-out pool that no client holds (``ImageData/TextData.null_pool``), with the evaluators'
null functions (:mod:`gradleak.evaluation.nulls`), 1000 seeded draws (patches: 200):

* PEFTLeak (patches): N random held-out images cut into the model's patches, each placed at its own position and
  grouped by image, scored by :func:`gradleak.metrics.patches.patch_recovery` at the cell's PSNR threshold.
* images (lora_span, LoRA-ViT optimisation attacks): N random held-out images, Hungarian on MSE (the images
  evaluator's matching); PSNR / SSIM means.
* text (UTR, DAGER, LAMP): N random sentences no client holds, ROUGE-1/2 F1 with the evaluator's matching.
* membership (ProjRes): random member sets of the same size (label permutations; the AUC and TPR nulls depend only on
  the member / non-member counts).
* leakage (RDLV): see the leakage section's own "Against the null" table (computed by ``benchmarks/leakage.py``).

``python benchmarks/nulls.py --update-docs`` (a few minutes on 2 cores; writes benchmarks/out/nulls.json);
``--only utr`` recomputes one paper's rows and keeps the others' stored ones.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import REVISION_NOTE, ROOT, revision, revision_label, write_section  # noqa: E402
from gradleak.attacks.dager import NOT_APPLICABLE  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
DRAWS = 1000
PATCH_DRAWS = 200


def config_from_command(command: str):
    """The validated config of a recorded ``gradleak run CONFIG --set ...`` command."""
    from gradleak.config.loading import load_yaml
    from gradleak.run.runner import validate

    toks = shlex.split(command.replace("OMP_NUM_THREADS=1 ", ""))
    i = toks.index("run")
    path, sets = toks[i + 1], [toks[j + 1] for j, t in enumerate(toks) if t == "--set"]
    return validate(load_yaml(ROOT / path), sets)[1]


def config_from_dict(raw: dict):
    from gradleak.run.runner import validate

    return validate(json.loads(json.dumps(raw)), [])[1]


def _quantiles(a: np.ndarray, value: float | None) -> dict:
    a = np.asarray(a, dtype=float)
    a = a[np.isfinite(a)]
    out = {"null_median": float(np.median(a)) if a.size else float("nan"),
           "null_p99": float(np.quantile(a, 0.99)) if a.size else float("nan"), "draws": int(a.size)}
    if value is not None and a.size:
        out["value"] = float(value)
        out["p_value"] = float((1 + (a >= value).sum()) / (1 + a.size))
        out["beyond_null"] = bool(value > out["null_p99"])
    return out


def _image_pool(cfg):
    from gradleak.data.splits import ImageData

    data = ImageData(cfg)
    x, _ = data.clients(0, 1 << 30)[0]
    pool, source = data.null_pool(0)
    return x.float(), pool.float(), source


def image_null_setting(cfg, values: dict[str, float | None], best: bool = False,
                       trivial: float | None = None) -> dict:
    """The null of a setting's image scores: the batch mean (``best=False``), or the best image (``best=True``, the
    audit's ``psnr_max`` / ``ssim_max``), whose PSNR bar is also the trivial images' best (``trivial``: grey, flat,
    mean public; :func:`gradleak.evaluation.levels.bar`) -- then "beyond" means above both."""
    from gradleak.evaluation.nulls import image_null

    x, pool, source = _image_pool(cfg)
    nul = image_null(x, pool, n=len(x), match="hungarian", draws=DRAWS, seed=cfg.seed + 17)
    out = {"source": source, "n": len(x), "headline": "best image" if best else "batch mean",
           **{k: _quantiles(nul[f"{k}_max" if best else k], values.get(k)) for k in ("psnr", "ssim")}}
    if best and trivial is not None and "value" in out["psnr"]:
        q = out["psnr"]
        q["trivial_bar"] = float(trivial)
        q["beyond_null"] = bool(q["value"] > max(q["null_p99"], float(trivial)))
    return out


def patch_null_setting(cfg, values: dict[str, float | None]) -> dict:
    from gradleak.evaluation.nulls import draw_subsets
    from gradleak.metrics.patches import image_to_patches, patch_psnr, patch_recovery

    x, pool, source = _image_pool(cfg)
    P = cfg.model.patch_size or 16
    truth = image_to_patches(x * 2 - 1, P)
    B, N, _ = truth.shape
    picks = draw_subsets(len(pool), B, PATCH_DRAWS, cfg.seed + 17)  # distinct within a draw when the pool allows it
    rate, best = np.empty(PATCH_DRAWS), np.empty(PATCH_DRAWS)
    positions = torch.arange(1, N + 1).repeat(B)
    groups = torch.arange(B).repeat_interleave(N)
    for d in range(PATCH_DRAWS):
        pick = torch.as_tensor(picks[d])
        cand = image_to_patches(pool[pick] * 2 - 1, P).reshape(B * N, -1)
        m = patch_recovery(truth, cand, positions, groups, cfg.metrics.psnr_threshold_db)
        rate[d] = m["patch_recovery_rate"]
        best[d] = float(patch_psnr(truth.to(torch.float64)[groups, positions - 1], cand.to(torch.float64)).max())
    return {"source": source, "n": B, "patch_size": P, "pool": len(pool),
            "patch_recovery_rate": _quantiles(rate, values.get("patch_recovery_rate")),
            "patch_psnr_max": _quantiles(best, values.get("patch_psnr"))}


def text_null_setting(cfg, values: dict[str, float | None]) -> dict:
    from gradleak.evaluation.nulls import text_null
    from gradleak.data.splits import TextData

    data = TextData(cfg)
    refs, _ = data.clients(0, 1 << 30)[0]
    pool, source = data.null_pool(0)
    nul = text_null(refs, pool, n=len(refs), draws=DRAWS, seed=cfg.seed + 23)
    return {"source": source, "n": len(refs),
            **{k: _quantiles(nul[k], values.get(k)) for k in ("rouge1_f1", "rouge2_f1")},
            **{f"_draws_{k}": nul[k].tolist() for k in ("rouge1_f1", "rouge2_f1")}}


def membership_null_setting(members: int, nonmembers: int, values: dict[str, float | None], seed: int = 0) -> dict:
    from gradleak.evaluation.nulls import membership_null

    labels = [1] * members + [0] * nonmembers
    scores = np.random.default_rng(seed).random(members + nonmembers)  # no ties: the permutation null is exact
    nul = membership_null(labels, scores, draws=DRAWS, seed=seed + 29, bootstrap=10)
    auc = values.get("auc")
    return {"n": f"{members} / {nonmembers}",
            "auc": _quantiles(nul["auc"], auc),
            "auc_distance": _quantiles(np.abs(nul["auc"] - 0.5), None if auc is None else abs(auc - 0.5)),
            "tpr_at_1pct_fpr": _quantiles(nul["tpr_at_1pct_fpr"], values.get("tpr_at_1pct_fpr"))}


# ------------------------------------------------------------------------------------------------ the settings

def peftleak_rows() -> list[dict]:
    d = json.loads((OUT / "peftleak.json").read_text())
    cells = {c["cell"]: c for c in d["cells"]}
    rows = []
    for cell, label in [("t1-cifar-B32-paper-s0", "Table 1, CIFAR samples, B = 32, paper design (seed 0)"),
                        ("t1-cifar-B32-improved-s0", "Table 1, B = 32, improved design (seed 0)"),
                        ("ho-fmnist-B32-paper-s4", "Table 1 setting, B = 32, paper design (held-out data: 32 "
                         "Fashion-MNIST images no tuned cell drew, seed 4)"),
                        ("f6a-B8-paper-s0", "Fig. 6a, B = 8, paper design"),
                        ("f6a-B128-improved-s0", "Fig. 6a, B = 128 (natural crops), improved design")]:
        c = cells.get(cell)
        if c is None:
            continue
        m = c["metrics"]
        vals = {"patch_recovery_rate": m.get("patch_recovery_rate"), "patch_psnr": m.get("recovered_patch_psnr_median")}
        print(f"peftleak {cell}", flush=True)
        rows.append({"paper": "PEFTLeak", "setting": label, "cell": cell, "command": c["command"],
                     **patch_null_setting(config_from_command(c["command"]), vals)})
    return rows


UTR_GROUPS = {"table1": "Table 1", "table2": "Table 2", "table3": "Table 3 (defenses)", "fig4a": "Fig. 4a",
              "fig4b": "Fig. 4b", "noise": "noise-aware"}
NA_DAGER = f"n/a — not applicable: {NOT_APPLICABLE}"
UTR_METHODS = {"dager_lora": "DAGER (LoRA q+k, 2 layers)",
               "dager_lora_L6": "our encoder search with DAGER's span test (LoRA q+k, 6 layers)",
               "dager_full_L6": "our encoder search with DAGER's span test, full-rank (LoRA rank 384, 6 layers)",
               "dager_frozen": "DAGER (adapters)", "lamp": "LAMP", "lamp_bag": "LAMP + UTR bag"}
#: a UTR value stored before the project's ROUGE F1 keys: marked, and :data:`LEGACY_F1_NOTE` says what it is
LEGACY_F1_MARK = "†"
LEGACY_F1_NOTE = (
    f"{LEGACY_F1_MARK} = not measured in ROUGE F1 as these documents define it (`rouge1_f1` / `rouge2_f1`: "
    "batch-level F1 over every returned sentence, `gradleak.metrics.text.rouge_f1_scores` -- the audit's headline for "
    "text and what the null draws score; the one ROUGE F1 the documents report): the cell's stored row predates it "
    "and holds only `rouge1_f` / `rouge2_f`, another definition (the mean over the private sentences of the "
    "rouge_score package's F-measure against each one's matched candidate, `gradleak.metrics.text.rouge_scores`: "
    "unmatched returned sentences do not lower it), which is neither shown as F1 nor set against this null (its p99 "
    "in brackets), so the row's beyond-chance is not measured. Rerunning the cell "
    "(`python benchmarks/utr.py --out benchmarks/out --cells 'CELL' --rerun`) measures it.")


def utr_setting(r: dict) -> str:
    """A ``benchmarks/utr.py`` row's label, read from its stored config: the method of its cell id and, for UTR (our
    extended search), the reduction factor it ran at (Table 2's ``t2/*/utr/*`` cells run at rf = 1)."""
    key = r["cell"].split("/")[2] if r["cell"].count("/") >= 2 else ""
    if key in ("utr", "utr_rf1"):
        method = f"UTR (our extension) rf={r['config']['peft'].get('reduction_factor', 2)}"
    else:
        method = UTR_METHODS.get(key, key)
    return f"{UTR_GROUPS[r['group']]}: `{r['cell']}` ({method}, B = {r['config']['data']['batch_size']})"


def restate_utr(row: dict, u: dict | None) -> dict:
    """A stored UTR null row as the report shows it, from its cell's row ``u`` of ``utr.json``: the setting rebuilt
    (:func:`utr_setting`) and the project's ROUGE-1/2 F1 (``rouge{n}_f1``, the metric the null draws score) as the
    value where the cell stores it -- older null rows hold ``rouge{n}_f``, another definition; a cell without
    ``rouge{n}_f1`` is marked ``legacy``: the report shows no value for it (:data:`LEGACY_F1_NOTE`)."""
    if u is None or row.get("paper") != "UTR":
        return row
    row = {**row, "setting": utr_setting(u)}
    if row.get("not_applicable"):
        return row
    m = u.get("metrics") or {}
    for k in ("rouge1_f1", "rouge2_f1"):
        q = dict(row.get(k) or {})
        if m.get(k) is not None and q.get("draws"):
            q.update(value=float(m[k]), beyond_null=bool(m[k] > q["null_p99"]))
            q.pop("p_value", None)  # the draws are not stored: no p-value for the new value
        else:
            q["legacy"] = True
        row[k] = q
    return row


def utr_rows() -> list[dict]:
    """Every cell of benchmarks/utr.py's tables with a ROUGE F1 (the text null depends on the cell's own sentences:
    its data, batch size and seed)."""
    u = json.loads((OUT / "utr.json").read_text())
    rows, cache = [], {}
    for r in u:
        m = r.get("metrics") or {}
        if r.get("group") not in UTR_GROUPS or m.get("rouge1_f1", m.get("rouge1_f")) is None or "error" in r:
            continue
        cfg = config_from_dict(r["config"])
        setting = utr_setting(r)
        if m.get("attack_failed") and cfg.attack.name == "dager":  # nothing measured: no value to set beside chance
            rows.append({"paper": "UTR", "setting": setting, "cell": r["cell"], "not_applicable": NA_DAGER})
            continue
        key = (cfg.data.name, cfg.data.batch_size, cfg.seed, cfg.fl.clients, cfg.trials, cfg.data.nonmembers)
        # the project's ROUGE F1 (what the null draws score); rows stored before it: rouge{n}_f (restate_utr marks them)
        vals = {k: m.get(k, m.get(k[:-1])) for k in ("rouge1_f1", "rouge2_f1")}
        print(f"utr {r['cell']}", flush=True)
        if key not in cache:
            cache[key] = text_null_setting(cfg, {})
        base = cache[key]
        out = {k: v for k, v in base.items() if not isinstance(v, dict) and not k.startswith("_")}
        for k in ("rouge1_f1", "rouge2_f1"):  # the cached draws' quantiles, with this cell's value
            q = dict(base[k])
            v = vals.get(k)
            if v is not None and q["draws"]:
                q["value"] = float(v)
                q["beyond_null"] = bool(v > q["null_p99"])
                q["p_value"] = float((1 + (np.asarray(base["_draws_" + k]) >= v).sum()) / (1 + q["draws"]))
            out[k] = q
        rows.append({"paper": "UTR", "setting": setting, "cell": r["cell"], **out})
    return rows


def projres_rows() -> list[dict]:
    d = json.loads((OUT / "projres.json").read_text())
    rows = []
    for c in d["cells"]:
        m = c.get("metrics") or {}
        if m.get("auc") is None or not m.get("members"):
            continue
        print(f"projres {c['cell']}", flush=True)
        rows.append({"paper": "ProjRes", "setting": c["cell"], "cell": c["cell"], "command": c["command"],
                     **membership_null_setting(int(m["members"]), int(m["nonmembers"]),
                                               {"auc": m["auc"], "tpr_at_1pct_fpr": m.get("tpr_at_1pct_fpr")})})
    return rows


def image_rows() -> list[dict]:
    rows = []
    lv = json.loads((OUT / "lora_vit.json").read_text())
    for key, r in lv.items():
        if not isinstance(r, dict) or "psnr_median" not in r:
            continue
        print(f"lora_span {key}", flush=True)
        cmd = r["example_command"]
        if key[:2] != "b1":
            cmd = cmd.replace("cifar_b1.yaml", f"cifar_b1.yaml --set data.batch_size={key[1]}")
        best = "best_psnr_median" in r  # rows that keep the audit's best-image headline (and the trivial images)
        vals = ({"psnr": r["best_psnr_median"], "ssim": r["best_ssim_median"]} if best
                else {"psnr": r.get("psnr_median"), "ssim": r.get("ssim_median")})
        rows.append({"paper": "lora_span", "setting": f"{key} (median of {r['runs']} runs"
                     + (f", best image; trivial-image bar {r['trivial_psnr_median']:.1f} dB)" if best
                        else ", batch mean)"), "cell": key, "command": cmd,
                     **image_null_setting(config_from_command(cmd), vals, best=best,
                                          trivial=r.get("trivial_psnr_median") if best else None)})
    opt = json.loads((OUT / "lora_vit_opt_cpu.json").read_text())
    for key, r in opt.items():
        if not key.startswith("table1/b1/") or "plain" not in r:
            continue
        print(f"lora_vit_opt {key}", flush=True)
        for arm in ("plain", "anchor"):
            ps, ss = r[arm]["psnr"], r[arm]["ssim"]
            if not ps:
                continue
            nul = best_of_runs_null(r["example_command"], len(ps), {"psnr": max(ps), "ssim": max(ss)})
            rows.append({"paper": "LoRA-ViT optimisation",
                         "setting": f"{r['method']} {arm} (best of {len(ps)} seeds, one image each; trivial-image bar "
                                    f"{nul['psnr']['trivial_bar']:.1f} dB)",
                         "cell": key, "command": r["example_command"], **nul})
    return rows


def best_of_runs_null(command: str, k: int, values: dict[str, float]) -> dict:
    """The null of the best of ``k`` B = 1 runs whose seed ``K`` also draws the victim (``data.seed=K seed=K``, K < k):
    per draw, the best over the k victims of one random public image each, matched the same way (each victim's own
    1000 draws, :func:`gradleak.evaluation.nulls.image_null`); its PSNR bar is also the trivial images' best over the
    k victims (:func:`gradleak.evaluation.nulls.reference_images`: grey, flat, mean public) -- the audit's best-image
    rule applied to the best of k runs."""
    import re

    from gradleak.evaluation.images import IMAGE_REFS
    from gradleak.evaluation.nulls import image_null, reference_images

    draws = {"psnr": [], "ssim": []}
    trivial, sources = [], set()
    for seed in range(k):
        cmd = re.sub(r"data\.seed=\d+", f"data.seed={seed}", re.sub(r"(?<![.\w])seed=\d+", f"seed={seed}", command))
        cfg = config_from_command(cmd)
        assert (cfg.seed, cfg.data.seed) == (seed, seed), cmd
        x, pool, source = _image_pool(cfg)
        sources.add(source)
        nul = image_null(x, pool, n=len(x), match="hungarian", draws=DRAWS, seed=cfg.seed + 17)
        draws["psnr"].append(nul["psnr_max"])
        draws["ssim"].append(nul["ssim_max"])
        ref = reference_images(x, pool)
        trivial.append(max(ref[f"psnr_max_{name}"] for name in IMAGE_REFS if f"psnr_max_{name}" in ref))
    out = {"source": "; ".join(sorted(sources)), "n": k, "headline": f"best of {k} runs",
           **{m: _quantiles(np.max(np.stack(draws[m]), axis=0), values.get(m)) for m in ("psnr", "ssim")}}
    q = out["psnr"]
    q["trivial_bar"] = float(max(trivial))
    if "value" in q:
        q["beyond_null"] = bool(q["value"] > max(q["null_p99"], q["trivial_bar"]))
    return out


def _cell(q: dict | None, spec: str = ".3g", pct: bool = False) -> str:
    """``ours (null p99)``; ours in bold when beyond the null."""
    if not q:
        return "–"
    f = (lambda v: f"{100 * v:.1f} %") if pct else (lambda v: format(v, spec))
    v = q.get("value")
    if q.get("legacy"):  # another ROUGE definition's value: not shown as this metric (LEGACY_F1_NOTE)
        return f"–{LEGACY_F1_MARK} ({f(q['null_p99'])})"
    if v is None or v != v:
        return f"– ({f(q['null_p99'])})"
    return (f"**{f(v)}**" if q.get("beyond_null") else f(v)) + f" ({f(q['null_p99'])})"


#: per table, the one metric whose test says "beyond chance" -- no OR over the columns: the headline the audit grades
#: for the reconstruction kind (:func:`gradleak.run.audit.headline_metric`, rules in :mod:`gradleak.evaluation.levels`)
#: as the stored rows hold it. Text: ROUGE-1 F1. Membership: the AUC both ways, abs(AUC - 0.5) (the grade's
#: ``auc_distance``: an inverted signal leaks too). Patches and images: PSNR (the audit's ``psnr_max``, best-image
#: PSNR; these rows hold the recovered patches' median PSNR / the matched batch's mean PSNR, see :func:`report`).
DECIDES = {"PEFTLeak": "patch_psnr_max", "UTR": "rouge1_f1", "ProjRes": "auc_distance", "lora_span": "psnr",
           "LoRA-ViT optimisation": "psnr"}


def _leaks(r: dict) -> bool | None:
    """Beyond the null on the deciding metric; None when the row holds no value of it (LEGACY_F1_NOTE)."""
    q = r.get(DECIDES[r["paper"]]) or {}
    return None if q.get("legacy") else bool(q.get("beyond_null"))


VERDICT = {True: "yes", False: "no", None: f"not measured{LEGACY_F1_MARK}"}


TABLES = [  # (paper, header, metric keys with their format)
    ("PEFTLeak", ["patch recovery", "patch PSNR dB (null: best chance patch)"],
     [("patch_recovery_rate", ".3g", True), ("patch_psnr_max", ".1f", False)]),
    ("UTR", ["ROUGE-1 F1", "ROUGE-2 F1"], [("rouge1_f1", ".1f", False), ("rouge2_f1", ".1f", False)]),
    ("ProjRes", ["members / non-members", "AUC", "abs(AUC − 0.5)", "TPR @ 1 % FPR"],
     [("n", None, False), ("auc", ".3f", False), ("auc_distance", ".3f", False), ("tpr_at_1pct_fpr", ".3f", False)]),
    ("lora_span", ["PSNR dB", "SSIM"], [("psnr", ".1f", False), ("ssim", ".3f", False)]),
    ("LoRA-ViT optimisation", ["PSNR dB", "SSIM"], [("psnr", ".1f", False), ("ssim", ".3f", False)]),
]


def report(rows: list[dict]) -> str:
    lines = ["Generated by `benchmarks/nulls.py` (docs/DESIGN.md §6). Every headline of the sections below, beside what chance "
             "scores on the same metric in the same setting, matched the same way (the evaluators' null functions, "
             "`gradleak.evaluation.nulls`): the chance reconstructions are random samples of the private set's own "
             f"source that no client holds ({DRAWS} seeded draws; PEFTLeak patches {PATCH_DRAWS}); membership: random "
             "member sets of the same size. Each cell reads **ours** (the null's 99th percentile); bold = beyond it. "
             "An AUC below 0.5 beyond the null of abs(AUC − 0.5) is an inverted signal and leaks too. The leakage "
             "quantification section has its own table (RDLV, best-of-N). Each row's cell and command: "
             "`benchmarks/out/nulls.json`.", "",
             "**Beyond chance** is decided by one metric per table, the headline the audit grades for that "
             "reconstruction kind (`gradleak.run.audit.headline_metric`, rules in `gradleak.evaluation.levels`), not "
             "by whichever column clears its null: UTR -- ROUGE-1 F1 (the project's, `rouge1_f1`); ProjRes -- the AUC "
             "read both ways, abs(AUC − 0.5), as the audit's grade reads it; PEFTLeak and the image attacks -- PSNR. "
             "The audit's image headline is best-image PSNR (`psnr_max`), whose bar also counts the grey, mean public "
             "and flat images. lora_span rows marked *best image* are graded that way: the median over runs of the "
             "best image's PSNR / SSIM against the null of the best of as many random public images (matched the same "
             "way), and beyond only when the PSNR also clears the trivial images' best; rows marked *batch mean* were "
             "stored before the rows kept the best image, and compare the matched batch's mean PSNR with the null of "
             "that mean (the same as best-image PSNR at B = 1). PEFTLeak rows store the recovered patches' median "
             "PSNR against the best chance patch; the LoRA-ViT optimisation rows (B = 1, each seed its own victim image) the "
             "best seed's PSNR / SSIM against the null of the best of as many runs (per draw, the best over the seeds' "
             "victims of one random public image each) and, for PSNR, the trivial images' best over those victims.",
             "", REVISION_NOTE, ""]
    for paper, heads, keys in TABLES:
        mine = [r for r in rows if r["paper"] == paper]
        if not mine:
            continue
        lines += [f"### {paper}", "", "| setting | " + " | ".join(heads) + " | beyond chance | revision |",
                  "|---|" + "---|" * len(heads) + "---|---|"]
        for r in mine:
            if r.get("not_applicable"):
                lines.append(f"| {r['setting']} | " + " | ".join([r["not_applicable"]] * len(heads))
                             + f" | n/a | {revision_label(r)} |")
                continue
            cells = [str(r.get(k, "–")) if spec is None else _cell(r.get(k), spec, pct) for k, spec, pct in keys]
            lines.append(f"| {r['setting']} | " + " | ".join(cells) + f" | {VERDICT[_leaks(r)]} | {revision_label(r)} |")
        lines.append("")
        if any((r.get(k) or {}).get("legacy") for r in mine for k, _, _ in keys if isinstance(r.get(k), dict)):
            lines += [f"*{LEGACY_F1_NOTE}*", ""]
    lines += ["**Who leaks, restated against the null** (per paper; a comparison between arms that are both at "
              "chance is not a conclusion):", ""]
    for paper in dict.fromkeys(r["paper"] for r in rows):
        na = [r["setting"] for r in rows if r["paper"] == paper and r.get("not_applicable")]
        mine = [r for r in rows if r["paper"] == paper and not r.get("not_applicable")]
        no = [r["setting"] for r in mine if _leaks(r) is False]
        unmeasured = [r for r in mine if _leaks(r) is None]
        text = f"- {paper}: {sum(_leaks(r) is True for r in mine)} of {len(mine)} settings beyond chance"
        text += "." if not no else "; at chance: " + "; ".join(no) + "."
        if unmeasured:
            text += (f" Not measured in `{DECIDES[paper]}` ({len(unmeasured)}, marked {LEGACY_F1_MARK}: stored before "
                     "it; rerun to measure).")
        if na:
            text += f" Not applicable ({len(na)}, nothing measured): " + "; ".join(na) + "."
        lines.append(text)
    return "\n".join(lines)


#: --only groups: the function computing them and the papers their rows carry
GROUPS = {"peftleak": (peftleak_rows, ("PEFTLeak",)), "utr": (utr_rows, ("UTR",)),
          "projres": (projres_rows, ("ProjRes",)), "images": (image_rows, ("lora_span", "LoRA-ViT optimisation"))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--report-only", action="store_true", help="rewrite the docs section from nulls.json")
    ap.add_argument("--update-docs", action="store_true", help="compute, then rewrite the docs section")
    ap.add_argument("--only", default="", help=f"comma list of {','.join(GROUPS)}: recompute these, keep the other "
                    "papers' rows of the stored nulls.json")
    args = ap.parse_args(argv)
    only = set(filter(None, args.only.split(",")))
    if only - set(GROUPS):
        ap.error(f"--only: unknown group(s) {', '.join(sorted(only - set(GROUPS)))}")
    torch.set_num_threads(1)
    path = args.out / "nulls.json"
    if args.report_only:
        rows = json.loads(path.read_text())
    else:
        stored = json.loads(path.read_text()) if only and path.exists() else []
        rows, rev = [], revision()  # every computed row records the code revision that computed it
        for group, (compute, papers) in GROUPS.items():
            rows += ([{**r, "revision": rev} for r in compute()] if not only or group in only
                     else [r for r in stored if r["paper"] in papers])
        path.write_text(json.dumps(rows, indent=1, default=str))
        print(f"wrote {path}", flush=True)
    utr = {r["cell"]: r for r in json.loads((OUT / "utr.json").read_text())} if (OUT / "utr.json").exists() else {}
    rows = [restate_utr(r, utr.get(r["cell"])) for r in rows]  # labels and ROUGE F1 from the cells' stored rows
    write_section(args, "nulls", report(rows), "Against the null: every headline beside chance", "nulls")
    return 0


if __name__ == "__main__":
    sys.exit(main())
