"""Cost model: sanity against known physical figures, and monotonicity."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.core.costmodel import ENGINE_STARTUP_S, GPUS, MODELS, CostModel, ReloadSource, StepWork

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


# -- reload sources (issue 14: seeded fast reload) ---------------------------------------------------


@pytest.mark.parametrize("gpu", sorted(GPUS))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_disk_reload_is_weights_over_load_bandwidth_plus_startup(model: str, gpu: str) -> None:
    cm = CostModel.preset(model, gpu)
    g, tp = GPUS[gpu], cm.tp
    disk = cm.model.weight_bytes / (g.load_bw * tp) + ENGINE_STARTUP_S
    # the default is disk, bit for bit what it was before reload sources existed
    assert cm.load_time() == cm.load_time(source=ReloadSource.DISK) == disk
    assert cm.load_time(engine_startup_s=0.0) == cm.weights_time() == cm.model.weight_bytes / (g.load_bw * tp)
    peer = cm.model.weight_bytes / (g.peer_bw * tp) + ENGINE_STARTUP_S
    assert cm.load_time(source=ReloadSource.PEER) == pytest.approx(peer, rel=1e-12)
    # a seed's NIC is faster than storage for every preset, so a seeded reload is shorter
    assert cm.load_time(source=ReloadSource.PEER) < cm.load_time()


def test_reload_times_for_qwen3_32b_tp2_on_h100() -> None:
    cm = CostModel.preset("Qwen3-32B", "H100-80G")  # TP 2: 65.6 GB, 32.8 GB per rank
    assert cm.weights_time() == pytest.approx(16.4)  # 2 GB/s per GPU from storage
    assert cm.weights_time(ReloadSource.PEER) == pytest.approx(65.6e9 / 90e9)  # 45 GB/s per GPU: 0.73 s
    assert cm.load_time() == pytest.approx(36.4)
    assert cm.load_time(source=ReloadSource.PEER) == pytest.approx(20.73, abs=0.01)
    # another interconnect: 100 Gb/s-class NICs (~11.25 GB/s per GPU)
    assert cm.weights_time(ReloadSource.PEER, peer_bw=11.25e9) == pytest.approx(65.6e9 / 22.5e9)
    # TP ranks load their shards in parallel, from either source
    tp4 = CostModel.preset("Qwen3-32B", "H100-80G", tp=4)
    for source in ReloadSource:
        assert tp4.weights_time(source) == pytest.approx(cm.weights_time(source) / 2)
    # the strings of a scenario or config name the same sources
    assert cm.weights_time(ReloadSource("peer")) == cm.weights_time(ReloadSource.PEER)


def test_seed_slowdown_is_the_transfers_share_of_hbm_bandwidth() -> None:
    h100 = CostModel.preset("Qwen3-32B", "H100-80G")
    assert h100.seed_slowdown() == pytest.approx(1 + 45e9 / (3.35e12 * 0.85))
    assert 1.01 < h100.seed_slowdown() < 1.02  # small: the seed barely notices
    assert 1.0 < CostModel.preset("Qwen3-32B", "H200").seed_slowdown() < h100.seed_slowdown()
    assert h100.seed_slowdown(peer_bw=0.0) == 1.0
    assert h100.seed_slowdown(peer_bw=90e9) > h100.seed_slowdown()
