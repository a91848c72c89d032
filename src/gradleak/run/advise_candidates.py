"""The candidates of ``gradleak audit --advise`` as configs: a candidate spec
(:data:`gradleak.run.advise_options.CANDIDATES`, an ``extra`` one of :func:`gradleak.run.advise.advise`) at a strength
becomes the probe's config and the ``--set`` overrides of the recommendation, and is read back from a config as the
search's starting point.

Where a candidate goes is its ``stage``: an update defense is appended to ``defenses`` (one already there of the same
name and mode is replaced, its other parameters kept), a training-time defense is ``defense:``, and an FL-stage
candidate (``fl``) is asked itself -- its spec's ``fl_stage`` object (:mod:`gradleak.fl.secure_aggregation`) builds
its config and overrides. An ``extra`` candidate's callables (``configure``, ``set``, ``start``) replace these steps.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from gradleak.run.advise_options import CANDIDATES


def fmt(v: Any) -> str:
    """A strength or a number in the advice's words: 4 significant digits for a float."""
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def key(spec: dict) -> str:
    """A candidate's name in the advice (its defense's name, or e.g. ``gaussian_noise_absolute`` for a second mode)."""
    return spec.get("key", spec["name"])


#: the candidates by their name in the advice (:func:`key`)
CANDIDATE_BY_NAME = {key(c): c for c in CANDIDATES}


def matches(entry: dict, spec: dict) -> bool:
    """An update defense of the config is this candidate: same name and the same mode (e.g. per-coordinate noise)."""
    params = entry.get("params") or {}
    return entry.get("name") == spec["name"] and all(bool(params.get(k, False)) == v
                                                     for k, v in (spec.get("mode") or {}).items())


def defended_config(raw: dict, spec: dict, value: Any) -> dict:
    """``raw`` with the candidate at ``value``: a defense already there of the same name is replaced (its other
    parameters kept), others are kept. An FL-stage candidate builds its own config (secure aggregation over K clients:
    :meth:`gradleak.fl.secure_aggregation.SecureAggregation.configure`)."""
    if "configure" in spec:  # an extra candidate (``advise(extra=...)``) builds its own probe config
        return spec["configure"](raw, value)
    if spec["stage"] not in ("update", "training"):  # an FL-stage candidate
        return spec["fl_stage"].configure(raw, value)
    out = copy.deepcopy(raw)
    name, p = spec["name"], spec["param"]
    if spec["stage"] == "update":
        ds = list(out.get("defenses") or [])
        old = next((d for d in ds if matches(d, spec)), None)
        params = {**spec["fixed"], **((old or {}).get("params") or {}), **(spec.get("mode") or {}), p: value}
        out["defenses"] = [d for d in ds if d is not old] + [{"name": name, "params": params}]
    else:
        old = out.get("defense") if (out.get("defense") or {}).get("name") == name else {}
        out["defense"] = {**spec["fixed"], **(old or {}), "name": name, p: value}
    return out


def starting_point(raw: dict, spec: dict) -> Any:
    """The configured strength of this defense when the config already has it (the search's weak end), else None."""
    if "start" in spec:
        return spec["start"](raw)
    name, p = spec["name"], spec["param"]
    if spec["stage"] == "update":
        d = next((d for d in raw.get("defenses") or [] if matches(d, spec)), None)
        return ((d or {}).get("params") or {}).get(p)
    if spec["stage"] == "training":
        d = raw.get("defense") or {}
        return d.get(p) if d.get("name") == name else None
    return spec["fl_stage"].strength(raw)


def set_strings(raw: dict, spec: dict, value: Any) -> list[str]:
    """The ``--set`` overrides that put the candidate at ``value`` into the audited config."""
    if "set" in spec:
        return spec["set"](raw, value)
    if spec["stage"] == "update":
        return ["defenses=" + json.dumps(defended_config(raw, spec, value)["defenses"])]
    if spec["stage"] == "training":
        return ["defense=" + json.dumps(defended_config(raw, spec, value)["defense"])]
    return spec["fl_stage"].set_strings(raw, value)


def clip_norm(cfg: dict, spec: dict) -> Any:
    """The clipping norm of the DP candidate in ``cfg`` (the configured one, or the candidate's fixed one)."""
    if spec["stage"] == "training":
        return (cfg.get("defense") or {}).get("max_grad_norm", 1.0)
    d = next((d for d in cfg.get("defenses") or [] if matches(d, spec)), {})
    return (d.get("params") or {}).get("max_norm", 1.0)
