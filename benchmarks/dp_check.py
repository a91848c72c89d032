"""The DP check (gradleak.run.dp_check): the one-shot empirical ε (Andrew et al., ICLR 2024) beside each declared
mechanism's accountant ε, on the shipped text audit (``configs/audit/text_adapters.yaml``: MiniLM, 2 layers, bottleneck
adapters, 445,636 trainable coordinates, 1 client, FedSGD, 1 round), and the wall time the check adds to the audit.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/dp_check.py              # -> benchmarks/out/dp_check.{jsonl,json,md}
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/dp_check.py --timing     # also the audit's wall time with / without
    .venv/bin/python benchmarks/dp_check.py --report-only                  # rebuild the JSON + the docs section

Cells ``<mechanism>|seed<S>``: the check as ``gradleak audit`` runs it (:func:`gradleak.run.dp_check.dp_check` on the
audited config with the mechanism's ``--set``, :func:`cell_config`), 100 canaries inserted and 100 never inserted. Seed 0
is the shipped seed; seed 1 is held out (other client data: the sentences follow ``seed``; other canary and noise
draws). DP-SGD runs at its own seeds (:data:`OWN_SEEDS`): a canary under DP-SGD is one example clipped at C and noised
with std z·C from the noise stream the client-side ``dp_gaussian`` draws from at the same seed, so at a seed that
``dp_gaussian client z=1`` also runs its each-upload statistics are that cell's draw again (the rows at 7b5978d: the
same ε, interval and test statistics at seeds 0 and 1, to 1e-14) -- one measurement under two names, counted twice in
the section's summary. Nothing here was tuned on these cells: the
estimator's choices (one common spread, the 99.9 % lower end for a violation) were made on simulated Gaussian canaries
(gradleak.evaluation.empirical_epsilon, :func:`estimate`'s docstring), the canary count for the wall time.
For one round of a Gaussian mechanism with noise multiplier z the exact ε is that of μ = 1/z (``exact``): the
measured ε of the threat model the noise protects directly (each upload for local noise, the aggregate for central
noise) should sit near it, the accountant's (RDP) claim above it.

``--timing``: ``gradleak audit configs/audit/text_adapters.yaml`` with the local ``dp_gaussian`` declared, with the
check and with ``--set audit.dp_check=false``, alternating, three times each (cells ``timing|check|<i>`` and
``timing|off|<i>``; wall seconds of the whole command).

Breakages that look like real bugs (docs/DESIGN.md §6, the DP check), two ways:

* on the text audit (cells ``<breakage>|seed<S>``, the same check with the mechanism broken in-process as
  ``tests/test_dp_check.py`` breaks it, by replacing ``DPGaussian.apply``): every tenth client upload clipped but not
  noised (client ids 0, 10, 20, ...: ten of the 100 canaries), at the shipped seed 0 and the held-out seeds 1 and 2,
  beside the correct mechanism at seed 2;
* simulated (cells ``sim|<mechanism>|<breakage>``): the canary statistics of one round drawn exactly in distribution
  at the text audit's size (:func:`gradleak.evaluation.empirical_epsilon.simulated_check`, judged by the check's own
  :func:`~gradleak.evaluation.empirical_epsilon.judge`), :data:`SIM_DRAWS` seeded checks per breakage -- k of n
  uploads un-noised (2 %, 5 %, 10 %), noise 1.5× and 2× too small; breakages of the mechanism's code: one tensor
  (the largest of :data:`TEXT_TENSORS`) left un-noised, clipping per tensor where the claim is per update, clipping
  on Δw while the noise is calibrated to the upload Δw / lr (lr 0.05, the audit's, and 0.5) -- and
  :data:`SIM_NULL_DRAWS` per correct mechanism (the false-alarm table: dp_gaussian, DP-SGD, Flower's central wrappers
  and LocalDpMod as :data:`SIM_MECHANISMS` models them). The tests' thresholds are derived (family-wise α = 0.01,
  Bonferroni), not tuned here.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import (REFERENCE_OUT, REVISION_NOTE, ROOT, add_out_args, display, fmt_num, latest_rows, resolve_out,  # noqa: E402
                    revision, revision_label, run_cells, start_fresh, write_section)

NAME = "dp_check"
#: NVFlare SVTPrivacy's noise_var the stored advice recommends on the text audit's seed 0, and its cell name
SVT_NOISE_VAR = 0.541
SVT = f"nvflare_svt noise_var={SVT_NOISE_VAR:g}"
CONFIG = ROOT / "configs" / "audit" / "text_adapters.yaml"
SEEDS = {0: "shipped", 1: "held out"}
#: mechanism -> (the audit's --set strings, noise multiplier of the Gaussian mechanism for the exact ε or None)
MECHANISMS = {
    "dp_gaussian client z=0.5": (["defenses=[{name: dp_gaussian, params: {noise_multiplier: 0.5, max_norm: 1.0e-3}}]"], 0.5),
    "dp_gaussian client z=1": (["defenses=[{name: dp_gaussian, params: {noise_multiplier: 1.0, max_norm: 1.0e-3}}]"], 1.0),
    "dp_gaussian client z=2": (["defenses=[{name: dp_gaussian, params: {noise_multiplier: 2.0, max_norm: 1.0e-3}}]"], 2.0),
    "dp_gaussian server z=1": (["defenses=[{name: dp_gaussian, params: {noise_multiplier: 1.0, max_norm: 1.0e-3, "
                                "where: server}}]"], 1.0),
    "dpsgd z=1": (["defense={name: dpsgd, noise_multiplier: 1.0, max_grad_norm: 1.0}"], 1.0),
    "flower server-fixed z=1": (["fl.engine=flower", "fl.flower.dp=server-fixed", "fl.flower.noise_multiplier=1.0",
                                 "fl.flower.clipping_norm=1.0e-4"], 1.0),
    # NVFlare's SVTPrivacy at the strength the stored advice recommends on the text audit's seed 0 (benchmarks/advise.py,
    # 4c4f312: noise_var = 0.541, named in defense: as --advise places it), checked with per-coordinate canaries
    # against NVFlare's own accountant (gradleak.run.svt_check)
    SVT: ([f"defense={{name: nvflare_svt, noise_var: {SVT_NOISE_VAR}}}"], None),
}
CANARIES = 100
#: breakages of a declared mechanism on the text audit: name -> (the mechanism broken, its breakage, seeds)
BREAKAGES = {"dp_gaussian client z=1, noise skipped on 1 upload in 10": ("dp_gaussian client z=1", "skip_one_in_ten"),
             f"{SVT}, release noise removed": (SVT, "svt_release_unnoised"),
             "dp_gaussian client z=1, noise skipped on one tensor (text_adapters.layer_1.up.weight)":
                 ("dp_gaussian client z=1", "one_tensor_unnoised")}
#: the tensor :func:`one_tensor_unnoised` leaves un-noised (73,728 of the text audit's 445,636 coordinates)
UNNOISED_TENSOR = "text_adapters.layer_1.up.weight"
BREAKAGE_SEEDS = {0: "shipped", 1: "held out", 2: "held out"}
#: seeds beyond SEEDS for a correct mechanism beside the breakages
EXTRA_SEEDS = {"dp_gaussian client z=1": {2: "held out"}}
#: a mechanism's seeds instead of SEEDS: DP-SGD's canaries are dp_gaussian client's Gaussian mechanism with its noise
#: draws (module docstring), so it runs where no ``dp_gaussian client z=1`` cell runs
OWN_SEEDS = {"dpsgd z=1": {3: "held out", 4: "held out"}}
#: simulated checks per breakage, and per correct mechanism (false alarms)
SIM_DRAWS, SIM_NULL_DRAWS = 200, 1000
#: the text audit's trainable tensors (``configs/audit/text_adapters.yaml``: MiniLM's classifier weight and bias, then
#: the bottleneck adapters of the embedding and layers 0, 1: down weight, down bias, up weight, up bias), in order
TEXT_TENSORS = (1536, 4) + (73728, 192, 73728, 384) * 3
#: the largest of them (``text_adapters.layer_1.up.weight`` and its five equals: 16.5 % of the coordinates)
LARGEST_TENSOR = max(TEXT_TENSORS)
#: the text audit's learning rate (``fl.lr``): an upload is Δw / lr (FedSGD: the gradient)
TEXT_LR = 0.05


def _opacus_one_step(z: float, delta: float) -> float:
    """DP-SGD's claim for a canary client's one example: Opacus' RDPAccountant, one step at sampling rate 1 (as
    ``defense: dpsgd`` accounts it, gradleak.defenses.training)."""
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    acc.step(noise_multiplier=z, sample_rate=1.0)
    return float(acc.get_epsilon(delta))


def _localdp_claim(epsilon: float, delta: float) -> tuple[float, float]:
    """``LocalDpMod`` (sensitivity = clipping norm)'s noise multiplier (the classic Gaussian bound of its ε, δ) and
    its claim over one round, as the Flower engine declares it (gradleak.fl.engines.flower: RDP of that z)."""
    from gradleak.accounting import classic_gaussian_z, gaussian_rdp_epsilon

    z = classic_gaussian_z(epsilon, delta)
    return z, gaussian_rdp_epsilon(z, 1, delta)


#: simulated cases: name -> (noise multiplier, central noise, the claim: None for the RDP of the Gaussian mechanism
#: (dp_gaussian, Flower's central wrappers), else a function () -> ε (DP-SGD's Opacus accountant, LocalDpMod's)).
#: As the project models them (gradleak.run.dp_check): DP-SGD's canary is one example clipped at C and noised with
#: std z·C (a local Gaussian mechanism); Flower's server-fixed and client-fixed wrappers clip each upload (Δw / lr) and
#: add N(0, (zC)²) to the sum (central); LocalDpMod clips and noises each upload (local)
SIM_MECHANISMS = {"dp_gaussian client z=1": (1.0, False, None), "dp_gaussian client z=0.5": (0.5, False, None),
                  "dp_gaussian client z=2": (2.0, False, None), "dp_gaussian server z=1": (1.0, True, None),
                  "dpsgd z=1": (1.0, False, lambda: _opacus_one_step(1.0, 1e-5)),
                  "flower server-fixed z=1": (1.0, True, None), "flower client-fixed z=1": (1.0, True, None),
                  "flower LocalDpMod ε=1": (_localdp_claim(1.0, 1e-5)[0], False, lambda: _localdp_claim(1.0, 1e-5)[1])}
SIM_BREAKAGES = {"2 % of uploads un-noised": {"unnoised": 2}, "5 % of uploads un-noised": {"unnoised": 5},
                 "10 % of uploads un-noised": {"unnoised": 10}, "noise 1.5x too small": {"noise_scale": 1.5},
                 "noise 2x too small": {"noise_scale": 2.0},
                 # breakages of the mechanism's code (simulated_statistics' unnoised_tensor, tensor_sizes, clip_scale)
                 f"one tensor un-noised (the largest: {LARGEST_TENSOR:,} of {sum(TEXT_TENSORS):,} coordinates)":
                     {"unnoised_tensor": LARGEST_TENSOR},
                 f"clipped per tensor ({len(TEXT_TENSORS)} tensors), claim per update":
                     {"tensor_sizes": TEXT_TENSORS},
                 f"clip on Δw, noise calibrated to Δw / lr (lr {TEXT_LR:g})": {"clip_scale": 1.0 / TEXT_LR},
                 "clip on Δw, noise calibrated to Δw / lr (lr 0.5)": {"clip_scale": 2.0}}
#: the breakages of the mechanism's code (above), also simulated on the central mechanism
CODE_BREAKAGES = [b for b, kw in SIM_BREAKAGES.items() if set(kw) & {"unnoised_tensor", "tensor_sizes", "clip_scale"}]
#: (mechanism, breakage) simulated; breakage None: the correct mechanism (false alarms)
SIM_CASES = ([(m, None) for m in SIM_MECHANISMS]
             + [("dp_gaussian client z=1", b) for b in SIM_BREAKAGES]
             + [("dp_gaussian server z=1", b) for b in ("noise 1.5x too small", "noise 2x too small")]
             + [("dp_gaussian server z=1", b) for b in CODE_BREAKAGES])
#: each correct mechanism's false-alarm draws start here (other seeds than the breakages' and than each other's: the
#: first four's at 100,000 as measured before, the others' each 10,000 further)
NULL_FIRST_SEED = {m: 100_000 if i < 4 else 100_000 + 10_000 * (i - 2) for i, m in enumerate(SIM_MECHANISMS)}


def skip_one_in_ten():
    """``DPGaussian.apply`` that clips every upload but noises none of client ids 0, 10, 20, ... (every tenth client
    upload, canaries included): returns (class, attribute, replacement)."""
    from gradleak.defenses.update import DPGaussian

    real = DPGaussian.apply

    def apply(self, update, ctx):
        return self.clip.apply(update, ctx) if ctx["client_id"] % 10 == 0 else real(self, update, ctx)

    return DPGaussian, "apply", apply



def svt_release_unnoised():
    """``NVFlareSVT.apply`` whose released entries carry no release noise: the real filter runs (its selection, its
    accountant), then each entry it released is replaced by the clipped input it was computed from (a release loop
    that forgets the Laplace noise); the claim stays NVFlare's. Returns (class, attribute, replacement)."""
    from gradleak.defenses.nvflare import NVFlareSVT

    real = NVFlareSVT.apply

    def apply(self, update, ctx):
        out = real(self, update, ctx)
        bound = self.cfg.gamma * max(int(update.local_steps or 1), 1) / float(ctx.get("lr", 1.0))  # γ in upload units
        return out.map(lambda k, v: v.where(v == 0, update.tensors[k].clamp(-bound, bound).to(v)))

    return NVFlareSVT, "apply", apply


def one_tensor_unnoised():
    """``DPGaussian.apply`` that clips every client upload and noises every tensor but :data:`UNNOISED_TENSOR` (a
    noise loop that misses one tensor): returns (class, attribute, replacement)."""
    from gradleak.defenses.update import DPGaussian

    real = DPGaussian.apply

    def apply(self, update, ctx):
        if self.server_side:
            return real(self, update, ctx)
        clipped = self.clip.apply(update, ctx)
        if UNNOISED_TENSOR not in clipped.tensors:
            raise KeyError(f"{UNNOISED_TENSOR} is not a trainable tensor of this upload: {sorted(clipped.tensors)}")
        return self.noise.apply(clipped, ctx).map(lambda k, v: clipped.tensors[k] if k == UNNOISED_TENSOR else v)

    return DPGaussian, "apply", apply


def audit_command(sets: list[str], seed: int) -> str:
    args = ["gradleak", "audit", display(CONFIG), "--out", f"runs/dp_check_seed{seed}"]
    for s in sets + [f"seed={seed}"]:
        args += ["--set", s]
    return shlex.join(args)


def seeds_of(mechanism: str) -> dict[int, str]:
    """The seeds (and their roles) a correct mechanism's cells run at."""
    return OWN_SEEDS.get(mechanism) or {**SEEDS, **EXTRA_SEEDS.get(mechanism, {})}


def cell_config(sets: list[str], seed: int) -> dict:
    """The config one check cell validates: the audit's (``sets`` and ``seed`` as ``--set`` strings), as the audit
    hands it to its attacks (:func:`gradleak.run.audit.candidate`, UTR's: the check runs no attack)."""
    from gradleak.config.loading import load_yaml
    from gradleak.run.audit import audit_overrides, candidate

    return candidate(audit_overrides(load_yaml(CONFIG), sets + [f"seed={seed}"]), "utr")


def check(sets: list[str], seed: int, breakage: str | None = None) -> dict:
    import torch

    from gradleak.run.dp_check import dp_check
    from gradleak.run.runner import validate

    torch.set_num_threads(1)
    _, cfg = validate(cell_config(sets, seed))
    if breakage is None:
        return dp_check(cfg, "cpu", canaries=CANARIES)
    owner, attr, broken = globals()[breakage]()
    real = getattr(owner, attr)
    setattr(owner, attr, broken)
    try:
        return dp_check(cfg, "cpu", canaries=CANARIES)
    finally:
        setattr(owner, attr, real)


def simulate(mechanism: str, breakage: str | None) -> dict:
    """Seeded simulated checks of one case: how many read ``claim_violated``, by which claim test, and by the fit
    alone (its 99.9 % lower end above the claim: the verdict before the claim tests)."""
    from gradleak.evaluation.empirical_epsilon import CLAIM_TESTS, simulated_check

    z, central, claim_of = SIM_MECHANISMS[mechanism]
    claim = claim_of() if claim_of else None
    draws = SIM_DRAWS if breakage else SIM_NULL_DRAWS
    first = 0 if breakage else NULL_FIRST_SEED[mechanism]  # the false-alarm draws are other seeds than the breakages'
    flagged, by_fit, by_test, by_one_run = 0, 0, {t: 0 for t in CLAIM_TESTS}, 0
    for seed in range(first, first + draws):
        verdict, measured = simulated_check(seed, noise_multiplier=z, central=central, claim=claim,
                                            **(SIM_BREAKAGES[breakage] if breakage else {}))
        flagged += verdict == "claim_violated"
        by_fit += any(m["strict_lower"] > m["claimed_epsilon"] for m in measured)
        by_one_run += any(m.get("one_run_strict", 0.0) > m["claimed_epsilon"] for m in measured)
        for t in CLAIM_TESTS:
            by_test[t] += any(m["tests"].get(t, {}).get("rejects", False) for m in measured)
    return {"draws": draws, "claim_violated": flagged, "rate": flagged / draws, "by_fit_alone": by_fit,
            "by_one_run_alone": by_one_run,
            "by_test": by_test, "first_seed": first, "noise_multiplier": z, "central": central,
            "claimed_epsilon": measured[0]["claimed_epsilon"]}


def fill(res: dict, row: dict) -> str:
    from gradleak.evaluation.empirical_epsilon import gaussian_mechanism_epsilon

    z = MECHANISMS[row.get("broken") or row["mechanism"]][1]
    row.update(verdict=res["verdict"], claimed_epsilon=res["claimed_epsilon"],
               accountant="; ".join(c["accountant"] for c in res["mechanisms"]),
               exact_epsilon=gaussian_mechanism_epsilon(1.0 / z, res["delta"]) if z else None,
               delta=res["delta"], check_seconds=res["seconds"], canaries=res["canaries"], dimension=res["dimension"],
               measured={m["threat_model"]: {**{k: m[k] for k in ("epsilon", "interval", "strict_lower", "lower_bound",
                                                                  "epsilon_separate_spreads", "verdict", "one_run_bound",
                                                                  "one_run_ceiling", "one_run_strict", "kind",
                                                                  "ceiling", "null_epsilon", "agreement",
                                                                  "null_agreement", "support", "evidence", "testable",
                                                                  "confidence") if k in m},
                                              **({"one_run_guesses": m["one_run"]["guesses"],
                                                  "one_run_correct": m["one_run"]["correct"]} if "one_run" in m else {}),
                                              "tests": {t: {k: v.get(k) for k in ("statistic", "p_value", "alpha",
                                                                                   "rejects")}
                                                        for t, v in (m.get("tests") or {}).items()}}
                         for m in res["measured"]})
    return f"{res['verdict']} (claimed {res['claimed_epsilon']:.3g})"


def timed_audit(sets: list[str], out: str) -> dict:
    import shutil

    shutil.rmtree(out, ignore_errors=True)  # a fresh --out: a reused one would reuse the finished runs
    cmd = [str(ROOT / ".venv" / "bin" / "gradleak"), "audit", str(CONFIG), "--out", out]
    for s in sets:
        cmd += ["--set", s]
    import os

    import resource

    def cpu() -> float:
        u = resource.getrusage(resource.RUSAGE_CHILDREN)
        return u.ru_utime + u.ru_stime

    load0 = os.getloadavg()[0]
    c0, t0 = cpu(), time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-2000:])
    # the machine's 1-minute load average before and after the run (other processes share the cores), and the CPU
    # seconds (user + system) of the audit process and the children it waited for: less sensitive to that load
    return {"audit_seconds": time.perf_counter() - t0, "cpu_seconds": cpu() - c0, "load": [load0, os.getloadavg()[0]],
            "cpus": os.cpu_count()}


def decisive(m: dict) -> str:
    """The threat model the noise protects directly: each upload for local noise and DP-SGD, else the final model."""
    return "each_upload" if "each_upload" in m else "final_model"


def rejecting(m: dict) -> str:
    """The claim tests that reject, per threat model (one round: every round is the final model, not repeated)."""
    out = []
    for t, x in m.items():
        names = [n for n, v in (x.get("tests") or {}).items() if v.get("rejects")]
        if names and not (t == "every_round" and "final_model" in m):
            out.append(f"{t.replace('_', ' ')}: {', '.join(names)}")
    return "; ".join(out) or "none"


def ceiling(r: dict) -> float:
    """The largest ε the threshold bound could certify with the row's canaries (95 %, perfectly separated)."""
    from gradleak.evaluation.empirical_epsilon import bound_ceiling

    return bound_ceiling(r["canaries"], r["canaries"], r["delta"])


def one_run_parts(m: dict) -> list[tuple[str, dict]]:
    """The threat models of a row's ``measured`` with a one-run bound (Steinke et al. 2023), every round left out where
    it is the final model's statistic again (one round)."""
    return [(t, x) for t, x in m.items() if "one_run_bound" in x and not (t == "every_round" and "final_model" in m)]


def one_run_cells(m: dict, f) -> tuple[str, str]:
    """The table's "one-run bound (95 %)" and "its ceiling" cells: per threat model, or "not measured" (a row written
    before the bound)."""
    parts = one_run_parts(m)
    if not parts:
        return "not measured", "not measured"
    return (", ".join(f"{t.replace('_', ' ')} {f(x['one_run_bound'])} ({x['one_run_correct']}/{x['one_run_guesses']})"
                      for t, x in parts),
            ", ".join(f(x["one_run_ceiling"]) for _, x in parts))


def in_grid(rows: list[dict]) -> tuple[list[dict], list[str]]:
    """The rows of cells :func:`cells` builds, and the ids of the stored cells it no longer builds (kept in the JSONL,
    never shown: e.g. DP-SGD's rows at dp_gaussian client's seeds, a duplicate measurement)."""
    grid = set(cell_ids())
    return [r for r in rows if r["cell"] in grid], [r["cell"] for r in rows if r["cell"] not in grid]


def table(rows: list[dict]) -> str:
    def f(x, spec=".3g"):
        return fmt_num(x, spec)

    rows, gone = in_grid(rows)
    real = [r for r in rows if not r["cell"].startswith(("timing", "sim|")) and "measured" in r]
    svt = [r for r in real if any(x.get("kind") == "per_coordinate" for x in r["measured"].values())]
    real = [r for r in real if r not in svt]
    correct = [r for r in real if not r.get("broken")]
    broken = [r for r in real if r.get("broken")]
    inside = sum(1 for r in correct if r.get("exact_epsilon") is not None and "interval" in r["measured"][decisive(r["measured"])]
                 and r["measured"][decisive(r["measured"])]["interval"][0] <= r["exact_epsilon"]
                 <= r["measured"][decisive(r["measured"])]["interval"][1])
    fit_over = sum(1 for r in correct for x in r["measured"].values() if x["strict_lower"] > r["claimed_epsilon"])
    orr = [r for r in correct if one_run_parts(r["measured"])]
    lines = ["Each row: the check of one declared mechanism (``benchmarks/dp_check.py``; the same check "
             "`gradleak audit configs/audit/text_adapters.yaml --set <mechanism>` writes as `dp_check`). ε at "
             "δ = 1e-5; *exact*: the Gaussian mechanism's ε for one round (μ = 1/z); measured: the one-shot estimate "
             "(one common spread), its 95 % bootstrap interval, and the 99.9 % lower end the fit's verdict reads; "
             "*claim tests*: the tests of the canaries' statistics against the claim (shift, spread, tail; and each "
             "tensor's noise, `tensor_variance` / `tensor_tail`: each tensor's noise energy across the canary, per "
             "coordinate, over the other tensors', F-distributed under the claim, which noises every coordinate with "
             "one σ; family-wise α = 0.01) that reject. The paper's own numbers (StackOverflow / EMNIST, thousands of rounds "
             "and clients) are not comparable to one round of one text client; the comparable reference is the exact "
             f"ε. Measured on these rows (computed): of the {len(correct)} correct mechanisms' rows, the exact ε lies "
             f"inside the 95 % interval of the threat model the noise protects directly in {inside} (each upload for "
             "local noise and DP-SGD, the aggregate for central noise); the fit's 99.9 % lower end exceeds the claim "
             f"in {fit_over} threat model(s); *threshold bound*: the distribution-free lower bound (Jagielski et al. "
             "2020, Jeffreys intervals, 95 %), the largest over the threat models, and in brackets the most it could "
             "read with these canaries (perfect separation): a claim above that ceiling is not testable by the bound "
             f"at this size ({sum(r['claimed_epsilon'] > ceiling(r) for r in correct)} of the {len(correct)} rows), "
             "and its verdict rests on the fit and the claim tests; *one-run bound*: the rigorous lower bound of "
             "Steinke, Nasr & Jagielski (NeurIPS 2023, Thm. 3.1 / 5.2) at 95 %, per threat model, with its guesses "
             "(right / made): the inserted and never-inserted canaries ranked together for the aggregate (the "
             f"inserted count fixed, so the level is scaled by P[Binomial({2 * CANARIES}, ½) = {CANARIES}]), in pairs for each upload "
             "(the swap of a pair's members is two add/remove steps: group privacy), both in "
             "`gradleak.evaluation.empirical_epsilon.one_run_bound`; *its ceiling*: what it reads with every guess "
             f"right. Computed on the rows that carry it ({len(orr)} of the {len(correct)} correct mechanisms' rows): "
             f"the bound exceeds the claim in {sum(1 for r in orr if max(x['one_run_bound'] for _, x in one_run_parts(r['measured'])) > r['claimed_epsilon'])}"
             f", exceeds the exact ε in {sum(1 for r in orr if r.get('exact_epsilon') is not None and max(x['one_run_bound'] for _, x in one_run_parts(r['measured'])) > r['exact_epsilon'])}"
             f", and the claim lies above its largest ceiling in {sum(1 for r in orr if max(x['one_run_ceiling'] for _, x in one_run_parts(r['measured'])) < r['claimed_epsilon'])}"
             " (there a `consistent` reads *not testable at this size* by the bound, not as evidence); verdicts: "
             + ", ".join(f"{v} {sum(r['verdict'] == v for r in correct)}" for v in sorted({r['verdict'] for r in correct}))
             + ". Broken DP is also called `claim_violated` by the tests `tests/test_dp_check.py` (noise added "
             "before clipping, clipping bound ignored, no noise, noise skipped on one upload in ten, one tensor left "
             "un-noised, central noise "
             "divided by the client count twice; DP-SGD without noise or without per-sample clipping), and a correct "
             "mechanism `consistent` (dp_gaussian client and server, DP-SGD, Flower's server-side fixed clipping).", "",
             "| mechanism | seed | claimed (accountant) | exact | each upload | every round / final model | threshold "
             "bound (ceiling) | one-run bound (95 %) | its ceiling | claim tests rejecting | verdict | s | revision |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in correct + broken:
        m = r["measured"]

        def cell(t):
            if t not in m:
                return "not claimed"
            x = m[t]
            return f"{f(x['epsilon'])} [{f(x['interval'][0])}, {f(x['interval'][1])}] (≥ {f(x['strict_lower'])})"

        agg = "final_model" if "final_model" in m else "every_round"
        lines.append(f"| {r['mechanism']} | {r['seed']} ({r['role']}) | {f(r['claimed_epsilon'])} | "
                     f"{f(r.get('exact_epsilon'))} | {cell('each_upload')} | {cell(agg)} | "
                     f"{f(max(x['lower_bound'] for x in m.values()))} ({f(ceiling(r))}) | "
                     + " | ".join(one_run_cells(m, f)) + f" | {rejecting(m)} | "
                     f"{r['verdict']} | {f(r['check_seconds'], '.1f')} | {revision_label(r)} |")
    for name in BREAKAGES:
        got = [r for r in broken if r["mechanism"] == name]
        if got:
            each = [r["measured"]["each_upload"] for r in got if "each_upload" in r["measured"]]
            lines += ["", f"**{name}** on the text audit (computed from the rows): "
                      + ", ".join(f"seed {r['seed']} ({r['role']}) `{r['verdict']}`" for r in got)
                      + f". The fit alone reads each upload at ε = "
                      + ", ".join(f"{f(x['epsilon'])} [{f(x['interval'][0])}, {f(x['interval'][1])}]" for x in each)
                      + f" against the claimed {f(got[0]['claimed_epsilon'])}: "
                      + ("below the claim" if all(x["epsilon"] < got[0]["claimed_epsilon"] for x in each)
                         else "not all below the claim")
                      + (" (the mixture lowers the one-spread fit)" if BREAKAGES[name][1] == "skip_one_in_ten" else "")
                      + "; the claim tests that reject: "
                      + "; ".join(f"seed {r['seed']}: {rejecting(r['measured'])}" for r in got) + "."]
    if svt:
        lines += ["", svt_section(svt, f)]
    sims = [r for r in rows if r["cell"].startswith("sim|") and "draws" in r]
    if sims:
        from gradleak.evaluation.empirical_epsilon import CLAIM_TESTS

        def simrow(r):
            return (f"| {r['mechanism']} | {r['breakage']} | {r['draws']} | {r['claim_violated']} | "
                    f"{100 * r['rate']:.1f} % | " + " / ".join(str(r["by_test"].get(t, "not measured")) for t in CLAIM_TESTS)
                    + f" | {r['by_fit_alone']} | {r.get('by_one_run_alone', 'not measured')} | {revision_label(r)} |")

        head = ["| mechanism | breakage | simulated checks | claim_violated | rate | by "
                + " / ".join(t.replace("_", " ") for t in CLAIM_TESTS) + " | by the "
                "fit alone | by the one-run bound alone (99.9 %) | revision |", "|---|---|---|---|---|---|---|---|---|"]
        det = [r for r in sims if r["breakage"] != "correct"]
        null = [r for r in sims if r["breakage"] == "correct"]
        lines += ["", "**Breakages that look like real bugs, simulated** (`sim|` cells): one round at the text audit's "
                  "size (445,636 coordinates, 100 canaries inserted and 100 never inserted, δ = 1e-5, the accountant's "
                  "RDP claim), the canary statistics drawn exactly in distribution "
                  "(`gradleak.evaluation.empirical_epsilon.simulated_check`) and judged by the check's own `judge`; "
                  "seeded draws. *By the fit alone*: the checks the verdict before the claim tests (the fit's 99.9 % "
                  "lower end above the claim) would have flagged; *by the one-run bound alone*: the checks whose "
                  "rigorous one-run bound at 99.9 % (Steinke et al. 2023) exceeds the claim, which the verdict also "
                  "reads. Breakages of the mechanism's code, each a broken "
                  "mechanism drawn exactly (`simulated_statistics`' `unnoised_tensor`, `tensor_sizes`, `clip_scale`; "
                  f"the text audit's {len(TEXT_TENSORS)} trainable tensors): *one tensor un-noised* -- the noise "
                  "misses one tensor on every upload; *clipped per tensor* -- each tensor clipped to C where the "
                  "claim clips the whole update to C (the update's norm up to C·√T); *clip on Δw, noise calibrated "
                  "to Δw / lr* -- the clipping bounds the weight change at C while the noise std z·C is added to "
                  "the upload Δw / lr, so the upload's sensitivity is C / lr. Each tensor's noise summary (what the "
                  "per-tensor tests read) is drawn beside the cosines "
                  "(`gradleak.evaluation.empirical_epsilon.simulated_tensor_statistics`: each upload's energy across "
                  "the canary, σ² χ²(m − 1) per tensor of m coordinates, none on a tensor the noise misses; the "
                  "aggregate's with the canaries' common part taken off and the real client's clipped update left "
                  "in, bounded).", ""] + head + [simrow(r) for r in det]
        if det:
            worst = min(det, key=lambda r: r["rate"])
            missed = [r for r in det if r["rate"] < 0.5]
            share = LARGEST_TENSOR / sum(TEXT_TENSORS)
            lines += ["", "Detection (computed): " + "; ".join(
                f"{r['mechanism']}, {r['breakage']}: {r['claim_violated']} of {r['draws']} (the fit alone "
                f"{r['by_fit_alone']})" for r in det) + f". Lowest rate: {100 * worst['rate']:.1f} % "
                f"({worst['breakage']}, {worst['mechanism']})."]
            if missed:
                lines += ["", "**Missed** (computed: detected in under half the checks): " + "; ".join(
                    f"{r['mechanism']}, {r['breakage']} ({r['claim_violated']} of {r['draws']})" for r in missed)
                    + ". In the other checks it reads `consistent` on a broken mechanism."
                    + (f" For a tensor the noise misses, an isotropic canary puts only that tensor's share of its "
                       f"norm there ({100 * share:.1f} % of the coordinates), so its cosine's mean grows by only "
                       f"{100 * (1 / (1 - share) ** 0.5 - 1):.0f} % (1/√(1 − share)), within what the claim allows, while "
                       "a real client's update on that tensor is exposed in full (ε = ∞ for it)"
                       if any("unnoised_tensor" in SIM_BREAKAGES.get(r["breakage"], {}) for r in missed) else "")
                    + "."]
        if null:
            top = max(null, key=lambda r: r["rate"])
            lines += ["", "**False alarms** on correct mechanisms, simulated (other seeds than the breakages'), as the "
                      "project models them (`gradleak.run.dp_check`): DP-SGD's canary is one example clipped at C "
                      "and noised with std z·C, claimed by Opacus' RDPAccountant (one step, sampling rate 1); Flower's "
                      "DifferentialPrivacyServerSideFixedClipping and ...ClientSideFixedClipping (+ fixedclipping_mod) "
                      "clip each upload and add N(0, (zC)²) to the sum, claimed by the RDP of z (Flower keeps no "
                      "accountant); LocalDpMod (ε = 1, δ = 1e-5, sensitivity = clipping norm) clips and noises each "
                      "upload with z = √(2 ln(1.25/δ)) / ε, claimed by the RDP of that z over one round:", ""] \
                + head + [simrow(r) for r in null] + [
                "", f"Largest false-alarm rate (computed): {100 * top['rate']:.2f} % ({top['mechanism']}, "
                    f"{top['claim_violated']} of {top['draws']}): "
                    f"{'within' if top['rate'] <= 0.01 else 'ABOVE'} the 1 % the family-wise α = 0.01 promises."]
    timing = [r for r in rows if r["cell"].startswith("timing") and "audit_seconds" in r]
    if timing:
        on = [r["audit_seconds"] for r in timing if r["arm"] == "check"]
        off = [r["audit_seconds"] for r in timing if r["arm"] == "off"]
        if on and off:
            mon, moff = sum(on) / len(on), sum(off) / len(off)
            con = [r["cpu_seconds"] for r in timing if r["arm"] == "check" and "cpu_seconds" in r]
            coff = [r["cpu_seconds"] for r in timing if r["arm"] == "off" and "cpu_seconds" in r]
            loads = [x for r in timing for x in r.get("load") or ()]
            where = (f"on a shared {timing[0].get('cpus')}-core machine (1-minute load average {min(loads):.1f}–"
                     f"{max(loads):.1f} around the runs)" if loads else "on one idle 2-core machine")
            lines += ["", f"Wall time of `gradleak audit configs/audit/text_adapters.yaml` with the local dp_gaussian "
                          f"(z = 1) declared, alternating runs {where} (`--timing`): with the check "
                          f"{', '.join(f(x, '.1f') for x in on)} s (mean {mon:.1f}), with `--set audit.dp_check=false` "
                          f"{', '.join(f(x, '.1f') for x in off)} s (mean {moff:.1f}): the check adds "
                          f"{(mon / moff - 1) * 100:.0f} %"
                          + (f"; CPU seconds (user + system of the audit and its children, less sensitive to the "
                             f"machine's load) with the check {', '.join(f(x, '.1f') for x in con)} (mean "
                             f"{sum(con) / len(con):.1f}), without {', '.join(f(x, '.1f') for x in coff)} (mean "
                             f"{sum(coff) / len(coff):.1f}): the check adds "
                             f"{(sum(con) / len(con) / (sum(coff) / len(coff)) - 1) * 100:.0f} % of CPU"
                             if con and coff else "")
                          + f" (revision: {revision_label(timing)})."]
    if gone:
        lines += ["", f"Stored rows of cells no longer measured, not shown (computed): {', '.join(gone)}."]
    lines += ["", f"Code revision(s) of these rows: {revision_label(rows)}. {REVISION_NOTE}"]
    return "\n".join(lines) + "\n"


def svt_section(rows: list[dict], f) -> str:
    """The SVT paragraph and table: NVFlare's SVTPrivacy checked with per-coordinate canaries against its own
    accountant (gradleak.run.svt_check), the correct filter and the breakage; the reading computed from the rows."""
    correct = [r for r in rows if not r.get("broken")]
    broken = [r for r in rows if r.get("broken")]
    out = [f"**NVFlare's SVTPrivacy** (`{SVT}`, `defense:` as the stored advice places it on the text audit; "
           "`gradleak.run.svt_check`): SVT bounds each coordinate, not the L2 norm, so its check uses per-coordinate "
           "canaries -- independent random signs scaled beyond γ on every coordinate, each through the real NVFlare "
           "filter with its own accountant -- and reads each canary's sign agreement on the released coordinates "
           "against the exact Binomial(n, ½) of a never-inserted canary (`gradleak.evaluation.sign_canaries`): "
           "ε ≥ max_j L_j − log(k / α), L_j = −log P[Binomial(n_j, ½) ≥ agreement_j], a pure-DP lower bound at "
           "99 % without a Gaussian model; *its ceiling*: every released sign agreeing; *null*: the same bound "
           "on the never-inserted canaries (same uploads). The claim is NVFlare's: ε_threshold + ε_query + "
           "ε_release of one call (δ = 0). The breakage keeps the filter and its accountant but releases the clipped "
           "entries without their Laplace noise.", "",
           "| mechanism | seed | claimed (NVFlare's accountant, one call) | bound (99 %) | its ceiling | null | "
           "signs agreeing (never inserted) | released coordinates | verdict | s | revision |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in correct + broken:
        x = next(v for v in r["measured"].values() if v.get("kind") == "per_coordinate")
        out.append(f"| {r['mechanism']} | {r['seed']} ({r['role']}) | {f(r['claimed_epsilon'])} | {f(x['epsilon'])} | "
                   f"{f(x['ceiling'])} | {f(x['null_epsilon'])} | {100 * x['agreement']:.1f} % "
                   f"({100 * x['null_agreement']:.1f} %) | {x['support'][0]:,}–{x['support'][1]:,} | {r['verdict']} | "
                   f"{f(r['check_seconds'], '.1f')} | {revision_label(r)} |")

    def pc(r):
        return next(v for v in r["measured"].values() if v.get("kind") == "per_coordinate")

    out += ["", "Reading (computed from the rows): the correct filter reads "
            + ", ".join(f"`{r['verdict']}` at seed {r['seed']}" for r in correct)
            + (f"; its claim is {'below' if all(pc(r)['testable'] for r in correct) else 'not always below'} the "
               "ceiling, so the check could have refuted it at this size" if correct else "")
            + "; the breakage reads " + ", ".join(f"`{r['verdict']}` at seed {r['seed']}" for r in broken)
            + f"; the never-inserted canaries' bound is {'0 in every row' if all(pc(r)['null_epsilon'] == 0 for r in rows) else 'NOT 0 in some row'}."]
    return "\n".join(out)


def cells(rev: str, out: Path, timing: bool = False) -> list[tuple[dict, object, tuple]]:
    """Every cell as the cell loop takes it: ``(row, job, args)`` -- the checks of the correct mechanisms, of the
    breakages, the simulated cases and (``timing``) the timed audits."""
    todo = [({"cell": f"{name}|seed{s}", "mechanism": name, "seed": s, "role": role, "revision": rev,
              "command": audit_command(sets, s)}, check, (sets, s))
            for name, (sets, _) in MECHANISMS.items() for s, role in seeds_of(name).items()]
    todo += [({"cell": f"{name}|seed{s}", "mechanism": name, "broken": base, "breakage": how, "seed": s,
               "role": role, "revision": rev,
               "command": audit_command(MECHANISMS[base][0], s) + f"  # with DPGaussian.apply replaced by {how}() "
               "of benchmarks/dp_check.py"}, check, (MECHANISMS[base][0], s, how))
             for name, (base, how) in BREAKAGES.items() for s, role in BREAKAGE_SEEDS.items()]
    todo += [({"cell": f"sim|{m}|{b or 'correct'}", "simulated": True, "mechanism": m, "breakage": b or "correct",
               "revision": rev}, simulate, (m, b)) for m, b in SIM_CASES]
    if timing:
        sets = MECHANISMS["dp_gaussian client z=1"][0]
        for i in range(3):
            for arm, extra in (("check", []), ("off", ["audit.dp_check=false"])):
                todo.append(({"cell": f"timing|{arm}|{i}", "arm": arm, "revision": rev,
                              "command": audit_command(sets + extra, 0)}, timed_audit,
                             (sets + extra, str(out / NAME / f"timing_{arm}_{i}"))))
    return todo


def cell_ids() -> list[str]:
    """The ids of every cell :func:`cells` builds (timing cells included)."""
    return [row["cell"] for row, _, _ in cells("", Path("."), timing=True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_args(ap, NAME)
    ap.set_defaults(out=REFERENCE_OUT)
    ap.add_argument("--timing", action="store_true", help="also time the audit with and without the check")
    ap.add_argument("--redo", action="store_true", help="recompute the selected cells (their rows are replaced)")
    ap.add_argument("--cells", nargs="+", metavar="PATTERN", default=None,
                    help="run only the cells whose id matches one of these shell-style patterns (e.g. 'timing|*')")
    args = ap.parse_args()
    args.out = resolve_out(args.out)
    jsonl = args.out / f"{NAME}.jsonl"
    if args.fresh:
        start_fresh(jsonl)
    rev = revision()
    if args.check:
        raise SystemExit(0)
    if not args.report_only:
        todo = cells(rev, args.out, timing=args.timing)
        if args.cells:
            import fnmatch

            todo = [t for t in todo if any(fnmatch.fnmatchcase(t[0]["cell"], p) for p in args.cells)]
        run_cells(jsonl, todo, lambda res, row: (row.update(res) or "done") if "audit_seconds" in res or "draws" in res
                  else fill(res, row),
                  label=NAME, redo=args.redo, error_fields={"revision": rev})
    rows = latest_rows(jsonl)
    (args.out / f"{NAME}.json").write_text(json.dumps(in_grid(rows)[0], indent=1, default=str))
    write_section(args, NAME, table(rows), "The DP check: measured ε beside the accountant's", NAME)
    print(f"{len(rows)} rows in {display(jsonl)}")


if __name__ == "__main__":
    main()
