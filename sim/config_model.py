"""The base of every scenario section: the input rules no field can opt out of.

Every pydantic model a scenario is validated with (the top level, ``kv_cache``, ``cluster``,
``workload`` and its parts, every policy config and engine preset) subclasses :class:`ConfigModel`
(``tests/test_bad_inputs.py`` walks the schema to hold that), so each rule is written once:

- unknown keys are errors (``extra="forbid"``);
- no boolean where a number is meant: pydantic's lax mode reads YAML's ``true`` as 1, so
  ``num_requests: true`` would quietly simulate one request;
- numbers are finite: ``.inf`` and ``.nan`` are never a count, size, rate or time;
- integers are at most :data:`INT_MAX` unless the field declares its own upper bound: no count,
  length or size in a scenario is larger, and it keeps sums of token counts inside int64.

What the host can hold (running-table rows, KV blocks, requests) is checked on the whole scenario,
where the sizes are known together (``sim/host_memory.py``).
"""

from __future__ import annotations

import functools
import types
import typing
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

INT_MAX = 2**32  # tokens, requests, blocks, rows: more than any model's context or any host's memory
# The simulated clock is float64 seconds: at 1e9 s (~32 years) a step of 1 us is still resolved to
# 0.1 %; far beyond, steps vanish into rounding (at 1e20 s every step takes 0 s). Inputs that put
# an event later than this are refused.
MAX_SIM_SECONDS = 1e9


def _admits_bool(annotation: Any) -> bool:
    """Whether a field of this type may hold a bool (``bool``, ``Any``, a ``Literal[True]``)."""
    if annotation is bool or annotation is Any:
        return True
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Literal:
        return any(isinstance(a, bool) for a in args)
    return any(_admits_bool(a) for a in args if isinstance(a, type | types.GenericAlias | types.UnionType)
               or typing.get_origin(a) is not None)


def _admits_number(annotation: Any) -> bool:
    """Whether a field of this type may hold an int or a float (a bool elsewhere is pydantic's to refuse)."""
    if annotation is int or annotation is float:
        return True
    return any(_admits_number(a) for a in typing.get_args(annotation) if not isinstance(a, str | int | float))


def _holds_model(annotation: Any) -> bool:
    """Whether a field of this type holds a nested model (which checks its own fields)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return True
    return any(_holds_model(a) for a in typing.get_args(annotation) if not isinstance(a, str | int | float))


@functools.cache
def _field_kind(model: type[BaseModel], name: str) -> tuple[bool, bool]:
    """(a bool is fine here, holds a nested model) for one field, worked out once per model."""
    annotation = model.model_fields[name].annotation
    return _admits_bool(annotation) or not _admits_number(annotation), _holds_model(annotation)


def _has_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return True
    if isinstance(value, list | tuple):
        return any(isinstance(x, bool) for x in value)
    if isinstance(value, dict):
        return any(isinstance(x, bool) for x in value.values())
    return False


def _ints(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list | tuple):
        return [x for x in value if isinstance(x, int) and not isinstance(x, bool)]
    if isinstance(value, dict):
        return [x for x in value.values() if isinstance(x, int) and not isinstance(x, bool)]
    return []


class ConfigModel(BaseModel):
    """A scenario section: unknown keys, booleans for numbers, inf/nan and absurd integers are errors.

    The two checks are model validators (a field validator for every field would also wrap the
    tag fields of the tagged unions, which pydantic refuses); their errors carry the field in
    ``ctx["field"]``, which ``scenario.format_validation_error`` appends to the path.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_number(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, value in data.items():
            if name not in cls.model_fields or not _has_bool(value):
                continue
            admits_bool, holds_model = _field_kind(cls, name)
            if not (admits_bool or (not isinstance(value, bool) and holds_model)):
                where, shown = name, value  # a mapping of numbers (slo) names the key that holds the bool
                if isinstance(value, dict):
                    key, shown = next((k, v) for k, v in value.items() if isinstance(v, bool))
                    where = f"{name}.{key}"
                raise PydanticCustomError(
                    "bool_for_number",
                    "expected a number, got {value} (YAML's true/false are not numbers)",
                    {"field": where, "value": _yaml_text(shown)},
                )
        return data

    @model_validator(mode="after")
    def _bounded_ints(self) -> Any:
        for name, field in type(self).model_fields.items():
            big = [v for v in _ints(getattr(self, name)) if v > INT_MAX]
            if big and not any(isinstance(m, annotated_types.Le | annotated_types.Lt) for m in field.metadata):
                raise PydanticCustomError(
                    "int_too_large", "{value} is too large: at most {limit}",
                    {"field": name, "value": big[0], "limit": INT_MAX},
                )
        return self


def _yaml_text(value: Any) -> str:
    """A value as the user wrote it in YAML (true, not True)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_yaml_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml_text(v)}" for k, v in value.items()) + "}"
    return repr(value)
