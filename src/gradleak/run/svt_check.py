"""The DP check of NVFlare's SVTPrivacy filter (``nvflare_svt``, :class:`gradleak.defenses.nvflare.NVFlareSVT`)
against NVFlare's own ε accounting, with per-coordinate canaries (docs/DESIGN.md §6 and §7).

SVTPrivacy bounds each coordinate of Δw / steps by γ and accounts pure ε-DP per call (per client per round):
ε_threshold + ε_query + ε_release (NVFlare's ``get_privacy_spent``). Isotropic canaries scaled to an L2 bound
(:mod:`gradleak.run.dp_check`) do not fit a per-coordinate bound, so here each canary is a vector of independent
random signs scaled :data:`gradleak.fl.canaries.CANARY_SCALE` times beyond γ · steps / lr on every coordinate (the
filter clips it to ±γ everywhere: the largest input its accounting covers). Each canary's upload goes through the
real filter -- the configured instance, one NVFlare filter (and accountant) per client id, as in the federation --
with the round's lr and the run's seed; the filter is a local randomizer, so its output on the canary's upload is
exactly what the server sees of that client (``each_upload``; the aggregate and the final model are post-processing
of it). The statistic and the rigorous bound: :mod:`gradleak.evaluation.sign_canaries` (each canary's sign
agreement on the released coordinates against the exact Binomial(n, ½) of a never-inserted canary); the claim:
the per-call ε each canary's own filter accounted. The verdict (:func:`gradleak.evaluation.sign_canaries
.judge_agreement`): ``claim_violated`` / ``vacuous`` / ``consistent``, the sentence saying whether the claim was
testable at this size.
"""

from __future__ import annotations

import math
import time
import torch

METHOD = ("per-coordinate canaries (independent random signs, clipped by SVTPrivacy to ±gamma on every coordinate) "
          "through the real NVFlare filter; each canary's sign agreement on the released coordinates against the "
          "exact Binomial(n, 1/2) of a never-inserted canary; pure-DP bound eps >= max_j L_j - log(k / alpha), "
          "L_j = -log P[Binomial(n_j, 1/2) >= agreement_j] (gradleak.evaluation.sign_canaries)")


def svt_filters(defenses: list) -> list:
    """The ``nvflare_svt`` filters among a round's update defenses."""
    from gradleak.defenses.nvflare import NVFlareSVT

    return [d for d in defenses if isinstance(d, NVFlareSVT)]


def sign_canary(dim: int, seed: int, index: int) -> torch.Tensor:
    """The flat ±1 vector (float64) of per-coordinate canary ``index`` (inserted or not) under ``seed``."""
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + 7_907 * int(index) + 54_321)
    return torch.randint(0, 2, (int(dim),), generator=g).to(torch.float64) * 2.0 - 1.0


def svt_dp_check(cfg, model, svt, *, canaries: int, first_id: int, shapes: list, log=lambda m: None) -> dict:
    """The check of ``svt`` (an :class:`~gradleak.defenses.nvflare.NVFlareSVT` of ``cfg``'s round defenses) with
    ``canaries`` per-coordinate canaries as clients ``first_id``, ``first_id`` + 1, ...; ``shapes``: the trainable
    parameters' (name, shape). Returns ``audit.json``'s ``dp_check`` (the fields of :func:`gradleak.run.dp_check
    .dp_check`, ``measured`` holding the one ``each_upload`` entry)."""
    from gradleak.evaluation.empirical_epsilon import ALPHA, VACUOUS_EPSILON
    from gradleak.evaluation.sign_canaries import judge_agreement
    from gradleak.fl.canaries import CANARY_SCALE, flat
    from gradleak.fl.core import Update

    t0 = time.perf_counter()
    dim = sum(int(torch.Size(s).numel()) for _, s in shapes)
    lr = float(cfg.fl.lr_at(0))
    steps = 1  # a canary's upload is one step (NUM_STEPS_CURRENT_ROUND = 1)
    scale = CANARY_SCALE * float(svt.cfg.gamma) * steps / lr  # beyond the per-coordinate clip, in upload units
    kind = "gradient" if cfg.fl.algorithm == "fedsgd" else "pseudo_gradient"
    seed = int(cfg.seed) * 31 + 11
    log(f"[dp_check] nvflare_svt: {canaries} per-coordinate canaries through the filter, {dim} coordinates")
    support, agree, agree_unseen, claimed = [], [], [], []
    for j in range(int(canaries)):
        s = sign_canary(dim, seed, j)
        tensors, i = {}, 0
        for name, shape in shapes:
            k = int(torch.Size(shape).numel())
            tensors[name] = (s[i:i + k] * scale).reshape(shape)
            i += k
        cid = first_id + j
        out = svt.apply(Update(tensors, 1, cid, kind, steps), {"client_id": cid, "seed": int(cfg.seed), "lr": lr})
        u = flat(out.tensors, shapes)
        released = u != 0
        signs = torch.sign(u[released])
        support.append(int(released.sum()))
        agree.append(int((signs == s[released]).sum()))
        agree_unseen.append(int((signs == sign_canary(dim, seed, canaries + j)[released]).sum()))
        claimed.append(float(svt.filters[cid].get_privacy_spent()))  # this canary's filter: one call
    claim = max(claimed)
    verdict, sentence, m = judge_agreement(support, agree, agree_unseen, claim, ALPHA, vacuous_above=VACUOUS_EPSILON)
    words = svt.epsilon_words.replace("summed over the rounds (the worst client)", "one call (one canary upload)")
    return {"verdict": verdict, "sentence": sentence, "claimed_epsilon": claim,
            "mechanisms": [{"name": "nvflare_svt", "claimed_epsilon": claim, "accountant": words, "delta": 0.0,
                            "covers": ["each_upload"]}],
            "measured": [m], "delta": 0.0, "canaries": int(canaries), "unseen_canaries": int(canaries),
            "dimension": dim, "rounds": 1, "engine": cfg.fl.engine, "clients": first_id,
            "started_from": "the canaries' uploads alone (a local filter: the model does not enter)",
            "canary_norm": scale * math.sqrt(dim), "method": METHOD, "tests_alpha": ALPHA,
            "seconds": time.perf_counter() - t0}


def check_words(m: dict) -> str:
    """One line of the report for a per-coordinate measurement (``measured`` entry of :func:`svt_dp_check`)."""
    from gradleak.evaluation.empirical_epsilon import fmt_epsilon

    return (f"measured, {m['threat_model'].replace('_', ' ')} (per-coordinate canaries): ε ≥ {fmt_epsilon(m['epsilon'])} "
            f"at {100 * m['confidence']:g} % (never-inserted canaries: {fmt_epsilon(m['null_epsilon'])}; at most "
            f"{fmt_epsilon(m['ceiling'])} at this size; {100 * m['agreement']:.1f} % of released signs agree, "
            f"never-inserted {100 * m['null_agreement']:.1f} %) against the claimed "
            f"{fmt_epsilon(m.get('claimed_epsilon'))}: {m.get('verdict', '').replace('_', ' ')}")


__all__ = ["METHOD", "check_words", "sign_canary", "svt_dp_check", "svt_filters"]
