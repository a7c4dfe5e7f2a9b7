"""In-process torch workers (tiny random model, fp32, CPU) on the real planes: KV pages stream to a
holder's store and a resumed request restores from them exactly; a restarting worker loads its draft
model, drafts for a survivor over the draft plane, and the target's output stays plain decoding's."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest

pytest.importorskip("torch")

from gateway.core.health import Phase
from gateway.protocol import control_pb2 as pb
from gateway.protocol.generate import GenerateRequest, HolderRef, LumenExt, SamplingParams
from gateway.protocol.launch import EngineSpec
from tests.fixtures.planes import introduce
from worker_hooks.agent import Agent
from worker_hooks.engine.handle import RequestHandle
from worker_hooks.engine.service import Worker, start_worker

PS = 8
BASE: dict[str, Any] = {
    "control_address": "",
    "backend": "torch",
    "torch_model": "tiny",
    "model": "Qwen3-8B",  # the cost model the gateway would plan with; a registered draft pair
    "draft_model": "Qwen3-0.6B",
    "page_size": PS,
    "kv_capacity_tokens": 4096,
    "ckpt_budget_bytes": 64 << 20,
    "torch_threads": 1,
    "log_level": "warning",
}
GREEDY = SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=48, temperature=0.9, top_p=0.95, ignore_eos=True)


def spec(worker_id: str, **kw: Any) -> EngineSpec:
    return EngineSpec(worker_id=worker_id, **(BASE | kw))


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [(i * 37 + salt * 11) % 256 for i in range(n)]


def req(
    rid: str, prompt: list[int], params: SamplingParams, *holders: Worker, seed: int = 0
) -> GenerateRequest:
    refs = [HolderRef(worker_id=h.worker_id, kv_endpoint=h.kv_endpoint) for h in holders]
    return GenerateRequest(
        rid=rid, input_ids=prompt, sampling_params=params, lumen=LumenExt(seed_base=seed, checkpoint=refs)
    )


async def until(cond: Any, within: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not cond():
        if loop.time() > deadline:
            raise TimeoutError(f"condition not met within {within} s")
        await asyncio.sleep(0.005)


async def collect(handle: RequestHandle) -> tuple[list[int], list[int], str]:
    """A request's whole output, how many ids each emission carried, and its finish type."""
    out: list[int] = []
    sizes: list[int] = []
    while True:
        e = await handle.next()
        out.extend(e.new_ids)
        sizes.append(len(e.new_ids))
        if e.finish is not None:
            return out, sizes, e.finish.type


async def drain(handle: RequestHandle) -> tuple[list[int], list[int]]:
    out, sizes, finish = await collect(handle)
    assert finish == "length", finish
    return out, sizes


@contextlib.asynccontextmanager
async def workers(*specs: EngineSpec) -> AsyncIterator[list[Worker]]:
    async with contextlib.AsyncExitStack() as stack:
        started = [await stack.enter_async_context(start_worker(s)) for s in specs]
        introduce(*started)  # what the gateway's Members does: their data planes trust each other
        yield started


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_interrupted_request_restores_from_real_kv_pages_on_its_holder(params: SamplingParams) -> None:
    prompt = prompt_of(45, 1)
    async with workers(spec("a"), spec("b"), spec("ref")) as (a, b, ref):
        truth, _ = await drain(ref.engine.submit(req("t", prompt, params, seed=3)))

        h = a.engine.submit(req("r-1", prompt, params, b, seed=3))
        emitted: list[int] = []
        while len(emitted) < 20:
            emitted.extend((await h.next()).new_ids)
        a.engine.pause()  # as a dying worker: no more steps; what reached b stays there
        await asyncio.sleep(0.05)
        while (e := h.next_nowait()) is not None:
            emitted.extend(e.new_ids)
        seq = a.engine.scheduler.get("r-1")
        assert seq is not None
        durable = seq.kv_len // PS * PS
        store = b.engine.ckpt.store
        assert store is not None
        await until(lambda: store.durable_tokens("r-1") == durable)
        # the holder got real KV: a page is the model's K/V bytes, not the synthetic pattern
        assert b.engine.ckpt.stats().bytes_used == durable // PS * a.engine.ckpt.page_nbytes
        a.engine.abort("r-1", "worker failed")
        a.engine.resume()

        left = msgspec.structs.replace(params, max_new_tokens=params.max_new_tokens - len(emitted))
        resumed = req("r-2", prompt + emitted, left, seed=3)
        h2 = b.engine.submit(resumed)
        assert h2.restored_tokens == durable > 0
        rest, _ = await drain(h2)
        assert emitted + rest == truth
        assert b.engine.ckpt.stats().restores == 1
        b.engine.pool.check_integrity()
        async with aiohttp.ClientSession() as http, http.get(b.url + "/metrics") as resp:
            text = await resp.text()
        rows = (line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("lumen_"))
        metrics = {name.split("{")[0]: float(v) for name, v in rows}
        assert metrics["lumen_restores_total"] == 1
        assert metrics["lumen_torch_restore_seconds_total"] > 0
        assert metrics["lumen_torch_forward_seconds_total"] > 0


def pair(target: Worker, drafter: Worker, k: int = 4) -> None:
    introduce(target, drafter)
    for w, peer, role in ((target, drafter, "target"), (drafter, target, "drafter")):
        Agent(w.spec, w.engine, w.url).handle(
            pb.GatewayMessage(
                start_draft_assist=pb.StartDraftAssist(
                    peer_id=peer.worker_id, peer_endpoint=peer.engine.assist.endpoint, role=role, k=k
                )
            )
        )


async def test_the_cuda_lanes_restore_scenario_runs_here_on_the_cpu() -> None:
    """tests/gpu runs only where CUDA is; its restore scenario runs here too, so it cannot fall out of
    step with the workers' protocols unseen (it once did: its workers never trusted each other's KV
    planes, and on an H200 the holder waited for a key forever)."""
    from tests.gpu.test_torch_cuda import GREEDY, restore_an_interrupted_request

    await restore_an_interrupted_request(GREEDY, "cpu")


@pytest.mark.parametrize("draft", ["self:2", "tiny-draft"])
async def test_a_restarting_worker_drafts_for_a_survivor_and_outputs_stay_exact(draft: str) -> None:
    reqs = [req(f"r{i}", prompt_of(9 + 13 * i, i), GREEDY if i % 2 else SEEDED, seed=i) for i in range(4)]
    # the full model stays "loading" (its plan's minimum time) for the whole test
    drafter_spec = spec("d", restart=True, torch_draft=draft, draft_load_s=0.0, model_load_s=1e5)
    # the target waits for drafts as long as a CPU forward of the drafter may take on a busy 2-core
    # machine (the default 30 ms is a GPU figure): the test is about exactness and drafting, not latency
    target_spec = spec("t", draft_timeout_ms=2000)
    async with workers(spec("plain"), drafter_spec, target_spec) as (plain, d, t):
        truth = [out for out, _ in await asyncio.gather(*(drain(plain.engine.submit(r)) for r in reqs))]
        await until(lambda: d.engine.phase is Phase.DRAFT_READY)
        role = d.engine.assist.drafter
        assert role is not None and role.torch_drafter is not None and role.torch_drafter.model is not None
        pair(t, d)
        results = await asyncio.gather(*(drain(t.engine.submit(r)) for r in reqs))
        assert [out for out, _ in results] == truth
        sp = t.engine.assist.speculator
        assert sp is not None
        st = sp.client.stats
        assert st.drafted > 0
        if draft == "self:2":  # the target's own layers: every draft is right, steps carry k + 1 tokens
            assert st.accepted == st.drafted
            assert max(max(sizes) for _, sizes in results) > 1
        assert d.engine.stats().requests_total == 0


async def test_a_worker_serves_a_huggingface_folder(tmp_path: Any) -> None:
    """config.json + sharded safetensors + tokenizer.json, as a model folder on disk would be; the
    weights are the "tiny" preset's, so the outputs must equal a preset worker's."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from models.torch_config import PRESETS
    from models.torch_weights import random_model, save_model
    from worker_hooks.engine.torch_backend import expected_outputs

    folder = tmp_path / "tiny-hf"
    save_model(random_model(PRESETS["tiny"], seed=0), folder, shard_bytes=40_000)
    assert len(list(folder.glob("*.safetensors"))) > 1
    vocab = {chr(0x100 + i): i for i in range(256)} | {"<|bos|>": 256, "<|eos|>": 257, "<|pad|>": 258}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|pad|>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.save(str(folder / "tokenizer.json"))
    # the gateway reads the folder's tokenizer; its ids are the ids the model embeds
    from gateway.config import TokenizerSection
    from gateway.server.api.tokenizer import make_tokenizer

    gateway_tok = make_tokenizer(TokenizerSection(kind="hf", path=str(folder / "tokenizer.json")))
    assert gateway_tok.vocab_size == 259 == PRESETS["tiny"].vocab_size
    assert gateway_tok.encode("\u0141\u0100") == [65, 0]

    reqs = [(prompt_of(20 + 9 * i, i), GREEDY if i % 2 else SEEDED, i) for i in range(3)]
    async with workers(spec("hf", torch_model=str(folder))) as (w,):
        outs = await asyncio.gather(
            *(drain(w.engine.submit(req(f"r{i}", p, sp, seed=s))) for i, (p, sp, s) in enumerate(reqs))
        )
    assert [o for o, _ in outs] == expected_outputs(reqs, model="tiny", page_size=PS)


async def test_aborts_while_forwards_run_lose_nothing_and_leak_no_page() -> None:
    """Aborts land on the loop while the step thread runs a forward: the aborted requests end with an
    abort, every other request is exact, and the pool ends with every page free."""
    import random

    from worker_hooks.engine.torch_backend import expected_outputs

    rnd = random.Random(9)
    reqs = [
        (
            prompt_of(rnd.randrange(4, 90), i),
            msgspec.structs.replace(GREEDY, max_new_tokens=rnd.randrange(1, 40)),
            i,
        )
        for i in range(60)
    ]
    truth = expected_outputs(reqs, model="tiny", page_size=PS)
    async with workers(spec("w", max_running_requests=16, chunked_prefill_size=64)) as (w,):
        handles = [w.engine.submit(req(f"r{i}", p, sp, seed=s)) for i, (p, sp, s) in enumerate(reqs)]
        victims = set(rnd.sample(range(len(reqs)), 20))

        async def abort_later() -> None:
            for i in sorted(victims, key=lambda _: rnd.random()):
                await asyncio.sleep(rnd.uniform(0.0, 0.01))
                w.engine.abort(f"r{i}", "client went away")

        results, _ = await asyncio.gather(asyncio.gather(*(collect(h) for h in handles)), abort_later())
        pool = w.engine.pool
        await until(lambda: not w.engine.scheduler.has_work)
        pool.check_integrity()
        assert pool.free_pages == pool.total_pages
    kept = [i for i, (_, _, finish) in enumerate(results) if finish != "abort"]
    assert all(i in victims for i, (_, _, finish) in enumerate(results) if finish == "abort")
    assert [results[i][0] for i in kept] == [truth[i] for i in kept]
    assert len(kept) < len(reqs)  # some aborts did land mid-flight
