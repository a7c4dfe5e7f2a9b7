"""Bounded logging of unauthenticated peers (gateway/server/logbound.py, issue 29)."""

from __future__ import annotations

from gateway.server.logbound import LogThrottle, clip


def test_clip_keeps_short_fields_and_cuts_long_ones_saying_their_length() -> None:
    assert clip("w0") == "w0" and clip(7) == 7 and clip(None) is None
    cut = clip("A" * (3 << 20))
    assert isinstance(cut, str) and len(cut) < 200 and cut.endswith(f"[{3 << 20} chars]")
    assert clip(b"\xff" * 300, 10) == "\ufffd" * 10 + "...[300 chars]"


def test_the_throttle_lets_a_burst_through_then_counts_what_it_suppresses() -> None:
    now = [0.0]
    t = LogThrottle(per_s=1.0, burst=3, clock=lambda: now[0])
    assert [t.allow() for _ in range(5)] == [0, 0, 0, None, None]
    now[0] = 1.0
    assert t.allow() == 2  # the line that gets through says two were suppressed before it
    assert t.allow() is None
