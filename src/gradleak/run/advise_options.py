"""The options of ``gradleak audit --advise``, apart from the search itself so that the audit's config
check (:func:`gradleak.run.audit.audit_overrides`) validates ``audit.advise`` / ``audit.budget`` without importing
the search (:mod:`gradleak.run.advise`, which imports the audit)."""

from __future__ import annotations

from typing import Any

from gradleak.errors import BadInput

#: bisection steps after the strong end
STEPS = 3
#: federated rounds of the utility runs (the accuracy cost) when ``audit.utility_rounds`` is not set
UTILITY_ROUNDS = 20
#: an epsilon above this guarantees nothing meaningful: such a DP row ranks after the other equally cheap defenses
#: (it is absolute noise under a DP name) and the report marks it
MEANINGFUL_EPSILON = 10.0
#: tie-break among equally cheap defenses: the most standard first
STANDARD = ("dp_gaussian", "dpsgd", "secure_aggregation", "gaussian_noise", "gaussian_noise_absolute", "clipping",
            "topk_pruning", "stochastic_quantization", "percentile_noise", "fisguard", "rdlv_filter")

#: the candidates (``scale``: ``log``, ``log1m`` (on 1 - x), ``int`` (whole numbers, log), ``lin``; ``requires``: what
#: the setup must have, else the candidate is listed as not applicable): where the defense goes (``update``: appended to ``defenses``; ``training``: ``defense:``; ``fl``:
#: secure aggregation), the parameter searched, its bracket (weak -> strong), the scale, fixed parameters; ``key``: the
#: name in the advice when one defense is searched in two modes; ``mode``: the parameters that make a configured
#: defense this candidate (its starting point)
CANDIDATES: list[dict[str, Any]] = [
    {"name": "gaussian_noise", "stage": "update", "param": "std", "weak": 1e-3, "strong": 10.0, "scale": "log",
     "fixed": {}, "mode": {"per_coordinate": True}, "what": "noise std as a multiple of the update's per-coordinate RMS"},
    {"name": "gaussian_noise", "key": "gaussian_noise_absolute", "stage": "update", "param": "std", "weak": 1e-7,
     "strong": 0.1, "scale": "log", "fixed": {}, "mode": {"per_coordinate": False, "relative": False},
     "what": "absolute noise std per coordinate (on the update's own scale)"},
    {"name": "percentile_noise", "stage": "update", "param": "sigma0", "weak": 1e-2, "strong": 100.0, "scale": "log",
     "fixed": {}, "what": "noise std as a multiple of the 95th percentile of |update|"},
    {"name": "dp_gaussian", "stage": "update", "param": "noise_multiplier", "weak": 1e-3, "strong": 10.0,
     "scale": "log", "fixed": {"max_norm": 1.0, "where": "client"},
     "what": "noise multiplier, each upload clipped to L2 norm 1.0 (local DP)"},
    {"name": "clipping", "stage": "update", "param": "max_norm", "weak": 10.0, "strong": 1e-4, "scale": "log",
     "fixed": {}, "what": "L2 bound of each update"},
    {"name": "topk_pruning", "stage": "update", "param": "prune_fraction", "weak": 0.5, "strong": 0.999,
     "scale": "log1m", "fixed": {}, "what": "fraction of the coordinates zeroed"},
    {"name": "stochastic_quantization", "stage": "update", "param": "bits", "weak": 8, "strong": 1, "scale": "int",
     "fixed": {}, "what": "bits per coordinate"},
    {"name": "dpsgd", "stage": "training", "param": "noise_multiplier", "weak": 1e-3, "strong": 10.0, "scale": "log",
     "fixed": {"max_grad_norm": 1.0}, "what": "DP-SGD noise multiplier, per-sample clipping norm 1.0"},
    {"name": "secure_aggregation", "stage": "fl", "param": "clients", "weak": 2, "strong": 8, "scale": "int",
     "fixed": {}, "what": "clients summed by secure aggregation"},
    {"name": "fisguard", "stage": "training", "param": "rank", "weak": 64, "strong": 4, "scale": "int", "fixed": {},
     "what": "rank of the fixed input subspaces", "membership_only": True},
    {"name": "rdlv_filter", "stage": "training", "param": "threshold", "weak": 1.0, "strong": 0.0, "scale": "lin",
     "fixed": {}, "requires": "batchnorm",
     "what": "RDLV threshold: a client withholds an update whose self-audit's RDLV lower 95 % bound exceeds it"},
]


def advise_section(section: Any, field: str = "audit.advise", extra_names: tuple[str, ...] = ()) -> dict | None:
    """The validated ``audit.advise`` value: ``None`` (off), or ``{"candidates": [...] | None, "steps": int}``.
    ``true`` = every candidate, :data:`STEPS` steps; a mapping may narrow ``candidates`` and set ``steps``.
    ``extra_names``: candidates beyond :data:`CANDIDATES` (``advise(extra=...)``); ``field``: the name in errors."""
    if section is None or section is False:
        return None
    if section is True:
        return {"candidates": None, "steps": STEPS}
    if not isinstance(section, dict):
        raise BadInput(field, f"must be true, false or a mapping, got {section!r}.",
                       "write audit: {advise: true} (or {advise: {candidates: [gaussian_noise], steps: 2}}).")
    bad = sorted(set(section) - {"candidates", "steps"})
    if bad:
        raise BadInput(f"{field}.{bad[0]}", "this key does not exist.", f"{field} has candidates and steps.")
    names = [c.get("key", c["name"]) for c in CANDIDATES] + list(extra_names)
    cands = section.get("candidates")
    if cands is not None and (not isinstance(cands, list) or not cands or any(c not in names for c in cands)):
        raise BadInput(f"{field}.candidates", f"must be a non-empty list of candidates, got {cands!r}.",
                       f"choose from {', '.join(names)}.")
    steps = section.get("steps", STEPS)
    if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps <= 20:
        raise BadInput(f"{field}.steps", f"must be a whole number in [0, 20], got {steps!r}.", "write e.g. steps: 3.")
    return {"candidates": cands, "steps": steps}


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
