"""SSE keep-alive comments: a streaming response that has written nothing for `limits.sse_keepalive_s`
writes the comment line `: keep-alive`, so a client can tell a working gateway (a recovery pause, a
resumed stream replaying the prefix it already has) from a partitioned one. Nothing is written before
the headers, which wait for the stream's first step (a failure before it still gets its status).

One timer per stream, armed when the headers are sent and re-armed only when it fires (as the worker
client's `_Watchdog`): a write costs a clock read (~0.2 µs); a comment is written by a task of its
own, started only after a full interval of silence, never one per chunk. The timer stops with the
stream (`stop_keepalive`, `write_eof`).

The comment is one line WITHOUT a blank line after it. Every SSE parser ignores a line starting with
`:`, but a blank line dispatches an event, and parsers that keep the last `id:` (the SSE spec says to
keep it; the OpenAI SDK and httpx-sse do) then hand the application an event with empty data, which
the OpenAI SDK fails to decode as JSON. A lone comment line dispatches nothing and changes no state,
so the events, their text and their `id:` positions are exactly those of a stream without comments.
Every event this gateway writes ends with its blank line, so the comment always starts a line.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import structlog
from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.web_request import BaseRequest

from gateway.protocol.openai.envelopes import SSE_HEADERS

log = structlog.get_logger(__name__)

KEEPALIVE = b": keep-alive\n"

_stream_write = web.StreamResponse.write  # the base write, without zero-argument super() per chunk


class SseResponse(web.StreamResponse):
    """An SSE response that writes `KEEPALIVE` after `keepalive_s` seconds without a write (0: never)."""

    def __init__(self, keepalive_s: float) -> None:
        super().__init__(headers=SSE_HEADERS)
        self._keepalive_s = keepalive_s
        self._loop: asyncio.AbstractEventLoop | None = None  # set while keep-alives are on
        self._clock: Callable[[], float] | None = None  # its `time`, likewise
        self._last = 0.0  # loop time of the last write
        self._timer: asyncio.TimerHandle | None = None
        self._comment: asyncio.Task[None] | None = None  # the comment being written, if any
        self._transport: asyncio.BaseTransport | None = None

    async def prepare(self, request: BaseRequest) -> AbstractStreamWriter | None:
        writer = await super().prepare(request)
        if self._keepalive_s > 0 and self._loop is None and not self._eof_sent:
            # the headers are out: silence from here on is what a client's read timeout sees
            self._loop = loop = asyncio.get_running_loop()
            self._clock = loop.time
            self._transport = request.transport
            self._last = loop.time()
            self._timer = loop.call_at(self._last + self._keepalive_s, self._fire)
        return writer

    def write(self, data: bytes | bytearray | memoryview) -> Coroutine[Any, Any, None]:
        # not `async`: no coroutine frame of its own per chunk, only the clock read
        clock = self._clock
        if clock is not None:
            self._last = clock()
        return _stream_write(self, data)

    async def write_eof(self, data: bytes = b"") -> None:
        self.stop_keepalive()
        await super().write_eof(data)

    def stop_keepalive(self) -> None:
        """No more comments: the stream ended (or the client left). Idempotent."""
        self._halt()
        comment, self._comment = self._comment, None
        if comment is not None and not comment.done():
            comment.cancel()  # not started: writes nothing; mid-drain: its bytes are whole already

    def _halt(self) -> None:
        self._loop = self._clock = None
        self._transport = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self) -> None:
        self._timer = None
        loop = self._loop
        if loop is None:
            return
        now = loop.time()
        due = self._last + self._keepalive_s
        if now < due:  # written since the timer was armed: wait for the rest of a full interval
            self._timer = loop.call_at(due, self._fire)
            return
        transport = self._transport
        if transport is None or transport.is_closing():
            self._halt()  # the client left; the stream's own writer finds out on its next write
            return
        # bytes still queued (a slow reader) already tell the client the stream is alive
        busy = isinstance(transport, asyncio.WriteTransport) and transport.get_write_buffer_size() > 0
        if not busy and (self._comment is None or self._comment.done()):
            self._comment = loop.create_task(self._write_comment(), name="sse-keepalive")
        self._last = now
        self._timer = loop.call_at(now + self._keepalive_s, self._fire)

    async def _write_comment(self) -> None:
        try:
            await _stream_write(self, KEEPALIVE)  # not self.write: a comment does not move `_last` again
        except (ConnectionError, RuntimeError) as exc:  # the client left, or the stream just ended
            log.debug("keep-alive not written", error=repr(exc))
            self._halt()
