"""gradleak.atomic: the one atomic write (a temporary file in the folder, then one rename)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from gradleak.atomic import atomic_path, write_text_atomic


def test_a_finished_write_replaces_the_file_with_the_mode_asked(tmp_path):
    p = tmp_path / "sub" / "f.md"
    write_text_atomic(p, "one")
    write_text_atomic(p, "two", mode=0o644)
    assert p.read_text() == "two" and (os.stat(p).st_mode & 0o777) == 0o644
    assert sorted(x.name for x in p.parent.iterdir()) == ["f.md"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    p = tmp_path / "f.bin"
    write_text_atomic(p, "old")
    with pytest.raises(RuntimeError):
        with atomic_path(p) as tmp:
            with open(tmp, "w") as f:
                f.write("half")
            raise RuntimeError("killed half-way")
    assert p.read_text() == "old" and sorted(x.name for x in tmp_path.iterdir()) == ["f.bin"]


# ------------------------------------------------------------------------------------- every writer, one primitive

def test_the_handle_and_bytes_writers_replace_the_file_and_keep_it_owner_only(tmp_path):
    import stat

    from gradleak.atomic import atomic_open, write_bytes_atomic

    p = tmp_path / "f.bin"
    write_bytes_atomic(p, b"\x00\x01")
    assert p.read_bytes() == b"\x00\x01" and stat.S_IMODE(p.stat().st_mode) == 0o600
    with atomic_open(p, binary=True, mode=0o644) as f:
        f.write(b"two")
    assert p.read_bytes() == b"two" and stat.S_IMODE(p.stat().st_mode) == 0o644
    assert sorted(x.name for x in tmp_path.iterdir()) == ["f.bin"]


def test_an_exception_inside_each_writer_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    """Killed half-way (an exception after part of the content is written): the old file, byte for byte, and nothing
    else in the folder -- for the handle writer, the JSON writer (an object json cannot write, met after the first
    keys), the PNG writer and the folder writer."""
    import json

    from gradleak.atomic import atomic_dir, atomic_open
    from gradleak.report.images import save_png_atomically
    from gradleak.run.results import write_json_atomic

    p = tmp_path / "results.json"
    write_json_atomic(p, {"a": 1})
    old = p.read_bytes()
    assert old == json.dumps({"a": 1}, indent=2).encode()  # the bytes json.dump(indent=2) writes
    with pytest.raises(RuntimeError), atomic_open(p) as f:
        f.write('{"half": ')
        f.flush()
        raise RuntimeError("killed half-way")
    with pytest.raises(TypeError):
        write_json_atomic(p, {"b": list(range(5000)), "c": object()})
    png = tmp_path / "ground_truth.png"
    png.write_bytes(b"old png")

    def half(tmp):
        with open(tmp, "wb") as f:
            f.write(b"\x89PNG half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        save_png_atomically(png, half)
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("old")
    with pytest.raises(RuntimeError), atomic_dir(d) as tmp:
        (tmp / "config.json").write_text("new")
        raise RuntimeError("killed half-way")
    assert p.read_bytes() == old and png.read_bytes() == b"old png" and (d / "config.json").read_text() == "old"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["ground_truth.png", "model", "results.json"]
    assert sorted(x.name for x in d.iterdir()) == ["config.json"]


def test_a_finished_folder_takes_the_place_of_the_old_one(tmp_path):
    from gradleak.atomic import atomic_dir

    d = tmp_path / "cache" / "model"
    for text in ("one", "two"):
        with atomic_dir(d) as tmp:
            (tmp / "config.json").write_text(text)
            (tmp / text).write_text(text)
    assert sorted(x.name for x in d.iterdir()) == ["config.json", "two"] and (d / "config.json").read_text() == "two"
    assert sorted(x.name for x in d.parent.iterdir()) == ["model"]


def test_a_jsonl_rewrite_writes_the_lines_append_jsonl_writes(tmp_path):
    from gradleak.run.results import append_jsonl, write_jsonl_atomic

    rows = [{"cell": "a", "x": 1.5}, {"cell": "b", "y": [1, 2]}]
    for r in rows:
        append_jsonl(tmp_path / "appended.jsonl", r)
    write_jsonl_atomic(tmp_path / "rewritten.jsonl", rows)
    assert (tmp_path / "rewritten.jsonl").read_bytes() == (tmp_path / "appended.jsonl").read_bytes()


# The scan: every write of a file in src/gradleak goes through gradleak.atomic. A call below writes a file directly
# unless it writes the temporary that gradleak.atomic handed out (it names the ``as`` target of a
# ``with atomic_path/atomic_open/atomic_dir(...)`` it sits in, or a parameter of the callback given to
# save_png_atomically).
SRC = Path(__file__).resolve().parents[1] / "src" / "gradleak"
#: method or function names that always write a file (or a folder) given to them
WRITERS = {"write_text", "write_bytes", "savefig", "save", "savez", "savez_compressed", "savetxt", "save_pretrained",
           "save_file", "tofile", "to_csv", "to_parquet", "to_json", "dump", "imwrite", "imsave", "touch",
           # a hand-rolled atomic write: its own temporary file or rename
           "mkstemp", "NamedTemporaryFile", "replace", "rename", "renames", "move", "copy", "copyfile",
           "copy2", "copytree"}
#: receivers whose ``replace`` / ``rename`` / ``copy`` / ``move`` are about files (``str.replace`` is not)
FILE_MODULES = {"os", "shutil", "tempfile"}
OPENER_MODULES = {"os", "io", "codecs", "gzip", "bz2", "lzma", "tarfile", "zipfile"}  # X.open(path, mode)
GUARDS = {"atomic_path", "atomic_open", "atomic_dir"}
CALLBACK_WRITERS = {"save_png_atomically"}  # write(tmp): the callback writes the temporary it is handed
#: writes that must not be atomic, each with its reason: (file relative to src/gradleak, function, call name).
#: Keep it short; a stale entry fails too.
ALLOWED: set[tuple[str, str, str]] = set()  # none: every file gradleak writes goes through gradleak.atomic


def _name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _receiver(func: ast.expr) -> str:
    return func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""


def _opens_for_writing(call: ast.Call) -> bool:
    """``open(path, mode)`` / ``Path.open(mode)`` / ``os.fdopen(fd, mode)`` with a mode that writes (or one that cannot
    be read off the source), ``os.open`` with a flag that writes."""
    name, recv = _name(call.func), _receiver(call.func)
    if name == "open" and recv == "os":
        flags = {n.attr for n in ast.walk(call) if isinstance(n, ast.Attribute)}
        return bool(flags & {"O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND", "O_TRUNC"})
    if name not in ("open", "fdopen") or recv == "Image":  # PIL's Image.open only reads
        return False
    # open(path, mode), os.fdopen(fd, mode), gzip.open(path, mode)...; a Path's p.open(mode)
    pos = 1 if isinstance(call.func, ast.Name) or recv in OPENER_MODULES else 0
    mode = next((k.value for k in call.keywords if k.arg == "mode"), call.args[pos] if len(call.args) > pos else None)
    if mode is None:
        return False  # "r"
    if not (isinstance(mode, ast.Constant) and isinstance(mode.value, str)):
        return True
    return any(c in mode.value for c in "wax+")


def _is_write(call: ast.Call) -> bool:
    name, recv = _name(call.func), _receiver(call.func)
    if name in ("open", "fdopen"):
        return _opens_for_writing(call)
    if name in ("replace", "rename", "renames", "move", "copy", "copyfile", "copy2", "copytree", "mkstemp",
                "NamedTemporaryFile"):
        # a Path's p.rename(q) too; p.replace(q) cannot be told from str.replace on the source: not scanned
        return recv in FILE_MODULES or name == "rename" or isinstance(call.func, ast.Name) and name not in (
            "replace", "copy")
    if name in ("dump", "safe_dump"):  # json / pickle to a file, yaml to a stream (yaml.safe_dump(x) and a pydantic
        # model's .dump() return the content)
        return (recv in ("json", "pickle", "cloudpickle", "marshal") or len(call.args) > 1
                or any(k.arg in ("fp", "file", "stream") for k in call.keywords))
    return name in WRITERS


def direct_writes(tree: ast.AST) -> list[tuple[str, str, int]]:
    """``(function, call name, line)`` of every write in ``tree`` that does not go through gradleak.atomic."""
    found = []

    def names(node) -> set[str]:
        return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}

    def visit(node, func: str, temps: frozenset[str]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            func = node.name
        if isinstance(node, (ast.With, ast.AsyncWith)):
            bound = set(temps)
            for item in node.items:
                if (isinstance(item.context_expr, ast.Call) and _name(item.context_expr.func) in GUARDS
                        and isinstance(item.optional_vars, ast.Name)):
                    bound.add(item.optional_vars.id)
                elif names(item.context_expr) & bound and isinstance(item.optional_vars, ast.Name):
                    bound.add(item.optional_vars.id)  # with atomic_path(p) as tmp, open(tmp, "w") as f: f is a temp
            temps = frozenset(bound)
        if isinstance(node, ast.Call):
            if _name(node.func) in CALLBACK_WRITERS:
                for arg in node.args:
                    if isinstance(arg, ast.Lambda):
                        visit(arg.body, func, temps | {a.arg for a in arg.args.args})
                for child in [node.func, *[a for a in node.args if not isinstance(a, ast.Lambda)],
                              *[k.value for k in node.keywords]]:
                    visit(child, func, temps)
                return
            if _is_write(node) and not names(node) & temps:
                found.append((func, _name(node.func), node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, func, temps)

    visit(tree, "<module>", frozenset())
    return found


def test_the_scan_finds_a_direct_write_and_passes_a_write_of_the_temporary():
    src = '''
import json, os, shutil, torch
from pathlib import Path
def bad(p, fig, obj, img):
    Path(p).write_text("x")
    with open(p, "w") as f:
        json.dump(obj, f)
    fig.savefig(p)
    torch.save(obj, p)
    img.save(p, format="PNG")
    os.replace(p, p + ".old")
    shutil.move(p, p + ".old")
    with p.open("ab") as f:
        f.write(b"x")
    with gzip.open(p, "wt") as f:
        pass
    Path(p).rename(p + ".old")
def good(p, fig, obj):
    text = Path(p).read_text().replace("a", "b")
    with open(p) as f, open(p, "rb") as g, p.open() as h:
        pass
    s = yaml.safe_dump(obj)
    with atomic_path(p) as tmp:
        fig.savefig(tmp)
        torch.save(obj, tmp)
    with atomic_path(p) as tmp, open(tmp, "w") as f:
        json.dump(obj, f)
    with atomic_path(p) as tmp:
        with open(tmp, "wb") as f:
            pickle.dump(obj, f)
    with gzip.open(p) as f, Image.open(p) as im:
        pass
    with atomic_open(p) as f:
        json.dump(obj, f)
    with atomic_dir(p) as d:
        (d / "x.json").write_text("{}")
    save_png_atomically(p, lambda tmp: fig.savefig(tmp, format="png"))
'''
    found = direct_writes(ast.parse(src))
    assert {f for f, _, _ in found} == {"bad"}, found
    assert [n for _, n, _ in found] == ["write_text", "open", "dump", "savefig", "save", "save", "replace", "move",
                                        "open", "open", "rename"]


def test_every_file_write_in_src_goes_through_gradleak_atomic():
    """A new ``Path.write_text``, ``open(.., "w")``, ``json.dump``, ``savefig``, ``.save(``, ``torch.save``,
    ``np.save``, ``os.replace``... in src/gradleak outside gradleak/atomic.py fails here: route it through
    :mod:`gradleak.atomic` (docs/DESIGN.md §2: the one atomic file write), or, for a write that must not be atomic (a
    log stream), add it to ``ALLOWED`` with its reason."""
    seen, bad = set(), []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel == "atomic.py":
            continue
        for func, call, line in direct_writes(ast.parse(path.read_text(), filename=str(path))):
            if (rel, func, call) in ALLOWED:
                seen.add((rel, func, call))
            else:
                bad.append(f"{rel}:{line} {func}(): {call}")
    assert not bad, "direct file writes (use gradleak.atomic):\n" + "\n".join(bad)
    assert ALLOWED <= seen, f"stale ALLOWED entries: {sorted(ALLOWED - seen)}"
