"""The audit's check of a DP claim: an empirical ε beside every accountant's ε (``audit.json`` ``dp_check``).

Whenever the config declares a DP mechanism — ``dp_gaussian`` (client or server noise), DP-SGD (``defense: dpsgd``,
Opacus' accountant) or Flower's DP wrappers on the Flower engine (``fl.flower.dp``: server-fixed, client-fixed,
local) — :func:`dp_check` runs the configured federation again (same model, clients, engine, rounds, defenses and
seeds; no attack) with canary clients added (:mod:`gradleak.fl.canaries`), and measures ε one-shot (Andrew et al.,
ICLR 2024, Sec. 3–4; :mod:`gradleak.evaluation.empirical_epsilon`) in each threat model the mechanism claims to cover:

* ``final_model``: each canary's cosine with the change of the trainable parameters over all rounds (the released
  model; paper Sec. 4, "final model");
* ``every_round``: its largest cosine with a round's aggregate, over the rounds (every iterate seen; paper Sec. 4);
* ``each_upload``: its largest cosine with its own upload, over the rounds (a server that sees individual uploads),
  for mechanisms that noise each upload (client-side ``dp_gaussian``, DP-SGD, Flower's ``LocalDpMod``); central DP
  makes no claim against the server that receives the updates before the noise.

Unseen canaries (as many as inserted, other seeds) are scored the same way on the same deltas and uploads. The claimed ε
is the accountant's, named: RDP of the Gaussian mechanism (Opacus ``RDPAccountant``, sampling rate 1, one step per
round) for ``dp_gaussian`` and Flower's central wrappers; DP-SGD's own Opacus accountant for the canary example (one
example per canary client: sampling rate 1); ``LocalDpMod``'s per-round ε as the RDP of its noise multiplier over the
rounds. With several mechanisms declared, the smallest claim covering a threat model is the claim there. Beside the
fit, each threat model's statistics go through the claim tests (shift, spread, tail:
:func:`gradleak.evaluation.empirical_epsilon.claim_tests`; and each tensor's noise:
:func:`~gradleak.evaluation.empirical_epsilon.tensor_tests`; family-wise α = 0.01 over the check), which see a
mechanism that leaks on a fraction of its uploads, noises at the wrong scale or misses a tensor (an isotropic canary
puts only that tensor's share of its norm there, so its cosine barely moves; the tensor's own noise energy does). The
statistics are streamed round by round (:class:`gradleak.run.canary_statistics.CanaryStatistics`: running sums,
O(canaries) memory; the builtin engine reports each round as it ends (``on_round``) and keeps none, so memory does
not grow with the rounds; the Flower and NVFlare engines return every round, which :func:`fitted_canaries` sizes and
the check lets go round by round). The verdict
(:func:`gradleak.evaluation.empirical_epsilon.judge`, :func:`~gradleak.evaluation.empirical_epsilon.dp_verdict`):
``claim_violated``, ``vacuous`` or ``consistent``.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any

import torch

from gradleak.errors import BadInput

#: canary clients inserted (and as many never inserted) by default
CANARIES = 100
#: δ of the measured and of the claimed ε where the mechanism declares none (dp_gaussian, Flower's central wrappers)
DELTA = 1e-5

METHOD = ("one-shot empirical ε (Andrew et al., ICLR 2024, Sec. 3–4): canary clients uploading random isotropic "
          "directions; cosine statistics of inserted vs never-inserted canaries; two Gaussians with one common spread "
          "(ours; the paper fits two spreads, reported as epsilon_separate_spreads); 95 % bootstrap interval (ours)")
TESTS_METHOD = ("beside the fit, three tests of the inserted canaries' statistics against what the claim allows "
                "(gradleak.evaluation.empirical_epsilon.claim_tests): shift (noise at too small a scale: the mean "
                "against the claim's μ), spread (a mixture: the spread against a never-inserted canary's, exact "
                "1/√d for one cosine), tail (uploads that escaped the noise: the count beyond the cosine the claimed "
                "(ε, δ) allows, exact binomial); and two of each tensor's noise (gradleak.evaluation.empirical_epsilon."
                "tensor_tests: each tensor's noise energy across the canary's part, per degree of freedom, over the "
                "other tensors' -- F-distributed under the claim, which noises every coordinate with one σ --, "
                "pooled over the uploads and the smallest in one upload, Bonferroni over the tensors); family-wise "
                "α = 0.01 over every test of every distinct threat model (Bonferroni)")


#: memory the check's uploads may hold (float64 uploads of every client and canary of every round, plus the canaries'
#: float32 directions)
MEMORY_GIB = 6.0
#: the fewest canaries a check runs with (below this the interval says little)
MIN_CANARIES = 20


def fitted_canaries(k: int, dim: int, rounds: int, clients: int) -> int:
    """``k`` canaries, or fewer (not below :data:`MIN_CANARIES`) so that the uploads the engine keeps for the
    statistics fit :data:`MEMORY_GIB`: rounds × (clients + k) × dim × 8 bytes, plus k × dim × 4."""
    per = max(dim, 1) * (8 * max(rounds, 1) + 4)
    fit = int((MEMORY_GIB * 2 ** 30 - max(rounds, 1) * clients * dim * 8) // per)
    return max(MIN_CANARIES, min(k, fit))


def dp_section(section: Any, field: str = "audit.dp_check") -> dict | None:
    """The validated ``audit.dp_check``: ``None`` (off: ``false``), or ``{"canaries": k}`` (default ``true``)."""
    if section is False:
        return None
    if section is None or section is True:
        return {"canaries": CANARIES}
    if not isinstance(section, dict) or set(section) - {"canaries"}:
        raise BadInput(field, f"must be true, false or {{canaries: N}}, got {section!r}.",
                       "write e.g. audit: {dp_check: {canaries: 256}} (or dp_check: false to skip it).")
    k = section.get("canaries", CANARIES)
    if isinstance(k, bool) or not isinstance(k, int) or not 8 <= k <= 100_000:
        raise BadInput(f"{field}.canaries", f"must be a whole number in [8, 100000], got {k!r}.",
                       "write e.g. canaries: 256 (more canaries: a narrower interval, a longer check).")
    return {"canaries": k}


def _gaussian_epsilon(z: float, steps: int, delta: float) -> float:
    from gradleak.accounting import gaussian_rdp_epsilon

    return gaussian_rdp_epsilon(z, steps, delta)


def round_defenses(cfg) -> list:
    """The update defenses of every round, as the pipeline builds them (the ``defenses:`` list, then a ``defense:``
    that is an update transform), without a model."""
    from gradleak.defenses import build_defenses

    return build_defenses([d.model_dump() for d in cfg.defenses], seed=cfg.seed) + \
        cfg.training_defense.update_transforms(seed=cfg.seed)


def declares_dp(cfg) -> bool:
    """Whether ``cfg`` declares a DP mechanism the check measures (cheap: no model is built); NVFlare's SVTPrivacy
    filter counts (:mod:`gradleak.run.svt_check`)."""
    from gradleak.run.svt_check import svt_filters

    defenses = round_defenses(cfg)
    return bool(declared_mechanisms(cfg, defenses)) or bool(svt_filters(defenses))


def declared_mechanisms(cfg, defenses: list) -> list[dict]:
    """The DP mechanisms ``cfg`` declares, each with what the server knows of it: ``name``, ``clip`` (the bound the
    canary is scaled against, in the upload's units), ``covers`` (threat models its claim covers), ``claim``
    (a function of the rounds run and the training defense's report after them -> (ε, accountant words)) and
    ``delta``."""
    out = []
    for d in defenses:  # each defense's own claims (dp_gaussian), then the training-time defense's (DP-SGD)
        out += d.dp_claims(cfg, _gaussian_epsilon, DELTA)
    out += cfg.training_defense.dp_claims(cfg, _gaussian_epsilon, DELTA)
    from gradleak.fl.engines import engine_of

    out += engine_of(cfg.fl.engine).dp_claims(cfg, DELTA)  # the engine's own mechanisms
    return out


def _real_signal_weight(real: list, per: int, cfg) -> float:
    """The real clients' summed aggregation weight over a canary's (FedAvg weighs by samples), times the local steps
    a FedAvg upload sums: a bound of their clipped updates' norm in units of a canary's clipped part (each is clipped
    to the bound a canary is clipped to; :class:`gradleak.run.canary_statistics.CanaryStatistics`' ``signal_bound``)."""
    import math

    total = 0.0
    for c in real:
        n = max(int(c.num_samples), 1)
        steps = 1
        if cfg.fl.algorithm == "fedavg":
            b = cfg.fl.local_batch_size or n
            steps = max(int(cfg.fl.local_epochs), 1) * max(math.ceil(n / max(int(b), 1)), 1)
        total += n / max(per, 1) * steps
    return total


@dataclass
class _Canaries:
    """The check's federation: the real clients and the canary clients added to them, and what the statistics need
    of the trainable parameters (``shapes``, their ``names``, ``dim`` coordinates)."""

    shapes: list
    names: set
    dim: int
    clip: float  # the smallest declared clip bound: a canary's norm is CANARY_SCALE times it
    asked: int  # canaries asked for
    k: int  # canaries inserted (fitted to MEMORY_GIB)
    real: list  # the real clients
    per: int  # samples a canary stands for (a real client's per round)
    seed: int
    first_id: int  # the first canary's client id
    cans: list


def dp_check(cfg, device: str | torch.device | None = None, *, canaries: int = CANARIES,
             log=lambda m: None, sent: dict[str, torch.Tensor] | None = None) -> dict | None:
    """The DP check of ``cfg`` (a validated experiment config), or None when it declares no DP mechanism.
    ``sent``: the weights a recorded round started from (a live framework audit's replay,
    :meth:`gradleak.run.round_audit.RoundAudit.round_dp_check`): the federation with its canaries starts there instead
    of at the model's initial weights."""
    from gradleak.evaluation.empirical_epsilon import judge
    from gradleak.run.pipeline import federation

    t0 = time.perf_counter()
    dev = torch.device(device or cfg.device or "cpu") if not isinstance(device, torch.device) else device
    data, handle, mcfg, defense, defenses, loss_fn = federation(cfg, dev)
    model = handle.model
    mechanisms = declared_mechanisms(cfg, defenses)
    if not mechanisms:  # NVFlare's SVTPrivacy alone: per-coordinate canaries against its own accountant
        from gradleak.run.svt_check import svt_dp_check, svt_filters

        svt = svt_filters(defenses)
        if not svt:
            return None
        return svt_dp_check(cfg, model, svt[0], canaries=canaries, first_id=int(cfg.fl.clients), log=log,
                            shapes=[(n, p.shape) for n, p in model.named_parameters() if p.requires_grad])
    if sent:
        _start_from(model, sent)
    c = _canaries(cfg, data, handle, mcfg, loss_fn, dev, mechanisms, canaries)
    rounds = int(cfg.fl.rounds)
    log(f"[dp_check] {len(c.real)} client(s) + {c.k} canaries, {rounds} round(s), {c.dim} trainable coordinates")
    covered = sorted({t for m in mechanisms for t in m["covers"]})
    seen, unseen = _streamed_statistics(cfg, model, c, defense, defenses, "each_upload" in covered)
    claims = _claims(mechanisms, rounds, _canary_report(defense, c.first_id))
    delta = min(m["delta"] for m in mechanisms)
    statistics = _threat_statistics(covered, seen, unseen, claims)
    claimed = min((cl["claimed_epsilon"] for cl in claims if cl["claimed_epsilon"] is not None), default=None)
    verdict, sentence, measured = judge(statistics, claimed, delta, dim=c.dim, seed=c.seed)
    return _result(cfg, c, verdict, sentence, claimed, claims, measured, delta, rounds, sent, t0)


def _start_from(model, sent: dict[str, torch.Tensor]) -> None:
    """The model's parameters set to the recorded round's sent weights (those it has)."""
    with torch.no_grad():
        params = dict(model.named_parameters())
        for k, v in sent.items():
            if k in params:
                params[k].copy_(v.to(device=params[k].device, dtype=params[k].dtype))


def _canaries(cfg, data, handle, mcfg, loss_fn, dev, mechanisms: list, canaries: int) -> _Canaries:
    """The real clients of the configured federation and ``canaries`` canary clients (fewer when their uploads would
    not fit :data:`MEMORY_GIB`: :func:`fitted_canaries`), each uploading its direction at CANARY_SCALE × the
    smallest declared clip bound and standing for a real client's samples per round."""
    from gradleak.fl.canaries import CANARY_SCALE, CanaryClient
    from gradleak.run.pipeline import clients_and_truth

    model = handle.model
    shapes = [(n, p.shape) for n, p in model.named_parameters() if p.requires_grad]
    dim = sum(int(s.numel()) for _, s in shapes)
    clip = min(m["clip"] for m in mechanisms)
    k = fitted_canaries(canaries, dim, int(cfg.fl.rounds), int(cfg.fl.clients))
    batches = data.clients(0, mcfg.num_classes)
    real, _ = clients_and_truth(handle, batches, loss_fn, dev, cfg.threat_model, cfg)
    per = max(real[0].num_samples, 1) if cfg.data.samples_per_client is None else cfg.data.batch_size
    seed = int(cfg.seed) * 31 + 5
    first_id = len(real)
    cans = [CanaryClient(first_id + i, i, shapes, seed, CANARY_SCALE * clip, num_samples=per) for i in range(k)]
    return _Canaries(shapes=shapes, names={n for n, _ in shapes}, dim=dim, clip=clip, asked=canaries, k=k, real=real,
                     per=per, seed=seed, first_id=first_id, cans=cans)


def _streamed_statistics(cfg, model, c: _Canaries, defense, defenses: list, each: bool) -> tuple[dict, dict]:
    """The federation with its canaries run through the configured engine, streamed: the trainable parameters sent
    each round, then the final ones (the last aggregate applied); each round's step and uploads go through the
    inserted and the never-inserted canaries' running statistics and are let go (CanaryStatistics: O(k) memory).
    An engine that reports round by round (on_round: the builtin one) keeps no round at all, so memory does not grow
    with the rounds; another (Flower, NVFlare) returns every round, measured and let go one at a time. ``each``:
    the uploads are measured too (a mechanism claims ``each_upload``). Returns the (seen, unseen) statistics."""
    from gradleak.fl.canaries import direction, flat
    from gradleak.fl.engines import rounds_engine
    from gradleak.run.canary_statistics import CanaryStatistics

    shapes, first_id, rounds = c.shapes, c.first_id, int(cfg.fl.rounds)
    rounds_fn = rounds_engine(cfg.fl)
    plan = cfg.client_plan() if cfg.fl.algorithm == "fedavg" else None
    signal = _real_signal_weight(c.real, c.per, cfg)
    seen_s = CanaryStatistics(c.k, shapes, lambda j: c.cans[j].unit(), first_id=first_id if each else None,
                              tensors=True, signal_bound=signal)
    unseen_s = CanaryStatistics(c.k, shapes, lambda j: direction(shapes, c.seed, c.k + j),
                                first_id=first_id if each else None)
    held: dict[str, Any] = {}

    def uploads(ups):
        return {u.client_id: u.tensors for u in ups if u.client_id >= first_id} if each else None

    def measure(sent_flat, ups):
        """Round r's state arrives: round r - 1 (held) is measured against it and let go."""
        if "first" not in held:
            held["first"] = sent_flat
        if "prev" in held:
            prev, prev_ups = held.pop("prev")
            for st in (seen_s, unseen_s):
                st.add_round(prev - sent_flat, prev_ups)
        held["prev"] = (sent_flat, ups)

    def sent_flat(sent):
        return flat({k: v for k, v in sent.items() if k in c.names}, shapes)

    kw = dict(rounds=rounds, algorithm=cfg.fl.algorithm, lr=cfg.fl.lr, local_epochs=cfg.fl.local_epochs,
              local_batch_size=cfg.fl.local_batch_size, defenses=defenses, seed=cfg.seed, secure_aggregation=False,
              local_update=defense.local_update,
              client_settings=(plan + [{}] * c.k) if plan is not None else None, lr_at=cfg.fl.lr_at)
    if "on_round" in inspect.signature(rounds_fn).parameters:
        outcome = rounds_fn(model, c.real + c.cans, keep_round=lambda _r: False,
                            on_round=lambda r, sent, ups: measure(sent_flat(sent), uploads(ups)), **kw)
    else:
        outcome = rounds_fn(model, c.real + c.cans, **kw)
        for r in range(len(outcome.round_states)):
            measure(sent_flat(outcome.round_states[r]), uploads(outcome.rounds[r]))
            outcome.round_states[r], outcome.rounds[r] = None, None  # measured: let them go
    last, last_ups = held.pop("prev")
    first = held["first"]
    final = last - cfg.fl.lr_at(rounds - 1) * flat(outcome.last_aggregate.tensors, shapes)
    for st in (seen_s, unseen_s):
        st.add_round(last - final, last_ups, final=first - final)
    return seen_s.finish(first - final), unseen_s.finish(first - final)


def _canary_report(defense, first_id: int) -> dict:
    """The training-time defense's report after the rounds, with the canaries' own DP-SGD ε and steps (the largest
    over the canary clients) where it reports them per client."""
    report = defense.report([]) if hasattr(defense, "report") else {}
    report = dict(report or {})
    steps = [v for kk, v in report.items() if kk.startswith("dp_steps_client") and int(kk[15:]) >= first_id]
    eps_c = [v for kk, v in report.items() if kk.startswith("dp_epsilon_client") and int(kk[17:]) >= first_id]
    if eps_c:
        report["canary_epsilon"], report["canary_steps"] = max(eps_c), max(steps)
    return report


def _claims(mechanisms: list, rounds: int, report: dict) -> list[dict]:
    """Each declared mechanism's claim over the rounds run: its ε, the accountant in words, δ and what it covers."""
    claims = []
    for m in mechanisms:
        eps, words = m["claim"](rounds, report)
        claims.append({"name": m["name"], **({"where": m["where"]} if "where" in m else {}), "claimed_epsilon": eps,
                       "accountant": words, "delta": m["delta"], "covers": m["covers"]})
    return claims


def _threat_statistics(covered: list, seen: dict, unseen: dict, claims: list) -> dict:
    """Per threat model a mechanism covers (and the canaries measured): the inserted and never-inserted canaries'
    statistics, how many cosines each is the largest of, and the smallest claim covering it."""
    statistics = {}
    for t in ("final_model", "every_round", "each_upload"):
        if t not in covered or not seen[t]:
            continue
        cl = [c for c in claims if t in c["covers"] and c["claimed_epsilon"] is not None]
        claim = min(cl, key=lambda c: c["claimed_epsilon"]) if cl else None
        # how many cosines each statistic is the largest of: one for the final model, the rounds otherwise
        statistics[t] = {"seen": seen[t], "unseen": unseen[t], "maxima": seen["maxima"][t],
                         "claimed_epsilon": claim["claimed_epsilon"] if claim else None,
                         "claimed_by": claim["name"] if claim else None}
        if t in seen.get("tensors", {}):
            statistics[t]["tensors"] = seen["tensors"][t]
    return statistics


def _result(cfg, c: _Canaries, verdict, sentence, claimed, claims, measured, delta, rounds: int, sent,
            t0: float) -> dict:
    """``audit.json``'s ``dp_check`` (module docstring)."""
    from gradleak.evaluation.empirical_epsilon import ALPHA
    from gradleak.fl.canaries import CANARY_SCALE

    canaries, asked, dim = c.k, c.asked, c.dim
    return {"verdict": verdict, "sentence": sentence, "claimed_epsilon": claimed, "mechanisms": claims,
            "measured": measured, "delta": delta, "canaries": canaries, "unseen_canaries": canaries,
            "dimension": dim, "rounds": rounds, "engine": cfg.fl.engine, "clients": len(c.real),
            "started_from": "the recorded round's sent weights" if sent else "the model's initial weights",
            "canary_norm": CANARY_SCALE * c.clip, "method": METHOD, "tests_alpha": ALPHA, "tests_method": TESTS_METHOD,
            "seconds": time.perf_counter() - t0,
            **({"canaries_asked": asked, "canaries_note": f"{asked} canaries would hold more than {MEMORY_GIB:g} GiB "
                f"of uploads for {dim} coordinates over {cfg.fl.rounds} round(s): {canaries} inserted (a wider "
                "interval)"} if canaries != asked else {})}
