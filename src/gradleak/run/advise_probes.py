"""The probes of ``gradleak audit --advise``: one probe is an audit of the config with a candidate defense added
(:func:`gradleak.run.audit.run_audit` restricted to the tested attacks), compacted to what the advice reads, run as a
cell of the one resumable cell loop (:func:`gradleak.run.cells.run_cells`, :class:`ProbeCells`).

A probe *stops* the leak (:func:`outcome`) when every attack it ran is at level ``none`` or refused by the threat gate
because the server no longer sees an individual update (:data:`GATE_STOP`, e.g. under secure aggregation); a failed
probe, or an attack refused for another reason, is ``unmeasured``: no evidence of a stop (docs/DESIGN.md §6). A probe
the cell loop held back once the budget was spent (:func:`held_back`) is no evidence either way. Victim batch ``b``
(:func:`batch_config`) moves ``seed`` and ``data.seed`` by
:data:`~gradleak.run.advise_options.BATCH_SEED_STEP` each; the probes' held-out test set (:func:`spare_images`) fits
beside the clients of the largest federation a probe builds.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

from gradleak.errors import BadInput
from gradleak.run.advise_candidates import defended_config, fmt, key
from gradleak.run.advise_options import BATCH_SEED_STEP, CANDIDATES

#: held-out samples for the accuracy when the config sets no ``data.test_size``
TEST_SIZE = 64
#: the gate's refusal that a defense causes: the server no longer sees an individual update (secure aggregation)
GATE_STOP = "threat.individual_updates"


def probe(raw: dict, out_dir: str, only: list[str], device: str | None, workers: int, utility_from: list[str]) -> dict:
    """One probe (a cell): the audit of ``raw`` restricted to ``only`` into ``out_dir``, compacted to what the
    advice needs. A setup whose every attack the threat gate refuses comes back as ``refused`` (not an error)."""
    from gradleak.run.audit import run_audit

    try:
        res = run_audit(raw, out_dir, [], device, only=only, log=lambda m: None, workers=workers)
    except BadInput as err:  # every attack refused: each one's own reason (the gate's, or the setup's)
        return refused(raw, only, err)
    out: dict[str, Any] = {"verdict": res["verdict"], "attacks": {}}
    for e in res["attacks"]:
        out["attacks"][e["name"]] = {k: e.get(k) for k in ("level", "metric", "value", "null_median", "null_p99",
                                                             "p_value", "reason")}
        mets = e.get("metrics") or {}
        if e["name"] in utility_from and out.get("accuracy") is None and "accuracy" in mets:
            out["accuracy"], out["accuracy_from"] = mets["accuracy"], e["name"]
        if "dp_epsilon" in mets and out.get("dp_epsilon") is None:
            out["dp_epsilon"] = mets["dp_epsilon"]
    dp = res.get("dp_check")
    if dp:  # the probe's measured ε (its strongest threat model) beside the claim
        worst = max(dp.get("measured") or [{}], key=lambda m: m.get("epsilon", -1.0))
        # a measured threat model without an interval (NVFlare SVT's sign-canary check: a bound, not a fit) keeps
        # what it has
        out["dp_check"] = {"verdict": dp["verdict"], "claimed_epsilon": dp.get("claimed_epsilon"),
                           **({k: worst.get(k) for k in ("epsilon", "interval", "threat_model")}
                              if "epsilon" in worst else {})}
    return out


def refused(raw: dict, only: list[str], err: BadInput) -> dict:
    """The probe row of a setup whose every attack was refused (``err``): each attack's own reason -- the gate's, or
    its line of the list of refusals once the data were known, else the shared error."""
    from gradleak.run.audit import plan_audit

    reasons = {}
    for a in only:
        try:
            plan_audit(raw, [], [a])  # the gate accepts it: its run was refused once the data were known
            own = [ln.strip()[len(a) + 2:] for ln in str(err).splitlines()[1:] if ln.strip().startswith(f"{a}: ")]
            reasons[a] = own[0] if own else str(err)  # its line of a list of refusals, else the shared error
        except BadInput as e:
            reasons[a] = str(e)
    return {"refused": str(err), "field": err.field,
            "attacks": {a: {"level": None, "reason": r} for a, r in reasons.items()}}


def probe_job(raw, out_dir, only, device, workers, utility_from):
    """A probe cell's job (module level: the local and Ray executors pickle it)."""
    return probe(raw, out_dir, only, device, workers, utility_from)


def batch_seed(raw: dict, batch: int) -> int:
    """The ``data.seed`` of victim batch ``batch`` (0: the audited config's own)."""
    return int((raw.get("data") or {}).get("seed") or 0) + BATCH_SEED_STEP * int(batch)


def batch_config(raw: dict, batch: int) -> dict:
    """``raw`` drawing victim batch ``batch``: ``seed`` and ``data.seed`` moved by ``BATCH_SEED_STEP`` each (the
    samples follow ``data.seed``, the noise and initialisation ``seed``); batch 0 is ``raw`` itself."""
    if not batch:
        return raw
    out = copy.deepcopy(raw)
    out["seed"] = int(out.get("seed") or 0) + BATCH_SEED_STEP * int(batch)
    out["data"] = {**(out.get("data") or {}), "seed": batch_seed(raw, batch)}
    return out


def held_back(row: dict) -> bool:
    """A probe the cell loop held back before it started, the budget being spent (:class:`gradleak.run.cells.NotStarted`):
    no evidence either way; its search ends unfinished."""
    return str(row.get("error") or "").startswith("NotStarted")


def audit_levels(audit_result: dict) -> dict:
    """The audit's own result in a probe row's shape (:func:`probe`): the undefended baseline of the search."""
    return {"verdict": audit_result.get("verdict"), "from_audit": True,
            "attacks": {e["name"]: {k: e.get(k) for k in ("level", "metric", "value", "null_median", "null_p99",
                                                           "p_value", "reason")} for e in audit_result["attacks"]}}


def outcome(row: dict, attacks: list[str]) -> str:
    """``stopped``: every leaking attack back at level ``none`` or refused by the gate because the server no longer
    sees an individual update; ``leaks``: one still at ``partial`` or more; ``unmeasured``: otherwise (an attack
    refused for another reason, undefined, or the probe failed)."""
    if "error" in row:
        return "unmeasured"
    seen = []
    for a in attacks:
        e = (row.get("attacks") or {}).get(a) or {}
        lv = e.get("level")
        if lv in ("partial", "strong", "exact"):
            return "leaks"
        seen.append(lv == "none" or (lv is None and str(e.get("reason") or "").startswith(GATE_STOP)))
    return "stopped" if all(seen) else "unmeasured"


def stopped(row: dict, attacks: list[str]) -> bool:
    return outcome(row, attacks) == "stopped"


def probe_id(spec: dict, value, attacks: list[str], tested: list[str]) -> str:
    """The cell id of a probe of ``spec`` at ``value``: ``<candidate>:<param>=<value>``, with ``[a+b]`` when it runs
    only some of the tested attacks (the screen of the search)."""
    return f"{key(spec)}:{spec['param']}={fmt(value)}" + (
        "" if set(attacks) == set(tested) else f"[{'+'.join(attacks)}]")


def level_words(row: dict, attacks: list[str]) -> dict[str, str]:
    """Each attack's level in a probe row, in words: the level, a carried level with the rule's words, the gate's
    refusal, or why it did not run."""
    out = {}
    for a in attacks:
        e = (row.get("attacks") or {}).get(a) or {}
        reason = str(e.get("reason") or "no result")
        if e.get("carried"):  # the post-processing rule's: never silently (gradleak.run.advise_carry)
            out[a] = f"{e['level']} ({e['carried']})"
            continue
        out[a] = e.get("level") or ("refused: the server sees no individual update" if reason.startswith(GATE_STOP)
                                    else "not run: " + reason[:160])
    return out


def spare_images(cfg) -> int:
    """:data:`TEST_SIZE`, or fewer when a fixed image set (e.g. the 40 CIFAR samples) cannot spare that many beside the
    clients' images of the largest federation a probe builds (an FL-stage candidate's, e.g. secure aggregation: up to 8
    clients), their validation images and the prior images."""
    from gradleak.modalities import modality_of

    total = modality_of(cfg).fixed_size(cfg)
    if total is None:
        return TEST_SIZE
    clients = max([int(cfg.fl.clients)] + [c["fl_stage"].largest_federation() for c in CANDIDATES if "fl_stage" in c])
    used = clients * (cfg.data.batch_size + cfg.data.validation_size) + (
        cfg.data.prior_size if cfg.attack_cls.uses_prior else 0)
    return max(0, min(TEST_SIZE, total - used - 1))


def not_admitted(base: dict, spec: dict, leaking: list[str]) -> str | None:
    """None when this setup admits the candidate (at its strong end), else why not. The gate refusing every attack
    (the server no longer sees what they read) is a stop, not a refusal of the defense."""
    from gradleak.modalities import modality_of
    from gradleak.run.audit import plan_audit

    try:
        cfg = plan_audit(defended_config(base, spec, spec["strong"]), [], leaking)[3][0][2]
    except BadInput as err:
        return None if err.field.startswith("threat.") else str(err)
    needs = spec.get("requires")
    if needs == "batchnorm" and not modality_of(cfg).has_batchnorm(cfg):
        return (f"{key(spec)} audits each update with the BN-aware inversion, which reads BatchNorm running "
                f"statistics: the model ({cfg.model.name}, {cfg.modality}) has no BatchNorm layer (it applies to "
                "model.name=resnet18 with model.norm=batch, e.g. configs/leakage/fmnist_resnet18.yaml)")
    return None


class ProbeCells:
    """The advice's probes (``utility=False``) and utility runs (``True``) as cells of one JSONL, in parallel under
    ``executor``; each cell's id holds its config's hash: a changed config (or a changed candidate) is a new cell.
    ``utility_attacks``: the attacks a utility run's config is planned with (the model's dtype and initialisation
    follow the attack, as in the probes); ``hold(cell)``: the budget's hold-back (the cell loop's ``skip``);
    ``shared_start(cid)``: the baseline's accuracy before training that a utility run reuses, or None;
    ``utility_job``: the utility cells' job (:func:`gradleak.run.advise_utility.utility_cell_job`). Every row lands
    in ``advice["probes"]`` or ``advice["utility"]``; ``ran`` lists the cells this call ran (not done before)."""

    def __init__(self, out_dir: str | Path, jsonl: Path, advice: dict, tested: list[str], utility_from: list[str],
                 utility_attacks: list[str], utility_rounds: int, device: str | None, workers: int, executor: str,
                 log: Callable[[str], Any], hold: Callable, shared_start: Callable[[str], Any], utility_job: Callable):
        self.out_dir, self.jsonl, self.advice, self.tested = Path(out_dir), jsonl, advice, tested
        self.utility_from, self.utility_attacks = utility_from, utility_attacks
        self.utility_rounds, self.device = utility_rounds, device
        self.workers, self.executor, self.log = workers, executor, log
        self.hold, self.shared_start, self.utility_job = hold, shared_start, utility_job
        self.ran: list[str] = []

    def quiet(self, msg: str) -> None:
        if " cells: " not in msg:
            self.log(msg)

    def cell(self, job: tuple, probe_workers: int):
        """The cell of one job ``(cid, config, is_utility[, attacks])`` and its id (``<cid>#<config hash>``)."""
        from gradleak.run.audit import config_hash
        from gradleak.run.cells import Cell, cell_dir_name

        cid, cfg_raw, is_utility, *only = job
        cell_key = f"{cid}#{config_hash(cfg_raw)[:8]}"
        d = self.out_dir / "advise" / cell_dir_name(cid)
        args = ((cfg_raw, self.utility_attacks, self.utility_rounds, self.device, cid == "utility:baseline",
                 self.shared_start(cid))
                if is_utility else (cfg_raw, str(d), (only[0] if only else None) or self.tested, self.device,
                                    probe_workers, self.utility_from))
        return Cell(cell_key, self.utility_job if is_utility else probe_job, args, info=(cid, d))

    def row(self, cell, res, err, seconds) -> dict:
        from gradleak.run.cells import error_text

        r = {"cell": cell.id, "out": str(cell.info[1].relative_to(self.out_dir)), "seconds": seconds}
        return {**r, "error": error_text(err)} if err is not None else {**r, **res}

    def describe(self, r: dict) -> str:
        if r["cell"].startswith("utility:"):
            return f"accuracy {fmt(r.get('accuracy'))} after {r.get('rounds')} round(s)"
        ran_here = list(r.get("attacks") or {}) or self.tested
        return "stops the leak" if stopped(r, ran_here) else "leaks: " + ", ".join(
            f"{a} {lv}" for a, lv in level_words(r, ran_here).items())

    def run(self, jobs: list[tuple]) -> list[dict]:
        """The rows of ``jobs`` (run now, or read back when done before). A probe job may name the attacks it runs as
        a fourth element (default: every tested attack)."""
        from gradleak.run.cells import done_cells, run_cells

        # a probe's own attacks run in parallel on every worker when it runs alone (or inline); beside other cells
        # under a pool executor each cell holds one worker
        probe_workers = self.workers if self.executor == "inline" or len(jobs) == 1 else 1
        cells = [self.cell(job, probe_workers) for job in jobs]
        names = {c.id: c.info[0] for c in cells}
        before = done_cells(self.jsonl)
        self.ran.extend(names[c.id] for c in cells if c.id not in before)
        latest = run_cells(cells, self.jsonl, self.row, label="advise", log=self.quiet, describe=self.describe,
                           executor=self.executor if len(cells) > 1 else "inline", workers=self.workers,
                           skip=self.hold)
        rows = [latest[c.id] for c in cells]
        for c, r in zip(cells, rows):
            (self.advice["utility"] if names[c.id].startswith("utility:") else self.advice["probes"])[names[c.id]] = r
        return rows
