"""KV checkpointing between in-process workers (DESIGN 4.4): streaming, restore by prefix, drops,
holder reassignment, budgets. No gateway: holder refs are passed by hand in `lumen.checkpoint`."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest

from gateway.core.costmodel import CostModel
from gateway.protocol import control_pb2 as pb
from gateway.protocol.generate import (
    GenerateRequest,
    HolderRef,
    LumenExt,
    SamplingParams,
    decode_chunk,
)
from gateway.protocol.launch import EngineSpec
from gateway.protocol.pagekeys import page_keys
from models.synthetic import expected_output
from tests.fixtures.planes import introduce
from worker_hooks.agent import Agent
from worker_hooks.engine.checkpointing import PageBytes
from worker_hooks.engine.handle import RequestHandle
from worker_hooks.engine.service import Worker, start_worker
from worker_hooks.kv.payload import page_bytes, verify
from worker_hooks.kv.store import CheckpointStore

PS = 16
MODEL = "Qwen3-0.6B"
KV_PER_TOKEN = CostModel.preset(MODEL, "H100-80G").model.kv_bytes_per_token
PAGE_MODELLED = PS * KV_PER_TOKEN


def spec(wid: str, **kw: Any) -> EngineSpec:
    base: dict[str, Any] = {
        "worker_id": wid,
        "control_address": "",
        "model": MODEL,
        "time_scale": 0.01,
        "page_size": PS,
        "ckpt_budget_bytes": 1 << 34,  # modelled: 16 GiB, 16 MiB of real synthetic pages
    }
    return EngineSpec(**(base | kw))


@contextlib.asynccontextmanager
async def cluster(*specs: EngineSpec) -> AsyncIterator[list[Worker]]:
    async with contextlib.AsyncExitStack() as stack:
        workers = [await stack.enter_async_context(start_worker(s)) for s in specs]
        introduce(*workers)  # what the gateway's Members does: their KV planes trust each other
        yield workers


def ref(w: Worker) -> HolderRef:
    return HolderRef(worker_id=w.worker_id, kv_endpoint=w.kv_endpoint)


def req(
    rid: str, prompt: list[int], params: SamplingParams, *holders: Worker, seed: int = 0
) -> GenerateRequest:
    ext = LumenExt(seed_base=seed, checkpoint=[ref(h) for h in holders])
    return GenerateRequest(rid=rid, input_ids=prompt, sampling_params=params, lumen=ext)


def store(w: Worker) -> CheckpointStore:
    s = w.engine.ckpt.store
    assert s is not None
    return s


def prompt_of(n: int, salt: int = 0) -> list[int]:
    return [32 + (i * 7 + salt) % 90 for i in range(n)]


async def until(cond: Callable[[], bool], within: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not cond():
        if loop.time() > deadline:
            raise TimeoutError(f"condition not met within {within} s")
        await asyncio.sleep(0.002)


async def read_until(handle: RequestHandle, n: int) -> list[int]:
    out: list[int] = []
    while len(out) < n:
        e = await handle.next()
        assert e.finish is None, e.finish
        out.extend(e.new_ids)
    return out


async def drain(handle: RequestHandle) -> tuple[list[int], str]:
    out: list[int] = []
    while True:
        e = await handle.next()
        out.extend(e.new_ids)
        if e.finish is not None:
            return out, e.finish.type


async def quiesce(w: Worker, handle: RequestHandle | None = None) -> list[int]:
    """Pause the engine and wait for the step in flight; returns the ids it delivered meanwhile."""
    w.engine.pause()
    steps = -1
    while steps != w.engine.stats().steps_total:
        steps = w.engine.stats().steps_total
        await asyncio.sleep(0.02)
    extra: list[int] = []
    while handle is not None and (e := handle.next_nowait()) is not None:
        extra.extend(e.new_ids)
    return extra


def full_pages(tokens: int) -> int:
    return tokens // PS * PS


# -- streaming ------------------------------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [1, 7, 8, 1835, 94371])
def test_page_bytes_are_the_payload_helpers_bytes(nbytes: int) -> None:
    keys = page_keys(prompt_of(64), PS)
    assert bytes(PageBytes(nbytes).of(keys)) == b"".join(page_bytes(k, nbytes) for k in keys)
    assert bytes(PageBytes(nbytes).of(keys[:1])) == page_bytes(keys[0], nbytes)


async def test_holder_gets_every_full_page_and_end_frees_them() -> None:
    async with cluster(spec("a"), spec("b")) as (a, b):
        prompt, params = prompt_of(50), SamplingParams(max_new_tokens=30, temperature=0.0)
        out, finish = await drain(a.engine.submit(req("r", prompt, params, b)))
        assert (out, finish) == expected_output(prompt, params)
        server = b.engine.ckpt.server
        assert server is not None
        await until(lambda: server.stats.ends == 1)
        # KV exists for every token but the last one emitted: floor((50 + 30 - 1) / 16) pages
        assert server.stats.pages == (50 + 30 - 1) // PS == 4
        sent = a.engine.ckpt.stats().bytes_sent
        assert sent == 4 * PAGE_MODELLED
        # END freed them; the heartbeat deltas say so
        assert (store(b).bytes_used, store(b).stats().pages, b.engine.ckpt.stats().bytes_used) == (0, 0, 0)
        assert b.engine.ckpt.durable() == {}  # held and released between two reports: nothing changed
        store(b).check_integrity()
        assert a.engine.ckpt.stats().streaming == 0


async def test_durable_prefix_is_exactly_the_full_pages_of_the_computed_kv() -> None:
    async with cluster(spec("a"), spec("b")) as (a, b):
        prompt = prompt_of(70)
        h = a.engine.submit(req("r", prompt, SamplingParams(max_new_tokens=10**5), b))
        await read_until(h, 40)
        await quiesce(a, h)
        seq = a.engine.scheduler.get("r")
        assert seq is not None and seq.kv_len == 70 + len(seq.output) - 1
        expect = full_pages(seq.kv_len)
        await until(lambda: store(b).durable_tokens("r") == expect)
        assert b.engine.ckpt.durable() == {"r": expect}
        # the pages are the synthetic KV of exactly those tokens, byte for byte
        for key in page_keys(seq.context(0, expect), PS):
            page = store(b).page(key)
            assert page is not None and verify(key, page)
        s = b.engine.ckpt.stats()
        assert (s.tokens_held, s.bytes_used) == (expect, expect // PS * PAGE_MODELLED)
        a.engine.resume()


# -- restore by prefix --------------------------------------------------------------------------------


async def test_resume_on_the_holder_restores_the_prefix_and_continues_exactly() -> None:
    async with (
        cluster(spec("a"), spec("b"), spec("c")) as (a, b, c),
        aiohttp.ClientSession() as client,
    ):
        prompt = prompt_of(45)
        params = SamplingParams(max_new_tokens=90, temperature=0.8, top_p=0.95)
        truth, _ = expected_output(prompt, params, seed_base=7)
        h = a.engine.submit(req("r-1", prompt, params, b, seed=7))
        emitted = await read_until(h, 25)
        emitted += await quiesce(a, h)
        produced = a.engine.scheduler.get("r-1")
        assert produced is not None
        durable = full_pages(produced.kv_len)
        await until(lambda: store(b).durable_tokens("r-1") == durable)
        a.engine.abort("r-1", "worker failed")  # not a drop: the holder keeps the pages
        a.engine.resume()

        # the gateway resumes on the holder with prompt + what the client got, and a new holder c
        resumed = prompt + emitted
        expect_restored = min(durable, full_pages(len(resumed) - 1))
        body = {
            "rid": "r-2",
            "input_ids": resumed,
            "sampling_params": {"max_new_tokens": 90 - len(emitted), "temperature": 0.8, "top_p": 0.95},
            "lumen": {"seed_base": 7, "epoch": b.incarnation, "checkpoint": [{"worker_id": "c", "kv_endpoint": c.kv_endpoint}]},
        }  # fmt: skip
        async with client.post(b.url + "/generate", json=body) as resp:
            assert resp.status == 200
            chunks = [
                decode_chunk(line.removeprefix(b"data: ").strip())
                async for line in resp.content
                if line.strip() and b"[DONE]" not in line
            ]
        assert 0 < expect_restored < len(resumed)
        assert all(ch.meta_info.restored_tokens == expect_restored for ch in chunks)
        assert all(ch.meta_info.cached_tokens == expect_restored for ch in chunks)
        assert emitted + [t for ch in chunks for t in ch.output_ids] == truth
        cs = b.engine.ckpt.stats()
        assert (cs.restores, cs.restored_tokens) == (1, expect_restored)
        # the resumed request checkpoints afresh on c, restored pages included
        c_server = c.engine.ckpt.server
        assert c_server is not None
        await until(lambda: c_server.stats.ends == 1)
        assert c_server.stats.pages == (45 + 90 - 1) // PS


async def test_restore_is_cheaper_than_recompute_in_the_modelled_step() -> None:
    big = {"model": "Qwen3-8B", "time_scale": 0.0}
    async with cluster(spec("a", **big), spec("b", **big), spec("c", **big)) as (a, b, c):
        prompt = prompt_of(1000)
        h = a.engine.submit(req("r-1", prompt, SamplingParams(max_new_tokens=10**5), b))
        await until(lambda: store(b).durable_tokens("r-1") >= 1000)
        a.engine.abort("r-1", "worker failed")
        await drain(h)

        params = SamplingParams(max_new_tokens=1)
        times = {}
        for w in (b, c):  # b restores 992 tokens from its store, c prefills all 1000
            before = w.engine.stats().modelled_s_total
            out, _ = await drain(w.engine.submit(req("r-2", prompt, params)))
            assert out == expected_output(prompt, params)[0]
            times[w.worker_id] = w.engine.stats().modelled_s_total - before
        assert b.engine.ckpt.stats().restored_tokens == 992 and c.engine.ckpt.stats().restores == 0
        cost = b.engine.cost
        assert times["b"] == pytest.approx(cost.restore_time(992) + cost.prefill_time(8, 992))
        assert times["c"] == pytest.approx(cost.prefill_time(1000))
        assert times["b"] < 0.7 * times["c"]


async def test_no_restore_without_a_matching_prefix_or_below_one_page() -> None:
    async with cluster(spec("a"), spec("b")) as (a, b):
        prompt = prompt_of(40)
        h = a.engine.submit(req("r", prompt, SamplingParams(max_new_tokens=10**5), b))
        await until(lambda: store(b).durable_tokens("r") >= 32)
        a.engine.abort("r", "gone")
        await drain(h)
        for rid, ids in (("x", prompt_of(40, salt=1)), ("y", prompt[:16]), ("z", prompt[:17])):
            h2 = b.engine.submit(req(rid, ids, SamplingParams(max_new_tokens=2)))
            assert h2.restored_tokens == (16 if rid == "z" else 0)  # the last token is never restored
            await drain(h2)


# -- drops, aborts and resets -------------------------------------------------------------------------


async def test_drop_checkpoint_through_the_agent_handler() -> None:
    async with cluster(spec("a"), spec("b")) as (a, b):
        ha = a.engine.submit(req("held", prompt_of(40), SamplingParams(max_new_tokens=10**5), b))
        hb = a.engine.submit(req("live", prompt_of(40, 3), SamplingParams(max_new_tokens=10**5), b))
        await until(lambda: min(store(b).durable_tokens(r) for r in ("held", "live")) >= 48)
        a.engine.abort("held", "worker failed")  # the gateway will resume from these pages
        await drain(ha)
        b.engine.ckpt.durable()  # reported

        # holder side: the gateway's DropCheckpoint frees what b holds
        Agent(b.spec, b.engine, b.url).handle(
            pb.GatewayMessage(drop_checkpoint=pb.DropCheckpoint(rids=["held"]))
        )
        assert store(b).durable_tokens("held") == 0 and b.engine.ckpt.durable() == {"held": 0}

        # serving side: a drops its stream and its holders' pages of the request it still runs
        Agent(a.spec, a.engine, a.url).handle(
            pb.GatewayMessage(drop_checkpoint=pb.DropCheckpoint(rids=["live"]))
        )
        assert not a.engine.ckpt.streaming("live")
        await until(lambda: store(b).durable_tokens("live") == 0)
        await read_until(hb, 40)  # the request itself runs on, without a checkpoint
        assert store(b).durable_tokens("live") == 0 and store(b).bytes_used == 0
        a.engine.abort("live")


async def test_abort_request_drops_the_checkpoint_but_a_disconnect_keeps_it() -> None:
    async with cluster(spec("a"), spec("b")) as (a, b), aiohttp.ClientSession() as client:
        for rid in ("kept", "dropped"):
            a.engine.submit(req(rid, prompt_of(40), SamplingParams(max_new_tokens=10**5), b))
        await until(lambda: min(store(b).durable_tokens(r) for r in ("kept", "dropped")) >= 48)
        a.engine.abort("kept", "client disconnected")
        async with client.post(a.url + "/abort_request", json={"rid": "dropped"}) as r:
            assert (await r.json())["aborted"] == ["dropped"]
        await until(lambda: store(b).durable_tokens("dropped") == 0)
        # a's link to b sent one control message, that DROP: the disconnect (before it) sent none
        sender = a.engine.ckpt.sender
        assert sender is not None and sender.stats()[b.kv_endpoint].controls == 1
        assert store(b).durable_tokens("kept") >= 48


async def test_incarnation_reset_keeps_held_pages_and_streams_as_the_new_incarnation() -> None:
    async with cluster(spec("a"), spec("b")) as (a, b):
        a.engine.submit(req("old", prompt_of(40), SamplingParams(max_new_tokens=10**5), b))
        b.engine.submit(req("held-on-a", prompt_of(40, 5), SamplingParams(max_new_tokens=10**5), a))
        await until(
            lambda: store(b).durable_tokens("old") >= 48 and store(a).durable_tokens("held-on-a") >= 48
        )
        old_sender = a.engine.ckpt.sender
        new = a.engine.reset_incarnation()
        assert a.engine.ckpt.sender is not old_sender and a.engine.ckpt.sender is not None
        assert a.engine.ckpt.sender.incarnation == new
        introduce(a, b)  # the gateway's Members after a re-attached: b takes pages of a's new incarnation
        held = store(a).durable_tokens("held-on-a")
        assert held >= 48  # a's store keeps other workers' pages across its own reset
        h = a.engine.submit(req("new", prompt_of(40, 9), SamplingParams(max_new_tokens=30), b))
        await drain(h)
        server = b.engine.ckpt.server
        assert server is not None
        await until(lambda: server.stats.ends == 1)
        assert store(b).durable_tokens("old") >= 48  # the fenced request's pages stay for a resume
        b.engine.abort("held-on-a")


# -- holder reassignment ------------------------------------------------------------------------------


async def test_assign_holder_resends_every_page_to_the_new_holder() -> None:
    async with cluster(spec("a"), spec("b"), spec("c")) as (a, b, c):
        h = a.engine.submit(req("r", prompt_of(60), SamplingParams(max_new_tokens=10**5), b))
        await read_until(h, 30)
        await quiesce(a, h)
        seq = a.engine.scheduler.get("r")
        assert seq is not None
        expect = full_pages(seq.kv_len)
        await until(lambda: store(b).durable_tokens("r") == expect)

        agent = Agent(a.spec, a.engine, a.url)
        both = [pb.HolderTarget(worker_id=w.worker_id, kv_endpoint=w.kv_endpoint) for w in (b, c)]
        agent.handle(pb.GatewayMessage(assign_holder=pb.AssignHolder(rid="r", holders=both)))
        await until(lambda: store(c).durable_tokens("r") == expect)
        assert store(c).chain("r") is not None
        assert (
            store(b).stats().deduped_pages == 0
            and a.engine.ckpt.stats().bytes_sent == 2 * (expect // PS) * PAGE_MODELLED
        )

        # b died: the gateway names c alone; b gets nothing more, c keeps up
        agent.handle(pb.GatewayMessage(assign_holder=pb.AssignHolder(rid="r", holders=both[1:])))
        a.engine.resume()
        await read_until(h, 40)
        await quiesce(a, h)
        now = full_pages(seq.kv_len)
        assert now > expect
        await until(lambda: store(c).durable_tokens("r") == now)
        assert store(b).durable_tokens("r") == expect
        # a request that is not running here is ignored
        agent.handle(pb.GatewayMessage(assign_holder=pb.AssignHolder(rid="nope", holders=both)))
        assert not a.engine.ckpt.streaming("nope")
        a.engine.resume()


# -- budgets --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("eviction", ["shortest_prefix_first", "lru", "none"])
async def test_a_tiny_budget_is_never_exceeded(eviction: str) -> None:
    tiny = spec("b", ckpt_budget_bytes=5 * PAGE_MODELLED, ckpt_eviction=eviction)
    async with cluster(spec("a", max_running_requests=8, time_scale=0.1), tiny) as (a, b):
        handles = [
            a.engine.submit(req(f"r{i}", prompt_of(20 + 9 * i, i), SamplingParams(max_new_tokens=60), b))
            for i in range(8)
        ]
        done = asyncio.gather(*(drain(h) for h in handles))
        while not done.done():
            store(b).check_integrity()
            s = b.engine.ckpt.stats()
            assert s.bytes_used <= 5 * PAGE_MODELLED and store(b).bytes_used <= store(b).budget_bytes
            await asyncio.sleep(0.001)
        await done
        server = b.engine.ckpt.server
        assert server is not None
        await until(lambda: server.stats.ends == 8)
        st = store(b).stats()
        assert server.stats.pages >= 5 and st.refused_pages + st.evicted_pages > 0
        assert (st.evicted_pages > 0) == (eviction != "none")


async def test_a_worker_without_budget_runs_no_store() -> None:
    async with cluster(spec("z", ckpt_budget_bytes=0)) as (z,), aiohttp.ClientSession() as client:
        assert (z.kv_endpoint, z.engine.ckpt.store, z.engine.ckpt.stats().budget_bytes) == ("", None, 0)
        h = z.engine.submit(req("r", prompt_of(40), SamplingParams(max_new_tokens=3)))
        assert h.restored_tokens == 0
        await drain(h)
        bad = {
            "rid": "b",
            "input_ids": [40],
            "lumen": {"checkpoint": [{"worker_id": "x", "kv_endpoint": "nowhere"}]},
        }
        async with client.post(z.url + "/generate", json=bad) as r:
            assert r.status == 400 and "kv_endpoint" in (await r.json())["error"]["message"]


# -- cost on the step loop ----------------------------------------------------------------------------


async def test_streaming_adds_little_to_the_step_loop() -> None:
    """Mean wall time of the step loop per step (sleeps excluded), streaming on vs off."""
    results: dict[str, list[float]] = {"off": [], "on": []}
    async with cluster(spec("a", time_scale=0.0), spec("b")) as (a, b):
        for rnd in range(3):
            for mode in ("off", "on"):
                s0 = a.engine.stats()
                holders = (b,) if mode == "on" else ()
                handles = [
                    a.engine.submit(req(f"{mode}{rnd}-{i}", prompt_of(64, i), SamplingParams(max_new_tokens=200), *holders))
                    for i in range(16)
                ]  # fmt: skip
                await asyncio.gather(*(drain(h) for h in handles))
                s1 = a.engine.stats()
                results[mode].append((s1.busy_s_total - s0.busy_s_total) / (s1.steps_total - s0.steps_total))
        server = b.engine.ckpt.server
        assert server is not None
        await until(lambda: server.stats.ends == 3 * 16)
    off, on = (statistics.median(results[m]) * 1e6 for m in ("off", "on"))
    print(
        f"\nstep loop, 16 requests decoding: off {off:.1f} us/step, on {on:.1f} us/step ({on / off - 1:+.1%})"
    )
    assert on < 5 * off + 200  # generous: a sanity bound, not a benchmark
