"""The audit's runs on disk (:mod:`gradleak.run.audit`; docs/ARCHITECTURE.md, ``run/``): each run's folder under
``--out`` (``attacks/<attack>/[seed<k>/][variant<k>/]``, :func:`run_folder`), its key in the resumable cell loop
(:func:`run_key`: a hash of its full config and code), the ledger of finished runs (:data:`RUN_LEDGER`) and which of
them a rerun reuses (:func:`reusable_runs`), and the removal of a previous or refused audit's own files
(:func:`remove_stale_audit`, :func:`discard_failed_audit`) -- never anything else under ``--out``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

from gradleak.run.audit_plan import attack_names


#: the ledger of the audit's finished runs (attack x seed x variant), under ``--out``: the JSONL of the one
#: resumable cell loop (:func:`gradleak.run.cells.run_cells`), one row per run, written atomically as the run ends
RUN_LEDGER = "attacks/runs.jsonl"


def config_hash(raw: dict) -> str:
    return hashlib.sha256(json.dumps(raw, sort_keys=True, default=str).encode()).hexdigest()[:16]


def run_key(cand: dict, device: str | None, where: str) -> str:
    """The key of one attack run: a hash of its full run config (the attack's candidate config with its seed and
    variant), the device, its folder under ``--out``, gradleak's version and the digest of its code
    (:func:`gradleak.code_digest`). A rerun reuses a finished run only under the same key: any change to the run's
    config, or to the code that measured it, reruns it."""
    from gradleak import __version__, code_digest

    return config_hash({"run": cand, "device": device, "out": where, "gradleak": __version__, "code": code_digest()})


def reusable_runs(out: Path, runs: dict[str, str]) -> dict[str, dict]:
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


def remove_stale_audit(out: Path, keep: set[str] | frozenset[str] = frozenset()) -> None:
    """A reused ``--out``: remove the previous audit's own files (audit.json, the report, and the run artifacts under
    ``attacks/<attack>/[seed<k>/][variant<k>/]``, emptied folders too), never anything else. ``keep``: the folders
    (relative to ``out``, e.g. ``attacks/dlg/variant1``) of finished runs this audit reuses (:func:`reusable_runs`):
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


def discard_failed_audit(out: Path, created: bool) -> None:
    """Nothing of an audit refused once its runs started stays in ``--out``: the ledger, the run folders (gradleak's
    own files only, :func:`remove_stale_audit`), the DP check's folder, and ``--out`` itself when this audit made
    it and it is empty."""
    from gradleak.run.runner import RUN_ARTIFACTS, remove_stale_artifacts

    ledger = out / RUN_LEDGER
    if ledger.is_file() and not ledger.is_symlink():
        ledger.unlink()
    remove_stale_audit(out)
    dp = out / "dp_check"
    if dp.is_dir() and not dp.is_symlink():
        remove_stale_artifacts(dp, RUN_ARTIFACTS)
        with contextlib.suppress(OSError):
            dp.rmdir()
    if created:
        with contextlib.suppress(OSError):
            out.rmdir()


def run_folder(name: str, seed: int, variant: int, multi: bool) -> str:
    """The folder (relative to ``--out``) of one run of attack ``name``: ``attacks/<name>``, with ``/seed<seed>`` when
    the audit runs several seeds and ``/variant<variant>`` for a full-strength variant (not the configured run, 0)."""
    return f"attacks/{name}" + (f"/seed{seed}" if multi else "") + (f"/variant{variant}" if variant else "")
