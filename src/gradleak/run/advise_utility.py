"""The utility side of ``gradleak audit --advise``: what a defense costs the model in training, and the
clipping norm of the DP candidates fitted to the updates.

**Utility.** A probe is one attacked round; what a defense costs shows over training. For the baseline (the audited
config, no added defense) and every candidate at the strength the search found, :func:`utility_job` trains the
global model for ``audit.utility_rounds`` federated rounds (:func:`gradleak.run.pipeline.train_global`: the pipeline's
round engine, defenses and seeds, no attack), each round's clients holding fresh samples of the attacked round's
batch size (one seeded draw of ``rounds`` x their samples, disjoint from the ``data.test_size`` test samples; a data
set too small for that many cycles through what it has: local epochs), and measures the global model's test accuracy
before training, halfway and at the end. Cost = baseline accuracy - accuracy
with the defense after the same rounds, same seeds. Decisions: ``fl.rounds`` becomes the utility rounds (a step-decay
schedule runs over them); membership candidates (``data.nonmembers``) are not drawn (nothing is attacked); secure
aggregation trains as without it (the builtin engine's aggregate is the plain mean, the masked sum equals it to
2^-40), over its K clients (K batches a round: more data than the baseline's clients, said in the row).

**Clipping norm.** The baseline utility run records every upload's L2 norm (rounds x clients) and every sample's
gradient L2 norm at the model sent that round; DP-Gaussian clips at the median upload norm and DP-SGD at the median
per-sample gradient norm: the median quantile of adaptive clipping (Andrew et al. 2021, "Differentially private
learning with adaptive clipping", NeurIPS), here fitted once from the undefended run. A fixed norm far above the
updates' (1.0 against adapters' updates of ~1e-2) clips nothing, and the "DP" noise is then absolute noise whose epsilon
guarantees nothing.

**Epsilon.** DP mechanisms report epsilon at :data:`~gradleak.run.advise_options.DELTA` from their own accounting
(:meth:`gradleak.defenses.base.Defense.advice_epsilon`; the Gaussian mechanism's RDP epsilon is
:func:`gaussian_epsilon`): ``epsilon`` over the utility rounds (:func:`measure_utility`) and ``epsilon_attacked`` over
the audited round(s) (the search's row).
"""

from __future__ import annotations

import copy
import math
from typing import Any

from gradleak.errors import BadInput
from gradleak.run.advise_candidates import defended_config, fmt, key
from gradleak.run.advise_options import DELTA
from gradleak.run.advise_probes import held_back


def clip_fit(spec: dict) -> tuple[str, str, str] | None:
    """A candidate's clipping parameter, which observed norm sets it and the words: its defense's own
    (:attr:`gradleak.defenses.base.Defense.clip_fit`); None for a candidate without one."""
    from gradleak.defenses.base import defense_class

    cls = defense_class(spec["name"])
    return cls.clip_fit if cls is not None else None


def utility_config(raw: dict, slices: int, rounds: int) -> dict:
    """``raw`` for :func:`gradleak.run.pipeline.train_global`: every client holds ``slices`` times its samples,
    ``fl.rounds`` = ``rounds``, one trial, no non-member candidates, no secure aggregation (see the module
    docstring)."""
    out = copy.deepcopy(raw)
    out.pop("audit", None)
    data, fl = dict(out.get("data") or {}), dict(out.get("fl") or {})
    if fl.get("client_images"):
        fl["client_images"] = [int(n) * slices for n in fl["client_images"]]
    else:
        data["batch_size"] = int(data.get("batch_size", 8)) * slices
    data.pop("nonmembers", None)
    fl.update(rounds=rounds, secure_aggregation=False)
    out.update(data=data, fl=fl, trials=1)
    return out


def plan_utility(raw: dict, attacks: list[str], rounds: int):
    """The validated config of the utility run of ``raw`` and its number of distinct slices: ``rounds`` when the data
    set has the samples, else as many as fit beside the ``data.test_size`` test samples (the rounds then cycle through
    them: local epochs). The config is the first of ``attacks`` that validates (the attack decides the model's dtype and
    initialisation, as in the probes)."""
    from gradleak.modalities import modality_of
    from gradleak.run.audit import plan_audit

    def plan(slices: int):
        try:
            return plan_audit(utility_config(raw, slices, rounds), [], attacks)[3][0][2]
        except (BadInput, IndexError) as err:
            raise BadInput("audit.utility_rounds", f"the utility run of {rounds} round(s) cannot be set up: {err}",
                           "lower audit.utility_rounds (or data.test_size).") from None

    one = plan(1)
    per_round = sum(p["images"] for p in one.client_plan())
    total = modality_of(one).training_pool(one)  # None: as many samples as asked
    slices = rounds if total is None else min(rounds, (total - one.data.test_size) // max(1, per_round))
    if slices < 1:
        raise BadInput("data.test_size", f"{one.data.test_size} test samples leave no training sample of the "
                       f"{total} of '{one.data.name}' for the utility run.", "lower data.test_size.")
    return (plan(slices) if slices > 1 else one), slices


def utility_job(raw: dict, attacks: list[str], rounds: int, device: str | None, norms: bool = False,
                accuracy_start: float | None = None) -> dict:
    """A utility cell's job: train ``raw`` (a probe's config) for ``rounds`` rounds without an attack and measure the
    test accuracy (:func:`gradleak.run.pipeline.train_global`; ``accuracy_start``: the baseline's, for a candidate
    whose model before training is the baseline's)."""
    from gradleak.run.pipeline import train_global

    cfg, slices = plan_utility(raw, attacks, rounds)
    return train_global(cfg, device or cfg.device, rounds, slices=slices, norms=norms, accuracy_start=accuracy_start)


def fitted_clip(spec: dict, baseline: dict) -> dict:
    """The DP candidate ``spec`` with its clipping norm fitted to the baseline utility run's observed norms (the
    median; :func:`clip_fit`), or ``spec`` unchanged (another candidate, or no norm observed)."""
    fit = clip_fit(spec)
    if fit is None:
        return spec
    param, source, words = fit
    from gradleak.defenses.base import median_clip

    seen = [v for v in baseline.get(source) or [] if v == v and v > 0]
    norm = median_clip(seen)
    if norm is None:
        return spec
    why = (f"clipping norm {param} = {norm:g}: {words} ({len(seen)} observed over the baseline's "
           f"{baseline.get('rounds')} utility round(s); the median quantile of adaptive clipping, Andrew et al. 2021)")
    what = spec["what"].split(",")[0] + f", clipped at the fitted norm {norm:g}"
    return {**spec, "fixed": {**spec["fixed"], param: norm}, "clip_norm": norm, "clip_note": why, "what": what}


def improves(baseline: dict) -> bool:
    """Whether the undefended model's test accuracy rose over the utility rounds (else a cost measures nothing)."""
    a, b = baseline.get("accuracy_start"), baseline.get("accuracy")
    return isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > a


def utility_cell_job(raw, attacks, rounds, device, norms, accuracy_start=None):
    """A utility cell's job (:func:`utility_job`; module level: the local and Ray executors pickle it)."""
    if accuracy_start is None:
        return utility_job(raw, attacks, rounds, device, norms)
    return utility_job(raw, attacks, rounds, device, norms, accuracy_start)


def gaussian_epsilon(noise_multiplier: float, steps: int, delta: float = DELTA) -> float | None:
    """Epsilon of ``steps`` compositions of the Gaussian mechanism with ``noise_multiplier`` (sampling rate 1): the
    RDP accountant's closed form (:func:`gradleak.accounting.gaussian_rdp_epsilon`, equal to Opacus'
    ``RDPAccountant``)."""
    from gradleak.accounting import gaussian_rdp_epsilon

    return gaussian_rdp_epsilon(noise_multiplier, steps, delta)


def dp_class(spec: dict):
    """The registered DP mechanism a candidate searches (its class owns the epsilon), or None."""
    from gradleak.defenses.base import defense_class

    cls = defense_class(spec["name"])
    return cls if cls is not None and cls.is_dp else None


def dp_epsilon(cls, strength: Any, rounds: int, measured: Any) -> Any:
    """The DP mechanism ``cls``'s own epsilon at ``strength`` over ``rounds`` rounds (``measured``: the run's own
    accountant's, if any), at :data:`~gradleak.run.advise_options.DELTA`."""
    return cls.advice_epsilon(strength, rounds, measured, DELTA, gaussian_epsilon)


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
    for (r, spec), u in zip(found, runs):
        if held_back(u):  # the budget was spent and the strength is unverified (never recommended): not measured
            r["utility_note"] = ("accuracy not measured: the budget was spent and this strength was not checked "
                                 "against every tested attack")
            continue
        if "error" in u:
            r["utility_error"] = u["error"]
            continue
        fill_utility(r, spec, u, advice, attacked_rounds)


def fill_utility(r: dict, spec: dict, u: dict, advice: dict, attacked_rounds: int) -> None:
    """A row's utility fields from its utility run ``u``: accuracy, divergence, cost and its sampling error, the DP
    epsilon over the utility rounds with its words, and an FL-stage candidate's own note."""
    b = advice["baseline"].get("accuracy")
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
    cls = dp_class(spec)
    if cls is not None:  # the defense's own accounting over the utility rounds
        r["epsilon"] = dp_epsilon(cls, r["strength"], u.get("rounds") or 1, u.get("dp_epsilon"))
        if cls.epsilon_delta is not None:  # the defense's own δ (pure DP: 0), shown beside its ε
            r["epsilon_delta"] = cls.epsilon_delta
    if clip_fit(spec) is not None:
        r["epsilon_note"] = (f"epsilon over the {u.get('rounds')} utility round(s) (the training whose accuracy is "
                             f"reported); epsilon_attacked over the audited {attacked_rounds} round(s)")
    if cls is not None and cls.epsilon_words:  # the defense's own words on its accountant
        r["epsilon_note"] = "; ".join(x for x in (r.get("epsilon_note"), cls.epsilon_words) if x)
    if "fl_stage" in spec:  # an FL-stage candidate's own words (secure aggregation: federations of other sizes)
        r["utility_note"] = spec["fl_stage"].utility_note(fmt(r["strength"]))
