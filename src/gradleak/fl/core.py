"""Clients, updates, aggregation and the :class:`ServerView` (docs/DESIGN.md §1).

The server view is the only thing an attack may read. A :class:`Client` holds the private batch and
never hands it to the server; :meth:`Client.local_update` returns an :class:`Update` holding only
parameter-shaped tensors.

Sign convention: ``Update.tensors`` holds what the client *uploads*. In FedSGD that is the gradient of
the mean loss on the local batch (``kind="gradient"``). In FedAvg it is the model delta divided by
``-lr`` (``kind="pseudo_gradient"``), i.e. the sum of the local gradients when the weights barely move,
so attacks that read gradients can read FedAvg updates the same way.

BatchNorm (Hatamizadeh et al. 2022 §II-B: the client update carries the updated BN running statistics): for a
model with ``_BatchNorm`` layers that track running statistics, ``Update.buffers`` holds the **change** of
every BN buffer over local training (``running_mean``, ``running_var``, ``num_batches_tracked``; float64,
new − old) — NVFlare's ``WEIGHT_DIFF`` convention for the running statistics. Decisions: the change rather
than the new value, so that noise defenses treat buffers like the weight differences and the server's
average of changes equals the average of the clients' new values (all clients start from the same
checkpoint); ``None`` for models without BN (every earlier attack sees the same ``Update`` as before).
The parameter-wise transforms (``map``, ``flat``) act on ``tensors`` only and carry ``buffers`` unchanged.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np
import torch
from torch import nn

from gradleak.errors import BadInput

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Update:
    """Parameter-shaped tensors a client uploads, keyed by parameter name."""

    tensors: dict[str, torch.Tensor]
    num_samples: int
    client_id: int = 0
    kind: str = "gradient"
    local_steps: int = 1
    buffers: Optional[dict[str, torch.Tensor]] = None  # BN buffer changes (new − old), see the module docstring

    def norm(self) -> float:
        return float(torch.sqrt(sum((t.double() ** 2).sum() for t in self.tensors.values())))

    def map(self, fn: Callable[[str, torch.Tensor], torch.Tensor]) -> "Update":
        return Update({k: fn(k, v) for k, v in self.tensors.items()}, self.num_samples,
                      self.client_id, self.kind, self.local_steps, self.buffers)

    def flat(self) -> torch.Tensor:
        return torch.cat([t.reshape(-1) for t in self.tensors.values()])

    def unflat(self, vec: torch.Tensor) -> "Update":
        out, i = {}, 0
        for k, t in self.tensors.items():
            out[k] = vec[i:i + t.numel()].reshape(t.shape).to(t.dtype)
            i += t.numel()
        return Update(out, self.num_samples, self.client_id, self.kind, self.local_steps, self.buffers)


def apply_update_defenses(upd: "Update", defenses: Sequence[Any], *, client_id: Any, seed: int, lr: float) -> "Update":
    """``upd`` through the update defenses in order, each given the context every engine gives it: the client, the
    round's seed and its lr (:meth:`gradleak.defenses.base.UpdateDefense.apply`)."""
    for d in defenses:
        upd = d.apply(upd, {"client_id": client_id, "seed": seed, "lr": lr})
    return upd


def batchnorm_buffer_names(model: nn.Module) -> list[str]:
    """State-dict names of the buffers of every ``_BatchNorm`` module that tracks running statistics."""
    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.track_running_stats:
            for b, t in mod.named_buffers(recurse=False):
                if t is not None:
                    out.append(f"{name}.{b}" if name else b)
    return out


def batchnorm_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached CPU copies of the BN buffers (empty for a model without BatchNorm)."""
    names = set(batchnorm_buffer_names(model))
    return {n: b.detach().clone().cpu() for n, b in model.named_buffers() if n in names}


def _buffer_change(before: dict[str, torch.Tensor], model: nn.Module) -> Optional[dict[str, torch.Tensor]]:
    if not before:
        return None
    after = batchnorm_buffers(model)
    return {n: after[n].to(torch.float64) - b.to(torch.float64) for n, b in before.items()}


@dataclass
class ServerView:
    """What the server observes: the model it sent, the updates, and granted public knowledge.

    ``updates`` holds one :class:`Update` per client when the server sees individual updates, or a
    single aggregate when secure aggregation hides them (``secure_aggregation=True``).
    ``public`` holds what the threat model grants (e.g. ``{"batch_size": 32, "public_images": ...}``).
    ``rounds`` holds, for multi-round attacks, one list of updates per round (round-major), each
    paired with the model state the server sent that round in ``round_states`` (trainable parameters, plus
    the BN buffers for a BatchNorm model: the full checkpoint).
    """

    model: nn.Module
    updates: list[Update]
    public: dict[str, Any] = field(default_factory=dict)
    secure_aggregation: bool = False
    rounds: list[list[Update]] = field(default_factory=list)
    round_states: list[dict[str, torch.Tensor]] = field(default_factory=list)


def default_classification_loss(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    out = model(inputs)
    logits = out.logits if hasattr(out, "logits") else out
    return nn.functional.cross_entropy(logits, labels)


class Client:
    """A federated client that owns a private batch and trains only the trainable parameters.

    ``trainable`` lists the parameter names the client trains and uploads (adapters, head, ...).
    Defenses are applied in order to the update before upload (client-side transforms);
    ``train_hooks`` lets training-time defenses such as DP-SGD replace the local optimisation.
    """

    def __init__(self, client_id: int, inputs: torch.Tensor, labels: torch.Tensor,
                 loss_fn: LossFn = default_classification_loss, round_batch: int | None = None, sample_seed: int = 0):
        if len(inputs) != len(labels):
            raise BadInput("data", f"{len(inputs)} inputs but {len(labels)} labels.",
                           "give one label per input.")
        if round_batch is not None and not 1 <= round_batch <= len(inputs):
            raise BadInput("data.batch_size", f"a round's batch of {round_batch} does not fit the client's "
                           f"{len(inputs)} samples.", "use 1 <= data.batch_size <= data.samples_per_client.")
        self.client_id = client_id
        self._inputs = inputs
        self._labels = labels
        self.loss_fn = loss_fn
        self.round_batch = round_batch
        self.sample_seed = sample_seed

    def round_indices(self, round_index: int) -> torch.Tensor:
        """The indices of the samples the client trains on in round ``round_index`` when it holds a dataset of N
        (``round_batch`` = B): a data loader's shuffled epochs with ``drop_last`` — epoch e is a permutation seeded
        by ``sample_seed``, the client id and e, cut into ⌊N/B⌋ batches of exactly B (the N mod B left over are
        dropped that epoch); round r takes batch r mod ⌊N/B⌋ of epoch r div ⌊N/B⌋."""
        n = len(self._inputs)
        B = self.round_batch or n
        per_epoch = n // B
        epoch, k = divmod(int(round_index), per_epoch)
        gen = torch.Generator().manual_seed(int(self.sample_seed) * 1_000_003 + int(self.client_id) * 7_919 + epoch)
        return torch.randperm(n, generator=gen)[k * B:(k + 1) * B]

    def for_round(self, round_index: int) -> "Client":
        """The client as it trains in round ``round_index``: itself when its batch is its whole data, else the same
        client (id, loss) holding that round's batch (:meth:`round_indices`)."""
        if self.round_batch is None or self.round_batch >= len(self._inputs):
            return self
        idx = self.round_indices(round_index).to(self._inputs.device)
        return Client(self.client_id, self._inputs[idx], self._labels[idx], loss_fn=self.loss_fn)

    @property
    def num_samples(self) -> int:
        return len(self._inputs)

    @staticmethod
    def trainable_names(model: nn.Module) -> list[str]:
        return [n for n, p in model.named_parameters() if p.requires_grad]

    def per_sample_gradient_norms(self, model: nn.Module) -> list[float]:
        """The L2 norm of each private sample's own loss gradient over the trainable parameters at ``model`` (what
        DP-SGD clips), one backward per sample; only norms leave the client."""
        params = [p for p in model.parameters() if p.requires_grad]
        device = next(model.parameters()).device
        out = []
        for i in range(len(self._inputs)):
            x, y = self._inputs[i:i + 1].to(device), self._labels[i:i + 1].to(device)
            grads = torch.autograd.grad(self.loss_fn(model, x, y), params, allow_unused=True)
            out.append(float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads if g is not None))))
        return out

    def local_update(self, model: nn.Module, *, algorithm: str = "fedsgd", epochs: int = 1,
                     lr: float = 0.01, batch_size: int | None = None,
                     defenses: Sequence[Any] = (), seed: int = 0, in_place: bool = False) -> Update:
        """Run local training on a private copy of ``model`` and return the upload.

        ``in_place=True`` trains ``model`` itself (the round protocol hands each client its own copy already).

        ``fedsgd``: one gradient of the mean loss over the whole local batch.
        ``fedavg``: ``epochs`` passes of SGD with minibatches of ``batch_size`` (shuffled with
        ``seed``); the upload is ``(w_before - w_after) / lr``.
        """
        names = self.trainable_names(model)
        if not names:
            raise BadInput("model", "the model has no trainable parameters, so the client has nothing to upload.",
                           "insert adapters/LoRA or unfreeze the head before federated training.")
        device = next(model.parameters()).device
        x, y = self._inputs.to(device), self._labels.to(device)
        bn_before = batchnorm_buffers(model)  # empty without BatchNorm
        if algorithm == "fedsgd":
            params = [p for n, p in model.named_parameters() if p.requires_grad]
            loss = self.loss_fn(model, x, y)
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            tensors = {n: (g.detach() if g is not None else torch.zeros_like(p))
                       for n, p, g in zip(names, params, grads)}
            upd = Update(tensors, len(x), self.client_id, "gradient", 1)
        elif algorithm == "fedavg":
            local = model if in_place else copy.deepcopy(model)
            params = {n: p for n, p in local.named_parameters() if p.requires_grad}
            # the weights move in the model's dtype, but the change is accumulated in float64: a float32
            # ``w_before - w_after`` rounds the small steps against the large weights (5.8 % off the
            # gradient on MiniLM after one full-batch step)
            before = {n: p.detach().to(torch.float64).clone() for n, p in params.items()}
            moved = {n: torch.zeros_like(b) for n, b in before.items()}
            bs = batch_size or len(x)
            gen = torch.Generator().manual_seed(seed)
            steps = 0
            for _ in range(epochs):
                order = torch.randperm(len(x), generator=gen)
                for i in range(0, len(x), bs):
                    idx = order[i:i + bs].to(device)
                    loss = self.loss_fn(local, x[idx], y[idx])
                    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
                    with torch.no_grad():
                        for (n, p), g in zip(params.items(), grads):
                            if g is None:
                                continue
                            moved[n] += lr * g.detach().to(torch.float64)
                            p.copy_((before[n] - moved[n]).to(p.dtype))
                    steps += 1
            tensors = {n: moved[n] / lr for n in params}  # float64 whatever the model dtype
            upd = Update(tensors, len(x), self.client_id, "pseudo_gradient", steps)
        else:
            raise BadInput("fl.algorithm", f"unknown algorithm '{algorithm}'.", "use 'fedsgd' or 'fedavg'.")
        upd.buffers = _buffer_change(bn_before, model if (algorithm == "fedsgd" or in_place) else local)
        return apply_update_defenses(upd, defenses, client_id=self.client_id, seed=seed, lr=lr)


def aggregate(updates: Iterable[Update]) -> Update:
    """Sample-weighted mean of updates (FedAvg aggregation)."""
    ups = list(updates)
    if not ups:
        raise BadInput("updates", "no updates to aggregate.", "run at least one client.")
    total = sum(u.num_samples for u in ups)
    keys = ups[0].tensors.keys()
    out = {k: sum(u.tensors[k] * (u.num_samples / total) for u in ups) for k in keys}
    buffers = None
    if all(u.buffers is not None for u in ups):  # BN running statistics: the same sample-weighted mean of changes
        buffers = {k: sum(u.buffers[k].to(torch.float64) * (u.num_samples / total) for u in ups) for k in ups[0].buffers}
    return Update(out, total, -1, ups[0].kind, max(u.local_steps for u in ups), buffers)


def secure_aggregate(updates: Sequence[Update], seed: int = 0, frac_bits: int = 40) -> Update:
    """Secure aggregation by pairwise additive masks (Bonawitz et al. 2017), simulated in-process.

    As in the protocol, each client encodes its weighted update in fixed point (``frac_bits`` bits below
    the largest magnitude) in the ring Z_M, M = 2^62, and adds masks +m_ij / −m_ij shared with every
    other client j. Each masked vector is uniformly random in Z_M; the masks cancel exactly in the sum,
    so the server obtains the weighted mean (to 2^-frac_bits of the largest entry) and nothing else:
    the server view then holds no individual update. (Masking real numbers with large Gaussian masks
    instead would round small updates away.)
    """
    ups = list(updates)
    total = sum(u.num_samples for u in ups)
    gen = torch.Generator().manual_seed(seed)
    out = _masked_mean([u.tensors for u in ups], [u.num_samples / total for u in ups], gen, frac_bits)
    buffers = None
    if all(u.buffers is not None for u in ups):  # BN buffer changes: masked too, with their own fixed-point scale
        buffers = _masked_mean([u.buffers for u in ups], [u.num_samples / total for u in ups], gen, frac_bits)
    return Update(out, total, -1, ups[0].kind, max(u.local_steps for u in ups), buffers)


MODULUS = 2**62  # the ring Z_M of the secure-aggregation simulation


def fixed_point(dicts: Sequence[dict[str, torch.Tensor]], weights: Sequence[float],
                frac_bits: int) -> tuple[list[dict[str, torch.Tensor]], float]:
    """Each client's weighted update in fixed point in Z_M (before masking), and the common scale."""
    weighted = [{k: v.double() * w for k, v in d.items()} for d, w in zip(dicts, weights)]
    bound = max(float(t.abs().max()) for w in weighted for t in w.values()) or 1.0
    scale = 2.0**frac_bits / bound
    return [{k: torch.remainder(torch.round(v * scale).long(), MODULUS) for k, v in w.items()} for w in weighted], scale


def masked_uploads(dicts: Sequence[dict[str, torch.Tensor]], weights: Sequence[float], gen: torch.Generator,
                   frac_bits: int) -> tuple[list[dict[str, torch.Tensor]], float]:
    """What each client sends under secure aggregation: its fixed-point vector plus a mask +m_ij / −m_ij shared with
    every other client j (uniform in Z_M), and the scale. Each vector alone is uniformly random; the masks cancel in
    the sum."""
    encoded, scale = fixed_point(dicts, weights, frac_bits)
    for i in range(len(dicts)):
        for j in range(i + 1, len(dicts)):
            for k in encoded[i]:
                m = torch.randint(0, MODULUS, encoded[i][k].shape, generator=gen, dtype=torch.long)
                encoded[i][k] = torch.remainder(encoded[i][k] + m, MODULUS)
                encoded[j][k] = torch.remainder(encoded[j][k] - m, MODULUS)
    return encoded, scale


def _masked_mean(dicts: Sequence[dict[str, torch.Tensor]], weights: Sequence[float], gen: torch.Generator,
                 frac_bits: int) -> dict[str, torch.Tensor]:
    """The weighted sum of ``dicts`` as the server computes it from pairwise-masked fixed-point vectors."""
    modulus = MODULUS
    encoded, scale = masked_uploads(dicts, weights, gen, frac_bits)
    out = {}
    for k in encoded[0]:
        acc = torch.zeros_like(encoded[0][k])
        for e in encoded:  # what the server adds up: masked vectors only
            acc = torch.remainder(acc + e[k], modulus)
        signed = torch.where(acc >= modulus // 2, acc - modulus, acc)
        out[k] = (signed.double() / scale).to(dicts[0][k].dtype)
    return out


def dirichlet_split(labels: np.ndarray, num_clients: int, alpha: float, seed: int = 0) -> list[np.ndarray]:
    """Split sample indices over clients with per-class Dirichlet(alpha) proportions (non-IID)."""
    if alpha <= 0:
        raise BadInput("fl.dirichlet_alpha", f"alpha must be > 0, got {alpha}.", "use e.g. 0.5 (non-IID) or 100 (near IID).")
    rng = np.random.default_rng(seed)
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        props = rng.dirichlet(alpha * np.ones(num_clients))
        cuts = (np.cumsum(props) * len(idx)).astype(int)[:-1]
        for k, chunk in enumerate(np.split(idx, cuts)):
            parts[k].extend(chunk.tolist())
    return [np.array(sorted(p), dtype=int) for p in parts]


def model_as_sent(base, sent: dict, *, reads: bool = True, field: str = "params",
                  fix: str = "the server and the clients must build the same model."):
    """A client's own copy of ``base`` loaded with the tensors the server ``sent`` (a framework engine's client side:
    Flower's ClientApp, NVFlare's Executor). A client that reads no model (a canary) gets ``base`` itself. A sent
    name the model does not have is a :class:`~gradleak.errors.BadInput` naming ``field``."""
    local = copy.deepcopy(base) if reads else base
    params = dict(local.named_parameters())
    unknown = sorted(set(sent) - set(params))
    if unknown:
        raise BadInput(field, f"the server sent {field} the client's model does not have ({', '.join(unknown[:3])}).",
                       fix)
    if reads:
        with torch.no_grad():
            for nm, v in sent.items():
                params[nm].copy_(v.to(device=params[nm].device, dtype=params[nm].dtype))
    return local
