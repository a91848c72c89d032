"""The DP check's canary statistics, streamed round by round (docs/DESIGN.md §6; :mod:`gradleak.run.dp_check`).

:class:`CanaryStatistics` reads each round's aggregate step and the canaries' uploads once and keeps running sums
(count, mean, M2, smallest, largest; per canary and per tensor), so what the check holds does not grow with the rounds:
the cosines of Andrew et al. (ICLR 2024, Sec. 3-4) and each tensor's noise summary, which
:func:`gradleak.evaluation.empirical_epsilon.tensor_tests` tests against the claim.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch


class _Running:
    """Running count, mean, M2 (Welford), smallest and largest of a ratio, and the summed energies behind it, each an
    array of one shape (canaries × tensors, or tensors): updated one round at a time, never a list of rounds."""

    def __init__(self, shape: tuple[int, ...]):
        import numpy as np

        self.count = np.zeros(shape)
        self.mean = np.zeros(shape)
        self.m2 = np.zeros(shape)
        self.min = np.full(shape, np.inf)
        self.max = np.full(shape, -np.inf)
        self.energy = np.zeros(shape)  # the tensor's energy, summed
        self.rest = np.zeros(shape)  # the rest's energy (after the signal bound), summed

    def add(self, where, ratio, energy, rest, seen=True) -> None:
        """Add one value at ``where`` (an index into the arrays) where ``seen`` (a mask: the tensors present)."""
        import numpy as np

        seen = np.asarray(seen, bool)
        n = self.count[where] + seen
        d = np.where(seen, ratio - self.mean[where], 0.0)
        d = np.where(np.isfinite(d), d, 0.0)  # an ∞ ratio (no rest energy) counts in min / max only
        mean = self.mean[where] + np.where(n > 0, d / np.maximum(n, 1), 0.0)
        self.m2[where] = self.m2[where] + np.where(seen, d * (np.where(np.isfinite(ratio), ratio, mean) - mean), 0.0)
        self.mean[where], self.count[where] = mean, n
        self.min[where] = np.where(seen, np.minimum(self.min[where], ratio), self.min[where])
        self.max[where] = np.where(seen, np.maximum(self.max[where], ratio), self.max[where])
        self.energy[where] = self.energy[where] + np.where(seen, energy, 0.0)
        self.rest[where] = self.rest[where] + np.where(seen, rest, 0.0)


class CanaryStatistics:
    """The statistics of ``k`` canaries (``unit(j)``: canary j's flat unit direction), streamed one round at a time
    (:meth:`add_round`): what :func:`gradleak.run.dp_check.dp_check` measures, held in O(k × tensors) memory whatever
    the number of rounds (no upload, direction or round delta is kept past its round).

    Per canary j: its largest cosine with a round's aggregate step (``every_round``), with its own upload (client
    ``first_id + j``; ``each_upload``) and the count of its uploads; at :meth:`finish`, its cosine with the final
    model's change (``final_model``). With ``tensors`` (the inserted canaries), also each tensor's noise (Andrew et al.
    read the cosine only; ours, docs/DESIGN.md §6): per canary and tensor, the energy of its upload across its own
    direction's part, over the rest's (:func:`gradleak.evaluation.empirical_epsilon.tensor_ratios`; count, mean, M2,
    smallest, largest of the ratio and the summed energies), and per tensor the same of each released aggregate step
    and of the final change, after the canaries' common part is fitted and taken off, with the real clients' clipped
    updates bounded by ``signal_bound`` × the fitted canary coefficient (their summed weight over a canary's: a real
    client is clipped to the bound a canary is clipped to)."""

    def __init__(self, k: int, shapes: Sequence[tuple[str, torch.Size]], unit, *, first_id: int | None = None,
                 tensors: bool = False, signal_bound: float = 0.0):
        import numpy as np

        self.k, self.shapes, self.unit, self.first_id = int(k), list(shapes), unit, first_id
        self.sizes = np.array([int(torch.Size(s).numel()) for _, s in self.shapes], dtype=float)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(int)
        self.tensors, self.signal_bound = bool(tensors), float(signal_bound)
        self.rounds = 0
        self.every_round = np.full(self.k, -np.inf)
        self.each_upload = np.full(self.k, -np.inf)
        self.uploads = np.zeros(self.k, dtype=int)
        t = len(self.shapes)
        self.upload_tensors = _Running((self.k, t)) if tensors else None
        self.step_tensors = _Running((t,)) if tensors else None
        self.final_tensors = _Running((t,)) if tensors else None
        self._canary_sum = None  # Σ_j unit(j) (one flat vector), for the canaries' common part of an aggregate
        self._final = None  # the final-model cosines, when the last round's call was handed the final change

    def state_bytes(self) -> int:
        """The bytes of the arrays it holds (tests: the same after 2 rounds and after 20)."""
        import numpy as np

        total = 0
        for v in vars(self).values():
            parts = vars(v).values() if isinstance(v, _Running) else [v]
            for p in parts:
                if isinstance(p, np.ndarray):
                    total += p.nbytes
                elif isinstance(p, torch.Tensor):
                    total += p.numel() * p.element_size()
                elif isinstance(p, (list, tuple, dict)) and p is not self.shapes:
                    total += 8 * len(p)
        return total

    def _aggregate_energies(self, delta: torch.Tensor) -> tuple:
        """Each tensor's energy of ``delta`` after the canaries' common part (fitted on Σ_j unit(j)) is taken off, and
        the bound on the real clients' signal left in it."""
        import numpy as np

        s = self._canary_sum
        ss = float(s @ s)
        a = float(delta @ s) / ss if ss > 0 else 0.0
        res = delta - a * s if ss > 0 else delta
        e = np.array([float(res[i:j] @ res[i:j]) for i, j in zip(self.offsets[:-1], self.offsets[1:])])
        # the fitted coefficient's own noise: the residual's spread per coordinate over ‖Σ unit‖
        noise = math.sqrt(max(e.sum(), 0.0) / max(len(res), 1)) / math.sqrt(ss) if ss > 0 else 0.0
        return e, self.signal_bound * (abs(a) + 4.0 * noise)

    def _add_tensors(self, run: _Running, delta: torch.Tensor) -> None:
        from gradleak.evaluation.empirical_epsilon import tensor_ratios

        e, bound = self._aggregate_energies(delta)
        ratio, rest = tensor_ratios(e, self.sizes, bound=bound)
        run.add(slice(None), ratio, e, rest)

    def add_round(self, delta: torch.Tensor, uploads: dict[int, dict[str, torch.Tensor]] | None = None,
                  final: torch.Tensor | None = None) -> None:
        """One round: ``delta`` the flat aggregate step the server applied (the parameters sent this round minus
        those sent next, float64), ``uploads`` (client id -> its upload's tensors) when each upload is measured;
        ``final`` (the last round's call): the change over all rounds, whose cosines are then read in the same pass
        over the canaries (a direction regenerated once, not twice; :meth:`finish` takes the same vector)."""
        import numpy as np

        from gradleak.evaluation.empirical_epsilon import tensor_ratios

        dn = float(delta.norm().clamp_min(1e-300))
        if final is not None:
            fn = float(final.norm().clamp_min(1e-300))
            self._final = np.zeros(self.k)
        build = self.tensors and self._canary_sum is None
        if build:
            self._canary_sum = torch.zeros_like(delta)
        df = self.sizes - 1
        for j in range(self.k):
            v = self.unit(j)
            if build:
                self._canary_sum += v
            self.every_round[j] = max(self.every_round[j], float(v @ delta) / dn)
            if final is not None:
                self._final[j] = float(v @ final) / fn
            u = uploads.get(self.first_id + j) if uploads is not None and self.first_id is not None else None
            if u is None:
                continue
            dots, sqs, vvs, seen = [], [], [], []
            for (name, _), i, k in zip(self.shapes, self.offsets[:-1], self.offsets[1:]):
                t = u.get(name)
                if t is None:  # a tensor the upload does not carry: nothing of it is released
                    dots.append(0.0), sqs.append(0.0), vvs.append(1.0), seen.append(False)
                    continue
                t = t.reshape(-1).to(torch.float64)
                vt = v[i:k]
                dots.append(float(vt @ t)), sqs.append(float(t @ t)), vvs.append(float(vt @ vt)), seen.append(True)
            dots, sqs, vvs, seen = (np.array(x) for x in (dots, sqs, vvs, seen))
            self.each_upload[j] = max(self.each_upload[j], dots.sum() / max(math.sqrt(sqs.sum()), 1e-300))
            self.uploads[j] += 1
            if self.tensors:
                across = np.where(seen, np.maximum(sqs - np.where(vvs > 0, dots * dots / np.where(vvs > 0, vvs, 1),
                                                                   0.0), 0.0), 0.0)
                ratio, rest = tensor_ratios(across, np.where(seen, df, 0.0))
                self.upload_tensors.add(j, ratio, across, rest, seen & (df > 0))
        if self.tensors:
            self._add_tensors(self.step_tensors, delta)
        self.rounds += 1

    def finish(self, final: torch.Tensor) -> dict:
        """The statistics after the last round, ``final`` the flat change of the parameters over all rounds: per threat
        model the canaries' values (``final_model``, ``every_round``, ``each_upload``: canaries with an upload), the
        most cosines a statistic is the largest of (``maxima``), and with ``tensors`` each threat model's noise
        summary (``tensors``: :func:`gradleak.evaluation.empirical_epsilon.tensor_tests`)."""
        import numpy as np

        fn = float(final.norm().clamp_min(1e-300))
        cos = self._final.tolist() if self._final is not None else [float(self.unit(j) @ final) / fn
                                                                      for j in range(self.k)]
        out = {"final_model": cos,
               "every_round": self.every_round.tolist(),
               "each_upload": [float(x) for x, n in zip(self.each_upload, self.uploads) if n > 0],
               "maxima": {"final_model": 1, "every_round": self.rounds,
                          "each_upload": int(self.uploads.max()) if self.k else 0}}
        if self.tensors:
            self._add_tensors(self.final_tensors, final)
            names = [n for n, _ in self.shapes]
            up = self.upload_tensors
            out["tensors"] = {"final_model": _summary(names, self.sizes, self.final_tensors, 1),
                              "every_round": _summary(names, self.sizes, self.step_tensors, self.rounds)}
            if self.uploads.sum():
                pooled = _Running((len(names),))
                pooled.count, pooled.energy, pooled.rest = up.count.sum(0), up.energy.sum(0), up.rest.sum(0)
                pooled.min = up.min.min(0)
                out["tensors"]["each_upload"] = _summary(names, self.sizes - 1, pooled, int(self.uploads.sum()))
        return out


def _summary(names: list[str], df, run: _Running, vectors: int) -> dict:
    """The noise summary :func:`gradleak.evaluation.empirical_epsilon.tensor_tests` reads, from running sums."""
    import numpy as np

    df = np.asarray(df, float)
    rest_df = df.sum() - df
    with np.errstate(divide="ignore", invalid="ignore"):
        pooled = (run.energy / np.where(df > 0, df, 1)) / (run.rest / np.where(rest_df > 0, rest_df, 1))
    pooled = np.where(run.rest > 0, pooled, np.where(run.energy > 0, np.inf, 1.0))
    return {"names": list(names), "df": df.tolist(), "vectors": int(vectors), "pooled_ratio": pooled.tolist(),
            "min_ratio": np.where(np.isfinite(run.min) | (run.min > 0), run.min, 1.0).tolist()}
