"""The house rules of docs/DESIGN.md §2, checked on the source.

An AST walk over ``src/gradleak`` collects every import of ours — at module level *and* inside functions (a lazy
import is still a dependency) — and fails on

1. an import cycle between modules (strongly connected components of the module graph);
2. a ``_private`` name taken from another package;
3. an import against the allowed direction: ``ALLOWED`` below is the explicit table of package edges.

``ALLOWLIST`` names today's violations one by one. It may only shrink: a listed violation that no longer exists fails
too, so whoever fixes one deletes its line.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "gradleak"

# Foundation every package may import.
BASE = {"", "errors", "registry", "validation", "atomic", "accounting"}
# package -> the packages it may import (besides itself and BASE). Dependencies point down the pipeline.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "atomic": set(),  # the one atomic file write (temporary file + rename)
    "accounting": set(),  # closed-form DP accounting (math only): defenses, engines and the DP check claim with it
    "registry": set(),
    "validation": set(),  # the base of every user-facing pydantic model (finite numbers, no booleans for numbers)
    "": set(),  # gradleak/__init__.py
    "metrics": set(),
    "data": set(),
    "models": {"data"},
    "peft": {"models"},
    "fl": set(),
    "defenses": {"fl", "peft", "models", "data", "metrics"},
    "attacks": {"fl", "peft", "models", "data", "metrics", "defenses"},
    "evaluation": {"metrics", "data", "models", "report"},
    "report": set(),
    # a modality plug-in: its data class, encoding, truth, public interface, accuracy (docs/DESIGN.md §7)
    "modalities": {"data", "fl", "models", "metrics"},
    "config": {"modalities", "fl", "peft", "models", "data", "defenses", "attacks", "evaluation", "metrics"},
    "run": {"config", "modalities", "fl", "peft", "models", "data", "defenses", "attacks", "evaluation", "metrics", "report"},
    "integrations": {"config", "run", "modalities", "fl", "peft", "models", "data", "defenses", "attacks",
                     "evaluation", "metrics", "report"},
    "cli": {"config", "run", "integrations", "modalities", "fl", "peft", "models", "data", "defenses", "attacks",
            "evaluation", "metrics", "report"},
}

# Today's violations, by name. Delete a line when its violation is gone (a stale line fails the test).
ALLOWLIST: set[str] = set()  # empty: every violation named on 2026-12-03 is fixed


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def _imports(modules: dict[str, Path]) -> list[tuple[str, str, str, int]]:
    """(importer, imported module, imported name or '', line) for every import of ours."""
    out = []
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "gradleak":
                        out.append((mod, alias.name, "", node.lineno))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    anchor = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                if base.split(".")[0] != "gradleak":
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub in modules:  # `from gradleak.x import y` with y a module
                        out.append((mod, sub, "", node.lineno))
                    else:
                        out.append((mod, base, alias.name, node.lineno))
    return out


def _package(mod: str) -> str:
    parts = mod.split(".")
    if len(parts) == 1:
        return ""
    return parts[1]


def _cycles(modules: dict[str, Path], imports) -> list[list[str]]:
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for src, dst, _name, _line in imports:
        if dst in modules and dst != src:
            graph[src].add(dst)
    # a module's own package __init__ is imported by Python anyway; an edge package -> its submodule plus
    # submodule -> package is still a cycle and is reported.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:  # Tarjan
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return comps


def _cycle_path(comp: list[str], modules, imports) -> str:
    """One readable cycle through a strongly connected component, starting at its first module."""
    members = set(comp)
    graph: dict[str, list[str]] = {m: [] for m in comp}
    for src, dst, _n, _l in imports:
        if src in members and dst in members and dst != src and dst not in graph[src]:
            graph[src].append(dst)
    start = comp[0]
    # BFS for the shortest path back to start
    prev: dict[str, str] = {}
    frontier = [start]
    seen = {start}
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    path = [w, v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return " -> ".join(reversed(path))
                if w not in seen:
                    seen.add(w)
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return " -> ".join(comp)


def violations() -> set[str]:
    modules = _modules()
    imports = _imports(modules)
    found: set[str] = set()
    for comp in _cycles(modules, imports):
        found.add(f"cycle: {_cycle_path(comp, modules, imports)}")
    for src, dst, name, _line in imports:
        sp, dp = _package(src), _package(dst)
        if name.startswith("_") and not name.startswith("__") and sp != dp:
            found.add(f"private: {src} -> {dst}.{name}")
        if sp != dp and dp not in BASE and dp not in ALLOWED.get(sp, set()):
            found.add(f"edge: {sp or 'gradleak'} -> {dp} ({src} -> {dst})")
    return found


def test_every_package_has_a_row():
    packages = {_package(m) for m in _modules()}
    assert packages <= set(ALLOWED), f"add a row to ALLOWED for {sorted(packages - set(ALLOWED))}"


def test_no_new_layering_violation():
    new = violations() - ALLOWLIST
    assert not new, "layering violations (DESIGN.md §2):\n" + "\n".join(sorted(new))


def test_allowlist_has_no_stale_entry():
    stale = ALLOWLIST - violations()
    assert not stale, "fixed — delete from ALLOWLIST:\n" + "\n".join(sorted(stale))


def test_the_walk_sees_lazy_imports_and_cycles(tmp_path, monkeypatch):
    """The checker itself: a function-level import closing a cycle, a private name and an upward edge are found."""
    pkg = tmp_path / "gradleak"
    (pkg / "metrics").mkdir(parents=True)
    (pkg / "attacks").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "metrics" / "__init__.py").write_text("")
    (pkg / "attacks" / "__init__.py").write_text("")
    (pkg / "attacks" / "a.py").write_text("from gradleak.metrics.m import _helper\n")
    (pkg / "metrics" / "m.py").write_text("def f():\n    from gradleak.attacks import a\n")
    monkeypatch.setitem(globals(), "SRC", pkg)
    found = violations()
    assert "cycle: gradleak.attacks.a -> gradleak.metrics.m -> gradleak.attacks.a" in found
    assert "private: gradleak.attacks.a -> gradleak.metrics.m._helper" in found
    assert "edge: metrics -> attacks (gradleak.metrics.m -> gradleak.attacks.a)" in found
