"""``run/`` asks the plug-ins instead of naming them (docs/ARCHITECTURE.md, "The tree"; docs/DESIGN.md §7): no
comparison in ``src/gradleak/run`` tests a value against a registered modality, reconstruction kind, PEFT kind or
defense name, so a new plug-in of any of them needs no edit to ``run/`` (the toy modality of
``tests/test_toy_modality.py`` is the worked case)."""

from __future__ import annotations

import ast
from pathlib import Path

RUN = Path(__file__).resolve().parents[1] / "src" / "gradleak" / "run"


def plugin_names() -> dict[str, set[str]]:
    from gradleak.evaluation.base import EVALUATORS
    from gradleak.modalities import MODALITIES
    from gradleak.peft import PEFT_KINDS
    from gradleak.registry import DEFENSES, load_all

    load_all()
    # "none" is also a level and the "no plug-in" value (peft.kind none, defense none): the no-defense entry is asked
    # through Defense.protects, and a level is no plug-in, so the scan leaves that one word out
    return {k: v - {"none"} for k, v in {"modality": set(MODALITIES.names()), "reconstruction kind": set(EVALUATORS.names()),
            "PEFT kind": set(PEFT_KINDS.names()), "defense": set(DEFENSES.names())}.items()}


def _strings(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for e in node.elts for s in _strings(e)]
    return []


def named_branches(source: str, names: dict[str, set[str]]) -> list[tuple[int, str, str]]:
    """``(line, registry, name)`` of every comparison (``==``, ``!=``, ``in``, ``not in``) with a registered name as
    a literal operand."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            for operand in [node.left, *node.comparators]:
                for s in _strings(operand):
                    out += [(node.lineno, reg, s) for reg, group in names.items() if s in group]
    return out


def test_run_names_no_modality_kind_or_defense():
    names = plugin_names()
    assert {"image", "text"} <= names["modality"] and "membership" in names["reconstruction kind"]
    assert "lora" in names["PEFT kind"] and "dpsgd" in names["defense"]  # the registries were read
    found = [(p.name, *hit) for p in sorted(RUN.glob("*.py")) for hit in named_branches(p.read_text(), names)]
    assert not found, f"run/ branches on a plug-in's name (ask the plug-in instead): {found}"


def test_the_scan_sees_a_named_branch():
    names = {"modality": {"image"}, "defense": {"dpsgd"}, "reconstruction kind": {"membership"}}
    src = ("if cfg.modality == 'image': pass\nif kind in ('membership', 'x'): pass\n"
           "if name != 'dpsgd': pass\nif level == 'none': pass\n")
    assert named_branches(src, names) == [(1, "modality", "image"), (2, "reconstruction kind", "membership"),
                                          (3, "defense", "dpsgd")]
