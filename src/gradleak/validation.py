"""The one base of every pydantic model that holds user input (config sections, defense and attack parameters).

Two rules hold for every field of every such model, so a new section or parameter cannot forget them:

* **finite numbers**: NaN and ±inf are refused in every float field (``allow_inf_nan=False``: "Input should be a
  finite number"). A field where infinity means something ("no limit") is annotated :data:`InfOK`, which takes
  ``.inf`` and still refuses NaN; its description says what infinity means.
* **numbers are numbers**: a boolean (``true``) given to an int or float field is refused — pydantic would read it
  as 1 — and a fractional number for an int field is refused as pydantic always does (``1.5`` is not ``1``). YAML
  ints (``8``) and ``--set data.batch_size=8`` still parse as ints.
"""

from __future__ import annotations

import math
import types
import typing
from typing import Annotated, Any, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError


def _not_nan(v: Any) -> Any:
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            return v
    if isinstance(v, float) and math.isnan(v):
        raise PydanticCustomError("nan_number", "Input should be a number, not NaN")
    return v


#: a float field that accepts ±inf (say in its description what infinity means); NaN is still refused (before
#: the field's bounds, so the message says NaN, not "greater than 0")
InfOK = Annotated[float, Field(allow_inf_nan=True), BeforeValidator(_not_nan)]


def _numeric_without_bool(ann: Any) -> bool:
    """Whether ``ann`` accepts ints or floats but not booleans (Optional/Union/Annotated looked through)."""
    kinds = _kinds(ann)
    return bool(kinds & {int, float}) and bool not in kinds and Any not in kinds


def _kinds(ann: Any) -> set:
    origin = typing.get_origin(ann)
    if origin is Annotated:
        return _kinds(typing.get_args(ann)[0])
    if origin is Union or (hasattr(types, "UnionType") and origin is types.UnionType):
        out: set = set()
        for a in typing.get_args(ann):
            out |= _kinds(a)
        return out
    if origin is typing.Literal:
        return {type(a) for a in typing.get_args(ann)}
    if ann is Any:
        return {Any}
    return {ann} if isinstance(ann, type) else set()


def _item_type(ann: Any) -> Any:
    """The element type of a list/tuple/set annotation (through Optional), else None."""
    origin = typing.get_origin(ann)
    if origin is Annotated:
        return _item_type(typing.get_args(ann)[0])
    if origin is Union or (hasattr(types, "UnionType") and origin is types.UnionType):
        for a in typing.get_args(ann):
            t = _item_type(a)
            if t is not None:
                return t
        return None
    if origin in (list, tuple, set, frozenset):
        args = [a for a in typing.get_args(ann) if a is not Ellipsis]
        return args[0] if args else None
    return None


class Checked(BaseModel):
    """Base of every user-facing config model: unknown keys are errors, numbers must be finite numbers."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_number(cls, v: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name) if info.field_name else None
        if field is None:
            return v
        ann = field.annotation
        if isinstance(v, bool) and _numeric_without_bool(ann):
            raise PydanticCustomError("bool_for_number", "Input should be a number, not a boolean ({value})",
                                      {"value": str(v).lower()})
        if isinstance(v, (list, tuple)):
            item = _item_type(ann)
            if item is not None and _numeric_without_bool(item) and any(isinstance(x, bool) for x in v):
                raise PydanticCustomError("bool_for_number", "Every item should be a number, not a boolean")
        return v


__all__ = ["Checked", "InfOK"]
