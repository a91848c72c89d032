"""Errors that carry the field to change and the fix (docs/DESIGN.md §4: exit code 2 for bad input)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError


class GradleakError(Exception):
    """Base class of the errors gradleak raises on purpose."""


class BadInput(GradleakError):
    """Bad user input: names the offending field and how to fix it. The CLI exits with code 2."""

    def __init__(self, field: str, problem: str, fix: str = ""):
        self.field = field
        self.problem = problem
        self.fix = fix
        msg = f"{field}: {problem}"
        if fix:
            msg += f" Fix: {fix}"
        super().__init__(msg)


class TrainingDiverged(BadInput):
    """A client's upload holds NaN/inf: training diverged (too high an lr, or a defense's noise). ``client_id`` and
    ``round_index`` (the engine's round) say where; :func:`gradleak.run.pipeline.train_global` turns it into a measured
    outcome of the utility run (the defense at that strength makes the model untrainable)."""

    def __init__(self, client_id: int, round_index: int, lr: float):
        super().__init__("fl.lr", f"training diverged: client {client_id}'s upload in round {round_index} holds NaN/inf "
                         f"(lr = {lr}).", "lower fl.lr (or check the defenses' parameters).")
        self.client_id = client_id
        self.round_index = round_index
        self.lr = lr


class MissingAsset(BadInput):
    """An offline asset (package data or Debian file) is not installed; names the install command."""

    def __init__(self, asset: str, install: str, field: str = "data.name"):
        super().__init__(field, f"the offline asset '{asset}' is not installed on this machine.",
                         f"install it with `{install}` (or run `make demo`, which installs every asset).")
        self.asset = asset
        self.install = install


#: the parts of a pydantic error location that name a validator or a union member, not a config key
_TYPE_TAG = re.compile(r"^(function-.*|float|int|str|bool|none|literal\[.*\]|list\[.*\]|dict\[.*\]|"
                       r"constrained-.*|function-after\[.*\]|is-instance\[.*\])$")


def describe_validation_error(err: "ValidationError") -> BadInput:
    """The first error of a pydantic validation as a BadInput naming its field (dotted location)."""
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"] if not _TYPE_TAG.match(str(p))) or "(config)"
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        return BadInput(loc, "this config key does not exist.", "remove it or check its spelling against the shipped configs.")
    if first["type"] == "finite_number":
        return BadInput(loc, f"is not a finite number (got {first.get('input')!r}).",
                        "give a finite number (NaN and infinity are not allowed here).")
    if first["type"] == "nan_number":
        return BadInput(loc, "is NaN, not a number.", "give a number (this field accepts .inf).")
    if first["type"] == "bool_for_number":
        return BadInput(loc, f"{msg}.", "give a number (true/false would be read as 1/0).")
    return BadInput(loc, f"{msg} (got {first.get('input')!r}).", "change this value in the config or with --set.")
