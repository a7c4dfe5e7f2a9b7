"""Gray-failure verdicts: a worker far slower per token than its peers is degraded, and trusted again."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.core.gray import GrayParams, GrayVerdict, gray_verdicts

P = GrayParams()


def test_one_slow_worker_among_peers_is_degraded() -> None:
    times = {"w0": 0.02, "w1": 0.021, "w2": 0.019, "w3": 0.1}
    assert gray_verdicts(times, (), P) == GrayVerdict(frozenset({"w3"}), frozenset())


def test_a_moderately_slower_worker_is_left_alone() -> None:
    assert gray_verdicts({"w0": 0.02, "w1": 0.02, "w2": 0.045}, (), P) == GrayVerdict(
        frozenset(), frozenset()
    )


def test_hysteresis_between_degrade_and_restore() -> None:
    # 2x the median: not enough to degrade a healthy worker, too much to restore a degraded one
    times = {"w0": 0.02, "w1": 0.02, "w2": 0.04}
    assert gray_verdicts(times, (), P).degrade == frozenset()
    assert gray_verdicts(times, ("w2",), P) == GrayVerdict(frozenset(), frozenset())
    assert gray_verdicts({**times, "w2": 0.025}, ("w2",), P).restore == {"w2"}


def test_unmeasured_degraded_worker_is_trusted_again() -> None:
    assert gray_verdicts({"w0": 0.02, "w1": 0.02, "w2": 0.02}, ("w3",), P).restore == {"w3"}


def test_too_few_peers_decides_nothing_and_disabled_restores_all() -> None:
    assert gray_verdicts({"w0": 0.02, "w1": 0.5}, (), P) == GrayVerdict(frozenset(), frozenset())
    off = GrayParams(enabled=False)
    assert gray_verdicts({"w0": 0.02, "w1": 0.02, "w2": 1.0}, ("w2",), off).restore == {"w2"}


def test_bad_params_are_refused() -> None:
    with pytest.raises(ValueError, match="recover_factor"):
        GrayParams(slow_factor=1.5, recover_factor=2.0)


times_st = st.dictionaries(
    st.sampled_from([f"w{i}" for i in range(8)]), st.floats(1e-3, 1.0), min_size=0, max_size=8
)


@given(times_st, st.data())
def test_verdicts_ignore_order_and_scale(times: dict[str, float], data: st.DataObject) -> None:
    degraded = data.draw(st.frozensets(st.sampled_from([f"w{i}" for i in range(8)])))
    v = gray_verdicts(times, degraded, P)
    shuffled = dict(data.draw(st.permutations(list(times.items()))))
    assert gray_verdicts(shuffled, sorted(degraded), P) == v
    scale = data.draw(st.sampled_from([0.25, 2.0, 1024.0]))  # powers of two: exact in floating point
    assert gray_verdicts({w: t * scale for w, t in times.items()}, degraded, P) == v


@given(times_st, st.data())
def test_never_a_majority_and_never_a_worker_at_the_median(
    times: dict[str, float], data: st.DataObject
) -> None:
    degraded = data.draw(
        st.frozensets(st.sampled_from(sorted(times) or ["w0"]), max_size=max(0, (len(times) - 1) // 2))
    )
    v = gray_verdicts(times, degraded, P)
    assert not (v.degrade & v.restore)
    assert v.degrade.isdisjoint(degraded) and v.restore <= degraded
    after = (set(degraded) | v.degrade) - v.restore
    assert len(after) <= max(0, (len(times) - 1) // 2)
    fastest = min(times.values(), default=None)
    for w in v.degrade:
        assert times[w] > P.slow_factor * fastest  # type: ignore[operator]
