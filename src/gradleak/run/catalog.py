"""What ``gradleak list`` prints, as data: every registry's entries with their modality and detail lines, and each
model's LoRA target names (docs/DESIGN.md §2: the registries are the one source).

Building it imports every registering module (torch, transformers: seconds), so ``gradleak list`` reads it from a cache,
``$GRADLEAK_CACHE/catalog-<digest>.json`` (default ``~/.cache/gradleak``), where ``<digest>`` is the sha256 of
every source file of the package (``gradleak.cli.source_digest``): an edited attack or defense is a new digest, so
the cache is never stale; a miss builds it here and writes it atomically. Reading it imports no torch (the cache
lives in ``cli.py``: importing ``gradleak.run`` loads the runner).
"""

from __future__ import annotations

from typing import Any

def _field_lines(cls) -> list[str]:
    """``name = default — description`` per field: a default_factory's value, ``(required)`` without a default."""
    lines = []
    for name, f in getattr(cls, "model_fields", {}).items():
        if f.is_required():
            default = "(required)"
        else:
            v = f.get_default(call_default_factory=True)
            default = "null" if v is None else v
        desc = f" — {f.description}" if f.description else ""
        lines.append(f"{name} = {default}{desc}")
    return lines


def _entry(name: str, summary: str, modality: str | None = None, tag: str = "", details: list[str] | None = None,
           bold: bool = False) -> dict[str, Any]:
    return {"name": name, "summary": summary, "modality": modality, "tag": tag, "details": details or [],
            "bold": bold}


def build_catalog() -> dict[str, Any]:
    """Every registry as data (the slow path: imports every registering module)."""
    from gradleak.data import dataset_modality
    from gradleak.evaluation import EVALUATORS
    from gradleak.models import MODELS
    from gradleak.peft import KIND_FIELDS, PEFT_KINDS
    from gradleak.registry import ATTACKS, DATASETS, DEFENSES, EXPERIMENTS, METRICS, load_all

    load_all()
    sections: list[dict[str, Any]] = []

    def section(key: str, title: str, entries: list[dict[str, Any]], note: str = "") -> None:
        sections.append({"key": key, "title": title, "entries": entries, "note": note})

    section("experiments", "experiments",
            [_entry(e.name, e.summary, e.obj.get("modality")) for e in EXPERIMENTS])
    section("models", "models", [_entry(e.name, e.summary, getattr(e.obj, "modality", None),
                                        tag=getattr(e.obj, "modality", "")) for e in MODELS],
            note="(text experiments also take a local HF model directory as model.name)")
    section("peft", "peft kinds (peft.kind)",
            [_entry(e.name, e.summary, details=["parameters: " + ", ".join(f"peft.{f}" for f in sorted(KIND_FIELDS[e.name]))])
             for e in PEFT_KINDS])
    attacks = []
    for e in ATTACKS:
        c = e.obj
        req = [k for k, v in c.requires().items() if v] or ["nothing beyond honest-but-curious"]
        attacks.append(_entry(e.name, e.summary, c.modality, bold=True, details=[
            f"applies to: {c.modality} data, peft.kind {' | '.join(c.peft_kinds)}; returns {c.reconstruction}; "
            f"devices {', '.join(c.devices)}",
            f"threat requires: {', '.join(req)}"] + [f"attack.{fl}" for fl in _field_lines(c.Config)]))
    section("attacks", "attacks (attack.name)", attacks)
    for stage, key, title, prefix in (
            ("update", "update_defenses", "update defenses (defenses: [{name, params}])", "params."),
            ("training", "training_defenses", "training defenses (defense: {name, <parameters>})", "defense.")):
        entries = []
        for e in DEFENSES:
            if e.obj.stage != stage:
                continue
            aliases = DEFENSES.aliases(e.name)
            mods = tuple(getattr(e.obj, "modalities", ()) or ())
            entries.append(_entry(e.name, e.summary + (f" (also: {', '.join(aliases)})" if aliases else ""),
                                  mods[0] if len(mods) == 1 else None,
                                  details=[f"{prefix}{fl}" for fl in _field_lines(e.obj.Config)]))
        section(key, title, entries)
    section("datasets", "datasets", [_entry(e.name, e.summary, dataset_modality(e.name)) for e in DATASETS])
    section("evaluators", "evaluators", [_entry(e.name, e.summary) for e in EVALUATORS])
    section("metrics", "metrics", [_entry(e.name, e.summary) for e in METRICS])
    return {"sections": sections}


def lora_targets(name: str) -> dict[str, Any]:
    """``{"linear": [...], "default": [...]}``: the model's linear module names (what ``peft.lora_targets`` may name)
    and the default targets it has, read from its architecture without weights
    (:func:`gradleak.models.linear_module_names`)."""
    from gradleak.models import linear_module_names

    names, default = linear_module_names(name)
    return {"linear": names, "default": [t for t in default if t in names]}
