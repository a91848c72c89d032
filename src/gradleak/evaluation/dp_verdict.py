"""The DP check's verdict and its wording (docs/DESIGN.md §6): :func:`judge` measures each threat model's canary
statistics (the one-shot estimate, :mod:`gradleak.evaluation.dp_estimate`; the claim tests,
:mod:`gradleak.evaluation.dp_claim_tests`) with the tests' family-wise α split over the check, and :func:`dp_verdict`
reads them against the claimed ε: ``claim_violated``, ``vacuous`` or ``consistent``, with the sentence that explains
it. Part of :mod:`gradleak.evaluation.empirical_epsilon`."""

from __future__ import annotations

import copy
import math

from gradleak.evaluation.dp_claim_tests import ALPHA, CLAIM_TESTS, claim_tests, tensor_test_names, tensor_tests
from gradleak.evaluation.dp_estimate import BOOTSTRAP, STRICT, estimate
from gradleak.evaluation.dp_gaussian_pair import EPSILON_CAP

#: a claimed ε above this is no meaningful guarantee (the advice's threshold for a "hollow" DP setting)
VACUOUS_EPSILON = 10.0


TEST_WORDS = {"shift": "its mean sits further from the never-inserted canaries' than the claimed noise allows "
                       "(noise at too small a scale)",
              "spread": "its canaries' statistics spread more than a Gaussian mechanism's can (a mixture: some "
                        "uploads less noised than the others)",
              "tail": "more of its canaries' statistics lie beyond the largest value the claimed (ε, δ) allows than "
                      "chance explains (uploads that escaped the noise)",
              "tensor_variance": "a tensor holds less noise than the claimed mechanism adds to every coordinate (a "
                                 "tensor the noise misses)",
              "tensor_tail": "some uploads hold less noise on a tensor than the claimed mechanism allows (a tensor "
                             "the noise misses on some uploads)"}


def rejected_tests(m: dict) -> list[str]:
    """The names of the claim tests (:func:`claim_tests`, ``m["tests"]``) that reject on the measurement ``m``."""
    return [t for t in CLAIM_TESTS if (m.get("tests") or {}).get(t, {}).get("rejects")]


def _violates(m: dict, claimed: float | None) -> bool:
    # an infinite estimate says only "beyond EPSILON_CAP" (the search's ceiling): evidence against a claim below the
    # cap, none against a larger one (e.g. DP-Gaussian at z = 0.001 claims 5.5e5 for one round; its canaries separate
    # beyond the cap, which such a mechanism does)
    fit = (claimed is not None and m["strict_lower"] > claimed
           and (math.isfinite(m["strict_lower"]) or claimed < EPSILON_CAP))
    return bool(fit or rejected_tests(m) or _one_run_refutes(m, claimed))


def _one_run_refutes(m: dict, claimed: float | None) -> bool:
    """The rigorous one-run bound at the strict confidence (``one_run_strict``, :func:`one_run_bound`) above the
    claim: the claim is refuted without the Gaussian model."""
    return claimed is not None and m.get("one_run_strict", 0.0) > claimed


def dp_verdict(claimed: float | None, measured: list[dict]) -> tuple[str, str]:
    """``claim_violated`` when some measured threat model (one the claim covers) has its fit's 99.9 % lower end above
    ``claimed`` (an infinite low end -- beyond :data:`EPSILON_CAP` -- only against a claim below the cap) or one of
    its claim tests (``tests``, :func:`claim_tests`) rejecting or its rigorous one-run bound at the strict confidence
    (``one_run_strict``, :func:`one_run_bound`) above ``claimed``; else ``vacuous`` when ``claimed`` >
    :data:`VACUOUS_EPSILON` (or infinite); else ``consistent``. Returns the verdict and the sentence that explains
    it."""
    over = [m for m in measured if _violates(m, claimed)]
    if over:
        m = max(over, key=lambda m: (len(rejected_tests(m)), m["strict_lower"]))
        where = m["threat_model"].replace("_", " ")
        fit = (f"measured ε = {fmt_epsilon(m['epsilon'])} (95 % interval {fmt_epsilon(m['interval'][0])}–"
               f"{fmt_epsilon(m['interval'][1])}; 99.9 % lower end {fmt_epsilon(m['strict_lower'])})")
        tests = rejected_tests(m)
        if tests:
            why = "; ".join(f"{TEST_WORDS[t]} (p = {m['tests'][t]['p_value']:.2g} ≤ {m['tests'][t]['alpha']:.2g})"
                            for t in tests)
            return "claim_violated", (f"in the {where} threat model the canaries do not behave as the claimed ε = "
                                      f"{fmt_epsilon(claimed)} allows: "
                                      f"{why}; the Gaussian fit reads {fit}: the implementation does not do what its "
                                      "accountant assumes")
        if not (m["strict_lower"] > claimed):  # the one-run bound alone refutes the claim
            return "claim_violated", (
                f"the {where} leaks more than the claim allows: the one-run bound (Steinke et al. 2023, "
                f"distribution-free) proves ε ≥ {fmt_epsilon(m['one_run_strict'])} at {STRICT:.1%} confidence, above "
                f"the claimed ε = {fmt_epsilon(claimed)} (the Gaussian fit reads {fit}): the implementation does not "
                "do what its accountant assumes")
        return "claim_violated", (f"the {where} leaks more than the claim allows: {fit} above the claimed ε = "
                                  f"{fmt_epsilon(claimed)}: the implementation does not do what its accountant assumes")
    if claimed is None or not math.isfinite(claimed) or claimed > VACUOUS_EPSILON:
        return "vacuous", (f"the claimed ε = {fmt_epsilon(claimed)} is above {VACUOUS_EPSILON:g}: no meaningful guarantee "
                           "(the measurement did not exceed it)")
    worst = max(measured, key=lambda m: m["epsilon"]) if measured else None
    return "consistent", ("the measured ε stays within the claim" + (
        f" (largest: ε = {fmt_epsilon(worst['epsilon'])}, {worst['threat_model'].replace('_', ' ')}, interval "
        f"{fmt_epsilon(worst['interval'][0])}–{fmt_epsilon(worst['interval'][1])}; claimed {fmt_epsilon(claimed)})" if worst else "")
        + (", and no claim test rejects" if any("tests" in m for m in measured) else "")
        + (f"; the one-run bound (Steinke et al. 2023, {100 * best['one_run']['confidence']:g} %) proves ε ≥ "
           f"{fmt_epsilon(best['one_run_bound'])} ({best['threat_model'].replace('_', ' ')}), at most "
           f"{fmt_epsilon(best['one_run_ceiling'])} with these canaries"
           if (best := max((m for m in measured if "one_run" in m), key=lambda m: m["one_run_bound"], default=None))
           else "")
        + (f"; the distribution-free bounds could certify at most ε = {fmt_epsilon(ceiling)} with these "
           f"canaries (threshold bound{' and one-run bound' if best else ''}), so against the claimed "
           f"{fmt_epsilon(claimed)} they are not testable at this size: the verdict rests on the fit and the claim tests"
           if (ceiling := min((max(m.get("lower_bound_ceiling", math.inf), m.get("one_run_ceiling", -math.inf))
                               for m in measured), default=math.inf)) < claimed
           else "")
        )


def judge(statistics: dict[str, dict], claimed: float | None, delta: float, *, dim: int, seed: int = 0,
          alpha: float = ALPHA, resamples: int = BOOTSTRAP) -> tuple[str, str, list[dict]]:
    """The check's verdict from each threat model's canary statistics (``statistics``: threat model -> ``seen``,
    ``unseen``, ``maxima`` (how many cosines each statistic is the largest of), ``claimed_epsilon`` (the claim
    covering it), optional ``claimed_by`` and ``tensors`` (each tensor's noise summary, :func:`tensor_tests`)): the fit (:func:`estimate`) and the claim tests (:func:`claim_tests`) per
    threat model, the tests' family-wise ``alpha`` split evenly over every test of every *distinct* statistic
    (Bonferroni; after one round every_round's statistics are final_model's, one family member), each threat model
    judged against its own claim, then the check (:func:`dp_verdict`: the first violated threat model, else the
    smallest claim ``claimed``). Returns (verdict, sentence, the measurements). :func:`gradleak.run.dp_check.dp_check`
    and the simulated checks of ``benchmarks/dp_check.py`` both judge here. The family: the three tests of
    :func:`claim_tests` and the per-tensor tests that apply (:func:`tensor_test_names`) of each distinct statistic."""
    distinct = {(tuple(v["seen"]), tuple(v["unseen"])): 3 + len(tensor_test_names(v.get("tensors")))
                for v in statistics.values()}
    each = alpha / max(sum(distinct.values()), 1)
    measured, done = [], {}
    for t, v in statistics.items():
        key = (tuple(v["seen"]), tuple(v["unseen"]), v["claimed_epsilon"], v.get("maxima", 1), t == "each_upload")
        if key not in done:  # the same statistics (every_round after one round) are measured once
            done[key] = (estimate(v["seen"], v["unseen"], delta, seed=seed, resamples=resamples,
                                  paired=t == "each_upload"),
                         claim_tests(v["seen"], v["unseen"], v["claimed_epsilon"], delta, dim=dim,
                                     maxima=v.get("maxima", 1), alpha=each))
        est, tests = (copy.deepcopy(x) for x in done[key])
        tests.update(tensor_tests(v.get("tensors"), alpha=each))
        m = {"threat_model": t, **est, "claimed_epsilon": v["claimed_epsilon"], "claimed_by": v.get("claimed_by"),
             "tests": tests, "maxima": v.get("maxima", 1)}
        m["verdict"] = dp_verdict(m["claimed_epsilon"], [m])[0]  # each threat model against the claim covering it
        measured.append(m)
    violated = [m for m in measured if m["verdict"] == "claim_violated"]
    verdict, sentence = dp_verdict(violated[0]["claimed_epsilon"] if violated else claimed, violated or measured)
    return verdict, sentence, measured


def fmt_epsilon(x: float | None) -> str:
    if x is None:
        return "none"
    if not math.isfinite(x):
        return "∞"
    return f"{x:.3g}"
