"""NVFlare's own privacy filters as gradleak update defenses (docs/DESIGN.md §7), in the one registry.

Each defense runs the **real** NVFlare ``DXOFilter`` (nvflare 2.9, the optional extra ``nvflare``; imported inside
functions only) on the client's upload, as an NVFlare client's task-result filter chain would:

* the upload becomes a DXO of ``DataKind.WEIGHT_DIFF`` (:func:`to_dxo`): the weight change Δw of every trainable
  parameter, ``-lr × upload`` (a gradleak upload is a gradient or the pseudo-gradient Δw / -lr; ``ctx["lr"]``), and
  with ``include_buffers`` (default true) the BatchNorm running-statistics changes as they are
  (``num_batches_tracked``, a step counter the server knows, is left out), each a NumPy float64 array under its own
  name; the meta ``NUM_STEPS_CURRENT_ROUND`` is the upload's local steps (NVFlare's filters divide by it: their
  ``gamma`` / ``tau`` are per-step bounds);
* ``filter.process_dxo(dxo, Shareable(), FLContext())`` runs (a bare ``FLContext``: the filters only log through it);
* the filtered Δw goes back to the upload's scale (:func:`from_dxo`), in the upload's dtype.

Registered:

* ``nvflare_percentile`` -- ``PercentilePrivacy(percentile, gamma)`` (Shokri & Shmatikov 2015): the entries whose
  |Δw| / steps is below the ``percentile``-th percentile of all of them are zeroed, the rest clipped to ±``gamma``.
  The server is told the sparsity (keep fraction 1 - percentile / 100, global scope: it sees the support); the
  per-coordinate clip is a bound on values, not an L2 norm, and adds no noise.
* ``nvflare_svt`` -- ``SVTPrivacy`` (the sparse vector technique): ``ceil(fraction × #entries)`` entries are
  selected by a noisy threshold test (Laplace noise), clipped to ±``gamma`` and released with Laplace noise of scale
  2 γ n_upload / ε_release (ε_release = n_upload × ``noise_var`` unless set), every other entry zeroed. Its
  randomness is NumPy's global generator: gradleak seeds it per defense, client and round (:func:`numpy_seed`) and
  restores it afterwards. The server is told the sparsity (keep fraction ``fraction``) and that the upload carries
  noise of a scale it cannot compute from the upload hook (the scale on the upload is √2 b × steps / lr, which needs
  the round's lr): ``noise_unknown``, so the attacks read the level off the spectrum. **ε as NVFlare counts it**:
  SVTPrivacy's own accountant (``get_privacy_spent``, a pure-DP sum, δ = 0) adds ε_threshold + ε_query +
  ε_release = ``epsilon`` + ε_release per call, i.e. per client per round; gradleak keeps one filter per client (an
  NVFlare client has its own), and ``report`` gives ``dp_epsilon``: the largest client's sum (per round ×
  rounds), ``nvflare_svt_epsilon_client{c}`` and ``nvflare_svt_epsilon_per_round``. The DP check measures it
  with per-coordinate canaries against that accountant (:mod:`gradleak.run.svt_check`: the isotropic canaries of
  :mod:`gradleak.run.dp_check` are scaled to an L2 bound; SVT's is per coordinate).
* ``nvflare_exclude`` -- ``ExcludeVars(exclude_vars)``: the named tensors (a list of names, or a regular expression
  searched in each name) leave the upload. In gradleak they arrive as zeros: every client runs the same filter,
  so the aggregate of that tensor is zero, as in NVFlare where no client sends it and the global tensor stays
  unchanged. Not an advice candidate: what to withhold is a choice of tensors, not a strength on one scale.

NVFlare's quantisation filter (``nvflare.app_opt.pt.quantization.ModelQuantizer``) is not registered: its module
imports ``bitsandbytes`` at the top (not a dependency of gradleak), its 8- and 4-bit modes move every tensor to CUDA
(``.cuda()``), and it accepts float32/float16/bfloat16 only (gradleak's uploads are often float64); its float16 mode
is a cast, which gradleak's ``stochastic_quantization`` brackets.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

import numpy as np
import torch
from pydantic import Field

from gradleak.defenses.base import DefenseParams, UpdateDefense
from gradleak.errors import BadInput
from gradleak.fl.core import Update
from gradleak.registry import DEFENSES



def require_nvflare(field: str) -> None:
    """BadInput naming ``field`` and the ``nvflare`` extra when NVFlare is not installed (or not 2.9)."""
    from gradleak.fl.engines.nvflare_bridge import require_nvflare as require

    require(field, "NVFlare's privacy filters")


def fl_context():
    """A minimal NVFlare ``FLContext`` (the filters only log through it)."""
    from nvflare.apis.fl_context import FLContext

    return FLContext()


def numpy_seed(ctx: dict, seed: int) -> int:
    """The seed of NumPy's global generator for one filter call: per defense, client and round (as
    :func:`gradleak.defenses.update._gen` seeds torch)."""
    return (int(seed) * 1_000_003 + int(ctx.get("client_id", 0)) * 7_919 + int(ctx.get("seed", 0))) % (2 ** 32)


def _skip_buffer(name: str) -> bool:
    return name.endswith("num_batches_tracked")


def to_dxo(update: Update, ctx: dict, include_buffers: bool = True):
    """The upload as NVFlare's filters see it: a WEIGHT_DIFF DXO of Δw = -lr × upload (float64 NumPy arrays), the BN
    buffer changes as they are, ``NUM_STEPS_CURRENT_ROUND`` = the upload's local steps."""
    from nvflare.apis.dxo import DXO, DataKind, MetaKey

    lr = float(ctx.get("lr", 1.0))
    data = {k: t.detach().to(torch.float64).cpu().numpy() * -lr for k, t in update.tensors.items()}
    if include_buffers and update.buffers is not None:
        data.update({k: t.detach().to(torch.float64).cpu().numpy().copy() for k, t in update.buffers.items()
                     if not _skip_buffer(k)})
    return DXO(data_kind=DataKind.WEIGHT_DIFF, data=data,
               meta={MetaKey.NUM_STEPS_CURRENT_ROUND: max(int(update.local_steps or 1), 1)})


def from_dxo(dxo, update: Update, ctx: dict, include_buffers: bool = True) -> Update:
    """The filtered DXO back as an upload (Δw / -lr, the upload's dtypes); a tensor the filter removed arrives as
    zeros."""
    lr = float(ctx.get("lr", 1.0))
    data = dxo.data

    def back(t: torch.Tensor, v: Any, scale: float) -> torch.Tensor:
        if v is None:
            return torch.zeros_like(t)
        return (torch.as_tensor(np.asarray(v, dtype=np.float64)).reshape(t.shape) / scale).to(t)

    tensors = {k: back(t, data.get(k), -lr) for k, t in update.tensors.items()}
    buffers = update.buffers
    if include_buffers and buffers is not None:
        buffers = {k: (t if _skip_buffer(k) else back(t, data.get(k), 1.0)) for k, t in buffers.items()}
    return Update(tensors, update.num_samples, update.client_id, update.kind, update.local_steps, buffers)


def run_filter(flt, update: Update, ctx: dict, include_buffers: bool = True) -> Update:
    """``flt.process_dxo`` on the upload's DXO (:func:`to_dxo`), back as an upload; a filter that returns None (it
    declined) leaves the upload unchanged."""
    from nvflare.apis.shareable import Shareable

    dxo = to_dxo(update, ctx, include_buffers)
    out = flt.process_dxo(dxo, Shareable(), fl_context())
    return update if out is None else from_dxo(out, update, ctx, include_buffers)


class _NVFlareFilter(UpdateDefense):
    """An NVFlare DXO filter on the upload."""

    modalities = ("image", "text")

    def setup(self) -> None:
        require_nvflare(f"defenses.{self.registered_name}")
        self.check()

    registered_name = "nvflare"

    def check_experiment(self, cfg: Any) -> None:
        """Not applicable without NVFlare (the audit's list of applicable defenses leaves it out); read from the
        package metadata, without importing NVFlare."""
        from gradleak.fl.engines.nvflare_bridge import nvflare_problem

        problem = nvflare_problem(f"defenses.{self.registered_name}", "NVFlare's privacy filters")
        if problem is not None:
            raise problem

    def check(self) -> None:
        """The parameters beyond their types."""

    def make_filter(self):
        raise NotImplementedError

    def apply(self, update: Update, ctx: dict) -> Update:
        return run_filter(self.make_filter(), update, ctx, self.cfg.include_buffers)


@DEFENSES.register("nvflare_percentile", "NVFlare's PercentilePrivacy filter (the real class): zero the entries of Δw "
                   "below the percentile-th percentile of |Δw|, clip the rest to ±gamma")
class NVFlarePercentile(_NVFlareFilter):
    class Config(DefenseParams):
        percentile: float = Field(10.0, description="only |Δw| above this percentile of all entries is shared (0..100)")
        gamma: float = Field(0.01, description="clip of the shared per-step |Δw| (> 0)")
        include_buffers: bool = Field(True, description="BN running-statistics changes in the DXO (NVFlare sends them)")

    registered_name = "nvflare_percentile"
    advice = ({"stage": "update", "param": "percentile", "weak": 10.0, "strong": 99.9, "scale": "log1m", "unit": 100.0,
               "fixed": {}, "order": 11, "rank": 11,
               "what": "NVFlare PercentilePrivacy: the percentile of |Δw| below which entries are zeroed (the rest "
                       "clipped to ±0.01 per step)"},)

    def check(self) -> None:
        c = self.cfg
        if not 0 <= c.percentile <= 100:
            raise BadInput("defenses.nvflare_percentile.percentile", f"must be in [0, 100], got {c.percentile}.",
                           "use e.g. 10 (NVFlare's default) or 90; NVFlare itself would silently skip the filter.")
        if c.gamma <= 0:
            raise BadInput("defenses.nvflare_percentile.gamma", f"must be > 0, got {c.gamma}.",
                           "use e.g. 0.01 (NVFlare's default); NVFlare itself would silently skip the filter.")

    def make_filter(self):
        from nvflare.app_common.filters.percentile_privacy import PercentilePrivacy

        return PercentilePrivacy(percentile=self.cfg.percentile, gamma=self.cfg.gamma)

    def server_knowledge(self) -> dict:
        """The support is visible: the largest (1 - percentile / 100) of the entries are kept (all entries pooled)."""
        return {"sparsity": {"keep_fraction": 1 - self.cfg.percentile / 100.0, "scope": "global"}}


@DEFENSES.register("nvflare_svt", "NVFlare's SVTPrivacy filter (the real class): the sparse vector technique -- a "
                   "fraction of Δw's entries selected by a noisy threshold, clipped to ±gamma, released with Laplace "
                   "noise; the rest zeroed")
class NVFlareSVT(_NVFlareFilter):
    class Config(DefenseParams):
        fraction: float = Field(0.1, description="fraction of the entries uploaded (0, 1]")
        epsilon: float = Field(0.1, description="ε of the threshold and query (selection) phase, per call")
        noise_var: float = Field(0.1, description="release noise: ε_release = n_upload × noise_var (Laplace scale "
                                 "2 gamma / noise_var) unless epsilon_release is set")
        gamma: float = Field(1e-5, description="clip of the per-step |Δw| (the queries' sensitivity)")
        tau: float = Field(1e-6, description="the threshold before its noise")
        replace: bool = Field(True, description="sample the released entries with replacement (NVFlare's default)")
        epsilon_threshold: Optional[float] = Field(None, description="ε of the threshold noise (default: the standard "
                                                   "SVT split of epsilon)")
        epsilon_query: Optional[float] = Field(None, description="ε of the query noise (default: epsilon's remainder)")
        epsilon_release: Optional[float] = Field(None, description="ε of the release noise (default: n_upload × noise_var)")
        include_buffers: bool = Field(True, description="BN running-statistics changes in the DXO (NVFlare sends them)")
        seed: int = Field(0, description="seed of NumPy's generator per call (default: the run's seed)")

    seeded = True
    is_dp = True
    epsilon_delta = 0.0  # pure ε-DP: the advice prints δ = 0 beside its ε
    epsilon_words = ("pure ε-DP (δ = 0) as NVFlare's own SVTPrivacy accountant sums it: epsilon + n_upload × noise_var "
                     "per client per round, summed over the rounds (the worst client)")
    registered_name = "nvflare_svt"
    advice = ({"stage": "training", "param": "noise_var", "weak": 100.0, "strong": 1e-3, "scale": "log", "fixed": {},
               "order": 12, "rank": 12,
               "what": "NVFlare SVTPrivacy's noise_var: release noise Laplace(2 gamma / noise_var) per selected entry "
                       "(gamma = 1e-5 per step, 10 % of the entries; named in defense: so its ε is reported)"},)

    def check(self) -> None:
        c, f = self.cfg, "defenses.nvflare_svt."
        if not 0 < c.fraction <= 1:
            raise BadInput(f + "fraction", f"must be in (0, 1], got {c.fraction}.", "use e.g. 0.1 (NVFlare's default).")
        for name in ("epsilon", "noise_var", "gamma"):
            if not getattr(c, name) > 0:
                raise BadInput(f + name, f"must be > 0, got {getattr(c, name)}.", "use NVFlare's default or larger.")
        for name in ("epsilon_threshold", "epsilon_query", "epsilon_release"):
            v = getattr(c, name)
            if v is not None and not v > 0:
                raise BadInput(f + name, f"must be > 0, got {v}.", "leave it out (NVFlare's split) or set it > 0.")
        #: one SVTPrivacy per client (an NVFlare client runs its own filter, with its own accountant)
        self.filters: dict[int, Any] = {}

    def make_filter(self, client_id: int = 0):
        from nvflare.app_common.filters.svt_privacy import SVTPrivacy

        if client_id not in self.filters:
            c = self.cfg
            self.filters[client_id] = SVTPrivacy(
                fraction=c.fraction, epsilon=c.epsilon, noise_var=c.noise_var, gamma=c.gamma, tau=c.tau,
                replace=c.replace, epsilon_threshold=c.epsilon_threshold, epsilon_query=c.epsilon_query,
                epsilon_release=c.epsilon_release)
        return self.filters[client_id]

    def apply(self, update: Update, ctx: dict) -> Update:
        flt = self.make_filter(int(ctx.get("client_id", update.client_id)))
        state = np.random.get_state()
        np.random.seed(numpy_seed(ctx, self.cfg.seed))
        try:
            return run_filter(flt, update, ctx, self.cfg.include_buffers)
        finally:
            np.random.set_state(state)

    def epsilon_per_call(self, entries: int) -> float:
        """ε one call spends on an upload of ``entries`` entries, as SVTPrivacy's accountant adds it: ε_threshold +
        ε_query + ε_release = epsilon + ε_release (ε_release = n_upload × noise_var unless set)."""
        c = self.cfg
        n_upload = int(min(math.ceil(float(entries) * c.fraction), float(entries)))
        release = c.epsilon_release if c.epsilon_release is not None else float(n_upload) * c.noise_var
        return float(c.epsilon) + float(release)

    def report(self, rounds: list) -> dict[str, float]:
        """ε as NVFlare counts it: each client's filter's own accountant (``get_privacy_spent``: the per-call ε summed
        over its calls, one a round; pure DP, δ = 0); ``dp_epsilon`` the largest."""
        spent = {c: float(f.get_privacy_spent()) for c, f in self.filters.items()}
        if not spent:
            return {}
        out = {f"nvflare_svt_epsilon_client{c}": e for c, e in sorted(spent.items())}
        out["dp_epsilon"] = max(spent.values())
        ledger = [call for f in self.filters.values() for call in f.get_privacy_ledger()]
        if ledger:
            out["nvflare_svt_epsilon_per_round"] = max(float(call["epsilon_total"]) for call in ledger)
        return out

    @classmethod
    def advice_epsilon(cls, value, rounds: int, measured, delta: float, gaussian_epsilon):
        """The run's ``dp_epsilon``: SVTPrivacy's own accountant (per round × rounds, pure DP)."""
        return measured

    def server_knowledge(self) -> dict:
        """The support is visible (about ``fraction`` of the entries); the release noise's scale on the upload needs
        the round's lr, which the noise hook does not receive: ``noise_unknown``."""
        return {"sparsity": {"keep_fraction": float(self.cfg.fraction), "scope": "global"}, "noise_unknown": True}

    def observed_noise_variance(self, update: Update, aggregate_of: int = 1, individual: bool = True,
                                tensor: str | None = None) -> None:
        return None


@DEFENSES.register("nvflare_exclude", "NVFlare's ExcludeVars filter (the real class): the named tensors (a list, or "
                   "a regular expression) are not uploaded")
class NVFlareExclude(_NVFlareFilter):
    class Config(DefenseParams):
        exclude_vars: Union[list[str], str] = Field(description="tensor names, or a regular expression searched in "
                                                    "each name")
        include_buffers: bool = Field(True, description="BN running-statistics changes in the DXO (NVFlare sends them)")

    registered_name = "nvflare_exclude"

    def check(self) -> None:
        if not self.cfg.exclude_vars:
            raise BadInput("defenses.nvflare_exclude.exclude_vars", "names nothing to exclude.",
                           "give tensor names (a list) or a regular expression; NVFlare would silently skip the filter.")

    def make_filter(self):
        from nvflare.app_common.filters.exclude_vars import ExcludeVars

        v = self.cfg.exclude_vars
        return ExcludeVars(exclude_vars=list(v) if isinstance(v, list) else v)


__all__ = ["NVFlareExclude", "NVFlarePercentile", "NVFlareSVT", "fl_context", "from_dxo", "numpy_seed",
           "require_nvflare", "run_filter", "to_dxo"]
