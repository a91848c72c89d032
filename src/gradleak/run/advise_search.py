"""The search of ``gradleak audit --advise`` for one candidate: the strong end of its bracket, then ``steps`` bisections
on its scale (:func:`midpoint`), the weak end when every probe stopped, the check of the strength found against every
tested attack (resumed above it where another attack still leaks), and the check on more victim batches (resumed on
the batch that still leaks). The search assumes that a stronger setting of the same defense stops what a weaker one
stopped (docs/DESIGN.md §6); the strength reported is the weakest probed one that stops, the threshold lying between
it and the strongest probed one that did not.

:class:`CandidateSearch` is a generator: it yields each probe it needs (a job of
:class:`gradleak.run.advise_probes.ProbeCells`) and is sent the probe's row. The driver
(:func:`gradleak.run.advise.advise`) advances every candidate's search one probe at a time, so the candidates' next
probes run together; each search's own probes stay sequential (a bisection step depends on the one before).
"""

from __future__ import annotations

import math
from typing import Any

from gradleak.run.advise_candidates import clip_norm, defended_config, fmt, key, set_strings, starting_point
from gradleak.run.advise_probes import (batch_config, batch_seed, held_back, level_words, not_admitted, outcome,
                                        probe_id, stopped)
from gradleak.run.advise_utility import clip_fit, dp_class, dp_epsilon


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


class CandidateSearch:
    """One candidate's search over its bracket (see the module docstring); :meth:`run` is the generator. ``session``
    is the advice's shared state (:class:`gradleak.run.advise.Session`): ``base`` / ``probe_base`` (the configs),
    ``tested`` / ``screen`` / ``leaking`` (the attacks), ``steps``, ``batches``, ``advice`` (the rows), ``checking``
    (the checks now asked), ``attacked_rounds`` and ``over_budget()``. Its state: the row, and the bracket's
    ``bad`` (leaks) / ``good`` (stops, its probe row ``found``) ends with the search's ``status``."""

    def __init__(self, spec: dict, session: Any):
        self.spec, self.s = spec, session
        self.row: dict[str, Any] = {}
        self.start: Any = None
        self.weak: Any = None
        self.bad: Any = None
        self.good: Any = None
        self.found: dict | None = None
        self.status = "stopped"

    def run(self):
        """The search, as a generator of probe jobs (sent each probe's row)."""
        s = self.s
        if not self.open():
            return
        r = yield from self.strong_end(s.screen)
        if r is None:
            return
        yield from self.bisect(self.weak, r, s.screen)
        yield from self.weak_end()
        if s.screen != s.tested and not (yield from self.verify()):
            return
        if self.status == "stopped" and s.batches > 1 and not self.row.get("unverified"):
            if not (yield from self.check_batches()):
                return
        self.close()

    def open(self) -> bool:
        """The candidate's row in the advice (its bracket: from the configured strength when the config has one);
        False when the setup does not admit it or the budget is spent (the row says so)."""
        spec, s = self.spec, self.s
        row = {"defense": key(spec), "stage": spec["stage"], "parameter": spec["param"], "what": spec["what"],
               "fixed": spec["fixed"], "probes": [], **(spec.get("row") or {})}
        self.row = row
        self.start = starting_point(s.base, spec)
        self.weak = self.start if self.start is not None else spec["weak"]
        row["bracket"] = [self.weak, spec["strong"]]
        if self.start is not None:
            row["starting_point"] = self.start
        if "clip_note" in spec:
            row.update({"clip_norm": spec["clip_norm"], "clip_note": spec["clip_note"]})
        s.advice["rows"].append(row)
        why_not = not_admitted(s.base, spec, s.leaking)
        if why_not is not None:
            row.update({"status": "not_applicable", "note": why_not})
            return False
        if s.over_budget():
            row.update({"status": "unfinished", "note": "not started: the budget was spent"})
            return False
        return True

    def at(self, value, attacks, batch: int = 0):
        """The probe of the candidate at ``value`` against ``attacks`` (recorded in the row) on victim batch ``batch``
        (0: the audited one): asked of the driver, which runs it beside the other candidates' next probes."""
        cid = probe_id(self.spec, value, attacks, self.s.tested) + (f"@batch{batch}" if batch else "")
        r = yield (cid, defended_config(batch_config(self.s.probe_base, batch), self.spec, value), False, attacks)
        self.row["probes"].append([value, cid])
        return r

    def strong_end(self, attacks, batch: int = 0):
        """The strong end's probe; None (and the row's status set) unless it stops ``attacks``."""
        strong = self.spec["strong"]
        r = yield from self.at(strong, attacks, batch)
        if held_back(r):
            self.row.update({"status": "unfinished", "note": "not started: the budget was spent"})
        elif "error" in r:
            self.row.update({"status": "failed", "note": r["error"]})
        elif outcome(r, attacks) == "unmeasured":
            self.row.update({"status": "not_measured", "levels": level_words(r, attacks),
                             "note": f"not measured at the strong end {fmt(strong)}: an attack did not run there"})
        elif not stopped(r, attacks):
            self.row.update({"status": "not_stopped", "levels": level_words(r, attacks),
                             "note": f"not stopped within [{fmt(self.weak)}, {fmt(strong)}]"})
        else:
            return r
        return None

    def bisect(self, bad, found, attacks, batch: int = 0):
        """``steps`` bisections between ``bad`` (leaks) and the strong end (stops, its row ``found``); sets the
        search's ``bad``, ``good``, ``found`` and ``status`` (``unfinished`` when the budget ended it)."""
        s, good, status = self.s, self.spec["strong"], "stopped"
        for _ in range(s.steps):
            m = midpoint(self.spec, bad, good)
            if m is None:
                break
            if s.over_budget():
                status = "unfinished"
                break
            rm = yield from self.at(m, attacks, batch)
            if held_back(rm):  # the budget was spent before it started
                status = "unfinished"
                break
            if stopped(rm, attacks):  # a failed or unmeasured probe is not evidence of a stop
                good, found = m, rm
            else:
                bad = m
        self.bad, self.good, self.found, self.status = bad, good, found, status

    def weak_end(self):
        """Every probe stopped: the weak end, assumed to leak, is measured (the configured strength is measured by the
        audit itself)."""
        s = self.s
        if self.status == "stopped" and self.bad == self.weak and self.start is None and not s.over_budget():
            rw = yield from self.at(self.weak, s.screen)
            if "error" not in rw and stopped(rw, s.screen):
                self.good, self.found = self.weak, rw
                self.row["note"] = (f"stops already at the bracket's weak end {fmt(self.weak)}: a weaker strength may "
                                    "stop it too (not searched)")

    def verify(self):
        """The strength found against the screen, checked against every tested attack; where another attack still
        leaks there, the search resumes above it against every attack. False: the search ended (the row says why)."""
        s, row, strong, tested = self.s, self.row, self.spec["strong"], self.s.tested
        row["searched_against"] = s.screen
        if s.over_budget():
            self.status = "unfinished"
            row["unverified"] = True
            return True
        s.checking[key(self.spec)] = (self.spec, self.good)  # its utility run may start beside this check
        rv = yield from self.at(self.good, tested)
        s.checking.pop(key(self.spec), None)
        if held_back(rv):  # the budget was spent before the check started: never recommended
            self.status = "unfinished"
            row["unverified"] = True
        elif stopped(rv, tested):
            self.found = rv
        elif "error" in rv or outcome(rv, tested) == "unmeasured":
            row.update({"status": "failed", "levels": level_words(rv, tested), "note": (
                f"stops {', '.join(s.screen)} at {fmt(self.good)}, but its check against every tested attack "
                f"failed: {rv.get('error') or 'an attack did not run'}")})
            return False
        else:  # another attack still leaks there: search above it against every attack
            row["verification"] = {"strength": self.good, "levels": level_words(rv, tested)}
            if self.good == strong:
                row.update({"status": "not_stopped", "levels": level_words(rv, tested),
                            "note": f"not stopped within [{fmt(self.weak)}, {fmt(strong)}]"})
                return False
            lo = self.good
            r = yield from self.strong_end(tested)
            if r is None:
                return False
            yield from self.bisect(lo, r, tested)
        return True

    def batch_entry(self, b: int, r: dict, ok: bool | None) -> dict:
        """Victim batch ``b``'s line in the row: its data seed, the strength probed there and its levels."""
        return {"batch": b, "data_seed": batch_seed(self.s.base, b), "strength": self.good,
                "levels": level_words(r, self.s.tested), "stopped": ok}

    def check_batches(self):
        """A recommendation holds for new victims: the strength found is probed on ``batches - 1`` more victim
        batches, and raised (bisection between it and the strong end) on one that still leaks. False: the search
        ended (the row says why)."""
        s, row, strong, tested = self.s, self.row, self.spec["strong"], self.s.tested
        seen = [self.batch_entry(0, self.found, True)]
        for b in range(1, s.batches):
            if s.over_budget():
                self.status = "unfinished"
                row["unverified"] = True
                row["note"] = "not checked on every victim batch: the budget was spent"
                break
            rb = yield from self.at(self.good, tested, b)
            if held_back(rb) or "error" in rb or outcome(rb, tested) == "unmeasured":
                self.status = "unfinished"
                row["unverified"] = True
                row["note"] = (f"its check on victim batch {b} did not measure: "
                               f"{rb.get('error') or 'an attack did not run'}")
                seen.append(self.batch_entry(b, rb, None))
                break
            ok = stopped(rb, tested)
            seen.append(self.batch_entry(b, rb, ok))
            if ok:
                continue
            if self.good == strong:
                row.update({"status": "not_stopped", "levels": level_words(rb, tested), "batches": seen,
                            "note": f"not stopped within [{fmt(self.weak)}, {fmt(strong)}] on victim batch {b}"})
                return False
            lo = self.good
            r = yield from self.strong_end(tested, b)
            if r is None:
                row["batches"] = seen
                return False
            yield from self.bisect(lo, r, tested, b)
            seen.append(self.batch_entry(b, self.found, True))
            if self.status != "stopped":
                break
        row["batches"] = seen
        return True

    def close(self) -> None:
        """The row of a search that found a strength: its status, strength, interval, levels, ``--set`` overrides and
        config, the budget's words, and the epsilons (measured at the strength found; the defense's own accounting
        over the audited round(s))."""
        s, spec, row, good, bad, found = self.s, self.spec, self.row, self.good, self.bad, self.found
        row.update({"status": self.status, "strength": good, "interval": [bad if bad != good else None, good],
                    "levels": level_words(found, s.tested), "set": set_strings(s.base, spec, good),
                    "config": {k: v for k, v in defended_config(s.base, spec, good).items()
                               if k in ("defenses", "defense", "fl", "threat")}})
        if row.get("unverified"):  # the attacks beyond the screen never ran at this strength: said so
            row["levels"] = {a: (lv if a in s.screen else "not checked: the budget was spent")
                             for a, lv in row["levels"].items()}
        if self.status == "unfinished":
            row["note"] = (f"unfinished (budget): stops at {fmt(good)}; " + (
                f"the weakest strength lies in [{fmt(bad)}, {fmt(good)}]" if bad != good else
                "the bracket's weak end (a weaker strength may stop it too: not searched)") + (
                               f" (against {', '.join(s.screen)} only: not yet checked against every tested attack, "
                               "so not recommended)" if row.get("unverified") else ""))
        if (found or {}).get("dp_check"):  # measured at the strength found (gradleak.run.dp_check)
            row["epsilon_measured"] = found["dp_check"]
        cls = dp_class(spec)
        if cls is not None:  # the defense's own accounting over the audited round(s)
            row["epsilon_attacked"] = dp_epsilon(cls, good, s.attacked_rounds, found.get("dp_epsilon"))
        elif "epsilon" in spec:
            row.update(spec["epsilon"](good, s.attacked_rounds))
        if clip_fit(spec) is not None and "clip_norm" not in row:  # no norm observed: the candidate's own norm
            row["clip_note"] = (f"clipping norm held at {clip_norm(defended_config(s.base, spec, good), spec)} (no "
                                "update norm observed in the baseline utility run)")
