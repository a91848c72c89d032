"""Evaluation units (docs/DESIGN.md §2): the only step that sees the ground truth, one unit per reconstruction kind.

Each unit module registers an :class:`~gradleak.evaluation.base.EvaluationUnit` under its kind -- its evaluator
(the metrics against the private samples, with the null beside every headline), its headline metric, its level
rules, its sweep metric and its audit fields:

* :mod:`~gradleak.evaluation.images` (``images``), :mod:`~gradleak.evaluation.patches` (``patches``),
  :mod:`~gradleak.evaluation.leakage` (``leakage``), :mod:`~gradleak.evaluation.text` (``token_sequences``),
  :mod:`~gradleak.evaluation.membership` (``membership``);
* shared: :mod:`~gradleak.evaluation.base` (Truth, Evaluation, the registry ``EVALUATORS``, ``evaluate``),
  :mod:`~gradleak.evaluation.nulls` (chance, matched exactly as the attack is scored), :mod:`~gradleak.evaluation.levels`
  (the levels, the bar, the verdict).

A new reconstruction kind is one new module here (imported below).
"""

from gradleak.evaluation.levels import LEAKING, LEVELS, grade, level_rank, verdict_of
from gradleak.evaluation.nulls import NULL_DRAWS, summarize
from gradleak.evaluation.base import EVALUATORS, Evaluation, EvaluationUnit, Truth, evaluate, unit
from gradleak.evaluation import images, leakage, membership, patches, text  # noqa: F401 -- registers the units

__all__ = ["EVALUATORS", "Evaluation", "EvaluationUnit", "LEAKING", "LEVELS", "NULL_DRAWS", "Truth", "evaluate",
           "grade", "level_rank", "summarize", "unit", "verdict_of"]
