"""Hostile bodies get a clean 4xx in OpenAI's error shape, never a 500 (issue 15, item 3, in part):
invalid UTF-8 inside the JSON, a compressed body that is not what its Content-Encoding says, an
encoding the gateway does not read. A good gzip body is read as usual."""

from __future__ import annotations

import gzip
from collections.abc import AsyncIterator

import aiohttp
import pytest

from gateway.config import load_config
from gateway.server.app import Gateway


@pytest.fixture
async def gateway_url() -> AsyncIterator[str]:
    gw = Gateway(load_config(overrides={"gateway.port": 0, "gateway.control_port": 0}))
    await gw.start()
    try:
        yield f"http://127.0.0.1:{gw.http_port}/v1/completions"
    finally:
        await gw.stop()


@pytest.mark.parametrize(
    ("body", "headers", "code"),
    [
        (b'{"prompt": "\xff\xfe", "max_tokens": 1}', {}, "invalid_json"),
        (b"this is not gzip", {"Content-Encoding": "gzip"}, "invalid_encoding"),
        (b"\x00\x01 nor deflate", {"Content-Encoding": "deflate"}, "invalid_encoding"),
        (b'{"prompt": "x"}', {"Content-Encoding": "zstdx"}, "unsupported_encoding"),
        (gzip.compress(b'{"prompt": 5}'), {"Content-Encoding": "gzip"}, "invalid_type"),  # read, then checked
    ],
)
async def test_hostile_bodies_get_an_openai_400(
    gateway_url: str, body: bytes, headers: dict[str, str], code: str
) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.post(gateway_url, data=body, headers={"Content-Type": "application/json", **headers}) as resp,
    ):
        assert resp.status == 400
        err = (await resp.json())["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == code and err["message"]
