"""The prepared GPU run: the image audits, one vit_lora ``--advise``, and the spatial-anchor study's GIAS cells at the
paper's iteration counts, on one device, each step a resumable row labelled with the device it ran on.

    .venv/bin/python benchmarks/gpu.py --device cuda                    # -> benchmarks/out/gpu.{jsonl,json}
    .venv/bin/python benchmarks/gpu.py --device cpu --tiny --out DIR    # every step at a tiny scale (tests/test_gpu_script.py)

Plan (steps in order; the minutes are the budget each step is given on one large GPU -- H100 / H200 class --, not
measurements: no GPU was lent when this script was written, so the first GPU run is where the real numbers come from;
``--budget-seconds`` (default 540) stops starting new steps once spent, so the run ends within 10 minutes):

1. ``audit_vit_adapters`` (~1.5 min): ``gradleak audit configs/audit/vit_adapters.yaml --device cuda`` -- every
   applicable attack at full strength (on 2 CPU cores: 255 s wall).
2. ``audit_vit_lora`` (~1.5 min): the same for ``configs/audit/vit_lora.yaml``.
3. ``advise_vit_lora`` (4 min, ``--budget 240``): ``gradleak audit configs/audit/vit_lora.yaml --advise --device
   cuda`` (about 3 h on 2 CPU cores); the candidates not finished within the budget are listed as unfinished in the
   row (a budget, not a silent cut).
4. ``generator`` (CPU, ~1.5 min on 16 cores): the in-distribution DCGAN of benchmarks/anchor.py (trained once,
   reused).
5. ``anchor_gias`` (~1.5 min): benchmarks/anchor.py lane 4's GIAS cells (scale paper: 2000 latent + 8000 generator
   steps, 3 restarts) on the pretrained DINOv2 backbone, images 0 and 1, anchor off and on -- 4 cells of paper 001's
   own claim (GIAS + spatial anchor on a pretrained backbone), rows in ``<out>/anchor.jsonl`` as anchor.py writes them.

Every row: the step, ``device`` and ``device_name`` (``torch.cuda.get_device_name``), ``tiny``, wall seconds, the code
revision, the command that reproduces it, and what it found (verdict and levels; the advice's recommendation and
unfinished candidates; the anchor cells' PSNR/SSIM). ``--tiny`` runs each step on CPU at a scale of seconds (one
layer, 16 px, one-step attacks, no advice search budget beyond a probe) so a test checks every piece.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import REFERENCE_OUT, ROOT, display, latest_rows, resolve_out, revision, run_cells  # noqa: E402

NAME = "gpu"
AUDITS = {"audit_vit_adapters": ROOT / "configs" / "audit" / "vit_adapters.yaml",
          "audit_vit_lora": ROOT / "configs" / "audit" / "vit_lora.yaml"}
ADVISE_BUDGET = 240.0
#: anchor lane 4's GIAS cells this run takes (paper 001's claim: GIAS + anchor on a pretrained backbone)
ANCHOR_CELLS = ("vit4p8/paper/dinov2/gias/u0s0", "vit4p8/paper/dinov2/gias+anchor/u0s0",
                "vit4p8/paper/dinov2/gias/u1s0", "vit4p8/paper/dinov2/gias+anchor/u1s0")
#: tiny scale (--tiny): what makes each step take seconds on CPU
TINY_AUDIT = ["model.layers=1", "data.image_size=16", "audit.params.dlg.steps=1"]
TINY_ANCHOR = ["model.pretrain=null", "model.layers=2", "attack.name=ig", "attack.anchor=true", "attack.steps=2",
               "data.seed=0", "seed=0"]



def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


def audit_step(config: str, out: str, device: str, tiny: bool) -> dict:
    from gradleak.config.loading import load_yaml
    from gradleak.run.audit import run_audit

    res = run_audit(load_yaml(config), out, TINY_AUDIT if tiny else [], device, only=["dlg"] if tiny else None,
                    log=lambda m: print(m, flush=True), workers=1)
    return {"verdict": res["verdict"], "levels": {a["name"]: a["level"] for a in res["attacks"] if "level" in a},
            "audit_seconds": res["seconds"]}


def advise_step(config: str, out: str, device: str, tiny: bool) -> dict:
    from gradleak.config.loading import load_yaml
    from gradleak.run.advise import run_audit_advised

    res = run_audit_advised(load_yaml(config), out, TINY_AUDIT if tiny else [], device,
                            only=["dlg"] if tiny else None, log=lambda m: print(m, flush=True),
                            budget_seconds=ADVISE_BUDGET, advise_on=True)
    adv = res.get("advice") or {}
    return {"verdict": res["verdict"], "recommendation": adv.get("sentence"),
            "unfinished": adv.get("unfinished") or [],
            "rows": [{k: r.get(k) for k in ("defense", "strength", "status", "cost", "epsilon")}
                     for r in adv.get("rows") or []]}


def generator_step(out: str, tiny: bool) -> dict:
    import anchor

    if tiny:  # the tiny anchor step runs IG: no generator needed; the step still proves the import path
        return {"generator": None, "skipped": "tiny: the anchor step runs IG with the anchor (no DCGAN)"}
    return {"generator": display(anchor.ensure_generator(Path(out)))}


def anchor_step(out: str, device: str, tiny: bool) -> dict:
    import anchor

    from gradleak.run import run_file

    if tiny:
        res = run_file(anchor.CONFIG, Path(out) / "anchor_tiny", TINY_ANCHOR, device)
        m = res["metrics"]
        return {"cells": {"tiny/ig+anchor": {"psnr": m.get("image_psnr_mean"), "ssim": m.get("image_ssim_mean")}}}
    cells = [c for c in anchor.grid(display(anchor.generator_path(Path(out)))) if c["cell"] in ANCHOR_CELLS]
    anchor.run(cells, Path(out), device)
    rows = {r["cell"]: r for r in latest_rows(Path(out) / f"{anchor.NAME}.jsonl")}
    return {"cells": {c: {"psnr": (rows.get(c, {}).get("metrics") or {}).get("image_psnr_mean"),
                          "ssim": (rows.get(c, {}).get("metrics") or {}).get("image_ssim_mean"),
                          "error": rows.get(c, {}).get("error")} for c in ANCHOR_CELLS}}


def steps(out: Path, device: str, tiny: bool) -> list[tuple[str, str, object, tuple]]:
    """``(step, command, job, args)`` in run order."""
    dev = f" --device {device}"
    cmd = lambda c: f"gradleak audit {display(c)} --out {display(out / NAME)}/<step>" + dev  # noqa: E731
    s = [(k, cmd(c), audit_step, (str(c), str(out / NAME / k), device, tiny)) for k, c in AUDITS.items()]
    s.append(("advise_vit_lora", cmd(AUDITS["audit_vit_lora"]) + f" --advise --budget {ADVISE_BUDGET:g}", advise_step,
              (str(AUDITS["audit_vit_lora"]), str(out / NAME / "advise_vit_lora"), device, tiny)))
    s.append(("generator", "benchmarks/anchor.py's ensure_generator (gradleak train-generator "
              + " ".join(__import__("anchor").GENERATOR_COMMAND[1:]) + ")", generator_step, (str(out), tiny)))
    s.append(("anchor_gias", f"benchmarks/anchor.py --lane 4 --cells '<{len(ANCHOR_CELLS)} cells>'" + dev,
              anchor_step, (str(out), device, tiny)))
    return s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="torch device (cuda; cpu with --tiny for the test)")
    ap.add_argument("--tiny", action="store_true", help="every step at a scale of seconds (CPU check of the script)")
    ap.add_argument("--out", type=Path, default=REFERENCE_OUT, help="rows: OUT/gpu.jsonl (default benchmarks/out)")
    ap.add_argument("--budget-seconds", type=float, default=540.0,
                    help="start no new step once this many seconds are spent (default 540: the run fits 10 minutes)")
    args = ap.parse_args(argv)
    out = resolve_out(args.out)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here; use a GPU machine, or --device cpu --tiny to check the script",
              file=sys.stderr)
        return 2
    torch.set_num_threads(1) if args.device == "cpu" else None
    t0 = time.perf_counter()
    rev, name = revision(), device_name(args.device)
    todo = []
    for step, command, job, jargs in steps(out, args.device, args.tiny):
        def gated(*a, _job=job, _step=step):
            spent = time.perf_counter() - t0
            if spent > args.budget_seconds:
                raise TimeoutError(f"not started: {spent:.0f} s of the {args.budget_seconds:g} s budget spent")
            return _job(*a)

        todo.append(({"cell": f"{step}|{args.device}" + ("|tiny" if args.tiny else ""), "step": step,
                      "device": args.device, "device_name": name, "tiny": args.tiny, "revision": rev,
                      "command": command}, gated, jargs))
    rows = run_cells(out / f"{NAME}.jsonl", todo, lambda res, row: (row.update(res) or "done"), label=NAME,
                     error_fields={"revision": rev})
    (out / f"{NAME}.json").write_text(json.dumps(latest_rows(out / f"{NAME}.jsonl"), indent=1, default=str))
    bad = [r["cell"] for r in rows.values() if "error" in r]
    print(f"{len(rows)} step(s), {len(bad)} failed{': ' + ', '.join(bad) if bad else ''}; "
          f"{time.perf_counter() - t0:.0f} s; rows in {display(out / f'{NAME}.jsonl')}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
