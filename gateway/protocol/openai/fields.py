"""Typed reads from a decoded JSON body, each failure an InvalidRequest naming the parameter.

JSON `null` reads as "not given" (OpenAI clients send explicit nulls). A bool is never a number; an
integer may be written with a zero fraction (`1.0`), as JSON Schema's `integer` allows.
Codes follow OpenAI's: `invalid_json`, `invalid_type`, `invalid_value`, `missing_required_parameter`,
`unsupported_parameter`, `unknown_parameter`.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from gateway.protocol.openai.errors import InvalidRequest

INVALID_TYPE = "invalid_type"
INVALID_VALUE = "invalid_value"
MISSING = "missing_required_parameter"
UNSUPPORTED = "unsupported_parameter"
UNKNOWN = "unknown_parameter"


def decode_object(raw: bytes) -> dict[str, Any]:
    """Parse a request body that must be one JSON object."""
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    except RecursionError as exc:
        raise InvalidRequest("request body is nested too deeply", code="invalid_json") from exc
    except UnicodeDecodeError as exc:  # msgspec raises it for invalid UTF-8 inside a string
        raise InvalidRequest(
            f"request body is not valid UTF-8: {exc.reason} at byte {exc.start}", code="invalid_json"
        ) from exc
    if not isinstance(value, dict):
        raise InvalidRequest(
            f"request body must be a JSON object, got {json_type(value)}", code="invalid_json"
        )
    return value


def json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def as_int(value: object) -> int | None:
    """`value` as an integer, also when JSON wrote it with a fraction of zero (`1.0`: JSON Schema's
    `integer` is a value, and OpenAI's API reads it so); None for anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class Fields:
    def __init__(self, obj: dict[str, Any], prefix: str = "") -> None:
        self._obj = obj
        self._prefix = prefix

    def name(self, key: str) -> str:
        return f"{self._prefix}{key}"

    def given(self, key: str) -> bool:
        return self._obj.get(key) is not None

    def raw(self, key: str) -> Any:
        return self._obj.get(key)

    def items(self) -> list[tuple[str, Any]]:
        """Every field as given, nulls included."""
        return list(self._obj.items())

    def fail(self, key: str, why: str, code: str = INVALID_VALUE) -> InvalidRequest:
        return InvalidRequest(f"'{self.name(key)}' {why}", param=self.name(key), code=code)

    def missing(self, key: str) -> InvalidRequest:
        return self.fail(key, "is required", MISSING)

    def wrong(self, key: str, want: str) -> InvalidRequest:
        return self.fail(key, f"must be {want}, got {json_type(self._obj.get(key))}", INVALID_TYPE)

    def integer(self, key: str, default: int, lo: int | None = None, hi: int | None = None) -> int:
        v = self._obj.get(key)
        if v is None:
            return default
        n = as_int(v)
        if n is None:
            raise self.wrong(key, "an integer")
        if (lo is not None and n < lo) or (hi is not None and n > hi):
            raise self.fail(key, f"must be in {_range(lo, hi)}, got {n}")
        return n

    def opt_int(self, key: str, lo: int | None = None, hi: int | None = None) -> int | None:
        return self.integer(key, 0, lo, hi) if self.given(key) else None

    def number(self, key: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
        v = self._obj.get(key)
        if v is None:
            return default
        if not is_number(v):
            raise self.wrong(key, "a number")
        if v > hi or v < lo or (lo_open and v == lo):
            interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
            raise self.fail(key, f"must be in {interval}, got {v}")
        return float(v)

    def boolean(self, key: str, default: bool) -> bool:
        v = self._obj.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise self.wrong(key, "a boolean")
        return v

    def string(self, key: str) -> str | None:
        v = self._obj.get(key)
        if v is None:
            return None
        if not isinstance(v, str):
            raise self.wrong(key, "a string")
        return v

    def obj(self, key: str) -> Fields | None:
        v = self._obj.get(key)
        if v is None:
            return None
        if not isinstance(v, dict):
            raise self.wrong(key, "an object")
        return Fields(v, prefix=f"{self.name(key)}.")

    def array(self, key: str) -> list[Any] | None:
        v = self._obj.get(key)
        if v is None:
            return None
        if not isinstance(v, list):
            raise self.wrong(key, "an array")
        return v

    def token_ids(self, key: str, vocab_size: int, *, max_len: int | None = None) -> tuple[int, ...]:
        items = self.array(key)
        if items is None:
            return ()
        ids = check_token_ids(items, self.name(key), vocab_size)
        if max_len is not None and len(ids) > max_len:
            raise self.fail(key, f"may hold at most {max_len} ids, got {len(ids)}")
        return ids

    def stop(self, key: str, max_items: int) -> tuple[str, ...]:
        """OpenAI `stop`: a string or a list of at most `max_items` non-empty strings."""
        v = self._obj.get(key)
        if v is None:
            return ()
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise self.fail(key, f"must be a string or an array of strings, got {json_type(v)}", INVALID_TYPE)
        if len(items) > max_items:
            raise self.fail(key, f"may hold at most {max_items} strings, got {len(items)}")
        if any(not s for s in items):
            raise self.fail(key, "must not contain an empty string")
        return tuple(dict.fromkeys(items))

    def unsupported(self, key: str, allowed: tuple[object, ...], what: str) -> None:
        """Refuse a known field the server cannot honour unless it holds a neutral value."""
        v = self._obj.get(key)
        if v is None or any(v == a and type(v) is type(a) for a in allowed):
            return
        raise self.fail(key, f"is not supported ({what})", UNSUPPORTED)


def check_token_ids(items: list[Any], name: str, vocab_size: int) -> tuple[int, ...]:
    """`items` as token ids, each an integer in the vocabulary."""
    if items and set(map(type, items)) == {int} and min(items) >= 0 and max(items) < vocab_size:
        return tuple(items)  # the common case, checked in C loops; the loop below names what is wrong
    ids = []
    for i, t in enumerate(items):
        n = as_int(t)
        if n is None:
            raise InvalidRequest(
                f"'{name}[{i}]' must be an integer token id, got {json_type(t)}",
                param=name,
                code=INVALID_TYPE,
            )
        if not 0 <= n < vocab_size:
            raise InvalidRequest(
                f"'{name}[{i}]' = {n} is not a token id (0..{vocab_size - 1})", param=name, code=INVALID_VALUE
            )
        ids.append(n)
    return tuple(ids)


def _range(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f"{lo}..{hi}"
    return f">= {lo}" if lo is not None else f"<= {hi}"
