"""The matching problem read off the server's view: the attack's copy of the model, the observed tensors bound to
its parameters, the batch size, image shape and labels, the groups of paper 001 eq. 7, and the client's schedule
for ``emulate: local_steps`` (paper 001 Supp. M). The decisions (labels, batch size, attention, the PE gradients
without the anchor, the FedAvg emulation) are recorded in :mod:`gradleak.attacks.optimization.inverting_gradients`.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any, Optional

import torch
from torch import nn

from gradleak.attacks.common.simulation import client_training_config, local_schedule, output_logits
from gradleak.attacks.optimization.labels import recover_labels_from_head
from gradleak.attacks.optimization.matching_config import emulate_needs_fedavg, emulate_no_secagg, no_layer_pe
from gradleak.errors import BadInput
from gradleak.fl.core import ServerView, Update


def _force_eager_attention(model: nn.Module) -> bool:
    """Eager attention on the attack's copy (SDPA has no double backward). A float64 model gets ``eager_precise``
    (:mod:`gradleak.models.attention`): HF's eager softmax runs in float32 even in float64 models, which would cap
    the float64 objective's precision at ~1e-7."""
    p0 = next(model.parameters(), None)
    if p0 is not None and p0.dtype == torch.float64 and any(
            getattr(getattr(m, "config", None), "_attn_implementation", None) is not None for m in model.modules()):
        from gradleak.models.attention import use_precise_eager

        return use_precise_eager(model)
    switched = False
    for m in model.modules():
        cfg = getattr(m, "config", None)
        impl = getattr(cfg, "_attn_implementation", None) if cfg is not None else None
        if impl not in (None, "eager", "eager_precise"):
            try:
                cfg._attn_implementation = "eager"
                switched = True
            except Exception:  # pragma: no cover - exotic configs
                pass
    return switched


class MatchingSetup:
    """The view reading of the gradient-matching attacks (a mixin of
    :class:`~gradleak.attacks.optimization.inverting_gradients.InvertingGradients`): :meth:`_setup` returns
    everything one reconstruction matches against."""

    def _setup(self, view: ServerView, time_fwdbwd: bool) -> SimpleNamespace:
        """The matching problem of ``view``: the model copy, the bound tensors, batch size, shape, labels, the groups
        and norms of eq. 7, the fwd+bwd probe (``time_fwdbwd``) and the FedAvg emulation's schedule."""
        from gradleak.peft.layer_pe import is_input_pe, is_layer_pe

        self._clip = None
        if self.noise_model == "declared":  # the declared defenses' clipping bound (the noise: the l2 distance)
            from gradleak.defenses.declared import view_declared

            declared = view_declared(view)
            upd = view.updates[min(self.client_index, len(view.updates) - 1)] if view.updates else None
            per_sample = declared.per_sample_clip_norm if int(getattr(upd, "num_samples", 0) or 0) == 1 else None
            self._clip = declared.clip_norm or per_sample

        if not view.updates:
            raise BadInput("view.updates", "the server view holds no update.", "run at least one client round.")
        if not 0 <= self.client_index < len(view.updates):
            raise BadInput("attack.client_index", f"client_index {self.client_index} but the view holds "
                           f"{len(view.updates)} update(s).", "pick an index of an observed update.")
        update = view.updates[self.client_index]
        if self.anchor and not any(is_layer_pe(k) for k in update.tensors):
            raise no_layer_pe()
        model = copy.deepcopy(view.model)
        eager_switched = _force_eager_attention(model)
        names, params, targets = self._bind(model, update)
        device, dtype = params[0].device, params[0].dtype

        batch_size, bs_source = self._batch_size(view, update)
        shape = self._shape(view, model)
        labels, label_source = self._labels(view, model, update, batch_size, shape, device, dtype)

        # ---- the groups of eq. 7: θ' (head + PEFT) by the attack's distance, the PEs by one cosine
        # (the input table counts as the prescribed architecture's PE only next to layer-wise PEs; a client that
        # trains it on its own, e.g. full fine-tuning, has it matched with θ' as IG always did)
        prescribed = any(is_layer_pe(n) for n in names)
        pe_terms = [i for i, n in enumerate(names) if (self.anchor and (is_layer_pe(n) or is_input_pe(n)))
                    or (self.input_pe_term and is_input_pe(n))]
        unmatched = [i for i, n in enumerate(names) if prescribed and (is_layer_pe(n) or is_input_pe(n))
                     and i not in pe_terms]
        main = [i for i in range(len(names)) if i not in pe_terms and i not in unmatched]
        if not main:
            raise BadInput("view.updates", "the update holds only positional-embedding gradients; there is no "
                           "head/PEFT gradient to match.", "train the head or a PEFT module (peft.train_head=true).")
        fb_probe = self._fwdbwd_probe(model, params, batch_size, shape, labels, device, dtype) if time_fwdbwd else None
        fb_samples = [fb_probe() for _ in range(6)][1:] if fb_probe else []  # after one warm-up call
        for i in unmatched:  # not matched: no gradient needed (faster), and not part of the objective
            params[i].requires_grad_(False)
        groups = {"main": main, "pe": pe_terms}
        norms = {g: torch.sqrt(sum((targets[i] ** 2).sum() for i in idx)) if idx else None for g, idx in groups.items()}
        if float(norms["main"]) == 0.0:
            raise BadInput("view.updates", "the observed update is all zeros; there is nothing to match.",
                           "attack an update with non-zero gradients.")
        if pe_terms and float(norms["pe"]) == 0.0:
            pe_terms = groups["pe"] = []  # nothing to anchor on (recorded in info)
        emulation = None
        if self.emulate == "local_steps":  # matching_terms finds the client's schedule on the attack's model copy
            emulation = model._gradleak_local_steps = self._emulation(view, update, names, batch_size)
        return SimpleNamespace(update=update, model=model, eager_switched=eager_switched, names=names, params=params,
                               targets=targets, device=device, dtype=dtype, batch_size=batch_size, bs_source=bs_source,
                               shape=shape, labels=labels, label_source=label_source, groups=groups, norms=norms,
                               main=main, pe_terms=pe_terms, unmatched=unmatched, fb_probe=fb_probe,
                               fb_samples=fb_samples, emulation=emulation)

    def _emulation(self, view: ServerView, update: Update, names: list[str], n: int) -> SimpleNamespace:
        """The client's local-training schedule for ``emulate: local_steps`` (module docstring): its batch size,
        epochs and lr from the public training configuration, checked against the update's step count."""
        if update.kind != "pseudo_gradient":
            raise emulate_needs_fedavg("fedsgd" if update.kind == "gradient" else update.kind)
        if view.secure_aggregation or update.client_id < 0:
            raise emulate_no_secagg()
        r = len(view.rounds) - 1 if view.rounds else -1  # view.updates is the last observed round
        b, e, lr = client_training_config(self.fl, int(update.client_id), n, r)
        schedule = local_schedule(n, b, e)
        if update.local_steps and len(schedule) != int(update.local_steps):
            raise BadInput("attack.emulate", f"the public training configuration gives client {update.client_id} "
                           f"{len(schedule)} local step(s) ({n} samples, batch size {b}, {e} epoch(s)) but its update "
                           f"reports {update.local_steps}.", "give the attack the clients' training configuration "
                           "(fl: local_batch_size / local_epochs / client_batch_sizes / client_epochs, lr_at), or use "
                           "attack.emulate=single_step.")
        if lr is None and len(schedule) > 1:
            raise BadInput("attack.emulate", "the clients' learning rate is unknown, so their local steps cannot be "
                           "simulated.", "run through the pipeline (gradleak run), or give the attack fl={'lr': ...}.")
        return SimpleNamespace(names=list(names), schedule=schedule, lr=float(lr) if lr is not None else 0.0,
                               batch_size=b, epochs=e, steps=len(schedule), round=r)

    def _emulation_info(self, emu: Optional[SimpleNamespace]) -> dict[str, Any]:
        if emu is None:
            return {}
        return {"emulation": {"mode": "local_steps", "local_steps": emu.steps, "batch_size": emu.batch_size,
                              "epochs": emu.epochs, "lr": emu.lr, "round": emu.round,
                              "shuffle": "consecutive batches of the dummies; later epochs re-use epoch 1's order"}}

    def _bind(self, model: nn.Module, update: Update):
        named = dict(model.named_parameters())
        missing = [k for k in update.tensors if k not in named]
        if missing:
            raise BadInput("view.updates", f"the update holds tensors the model does not have: {missing[:3]}.",
                           "attack an update produced on the model in the same view.")
        for p in model.parameters():
            p.requires_grad_(False)
        names, params, targets = [], [], []
        for k, t in update.tensors.items():
            p = named[k]
            if tuple(p.shape) != tuple(t.shape):
                raise BadInput("view.updates", f"'{k}' has shape {tuple(t.shape)} in the update but "
                               f"{tuple(p.shape)} in the model.", "attack an update produced on this model.")
            if not p.is_floating_point():
                continue
            p.requires_grad_(True)
            names.append(k)
            params.append(p)
            targets.append(t.detach().to(p.device, p.dtype))
        if not params:
            raise BadInput("view.updates", "the update holds no floating-point parameter gradients.",
                           "attack an update with trainable parameters.")
        return names, params, targets

    def _batch_size(self, view: ServerView, update: Update) -> tuple[int, str]:
        bs = view.public.get("batch_size")
        if bs is not None:
            if int(bs) < 1:
                raise BadInput("view.public.batch_size", f"batch size must be >= 1, got {bs}.", "grant the true batch size.")
            return int(bs), "public"
        if update.num_samples >= 1:
            return int(update.num_samples), "update.num_samples"
        raise BadInput("view.public.batch_size", "the batch size is neither granted nor carried by the update.",
                       "put it into ServerView.public['batch_size'].")

    def _shape(self, view: ServerView, model: nn.Module) -> tuple[int, int, int]:
        if self.image_shape is not None:
            return self.image_shape  # type: ignore[return-value]
        shp = view.public.get("image_shape")
        if shp is not None:
            return tuple(int(s) for s in shp)  # type: ignore[return-value]
        cfg = getattr(model, "config", None)
        size, ch = getattr(cfg, "image_size", None), getattr(cfg, "num_channels", None)
        if size is not None and ch is not None:
            h, w = (size, size) if isinstance(size, int) else tuple(size)
            return int(ch), int(h), int(w)
        raise BadInput("attack.image_shape", "the image shape is unknown.",
                       "pass image_shape=(C, H, W) or grant ServerView.public['image_shape'].")

    def _labels(self, view: ServerView, model: nn.Module, update: Update, batch_size: int,
                shape: tuple[int, int, int], device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, str]:
        lab = view.public.get("labels")
        if self.labels == "known" or (self.labels == "auto" and lab is not None):
            if lab is None:
                raise BadInput("view.public.labels", "labels='known' but the threat model grants no labels.",
                               "grant them via ServerView.public['labels'] or use labels='idlg' / 'auto'.")
            lab = torch.as_tensor(lab, dtype=torch.long).reshape(-1)
            if len(lab) != batch_size:
                raise BadInput("view.public.labels", f"{len(lab)} labels for a batch of {batch_size}.",
                               "grant one label per private sample.")
            return lab.to(device), "public"
        num_logits = view.public.get("num_classes")
        if num_logits is None:
            with torch.no_grad():
                num_logits = output_logits(model(torch.zeros((1, *shape), device=device, dtype=dtype))).shape[-1]
        labels, source = recover_labels_from_head(update, int(num_logits), batch_size, self.label_param)
        return labels.to(device), source
