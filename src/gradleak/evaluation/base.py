"""The shared ground of the evaluation units (docs/DESIGN.md §2): what the evaluation sees (:class:`Truth`), what it returns
(:class:`Evaluation`), what one reconstruction kind means (:class:`EvaluationUnit`) and the registry of units.

Evaluation is the only step that sees the ground truth. An attack's ``reconstruction`` kind picks its unit; the unit
scores the reconstruction against the private samples, puts the null beside every headline metric
(:func:`attach_null`, :mod:`gradleak.evaluation.nulls`), and carries the level rules the audit grades with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from gradleak.registry import Registry


@dataclass
class Truth:
    """The private samples the observed update came from (never shown to the attack)."""

    modality: str
    inputs: Any  # images in [0, 1] (B×C×H×W) or encoded text {"input_ids", "attention_mask"}
    labels: torch.Tensor
    texts: list[str] | None = None
    tokenizer: Any = None
    model_kind: str | None = None
    bottleneck: int | None = None
    membership: dict[int, list[bool]] | None = None  # per observed update: which candidates are members
    client_inputs: list[torch.Tensor] | None = None  # leakage: every client's training images in [0, 1]
    client_validation: list[torch.Tensor] | None = None  # leakage: every client's validation images (IIP pool)
    client_steps: list[int] | None = None  # leakage: every client's local steps (picks the high-risk client)
    null_pool: Any = None  # public samples of the same source no client holds (images in [0, 1] / sentences)
    null_source: str | None = None  # what the null pool is, in words


@dataclass
class Evaluation:
    metrics: dict[str, float]
    figures: list[dict] = field(default_factory=list)
    tables: list[dict] = field(default_factory=list)
    artifacts: list[str] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)  # per-sample rows (text: reference vs reconstruction)
    notes: list[str] = field(default_factory=list)
    client: int = 0  # the attacked client (metrics.attack_clients = all: every client in turn)
    trial: Any = 0



def _no_fields(metrics: Mapping[str, Any]) -> dict:
    return {}


def _headline_decides(metrics: Mapping[str, Any], level: str) -> str | None:
    return None


def _no_truth_fields(data, trial: int, batches: list, threat, cfg) -> tuple[dict, dict]:
    return {}, {}


def _no_hint(metrics: Mapping[str, Any]) -> str:
    return ""


def every_client_data(data, trial: int, batches: list, threat, cfg) -> tuple[dict, dict]:
    """The truth fields of a unit that scores every client of the federation in one run (``scores_every_client``):
    every client's training images (``client_inputs``), the held-out validation images (``client_validation``, the
    IIP pool) and each client's local steps (``client_steps``, which pick the high-risk client); the server is
    granted nothing more."""
    steps = [p["epochs"] * -(-p["images"] // p["batch_size"]) for p in cfg.client_plan()]
    return {}, {"client_inputs": [b[0] for b in batches], "client_validation": data.validation(),
                "client_steps": steps}


@dataclass(frozen=True)
class EvaluationUnit:
    """Everything one reconstruction kind means, in one place.

    * ``evaluate(truth, rec, cfg, out_dir, trial) -> Evaluation``: the metrics against the truth, each headline with
      its null (``<m>_null_median``, ``<m>_null_p99``, ``<m>_p_value``);
    * ``headline``: the metric the audit reports (its null sits beside it);
    * ``grade(metrics, psnr_threshold_db) -> {"level", "rule", "evidence"}``: the level rules
      (:mod:`gradleak.evaluation.levels` holds the levels and the verdict);
    * ``sweep_metric``: the metric a sweep prints and plots for this kind;
    * ``per_client``: whether the pipeline attacks one client at a time (``metrics.attack_clients: all``); membership
      and leakage attacks score every client themselves;
    * ``audit_fields(metrics)``: the audit entry's extra fields (samples reconstructed, units, intervals);
    * ``decided_by(metrics, level)``: the metric whose test decided ``grade``'s level (e.g. word-bag recall for a
      word-bag ``partial``), which the audit shows with *its* null (``<m>_null_p99``, ``<m>_p_value``) -- None: the
      headline;
    * ``rules``: the level rules in words, as the audit's report lists them (``levels.rules`` of audit.json; the
      table of :mod:`gradleak.evaluation.levels` is their summary);
    * ``scores_every_client``: one run scores every client of the federation, each client's metrics suffixed
      ``<m>_client<c>`` (:meth:`clients_of`); the audit keeps the clients' own labels (a sum of updates is never
      credited for them) and a round audit grades only the clients whose uploads it holds;
    * ``counts_batch_samples``: ``audit_fields``' ``n_total`` counts the attacked batch's private samples (images,
      sentences; not patches), so a round audit reads it from the truth it holds;
    * ``draws_null_pool``: the null is drawn from public samples of the data's source (the membership kind's null is
      its candidates: no pool is drawn for it);
    * ``truth_fields(data, trial, batches, threat, cfg) -> (granted, fields)``: what the kind needs beside the
      private batch -- ``granted``: public knowledge the server is given for it (membership: the candidates),
      ``fields``: extra :class:`Truth` fields for the evaluation (membership labels; every client's data);
    * ``undefined_hint(metrics)``: words appended to an ``undefined`` level's reason, naming the config field that
      would make it measurable (membership without non-members: ``data.nonmembers``); "" when there is none.
    """

    kind: str
    evaluate: Callable[..., Evaluation]
    headline: str
    grade: Callable[[Mapping[str, Any], float], dict]
    sweep_metric: str
    per_client: bool = False
    audit_fields: Callable[[Mapping[str, Any]], dict] = _no_fields
    decided_by: Callable[[Mapping[str, Any], str], "str | None"] = _headline_decides
    rules: str = ""
    scores_every_client: bool = False
    counts_batch_samples: bool = False
    draws_null_pool: bool = True
    truth_fields: Callable[..., "tuple[dict, dict]"] = _no_truth_fields
    undefined_hint: Callable[[Mapping[str, Any]], str] = _no_hint

    def clients_of(self, metrics: Mapping[str, Any]) -> "list[tuple[int, dict]] | None":
        """Every client's metrics of one run of a unit that scores every client (``<m>_client<c>`` -> client ``c``'s
        ``<m>``), in client order; a run with no suffixed metric is client 0's. None for a unit that does not
        (its run's clients are the pipeline's per-client records)."""
        if not self.scores_every_client:
            return None
        import re

        out: dict[int, dict] = {}
        for k, v in metrics.items():
            mt = re.fullmatch(r"(.+)_client(\d+)", k)
            if mt:
                out.setdefault(int(mt.group(2)), {})[mt.group(1)] = v
        return sorted(out.items()) or [(0, dict(metrics))]

    def client_suffix(self, client: Any) -> str:
        """The suffix of a client's own metrics in the run's metrics (``_client<c>`` where :meth:`clients_of` split
        them; "" otherwise)."""
        return f"_client{client}" if self.scores_every_client else ""


EVALUATORS: Registry[EvaluationUnit] = Registry("evaluator")


def register(unit: EvaluationUnit, summary: str) -> EvaluationUnit:
    return EVALUATORS.register(unit.kind, summary)(unit)


def unit(kind: str) -> EvaluationUnit:
    """The unit of a reconstruction kind (a clear error naming ``attack.reconstruction`` for an unknown one)."""
    return EVALUATORS.get(kind, field="attack.reconstruction")


def attach_null(metrics: dict, key: str, null, lower_is_leak: bool = False) -> None:
    """``metrics[key]`` gets its null beside it: ``<key>_null_median``, ``<key>_null_p99``, ``<key>_p_value``."""
    from gradleak.evaluation.nulls import summarize

    s = summarize(metrics.get(key, float("nan")), null, lower_is_leak)
    metrics[f"{key}_null_median"], metrics[f"{key}_null_p99"], metrics[f"{key}_p_value"] = (
        s["null_median"], s["null_p99"], s["p_value"])



def evaluate(kind: str, truth: Truth, rec, cfg, out_dir: Path, trial: int = 0) -> Evaluation:
    ev = unit(kind).evaluate(truth, rec, cfg, out_dir, trial)
    for k, v in (rec.metrics or {}).items():  # attack-side numbers (no truth involved)
        ev.metrics.setdefault(k, float(v))
    return ev
