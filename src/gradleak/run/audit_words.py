"""The audit's words beside its attacks (:mod:`gradleak.run.audit`): the setup in plain words (:func:`describe_setup`),
the command line (:func:`audit_command`), the defenses the setup accepts (:func:`applicable_defenses`) and the
context ``audit.json`` carries for the report (:func:`report_context`: the levels' rules, asked of each evaluation unit,
and the null), one home for ``gradleak audit`` and the framework round audits (docs/DESIGN.md §7).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from gradleak.errors import BadInput
from gradleak.run.audit_ledger import config_hash


def report_context(raw: dict, cfg, command: str) -> dict:
    """What ``audit.json`` holds beside its attacks for the report (:func:`gradleak.run.audit_report.write_audit_report`)
    and ``gradleak report``: the levels' rules and null, the setup and the configured threat in words, the config and
    its hash, the command, the seed, the versions, the modality and the defenses the setup accepts. ``cfg``: one
    validated config of the audit (the setup). One home for ``gradleak audit`` and the framework round audits
    (:mod:`gradleak.run.round_audit`, docs/DESIGN.md §7)."""
    from gradleak.run.results import environment

    return {"levels": {"psnr_db": cfg.metrics.psnr_threshold_db, "rules": level_rules(),
                       "null": f"{cfg.metrics.null_draws} seeded draws of public samples of the data's own source, "
                               "matched as the reconstruction; beyond the null = above its 99th percentile"},
            "setup": describe_setup(cfg), "threat": cfg.threat_model.describe(), "config": raw,
            "config_hash": config_hash(raw), "command": command, "seed": cfg.seed, "environment": environment(),
            "modality": cfg.modality, "defenses_available": applicable_defenses(cfg)}


def level_rules() -> dict[str, str]:
    """The level rules in words of every reconstruction kind, each asked of its evaluation unit
    (:attr:`~gradleak.evaluation.base.EvaluationUnit.rules`; a kind registered later appears untouched)."""
    from gradleak.evaluation import EVALUATORS

    return {e.name: e.obj.rules for e in EVALUATORS}


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
    tname = getattr(section, "name", None)
    tcls = defense_class(tname) if tname else None
    if tcls is not None and tcls.protects:  # the no-defense entry protects nothing
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
        if not cls.protects or not cls.implemented_for(cfg.modality):
            continue
        try:
            cls.check_experiment(cls.__new__(cls), cfg)  # the hook reads the experiment only
        except BadInput:
            continue
        except Exception:  # noqa: BLE001 -- a hook that needs the built defense: its modality gate decided
            pass
        out.append({"name": e.name, "stage": cls.stage, "summary": e.summary})
    return out
