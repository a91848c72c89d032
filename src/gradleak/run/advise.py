"""``gradleak audit --advise``: the weakest strength of each defense that stops every leaking attack, and
what it costs the model.

For the attacks the audit graded ``partial`` or more, each candidate defense this setup admits
(:data:`~gradleak.run.advise_options.CANDIDATES`) is searched over a bracket ``[weak, strong]`` of one parameter: first the strong end (if even
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

The undefended baseline's levels are the audit's own (:func:`~gradleak.run.advise_probes.audit_levels`): a probe without a defense would be the
audit of the same config, seeds and clients once more. The checks against every tested attack (minutes each on an
image config, where the optimisation attacks run) wait while any search still bisects against the screen and then
run as one batch, so they share the workers instead of each holding a batch of seconds-long probes; each candidate's
utility run at the strength checked runs in that batch too (a check that moves the strength gets the new strength's
run afterwards). A probe that runs alone in its batch runs its attacks in parallel on every worker.

Utility (:mod:`gradleak.run.advise_utility`): a probe is one attacked round, after which the accuracy has not moved;
the cost is measured by training. In the first batch, beside the first probes of the candidates that fit no clipping
norm, the baseline (no added defense) trains ``audit.utility_rounds``
rounds (:data:`~gradleak.run.advise_options.UTILITY_ROUNDS` when unset) without an attack, on fresh samples each round, and records the uploads' and
the samples' gradient norms, to which the DP candidates' clipping norms are fitted (their median); those candidates
start once it is in. After the search,
every candidate trains the same rounds at the strength found, same seeds. Cost = baseline accuracy - accuracy with
the defense, on ``data.test_size`` held-out samples (:data:`~gradleak.run.advise_probes.TEST_SIZE` when the config has none). These runs are
cells of the same JSONL. DP mechanisms report epsilon at :data:`~gradleak.run.advise_options.DELTA` twice: ``epsilon`` over the utility rounds
(the training whose accuracy is reported) and ``epsilon_attacked`` over the audited round(s) (what the probe's
attacker faced): DP-SGD from its own accountant (per-sample clipping, sampling rate of its local steps), DP-Gaussian
the Gaussian mechanism's RDP epsilon (Opacus' ``RDPAccountant``, sampling rate 1, one step per round), NVFlare's
SVT filter its own accountant (pure DP) -- each DP defense's own
:meth:`~gradleak.defenses.base.Defense.advice_epsilon`; other defenses have none (no bounded sensitivity). The
candidates are every registered defense's :attr:`~gradleak.defenses.base.Defense.advice` brackets and secure
aggregation, an FL-stage candidate that builds its own configs (:mod:`gradleak.fl.secure_aggregation`;
:func:`gradleak.run.advise_options.candidates`). ``executor`` (``--executor``): ``inline``, or ``local`` / ``ray`` (the
cell loop's executors, :mod:`gradleak.run.cells`) to run the strong-end probes of every candidate and the utility
runs in parallel (the bisection steps depend on each other and stay sequential).

The roles, one module each: this module drives the search (:func:`advise`, :class:`Session`) and is the public API
(:func:`advise`, :func:`run_audit_advised`); :mod:`gradleak.run.advise_options` the options and the candidates;
:mod:`gradleak.run.advise_candidates` a candidate at a strength as a config; :mod:`gradleak.run.advise_search` one
candidate's search (bisection, the check against every tested attack, the victim batches);
:mod:`gradleak.run.advise_probes` the probes and their cells; :mod:`gradleak.run.advise_utility` the utility runs and
the epsilons; :mod:`gradleak.run.advise_carry` the post-processing rule and its spot check;
:mod:`gradleak.run.advise_report` the ranking, the recommendation's words and the plot's data.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any, Callable

from gradleak.errors import BadInput
from gradleak.run.advise_candidates import defended_config, fmt, key
from gradleak.run.advise_carry import Carry, carryable, merge, spot_checked
from gradleak.run.advise_options import (CANDIDATES, DELTA, STEPS, advise_section, check_budget,
                                         check_utility_rounds)
from gradleak.run.advise_probes import TEST_SIZE, ProbeCells, audit_levels, level_words, probe_job, spare_images
from gradleak.run.advise_report import conclude, plot_panels, ranked
from gradleak.run.advise_search import CandidateSearch
from gradleak.run.advise_utility import clip_fit, fitted_clip, measure_utility, utility_cell_job


def check_executor(executor: str) -> str:
    """``--executor`` of the search: one of the cell loop's executors."""
    from gradleak.run.cells import EXECUTORS

    if executor not in EXECUTORS:
        raise BadInput("--executor", f"unknown executor '{executor}'.", f"use one of: {', '.join(EXECUTORS)}.")
    return executor


def clock() -> float:
    """The search's clock (the budget's): seconds."""
    return time.perf_counter()


class Session:
    """One advice's shared state: the audited config (``base``: its ``audit`` options dropped; ``probe_base``: the
    probes' config, no figures), the attacks (``leaking``: the audit's leaks; ``tested``: every attack it measured;
    ``screen``: those the bisection probes), the budget, the rows (``advice``), the searches under way and their checks
    now asked (``checking``), the probe cells (``cells``) and the post-processing rule's state (``carry``)."""

    def __init__(self, raw: dict, audit_result: dict, steps: int, batches: int, budget_seconds: float | None,
                 utility_rounds: int, executor: str):
        from gradleak.evaluation.levels import LEAKING

        self.t0 = clock()
        self.audit_result, self.steps, self.batches = audit_result, steps, batches
        self.budget_seconds, self.utility_rounds = budget_seconds, utility_rounds
        self.leaking = [e["name"] for e in audit_result["attacks"] if e.get("level") in LEAKING]
        # the probes run every attack the audit measured, not only those that leaked undefended: a defense can leave
        # a lossy attack as the best one, and a recommendation is a claim about the strongest attacker
        self.tested = [e["name"] for e in audit_result["attacks"] if e.get("level") in LEAKING + ("none",)]
        self.base = copy.deepcopy(raw)
        section = dict(self.base.get("audit") or {})
        for k in ("advise", "budget", "utility_rounds"):
            section.pop(k, None)
        if section:
            self.base["audit"] = section
        else:
            self.base.pop("audit", None)
        self.advice: dict[str, Any] = {
            "attacks": self.leaking, "tested_against": self.tested, "delta": DELTA, "steps": steps,
            "budget_seconds": budget_seconds, "rows": [], "recommendation": None, "unfinished": [], "probes": {},
            "utility": {}, "utility_rounds": utility_rounds, "executor": executor}
        # the spectral prediction beside the search: the noise std that the audit's leakage margin says drowns the
        # signal
        margins = {e["name"]: e["leakage_margin"] for e in audit_result["attacks"] if e.get("leakage_margin")}
        if margins:
            self.advice["margin"] = margins
        # the search runs against the attacks that leaked undefended (the screen: those the defense must stop); the
        # strength it finds is then verified against every tested attack. A leak of the screen is a leak of every
        # attack, so each "leaks" of the search bounds the full threshold from below; a failed verification resumes
        # the search above the found strength against every attack (gradleak.run.advise_search)
        self.screen = [a for a in self.tested if a in self.leaking]
        if not self.screen or set(self.screen) == set(self.tested):
            self.screen = list(self.tested)
        self.checking: dict[str, tuple[dict, Any]] = {}  # candidate -> (spec, strength) of its check now asked
        self.held_checks: set[str] = set()  # candidates whose check against every tested attack the budget held back
        self.specs: list[dict] = []  # the candidates as searched (DP: the clipping norm fitted to the baseline run)
        self.searches: list[tuple] = []  # (search generator, spec, the probe job it asks) of every search under way
        self.early: list[tuple] = []  # utility jobs that go into the next batch
        self.base_utility: dict | None = None
        self.carry: Carry | None = None

    def prepare(self, out_dir: str | Path, device: str | None, workers: int, executor: str,
                log: Callable[[str], Any]) -> None:
        """The probes' config and cells: the held-out test set (``data.test_size``, when the config has none), the
        config without figures, the JSONL (keyed by the config, the attacks and the code) and the baseline's
        levels (the audit's own)."""
        from gradleak import code_digest
        from gradleak.registry import ATTACKS
        from gradleak.run.audit import config_hash, plan_audit

        base, advice = self.base, self.advice
        cfg0 = plan_audit(base, [], self.leaking)[3][0][2]  # the first leaking attack's validated config
        self.attacked_rounds = cfg0.fl.rounds
        data = dict(base.get("data") or {})
        if not data.get("test_size"):
            n_test = spare_images(cfg0)
            data["test_size"] = n_test
            base["data"] = data
            advice["test_size_note"] = (f"data.test_size = {n_test} set for the probes (the config has none; the "
                                        "held-out samples are disjoint from the clients', which stay the same)"
                                        + (f"; fewer than {TEST_SIZE} because '{cfg0.data.name}' has no more to spare"
                                           if n_test < TEST_SIZE else ""))
        advice["test_size"] = data["test_size"]
        self.probe_base = copy.deepcopy(base)  # the probes' config: no plotted figures (only their numbers are read)
        self.probe_base["metrics"] = {**(self.probe_base.get("metrics") or {}), "figures": False}
        utility_from = [a for a in self.leaking if not ATTACKS.get(a).rewrites_weights]
        self.kinds = {ATTACKS.get(a).reconstruction for a in self.leaking}
        out = Path(out_dir) / "advise"
        out.mkdir(parents=True, exist_ok=True)
        # the code's digest in the name: a rerun after a code change probes again (no probe of other code is reused)
        jsonl = out / f"advise-{config_hash({'config': base, 'only': self.tested, 'code': code_digest()})}.jsonl"
        advice["jsonl"] = str(jsonl.relative_to(Path(out_dir)))
        self.cells = ProbeCells(out_dir, jsonl, advice, self.tested, utility_from, utility_from or self.leaking,
                                self.utility_rounds, device, workers, executor, log, self.hold, self.shared_start,
                                utility_cell_job)
        # the baseline's levels are the audit's own: the undefended probe would be the audit of the same config, seeds
        # and clients again (``data.test_size`` draws held-out samples beside the clients', never theirs), and for an
        # image config it alone ran every optimisation attack once more (~15 core-minutes on vit_lora)
        self.baseline = audit_levels(self.audit_result)
        advice["probes"]["baseline"] = self.baseline

    def over_budget(self) -> bool:
        return self.budget_seconds is not None and clock() - self.t0 >= self.budget_seconds

    def hold(self, cell) -> bool:
        """Once the budget is spent the cell loop holds back (never starts) every probe not yet started, and the
        utility run of a candidate whose check it held back or whose strength ended unverified: such a strength is
        never recommended, so its cost is not needed (a rerun with a larger budget measures both). The baseline's
        utility run and those of candidates that can be recommended always run."""
        if not self.over_budget():
            return False
        cid = cell.info[0]
        if cell.fn is probe_job:
            cand = cid.split(":", 1)[0]
            if cand in self.checking:  # this candidate's probe now asked is its check
                self.held_checks.add(cand)
            return True
        cand = cid.split(":")[1]  # utility:<candidate>:<param>=<value>
        return cand in self.held_checks or any(r.get("unverified") for r in self.advice["rows"]
                                               if r["defense"] == cand)

    def shared_start(self, cid: str) -> float | None:
        """The baseline's accuracy before training, for the utility run of an update defense (the same model, data
        and test samples before the first upload: measured once); None for the others (a training-time defense
        changes the model, an FL-stage candidate the clients' draw)."""
        spec = next((sp for sp in self.specs if cid.startswith(f"utility:{key(sp)}:")), None)
        start = (self.base_utility or {}).get("accuracy_start")
        return start if spec is not None and spec["stage"] == "update" and isinstance(start, float) else None

    def run_batch(self, jobs: list[tuple]) -> list[dict]:
        """Probes or utility runs as one batch of cells (:meth:`gradleak.run.advise_probes.ProbeCells.run`)."""
        return self.cells.run(jobs)

    def utility_of(self, spec: dict) -> list[tuple]:
        """The utility run of a finished search's strength (the job
        :func:`~gradleak.run.advise_utility.measure_utility` runs), or none: queued into the next batch, beside the
        other searches' probes, so no worker idles while they end."""
        row = next((r for r in reversed(self.advice["rows"]) if r["defense"] == key(spec)), {})
        if "strength" not in row:
            return []
        return [(f"utility:{key(spec)}:{spec['param']}={fmt(row['strength'])}",
                 defended_config(self.base, spec, row["strength"]), True)]

    def heavy(self, job: tuple) -> bool:
        """A probe beyond the screen (a check against every tested attack: the optimisation attacks' minutes)."""
        return not set(job[3] if len(job) > 3 and job[3] else self.tested) <= set(self.screen)

    def begin(self, chosen_specs: list[dict]) -> None:
        """Start the searches of ``chosen_specs``: each asks its first probe (one that ends at once queues its
        utility run, if it found a strength)."""
        for spec in chosen_specs:
            self.specs.append(spec)
            g = CandidateSearch(spec, self).run()
            try:
                self.searches.append((g, spec, next(g)))
            except StopIteration:
                self.early.extend(self.utility_of(spec))

    def step(self, chosen: list[dict]) -> None:
        """One batch: one probe of every search still running (and the utility runs of those done). The checks
        against every tested attack wait while any search still bisects against the screen: they then run together,
        one batch for every candidate's check, instead of each holding a batch of seconds-long screen probes for
        minutes while the other workers idle. The first batch holds the baseline's utility run, after which the
        candidates that fit their clipping norm to it start."""
        searches = self.searches
        light = [s for s in searches if not self.heavy(s[2])]
        now = light or list(searches)
        if not light:  # the checks: each candidate's utility run at the strength checked starts beside them (the
            # check rarely moves it; if it does, measure_utility runs the new strength's after the search)
            self.early += [(f"utility:{key(sp)}:{sp['param']}={fmt(v)}", defended_config(self.base, sp, v), True)
                           for sp, v in self.checking.values()]
        probe_jobs, carried = self.carry.jobs(now, self.tested, self.probe_base, self.run_batch)
        results = self.run_batch(probe_jobs + self.early
                                 + ([("utility:baseline", self.base, True)] if self.base_utility is None else []))
        merge(results, probe_jobs, carried, self.advice["probes"])
        self.early = []
        if self.base_utility is None:
            self.base_utility = bu = results[-1]
            self.advice["baseline"] = {"accuracy": bu.get("accuracy"),
                                       "levels": level_words(self.baseline, self.tested),
                                       **{k: bu.get(k) for k in ("accuracy_start", "accuracy_curve", "error",
                                                                 "diverged") if k in bu}}
            self.begin([fitted_clip(s, bu) for s in chosen if clip_fit(s) is not None])
        nxt = [s for s in self.searches if s not in now]
        for (g, spec, _), r in zip(now, results):
            try:
                nxt.append((g, spec, g.send(r)))
            except StopIteration:
                self.early += self.utility_of(spec)
        self.searches = nxt

    def finish(self, chosen: list[dict], rule: bool) -> None:
        """After the searches: the rows in the candidates' order, their utility runs, what the rule carried, its
        spot check on the ranking, and the advice's conclusion."""
        advice = self.advice
        order = [key(sp) for sp in chosen]
        advice["rows"].sort(key=lambda r: order.index(r["defense"]))  # the candidates' order, whenever each began
        by_key = {key(sp): sp for sp in self.specs}  # the candidates as searched (DP: the fitted clipping norm)
        measure_utility(self.base, [(r, by_key[r["defense"]]) for r in advice["rows"] if "strength" in r], advice,
                        self.run_batch, self.attacked_rounds)
        for r in advice["rows"]:
            if self.carry.carried.get(r["defense"]):
                r["carried"] = sorted(self.carry.carried[r["defense"]])
        advice["post_processing_rule"] = {"on": bool(rule), "carryable": self.carry.attacks}
        ok = spot_checked(ranked(advice["rows"]), by_key, self.carry, self.audit_result, self.probe_base,
                          self.run_batch, self.tested)
        advice["unfinished"] = [r["defense"] for r in advice["rows"] if r.get("status") == "unfinished"]
        advice["ran_now"] = self.cells.ran
        advice["seconds"] = clock() - self.t0
        conclude(advice, ok, self.utility_rounds)


def advise(raw: dict, out_dir: str | Path, audit_result: dict, device: str | None = None, workers: int = 1,
           budget_seconds: float | None = None, candidates: list[str] | None = None, steps: int = STEPS,
           log: Callable[[str], Any] = print, extra: list[dict] = (), utility_rounds: int | None = None,
           executor: str = "inline", batches: int | None = None, post_processing_rule: bool | None = None) -> dict:
    """The advice for the audit ``audit_result`` of ``raw`` (the resolved config, e.g. ``audit_result["config"]``):
    see the module docstring. Probes go to ``out_dir/advise/``; returns the ``advice`` dict.

    ``extra``: more candidates (e.g. Flower's DP wrappers, :mod:`gradleak.integrations.flower_advise`), specs like
    :data:`~gradleak.run.advise_options.CANDIDATES` whose callables replace the generic steps: ``configure(raw, value)`` the probe config,
    ``set(raw, value)`` the overrides, ``start(raw)`` the configured strength, ``epsilon(value, rounds)`` a dict
    (``epsilon``, ``epsilon_note``) for the row; ``row``: fields copied into the row (``tie_break``: the rank
    among equally cheap rows, before :data:`~gradleak.run.advise_options.STANDARD`'s; ``scale``; ``is_dp``: an epsilon row).

    ``batches`` (default :data:`~gradleak.run.advise_options.BATCHES`): a strength found on the audited victim batch
    is probed against every tested attack on ``batches - 1`` more victim batches (``seed`` and ``data.seed`` moved by
    :data:`~gradleak.run.advise_options.BATCH_SEED_STEP` each: other samples, other noise); where one still leaks, the
    search resumes above that strength on that batch (bisection between it and the strong end), assuming -- as every
    bisection here does -- that a stronger setting of the same defense stops what a weaker one stopped. The row's
    ``batches`` lists each batch's data seed, the strength probed there and its levels.

    ``post_processing_rule`` (default :data:`gradleak.run.advise_carry.RULE`, on): an update defense's probes do not rerun an attack measured at ``none``
    on the same victim batch's raw upload (with its noise-aware variants), carried as ``none (post-processing: ...)``;
    the recommendation's spot check reruns one carried attack (:mod:`gradleak.run.advise_carry`)."""
    from gradleak.run import advise_carry
    from gradleak.run.advise_options import BATCHES

    batches = BATCHES if batches is None else int(batches)
    budget_seconds = check_budget(budget_seconds)
    utility_rounds = check_utility_rounds(utility_rounds if utility_rounds is not None
                                          else (raw.get("audit") or {}).get("utility_rounds"))
    check_executor(executor)
    s = Session(raw, audit_result, steps, batches, budget_seconds, utility_rounds, executor)
    if not s.leaking:
        s.advice["sentence"] = "Nothing to stop: no attack leaked above its null in this audit."
        return s.advice
    s.prepare(out_dir, device, workers, executor, log)
    chosen = [c for c in CANDIDATES if (candidates is None or key(c) in candidates)
              and (not c.get("attack_kinds") or set(c["attack_kinds"]) & set(s.kinds))]
    chosen += [c for c in extra if candidates is None or key(c) in candidates]
    rule = advise_carry.RULE if post_processing_rule is None else bool(post_processing_rule)
    s.carry = Carry(s.baseline, carryable(audit_result, s.tested, s.leaking) if rule else [])
    # the baseline utility run goes in the first batch, beside the first probes of every candidate that does not fit
    # its clipping norm to it; the DP candidates start once it is in
    s.begin([c for c in chosen if clip_fit(c) is None])
    while s.searches or s.base_utility is None:
        s.step(chosen)
    s.finish(chosen, rule)
    return s.advice


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
