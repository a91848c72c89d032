"""Simulated public uploads before their update defenses, kept in the process between decoder trainings (docs/DESIGN.md
§2: shared by the learned attacks, :mod:`gradleak.attacks.learned_wordbag` and :mod:`gradleak.attacks.learned_image`).

A learned attack trains its decoder on public batches passed through the client's step and then the declared *update*
defenses (:meth:`gradleak.fl.core.Client.local_update`: the raw upload, then each defense's ``apply`` with the
context ``{client_id, seed, lr}``). The raw upload depends on the sent model, the public protocol, the batch and its
seeds -- not on the update defenses -- so ``gradleak audit --advise``, whose probes differ only in an update defense's
strength, simulated the same raw uploads again for every probe (14 of the 24 s of a learned_wordbag probe on
text_adapters). :func:`defended_upload` computes each raw upload once per process (the cell loop's workers persist
between probes, :mod:`gradleak.run.cells`) and applies the defenses to a private copy, in the order and with the
context :meth:`~gradleak.fl.core.Client.local_update` uses: the same tensors, bit for bit, as the uncached path
(tested). A training-time defense's step (DP-SGD) changes the raw upload itself and never goes through here.

Memory is bounded: at most :data:`MAX_BYTES` (``$GRADLEAK_RAW_UPLOAD_CACHE_MB``, default 1024; 0 turns the cache off)
per process. Uploads are grouped by the simulation they belong to (the ``group`` digest: the sent model and the
protocol); a new group evicts the least recently used other groups, never its own entries, and an upload that does not
fit is computed and not stored (a sequential pass over more uploads than fit keeps the first ones, instead of evicting
each before its next use).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from typing import Any, Sequence

import torch

#: the cache's bound per process in bytes (``$GRADLEAK_RAW_UPLOAD_CACHE_MB`` MiB, default 1024; 0: no cache)
MAX_BYTES = int(float(os.environ.get("GRADLEAK_RAW_UPLOAD_CACHE_MB", "1024")) * 2 ** 20)

_GROUPS: "OrderedDict[str, dict[str, Any]]" = OrderedDict()
_SIZE = {"bytes": 0, "hits": 0, "misses": 0}


def model_digest(model: torch.nn.Module) -> str:
    """The digest of the sent model's state (every name and value): computed once per decoder training, it enters the
    decoder's cache key and the simulation's :func:`group_digest`."""
    h = hashlib.sha256()
    for n, p in sorted(model.state_dict().items()):
        h.update(n.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def group_digest(model_sha: str, protocol: dict) -> str:
    """The digest of one simulation's fixed parts: the sent model's state (``model_sha``, :func:`model_digest`) and
    ``protocol`` (the public protocol, the loss, the labels' classes: everything besides the batch that shapes the raw
    upload)."""
    h = hashlib.sha256(model_sha.encode())
    h.update(json.dumps(protocol, sort_keys=True, default=str).encode())
    return h.hexdigest()


def upload_digest(x: torch.Tensor, y: torch.Tensor, seed: int) -> str:
    """The digest of one simulated upload's own parts: the client's inputs, labels and step seed."""
    h = hashlib.sha256()
    for t in (x, y):
        h.update(str((tuple(t.shape), str(t.dtype))).encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    h.update(str(int(seed)).encode())
    return h.hexdigest()


def _nbytes(upd) -> int:
    return sum(t.numel() * t.element_size() for t in upd.tensors.values()) + sum(
        t.numel() * t.element_size() for t in (upd.buffers or {}).values())


def _copy(upd):
    from gradleak.fl.core import Update

    return Update({k: v.clone() for k, v in upd.tensors.items()}, upd.num_samples, upd.client_id, upd.kind,
                  upd.local_steps, {k: v.clone() for k, v in upd.buffers.items()} if upd.buffers is not None else None)


def _store(group: str, key: str, upd) -> None:
    size = _nbytes(upd)
    while _SIZE["bytes"] + size > MAX_BYTES and any(g != group for g in _GROUPS):
        old = next(g for g in _GROUPS if g != group)  # the least recently used other group
        _SIZE["bytes"] -= sum(_nbytes(u) for u in _GROUPS.pop(old).values())
    if _SIZE["bytes"] + size > MAX_BYTES:
        return
    _GROUPS.setdefault(group, {})[key] = _copy(upd)
    _SIZE["bytes"] += size


def defended_upload(client, model: torch.nn.Module, group: str | None, *, defenses: Sequence[Any] = (),
                    algorithm: str, epochs: int, lr: float, batch_size: int | None, seed: int):
    """``client.local_update(model, ..., defenses=defenses, seed=seed)``, its raw upload (before ``defenses``) taken
    from the process's cache when the same ``group`` (:func:`group_digest`) simulated the same batch and seed before.
    ``group`` None: no cache."""
    from gradleak.fl.core import apply_update_defenses

    kw = dict(algorithm=algorithm, epochs=epochs, lr=lr, batch_size=batch_size, seed=seed)
    if group is None or MAX_BYTES <= 0:
        return client.local_update(model, defenses=defenses, **kw)
    key = upload_digest(client._inputs, client._labels, seed)
    cached = (_GROUPS.get(group) or {}).get(key)
    if cached is None:
        _SIZE["misses"] += 1
        raw = client.local_update(model, defenses=(), **kw)
        _store(group, key, raw)
    else:
        _SIZE["hits"] += 1
        _GROUPS.move_to_end(group)
        raw = cached
    upd = _copy(raw)
    return apply_update_defenses(upd, defenses, client_id=client.client_id, seed=seed, lr=lr)  # as local_update


def stats() -> dict[str, int]:
    """The cache's bytes held, hits and misses in this process (a diagnostic)."""
    return dict(_SIZE)


def clear() -> None:
    """Empty the cache of this process."""
    _GROUPS.clear()
    _SIZE.update(bytes=0, hits=0, misses=0)


__all__ = ["MAX_BYTES", "clear", "defended_upload", "group_digest", "model_digest", "stats", "upload_digest"]
