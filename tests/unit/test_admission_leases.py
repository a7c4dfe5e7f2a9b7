"""A Lumen worker's batch limit under the gateways' leases (worker_hooks/engine/admission.py)."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from tests.fixtures.clock import FakeClock
from worker_hooks.engine.admission import MAX_BOOST, AdmissionLeases


def test_a_grant_raises_the_limit_until_its_lease_ends() -> None:
    clock = FakeClock(100.0)
    leases = AdmissionLeases(64, clock)
    assert leases.limit() == 64
    assert leases.grant("gw1", 4 / 3, 3.0) == 85
    clock.t += 2.9
    assert leases.limit() == 85
    clock.t += 0.2
    assert leases.limit() == 64 and leases.next_expiry() is None


def test_the_largest_live_grant_wins_and_a_boost_of_one_withdraws_at_once() -> None:
    clock = FakeClock(100.0)
    leases = AdmissionLeases(10, clock)
    leases.grant("gw1", 1.2, 3.0)
    assert leases.grant("gw2", 1.5, 1.0) == 15
    clock.t += 1.5  # gw2's lease ended, gw1's still live
    assert leases.limit() == 12
    assert leases.grant("gw1", 1.0, 3.0) == 10
    leases.grant("gw1", 1.4, 3.0)
    leases.clear()
    assert leases.limit() == 10


@given(st.floats(allow_nan=True, allow_infinity=True), st.floats(allow_nan=True, allow_infinity=True))
def test_no_grant_lowers_the_limit_or_raises_it_past_the_clamp(boost: float, lease_s: float) -> None:
    leases = AdmissionLeases(32, FakeClock(100.0))
    limit = leases.grant("gw", boost, lease_s)
    assert 32 <= limit <= math.floor(32 * MAX_BOOST)
    if not (math.isfinite(boost) and math.isfinite(lease_s)) or boost <= 1 or lease_s <= 0:
        assert limit == 32


def test_the_queue_order_is_the_freshest_live_grants_and_ends_with_it() -> None:
    clock = FakeClock(100.0)
    leases = AdmissionLeases(8, clock)
    assert leases.shortest_first_rate() is None
    leases.grant("gw1", 1.0, 3.0, shortest_first_rate=2000.0)  # an order alone is a grant
    assert leases.shortest_first_rate() == 2000.0 and leases.limit() == 8
    clock.t += 1.0
    leases.grant("gw2", 1.5, 3.0, shortest_first_rate=500.0)
    assert leases.shortest_first_rate() == 500.0 and leases.limit() == 12
    leases.grant("gw2", 1.0, 3.0)  # gw2 withdraws: gw1's order again
    assert leases.shortest_first_rate() == 2000.0
    clock.t += 2.5
    assert leases.shortest_first_rate() is None  # gw1's lease ended
    assert leases.grant("gw1", 1.0, 3.0, shortest_first_rate=float("nan")) == 8
    assert leases.shortest_first_rate() is None  # a malformed order is no order
