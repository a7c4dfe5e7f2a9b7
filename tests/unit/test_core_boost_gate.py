"""The batch boost's cost gate (gateway.core.outage `BoostGate`, `boost_gain`, issue 17): the boost
only where a larger batch makes a worker complete requests faster for the load's shape."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.core.costmodel import CostModel
from gateway.core.loadshape import LoadShape
from gateway.core.outage import BoostGate, OutageParams, boost_gain, outage_boost
from gateway.core.speculation import DEFAULT_OUTPUT_TOKENS, DEFAULT_PROMPT_TOKENS
from gateway.core.types import ParamError

H100 = CostModel.preset("Qwen3-32B", "H100-80G")
GATE = BoostGate(H100, 64, H100.kv_capacity_tokens(), 8192)
CONV = (DEFAULT_PROMPT_TOKENS, DEFAULT_OUTPUT_TOKENS)  # the conversation trace's means
LONG_OUTPUT = (2400.0, 470.0)  # the simulator's long-output shape (means)
CODE = (2400.0, 40.0)  # the simulator's code-like shape (means): prefill-bound


def test_decode_bound_shapes_gain_from_a_third_more_slots_and_prefill_bound_ones_do_not() -> None:
    conv, long_output, code = (boost_gain(GATE, 4 / 3, *s) for s in (CONV, LONG_OUTPUT, CODE))
    assert conv > 1.08 and long_output > 1.08  # ~1.12: the batch grew by 1/3, its steps longer
    assert 1.0 <= code < 1.02  # the time goes to prefill chunks the larger batch only slows
    p = OutageParams()  # the default gate: 1.05
    assert outage_boost(p, True, 4, 1, GATE, CONV) == pytest.approx(4 / 3)
    assert outage_boost(p, True, 4, 1, GATE, LONG_OUTPUT) == pytest.approx(4 / 3)
    assert outage_boost(p, True, 4, 1, GATE, CODE) == 1.0


def test_a_worker_whose_kv_holds_no_more_requests_gains_nothing() -> None:
    ctx = CONV[0] + CONV[1] / 2
    full = BoostGate(H100, 64, 64 * ctx + 1, 8192)  # KV for the base batch and not one more
    assert boost_gain(full, 1.5, *CONV) == 1.0
    assert outage_boost(OutageParams(), True, 4, 1, full, CONV) == 1.0
    roomy = BoostGate(H100, 64, 70 * ctx, 8192)  # room for 6 more: a smaller gain than unbounded
    assert 1.0 < boost_gain(roomy, 1.5, *CONV) < boost_gain(GATE, 1.5, *CONV)


@given(
    st.floats(1.0, 3.0),
    st.integers(2, 64),
    st.integers(0, 64),
    st.floats(1.0, 16384.0),
    st.floats(1.0, 2048.0),
    st.floats(0.0, 1.3),
)
def test_the_gate_either_keeps_the_ungated_factor_or_takes_the_boost_away(
    cap: float, workers: int, down: int, prompt: float, output: float, min_gain: float
) -> None:
    down = min(down, workers)
    params = OutageParams(batch_boost=cap, boost_min_gain=min_gain)
    plain = outage_boost(params, True, workers, down)
    gated = outage_boost(params, True, workers, down, GATE, (prompt, output))
    if plain == 1.0 or min_gain == 0.0:
        assert gated == plain
    else:
        pays = boost_gain(GATE, plain, prompt, output) >= min_gain
        assert gated == (plain if pays else 1.0)
    assert outage_boost(params, False, workers, down, GATE, (prompt, output)) == 1.0


@given(st.floats(1.0, 16384.0), st.floats(1.0, 2048.0))
def test_no_extra_slot_no_gain(prompt: float, output: float) -> None:
    assert boost_gain(GATE, 1.0, prompt, output) == 1.0
    assert boost_gain(GATE, 1.01, prompt, output) == 1.0  # 64 x 1.01 rounds down to 64


def test_the_gate_judges_the_conversation_means_until_the_shape_is_measured() -> None:
    shape = LoadShape(span=3)
    for _ in range(2):
        shape.observe(2400, 40)
    assert shape.means() == CONV  # two of three: not yet
    shape.observe(2400, 40)
    assert shape.means() == (2400.0, 40.0)


@pytest.mark.parametrize("bad", [-0.1, math.inf, math.nan])
def test_a_min_gain_below_zero_or_not_finite_is_refused_by_name(bad: float) -> None:
    with pytest.raises(ParamError, match="boost_min_gain"):
        OutageParams(boost_min_gain=bad)


def test_a_gate_without_a_batch_or_kv_is_refused() -> None:
    with pytest.raises(ParamError, match="base_batch"):
        BoostGate(H100, 0)
    with pytest.raises(ParamError, match="kv_tokens"):
        BoostGate(H100, 64, 0)
