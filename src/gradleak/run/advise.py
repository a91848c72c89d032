"""``gradleak audit --advise``: the weakest strength of each defense that stops every leaking attack, and
what it costs the model.

For the attacks the audit graded ``partial`` or more, each candidate defense this setup admits
(:data:`CANDIDATES`) is searched over a bracket ``[weak, strong]`` of one parameter: first the strong end (if even
that leaves an attack above its null: "not stopped within the bracket"), then ``steps`` bisections on a log scale
(on ``1 - x`` for a pruned fraction, whole numbers for bits, clients and ranks). Each probe is an audit
(:func:`gradleak.run.audit.run_audit` with ``only=`` every attack the audit measured -- not only the leaking ones:
a defense can leave a lossy attack as the strongest -- and the defense added to the config's own), so the attacks
re-run at full strength against it (their variants derived from the declared defense,
:mod:`gradleak.defenses.declared`). A probe *stops* the leak when every tested attack is at level ``none`` (or
refused by the threat gate: the server no longer sees what the attack reads, e.g. an individual update under secure
aggregation); ``advice["tested_against"]`` names them. The search assumes the
leak falls monotonically with the strength; the strength reported is the weakest probed one that stops, the
threshold lying between it and the strongest probed one that did not.

The bisection probes run the attacks that leaked undefended (the *screen*: the exact attacks take seconds where an
optimisation attack takes minutes), and the strength found is then probed against every tested attack before it
counts (``row["searched_against"]``). This finds the same threshold: a probe where a screen attack leaks is a probe
where the full set leaks (the screen is a subset), so every "leaks" of the search is also one for every attack; if
the check at the found strength shows another attack leaking, the search resumes above it against every attack
(``row["verification"]``). A strength the budget left unchecked is ``unverified`` and never recommended.

Probes are cells of the one resumable cell loop (:func:`gradleak.run.cells.run_cells`) in
``OUT/advise/advise-<hash>.jsonl`` (the hash of the audited config): a rerun after a kill redoes no finished probe.
``budget_seconds`` bounds the search: no probe starts once it is spent (a probe already asked of the cell loop but not
yet started is held back, :class:`gradleak.run.cells.NotStarted`; a running one finishes), and defenses whose search
did not end are listed as unfinished -- a strength whose check against every tested attack did not run is
``unverified`` and never recommended. A rerun with a larger budget (or none) resumes where it stopped.

The undefended baseline's levels are the audit's own (:func:`audit_levels`): a probe without a defense would be the
audit of the same config, seeds and clients once more. The checks against every tested attack (minutes each on an
image config, where the optimisation attacks run) wait while any search still bisects against the screen and then
run as one batch, so they share the workers instead of each holding a batch of seconds-long probes; each candidate's
utility run at the strength checked runs in that batch too (a check that moves the strength gets the new strength's
run afterwards). A probe that runs alone in its batch runs its attacks in parallel on every worker.

Utility (:mod:`gradleak.run.advise_utility`): a probe is one attacked round, after which the accuracy has not moved;
the cost is measured by training. In the first batch, beside the first probes of the candidates that fit no clipping
norm, the baseline (no added defense) trains ``audit.utility_rounds``
rounds (:data:`UTILITY_ROUNDS` when unset) without an attack, on fresh samples each round, and records the uploads' and
the samples' gradient norms, to which the DP candidates' clipping norms are fitted (their median); those candidates
start once it is in. After the search,
every candidate trains the same rounds at the strength found, same seeds. Cost = baseline accuracy - accuracy with
the defense, on ``data.test_size`` held-out samples (:data:`TEST_SIZE` when the config has none). These runs are
cells of the same JSONL. DP mechanisms report epsilon at :data:`DELTA` twice: ``epsilon`` over the utility rounds
(the training whose accuracy is reported) and ``epsilon_attacked`` over the audited round(s) (what the probe's
attacker faced): DP-SGD from its own accountant (per-sample clipping, sampling rate of its local steps), DP-Gaussian
the Gaussian mechanism's RDP epsilon (Opacus' ``RDPAccountant``, sampling rate 1, one step per round), NVFlare's
SVT filter its own accountant (pure DP) -- each DP defense's own
:meth:`~gradleak.defenses.base.Defense.advice_epsilon`; other defenses have none (no bounded sensitivity). The
candidates are every registered defense's :attr:`~gradleak.defenses.base.Defense.advice` brackets and secure
aggregation (:func:`gradleak.run.advise_options.candidates`). ``executor`` (``--executor``): ``inline``, or ``local`` / ``ray`` (the
cell loop's executors, :mod:`gradleak.run.cells`) to run the strong-end probes of every candidate and the utility
runs in parallel (the bisection steps depend on each other and stay sequential).
"""

from __future__ import annotations

import copy
import json
import math
import time
from pathlib import Path
from typing import Any, Callable

from gradleak.errors import BadInput
from gradleak.run.advise_options import (CANDIDATES, MEANINGFUL_EPSILON, STANDARD, STEPS, UTILITY_ROUNDS,
                                         advise_section, check_budget, check_utility_rounds)
from gradleak.run.advise_carry import (Carry, carried_entry, carryable, noise_aware_variants, post_processing,
                                       reference_job, spot_pick, variant_key)
from gradleak.run.advise_utility import clip_fit, fitted_clip, improves
from gradleak.run.advise_utility import utility_job as utility

#: held-out samples for the accuracy when the config sets no ``data.test_size``
TEST_SIZE = 64
#: delta of every reported epsilon
DELTA = 1e-5


def check_executor(executor: str) -> str:
    """``--executor`` of the search: one of the cell loop's executors."""
    from gradleak.run.cells import EXECUTORS

    if executor not in EXECUTORS:
        raise BadInput("--executor", f"unknown executor '{executor}'.", f"use one of: {', '.join(EXECUTORS)}.")
    return executor


def clock() -> float:
    """The search's clock (the budget's): seconds."""
    return time.perf_counter()


# ------------------------------------------------------------------------------------------------ strengths

def midpoint(spec: dict, a: float, b: float) -> float | None:
    """The strength halfway between ``a`` and ``b`` on the candidate's scale; None when none lies between."""
    if spec["scale"] == "int":
        m = int(round(math.sqrt(a * b)))
        return None if m in (a, b) or not min(a, b) < m < max(a, b) else m
    if spec["scale"] == "log1m":  # on unit - x (a fraction: unit 1; a percentile: 100)
        u = spec.get("unit", 1)
        m = u - math.sqrt((u - a) * (u - b))
    elif spec["scale"] == "lin":
        m = (a + b) / 2
    else:
        m = math.sqrt(a * b)
    return float(f"{m:.3g}") if float(f"{m:.3g}") not in (a, b) else None


def fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def key(spec: dict) -> str:
    """A candidate's name in the advice (its defense's name, or e.g. ``gaussian_noise_absolute`` for a second mode)."""
    return spec.get("key", spec["name"])


def matches(entry: dict, spec: dict) -> bool:
    """An update defense of the config is this candidate: same name and the same mode (e.g. per-coordinate noise)."""
    params = entry.get("params") or {}
    return entry.get("name") == spec["name"] and all(bool(params.get(k, False)) == v
                                                     for k, v in (spec.get("mode") or {}).items())


def defended_config(raw: dict, spec: dict, value: Any) -> dict:
    """``raw`` with the candidate at ``value``: a defense already there of the same name is replaced (its other
    parameters kept), others are kept. Secure aggregation over K clients: ``data.nonmembers`` (per client: the
    membership attacks' candidates) is divided by K, the same candidates in all, so the K clients' data fit the data
    set as the configured clients' did."""
    if "configure" in spec:  # an extra candidate (``advise(extra=...)``) builds its own probe config
        return spec["configure"](raw, value)
    out = copy.deepcopy(raw)
    name, p = spec["name"], spec["param"]
    if spec["stage"] == "update":
        ds = list(out.get("defenses") or [])
        old = next((d for d in ds if matches(d, spec)), None)
        params = {**spec["fixed"], **((old or {}).get("params") or {}), **(spec.get("mode") or {}), p: value}
        out["defenses"] = [d for d in ds if d is not old] + [{"name": name, "params": params}]
    elif spec["stage"] == "training":
        old = out.get("defense") if (out.get("defense") or {}).get("name") == name else {}
        out["defense"] = {**spec["fixed"], **(old or {}), "name": name, p: value}
    else:  # secure aggregation over `value` clients
        out["fl"] = {**(out.get("fl") or {}), "secure_aggregation": True, "clients": int(value)}
        nonmembers = (out.get("data") or {}).get("nonmembers")
        if nonmembers:
            out["data"] = {**out["data"], "nonmembers": max(1, int(nonmembers) * int((raw.get("fl") or {}).get(
                "clients", 1)) // int(value))}
        threat = dict(out.get("threat") or {})
        if threat.get("individual_updates"):
            threat.pop("individual_updates")
            out["threat"] = threat
    return out


def starting_point(raw: dict, spec: dict) -> Any:
    """The configured strength of this defense when the config already has it (the search's weak end), else None."""
    if "start" in spec:
        return spec["start"](raw)
    name, p = spec["name"], spec["param"]
    if spec["stage"] == "update":
        d = next((d for d in raw.get("defenses") or [] if matches(d, spec)), None)
        return ((d or {}).get("params") or {}).get(p)
    if spec["stage"] == "training":
        d = raw.get("defense") or {}
        return d.get(p) if d.get("name") == name else None
    fl = raw.get("fl") or {}
    return fl.get("clients", 1) if fl.get("secure_aggregation") else None


def set_strings(raw: dict, spec: dict, value: Any) -> list[str]:
    """The ``--set`` overrides that put the candidate at ``value`` into the audited config."""
    if "set" in spec:
        return spec["set"](raw, value)
    cfg = defended_config(raw, spec, value)
    if spec["stage"] == "update":
        return ["defenses=" + json.dumps(cfg["defenses"])]
    if spec["stage"] == "training":
        return ["defense=" + json.dumps(cfg["defense"])]
    return ["fl.secure_aggregation=true", f"fl.clients={int(value)}"] + (
        [f"data.nonmembers={cfg['data']['nonmembers']}"] if (cfg.get("data") or {}).get("nonmembers") != (
            raw.get("data") or {}).get("nonmembers") else [])


def gaussian_epsilon(noise_multiplier: float, steps: int, delta: float = DELTA) -> float | None:
    """Epsilon of ``steps`` compositions of the Gaussian mechanism with ``noise_multiplier`` (sampling rate 1): the
    RDP accountant's closed form (:func:`gradleak.accounting.gaussian_rdp_epsilon`, equal to Opacus'
    ``RDPAccountant``)."""
    from gradleak.accounting import gaussian_rdp_epsilon

    return gaussian_rdp_epsilon(noise_multiplier, steps, delta)


# ------------------------------------------------------------------------------------------------ probes

def probe(raw: dict, out_dir: str, only: list[str], device: str | None, workers: int, utility_from: list[str]) -> dict:
    """One probe (a cell): the audit of ``raw`` restricted to ``only`` into ``out_dir``, compacted to what the
    advice needs. A setup whose every attack the threat gate refuses comes back as ``refused`` (not an error)."""
    from gradleak.run.audit import plan_audit, run_audit

    try:
        res = run_audit(raw, out_dir, [], device, only=only, log=lambda m: None, workers=workers)
    except BadInput as err:  # every attack refused: each one's own reason (the gate's, or the setup's)
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


def batch_seed(raw: dict, batch: int) -> int:
    """The ``data.seed`` of victim batch ``batch`` (0: the audited config's own)."""
    from gradleak.run.advise_options import BATCH_SEED_STEP

    return int((raw.get("data") or {}).get("seed") or 0) + BATCH_SEED_STEP * int(batch)


def batch_config(raw: dict, batch: int) -> dict:
    """``raw`` drawing victim batch ``batch``: ``seed`` and ``data.seed`` moved by ``BATCH_SEED_STEP`` each (the
    samples follow ``data.seed``, the noise and initialisation ``seed``); batch 0 is ``raw`` itself."""
    if not batch:
        return raw
    from gradleak.run.advise_options import BATCH_SEED_STEP

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


#: the gate's refusal that a defense causes: the server no longer sees an individual update (secure aggregation)
GATE_STOP = "threat.individual_updates"


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


def hollow_dp(r: dict) -> bool:
    """A DP row whose epsilon guarantees nothing: absolute noise under a DP name (no epsilon, or above
    ``MEANINGFUL_EPSILON``)."""
    e = r.get("epsilon")
    from gradleak.defenses.base import is_dp_defense

    return bool(is_dp_defense(r["defense"]) or r.get("is_dp")) and not (
        isinstance(e, (int, float)) and e <= MEANINGFUL_EPSILON)


def ranked(rows: list[dict]) -> list[dict]:
    """The candidates that can be recommended (a strength found: ``stopped``, or ``unfinished`` with its best so far;
    never one whose strength was not checked against every tested attack, ``unverified``), best first: a defense the model trains under before one it diverges under; then the lowest accuracy cost (an
    unmeasured cost last); a finished search before an unfinished one; a meaningful DP guarantee before a hollow one;
    then the candidate's tie-break (its place in ``STANDARD``)."""
    ok = [r for r in rows if r.get("status") in ("stopped", "unfinished") and "strength" in r
          and not r.get("unverified")]
    return sorted(ok, key=lambda r: (bool(r.get("diverged")),
                                     r.get("cost") if isinstance(r.get("cost"), (int, float)) else math.inf,
                                     r["status"] != "stopped", hollow_dp(r),
                                     r["tie_break"] if "tie_break" in r else STANDARD.index(r["defense"])))


def _levels(row: dict, attacks: list[str]) -> dict[str, str]:
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


def advise(raw: dict, out_dir: str | Path, audit_result: dict, device: str | None = None, workers: int = 1,
           budget_seconds: float | None = None, candidates: list[str] | None = None, steps: int = STEPS,
           log: Callable[[str], Any] = print, extra: list[dict] = (), utility_rounds: int | None = None,
           executor: str = "inline", batches: int | None = None, post_processing_rule: bool | None = None) -> dict:
    """The advice for the audit ``audit_result`` of ``raw`` (the resolved config, e.g. ``audit_result["config"]``):
    see the module docstring. Probes go to ``out_dir/advise/``; returns the ``advice`` dict.

    ``extra``: more candidates (e.g. Flower's DP wrappers, :mod:`gradleak.integrations.flower_advise`), specs like
    :data:`CANDIDATES` whose callables replace the generic steps: ``configure(raw, value)`` the probe config,
    ``set(raw, value)`` the overrides, ``start(raw)`` the configured strength, ``epsilon(value, rounds)`` a dict
    (``epsilon``, ``epsilon_note``) for the row; ``row``: fields copied into the row (``tie_break``: the rank
    among equally cheap rows, before :data:`STANDARD`'s; ``scale``; ``is_dp``: an epsilon row).

    ``batches`` (default :data:`~gradleak.run.advise_options.BATCHES`): a strength found on the audited victim batch
    is probed against every tested attack on ``batches - 1`` more victim batches (``seed`` and ``data.seed`` moved by
    :data:`~gradleak.run.advise_options.BATCH_SEED_STEP` each: other samples, other noise); where one still leaks, the
    search resumes above that strength on that batch (bisection between it and the strong end), assuming -- as every
    bisection here does -- that a stronger setting of the same defense stops what a weaker one stopped. The row's
    ``batches`` lists each batch's data seed, the strength probed there and its levels.

    ``post_processing_rule`` (default :data:`gradleak.run.advise_carry.RULE`, on): an update defense's probes do not rerun an attack measured at ``none``
    on the same victim batch's raw upload (with its noise-aware variants), carried as ``none (post-processing: ...)``;
    the recommendation's spot check reruns one carried attack (:mod:`gradleak.run.advise_carry`)."""
    from gradleak.run.advise_options import BATCHES

    batches = BATCHES if batches is None else int(batches)
    from gradleak.evaluation.levels import LEAKING
    from gradleak.registry import ATTACKS
    from gradleak.run.audit import config_hash, plan_audit
    from gradleak.run.cells import Cell, cell_dir_name, done_cells, error_text, run_cells
    budget_seconds = check_budget(budget_seconds)
    utility_rounds = check_utility_rounds(utility_rounds if utility_rounds is not None
                                          else (raw.get("audit") or {}).get("utility_rounds"))
    check_executor(executor)
    t0 = clock()
    leaking = [e["name"] for e in audit_result["attacks"] if e.get("level") in LEAKING]
    # the probes run every attack the audit measured, not only those that leaked undefended: a defense can leave a
    # lossy attack as the best one, and a recommendation is a claim about the strongest attacker
    tested = [e["name"] for e in audit_result["attacks"] if e.get("level") in LEAKING + ("none",)]
    base = copy.deepcopy(raw)
    section = dict(base.get("audit") or {})
    for k in ("advise", "budget", "utility_rounds"):
        section.pop(k, None)
    if section:
        base["audit"] = section
    else:
        base.pop("audit", None)
    advice: dict[str, Any] = {"attacks": leaking, "tested_against": tested, "delta": DELTA, "steps": steps,
                              "budget_seconds": budget_seconds,
                              "rows": [], "recommendation": None, "unfinished": [], "probes": {}, "utility": {},
                              "utility_rounds": utility_rounds, "executor": executor}
    # the spectral prediction beside the search: the noise std that the audit's leakage margin says drowns the signal
    margins = {e["name"]: e["leakage_margin"] for e in audit_result["attacks"] if e.get("leakage_margin")}
    if margins:
        advice["margin"] = margins
    if not leaking:
        advice["sentence"] = "Nothing to stop: no attack leaked above its null in this audit."
        return advice
    cfg0 = plan_audit(base, [], leaking)[3][0][2]  # the first leaking attack's validated config (threat upgraded if so)
    data = dict(base.get("data") or {})
    if not data.get("test_size"):
        n_test = _spare_images(cfg0)
        data["test_size"] = n_test
        base["data"] = data
        advice["test_size_note"] = (f"data.test_size = {n_test} set for the probes (the config has none; the "
                                    "held-out samples are disjoint from the clients', which stay the same)"
                                    + (f"; fewer than {TEST_SIZE} because '{cfg0.data.name}' has no more to spare"
                                       if n_test < TEST_SIZE else ""))
    advice["test_size"] = data["test_size"]
    probe_base = copy.deepcopy(base)  # the probes' config: no plotted figures (only their numbers are read)
    probe_base["metrics"] = {**(probe_base.get("metrics") or {}), "figures": False}
    utility_from = [a for a in leaking if not ATTACKS.get(a).rewrites_weights]
    kinds = {ATTACKS.get(a).reconstruction for a in leaking}
    out = Path(out_dir) / "advise"
    out.mkdir(parents=True, exist_ok=True)
    from gradleak import code_digest

    # the code's digest in the name: a rerun after a code change probes again (no probe of other code is reused)
    jsonl = out / f"advise-{config_hash({'config': base, 'only': tested, 'code': code_digest()})}.jsonl"
    advice["jsonl"] = str(jsonl.relative_to(Path(out_dir)))
    ran: list[str] = []

    def quiet(msg: str) -> None:
        if " cells: " not in msg:
            log(msg)

    checking: dict[str, tuple[dict, Any]] = {}  # candidate -> (spec, strength) of its check now asked
    held_checks: set[str] = set()  # candidates whose check against every tested attack the budget held back

    def hold(cell) -> bool:
        """Once the budget is spent the cell loop holds back (never starts) every probe not yet started, and the
        utility run of a candidate whose check it held back or whose strength ended unverified: such a strength is
        never recommended, so its cost is not needed (a rerun with a larger budget measures both). The baseline's
        utility run and those of candidates that can be recommended always run."""
        if not over_budget():
            return False
        cid = cell.info[0]
        if cell.fn is _probe_job:
            cand = cid.split(":", 1)[0]
            if cand in checking:  # this candidate's probe now asked is its check
                held_checks.add(cand)
            return True
        cand = cid.split(":")[1]  # utility:<candidate>:<param>=<value>
        return cand in held_checks or any(r.get("unverified") for r in advice["rows"] if r["defense"] == cand)

    def shared_start(cid: str) -> float | None:
        """The baseline's accuracy before training, for the utility run of an update defense (the same model, data
        and test samples before the first upload: measured once); None for the others (a training-time defense
        changes the model, secure aggregation the clients' draw)."""
        spec = next((sp for sp in specs if cid.startswith(f"utility:{key(sp)}:")), None)
        start = (base_utility or {}).get("accuracy_start")
        return start if spec is not None and spec["stage"] == "update" and isinstance(start, float) else None

    def run_batch(jobs: list[tuple]) -> list[dict]:
        """Probes (``utility=False``) or utility runs (``True``) as cells, in parallel under ``executor``; each
        cell's id holds its config's hash: a changed config (or a changed candidate) is a new cell. A probe job may
        name the attacks it runs as a fourth element (default: every tested attack)."""
        cells, names = [], {}
        # a probe's own attacks run in parallel on every worker when it runs alone (or inline); beside other cells
        # under a pool executor each cell holds one worker
        probe_workers = workers if executor == "inline" or len(jobs) == 1 else 1
        for cid, cfg_raw, is_utility, *only in jobs:
            key = f"{cid}#{config_hash(cfg_raw)[:8]}"
            d = out / cell_dir_name(cid)
            args = ((cfg_raw, utility_from or leaking, utility_rounds, device, cid == "utility:baseline",
                     shared_start(cid))
                    if is_utility else (cfg_raw, str(d), (only[0] if only else None) or tested, device,
                                        probe_workers, utility_from))
            cells.append(Cell(key, _utility_job if is_utility else _probe_job, args, info=(cid, d)))
            names[key] = cid
        before = done_cells(jsonl)
        ran.extend(names[c.id] for c in cells if c.id not in before)

        def row(cell, res, err, seconds):
            r = {"cell": cell.id, "out": str(cell.info[1].relative_to(Path(out_dir))), "seconds": seconds}
            return {**r, "error": error_text(err)} if err is not None else {**r, **res}

        def describe(r):
            if r["cell"].startswith("utility:"):
                return f"accuracy {fmt(r.get('accuracy'))} after {r.get('rounds')} round(s)"
            ran_here = list(r.get("attacks") or {}) or tested
            return "stops the leak" if stopped(r, ran_here) else "leaks: " + ", ".join(
                f"{a} {lv}" for a, lv in _levels(r, ran_here).items())

        latest = run_cells(cells, jsonl, row, label="advise", log=quiet, describe=describe,
                           executor=executor if len(cells) > 1 else "inline", workers=workers, skip=hold)
        rows = [latest[c.id] for c in cells]
        for c, r in zip(cells, rows):
            (advice["utility"] if names[c.id].startswith("utility:") else advice["probes"])[names[c.id]] = r
        return rows

    # the search runs against the attacks that leaked undefended (the screen: those the defense must stop); the
    # strength it finds is then verified against every tested attack. A leak of the screen is a leak of every
    # attack, so each "leaks" of the search bounds the full threshold from below; a failed verification resumes
    # the search above the found strength against every attack (:func:`screened_search`)
    screen = [a for a in tested if a in leaking]
    if not screen or set(screen) == set(tested):
        screen = list(tested)

    def over_budget() -> bool:
        return budget_seconds is not None and clock() - t0 >= budget_seconds

    # the baseline's levels are the audit's own: the undefended probe would be the audit of the same config, seeds
    # and clients again (``data.test_size`` draws held-out samples beside the clients', never theirs), and for an
    # image config it alone ran every optimisation attack once more (~15 core-minutes on vit_lora)
    baseline = audit_levels(audit_result)
    advice["probes"]["baseline"] = baseline
    chosen = [s for s in CANDIDATES if (candidates is None or key(s) in candidates)
              and (not s.get("membership_only") or "membership" in kinds)]
    chosen += [s for s in extra if candidates is None or key(s) in candidates]
    specs: list[dict] = []  # the candidates as searched (DP: the clipping norm fitted to the baseline utility run)

    def search(spec):
        """One candidate's search, as a generator: it yields each probe it needs (a :func:`run_batch` job) and is
        sent the probe's row. The driver below advances every candidate's search one probe at a time, so the
        candidates' next probes run together (in parallel under the ``local`` / ``ray`` executor); each search's own
        probes stay sequential (a bisection step depends on the one before)."""
        row: dict[str, Any] = {"defense": key(spec), "stage": spec["stage"], "parameter": spec["param"],
                               "what": spec["what"], "fixed": spec["fixed"], "probes": [], **(spec.get("row") or {})}
        start = starting_point(base, spec)
        weak = start if start is not None else spec["weak"]
        row["bracket"] = [weak, spec["strong"]]
        if start is not None:
            row["starting_point"] = start
        if "clip_note" in spec:
            row.update({"clip_norm": spec["clip_norm"], "clip_note": spec["clip_note"]})
        advice["rows"].append(row)
        why_not = _admitted(base, spec, leaking)
        if why_not is not None:
            row.update({"status": "not_applicable", "note": why_not})
            return
        if over_budget():
            row.update({"status": "unfinished", "note": "not started: the budget was spent"})
            return

        def at(value, attacks, batch: int = 0):
            """The probe of ``spec`` at ``value`` against ``attacks`` (recorded in the row) on victim batch ``batch``
            (0: the audited one): asked of the driver, which runs it beside the other candidates' next probes."""
            cid = probe_id(spec, value, attacks, tested) + (f"@batch{batch}" if batch else "")
            r = yield (cid, defended_config(batch_config(probe_base, batch), spec, value), False, attacks)
            row["probes"].append([value, cid])
            return r

        def strong_end(attacks, batch: int = 0) -> dict | None:
            """The strong end's probe; None (and the row's status set) unless it stops ``attacks``."""
            r = yield from at(spec["strong"], attacks, batch)
            if held_back(r):
                row.update({"status": "unfinished", "note": "not started: the budget was spent"})
            elif "error" in r:
                row.update({"status": "failed", "note": r["error"]})
            elif outcome(r, attacks) == "unmeasured":
                row.update({"status": "not_measured", "levels": _levels(r, attacks),
                            "note": f"not measured at the strong end {fmt(spec['strong'])}: an attack did not run "
                                    "there"})
            elif not stopped(r, attacks):
                row.update({"status": "not_stopped", "levels": _levels(r, attacks),
                            "note": f"not stopped within [{fmt(weak)}, {fmt(spec['strong'])}]"})
            else:
                return r
            return None

        def bisect(bad, good, found, attacks, batch: int = 0):
            status = "stopped"
            for _ in range(steps):
                m = midpoint(spec, bad, good)
                if m is None:
                    break
                if over_budget():
                    status = "unfinished"
                    break
                rm = yield from at(m, attacks, batch)
                if held_back(rm):  # the budget was spent before it started
                    status = "unfinished"
                    break
                if stopped(rm, attacks):  # a failed or unmeasured probe is not evidence of a stop
                    good, found = m, rm
                else:
                    bad = m
            return bad, good, found, status

        r = yield from strong_end(screen)
        if r is None:
            return
        bad, good, found, status = yield from bisect(weak, spec["strong"], r, screen)
        if status == "stopped" and bad == weak and start is None and not over_budget():
            # every probe stopped: the weak end, assumed to leak, is measured (the configured strength is measured
            # by the audit itself)
            rw = yield from at(weak, screen)
            if "error" not in rw and stopped(rw, screen):
                good, found = weak, rw
                row["note"] = (f"stops already at the bracket's weak end {fmt(weak)}: a weaker strength may stop it "
                               "too (not searched)")
        if screen != tested:  # the found strength, verified against every tested attack
            row["searched_against"] = screen
            if over_budget():
                status = "unfinished"
                row["unverified"] = True
            else:
                checking[key(spec)] = (spec, good)  # its utility run may start beside this check (the driver)
                rv = yield from at(good, tested)
                checking.pop(key(spec), None)
                if held_back(rv):  # the budget was spent before the check started: never recommended
                    status = "unfinished"
                    row["unverified"] = True
                elif stopped(rv, tested):
                    found = rv
                elif "error" in rv or outcome(rv, tested) == "unmeasured":
                    row.update({"status": "failed", "levels": _levels(rv, tested), "note": (
                        f"stops {', '.join(screen)} at {fmt(good)}, but its check against every tested attack "
                        f"failed: {rv.get('error') or 'an attack did not run'}")})
                    return
                else:  # another attack still leaks there: search above it against every attack
                    row["verification"] = {"strength": good, "levels": _levels(rv, tested)}
                    if good == spec["strong"]:
                        row.update({"status": "not_stopped", "levels": _levels(rv, tested),
                                    "note": f"not stopped within [{fmt(weak)}, {fmt(spec['strong'])}]"})
                        return
                    lo = good
                    r = yield from strong_end(tested)
                    if r is None:
                        return
                    bad, good, found, status = yield from bisect(lo, spec["strong"], r, tested)
        if status == "stopped" and batches > 1 and not row.get("unverified"):
            # a recommendation holds for new victims: the strength found stops every tested attack on more batches
            def entry(b: int, r: dict, ok: bool | None) -> dict:
                return {"batch": b, "data_seed": batch_seed(base, b), "strength": good, "levels": _levels(r, tested),
                        "stopped": ok}

            seen = [entry(0, found, True)]
            for b in range(1, batches):
                if over_budget():
                    status = "unfinished"
                    row["unverified"] = True
                    row["note"] = "not checked on every victim batch: the budget was spent"
                    break
                rb = yield from at(good, tested, b)
                if held_back(rb) or "error" in rb or outcome(rb, tested) == "unmeasured":
                    status = "unfinished"
                    row["unverified"] = True
                    row["note"] = (f"its check on victim batch {b} did not measure: "
                                   f"{rb.get('error') or 'an attack did not run'}")
                    seen.append(entry(b, rb, None))
                    break
                ok = stopped(rb, tested)
                seen.append(entry(b, rb, ok))
                if ok:
                    continue
                if good == spec["strong"]:
                    row.update({"status": "not_stopped", "levels": _levels(rb, tested), "batches": seen,
                                "note": f"not stopped within [{fmt(weak)}, {fmt(spec['strong'])}] on victim batch {b}"})
                    return
                lo = good
                r = yield from strong_end(tested, b)
                if r is None:
                    row["batches"] = seen
                    return
                bad, good, found, status = yield from bisect(lo, spec["strong"], r, tested, b)
                seen.append(entry(b, found, True))
                if status != "stopped":
                    break
            row["batches"] = seen
        row.update({"status": status, "strength": good, "interval": [bad if bad != good else None, good],
                    "levels": _levels(found, tested), "set": set_strings(base, spec, good),
                    "config": {k: v for k, v in defended_config(base, spec, good).items()
                               if k in ("defenses", "defense", "fl", "threat")}})
        if row.get("unverified"):  # the attacks beyond the screen never ran at this strength: said so
            row["levels"] = {a: (lv if a in screen else "not checked: the budget was spent")
                             for a, lv in row["levels"].items()}
        if status == "unfinished":
            row["note"] = (f"unfinished (budget): stops at {fmt(good)}; " + (
                f"the weakest strength lies in [{fmt(bad)}, {fmt(good)}]" if bad != good else
                "the bracket's weak end (a weaker strength may stop it too: not searched)") + (
                               f" (against {', '.join(screen)} only: not yet checked against every tested attack, "
                               "so not recommended)" if row.get("unverified") else ""))
        if (found or {}).get("dp_check"):  # measured at the strength found (gradleak.run.dp_check)
            row["epsilon_measured"] = found["dp_check"]
        cls = _dp_class(spec)
        if cls is not None:  # the defense's own accounting over the audited round(s)
            row["epsilon_attacked"] = cls.advice_epsilon(good, cfg0.fl.rounds, found.get("dp_epsilon"), DELTA,
                                                        gaussian_epsilon)
        elif "epsilon" in spec:
            row.update(spec["epsilon"](good, cfg0.fl.rounds))
        if clip_fit(spec) is not None and "clip_norm" not in row:  # no norm observed: the candidate's own norm
            row["clip_note"] = (f"clipping norm held at {_clip_norm(defended_config(base, spec, good), spec)} (no "
                                "update norm observed in the baseline utility run)")

    def utility_of(spec: dict) -> list[tuple]:
        """The utility run of a finished search's strength (the job :func:`measure_utility` runs), or none: queued
        into the next batch, beside the other searches' probes, so no worker idles while they end."""
        row = next((r for r in reversed(advice["rows"]) if r["defense"] == key(spec)), {})
        if "strength" not in row:
            return []
        return [(f"utility:{key(spec)}:{spec['param']}={fmt(row['strength'])}",
                 defended_config(base, spec, row["strength"]), True)]

    def heavy(job: tuple) -> bool:
        """A probe beyond the screen (a check against every tested attack: the optimisation attacks' minutes)."""
        return not set(job[3] if len(job) > 3 and job[3] else tested) <= set(screen)

    searches, early = [], []
    from gradleak.run import advise_carry

    post_processing_rule = advise_carry.RULE if post_processing_rule is None else bool(post_processing_rule)
    carry = Carry(baseline, carryable(audit_result, tested, leaking) if post_processing_rule else [])

    def carry_jobs(items: list[tuple]) -> tuple[list[tuple], list[dict[str, str]]]:
        """The post-processing rule on one batch of probes (:mod:`gradleak.run.advise_carry`): each probe of an
        update defense drops the attacks the rule carries on its victim batch (the raw-upload references run first,
        once per batch and variant), which come back as ``none (post-processing: ...)``."""
        plans: list[tuple | None] = []
        for _, spec, job in items:
            cid, cfg_raw, is_utility, *rest = job
            attacks = (rest[0] if rest else None) or tested
            todo = [a for a in attacks if a in carry.attacks]
            if is_utility or not todo or not post_processing(spec):
                plans.append(None)
                continue
            b = int(cid.rsplit("@batch", 1)[1]) if "@batch" in cid else 0
            plans.append((b, noise_aware_variants(cfg_raw, todo), todo, attacks))
        need: dict[str, tuple] = {}
        for p in plans:
            for rid, what in carry.needs(p[0], p[1]) if p else []:
                names = list(carry.attacks) if what[0] == "plain" else [
                    a for a in p[2] if what[2] in {variant_key(v) for v in p[1].get(a, [])}]
                old = need.get(rid, (what, []))[1]
                need[rid] = (what, sorted(set(old) | set(names)))
        if need:
            jobs = []
            for rid, (what, names) in need.items():
                cfg_ref, only = reference_job(probe_base, what, names, {what[2]: names}, batch_config)
                jobs.append((rid, cfg_ref, False, only))
            for (rid, (what, _)), r in zip(need.items(), run_batch(jobs)):
                carry.store(what, r)
        out_jobs, words = [], []
        for (_, spec, job), p in zip(items, plans):
            w = carry.split(p[0], p[2], p[1]) if p else {}
            if not w:
                out_jobs.append(job)
                words.append({})
                continue
            carry.carried.setdefault(key(spec), set()).update(w)
            keep = [a for a in p[3] if a not in w]
            # the id a probe of these attacks alone has: the screen's probe at the same strength and batch is reused
            at_batch = f"@batch{p[0]}" if p[0] else ""
            stem = job[0][:-len(at_batch)] if at_batch else job[0]
            out_jobs.append((stem.split("[", 1)[0] + ("" if set(keep) == set(tested) else f"[{'+'.join(keep)}]")
                             + at_batch, job[1], False, keep))
            words.append(w)
        return out_jobs, words

    def begin(chosen_specs: list[dict]) -> None:
        for spec in chosen_specs:
            specs.append(spec)
            g = search(spec)
            try:
                searches.append((g, spec, next(g)))
            except StopIteration:
                early.extend(utility_of(spec))

    # the baseline utility run goes in the first batch, beside the first probes of every candidate that does not fit
    # its clipping norm to it; the DP candidates start once it is in
    begin([s for s in chosen if clip_fit(s) is None])
    base_utility = None
    while searches or base_utility is None:
        # one probe of every search still running (and the utility runs of those done), as one batch. The checks
        # against every tested attack wait while any search still bisects against the screen: they then run
        # together, one batch for every candidate's check, instead of each holding a batch of seconds-long screen
        # probes for minutes while the other workers idle
        light = [s for s in searches if not heavy(s[2])]
        now = light or list(searches)
        if not light:  # the checks: each candidate's utility run at the strength checked starts beside them (the
            # check rarely moves it; if it does, measure_utility runs the new strength's after the search)
            early += [(f"utility:{key(sp)}:{sp['param']}={fmt(v)}", defended_config(base, sp, v), True)
                      for sp, v in checking.values()]
        probe_jobs, carried = carry_jobs(now)
        results = run_batch(probe_jobs + early + ([("utility:baseline", base, True)] if base_utility is None else []))
        for i, w in enumerate(carried):  # the carried attacks back into their probes' rows, with their words
            if w and "error" not in results[i]:
                results[i] = {**results[i], "carried": w,
                              "attacks": {**(results[i].get("attacks") or {}), **{a: carried_entry(t)
                                                                                  for a, t in w.items()}}}
                advice["probes"][probe_jobs[i][0]] = results[i]
        early = []
        if base_utility is None:
            base_utility = results[-1]
            advice["baseline"] = {"accuracy": base_utility.get("accuracy"), "levels": _levels(baseline, tested),
                                  **{k: base_utility.get(k) for k in ("accuracy_start", "accuracy_curve", "error",
                                                                      "diverged") if k in base_utility}}
            begin([fitted_clip(s, base_utility) for s in chosen if clip_fit(s) is not None])
        nxt = [s for s in searches if s not in now]
        for (g, spec, _), r in zip(now, results):
            try:
                nxt.append((g, spec, g.send(r)))
            except StopIteration:
                early += utility_of(spec)
        searches = nxt

    order = [key(sp) for sp in chosen]
    advice["rows"].sort(key=lambda r: order.index(r["defense"]))  # the candidates' order, whenever each began
    by_key = {key(sp): sp for sp in specs}  # the candidates as searched (DP: the fitted clipping norm)
    measure_utility(base, [(r, by_key[r["defense"]]) for r in advice["rows"] if "strength" in r], advice, run_batch,
                    cfg0.fl.rounds)
    for r in advice["rows"]:
        if carry.carried.get(r["defense"]):
            r["carried"] = sorted(carry.carried[r["defense"]])
    advice["post_processing_rule"] = {"on": bool(post_processing_rule), "carryable": carry.attacks}
    ok = spot_checked(ranked(advice["rows"]), by_key, carry, audit_result, probe_base, run_batch, tested)
    advice["unfinished"] = [r["defense"] for r in advice["rows"] if r.get("status") == "unfinished"]
    advice["ran_now"] = ran
    advice["seconds"] = clock() - t0
    advice["ranking"] = [r["defense"] for r in ok]
    b = advice["baseline"]
    if b.get("diverged"):
        advice["cost_note"] = (f"the undefended model's own training diverged (a NaN/inf upload in round "
                               f"{b['diverged']['round']} at lr {fmt(b['diverged']['lr'])}): every cost compares "
                               "against a diverged run (lower fl.lr or its schedule)")
    elif not improves(b):
        advice["cost_note"] = (f"the undefended model's test accuracy does not rise over the {utility_rounds} utility "
                               f"round(s) ({fmt(b.get('accuracy_start'))} before, {fmt(b.get('accuracy'))} after), so "
                               "the costs measure no lost learning (raise audit.utility_rounds, or audit a setup "
                               "whose undefended model learns in that many rounds)")
    if ok:
        best = ok[0]
        cost = best.get("cost")
        advice["recommendation"] = {"defense": best["defense"], "parameter": best["parameter"],
                                    "strength": best["strength"], "set": best["set"], "cost": cost,
                                    "accuracy": best.get("accuracy"), "epsilon": best.get("epsilon")}
        advice["sentence"] = (
            f"Recommended: {best['defense']} with {best['parameter']} = {fmt(best['strength'])} ({best['what']}): "
            f"the weakest strength probed that brings {', '.join(leaking)} back to its null (tested against every attack "
            f"the audit measured: {', '.join(tested)}), at an accuracy cost of "
            + (f"{cost * 100:+.1f} points ({fmt(advice['baseline']['accuracy'])} -> {fmt(best.get('accuracy'))}"
               + (f"; within twice the test set's sampling error of {best['cost_se'] * 100:.1f} points: not "
                  "distinguishable from no cost" if abs(cost) < 2 * best.get("cost_se", 0) else "") + ")"
               if isinstance(cost, (int, float)) else "(not measured)")
            + (f" after {utility_rounds} training round(s)" if isinstance(cost, (int, float)) else "")
            + (f", epsilon = {fmt(best['epsilon'])} at delta = {DELTA:g} over those rounds"
               if isinstance(best.get("epsilon"), float) else "")
            + ". Set it with " + " ".join(f"--set '{s}'" for s in best["set"]) + ".")
    else:
        advice["sentence"] = ("No candidate stopped every leaking attack within its bracket"
                              + (" (some were not finished within the budget)" if advice["unfinished"] else "") + ".")
    return advice


def spot_checked(ok: list[dict], by_key: dict, carry, audit_result: dict, probe_base: dict, run_batch,
                 tested: list[str]) -> list[dict]:
    """The ranking ``ok`` after the post-processing rule's spot check (:mod:`gradleak.run.advise_carry`): the best
    row that carried an attack reruns the one whose undefended run was quickest, at its strength on the audited
    batch, in full (its variants included); the result goes into the row's ``spot_check``. A spot check above
    ``none`` withdraws that row (status ``failed``: the rule did not hold there) and the next one is checked."""
    from gradleak.evaluation.levels import LEAKING

    while ok:
        best = ok[0]
        a = spot_pick(set(best.get("carried") or []), audit_result)
        if a is None:
            return ok
        spec = by_key[best["defense"]]
        cid = f"spotcheck:{probe_id(spec, best['strength'], [a], tested)}"
        r = run_batch([(cid, defended_config(probe_base, spec, best["strength"]), False, [a])])[0]
        e = (r.get("attacks") or {}).get(a) or {}
        best["spot_check"] = {"attack": a, "strength": best["strength"], "level": e.get("level"),
                              **{k: e.get(k) for k in ("metric", "value", "null_p99", "p_value")},
                              "seconds": r.get("seconds"), **({"error": r["error"]} if "error" in r else {})}
        if e.get("level") not in LEAKING:
            return ok
        best.update({"status": "failed", "note": f"the post-processing rule's spot check failed: {a} reads "
                                                 f"{e.get('level')} at {fmt(best['strength'])} (it was carried as "
                                                 "none from the raw upload)"})
        ok = ok[1:]
    return ok


def _dp_class(spec: dict):
    """The registered DP mechanism a candidate searches (its class owns the epsilon), or None."""
    from gradleak.defenses.base import defense_class

    cls = defense_class(spec["name"])
    return cls if cls is not None and cls.is_dp else None


def _spare_images(cfg) -> int:
    """:data:`TEST_SIZE`, or fewer when a fixed image set (e.g. the 40 CIFAR samples) cannot spare that many beside the
    clients' images of the largest federation a probe builds (secure aggregation: up to 8 clients), their validation
    images and the prior images."""
    from gradleak.modalities import modality_of

    total = modality_of(cfg).fixed_size(cfg)
    if total is None:
        return TEST_SIZE
    clients = max(int(cfg.fl.clients), max(int(c["strong"]) for c in CANDIDATES if c["name"] == "secure_aggregation"))
    used = clients * (cfg.data.batch_size + cfg.data.validation_size) + (cfg.data.prior_size if cfg.attack_cls.uses_prior
                                                                         else 0)
    return max(0, min(TEST_SIZE, total - used - 1))


def _clip_norm(cfg: dict, spec: dict) -> Any:
    """The clipping norm of the DP candidate in ``cfg`` (the configured one, or the candidate's fixed one)."""
    if spec["stage"] == "training":
        return (cfg.get("defense") or {}).get("max_grad_norm", 1.0)
    d = next((d for d in cfg.get("defenses") or [] if matches(d, spec)), {})
    return (d.get("params") or {}).get("max_norm", 1.0)


def _probe_job(raw, out_dir, only, device, workers, utility_from):
    """A probe cell's job (module level: the local and Ray executors pickle it)."""
    return probe(raw, out_dir, only, device, workers, utility_from)


def _utility_job(raw, attacks, rounds, device, norms, accuracy_start=None):
    """A utility cell's job (:func:`gradleak.run.advise_utility.utility_job`)."""
    if accuracy_start is None:
        return utility(raw, attacks, rounds, device, norms)
    return utility(raw, attacks, rounds, device, norms, accuracy_start)


def _admitted(base: dict, spec: dict, leaking: list[str]) -> str | None:
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


def cost_sampling_error(base: Any, acc: Any, n: Any) -> float | None:
    """The standard error of a cost (baseline accuracy - accuracy with the defense) from the ``n`` test samples
    alone: two independent binomial proportions. The training's own seed-to-seed spread is not in it (a lower
    bound on the cost's uncertainty)."""
    if not all(isinstance(v, (int, float)) for v in (base, acc)) or not isinstance(n, int) or n <= 0:
        return None
    return math.sqrt((base * (1 - base) + acc * (1 - acc)) / n)


def measure_utility(base: dict, found: list[tuple[dict, dict]], advice: dict, run_batch, attacked_rounds: int) -> None:
    """The utility runs of the candidates found (``(row, spec)`` pairs) at their strengths, in one batch of cells;
    fills each row's ``accuracy``, ``cost`` (against the baseline run) and, for DP, ``epsilon`` over the utility
    rounds."""
    runs = run_batch([(f"utility:{key(spec)}:{spec['param']}={fmt(r['strength'])}",
                       defended_config(base, spec, r["strength"]), True) for r, spec in found]) if found else []
    b = advice["baseline"].get("accuracy")
    for (r, spec), u in zip(found, runs):
        if held_back(u):  # the budget was spent and the strength is unverified (never recommended): not measured
            r["utility_note"] = ("accuracy not measured: the budget was spent and this strength was not checked "
                                 "against every tested attack")
            continue
        if "error" in u:
            r["utility_error"] = u["error"]
            continue
        r.update(accuracy=u.get("accuracy"), accuracy_curve=u.get("accuracy_curve"), utility_rounds=u.get("rounds"))
        if u.get("diverged"):
            d = u["diverged"]
            r["diverged"] = d
            r["utility_note"] = (f"training diverged under this defense: client {d['client']}'s upload in round "
                                 f"{d['round']} of {u.get('rounds')} held NaN/inf (lr = {fmt(d['lr'])}); the accuracy is "
                                 "the global model's when it did (training cannot continue)")
        if isinstance(b, (int, float)) and isinstance(r["accuracy"], (int, float)):
            r["cost"] = b - r["accuracy"]
            se = cost_sampling_error(b, r["accuracy"], advice.get("test_size"))
            if se is not None:
                r["cost_se"] = se
        cls = _dp_class(spec)
        if cls is not None:  # the defense's own accounting over the utility rounds
            r["epsilon"] = cls.advice_epsilon(r["strength"], u.get("rounds") or 1, u.get("dp_epsilon"), DELTA,
                                              gaussian_epsilon)
            if cls.epsilon_delta is not None:  # the defense's own δ (pure DP: 0), shown beside its ε
                r["epsilon_delta"] = cls.epsilon_delta
        if clip_fit(spec) is not None:
            r["epsilon_note"] = (f"epsilon over the {u.get('rounds')} utility round(s) (the training whose accuracy is "
                                 f"reported); epsilon_attacked over the audited {attacked_rounds} round(s)")
        if cls is not None and cls.epsilon_words:  # the defense's own words on its accountant
            r["epsilon_note"] = "; ".join(x for x in (r.get("epsilon_note"), cls.epsilon_words) if x)
        if spec["name"] == "secure_aggregation":
            r["utility_note"] = (f"trains {fmt(r['strength'])} clients' batches a round (the baseline: the configured "
                                 "clients'): the cost compares federations of different sizes")


def plot_panels(advice: dict) -> list[dict]:
    """The privacy-utility plot's data: per searched defense, each probe's strength with each leaking attack's
    headline (and its null median / p99) and, at the strength found, the utility run's accuracy; the baseline
    accuracy beside it."""
    panels = []
    for r in advice.get("rows") or []:
        pts = []
        for value, cid in r.get("probes") or []:
            p = (advice.get("probes") or {}).get(cid) or {}
            if "error" in p:
                continue
            u = (advice.get("utility") or {}).get("utility:" + cid) or {}  # trained at the strength found only
            pts.append({"x": value, "accuracy": u.get("accuracy"),
                        "attacks": {a: {k: ((p.get("attacks") or {}).get(a) or {}).get(k)
                                        for k in ("value", "null_median", "null_p99", "metric", "level")}
                                    for a in advice["attacks"]}})
        if pts:
            pts.sort(key=lambda t: t["x"])
            panels.append({"title": f"{r['defense']} ({r['parameter']})", "points": pts,
                           "log": (r.get("scale") or CANDIDATE_BY_NAME[r["defense"]]["scale"]) not in ("log1m", "lin"),
                           "found": r.get("strength"), "baseline_accuracy": (advice.get("baseline") or {}).get("accuracy")})
    return panels


CANDIDATE_BY_NAME = {key(c): c for c in CANDIDATES}


def run_audit_advised(raw: dict, out_dir: str | Path, overrides: list[str] | None = None, device: str | None = None,
                      only: list[str] | None = None, command: str = "", log: Callable[[str], Any] = print,
                      workers: int = 1, budget_seconds: float | None = None, advise_on: bool = False,
                      executor: str = "inline") -> dict:
    """``gradleak audit --advise``: the audit (itself a cell, so a rerun after a kill reuses it), then
    :func:`advise` when ``advise_on`` or ``audit.advise`` says so; ``advice`` goes into audit.json and the report
    (with ``advice.png``, the privacy-utility plot). ``budget_seconds`` (``--budget``) overrides ``audit.budget``;
    ``executor`` (``--executor``): see :func:`advise`."""
    from gradleak.run.audit import config_hash, plan_audit, run_audit
    from gradleak.run.audit_report import write_audit_report
    from gradleak.run.cells import Cell, error_text, run_cells
    from gradleak.run.results import write_json_atomic
    from gradleak.run.runner import check_out_dir

    budget_seconds = check_budget(budget_seconds)
    check_executor(executor)
    resolved = plan_audit(raw, overrides, only)[0]
    section = resolved.get("audit") or {}
    opts = advise_section(section.get("advise"))
    if opts is None and not advise_on:
        if budget_seconds is not None:
            raise BadInput("--budget", "bounds the --advise search, but the audit is not advising.",
                           "add --advise (or audit: {advise: true}), or drop --budget.")
        return run_audit(raw, out_dir, overrides, device, only=only, command=command, log=log, workers=workers)
    opts = opts or {"candidates": None, "steps": STEPS}
    if budget_seconds is None:
        budget_seconds = check_budget(section.get("budget"), "audit.budget")
    out = check_out_dir(out_dir)
    (out / "advise").mkdir(exist_ok=True)
    from gradleak import code_digest

    h = config_hash({"config": resolved, "only": only, "code": code_digest()})
    path = out / "audit.json"

    def audit_row(cell, res, err, seconds):
        if err is not None:
            return {"cell": cell.id, "error": error_text(err)}
        return {"cell": cell.id, "verdict": res["verdict"], "config_hash": res["config_hash"], "seconds": seconds}

    jsonl = out / "advise" / f"audit-{h}.jsonl"
    fresh: list = []

    def audit_job(*args):
        fresh.append(True)
        return run_audit(*args)

    done = run_cells([Cell("audit", audit_job, (raw, out, overrides, device, only, command, log, workers))], jsonl,
                     audit_row, fatal=(BadInput,), label="advise", log=lambda m: None)
    if "error" in done["audit"]:
        raise RuntimeError(f"the audit failed (rerun to retry): {done['audit']['error']}")
    result = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    if result is None or result.get("config_hash") != done["audit"].get("config_hash"):  # audit.json gone or other
        result = run_audit(raw, out, overrides, device, only=only, command=command, log=log, workers=workers)
    elif not fresh:
        log("[advise] the audit of this config was done before: reused (audit.json)")
    log("[advise] searching the weakest defense that stops: "
        + (", ".join(e["name"] for e in result["attacks"] if e.get("level") in ("partial", "strong", "exact"))
           or "nothing (no leak)"))
    adv = advise(result["config"], out, result, device=device, workers=workers, budget_seconds=budget_seconds,
                 candidates=opts["candidates"], steps=opts["steps"], log=log,
                 utility_rounds=check_utility_rounds(section.get("utility_rounds")), executor=executor,
                 batches=opts.get("batches"))
    panels = plot_panels(adv)
    if panels:
        from gradleak.report.plots import save_privacy_utility_plot

        save_privacy_utility_plot(panels, out / "advice.png")
        adv["plot"] = "advice.png"
    result["advice"] = adv
    write_json_atomic(path, result)
    write_audit_report(result, out)
    return result
