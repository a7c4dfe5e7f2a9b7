"""Adaptive speculation length: expected tokens per step, the choice of k, the acceptance estimate."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.core.speculation import AcceptanceEstimator, choose_k, expected_tokens_per_step

rates = st.floats(0.0, 1.0)


@pytest.mark.parametrize(
    ("a", "k", "expected"), [(0.0, 4, 1.0), (1.0, 4, 5.0), (0.5, 1, 1.5), (0.5, 3, 1.875), (0.7, 0, 1.0)]
)
def test_expected_tokens_worked_values(a: float, k: int, expected: float) -> None:
    assert expected_tokens_per_step(a, k) == pytest.approx(expected)


@given(rates, st.integers(0, 16))
def test_expected_tokens_is_the_geometric_sum(a: float, k: int) -> None:
    direct = math.fsum(a**i for i in range(k + 1))
    assert expected_tokens_per_step(a, k) == pytest.approx(direct, rel=1e-9)
    assert 1.0 <= expected_tokens_per_step(a, k) <= k + 1
    assert expected_tokens_per_step(a, k + 1) >= expected_tokens_per_step(a, k)


@pytest.mark.parametrize(("a", "k"), [(-0.1, 1), (1.1, 1), (0.5, -1)])
def test_expected_tokens_rejects_bad_input(a: float, k: int) -> None:
    with pytest.raises(ValueError):
        expected_tokens_per_step(a, k)


def test_choose_k_extremes() -> None:
    # nothing is ever accepted: drafting only costs
    assert choose_k(0.0, 1, 8, 0.05) == 1
    assert choose_k(0.0, 0, 8, 0.05) == 0
    # everything is accepted and drafts are cheap: draft as much as allowed
    assert choose_k(1.0, 1, 8, 0.05) == 8
    # free verification: more drafts never hurt, and ties keep the smaller k
    assert choose_k(0.0, 2, 8, 0.0) == 2


@given(rates, st.floats(0.0, 2.0), st.integers(0, 4), st.integers(0, 8))
def test_choose_k_is_the_argmax(a: float, c: float, k_min: int, extra: int) -> None:
    k_max = k_min + extra
    k = choose_k(a, k_min, k_max, c)
    assert k_min <= k <= k_max
    value = expected_tokens_per_step(a, k) / (1 + c * k)
    assert all(
        expected_tokens_per_step(a, j) / (1 + c * j) <= value * (1 + 1e-12) for j in range(k_min, k_max + 1)
    )


def test_choose_k_with_a_cost_function() -> None:
    # a step costs 10 ms plus 1 ms per drafted token: at a = 0.8 the optimum is interior
    k = choose_k(0.8, 1, 16, lambda k: 10.0 + k)
    values = [expected_tokens_per_step(0.8, j) / (10.0 + j) for j in range(1, 17)]
    assert k == 1 + values.index(max(values))
    assert 1 < k < 16
    with pytest.raises(ValueError):
        choose_k(0.8, 1, 4, lambda k: 0.0)
    with pytest.raises(ValueError):
        choose_k(0.8, 3, 2, 0.1)


def test_estimator_starts_at_the_prior_and_tracks_rounds() -> None:
    est = AcceptanceEstimator(prior=0.5, weight=0.2)
    assert est.rate == 0.5
    # 4 drafts, 2 accepted: 3 tokens tested (2 agreements, then a disagreement)
    est = est.update(2, 4)
    assert est.rate == pytest.approx(2 / 3)
    assert est.rounds == 1
    assert est.update(0, 0) is est
    for _ in range(200):
        est = est.update(4, 4)
    assert est.rate == pytest.approx(1.0, abs=1e-9)


@given(st.lists(st.tuples(st.integers(0, 8), st.integers(0, 8)), max_size=30))
def test_estimate_stays_a_rate(rounds: list[tuple[int, int]]) -> None:
    est = AcceptanceEstimator()
    for x, y in rounds:
        est = est.update(min(x, y), max(x, y))
        assert 0.0 <= est.rate <= 1.0


def test_estimator_recovers_a_geometric_acceptance_rate() -> None:
    # rounds drawn with a deterministic pattern of per-token agreement at rate 0.75
    pattern = [True, True, True, False] * 50
    est, i = AcceptanceEstimator(prior=0.1, weight=0.05), 0
    for _ in range(150):
        n = 0
        while n < 4 and pattern[i % len(pattern)]:
            n, i = n + 1, i + 1
        i += 1 if n < 4 else 0
        est = est.update(n, 4)
    assert est.rate == pytest.approx(0.75, abs=0.03)


@pytest.mark.parametrize("kw", [{"prior": 1.5}, {"weight": 0.0}, {"weight": 1.5}])
def test_estimator_validates(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        AcceptanceEstimator(**kw)
    with pytest.raises(ValueError):
        AcceptanceEstimator().update(3, 2)
