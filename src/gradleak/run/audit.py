"""``gradleak audit``: every registered attack against one federated PEFT setup, and a verdict with evidence.

The audit config is an ordinary experiment config (``experiment``, ``model``, ``peft``, ``data``, ``fl``,
``defenses``, ``threat``) whose ``attack`` section, if any, is ignored: the audit tries every attack in the
registry with its default parameters, so an attack registered later appears without touching this module. An
optional ``audit:`` section overrides an attack's parameters (``params: {<attack>: {...}}``, a quick audit) and
runs every attack on several seeds (``seeds: [0, 1, 2]``): the entry then reports the worst (most leaking) run as
its evidence, with the median and the range of the headline metric and the per-seed results.

Applicability is the pipeline's own gate (:func:`gradleak.run.validate`): an attack is applicable when
the config with ``attack.name`` set to it validates. When it is refused only because the threat model withholds
a *server capability* (``malicious``, ``prescribes_architecture``, ``public_data``: what a dishonest server can
take for itself), the audit runs it again under the smallest such upgrade and records that threat -- that is
what makes the verdict "leaks only under a malicious server" possible. Refusals for other reasons (modality,
PEFT kind, facts of the deployment such as leaked sequence lengths or individual updates) are reported with the
gate's own message. An attack the gate accepts but that cannot measure anything in this architecture
(:meth:`AttackBase.measurable`: DAGER on a frozen backbone) is not applicable, with its reason, and is not run.
When no attack can run, the audit exits 2 with the error that concerns the setup (:func:`setup_error`: the refusal
the attacks meant for this modality and PEFT kind share, else each one's); an error found once the data and model
load (a split larger than the data) ends the same way when every planned run was refused
(:func:`runtime_setup_error`), and ``--out`` keeps nothing of the audit.

Levels, per reconstruction kind (:mod:`gradleak.evaluation.levels`; each beyond a null computed the same way as
the attack's score, :mod:`gradleak.evaluation.nulls`): ``exact`` / ``strong`` / ``partial`` / ``none`` /
``undefined``. Every client of the audited round is attacked (``metrics.attack_clients: all``) and the worst client
is the evidence. Each attack runs at full strength: besides its configured parameters, the audit runs the
variants the attack declares from the declared defenses (:meth:`AttackBase.audit_variants`: UTR's noise mode and
tolerances, lora_span's rank cut) and keeps the most leaking run.

Verdict: ``leaks`` when an attack reaches ``partial`` or more under the configured threat;
``leaks_stronger_server`` when only an upgraded server's does; ``no_leak_found`` otherwise (evidence, not proof).
An attack that crashed or measured nothing is ``undefined`` and listed as such, never counted as "ran".

What the report says is what decided (docs/ARCHITECTURE.md, "gradleak audit"): each entry's ``decided_by`` is the
metric whose test gave the level, with its own null and p-value, and the banner shows it; under secure aggregation
over N > 1 clients the evidence is credited to "the sum of N clients"; a warning stays with the run and client it
came from (``run_warnings``), the evidence shows only its own; ``--only`` checks the attacks it leaves out with the
gate (validation only): ``not_tested`` and the banner name those that apply here, ``not_applicable`` those that
never could.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import shlex
import time
import warnings
from pathlib import Path
from typing import Any, Callable

from gradleak.errors import BadInput
from gradleak.evaluation.levels import leak_rank
from gradleak.run.answer import client_metric_sets, server_words  # noqa: F401 -- the audit's API too (one home)
from gradleak.run.audit_report import write_audit_report

#: threat flags a dishonest server can grant itself (the upgrade the audit tries); other flags are deployment facts
TPR_THRESHOLD = 0.1
#: torch's once-per-process "Overriding a previously registered kernel" warning block (a kernel registration in a
#: dependency, harmless to the run): each spawned audit worker would print it again, so the runs silence it alone
KERNEL_OVERRIDE_WARNING = r"(?s).*Overriding a previously registered kernel"


def attack_names() -> list[str]:
    from gradleak.registry import ATTACKS, load_all

    load_all()  # every attack module registers itself: later families appear here untouched
    return ATTACKS.names()


def candidate(raw: dict, name: str, threat: dict | None = None, variant: dict | None = None) -> dict:
    """The run config of one attack: the setup, ``attack.name`` and the attack's defaults, plus any
    ``audit.params.<attack>`` the audit config gives (e.g. fewer steps for a quick audit) and a full-strength
    ``variant``; every client of the round is attacked (``metrics.attack_clients: all``); no accuracy is measured
    (``metrics.utility: false``: --advise measures a defense's utility in runs of its own)."""
    cand = copy.deepcopy(raw)
    extra = ((cand.pop("audit", None) or {}).get("params") or {}).get(name) or {}
    flat = {k: v for k, v in (cand.get("attack") or {}).items() if k not in ("name", "params")}
    # a flat `--set attack.<param>=...` on the audit applies to every attack that has that parameter
    from gradleak.registry import ATTACKS

    fields = set(getattr(ATTACKS.get(name).Config, "model_fields", {}))
    inherited = {k: v for k, v in flat.items() if k in fields}
    cand["attack"] = {"name": name, **inherited, **extra, **(variant or {})}
    metrics = dict(cand.get("metrics") or {})
    metrics.setdefault("attack_clients", "all")
    metrics.setdefault("utility", False)  # the accuracy after one attacked round: read by nothing (--advise has its own)
    cand["metrics"] = metrics
    if threat is not None:
        cand["threat"] = threat
    return cand


def audit_overrides(raw: dict, overrides: list[str]) -> dict:
    """``--set`` overrides of an audit config: ``audit.params.<attack>.<parameter>=...`` and ``audit.seeds=[...]``
    as the YAML's ``audit:`` section spells them; every other key as :func:`gradleak.config.loading.apply_overrides`.
    The later of two overrides of the same key wins, in either group."""
    from gradleak.config.loading import apply_overrides, parse_value
    from gradleak.config.schema import ExperimentConfig
    from gradleak.registry import ATTACKS

    section = raw.pop("audit", None)
    if section is not None and not isinstance(section, dict):
        raise BadInput("audit", f"must be a mapping, got {section!r}.", "write e.g. audit: {params: {ig: {iterations: 50}}}.")
    section = copy.deepcopy(section or {})
    plain = []
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if key != "audit" and not key.startswith("audit."):
            plain.append(item)
            continue
        if "=" not in item:
            raise BadInput("--set", f"'{item}' is not of the form dotted.key=value.",
                           "write e.g. --set audit.params.lora_span.rank_rtol=1e-4.")
        value = parse_value(item.split("=", 1)[1], f"--set {key}")
        parts = key.split(".")[1:]
        names = attack_names()
        if parts in (["seeds"], ["advise"], ["budget"], ["utility_rounds"], ["dp_check"]):
            section[parts[0]] = value
        elif parts[:1] == ["params"] and 2 <= len(parts) <= 3:
            if parts[1] not in names:
                raise BadInput(f"--set {key}", f"'{parts[1]}' is not an attack.", f"use one of: {', '.join(names)}.")
            params = section.setdefault("params", {})
            if not isinstance(params, dict):
                params = section["params"] = {}
            if len(parts) == 2:
                if not isinstance(value, dict):
                    raise BadInput(f"--set {key}", "must be a mapping of the attack's parameters.",
                                   f"write e.g. --set {key}={{iterations: 50}}.")
                params[parts[1]] = value
            else:
                known = set(ATTACKS.get(parts[1]).Config.model_fields)
                if parts[2] not in known:
                    raise BadInput(f"--set {key}", f"'{parts[2]}' is not a parameter of '{parts[1]}'.",
                                   f"parameters of '{parts[1]}': {', '.join(sorted(known)) or '(none)'}.")
                params[parts[1]] = {**(params.get(parts[1]) or {}), parts[2]: value}
        else:
            raise BadInput(f"--set {key}", "the audit section has the keys audit.seeds, audit.advise, audit.budget, "
                           "audit.utility_rounds, audit.dp_check and audit.params.<attack>.<parameter>.",
                           "write e.g. --set audit.params.lora_span.rank_rtol=1e-4 or --set audit.seeds=[0,1].")
    out = apply_overrides(raw, plain, ExperimentConfig) if plain else raw
    bad = sorted(set(section) - {"params", "seeds", "advise", "budget", "utility_rounds", "dp_check"})
    if bad:
        raise BadInput(f"audit.{bad[0]}", "this key of the audit section does not exist.",
                       "the audit section has params: {<attack>: {...}}, seeds: [...], advise, budget, "
                       "utility_rounds and dp_check.")
    from gradleak.run.dp_check import dp_section

    dp_section(section.get("dp_check"))
    from gradleak.run.advise_options import advise_section, check_budget, check_utility_rounds

    advise_section(section.get("advise"))  # `audit: {advise: true, budget: SECONDS}` (--advise), checked here
    check_budget(section.get("budget"), "audit.budget")
    check_utility_rounds(section.get("utility_rounds"))
    params = section.get("params")
    if params is not None and not isinstance(params, dict):
        raise BadInput("audit.params", f"must map attack names to their parameters, got {params!r}.",
                       "write e.g. audit: {params: {lora_span: {rank_rtol: 1e-4}}}.")
    for name, ps in (params or {}).items():
        if name not in attack_names():
            raise BadInput(f"audit.params.{name}", f"'{name}' is not an attack.", f"use one of: {', '.join(attack_names())}.")
        if not isinstance(ps, dict):
            raise BadInput(f"audit.params.{name}", f"must be a mapping of the attack's parameters, got {ps!r}.",
                           f"write e.g. audit: {{params: {{{name}: {{...}}}}}}.")
    if section:
        out["audit"] = section
    return out


def full_strength_variants(A, cand: dict, cfg, defenses: list | None = None) -> list[dict]:
    """The parameter sets the audit runs for attack ``A`` on ``cand``: ``{}`` (as configured: with the parameters
    the user set, flat ``attack.<p>`` or ``audit.params.<attack>.<p>``, in the file or by ``--set``) and the attack's
    :meth:`audit_variants` (full strength: the verdict must not rest on a tolerance the config leaves), derived from
    *every* defense the config declares -- the update list, the training-time ``defense:`` (DP-SGD), secure
    aggregation, a framework's DP wrapper -- resolved once (:func:`gradleak.defenses.declared.declared_defenses`).
    ``defenses`` (legacy: an update list) is ignored; the validated ``cfg`` is the source."""
    from gradleak.defenses.declared import declared_defenses
    from gradleak.run.runner import validate

    vs: list[dict] = [{}]
    if not A.measurable(cfg):  # nothing in this setup's uploads for any parameter set
        return vs
    for v in A.audit_variants(cfg.attack_cfg.model_dump(mode="json"), declared_defenses(cfg)):
        if not v or v in vs:
            continue
        try:  # a variant the attack's config refuses is skipped (it would not be a stronger attack)
            validate({**cand, "attack": {**cand["attack"], **v}})
            vs.append(v)
        except BadInput:
            pass
    return vs


def shared_runs(planned: list, variants: dict[str, list[dict]]) -> dict[str, tuple[str, str]]:
    """``{attack: (other, why)}`` for each planned attack whose runs are another planned attack's
    (:meth:`~gradleak.attacks.base.AttackBase.same_run_as`), checked here rather than trusted: the run configs equal
    but for the attack's name, the validated attack parameters equal, the same full-strength variants. The audit runs
    ``other`` once and judges both on it."""
    by = {e["name"]: (cand, cfg) for e, cand, cfg, _ in planned}
    out: dict[str, tuple[str, str]] = {}
    for e, cand, cfg, A in planned:
        same = A.same_run_as(cfg)
        if same is None or same[0] == e["name"] or same[0] not in by or same[0] in out:
            continue
        other, why = same
        ocand, ocfg = by[other]
        if ({**cand, "attack": {**cand["attack"], "name": other}} == ocand
                and cfg.attack_cfg.model_dump(mode="json") == ocfg.attack_cfg.model_dump(mode="json")
                and variants[e["name"]] == variants[other]):
            out[e["name"]] = (other, why)
    return out


def _remove_stale_audit(out: Path, keep: set[str] | frozenset[str] = frozenset()) -> None:
    """A reused ``--out``: remove the previous audit's own files (audit.json, the report, and the run artifacts under
    ``attacks/<attack>/[seed<k>/][variant<k>/]``, emptied folders too), never anything else. ``keep``: the folders
    (relative to ``out``, e.g. ``attacks/dlg/variant1``) of finished runs this audit reuses (:func:`_reusable_runs`):
    their own artifacts stay; the folders below them are cleaned as usual."""
    import re

    from gradleak.run.runner import RUN_ARTIFACTS, remove_stale_artifacts

    remove_stale_artifacts(out, re.compile(r"^(audit\.json|report\.html|report_data\.json)$"))
    root = out / "attacks"
    if not root.is_dir() or root.is_symlink():
        return
    names = set(attack_names())
    level = re.compile(r"^(seed-?\d+|variant\d+)$")

    def clean(d: Path) -> None:
        if d.relative_to(out).as_posix() not in keep:
            remove_stale_artifacts(d, RUN_ARTIFACTS)
        for sub in d.iterdir():
            if sub.is_dir() and not sub.is_symlink() and level.match(sub.name):
                clean(sub)
        with contextlib.suppress(OSError):
            d.rmdir()  # only if empty

    for d in root.iterdir():
        if d.is_dir() and not d.is_symlink() and d.name in names:
            clean(d)
    with contextlib.suppress(OSError):
        root.rmdir()


#: the ledger of the audit's finished runs (attack x seed x variant), under ``--out``: the JSONL of the one
#: resumable cell loop (:func:`gradleak.run.cells.run_cells`), one row per run, written atomically as the run ends
RUN_LEDGER = "attacks/runs.jsonl"


def run_key(cand: dict, device: str | None, where: str) -> str:
    """The key of one attack run: a hash of its full run config (the attack's candidate config with its seed and
    variant), the device, its folder under ``--out``, gradleak's version and the digest of its code
    (:func:`gradleak.code_digest`). A rerun reuses a finished run only under the same key: any change to the run's
    config, or to the code that measured it, reruns it."""
    from gradleak import __version__, code_digest

    return config_hash({"run": cand, "device": device, "out": where, "gradleak": __version__, "code": code_digest()})


def _reusable_runs(out: Path, runs: dict[str, str]) -> dict[str, dict]:
    """The ledger's rows (``cell`` = run id, see :func:`run_audit`) this audit reuses: finished (no ``error``), one of
    this audit's ``runs`` (cell id -> folder relative to ``out``), and with their folder's ``results.json`` in place
    (a run refused once the data are known has none, and needs none). The ledger is rewritten (atomically) with
    those rows alone: the rows of another config hold another run's metrics and sentences, stale like its files."""
    from gradleak.run.results import latest_by_cell, write_jsonl_atomic

    path = out / RUN_LEDGER
    if not path.is_file() or path.is_symlink():
        return {}
    keep = {c: r for c, r in latest_by_cell(path).items()
            if c in runs and "error" not in r and r.get("out") == runs[c]
            and ("bad_input" in (r.get("result") or {}) or (out / runs[c] / "results.json").is_file())}
    if keep:
        write_jsonl_atomic(path, keep.values())
    else:
        path.unlink()
    return keep


def _upgrade(raw: dict, name: str) -> dict | None:
    """The smallest threat upgrade (server capabilities only) the attack needs, or None if it needs more."""
    from gradleak.registry import ATTACKS

    A = ATTACKS.get(name)
    try:
        need = dict(A.requires())
    except Exception:  # noqa: BLE001 -- an attack whose requirements depend on its config: no upgrade
        return None
    threat = dict(raw.get("threat") or {})
    if need.get("malicious"):
        threat["preset"] = "malicious"
    elif need.get("prescribes_architecture") and threat.get("preset", "honest-but-curious") == "honest-but-curious":
        threat["preset"] = "prescribes-architecture"
    if need.get("public_data"):
        threat["public_data"] = True
    return threat if threat != dict(raw.get("threat") or {}) else None


def headline_metric(kind: str) -> str | None:
    """The headline metric of a reconstruction kind (its evaluation unit's; its null sits beside it)."""
    from gradleak.evaluation import EVALUATORS

    return EVALUATORS.get(kind).headline if kind in EVALUATORS else None


#: the judgement keys a per-client row carries (the one entry shape of ``audit.json``, CLI and framework audits)
ROW_KEYS = ("level", "success", "value", "null_p99", "p_value", "n_success", "n_total", "decided_by")


def client_row(client: Any, judgement: dict, warnings: list | None = None) -> dict:
    """One client's row of an attack's ``per_client`` list: its label and its judgement (the keys of
    :data:`ROW_KEYS`), with the attack's warnings for that client."""
    row = {"client": client}
    row.update({k: judgement.get(k) for k in ROW_KEYS})
    if judgement.get("sample"):  # the counts the client's measurement rests on (membership: members vs non-members)
        row["sample"] = judgement["sample"]
    row["warnings"] = list(warnings or [])
    return row


def judge(kind: str, metrics: dict, cfg) -> dict:
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
    if kind in EVALUATORS:
        out.update(EVALUATORS.get(kind).audit_fields(m))
        # the metric whose test decided the level, with *its* null and p-value (the headline may not have decided:
        # a word-bag `partial` rests on word-bag recall, not ROUGE-1 F1); the banner and the rows show it
        key = EVALUATORS.get(kind).decided_by(m, g["level"]) or head
        if key:
            bar_value = (g["evidence"] or {}).get(f"{key}_bar")
            out["decided_by"] = {"metric": key, "value": m.get(key), "null_p99": m.get(f"{key}_null_p99"),
                                 "p_value": m.get(f"{key}_p_value"),
                                 **({"bar": bar_value} if bar_value is not None and bar_value == bar_value else {})}
    return out


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


def config_hash(raw: dict) -> str:
    return hashlib.sha256(json.dumps(raw, sort_keys=True, default=str).encode()).hexdigest()[:16]


def gate_attack(raw: dict, name: str):
    """The pipeline's gate on one attack of the audit (module docstring): ``(entry, plan, err)`` -- the audit entry
    (applicable, under which threat, or the refusal as ``reason``), ``(entry, cand, cfg, A)`` when it can run under the
    configured threat or its smallest server upgrade (else None), and the gate's refusal when it cannot run (under the
    configured threat, or under the upgrade it needs; else None). An attack the gate accepts but whose
    :meth:`~gradleak.attacks.base.AttackBase.measurable` says this architecture uploads nothing it reads (DAGER on a
    frozen backbone) is not applicable, with the attack's reason, and is not planned. Validation only: nothing runs."""
    from gradleak.registry import ATTACKS
    from gradleak.run.runner import validate

    A = ATTACKS.get(name)
    summary = next((x.summary for x in ATTACKS if x.name == name), "")
    entry: dict[str, Any] = {"name": name, "description": summary, "reconstruction": A.reconstruction,
                             "modality": A.modality, "applicable": False}
    cand, threat_used = candidate(raw, name), "configured"
    try:
        _, cfg = validate(cand)
    except BadInput as err:
        up = _upgrade(raw, name) if err.field.startswith("threat") else None
        if up is None:
            entry["reason"] = str(err)
            return entry, None, err
        try:
            cand = candidate(raw, name, up)
            _, cfg = validate(cand)
            threat_used = "upgraded"
            entry["upgrade"] = up
        except BadInput as err2:
            entry["reason"] = str(err2)
            return entry, None, err2
    if not A.measurable(cfg):  # decided from the model and its PEFT before anything runs (DAGER, frozen backbone)
        entry["reason"] = f"not applicable to this architecture: {A.not_measurable_reason(cfg)}"
        entry["not_measurable"] = True
        return entry, None, None
    entry.update({"applicable": threat_used == "configured", "applicable_under": threat_used,
                  "threat": cfg.threat_model.capability, "threat_words": server_words(cfg.threat_model)})
    if threat_used == "upgraded":
        entry["reason"] = f"needs a stronger server than configured: run as {entry['threat_words']}"
    return entry, (entry, cand, cfg, A), None


def runtime_setup_error(planned: list, results: dict[str, dict], shared: dict, seeds: list[int],
                        variants: dict[str, list[dict]]) -> BadInput:
    """The error of an audit whose every planned attack was refused once its data and model were known (a split
    larger than the data, a CSV column that is not there, LoRA targets the model does not have): the refusal they
    share, as the run raised it; else each attack's refusal on its own line (:func:`refused_attacks`)."""
    refusals = []
    for e, _, _, _ in planned:
        src = shared[e["name"]][0] if e["name"] in shared else e["name"]
        res = next((results.get(f"{src}@{sd}#{k}") or {} for sd in seeds for k in range(len(variants[e["name"]]))
                    if "bad_input" in (results.get(f"{src}@{sd}#{k}") or {})), {})
        refusals.append((e["name"], refusal(res), res.get("bad_input") or e.get("reason") or "refused"))
    if len({str(err) if err is not None else why for _, err, why in refusals}) == 1:
        name, err, why = refusals[0]
        return err if err is not None else BadInput("audit", f"{name}: {why}")
    return refused_attacks(refusals)


def refusal(res: dict) -> BadInput | None:
    """The BadInput a refused run raised, rebuilt from its result: ``bad_input_parts`` (field, problem, fix), else
    its text ``"<field>: <problem> Fix: <fix>"`` (a ledger row of an older audit); None for a run not refused."""
    parts = res.get("bad_input_parts")
    if isinstance(parts, list) and len(parts) == 3:
        return BadInput(*(str(x) for x in parts))
    text = res.get("bad_input")
    if not isinstance(text, str) or ": " not in text:
        return None
    field, rest = text.split(": ", 1)
    problem, _, fix = rest.partition(" Fix: ")
    return BadInput(field, problem, fix)


def _discard_failed_audit(out: Path, created: bool) -> None:
    """Nothing of an audit refused once its runs started stays in ``--out``: the ledger, the run folders (gradleak's
    own files only, :func:`_remove_stale_audit`), the DP check's folder, and ``--out`` itself when this audit made
    it and it is empty."""
    from gradleak.run.runner import RUN_ARTIFACTS, remove_stale_artifacts

    ledger = out / RUN_LEDGER
    if ledger.is_file() and not ledger.is_symlink():
        ledger.unlink()
    _remove_stale_audit(out)
    dp = out / "dp_check"
    if dp.is_dir() and not dp.is_symlink():
        remove_stale_artifacts(dp, RUN_ARTIFACTS)
        with contextlib.suppress(OSError):
            dp.rmdir()
    if created:
        with contextlib.suppress(OSError):
            out.rmdir()


def left_out_split(raw: dict, names: list[str]) -> dict:
    """The attacks ``--only`` left out (every registered attack not in ``names``), each checked by the gate
    (:func:`gate_attack`, validation only: none is run): ``applicable`` -- it would run here, under the configured
    threat or its server upgrade (``[{name, applicable_under, threat_words}]``) -- and ``not_applicable`` -- the gate
    refuses it in this setup anyway (``[{name, modality, reason}]``)."""
    out: dict[str, list[dict]] = {"applicable": [], "not_applicable": []}
    for name in attack_names():
        if name in names:
            continue
        entry, plan, _ = gate_attack(raw, name)
        if plan is not None:
            out["applicable"].append({"name": name, "applicable_under": entry["applicable_under"],
                                      "threat_words": entry["threat_words"]})
        else:
            out["not_applicable"].append({"name": name, "modality": entry["modality"], "reason": entry["reason"]})
    return out


def plan_audit(raw: dict, overrides: list[str] | None = None, only: list[str] | None = None):
    """Validate an audit before anything runs or is written: the config (+ ``overrides``), ``--only``, each attack
    under the configured threat or its smallest upgrade, ``audit.seeds``. Returns ``(raw, names, entries, planned,
    seeds, base_err)`` (``base_err``: None -- a plan with no attack to run raises the setup's error instead,
    :func:`setup_error`)."""
    raw = audit_overrides(copy.deepcopy(raw), overrides or [])
    names = attack_names()
    if only:
        bad = sorted(set(only) - set(names))
        if bad:
            raise BadInput("--only", f"unknown attack(s) {', '.join(bad)}.", f"choose from {', '.join(names)}.")
        names = [n for n in names if n in only]
    # the setup itself must be valid: each attack through the gate; with none to run, the setup's own error
    entries, planned, errors = [], [], {}
    for name in names:
        entry, plan, err = gate_attack(raw, name)
        if err is not None:
            errors[name] = err
        if plan is not None:
            planned.append(plan)
        entries.append(entry)
    base_err = setup_error(raw, entries, errors) if not planned else None
    # run the applicable attacks (x the audit's seeds): in this process (workers=1) or a spawned pool
    seeds = list(((raw.get("audit") or {}).get("seeds")) or [raw.get("seed", 0)])
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in seeds):
        raise BadInput("audit.seeds", f"must be a list of integers, got {seeds!r}.", "write e.g. audit: {seeds: [0, 1, 2]}.")
    if not planned:  # nothing to run: refused before the output folder is made
        raise base_err
    return raw, names, entries, planned, seeds, base_err


def _fits(raw: dict, A) -> bool | None:
    """Whether attack ``A`` is meant for this setup's modality and PEFT kind (read from the raw config over its
    preset's defaults); None when the config does not say (an unknown experiment)."""
    from gradleak.config.schema import with_defaults
    from gradleak.peft import PeftConfig
    from gradleak.registry import EXPERIMENTS

    try:
        full = with_defaults({k: v for k, v in raw.items() if k != "audit"})
        modality = EXPERIMENTS.get(full["experiment"])["modality"]
        kind = (full.get("peft") or {}).get("kind", PeftConfig.model_fields["kind"].default)
    except (BadInput, KeyError, TypeError, AttributeError):
        return None
    return A.modality == modality and kind in A.peft_kinds


def setup_error(raw: dict, entries: list[dict], errors: dict[str, BadInput]) -> BadInput:
    """The error to report when no attack can run (docs/ARCHITECTURE.md, "gradleak audit"): the one that concerns the
    user's setup. The attacks meant for this modality and PEFT kind are asked first: when they all give the same
    refusal (a data, model, defense or PEFT error: it comes before anything attack-specific), that error alone;
    otherwise each of them with its reason. Attacks for another modality or PEFT kind only explain themselves when
    nothing else does (``--only april`` on text)."""
    from gradleak.registry import ATTACKS

    meant = [e for e in entries if _fits(raw, ATTACKS.get(e["name"]))] or entries
    refusals = [(e["name"], errors.get(e["name"]), e.get("reason", "")) for e in meant]
    distinct = {str(err) if err is not None else why for _, err, why in refusals}
    if len(distinct) == 1:
        name, err, why = refusals[0]
        return err if err is not None else BadInput("--only" if len(entries) < len(attack_names()) else "attack",
                                                    f"{name}: {why}", "audit a setup some attack applies to "
                                                    "(gradleak list shows where each attack applies).")
    return refused_attacks(refusals)


def refused_attacks(refusals: list[tuple[str, BadInput | None, str]]) -> BadInput:
    """One error listing each refused attack with its reason (``(attack, error, reason)``), one line each."""
    lines = "".join(f"\n  {name}: {str(err) if err is not None else why}" for name, err, why in refusals)
    return BadInput("audit", f"no attack can run on this setup; each was refused:{lines}\n",
                    "change what each line names (or leave that attack out with --only).")


def run_audit(raw: dict, out_dir: str | Path, overrides: list[str] | None = None, device: str | None = None,
              only: list[str] | None = None, command: str = "", log: Callable[[str], Any] = print,
              workers: int = 1) -> dict:
    """Run the audit of ``raw`` (+ ``overrides``) into ``out_dir``: ``audit.json`` + ``report.html``.
    ``workers`` > 1 runs the applicable attacks in a spawned process pool (one torch thread each)."""
    from gradleak.run.runner import check_out_dir, protect_private_artifacts, validate

    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise BadInput("--workers", f"must be a whole number >= 1, got {workers!r}.",
                       "use --workers 1 (in this process) or more (parallel attacks).")
    raw, names, entries, planned, seeds, base_err = plan_audit(raw, overrides, only)
    multi = len(seeds) > 1
    t_all = time.perf_counter()
    created = not Path(out_dir).exists()
    out = check_out_dir(out_dir)  # validated first, then created (stale files: removed once the runs are known)

    def where(name, sd):
        return f"attacks/{name}" + (f"/seed{sd}" if multi else "")

    defenses = list(raw.get("defenses") or [])
    variants: dict[str, list[dict]] = {}
    for e, cand, cfg, A in planned:
        vs = full_strength_variants(A, cand, cfg, defenses)
        user = {k: v for k, v in cand["attack"].items() if k != "name"}
        if user:  # what the user set runs as set (the first run); said, so a variant's headline is not a surprise
            e["parameters_set"] = user
            log(f"[audit] {e['name']}: runs with {', '.join(f'{k}={v}' for k, v in user.items())} as set"
                + (f", and {len(vs) - 1} full-strength variant(s) ({', '.join(sorted({k for v in vs for k in v}))}); "
                   "the most leaking run is the evidence" if len(vs) > 1 else ""))
        variants[e["name"]] = vs
        e["variants"] = vs

    def vdir(name, sd, k):
        return where(name, sd) + (f"/variant{k}" if k else "")

    shared = shared_runs(planned, variants)  # e.g. APRIL without a PE term to read: DLG's run, run once
    for name, (other, why) in shared.items():
        log(f"[audit] {name}: judged on {other}'s run (the same run: {why.split(': ', 1)[-1]})")
    jobs = [(f"{e['name']}@{sd}#{k}", {**cand, "attack": {**cand["attack"], **v}, "seed": sd},
             str(out / vdir(e["name"], sd, k)), device)
            for e, cand, _, _ in planned if e["name"] not in shared
            for sd in seeds for k, v in enumerate(variants[e["name"]])]
    for e, _, cfg, _ in planned:
        log(f"[audit] {e['name']}: running under the {e['applicable_under']} threat ({e['threat_words']})"
            + (f", seeds {seeds}" if multi else ""))
    dp_job = dp_check_job(raw, planned, out, device)
    if dp_job is not None:  # first: the longest jobs start early in a worker pool
        jobs.insert(0, dp_job)
        log("[audit] dp_check: the declared DP mechanism's claim is checked (canary clients; gradleak.run.dp_check)")
    results = _run_jobs(out, jobs, workers, log)
    for entry, cand, cfg, A in planned:
        name = entry["name"]
        src = shared[name][0] if name in shared else name  # whose runs these are
        runs = [(sd, k, results[f"{src}@{sd}#{k}"]) for sd in seeds for k in range(len(variants[name]))]
        entry["seconds"] = 0.0 if name in shared else sum(r.get("seconds", 0.0) for _, _, r in runs)
        if name in shared:
            entry["shared_run"] = {"attack": src, "why": shared[name][1]}
        ok_runs = [(sd, k, r) for sd, k, r in runs if "metrics" in r]
        if record_failures(entry, [r for _, _, r in runs], A.reconstruction, log):
            continue
        judged = []  # (seed, variant, result, client, judgement) for every client of every run
        warned: dict = {}  # (seed, variant, client) -> the warnings of that client's attack in that run
        summed = cfg.fl.clients if not cfg.threat_model.individual_updates else 1
        for sd, k, r in ok_runs:
            per = (r.get("details") or {}).get("per_client")
            sets = client_metric_sets(A.reconstruction, r["metrics"], per)
            for i, (client, mets) in enumerate(sets):
                warned[(sd, k, sum_label(client, summed, A.reconstruction))] = client_warnings(r, per, i, len(sets))
                judged.append((sd, k, r, sum_label(client, summed, A.reconstruction), judge(A.reconstruction, mets, cfg)))
        sd, k, res, client, j = max(judged, key=lambda t: leak_rank(t[4]))  # the most leaking client/run is the evidence
        entry["out"] = vdir(src, sd, k)
        entry.update(j)
        entry["worst_client"] = client
        if len(variants[name]) > 1:
            entry["worst_variant"] = variants[name][k] or "as configured"
        run0 = [t for t in judged if t[0] == sd and t[1] == k]
        entry["per_client"] = [client_row(t[3], t[4], warned.get((t[0], t[1], t[3]), [])) for t in run0]  # one shape
        by_run: dict = {}
        for t in judged:
            if leak_rank(t[4]) > leak_rank(by_run.get((t[0], t[1]), {"level": "undefined"})):
                by_run[(t[0], t[1])] = t[4]
        if len(variants[name]) > 1:
            entry["per_variant"] = [{"variant": variants[name][kk] or "as configured", "seed": s0,
                                     "level": jj["level"], "value": jj.get("value")}
                                    for (s0, kk), jj in sorted(by_run.items(), key=lambda t: (t[0][0], t[0][1]))]
        vals = [jj.get("value") for (s0, kk), jj in by_run.items() if kk == 0
                and isinstance(jj.get("value"), (int, float)) and jj["value"] == jj["value"]]
        if multi:
            entry["per_seed"] = [{"seed": s0, "success": jj["success"], "level": jj["level"], "value": jj.get("value"),
                                  "n_success": jj.get("n_success")} for (s0, kk), jj in sorted(by_run.items()) if kk == 0]
            entry["worst_seed"] = sd
            if vals:
                srt = sorted(vals)
                entry["median"] = srt[len(srt) // 2] if len(srt) % 2 else 0.5 * (srt[len(srt) // 2 - 1] + srt[len(srt) // 2])
                entry["spread"] = [srt[0], srt[-1]]
        if entry["level"] == "undefined":
            entry["undefined"] = True
            missing = ""
            if A.reconstruction == "membership" and not (res["metrics"].get("nonmembers") or 0):
                missing = " -- no non-member candidates: set data.nonmembers (e.g. 100)"
            entry["reason"] = (f"undefined: {entry['rule']}{missing}; the run measured nothing, so it is not evidence "
                               "either way")
        entry["metrics"] = {kk: v for kk, v in res["metrics"].items() if isinstance(v, (int, float))}
        margin = leakage_margin(entry["metrics"])
        if margin:  # how far the defense is from drowning the signal the attack read (per attacked layer)
            entry["leakage_margin"] = margin
        entry["artifacts"] = [a for a in res.get("artifacts", []) if str(a).endswith(".png")]
        entry["evidence_rows"] = _evidence_rows(res)
        # every warning stays with the run (seed, setting) and the client it came from; the evidence carries only its
        # own: another client's or another setting's caveat (e.g. "a least-squares guess") must not sit on it
        entry["run_warnings"] = [{"seed": s0, "variant": variants[name][kk] or "as configured", "client": c0,
                                  "warning": str(w)} for (s0, kk, c0), ws in warned.items() for w in ws]
        warns = (warned.get((sd, k, client)) or []) + ([shared[name][1]] if name in shared else [])
        if warns:
            entry["warnings"] = [str(w) for w in warns]
            entry["reason"] = "; ".join(([entry["reason"]] if entry.get("reason") else []) + entry["warnings"][:2])
        from gradleak.run.audit_report import attack_line

        log(f"[audit] {attack_line(entry, seeds if multi else None)}")
        for w in dict.fromkeys(entry.get("warnings") or []):  # e.g. lora_span's under-determined setting: said
            log(f"[audit] {name}: WARNING: {w}")
    ran = [e for e in entries if "level" in e]
    if not ran:  # every planned run was refused once its data and model were known: the setup's error, exit 2
        err = runtime_setup_error(planned, results, shared, seeds, variants)
        _discard_failed_audit(out, created)
        raise err
    # --only: the left-out attacks checked by the gate (validated, not run), so the banner and not_tested say which of
    # them could have run here and the ones that never could are grouped apart
    left_out = left_out_split(raw, names) if only else {"applicable": [], "not_applicable": []}
    verdict, headline = verdict_and_headline(entries, [x["name"] for x in left_out["applicable"]])
    shown_cand = next((c for e, c, _, _ in planned if e in ran), planned[0][1] if planned else None)
    _, shown = validate(shown_cand if shown_cand is not None else candidate(raw, names[0]))
    result = {"verdict": verdict, "headline": headline, "attacks": entries, **report_context(raw, shown, command),
              "seconds": time.perf_counter() - t_all,
              "not_tested": [f"{x['name']}: applicable (under {x['threat_words']}), not run: left out by --only"
                             for x in left_out["applicable"]],
              "not_applicable": [f"{e['name']}: {e['reason']}" for e in entries if "level" not in e]
                                + [f"{x['name']}: {x['reason']}" for x in left_out["not_applicable"]],
              "undefined": [f"{e['name']}: {e['reason']}" for e in entries if e.get("level") == "undefined"],
              "only": list(only) if only else None,
              "left_out_by_only": [n for n in attack_names() if n not in names] if only else [],
              "left_out": left_out}
    from gradleak.run.evidence import evidence_record  # config, weights, split seeds and source hashes (never raises)

    result["evidence_record"] = evidence_record(raw, shown, [c for _, _, c, _ in planned], seeds, command)
    dp = dp_check_entry(results.get(DP_JOB) if dp_job is not None else None)
    if dp is not None:
        result["dp_check"] = dp
        log(f"[audit] dp_check: {dp['verdict'].upper()} -- {dp['sentence']}")
    from gradleak.run.results import write_json_atomic

    write_json_atomic(out / "audit.json", result)
    write_audit_report(result, out)
    protect_private_artifacts(out)
    return result


def report_context(raw: dict, cfg, command: str) -> dict:
    """What ``audit.json`` holds beside its attacks for the report (:func:`gradleak.run.audit_report.write_audit_report`)
    and ``gradleak report``: the levels' rules and null, the setup and the configured threat in words, the config and
    its hash, the command, the seed, the versions, the modality and the defenses the setup accepts. ``cfg``: one
    validated config of the audit (the setup). One home for ``gradleak audit`` and the framework round audits
    (:mod:`gradleak.run.round_audit`, docs/DESIGN.md §7)."""
    from gradleak.run.results import environment

    return {"levels": {"psnr_db": cfg.metrics.psnr_threshold_db, "rules": LEVEL_RULES,
                       "null": f"{cfg.metrics.null_draws} seeded draws of public samples of the data's own source, "
                               "matched as the reconstruction; beyond the null = above its 99th percentile"},
            "setup": describe_setup(cfg), "threat": cfg.threat_model.describe(), "config": raw,
            "config_hash": config_hash(raw), "command": command, "seed": cfg.seed, "environment": environment(),
            "modality": cfg.modality, "defenses_available": applicable_defenses(cfg)}


#: the job id of the DP check in the audit's cell loop (beside the attack runs; gradleak.run.dp_check)
DP_JOB = "dp_check"
_DP_KEY = "_dp_check"


def dp_check_job(raw: dict, planned: list, out: Path, device: str | None) -> tuple | None:
    """The DP check's job for :func:`_run_jobs` when the audited federation declares a DP mechanism and
    ``audit.dp_check`` is not false: the first planned run's config (its federation: model, data, clients, engine,
    rounds, defenses; the attack is not used) marked with the check's options. It runs in the same resumable cell loop
    as the attacks (in parallel with them under ``--workers``), so a rerun into the same ``--out`` reuses it."""
    from gradleak.run.dp_check import declares_dp, dp_section

    opts = dp_section((raw.get("audit") or {}).get("dp_check"))
    if opts is None or not planned or not declares_dp(planned[0][2]):
        return None
    return (DP_JOB, {**planned[0][1], _DP_KEY: opts}, str(out / "dp_check"), device)


def _run_dp_check(cand: dict, out_dir: str, device: str | None) -> dict:
    """The DP check of a marked run config (in this process or a worker), also written to ``out_dir/results.json``
    (what the ledger's reuse looks for); a crash comes back as ``error``."""
    t0 = time.perf_counter()
    try:
        from gradleak.run import dp_check as dpc
        from gradleak.run.runner import validate

        cand = dict(cand)
        opts = cand.pop(_DP_KEY)
        _, cfg = validate(cand)
        res = dpc.dp_check(cfg, device, canaries=opts["canaries"])
        from gradleak.run.results import write_json_atomic

        Path(out_dir).mkdir(parents=True, exist_ok=True)
        write_json_atomic(Path(out_dir) / "results.json", {"dp_check": res})
    except Exception as err:  # noqa: BLE001 -- a crashed check (or a BadInput) is undefined, never a pass
        return {"error": f"{type(err).__name__}: {err}", "seconds": time.perf_counter() - t0}
    return {"dp_check": res, "seconds": time.perf_counter() - t0}


def dp_check_entry(res: dict | None) -> dict | None:
    """``audit.json``'s ``dp_check`` from the job's result: the check, or ``undefined`` with the error."""
    if res is None:
        return None
    if res.get("dp_check") is not None:
        return res["dp_check"]
    return {"verdict": "undefined", "sentence": f"the DP check could not run: {res.get('error', 'no result')}"}


def run_audit_grid(raw: dict, out_dir: str | Path, overrides: list[str] | None = None, device: str | None = None,
                   only: list[str] | None = None, command: str = "", log: Callable[[str], Any] = print,
                   workers: int = 1, yes: bool = False) -> dict:
    """An audit per cell of the config's ``grid:`` (e.g. defense strengths) into ``OUT/cells/<cell>/``, one row per
    cell in ``OUT/audit_grid.jsonl`` through the one cell loop (:func:`gradleak.run.cells.run_cells`:
    resumable, a finished cell is not redone, a failed one is retried); ``OUT/audit_grid.json`` lists each cell's
    verdict. A setup the audit refuses (``BadInput``) stops the grid; a cell that still fails after its retry is
    raised once the others are done."""
    from gradleak.run.cells import Cell, cell_dir_name, error_text, run_cells
    from gradleak.run.results import write_json_atomic
    from gradleak.run.runner import check_out_dir
    from gradleak.run.sweep import MAX_CELLS, cell_config, expand_grid

    base, cells = expand_grid(raw)
    if len(cells) > MAX_CELLS and not yes:
        raise BadInput("grid", f"{len(cells)} cells exceed the limit of {MAX_CELLS} for one audit grid.",
                       "shrink the grid, or pass --yes.")
    for _, a in cells:  # every cell must plan (validate) before the folder is made or any cell runs
        plan_audit(cell_config(base, a), overrides, only)
    out = check_out_dir(out_dir)
    jobs = []
    for i, (cid, a) in enumerate(cells):
        d = out / "cells" / cell_dir_name(cid)
        jobs.append(Cell(cid, _audit_cell, (cell_config(base, a), d, overrides, device, only, command, log, workers,
                                            f"[audit grid] cell {i + 1}/{len(cells)}: {cid}"),
                         {"cell": cid, "assign": a, "out": str(d.relative_to(out))}))

    def row(cell, res, err, seconds):
        r = {"cell": cell.id, "assign": cell.info["assign"]}
        if err is not None:
            return {**r, "error": error_text(err), "out": cell.info["out"]}
        return {**r, "verdict": res["verdict"], "headline": res["headline"], "out": cell.info["out"]}

    latest = run_cells(jobs, out / "audit_grid.jsonl", row, fatal=(BadInput,), label="audit grid",
                       describe=lambda r: r["verdict"], log=log)
    rows = list(latest.values())
    summary = {"cells": rows, "command": command}
    write_json_atomic(out / "audit_grid.json", summary)
    failed = [r for r in rows if "error" in r]
    if failed:
        raise RuntimeError(f"{len(failed)} audit grid cell(s) failed (rerun to retry): "
                           + "; ".join(f"{r['cell']}: {r['error']}" for r in failed))
    return summary


def _audit_cell(raw: dict, out_dir: Path, overrides, device, only, command, log, workers, announce: str) -> dict:
    """One audit grid cell (in this process): its audit into ``out_dir``."""
    log(announce)
    return run_audit(raw, out_dir, overrides, device, only=only, command=command, log=log, workers=workers)


def _run_one(name: str, cand: dict, out_dir: str, device: str | None) -> dict:
    """One attack's run (in this process or a worker); errors come back as values (they must cross processes).
    The DP check's job (:data:`DP_JOB`) runs :func:`_run_dp_check` instead."""
    if name == DP_JOB:
        return _run_dp_check(cand, out_dir, device)
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():  # imports too: a dependency's kernel registration warns when first loaded
            warnings.filterwarnings("ignore", message=KERNEL_OVERRIDE_WARNING)
            from gradleak.run import runner

            res = runner.run_config(cand, out_dir, device=device)
    except BadInput as err:
        return {"bad_input": str(err), "bad_input_parts": [err.field, err.problem, err.fix],
                "seconds": time.perf_counter() - t0}
    except Exception as err:  # noqa: BLE001
        return {"error": f"{type(err).__name__}: {err}", "seconds": time.perf_counter() - t0}
    return {"metrics": res.get("metrics", {}), "artifacts": res.get("artifacts", []),
            "details": {"warnings": (res.get("details") or {}).get("warnings", []),
                        "trials": (res.get("details") or {}).get("trials", []),
                        "per_client": (res.get("details") or {}).get("per_client", [])},
            "seconds": time.perf_counter() - t0}


def _run_jobs(out: Path, jobs: list[tuple], workers: int, log: Callable[[str], Any] = print) -> dict[str, dict]:
    """``{job: result}`` of every ``(job, run config, folder, device)`` of the audit, through the one resumable cell
    loop (:func:`gradleak.run.cells.run_cells`; docs/ARCHITECTURE.md, ``run/``): each run is a cell whose id is
    ``<job>/<run key>`` (:func:`run_key`: a hash of the run's full config), and each finished run's row goes to the
    ledger ``OUT/attacks/runs.jsonl`` (atomically) as it ends. A killed audit rerun into the same ``--out`` with the
    same config reruns no finished run (its row and its folder are reused, and the log names them); a run whose
    config changed gets a new key and reruns; the previous audit's other files are removed
    (:func:`_remove_stale_audit`). A run that failed is recorded (level undefined) and run again on the next audit.
    Runs go one after another in this process, or to a pool of ``workers`` spawned processes (one torch thread each)
    when > 1."""
    import uuid

    from gradleak.run.cells import Cell, error_text, run_cells

    folders = {f"{job}/{run_key(cand, dev, Path(d).relative_to(out).as_posix())}": Path(d).relative_to(out).as_posix()
               for job, cand, d, dev in jobs}
    cells = [Cell(cid, _run_one, job, {"job": job[0], "out": rel})
             for job, (cid, rel) in zip(jobs, folders.items())]
    reused = _reusable_runs(out, folders)
    _remove_stale_audit(out, keep={folders[c] for c in reused})
    if reused:
        log(f"[audit] reused {len(reused)} finished run(s) of this config from {RUN_LEDGER} (not rerun): "
            + ", ".join(r["job"] for r in reused.values()))

    def row(cell, res, err, seconds):
        res = {"error": error_text(err), "seconds": seconds} if err is not None else res  # the worker itself died
        r = {"cell": cell.id, "job": cell.info["job"], "out": cell.info["out"], "run_id": uuid.uuid4().hex,
             "result": res}
        if "error" in res:  # not done: run again by the next audit
            r["error"] = res["error"]
        return r

    todo = len(cells) - len(reused)
    latest = run_cells(cells, out / RUN_LEDGER, row, executor="inline" if workers <= 1 or todo <= 1 else "local",
                       workers=workers, retries=0, label="audit",
                       describe=lambda r: (f"refused -- {r['result']['bad_input']} --" if "bad_input" in r["result"]
                                           else "finished"), log=log)
    return {r["job"]: r["result"] for r in latest.values()}


def sum_label(client, summed: int, kind: str):
    """The attacked "client" as what it is: under secure aggregation over ``summed`` > 1 clients the server saw only
    the sum of their updates, so the evidence is credited to ``the sum of N clients``, not to client 0 (the leakage
    kind keeps its labels: its scores are per client's own images)."""
    if summed <= 1 or kind == "leakage":
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


def _evidence_rows(res: dict) -> list[dict]:
    rows = []
    for t in (res.get("details") or {}).get("trials", []) or []:
        for ref, rec in zip(t.get("references", []), t.get("reconstructions", [])):
            rows.append({"reference": ref, "reconstruction": rec})
    return rows[:16]


LEVEL_RULES = {
    "images": "exact: an image at PSNR >= the threshold / strong: best-image SSIM beyond the null and >= 0.5 / "
              "partial: best-image PSNR beyond the null (and the mean public, grey and best flat image)",
    "patches": "exact: patches recovered at PSNR >= the threshold / strong, partial: as images",
    "token_sequences": "exact: a sentence word for word / strong: ROUGE-2 F1 beyond the null (and the word bag in "
                       "random order) and >= 50 / partial: word-bag recall (or ROUGE-1 F1) beyond the null",
    "membership": "strong: TPR at 1 % FPR >= 0.1 and beyond the null, graded only with >= 100 non-members (fewer "
                  "cannot resolve a 1 % FPR) / partial: |AUC - 0.5| beyond the null, or with fewer non-members the "
                  "TPR at FPR 0 >= 0.1 and beyond the null",
    "leakage": "exact: a reconstruction at PSNR >= the threshold / strong: SSIM beyond the null and >= 0.5 / "
               "partial: RDLV beyond the null (rdlv_excess > 0)",
}



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


def describe_setup(cfg) -> list[str]:
    """The configuration in plain words (who trains what, who sees what)."""
    lines = [f"model: {cfg.model.name}; PEFT: {cfg.peft.kind}; data: {cfg.data.name}, batch size {cfg.data.batch_size}",
             f"federated: {cfg.fl.algorithm}, {cfg.fl.clients} client(s), {cfg.fl.rounds} round(s)"
             + (f", {cfg.fl.local_epochs} local epoch(s)" if cfg.fl.algorithm == "fedavg" else ""),
             "secure aggregation: " + (("on, over one client -- the sum of one update is that update: the server "
                                        "sees it" if cfg.fl.clients <= 1 else "on -- the server sees only the sum of "
                                        "the updates") if getattr(cfg.fl, "secure_aggregation", False)
                                       else "off -- the server sees every client's update")]
    from gradleak.fl.engines import engine_of

    engine_line = engine_of(cfg.fl.engine).describe(cfg.fl)  # how the engine runs, what the server sees
    if engine_line:
        lines.append(engine_line)
    from gradleak.defenses.base import defense_class

    for d in cfg.defenses:
        p = d.params
        cls = defense_class(d.name)
        lines.append(f"defense {d.name} {json.dumps(p)}" + (cls.describe(p) if cls is not None else ""))
    # the training-time `defense:` section (DP-SGD, FISGuard, ...): declared as much as the update list is
    section = getattr(cfg, "defense", None)
    tname = getattr(section, "name", "none") or "none"
    if tname != "none":
        params = {k: v for k, v in section.model_dump(mode="json").items() if k != "name"}
        lines.append(f"training defense {tname} {json.dumps(params)} (the `defense:` section: it changes each "
                     "client's local training)")
    from gradleak.defenses.declared import declared_defenses

    declared = declared_defenses(cfg).names  # the one resolution the attacks' tuning reads too
    lines.append("declared defenses: " + (", ".join(declared) if declared else "none"))
    return lines


def audit_command(config: str | Path, out: str | Path, sets: list[str] | None = None, only: str | None = None,
                  device: str | None = None, workers: int | None = None) -> str:
    """The ``gradleak audit`` command line of a run, every argument shell-quoted (copy-pasteable: ``--set`` values
    with braces, brackets or spaces survive a shell)."""
    args = ["gradleak", "audit", str(config), "--out", str(out)]
    for x in sets or []:
        args += ["--set", x]
    if only:
        args += ["--only", only]
    if device:
        args += ["--device", device]
    if workers is not None:
        args += ["--workers", str(workers)]
    return " ".join(shlex.quote(a) for a in args)


def applicable_defenses(cfg) -> list[dict]:
    """The registered defenses this setup accepts (its modality, the defense's own ``check_experiment``), each with
    its stage and one-line summary: facts for "what to do next", not advice (nothing here is ranked)."""
    from gradleak.registry import DEFENSES, load_all

    load_all()
    out = []
    for e in DEFENSES:
        cls = e.obj
        if e.name == "none" or cfg.modality not in getattr(cls, "modalities", ("image", "text")):
            continue
        try:
            cls.check_experiment(cls.__new__(cls), cfg)  # the hook reads the experiment only
        except BadInput:
            continue
        except Exception:  # noqa: BLE001 -- a hook that needs the built defense: its modality gate decided
            pass
        out.append({"name": e.name, "stage": cls.stage, "summary": e.summary})
    return out
