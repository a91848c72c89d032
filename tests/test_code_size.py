"""Split by role (docs/ARCHITECTURE.md, "The tree"): no source file over 800 lines, no function over 100 lines in
``src/gradleak``, so each module has one role a reader can hold. A function's length counts its docstring and its
nested functions (a nested function is also measured on its own)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "gradleak"
MAX_FILE, MAX_FUNCTION = 800, 100


def sizes(root: Path = SRC):
    """``(files over MAX_FILE, functions over MAX_FUNCTION)`` under ``root``, each as ``(lines, where)``."""
    files, functions = [], []
    paths = sorted(root.rglob("*.py"))
    assert paths, f"no Python source under {root}"
    for path in paths:
        text = path.read_text()
        rel = path.relative_to(root.parent)
        if len(text.splitlines()) > MAX_FILE:
            files.append((len(text.splitlines()), str(rel)))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION:
                    functions.append((n, f"{rel}:{node.lineno} {node.name}"))
    return files, functions


def test_no_source_file_over_800_lines():
    files, _ = sizes()
    assert not files, f"split these by role: {files}"


def test_no_function_over_100_lines():
    _, functions = sizes()
    assert not functions, f"extract named steps from: {functions}"


def test_the_measure_sees_a_long_file_and_a_long_function(tmp_path):
    pkg = tmp_path / "gradleak"
    pkg.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION))
    (pkg / "long.py").write_text(f"def f():\n{body}\n" + "\n" * MAX_FILE)
    (pkg / "short.py").write_text("def g():\n    return 1\n")
    files, functions = sizes(pkg)
    assert [w for _, w in files] == ["gradleak/long.py"]
    assert [w for _, w in functions] == ["gradleak/long.py:1 f"] and functions[0][0] == MAX_FUNCTION + 1
