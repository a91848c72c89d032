"""ProjRes membership inference (FISGuard paper, paper 004 in docs/PAPERS.md: Sec. III, VI-B) on the gradients of trainable linear layers.

The rows of the gradient G (out × in) of a linear layer are combinations of the layer's inputs on the
client's batch, so a member's input lies in the row space of G and a non-member's (mostly) does not. The
score of a candidate sentence is the *relative projection residual* of its input representations at the
layer, ``‖h − P_row(G) h‖ / ‖h‖`` (P_row(G) = V_k V_kᵀ from the SVD of G), computed by the server with the
model it sent; lower = more likely a member. ``Reconstruction.data["scores"]`` holds ``−residual``
(higher = member) for the evaluator (ROC AUC, TPR at low FPR).

Decisions the summary leaves open (open point A5.2, docs/PAPERS.md), each a parameter:

* ``aggregation`` over a sentence's tokens: ``min`` (default; one token in the span is enough evidence),
  ``mean``, or ``sentence`` (the residual of the mean token representation). Special tokens ([CLS]/[SEP],
  BOS/EOS, padding) are excluded: they occur in every sentence and lie in every batch's span.
* ``layers``: every trainable linear layer whose weight gradient the update carries (adapter down- and
  up-projections, LoRA A and B, the task head) or the names given; ``layer_aggregation`` combines them
  (``min_z``, default: each layer's residuals standardised over the client's candidates, then the minimum —
  a saturated layer, where every candidate lies in the span, has no spread and drops out, and so does a layer
  whose gradient rank is at most the batch size when the server knows it (one direction per sentence at most:
  the last layer of a classifier, where only the pooled token receives gradient); ``min`` of the raw
  residuals lets such a layer tie every candidate at 0; ``mean``). Per-layer scores are kept in
  ``info["layer_scores"]`` so the evaluation can report each layer's AUC.
* Rounds: a member is in the span of its client's gradient in every observed round; the residual is
  combined over rounds by ``round_aggregation`` (``min`` default).
* Rank: singular values above ``rank_rtol`` × the largest count (float32 gradients: 1e-5).
* Candidates come from the server's public knowledge (``view.public["candidates"]``: per observed update,
  the sentences to score); granted under ``threat.public_data``. ``max_clients`` scores the first N observed
  clients only (the cost is candidates × observed rounds forward passes).

Noisy uploads (``noise``; beyond the paper, which scores a clean gradient). The upload is G̃ = G + σE (Gaussian
noise, DP-Gaussian, DP-SGD: E i.i.d. N(0, 1), σ the per-coordinate std). G̃ is full rank, so at ``rank_rtol`` its
row space is the whole input space (an up-projection, m >= n: every residual 0) or half of it filled with noise
directions (a down-projection), and Sec. VI-B's argument -- a row space covering every candidate leaves no residual
to rank -- applies to the noise as it does to FISGuard's fixed subspace. ``noise`` (``public``/``declared``: σ from
the declared defenses, :func:`gradleak.defenses.declared.view_noise_std`; ``estimate``: σ read off each layer's
spectrum bulk, Gavish-Donoho; a float: that σ; ``none``: the exact score above, unchanged) replaces the row space by
what the noise leaves testable, with one of two scores (``noise_score``):

* ``residual`` -- the Sec. III score on the *signal subspace*: only the right singular directions of G̃ above the
  noise edge margin × σ(√m + √n) are kept (Bai-Yin / Marchenko-Pastur: below it no direction can be told from
  noise; :func:`gradleak.attacks.common.subspace.noisy_subspace`) and the candidate's relative residual is taken
  against them. A layer with no direction above the edge gives every candidate residual 1 (no spread: it drops out
  of ``min_z``; pure noise ties every candidate, AUC ½).
* ``chi2`` -- a matched filter for the candidate's own direction: for a unit ĥ, G̃ĥ = Gĥ + σEĥ with Eĥ ~ N(0, I_m)
  exactly, so T = ‖G̃ĥ‖²/σ² is χ²_m when ĥ ⟂ row(G) (what noise alone gives) and non-central with ‖Gĥ‖²/σ²
  otherwise; the score is z = (T − m)/√(2m) (higher = member; the residual ‖ĥ − P_row(G)ĥ‖ is 1 exactly when
  ‖Gĥ‖ = 0, and ‖Gĥ‖² is ĥ's energy in row(G) weighted by G's singular values). Testing a *known* direction needs
  ‖Gĥ‖ ≳ σ√m, not a singular value above σ(√m + √n): it still ranks members where the spectrum has drowned (a wide
  layer such as the task head, m ≪ n). A layer counts only when one of its tests (every scored token or vector
  of every candidate) exceeds the χ²_m quantile 1 − ``noise_alpha`` / #tests (Bonferroni: noise alone passes with
  probability ``noise_alpha``); otherwise every candidate gets z = 0 and the layer drops out.

``info`` then holds the σ used and the signal rank per layer (``rank_per_layer``) and, for ``chi2``, the layers that
passed the noise gate.

Information limit (docs/DESIGN.md §6, "where the information stops"). Under declared noise every scored layer's upload
carries its limit (:func:`gradleak.attacks.common.subspace.spectral_margin` at the declared per-coordinate std,
whatever the score): ``info["leakage_margin_per_layer"]`` and the metrics ``{key}_projres_layer{i}`` (``i``: the
layer's index in ``info["layers"]``), summarised over the layers as ``{key}_projres``: ``directions_above_edge``
summed (the directions any subspace attacker of these layers can tell from the noise), ``margin_strongest``,
``drowning_noise_std_all`` and the rest the largest (the most exposed layer; ``margin_strongest`` <= 1.05 exactly when
no layer has a direction above its edge). The ``chi2`` score is not bounded by it: a known direction is testable
below the edge (above).

Oracle ceiling (``directions``; an upper bound for the benchmark, not an attack a server runs on a noisy upload):
each layer's exact row space cut to its K strongest right singular directions (``directions``: one K for every layer
or one per layer in ``info["layers"]`` order; K = 0: no direction, every residual 1, the layer drops out of ``min_z``),
scored as above. On the noise-free upload with the K the noise leaves above each layer's edge, it is the best the
Sec. III score does with those directions; with K >= each layer's rank it is the exact score itself. The adaptive attack (``projres_adaptive``) has no row-space step: its NNLS fit of G̃ over the
candidates' gradients is already the maximum-likelihood fit under i.i.d. Gaussian noise.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

import torch
from pydantic import Field, field_validator
from torch import nn

from gradleak.attacks.common.parameters import set_config_fields
from gradleak.attacks.base import AttackBase, AttackConfig, Reconstruction
from gradleak.errors import BadInput
from gradleak.registry import ATTACKS


class ProjResConfig(AttackConfig):
    aggregation: Literal["min", "mean", "sentence"] = Field("min", description="token aggregation of a sentence's residuals")
    layers: Union[Literal["all"], list[str]] = Field("all", description="'all' trainable linear layers, or parameter-name substrings")
    layer_aggregation: Literal["min_z", "min", "mean"] = Field(
        "min_z", description="combine the layers: min of per-layer standardised residuals (min_z), raw min, or mean")
    round_aggregation: Literal["min", "mean", "last"] = Field("min", description="combine the observed rounds")
    rank_rtol: float = Field(1e-5, gt=0, lt=1, description="relative singular-value cut-off of the gradient's row space")
    batch_size: int = Field(64, ge=1, description="candidates per forward pass")
    max_clients: Optional[int] = Field(None, ge=1, description="score only the first N observed clients (cost: "
                                       "candidates × observed rounds forward passes)")
    noise: Union[float, Literal["none", "public", "declared", "estimate"]] = Field(
        "none", description="noise on the observed gradients: 'none' = exact row space (the paper), "
        "'public'/'declared' = the per-coordinate std the declared defenses imply (exact when none adds noise), "
        "'estimate' = read off each layer's spectrum (Gavish-Donoho), or a known std (float > 0)")
    noise_score: Literal["residual", "chi2"] = Field(
        "residual", description="with noise: residual on the signal subspace above the noise edge, or chi2 = the "
        "matched-filter energy of the candidate's direction over what noise alone gives")
    noise_alpha: float = Field(0.01, gt=0, lt=1, description="chi2: a layer counts when a test exceeds the chi-square "
                               "quantile 1 - alpha / #tests (noise alone passes with probability alpha)")
    directions: Optional[Union[int, list[int]]] = Field(
        None, description="oracle ceiling (benchmarks): each layer's exact row space cut to its K strongest directions "
        "(one K for every layer, or one per scored layer in the order of info['layers']); with noise 'none' only")

    @field_validator("noise")
    @classmethod
    def _noise_positive(cls, v):
        if isinstance(v, float) and v <= 0:
            raise ValueError("a noise std must be > 0 (use 'none' for the exact row space)")
        return v

    @field_validator("directions")
    @classmethod
    def _directions_non_negative(cls, v):
        if v is not None and any(k < 0 for k in ([v] if isinstance(v, int) else v)):
            raise ValueError("directions must be >= 0 (K strongest directions per layer)")
        return v


def row_space(G: torch.Tensor, rtol: float, max_directions: Optional[int] = None) -> torch.Tensor:
    """Orthonormal basis (in × k) of the row space of G (out × in), strongest direction first; ``max_directions``:
    at most that many (the oracle ceiling's K strongest)."""
    G = G.detach().to(torch.float64)
    if G.abs().max() == 0:
        return G.new_zeros(G.shape[1], 0)
    _, S, Vh = torch.linalg.svd(G, full_matrices=False)
    k = int((S > rtol * S[0]).sum())
    if max_directions is not None:
        k = min(k, int(max_directions))
    return Vh[:k].T


def relative_residual(h: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """‖h − V Vᵀ h‖ / ‖h‖ along the last dimension (0 for h = 0)."""
    h = h.to(torch.float64)
    if V.shape[1] >= h.shape[-1]:  # the row space is the whole input space: every vector lies in it exactly
        return torch.zeros(h.shape[:-1], dtype=torch.float64)
    r = h - (h @ V) @ V.T if V.shape[1] else h
    return r.norm(dim=-1) / h.norm(dim=-1).clamp_min(1e-300)


@dataclass
class NoisyRowSpace:
    """What a noisy layer gradient G̃ (out × in) = G + σE leaves testable (module docstring, "Noisy uploads"):
    the signal subspace above the noise edge and the per-candidate score, lower = more likely a member
    (``residual``: relative residual on the signal subspace; ``chi2``: −z of the matched-filter statistic)."""

    G: torch.Tensor  # the noisy gradient, float64
    sigma: float
    score: str
    basis: torch.Tensor  # (in × r) signal subspace
    edge: float

    @property
    def rank(self) -> int:
        return int(self.basis.shape[1])

    def chi2_z(self, h: torch.Tensor) -> torch.Tensor:
        """z = (‖G̃ĥ‖²/σ² − m)/√(2m) for ĥ = h/‖h‖ along the last dimension (0 for h = 0)."""
        h = h.to(torch.float64)
        n = h.norm(dim=-1, keepdim=True)
        T = (h @ self.G.T).pow(2).sum(-1) / n.squeeze(-1).clamp_min(1e-300) ** 2 / self.sigma ** 2
        m = self.G.shape[0]
        return torch.where(n.squeeze(-1) > 0, (T - m) / math.sqrt(2 * m), torch.zeros_like(T))

    def residual(self, h: torch.Tensor) -> torch.Tensor:
        if self.score == "chi2":
            return -self.chi2_z(h)
        if self.rank == 0:
            return torch.ones(h.shape[:-1], dtype=torch.float64)
        return relative_residual(h, self.basis)

    def gate(self, tests: int, alpha: float) -> float:
        """The z a test must exceed for the layer to count: the χ²_m quantile 1 − alpha / tests (Bonferroni)."""
        from scipy.stats import chi2

        m = self.G.shape[0]
        return (float(chi2.isf(alpha / max(tests, 1), m)) - m) / math.sqrt(2 * m)


def noisy_row_space(G: torch.Tensor, sigma: float, score: str = "residual") -> NoisyRowSpace:
    """Signal subspace of G̃ (out × in) under per-coordinate noise std ``sigma`` (the edge of
    :func:`gradleak.attacks.common.subspace.noisy_subspace`) and the ``score`` it is tested with."""
    from gradleak.attacks.common.subspace import noisy_subspace

    G = G.detach().to(torch.float64).cpu()
    sub = noisy_subspace([G], float(sigma))
    return NoisyRowSpace(G, float(sigma), score, sub.basis, sub.noise_edge)


def _residual(h: torch.Tensor, base) -> torch.Tensor:
    if isinstance(base, NoisyRowSpace):
        return base.residual(h)
    return relative_residual(h, base.cpu())


class _InputCapture:
    """Forward pre-hooks recording the input of each target linear module."""

    def __init__(self, modules: dict[str, nn.Module]):
        self.modules, self.records, self.handles = modules, {}, []

    def __enter__(self):
        for name, m in self.modules.items():
            self.handles.append(m.register_forward_pre_hook(lambda mod, args, name=name: self.records.__setitem__(name, args[0].detach())))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return False


def target_layers(model: nn.Module, update_keys, wanted) -> dict[str, nn.Module]:
    """Linear modules whose ``.weight`` gradient the update carries (names without ``.weight``)."""
    mods = dict(model.named_modules())
    out = {}
    for k in update_keys:
        if not k.endswith(".weight"):
            continue
        name = k[: -len(".weight")]
        m = mods.get(name)
        if isinstance(m, nn.Linear) and (wanted == "all" or any(w in k for w in wanted)):
            out[name] = m
    return out


@ATTACKS.register("projres", "ProjRes membership inference: projection residual on the observed gradient's row space")
class ProjRes(AttackBase):
    """Honest-but-curious server holding candidate sentences (``threat.public_data``)."""

    name = "projres"
    Config = ProjResConfig
    modality = "text"
    peft_kinds = ("adapters", "lora", "none")
    reconstruction = "membership"
    devices = ("cpu", "cuda")

    def __init__(self, **params: Any):
        set_config_fields(self, params)  # ProjResConfig: the one place the defaults live

    @classmethod
    def requires(cls, cfg=None) -> dict[str, bool]:
        return {"public_data": True}

    @classmethod
    def audit_variants(cls, params, defenses):
        """Under declared noise the exact row space is the whole (or half the) input space and the plain score ties
        or inverts (module docstring, "Noisy uploads"): the audit also runs both noise-aware scores, with the declared
        σ (``public``) when every noisy defense's scale is known, and σ read off the spectrum (``estimate``) when one
        adds noise of an unknown scale (percentile noise, stochastic rounding of a summed upload). Stochastic rounding
        of an individual upload runs both: its declared σ is each layer's step² / 6, a mean over the coordinates'
        fractional parts (:class:`~gradleak.defenses.update.StochasticQuantization`), not the exact level."""
        from gradleak.defenses.declared import as_declared

        declared = as_declared(defenses)
        if not declared.adds_noise:
            return []
        modes = ["estimate"] if declared.noise_unknown else (
            ["public", "estimate"] if declared.noise_per_tensor else ["public"])
        here = {"noise": params.get("noise", "none"), "noise_score": params.get("noise_score", "residual")}
        out = [{"noise": m, "noise_score": sc} for m in modes for sc in ("residual", "chi2")]
        return [v for v in out if v != here]

    def observes_round(self, round_index: int, total_rounds: int) -> bool:
        return self.round_aggregation != "last" or round_index == total_rounds - 1

    def _row_space(self, view, upd, G: torch.Tensor, tensor: Optional[str] = None):
        """The exact row space of G (the upload's tensor ``tensor``) when no noise is declared (``public``), else its
        :class:`NoisyRowSpace`."""
        G64 = G.detach().to(torch.float64).cpu()
        if self.noise in ("public", "declared"):
            from gradleak.defenses.declared import view_noise_std

            # this client's upload (a relative noise scales with it), this layer's tensor (stochastic rounding: its step)
            std = view_noise_std(view, upd, tensor=tensor) or 0.0
            rounding = float(view.public.get("upload_rounding_std") or 0.0)  # a weight reply's rounding (Flower)
            sigma = (std ** 2 + rounding ** 2) ** 0.5
        else:
            from gradleak.attacks.common.text import declared_noise_std

            sigma = declared_noise_std(view, self.noise, [G64], tensor=tensor)
        if not sigma or not math.isfinite(sigma):
            return row_space(G, self.rank_rtol)
        return noisy_row_space(G64, sigma, self.noise_score)

    def reconstruct(self, view) -> Reconstruction:
        cands = view.public.get("candidates")
        tok = view.public.get("tokenizer")
        if not cands:
            raise BadInput("threat.public_data", "ProjRes needs candidate samples to score.",
                           "grant threat.public_data=true (the server holds candidates) and set data.nonmembers > 0.")
        if self.max_clients:
            cands = dict(list(cands.items())[: self.max_clients])
        model = copy.deepcopy(view.model).eval()  # scored with each round's state loaded; the view stays as sent
        targets = target_layers(model, list(view.updates[0].tensors), self.layers)
        if not targets:
            raise BadInput("attack.layers", f"no trainable linear layer of the update matches {self.layers!r}.",
                           "use layers: all, or substrings of the update's parameter names.")
        caps = self._directions(list(targets))
        rounds = view.rounds if self.round_aggregation != "last" else view.rounds[-1:]
        states = view.round_states if self.round_aggregation != "last" else view.round_states[-1:]
        per_round: list[dict[int, dict[str, torch.Tensor]]] = []
        ranks: dict[str, list[int]] = {n: [] for n in targets}
        client_rank: dict[int, dict[str, int]] = {}
        sigmas: dict[str, list[float]] = {n: [] for n in targets}
        gates: dict[str, list[bool]] = {n: [] for n in targets}
        limits: dict[int, dict[str, dict[str, float]]] = {}
        for ups, state in zip(rounds, states):
            with torch.no_grad():
                params = dict(model.named_parameters())
                for n, v in state.items():
                    params[n].copy_(v.to(params[n].device, params[n].dtype))
            res: dict[int, dict[str, torch.Tensor]] = {}
            for ci, texts in cands.items():
                upd = ups[ci]
                if self.noise == "none":
                    bases = {n: row_space(upd.tensors[n + ".weight"], self.rank_rtol, caps.get(n)) for n in targets}
                else:
                    bases = {n: self._row_space(view, upd, upd.tensors[n + ".weight"], n + ".weight")
                             for n in targets}
                for n, V in bases.items():
                    ranks[n].append(_rank(V))
                    if isinstance(V, NoisyRowSpace):
                        sigmas[n].append(V.sigma)
                client_rank[ci] = {n: _rank(V) for n, V in bases.items()}
                if ci not in limits:  # the first observed round's upload: its information limit per layer
                    limits[ci] = self._limits(view, upd, targets, client_rank[ci])
                res[ci] = self._score(model, tok, targets, bases, texts, view.public.get("model_kind"), gates)
            per_round.append(res)
        batch = int(view.public.get("batch_size") or 0)
        scores, layer_scores = {}, {n: {} for n in targets}
        for ci in cands:
            stack = {n: torch.stack([r[ci][n] for r in per_round]) for n in targets}  # rounds × candidates
            comb = {n: (s.min(0).values if self.round_aggregation == "min" else s.mean(0)) for n, s in stack.items()}
            for n in targets:
                layer_scores[n][ci] = (-comb[n]).tolist()
            allr = torch.stack(list(comb.values()))  # layers × candidates
            if self.layer_aggregation == "min_z":
                # standardise each layer over this client's candidates (no truth needed): a saturated layer (every
                # candidate in its span) has no spread and drops out; a member stands out in its best layer
                sd = allr.std(1, keepdim=True)
                z = (allr - allr.mean(1, keepdim=True)) / sd.clamp_min(1e-12)
                informative = sd[:, 0] > 1e-9
                # rank <= B: at most one direction per sentence (a pooled token), no member's tokens; a chi2 layer
                # counts by its noise gate instead (its matched filter needs no direction above the edge)
                if batch and not (self.noise != "none" and self.noise_score == "chi2"):
                    ranks_now = torch.tensor([client_rank[ci][n] for n in comb])
                    if (informative & (ranks_now > batch)).any():
                        informative &= ranks_now > batch
                total = z[informative].min(0).values if informative.any() else allr.mean(0)
            else:
                total = allr.min(0).values if self.layer_aggregation == "min" else allr.mean(0)
            scores[ci] = (-total).tolist()
        info = {"layers": list(targets), "rank_per_layer": {n: max(r) if r else 0 for n, r in ranks.items()},
                "input_width_per_layer": {n: m.in_features for n, m in targets.items()},
                "rounds_scored": len(per_round), "layer_scores": layer_scores}
        metrics: dict[str, float] = {}
        first = limits.get(next(iter(cands)))
        if first:  # the first scored client's upload (the benchmark's one client): per layer and summarised
            names = list(targets)
            info["leakage_margin_per_layer"] = first
            for i, n in enumerate(names):
                metrics.update({f"{k}_projres_layer{i}": v for k, v in first[n].items()})
            metrics.update({f"{k}_projres": v for k, v in summarise_limits(list(first.values())).items()})
            info["leakage_margin"] = {"layer": "projres", **{k: metrics[f"{k}_projres"] for k in
                                                             summarise_limits(list(first.values()))}}
        if caps:
            info["directions"] = {n: caps.get(n) for n in targets}
        if self.noise != "none":
            info["noise"] = self.noise
            info["noise_score"] = self.noise_score
            info["noise_std_per_layer"] = {n: (max(v) if v else None) for n, v in sigmas.items()}
            if self.noise_score == "chi2":
                info["layers_above_noise"] = [n for n, v in gates.items() if any(v)]
        return Reconstruction({"scores": scores}, info, metrics)

    def _directions(self, names: list[str]) -> dict[str, int]:
        """Layer -> K of ``directions`` (the oracle ceiling; module docstring); {} without it."""
        if self.directions is None:
            return {}
        if self.noise != "none":
            raise BadInput("attack.directions", "the oracle ceiling cuts the exact row space (noise 'none').",
                           "set attack.noise=none with attack.directions, or drop attack.directions.")
        if isinstance(self.directions, int):
            return {n: int(self.directions) for n in names}
        if len(self.directions) != len(names):
            raise BadInput("attack.directions", f"{len(self.directions)} values for {len(names)} scored layers "
                           f"({', '.join(names)}).", "give one K per scored layer, in that order, or one K for all.")
        return {n: int(k) for n, k in zip(names, self.directions)}

    @staticmethod
    def _limits(view, upd, targets, ranks: dict[str, int]) -> dict[str, dict[str, float]]:
        """Per layer, the information limit of this upload's weight gradient at the declared per-coordinate std
        (noise and bounded errors, and a weight reply's rounding; :func:`spectral_margin`); without declared noise
        only the drowning stds."""
        from gradleak.attacks.common.subspace import spectral_margin
        from gradleak.defenses.declared import view_error_std

        out = {}
        for n in targets:
            key = n + ".weight"
            std = view_error_std(view, upd, tensor=key) or 0.0
            rounding = float(view.public.get("upload_rounding_std") or 0.0)
            sigma = (std ** 2 + rounding ** 2) ** 0.5
            out[n] = spectral_margin([upd.tensors[key].detach().to(torch.float64).cpu()], ranks.get(n, 0),
                                     sigma if sigma > 0 and math.isfinite(sigma) else None)
        return out

    def _score(self, model, tok, targets, bases, texts, kind, gates=None) -> dict[str, torch.Tensor]:
        """Residual per candidate and layer (aggregated over the candidate's non-special tokens). A ``chi2`` layer
        whose largest test stays below the noise gate (:meth:`NoisyRowSpace.gate`) scores every candidate 0
        (``gates[layer]`` records whether it passed)."""
        from gradleak.models.text import causal_specials, encode_batch

        out = {n: [] for n in targets}
        chi2 = {n for n, b in bases.items() if isinstance(b, NoisyRowSpace) and b.score == "chi2"}
        best = {n: -math.inf for n in chi2}  # the largest z over every test of the layer
        tests = {n: 0 for n in chi2}
        dev = next(model.parameters()).device
        special = set(tok.all_special_ids) | (set(causal_specials(tok)) if kind == "causal" else set())
        for a in range(0, len(texts), self.batch_size):
            enc = encode_batch(tok, kind, texts[a:a + self.batch_size])  # as the client tokenises
            ids, mask = enc["input_ids"], enc["attention_mask"]
            keep = mask.bool() & ~torch.isin(ids, torch.tensor(sorted(special)))
            with torch.no_grad(), _InputCapture(targets) as cap:
                model(input_ids=ids.to(dev), attention_mask=mask.to(dev))
            for n in targets:
                h = cap.records[n].cpu()
                r = _residual(h, bases[n])
                if h.dim() == 2:  # one vector per sentence (the task head's pooled input)
                    out[n].append(r)
                    tested = r
                elif self.aggregation == "sentence":
                    w = keep.unsqueeze(-1).to(h.dtype)
                    mean = (h * w).sum(1) / w.sum(1).clamp_min(1)
                    out[n].append(_residual(mean, bases[n]))
                    tested = out[n][-1]
                elif self.aggregation == "min":
                    out[n].append(torch.where(keep, r, torch.full_like(r, float("inf"))).min(1).values)
                    tested = r[keep]
                else:
                    out[n].append((r * keep).sum(1) / keep.sum(1).clamp_min(1))
                    tested = r[keep]
                if n in chi2 and tested.numel():
                    best[n] = max(best[n], float(-tested.min()))
                    tests[n] += int(tested.numel())
        scores = {n: torch.cat(v) for n, v in out.items()}
        for n in chi2:
            passed = best[n] > bases[n].gate(tests[n], self.noise_alpha)
            if gates is not None:
                gates[n].append(passed)
            if not passed:  # nothing above what noise alone gives: every candidate ties, the layer drops out
                scores[n] = torch.zeros_like(scores[n])
        return scores


def summarise_limits(per_layer: list[dict[str, float]]) -> dict[str, float]:
    """The information limit over the layers ProjRes reads (module docstring): directions above the edge summed,
    every other key the largest over the layers (nan where no layer has it)."""
    out: dict[str, float] = {}
    for k in sorted({k for d in per_layer for k in d}):
        vals = [float(d[k]) for d in per_layer if k in d and d[k] == d[k]]
        if k in ("directions_above_edge", "signal_rank"):
            out[k] = float(sum(vals)) if vals else float("nan")
        else:
            out[k] = max(vals) if vals else float("nan")
    return out


def _rank(base) -> int:
    return base.rank if isinstance(base, NoisyRowSpace) else int(base.shape[1])


class GradientDecompositionConfig(AttackConfig):
    max_labels: int = Field(16, ge=1, description="refuse tasks with more classes than this (one gradient per class and candidate)")
    rank_rtol: float = Field(1e-10, gt=0, lt=1, description="relative eigenvalue floor of the candidates' Gram matrix")
    max_clients: Optional[int] = Field(None, ge=1, description="decompose only the first N observed clients (cost)")


@ATTACKS.register("projres_adaptive",
                  "adaptive MIA: decompose the observed update over the candidates' per-sample gradients (NNLS)")
class GradientDecomposition(AttackBase):
    """Beyond the paper: FISGuard's guarantee is ProjRes-specific. The server knows the model
    it sent (Q included), the loss and the candidates, so it computes every candidate's per-sample gradient of
    the uploaded parameters for every label y, ``g_{c,y}``, and decomposes the observed FedSGD update
    ``G = (1/B) Σ_members g_{c,y_c}`` over them by non-negative least squares. A member carries weight ≈ 1/B on
    its true label, a non-member ≈ 0; the score of a candidate is its largest weight over labels.

    Decisions: FedSGD (one local step; for FedAvg the decomposition is an approximation); the last observed
    round; the plain task loss (client-side loss changes such as label smoothing are not modelled); causal LMs
    need no label (one gradient per candidate, LM loss). NNLS runs on the Cholesky factor of the Gram matrix
    of the candidate gradients (exact, n × n instead of params × n).
    """

    name = "projres_adaptive"
    Config = GradientDecompositionConfig
    modality = "text"
    peft_kinds = ("adapters", "lora", "none")
    reconstruction = "membership"
    devices = ("cpu", "cuda")

    def __init__(self, **params: Any):
        set_config_fields(self, params)  # GradientDecompositionConfig: the one place the defaults live

    @classmethod
    def requires(cls, cfg=None) -> dict[str, bool]:
        return {"public_data": True}

    def observes_round(self, round_index: int, total_rounds: int) -> bool:
        return round_index == total_rounds - 1  # it decomposes the last observed round

    def reconstruct(self, view) -> Reconstruction:
        from scipy.optimize import nnls

        from gradleak.models.text import encode_batch

        cands, tok = view.public.get("candidates"), view.public.get("tokenizer")
        if not cands:
            raise BadInput("threat.public_data", "the adaptive attack needs candidate samples.",
                           "grant threat.public_data=true and set data.nonmembers > 0.")
        kind = view.public.get("model_kind")
        lm = view.public.get("model_task") == "lm"  # causal LM loss: no label to try
        model = copy.deepcopy(view.model).eval()
        params = dict(model.named_parameters())
        with torch.no_grad():
            for n, v in view.round_states[-1].items():
                params[n].copy_(v.to(params[n].device, params[n].dtype))
        names = [n for n in view.updates[0].tensors if n in params]
        plist = [params[n] for n in names]
        for p in plist:
            p.requires_grad_(True)
        n_labels = 1
        if not lm:
            n_labels = int(model.config.num_labels)
            if n_labels > self.max_labels:
                raise BadInput("attack.max_labels", f"the task has {n_labels} classes (> {self.max_labels}).",
                               "raise attack.max_labels (cost grows with it).")
        dev = plist[0].device
        scores, fit = {}, []
        chosen = list(cands)[: self.max_clients] if self.max_clients else list(cands)
        for ci in chosen:
            texts = cands[ci]
            target = torch.cat([view.rounds[-1][ci].tensors[n].reshape(-1).double().cpu() for n in names])
            cols = []
            for t in texts:
                ids = encode_batch(tok, kind, [t])["input_ids"].to(dev)
                if lm:
                    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
                    cols.append(self._flat(torch.autograd.grad(out.loss, plist, allow_unused=True), plist))
                    continue
                logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
                for y in range(n_labels):
                    loss = nn.functional.cross_entropy(logits, torch.tensor([y], device=dev))
                    g = torch.autograd.grad(loss, plist, retain_graph=y < n_labels - 1, allow_unused=True)
                    cols.append(self._flat(g, plist))
            A = torch.stack(cols, 1)  # params × (candidates · labels)
            w, resid = self._nnls(A, target, nnls)
            w = w.reshape(len(texts), n_labels)
            scores[ci] = w.max(1).values.tolist()
            fit.append(resid)
        info = {"parameters": len(names), "labels_tried": n_labels, "relative_fit_residual_max": max(fit)}
        return Reconstruction({"scores": scores}, info)

    @staticmethod
    def _flat(grads, plist) -> torch.Tensor:
        return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1).double().cpu()
                          for g, p in zip(grads, plist)])

    def _nnls(self, A: torch.Tensor, b: torch.Tensor, nnls):
        """min ‖A w − b‖, w ≥ 0, through the Cholesky factor R of AᵀA (Rᵀ R = AᵀA): ‖R w − R⁻ᵀ Aᵀ b‖."""
        import numpy as np

        K = (A.T @ A).numpy()
        c = (A.T @ b).numpy()
        jitter = self.rank_rtol * max(float(np.trace(K)) / len(K), 1e-300)
        R = np.linalg.cholesky(K + jitter * np.eye(len(K))).T
        z = np.linalg.solve(R.T, c)
        w, _ = nnls(R, z, maxiter=50 * len(K))
        resid = float(torch.linalg.norm(A @ torch.from_numpy(w) - b) / torch.linalg.norm(b).clamp_min(1e-300))
        return torch.from_numpy(w), resid
