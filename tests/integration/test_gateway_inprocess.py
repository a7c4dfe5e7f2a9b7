"""The gateway against real in-process workers: one event loop, real sockets, real gRPC and HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from gateway.config import load_config
from gateway.protocol.generate import SamplingParams
from gateway.protocol.launch import EngineSpec
from gateway.protocol.streamid import RESUMABLE_HEADERS
from gateway.server.app import Gateway
from models.synthetic import expected_output
from worker_hooks.engine.service import start_worker

MODEL = "lumen-synthetic"


@contextlib.asynccontextmanager
async def cluster(
    n: int = 2, worker: dict[str, Any] | None = None, **overrides: Any
) -> AsyncIterator[tuple[Gateway, list[Any], aiohttp.ClientSession]]:
    cfg = load_config(
        overrides={
            "gateway.port": 0,
            "gateway.control_port": 0,
            "timeouts.control_stop_grace_s": 0.05,  # stop() cancels the workers' streams at once
            "recovery.mode": "stop_restart",
            "limits.max_prompt_tokens": 2048,
            "health.heartbeat_interval_ms": 50,
            "health.heartbeat_misses": 6,
            **overrides,
        }
    )
    gw = Gateway(cfg)
    await gw.start()
    async with contextlib.AsyncExitStack() as stack:
        workers = []
        for i in range(n):
            spec = EngineSpec(
                worker_id=f"w{i}",
                control_address=f"127.0.0.1:{gw.control_port}",
                control_token=gw.config.gateway.control_token,
                model="Qwen3-0.6B",
                time_scale=0.2,
                heartbeat_interval_ms=50,
                **(worker or {}),
            )
            workers.append(await stack.enter_async_context(start_worker(spec)))
        for _ in range(200):
            if gw.monitor.healthy_count() == n:
                break
            await asyncio.sleep(0.02)
        # Lumen's own clients ask for resumable streams (`id:` lines; gateway/protocol/streamid.py)
        http = await stack.enter_async_context(
            aiohttp.ClientSession(f"http://127.0.0.1:{gw.http_port}", headers=RESUMABLE_HEADERS)
        )
        try:
            yield gw, workers, http
        finally:
            await gw.stop()


def expected_bytes(prompt: list[int], n: int, temperature: float = 0.0, seed: int = 0) -> bytes:
    sp = SamplingParams(max_new_tokens=n, temperature=temperature, stop_token_ids=[257])
    ids, _ = expected_output(prompt, sp, seed)
    return bytes(ids)


async def sse(resp: aiohttp.ClientResponse) -> list[dict[str, Any]]:
    out = []
    async for raw in resp.content:
        line = raw.strip()
        if line.startswith(b"data:") and line != b"data: [DONE]":
            out.append(json.loads(line[5:]))
    return out


async def stream_text(http: aiohttp.ClientSession, prompt: list[int], n: int, got: list[str]) -> int:
    """One greedy streaming completion, its text appended to `got` as it comes; the HTTP status."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
    async with http.post("/v1/completions", json=body) as r:
        for c in await sse(r):
            got.extend(ch.get("text", "") for ch in c.get("choices", []))
        return r.status


async def streaming_session(gw: Gateway) -> Any:
    """The gateway's one live session, once it has streamed 10 tokens."""
    assert gw.sessions is not None
    while not any(len(s.emitted) >= 10 for s in gw.sessions.live.values()):
        await asyncio.sleep(0.01)
    return next(iter(gw.sessions.live.values()))


async def test_completions_stream_and_not_are_exact() -> None:
    async with cluster() as (_gw, _ws, http):
        prompt = list(b"The quick brown fox")
        want = expected_bytes(prompt, 24).decode()
        async with http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0},
        ) as r:
            body = await r.json()
            assert r.status == 200, body
        assert body["choices"][0]["text"] == want
        assert body["usage"] == {**body["usage"], "prompt_tokens": len(prompt), "completion_tokens": 24}
        async with http.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": 24,
                "temperature": 0.7,
                "seed": 42,
                "stream": True,
            },
        ) as r:
            chunks = await sse(r)
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert text == expected_bytes(prompt, 24, 0.7, 42).decode()


async def test_chat_stream_and_native_generate() -> None:
    async with cluster() as (_gw, _ws, http):
        msgs = [{"role": "user", "content": "hello"}]
        async with http.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 10, "stream": True}
        ) as r:
            assert r.status == 200
            chunks = await sse(r)
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert len(content) == 10
        async with http.post(
            "/generate",
            json={"input_ids": [72, 105], "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
        ) as r:
            body = await r.json()
        assert body["output_ids"] == list(expected_bytes([72, 105], 8))
        assert body["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        ({"model": "nope", "prompt": "x"}, 404, None),
        ({"model": MODEL, "prompt": ""}, 400, "prompt"),
        ({"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x" * 3000}, 400, None),
        ({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ],
)
async def test_validation_errors_through_the_full_gateway(body: Any, status: int, param: str | None) -> None:
    async with cluster(1) as (_gw, _ws, http):
        kw = {"data": body} if isinstance(body, bytes) else {"json": body}
        async with http.post("/v1/completions", **kw) as r:
            assert r.status == status
            err = (await r.json())["error"]
        assert err["message"] and err["type"]
        if param:
            assert err.get("param") == param


async def test_health_admin_metrics() -> None:
    async with cluster(2) as (gw, ws, http):
        async with http.get("/health") as r:
            assert (await r.json())["healthy_workers"] == 2
        async with http.get("/admin/workers") as r:
            assert r.status == 401  # the admin API always needs its key (a generated one here)
        admin = {"Authorization": f"Bearer {gw.config.gateway.admin_api_keys[0]}"}
        async with http.get("/admin/workers", headers=admin) as r:
            listed = await r.json()
        assert [(w["id"], w["state"], w["incarnation"]) for w in listed] == [
            (w.worker_id, "HEALTHY", w.incarnation) for w in ws
        ]
        async with http.post("/admin/workers/w0/kill", headers=admin) as r:
            assert r.status == 400  # no fault injection outside a test cluster
        async with http.get("/metrics") as r:
            text = await r.text()
        assert 'lumen_workers{state="HEALTHY"} 2.0' in text


async def test_worker_shutdown_mid_stream_resumes_on_the_other_worker() -> None:
    async with cluster(2) as (gw, ws, http):
        prompt = list(b"resume me please")
        want = expected_bytes(prompt, 200).decode()
        got: list[str] = []
        task = asyncio.create_task(stream_text(http, prompt, 200, got))
        session = await streaming_session(gw)
        victim = next(w for w in ws if w.worker_id == session.worker_id)
        await victim.engine.stop()  # its streams end with an abort: the gateway must resume elsewhere
        await task
        assert "".join(got) == want
        assert session.interruptions and session.interruptions[0].resumed_on != victim.worker_id


async def test_a_worker_that_restarted_behind_the_gateways_back_costs_no_attempt() -> None:
    """w0's process became a newer incarnation the gateway has not heard of yet (a restart at the same
    address): it answers 409 stale_epoch. The gateway fences the incarnation it addressed, and the
    request goes to w1 without spending one of its attempts: with recovery.max_attempts = 1 every
    request still completes exactly (before, the refusal was the one attempt: "gave up after 1")."""
    async with cluster(2, **{"recovery.max_attempts": 1}) as (gw, ws, http):
        stale = gw.monitor.workers["w0"].incarnation
        ws[0].engine.incarnation = stale + 1  # what the gateway addresses is gone
        prompt = list(b"who serves me")
        want = expected_bytes(prompt, 12).decode()
        for _ in range(6):  # the router spreads them: some are sent to w0 first
            async with http.post(
                "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}
            ) as r:
                body = await r.json()
                assert r.status == 200, body
                assert body["choices"][0]["text"] == want
        refused = [e for e in gw.monitor.events if e.worker_id == "w0" and e.incarnation == stale]
        assert any("409 stale_epoch" in e.reason for e in refused), [e.reason for e in refused]


async def test_a_worker_reset_by_another_gateway_costs_no_attempt_and_is_not_addressed_again() -> None:
    """Another gateway fenced the worker streaming our request: the worker becomes a new incarnation
    and drops the request (abort, `INCARNATION_RESET_ABORT`) before this gateway's view of it changes.
    The gateway fails that incarnation at once, so the resume does not address it again, and the
    attempt does not count: with recovery.max_attempts = 1 the stream still completes exactly (before,
    a burst of such fences across workers spent a request's attempts in milliseconds: seen in
    `lumen chaos --seed 41`, "gave up after 4 worker attempts")."""
    async with cluster(2, **{"recovery.max_attempts": 1}) as (gw, ws, http):
        prompt = list(b"fenced elsewhere")
        want = expected_bytes(prompt, 200).decode()
        got: list[str] = []
        task = asyncio.create_task(stream_text(http, prompt, 200, got))
        session = await streaming_session(gw)
        victim = next(w for w in ws if w.worker_id == session.worker_id)
        old = gw.monitor.workers[victim.worker_id].incarnation
        victim.engine.reset_incarnation()  # what a fence by another gateway does to the worker
        assert await task == 200
        assert "".join(got) == want
        (it,) = session.interruptions
        assert "incarnation reset" in it.reason
        failed = [e for e in gw.monitor.events if e.worker_id == victim.worker_id and e.incarnation == old]
        assert any(e.dst.value == "FAILED" for e in failed), [(e.dst, e.reason) for e in failed]
