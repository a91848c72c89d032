"""The information limit of PEFTLeak's attacked tensor -- its adapter bins -- under the declared upload noise, and the
oracle restriction of an upload to its strongest bins (the ceiling of benchmarks/defended.py; docs/DESIGN.md §6).

**The attacked tensor.** PEFTLeak reads every usable bin j of every attacked adapter: the difference
``d_j = (ΔW_j, Δb_j)`` of neuron j and neuron j + 1 of the down-projection gradient (the top bin: the top neuron
alone), D + 1 coordinates (PEFTLeak Sec. 4.3, eqs. (24)–(25)). A lone patch in the bin makes ``d_j`` proportional to
its adapter input; an empty bin is zero.

**Its limit under noise** (the noise model of :mod:`.denoise`): i.i.d. N(0, σ²) per upload coordinate puts
N(0, v_j) on every coordinate of ``d_j``, v_j = 2σ² (σ² for the top bin). A bin's energy ``E_j = ‖d_j‖² / v_j`` is
χ²_{D+1} under noise alone; the **noise edge** is the χ²_{D+1} quantile at ``alpha / n_bins`` (Bonferroni over every
usable bin of the observed rounds) -- the noise mode's own occupancy test, so pure noise puts no bin above it with
probability ≥ 1 − alpha. Written with the bin's *noise-free-scale energy* ``u_j = w_j ‖d_j‖²`` (w_j = ½, 1 for the
top bin), ``E_j = u_j / σ²``: the order of the bins by u does not depend on σ. The metrics (suffix
:data:`SUFFIX`, read like :func:`gradleak.attacks.common.subspace.spectral_margin`'s per tensor):

* ``directions_above_edge`` -- bins whose energy stands above the edge (the bins any attacker can tell from noise;
  "directions" so every part's limit has the same key);
* ``margin_strongest`` -- √(E_max / edge): the strongest bin's norm over the edge's (does not saturate; ≤ 1: no bin
  stands out of the noise);
* ``spectral_margin`` -- the same for the weakest bin above the edge (the margin at the attack's cut: just above 1
  by construction wherever bins cross the edge; never read as absence);
* ``debiased_strongest`` / ``debiased_weakest_above_edge`` -- the signal norm behind those bins, √(‖d_j‖² −
  v_j (D + 1)) (the noise's mean energy removed; 0 where nothing is left);

and, whether or not a noise std is known, the **signal scale** as a per-coordinate std:

* ``drowning_noise_std_all`` -- √(s_max / (edge − (D + 1))), s = the bin's signal part of u (u itself noise-free;
  under noise u − σ²(D + 1), the noise's mean removed): the upload noise std at which the strongest bin's expected
  energy, signal s/σ² plus the noise's mean D + 1, reaches the edge;
* ``drowning_noise_std_median`` / ``drowning_noise_std`` -- the same for the median / the weakest bin carrying
  signal (noise-free: every bin above float64 rounding, ‖d_j‖ > 1e-9 of the strongest; under noise: the bins
  above the edge).

On the undefended upload these read the signal exactly: a noise std well above ``drowning_noise_std_all`` leaves no
bin above the edge (K = 0), one well below ``drowning_noise_std`` leaves every one, and at a std between them about
the bins whose drowning std exceeds it stand above (the energy's spread, √(2(D + 1)) at noise alone, blurs the
crossing). Counting the noise's mean matters: with D = 768 and 1536 bins the edge is 952, so a bin crosses at a std
√(952 / 183) = 2.3 x the one at which its signal energy alone reaches the edge.

**Oracle restriction** (:func:`strongest_bins`, ``attack.keep_bins = K``): keep the K bins of largest u, zero every
other bin's difference, then recover as usual: what the attack does with the K bins a noisy upload leaves above its
edge, read noise-free -- the ceiling of the surviving information, graded by the same null. A zeroed bin is *unknown*,
not empty: the recovery's consistency filter lets a candidate fall there (:meth:`.recovery.PEFTLeakRecovery._unknown`)
and no trust is drawn from it. Measured on the tiny test ViT (8 images, 199 carrying bins): read as empty, the 27
strongest bins gave no patch (every candidate's other adapters fell in zeroed bins); read as unknown, 5 of 32
patches -- a ceiling that reads a drowned consistency check as absent information would be green over a leak.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from gradleak.attacks.peftleak.geometry import F64
from gradleak.errors import BadInput

#: the metrics' suffix: the tensor PEFTLeak's limit is read on
SUFFIX = "adapter_bins"
#: a bin carries signal, noise-free, when its norm exceeds this fraction of the strongest bin's (float64 rounding)
ROUNDING = 1e-9


def bin_differences(upd, pre: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The down-projection gradients of adapter ``pre`` in ``upd`` (float64, CPU) and their bin differences: bin j =
    neuron j minus neuron j + 1, the top bin alone (PEFTLeak eqs. 24-25): ``(GW, Gb, dGW, dGb)``."""
    if f"{pre}.down.weight" not in upd.tensors:
        raise BadInput("update", f"the observed update lacks '{pre}.down.weight'.",
                       "the client must upload the adapter gradients (adapters trainable).")
    GW = upd.tensors[f"{pre}.down.weight"].to("cpu", F64)
    Gb = upd.tensors[f"{pre}.down.bias"].to("cpu", F64)
    return GW, Gb, torch.cat([GW[:-1] - GW[1:], GW[-1:]]), torch.cat([Gb[:-1] - Gb[1:], Gb[-1:]])


def bin_energies(view, server, n_rounds: int) -> list[tuple[int, int, int, float]]:
    """``(round, slot index, bin, u)`` for every usable bin of the first ``n_rounds`` observed rounds, u = w‖d‖²
    (module docstring)."""
    out = []
    for k in range(n_rounds):
        upd = view.rounds[k][0]
        for sp in server.plans[k].slots:
            _, _, dGW, dGb = bin_differences(upd, sp.slot.prefix)
            u = (dGW * dGW).sum(1) + dGb * dGb
            w = torch.full_like(u, 0.5)
            w[-1] = 1.0
            u = (u * w).tolist()
            out += [(k, sp.index, j, u[j]) for j in sp.usable_bins]
    return out


def edge(alpha: float, n_bins: int, D: int) -> float:
    """The noise edge of one bin's energy: the χ²_{D+1} quantile at ``alpha / n_bins`` (the noise mode's occupancy
    threshold, :class:`.denoise.NoiseTests`)."""
    from scipy.stats import chi2

    return float(chi2.isf(alpha / max(n_bins, 1), D + 1))


def bin_limit(view, server, n_rounds: int, sigma: Optional[float], alpha: float) -> dict[str, float]:
    """The limit of the observed bins (module docstring) at per-coordinate upload noise std ``sigma`` (None: not
    known; only the signal scale is read), edge at false-alarm level ``alpha``; keys ``<name>_``:data:`SUFFIX`."""
    bins = bin_energies(view, server, n_rounds)
    if not bins:
        return {}
    D = server.D
    thr = edge(alpha, len(bins), D)
    u = torch.tensor([b[3] for b in bins], dtype=F64)
    w = torch.tensor([1.0 if b[2] == server.r - 1 else 0.5 for b in bins], dtype=F64)
    out: dict[str, float] = {}
    signal = u  # the signal part of u (noise-free: all of it)
    if sigma is not None and sigma > 0:
        E = u / sigma ** 2
        above = E > thr
        signal = (u - sigma ** 2 * (D + 1)).clamp(min=0)
        carrying = signal[above]
        i = int(torch.argmax(E))
        signal2 = (u - sigma ** 2 * (D + 1)) / w  # ‖d‖² less the noise's mean energy v (D + 1)
        out["directions_above_edge"] = float(above.sum())
        out["margin_strongest"] = math.sqrt(float(E[i]) / thr)
        out["debiased_strongest"] = math.sqrt(max(float(signal2[i]), 0.0))
        if bool(above.any()):
            j = int(torch.nonzero(above)[:, 0][torch.argmin(E[above])])
            out["spectral_margin"] = math.sqrt(float(E[j]) / thr)
            out["debiased_weakest_above_edge"] = math.sqrt(max(float(signal2[j]), 0.0))
        else:
            out["spectral_margin"] = float("nan")
            out["debiased_weakest_above_edge"] = 0.0
    else:
        carrying = u[u > (ROUNDING ** 2) * float(u.max())] if float(u.max()) > 0 else u[:0]
    room = thr - (D + 1)  # the edge less the noise's mean energy: what a bin's signal must supply
    out["drowning_noise_std_all"] = math.sqrt(float(signal.max()) / room)
    if len(carrying):
        out["drowning_noise_std_median"] = math.sqrt(float(carrying.median()) / room)
        out["drowning_noise_std"] = math.sqrt(float(carrying.min()) / room)
    else:
        out["drowning_noise_std_median"] = out["drowning_noise_std"] = 0.0
    out["bins_tested"] = float(len(bins))
    return {f"{k}_{SUFFIX}": v for k, v in out.items()}


def strongest_bins(view, server, n_rounds: int, keep: int) -> dict[tuple[int, int], torch.Tensor]:
    """``(round, slot index) -> bool mask over the slot's r bins``: True for the ``keep`` usable bins of largest
    u over all observed rounds (ties broken by order), False for every other bin (usable or not): the oracle
    restriction of the module docstring."""
    bins = bin_energies(view, server, n_rounds)
    order = sorted(range(len(bins)), key=lambda i: -bins[i][3])[:max(int(keep), 0)]
    masks: dict[tuple[int, int], torch.Tensor] = {}
    for k in range(n_rounds):
        for sp in server.plans[k].slots:
            masks[(k, sp.index)] = torch.zeros(server.r, dtype=torch.bool)
    for i in order:
        k, idx, j, _ = bins[i]
        masks[(k, idx)][j] = True
    return masks


def apply_mask(dGW: torch.Tensor, dGb: torch.Tensor, mask: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The bin differences with every bin outside ``mask`` zeroed (``mask`` None: unchanged)."""
    if mask is None:
        return dGW, dGb
    return dGW * mask[:, None].to(dGW.dtype), dGb * mask.to(dGb.dtype)


__all__ = ["ROUNDING", "SUFFIX", "apply_mask", "bin_energies", "bin_limit", "edge", "strongest_bins"]
