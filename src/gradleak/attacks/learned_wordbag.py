"""Learned inversion of a defended text upload into its word bag (Wu, Chen, Liu, Gu, "Learning to Invert", UAI 2023,
Sec. 3: a decoder trained on (defended gradient -> input) pairs the server makes from public data; not one of the five
papers of docs/PAPERS.md). The text slice: a multi-label word-bag classifier.

The server knows the model it sent, the PEFT and the declared update defenses (Kerckhoffs: they are in its own
configuration; ``view.public["update_defenses"]``, and an update transform named in ``defense:`` from
``view.public["declared_defenses"]``, docs/ARCHITECTURE.md "The threat model"). From public sentences
of the same kind (``threat.public_data``) it simulates the clients' upload exactly as a client makes it
(:meth:`gradleak.fl.core.Client.local_update`: the same algorithm, local epochs, batch size and lr of the public
protocol, the batch size of the clients, the client's loss) and passes it through the *same defense objects*
(:func:`gradleak.defenses.build_defenses` on the declared list), seeded independently of the victims'
(``seed`` + :data:`DEFENSE_SEED_OFFSET`, one seed per simulated upload). It then learns (defended upload -> bag of
vocabulary tokens) and reads the victim's upload with it.

Decisions the paper leaves open (each a parameter):

* **Compression** (so training fits a CPU): the decoder sees two fixed, seeded maps of the defended upload, never the
  upload itself. (a) A count sketch (feature hashing, Weinberger et al. 2009: every coordinate added with a seeded
  random sign into one of ``sketch_dim`` seeded buckets -- a sparse random projection), divided by its norm.
  (b) The token energies of the first ``energy_tensors`` 2-D upload tensors whose input width is the model's
  embedding width (the embedding adapter's down-projection first, docs/DESIGN.md §6 "UTR's oracle ceiling" reads
  the same tensor): for each public-vocabulary token v, ``log(‖G ê_v‖² / ‖G‖_F²)`` summed over those tensors, ê_v
  its word embedding centred on the vocabulary's mean and normalised (:func:`token_directions`) --
  a per-tensor statistic, not a test: nothing is thresholded, the decoder learns what each token's energy means
  under the defense.
* **Decoder**: per token v, ``logit_v = a_v + (β + b_v) z_v + (U s)_v`` (z_v: v's energy standardised over the
  training uploads; β one weight every token shares, b_v its own correction: a token few public batches hold learns
  from the others; s: the sketch) -- logistic regression with a per-token energy weight; ``epochs`` full-batch Adam steps
  on the binary cross-entropy, weight decay ``weight_decay``. The vocabulary is the public training sentences'
  tokens (no special token); a token no public sentence holds cannot be predicted.
* **Bag size**: the k most probable tokens, k the mean number of vocabulary tokens a training batch holds (the public
  batches' size, no truth involved; a decoder's own expected count ``Σ_v p_v`` is as miscalibrated as it overfits).
* **Null through the same decoder** (the issue's grading rule, docs/DESIGN.md §6 "every headline metric has a
  null"): ``null_batches`` random batches of held-out public sentences (disjoint from the training sentences) go
  through the same simulation, defenses and decoder; their bags are ``info["null_word_bags"]``. The ``token_sequences``
  unit (:mod:`gradleak.evaluation.text`) grades the victim's bag recall against both chances -- a random public bag
  of its size and these bags, drawn for drawn the larger -- so a decoder that only learned the public prior (the
  frequent words) is at chance: its null bags are its victim bag.
* **Cache**: a trained decoder and its null bags are stored under ``$GRADLEAK_CACHE/learned_wordbag/<hash>.pt``
  (written atomically, :func:`gradleak.atomic.atomic_path`), the hash over this module's source, the sent model's weights, the PEFT's
  trainable names, the declared defenses, the public protocol, the public sentences, the batch size and every
  parameter of this attack (the projection seed included).

Training-time defenses: one that replaces the client's step and changes the upload (DP-SGD: per-sample clipping and
noise, Abadi et al. 2016) is simulated with a copy of the declared defense object (its noise drawn under a seed apart
from the victims'), its step on each public batch, then the update list -- the pipeline's order; the others
(FISGuard's re-parameterisation is in the sent model already; dropout, L2, label smoothing, min-max change the
objective) are not simulated, and under one the attack is not applicable (``measurable``). An update transform named
in ``defense:`` (as ``--advise`` places NVFlare's SVT filter) is simulated after the ``defenses:`` list, as the
pipeline applies it. The sequence decoder of the paper is not built.

"""

from __future__ import annotations

import copy

import hashlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pydantic import Field

from gradleak.attacks.base import AttackBase, AttackConfig, Reconstruction
from gradleak.attacks.common.parameters import set_config_fields
from gradleak.attacks.common.raw_uploads import defended_upload, group_digest, model_digest
from gradleak.errors import BadInput
from gradleak.registry import ATTACKS

#: the simulated uploads' defenses are seeded apart from the victims' (``seed`` + this + the upload's index)
DEFENSE_SEED_OFFSET = 7_340_033
CACHE_VERSION = 1


class LearnedWordBagConfig(AttackConfig):
    public_batches: int = Field(400, ge=10, description="simulated defended uploads of public batches to train on")
    null_batches: int = Field(200, ge=20, description="held-out public batches through the same decoder: the null")
    heldout_sentences: int = Field(300, ge=4, description="public sentences held out of training for the null batches")
    sketch_dim: int = Field(128, ge=8, description="buckets of the seeded count sketch of the whole upload")
    energy_tensors: int = Field(1, ge=0, description="2-D upload tensors (input width = embedding width) whose "
                                "per-token energies the decoder reads (0: the sketch alone)")
    min_count: int = Field(2, ge=1, description="vocabulary: the tokens at least this many training batches hold (a "
                           "token seen once cannot be learned)")
    epochs: int = Field(300, ge=1, description="full-batch Adam steps of the decoder")
    lr: float = Field(0.05, gt=0, description="Adam learning rate of the decoder")
    weight_decay: float = Field(1e-4, ge=0, description="Adam weight decay of the decoder")
    projection_seed: int = Field(0, ge=0, description="seed of the count sketch (part of the cache key)")
    cache: bool = Field(True, description="reuse / store the trained decoder under $GRADLEAK_CACHE/learned_wordbag")


def cache_dir() -> Path:
    """``$GRADLEAK_CACHE/learned_wordbag`` (default ``~/.cache/gradleak/learned_wordbag``)."""
    return Path(os.environ.get("GRADLEAK_CACHE") or Path.home() / ".cache" / "gradleak").expanduser() / "learned_wordbag"


class CountSketch:
    """A fixed seeded count sketch of an upload's tensors (one bucket and one sign per coordinate, per tensor name)."""

    def __init__(self, shapes: dict[str, tuple], dim: int, seed: int):
        self.dim, self.maps = dim, {}
        for i, (name, shape) in enumerate(sorted(shapes.items())):
            n = int(np.prod(shape)) if len(shape) else 1
            g = torch.Generator().manual_seed(seed * 1_000_003 + int(hashlib.sha256(name.encode()).hexdigest()[:8], 16))
            self.maps[name] = (torch.randint(dim, (n,), generator=g), torch.randint(2, (n,), generator=g).float() * 2 - 1)

    def __call__(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        s = torch.zeros(self.dim)
        for name, (idx, sign) in self.maps.items():
            if name in tensors:
                s.index_add_(0, idx, tensors[name].detach().float().reshape(-1).cpu() * sign)
        return s / s.norm().clamp_min(1e-30)


class WordBagDecoder(torch.nn.Module):
    """``logit_v = a_v + (β + b_v) z_v + (U s)_v`` (module docstring, "Decoder")."""

    def __init__(self, vocab: int, sketch_dim: int):
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(vocab))
        self.b = torch.nn.Parameter(torch.zeros(vocab))
        self.beta = torch.nn.Parameter(torch.zeros(()))
        self.U = torch.nn.Linear(sketch_dim, vocab, bias=False)
        torch.nn.init.zeros_(self.U.weight)

    def forward(self, z: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return self.a + (self.beta + self.b) * z + self.U(s)


def update_stage(name: str) -> bool:
    """Whether the defense ``name`` transforms the upload (an update transform, simulated by both learned attacks
    when it is named in ``defense:``)."""
    from gradleak.registry import DEFENSES

    return name in DEFENSES and DEFENSES.get(name).stage == "update"


def defense_section_entry(view) -> dict | None:
    """The ``defense:`` section as a ``defenses:`` entry when it is an update transform (the pipeline applies it to
    every upload after the ``defenses:`` list, :func:`gradleak.run.pipeline`'s ``build_defenses`` + the section's
    ``update_transforms``), read from what the server is told (``view.public["declared_defenses"]``); else None."""
    declared = view.public.get("declared_defenses")
    transform = getattr(getattr(declared, "training", None), "transform", None)
    if transform is None:
        return None
    return {"name": training_name(transform), "params": transform.cfg.model_dump()}


def _simulated_training(name: str) -> bool:
    """Whether the training-time defense ``name`` is simulated: it replaces the client's step
    (``local_update``) and changes what the upload carries (DP-SGD)."""
    from gradleak.defenses.base import TrainingDefense, defense_class

    cls = defense_class(name)
    return (cls is not None and issubclass(cls, TrainingDefense) and bool(getattr(cls, "changes_upload", False))
            and getattr(cls, "local_update", None) is not None)


def _declared_training(view):
    """The declared training-time defense object when the simulation runs its step (:func:`_simulated_training`),
    else None."""
    from gradleak.defenses.declared import view_declared

    training = getattr(view_declared(view), "training", None)
    if training is None or getattr(training, "transform", None) is not None:
        return None
    name = training_name(training)
    return training if name is not None and _simulated_training(name) else None


def simulated_training(view, seed: int):
    """A copy of the declared training-time defense whose step the simulation runs (:func:`_simulated_training`),
    drawing under ``seed`` (never the victims' noise), or None."""
    training = _declared_training(view)
    if training is None:
        return None
    sim = copy.deepcopy(training)
    if hasattr(sim, "seed"):
        sim.seed = int(seed)
    return sim


def trainable_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` for one simulated training-time step: its trainable parameters, buffers and modules copied,
    its frozen parameters shared (a client's step reads them and changes the trainable ones only; sharing them spares
    copying the frozen backbone for every simulated upload -- most of a DP-SGD probe's simulation on MiniLM)."""
    memo = {id(p): p for p in model.parameters() if not p.requires_grad}
    return copy.deepcopy(model, memo)


def training_name(training) -> str | None:
    """The registered name of a defense object (a training-time one, or the update transform of ``defense:``)."""
    from gradleak.registry import DEFENSES

    return next((e.name for e in DEFENSES if e.obj is type(training)), None)


def training_entry(view) -> dict | None:
    """The simulated training-time defense as a cache-key entry (name and parameters), or None."""
    training = _declared_training(view)  # the declared object itself: a key needs no copy
    if training is None:
        return None
    cfg = getattr(training, "cfg", None)
    return {"name": training_name(training), "params": cfg.model_dump() if hasattr(cfg, "model_dump") else repr(cfg)}


def simulated_defenses(view) -> list[dict]:
    """The update defenses a simulated upload goes through, in the pipeline's order: the ``defenses:`` list, then an
    update transform named in ``defense:`` (:func:`defense_section_entry`)."""
    entries = list(view.public.get("update_defenses") or [])
    extra = defense_section_entry(view)
    return entries + ([extra] if extra is not None else [])


def bag_from_probs(p: torch.Tensor, vocab: list[int], k: int) -> list[int]:
    """The ``k`` most probable tokens (at least one)."""
    k = max(1, min(len(vocab), int(k)))
    return sorted(int(vocab[i]) for i in torch.topk(p, k).indices.tolist())


def energy_tensor_names(tensors: dict, width: int, k: int) -> list[str]:
    """The first ``k`` 2-D upload tensors whose input width is the embedding width ``width``: those named
    ``embedding`` first (the embedding adapter reads the token embeddings themselves), then in upload order."""
    names = [n for n, t in tensors.items() if t.dim() == 2 and t.shape[1] == width]
    return sorted(names, key=lambda n: (0 if "embedding" in n else 1, names.index(n)))[:k]


def token_directions(emb: torch.Tensor, vocab: list[int]) -> torch.Tensor:
    """Unit word embeddings of ``vocab``, centred on the whole vocabulary's mean embedding first (the shared
    component every token carries would give every token the same energy)."""
    d = emb[torch.tensor(vocab)] - emb.mean(0)
    return d / d.norm(dim=1, keepdim=True).clamp_min(1e-30)


@ATTACKS.register("learned_wordbag", "learned inversion (Wu et al. 2023): a word-bag decoder trained on simulated "
                  "defended uploads of public sentences")
class LearnedWordBag(AttackBase):
    """Honest-but-curious server holding public sentences of the same kind (``threat.public_data``)."""

    name = "learned_wordbag"
    Config = LearnedWordBagConfig
    modality = "text"
    peft_kinds = ("adapters", "lora", "none")
    reconstruction = "token_sequences"
    devices = ("cpu",)

    def __init__(self, seed: int = 0, fl: dict | None = None, public: dict | None = None, **params: Any):
        set_config_fields(self, params)
        self.seed, self.fl, self.public = int(seed), dict(fl or {}), dict(public or {})
        self._trained: dict | None = None

    @classmethod
    def requires(cls, cfg=None) -> dict[str, bool]:
        return {"public_data": True}

    @classmethod
    def measurable(cls, experiment_cfg) -> bool:
        """False under a training-time ``defense:`` (DP-SGD, dropout, ...): this slice simulates the update defenses
        only, and a decoder trained without the clients' training-time defense would be graded on a mismatch. An
        *update* transform named in ``defense:`` (e.g. ``nvflare_svt``, which ``--advise`` places there so its ε is
        reported; :class:`gradleak.defenses.base.UpdateInDefenseSection`) is simulated like the ``defenses:`` list
        (:func:`defense_section_entry`), so it is measurable."""
        d = getattr(experiment_cfg, "defense", None)
        return getattr(d, "name", "none") in (None, "none") or update_stage(d.name) or _simulated_training(d.name)

    @classmethod
    def not_measurable_reason(cls, experiment_cfg) -> str:
        return ("the learned word-bag decoder simulates the declared update defenses (defenses:, or an update "
                "transform named in defense:) and a training-time defense that replaces the client's step and changes "
                f"the upload (DP-SGD), not the training-time defense '{experiment_cfg.defense.name}'")

    @classmethod
    def from_config(cls, cfg, ctx) -> "LearnedWordBag":
        return cls(seed=ctx.seed, fl=ctx.fl, public=ctx.public, **cfg.model_dump())

    # ------------------------------------------------------------------ simulation

    def _public_split(self) -> tuple[list[str], list[str]]:
        texts = list(self.public.get("public_texts") or [])
        if len(texts) < self.heldout_sentences + 20:
            raise BadInput("threat.public_data", f"the learned word-bag decoder needs public sentences: "
                           f"{len(texts)} granted, at least {self.heldout_sentences + 20} needed "
                           f"({self.heldout_sentences} held out for its null + 20 to train on).",
                           "grant threat.public_data=true on a dataset with sentences no client holds, or lower "
                           "attack.heldout_sentences.")
        return texts[self.heldout_sentences:], texts[:self.heldout_sentences]

    def _simulator(self, view, model_sha: str):
        from gradleak.defenses import build_defenses
        from gradleak.fl.core import Client, apply_update_defenses
        from gradleak.models.text import encode_batch, text_loss

        tok, kind, task = view.public["tokenizer"], view.public.get("model_kind", "bidirectional"), view.public.get("model_task")
        loss_fn = text_loss(kind, task=task)
        model = view.model
        fl = self.fl
        algorithm = fl.get("algorithm", "fedsgd")
        sizes = fl.get("client_batch_sizes") or [int(view.public.get("batch_size") or 1)]
        B = int(sizes[0])
        lr_at = fl.get("lr_at") or [fl.get("lr", 0.01)]
        lr = float(lr_at[0])
        with torch.no_grad():
            probe = encode_batch(tok, kind, ["a"], None)
            classes = int(model(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits.shape[-1])
        entries = simulated_defenses(view)
        training = simulated_training(view, self.seed + DEFENSE_SEED_OFFSET)
        # the raw uploads (before the update defenses) are the same for every update defense: computed once per
        # process (:mod:`gradleak.attacks.common.raw_uploads`); a simulated training-time step changes them
        group = None if training is not None else group_digest(model_sha, {"attack": "learned_wordbag", "kind": kind,
                                                                       "task": task, "classes": classes, "fl": fl})

        def simulate(texts: list[str], index: int):
            enc = encode_batch(tok, kind, texts, None)
            x = torch.stack([enc["input_ids"], enc["attention_mask"]], 1)
            g = torch.Generator().manual_seed(self.seed * 7919 + index)
            y = torch.randint(classes, (len(texts),), generator=g)  # the victims' labels are private: random ones
            dseed = self.seed + DEFENSE_SEED_OFFSET + index
            # a seed the deployment pinned (params.seed) is the victims' noise: replaced, never shared
            defenses = build_defenses([{**e, "params": {**(e.get("params") or {}), "seed": dseed}}
                                       if "seed" in (e.get("params") or {}) else e for e in entries], seed=dseed)
            client = Client(index, x, y, loss_fn=loss_fn)
            if training is None:
                upd = defended_upload(client, model, group, algorithm=algorithm,
                                      epochs=int(fl.get("local_epochs") or 1), lr=lr,
                                      batch_size=fl.get("local_batch_size"), defenses=defenses, seed=dseed)
            else:  # the training-time defense's own step on a copy of the sent model, then the update list (the
                # builtin engine's order)
                upd = training.local_update(client, trainable_copy(model), seed=dseed, algorithm=algorithm, lr=lr,
                                            round_index=0, epochs=int(fl.get("local_epochs") or 1),
                                            batch_size=fl.get("local_batch_size"))
                upd = apply_update_defenses(upd, defenses, client_id=index, seed=dseed, lr=lr)
            return upd.tensors, enc

        return simulate, B

    def _features(self, view, tensors: dict, sketch: CountSketch, vocab_dirs, energy_names: list[str]):
        s = sketch(tensors)
        z = torch.zeros(vocab_dirs.shape[0]) if vocab_dirs is not None else torch.zeros(0)
        for n in energy_names:
            G = tensors[n].detach().float().cpu()
            tot = float((G * G).sum())
            if tot > 0:
                z = z + torch.log(((vocab_dirs @ G.T) ** 2).sum(1) / tot + 1e-12)
        return z, s

    def _key(self, view, train: list[str], held: list[str], model_sha: str) -> str:
        h = hashlib.sha256(Path(__file__).read_bytes())  # this module's code: a changed decoder never reads an old one
        h.update(model_sha.encode())  # the sent model's weights (:func:`gradleak.attacks.common.raw_uploads.model_digest`)
        names = sorted(view.updates[0].tensors)
        params = {k: getattr(self, k) for k in LearnedWordBagConfig.model_fields if k != "cache"}
        h.update(json.dumps({"v": CACHE_VERSION, "trainable": names, "defenses": simulated_defenses(view),
                             "training": training_entry(view),
                             "fl": self.fl, "params": params, "seed": self.seed,
                             "batch": view.public.get("batch_size")}, sort_keys=True, default=str).encode())
        h.update("\n".join(train).encode())
        h.update(b"\x00")
        h.update("\n".join(held).encode())
        return h.hexdigest()[:24]

    def _train(self, view) -> dict:
        """Train (or load) the decoder and its null bags for this view's model, defenses and public data."""
        train, held = self._public_split()
        model_sha = model_digest(view.model)
        key = self._key(view, train, held, model_sha)
        path = cache_dir() / f"{key}.pt"
        if self.cache and path.is_file():
            t0 = time.perf_counter()
            state = torch.load(path, weights_only=False)
            state["cache_hit"], state["load_seconds"] = True, time.perf_counter() - t0
            return state
        t0 = time.perf_counter()
        simulate, B = self._simulator(view, model_sha)
        tok = view.public["tokenizer"]
        special = set(getattr(tok, "all_special_ids", []) or [])
        shapes = {n: tuple(t.shape) for n, t in view.updates[0].tensors.items()}
        sketch = CountSketch(shapes, self.sketch_dim, self.projection_seed)
        emb = view.model.get_input_embeddings().weight.detach().float().cpu()
        energy_names = energy_tensor_names(view.updates[0].tensors, emb.shape[1], self.energy_tensors)
        rng = np.random.default_rng(self.seed + 31)
        batches = [[train[i] for i in rng.choice(len(train), size=min(B, len(train)), replace=False)]
                   for _ in range(self.public_batches)]
        null_batches = [[held[i] for i in rng.choice(len(held), size=min(B, len(held)), replace=False)]
                        for _ in range(self.null_batches)]
        from collections import Counter

        held_by = Counter(t for texts in batches for t in {t for s in texts
                                                            for t in tok(s, add_special_tokens=False)["input_ids"]})
        vocab = sorted(t for t, c in held_by.items() if c >= self.min_count and t not in special)
        pos = {t: i for i, t in enumerate(vocab)}
        dirs = token_directions(emb, vocab) if energy_names else None
        Z, S, Y = [], [], torch.zeros(len(batches), len(vocab))
        for i, texts in enumerate(batches):
            tensors, enc = simulate(texts, i)
            z, s = self._features(view, tensors, sketch, dirs, energy_names)
            Z.append(z), S.append(s)
            for t in enc["input_ids"][enc["attention_mask"].bool()].tolist():
                if t in pos:
                    Y[i, pos[t]] = 1.0
        t_sim = time.perf_counter() - t0
        Z, S = torch.stack(Z), torch.stack(S)
        mu, sd = Z.mean(0), Z.std(0).clamp_min(1e-12) if len(Z) > 1 else torch.ones(Z.shape[1])
        dec = WordBagDecoder(len(vocab), self.sketch_dim)
        opt = torch.optim.Adam(dec.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        with torch.no_grad():  # start from the public prior (each token's frequency)
            f = Y.mean(0).clamp(1e-4, 1 - 1e-4)
            dec.a.copy_(torch.log(f / (1 - f)))
        Zs = (Z - mu) / sd if Z.shape[1] else torch.zeros(len(S), len(vocab))
        t1 = time.perf_counter()
        for _ in range(self.epochs):
            opt.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(dec(Zs, S), Y)
            loss.backward()
            opt.step()
        train_loss = float(loss.detach())
        state = {"vocab": vocab, "bag_size": max(1, int(round(float(Y.sum(1).mean())))), "simulate_seconds": t_sim, "decoder": dec.state_dict(), "mu": mu, "sd": sd, "energy_names": energy_names,
                 "sketch_dim": self.sketch_dim, "key": key, "train_loss": train_loss,
                 "public_train_sentences": len(train), "public_batches": len(batches),
                 "fit_seconds": time.perf_counter() - t1}
        # the null: held-out public batches through the same simulation, defenses and decoder
        nulls = []
        for j, texts in enumerate(null_batches):
            tensors, _ = simulate(texts, self.public_batches + j)
            nulls.append(self._predict(state, dec, tensors, sketch, dirs))
        state["null_word_bags"] = nulls
        state["train_seconds"] = time.perf_counter() - t0
        state["cache_hit"] = False
        if self.cache:
            from gradleak.atomic import atomic_path

            with atomic_path(path) as tmp:
                torch.save(state, tmp)
        return state

    def _predict(self, state: dict, dec: WordBagDecoder, tensors: dict, sketch: CountSketch, dirs) -> list[int]:
        z, s = self._features(None, tensors, sketch, dirs, state["energy_names"])
        zs = (z - state["mu"]) / state["sd"] if z.numel() else torch.zeros(len(state["vocab"]))
        with torch.no_grad():
            p = torch.sigmoid(dec(zs[None], s[None]))[0]
        return bag_from_probs(p, state["vocab"], state["bag_size"])

    # ------------------------------------------------------------------ attack

    def reconstruct(self, view) -> Reconstruction:
        if not view.updates:
            raise BadInput("threat", "no upload observed.", "observe at least one round.")
        t0 = time.perf_counter()
        state = self._train(view)
        dec = WordBagDecoder(len(state["vocab"]), state["sketch_dim"])
        dec.load_state_dict(state["decoder"])
        shapes = {n: tuple(t.shape) for n, t in view.updates[0].tensors.items()}
        sketch = CountSketch(shapes, state["sketch_dim"], self.projection_seed)
        dirs = None
        if state["energy_names"]:
            dirs = token_directions(view.model.get_input_embeddings().weight.detach().float().cpu(), state["vocab"])
        bag = self._predict(state, dec, view.updates[0].tensors, sketch, dirs)
        info = {"word_bag": bag, "null_word_bags": state["null_word_bags"], "decoder_key": state["key"],
                "decoder_cache_hit": bool(state["cache_hit"]), "decoder_vocabulary": len(state["vocab"]),
                "decoder_train_loss": state["train_loss"], "energy_tensors": list(state["energy_names"]),
                "public_batches": state["public_batches"], "decoder_bag_size": state["bag_size"],
                "decoder_simulate_seconds": state.get("simulate_seconds"), "decoder_fit_seconds": state.get("fit_seconds"), "null_batches": len(state["null_word_bags"]),
                "word_bag_seconds": time.perf_counter() - t0}
        metrics = {"decoder_train_seconds": float(state.get("train_seconds", float("nan"))) if not state["cache_hit"]
                   else 0.0, "decoder_cache_hit": float(bool(state["cache_hit"])),
                   "decoder_public_batches": float(state["public_batches"]),
                   "learned_attack_seconds": time.perf_counter() - t0}
        if not math.isfinite(state["train_loss"]):
            info["failure"] = "the decoder's training loss is not finite"
        return Reconstruction(data=[], info=info, metrics=metrics)
