"""The null beside every headline of docs/REPRODUCTION.md (issue 26): what chance scores on the same metric,
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

``python benchmarks/nulls.py --update-docs`` (a few minutes on 2 cores; writes benchmarks/out/nulls.json).
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
from _bench import ROOT, write_section  # noqa: E402

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


def image_null_setting(cfg, values: dict[str, float | None]) -> dict:
    from gradleak.evaluation.nulls import image_null

    x, pool, source = _image_pool(cfg)
    nul = image_null(x, pool, n=len(x), match="hungarian", draws=DRAWS, seed=cfg.seed + 17)
    return {"source": source, "n": len(x), **{k: _quantiles(nul[k], values.get(k)) for k in ("psnr", "ssim")}}


def patch_null_setting(cfg, values: dict[str, float | None]) -> dict:
    from gradleak.attacks.peftleak import image_to_patches
    from gradleak.evaluation.nulls import draw_subsets
    from gradleak.metrics.patches import patch_recovery

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
        mse = ((truth.to(torch.float64)[groups, positions - 1] - cand.to(torch.float64)) ** 2).mean(-1) / 4.0
        best[d] = float((10 * torch.log10(1.0 / mse.clamp_min(1e-30))).max())
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
            **{k: _quantiles(nul[k], values.get(k)) for k in ("rouge1_f1", "rouge2_f1")}}


def membership_null_setting(members: int, nonmembers: int, values: dict[str, float | None], seed: int = 0) -> dict:
    from gradleak.evaluation.nulls import membership_null

    labels = [1] * members + [0] * nonmembers
    scores = np.random.default_rng(seed).random(members + nonmembers)  # no ties: the permutation null is exact
    nul = membership_null(labels, scores, draws=DRAWS, seed=seed + 29, bootstrap=10)
    return {"n": f"{members} / {nonmembers}",
            "auc": _quantiles(nul["auc"], values.get("auc")),
            "tpr_at_1pct_fpr": _quantiles(nul["tpr_at_1pct_fpr"], values.get("tpr_at_1pct_fpr"))}


# ------------------------------------------------------------------------------------------------ the settings

def peftleak_rows() -> list[dict]:
    d = json.loads((OUT / "peftleak.json").read_text())
    cells = {c["cell"]: c for c in d["cells"]}
    rows = []
    for cell, label in [("t1-cifar-B32-paper-s0", "Table 1, CIFAR samples, B = 32, paper design (seed 0)"),
                        ("t1-cifar-B32-improved-s0", "Table 1, B = 32, improved design (seed 0)"),
                        ("t1-cifar-B32-paper-s4", "Table 1, B = 32, paper design (held-out seed 4)"),
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


def utr_rows() -> list[dict]:
    u = json.loads((OUT / "utr.json").read_text())
    by = {r["cell"]: r for r in u}
    rows = []
    for B in (1, 2, 4, 8):
        for model in ("minilm", "smollm2"):
            for method, label in [("utr", "UTR rf=2"), ("dager_lora", "DAGER (LoRA on query)"), ("lamp", "LAMP")]:
                r = by.get(f"t1/{model}/{method}/B{B}")
                if r is None or r["metrics"].get("rouge1_f") is None:
                    continue
                m = r["metrics"]
                vals = {"rouge1_f1": m.get("rouge1_f"), "rouge2_f1": m.get("rouge2_f")}
                print(f"utr {r['cell']}", flush=True)
                rows.append({"paper": "UTR", "setting": f"Table 1, {model}, B = {B}, {label}", "cell": r["cell"],
                             **text_null_setting(config_from_dict(r["config"]), vals)})
    return rows


def projres_rows() -> list[dict]:
    d = json.loads((OUT / "projres.json").read_text())
    rows = []
    for c in d["cells"]:
        if "main" not in c.get("tables", []) and not c["cell"].endswith("/none"):
            continue
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
    for key in ("b1/r128/p4/qv", "b2/r128/p4/qv", "b4/r128/p4/qv"):
        r = lv.get(key)
        if not r:
            continue
        print(f"lora_span {key}", flush=True)
        cmd = r["example_command"]
        if key[:2] != "b1":
            cmd = cmd.replace("cifar_b1.yaml", f"cifar_b1.yaml --set data.batch_size={key[1]}")
        rows.append({"paper": "lora_span", "setting": f"{key} (median of {r['runs']} runs)", "cell": key,
                     "command": cmd, **image_null_setting(config_from_command(cmd),
                                                          {"psnr": r.get("psnr_median"), "ssim": r.get("ssim_median")})})
    opt = json.loads((OUT / "lora_vit_opt_cpu.json").read_text())
    for key, r in opt.items():
        if not key.startswith("table1/b1/") or "plain" not in r:
            continue
        print(f"lora_vit_opt {key}", flush=True)
        for arm in ("plain", "anchor"):
            ps, ss = r[arm]["psnr"], r[arm]["ssim"]
            if not ps:
                continue
            rows.append({"paper": "LoRA-ViT optimisation", "setting": f"{r['method']} {arm} (best of {len(ps)} seeds)",
                         "cell": key, "command": r["example_command"],
                         **image_null_setting(config_from_command(r["example_command"]),
                                              {"psnr": max(ps), "ssim": max(ss)})})
    return rows


def _fmt(q: dict, pct: bool = False) -> tuple[str, str, str, str]:
    f = (lambda v: f"{100 * v:.1f} %") if pct else (lambda v: f"{v:.3g}")
    v = q.get("value")
    if v is None or v != v:
        return "–", f(q["null_median"]), f(q["null_p99"]), "–"
    return f(v), f(q["null_median"]), f(q["null_p99"]), ("**yes**" if q["beyond_null"] else "no") + f" (p = {q['p_value']:.3g})"


def report(rows: list[dict]) -> str:
    lines = ["Generated by `benchmarks/nulls.py` (issue 26). Each headline of the sections below, beside what chance "
             "scores on the same metric in the same setting, matched the same way (the evaluators' null functions, "
             "`gradleak.evaluation.nulls`): the chance reconstructions are random samples of the private set's own "
             f"source that no client holds ({DRAWS} seeded draws; PEFTLeak patches {PATCH_DRAWS}). 'beyond' means "
             "above the null's 99th percentile; p is the share of draws at or above ours (+1 smoothing). The "
             "leakage quantification section has its own table (RDLV, best-of-N). Commands: each row's cell in "
             "`benchmarks/out/nulls.json`.", "",
             "| paper | setting | metric | ours | null median | null p99 | beyond the null |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        metrics = [("patch_recovery_rate", "patch recovery", True), ("patch_psnr_max", "patch PSNR (ours: median of "
                    "recovered; null: best chance patch) dB", False), ("psnr", "PSNR dB", False), ("ssim", "SSIM", False),
                   ("rouge1_f1", "ROUGE-1 F1", False), ("rouge2_f1", "ROUGE-2 F1", False), ("auc", "AUC", False),
                   ("tpr_at_1pct_fpr", "TPR @ 1 % FPR", False)]
        for key, name, pct in metrics:
            if key in r:
                lines.append(f"| {r['paper']} | {r['setting']} | {name} | " + " | ".join(_fmt(r[key], pct)) + " |")
    def leaks(r):
        return any(v.get("beyond_null") for v in r.values() if isinstance(v, dict) and "beyond_null" in v)

    lines += ["", "**Who leaks, restated against the null** (per paper; a comparison between arms that are both at "
              "chance is not a conclusion):", ""]
    for paper in dict.fromkeys(r["paper"] for r in rows):
        mine = [r for r in rows if r["paper"] == paper]
        yes = [r for r in mine if leaks(r)]
        no = [r["setting"] for r in mine if not leaks(r)]
        text = f"- {paper}: {len(yes)} of {len(mine)} settings beyond chance"
        text += "." if not no else "; at chance: " + "; ".join(no) + "."
        lines.append(text)
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--report-only", action="store_true", help="rewrite the docs section from nulls.json")
    ap.add_argument("--update-docs", action="store_true", help="compute, then rewrite the docs section")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    path = args.out / "nulls.json"
    if args.report_only:
        rows = json.loads(path.read_text())
    else:
        rows = peftleak_rows() + utr_rows() + projres_rows() + image_rows()
        path.write_text(json.dumps(rows, indent=1, default=str))
        print(f"wrote {path}", flush=True)
    write_section(args, "nulls", report(rows), "Against the null: every headline beside chance (issue 26)", "nulls")
    return 0


if __name__ == "__main__":
    sys.exit(main())
