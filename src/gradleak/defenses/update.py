"""Update transforms applied by the client before upload (PEFTLeak Fig. 21; UTR Table 3).

Each defense is a registered :class:`~gradleak.defenses.base.UpdateDefense` with a pydantic ``Config`` and
``apply(update, ctx) -> update``. Randomness is seeded from the defense's ``seed`` and the client id in ``ctx`` so runs
are reproducible.
"""

from __future__ import annotations

import torch
from pydantic import Field

from gradleak.defenses.base import DefenseConfig, DefenseParams, UpdateDefense, build_defenses
from gradleak.errors import BadInput
from gradleak.fl.core import Update
from gradleak.registry import DEFENSES


def _gen(ctx: dict, seed: int) -> torch.Generator:
    """Seeded per defense, client and round (``ctx["seed"]`` differs per round), so noise never repeats."""
    return torch.Generator().manual_seed(int(seed) * 1_000_003 + int(ctx.get("client_id", 0)) * 7_919
                                         + int(ctx.get("seed", 0)))


@DEFENSES.register("gaussian_noise", "add N(0, std^2) noise; std absolute, relative to the update's L2 norm, or "
                   "per_coordinate: std = noise-to-signal ratio x ||update|| / sqrt(#coordinates)")
class GaussianNoise(UpdateDefense):
    """``relative``: std x ||update||; ``per_coordinate``: std x ||update|| / sqrt(P) for P coordinates, so ``std``
    is the noise-to-signal ratio of the whole upload (E||noise|| = std ||update||)."""

    class Config(DefenseParams):
        std: float = Field(description="noise std (absolute, or a ratio: relative / per_coordinate)")
        relative: bool = Field(False, description="std x ||update||")
        per_coordinate: bool = Field(False, description="std x ||update|| / sqrt(#coordinates)")
        seed: int = Field(0, description="noise seed (default: the run's seed)")

    seeded = True
    advice = (
        {"stage": "update", "param": "std", "weak": 1e-3, "strong": 10.0, "scale": "log", "fixed": {},
         "mode": {"per_coordinate": True}, "what": "noise std as a multiple of the update's per-coordinate RMS",
         "order": 0, "rank": 3},
        {"key": "gaussian_noise_absolute", "stage": "update", "param": "std", "weak": 1e-7, "strong": 0.1,
         "scale": "log", "fixed": {}, "mode": {"per_coordinate": False, "relative": False},
         "what": "absolute noise std per coordinate (on the update's own scale)", "order": 1, "rank": 4},
    )

    def setup(self) -> None:
        c = self.cfg
        if c.std < 0:
            raise BadInput("defenses.gaussian_noise.std", f"std must be >= 0, got {c.std}.", "use a non-negative std.")
        if c.relative and c.per_coordinate:
            raise BadInput("defenses.gaussian_noise", "relative and per_coordinate are exclusive.",
                           "set one of them (per_coordinate: std is the noise-to-signal ratio).")
        self.std, self.relative, self.per_coordinate, self.seed = c.std, c.relative, c.per_coordinate, c.seed

    def apply(self, update: Update, ctx: dict) -> Update:
        g = _gen(ctx, self.seed)
        scale = self.std * (update.norm() if self.relative else 1.0)
        if self.per_coordinate:
            scale = self.std * update.norm() / max(sum(t.numel() for t in update.tensors.values()), 1) ** 0.5
        return update.map(lambda _, t: t + scale * torch.randn(t.shape, generator=g, dtype=torch.float64).to(t))

    def server_knowledge(self) -> dict:
        return {"adds_noise": self.std > 0}

    def observed_noise_variance(self, update: Update, aggregate_of: int = 1, individual: bool = True,
                                tensor: str | None = None) -> float:
        """The same on every tensor (``tensor`` is ignored). For noise relative to the update's norm, std = s ||g||, and the server estimates ||g|| from the noisy
        upload: E||g + n||² = ||g||² (1 + P s²) for P coordinates."""
        P = sum(t.numel() for t in update.tensors.values())
        std = self.std
        if self.relative:
            std = std * update.norm() / (1 + P * std * std) ** 0.5
        elif self.per_coordinate:  # ||g + n||² ≈ ||g||² (1 + std²)
            std = std * update.norm() / (1 + std * std) ** 0.5 / P ** 0.5
        return std * std / (1 if individual else aggregate_of)


def _percentile(values: torch.Tensor, q: float) -> torch.Tensor:
    """``np.percentile(values, q)`` (linear interpolation) via ``kthvalue`` (no 2^24-entry limit)."""
    n = values.numel()
    pos = q / 100.0 * (n - 1)
    lo, hi = int(pos // 1), min(int(pos // 1) + 1, n - 1)
    a = values.kthvalue(lo + 1).values
    b = values.kthvalue(hi + 1).values if hi != lo else a
    return a + (b - a) * (pos - lo)


@DEFENSES.register("percentile_noise", "Gaussian noise σ = σ0 × p-th percentile of |Δw| (Hatamizadeh et al. 2022; "
                   "NVFlare GaussianPrivacy); BN buffer changes included; per-tensor variant; or an absolute σ. "
                   "Also as `defense: {name: percentile_noise, sigma0: ...}`")
class PercentileNoise(UpdateDefense):
    """Noise on every entry of the update, σ relative to a percentile of its absolute values.

    Registered as ``percentile_noise`` (the name the configs and the paper's reproduction use) and, for older
    ``defenses:`` lists, as ``gaussian_percentile``: one class, so both names draw the same noise. In the
    ``defense:`` section it trains nothing and runs after the ``defenses:`` list
    (:class:`~gradleak.defenses.base.UpdateInDefenseSection`), so ``--set defense.sigma0=25`` sweeps it; its report
    is ``noise_sigma0``.

    Hatamizadeh et al. 2022 §II-C: σ = σ0 × (95th percentile of the absolute update values), the
    percentile chosen to reduce outlier influence; noise added to every entry. Readings and decisions, recorded:

    * **Scale.** NVFlare's ``GaussianPrivacy`` filter acts on the shared weight *difference* Δw (and the
      running-statistics changes, which travel in the same dictionary). gradleak's FedAvg upload is
      ``Δw / −lr`` (:mod:`gradleak.fl.core`), so the percentile and the noise are computed on the Δw scale
      (parameter entries × ``ctx["lr"]``, BN buffer changes as they are) and the parameter noise is divided
      by lr again. Without ``lr`` in ``ctx`` (a direct call) the upload's own scale is used.
    * **Which entries.** NVFlare takes the percentile over the **non-zero** absolute values of all entries
      concatenated (``per_tensor=False``); the paper's wording also allows one percentile per tensor
      (``per_tensor=True``: each tensor's noise scales with its own percentile). ``include_buffers``
      (default true, as NVFlare) adds the BN ``running_mean``/``running_var`` changes to both the
      percentile and the noise; ``num_batches_tracked`` (an integer step counter, which the server knows
      from the training configuration) is left unchanged. Measured before this choice: with the global
      percentile the parameter entries set σ while the BN-buffer changes are ~10⁴ times larger, so the
      buffers barely notice the noise.
    * **Absolute σ** (``absolute=True``): σ = ``sigma0`` on the Δw scale (the paper's σ = 10⁻² example).
    * σ0 = 0 returns the update unchanged; σ0 < 0 is refused. Seeded per defense, client and round.
    """

    class Config(DefenseParams):
        sigma0: float = Field(0.0, le=1e9, description="σ = σ0 × percentile of |update| (0: no noise; < 0 refused)")
        percentile: float = Field(95.0, description="the percentile (the paper's: 95)")
        per_tensor: bool = Field(False, description="one percentile per tensor instead of over all entries (NVFlare)")
        include_buffers: bool = Field(True, description="BN running-statistics changes in the percentile and noised")
        absolute: bool = Field(False, description="σ = sigma0 itself (on the Δw scale), e.g. the paper's 1e-2")
        seed: int = Field(0, description="noise seed (default: the run's seed)")

    seeded = True
    modalities = ("image", "text")
    advice = ({"stage": "update", "param": "sigma0", "weak": 1e-2, "strong": 100.0, "scale": "log", "fixed": {},
               "what": "noise std as a multiple of the 95th percentile of |update|", "order": 2, "rank": 8},)

    def setup(self) -> None:
        c = self.cfg
        if c.sigma0 < 0:
            raise BadInput("defense.sigma0", f"σ0 must be ≥ 0, got {c.sigma0}.",
                           "use σ0 = 0 (no noise) or a positive multiple of the percentile (e.g. 10, 25, 50).")
        if not 0 < c.percentile <= 100:
            raise BadInput("defense.percentile", f"the percentile must be in (0, 100], got {c.percentile}.",
                           "use e.g. 95 (the paper's).")
        self.sigma0, self.percentile, self.per_tensor = c.sigma0, c.percentile, c.per_tensor
        self.include_buffers, self.absolute, self.seed = c.include_buffers, c.absolute, c.seed

    def _entries(self, update: Update, scale: float) -> dict[str, tuple[torch.Tensor, float]]:
        """Name -> (tensor, factor to the Δw scale) of every entry that is noised."""
        out = {f"p:{k}": (t, scale) for k, t in update.tensors.items()}
        if self.include_buffers and update.buffers is not None:
            out.update({f"b:{k}": (t, 1.0) for k, t in update.buffers.items()
                        if not k.endswith("num_batches_tracked")})
        return out

    def sigmas(self, update: Update, ctx: dict) -> dict[str, float]:
        """σ on the Δw scale: one value for every entry (``per_tensor=False``) or one per tensor."""
        scale = float(ctx.get("lr", 1.0))
        entries = self._entries(update, scale)
        if self.absolute:
            return {k: self.sigma0 for k in entries}

        def pct(ts) -> float:
            v = torch.cat([(t.detach().to(torch.float64).reshape(-1) * f).abs() for t, f in ts])
            v = v[v > 0]
            return float(_percentile(v, self.percentile)) if v.numel() else 0.0

        if self.per_tensor:
            return {k: self.sigma0 * pct([e]) for k, e in entries.items()}
        s = self.sigma0 * pct(list(entries.values()))
        return {k: s for k in entries}

    def apply(self, update: Update, ctx: dict) -> Update:
        if self.sigma0 == 0:
            return update
        g = _gen(ctx, self.seed)
        scale = float(ctx.get("lr", 1.0))
        sig = self.sigmas(update, ctx)

        def noised(t: torch.Tensor, s: float) -> torch.Tensor:
            return t + (s * torch.randn(t.shape, generator=g, dtype=torch.float64)).to(t)

        tensors = {k: noised(t, sig[f"p:{k}"] / scale) for k, t in update.tensors.items()}
        buffers = update.buffers
        if buffers is not None and self.include_buffers:
            buffers = {k: (noised(t, sig[f"b:{k}"]) if f"b:{k}" in sig else t) for k, t in buffers.items()}
        return Update(tensors, update.num_samples, update.client_id, update.kind, update.local_steps, buffers)

    #: :meth:`observed_noise_variance` needs the round's lr (the percentile is taken on the Δw scale)
    observed_noise_needs_lr = True

    def observed_noise_variance(self, update: Update, aggregate_of: int = 1, individual: bool = True,
                                tensor: str | None = None, lr: float | None = None) -> float | None:
        """The per-coordinate noise variance on the observed tensor scale, **read off the noisy upload**: σ follows
        the clean update's percentile p, which the server does not see, but the percentile of the noisy entries
        is p_obs² ≈ p² + (z σ)² with σ = σ0 p and z = Φ⁻¹((1 + q/100)/2) (1.96 for q = 95; the q-th percentile of
        |N(0, σ²)| is z σ), so p = p_obs / (1 + (z σ0)²)^{1/2}. Exact in both limits (σ0 → 0: p_obs = p;
        σ0 → ∞: p_obs = z σ); in between the percentile of a sum of independent |x| and |n| sits within a few
        per cent of the quadrature sum for the bell-shaped gradient entries the attacks see (measured in
        ``tests/test_guarantees_defenses.py``). ``per_tensor``: the percentile of ``tensor`` (None without a
        name). Under secure aggregation the clients' σ differ with their own percentiles and only their sum is
        observed: None (the scale is read off the spectrum). ``lr``: the round's lr (the Δw scale); parameter
        entries only when it is unknown."""
        if self.sigma0 == 0:
            return 0.0
        if not individual:
            return None
        scale = float(lr) if lr else 1.0
        if self.absolute:
            std = self.sigma0
        else:
            entries = self._entries(update, scale)
            if self.per_tensor:
                if tensor is None or f"p:{tensor}" not in entries:
                    return None
                entries = {f"p:{tensor}": entries[f"p:{tensor}"]}
            v = torch.cat([(t.detach().to(torch.float64).reshape(-1) * f).abs() for t, f in entries.values()])
            v = v[v > 0]
            if not v.numel():
                return 0.0
            z = float(torch.special.ndtri(torch.tensor((1 + self.percentile / 100) / 2, dtype=torch.float64)))
            p_obs = float(_percentile(v, self.percentile))
            std = self.sigma0 * p_obs / (1 + (z * self.sigma0) ** 2) ** 0.5
        std /= scale  # parameter tensors are observed on the gradient scale (Δw / lr)
        return std * std

    def server_knowledge(self) -> dict:
        # the scale is not part of the protocol: it is read off the upload (observed_noise_variance); the attacks
        # that model the noise level also read it off the spectrum
        return {"noise_unknown": True, "adds_noise": self.sigma0 > 0}

    def report(self, rounds: list) -> dict[str, float]:
        return {"noise_sigma0": float(self.sigma0)}


DEFENSES.alias("gaussian_percentile", "percentile_noise")


@DEFENSES.register("clipping", "scale the whole update down to L2 norm <= max_norm")
class Clipping(UpdateDefense):
    class Config(DefenseParams):
        max_norm: float = Field(description="L2 bound of the whole update")

    advice = ({"stage": "update", "param": "max_norm", "weak": 10.0, "strong": 1e-4, "scale": "log", "fixed": {},
               "what": "L2 bound of each update", "order": 4, "rank": 5},)

    def setup(self) -> None:
        if self.cfg.max_norm <= 0:
            raise BadInput("defenses.clipping.max_norm", f"max_norm must be > 0, got {self.cfg.max_norm}.", "use e.g. 1.0.")
        self.max_norm = self.cfg.max_norm

    def apply(self, update: Update, ctx: dict) -> Update:
        factor = min(1.0, self.max_norm / max(update.norm(), 1e-300))
        return update.map(lambda _, t: t * factor)

    def server_knowledge(self) -> dict:
        return {"clip_norm": float(self.max_norm)}


@DEFENSES.register("dp_gaussian", "clip the update to max_norm, then add N(0, (noise_multiplier*max_norm)^2) on the "
                   "client (where=client) or N(0, (noise_multiplier*max_norm/K)^2) on the mean of K clipped updates "
                   "(where=server: central DP, UTR Table 3)")
class DPGaussian(UpdateDefense):
    """Gaussian mechanism on clipped updates.

    ``where="client"`` (local DP): each client clips its update to ``max_norm`` and adds N(0, (σC)²) before upload.
    ``where="server"`` (central DP, DP-FedAvg; UTR Table 3 "the server injects Gaussian noise into the aggregated
    adapter gradients"): each upload is clipped, and the noise N(0, (σC/K)²) goes on the mean of the K updates.
    Then whoever sees an individual upload (an honest-but-curious server without secure aggregation) sees it
    without noise; only the aggregate (the secure-aggregation view, the released model) is protected.
    """

    class Config(DefenseParams):
        noise_multiplier: float = Field(description="σ: noise std = σ · max_norm (client) or σ · max_norm / K (server)")
        max_norm: float = Field(1.0, description="C: L2 clipping bound of each update")
        where: str = Field("client", description="client: noise on each upload (local DP); server: on the aggregate")
        seed: int = Field(0, description="noise seed (default: the run's seed)")

    seeded = True
    is_dp = True
    clip_fit = ("max_norm", "update_norms", "the median L2 norm of the undefended uploads")
    advice = ({"stage": "update", "param": "noise_multiplier", "weak": 1e-3, "strong": 10.0, "scale": "log",
               "fixed": {"max_norm": 1.0, "where": "client"},
               "what": "noise multiplier, each upload clipped to L2 norm 1.0 (local DP)", "order": 3, "rank": 0},)

    @classmethod
    def describe(cls, params: dict) -> str:
        if params.get("where") == "server":
            return (" -- central DP: the noise is added to the aggregate, so a server that sees individual "
                    "updates still sees them raw")
        return ""

    @classmethod
    def advice_epsilon(cls, value, rounds: int, measured, delta: float, gaussian_epsilon):
        """The Gaussian mechanism's RDP ε of ``rounds`` compositions at noise multiplier ``value`` (sampling rate 1;
        ``gaussian_epsilon``: :func:`gradleak.accounting.gaussian_rdp_epsilon`, equal to Opacus'
        ``RDPAccountant``)."""
        return gaussian_epsilon(value, rounds, delta)

    def dp_claims(self, cfg, gaussian_epsilon, delta: float) -> list[dict]:
        z = self.noise_multiplier
        covers = ["final_model", "every_round"] + ([] if self.server_side else ["each_upload"])
        return [{"name": "dp_gaussian", "where": self.where, "clip": self.max_norm, "covers": covers, "delta": delta,
                 "claim": lambda rounds, rep, z=z: (
                     gaussian_epsilon(z, rounds, delta),
                     f"RDP of the Gaussian mechanism (closed form, as Opacus' RDPAccountant), noise multiplier {z:g}, "
                     f"sampling rate 1, {rounds} round(s), user-level (one client's clipped update)")}]

    def setup(self) -> None:
        c = self.cfg
        if c.noise_multiplier < 0:
            raise BadInput("defenses.dp_gaussian.noise_multiplier", "must be >= 0.", "use e.g. 1.0.")
        if c.where not in ("client", "server"):
            raise BadInput("defenses.dp_gaussian.where", f"must be 'client' or 'server', got {c.where!r}.",
                           "use where: client (noise on each upload) or where: server (noise on the aggregate).")
        self.clip = Clipping(c.max_norm)
        self.noise_multiplier, self.max_norm, self.where = c.noise_multiplier, c.max_norm, c.where
        self.server_side = c.where == "server"
        self.noise = GaussianNoise(c.noise_multiplier * c.max_norm, relative=False, seed=c.seed)

    def apply(self, update: Update, ctx: dict) -> Update:
        if self.server_side:  # the client only clips; the noise comes with the aggregate (server_apply)
            return self.clip.apply(update, ctx)
        return self.noise.apply(self.clip.apply(update, ctx), ctx)

    def server_apply(self, aggregate: Update, ctx: dict, num_updates: int) -> Update:
        """Central DP: N(0, (σC/K)²) on the mean of K clipped updates (seeded per round: ctx["seed"])."""
        noise = GaussianNoise(self.noise_multiplier * self.max_norm / max(num_updates, 1), seed=self.noise.seed)
        return noise.apply(aggregate, {**ctx, "client_id": -1})

    def server_knowledge(self) -> dict:
        return {"clip_norm": float(self.max_norm), "adds_noise": self.noise_multiplier > 0}

    def observed_noise_variance(self, update: Update, aggregate_of: int = 1, individual: bool = True,
                                tensor: str | None = None) -> float:
        std = self.noise_multiplier * self.max_norm  # the same on every tensor (``tensor`` is ignored)
        if self.server_side:  # the raw upload carries no noise; the mean of K uploads N(0, (σC/K)²)
            return 0.0 if individual else (std / aggregate_of) ** 2
        return std * std / (1 if individual else aggregate_of)


def coordinate_noise_std(entries: list[dict] | list[DefenseConfig], update: Update, aggregate_of: int = 1,
                         individual: bool = True, tensor: str | None = None) -> float | None:
    """Per-coordinate std of the Gaussian noise the update defenses ``entries`` put on an observed upload
    (``individual``) or on the observed mean of ``aggregate_of`` uploads; None when no defense adds Gaussian
    noise, or when one adds noise whose scale the server cannot know (percentile-scaled noise; quantisation without
    a ``tensor`` name, or of a summed upload). ``tensor``: the observed tensor it is for (quantisation's step is
    read off that tensor).

    The server knows the DP configuration (it is part of the published protocol); each defense says what it adds
    (:meth:`~gradleak.defenses.base.UpdateDefense.observed_noise_variance`). Independent noises add in variance;
    clipping scales the signal only."""
    from gradleak.defenses.declared import as_declared

    declared = as_declared(entries)
    declared.clients = max(int(aggregate_of), 1)
    return declared.noise_std(update, individual=individual, tensor=tensor)


@DEFENSES.register("topk_pruning", "zero all but the largest-magnitude (1 - prune_fraction) of the coordinates "
                   "(of the whole upload, or of each tensor with per_tensor: true)")
class TopKPruning(UpdateDefense):
    """Magnitude pruning of the upload (UTR Table 3; PEFTLeak Fig. 21). ``per_tensor: false`` (default) keeps the
    largest (1 - p) of *all* coordinates, so small tensors (an embedding adapter's gradient) can lose every entry;
    ``per_tensor: true`` keeps the largest (1 - p) of each tensor. The server sees which coordinates were kept
    (the nonzeros): :meth:`server_knowledge` declares it for the sparsity-aware tests."""

    class Config(DefenseParams):
        prune_fraction: float = Field(description="fraction of the coordinates set to zero, in [0, 1)")
        per_tensor: bool = Field(False, description="prune each tensor to its own top (1 - prune_fraction)")

    advice = ({"stage": "update", "param": "prune_fraction", "weak": 0.5, "strong": 0.999, "scale": "log1m",
               "fixed": {}, "what": "fraction of the coordinates zeroed", "order": 5, "rank": 6},)

    def setup(self) -> None:
        p = self.cfg.prune_fraction
        if not 0 <= p < 1:
            raise BadInput("defenses.topk_pruning.prune_fraction", f"must be in [0, 1), got {p}.",
                           "use e.g. 0.9 to zero 90% of the coordinates.")
        self.prune_fraction = p

    @staticmethod
    def _prune(flat: torch.Tensor, keep_fraction: float) -> torch.Tensor:
        keep = max(1, int(round(flat.numel() * keep_fraction)))
        thresh = flat.abs().kthvalue(flat.numel() - keep + 1).values if keep < flat.numel() else flat.abs().min() - 1
        return torch.where(flat.abs() >= thresh, flat, torch.zeros_like(flat))

    def apply(self, update: Update, ctx: dict) -> Update:
        if self.cfg.per_tensor:
            return update.map(lambda _, t: self._prune(t.reshape(-1), 1 - self.prune_fraction).reshape(t.shape))
        return update.unflat(self._prune(update.flat(), 1 - self.prune_fraction))

    def server_knowledge(self) -> dict:
        return {"sparsity": {"keep_fraction": 1 - self.prune_fraction,
                             "scope": "per_tensor" if self.cfg.per_tensor else "global"}}

    def kept_threshold(self, update: Update, tensor: str | None = None) -> float | None:
        """The pruning threshold t read off the pruned upload: the smallest kept (nonzero) magnitude -- of ``tensor``
        for ``per_tensor`` pruning (None without a name), of the whole upload for global pruning (every dropped
        coordinate of every tensor sits below the one global threshold, so a tensor that lost every entry is still
        bounded by it). None when the zeros are not visible (more nonzeros than the kept fraction allows: noise
        added after the pruning) or nothing was kept."""
        if self.prune_fraction == 0:
            return 0.0
        if self.cfg.per_tensor:
            if tensor is None or tensor not in update.tensors:
                return None
            ts = [update.tensors[tensor]]
        else:
            ts = list(update.tensors.values())
        flat = torch.cat([t.detach().reshape(-1).to(torch.float64).abs() for t in ts])
        kept = flat[flat > 0]
        allowed = max(1, int(round(flat.numel() * (1 - self.prune_fraction))))  # as _prune keeps (ties aside)
        if not kept.numel() or kept.numel() > 1.01 * allowed + 1:
            return None
        return float(kept.min())

    def observed_error_variance(self, update: Update, aggregate_of: int = 1, individual: bool = True,
                                tensor: str | None = None) -> float | None:
        """The pruning error on the observed tensor ``tensor`` as a per-coordinate scale: **t², t the kept threshold**
        (:meth:`kept_threshold`, read off the upload).

        The error model, chosen: every dropped coordinate is a true value the pruning zeroed, so |e| <= t (the
        smallest kept magnitude; ties at t are kept), and any law on [-t, t] has rms <= t. The std t is that bound:
        the largest per-coordinate scale a dropped coordinate can have, and the Bai-Yin edge it implies,
        t (sqrt(M) + sqrt(n)), the edge of the spectral information limit (K directions above it,
        ``margin_strongest`` = s_1 / edge; :func:`gradleak.attacks.common.subspace.spectral_margin`). Not the
        uniform law's t / sqrt(3): nothing makes the dropped values uniform, and the bound holds for every upload.
        Measured against the true dropped error (tests/test_pruning_error.py; MiniLM's embedding-adapter gradient,
        192 x 384, B = 2 / 4, seeds 0 / 11, 90-99.9 %): its rms is 0.005-0.43 t (most coordinates are dropped far
        below the threshold), so t over-states the scale; but the error is not i.i.d. -- it is the signal's own
        small entries, aligned with the signal's directions -- and its largest singular value reaches 0.02-1.45 x
        the edge t (sqrt(M) + sqrt(n)) (above 1 only under per-tensor pruning at 90-99 %). So K counts directions
        above the edge a bounded i.i.d. error of this scale would stay under, not a guarantee that each is free of
        the pruning error; the sub-edge test (graded against its null) reads what lies below.

        None: the threshold cannot be read (:meth:`kept_threshold`), or the server sees only the sum of several
        clients' pruned uploads (their supports differ; the sum's zeros are not any client's)."""
        if not individual and aggregate_of > 1:
            return None
        t = self.kept_threshold(update, tensor)
        return None if t is None else t * t


@DEFENSES.register("stochastic_quantization", "unbiased stochastic rounding of each tensor to 2^bits levels (QSGD-style)")
class StochasticQuantization(UpdateDefense):
    class Config(DefenseParams):
        bits: int = Field(description="2^bits levels between each tensor's min and max")
        seed: int = Field(0, description="rounding seed (default: the run's seed)")

    seeded = True
    advice = ({"stage": "update", "param": "bits", "weak": 8, "strong": 1, "scale": "int", "fixed": {},
               "what": "bits per coordinate", "order": 6, "rank": 7},)

    def setup(self) -> None:
        c = self.cfg
        if c.bits < 1:
            raise BadInput("defenses.stochastic_quantization.bits", f"bits must be >= 1, got {c.bits}.", "use e.g. 8.")
        self.levels, self.seed = 2 ** c.bits - 1, c.seed

    def apply(self, update: Update, ctx: dict) -> Update:
        g = _gen(ctx, self.seed)

        def q(_: str, t: torch.Tensor) -> torch.Tensor:
            lo, hi = t.min(), t.max()
            if hi <= lo:
                return t.clone()
            scaled = (t - lo) / (hi - lo) * self.levels
            floor = scaled.floor()
            up = (torch.rand(t.shape, generator=g, dtype=torch.float64).to(t) < (scaled - floor)).to(t.dtype)
            return lo + (floor + up) / self.levels * (hi - lo)

        return update.map(q)

    def observed_noise_variance(self, update: Update, aggregate_of: int = 1, individual: bool = True,
                                tensor: str | None = None) -> float | None:
        """The rounding noise on the observed tensor ``tensor`` of an individual upload, read off that tensor.

        The step is readable: the coordinates at a tensor's min and max round to themselves (scaled 0 and
        ``levels``), so the observed tensor keeps its range and step = (max - min) / (2^bits - 1). A coordinate
        whose scaled value has fractional part p is rounded up with probability p: zero-mean noise of variance
        step² p (1 - p). The server does not see p; this returns its mean over uniformly spread fractional parts,
        step² / 6 (the choice: exact for a tensor spread over many levels; the bound, at p = 1/2, is step² / 4 --
        with few levels, e.g. 1 or 2 bits, most coordinates sit mid-step and the noise is nearer the bound).
        A constant tensor is kept as it is (0).

        None (a scale the server cannot know): ``tensor`` None (the step differs per tensor) or not in the upload,
        and the mean of ``aggregate_of`` > 1 independently quantised uploads (secure aggregation): its variance
        would be the clients' mean step² / 6 divided by ``aggregate_of``, but each client quantised on its own
        range, and the clients' steps cannot be read off their sum."""
        if tensor is None or tensor not in update.tensors:
            return None
        if not individual and aggregate_of > 1:
            return None
        t = update.tensors[tensor].detach().to(torch.float64)
        if t.numel() == 0:
            return 0.0
        step = float(t.max() - t.min()) / self.levels
        return step * step / 6.0

    def server_knowledge(self) -> dict:
        """The rounding noise is known per tensor (``noise_per_tensor``, :meth:`observed_noise_variance`)."""
        return {"quant_bits": int(self.cfg.bits), "adds_noise": True, "noise_per_tensor": True}


__all__ = ["Clipping", "DPGaussian", "GaussianNoise", "PercentileNoise", "StochasticQuantization", "TopKPruning",
           "coordinate_noise_std"]
