"""Secure aggregation as an FL-stage object of ``gradleak audit --advise``: an FL option (``fl.secure_aggregation``,
the masked sum of :func:`gradleak.fl.core.secure_aggregate`), not a registered defense, searched over the number of
clients summed.

The advice asks an FL-stage candidate (the spec's ``fl_stage``, :data:`SECURE_AGGREGATION`) for what only it knows,
instead of naming it: its candidate spec and bracket (:meth:`SecureAggregation.advice_spec`: 2 to 8 clients, whole
numbers on a log scale), how a strength becomes a config (:meth:`~SecureAggregation.configure`) and ``--set``
overrides (:meth:`~SecureAggregation.set_strings`), the strength a config already has
(:meth:`~SecureAggregation.strength`), the largest federation a probe builds
(:meth:`~SecureAggregation.largest_federation`: the probes' held-out test set must fit beside its clients' data) and
the words of its utility row (:meth:`~SecureAggregation.utility_note`: a federation of K clients trains K batches a
round, the baseline its configured clients'). What the server then sees -- the sum, no individual update -- is the
threat gate's (:mod:`gradleak.fl.threat`); the post-processing argument that secure aggregation adds only the other
clients' uploads, independent of the victim's data, is :mod:`gradleak.run.advise_carry`'s.
"""

from __future__ import annotations

import copy
from typing import Any


class SecureAggregation:
    """The FL-stage candidate "secure aggregation over K clients" (docs/DESIGN.md §6: the advice's candidates)."""

    name = "secure_aggregation"
    stage = "fl"
    #: the parameter searched: the clients summed by the masked aggregate
    param = "clients"
    #: the bracket: weak end 2 clients, strong end 8
    weak, strong = 2, 8
    #: its place among the candidates (``order``) and in the tie-break among equally cheap rows (``rank``), as a
    #: defense's :attr:`~gradleak.defenses.base.Defense.advice`
    order, rank = 8, 2
    what = "clients summed by secure aggregation"

    def advice_spec(self) -> dict[str, Any]:
        """Its candidate spec, shaped like a defense's :attr:`~gradleak.defenses.base.Defense.advice` bracket, with
        ``fl_stage``: this object (which the advice asks for the configs)."""
        return {"name": self.name, "stage": self.stage, "param": self.param, "weak": self.weak, "strong": self.strong,
                "scale": "int", "fixed": {}, "what": self.what, "order": self.order, "rank": self.rank,
                "fl_stage": self}

    def configure(self, raw: dict, value: Any) -> dict:
        """``raw`` with secure aggregation over ``value`` clients. ``data.nonmembers`` (per client: the membership
        attacks' candidates) is divided by K, the same candidates in all, so the K clients' data fit the data set as
        the configured clients' did; ``threat.individual_updates`` is dropped (the server sees only the sum)."""
        out = copy.deepcopy(raw)
        out["fl"] = {**(out.get("fl") or {}), "secure_aggregation": True, "clients": int(value)}
        nonmembers = (out.get("data") or {}).get("nonmembers")
        if nonmembers:
            out["data"] = {**out["data"], "nonmembers": max(1, int(nonmembers) * int((raw.get("fl") or {}).get(
                "clients", 1)) // int(value))}
        threat = dict(out.get("threat") or {})
        if threat.get("individual_updates"):
            threat.pop("individual_updates")
            out["threat"] = threat
        return out

    def set_strings(self, raw: dict, value: Any) -> list[str]:
        """The ``--set`` overrides that put secure aggregation over ``value`` clients into the config ``raw``."""
        cfg = self.configure(raw, value)
        return ["fl.secure_aggregation=true", f"fl.clients={int(value)}"] + (
            [f"data.nonmembers={cfg['data']['nonmembers']}"] if (cfg.get("data") or {}).get("nonmembers") != (
                raw.get("data") or {}).get("nonmembers") else [])

    def strength(self, raw: dict) -> Any:
        """The clients ``raw`` already sums by secure aggregation (the search's weak end), else None."""
        fl = raw.get("fl") or {}
        return fl.get("clients", 1) if fl.get("secure_aggregation") else None

    def largest_federation(self) -> int:
        """The most clients a probe of this candidate builds: its strong end."""
        return int(self.strong)

    def utility_note(self, clients: Any) -> str:
        """The words of its utility row at ``clients`` clients."""
        return (f"trains {clients} clients' batches a round (the baseline: the configured clients'): the cost "
                "compares federations of different sizes")


#: the one secure-aggregation candidate
SECURE_AGGREGATION = SecureAggregation()


def fl_candidates() -> list[dict[str, Any]]:
    """The advice's FL-stage candidate specs (beside the registered defenses' brackets): secure aggregation's."""
    return [SECURE_AGGREGATION.advice_spec()]
