"""The threat model: what the server may do and what it gets to see (docs/DESIGN.md §1, LeakPro-style flags).

A config's ``threat:`` section names a preset and may override single flags::

    threat: {preset: honest-but-curious, knows_labels: true, individual_updates: false}

Presets (breaching's and LeakPro's capability levels):

* ``honest-but-curious`` — runs the protocol as agreed and only looks at what it receives.
* ``prescribes-architecture`` — may choose the architecture the clients train (add trainable modules,
  e.g. layer-wise positional embeddings) but sends honestly initialised weights.
* ``malicious`` — may also set the weights it sends, round by round (PEFTLeak's poisoning).

Flags (all booleans unless stated):

* ``individual_updates`` — the server sees each client's update; ``false`` = only the secure-aggregation sum.
* ``knows_labels`` / ``knows_batch_size`` / ``knows_lengths`` — these leak to the server
  (``knows_lengths``: per-sequence token counts, LAMP's assumption).
* ``public_data`` — the server holds public samples from the data distribution (disjoint from the clients').
* ``rounds_observed`` — how many rounds the attacker keeps (``null`` = every round run).

:func:`build_view` is the *only* place a :class:`~gradleak.fl.core.ServerView` is built from a round's
outcome: it copies into the view exactly what the resolved :class:`ThreatModel` grants and nothing else.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal, Optional

from pydantic import Field

from gradleak.errors import BadInput
from gradleak.validation import Checked

#: capability levels, weakest first
CAPABILITIES = ("honest-but-curious", "prescribes-architecture", "malicious")

PRESETS: dict[str, dict[str, Any]] = {
    "honest-but-curious": {"malicious": False, "prescribes_architecture": False},
    "prescribes-architecture": {"malicious": False, "prescribes_architecture": True},
    "malicious": {"malicious": True, "prescribes_architecture": True},
}

#: flags an attack may require, with the text the gate prints when one is withheld
FLAG_MEANING = {
    "malicious": "the server may set the weights it sends",
    "prescribes_architecture": "the server may choose the trainable architecture",
    "individual_updates": "the server sees each client's update (no secure aggregation)",
    "knows_labels": "the clients' labels leak to the server",
    "knows_batch_size": "the clients' batch sizes leak to the server",
    "knows_lengths": "the clients' sequence lengths leak to the server",
    "public_data": "the server holds public data from the same distribution",
}


@dataclass(frozen=True)
class ThreatModel:
    """A resolved threat model (preset + flags). ``capability`` is the preset's name."""

    capability: str = "honest-but-curious"
    malicious: bool = False
    prescribes_architecture: bool = False
    individual_updates: bool = True
    knows_labels: bool = False
    knows_batch_size: bool = True
    knows_lengths: bool = False
    public_data: bool = False
    rounds_observed: Optional[int] = None
    #: why individual updates are exposed although the config asked for secure aggregation (None: not the case)
    exposure: Optional[str] = None

    def grants(self, flag: str) -> bool:
        return bool(getattr(self, flag))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> list[str]:
        """The threat model in plain words (for reports)."""
        out = [f"capability: {self.capability}"]
        for f in FLAG_MEANING:
            out.append(f"{'yes' if self.grants(f) else 'no '} — {FLAG_MEANING[f]}")
        out.append("rounds observed: " + ("all" if self.rounds_observed is None else str(self.rounds_observed)))
        if self.exposure:
            out.append(self.exposure)
        return out


class ThreatConfig(Checked):
    """The ``threat:`` config section. Unset flags take the preset's value, then the defaults above."""

    preset: Literal["honest-but-curious", "prescribes-architecture", "malicious"] = "honest-but-curious"
    individual_updates: Optional[bool] = None
    knows_labels: Optional[bool] = None
    knows_batch_size: Optional[bool] = None
    knows_lengths: Optional[bool] = None
    public_data: Optional[bool] = None
    rounds_observed: Optional[int] = Field(None, ge=1)

    def resolve(self, secure_aggregation: bool = False, clients: int | None = None) -> ThreatModel:
        """The resolved threat model. Secure aggregation hides individual updates -- except over one client: the sum
        of one update is that update, so the server sees it (``exposure`` says why)."""
        base = ThreatModel(capability=self.preset, **PRESETS[self.preset])
        over = {k: v for k, v in self.model_dump().items() if k != "preset" and v is not None}
        tm = replace(base, **over)
        if secure_aggregation:
            if clients is not None and clients <= 1:
                return replace(tm, individual_updates=True, exposure=(
                    "secure aggregation over one client exposes its update: the sum of one update is that update "
                    "(the server sees it as if there were no secure aggregation)"))
            if self.individual_updates:
                raise BadInput("threat.individual_updates", "is true, but fl.secure_aggregation hides individual updates.",
                               "set one of them: secure aggregation on means the server sees only the sum.")
            tm = replace(tm, individual_updates=False)
        return tm


def with_article(words: str) -> str:
    """``words`` after its indefinite article, by sound: "an honest-but-curious server", "a malicious server",
    "a prescribes-architecture server" (the silent h of *honest* takes "an")."""
    w = words.strip()
    return ("an " if w[:1].lower() in "aeio" or w.lower().startswith(("honest", "hour")) else "a ") + w


THREAT_FLAGS = tuple(f.name for f in fields(ThreatModel) if f.name not in ("capability", "rounds_observed", "exposure"))


def check_requirements(attack_name: str, required: dict[str, bool], threat: ThreatModel) -> None:
    """Stop with exit 2 when ``required`` asks for flags the threat model withholds. The error names *every* withheld
    flag (its field is the first, ``threat.<flag>``) and one fix that grants them all, so that following the hint once
    makes the config validate (docs/ARCHITECTURE.md, "The threat model")."""
    missing = []
    for flag, need in required.items():
        if flag not in FLAG_MEANING:
            raise ValueError(f"attack '{attack_name}' requires unknown threat flag '{flag}'")
        if need and not threat.grants(flag):
            missing.append(flag)
    if not missing:
        return
    fixes = []
    if "malicious" in missing:  # the malicious preset grants prescribes_architecture too
        fixes.append("set threat.preset=malicious (or pick an attack for an honest server)")
    elif "prescribes_architecture" in missing:
        fixes.append("set threat.preset=prescribes-architecture or malicious")
    if "individual_updates" in missing:
        fixes.append("set threat.individual_updates=true and fl.secure_aggregation=false, or pick an attack that reads "
                     "the aggregate")
    facts = [f for f in missing if f not in ("malicious", "prescribes_architecture", "individual_updates")]
    if len(facts) == 1:
        fixes.append(f"grant it with --set threat.{facts[0]}=true if your deployment leaks it, or pick another attack")
    elif facts:
        fixes.append("grant them with " + " ".join(f"--set threat.{f}=true" for f in facts)
                     + " if your deployment leaks them, or pick another attack")
    needs = " and that ".join(FLAG_MEANING[f] for f in missing)
    withheld = "it" if len(missing) == 1 else "them (" + ", ".join(f"threat.{f}" for f in missing) + ")"
    raise BadInput(f"threat.{missing[0]}", f"attack '{attack_name}' requires that {needs}, "
                   f"but the threat model ({threat.capability}) withholds {withheld}.", "; ".join(fixes) + ".")


def build_view(*, model, rounds: list[list[Any]], round_states: list[dict], threat: ThreatModel,
               secure_sum: list[Any] | None, knowledge: dict[str, Any], always_public: dict[str, Any]):
    """Build the :class:`ServerView` from the rounds' outcome, granting exactly what ``threat`` allows.

    ``rounds``: per round, the clients' (defended) uploads; ``secure_sum``: per round, the secure-aggregation
    sum (used instead when individual updates are withheld); ``knowledge``: candidate facts keyed by the
    flag that grants them (``{"knows_labels": {"labels": [...]}, "public_data": {...}}``);
    ``always_public``: what the protocol makes public anyway (tokenizer, image shape, model kind).
    """
    from gradleak.fl.core import ServerView

    if not threat.individual_updates:
        if secure_sum is None:
            raise ValueError("secure aggregation requested but no sums were computed")
        seen = [[s] for s in secure_sum]
    else:
        seen = [list(r) for r in rounds]
    states = list(round_states)
    if threat.rounds_observed is not None:
        seen, states = seen[: threat.rounds_observed], states[: threat.rounds_observed]
    if not threat.knows_batch_size:  # the upload's sample count is the batch size: withhold it too
        seen = [[_strip_count(u) for u in r] for r in seen]
    public = dict(always_public)
    for flag, facts in knowledge.items():
        if threat.grants(flag):
            public.update(facts)
    return ServerView(model=model, updates=seen[-1], public=public, secure_aggregation=not threat.individual_updates,
                      rounds=seen, round_states=states)


def _strip_count(u):
    from gradleak.fl.core import Update

    return Update(u.tensors, 0, u.client_id, u.kind, u.local_steps, u.buffers)
