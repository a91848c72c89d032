"""The round engines: how federated rounds are run (docs/DESIGN.md §1, §7). Each takes the model, the clients and the
public protocol and returns the same :class:`~gradleak.fl.engines.builtin.RoundsOutcome`, so the pipeline after the
rounds (the server's view, the attack, the evaluation) does not know which ran.

An engine is a plug-in: a module of this package that registers an :class:`Engine` subclass in :data:`ENGINES`.
The engine owns its config section (``fl.<name>``, a pydantic model the config schema mounts from here), its round
function, its words in the audit report and the DP mechanisms it applies itself (what ``dp_check`` verifies and the
attacks' noise model reads). Every module of this package is imported when the registry is first read, so adding an
engine is adding its module: no list elsewhere names it.

* ``builtin`` (:mod:`gradleak.fl.engines.builtin`): gradleak's own round loop, in this process.
* ``flower`` (:mod:`gradleak.fl.engines.flower`): the same rounds through a real Flower federation (the optional
  ``fl`` extra), on the bridge :mod:`gradleak.fl.engines.flower_bridge`.
* ``nvflare`` (:mod:`gradleak.fl.engines.nvflare`): the same rounds through NVIDIA FLARE 2.9 (the optional ``nvflare``
  extra): its FLModel/DXO messages, Executor and filter chains in this process, or its simulator.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar

from gradleak.registry import Registry


class Engine:
    """One round engine (a plug-in). Subclasses set :attr:`name` and override what differs from the builtin loop."""

    #: ``fl.engine`` value
    name: ClassVar[str] = ""
    #: the ``fl.<name>`` section's pydantic model (a :class:`~gradleak.validation.Checked`), or None for no section
    section: ClassVar[Any] = None
    #: the pip extra the engine needs (named in its errors), or None
    extra: ClassVar[str | None] = None

    def rounds(self, fl: Any) -> Callable[..., Any]:
        """The round function (called as :func:`~gradleak.fl.engines.builtin.run_rounds`) under ``fl`` (the validated
        ``fl`` section)."""
        raise NotImplementedError

    def check(self, cfg: Any) -> None:
        """Refuse a validated experiment ``cfg`` this engine cannot run (raise :class:`~gradleak.errors.BadInput`)."""

    def describe(self, fl: Any) -> str | None:
        """One line for the audit report's setup: how the engine runs and what the server sees (None: nothing to
        add to the builtin protocol's lines)."""
        return None

    def framework_dp(self, fl: Any) -> tuple[str, dict] | None:
        """The DP mechanism the engine applies itself (its name in the declared defenses, its parameters), or None."""
        return None

    def dp_claims(self, cfg: Any, delta: float) -> list[dict]:
        """The engine's own DP mechanisms in :func:`gradleak.run.dp_check.declared_mechanisms`' form (``name``,
        ``clip`` in the upload's units, ``covers``, ``delta``, ``claim(rounds, report) -> (ε, words)``)."""
        return []


ENGINES: Registry[type[Engine]] = Registry("engine", home="gradleak.fl.engines._discover")


def engine_of(name: str, field: str = "fl.engine") -> Engine:
    """The engine registered as ``name`` (an instance)."""
    return ENGINES.get(name, field)()


def engine_sections() -> dict[str, Any]:
    """``{engine name: its fl.<name> section model}`` for the engines that have a section."""
    return {e.name: e.obj.section for e in ENGINES if e.obj.section is not None}


def rounds_engine(fl: Any) -> Callable[..., Any]:
    """The round function of ``fl.engine`` under the validated ``fl`` section ``fl``."""
    return engine_of(fl.engine).rounds(fl)
