"""A worker's 4xx is the client's 4xx or a retry elsewhere, never a bare 502 (issue 27).

- a request the server refuses for its content (a prompt past an SGLang stand-in's context length:
  SGLang's own validation, answered as a 400 body or, streamed, as an error chunk before any output)
  reaches the client as a 400 with an OpenAI error body, on every route and in both forms;
- a server refusing on its own account (403: its credentials) is not the client's fault: the request
  is served by another server;
- in draft assist, a drafter whose ids the target cannot take (another vocabulary: the target refuses
  the verification call with a 400) costs nothing visible: the stream goes on plainly, exact, and that
  drafter is not paired with the target again.

Each failed before the fix: the first two answered 502 (worker_rejected, or "gave up after N worker
attempts" for the streamed error chunks), the third 502 with no retry (the finding of issue 27).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from gateway.config import load_config
from gateway.protocol.draft import DraftReply, DraftTokens, decode_request, encode_reply
from gateway.protocol.planes import PlaneAuth, curve_server
from gateway.server.app import Gateway
from tests.fixtures.sglang_standin import SGLangStandIn, expected_ids, start_standin
from tests.fixtures.sglang_standin_engine import RequestError
from tests.integration.test_sglang_draft_assist import restarting_drafter
from tests.integration.test_sglang_gateway import sglang_cluster, stream_ids, wait_until

CONTEXT = 64


@contextlib.asynccontextmanager
async def gateway_over(
    urls: list[str], **overrides: Any
) -> AsyncIterator[tuple[Gateway, aiohttp.ClientSession]]:
    cfg = load_config(
        overrides={
            "gateway.port": 0,
            "gateway.control_port": 0,
            "timeouts.control_stop_grace_s": 0.05,
            "recovery.mode": "stop_restart",
            "sglang.poll_interval_ms": 50,
            "sglang.workers": [{"url": u, "id": f"sg{i}"} for i, u in enumerate(urls)],
            **overrides,
        }
    )
    gw = Gateway(cfg)
    await gw.start()
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{gw.http_port}") as http:
            await wait_until(lambda: gw.monitor.healthy_count() == len(urls), 10.0)
            yield gw, http
    finally:
        await gw.stop()


@contextlib.asynccontextmanager
async def standins(n: int, **kw: Any) -> AsyncIterator[list[SGLangStandIn]]:
    servers = [await start_standin(**kw) for _ in range(n)]
    try:
        yield servers
    finally:
        for s in servers:
            await s.stop()


LONG = list(range(40, 40 + CONTEXT + 10))  # past the stand-ins' context length


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["/v1/completions", "/generate"])
async def test_a_request_the_server_refuses_is_the_clients_400(route: str, stream: bool) -> None:
    async with (
        standins(2, context_length=CONTEXT) as servers,
        gateway_over([s.url for s in servers]) as (gw, http),
    ):
        if route == "/generate":
            body: dict[str, Any] = {
                "input_ids": LONG,
                "sampling_params": {"max_new_tokens": 4},
                "stream": stream,
            }
        else:
            body = {"prompt": LONG, "max_tokens": 4, "stream": stream}
        async with http.post(route, json=body) as resp:
            status, doc = resp.status, json.loads(await resp.read())
        assert status == 400, doc
        err = doc["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == "worker_rejected", err
        assert "context length" in err["message"] and "param" in err
        # refused by the first server it reached: not tried on the other one
        assert sum(len(s.refused) for s in servers) == 1
        text = gw.metrics.render().decode()
        assert 'lumen_worker_refusals_total{outcome="client_error",status="400"} 1.0' in text


@contextlib.asynccontextmanager
async def refusing_server(status: int) -> AsyncIterator[tuple[str, dict[str, int]]]:
    """A server that looks healthy to the poller and refuses every /generate with `status` (on its
    own account: a 403 says the gateway's credentials are not taken here)."""
    hits = {"generate": 0}

    async def ready(_: web.Request) -> web.Response:
        return web.Response(status=200)

    async def loads(_: web.Request) -> web.Response:
        return web.json_response(
            {"loads": [{"dp_rank": 0, "max_total_num_tokens": 4096, "max_running_requests": 8}]}
        )

    async def generate(_: web.Request) -> web.Response:
        hits["generate"] += 1
        return web.json_response({"error": {"message": "forbidden: bad token"}}, status=status)

    app = web.Application()
    app.router.add_get("/ready", ready)
    app.router.add_get("/v1/loads", loads)
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", hits
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("status", [403, 404, 429])
async def test_a_server_refusing_on_its_own_account_is_retried_elsewhere(status: int) -> None:
    async with (
        refusing_server(status) as (bad_url, hits),
        standins(1) as servers,
        gateway_over([bad_url, servers[0].url]) as (gw, http),
    ):
        prompts = [list(b"request %d" % i) for i in range(6)]
        got = await asyncio.gather(*(stream_ids(http, p, False, 16) for p in prompts))
        assert got == [expected_ids(p, 16, 0.0) for p in prompts]
        assert hits["generate"] >= 1  # the refusing server was tried, and its refusals were retried
        text = gw.metrics.render().decode()
        assert f'lumen_worker_refusals_total{{outcome="retried",status="{status}"}}' in text


@contextlib.asynccontextmanager
async def foreign_drafter() -> AsyncIterator[tuple[str, dict[str, int], str]]:
    """A drafter of another vocabulary: every id it proposes is past the target's."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    auth = PlaneAuth.generate()
    curve_server(sock, auth, "lumen.draft")
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    stats = {"rounds": 0}

    async def serve() -> None:
        while True:
            peer, buf = await sock.recv_multipart()
            req = decode_request(buf)
            drafts = [
                DraftTokens(rid=item.rid, tokens=[100_000 + i for i in range(item.k)]) for item in req.batch
            ]
            stats["rounds"] += 1
            await sock.send_multipart([peer, encode_reply(DraftReply(round=req.round, drafts=drafts))])

    task = asyncio.create_task(serve())
    try:
        yield f"tcp://127.0.0.1:{port}", stats, auth.keys.public
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        sock.close(0)
        ctx.term()


def refuse_foreign_ids(server: SGLangStandIn) -> list[str]:
    """Make the stand-in refuse input ids past its vocabulary with a 400, as a target of another
    vocabulary would answer the drafts (the stand-in itself does not check them)."""
    submit = server.engine.submit
    vocab = server.engine.cfg.vocab.vocab_size
    refused: list[str] = []

    def checked(req: Any, **kw: Any) -> Any:
        bad = [t for t in req.input_ids if t >= vocab]
        if bad:
            refused.append(f"{len(bad)} ids past the vocabulary")
            raise RequestError(f"input id {bad[0]} is out of the vocabulary [0, {vocab})")
        return submit(req, **kw)

    server.engine.submit = checked  # type: ignore[method-assign]
    return refused


async def test_drafts_the_target_refuses_leave_the_stream_plain_and_exact() -> None:
    async with (
        sglang_cluster(n=1, **{"draft.assist_gate": False}) as (gw, servers, http),
        foreign_drafter() as (endpoint, stats, key),
    ):
        refused = refuse_foreign_ids(servers[0])
        beat = await restarting_drafter(gw, endpoint, key)
        try:
            load = [
                asyncio.create_task(stream_ids(http, list(b"background %d" % i), False, 400))
                for i in range(3)
            ]
            await wait_until(lambda: gw.assist is not None and gw.assist.pairs == {"d0": "sg0"}, 10.0)
            prompts = [list(b"assisted request %d" % i) for i in range(3)]
            first = await stream_ids(http, prompts[0], False)
            rest = await asyncio.gather(*(stream_ids(http, p, False) for p in prompts[1:]))
            for task in load:
                task.cancel()
            await asyncio.gather(*load, return_exceptions=True)
        finally:
            beat.cancel()
        for p, ids in zip(prompts, [first, *rest], strict=True):
            assert ids == expected_ids(p, 48, 0.0)
        assert stats["rounds"] >= 1 and refused  # drafts were proposed and the target refused them
        # one refusal: the pair is dropped after the stream that met it, later streams go plain
        assert len(refused) == 1
        assert gw.verifier is not None and gw.verifier.for_target("sg0") is None
        assert 'lumen_gateway_draft_refusals_total{target="sg0"} 1.0' in gw.metrics.render().decode()
