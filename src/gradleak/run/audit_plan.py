"""The audit's planning (docs/ARCHITECTURE.md, "gradleak audit"; :mod:`gradleak.run.audit`): validation only, nothing
runs or is written.

Each registered attack's run config (:func:`candidate`: the setup, the attack's defaults, ``audit.params`` and every
client attacked), the audit's ``--set`` overrides (:func:`audit_overrides`), the pipeline's gate on each attack under
the configured threat or its smallest server upgrade (:func:`gate_attack`), the full-strength variants each attack
derives from the declared defenses (:func:`full_strength_variants`), the runs two attacks share (:func:`shared_runs`),
the attacks ``--only`` left out (:func:`left_out_split`), the plan (:func:`plan_audit`) and, when no attack can run,
the error that concerns the setup (:func:`setup_error`, :func:`runtime_setup_error`).
"""

from __future__ import annotations

import copy
from typing import Any

from gradleak.errors import BadInput
from gradleak.run.answer import server_words


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
