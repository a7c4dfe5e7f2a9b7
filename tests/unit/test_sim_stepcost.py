"""The simulator's aggregate step time equals the cost model's, and decode runs sum it exactly."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.core.costmodel import MODELS, CostModel, StepWork
from gateway.sim.stepcost import StepCost

models = st.sampled_from(sorted(MODELS))
gpus = st.sampled_from(["H100-80G", "H200"])


@given(
    models,
    gpus,
    st.lists(st.tuples(st.integers(1, 8192), st.integers(0, 16384)), max_size=4),
    st.lists(st.integers(1, 16384), max_size=64),
    st.integers(0, 256),
)
def test_aggregate_step_equals_the_cost_model(
    model: str, gpu: str, prefill: list[tuple[int, int]], decode: list[int], verify: int
) -> None:
    cm = CostModel.preset(model, gpu)
    if not decode:
        verify = 0
    new = sum(n for n, _ in prefill) + len(decode) + verify
    attn = sum(n * (c + n / 2) for n, c in prefill) + sum(decode) * (
        1 + (verify / len(decode) if decode else 0)
    )
    kv = sum(c for _, c in prefill) + sum(decode)
    expected = cm.step_time(StepWork(prefill=prefill, decode_contexts=decode, verify_tokens=verify))
    assert StepCost(cm).step(new, attn, kv) == pytest.approx(expected, rel=1e-9, abs=1e-15)


@given(
    models,
    st.integers(1, 256),
    st.integers(1, 8000),
    st.sampled_from([1.0, 2.5]),
    st.integers(0, 4),
    st.integers(0, 300),
)
def test_decode_run_sums_the_per_step_times(model: str, b: int, ctx: int, e: float, k: int, n: int) -> None:
    cm = CostModel.preset(model, "H100-80G")
    sc = StepCost(cm)
    run = sc.decode_run(b, b * ctx, b * e, k * b)
    steps = [cm.step_time(StepWork(decode_contexts=[ctx + j * e] * b, verify_tokens=k * b)) for j in range(n)]
    for j in (0, n // 2, n - 1):
        if j >= 0 and n:
            assert run.step(j) == pytest.approx(steps[j], rel=1e-9)
    assert run.time(n) == pytest.approx(sum(steps), rel=1e-9)
    # steps_within inverts time(): the number of whole steps ending within dt
    for dt in (0.0, sum(steps) / 3, sum(steps), sum(steps) * 2):
        got = run.steps_within(dt, n)
        assert run.time(got) <= dt * (1 + 1e-12)
        assert got == n or run.time(got + 1) > dt


def test_decode_run_crossing_from_compute_to_memory_bound() -> None:
    # verifying 8 drafts per request on a large batch of a small model is compute-bound while the
    # contexts are short; KV reads grow faster than attention FLOPs, so it turns memory-bound
    cm = CostModel.preset("Llama-3.2-1B", "H100-80G")
    run = StepCost(cm).decode_run(256, 256 * 100, 256, 8 * 256)
    assert run.ac > run.am  # compute-bound at first
    assert run.ac + run.bc * 5000 < run.am + run.bm * 5000  # memory-bound later
    n = 6000
    assert run.time(n) == pytest.approx(sum(run.step(j) for j in range(n)), rel=1e-9)
    assert run.steps_within(run.time(4321), n) == 4321
