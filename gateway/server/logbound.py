"""Bounded logging of what an unauthenticated peer sends (issue 29): every field it controls is
clipped before it is logged, and refusals are rate-limited, each line that gets through saying how
many were suppressed before it. Ten refused Hellos with a 3 MB worker id once put 30 MB in the log.

Pure apart from the injected clock; used by the control plane (workers/control.py)."""

from __future__ import annotations

import time
from collections.abc import Callable

MAX_FIELD_CHARS = 128  # what is kept of one field from an unauthenticated peer


def clip(value: object, limit: int = MAX_FIELD_CHARS) -> object:
    """`value` for a log line: a str or bytes longer than `limit` cut to `limit` with the length it
    had; numbers and None as they are; anything else by its clipped repr."""
    if value is None or isinstance(value, bool | int | float):
        return value
    text = value.decode(errors="replace") if isinstance(value, bytes | bytearray) else value
    if not isinstance(text, str):
        text = repr(text)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...[{len(text)} chars]"


class LogThrottle:
    """A token bucket for log lines: `burst` lines at once, then `per_s` a second. `allow()` is None
    for a line to suppress, else the number suppressed since the last line allowed."""

    def __init__(
        self, per_s: float = 1.0, burst: int = 10, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if per_s <= 0 or burst < 1:
            raise ValueError(f"LogThrottle needs per_s > 0 and burst >= 1, got {per_s}, {burst}")
        self.per_s = per_s
        self.burst = burst
        self.clock = clock
        self.tokens = float(burst)
        self.at = clock()
        self.suppressed = 0

    def allow(self) -> int | None:
        now = self.clock()
        self.tokens = min(float(self.burst), self.tokens + (now - self.at) * self.per_s)
        self.at = now
        if self.tokens < 1:
            self.suppressed += 1
            return None
        self.tokens -= 1
        n, self.suppressed = self.suppressed, 0
        return n
