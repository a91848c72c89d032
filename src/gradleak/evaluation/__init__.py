"""Evaluation units (DESIGN §2): per reconstruction kind, the null a score is read against and the graded level
rules that turn one attacked client's metrics into ``exact`` / ``strong`` / ``partial`` / ``none`` / ``undefined``.

* :mod:`gradleak.evaluation.nulls` -- chance, matched exactly as the attack is scored (>= 200 seeded draws);
* :mod:`gradleak.evaluation.levels` -- the level table and the audit's verdict.

The evaluators that see the ground truth live in :mod:`gradleak.experiments.evaluation` and attach these nulls to
every headline metric (``<m>_null_median``, ``<m>_null_p99``, ``<m>_p_value``).
"""

from gradleak.evaluation.levels import LEAKING, LEVELS, grade, level_rank, verdict_of
from gradleak.evaluation.nulls import NULL_DRAWS, summarize

__all__ = ["LEAKING", "LEVELS", "NULL_DRAWS", "grade", "level_rank", "summarize", "verdict_of"]
