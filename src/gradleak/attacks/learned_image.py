"""Learned inversion of a defended image upload (Wu, Chen, Liu, Gu, "Learning to Invert", UAI 2023, Sec. 3: a decoder
trained on (defended gradient -> input) pairs the server makes from public data; its two-stage form -- a coarse
reconstruction refined by a learned decoder -- follows ROG, Yue et al., USENIX Security 2023, Sec. 4). The image
slice of :mod:`gradleak.attacks.learned_wordbag` (the text slice); not one of the five papers of docs/PAPERS.md.

The server knows the model it sent, the PEFT and the declared update defenses (Kerckhoffs: they are in its own
configuration; ``view.public["update_defenses"]``, docs/ARCHITECTURE.md "The threat model"). From public images of
the private set's own source (``threat.public_data``: the held-out *prior* split, ``data.prior_size`` images no client,
validation set or null pool holds; :meth:`gradleak.data.splits.ImageData.prior_images`) it simulates the client's
upload exactly as a client makes it (:meth:`gradleak.fl.core.Client.local_update`: the public protocol's algorithm,
epochs, batch size and lr, the client's classification loss, random labels -- the victim's is private) and passes it
through the *same defense objects* (:func:`gradleak.defenses.build_defenses` on the declared list), seeded apart
from the victims' (``seed`` + :data:`DEFENSE_SEED_OFFSET` + the upload's index; a seed the deployment pins is
replaced). It then learns (defended upload -> image) and reads the victim's upload with it.

Decisions the papers leave open (each a parameter):

* **Compression / coarse stage** (so training fits a CPU): the decoder never sees the upload itself, only a fixed
  analytic map of it -- the per-patch least-squares image of block 0's LoRA-A row space (:mod:`gradleak.attacks.
  lora_span`, the token-count cut ``rank_cut: tokens``: the B (N + 1) strongest right singular vectors of the
  stacked block-0 q/k/v LoRA-A gradients, a truncated SVD, so no rank is decided from a gap the defense may have
  erased), unclipped. On an undefended upload this map is exact; under a defense it is a noisy image, the ROG
  "low-resolution" stage. It needs LoRA on block 0 of a ViT (otherwise BadInput, as lora_span).
* **Decoder**: a learned linear filter (a ``kernel`` × ``kernel`` convolution from the coarse image's channels to
  the image's, the same at every position, plus each pixel's public mean), fitted by ridge regression (relative
  penalty ``ridge``) on the simulated pairs: a Wiener filter that knows the defense's distortion from the
  simulations. 3 k² C weights per output channel: a few hundred public images fit it (``gradleak audit
  configs/audit/vit_lora.yaml --only learned_image`` under 8-bit stochastic quantisation, 192 training uploads: on the
  64 held-out public uploads 15.1 dB mean PSNR against 13.9 dB for the coarse image alone,
  ``decoder_heldout_psnr`` / ``coarse_heldout_psnr``; a development fit on natural-crops instead of the private set's
  source gained nothing on Fashion-MNIST, hence the prior split). Output clipped to [0, 1].
* **Null through the same decoder** (docs/DESIGN.md §6 "every headline metric has a null", "A learned attacker is
  graded through its own decoder"): ``null_images`` public images held out of training go through the same
  simulation, defenses and decoder; their reconstructions are ``info["null_images"]``. The ``images`` unit
  (:func:`gradleak.evaluation.images.null_images`) grades the victim's PSNR / SSIM against, draw for draw, the larger
  of a random held-out image's and a decoder image's, so a decoder that only learned the public mean (or a blur of
  it) is at chance. ``decoder_heldout_psnr``: the decoder's mean PSNR on those held-out public images against
  their own originals (public data only: how well it inverts, not a leak of the victim).
* **Cache**: a trained decoder and its null images are stored under ``$GRADLEAK_CACHE/learned_image/<hash>.pt``
  (written atomically, :func:`gradleak.atomic.atomic_path`), the hash over this module's source, the sent model's
  weights, the trainable names, the declared defenses, the public protocol, the public images, the batch size, the
  seed and every parameter of this attack.

Limits of this slice: training-time defenses (DP-SGD, dropout) are not simulated (an update transform named in
``defense:``, e.g. SVT, is) -- under one the attack is not applicable (``measurable``); a batch of B > 1 gives one
image (the coarse stage then mixes the batch's tokens, as lora_span reports), trained against the batch's first
image.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any

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
#: the coarse image is clamped to this range (model pixels in [-1, 1] map to [0, 1]: a solve that blew up under
#: noise stays finite; the filter then learns how much of it to trust)
COARSE_CLAMP = (-4.0, 5.0)


class LearnedImageConfig(AttackConfig):
    null_images: int = Field(64, ge=8, description="public images held out of training: the decoder's null")
    train_images: int | None = Field(None, ge=8, description="public images to train on (default: every prior-split "
                                     "image not held out; at most that)")
    kernel: int = Field(5, ge=1, le=15, description="side of the learned filter (odd)")
    ridge: float = Field(1e-2, ge=0, description="ridge penalty of the filter, relative to the mean diagonal of its "
                         "normal matrix")
    cache: bool = Field(True, description="reuse / store the trained decoder under $GRADLEAK_CACHE/learned_image")


def cache_dir() -> Path:
    """``$GRADLEAK_CACHE/learned_image`` (default ``~/.cache/gradleak/learned_image``)."""
    return Path(os.environ.get("GRADLEAK_CACHE") or Path.home() / ".cache" / "gradleak").expanduser() / "learned_image"


def _patches(x: torch.Tensor, k: int) -> torch.Tensor:
    """N × C × S × S -> (N·S·S) × (C·k²): each pixel's k × k neighbourhood (zero padded)."""
    u = torch.nn.functional.unfold(x, k, padding=k // 2)  # N × Ck² × S²
    return u.transpose(1, 2).reshape(-1, u.shape[1])


def fit_filter(coarse: torch.Tensor, target: torch.Tensor, k: int, ridge: float) -> dict:
    """Ridge fit of ``target - mean(target) ≈ filter * (coarse - mean(coarse))`` (module docstring, "Decoder")."""
    cm, tm = coarse.mean(0), target.mean(0)
    U = _patches(coarse - cm, k)
    T = (target - tm).reshape(len(target), target.shape[1], -1).transpose(1, 2).reshape(-1, target.shape[1])
    A = U.T @ U
    A = A + ridge * float(A.diagonal().mean().clamp_min(1e-30)) * torch.eye(len(A), dtype=A.dtype)
    W = torch.linalg.solve(A, U.T @ T)
    return {"coarse_mean": cm, "target_mean": tm, "weight": W, "kernel": k}


def apply_filter(f: dict, coarse: torch.Tensor) -> torch.Tensor:
    """The decoder's images in [0, 1] for coarse images ``coarse`` (N × C × S × S)."""
    U = _patches(coarse - f["coarse_mean"], f["kernel"]).reshape(len(coarse), -1, f["weight"].shape[0])
    C, S = f["target_mean"].shape[0], f["target_mean"].shape[-1]
    out = (U @ f["weight"]).transpose(1, 2).reshape(len(coarse), C, S, S) + f["target_mean"]
    return out.clamp(0, 1)


@ATTACKS.register("learned_image", "learned inversion (Wu et al. 2023; ROG): a filter trained on simulated defended "
                  "uploads of public images refines block 0's LoRA-span image")
class LearnedImage(AttackBase):
    """Honest-but-curious server holding held-out images of the private set's source (``threat.public_data``)."""

    name = "learned_image"
    Config = LearnedImageConfig
    modality = "image"
    peft_kinds = ("lora",)
    reconstruction = "images"
    devices = ("cpu", "cuda")
    uses_prior = True  # the pipeline holds data.prior_size images out: the decoder's public training images

    def __init__(self, seed: int = 0, fl: dict | None = None, public: dict | None = None, **params: Any):
        set_config_fields(self, params)
        self.seed, self.fl, self.public = int(seed), dict(fl or {}), dict(public or {})

    @classmethod
    def requires(cls, cfg=None) -> dict[str, bool]:
        return {"public_data": True}

    @classmethod
    def measurable(cls, experiment_cfg) -> bool:
        """False under a training-time ``defense:`` (DP-SGD, dropout, ...): this slice simulates the update defenses
        only, and a decoder trained without the clients' training-time defense would be graded on a mismatch. An
        *update* transform named in ``defense:`` (``nvflare_svt``, which ``--advise`` places there) is simulated after
        the ``defenses:`` list, as the pipeline applies it (:func:`gradleak.attacks.learned_wordbag.simulated_defenses`),
        so it is measurable."""
        from gradleak.attacks.learned_wordbag import update_stage

        d = getattr(experiment_cfg, "defense", None)
        return getattr(d, "name", "none") in (None, "none") or update_stage(d.name)

    @classmethod
    def not_measurable_reason(cls, experiment_cfg) -> str:
        return ("the learned image decoder simulates the declared update defenses (defenses:, or an update transform "
                "named in defense:) only, not the "
                f"training-time defense '{experiment_cfg.defense.name}'; declare it under defenses: if it is an update "
                "transform")

    @classmethod
    def from_config(cls, cfg, ctx) -> "LearnedImage":
        return cls(seed=ctx.seed, fl=ctx.fl, public=ctx.public, **cfg.model_dump())

    # ------------------------------------------------------------------ data and simulation

    def _public_split(self, view) -> tuple[torch.Tensor, torch.Tensor]:
        imgs = view.public.get("prior_images")
        if imgs is None:
            imgs = self.public.get("prior_images")
        n = 0 if imgs is None else len(imgs)
        if n < self.null_images + 8:
            raise BadInput("data.prior_size", f"the learned image decoder trains on the held-out prior split of the "
                           f"private set's source: {n} images granted, at least {self.null_images + 8} needed "
                           f"({self.null_images} held out for its null + 8 to train on).",
                           "grant threat.public_data=true and raise data.prior_size (e.g. 256), or lower "
                           "attack.null_images.")
        imgs = imgs.detach().to(torch.float32).cpu()
        train = imgs[self.null_images:]
        if self.train_images is not None:
            train = train[:self.train_images]
        return train, imgs[:self.null_images]

    def _simulator(self, view, model_sha: str):
        from gradleak.attacks.learned_wordbag import simulated_defenses
        from gradleak.defenses import build_defenses
        from gradleak.fl.core import Client, default_classification_loss

        model, fl = view.model, self.fl
        p0 = next(model.parameters())
        algorithm = fl.get("algorithm", "fedsgd")
        sizes = fl.get("client_batch_sizes") or [int(view.public.get("batch_size") or 1)]
        B = int(sizes[0])
        lr = float((fl.get("lr_at") or [fl.get("lr", 0.01)])[0])
        classes = int(view.public.get("num_classes") or 2)
        entries = simulated_defenses(view)
        # the raw uploads (before the update defenses) are the same for every update defense: computed once per
        # process (:mod:`gradleak.attacks.common.raw_uploads`)
        group = group_digest(model_sha, {"attack": "learned_image", "classes": classes, "fl": fl,
                                     "dtype": str(p0.dtype), "device": str(p0.device)})

        def simulate(images01: torch.Tensor, index: int):
            x = (images01.to(p0.dtype) * 2 - 1).to(p0.device)  # the image modality's encoding (model reads [-1, 1])
            g = torch.Generator().manual_seed(self.seed * 7919 + index)
            y = torch.randint(classes, (len(x),), generator=g).to(p0.device)  # the victim's labels are private
            dseed = self.seed + DEFENSE_SEED_OFFSET + index
            defenses = build_defenses([{**e, "params": {**(e.get("params") or {}), "seed": dseed}}
                                       if "seed" in (e.get("params") or {}) else e for e in entries], seed=dseed)
            client = Client(index, x, y, loss_fn=default_classification_loss)
            return defended_upload(client, model, group, algorithm=algorithm, epochs=int(fl.get("local_epochs") or 1),
                                   lr=lr, batch_size=fl.get("local_batch_size"), defenses=defenses, seed=dseed)

        return simulate, B

    def _coarse(self, view, upd) -> torch.Tensor:
        """The coarse stage: lora_span's per-patch image at the token-count cut, unclipped, in [0, 1] units."""
        from gradleak.attacks.lora_span import LoraSpan
        from gradleak.fl.core import ServerView

        span = LoraSpan(rank_cut="tokens", clip=False, time_fwdbwd=False)
        sub = ServerView(model=view.model, updates=[upd], public={k: view.public[k] for k in
                                                                  ("image_shape", "batch_size") if k in view.public},
                         round_states=list(view.round_states or [])[-1:])
        with torch.no_grad():
            x = span.reconstruct(sub).data["images"][:1].to(torch.float64)
        return torch.nan_to_num(x, nan=0.5, posinf=COARSE_CLAMP[1], neginf=COARSE_CLAMP[0]).clamp(*COARSE_CLAMP)

    def _key(self, view, train: torch.Tensor, held: torch.Tensor, model_sha: str) -> str:
        from gradleak.attacks.learned_wordbag import simulated_defenses

        h = hashlib.sha256(Path(__file__).read_bytes())  # this module's code: a changed decoder never reads an old one
        h.update(model_sha.encode())  # the sent model's weights (:func:`gradleak.attacks.common.raw_uploads.model_digest`)
        params = {k: getattr(self, k) for k in LearnedImageConfig.model_fields if k != "cache"}
        h.update(json.dumps({"v": CACHE_VERSION, "trainable": sorted(view.updates[0].tensors),
                             "defenses": simulated_defenses(view), "fl": self.fl, "params": params,
                             "seed": self.seed, "batch": view.public.get("batch_size"),
                             "shape": list(view.public.get("image_shape") or [])}, sort_keys=True,
                            default=str).encode())
        h.update(train.numpy().tobytes())
        h.update(b"\x00")
        h.update(held.numpy().tobytes())
        return h.hexdigest()[:24]

    def _train(self, view) -> dict:
        """Train (or load) the decoder and its null images for this view's model, defenses and public images."""
        train, held = self._public_split(view)
        model_sha = model_digest(view.model)
        key = self._key(view, train, held, model_sha)
        path = cache_dir() / f"{key}.pt"
        if self.cache and path.is_file():
            t0 = time.perf_counter()
            state = torch.load(path, weights_only=False)
            state["cache_hit"], state["load_seconds"] = True, time.perf_counter() - t0
            return state
        if self.kernel % 2 == 0:
            raise BadInput("attack.kernel", f"the filter's side must be odd, got {self.kernel}.", "use e.g. 3, 5 or 7.")
        t0 = time.perf_counter()
        simulate, B = self._simulator(view, model_sha)
        batches = [train[i:i + B] for i in range(0, len(train) - B + 1, B)]
        null_batches = [held[i:i + B] for i in range(0, len(held) - B + 1, B)]
        coarse = torch.cat([self._coarse(view, simulate(x, i)) for i, x in enumerate(batches)])
        target = torch.stack([x[0] for x in batches]).to(torch.float64)
        t_sim = time.perf_counter() - t0
        t1 = time.perf_counter()
        filt = fit_filter(coarse, target, self.kernel, self.ridge)
        fit = apply_filter(filt, coarse)
        train_psnr = _psnr(fit, target)
        t_fit = time.perf_counter() - t1
        nulls = torch.cat([self._coarse(view, simulate(x, len(batches) + j)) for j, x in enumerate(null_batches)])
        null_images = apply_filter(filt, nulls)
        heldout = _psnr(null_images, torch.stack([x[0] for x in null_batches]).to(torch.float64))
        state = {"filter": filt, "null_images": null_images.to(torch.float32), "key": key,
                 "train_psnr": float(train_psnr.mean()), "heldout_psnr": float(heldout.mean()),
                 "coarse_heldout_psnr": float(_psnr(nulls.clamp(0, 1), torch.stack([x[0] for x in null_batches])
                                                    .to(torch.float64)).mean()),
                 "public_images": len(batches), "simulate_seconds": t_sim, "fit_seconds": t_fit,
                 "train_seconds": time.perf_counter() - t0, "cache_hit": False}
        if self.cache:
            from gradleak.atomic import atomic_path

            with atomic_path(path) as tmp:
                torch.save(state, tmp)
        return state

    # ------------------------------------------------------------------ attack

    def reconstruct(self, view) -> Reconstruction:
        if not view.updates:
            raise BadInput("threat", "no upload observed.", "observe at least one round.")
        t0 = time.perf_counter()
        state = self._train(view)
        img = apply_filter(state["filter"], self._coarse(view, view.updates[0])).to(torch.float32)
        info = {"null_images": state["null_images"], "decoder_key": state["key"],
                "decoder_cache_hit": bool(state["cache_hit"]), "decoder_public_images": state["public_images"],
                "decoder_train_psnr": state["train_psnr"], "decoder_heldout_psnr": state["heldout_psnr"],
                "coarse_heldout_psnr": state["coarse_heldout_psnr"],
                "decoder_simulate_seconds": state.get("simulate_seconds"),
                "decoder_fit_seconds": state.get("fit_seconds")}
        metrics = {"decoder_train_seconds": float(state.get("train_seconds", float("nan"))) if not state["cache_hit"]
                   else 0.0, "decoder_cache_hit": float(bool(state["cache_hit"])),
                   "decoder_public_images": float(state["public_images"]),
                   "decoder_heldout_psnr": float(state["heldout_psnr"]),
                   "coarse_heldout_psnr": float(state["coarse_heldout_psnr"]),
                   "learned_attack_seconds": time.perf_counter() - t0}
        if not math.isfinite(state["train_psnr"]):
            info["failure"] = "the decoder's training fit is not finite"
        return Reconstruction({"images": img}, info, metrics)


def _psnr(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-image PSNR (dB) of images in [0, 1]."""
    mse = ((x.clamp(0, 1) - y) ** 2).flatten(1).mean(1).clamp_min(1e-12)
    return -10 * torch.log10(mse)

