"""UTR benchmark (paper 002, SPEC §3.6): Tables 1-3, Fig. 3 capacity curve, Fig. 4 sweeps.

    .venv/bin/python benchmarks/utr.py --quick            # reduced grid (minutes on 2 CPU cores)
    .venv/bin/python benchmarks/utr.py                    # full grid (hours on CPU)
    .venv/bin/python benchmarks/utr.py --only table1,capacity
    .venv/bin/python benchmarks/utr.py --check            # validate every cell's config, run nothing
    .venv/bin/python benchmarks/utr.py --out benchmarks/out --cells 't1/minilm/utr/B8' --rerun   # one cell again
    .venv/bin/python benchmarks/utr.py --report-only      # rebuild utr.json + docs section from --out
    .venv/bin/python benchmarks/utr.py --out benchmarks/out --report-only   # ... from the shipped reference

Every cell is one validated config (``cell_config``) run through the experiment pipeline
(``gradleak.run.validate`` -> ``run_experiment(cfg, RunContext(...))``) and appends one line to
``<out>/utr.jsonl`` (atomically). A rerun skips the cells whose latest line finished without error and retries
failed ones; ``--fresh`` moves the JSONL to ``utr.jsonl.bak`` and recomputes every cell. Then ``<out>/utr.json``
collects the latest row of every finished cell, ``<out>/utr_capacity.png`` is drawn, and the ``utr`` section
(our numbers next to the paper's, SPEC §3.6) goes to ``<out>/utr.md``; ``docs/REPRODUCTION.md`` is rewritten
only with ``--update-docs`` or ``--report-only``. ``--out`` defaults to ``runs/bench/utr`` (git-ignored);
``benchmarks/out/`` holds the published reference results the docs were built from.

Our offline models are narrower than the paper's (MiniLM d=384 for BERT-Base, SmolLM2-135M d=576 for
GPT2-L/Qwen), so bottlenecks are 192/288 at reduction factor 2, and capacity runs out at smaller batches:
cells past it carry ``capacity_exhausted=1``. DAGER's fair cells (a baseline at its own best) keep all 6 MiniLM layers
(``DAGER_LAYERS``) so its second span check is not on the last layer. LAMP cells grant ``threat.knows_lengths`` and
``threat.knows_labels`` explicitly (LAMP's threat model; the pipeline refuses LAMP without them).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import (REVISION_NOTE, add_out_args, check_configs, display, latest_rows, resolve_out,  # noqa: E402
                    revision, revision_label, run_cells as run_bench_cells, save_figure, start_fresh, write_section)
from _utr_paper import SEED_LABELS, paper_grid, paper_table  # noqa: E402
from gradleak.run.results import write_json_atomic  # noqa: E402
from gradleak.report.markdown import markdown_table  # noqa: E402
from gradleak.attacks.dager import NOT_APPLICABLE  # noqa: E402

NA_DAGER = f"n/a — not applicable: {NOT_APPLICABLE}"

GROUPS = ("table1", "table2", "table3", "fig4a", "fig4b", "capacity", "noise", "bottleneck")

PAPER_T1 = {  # (B, method) -> (BERT RT R1/R2, GPT2 RT R1/R2)
    (1, "utr"): ("100/100", "100/100"), (2, "utr"): ("100/100", "100/100"), (4, "utr"): ("100/100", "100/100"),
    (8, "utr"): ("100/100", "100/100"),
    (1, "lamp"): ("31.4/9.3", "64.7/16.5"), (2, "lamp"): ("11.2/0.9", "46.4/7.6"), (4, "lamp"): ("6.3/0.9", "35.1/4.2"),
    (8, "lamp"): ("6.8/0.3", "27.3/2.0"),
    (1, "dager"): ("100/100", "100/100"), (2, "dager"): ("98.1/96.5", "100/100"), (4, "dager"): ("66.8/50.1", "29.56/21.65"),
    (8, "dager"): ("37.1/11.4", "20.37/13.06"),
}
PAPER_T2 = {16: "100/100", 32: "100/100", 64: "0/0 (GPT2) 100/100 (Qwen)", 128: "0/0 (GPT2) 100/100 (Qwen)"}
PAPER_T3 = {"dp 0.01": "~100/~100", "dp 1.5": "~15/~15", "dp 2.0": "<2/<2", "dp 3.0": "~0/~0",
            "prune 0.9": "~65/~65", "prune 0.99": "~25/~25", "prune 0.999": "<5/<5"}


def cell_config(model: str, B: int, attack: str = "utr", rf: int = 2, eps: float = 1e-3, defenses=None,
                rounds: int = 1, peft: str = "adapters", trials: int = 1, seed: int = 0,
                data: str = "rt-sentences", noise: str | None = None, fl: dict | None = None,
                threat: dict | None = None, layers: int = 2, lora_rank: int = 128) -> dict:
    params = {}
    if attack in ("utr", "dager"):
        params = {"eps_bag": eps, "eps_sentence": eps}
    if attack == "utr":
        params["time_budget"] = 120.0  # encoder sentence search stops here (reported as search_truncated; never hit)
        if noise is not None:
            params["noise"] = noise
    cfg = {"experiment": "utr", "seed": seed, "trials": trials, "model": {"name": model, "layers": layers},
           # each PEFT kind takes only its own keys (the schema refuses the other kind's)
           "peft": {"kind": peft, "reduction_factor": rf} if peft == "adapters" else {"kind": peft, "lora_rank": lora_rank},
           "data": {"name": data, "batch_size": B}, "fl": {"rounds": rounds, "lr": 0.5, **(fl or {})},
           "attack": {"name": attack, "params": params}, "defenses": defenses or []}
    if threat:
        cfg["threat"] = dict(threat)
    if attack in ("lamp", "lamp_bag"):
        # LAMP's own schedule (2000 steps, 200 candidates every 75 steps after 10 % burn-in, LM weight 0.2, the
        # offline SmolLM2 as the re-tokenised prior for BERT); lamp_bag: the same, projected to UTR's word bag
        cfg["attack"] = {"name": "lamp", "params": {"bag_only": attack == "lamp_bag"}}
        # LAMP's threat model: lengths and labels leak to the server (the pipeline's gate refuses LAMP otherwise)
        cfg["threat"] = {"knows_lengths": True, "knows_labels": True}
    return cfg


def quick_grid() -> list[tuple[str, str, dict]]:
    """Reduced grid (~15 min on 2 loaded CPU cores), most informative cells first."""
    cells = []
    for B in (1, 2, 4, 8):
        cells.append(("table1", f"t1/minilm/utr_rf1/B{B}", cell_config("minilm", B, rf=1)))
        cells.append(("table1", f"t1/minilm/dager_frozen/B{B}", cell_config("minilm", B, attack="dager")))
    for B in (1, 2, 4, 8):
        cells.append(("table1", f"t1/minilm/utr/B{B}", cell_config("minilm", B)))
    for B in (1, 2, 4, 8):
        cells.append(("table1", f"t1/smollm2/dager_frozen/B{B}", cell_config("smollm2", B, attack="dager")))
    for B in (1, 2):
        cells.append(("table1", f"t1/smollm2/utr/B{B}", cell_config("smollm2", B)))
    cells.append(("table3", "t3/minilm/dp0.01", cell_config("minilm", 2, defenses=[
        {"name": "dp_gaussian", "params": {"noise_multiplier": 0.01, "max_norm": 1.0}}])))
    cells.append(("table3", "t3/minilm/dp1.5", cell_config("minilm", 2, defenses=[
        {"name": "dp_gaussian", "params": {"noise_multiplier": 1.5, "max_norm": 1.0}}])))
    cells.append(("table3", "t3/minilm/prune0.99", cell_config("minilm", 2, defenses=[
        {"name": "topk_pruning", "params": {"prune_fraction": 0.99}}])))
    for rf, bs in ((1, (32, 64)), (2, (16,))):  # B <= 8 comes from Table 1
        for B in bs:
            cells.append(("capacity", f"cap/minilm/rf{rf}/B{B}", cell_config("minilm", B, rf=rf)))
    cells.append(("table1", "t1/minilm/lamp/B1", cell_config("minilm", 1, attack="lamp", trials=2)))
    cells.append(("table1", "t1/smollm2/utr/B4", cell_config("smollm2", 4)))
    cells.append(("capacity", "cap/minilm/rf1/B16", cell_config("minilm", 16, rf=1)))
    return cells


def grid(quick: bool, only: set[str] | None) -> list[tuple[str, str, dict]]:
    """Full grid, most informative cells first (an interrupted run keeps what it finished)."""
    if quick:
        return [c for c in quick_grid() if not only or c[0] in only]
    cells = []
    models = ["minilm", "smollm2"]
    for m in models:
        for B in (1, 2, 4, 8):
            cells.append(("table1", f"t1/{m}/utr/B{B}", cell_config(m, B, trials=3)))
            cells.append(("table1", f"t1/{m}/utr_rf1/B{B}", cell_config(m, B, rf=1, trials=3)))
            cells.append(("table1", f"t1/{m}/dager_frozen/B{B}", cell_config(m, B, attack="dager")))
    for m in models:
        for B in (16, 32, 64, 128):
            cells.append(("table2", f"t2/{m}/utr/B{B}", cell_config(m, B, rf=1)))
    for m in models:
        for sig in (0.01, 1.5, 2.0, 3.0):
            cells.append(("table3", f"t3/{m}/dp{sig}", cell_config(m, 2, defenses=[
                {"name": "dp_gaussian", "params": {"noise_multiplier": sig, "max_norm": 1.0}}])))
        for frac in (0.9, 0.99, 0.999):
            cells.append(("table3", f"t3/{m}/prune{frac}", cell_config(m, 2, defenses=[
                {"name": "topk_pruning", "params": {"prune_fraction": frac}}])))
    for m in models:
        for B in (16, 32, 64, 128):  # rf=2 capacity curve; rf=1 B >= 16 is Table 2, B <= 8 Table 1
            cells.append(("capacity", f"cap/{m}/rf2/B{B}", cell_config(m, B, rf=2)))
        for rf in (1, 2):  # RT has 200 sentences: B = 256 on the news sentences (same mean length, 21.7 words)
            cells.append(("capacity", f"cap/{m}/rf{rf}/B256", cell_config(m, 256, rf=rf, data="news-sentences")))
    for m in models:
        for rf, bs in ((4, (2, 4, 8)), (8, (1, 2, 4))):  # past the bottleneck (joint batch verification on BERT)
            for B in bs:
                cells.append(("capacity", f"cap/{m}/rf{rf}/B{B}", cell_config(m, B, rf=rf)))
    for rf, B in ((8, 2), (4, 8)):  # more unique tokens than bottleneck neurons: two rounds stack the bag's rank
        cells.append(("capacity", f"cap/minilm/rf{rf}-2rounds/B{B}", cell_config("minilm", B, rf=rf, rounds=2)))
    for m in models:
        for B in (1, 2, 4, 8):
            cells.append(("table1", f"t1/{m}/dager_lora/B{B}", cell_config(m, B, attack="dager", peft="lora")))
            if B == 1:  # LAMP at its own schedule: ~5 min a sentence on one core (B = 1: the paper's comparison)
                cells.append(("table1", f"t1/{m}/lamp/B{B}", cell_config(m, B, attack="lamp", trials=2)))
                cells.append(("table1", f"t1/{m}/lamp_bag/B{B}", cell_config(m, B, attack="lamp_bag", trials=2)))
    cells += fair_baseline_grid()
    for m in models:
        for rf in (1, 2, 4, 8):
            cells.append(("fig4a", f"f4a/{m}/rf{rf}", cell_config(m, 4, rf=rf)))
        for eps in (1e-1, 1e-2, 1e-3, 1e-4):
            for B in (4, 16):
                cells.append(("fig4b", f"f4b/{m}/eps{eps}/B{B}", cell_config(m, B, rf=1, eps=eps)))
    cells += noise_grid()
    cells += bottleneck_grid()
    cells += paper_grid(cell_config)  # UTR as published beside ours (docs/DESIGN.md §6), seeds 0 and 4242
    return [c for c in cells if not only or c[0] in only]


#: a fair baseline: DAGER as published checks the first two attention layers of a deeper model (MiniLM-L6's 6
#: layers: its second check is on layer 1, not on a 2-layer [CLS] classifier's last layer, whose key/query gradient
#: sees only what the [CLS] query attends to); LoRA (rank 128) on query + key of every layer
DAGER_LAYERS = 6
#: LoRA rank = MiniLM's hidden size: B is square (and invertible), so the A gradient's rows span exactly what the full
#: query/key gradient's rows span -- the paper's full-fine-tuning setting as far as DAGER's span checks go
FULL_RANK = 384
#: seed 0 tuned on (the span tolerances); 4242 is a new seed on the same RT sentences, not held-out data
#: (held out = data no tuned cell drew: ``SEED_LABELS``, ``SEED_OVERLAP``)
FAIR_SEEDS = (0, 4242)
#: held out = data no tuned cell drew: a text cell's seed permutes the same RT sentences, so another seed is
#: not another data set. Measured over the grid with ``_bench.client_samples`` (tests/test_heldout_disjoint.py checks
#: every number): the RT sentences, those the seed-0 cells draw, those the seed-4242 cells draw, the ones both draw,
#: and the smallest share (%) of one seed-4242 cell's sentences that seed-0 cells draw
SEED_OVERLAP = {"rt": 200, "seed0": 128, "seed4242": 32, "shared": 25, "least_cell_pct": 78}
SEED_NOTE = (f"Seed 4242 is a new seed on the same data, not held-out data: a text cell's seed permutes the same "
             f"{SEED_OVERLAP['rt']} RT sentences; the seed-0 cells draw {SEED_OVERLAP['seed0']} of them and the "
             f"seed-4242 cells {SEED_OVERLAP['seed4242']}, {SEED_OVERLAP['shared']} of which seed-0 cells draw too (at "
             f"least {SEED_OVERLAP['least_cell_pct']} % of every seed-4242 cell's sentences; measured through the "
             "pipeline's own draw by `tests/test_heldout_disjoint.py`).")


def seed_label(seed: int) -> str:
    """What a table says beside a seed: tuned on (0), or a new seed on the same sentences (any other)."""
    return SEED_LABELS.get(seed, "new seed, same sentences: not held-out data")


#: what the 6-layer DAGER rows run: DAGER's span test (Petrov et al. 2024; stage 1 per (token, position) on BERT) with
#: our sentence search (:mod:`gradleak.attacks.common.encoder_search`, layer 1's query input as the probe), not DAGER's
#: own search -- the rows say so instead of "as published"
DAGER_OURS = "our encoder search with DAGER's span test"


def fair_cell(cell: str, seed: int | str) -> str:
    """The id of a fair-baseline cell at ``seed``: seed 0 keeps the Table 1 id, another seed gets ``/s<seed>``, the
    held-out sentences (``HELDOUT``) ``/heldout``."""
    if seed == HELDOUT:
        return f"{cell}/heldout"
    return cell if seed == FAIR_SEEDS[0] else f"{cell}/s{seed}"


#: held out = data no tuned cell drew: DAGER's span test at B = 1, 2, 4 (its tolerances tuned on RT seed 0)
#: again on another corpus, the news sentences, at the tuned seed. No tuned cell draws a news sentence; the capacity
#: cells at B = 256 (UTR, tuned on RT) read them too (tests/test_heldout_disjoint.py)
HELDOUT = "heldout"
HELDOUT_DATA = "news-sentences"
HELDOUT_LABEL = f"0, {HELDOUT_DATA} (held-out data: no tuned cell drew them)"
HELDOUT_BS = (1, 2, 4)
#: LAMP at B = 8 (paper 002 Table 1's last LAMP row): seed 0 only, ~8 min of one core a sentence
LAMP_BS = {FAIR_SEEDS[0]: (1, 2, 4, 8), FAIR_SEEDS[1]: (1, 2, 4)}


def fair_baseline_grid() -> list[tuple[str, str, dict]]:
    """Fair baselines: DAGER's span test with our encoder search (6 layers, LoRA on query + key) at B = 1, 2, 4, 8
    and LAMP at B = 1, 2, 4 on MiniLM, the tuned seed and a new one (LAMP B = 1 seed 0 is the 2-trial Table 1
    cell)."""
    cells = []
    for seed in FAIR_SEEDS:
        for B in (1, 2, 4, 8):
            cells.append(("table1", fair_cell(f"t1/minilm/dager_lora_L{DAGER_LAYERS}/B{B}", seed),
                          cell_config("minilm", B, attack="dager", peft="lora", seed=seed, layers=DAGER_LAYERS)))
            cells.append(("table1", fair_cell(f"t1/minilm/dager_full_L{DAGER_LAYERS}/B{B}", seed),
                          cell_config("minilm", B, attack="dager", peft="lora", seed=seed, layers=DAGER_LAYERS,
                                      lora_rank=FULL_RANK)))
    for B in HELDOUT_BS:  # held-out data: the news sentences, DAGER's tuned seed and tolerances
        cells.append(("table1", fair_cell(f"t1/minilm/dager_lora_L{DAGER_LAYERS}/B{B}", HELDOUT),
                      cell_config("minilm", B, attack="dager", peft="lora", layers=DAGER_LAYERS, data=HELDOUT_DATA)))
    for seed in FAIR_SEEDS:
        for B in LAMP_BS[seed]:
            if (seed, B) != (FAIR_SEEDS[0], 1):  # the Table 1 cell (2 trials) above
                cells.append(("table1", fair_cell(f"t1/minilm/lamp/B{B}", seed),
                              cell_config("minilm", B, attack="lamp", seed=seed)))
    return cells


#: past the bottleneck: how far past it (layer states / bottleneck rows) ROUGE stays >= 90; seed 0 tuned on,
#: 4242 a new seed (same sentences). MiniLM rf = 1 B >= 24 loses the positions (bag + positions + 1 > hidden size), so it stops at 22.
BOTTLENECK_SWEEP = {("minilm", 1): (12, 14, 16, 18, 20, 22), ("minilm", 2): (6, 7, 8, 9, 10, 12),
                    ("smollm2", 1): (16, 20, 24, 28, 32), ("smollm2", 2): (6, 8, 10, 12)}


#: sentence-search seconds per model: SmolLM2 past its bottleneck peels in rounds (a soft-graded round, then
#: strict ones) and needs more than the 120 s of the other cells
BOTTLENECK_BUDGET = {"minilm": 120.0, "smollm2": 600.0}


def bottleneck_grid() -> list[tuple[str, str, dict]]:
    cells = []
    for (m, rf), bs in BOTTLENECK_SWEEP.items():
        for B in bs:
            for seed in (0, 4242):
                raw = cell_config(m, B, rf=rf, seed=seed)
                raw["attack"]["params"]["time_budget"] = BOTTLENECK_BUDGET[m]
                cells.append(("bottleneck", f"bn/{m}/rf{rf}/B{B}/s{seed}", raw))
    return cells


NSR = (1e-5, 1e-4, 1e-3, 1e-2)


def noise_grid() -> list[tuple[str, str, dict]]:
    """Noise-aware membership: ROUGE against the per-coordinate noise-to-signal ratio (B = 2, rf = 2; seed 0 tuned on,
    4242 a new seed on the same sentences), the exact tests beside the noise-aware ones, and server-side DP on the aggregate."""
    cells = []
    for m in ("minilm", "smollm2"):
        for seed in (0, 4242):
            for nsr in NSR if m == "minilm" else NSR[1:3]:
                cells.append(("noise", f"noise/{m}/nsr{nsr:g}/s{seed}", cell_config(m, 2, seed=seed, defenses=[
                    {"name": "gaussian_noise", "params": {"std": nsr, "per_coordinate": True}}])))
        cells.append(("noise", f"noise/{m}/nsr0.0001-exact/s0", cell_config(m, 2, noise="none", defenses=[
            {"name": "gaussian_noise", "params": {"std": 1e-4, "per_coordinate": True}}])))
        # central DP (the paper's Table 3 setting): noise on the mean of K = 1 clipped updates, read from the
        # secure-aggregation view; an honest-but-curious server without secure aggregation sees the raw upload
        for sig in (0.01, 1.5):
            cells.append(("noise", f"noise/{m}/dp{sig}-server", cell_config(m, 2, fl={"secure_aggregation": True},
                                                                             defenses=[{"name": "dp_gaussian", "params": {
                                                                                 "noise_multiplier": sig, "max_norm": 1.0,
                                                                                 "where": "server"}}])))
        cells.append(("noise", f"noise/{m}/dp0.01-server-raw", cell_config(m, 2, defenses=[
            {"name": "dp_gaussian", "params": {"noise_multiplier": 0.01, "max_norm": 1.0, "where": "server"}}])))
    return cells


def run_cell(raw: dict, out_dir: Path) -> dict:
    """One cell exactly as ``gradleak run`` runs it (:func:`gradleak.run.run_config`, on the CPU)."""
    from gradleak.run import run_config

    return run_config(raw, out_dir, None, "cpu")


def r12(row: dict | None) -> str:
    if not row:
        return "–"
    m = row["metrics"]
    if m.get("attack_failed") and row["config"]["attack"]["name"] == "dager":  # nothing measured: not a 0
        return NA_DAGER
    s = f"{m['rouge1']:.1f}/{m['rouge2']:.1f}"
    if m.get("capacity_exhausted"):
        s += " (cap.)"
    if m.get("search_truncated"):
        s += " (time budget)"
    if m.get("attack_failed"):
        s += " (attack failed)"
    return s


#: Table 1 cells not in the grid, with the reason (a cell that was not run says why instead of a bare dash)
_LAMP_COST = "not run: ~8 min of one core a sentence"
_CAUSAL = "not run: a causal LM's layer 1 is no [CLS] bottleneck (2 layers suffice)"
NOT_RUN = {("smollm2", f"dager_lora_L{DAGER_LAYERS}"): _CAUSAL, ("smollm2", f"dager_full_L{DAGER_LAYERS}"): _CAUSAL,
           ("smollm2", "lamp"): _LAMP_COST + " (MiniLM measured)", ("minilm", "lamp", 8): _LAMP_COST + " (B <= 4 measured)",
           ("minilm", "lamp_bag"): _LAMP_COST + " (B = 1 only)", ("smollm2", "lamp_bag"): _LAMP_COST + " (B = 1 only)"}


def _seed_note(rows: list[dict | None]) -> str:
    """The seeds the stored cells of a row ran on, read from their configs: the seed the extended UTR search (and
    DAGER's span tolerances) were tuned on, or another seed on the same sentences (not held-out data) --
    said beside the paper's numbers (docs/DESIGN.md §6)."""
    seeds = sorted({r["config"]["seed"] for r in rows if r})
    tuned, held = [s for s in seeds if s == FAIR_SEEDS[0]], [s for s in seeds if s != FAIR_SEEDS[0]]
    said = ([f"tuned on seed {tuned[0]}"] if tuned else []) + (
        [f"seed {', '.join(map(str, held))} ({seed_label(held[0])})"] if held else [])
    return " and ".join(said) or "not run"


def _t1_cell(by: dict, model: str, key: str, B: int) -> str:
    row = by.get(f"t1/{model}/{key}/B{B}")
    if row is None:
        return NOT_RUN.get((model, key, B)) or NOT_RUN.get((model, key)) or "–"
    return r12(row)


def _command(cell: str) -> str:
    return f"`python benchmarks/utr.py --out benchmarks/out --only table1 --cells '{cell}' --rerun`"


def fair_section(by: dict) -> str:
    """Fair baselines: DAGER's span test (with our encoder search) and LAMP at B = 1, 2, 4 on MiniLM, each seed
    beside the new one (same sentences), ROUGE F1 beside its null (``benchmarks/nulls.py``'s text null of the cell's own batch),
    the command per cell."""
    from nulls import LEGACY_F1_MARK, LEGACY_F1_NOTE, config_from_dict, text_null_setting

    nulls: dict[tuple, dict] = {}

    def null_of(row: dict) -> dict:
        cfg = config_from_dict(row["config"])
        key = (cfg.data.name, cfg.data.batch_size, cfg.seed)
        if key not in nulls:
            nulls[key] = text_null_setting(cfg, {})
        return nulls[key]

    in_grid = {cid for _, cid, _ in fair_baseline_grid()} | {"t1/minilm/lamp/B1"}  # + the 2-trial Table 1 cell
    table, missing, legacy = [], set(), False
    for meth, key, bs in ((f"{DAGER_OURS} (LoRA q+k rank 128, {DAGER_LAYERS} layers)",
                           f"dager_lora_L{DAGER_LAYERS}", (1, 2, 4, 8)),
                          (f"{DAGER_OURS}, full-rank (LoRA q+k rank {FULL_RANK} = d, {DAGER_LAYERS} layers)",
                           f"dager_full_L{DAGER_LAYERS}", (1, 2, 4, 8)),
                          ("DAGER, 2 layers (2nd check on the last layer)", "dager_lora", (1, 2, 4, 8)),
                          ("LAMP (its schedule, SmolLM2 prior)", "lamp", (1, 2, 4, 8))):
        for B in bs:
            for seed in (*FAIR_SEEDS, HELDOUT):
                cell = fair_cell(f"t1/minilm/{key}/B{B}", seed)
                row = by.get(cell)
                if row is None and cell not in in_grid:
                    continue  # not a cell of the grid (the 2-layer row: the old Table 1 cell, seed 0 only)
                entry = {"method": meth, "B": B,
                         "seed": HELDOUT_LABEL if seed == HELDOUT else f"{seed} ({seed_label(seed)})"}
                if row is None:
                    missing.add(key.split("_")[0])
                    table.append({**entry, "R1/R2 recall": "not measured (note below)",
                                  "R1 / R2 F1 (null p99)": "–", "verified": "–", "paper BERT RT": "–",
                                  "attack s": "–", "command": _command(cell), "revision": "–"})
                    continue
                m, nul = row["metrics"], null_of(row)
                # the project's ROUGE F1 (rouge{n}_f1); a row stored before those keys holds only rouge{n}_f, another
                # definition (LEGACY_F1_NOTE): not shown, the cell marked not measured
                old = m.get("rouge1_f1") is None
                legacy |= old
                f1 = " / ".join(f"–{LEGACY_F1_MARK} ({nul[k]['null_p99']:.1f})" if old  # not shown as F1
                                else f"{v:.1f} ({nul[k]['null_p99']:.1f})" if v is not None else "–"
                                for k, v in ((k, m.get(k)) for k in ("rouge1_f1", "rouge2_f1")))
                trials = row["config"].get("trials", 1)
                n_sent = B * trials
                ver = m.get("sentences_verified")
                table.append({**entry, "R1/R2 recall": r12(row) + (f" ({trials} batches)" if trials > 1 else ""),
                              "R1 / R2 F1 (null p99)": f1,
                              "verified": f"{int(round(ver * trials))}/{n_sent}" if ver is not None else "–",
                              "paper BERT RT": PAPER_T1.get((B, key.split("_")[0]), ("–",))[0],
                              "attack s": _t(row), "command": _command(cell), "revision": revision_label(row)})
    return ("### Fair baselines: DAGER's span test with our encoder search, LAMP at B = 1, 2, 4, 8 "
            "(MiniLM, RT; DAGER also on held-out news sentences)\n\n"
            + FAIR_INTRO + "\n\n" + markdown_table(table, list(table[0])) + "\n\n"
            + (f"*{LEGACY_F1_NOTE}*\n\n" if legacy else "")
            + "".join(f"*{FAIR_NOT_MEASURED[k]}*\n\n" for k in sorted(missing) if k in FAIR_NOT_MEASURED)
            + fair_verdict(by))


#: why a fair-baseline cell has no stored result (what was observed when it was tried)
FAIR_NOT_MEASURED = {
    "lamp": "LAMP cells marked not measured have no stored row: LAMP's schedule costs ~8 min of one core a sentence "
            "(B = 4 took 1,070-1,120 s; every sentence gets its own 200 rearrangements per discrete step). B = 8 was "
            "run on 2026-12-05 with 2 torch threads beside other jobs and stopped unfinished at the session's end "
            "after 134 min (137 CPU-minutes). Run the row's command on a quiet machine (`--threads 1`).",
    "dager": "DAGER cells marked not measured have no stored row. The seed-4242 B = 4 cells were started but stopped "
             "unfinished when their session ended: on the shared machine a B = 4 cell took ~50 min of wall time "
             "(attack 2,800-3,000 s; the encoder search has no time budget under DAGER). Full-rank B = 8 (seed 0) was "
             "run on 2026-12-05 and killed by the kernel for memory: 22.4 GB resident on the 24 GiB machine, before "
             "it wrote a row; it needs a machine with more memory (its command above)."}

FAIR_INTRO = (
    "DAGER (Petrov et al. 2024) filters tokens by span membership of each (token, position) embedding in the first "
    "attention layer's query/key gradient row space and verifies sentences with the second layer's; the paper "
    "attacks whole models. Here: LoRA (rank 128) on query + key of every layer (the threat Table 1's DAGER row "
    f"keeps; the gradients DAGER reads are the LoRA A gradients, whose rows lie in the same span, rank <= 128), and "
    f"*full-rank*: LoRA rank {FULL_RANK} = the hidden size, whose square B makes the A gradient's row space exactly "
    "the full query/key gradient's (the paper's full fine-tuning, as far as the span checks see). MiniLM with all "
    f"{DAGER_LAYERS} layers (`model.layers = {DAGER_LAYERS}`), so the second check (layer 1) is not the last layer "
    "of the [CLS] classifier; span tolerances 1e-3 (tuned on seed 0; seed 4242 is a new seed on the same sentences, "
    "not held-out data), the encoder sentence search of `gradleak.attacks.common.encoder_search` with layer 1's "
    f"query input as the probe (our search, not DAGER's). The rows marked `{HELDOUT_LABEL}` run the tuned seed and "
    f"tolerances on another corpus, the {HELDOUT_DATA} (`data.name={HELDOUT_DATA}`): held-out data, no tuned cell drew "
    "any of them (`tests/test_heldout_disjoint.py`). "
    "Recall is the paper's metric; the F1 column is the project's batch-level ROUGE F1 (`rouge1_f1` / `rouge2_f1`, "
    "`gradleak.metrics.text.rouge_f1_scores`, the audit's headline for text) beside its null: ROUGE F1 of as many "
    "random sentences of the cell's own corpus (RT; news for the held-out rows) that no client holds, matched the "
    "same way (1000 draws, `benchmarks/nulls.py`; LAMP B = 1 seed 0 averages 2 batches, its null is the first "
    "batch's). `verified` = sentences the span check proves. LAMP grants lengths and labels (its threat model). "
    "Wall times on a shared 2-core machine (several jobs at once).")


def fair_verdict(by: dict) -> str:
    """One sentence on whether the paper's baseline claims hold here, from the stored numbers."""
    def r1(cell):
        row = by.get(cell)
        return None if row is None else row["metrics"]["rouge1"]

    d6 = [r1(fair_cell(f"t1/minilm/dager_lora_L{DAGER_LAYERS}/B2", s)) for s in FAIR_SEEDS]
    d2 = r1("t1/minilm/dager_lora/B2")
    df = [r1(fair_cell(f"t1/minilm/dager_full_L{DAGER_LAYERS}/B2", s)) for s in FAIR_SEEDS]
    lamp = {B: [r1(fair_cell(f"t1/minilm/lamp/B{B}", s)) for s in FAIR_SEEDS if B in LAMP_BS[s]] for B in (1, 2, 4, 8)}
    held = [r1(fair_cell(f"t1/minilm/dager_lora_L{DAGER_LAYERS}/B{B}", HELDOUT)) for B in HELDOUT_BS]
    if any(v is None for v in d6 + df) or d2 is None:
        return "**Verdict:** not all DAGER B = 2 cells are measured; no conclusion."
    holds = all(v >= 90 for v in d6 + df)
    fmt = lambda vs: " / ".join("not measured" if v is None else f"{v:.1f}" for v in vs)  # noqa: E731
    return (f"**Verdict:** the paper's DAGER level on BERT (ROUGE-1 >= 90 at B = 2; 98.1 on RT) "
            f"{'holds' if holds else 'does not hold'} here for {DAGER_OURS} (not DAGER's own search) when it gets "
            "what it is built for -- query/key "
            f"gradients of a model deep enough that its second check is not the last layer ({DAGER_LAYERS} layers; "
            f"B = 2 ROUGE-1 {fmt(d6)} with LoRA rank 128 and {fmt(df)} full-rank, seeds {FAIR_SEEDS[0]} / "
            f"{FAIR_SEEDS[1]}) -- not on a 2-layer [CLS] classifier ({d2:.1f}), and it is not applicable on an "
            "adapters-only upload (no attention-layer gradient: UTR's point, a 'cannot run', not a 0). LAMP at its "
            f"schedule: ROUGE-1 {fmt(lamp[1])} at B = 1 (paper 31.4); B = 2: {fmt(lamp[2])}, B = 4: "
            f"{fmt(lamp[4])}, B = 8: {fmt(lamp[8])} (paper 11.2, 6.3, 6.8). On held-out data ({HELDOUT_DATA}, the "
            f"tuned seed and tolerances) the same DAGER rows give ROUGE-1 {fmt(held)} at B = "
            f"{', '.join(map(str, HELDOUT_BS))}.")


def write_outputs(rows: list[dict], out: Path, args: argparse.Namespace) -> None:
    by = {r["cell"]: r for r in rows}
    write_json_atomic(out / "utr.json", rows)
    print(f"wrote {display(out / 'utr.json')} ({len(rows)} finished cells)", flush=True)
    parts = [("Generated by `benchmarks/utr.py` (our numbers: ROUGE-1/ROUGE-2 recall on Rotten Tomatoes sentences, "
             "first 2 layers, FedSGD; `(cap.)` = gradient subspace saturated, reported not hidden). Models: MiniLM-L6 "
             "(d=384) stands in for BERT-Base, SmolLM2-135M (d=576, RoPE) for GPT2-L/Qwen. Paper numbers from SPEC §3.6 (RT column). "
             "Table 1 UTR cells average 3 batches (trials). Capacity: stage 1 needs distinct embedding-adapter inputs "
             "(tokens; BERT: bag tokens + positions + 1) <= bottleneck, stage 2 needs distinct first-layer states "
             "(BERT: every token; causal: every distinct prefix) <= bottleneck; `layer states` is reported per cell. "
             "Times in these tables were taken while other jobs shared the 2 cores (up to 2-5x slower than idle); "
             "for an idle timing, rerun a row's command (`--threads 1`) on a quiet machine.\n\n"
             "How stage 2 works here (beyond the paper's greedy search): causal models -- breadth-first over the trie "
             "of prefixes, one batched forward per level (KV cache of the prefixes, every bag token as extension); "
             "BERT -- stage 1 gives exact (token, position) pairs and [SEP] positions, so stage 2 assigns each "
             "position's tokens to B chains by Hungarian assignments scored with S_LA residuals (left-to-right "
             "construction, point moves, splices, segment swaps) on cached per-pair layer-0 projections, and "
             "accepts a sentence only when every position passes the membership test.\n"), REVISION_NOTE]
    t1, shown = [], []
    for B in (1, 2, 4, 8):
        for meth, key in (("UTR rf=2", "utr"), ("UTR rf=1", "utr_rf1"), ("DAGER (adapters, frozen)", "dager_frozen"),
                          (f"{DAGER_OURS} (LoRA q+k, {DAGER_LAYERS} layers)", f"dager_lora_L{DAGER_LAYERS}"),
                          (f"{DAGER_OURS}, full-rank (LoRA rank {FULL_RANK} = d)", f"dager_full_L{DAGER_LAYERS}"),
                          ("DAGER (LoRA q+k, 2 layers: 2nd check on the last)", "dager_lora"), ("LAMP", "lamp"),
                          ("LAMP + UTR word bag", "lamp_bag")):
            base = key.split("_")[0]
            paper = PAPER_T1.get((B, base), ("–", "–"))
            if key == "dager_frozen":
                paper = ("0/0 (Qwen column)", "0/0 (Qwen column)")
            cells = [by.get(f"t1/{m}/{key}/B{B}") for m in ("minilm", "smollm2")]
            shown += cells
            if key in ("utr", "utr_rf1"):  # our extended search beside the paper's numbers, not UTR as published
                meth = f"{meth} (our extension, {_seed_note(cells)})"
            t1.append({"B": B, "method": meth, "minilm": _t1_cell(by, "minilm", key, B), "paper BERT RT": paper[0],
                       "smollm2": _t1_cell(by, "smollm2", key, B), "paper GPT2 RT": paper[1],
                       "time minilm s": _t(by.get(f"t1/minilm/{key}/B{B}")),
                       "time smollm2 s": _t(by.get(f"t1/smollm2/{key}/B{B}")), "revision": revision_label(cells)})
    seeds = sorted({r["config"]["seed"] for r in shown if r})
    parts.append("### Table 1 (B = 1..8)\n\n"
                 "`UTR` rows are our extension of the paper's method (`attack.params.search: extended`, the default: "
                 "exact pairs, value test, peeling, soft rank, trie / chain search -- see 'How stage 2 works here' and "
                 "the notes), not UTR as published: that is `UTR (paper)` in the next table. Every cell of this table "
                 + (f"ran on seed {FAIR_SEEDS[0]}, the seed the extended search and DAGER's span tolerances were tuned "
                    "on" if seeds == [FAIR_SEEDS[0]] else f"ran on seeds {', '.join(map(str, seeds))}")
                 + f"; seed {FAIR_SEEDS[1]} ({seed_label(FAIR_SEEDS[1])}) is in the next two tables, the noise table "
                   f"and under 'Past the bottleneck'. {SEED_NOTE}\n\n"
                 + markdown_table(t1, list(t1[0])))
    parts += [t for t in (paper_table(by, PAPER_T1),) if t]  # UTR (paper) vs UTR (ours), docs/DESIGN.md §6
    parts.append(fair_section(by))
    t2 = []
    for B in (16, 32, 64, 128):
        t2.append({"B": B, "minilm rf=1": r12(by.get(f"t2/minilm/utr/B{B}")), "smollm2 rf=1": r12(by.get(f"t2/smollm2/utr/B{B}")),
                   "unique vectors minilm / smollm2": f"{_m(by.get(f't2/minilm/utr/B{B}'), 'unique_token_vectors')} / "
                                                      f"{_m(by.get(f't2/smollm2/utr/B{B}'), 'unique_token_vectors')}",
                   "paper RT": PAPER_T2[B],
                   "revision": revision_label([by.get(f"t2/{m}/utr/B{B}") for m in ("minilm", "smollm2")])})
    t2_note = _seed_note([by.get(f"t2/{m}/utr/B{B}") for m in ("minilm", "smollm2") for B in (16, 32, 64, 128)])
    parts.append(f"### Table 2 (large batches, UTR: our extension, {t2_note}; reduction factor 1)\n\n"
                 + markdown_table(t2, list(t2[0])))
    t3 = []
    for name, key in (("DP σ=0.01", "dp0.01"), ("DP σ=1.5", "dp1.5"), ("DP σ=2", "dp2.0"), ("DP σ=3", "dp3.0"),
                      ("prune 90%", "prune0.9"), ("prune 99%", "prune0.99"), ("prune 99.9%", "prune0.999")):
        pk = name.replace("DP σ=", "dp ").replace("prune ", "prune ").replace("%", "")
        pk = {"prune 90": "prune 0.9", "prune 99": "prune 0.99", "prune 99.9": "prune 0.999", "dp 2": "dp 2.0",
              "dp 3": "dp 3.0"}.get(pk, pk)
        t3.append({"defense (B=2, rf=2)": name, "minilm": r12(by.get(f"t3/minilm/{key}")),
                   "smollm2": r12(by.get(f"t3/smollm2/{key}")), "paper BERT": PAPER_T3.get(pk, "–"),
                   "revision": revision_label([by.get(f"t3/{m}/{key}") for m in ("minilm", "smollm2")])})
    t3_note = _seed_note([by.get(f"t3/{m}/{k}") for m in ("minilm", "smollm2") for k in
                          ("dp0.01", "dp1.5", "dp2.0", "dp3.0", "prune0.9", "prune0.99", "prune0.999")])
    parts.append(f"### Table 3 (defenses, client-side on the update, clip 1.0; UTR: our extension, {t3_note})\n\n"
                 + markdown_table(t3, list(t3[0])))
    nz = []
    for m in ("minilm", "smollm2"):
        for nsr in NSR:
            r0, r1 = by.get(f"noise/{m}/nsr{nsr:g}/s0"), by.get(f"noise/{m}/nsr{nsr:g}/s4242")
            if r0 or r1:
                nz.append({"model": m, "upload noise": f"per-coordinate NSR {nsr:g}", "seed 0 (tuned on)": r12(r0),
                           f"seed 4242 ({seed_label(4242)})": r12(r1), "paper": "–", "revision": revision_label([r0, r1])})
        for key, name, paper in ((f"noise/{m}/nsr0.0001-exact/s0", "NSR 1e-4, exact tests (noise=none)", "–"),
                                 (f"noise/{m}/dp0.01-server", "central DP σ=0.01 (mean of K=1), secure-agg. view",
                                  PAPER_T3["dp 0.01"]),
                                 (f"noise/{m}/dp1.5-server", "central DP σ=1.5 (mean of K=1), secure-agg. view",
                                  PAPER_T3["dp 1.5"]),
                                 (f"noise/{m}/dp0.01-server-raw", "central DP σ=0.01, server reads the raw upload",
                                  "–")):
            if key in by:
                nz.append({"model": m, "upload noise": name, "seed 0 (tuned on)": r12(by[key]),
                           f"seed 4242 ({seed_label(4242)})": "–", "paper": paper, "revision": revision_label(by[key])})
    if nz:
        parts.append("### Noise-aware membership (B = 2, rf = 2)\n\n"
                     "Per-coordinate noise-to-signal ratio NSR: `gaussian_noise` with `per_coordinate: true`, std = "
                     "NSR·‖update‖/√P. UTR's default `noise: public` takes the std the published defense implies, "
                     "ranks from the noise spectrum's edge and tolerances from the noise floor; no sentence is "
                     "reported verified under noise.\n\n" + markdown_table(nz, list(nz[0])))
    f4 = []
    for m in ("minilm", "smollm2"):
        for rf in (1, 2, 4, 8):
            f4.append({"sweep": f"{m} rf={rf} (B=4)", "R1/R2": r12(by.get(f"f4a/{m}/rf{rf}")),
                       "unique vectors": _m(by.get(f"f4a/{m}/rf{rf}"), "unique_token_vectors"),
                       "revision": revision_label(by.get(f"f4a/{m}/rf{rf}"))})
        for eps in (1e-1, 1e-2, 1e-3, 1e-4):
            for B in (4, 16, 64):
                if f"f4b/{m}/eps{eps}/B{B}" in by:
                    f4.append({"sweep": f"{m} eps={eps} B={B} (rf=1)", "R1/R2": r12(by[f"f4b/{m}/eps{eps}/B{B}"]),
                               "unique vectors": _m(by[f"f4b/{m}/eps{eps}/B{B}"], "unique_token_vectors"),
                               "revision": revision_label(by[f"f4b/{m}/eps{eps}/B{B}"])})
    parts.append("### Fig. 4 (reduction factor, tolerance)\n\n" + markdown_table(f4, list(f4[0])))
    cap = [r for r in rows if r["cell"].startswith("cap/")]
    for r in rows:  # Table 1 UTR cells are points of the capacity curve too
        parts_ = r["cell"].split("/")
        if r["cell"].startswith(("t1/", "t2/")) and parts_[2] in ("utr", "utr_rf1"):
            cell = f"cap/{parts_[1]}/rf{r['config']['peft'].get('reduction_factor', 2)}/{parts_[3]}"
            if cell not in by:
                cap.append({**r, "cell": cell})
    cap.sort(key=lambda r: (r["cell"].rsplit("/", 1)[0], r["config"]["data"]["batch_size"]))
    if cap:
        crow = [{"cell": r["cell"], "B": r["config"]["data"]["batch_size"],
                 "unique vectors": r["metrics"]["unique_token_vectors"],
                 "layer states": r["metrics"].get("layer_states", "–"), "bottleneck": r["metrics"]["bottleneck"],
                 "word bag": r["metrics"]["word_bag_size"], "recovered tokens": r["metrics"]["recovered_tokens"],
                 "total tokens": r["metrics"].get("total_tokens"),
                 "capacity exhausted": "yes" if r["metrics"].get("capacity_exhausted") else "no",
                 "R1/R2": r12(r), "s/sentence": round(r["timings"]["seconds_per_sentence"], 2),
                 "revision": revision_label(r)} for r in cap]
        parts.append("### Capacity (Fig. 3) and time per sentence\n\n" + markdown_table(crow, list(crow[0])))
        fig = _plot(cap, out)
        if fig:
            parts.append(f"![capacity]({fig})")
    bn = [r for r in rows if r["cell"].startswith("bn/")]
    if bn:
        parts.append(_bottleneck_section(bn, out))
    parts.append(NOTES.replace("<PER_TENSOR>", per_tensor_note(out)))
    write_section(args, "utr", "\n\n".join(parts), "UTR — text reconstruction from adapter gradients (paper 002)", "utr")


def per_tensor_note(out: Path) -> str:
    """What per-tensor top-k pruning does to UTR, from the rows that measure it (``<out>/defended.jsonl``, written
    by ``benchmarks/defended.py``; the note once called it not measured)."""
    import re

    from _bench import fmt_num

    path = out / "defended.jsonl"
    rows = [r for r in latest_rows(path) if "error" not in r and r.get("part") == "text"] if path.exists() else []
    cells = []
    for r in rows:
        m = re.search(r"topk([0-9.]+)-per_tensor-(aware|plain)", r["cell"])
        if m:
            cells.append((float(m.group(1)), m.group(2), r))
    if not cells:
        return "Per-tensor top-k: no row in `benchmarks/out/defended.jsonl` yet (`benchmarks/defended.py` measures it)."
    leaks = lambda rs: sum(r.get("level") in ("partial", "strong", "exact") for r in rs)  # noqa: E731
    aware = [r for _, v, r in cells if v == "aware"]
    plain = [r for _, v, r in cells if v == "plain"]
    recall = [r["metrics"].get("word_bag_recall") for r in aware if r["metrics"].get("word_bag_recall") is not None]
    rouge = [r["metrics"].get("rouge1_f1") for _, _, r in cells if r["metrics"].get("rouge1_f1") is not None]
    exact = sum(r["metrics"].get("sentences_exact") or 0 for _, _, r in cells)
    models = sorted({r["cell"].split("|")[1] if r["cell"].count("|") > 3 else "minilm-L2" for _, _, r in cells})
    fr = sorted({f for f, _, _ in cells})
    return (f"Per-tensor top-k, which prunes each matrix on its own, is measured in the defended section (\"UTR under "
            f"pruning and DP\", `benchmarks/defended.py`; {len(cells)} cells, top-k {fmt_num(fr[0] * 100, 'g')}-"
            f"{fmt_num(fr[-1] * 100, 'g')} %, {', '.join(models)}): the sparsity-aware word bag reaches >= partial "
            f"in {leaks(aware)} of {len(aware)} cells (word-bag recall up to {fmt_num(max(recall, default=None), '.1f')} "
            f"%), the plain tests in {leaks(plain)} of {len(plain)}; ROUGE-1 F1 is at most "
            f"{fmt_num(max(rouge, default=None), '.1f')} and {fmt_num(exact, 'g')} sentences are exact in the "
            f"{len(cells)} cells: per-tensor pruning leaves "
            + ("part of the word bag readable" if leaks(aware) else "no word bag readable")
            + (" and no sentence." if not exact else f" and {fmt_num(exact, 'g')} exact sentences."))


NOTES = """### Notes

* **Past the bottleneck (beyond the paper).** On BERT the word bag is tested against S + span{position
  directions, LayerNorm bias} (exact while the bag has fewer tokens than bottleneck neurons, however many
  (token, position) pairs there are). When S_LA is saturated (N layer states > b bottleneck rows, N < hidden
  size), no single state lies in S_LA, but a set of chains whose m states are all right meets S_LA in
  k = b + m - N dimensions and a wrong set in none: the k smallest principal angles test pairs and triples of
  chains exactly (true pairs ~1e-12, one wrong token ~3e-5 mean squared sine). Accepted chains are projected
  out of S_LA (*peeled*) until the remaining states fit the projected subspace and the per-position test is
  exact again; the whole batch is finally checked jointly. Lengths the [SEP] positions leave open are tried as
  hypotheses. This alone took `t1/minilm/utr/B8` (225 states in 192 rows) from 77.1/67.8 to 96.7/96.2; it
  needs more than N - b right states at once, which the local search does not always reach.
* **Value test (beyond the paper).** The embedding adapter's gradient *values* test one sentence
  at a time: stage 1's coefficient row of a token that occurs once in the batch is that state's exact bottleneck
  signal (times its known LayerNorm scale), and the server computes a candidate sentence's signals with one
  forward/backward of the model it sent; a 2-class head leaves one scalar per sentence (the label picks it). True
  sentences match at every such position (relative residual <= 2e-6, MiniLM rf = 2 B = 8), one wrong token anywhere
  leaves >= 0.03 at every position (`gradleak.attacks.utr_values`). Chains are accepted one by one and peeled;
  stalled ones are moved by these residuals (point moves near the peaks, lengths moved to any [SEP] position stage 1
  read, splices). Once fewer states than bottleneck rows are left, accepted chains are peeled by *subtraction*
  instead of projection: their exact share of the first layer adapter's gradient (backward signals x inputs, at
  the fitted label scales) is taken off the upload, and the rest's row space is exact at any batch size. On 12
  batches of 8 (seeds 0, 1, 777, 4242; 165-278 states, up to 145 % of the bottleneck) every sentence is recovered
  and verified. It needs only stage 1's condition (bag + positions + 1 <= hidden size) and a
  one-step upload (FedSGD). Causal models get their own value test (next bullets but one).
* **More unique tokens than bottleneck neurons (beyond the paper).** When the server sees the same client batch in
  two rounds, the embedding adapter's input is the frozen embeddings, so stacking both rounds' gradients doubles
  the bag's rank: `cap/minilm/rf8-2rounds/B2` recovers the exact bag of 57 unique tokens with 48 neurons
  (precision/recall 100), `cap/minilm/rf4-2rounds/B8` the exact bag of 155 unique tokens with 96 neurons. The
  sentences stay below 90 (87.1/77.1 and 46.7/22.7, unverified): stage 2 uses one round's layer adapter, whose
  input moves with the trained embedding adapter from round to round, so its subspaces do not stack, and 71 and
  255 layer states are 148 % and 266 % of the bottleneck.
* **The limit of the row-space test is layer states, not unique tokens.** The first layer adapter's subspace
  holds one direction per distinct layer state (every token on BERT, every distinct prefix on causal LMs). At
  rf = 1 the bottleneck equals the hidden size, so once the batch has more states than that, S_LA is numerically
  the whole space and the per-position membership test is blind: MiniLM rf = 1 B = 16 (484 states, 278 unique
  tokens), true states' residual median 0.004 vs 0.005 for sentences with a wrong token
  (`pytest tests/test_utr.py -k blind -s`). The authors' code, which checks the true order, fails wherever the
  batch's tokens overflow the bottleneck (a measurement of the authors' code, not stored here).
* **Exact pairs and a soft basis past the bottleneck (beyond the paper).** Two more reads of the upload
  take MiniLM past that limit:
  - *Stage 1, exact.* The support test cannot place a token most sentences hold: on `t2/minilm/utr/B16` it read
    22 [SEP] positions for 14 true lengths (61 false pairs). The embedding adapter's up-projection gradient
    G_up = sum_l delta_l h_l^T has inputs h_l that are known for every candidate pair, and the down-projection
    gradient, one neuron at a time, fixes what G_up leaves open (`gradleak.attacks.utr_pairs`). The result is
    every candidate pair's exact bottleneck signal: zero for a false pair. Pairs far below the median are dropped
    and the rest solved again, a drop kept only while the equations still fit at the float32 floor. When the
    support test missed a true pair the equations do not fit, and the candidates of one allowed support violation
    are solved instead. MiniLM rf = 1 B = 16, seeds 0, 1, 777, 4242: exactly the true pairs every time
    (449/432/428/384; 59/40/51/36 false pairs dropped); rf = 2 B = 8 seed 0: 244 of 244, 27 dropped. The value
    test then checks every position of a chain, not only once-placed tokens.
  - *Lengths.* Sentences that share a length also share the "." before [SEP], so token counts cannot say how many
    chains end there. A shared [SEP] pair carries the sum of several sentences' signals and stands off the
    one-sentence trend of its norm (same labels add up, opposite ones cancel); that orders the length
    multisets. The inferred lengths were the true ones first on all four seeds above.
  - *Search.* Past the bottleneck the row space is everything, but the states' shares differ by orders of
    magnitude: the top 96 % of the first layer upload's singular directions (`soft_rank`) still grade states (a
    one-token change raises the state's residual with AUC 0.94 on seed 0, 0.99 on seed 4242). Chains the value
    test accepts are peeled by subtraction at any number of states.
  - *Measured, 300 s budget, one thread:* `gradleak run configs/utr/minilm_rt.yaml --out D --set
    data.batch_size=16 --set peft.reduction_factor=1 --set seed=S --set attack.params.time_budget=300 --set
    threads=1`. ROUGE 100/100 with 16 of 16 verified on seeds 0 (tuned on; 40 s), 1, 777 and 4242 (new seeds on the
    same RT sentences, not held-out data: 7, 11 and 14 of their 16 are sentences the seed-0 cells draw; 38, 98 and
    23 s), and on news sentences (`--set data.name=news-sentences`, 447 states, 24 s). rf = 2 B = 8
    (`--set data.batch_size=8`): 100/100, 8 of 8 verified, 3.4-11.5 s on seeds 0, 1, 777, 4242. Before these
    changes seed 0 gave 39.0/13.7 (2 verified). Further past: B = 20 at rf = 1 (559 states, 146 %) gives
    46.2/28.2 with none verified, and B = 24 loses the positions (366 unique tokens + positions + 1 exceed the
    hidden size).
* **Causal models past the bottleneck (beyond the paper; `gradleak.attacks.utr_causal`).** Under RoPE the
  embedding adapter's input is the token embedding alone, so its up-projection gradient gives every bag token's
  exact summed output gradient (least squares, relative fit ~4e-8). For a complete candidate sentence (BOS ... EOS)
  the server computes every position's gradient with one forward/backward; the LM loss is a mean over the batch's
  targets, so one global scale multiplies them. A once-used token matches at <= 3.1e-6; one token exchanged, or the
  last word dropped, leaves >= 4.7e-3 (rf = 1 B = 24 seed 0; a position's gradient sums every later loss). Verified
  sentences are peeled from the layer adapters' uploads (their exact share at that scale) and the rest is searched
  again: strictly (exact membership) once the states left fit the rows, otherwise soft-graded -- each prefix's
  extensions ranked by their residuals against the top singular directions of layer_0's and layer_1's uploads, the
  best (and a close second) kept, every node tested as a complete sentence. Before, nothing was reported verified
  from 90 % of the rows on (the float32 floor blurs the rank there) and nothing found past 100 %. Measured in the
  table below (`bn/smollm2/*`): rf = 2 B = 12 (101-102 %) 0.9/0.0 and 0.0/0.0 before, 100/100 with 12 of 12 verified
  now; rf = 1 B = 24 seed 4242 (93 %) 80.3/76.1 with none verified before, 100/100 with 24 of 24 now; seed 0 (106 %)
  0.5/0.0 before, 69.3/66.5 with 15 of 24 verified when the 600 s budget ran out; B = 28 seed 0 (120 %) 7.6/7.1, 2
  verified. **Not reached: SmolLM2 rf = 1 B = 32 (133 %)**, the target set for it -- 600 s verify no sentence on seeds
  0 and 4242 (nor did 1800 s on seed 0). `benchmarks/probes/utr_causal_probe.py` measures why: the soft grading (layer_0)
  ranks the true next token first for 80 % of prefixes at 106 %, 48 % at 120 % and 15 % at 133 % (a 25-token
  sentence needs every step right before the value test can see it); the value test itself needs the whole sentence
  (cutting it 16 tokens after a position still moves that position's gradient by 7-50 %, median 20 %); and the last
  adapter, whose gradient is a sum of terms each fixed by one (prefix, next token) transition, cannot test a
  transition while the later ones are unknown (the true transition's least-squares coefficient on what is left has
  medians 32-204 by level, not 1, as the false ones' 31-220: the ~700 unknown terms correlate with it).
* **Defenses (Table 3) and noise.** Noise: UTR takes the per-coordinate std the published
  defense implies (`attack.params.noise: public`; the server knows its DP parameters), ranks the gradient
  matrices from the noise spectrum's edge σ(√m + √n) and sets its tolerances from the noise floor; nothing is
  then reported verified. `benchmarks/probes/utr_noise_probe.py` shows why σ = 0.01 with clip 1.0 gives 0/0 here
  whether the noise is added by the client or by the server to the mean of K = 1 clipped updates: MiniLM's
  upload has norm 0.0065 (the clip never binds) and the word-bag matrix's largest singular value is 5.2e-5
  against an edge of 0.335 (1.5e-4 of it) -- no test of that matrix can see the signal. The paper's ~100 at
  σ = 0.01 implies a noise about 10^4 times smaller relative to the signal; the noise table above measures
  ROUGE against that ratio instead. Central DP leaves an honest-but-curious server that sees individual uploads
  the raw update (`dp0.01-server-raw`: 100/100). Pruning: global top-k over the whole upload keeps the
  largest coordinates, which lie outside the embedding adapter's down-projection: at 90 % it keeps 82 of that
  matrix's 73,728 entries (6.9 % of its energy; MiniLM B = 2, seed 0,
  `benchmarks/probes/utr_noise_probe.py`), far below the 35,855 degrees of freedom of its rank-71 row space, so 0/0 at 90 % is what the upload
  allows; the paper's ~65 needs a pruning that leaves this matrix mostly intact. <PER_TENSOR>
* **LAMP** runs its own schedule: 2000 Adam steps on the embeddings with step decay, the
  per-tensor cosine loss averaged over tensors, an embedding-norm regulariser, the best of 100 random inits,
  200 rearrangements per sentence every 75 steps after a 10 % burn-in (swap, move token, move span, prefix to
  the end) scored by the cosine loss + 0.2 x the auxiliary LM's NLL, the best iterate returned. LAMP's BERT prior
  (a GPT-2 with BERT's vocabulary) is not available offline: the SmolLM2-135M scores re-tokenised candidates, and
  only the 20 best by the gradient term. `LAMP + UTR word bag` projects to UTR's exact bag.
* **DAGER** needs attention-layer gradients: on an adapters-only upload (backbone frozen) it is not applicable --
  nothing is measured, the evaluation grades it undefined, and the tables say n/a instead of 0. With LoRA on query
  + key it checks layers 0 and 1 (its layers). On a 2-layer [CLS] classifier layer 1 is the last layer, whose
  gradient arrives through the [CLS] query only (`t1/minilm/dager_lora/B2`: rank 26 for 71 states, exact word bag,
  no sentence verified); the attack now warns there, and the fair row runs all 6 MiniLM layers (Fair baselines).
"""


def _t(row):
    return round(row["timings"]["attack_seconds"], 2) if row else None


def _m(row, k):
    return row["metrics"].get(k) if row else "–"


def _ratio(row: dict) -> float:
    m = row["metrics"]
    return 100.0 * m.get("layer_states", 0) / max(1.0, m.get("bottleneck", 1))


def _bottleneck_section(bn: list[dict], out: Path) -> str:
    """Past the bottleneck: ROUGE vs layer states / bottleneck rows, the reach (largest ratio up to which every batch
    gives ROUGE-1 >= 90) per model and reduction factor, and ``<out>/utr_bottleneck.png``."""
    series: dict[tuple[str, int], list[dict]] = {}
    for r in bn:
        _, m, rf, _, _ = r["cell"].split("/")
        series.setdefault((m, int(rf[2:])), []).append(r)
    table, reach = [], []
    for (m, rf), rs in sorted(series.items()):
        rs.sort(key=_ratio)
        ok = [r for r in rs if r["metrics"]["rouge1"] >= 90]
        first_bad = next((_ratio(r) for r in rs if r["metrics"]["rouge1"] < 90), None)
        top = max((_ratio(r) for r in ok if first_bad is None or _ratio(r) < first_bad), default=None)
        reach.append({"model": m, "rf": rf, "every batch >= 90 up to": f"{top:.0f} %" if top else "–",
                      "first batch < 90 at": f"{first_bad:.0f} %" if first_bad else "–",
                      "largest with >= 90": (f"{max(_ratio(r) for r in ok):.0f} %" if ok else "–"),
                      "revision": revision_label(rs)})
        for r in rs:
            seed = r["config"]["seed"]
            mt = r["metrics"]
            table.append({"model": m, "rf": rf, "B": r["config"]["data"]["batch_size"],
                          "seed": f"{seed} ({seed_label(seed)})",
                          "layer states / rows": f"{int(mt.get('layer_states', 0))} / {int(mt['bottleneck'])} "
                                                 f"({_ratio(r):.0f} %)",
                          "R1/R2": r12(r), "verified": f"{int(mt.get('sentences_verified', 0))}/"
                                                       f"{r['config']['data']['batch_size']}",
                          "attack s": _t(r), "revision": revision_label(r)})
    body = ("### Past the bottleneck: ROUGE against layer states / bottleneck rows\n\n"
            "Each cell is one batch (RT sentences, seed 0 tuned on, 4242 a new seed on the same sentences: not "
            "held-out data; FedSGD, 2 layers, one torch "
            "thread; sentence-search budget 120 s MiniLM, 600 s SmolLM2). `verified` = sentences the attack proves "
            "(membership at every position, or the value test). Reach:\n\n" + markdown_table(reach, list(reach[0]))
            + "\n\n" + markdown_table(table, list(table[0])))
    fig = _plot_bottleneck(series, out)
    return body + (f"\n\n![past the bottleneck]({fig})" if fig else "")


def _plot_bottleneck(series: dict, out: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # pragma: no cover
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for (m, rf), rs in sorted(series.items()):
        line = None
        for seed, mk in ((0, "o"), (4242, "s")):
            pts = sorted((_ratio(r), r["metrics"]["rouge1"]) for r in rs if r["config"]["seed"] == seed)
            if pts:
                kw = {"color": line.get_color()} if line else {}
                (line,) = ax.plot(*zip(*pts), marker=mk, ls="-" if seed == 0 else ":",
                                  label=f"{m} rf={rf} seed {seed}", **kw)
    ax.axvline(100, ls="--", lw=0.8, color="grey")
    ax.axhline(90, ls="--", lw=0.8, color="grey")
    ax.set_xlabel("distinct first-layer states / bottleneck rows (%)")
    ax.set_ylabel("ROUGE-1")
    ax.legend(fontsize=7)
    return save_figure(fig, out / "utr_bottleneck.png")


def _plot(cap: list[dict], out: Path) -> str | None:
    """Draw ``<out>/utr_capacity.png``; return its path relative to docs/ (where the Markdown is read)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # pragma: no cover
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    series: dict[str, list] = {}
    for r in cap:
        key = r["cell"].rsplit("/", 1)[0]
        series.setdefault(key, []).append(r)
    for key, rs in series.items():
        rs.sort(key=lambda r: r["config"]["data"]["batch_size"])
        bs = [r["config"]["data"]["batch_size"] for r in rs]
        axes[0].plot(bs, [r["metrics"]["rouge1"] for r in rs], marker="o", label=key)
        axes[1].plot([r["metrics"].get("layer_states", r["metrics"]["total_tokens"]) for r in rs],
                     [max(r["metrics"]["recovered_tokens"], 0.5) for r in rs], marker="o", label=key)
        bott = rs[0]["metrics"]["bottleneck"]
        axes[1].axvline(bott, ls="--", lw=0.8, color=axes[1].lines[-1].get_color())
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("batch size B")
    axes[0].set_ylabel("ROUGE-1")
    axes[1].set_xscale("log")
    axes[1].set_yscale("log")
    axes[1].set_xlabel("distinct first-layer states in the batch")
    axes[1].set_ylabel("recovered tokens (dashed: bottleneck)")
    axes[0].legend(fontsize=7)
    return save_figure(fig, out / "utr_capacity.png")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="reduced grid (~15 min on 2 loaded CPU cores)")
    ap.add_argument("--only", default="", help=f"comma list of {','.join(GROUPS)}")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    ap.add_argument("--cells", default="", help="comma-separated globs over cell ids, e.g. 't1/minilm/lamp*/*' (with --only)")
    ap.add_argument("--rerun", action="store_true", help="recompute the selected cells even when finished (the new "
                    "row replaces the cell's row; the old one moves to utr.history.jsonl)")
    add_out_args(ap, "utr")
    args = ap.parse_args(argv)
    args.out = resolve_out(args.out)
    if args.fresh and args.report_only:
        ap.error("--fresh recomputes cells; it cannot be combined with --report-only")
    only = set(filter(None, args.only.split(",")))
    if only - set(GROUPS):
        ap.error(f"--only: unknown group(s) {', '.join(sorted(only - set(GROUPS)))}")
    if args.check:
        return check_configs((cell, raw, []) for _, cell, raw in grid(args.quick, only))
    torch.set_num_threads(args.threads)
    jsonl = args.out / "utr.jsonl"
    if not args.report_only:
        if args.fresh:
            start_fresh(jsonl)
        sel = grid(args.quick, only)
        if args.cells:
            from fnmatch import fnmatch

            pats = [g for g in args.cells.split(",") if g]
            sel = [c for c in sel if any(fnmatch(c[1], g) for g in pats)]

        def fill(res: dict, row: dict) -> str:
            row.update(metrics=res["metrics"], timings=res["timings"], warnings=res["details"].get("warnings", []))
            return f"R1={row['metrics'].get('rouge1', 0):.1f} R2={row['metrics'].get('rouge2', 0):.1f}"

        rev = revision()  # every row records the code revision that wrote it
        run_bench_cells(jsonl, [({"cell": cell, "group": group, "config": raw, "revision": rev}, run_cell, (raw, args.out / "utr" / cell))
                                for group, cell, raw in sel], fill, label="utr", redo=args.rerun, wall_seconds=False,
                        error_fields={"metrics": {"rouge1": 0.0, "rouge2": 0.0}, "timings": {}})
    latest = latest_rows(jsonl)
    rows = [r for r in latest if "error" not in r and r.get("timings")]
    failed = [r["cell"] for r in latest if "error" in r]
    if failed:
        print(f"{len(failed)} failed cell(s), retried on the next run: {', '.join(failed)}", flush=True)
    if not rows:
        print(f"no finished cells in {display(jsonl)}: nothing to report (docs untouched). "
              "To rebuild from the shipped reference results: --out benchmarks/out --report-only", flush=True)
        return 1
    write_outputs(rows, args.out, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
