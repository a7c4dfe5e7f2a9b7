"""Draft assist's cost gate (gateway.core.speculation.assist_gain / assist_pays) and the gated pairing."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.costmodel import CostModel, StepWork
from gateway.core.health import WorkerState
from gateway.core.pairing import PairingParams, pair_drafters
from gateway.core.speculation import (
    AssistGate,
    assist_gain,
    assist_pays,
    expected_tokens_per_step,
    overloaded,
)
from gateway.core.types import ClusterView, LoadParams, ParamError, WorkerView

TARGET = CostModel.preset("Qwen3-32B", "H100-80G")
DRAFTER = CostModel.preset("Qwen3-1.7B", "H100-80G")
GATE = AssistGate(TARGET, DRAFTER, 0.7, 1, 8, nominal_batch=64)


@given(st.integers(1, 256), st.floats(1.0, 8000.0), st.integers(0, 16))
def test_the_batch_step_time_is_the_per_request_roofline(batch: int, ctx: float, verify: int) -> None:
    c = int(ctx)
    want = TARGET.step_time(StepWork(decode_contexts=[c] * batch, verify_tokens=verify))
    assert TARGET.batch_step_time(batch, c, verify) == pytest.approx(want, rel=1e-12)


@given(st.integers(1, 512), st.floats(1.0, 8000.0), st.floats(0.0, 1.0))
def test_free_drafts_gain_at_least_as_much_as_drafts_that_cost(batch: int, ctx: float, a: float) -> None:
    free = assist_gain(AssistGate(TARGET, None, a), batch, ctx)[1]
    paid = assist_gain(AssistGate(TARGET, DRAFTER, a), batch, ctx)[1]
    assert paid <= free + 1e-12
    # the gain is the chosen k's tokens per step over its relative step time
    k, gain = assist_gain(AssistGate(TARGET, DRAFTER, a), batch, ctx)
    plain = TARGET.batch_step_time(batch, ctx)
    drafted = TARGET.batch_step_time(batch, ctx, batch * k) + k * DRAFTER.batch_step_time(batch, ctx)
    assert gain == pytest.approx(expected_tokens_per_step(a, k) * plain / drafted)


@settings(max_examples=50)
@given(st.floats(0.3, 0.95))
def test_the_gain_falls_as_the_batch_grows(a: float) -> None:
    gate = AssistGate(TARGET, DRAFTER, a)
    gains = [assist_gain(gate, b, 1500.0)[1] for b in (1, 16, 64, 256, 1024)]
    assert all(x >= y - 1e-9 for x, y in itertools.pairwise(gains))
    assert gains[-1] < 1.0  # a batch that large is compute bound: verifying drafts costs more


def view(running: int, waiting: int, kv: int = 0) -> WorkerView:
    return WorkerView("w1", WorkerState.HEALTHY, 1, running, waiting, kv, 300_000)


def test_an_idle_or_not_overloaded_survivor_is_not_drafted_for() -> None:
    assert not assist_pays(GATE, view(0, 0))
    assert not assist_pays(GATE, view(10, 0, 15_000))  # room in the batch, nothing waiting
    assert not assist_pays(GATE, view(10, 3, 15_000))  # a momentary queue in front of a batch with room
    assert assist_pays(GATE, view(64, 5, 100_000))  # a full batch and a queue: drafting pays
    assert overloaded(GATE, view(64, 1)) and not overloaded(GATE, view(63, 1))


def test_a_large_batch_is_not_drafted_for_even_when_overloaded() -> None:
    big = AssistGate(TARGET, DRAFTER, 0.7, 1, 8, nominal_batch=1024)
    assert not assist_pays(big, view(1024, 50, 1024 * 2000))


def test_gate_bounds_name_the_field() -> None:
    for kw, field in (({"min_gain": -1.0}, "min_gain"), ({"min_waiting": -1}, "min_waiting")):
        with pytest.raises(ParamError) as exc:
            AssistGate(TARGET, **kw)
        assert exc.value.field == field


def test_gated_pairing_skips_an_idle_target_and_keeps_a_pair_while_it_still_pays() -> None:
    params = PairingParams(load=LoadParams(nominal_batch=64), gate=GATE)
    d = WorkerView("w0", WorkerState.DRAFT_READY, 2)
    busy = WorkerView("w1", WorkerState.HEALTHY, 1, 64, 20, 100_000, 300_000)
    calm = WorkerView("w1", WorkerState.HEALTHY, 1, 64, 0, 100_000, 300_000)
    idle = WorkerView("w1", WorkerState.HEALTHY, 1, 2, 0, 3_000, 300_000)
    assert pair_drafters(ClusterView.of([d, busy]), ["w0"], {}, params) == {"w0": "w1"}
    assert pair_drafters(ClusterView.of([d, calm]), ["w0"], {}, params) == {}  # new pairs need a queue
    assert pair_drafters(ClusterView.of([d, calm]), ["w0"], {"w0": "w1"}, params) == {"w0": "w1"}
    ungated = PairingParams(load=LoadParams(nominal_batch=64))
    assert pair_drafters(ClusterView.of([d, idle]), ["w0"], {}, ungated) == {"w0": "w1"}
    assert pair_drafters(ClusterView.of([d, idle]), ["w0"], {}, params) == {}
