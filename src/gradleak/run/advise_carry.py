"""The post-processing rule of ``gradleak audit --advise``: which attacks a probe need not rerun, and the spot check
that tests the rule on every advice.

**The rule.** An update defense is a function of the upload alone and of randomness independent of the client's data
(noise, clipping of the whole update, top-k, quantisation, NVFlare's filters; secure aggregation adds the other
clients' uploads, which are independent of the victim's data). By the data-processing inequality (Cover & Thomas,
*Elements of Information Theory*, Thm. 2.8.1) the defended upload holds no more information about the victim's data
than the raw one. An attack measured at ``none`` on the raw upload of a victim batch is therefore not rerun on that
batch's defended upload -- *when its noise-aware variant is no stronger than itself on the raw upload*: the attack the
audit runs under a declared defense is not only the plain attack on a processed input but its full-strength variants
(:func:`gradleak.run.audit.full_strength_variants`, e.g. the optimisation attacks' ``noise_model: declared``, which
matches by the declared noise's likelihood), so those variants are measured on the raw upload too, once per victim
batch (:func:`reference_job`), and an attack is carried only where the plain run and every such variant read
``none`` there. A carried attack enters the probe's row as level ``none`` with the words
``post-processing: measured undefended at p = ...`` (:func:`carried_entry`): never silently.

The rule does **not** apply to training-time defenses (DP-SGD, FISGuard, L2, dropout, label smoothing, min-max): they
change what the client computes, so the defended upload is not a function of the raw one (:func:`post_processing`).
Flower's DP wrappers are checked in full as well (their probes configure the framework, not a declared transform).

**The spot check.** The rule is measured, not assumed: ``benchmarks/postprocessing.py`` runs the carried attacks
anyway over (config, defense, strength, seed) cells and counts how many rise above ``none`` (docs/REPRODUCTION.md), and
every advice whose recommendation carried an attack reruns one of them -- the one whose undefended run took least time
-- at the recommended strength on the audited batch (:func:`spot_checked`), recorded in the row; a spot check that
leaks withdraws the recommendation (the next candidate is ranked)."""

from __future__ import annotations

import copy
import json
from typing import Any, Callable

from gradleak.run.advise_candidates import defended_config, fmt, key
from gradleak.run.advise_probes import batch_config, probe_id

#: the rule's default in :func:`gradleak.run.advise.advise` (a search without it checks every tested attack at every
#: strength it recommends)
RULE = True
#: candidate stages whose defense is a function of the upload alone (``fl``: secure aggregation)
POST_PROCESSING_STAGES = ("update", "fl")


def post_processing(spec: dict) -> bool:
    """Whether candidate ``spec`` is a post-processing of the upload (the rule may carry attacks into its probes)."""
    return spec.get("stage") in POST_PROCESSING_STAGES and "configure" not in spec


def carryable(audit_result: dict, tested: list[str], leaking: list[str]) -> list[str]:
    """The tested attacks the rule may carry: measured at ``none`` on the audited (raw) upload, not leaking."""
    levels = {e["name"]: e.get("level") for e in audit_result["attacks"]}
    return [a for a in tested if a not in leaking and levels.get(a) == "none"]


def noise_aware_variants(defended_raw: dict, attacks: list[str]) -> dict[str, list[dict]]:
    """``{attack: [variant params, ...]}``: the full-strength variants the audit would run for each of ``attacks``
    on ``defended_raw`` (derived from its declared defenses), besides the configured parameters."""
    from gradleak.errors import BadInput
    from gradleak.run.audit import full_strength_variants, plan_audit

    try:
        planned = plan_audit(defended_raw, [], attacks)[3]
    except BadInput:
        return {}
    out: dict[str, list[dict]] = {}
    for e, cand, cfg, A in planned:
        out[e["name"]] = [v for v in full_strength_variants(A, cand, cfg) if v]
    return out


def variant_key(v: dict) -> str:
    """A variant's parameters as one string (the key of its raw-upload reference)."""
    return json.dumps(v, sort_keys=True)


def with_params(raw: dict, params: dict[str, dict]) -> dict:
    """``raw`` with ``audit.params.<attack>`` set to ``params[attack]`` (merged over what the config sets)."""
    out = copy.deepcopy(raw)
    section = dict(out.get("audit") or {})
    ps = {k: dict(v) for k, v in (section.get("params") or {}).items()}
    for a, p in params.items():
        ps[a] = {**ps.get(a, {}), **p}
    section["params"] = ps
    out["audit"] = section
    return out


class Carry:
    """The rule's state over one advice: the raw-upload references per victim batch and what each candidate
    carried. ``baseline``: the audit's own probe row (batch 0's plain runs)."""

    def __init__(self, baseline: dict, attacks: list[str]):
        self.attacks = list(attacks)
        self.plain: dict[int, dict] = {0: baseline}  # batch -> probe row of the plain attacks on the raw upload
        self.aware: dict[tuple[int, str], dict] = {}  # (batch, variant key) -> probe row of the variants, raw upload
        self.carried: dict[str, set[str]] = {}  # candidate -> attacks carried in any of its probes

    def needs(self, batch: int, variants: dict[str, list[dict]]) -> list[tuple[str, tuple]]:
        """The reference probes still missing for ``batch`` (ids and :func:`reference_job` arguments)."""
        out = []
        if batch not in self.plain:
            out.append((f"reference:raw@batch{batch}", ("plain", batch, None)))
        for vk in sorted({variant_key(v) for vs in variants.values() for v in vs}):
            if (batch, vk) not in self.aware:
                out.append((f"reference:raw@batch{batch}:{vk}", ("aware", batch, vk)))
        return out

    def store(self, what: tuple, row: dict) -> None:
        kind, batch, vk = what
        if kind == "plain":
            self.plain[batch] = row
        else:
            self.aware[(batch, vk)] = row

    def split(self, batch: int, attacks: list[str], variants: dict[str, list[dict]]) -> dict[str, str]:
        """``{attack: words}`` for each of ``attacks`` the rule carries on ``batch``: plain and every variant at
        ``none`` on the raw upload (the references must be stored)."""
        out = {}
        for a in attacks:
            if a not in self.attacks:
                continue
            plain = ((self.plain.get(batch) or {}).get("attacks") or {}).get(a) or {}
            if plain.get("level") != "none":
                continue
            aware = [((self.aware.get((batch, variant_key(v))) or {}).get("attacks") or {}).get(a) or {}
                     for v in variants.get(a, [])]
            if any(x.get("level") != "none" for x in aware):
                continue
            out[a] = carried_words(plain, aware, batch)
        return out

    def plan(self, items: list[tuple], tested: list[str]) -> list[tuple | None]:
        """Per ``(search, spec, job)`` of one batch: ``(victim batch, variants, attacks the rule may carry, attacks)``
        for a probe of a post-processing candidate with an attack the rule may carry, else None."""
        plans: list[tuple | None] = []
        for _, spec, job in items:
            cid, cfg_raw, is_utility, *rest = job
            attacks = (rest[0] if rest else None) or tested
            todo = [a for a in attacks if a in self.attacks]
            if is_utility or not todo or not post_processing(spec):
                plans.append(None)
                continue
            b = int(cid.rsplit("@batch", 1)[1]) if "@batch" in cid else 0
            plans.append((b, noise_aware_variants(cfg_raw, todo), todo, attacks))
        return plans

    def run_references(self, plans: list[tuple | None], probe_base: dict, run_batch: Callable) -> None:
        """The raw-upload reference probes that ``plans`` still need (once per victim batch and variant), run as one
        batch of cells and stored."""
        need: dict[str, tuple] = {}
        for p in plans:
            for rid, what in self.needs(p[0], p[1]) if p else []:
                names = list(self.attacks) if what[0] == "plain" else [
                    a for a in p[2] if what[2] in {variant_key(v) for v in p[1].get(a, [])}]
                old = need.get(rid, (what, []))[1]
                need[rid] = (what, sorted(set(old) | set(names)))
        if not need:
            return
        jobs = []
        for rid, (what, names) in need.items():
            cfg_ref, only = reference_job(probe_base, what, names, {what[2]: names}, batch_config)
            jobs.append((rid, cfg_ref, False, only))
        for (rid, (what, _)), r in zip(need.items(), run_batch(jobs)):
            self.store(what, r)

    def jobs(self, items: list[tuple], tested: list[str], probe_base: dict,
             run_batch: Callable) -> tuple[list[tuple], list[dict[str, str]]]:
        """The rule on one batch of probes ``(search, spec, job)``: each probe of an update defense drops the attacks
        the rule carries on its victim batch (the raw-upload references run first, once per batch and variant);
        returns the jobs to run and, per job, ``{attack: words}`` of the attacks carried (:func:`merge`)."""
        plans = self.plan(items, tested)
        self.run_references(plans, probe_base, run_batch)
        out_jobs, words = [], []
        for (_, spec, job), p in zip(items, plans):
            w = self.split(p[0], p[2], p[1]) if p else {}
            if not w:
                out_jobs.append(job)
                words.append({})
                continue
            self.carried.setdefault(key(spec), set()).update(w)
            keep = [a for a in p[3] if a not in w]
            # the id a probe of these attacks alone has: the screen's probe at the same strength and batch is reused
            at_batch = f"@batch{p[0]}" if p[0] else ""
            stem = job[0][:-len(at_batch)] if at_batch else job[0]
            out_jobs.append((stem.split("[", 1)[0] + ("" if set(keep) == set(tested) else f"[{'+'.join(keep)}]")
                             + at_batch, job[1], False, keep))
            words.append(w)
        return out_jobs, words


def merge(results: list[dict], probe_jobs: list[tuple], words: list[dict[str, str]], probes: dict) -> None:
    """The carried attacks back into their probes' rows ``results`` (in place, and in ``probes``, the advice's rows by
    cell), each as level ``none`` with the rule's words (:func:`carried_entry`)."""
    for i, w in enumerate(words):
        if w and "error" not in results[i]:
            results[i] = {**results[i], "carried": w,
                          "attacks": {**(results[i].get("attacks") or {}), **{a: carried_entry(t)
                                                                              for a, t in w.items()}}}
            probes[probe_jobs[i][0]] = results[i]


def carried_words(plain: dict, aware: list[dict], batch: int) -> str:
    """The words a carried attack's level carries."""
    def p(e: dict) -> str:
        v = e.get("p_value")
        return f"p = {v:.3g}" if isinstance(v, (int, float)) else "p not recorded"

    return ("post-processing: measured undefended at " + p(plain)
            + (f", its noise-aware variant at {', '.join(p(x) for x in aware)}" if aware else "")
            + (f" on victim batch {batch}" if batch else ""))


def carried_entry(words: str) -> dict[str, Any]:
    """A carried attack's entry in a probe row (:func:`gradleak.run.advise_probes.probe`'s shape)."""
    return {"level": "none", "carried": words, "reason": None}


def reference_job(probe_base: dict, what: tuple, attacks: list[str], variants_by_key: dict[str, list[str]],
                  batch_config) -> tuple[dict, list[str]]:
    """The config and attacks of one reference probe: the raw upload of victim batch ``what[1]`` with the plain
    attacks, or with ``audit.params`` set to one variant for the attacks that have it."""
    kind, batch, vk = what
    raw = batch_config(probe_base, batch)
    if kind == "plain":
        return raw, list(attacks)
    names = variants_by_key[vk]
    return with_params(raw, {a: json.loads(vk) for a in names}), list(names)


def spot_pick(carried: set[str], audit_result: dict) -> str | None:
    """The carried attack the spot check reruns: the one whose undefended run took least time (then by name)."""
    secs = {e["name"]: e.get("seconds") for e in audit_result["attacks"]}
    if not carried:
        return None
    return min(sorted(carried), key=lambda a: secs.get(a) if isinstance(secs.get(a), (int, float)) else float("inf"))


def spot_checked(ok: list[dict], by_key: dict, carry: Carry, audit_result: dict, probe_base: dict, run_batch: Callable,
                 tested: list[str]) -> list[dict]:
    """The ranking ``ok`` after the post-processing rule's spot check: the best row that carried an attack reruns the
    one whose undefended run was quickest (:func:`spot_pick`), at its strength on the audited batch, in full (its
    variants included); the result goes into the row's ``spot_check``. A spot check above ``none`` withdraws that row
    (status ``failed``: the rule did not hold there) and the next one is checked."""
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
