"""The client's local-training schedule from the public training configuration, shared by the attacks that
simulate it: :mod:`gradleak.attacks.bn_inversion` (BN-aware inversion, Hatamizadeh et al. 2022) and the FedAvg
emulation of the image optimisation attacks (:mod:`gradleak.attacks.optimization`, ``attack.emulate:
local_steps``; paper 001 Supp. M). The differentiable simulation itself is
:func:`gradleak.attacks.bn_inversion.simulate_local_training`.

``fl`` is the public protocol the runner hands every attack (:class:`~gradleak.attacks.base.AttackContext` ``fl``):
``algorithm``, ``local_batch_size``, ``local_epochs``, ``lr``, per client ``client_batch_sizes`` /
``client_epochs`` and the per-round learning rates ``lr_at``.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional


def client_training_config(fl: Mapping[str, Any], client_id: int, n: int,
                           round_index: int) -> tuple[int, int, Optional[float]]:
    """(local batch size, local epochs, lr) of client ``client_id`` holding ``n`` samples in round
    ``round_index`` (negative: from the end): its own ``client_batch_sizes`` / ``client_epochs`` entry, else the
    protocol's ``local_batch_size`` (default ``n``: full batch) / ``local_epochs`` (default 1); FedSGD is one
    full-batch step. The batch size is capped at ``n`` (as the client's minibatching does). The lr is
    ``lr_at[round_index]``, else ``lr``, else ``None`` (unknown)."""
    bs = fl.get("client_batch_sizes") or []
    ep = fl.get("client_epochs") or []
    b = int(bs[client_id]) if 0 <= client_id < len(bs) else int(fl.get("local_batch_size") or n)
    e = int(ep[client_id]) if 0 <= client_id < len(ep) else int(fl.get("local_epochs") or 1)
    if fl.get("algorithm", "fedavg") == "fedsgd":
        b, e = n, 1
    lr_at = fl.get("lr_at") or []
    lr = lr_at[round_index] if lr_at else fl.get("lr")
    return min(b, n), e, (float(lr) if lr is not None else None)


__all__ = ["client_training_config"]
