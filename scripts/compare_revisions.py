#!/usr/bin/env python3
"""Compare the metrics of ``gradleak run`` / ``gradleak audit`` under two source trees (a refactor must
leave behaviour as it is: the shipped configs give the same metrics before and after the change).

Each cell runs once under each tree, one process at a time, as

    PYTHONPATH=<tree>/src OMP_NUM_THREADS=1 <python> -m gradleak.cli run CONFIG --out DIR --set ...

(``audit`` cells: ``... -m gradleak.cli audit CONFIG --out DIR --workers 1 ...``), in the tree's root as the working
directory (a side is a ``src/`` path, copied with its ``configs/`` into ``<work>/trees/`` first unless
``--no-snapshot``, or ``rev:<commit>``, extracted from the repository with git archive), with CONFIG taken from each
tree's own copy (the shipped configs; a config whose text differs between the trees is flagged). Then
``results.json``'s ``metrics`` (``audit.json``: the verdict and, per attack, its level,
value, null, worst client, per-client rows and numeric metrics) are compared key by key:

* keys must be the same: a key only *before* is a difference (``removed``); a key only *after* is reported as
  ``added`` (new by design is allowed) and fails only with ``--strict-added``;
* values must be equal: floats exactly (NaN == NaN), with the relative difference |a-b|/max(|a|,|b|) reported
  when they are not; strings after replacing the run directory and the tree root by placeholders;
* ``timings``, ``environment``, paths (``out``, ``artifacts``), wall-clock keys among the metrics (``*seconds``,
  ``*_to_fwdbwd_ratio``, ``*_time``; more with ``--ignore REGEX``) and the audit's ``command`` /
  ``config_hash`` are never compared; the audit's prose fields (``reason``, ``rule``, ``headline``, ``warnings``,
  ``note``) are reported as ``text`` differences but do not fail (``--strict-text`` makes them fail).

Prints a table (cell, keys compared, equal, differing keys with before / after) and writes a JSON summary
(``--summary``, default ``<work>/summary.json``). Exit status: 0 all shared metrics equal; 1 a shared metric differs,
a key was removed, a run failed under one tree only, or under both with different exit statuses (``fails_differ``,
e.g. an internal error that became a bad-input message); 2 the comparison could not be made (a tree does not import
its own ``gradleak``, or a cell failed under both trees alike: ``both_failed``).

``--reuse`` keeps a run whose directory holds a finished result made by the same command on a tree with the same
fingerprint (sha-256 of every file under ``<tree>/src/gradleak`` but ``__pycache__``) and the same config text;
re-running after a new refactor then re-runs only the side whose code changed (with ``--work`` kept).

    .venv/bin/python scripts/compare_revisions.py --before /work/wt-before/src --after src \\
        --work /tmp/compare_revisions --reuse
    .venv/bin/python scripts/compare_revisions.py --before rev:66451f3 --after rev:HEAD  # committed trees only
    .venv/bin/python scripts/compare_revisions.py --list [--extended]  # the cells
    .venv/bin/python scripts/compare_revisions.py --only utr,audit  # a subset (substring of the cell name)
    .venv/bin/python scripts/compare_revisions.py --cells cells.json   # [{"name":, "command": "run"|"audit",
                                                                       #   "config":, "set": [...], "args": [...]}]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# The quick cells (each a few minutes or less on 1 thread). `set` are `--set` overrides; `args` extra CLI args.
DEFAULT_CELLS: list[dict[str, Any]] = [
    {"name": "utr/minilm_rt", "command": "run", "config": "configs/utr/minilm_rt.yaml", "set": []},
    {"name": "peftleak/cifar_b32@B8", "command": "run", "config": "configs/peftleak/cifar_b32.yaml",
     "set": ["data.batch_size=8"]},
    {"name": "lora_vit/cifar_b1", "command": "run", "config": "configs/lora_vit/cifar_b1.yaml", "set": []},
    {"name": "peftleak/ig_baseline@steps20", "command": "run", "config": "configs/peftleak/ig_baseline.yaml",
     "set": ["attack.steps=20"]},
    {"name": "projres/minilm_adapter@small", "command": "run", "config": "configs/projres/minilm_adapter.yaml",
     "set": ["fl.clients=4", "fl.rounds=2", "data.nonmembers=8", "data.test_size=40"]},
    {"name": "leakage/fmnist_resnet18@small", "command": "run", "config": "configs/leakage/fmnist_resnet18.yaml",
     "set": ["fl.rounds=1", "attack.iterations=20", "attack.warmup=2"]},
    {"name": "audit/text_adapters", "command": "audit", "config": "configs/audit/text_adapters.yaml", "set": [],
     "args": ["--workers", "1"]},
    {"name": "audit/text_lora", "command": "audit", "config": "configs/audit/text_lora.yaml", "set": [],
     "args": ["--workers", "1"]},
]

# --extended adds these (about 17 min more on 1 thread): the code paths the refactor moved that the shipped configs
# do not reach: UTR at B = 8 and on SmolLM2 (utr.causal), DAGER and LAMP (continuous, and bag_only on UTR's word
# bag), PEFTLeak's paper design, the optimisation attacks (gradvit + GLR + anchor, april, dlg, ig with FedAvg local-step
# emulation, gias), every membership defense and the percentile_noise update defense with σ0 > 0.
EXTENDED_CELLS: list[dict[str, Any]] = [
    {"name": "utr/minilm_rt@B8", "command": "run", "config": "configs/utr/minilm_rt.yaml",
     "set": ["data.batch_size=8"]},
    {"name": "utr/minilm_rt@smollm2", "command": "run", "config": "configs/utr/minilm_rt.yaml",
     "set": ["model.name=smollm2"]},
    {"name": "text_adapters@dager", "command": "run", "config": "configs/audit/text_adapters.yaml",
     "set": ["attack.name=dager", "data.nonmembers=0"]},
    {"name": "text_adapters@lamp", "command": "run", "config": "configs/audit/text_adapters.yaml",
     "set": ["attack.name=lamp", "threat.knows_lengths=true", "threat.knows_labels=true", "attack.steps=20",
      "attack.lm=none", "attack.init_candidates=5", "attack.candidates=10", "data.nonmembers=0"]},
    {"name": "text_adapters@lamp_bag", "command": "run", "config": "configs/audit/text_adapters.yaml",
     "set": ["attack.name=lamp", "threat.knows_lengths=true", "threat.knows_labels=true", "attack.steps=20",
      "attack.lm=none", "attack.init_candidates=5", "attack.candidates=10", "attack.bag_only=true",
      "data.nonmembers=0"]},
    {"name": "peftleak/cifar_b32@B8_paper", "command": "run", "config": "configs/peftleak/cifar_b32.yaml",
     "set": ["data.batch_size=8", "attack.design=paper"]},
    {"name": "lora_vit/cifar_b1@gradvit", "command": "run", "config": "configs/lora_vit/cifar_b1.yaml",
     "set": ["attack.name=gradvit", "threat.public_data=true", "attack.steps=10", "attack.glr_every=5",
      "attack.anchor=true"]},
    {"name": "lora_vit/cifar_b1@april", "command": "run", "config": "configs/lora_vit/cifar_b1.yaml",
     "set": ["attack.name=april", "attack.steps=10"]},
    {"name": "lora_vit/cifar_b1@dlg", "command": "run", "config": "configs/lora_vit/cifar_b1.yaml",
     "set": ["attack.name=dlg", "attack.steps=10"]},
    {"name": "lora_vit/cifar_b1@ig_fedavg", "command": "run", "config": "configs/lora_vit/cifar_b1.yaml",
     "set": ["attack.name=ig", "attack.steps=5", "fl.algorithm=fedavg", "data.batch_size=4",
      "fl.local_batch_size=2", "attack.emulate=local_steps"]},
    {"name": "lora_vit/faces_b1@small", "command": "run", "config": "configs/lora_vit/faces_b1.yaml",
     "set": ["attack.latent_steps=10", "attack.generator_steps=10", "attack.glr_every=5"]},
    {"name": "projres/minilm_adapter@small_dpsgd", "command": "run", "config": "configs/projres/minilm_adapter.yaml",
     "set": ["fl.clients=4", "fl.rounds=2", "data.nonmembers=8", "data.test_size=40", "defense.name=dpsgd"]},
    {"name": "projres/minilm_adapter@small_fisguard", "command": "run", "config": "configs/projres/minilm_adapter.yaml",
     "set": ["fl.clients=4", "fl.rounds=2", "data.nonmembers=8", "data.test_size=40", "defense.name=fisguard",
      "defense.public_size=200"]},
    {"name": "projres/minilm_adapter@small_minmax", "command": "run", "config": "configs/projres/minilm_adapter.yaml",
     "set": ["fl.clients=4", "fl.rounds=2", "data.nonmembers=8", "data.test_size=40", "defense.name=minmax"]},
    {"name": "projres/minilm_adapter@small_l2", "command": "run", "config": "configs/projres/minilm_adapter.yaml",
     "set": ["fl.clients=4", "fl.rounds=2", "data.nonmembers=8", "data.test_size=40", "defense.name=l2"]},
    {"name": "projres/minilm_adapter@small_label_smoothing", "command": "run",
     "config": "configs/projres/minilm_adapter.yaml",
     "set": ["fl.clients=4", "fl.rounds=2", "data.nonmembers=8", "data.test_size=40",
      "defense.name=label_smoothing"]},
    {"name": "projres/minilm_adapter@small_dropout", "command": "run", "config": "configs/projres/minilm_adapter.yaml",
     "set": ["fl.clients=4", "fl.rounds=2", "data.nonmembers=8", "data.test_size=40", "defense.name=dropout"]},
    {"name": "leakage/fmnist_resnet18@small_sigma25", "command": "run",
     "config": "configs/leakage/fmnist_resnet18.yaml",
     "set": ["fl.rounds=1", "attack.iterations=20", "attack.warmup=2", "defense.sigma0=25"]},
]

RESULT_FILE = {"run": "results.json", "audit": "audit.json"}
# audit entry fields never compared (wall time, the run directory, the image paths)
AUDIT_SKIP = {"seconds", "out", "artifacts"}
AUDIT_TOP_SKIP = {"environment", "seconds", "command", "config_hash", "config"}
# wall-clock measurements that some attacks put among their metrics (lora_span: attack_seconds and
# attack_to_fwdbwd_ratio; the optimisation attacks: *_to_fwdbwd_ratio): never equal twice, never compared
IGNORE_DEFAULT = [r"(^|[._\]])[a-z_]*seconds$", r"_to_fwdbwd_ratio$", r"(^|\.)timings?(\.|$)", r"(^|\.)time_[a-z_]*$",
                  r"_time$"]
PROSE = {"reason", "rule", "headline", "warnings", "note", "not_tested", "not_applicable", "undefined", "setup", "threat",
         "levels"}


# ----------------------------------------------------------------------------------------------------- running

def tree_root(src: Path) -> Path:
    return src.resolve().parent


def fingerprint(src: Path) -> str:
    """sha-256 over the package's source files (relative path + bytes): equal trees, equal fingerprints."""
    h = hashlib.sha256()
    pkg = src / "gradleak"
    for p in sorted(pkg.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in {".pyc", ".pyo"}:
            h.update(str(p.relative_to(src)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def git_describe(root: Path) -> str:
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "src"], capture_output=True,
                               text=True, check=True).stdout.strip()
        return head + ("+dirty(src)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "?"


def child_env(src: Path, threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(src.resolve())
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    env["PYTHONHASHSEED"] = "0"
    env.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    return env


def materialise(spec: str, work: Path, repo: Path, snapshot: bool) -> tuple[Path, str, str]:
    """A side's ``src/`` to run: (src path, label for the report, git description).

    ``rev:<commit>`` extracts ``src/`` and ``configs/`` of that commit of ``repo`` (git archive) into
    WORK/trees/; a path is a tree's ``src/``, copied with its sibling ``configs/`` into WORK/trees/ when ``snapshot``
    (a tree that others edit while the cells run must not change under them: every cell sees the same code)."""
    import shutil
    import tarfile
    import io

    if spec.startswith("rev:"):
        rev = subprocess.run(["git", "-C", str(repo), "rev-parse", spec[4:]], capture_output=True, text=True,
                             check=True).stdout.strip()
        dest = work / "trees" / f"rev-{rev[:12]}"
        if not (dest / "src" / "gradleak").is_dir():
            if dest.exists():
                shutil.rmtree(dest)
            dest.mkdir(parents=True)
            blob = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", rev, "src", "configs"],
                                  capture_output=True, check=True).stdout
            with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
                tar.extractall(dest, filter="data")
        return dest / "src", f"{spec} ({rev[:12]})", rev[:12]
    src = Path(spec).resolve()
    desc = git_describe(tree_root(src))
    if not snapshot:
        return src, str(src), desc
    dest = work / "trees" / f"snap-{fingerprint(src)}"
    if not (dest / "src" / "gradleak").is_dir():
        tmp = work / "trees" / f".tmp-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        ign = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
        shutil.copytree(src / "gradleak", tmp / "src" / "gradleak", ignore=ign)
        if (tree_root(src) / "configs").is_dir():
            shutil.copytree(tree_root(src) / "configs", tmp / "configs", ignore=ign)
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    return dest / "src", f"{src} (snapshot {dest})", desc


def check_import(python: str, src: Path, threads: int) -> str | None:
    """The child must import gradleak from ``src`` (PYTHONPATH before the editable install): None, or the problem."""
    proc = subprocess.run([python, "-c", "import gradleak; print(gradleak.__file__)"], capture_output=True,
                          text=True, env=child_env(src, threads), cwd=str(tree_root(src)))
    if proc.returncode != 0:
        return f"cannot import gradleak under {src}: {proc.stderr.strip().splitlines()[-1:]}"
    got = Path(proc.stdout.strip()).resolve()
    if not str(got).startswith(str(src.resolve()) + os.sep):
        return f"PYTHONPATH={src} imports gradleak from {got}, not from the tree"
    return None


def run_cell(cell: dict, side: str, src: Path, work: Path, python: str, threads: int, timeout: float,
             reuse: bool, log) -> dict:
    root = tree_root(src)
    cfg = root / cell["config"]
    out = work / side / cell["name"].replace("/", "__")
    result_path = out / RESULT_FILE[cell["command"]]
    argv = ([python, "-m", "gradleak.cli", cell["command"], str(cfg), "--out", str(out)]
            + [x for s in cell.get("set", []) for x in ("--set", s)] + list(cell.get("args", [])))
    fp = fingerprint(src)
    meta = {"argv": argv[1:], "fingerprint": fp, "config_sha": _sha(cfg), "threads": threads}
    info = {"side": side, "tree": str(src), "fingerprint": fp, "out": str(out),
            "command": f"PYTHONPATH={src} OMP_NUM_THREADS={threads} " + " ".join(argv),
            "config_sha": meta["config_sha"]}
    meta_path = out / "compare_meta.json"
    if reuse and result_path.exists() and meta_path.exists():
        try:
            old = json.loads(meta_path.read_text())
        except ValueError:
            old = {}
        if {k: old.get(k) for k in meta} == meta and old.get("rc") == 0:
            log(f"  [{side}] {cell['name']}: reused {result_path} ({old.get('seconds', 0):.0f} s when run)")
            return {**info, "rc": 0, "seconds": old.get("seconds"), "reused": True, "result": _load(result_path)}
    if not cfg.exists():
        return {**info, "rc": None, "error": f"no config {cfg} in this tree", "seconds": 0.0}
    if out.exists():  # a fresh directory: never compare a stale result
        import shutil

        shutil.rmtree(out)
    out.mkdir(parents=True)
    log(f"  [{side}] {cell['name']}: {info['command']}")
    t0 = time.perf_counter()
    try:
        with open(out / "compare_stdout.txt", "w") as fo, open(out / "compare_stderr.txt", "w") as fe:
            proc = subprocess.run(argv, stdout=fo, stderr=fe, env=child_env(src, threads), cwd=str(root),
                                  timeout=timeout)
        rc = proc.returncode
        err = None
    except subprocess.TimeoutExpired:
        rc, err = None, f"timed out after {timeout:.0f} s"
    secs = time.perf_counter() - t0
    if rc != 0 and err is None:
        lines = (out / "compare_stderr.txt").read_text(errors="replace").strip().splitlines()
        # the last two lines that are neither a rich progress bar nor a traceback frame
        lines = [ln.strip() for ln in lines if ln.strip() and not any(ch in ln for ch in "━─│╭╮╰╯")]
        err = f"exit {rc}: " + " | ".join(lines[-2:])
    elif rc == 0 and not result_path.exists():
        rc, err = None, f"exit 0 but no {result_path.name}"
    meta_path.write_text(json.dumps({**meta, "rc": rc, "seconds": secs}, indent=2))
    log(f"  [{side}] {cell['name']}: {'ok' if rc == 0 else err} in {secs:.1f} s")
    res = {**info, "rc": rc, "seconds": secs, "reused": False}
    if rc == 0:
        res["result"] = _load(result_path)
    else:
        res["error"] = err
    return res


def _sha(p: Path) -> str | None:
    return hashlib.sha256(p.read_bytes()).hexdigest()[:16] if p.exists() else None


def _load(p: Path) -> Any:
    return json.loads(p.read_text())  # json accepts NaN / Infinity as written by write_json_atomic


# ----------------------------------------------------------------------------------------------------- comparing

def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out if out or not prefix else {prefix: {}}
    if isinstance(obj, list):
        out = {}
        for i, v in enumerate(obj):
            out.update(flatten(v, f"{prefix}[{i}]"))
        return out if out or not prefix else {prefix: []}
    return {prefix: obj}


def normalise(v: Any, subs: list[tuple[str, str]]) -> Any:
    if isinstance(v, str):
        for a, b in subs:
            v = v.replace(a, b)
    return v


def rel_diff(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b) or math.isinf(a) or math.isinf(b):
        return math.inf
    scale = max(abs(a), abs(b))
    return abs(a - b) / scale if scale else 0.0


def equal(a: Any, b: Any) -> tuple[bool, float | None]:
    """(equal?, relative difference when both are numbers and differ)."""
    num = (int, float)
    if isinstance(a, bool) or isinstance(b, bool):
        return (type(a) is type(b) and a == b), None
    if isinstance(a, num) and isinstance(b, num):
        if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
            return True, None
        if a == b:
            return True, None
        return False, rel_diff(float(a), float(b))
    return a == b, None


def compare_flat(before: dict[str, Any], after: dict[str, Any], prose: set[str] = frozenset(),
                 ignore: list[str] = ()) -> dict:
    import re

    pats = [re.compile(p) for p in ignore]
    skip = lambda k: any(p.search(k) for p in pats)
    ignored = sorted({k for k in [*before, *after] if skip(k)})
    before = {k: v for k, v in before.items() if not skip(k)}
    after = {k: v for k, v in after.items() if not skip(k)}
    shared = [k for k in before if k in after]
    diffs, text = [], []
    n_equal = 0
    for k in shared:
        ok, rd = equal(before[k], after[k])
        if ok:
            n_equal += 1
            continue
        row = {"key": k, "before": before[k], "after": after[k]}
        if rd is not None:
            row["rel_diff"] = rd
        leaf = k.split(".")[-1].split("[")[0]
        (text if leaf in prose or any(p in prose for p in _parts(k)) else diffs).append(row)
    return {"compared": len(shared), "equal": n_equal, "differ": diffs, "text": text,
            "removed": [k for k in before if k not in after], "added": [k for k in after if k not in before],
            "ignored": ignored}


def _parts(key: str) -> list[str]:
    return [p.split("[")[0] for p in key.split(".")]


def metrics_of_run(res: dict, subs) -> dict[str, Any]:
    return {k: normalise(v, subs) for k, v in flatten(res.get("metrics", {})).items()}


def metrics_of_audit(res: dict, subs) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for k, v in res.items():
        if k in AUDIT_TOP_SKIP or k == "attacks":
            continue
        flat.update(flatten({k: v}))
    for e in res.get("attacks", []):
        body = {k: v for k, v in e.items() if k not in AUDIT_SKIP and k != "name"}
        flat.update(flatten(body, f"attack[{e.get('name')}]"))
    return {k: normalise(v, subs) for k, v in flat.items()}


def compare_cell(cell: dict, b: dict, a: dict, strict_added: bool, strict_text: bool,
                 ignore: list[str] = tuple(IGNORE_DEFAULT)) -> dict:
    row: dict[str, Any] = {"cell": cell["name"], "command": cell["command"], "config": cell["config"],
                           "set": cell.get("set", []), "args": cell.get("args", []),
                           "before": {k: v for k, v in b.items() if k != "result"},
                           "after": {k: v for k, v in a.items() if k != "result"}}
    if b.get("config_sha") != a.get("config_sha"):
        row["config_differs"] = True
    if b["rc"] != 0 or a["rc"] != 0:
        if b["rc"] != 0 and a["rc"] != 0:  # the same failure is no behaviour change; another exit status is
            row["status"] = "both_failed" if b["rc"] == a["rc"] else "fails_differ"
        else:
            row["status"] = "run_failed"
        return row
    subs_b = [(b["out"], "<OUT>"), (str(Path(b["tree"]).resolve().parent), "<TREE>")]
    subs_a = [(a["out"], "<OUT>"), (str(Path(a["tree"]).resolve().parent), "<TREE>")]
    get = metrics_of_run if cell["command"] == "run" else metrics_of_audit
    prose = PROSE if cell["command"] == "audit" else set()
    cmp = compare_flat(get(b["result"], subs_b), get(a["result"], subs_a), prose, ignore)
    row.update(cmp)
    fail = bool(cmp["differ"] or cmp["removed"] or (strict_added and cmp["added"]) or (strict_text and cmp["text"]))
    row["status"] = "DIFFERS" if fail else "equal"
    return row


# ----------------------------------------------------------------------------------------------------- output

def fmt(v: Any) -> str:
    if isinstance(v, float):
        return repr(v)
    s = json.dumps(v) if not isinstance(v, str) else v
    return s if len(s) <= 60 else s[:57] + "..."


def print_table(rows: list[dict], out=sys.stdout) -> None:
    w = max([len(r["cell"]) for r in rows] + [4])
    hdr = f"{'cell':<{w}}  {'status':<12} {'keys':>5} {'equal':>5} {'new':>4} {'before s':>9} {'after s':>8}"
    print(hdr, file=out)
    print("-" * len(hdr), file=out)
    for r in rows:
        bs, as_ = r["before"].get("seconds"), r["after"].get("seconds")
        sec = lambda s, d: ("reused" if d.get("reused") else f"{s:.1f}") if isinstance(s, (int, float)) else "-"
        print(f"{r['cell']:<{w}}  {r['status']:<12} {r.get('compared', '-'):>5} {r.get('equal', '-'):>5} "
              f"{len(r.get('added', [])):>4} {sec(bs, r['before']):>9} {sec(as_, r['after']):>8}"
              + ("  (config text differs between trees)" if r.get("config_differs") else ""), file=out)
        for side in ("before", "after"):
            if r[side].get("rc") not in (0,):
                print(f"    {side} FAILED: {r[side].get('error')}", file=out)
        for d in r.get("differ", []):
            extra = f"  rel diff {d['rel_diff']:.3g}" if "rel_diff" in d else ""
            print(f"    DIFF  {d['key']}: before {fmt(d['before'])}  after {fmt(d['after'])}{extra}", file=out)
        for k in r.get("removed", []):
            print(f"    REMOVED  {k} (only before)", file=out)
        for d in r.get("text", []):
            print(f"    text  {d['key']}: before {fmt(d['before'])}  after {fmt(d['after'])}", file=out)
        if r.get("ignored"):
            print(f"    ignored (wall clock): {', '.join(r['ignored'][:8])}"
                  + (f" ... (+{len(r['ignored']) - 8})" if len(r["ignored"]) > 8 else ""), file=out)
        if r.get("added"):
            print(f"    added (only after): {', '.join(r['added'][:12])}"
                  + (f" ... (+{len(r['added']) - 12})" if len(r["added"]) > 12 else ""), file=out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--before", default="/work/wt-before/src", help="the 'before' tree's src/, or rev:<commit> of "
                    "--repo (default /work/wt-before/src)")
    ap.add_argument("--after", default=str(REPO / "src"), help="the 'after' tree's src/, or rev:<commit> "
                    "(default: this repo's src/)")
    ap.add_argument("--repo", type=Path, default=REPO, help="the git repository rev: sides come from")
    ap.add_argument("--no-snapshot", action="store_true", help="run a path side in place (default: copy its src/ "
                    "and configs/ into WORK/trees/ first, so edits made meanwhile do not reach half the cells)")
    ap.add_argument("--python", default=str(REPO / ".venv" / "bin" / "python"), help="the interpreter (a venv with "
                    "gradleak's dependencies; PYTHONPATH picks the tree)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/compare_revisions"), help="run directories: WORK/before/"
                    "<cell>, WORK/after/<cell>")
    ap.add_argument("--summary", type=Path, default=None, help="JSON summary (default WORK/summary.json)")
    ap.add_argument("--cells", type=Path, default=None, help="a JSON list of cells instead of the default ones")
    ap.add_argument("--extended", action="store_true", help="also the extended cells (about 17 min more)")
    ap.add_argument("--only", default=None, help="comma list: keep the cells whose name contains one of these")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run (default 1)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run before it is stopped (default 900)")
    ap.add_argument("--reuse", action="store_true",
                    help="reuse a finished run of the same command on an identical tree")
    ap.add_argument("--strict-added", action="store_true", help="a key only after fails too")
    ap.add_argument("--strict-text", action="store_true", help="an audit prose field that differs fails too")
    ap.add_argument("--ignore", action="append", default=[], metavar="REGEX", help="also skip the (flattened) "
                    "metric keys this regular expression finds (repeatable); wall-clock keys are always skipped")
    ap.add_argument("--list", action="store_true", help="print the cells and exit")
    args = ap.parse_args(argv)

    if args.cells:
        cells = json.loads(args.cells.read_text())
    else:
        cells = DEFAULT_CELLS + (EXTENDED_CELLS if args.extended else [])
    if args.only:
        keys = [k.strip() for k in args.only.split(",") if k.strip()]
        cells = [c for c in cells if any(k in c["name"] for k in keys)]
    if args.list:
        for c in cells:
            print(f"{c['name']}: " + " ".join(["gradleak", c["command"], c["config"],
                                               *[f"--set {s}" for s in c.get("set", [])], *c.get("args", [])]))
        return 0
    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    sides, labels = {}, {}
    for side, spec in (("before", args.before), ("after", args.after)):
        src, label, desc = materialise(spec, args.work, args.repo, not args.no_snapshot)
        sides[side] = src
        labels[side] = {"spec": spec, "label": label, "git": desc, "fingerprint": fingerprint(src), "src": str(src)}
        problem = check_import(args.python, src, args.threads)
        if problem:
            log(f"error: {side}: {problem}")
            return 2
        log(f"{side}: {label} (git {desc}, fingerprint {labels[side]['fingerprint']})")
    rows = []
    t_all = time.perf_counter()
    for cell in cells:
        log(f"cell {cell['name']}")
        runs = {side: run_cell(cell, side, src, args.work, args.python, args.threads, args.timeout, args.reuse, log)
                for side, src in sides.items()}
        rows.append(compare_cell(cell, runs["before"], runs["after"], args.strict_added, args.strict_text,
                                 IGNORE_DEFAULT + list(args.ignore)))
    print_table(rows)
    totals = {side: sum((r[side].get("seconds") or 0.0) for r in rows if not r[side].get("reused"))
              for side in sides}
    print(f"\nrun time (not counting reused runs): before {totals['before']:.0f} s, after {totals['after']:.0f} s; "
          f"wall {time.perf_counter() - t_all:.0f} s")
    status = 0
    if any(r["status"] in ("DIFFERS", "run_failed", "fails_differ") for r in rows):
        status = 1
    elif any(r["status"] == "both_failed" for r in rows):
        status = 2
    summary = {"before": labels["before"], "after": labels["after"],
               "command": " ".join([sys.executable, *sys.argv]), "threads": args.threads, "exit_status": status,
               "seconds": totals, "cells": rows}
    path = args.summary or (args.work / "summary.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2, default=str))
    print(f"summary: {path}; exit {status}")
    return status


if __name__ == "__main__":
    sys.exit(main())
