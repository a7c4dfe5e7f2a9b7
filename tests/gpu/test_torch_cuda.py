"""The torch backend on CUDA, with the tiny presets the CPU tests use: the same weights on either device,
the paged path == the dense one on the GPU, pages exported through pinned host memory restore bit for bit
(into other page ids, from bytes or from a pinned buffer, on the GPU or on the CPU), and torch workers on
`cuda` restore an interrupted request from a holder's real KV pages with exactly an uninterrupted run's
output. Every test here carries the `gpu` marker (tests/conftest.py): `pytest -m gpu` runs them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gateway.protocol.generate import GenerateRequest, HolderRef, LumenExt, SamplingParams  # noqa: E402
from gateway.protocol.launch import EngineSpec  # noqa: E402
from models.torch_config import PRESETS, parse_dtype  # noqa: E402
from models.torch_kv_cache import PagedKVCache  # noqa: E402
from models.torch_model import BatchItem, CausalLM  # noqa: E402
from models.torch_weights import random_model  # noqa: E402
from tests.fixtures.planes import introduce  # noqa: E402
from worker_hooks.engine.handle import RequestHandle  # noqa: E402
from worker_hooks.engine.service import Worker, start_worker  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is false)"
)

CUDA = "cuda"
PS = 4  # page size: small, so that every sequence crosses many page boundaries
PROMPT = [(i * 37 + 11) % 256 for i in range(45)]


def greedy_paged(
    model: CausalLM, cache: PagedKVCache, pages: list[int], prompt: list[int], chunks: list[int], steps: int
) -> tuple[list[int], torch.Tensor]:
    """Prefill in chunks (every position's logits), then decode one token per step."""
    logits, pos = [], 0
    for c in chunks:
        logits.append(model.forward_batch([BatchItem(pages, pos, prompt[pos : pos + c], 0)], cache)[0])
        pos += c
    seq = [*prompt, int(logits[-1][-1].argmax())]
    for _ in range(steps - 1):
        logits.append(model.forward_batch([BatchItem(pages, len(seq) - 1, seq[-1:])], cache)[0])
        seq.append(int(logits[-1][-1].argmax()))
    return seq, torch.cat(logits)


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_the_same_weights_and_logits_on_cuda_as_on_cpu(preset: str) -> None:
    cpu, gpu = random_model(PRESETS[preset], 7), random_model(PRESETS[preset], 7, device=CUDA)
    assert gpu.device.type == "cuda"
    for name, t in cpu.state_dict().items():
        assert torch.equal(gpu.state_dict()[name].cpu(), t), name  # random weights are device-independent
    torch.testing.assert_close(gpu.forward_dense(PROMPT).cpu(), cpu.forward_dense(PROMPT), atol=1e-3, rtol=0)


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_paged_prefill_and_decode_match_the_dense_reference_on_cuda(preset: str) -> None:
    model = random_model(PRESETS[preset], 7, device=CUDA)
    pages = torch.randperm(30, generator=torch.Generator().manual_seed(3))[:17].tolist()  # 68 positions
    cache = PagedKVCache(model.cfg, 30, PS, device=CUDA)
    assert cache.k[0].device.type == "cuda"
    seq, logits = greedy_paged(model, cache, pages, PROMPT, [20, 7, 18], 20)
    dense = model.forward_dense(seq)
    torch.testing.assert_close(logits, dense[:-1], atol=1e-4, rtol=0)
    assert seq[len(PROMPT) :] == [int(r.argmax()) for r in dense[len(PROMPT) - 1 : -1]]


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_pages_exported_from_the_gpu_restore_bit_for_bit(dtype_name: str) -> None:
    dtype = parse_dtype(dtype_name)
    model = random_model(PRESETS["tiny"], 2, dtype=dtype, device=CUDA)
    src_pages, dst_pages = [5, 0, 9, 2, 7, 11, 3, 1], [12, 4, 0, 15, 8, 1, 9, 14]
    src = PagedKVCache(model.cfg, 12, PS, dtype=dtype, device=CUDA)
    greedy_paged(model, src, src_pages, PROMPT[:30], [30], 1)
    data = src.export_pages(src_pages)  # gathered on the GPU, copied into pinned host memory
    assert data.dtype == np.uint8 and data.nbytes == 8 * src.page_nbytes
    k0 = src.k[0][src_pages[0]].contiguous().view(torch.uint8).cpu().numpy().tobytes()
    assert data[: len(k0)].tobytes() == k0  # page 1, layer 0, K first: the layout the CPU cache has

    from_bytes = PagedKVCache(model.cfg, 16, PS, dtype=dtype, device=CUDA)
    from_bytes.import_pages(dst_pages, data.tobytes())  # bytes, as they arrive from a store: staged
    from_pinned = PagedKVCache(model.cfg, 16, PS, dtype=dtype, device=CUDA)
    from_pinned.import_pages(dst_pages, data)  # the pinned buffer itself
    on_cpu = PagedKVCache(model.cfg, 16, PS, dtype=dtype)
    on_cpu.import_pages(dst_pages, data)
    for cache in (from_bytes, from_pinned, on_cpu):
        assert cache.export_pages(dst_pages).tobytes() == data.tobytes()
    with pytest.raises(ValueError, match="bytes"):
        from_bytes.import_pages(dst_pages[:3], data)
    # continuation from the restored pages == continuation from the original ones, bit for bit
    tok = 17
    for pos in range(30, 32):
        a = model.forward_batch([BatchItem(src_pages, pos, [tok])], src)[0]
        for cache in (from_bytes, from_pinned):
            assert torch.equal(model.forward_batch([BatchItem(dst_pages, pos, [tok])], cache)[0], a)
        tok = int(a.argmax())


# -- torch workers on cuda ---------------------------------------------------------------------------
WORKER_PS = 8
BASE: dict[str, Any] = {
    "control_address": "",
    "backend": "torch",
    "torch_model": "tiny",
    "torch_device": CUDA,
    "model": "Qwen3-8B",
    "page_size": WORKER_PS,
    "kv_capacity_tokens": 4096,
    "ckpt_budget_bytes": 64 << 20,
    "torch_threads": 1,
    "log_level": "warning",
}
GREEDY = SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=48, temperature=0.9, top_p=0.95, ignore_eos=True)


def req(rid: str, prompt: list[int], params: SamplingParams, *holders: Worker) -> GenerateRequest:
    refs = [HolderRef(worker_id=h.worker_id, kv_endpoint=h.kv_endpoint) for h in holders]
    ext = LumenExt(seed_base=3, checkpoint=refs)
    return GenerateRequest(rid=rid, input_ids=prompt, sampling_params=params, lumen=ext)


async def until(cond: Callable[[], bool], within: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not cond():
        if loop.time() > deadline:
            raise TimeoutError(f"condition not met within {within} s")
        await asyncio.sleep(0.005)


async def read_to_end(handle: RequestHandle, out: list[int]) -> str:
    while True:
        e = await handle.next()
        out.extend(e.new_ids)
        if e.finish is not None:
            return e.finish.type


@contextlib.asynccontextmanager
async def workers(*ids: str, device: str = CUDA) -> AsyncIterator[list[Worker]]:
    spec = {**BASE, "torch_device": device}
    async with contextlib.AsyncExitStack() as stack:
        started = [await stack.enter_async_context(start_worker(EngineSpec(worker_id=i, **spec))) for i in ids]
        introduce(*started)  # what the gateway's Members does: their KV planes trust each other
        yield started


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_cuda_workers_restore_an_interrupted_request_from_real_kv_pages(params: SamplingParams) -> None:
    await restore_an_interrupted_request(params, CUDA)


async def restore_an_interrupted_request(params: SamplingParams, device: str) -> None:
    """Three torch workers on `device`: one streams a request checkpointing to another, is aborted
    mid-stream, and the holder resumes it from the real K/V pages to exactly the uninterrupted output.
    The default test run runs it on the CPU too (tests/integration/test_torch_engine.py), so that the
    scenario stays in step with the workers' protocols on a machine without CUDA."""
    prompt = [(i * 37 + 11) % 256 for i in range(45)]
    async with workers("a", "b", "ref", device=device) as (a, b, ref):
        assert a.engine.torch is not None and a.engine.torch.device.type == device
        truth: list[int] = []
        assert await read_to_end(ref.engine.submit(req("t", prompt, params)), truth) == "length"

        h = a.engine.submit(req("r-1", prompt, params, b))
        emitted: list[int] = []
        while len(emitted) < 20:
            emitted.extend((await h.next()).new_ids)
        store = b.engine.ckpt.store
        assert store is not None
        await until(lambda: store.durable_tokens("r-1") >= 40)  # the prompt's full pages, at least
        a.engine.abort("r-1", "worker failed")  # the pages that reached b stay there
        assert await read_to_end(h, emitted) == "abort"
        assert b.engine.ckpt.stats().bytes_used == store.durable_tokens("r-1") // WORKER_PS * (
            a.engine.ckpt.page_nbytes
        )  # real K/V bytes from the GPU, not the synthetic pattern

        left = msgspec.structs.replace(params, max_new_tokens=params.max_new_tokens - len(emitted))
        h2 = b.engine.submit(req("r-2", prompt + emitted, left))
        assert h2.restored_tokens >= 40
        rest: list[int] = []
        assert await read_to_end(h2, rest) == "length"
        assert emitted + rest == truth
        assert b.engine.ckpt.stats().restores == 1
        b.engine.pool.check_integrity()
