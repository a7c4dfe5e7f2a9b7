"""A resumed attempt that never sends its first chunk: the client's stream has started, so the wait
is bounded by `recovery.stall_timeout_s` (the bound between two chunks of a started stream), not by
`recovery.first_token_timeout_s` (issue 28: seen once in `test_loadtest_cli[short-trace]`, a request
moved to w3 after w0's kill with 9 chunks delivered got nothing more for the first-token bound).

Two fake Lumen workers over real sockets in front of the live `SessionManager` and `LoadMonitor`: w0
streams a few tokens and then is declared failed; w1 answers the resumed attempt's headers and then
sends nothing."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from gateway.config import RecoverySection
from gateway.core.losses import Loss
from gateway.core.types import LoadParams
from gateway.protocol import control_pb2 as pb
from gateway.protocol.generate import GenerateChunk, MetaInfo, encode_sse_chunk
from gateway.protocol.versions import CONTROL_PROTOCOL_VERSION
from gateway.server.api.errors import UpstreamFailed
from gateway.server.api.jobs import GenerateJob, Sampling
from gateway.server.metrics import GatewayMetrics
from gateway.server.sessions import SessionManager
from gateway.server.workers.monitor import LoadMonitor


class FakeWorker:
    """`/generate`: `tokens` chunks, then silence (headers sent, no chunk more) until the test ends."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.bodies: list[dict[str, object]] = []
        self.sent = asyncio.Event()  # its chunks are out
        self.opened = asyncio.Event()  # a stream's headers are out
        self._end = asyncio.Event()
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def generate(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.opened.set()
        for i in range(self.tokens):
            await resp.write(encode_sse_chunk(GenerateChunk([100 + i], MetaInfo("x", 3, i + 1))))
        self.sent.set()
        await self._end.wait()
        return resp

    async def abort(self, request: web.Request) -> web.Response:
        return web.json_response({})

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[FakeWorker]:
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/abort_request", self.abort)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        try:
            yield self
        finally:
            self._end.set()
            await self._runner.cleanup()


def hello(wid: str, url: str) -> pb.Hello:
    return pb.Hello(
        protocol_version=CONTROL_PROTOCOL_VERSION,
        worker_id=wid,
        incarnation=1,
        http_url=url,
        kv_capacity_tokens=100_000,
        phase=pb.SERVING,
    )


async def test_a_resumed_attempt_without_a_first_chunk_is_a_stall() -> None:
    first_token_s, stall_s = 60.0, 0.3
    async with (
        FakeWorker(tokens=3).serving() as w0,
        FakeWorker(tokens=0).serving() as w1,
        aiohttp.ClientSession() as http,
    ):
        monitor = LoadMonitor(
            clock=asyncio.get_running_loop().time, heartbeat_interval_s=1.0, heartbeat_misses=3
        )
        rec0 = monitor.attach(hello("w0", w0.url))
        monitor.attach(hello("w1", w1.url))
        monitor.workers["w1"].inflight = 5  # the router sends the first attempt to w0
        metrics = GatewayMetrics()
        sessions = SessionManager(
            monitor=monitor,
            http=http,
            recovery=RecoverySection(
                mode="stop_restart",
                first_token_timeout_s=first_token_s,
                stall_timeout_s=stall_s,
                max_attempts=2,
                no_worker_wait_s=0.0,
            ),
            load_params=LoadParams(),
            metrics=metrics,
        )
        job = GenerateJob("r1", (1, 2, 3), Sampling(max_new_tokens=20, temperature=0.0))
        got: list[int] = []

        async def run() -> None:
            async for delta in sessions.generate(job):
                got.extend(delta.ids)
                if len(got) == 3:
                    monitor.detach(rec0, "killed by the test")  # w0 dies after 3 tokens

        with pytest.raises(UpstreamFailed) as err:
            async with asyncio.timeout(10 * stall_s + 5):  # far below first_token_timeout_s
                await run()
        await asyncio.gather(*sessions._aborts._tasks)  # the abort of the stalled attempt, sent
        assert got == [100, 101, 102]
        assert w1.opened.is_set() and len(w1.bodies[0]["input_ids"]) == 6  # type: ignore[arg-type]
        assert "stall" in str(err.value)
        # the interruptions carry their kind (gateway/core/losses.py): w0's death, then w1's stall
        kinds = [it.kind for it in sessions.recent_interrupted[-1].interruptions]
        assert kinds == [Loss.KILLED, Loss.STALLED]
