"""Labels from the classification head's gradient when the threat model grants none (iDLG, Zhao et al. 2020; paper
001 §3.5: labels "known or recovered from the last-layer gradients"), for the optimisation attacks of this package.

* ``∂L/∂b`` of the head bias (mean cross-entropy) is ``mean_i p_ic − n_c / B``. For B = 1 the unique negative entry is
  the label (exact). For B > 1 labels are assigned greedily: repeatedly take the most negative residual entry and add
  ``1/B`` to it (exact when every predicted probability is below ``1/B``, which holds for an untrained head). The head
  bias is the last 1-D tensor in the update whose length equals the number of logits (or ``label_param``).
* Without a head bias but with the head weight, at B = 1 the label is the one row of ``∂L/∂W = (p − y) h̄ᵀ`` whose
  sign (along the largest row) differs from the others (exact; ≥ 3 classes).
"""

from __future__ import annotations

import torch

from gradleak.errors import BadInput
from gradleak.fl.core import Update


def infer_labels_from_bias_gradient(bias_grad: torch.Tensor, batch_size: int) -> torch.Tensor:
    """iDLG label inference from ``∂L/∂b`` of the head (mean cross-entropy); see the module docstring."""
    residual = bias_grad.detach().to(torch.float64).clone()
    labels = []
    for _ in range(batch_size):
        c = int(torch.argmin(residual))
        labels.append(c)
        residual[c] += 1.0 / batch_size
    return torch.tensor(sorted(labels), dtype=torch.long)


def infer_label_from_head_weight_gradient(weight_grad: torch.Tensor) -> int:
    """Exact label of a single sample (B = 1) from ``∂L/∂W`` of a linear head (mean cross-entropy).

    Row c of the gradient is ``(p_c − y_c)·h̄`` for the head input h̄: every row is a multiple of the same vector,
    positive for the C − 1 other classes (p_c > 0) and negative for the label (p_y − 1 < 0). Projecting the rows on
    the largest one, the label is the single row whose sign differs from the others. With two classes both signs
    occur once (ambiguous without the sign of h̄): refused."""
    W = weight_grad.detach().to(torch.float64).reshape(weight_grad.shape[0], -1)
    if W.shape[0] < 3:
        raise BadInput("attack.labels", "label recovery from the head weight gradient is ambiguous with 2 classes "
                       "(the two rows are ± the same vector).",
                       "train the head bias (its gradient gives the label), or grant labels (threat.knows_labels=true).")
    ref = W[int(W.norm(dim=1).argmax())]
    coef = W @ ref
    pos, neg = (coef > 0).nonzero().reshape(-1), (coef < 0).nonzero().reshape(-1)
    if len(pos) == 1 and len(neg) >= 1:
        return int(pos[0])
    if len(neg) == 1 and len(pos) >= 1:
        return int(neg[0])
    raise BadInput("attack.labels", "the head weight gradient is not rank one with one sign-flipped row (several "
                   "samples in the update?), so the label cannot be read from it.",
                   "train the head bias, or grant labels (threat.knows_labels=true).")


def recover_labels_from_head(update: Update, num_logits: int, batch_size: int,
                             label_param: str | None = None) -> tuple[torch.Tensor, str]:
    """Labels from the head gradient when the threat model grants none (paper 001 §3.5 assumes labels "known or
    recovered from the last-layer gradients", iDLG): the head-bias gradient if the update holds one
    (:func:`infer_labels_from_bias_gradient`: exact at B = 1, greedy for B > 1), else at B = 1 the head weight
    gradient's rows (:func:`infer_label_from_head_weight_gradient`). Returns the labels and their source."""
    key = label_param
    if key is None:
        cands = [k for k, t in update.tensors.items() if t.ndim == 1 and t.numel() == num_logits and k.endswith("bias")]
        key = cands[-1] if cands else None
    if key is not None:
        if key not in update.tensors:
            raise BadInput("attack.label_param", f"the update holds no tensor named {key!r}.",
                           "name the head bias of this model, or leave label_param unset.")
        return infer_labels_from_bias_gradient(update.tensors[key], batch_size), f"idlg:{key}"
    wc = [k for k, t in update.tensors.items() if t.ndim == 2 and t.shape[0] == num_logits and k.endswith("weight")]
    if wc and batch_size == 1:
        k = wc[-1]
        return torch.tensor([infer_label_from_head_weight_gradient(update.tensors[k])], dtype=torch.long), f"head_rows:{k}"
    raise BadInput("attack.labels", "labels are not granted and the update holds no classification-head bias gradient"
                   + (" (the head weight rows give the label only at B = 1)" if wc else "") + ".",
                   "grant labels (threat.knows_labels=true, attack.labels=known) or train the head (peft.train_head=true).")


__all__ = ["infer_labels_from_bias_gradient", "infer_label_from_head_weight_gradient", "recover_labels_from_head"]
