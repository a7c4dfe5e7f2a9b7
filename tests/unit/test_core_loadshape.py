"""The load's shape (gateway.core.loadshape) and the gate retuned from it (pairing.with_load_shape)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.core.costmodel import CostModel
from gateway.core.loadshape import LoadShape
from gateway.core.pairing import PairingParams, with_load_shape
from gateway.core.speculation import AssistGate, assist_gain

TARGET = CostModel.preset("Qwen3-32B", "H100-80G")
DRAFTER = CostModel.preset("Qwen3-1.7B", "H100-80G")


@given(st.integers(0, 8192), st.integers(1, 4096), st.integers(1, 300))
def test_the_means_of_fewer_than_span_requests_are_their_plain_means(p: int, o: int, n: int) -> None:
    shape = LoadShape(span=300)
    for _ in range(n):
        shape.observe(p, o)
    assert shape.prompt_tokens == pytest.approx(p) and shape.output_tokens == pytest.approx(o)


def test_later_requests_weigh_one_span_th_each() -> None:
    shape = LoadShape(span=4)
    for _ in range(4):
        shape.observe(100, 10)
    shape.observe(500, 50)
    assert shape.prompt_tokens == pytest.approx(100 + (500 - 100) / 4)
    assert shape.output_tokens == pytest.approx(10 + (50 - 10) / 4)


def test_the_gate_follows_the_shape_beyond_its_tolerance_only() -> None:
    params = PairingParams(gate=AssistGate(TARGET, DRAFTER, nominal_batch=64))
    same = LoadShape(prompt_tokens=1170.0, output_tokens=205.0, span=1, seen=1)  # within 5 %
    assert with_load_shape(params, same) is params
    code = LoadShape(prompt_tokens=2097.0, output_tokens=33.0, span=1, seen=0)
    assert with_load_shape(params, code) is params  # not enough requests seen yet
    code.seen = 1
    gate = with_load_shape(params, code).gate
    assert gate is not None and (gate.prompt_tokens, gate.output_tokens) == (2097.0, 33.0)
    assert with_load_shape(PairingParams(), code).gate is None
    no_prefill = PairingParams(gate=AssistGate(TARGET, DRAFTER, prompt_tokens=0))
    assert with_load_shape(no_prefill, code) is no_prefill


def test_drafting_gains_least_on_a_code_like_load_and_most_where_decode_dominates() -> None:
    def gain(prompt: float, output: float) -> float:
        gate = AssistGate(TARGET, DRAFTER, nominal_batch=64, prompt_tokens=prompt, output_tokens=output)
        return assist_gain(gate, 64, prompt + output / 2)[1]

    code, conv, chatty = gain(2097, 33), gain(1155, 211), gain(500, 1000)
    assert code < 1.0 < conv < chatty  # drafts slow a prefill-bound target down
    # ~2k prompts with ~450-token outputs gain about what conversations do: longer outputs, but a
    # longer context to attend over in every verification
    assert gain(2097, 455) == pytest.approx(conv, abs=0.01)
