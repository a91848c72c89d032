"""The round engines: how federated rounds are run (docs/DESIGN.md §1). Each takes the model, the clients and the public
protocol and returns the same :class:`~gradleak.fl.engines.builtin.RoundsOutcome`, so the pipeline after the
rounds (the server's view, the attack, the evaluation) does not know which ran.

* ``builtin`` (:mod:`gradleak.fl.engines.builtin`): gradleak's own round loop, in this process.
* ``flower`` (:mod:`gradleak.fl.engines.flower`): the same rounds through a real Flower federation (the optional
  ``fl`` extra), on the bridge :mod:`gradleak.fl.engines.flower_bridge`.
"""

from __future__ import annotations

from typing import Any, Callable

ENGINES = ("builtin", "flower")


def rounds_engine(name: str, *, flower: Any = None) -> Callable[..., Any]:
    """The round function of engine ``name`` (``fl.engine``), called as
    :func:`~gradleak.fl.engines.builtin.run_rounds`; ``flower`` is the ``fl.flower`` section the Flower engine runs
    under."""
    if name == "flower":
        from functools import partial

        from gradleak.fl.engines.flower import run_rounds_flower

        return partial(run_rounds_flower, flower=flower)
    from gradleak.fl.engines.builtin import run_rounds

    return run_rounds
