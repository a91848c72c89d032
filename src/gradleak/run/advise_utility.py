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
"""

from __future__ import annotations

import copy
from typing import Any

from gradleak.errors import BadInput


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
