"""A request whose gateway went away mid-stream is kept for adoption within its orphan grace: another
gateway's `POST /lumen/adopt` gets the whole output from the first id, exactly what an uninterrupted
stream gives; without a grace, or after it, the request is aborted and cannot be adopted."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from gateway.protocol.generate import SamplingParams, decode_chunk
from models.synthetic import expected_output
from tests.integration.test_engine_server import read_sse, spec, wait_until
from worker_hooks.engine.service import start_worker

PROMPT = list(b"Adopt me, whoever you are.")
PARAMS = {"max_new_tokens": 120, "temperature": 0.7}
SEED = 31337


def body(rid: str, grace_s: float) -> dict[str, Any]:
    return {
        "rid": rid,
        "input_ids": PROMPT,
        "sampling_params": PARAMS,
        "stream": True,
        "lumen": {"seed_base": SEED, "orphan_grace_s": grace_s},
    }


async def read_some_then_leave(http: aiohttp.ClientSession, url: str, rid: str, grace_s: float) -> list[int]:
    """Read the stream until a few ids came, then drop the connection as a crashing gateway does."""
    got: list[int] = []
    resp = await http.post(url + "/generate", json=body(rid, grace_s))
    assert resp.status == 200
    async for line in resp.content:
        if line.startswith(b"data: {"):
            got += decode_chunk(line[6:].strip()).output_ids
            if len(got) >= 10:
                break
    resp.close()
    return got


async def test_an_orphaned_request_is_adopted_with_its_whole_output() -> None:
    want, _ = expected_output(PROMPT, SamplingParams(**PARAMS), seed_base=SEED)
    async with start_worker(spec(time_scale=0.2)) as w, aiohttp.ClientSession() as http:
        first = await read_some_then_leave(http, w.url, "r1", grace_s=30)
        assert first == want[: len(first)]
        await wait_until(lambda: len(w.engine.orphans) == 1)
        async with http.post(w.url + "/lumen/adopt", json={"rid": "r1", "epoch": w.incarnation}) as resp:
            assert resp.status == 200
            chunks, done = await read_sse(resp)
        assert done and [i for c in chunks for i in c.output_ids] == want
        assert chunks[0].output_ids[: len(first)] == first  # the first chunk replays what was sent
        assert chunks[-1].meta_info.finish_reason is not None
        assert w.engine.orphans.adopted_total == 1 and len(w.engine.orphans) == 0
        # adopted once: a second gateway finds nothing
        async with http.post(w.url + "/lumen/adopt", json={"rid": "r1"}) as resp:
            assert resp.status == 404


async def test_a_gateway_can_leave_an_adopted_request_again() -> None:
    want, _ = expected_output(PROMPT, SamplingParams(**PARAMS), seed_base=SEED)
    async with start_worker(spec(time_scale=0.2)) as w, aiohttp.ClientSession() as http:
        await read_some_then_leave(http, w.url, "r2", grace_s=30)
        await wait_until(lambda: len(w.engine.orphans) == 1)
        resp = await http.post(w.url + "/lumen/adopt", json={"rid": "r2"})
        await resp.content.readline()
        resp.close()  # the adopting gateway crashes too
        await wait_until(lambda: len(w.engine.orphans) == 1 and w.engine.orphans.adopted_total == 1)
        async with http.post(w.url + "/lumen/adopt", json={"rid": "r2"}) as again:
            chunks, done = await read_sse(again)
        assert done and [i for c in chunks for i in c.output_ids] == want


async def test_no_grace_or_an_expired_one_aborts_and_a_stale_epoch_is_refused() -> None:
    # slow steps: the request is still running when its 0.3 s grace ends
    async with start_worker(spec(time_scale=3.0)) as w, aiohttp.ClientSession() as http:
        await read_some_then_leave(http, w.url, "r3", grace_s=0)
        await wait_until(lambda: w.engine.aborted_total == 1)
        assert len(w.engine.orphans) == 0
        await read_some_then_leave(http, w.url, "r4", grace_s=0.3)
        await wait_until(lambda: w.engine.orphans.orphaned_total == 1)
        async with http.post(w.url + "/lumen/adopt", json={"rid": "r4", "epoch": w.incarnation + 1}) as resp:
            assert resp.status == 409  # another incarnation's request: refused, still kept
        await wait_until(lambda: w.engine.orphans.expired_total == 1 and w.engine.aborted_total == 2)
        async with http.post(w.url + "/lumen/adopt", json={"rid": "r4"}) as resp:
            assert resp.status == 404
        async with http.post(w.url + "/lumen/adopt", json={"nope": 1}) as resp:
            assert resp.status == 400
        assert not w.engine.scheduler.rids()
        await asyncio.sleep(0)
