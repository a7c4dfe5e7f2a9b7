"""Hostile HTTP gets a clean 4xx in OpenAI's error shape, never a 500, and never holds a connection
(issue 15, item 3): invalid UTF-8 inside the JSON, a compressed body that is not what its
Content-Encoding says, an encoding the gateway does not read (a good gzip body is read as usual);
requests aiohttp's parser refuses (bad request line, bad header, header too large, bad or overflowing
chunk size); connections that never finish their head (slowloris) or their body (a chunk of 2**64 - 1
bytes announced, a few sent); a body over the size limit. Raw sockets on a real gateway, waiting for
the server's EOF (a 30 s bound only turns a hang into a failure)."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from gateway.config import load_config
from gateway.server.app import Gateway

EOF_WITHIN_S = 30.0  # a hang bound, not a timing assertion: the deadlines below are 0.5-0.75 s
SHORT = {"limits.header_timeout_s": 0.75, "limits.body_timeout_s": 0.5, "limits.max_request_bytes": 4096}


@contextlib.asynccontextmanager
async def running_gateway(**overrides: Any) -> AsyncIterator[Gateway]:
    gw = Gateway(
        load_config(
            overrides={
                "gateway.port": 0,
                "gateway.control_port": 0,
                "timeouts.control_stop_grace_s": 0.05,  # stop() cancels the workers' streams at once
                **overrides,
            }
        )
    )
    await gw.start()
    try:
        yield gw
    finally:
        await gw.stop()


@pytest.fixture
async def gateway_url() -> AsyncIterator[str]:
    async with running_gateway() as gw:
        yield f"http://127.0.0.1:{gw.http_port}/v1/completions"


@pytest.fixture
async def short_gateway() -> AsyncIterator[Gateway]:
    """A gateway whose head and body deadlines are 0.75 s and 0.5 s, and whose body limit is 4 KiB."""
    async with running_gateway(**SHORT) as gw:
        yield gw


async def read_to_eof(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection (a reset ends it too)."""
    data = bytearray()
    async with asyncio.timeout(EOF_WITHIN_S):
        while True:
            try:
                chunk = await reader.read(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
    return bytes(data)


async def exchange(port: int, payload: bytes) -> bytes:
    """Send `payload` on a fresh connection; what comes back before the server closes it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(payload)
        await writer.drain()
        return await read_to_eof(reader)
    finally:
        writer.close()


def parse_response(raw: bytes) -> tuple[int, dict[str, str], Any]:
    head, sep, rest = raw.partition(b"\r\n\r\n")
    assert sep, f"no complete response: {raw[:200]!r}"
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    body = rest[: int(headers["content-length"])]
    assert headers["content-type"].startswith("application/json"), headers
    return int(status_line.split()[1]), headers, json.loads(body)


def assert_openai_error(body: Any, code: str | None = None) -> dict[str, Any]:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if code is not None:
        assert err["code"] == code, err
    return err


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


CHUNKED_HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (b"GARBAGE\r\n\r\n", "bad_request_line"),
        (b"GET /v1/models HTTP/1.1 extra\r\nHost: x\r\n\r\n", "bad_request_line"),
        (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n", None),
        (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n", "header_too_large"),
        (CHUNKED_HEAD + b"zz\r\n{}\r\n0\r\n\r\n", None),
        (CHUNKED_HEAD + b"1ffffffffffffffff\r\n{}", None),  # over 2**64: llhttp's "overflow"
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n", None),
    ],
    ids=[
        "method",
        "request-line",
        "header",
        "header-too-large",
        "chunk-size",
        "chunk-overflow",
        "two-lengths",
    ],
)
async def test_parser_errors_get_an_openai_400_and_the_connection_closes(
    short_gateway: Gateway, payload: bytes, code: str | None
) -> None:
    raw = await exchange(short_gateway.http_port, payload)  # returns once the server has closed
    status, headers, body = parse_response(raw)
    assert status == 400 and headers.get("connection", "close") == "close"  # HTTP/1.0: close is the default
    err = assert_openai_error(body, code)
    assert err["code"] in {"bad_request_line", "bad_header", "header_too_large", "bad_http_request"}
    assert err["message"].startswith("malformed HTTP request") and err["param"] is None


async def test_unfinished_heads_are_closed_while_normal_requests_are_served(short_gateway: Gateway) -> None:
    """Slowloris: 50 connections send part of a header line and stop, 5 send nothing at all; every one
    is closed by the server (header_timeout_s), and a normal request is served meanwhile."""
    port = short_gateway.http_port
    conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(55)]
    for _reader, writer in conns[:50]:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
        await writer.drain()
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{port}/v1/models") as resp,
    ):
        assert resp.status == 200 and (await resp.json())["data"][0]["id"] == "lumen-synthetic"
    try:
        got = await asyncio.gather(*(read_to_eof(reader) for reader, _ in conns))
    finally:
        for _, writer in conns:
            writer.close()
    assert got == [b""] * 55  # closed without an answer: there was no request to answer


async def test_a_chunk_of_2_64_bytes_that_never_arrives_gets_408_and_a_close(short_gateway: Gateway) -> None:
    payload = CHUNKED_HEAD + b"ffffffffffffffff\r\n" + b'{"prompt": "x", "max_tokens'
    status, headers, body = parse_response(await exchange(short_gateway.http_port, payload))
    assert status == 408 and headers["connection"] == "close"
    assert "did not arrive within 0.5 s" in assert_openai_error(body, "request_timeout")["message"]


async def test_a_chunk_of_2_64_bytes_that_keeps_coming_gets_413_and_a_close(short_gateway: Gateway) -> None:
    payload = CHUNKED_HEAD + b"ffffffffffffffff\r\n" + b"[" + b"1," * 5000
    status, headers, body = parse_response(await exchange(short_gateway.http_port, payload))
    assert status == 413 and headers["connection"] == "close"
    assert_openai_error(body, "request_too_large")


async def test_a_body_shorter_than_its_content_length_gets_408_and_a_close(short_gateway: Gateway) -> None:
    payload = (
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 1000\r\n\r\n{"text": '
    )
    status, headers, body = parse_response(await exchange(short_gateway.http_port, payload))
    assert status == 408 and headers["connection"] == "close"
    assert_openai_error(body, "request_timeout")
