"""The options of ``gradleak audit --advise``, apart from the search itself so that the audit's config
check (:func:`gradleak.run.audit.audit_overrides`) validates ``audit.advise`` / ``audit.budget`` without importing
the search (:mod:`gradleak.run.advise`, which imports the audit)."""

from __future__ import annotations

from typing import Any

from gradleak.errors import BadInput

#: bisection steps after the strong end
STEPS = 3
#: victim batches a found strength must stop (docs/DESIGN.md §6: a recommendation is a claim about new victims): the
#: searched batch and BATCHES - 1 more, each drawn with ``seed`` and ``data.seed`` moved by BATCH_SEED_STEP
BATCHES = 3
BATCH_SEED_STEP = 1009
#: federated rounds of the utility runs (the accuracy cost) when ``audit.utility_rounds`` is not set
UTILITY_ROUNDS = 20
#: an epsilon above this guarantees nothing meaningful: such a DP row ranks after the other equally cheap defenses
#: (it is absolute noise under a DP name) and the report marks it
MEANINGFUL_EPSILON = 10.0
#: delta of every reported epsilon
DELTA = 1e-5


def _specs() -> list[dict[str, Any]]:
    from gradleak.defenses.base import advice_candidates
    from gradleak.fl.secure_aggregation import fl_candidates

    return sorted(advice_candidates() + fl_candidates(), key=lambda s: s.get("order", float("inf")))


def candidates() -> list[dict[str, Any]]:
    """The candidates of ``--advise``: every registered defense's brackets
    (:attr:`gradleak.defenses.base.Defense.advice`) and secure aggregation, in their order. ``scale``: ``log``,
    ``log1m`` (on ``unit - x``), ``int`` (whole numbers, log), ``lin``; ``requires``: what the setup must have, else
    the candidate is listed as not applicable; ``stage``: where the defense goes (``update``: appended to
    ``defenses``; ``training``: ``defense:``; ``fl``: an FL option, whose spec's ``fl_stage`` object builds its configs,
    :class:`gradleak.fl.secure_aggregation.SecureAggregation`); ``param`` the parameter searched, its
    bracket (weak -> strong), ``fixed`` parameters; ``key``: the name in the advice when one defense is searched in
    two modes; ``mode``: the parameters that make a configured defense this candidate (its starting point)."""
    return [{k: v for k, v in s.items() if k not in ("order", "rank")} for s in _specs()]


def standard() -> tuple[str, ...]:
    """Tie-break among equally cheap defenses: the candidates' names (``key``), the most standard first."""
    return tuple(s.get("key", s["name"]) for s in sorted(_specs(), key=lambda s: s.get("rank", float("inf"))))


def __getattr__(name: str) -> Any:
    """``CANDIDATES`` and ``STANDARD``, built from the defense registry when first read (importing this module does
    not import the defenses)."""
    if name == "CANDIDATES":
        return candidates()
    if name == "STANDARD":
        return standard()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def advise_section(section: Any, field: str = "audit.advise", extra_names: tuple[str, ...] = ()) -> dict | None:
    """The validated ``audit.advise`` value: ``None`` (off), or ``{"candidates": [...] | None, "steps": int}``.
    ``true`` = every candidate, :data:`STEPS` steps; a mapping may narrow ``candidates`` and set ``steps``.
    ``extra_names``: candidates beyond :data:`CANDIDATES` (``advise(extra=...)``); ``field``: the name in errors."""
    if section is None or section is False:
        return None
    if section is True:
        return {"candidates": None, "steps": STEPS, "batches": BATCHES}
    if not isinstance(section, dict):
        raise BadInput(field, f"must be true, false or a mapping, got {section!r}.",
                       "write audit: {advise: true} (or {advise: {candidates: [gaussian_noise], steps: 2}}).")
    bad = sorted(set(section) - {"candidates", "steps", "batches"})
    if bad:
        raise BadInput(f"{field}.{bad[0]}", "this key does not exist.", f"{field} has candidates, steps and batches.")
    names = [c.get("key", c["name"]) for c in candidates()] + list(extra_names)
    cands = section.get("candidates")
    if cands is not None and (not isinstance(cands, list) or not cands or any(c not in names for c in cands)):
        raise BadInput(f"{field}.candidates", f"must be a non-empty list of candidates, got {cands!r}.",
                       f"choose from {', '.join(names)}.")
    steps = section.get("steps", STEPS)
    if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps <= 20:
        raise BadInput(f"{field}.steps", f"must be a whole number in [0, 20], got {steps!r}.", "write e.g. steps: 3.")
    batches = section.get("batches", BATCHES)
    if isinstance(batches, bool) or not isinstance(batches, int) or not 1 <= batches <= 10:
        raise BadInput(f"{field}.batches", f"must be a whole number in [1, 10], got {batches!r}.",
                       "write e.g. batches: 3 (the searched victim batch and two more).")
    return {"candidates": cands, "steps": steps, "batches": batches}


def check_budget(budget: Any, field: str = "--budget") -> float | None:
    """A search budget in seconds (> 0), or None."""
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0 or budget != budget:
        raise BadInput(field, f"must be a number of seconds > 0, got {budget!r}.", "write e.g. --budget 600.")
    return float(budget)


def check_utility_rounds(rounds: Any, field: str = "audit.utility_rounds") -> int:
    """``audit.utility_rounds``: the federated rounds each utility run trains (:data:`UTILITY_ROUNDS` when None)."""
    if rounds is None:
        return UTILITY_ROUNDS
    if isinstance(rounds, bool) or not isinstance(rounds, int) or not 1 <= rounds <= 10_000:
        raise BadInput(field, f"must be a whole number of rounds in [1, 10000], got {rounds!r}.",
                       "write e.g. audit: {utility_rounds: 40} (each utility run trains that many rounds).")
    return rounds
