"""Per-key limits on the client API (limits.per_key_*): over its concurrency or its rate, a key gets
429 in OpenAI's error shape with `Retry-After`, other keys are unaffected, a slot comes back when its
request ends; without API keys the client's address is the key; the default (0) limits nothing.
In process against a generator that holds its generations until the test opens a gate."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.config import Config, GatewaySection, LimitsSection
from gateway.server.api.jobs import GenerateJob, TokenDelta
from gateway.server.api.middleware import error_middleware
from gateway.server.api.routes import add_client_routes
from gateway.server.api.tokenizer import ByteTokenizer

K1, K2 = "first-key-0001", "second-key-002"


class Gate:
    """Each generation announces itself on `started`, then waits for `open` before its one token."""

    def __init__(self) -> None:
        self.open = asyncio.Event()
        self.started: asyncio.Queue[str] = asyncio.Queue()

    async def generate(self, job: GenerateJob) -> AsyncIterator[TokenDelta]:
        self.started.put_nowait(job.rid)
        await self.open.wait()
        yield TokenDelta((65,), "length")


@pytest.fixture
async def make() -> AsyncIterator[Any]:
    clients: list[TestClient[Any, Any]] = []

    async def factory(keys: tuple[str, ...] = (K1, K2), **limits: Any) -> tuple[TestClient[Any, Any], Gate]:
        gate = Gate()
        app = web.Application(middlewares=[error_middleware])
        config = Config(gateway=GatewaySection(api_keys=keys), limits=LimitsSection(**limits))
        add_client_routes(app, config=config, tokenizer=ByteTokenizer(), generator=gate)
        client = TestClient(TestServer(app))
        await client.start_server()
        clients.append(client)
        return client, gate

    yield factory
    for c in clients:
        await c.close()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def complete(client: TestClient[Any, Any], key: str) -> tuple[int, Any]:
    body = {"prompt": "hi", "max_tokens": 1}
    async with client.post("/v1/completions", json=body, headers=auth(key)) as r:
        return r.status, await r.json()


async def assert_429(resp: Any, retry_after: int | None = None) -> None:
    assert resp.status == 429
    err = (await resp.json())["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
    assert int(resp.headers["Retry-After"]) >= 1
    if retry_after is not None:
        assert int(resp.headers["Retry-After"]) == retry_after


async def test_a_key_over_its_concurrency_gets_429_until_its_request_ends(make: Any) -> None:
    client, gate = await make(per_key_max_concurrent=1)
    first = asyncio.create_task(complete(client, K1))
    await gate.started.get()  # K1's request is in flight, held by the gate
    async with client.post("/v1/completions", json={"prompt": "x"}, headers=auth(K1)) as r:
        await assert_429(r, retry_after=1)
    other = asyncio.create_task(complete(client, K2))  # another key has its own slot
    await gate.started.get()
    gate.open.set()
    assert (await first)[0] == 200 and (await other)[0] == 200
    assert (await complete(client, K1))[0] == 200  # the slot came back


async def test_a_key_over_its_rate_gets_429_with_retry_after(make: Any) -> None:
    client, gate = await make(per_key_rate_per_s=0.01, per_key_burst=2)  # refills one every 100 s
    gate.open.set()
    for _ in range(2):
        async with client.get("/v1/models", headers=auth(K1)) as r:
            assert r.status == 200
    async with client.get("/v1/models", headers=auth(K1)) as r:
        await assert_429(r)
        assert 90 <= int(r.headers["Retry-After"]) <= 100
    async with client.get("/v1/models", headers=auth(K2)) as r:
        assert r.status == 200


async def test_without_keys_the_address_is_the_key_and_auth_comes_first(make: Any) -> None:
    client, gate = await make(keys=(), per_key_rate_per_s=0.01)
    gate.open.set()
    async with client.get("/v1/models") as r:
        assert r.status == 200
    async with client.get("/v1/models") as r:
        await assert_429(r)
    keyed, _ = await make(per_key_rate_per_s=0.01)
    for _ in range(3):  # a request without a valid key is refused before it counts
        async with keyed.get("/v1/models", headers=auth("wrong-key-000")) as r:
            assert r.status == 401
    async with keyed.get("/v1/models", headers=auth(K1)) as r:
        assert r.status == 200


async def test_by_default_nothing_is_limited(make: Any) -> None:
    client, gate = await make()
    tasks = [asyncio.create_task(complete(client, K1)) for _ in range(20)]
    for _ in tasks:
        await gate.started.get()  # all 20 in flight at once
    gate.open.set()
    assert [status for status, _ in await asyncio.gather(*tasks)] == [200] * 20
