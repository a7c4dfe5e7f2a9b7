"""SSE keep-alive comments (gateway/server/api/keepalive.py) through a real in-process gateway and a
synthetic worker: while a stream is silent (here: its worker's engine paused mid-generation) the
gateway writes `: keep-alive` lines about every `limits.sse_keepalive_s`, on every streaming
endpoint; the events, their text and their `id:` positions are those of a stream without comments,
and the OpenAI SDK's own SSE decoder sees exactly those events. `sse_keepalive_s = 0` sends none; a
negative value is a config error naming the key."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, cast

import aiohttp
import pytest

from gateway.config import ConfigError, load_config
from gateway.protocol.streamid import read_position, stream_key
from gateway.server.api.keepalive import KEEPALIVE
from gateway.server.app import Gateway
from loadtests.client import sse_events
from tests.integration.test_gateway_inprocess import cluster

COMMENT = KEEPALIVE.rstrip(b"\n")
MAX_TOKENS = 40
# each engine step ~20x its modelled time: ~14 ms a token here, so the stream is still running when
# the client has its first event and pauses the engine
SLOWDOWN = 20.0
ENDPOINTS: dict[str, tuple[str, dict[str, Any]]] = {
    "completions": (
        "/v1/completions",
        {"prompt": "Keep me alive", "max_tokens": MAX_TOKENS, "temperature": 0},
    ),
    "chat": (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Keep me alive"}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        },
    ),
    "generate": (
        "/generate",
        {"text": "Keep me alive", "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}},
    ),
}


@dataclass
class Received:
    raw: bytearray = field(default_factory=bytearray)  # the body as it came
    lines: list[tuple[float, bytes]] = field(default_factory=list)  # (receive time, line without \n)

    @property
    def comments(self) -> list[float]:
        return [t for t, line in self.lines if line.startswith(b":")]

    def events(self) -> list[tuple[str | None, str]]:
        """(id, data) of each event, as an SSE parser sees them (comment lines ignored)."""
        out: list[tuple[str | None, str]] = []
        event_id: str | None = None
        data: str | None = None
        for _, line in self.lines:
            if line.startswith(b"id: "):
                event_id = line[4:].decode()
            elif line.startswith(b"data: "):
                data = line[6:].decode()
            elif not line and data is not None:
                out.append((event_id, data))
                event_id, data = None, None
        return out

    def max_gap(self) -> float:
        times = [t for t, _ in self.lines]
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


async def read_stream(resp: aiohttp.ClientResponse, on_line: Any) -> Received:
    """Every line of the body; `on_line(received)` after each (it may pause or resume the worker)."""
    got = Received()
    async for raw in resp.content:
        got.raw += raw
        got.lines.append((time.monotonic(), raw.rstrip(b"\n")))
        on_line(got)
    return got


async def loadtest_events(raw: bytes | bytearray) -> list[tuple[str | None, list[bytes]]]:
    async def lines() -> AsyncIterator[bytes]:
        for line in bytes(raw).splitlines(keepends=True):
            yield line

    return [e async for e in sse_events(cast(Any, lines()))]


def text_of(kind: str, evs: list[tuple[str | None, str]]) -> str:
    chunks = [json.loads(d) for _, d in evs if d != "[DONE]"]
    if kind == "generate":
        return str(chunks[-1]["text"])  # cumulative
    parts = []
    for c in chunks:
        for ch in c.get("choices", []):
            parts.append(ch.get("text") if kind == "completions" else ch["delta"].get("content"))
    return "".join(p or "" for p in parts)


def whole_text(kind: str, body: dict[str, Any]) -> str:
    if kind == "generate":
        return str(body["text"])
    ch = body["choices"][0]
    return str(ch["text"] if kind == "completions" else ch["message"]["content"])


def check_positions(gw: Gateway, evs: list[tuple[str | None, str]]) -> None:
    """The positions (`id:`, on each step's last event) verify with the cluster's key and only move
    forward, the last one covering every token: the comments moved nothing."""
    key = stream_key(gw.config.gateway.control_token)
    assert evs[-2][0] is not None  # the closing event before [DONE]
    sent = [read_position(key, i).choices[0].sent for i, d in evs if i is not None and d != "[DONE]"]
    assert len(sent) > 2 and sent == sorted(sent) and sent[-1] == MAX_TOKENS


async def paused_stream(
    gw: Gateway, workers: list[Any], http: aiohttp.ClientSession, kind: str, *, until_comments: int
) -> Received:
    """A stream whose worker pauses after the client's first event. With `until_comments`, the worker
    resumes once that many comments arrived; with 0, after half a second of pause (no event can
    end a pause that must see nothing)."""
    engine = workers[0].engine
    path, body = ENDPOINTS[kind]
    paused = asyncio.Event()

    def on_line(got: Received) -> None:
        if not paused.is_set() and got.events():
            engine.pause()
            paused.set()
        if until_comments and engine.paused and len(got.comments) >= until_comments:
            engine.resume()

    async def resume_later() -> None:
        await paused.wait()
        await asyncio.sleep(0.5)
        engine.resume()

    engine.set_slowdown(SLOWDOWN)
    timer = None if until_comments else asyncio.create_task(resume_later())
    try:
        async with http.post(path, json={**body, "stream": True}) as resp:
            assert resp.status == 200, await resp.text()
            got = await read_stream(resp, on_line)
    finally:
        engine.resume()
        if timer is not None:
            timer.cancel()
    assert paused.is_set()
    return got


@pytest.mark.parametrize("kind", list(ENDPOINTS))
async def test_a_silent_stream_gets_keepalive_comments_and_the_same_events(kind: str) -> None:
    interval = 0.1
    async with cluster(1, **{"limits.sse_keepalive_s": interval}) as (gw, workers, http):
        path, body = ENDPOINTS[kind]
        async with http.post(path, json=body) as resp:  # not streamed: no comments can reach it
            want = whole_text(kind, await resp.json())
        got = await paused_stream(gw, workers, http, kind, until_comments=3)

    comments = got.comments
    assert len(comments) >= 3
    gaps = [b - a for a, b in itertools.pairwise(comments)]
    assert all(0.5 * interval <= g <= 5 * interval for g in gaps[:2]), gaps  # about one per interval
    assert all(line == COMMENT for t, line in got.lines if t in comments)
    evs = got.events()
    assert evs[-1][1] == "[DONE]"
    assert text_of(kind, evs) == want and len(want) > 0
    check_positions(gw, evs)
    # the comments are whole lines between events (every event still ends with its blank line)
    assert got.raw.replace(KEEPALIVE, b"").count(b"\n\n") == len(evs)
    # the load-test and chaos clients' parser skips the comments too (their read timeout counts them)
    assert [(i, b"".join(d).decode()) for i, d in await loadtest_events(got.raw)] == evs
    if kind != "generate":
        # the OpenAI SDK's decoder sees exactly these events, each a JSON chunk or [DONE]: a comment
        # followed by a blank line would be an event with empty data to it (it keeps the last id)
        from openai._streaming import SSEDecoder

        sdk = list(SSEDecoder().iter_bytes(iter([bytes(got.raw)])))
        assert [e.data for e in sdk] == [d for _, d in evs]
        assert all(e.id == i for e, (i, _) in zip(sdk, evs, strict=True) if i is not None)


async def test_no_comments_when_keepalive_is_off() -> None:
    async with cluster(1, **{"limits.sse_keepalive_s": 0}) as (gw, workers, http):
        got = await paused_stream(gw, workers, http, "completions", until_comments=0)
    assert got.max_gap() >= 0.4  # the stream was silent for several of test 1's intervals
    assert got.comments == []
    evs = got.events()
    assert evs[-1][1] == "[DONE]"
    check_positions(gw, evs)


@pytest.mark.parametrize("value", [-1, -0.001, float("nan")])
def test_a_negative_keepalive_is_a_config_error_naming_the_key(value: float) -> None:
    with pytest.raises(ConfigError, match=r"limits\.sse_keepalive_s"):
        load_config(overrides={"limits.sse_keepalive_s": value})


async def test_a_replayed_resume_is_not_silent_while_it_catches_up() -> None:
    """docs/chaos.md: a resumed stream whose attempt cannot be adopted (here the worker keeps no
    orphans) replays the prefix the client already has without writing it; comments flow meanwhile."""
    overrides = {"limits.sse_keepalive_s": 0.05, "recovery.orphan_grace_s": 0.0}
    async with cluster(1, **overrides) as (gw, workers, http):
        path, body = ENDPOINTS["completions"]
        async with http.post(path, json=body) as resp:
            want = whole_text("completions", await resp.json())
        workers[0].engine.set_slowdown(SLOWDOWN)
        body = {**body, "stream": True}
        first = Received()
        async with http.post(path, json=body) as resp:
            async for raw in resp.content:  # break the stream after 25 events, a replay of ~0.35 s
                first.lines.append((time.monotonic(), raw.rstrip(b"\n")))
                if len(first.events()) >= 25:
                    resp.close()
                    break
        before = first.events()
        at = [i for i, _ in before if i is not None][-1]
        async with http.post(path, json=body, headers={"Last-Event-ID": at}) as resp:
            assert resp.status == 200, await resp.text()
            rest = await read_stream(resp, lambda got: None)
    head = next(k for k, (_, line) in enumerate(rest.lines) if line.startswith((b"id:", b"data:")))
    assert len(rest.comments) >= 2 and all(line == COMMENT for _, line in rest.lines[:head])
    evs = rest.events()
    assert evs[-1][1] == "[DONE]"
    assert text_of("completions", before) + text_of("completions", evs) == want
    check_positions(gw, evs)
