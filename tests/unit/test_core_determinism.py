"""The determinism judgement (gateway/core/determinism.py) and its reading from SGLang's /server_info."""

from __future__ import annotations

import msgspec

from gateway.core.determinism import (
    LUMEN_WORKER,
    UNKNOWN,
    Numerics,
    judge_numerics,
    nonexact_sides,
    seed_ignored_by,
)
from gateway.protocol.sglang import SGLangServerInfo
from gateway.server.workers.server_info import numerics

# what a real sglang 0.5.23 server on this machine answers (float32 on CPU, trimmed to the fields read)
REAL_CPU = (
    b'{"dtype": "float32", "device": "cpu", "attention_backend": "torch_native", "sampling_backend": '
    b'"pytorch", "enable_deterministic_inference": false, "schedule_policy": "fcfs", "tp_size": 1}'
)


def test_a_real_cpu_servers_answer_is_read_and_promises_nothing() -> None:
    info = msgspec.json.decode(REAL_CPU, type=SGLangServerInfo)
    n = numerics(info)
    assert n == Numerics("float32", "torch_native", "pytorch", False, "cpu")
    d = judge_numerics(n)
    assert not d.bit_equal and not d.seeded and d.label == "not-promised"
    assert "exact in practice" in d.note and "sampling_seed ignored" in d.note


def test_deterministic_inference_with_a_batch_invariant_backend_promises_both() -> None:
    for backend in ("flashinfer", "fa3", "triton"):
        d = judge_numerics(Numerics("bfloat16", backend, "pytorch", True, "cuda"))
        assert d.bit_equal and d.seeded and d.label == "exact"


def test_deterministic_inference_elsewhere_honours_seeds_only() -> None:
    d = judge_numerics(Numerics("float32", "torch_native", "pytorch", True, "cpu"))
    assert d.seeded and not d.bit_equal and d.label == "not-promised"


def test_gpu_without_deterministic_inference_may_diverge() -> None:
    d = judge_numerics(Numerics("bfloat16", "flashinfer", "flashinfer", False, "cuda"))
    assert not d.bit_equal and not d.seeded and "may diverge" in d.note
    # bf16 on CPU is not "exact in practice" (issue 27: 4-5 of 6 replays diverged)
    assert "may diverge" in judge_numerics(Numerics("bfloat16", "torch_native", "pytorch", False, "cpu")).note


def test_an_unread_or_old_answer_promises_nothing() -> None:
    info = msgspec.json.decode(b"{}", type=SGLangServerInfo)
    assert not judge_numerics(numerics(info)).bit_equal
    assert not UNKNOWN.bit_equal and not UNKNOWN.seeded
    assert LUMEN_WORKER.bit_equal and LUMEN_WORKER.seeded


def test_resume_sides_and_seed_ignoring_servers() -> None:
    cpu = judge_numerics(Numerics("float32", "torch_native", "pytorch", False, "cpu"))
    exact = judge_numerics(Numerics("bfloat16", "fa3", "pytorch", True, "cuda"))
    assert nonexact_sides(exact, exact) == ()
    assert nonexact_sides(cpu, exact) == ("off",)
    assert nonexact_sides(exact, cpu) == ("onto",)
    assert nonexact_sides(cpu, UNKNOWN) == ("off", "onto")
    assert seed_ignored_by([("b", cpu), ("a", exact), ("c", UNKNOWN)]) == ["b", "c"]
    assert seed_ignored_by([("a", exact), ("l", LUMEN_WORKER)]) == []
