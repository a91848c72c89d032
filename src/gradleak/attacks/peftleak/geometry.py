"""PEFTLeak's linear algebra of the poisoned ViT (PEFTLeak Sec. 4): orthonormal complements, projections, the adapter-input
scale of every slot (:func:`slot_scales`) and the per-patch quantities every statistic needs (:class:`PatchGeometry`).
Both parties use them: the server to plan its bins, the recovery to invert them. All in float64 (A1.6)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

F64 = torch.float64


def householder_complement(u: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis (d × (d−1)) of the complement of the unit vector u, in O(d²) (Householder)."""
    d = u.shape[0]
    e = torch.zeros(d, dtype=F64)
    e[0] = 1.0
    v = e - u
    if float(v.norm()) < 1e-12:
        return torch.eye(d, dtype=F64)[:, 1:]
    H = torch.eye(d, dtype=F64) - 2 * torch.outer(v, v) / (v @ v)
    return H[:, 1:]  # H e_1 = u, so the other columns are orthonormal and ⊥ u


def project_out(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Project x (d or n × d) onto the orthogonal complement of the orthonormal columns of q (d × k)."""
    return x - (x @ q) @ q.T


def slot_scales(v: torch.Tensor, n_blocks: int, sigma: float, eps: float) -> torch.Tensor:
    """Adapter-input scale φ for every slot, for tokens whose centred embedding has variance ``v``.

    Under the poisoned backbone the residual stream of a token stays ``a·y_c`` (y_c = its centred
    embedding): each LayerNorm outputs ``σ·a·y_c / sqrt(a²v + eps)`` (the MSA and MLP are identities and
    the adapters add ~up_scale), which is both the adapter's input and what the residual adds. Returns
    ``(..., 2·n_blocks + 1)``: slots in forward order, then the final LayerNorm.
    """
    a = torch.ones_like(v)
    out = []
    for _ in range(2 * n_blocks):
        phi = sigma * a / torch.sqrt(a * a * v + eps)
        out.append(phi)
        a = a + phi
    out.append(sigma * a / torch.sqrt(a * a * v + eps))
    return torch.stack(out, -1)


@dataclass
class PatchGeometry:
    """Per-patch quantities every statistic needs: centred ``M x`` (n × D), its squared norm, and its
    inner products with the centred positional embeddings (n × (N+1))."""

    Mx_c: torch.Tensor
    norm2: torch.Tensor
    pdot: torch.Tensor
    cache: dict = field(default_factory=dict)


__all__ = ["F64", "PatchGeometry", "householder_complement", "project_out", "slot_scales"]
