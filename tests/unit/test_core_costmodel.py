"""Cost model: sanity against known physical figures, and monotonicity."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.core.costmodel import GPUS, MODELS, CostModel, StepWork

KiB = 1024


@pytest.mark.parametrize(
    ("model", "kib"),
    [
        ("Qwen3-8B", 144),
        ("Qwen3-14B", 160),
        ("Qwen3-32B", 256),
        ("Llama-3-70B", 320),
        ("Qwen3-0.6B", 112),
        ("Qwen3-1.7B", 112),
        ("Llama-3.2-1B", 32),
    ],
)
def test_kv_bytes_per_token_match_design(model: str, kib: int) -> None:
    assert MODELS[model].kv_bytes_per_token == kib * KiB


def test_decode_is_memory_bound_and_near_weight_streaming_time() -> None:
    cm = CostModel.preset("Qwen3-32B", "H100-80G", tp=1)
    t = cm.decode_step_time([1000])
    weights_s = cm.model.weight_bytes / (GPUS["H100-80G"].hbm_bw * GPUS["H100-80G"].mbu)
    assert weights_s < t < weights_s * 1.2 + cm.step_overhead_s


def test_prefill_of_a_long_prompt_is_compute_bound() -> None:
    cm = CostModel.preset("Qwen3-32B", "H100-80G", tp=1)
    t = cm.prefill_time(8192)
    flops = 2 * cm.model.params * 8192
    assert t > flops / (989e12 * 0.71)


def test_h200_decodes_faster_than_h100() -> None:
    a = CostModel.preset("Qwen3-14B", "H100-80G").decode_step_time([2000] * 16)
    b = CostModel.preset("Qwen3-14B", "H200").decode_step_time([2000] * 16)
    assert b < a


def test_capacity_and_load_time_are_plausible() -> None:
    cm = CostModel.preset("Qwen3-32B", "H100-80G")  # TP 2 by preset
    assert 100_000 < cm.kv_capacity_tokens() < 1_000_000
    assert 20 < cm.load_time() < 300
    assert cm.restore_time(4096) < cm.prefill_time(4096)  # restoring KV beats recomputing it


@given(st.lists(st.integers(1, 32000), min_size=1, max_size=64), st.integers(1, 2000))
def test_step_time_is_monotone_in_work(contexts: list[int], extra: int) -> None:
    cm = CostModel.preset("Qwen3-8B", "H100-80G")
    base = cm.step_time(StepWork(decode_contexts=contexts))
    assert cm.step_time(StepWork(decode_contexts=[*contexts, extra])) >= base
    assert cm.step_time(StepWork(prefill=((extra, 0),), decode_contexts=contexts)) >= base


def test_empty_step_costs_nothing_and_bad_presets_raise() -> None:
    cm = CostModel.preset("Qwen3-8B", "H100-80G")
    assert cm.step_time(StepWork()) == 0.0
    with pytest.raises(KeyError, match="unknown model preset"):
        CostModel.preset("GPT-5", "H100-80G")
    with pytest.raises(ValueError, match="tp must be"):
        CostModel(MODELS["Qwen3-8B"], GPUS["H100-80G"], 0)
