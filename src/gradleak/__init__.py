"""gradleak: measure private-data leakage in federated parameter-efficient fine-tuning."""

__version__ = "0.1.0"

_DIGEST: list[str] = []


def code_digest() -> str:
    """sha256 (20 hex digits) of the package's ``.py`` files, relative path and bytes: part of every resume key (an
    audit's attack runs, the advice's probes), so a rerun into the same ``--out`` after a code change measures again
    instead of reusing what other code measured. Computed once per process."""
    if not _DIGEST:
        import hashlib
        from pathlib import Path

        pkg = Path(__file__).resolve().parent
        h = hashlib.sha256()
        for p in sorted(pkg.rglob("*.py")):
            h.update(str(p.relative_to(pkg)).encode())
            h.update(p.read_bytes())
        _DIGEST.append(h.hexdigest()[:20])
    return _DIGEST[0]
