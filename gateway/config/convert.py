"""TOML tables to frozen dataclasses, by their type hints: the gateway config and simulator scenarios.

Types understood: bool, int, float (ints accepted; NaN and infinities refused), str, enums (by value),
`Literal[...]`, `tuple[T, ...]`, and nested dataclasses (a table, or an array of tables for a tuple of
dataclasses). Unknown keys and wrong types are refused through `fail(key, value, why)`, which each
caller turns into its own error (ConfigError, ScenarioError) so the message names the dotted key.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from enum import Enum
from typing import Any, Literal, NoReturn

Fail = Callable[[str, object, str], NoReturn]


def build(cls: Any, table: object, prefix: str, fail: Fail) -> Any:
    """An instance of dataclass `cls` from `table`; missing keys take the dataclass defaults."""
    if not isinstance(table, dict):
        fail(prefix, table, "must be a table")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - names)
    if unknown:
        key = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        fail(key, table[unknown[0]], f"unknown key (known: {', '.join(sorted(names))})")
    return cls(**{k: convert(f"{prefix}.{k}" if prefix else k, v, hints[k], fail) for k, v in table.items()})


def convert(key: str, value: Any, tp: Any, fail: Fail) -> Any:
    origin = typing.get_origin(tp)
    if tp is bool:
        if not isinstance(value, bool):
            fail(key, value, "must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail(key, value, "must be an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            fail(key, value, "must be a number")
        if not math.isfinite(value):
            fail(key, value, "must be a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            fail(key, value, "must be a string")
        return value
    if isinstance(tp, type) and issubclass(tp, Enum):
        choices = [m.value for m in tp]
        if value not in choices:
            fail(key, value, f"must be one of {', '.join(map(str, choices))}")
        return tp(value)
    if origin is Literal:
        choices = list(typing.get_args(tp))
        if value not in choices:
            fail(key, value, f"must be one of {', '.join(map(str, choices))}")
        return value
    if origin is tuple:
        (item_tp, _ellipsis) = typing.get_args(tp)
        if not isinstance(value, list | tuple):
            fail(
                key,
                value,
                "must be an array of tables" if dataclasses.is_dataclass(item_tp) else "must be a list",
            )
        return tuple(convert(f"{key}[{i}]", v, item_tp, fail) for i, v in enumerate(value))
    if origin in (types.UnionType, typing.Union):
        raise TypeError(f"unsupported union type for {key}")
    if dataclasses.is_dataclass(tp):
        if dataclasses.is_dataclass(value):
            return value
        return build(tp, value, key, fail)
    raise TypeError(f"unsupported config type {tp!r} for {key}")


def to_dict(obj: Any) -> Any:
    """The TOML-shaped dict of a dataclass tree (enums as their values)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Enum):
        return obj.value
    return obj
