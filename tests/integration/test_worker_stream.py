"""The gateway's worker-stream client against a real HTTP server on loopback: chunks received together
come out merged (ids and logprob rows in order), an error or abort after good chunks comes after them,
the per-stream timer catches a stall and an interruption, and a finished stream's connection is reused."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web

from gateway.protocol.generate import AbortRequest, GenerateChunk
from gateway.server.workers.client import WorkerLost, WorkerStream

Script = Callable[[web.StreamResponse], Awaitable[None]]


def chunk(ids: list[int], done: int, fin: str = "", lps: bool = False) -> bytes:
    meta = f'"id":"r","prompt_tokens":3,"completion_tokens":{done},"cached_tokens":2'
    if fin:
        meta += f',"finish_reason":{{"type":"{fin}"}}'
    if lps:
        meta += ',"output_token_logprobs":[' + ",".join(f"[-0.5,{i},null]" for i in ids) + "]"
    return b'data: {"output_ids":%s,"meta_info":{%s}}\n\n' % (
        str(ids).replace(" ", "").encode(),
        meta.encode(),
    )


@asynccontextmanager
async def server(script: Script) -> AsyncIterator[tuple[str, list[int]]]:
    """A worker stand-in whose /generate streams what `script` writes; yields its URL and the client
    ports of the requests it got (the same port twice: one connection reused)."""
    ports: list[int] = []

    async def generate(request: web.Request) -> web.StreamResponse:
        await request.read()
        peer = request.transport.get_extra_info("peername") if request.transport else None
        ports.append(peer[1] if peer else 0)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await script(resp)
        return resp

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", ports
    finally:
        await runner.cleanup()


def stream(http: aiohttp.ClientSession, url: str, stall_s: float = 5.0) -> WorkerStream:
    return WorkerStream(
        http, url, AbortRequest(rid="r"), first_chunk_timeout_s=5.0, stall_timeout_s=stall_s, keep_alive=True
    )


async def read_all(s: WorkerStream) -> list[GenerateChunk]:
    out = []
    while (c := await s.next_chunk()) is not None:
        out.append(c)
    return out


async def test_chunks_received_together_are_merged_and_the_connection_is_reused() -> None:
    async def script(resp: web.StreamResponse) -> None:
        await resp.write(chunk([5], 1, lps=True))  # alone
        await resp.write(chunk([6], 2, lps=True) + chunk([7, 8], 4, lps=True) + chunk([9], 5, "length", True))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()

    async with server(script) as (url, ports), aiohttp.ClientSession() as http:
        for _ in range(2):
            async with stream(http, url) as s:
                got = await read_all(s)
            ids = [i for c in got for i in c.output_ids]
            assert ids == [5, 6, 7, 8, 9]
            assert len(got) <= 4  # the three chunks of one write are read together
            rows = [r[1] for c in got for r in c.meta_info.output_token_logprobs]
            assert rows == ids
            assert got[-1].meta_info.finish_reason is not None
            assert got[-1].meta_info.finish_reason.type == "length"
            assert all(c.meta_info.cached_tokens == 2 for c in got)
        assert len(ports) == 2 and ports[0] == ports[1]  # the finished stream's connection was pooled


async def test_an_error_or_abort_after_good_chunks_comes_after_them() -> None:
    for last, reason in (
        (b'data: {"error": {"message": "engine gave up", "code": 500}}\n\n', "engine gave up"),
        (chunk([], 2, "abort"), None),
    ):

        async def script(resp: web.StreamResponse, last: bytes = last) -> None:
            await resp.write(chunk([1], 1) + chunk([2], 2) + last)

        async with server(script) as (url, _), aiohttp.ClientSession() as http, stream(http, url) as s:
            first = await s.next_chunk()
            assert first is not None and first.output_ids == [1, 2]
            if reason is not None:
                with pytest.raises(WorkerLost, match=reason) as lost:
                    await s.next_chunk()
                assert lost.value.worker_error
            else:
                abort = await s.next_chunk()
                assert abort is not None and abort.output_ids == []
                assert abort.meta_info.finish_reason is not None
                assert abort.meta_info.finish_reason.type == "abort"


async def test_a_stall_and_an_interruption_end_the_wait() -> None:
    release = asyncio.Event()

    async def script(resp: web.StreamResponse) -> None:
        await resp.write(chunk([1], 1))
        await release.wait()  # then nothing: a stalled engine

    async with server(script) as (url, _), aiohttp.ClientSession() as http:
        try:
            async with stream(http, url, stall_s=0.2) as s:
                assert (await s.next_chunk()) is not None
                with pytest.raises(WorkerLost, match="stall"):
                    await s.next_chunk()
            async with stream(http, url) as s:
                assert (await s.next_chunk()) is not None
                waiting = asyncio.get_running_loop().create_task(s.next_chunk())
                await asyncio.sleep(0)  # let it start waiting
                s.interrupt("worker w0 failed")
                with pytest.raises(WorkerLost, match="worker w0 failed"):
                    await waiting
        finally:
            release.set()  # the stand-in's handlers end before the server shuts down


async def test_an_outer_cancellation_is_not_taken_for_a_stall() -> None:
    release = asyncio.Event()

    async def script(resp: web.StreamResponse) -> None:
        await resp.write(chunk([1], 1))
        await release.wait()

    async with server(script) as (url, _), aiohttp.ClientSession() as http:
        try:
            async with stream(http, url) as s:
                assert (await s.next_chunk()) is not None
                waiting = asyncio.get_running_loop().create_task(s.next_chunk())
                await asyncio.sleep(0)
                waiting.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await waiting
        finally:
            release.set()
