"""A default stream is framed as SGLang and OpenAI servers frame theirs, so clients that parse SSE line
by line (SGLang's `python -m sglang.bench_serving` reads every non-empty line as `data:` JSON) work
through Lumen; resumable streams (`id:` lines, `Last-Event-ID`, keep-alive comments) are there for
clients that ask: the `Lumen-Resumable` header, a key listed in `gateway.resumable_keys`, or
`gateway.resumable_streams = true` (gateway/protocol/streamid.py)."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from gateway.config import ConfigError, load_config
from gateway.protocol.streamid import RESUMABLE_HEADER
from gateway.server.api.auth import key_id
from tests.integration.test_gateway_inprocess import cluster

SLOWDOWN = 20.0  # ~14 ms a token: far above the keep-alive interval below
KEEPALIVE_S = 0.002
ENDPOINTS: dict[str, tuple[str, dict[str, Any]]] = {
    "completions": ("/v1/completions", {"prompt": "Frame me", "max_tokens": 24, "temperature": 0}),
    "chat": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Frame me"}], "max_tokens": 24, "temperature": 0},
    ),
    "generate": (
        "/generate",
        {"text": "Frame me", "sampling_params": {"max_new_tokens": 24, "temperature": 0}},
    ),
}
KEY = "sk-framing-test-key"


def bench_serving_parse(raw: bytes) -> list[Any]:
    """What sglang.bench_serving does with each line of a stream: strip it, skip it if empty, drop a
    leading `data: ` and parse the rest as JSON unless it is `[DONE]` (a line it cannot parse fails the
    request)."""
    out: list[Any] = []
    for line in raw.split(b"\n"):
        line = line.strip()
        if not line:
            continue
        data = line[6:] if line.startswith(b"data: ") else line
        out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


async def body_of(
    http: aiohttp.ClientSession, path: str, body: dict[str, Any], headers: dict[str, str]
) -> bytes:
    async with http.post(path, json={**body, "stream": True}, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.read()


def lines(raw: bytes) -> list[bytes]:
    return [ln for ln in raw.split(b"\n") if ln]


@pytest.mark.parametrize("kind", list(ENDPOINTS))
async def test_a_default_stream_has_only_data_lines_and_parses_line_by_line(kind: str) -> None:
    path, body = ENDPOINTS[kind]
    async with cluster(1, **{"limits.sse_keepalive_s": KEEPALIVE_S}) as (_gw, workers, http):
        workers[0].engine.set_slowdown(SLOWDOWN)  # silences between tokens longer than the keep-alive
        # the in-process helper's session asks for resumable streams; this request says no
        plain = await body_of(http, path, body, {RESUMABLE_HEADER: "0"})
        resumable = await body_of(http, path, body, {})
    assert all(ln.startswith(b"data: ") for ln in lines(plain)), lines(plain)[:5]
    parsed = bench_serving_parse(plain)  # no line breaks the line-by-line parser
    assert parsed[-1] == "[DONE]" and len(parsed) > 2
    # the resumable stream, asked for: ids and keep-alive comments; the same data lines otherwise
    assert any(ln.startswith(b"id: ") for ln in lines(resumable))
    assert any(ln.startswith(b":") for ln in lines(resumable))
    with pytest.raises(json.JSONDecodeError):
        bench_serving_parse(resumable)
    data = [ln for ln in lines(resumable) if ln.startswith(b"data: ")]
    assert len(data) == len(lines(plain))
    if kind == "generate":  # no ids nor timestamps in it to differ: the same bytes
        assert [json.loads(d[6:])["text"] for d in data[:-1]] == [p["text"] for p in parsed[:-1]]


async def test_resumable_streams_per_key_and_for_every_stream() -> None:
    path, body = ENDPOINTS["completions"]
    async with cluster(
        1, **{"gateway.api_keys": [KEY, "sk-other-key-0000"], "gateway.resumable_keys": [key_id(KEY)]}
    ) as (_gw, _workers, http):
        listed = await body_of(http, path, body, {"Authorization": f"Bearer {KEY}", RESUMABLE_HEADER: "0"})
        other = await body_of(
            http, path, body, {"Authorization": "Bearer sk-other-key-0000", RESUMABLE_HEADER: "0"}
        )
    assert any(ln.startswith(b"id: ") for ln in lines(listed))
    assert not any(ln.startswith(b"id: ") for ln in lines(other))
    async with cluster(1, **{"gateway.resumable_streams": True}) as (_gw, _workers, http):
        every = await body_of(http, path, body, {RESUMABLE_HEADER: "0"})
    assert any(ln.startswith(b"id: ") for ln in lines(every))


def test_a_resumable_key_must_be_a_key_id() -> None:
    with pytest.raises(ConfigError, match=r"gateway\.resumable_keys\[0\]"):
        load_config(overrides={"gateway.resumable_keys": ["sk-the-secret-itself"]})
