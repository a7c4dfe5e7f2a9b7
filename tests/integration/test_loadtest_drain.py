"""The side-by-side load's drain bound: a stream that never ends is cancelled `drain_s` after the last
arrival, counted as an error and named, instead of holding the run (and CI) forever. The gateway is
a fake at the HTTP seam: one request answers, the other is accepted and then never written to."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiohttp import web

from loadtests.faults import FaultSchedule
from loadtests.sidebyside.drive import _drive, _results
from loadtests.sidebyside.workload import Shape

pytestmark = pytest.mark.asyncio


def _event(obj: dict[str, object]) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


async def _completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    if body["max_tokens"] == 5:  # the stuck one: its headers went out, no event ever follows
        await asyncio.Event().wait()
    chunk: dict[str, object] = {
        "id": "cmpl-ok",
        "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
    }
    await resp.write(_event(chunk))
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def _workers(_request: web.Request) -> web.Response:
    return web.json_response([])


async def _sessions(_request: web.Request) -> web.Response:
    return web.json_response({"interrupted": []})


async def test_a_stuck_stream_is_cancelled_at_the_drain_bound_and_named() -> None:
    app = web.Application()
    app.router.add_post("/v1/completions", _completions)
    app.router.add_get("/admin/workers", _workers)
    app.router.add_get("/admin/sessions", _sessions)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    shapes = [Shape(0.0, 8, 4), Shape(0.05, 8, 5)]
    results = _results(shapes, seed=1)
    try:
        t0 = time.monotonic()
        # _drive runs its own event loop work; the fake serves on this one, so drive on a thread
        info = await asyncio.to_thread(
            asyncio.run, _drive([f"http://127.0.0.1:{port}"], shapes, results, FaultSchedule(), 1, 0.2, 0.5)
        )
        took = time.monotonic() - t0
    finally:
        await runner.cleanup()
    assert results[0].ok and results[0].rid == "cmpl-ok"
    assert not results[1].ok and "no answer 0.5 s after the last arrival" in (results[1].error or "")
    assert info["unanswered"] == ["#1 (no id) 0 chunks"]
    assert took < 10.0  # bounded by the drain, not by the client's 600 s timeout
