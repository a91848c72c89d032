"""The answer a run's report opens with: one sentence built from the run's results (``results.json``), never
written by hand.

The attack's reconstruction kind picks its evaluation unit (docs/ARCHITECTURE.md, ``evaluation/``): the sentence
gives the unit's headline metric beside its chance level -- the bar the level rules test it against (the null's
99th percentile, raised to a trivial reference where the unit has one, :func:`gradleak.evaluation.levels.bar`) --
and the level of :func:`gradleak.evaluation.levels.grade`, led by the samples recovered exactly where the unit counts
them (its ``audit_fields``). Every attacked client is graded as the audit grades it
(:func:`gradleak.run.answer.client_metric_sets`); the most leaking one is the answer. E.g. "PEFTLeak recovered 128 of
128 image patches exactly: best-image PSNR 102 dB against chance at 19.3 dB (level exact)."
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

from gradleak.report.markdown import fmt_p, p_floor_bound  # noqa: F401 -- the console's and the reports' one spelling

#: a headline metric in words, and its unit (a metric not listed is named by its key)
METRIC_WORDS = {"psnr_max": ("best-image PSNR", " dB"), "psnr": ("mean PSNR", " dB"), "ssim_max": ("best-image SSIM", ""),
                "rouge1_f1": ("ROUGE-1 F1", ""), "rouge2_f1": ("ROUGE-2 F1", ""), "auc": ("ROC AUC", ""),
                "rdlv": ("RDLV", "")}


def num(v: Any) -> str:
    """A number as the sentence writes it: three significant digits (102, 19.3, 0.906)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "∞" if v > 0 else "−∞"
    return f"{v:.3g}"


def attack_title(A, name: str) -> str:
    """How the sentence names the attack: its class's name (``PEFTLeak``, ``UTR``) when that spells the registered
    name (case, underscores and an ``Attack`` suffix aside), else the registered name."""
    cls = getattr(A, "__name__", "")
    cls = cls[: -len("Attack")] if cls.endswith("Attack") and len(cls) > 6 else cls
    return cls if cls.lower() == name.replace("_", "").lower() else name


def client_metric_sets(kind: str, metrics: dict, per_client: list[dict] | None = None) -> list[tuple[Any, dict]]:
    """``[(client, metrics)]`` of one run: the per-client results of ``metrics.attack_clients: all`` (else the run's
    metrics, client 0); for a unit that scores every client in one run (the leakage kind) every client's
    ``*_client<c>`` metrics (last attacked round; :meth:`~gradleak.evaluation.base.EvaluationUnit.clients_of`). The
    audit grades each of them (:func:`gradleak.run.audit_judge.judge`), and so does the answer."""
    from gradleak.evaluation import EVALUATORS

    every = EVALUATORS.get(kind).clients_of(metrics) if kind in EVALUATORS else None
    if every is not None:
        return every
    if per_client:
        return [(p.get("client", 0) if p.get("trial", 0) in (0, None) else f"{p.get('client', 0)}@trial{p['trial']}",
                 p["metrics"]) for p in per_client]
    return [(0, dict(metrics))]


def server_words(tm) -> str:
    """The server an attack ran under, named for what it is."""
    if tm.malicious:
        who = "a malicious server (sets the weights it sends)"
    elif tm.prescribes_architecture:
        who = "a server that prescribes the trainable architecture"
    else:
        who = "an honest-but-curious server"
    if tm.public_data:
        who += " holding public data"
    return who


def run_answer(results: dict) -> dict | None:
    """The answer of a run (module docstring): ``{"text", "level", "rule", "metric", "value", "chance",
    "null_median", "p_value", "client", "clients", "server", "keys"}`` (``keys``: the metrics of
    ``results["metrics"]`` the sentence is built from); None when the results name no registered attack."""
    from gradleak.evaluation import EVALUATORS
    from gradleak.evaluation.levels import grade, leak_rank
    from gradleak.registry import ATTACKS, load_all

    details = results.get("details") or {}
    name = (details.get("attack") or {}).get("name") or ((results.get("config") or {}).get("attack") or {}).get("name")
    load_all()
    if not name or name not in ATTACKS.names():
        return None
    A = ATTACKS.get(name)
    kind = A.reconstruction
    if kind not in EVALUATORS:
        return None
    unit = EVALUATORS.get(kind)
    head = unit.headline
    thr = ((results.get("config") or {}).get("metrics") or {}).get("psnr_threshold_db", 30.0)
    metrics = results.get("metrics") or {}
    judged = []
    per = details.get("per_client")
    per = per if isinstance(per, list) and all(isinstance(p, dict) and "metrics" in p for p in per) else None
    for client, mets in client_metric_sets(kind, metrics, per):
        g = grade(kind, mets, thr)
        fields = unit.audit_fields(mets)
        chance = (g.get("evidence") or {}).get(f"{head}_bar", mets.get(f"{head}_null_p99"))
        judged.append({"client": client, "level": g["level"], "rule": g["rule"], "value": mets.get(head),
                       "chance": chance, "null_median": mets.get(f"{head}_null_median"),
                       "p_value": mets.get(f"{head}_p_value"), "n_success": fields.get("n_success"),
                       "n_total": fields.get("n_total"), "unit": fields.get("unit"), "sample": fields.get("sample")})
    if not judged:
        return None
    j = max(judged, key=leak_rank)
    title = attack_title(A, name)
    words, suffix = METRIC_WORDS.get(head, (head, ""))
    lead = title
    if j["n_total"]:
        lead += f" recovered {j['n_success'] or 0} of {j['n_total']} {j['unit'] or kind.replace('_', ' ')} exactly"
    if len(judged) > 1:
        lead += f" (client {j['client']}, the most leaking of {len(judged)} attacked)"
    ok = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)  # noqa: E731
    value = f"{num(j['value'])}{suffix}" if ok(j["value"]) else "not measured"
    against = f"against chance at {num(j['chance'])}{suffix}" if ok(j["chance"]) else "with no null to compare against"
    level = j["level"] + (f": {j['rule']}" if j["level"] == "undefined" else "")
    on = f" on {j['sample']}" if j.get("sample") else ""  # the counts it rests on (membership: members vs non-members)
    text = f"{lead}: {words} {value} {against}{on} (level {level})."
    threat = details.get("threat")
    server = (server_words(SimpleNamespace(**{k: threat.get(k) for k in ("malicious", "prescribes_architecture",
                                                                          "public_data")}))
              if isinstance(threat, dict) and "malicious" in threat else None)
    suffix_keys = unit.client_suffix(j["client"])
    keys = [k for k in (f"{head}{suffix_keys}", f"{head}_null_median{suffix_keys}", f"{head}_null_p99{suffix_keys}",
                        f"{head}_p_value{suffix_keys}") if k in metrics]
    aside = ([f"null median {num(j['null_median'])}{suffix}"] if ok(j["null_median"]) else []) + (
        [fmt_p(j["p_value"])] if ok(j["p_value"]) else [])
    chance_words = (f"{num(j['chance'])}{suffix} is the bar the level rule tests the {words} against: the null's 99th "
                    "percentile (chance, scored as the attack is) or a trivial reference, whichever is higher"
                    + (f" ({', '.join(aside)})" if aside else "")) if ok(j["chance"]) else ""
    return {"text": text, "level": j["level"], "rule": j["rule"], "metric": head, "value": j["value"],
            "chance": j["chance"], "null_median": j["null_median"], "p_value": j["p_value"], "client": j["client"],
            "clients": len(judged), "server": server, "keys": keys, "unit": suffix.strip(),
            "chance_words": chance_words}
