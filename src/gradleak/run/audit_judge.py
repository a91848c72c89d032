"""The audit's judging (docs/ARCHITECTURE.md, "gradleak audit"; :mod:`gradleak.run.audit`): one client's metrics to its
level (:func:`judge`, the level rules of the kind's evaluation unit, the headline beside its null and the metric that
decided), one client's row (:func:`client_row`: the one entry shape of ``audit.json``, CLI and framework audits), one
attack's runs to its entry (:func:`judge_attack`: every client of every run judged, the most leaking is the
evidence; a crash is ``undefined``, never ``none``: :func:`record_failures`), and the verdict with its banner
(:func:`verdict_and_headline`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable

from gradleak.evaluation.levels import leak_rank
from gradleak.run.answer import client_metric_sets


def headline_metric(kind: str) -> str | None:
    """The headline metric of a reconstruction kind (its evaluation unit's; its null sits beside it)."""
    from gradleak.evaluation import EVALUATORS

    return EVALUATORS.get(kind).headline if kind in EVALUATORS else None


@dataclass(frozen=True)
class Judgement:
    """One client's judgement (:func:`judge`): its level and the rule that gave it (docs/DESIGN.md §7), the headline
    metric beside its null (median, 99th percentile, p-value), the counts of private samples exact, the metric that
    decided the level (``decided_by``: its value, null and p-value, and the bar it cleared) and the kind's own extra
    fields (``extra``: :attr:`~gradleak.evaluation.base.EvaluationUnit.audit_fields`, e.g. membership's ``sample``).
    A field whose metadata says ``row`` is on each client's row of ``per_client`` (:data:`ROW_KEYS`); every field is
    on the attack's entry from its most leaking client (:data:`ENTRY_KEYS`): the one entry shape of ``audit.json``,
    CLI and framework audits."""

    level: str = field(metadata={"row": True})
    rule: str
    evidence: Any
    success: bool = field(metadata={"row": True})
    metric: str | None
    value: Any = field(metadata={"row": True})
    null_median: Any
    null_p99: Any = field(metadata={"row": True})
    p_value: Any = field(metadata={"row": True})
    n_success: Any = field(default=None, metadata={"row": True})
    n_total: Any = field(default=None, metadata={"row": True})
    criterion: str | None = None
    decided_by: dict | None = field(default=None, metadata={"row": True})
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        """The judgement as ``audit.json`` holds it: every field, the kind's extra fields beside them, no
        ``decided_by`` when no metric decided."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("decided_by", "extra")}
        out.update(self.extra)
        if self.decided_by is not None:
            out["decided_by"] = self.decided_by
        return out


#: the judgement keys a per-client row carries (the one entry shape of ``audit.json``, CLI and framework audits)
ROW_KEYS = tuple(f.name for f in fields(Judgement) if f.metadata.get("row"))
#: the judgement keys an attack's entry carries from its most leaking client (every field, and the unit's ``unit``)
ENTRY_KEYS = tuple(f.name for f in fields(Judgement) if f.name != "extra") + ("unit",)


def client_row(client: Any, judgement: dict | Judgement, warnings: list | None = None) -> dict:
    """One client's row of an attack's ``per_client`` list: its label and its judgement (the keys of
    :data:`ROW_KEYS`), with the attack's warnings for that client."""
    if isinstance(judgement, Judgement):
        judgement = judgement.as_dict()
    row = {"client": client}
    row.update({k: judgement.get(k) for k in ROW_KEYS})
    if judgement.get("sample"):  # the counts the client's measurement rests on (membership: members vs non-members)
        row["sample"] = judgement["sample"]
    row["warnings"] = list(warnings or [])
    return row


def fold_clients(entry: dict, rows: list[dict], keys: tuple[str, ...] | None = ENTRY_KEYS) -> dict:
    """The one per-client fold of an attack's entry, CLI and framework audits: ``rows`` (one run's clients, each
    ``{"client", <judgement keys>, "warnings"}``) in ``per_client`` (:func:`client_row` each), the most leaking
    client's judgement on the entry (:func:`gradleak.evaluation.levels.leak_rank`, the first on a tie; ``keys``: the
    judgement keys copied, :data:`ENTRY_KEYS`, or ``None``: every key of its row) and its label in ``worst_client``.
    Returns the most leaking row."""
    worst = max(rows, key=leak_rank)
    entry.update({k: v for k, v in worst.items() if k not in ("client", "warnings")} if keys is None
                 else {k: worst[k] for k in keys if k in worst})
    entry["worst_client"] = worst["client"]
    entry["per_client"] = [client_row(o["client"], o, o.get("warnings")) for o in rows]
    return worst


def judge(kind: str, metrics: dict, cfg) -> Judgement:
    """The level of one client's metrics, with the headline metric beside its null (module docstring)."""
    from gradleak.evaluation import EVALUATORS
    from gradleak.evaluation.levels import LEAKING, grade

    g = grade(kind, metrics, cfg.metrics.psnr_threshold_db)
    head = headline_metric(kind)
    m = metrics
    out = {"level": g["level"], "rule": g["rule"], "evidence": g["evidence"], "success": g["level"] in LEAKING,
           "metric": head, "value": m.get(head), "null_median": m.get(f"{head}_null_median"),
           "null_p99": m.get(f"{head}_null_p99"), "p_value": m.get(f"{head}_p_value"),
           "n_success": None, "n_total": None, "criterion": g["rule"]}
    extra: dict = {}
    decided = None
    if kind in EVALUATORS:
        extra = dict(EVALUATORS.get(kind).audit_fields(m))
        # the metric whose test decided the level, with *its* null and p-value (the headline may not have decided:
        # a word-bag `partial` rests on word-bag recall, not ROUGE-1 F1); the banner and the rows show it
        key = EVALUATORS.get(kind).decided_by(m, g["level"]) or head
        if key:
            bar_value = (g["evidence"] or {}).get(f"{key}_bar")
            decided = {"metric": key, "value": m.get(key), "null_p99": m.get(f"{key}_null_p99"),
                       "p_value": m.get(f"{key}_p_value"),
                       **({"bar": bar_value} if bar_value is not None and bar_value == bar_value else {})}
    out.update({k: extra.pop(k) for k in list(extra) if k in out})  # the unit's counts (n_success, n_total)
    return Judgement(**out, decided_by=decided, extra=extra)


MARGIN_KEYS = ("spectral_margin", "drowning_noise_std_all", "drowning_noise_std", "signal_rank", "directions_above_edge",
               "margin_strongest", "debiased_strongest", "debiased_weakest_above_edge")


def leakage_margin(metrics: dict) -> dict[str, dict[str, float]]:
    """Per attacked layer, the leakage margin an exact attack measured on the observed upload
    (:func:`gradleak.attacks.common.subspace.spectral_margin`): ``spectral_margin`` (the weakest signal direction the
    attack used over the noise edge of the declared noise; nan without noise), ``drowning_noise_std`` (the
    per-coordinate noise std that would drown that direction) and ``drowning_noise_std_all`` (every direction); with a
    known noise std, the information limit: ``directions_above_edge``, ``margin_strongest`` and the debiased singular
    values. Read from the run's metrics ``<key>_<layer>``."""
    out: dict[str, dict[str, float]] = {}
    for k, v in metrics.items():
        for key in MARGIN_KEYS:
            if k.startswith(key + "_") and isinstance(v, (int, float)):
                layer = k[len(key) + 1:]
                if key == "drowning_noise_std" and layer.startswith("all_"):
                    continue
                out.setdefault(layer, {})[key] = float(v)
                break
    return out


def sum_label(client, summed: int, kind: str):
    """The attacked "client" as what it is: under secure aggregation over ``summed`` > 1 clients the server saw only
    the sum of their updates, so the evidence is credited to ``the sum of N clients``, not to client 0 (a unit that
    scores every client in one run -- the leakage kind -- keeps its labels: its scores are per client's own images)."""
    from gradleak.evaluation import EVALUATORS

    if summed <= 1 or (kind in EVALUATORS and EVALUATORS.get(kind).scores_every_client):
        return client
    words = f"the sum of {summed} clients"
    if isinstance(client, str) and "@" in client:  # a later trial: "0@trial2"
        return f"{words}@{client.split('@', 1)[1]}"
    return words


def client_warnings(res: dict, per: list[dict] | None, i: int, n: int) -> list[str]:
    """The warnings of the ``i``-th of ``n`` attacked clients of one run: the pipeline's per-client record
    (``details.per_client[i].warnings``); a run without it (one client, or an older results.json) has only the
    run's warnings to give."""
    if per and len(per) == n and any("warnings" in p for p in per):
        return [str(w) for w in per[i].get("warnings") or []]
    return [str(w) for w in (res.get("details") or {}).get("warnings") or []]


def evidence_rows(res: dict) -> list[dict]:
    rows = []
    for t in (res.get("details") or {}).get("trials", []) or []:
        for ref, rec in zip(t.get("references", []), t.get("reconstructions", [])):
            rows.append({"reference": ref, "reconstruction": rec})
    return rows[:16]


def record_failures(entry: dict, runs: list[dict], reconstruction: str, log: Callable[[str], Any] = print) -> bool:
    """The failure path of one attack's runs (``runs``: each run's result). A run refused once the data and model are
    known (``bad_input``) with no run measured: the attack is not applicable (with the reason). A crashed run is
    recorded in ``entry["failed"]``, never dropped; with no run measured the level is ``undefined`` -- never ``none``:
    a crash is not evidence of safety. Returns True when nothing is left to judge."""
    ok = [r for r in runs if "metrics" in r]
    bad = next((r for r in runs if "bad_input" in r), None)
    if bad is not None and not ok:  # refused once the data/model are known (e.g. a generator shape)
        entry.update({"applicable": False, "applicable_under": None, "reason": bad["bad_input"]})
        return True
    err = next((r for r in runs if "error" in r), None)
    if err is not None:  # one attack's crash must not lose the others' results: recorded, level undefined
        entry["failed"] = err["error"]
        log(f"[audit] {entry['name']}: a run FAILED ({err['error']})")
    if not ok:
        entry.update({"level": "undefined", "success": False, "undefined": True,
                      "metric": headline_metric(reconstruction), "value": None,
                      "rule": "the run failed: nothing was measured",
                      "reason": f"the run failed: {err['error'] if err else 'no result'}"})
        return True
    return False


def verdict_and_headline(entries: list[dict], not_run: list[str] | None = None,
                         by: str = "--only") -> tuple[str, str]:
    """The verdict and the banner: the worst level, the attack, the client and the evidence -- the metric that decided
    the level, beside its own null and p-value (:func:`gradleak.run.audit_report.shown_evidence`) -- never green
    while an attack is at ``partial`` or more. ``not_run``: applicable attacks ``--only`` left out, named in the
    banner (an audit of some attacks must not read as an audit of all); ``by``: what left them out (a framework
    round audit: its ``attacks=[...]``)."""
    from gradleak.evaluation.levels import LEAKING, verdict_of
    from gradleak.run.audit_report import client_words, evidence_words

    verdict = verdict_of(entries)
    leaking = sorted([e for e in entries if e.get("level") in LEAKING], key=leak_rank, reverse=True)
    conf = [e for e in leaking if e.get("applicable")]

    def words(e):
        n = (f"; {e['n_success']} of {e['n_total']} private {e.get('unit', 'samples')} exact"
             if e.get("n_success") else "")
        client = f", {client_words(e['worst_client'])}" if e.get("worst_client") is not None else ""
        return (f"{e['level'].upper()} leakage by {e['name']}{client} under {e.get('threat_words', e.get('threat'))}: "
                f"{e['rule']} -- {evidence_words(e)}{n}")

    left = (f"; {len(not_run)} applicable attack(s) not run ({by}): {', '.join(not_run)}" if not_run else "")
    if verdict == "leaks":
        return verdict, "LEAKS: " + words(conf[0]) + left
    if verdict == "leaks_stronger_server":
        return verdict, "LEAKS ONLY UNDER A STRONGER SERVER: " + words(leaking[0]) + left
    ran = [e for e in entries if e.get("level") in ("none",)]
    undef = [e for e in entries if e.get("level") == "undefined"]
    if verdict == "undefined":
        return verdict, ("UNDEFINED: no attack measured anything (" + "; ".join(
            f"{e['name']}: {e.get('reason', e.get('rule', ''))}" for e in undef) + ") -- this is not evidence of safety"
            + left)
    tried = ", ".join(f"{e['name']} ({len(e.get('variants') or [{}])} setting(s), "
                      f"{len(e.get('per_client') or [1])} client(s))" for e in ran)
    text = (f"NO LEAK FOUND: {len(ran)} attack(s) measured at full strength, none above its null -- {tried or 'none'}"
            f"{left} (evidence, not proof)")
    if undef:
        text += f"; {len(undef)} undefined (measured nothing): " + ", ".join(e["name"] for e in undef)
    return verdict, text


def judge_clients(runs: list[tuple], cfg, kind: str) -> tuple[list[tuple], dict]:
    """Every client of every measured run of one attack judged (:func:`judge`): ``(judged, warned)`` -- ``judged``:
    ``(seed, variant, result, client, judgement)`` each (the judgement as :meth:`Judgement.as_dict`), the client labelled as what the server saw
    (:func:`sum_label`); ``warned``: ``(seed, variant, client) -> `` that client's warnings in that run."""
    judged = []
    warned: dict = {}
    summed = cfg.fl.clients if not cfg.threat_model.individual_updates else 1
    for sd, k, r in runs:
        per = (r.get("details") or {}).get("per_client")
        sets = client_metric_sets(kind, r["metrics"], per)
        for i, (client, mets) in enumerate(sets):
            warned[(sd, k, sum_label(client, summed, kind))] = client_warnings(r, per, i, len(sets))
            judged.append((sd, k, r, sum_label(client, summed, kind), judge(kind, mets, cfg).as_dict()))
    return judged, warned


def worst_by_run(judged: list[tuple]) -> dict:
    """``(seed, variant) -> `` the most leaking client's judgement of that run."""
    by_run: dict = {}
    for t in judged:
        if leak_rank(t[4]) > leak_rank(by_run.get((t[0], t[1]), {"level": "undefined"})):
            by_run[(t[0], t[1])] = t[4]
    return by_run


def add_spread(entry: dict, by_run: dict, variants: list[dict], worst_seed: int, multi: bool) -> None:
    """Each full-strength setting's level (``per_variant``, with more than one setting) and, over several seeds, each
    seed's result of the configured setting (``per_seed``), the worst seed and the median and range of its
    headline."""
    if len(variants) > 1:
        entry["per_variant"] = [{"variant": variants[kk] or "as configured", "seed": s0,
                                 "level": jj["level"], "value": jj.get("value")}
                                for (s0, kk), jj in sorted(by_run.items(), key=lambda t: (t[0][0], t[0][1]))]
    vals = [jj.get("value") for (s0, kk), jj in by_run.items() if kk == 0
            and isinstance(jj.get("value"), (int, float)) and jj["value"] == jj["value"]]
    if multi:
        entry["per_seed"] = [{"seed": s0, "success": jj["success"], "level": jj["level"], "value": jj.get("value"),
                              "n_success": jj.get("n_success")} for (s0, kk), jj in sorted(by_run.items()) if kk == 0]
        entry["worst_seed"] = worst_seed
        if vals:
            srt = sorted(vals)
            entry["median"] = srt[len(srt) // 2] if len(srt) % 2 else 0.5 * (srt[len(srt) // 2 - 1] + srt[len(srt) // 2])
            entry["spread"] = [srt[0], srt[-1]]


def mark_undefined(entry: dict, kind: str, metrics: dict) -> None:
    """An entry whose evidence measured nothing: ``undefined``, with the rule and what the kind's unit says the
    config lacks (:attr:`~gradleak.evaluation.base.EvaluationUnit.undefined_hint`, e.g. ``data.nonmembers``)."""
    from gradleak.evaluation import EVALUATORS

    entry["undefined"] = True
    missing = EVALUATORS.get(kind).undefined_hint(metrics) if kind in EVALUATORS else ""
    entry["reason"] = (f"undefined: {entry['rule']}{missing}; the run measured nothing, so it is not evidence "
                       "either way")


def add_evidence(entry: dict, res: dict) -> None:
    """The evidence run's numbers (``metrics``), its leakage margin per attacked layer (how far the defense is from
    drowning the signal the attack read), its images and its reference / reconstruction rows."""
    entry["metrics"] = {kk: v for kk, v in res["metrics"].items() if isinstance(v, (int, float))}
    margin = leakage_margin(entry["metrics"])
    if margin:
        entry["leakage_margin"] = margin
    entry["artifacts"] = [a for a in res.get("artifacts", []) if str(a).endswith(".png")]
    entry["evidence_rows"] = evidence_rows(res)


def add_warnings(entry: dict, warned: dict, variants: list[dict], evidence: tuple, is_shared: bool,
                 shared_why: str | None) -> None:
    """Every warning stays with the run (seed, setting) and the client it came from (``run_warnings``); the evidence
    (``evidence``: its seed, setting and client) carries only its own, and a shared run's reason: another client's or
    another setting's caveat (e.g. "a least-squares guess") must not sit on it."""
    entry["run_warnings"] = [{"seed": s0, "variant": variants[kk] or "as configured", "client": c0,
                              "warning": str(w)} for (s0, kk, c0), ws in warned.items() for w in ws]
    warns = (warned.get(evidence) or []) + ([shared_why] if is_shared else [])
    if warns:
        entry["warnings"] = [str(w) for w in warns]
        entry["reason"] = "; ".join(([entry["reason"]] if entry.get("reason") else []) + entry["warnings"][:2])


def judge_attack(entry: dict, cfg, kind: str, runs: list[tuple], variants: list[dict], seeds: list[int],
                 shared: tuple[str, str] | None = None, log: Callable[[str], Any] = print) -> None:
    """One attack's entry from its runs (``runs``: ``(seed, variant, result)`` of every seed of ``seeds`` and every
    full-strength setting of ``variants``; ``shared``: ``(other, why)`` when they are another attack's runs,
    :func:`gradleak.run.audit_plan.shared_runs`): the failure path (:func:`record_failures`), else every client
    judged, the most leaking client of the most leaking run as the evidence (its folder, judgement, client and
    setting), every client of that run in ``per_client`` (the one shape), the spread over settings and seeds, and the
    evidence run's numbers and warnings; the entry's console line is logged."""
    from gradleak.run.audit_ledger import run_folder
    from gradleak.run.audit_report import attack_line

    multi = len(seeds) > 1
    shared_why = shared[1] if shared is not None else None
    entry["seconds"] = 0.0 if shared is not None else sum(r.get("seconds", 0.0) for _, _, r in runs)
    if shared is not None:
        entry["shared_run"] = {"attack": shared[0], "why": shared_why}
    if record_failures(entry, [r for _, _, r in runs], kind, log):
        return
    judged, warned = judge_clients([(sd, k, r) for sd, k, r in runs if "metrics" in r], cfg, kind)
    sd, k, res, client, j = max(judged, key=lambda t: leak_rank(t[4]))  # the most leaking client/run is the evidence
    entry["out"] = run_folder(shared[0] if shared is not None else entry["name"], sd, k, multi)
    fold_clients(entry, [{"client": t[3], **t[4], "warnings": warned.get((t[0], t[1], t[3]), [])}
                         for t in judged if t[0] == sd and t[1] == k], keys=None)  # the same client: the first worst
    if len(variants) > 1:
        entry["worst_variant"] = variants[k] or "as configured"
    add_spread(entry, worst_by_run(judged), variants, sd, multi)
    if entry["level"] == "undefined":
        mark_undefined(entry, kind, res["metrics"])
    add_evidence(entry, res)
    add_warnings(entry, warned, variants, (sd, k, client), shared is not None, shared_why)
    log(f"[audit] {attack_line(entry, seeds if multi else None)}")
    for w in dict.fromkeys(entry.get("warnings") or []):  # e.g. lora_span's under-determined setting: said
        log(f"[audit] {entry['name']}: WARNING: {w}")
