"""FISGuard (paper 004, FISGuard paper Sec. IV): fixed input subspaces for every client-trained linear layer that reads a
private representation, so the observed gradient's row space is the same public subspace for every client.

For each target layer ℓ (a bottleneck adapter's down-projection, a LoRA A matrix, optionally the task head):

1. run an independent **public** reference set through the *pretrained* model (adapters / LoRA at their
   function-preserving start) and stack the layer's input vectors X_pub (rows = non-special tokens; the
   head: pooled vectors);
2. Q_ℓ = the top-r right singular vectors of X_pub (r × d; not mean-centred — open point A5.3 of docs/PAPERS.md, and
   the layer applies Q to uncentred inputs);
3. re-parameterise ΔW_ℓ = U_ℓ Q_ℓ with U_ℓ = 0 trainable (fixed-down adapter: down = Q frozen, no
   non-linearity, up = U; fixed-input LoRA: A = Q frozen, B = U, scaling 1; head: logits = U Q pooled + b).

The client then uploads G_U = D Zᵀ with Z = Q X. When rank(G_U) = r its row space is all of R^r, every
candidate's projected residual is 0 and ProjRes is reduced to chance (AUC ½) — a ProjRes-specific guarantee,
not differential privacy. rank(G_U) ≤ min(m, r, #tokens that receive gradient): :func:`rank_report`
states, per observed update and layer, whether the condition holds.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gradleak.errors import BadInput


def _targets(handle, base_kind: str, protect_head: bool) -> dict[str, nn.Module]:
    """name -> the module whose *input* is the protected representation."""
    model = handle.model
    out: dict[str, nn.Module] = {}
    if base_kind == "adapters":
        from gradleak.peft.text_adapters import PREFIX

        mods = getattr(model, PREFIX, None)
        if mods is None:
            raise BadInput("defense.name", "FISGuard on adapters needs the text adapters.", "use peft.kind=adapters.")
        for name, m in mods.items():
            out[f"{PREFIX}.{name}"] = m
    elif base_kind == "lora":
        for name, m in model.named_modules():
            if hasattr(m, "lora_A") and "default" in getattr(m, "lora_A", {}):
                out[name] = m.lora_A["default"]
        if not out:
            raise BadInput("defense.name", "FISGuard on LoRA found no LoRA layer.", "use peft.kind=lora.")
    else:
        raise BadInput("peft.kind", f"FISGuard protects adapters or LoRA, not peft.kind={base_kind}.",
                       "use peft.kind=adapters or lora.")
    if protect_head:
        head = getattr(model, "classifier", None) or getattr(model, "score", None)
        if not isinstance(head, nn.Linear):
            raise BadInput("defense.protect_head", "the task head is not a linear layer, so it cannot get a fixed input.",
                           "set defense.protect_head=false.")
        out["classifier" if getattr(model, "classifier", None) is head else "score"] = head
    return out


@torch.no_grad()
def public_inputs(handle, modules: dict[str, nn.Module], texts: list[str], max_tokens: int = 200_000,
                  batch: int = 64) -> dict[str, torch.Tensor]:
    """The stacked input vectors of each module on the public texts (non-special, non-padding tokens)."""
    from gradleak.models.text import causal_specials

    tok, model = handle.tokenizer, handle.model
    dev = next(model.parameters()).device
    special = set(tok.all_special_ids)
    if handle.kind == "causal":
        special |= set(causal_specials(tok))
    rec: dict[str, list[torch.Tensor]] = {n: [] for n in modules}
    hooks = []
    current: dict[str, Any] = {}

    def hook(name):
        def fn(mod, args, *rest):
            x = args[0] if args else rest[0]["hidden_states"]
            current[name] = x.detach()
        return fn

    for n, m in modules.items():
        hooks.append(m.register_forward_pre_hook(hook(n)))
    try:
        for a in range(0, len(texts), batch):
            enc = handle.text_model.encode(texts[a:a + batch])
            ids, mask = enc["input_ids"], enc["attention_mask"].bool()
            keep = mask & ~torch.isin(ids, torch.tensor(sorted(special)))
            model(input_ids=ids.to(dev), attention_mask=enc["attention_mask"].to(dev))
            for n in modules:
                x = current[n].cpu().double()
                rec[n].append(x if x.dim() == 2 else x[keep])
            if sum(len(v) for v in rec[next(iter(rec))]) >= max_tokens:
                break
    finally:
        for h in hooks:
            h.remove()
    return {n: torch.cat(v) for n, v in rec.items()}


def layer_rank(name: str, rank: int, head_rank: int | None, layer_ranks: dict[str, int] | None) -> int:
    """r of one protected layer: ``head_rank`` for the task head, else the first ``layer_ranks`` entry whose key is
    a substring of the layer's name, else ``rank``."""
    if name in ("classifier", "score"):
        return head_rank or rank
    return next((r for key, r in (layer_ranks or {}).items() if key in name), rank)


def apply_fisguard(handle, *, base_kind: str, rank: int, public_texts: list[str], protect_head: bool = False,
                   head_rank: int | None = None, layer_ranks: dict[str, int] | None = None) -> dict[str, Any]:
    """Re-parameterise every target layer of ``handle.model`` in place; return the per-layer setup. ``layer_ranks``
    gives some layers their own r (our extension: e.g. the last adapter before mean pooling, whose gradient reaches
    at most C − 1 directions, the paper's Sec. VI-D bound rank(G_U) ≤ min(m, r, B_eff))."""
    mods = _targets(handle, base_kind, protect_head)
    unmatched = sorted(k for k in (layer_ranks or {}) if not any(k in n for n in mods if n not in ("classifier", "score")))
    if unmatched:
        raise BadInput("defense.layer_ranks", f"'{unmatched[0]}' matches no protected layer "
                       f"({', '.join(n for n in mods if n not in ('classifier', 'score'))}).",
                       "use substrings of the protected layers' names (e.g. layer_1 for the last adapter).")
    with torch.no_grad():  # the function-preserving start (U = 0) before the public inputs are read
        for m in mods.values():
            if base_kind == "adapters" and hasattr(m, "up"):
                m.up.weight.zero_()
                m.up.bias.zero_()
        if base_kind == "lora":
            for name in mods:
                if name not in ("classifier", "score"):
                    handle.model.get_submodule(name).lora_B["default"].weight.zero_()
    X = public_inputs(handle, mods, public_texts)
    report = {}
    dtype = next(handle.model.parameters()).dtype
    for name, m in mods.items():
        d = X[name].shape[1]
        r = layer_rank(name, rank, head_rank, layer_ranks)
        if r > d:
            raise BadInput("defense.rank", f"r = {r} is larger than the input width {d} of {name}.",
                           f"use r <= {d}.")
        if len(X[name]) < r:
            raise BadInput("defense.public_size", f"the public set gives only {len(X[name])} input vectors at {name}, "
                           f"fewer than r = {r}.", "use more public samples (defense.public_size) or a smaller r.")
        _, S, Vh = torch.linalg.svd(X[name], full_matrices=False)
        Q = Vh[:r].to(dtype)
        report[name] = {"rank": r, "input_width": d, "public_vectors": int(len(X[name])),
                        "energy_kept": float((S[:r] ** 2).sum() / (S ** 2).sum())}
        _rewrite(handle.model, name, m, Q, base_kind)
    return report


def _fixed(Q: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(Q.shape[1], Q.shape[0], bias=False).to(Q.dtype)
    with torch.no_grad():
        lin.weight.copy_(Q)
    lin.weight.requires_grad_(False)
    return lin


def _zero(r: int, out: int, dtype, bias: bool) -> nn.Linear:
    lin = nn.Linear(r, out, bias=bias).to(dtype)
    with torch.no_grad():
        lin.weight.zero_()
        if bias:
            lin.bias.zero_()
    return lin


def _rewrite(model: nn.Module, name: str, m: nn.Module, Q: torch.Tensor, base_kind: str) -> None:
    r = Q.shape[0]
    if name in ("classifier", "score"):  # logits = U (Q pooled) + b, U = 0
        head = nn.Sequential(_fixed(Q), _zero(r, m.out_features, Q.dtype, bias=m.bias is not None))
        setattr(model, name, head)
        return
    if base_kind == "adapters":
        m.down = _fixed(Q)
        m.up = _zero(r, m.up.out_features, Q.dtype, bias=True)
        m.fixed_input = True
        return
    layer = model.get_submodule(name)  # peft LoRA layer
    layer.lora_A["default"] = _fixed(Q)
    layer.lora_B["default"] = _zero(r, layer.lora_B["default"].out_features, Q.dtype, bias=False)
    layer.scaling["default"] = 1.0


def rank_report(update_tensors: dict[str, torch.Tensor], report: dict[str, Any], rtol: float = 1e-6) -> dict[str, dict]:
    """Per protected layer: rank(G_U) and whether it equals r (the condition of FISGuard's guarantee)."""
    out = {}
    for name, info in report.items():
        if name in ("classifier", "score"):  # Sequential(Q, U)
            key = f"{name}.1.weight"
        elif name.startswith("text_adapters."):  # fixed-down adapter: U is the up-projection
            key = f"{name}.up.weight"
        else:  # fixed-input LoRA layer: U is B
            key = f"{name}.lora_B.default.weight"
        G = update_tensors.get(key)
        if G is None:
            continue
        S = torch.linalg.svdvals(G.double())
        k = int((S > rtol * S[0]).sum()) if S.numel() and S[0] > 0 else 0
        out[name] = {"rank_G_U": k, "r": info["rank"], "condition_holds": k == info["rank"],
                     "module": key[: -len(".weight")]}
    return out
