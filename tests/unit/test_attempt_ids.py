"""A worker attempt's id says where its output starts in the choice, so a gateway adopting it after
another gateway died never lines up the worker's output with the wrong ids (found by the chaos soak:
an attempt that had moved once was adopted as if it started at id 0, and the stream ended early)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.server.api.jobs import Attempt, attempt_base, attempt_rid


@given(
    st.text(alphabet="abcdef0123456789-", min_size=1, max_size=40), st.integers(1, 50), st.integers(0, 10**6)
)
def test_the_base_round_trips_through_the_attempt_id(rid: str, n: int, base: int) -> None:
    wrid = attempt_rid(f"cmpl-{rid}", n, base)
    assert attempt_base(wrid) == base
    assert Attempt("w0", wrid, 1).base == base


def test_a_first_attempt_keeps_its_plain_id() -> None:
    assert attempt_rid("cmpl-ab", 1, 0) == "cmpl-ab-1"
    assert attempt_rid("cmpl-ab", 2, 42) == "cmpl-ab-2+42"
    assert attempt_base("cmpl-ab-2") == 0
