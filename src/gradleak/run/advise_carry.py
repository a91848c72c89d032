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
batch (:func:`reference_jobs`), and an attack is carried only where the plain run and every such variant read
``none`` there. A carried attack enters the probe's row as level ``none`` with the words
``post-processing: measured undefended at p = ...`` (:func:`carried_entry`): never silently.

The rule does **not** apply to training-time defenses (DP-SGD, FISGuard, L2, dropout, label smoothing, min-max): they
change what the client computes, so the defended upload is not a function of the raw one (:func:`post_processing`).
Flower's DP wrappers are checked in full as well (their probes configure the framework, not a declared transform).

**The spot check.** The rule is measured, not assumed: ``benchmarks/postprocessing.py`` runs the carried attacks
anyway over (config, defense, strength, seed) cells and counts how many rise above ``none`` (docs/REPRODUCTION.md), and
every advice whose recommendation carried an attack reruns one of them -- the one whose undefended run took least time
-- at the recommended strength on the audited batch (:func:`spot_check_job`), recorded in the row; a spot check that
leaks withdraws the recommendation (the next candidate is ranked)."""

from __future__ import annotations

import copy
import json
from typing import Any

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
        """The reference probes still missing for ``batch`` (ids and :func:`reference_jobs` arguments)."""
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


def carried_words(plain: dict, aware: list[dict], batch: int) -> str:
    """The words a carried attack's level carries."""
    def p(e: dict) -> str:
        v = e.get("p_value")
        return f"p = {v:.3g}" if isinstance(v, (int, float)) else "p not recorded"

    return ("post-processing: measured undefended at " + p(plain)
            + (f", its noise-aware variant at {', '.join(p(x) for x in aware)}" if aware else "")
            + (f" on victim batch {batch}" if batch else ""))


def carried_entry(words: str) -> dict[str, Any]:
    """A carried attack's entry in a probe row (:func:`gradleak.run.advise.probe`'s shape)."""
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
