"""The gateway's data-path client: one `/generate` SSE stream from one worker incarnation.

A stream can be interrupted from outside (its worker was declared failed), time out (stall), or carry
an error chunk; all surface as `WorkerLost` from `next_chunk`, so the session's failover logic has
one case to handle. Chunks come out incremental whatever the worker sends (SGLang's default
streaming repeats every id so far).

Cheap per token: `next_chunk` takes every complete chunk already received in one read and merges them
into one (their ids and logprob rows in order; it never waits for more), so a gateway that falls
behind handles, and writes, several tokens at once; and one timer per stream, re-armed only when it
fires (`_Watchdog`), bounds each wait instead of a timeout object per chunk. A stream a Lumen
worker finished gives its connection back to the pool (`keep_alive`); any other is closed, which a
worker that does not keep orphans (SGLang) takes as an abort.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from types import TracebackType
from typing import TypeVar

import aiohttp
import msgspec

from gateway.core.losses import Loss
from gateway.protocol.generate import (
    GenerateChunk,
    StreamError,
    decode_chunk,
    encode,
    incremental,
)

T = TypeVar("T")
_JSON_HEADERS = {"Content-Type": "application/json"}
_DRAIN_TIMEOUT_S = 2.0  # a finished stream's body must end within this to keep its connection


class WorkerLost(Exception):
    """The stream from a worker ended without finishing: the request must resume elsewhere. `kind`
    (gateway/core/losses.py) says why and is what the session decides by; `reason` is the words,
    for logs and the interruption record."""

    def __init__(self, reason: str, kind: Loss) -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind

    @property
    def connection_broke(self) -> bool:
        """The TCP connection itself failed (as opposed to a stall or a fencing decision)."""
        return self.kind is Loss.CONNECTION

    @property
    def worker_error(self) -> bool:
        """The worker sent an error chunk: it is alive, but should not get this request again."""
        return self.kind is Loss.WORKER_ERROR

    @property
    def incarnation_reset(self) -> bool:
        """The worker dropped the request because it became a new incarnation (another gateway fenced
        it): the incarnation addressed is gone, the worker itself is about to attach again."""
        return self.kind is Loss.RESET


# statuses by which a worker says the request itself is malformed or too large (SGLang: 400 for a
# failed validation, e.g. a prompt past the context length; 422 from its schema): the same body would
# be refused by any worker of the model, so the client's request is at fault
REQUEST_FAULT_STATUSES = frozenset({400, 413, 422})


def _status(code: int | str | None) -> int | None:
    """An error chunk's code as an HTTP status, if it is one."""
    if isinstance(code, int):
        return code
    return int(code) if isinstance(code, str) and code.isdigit() else None


class WorkerRefused(Exception):
    """The worker answered with an error status."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"worker answered {status}: {body[:200]}")
        self.status = status
        self.body = body

    @property
    def stale_incarnation(self) -> bool:
        """A Lumen worker's 409 `stale_epoch`: it is another (newer) incarnation than we addressed."""
        return self.status == 409 and "stale_epoch" in self.body

    @property
    def request_fault(self) -> bool:
        """The worker refused the request's content (400, 413, 422): the client's 4xx, not a retry."""
        return self.status in REQUEST_FAULT_STATUSES

    @property
    def retryable(self) -> bool:
        """Another worker may serve it: 409 (stale incarnation: our view lags), 5xx (loading, trouble),
        and every 4xx that is the worker's own (401/403: its credentials, 404/405: a route it lacks,
        408/429: busy): never a bare 502 for a refusal another worker would not make."""
        return not self.request_fault

    @property
    def message(self) -> str:
        """The worker's own message: an OpenAI-style `{"error": {"message"}}`, SGLang's `{"message"}`
        or `{"error": "..."}` (its contract errors), else the body's first 300 characters."""
        try:
            doc = msgspec.json.decode(self.body)
        except msgspec.DecodeError:
            return self.body[:300]
        if isinstance(doc, dict):
            err = doc.get("error", doc)
            if isinstance(err, dict) and isinstance(err.get("message"), str):
                return str(err["message"])[:300]
            if isinstance(err, str):
                return err[:300]
        return self.body[:300]


class _Watchdog:
    """Bounds the waits of one stream with one timer: starting a wait costs a clock read; the timer
    is re-armed only when it fires early (the deadline moved on since) or must fire sooner. Expiry
    cancels the waiting task, which `ended` turns into a timeout (as asyncio.timeout does)."""

    __slots__ = ("_cancelling", "_due", "_handle", "_loop", "_task", "expired")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0
        self.expired = False

    def time(self) -> float:
        return self._loop.time()

    def start(self, due: float) -> None:
        """A wait until at most `due` (loop time) begins in the current task."""
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a worker stream is read outside a task")
        self._due = due
        self._task, self._cancelling = task, task.cancelling()
        h = self._handle
        if h is None or h.when() > due:
            if h is not None:
                h.cancel()
            self._handle = self._loop.call_at(due, self._fire)

    def ended(self, exc: BaseException | None = None) -> bool:
        """The wait ended (raising `exc`): True when it ended because it expired."""
        task, self._task = self._task, None
        if self.expired and isinstance(exc, asyncio.CancelledError) and task is not None:
            return task.uncancel() <= self._cancelling
        return False

    def expire(self) -> None:
        """End the current wait now, if there is one."""
        if self._task is not None and not self.expired:
            self.expired = True
            self._task.cancel()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._task = None

    def _fire(self) -> None:
        self._handle = None
        if self._task is None:
            return  # not waiting: the next wait arms it again
        if self._loop.time() < self._due:
            self._handle = self._loop.call_at(self._due, self._fire)
            return
        self.expire()

    async def wait(self, aw: Awaitable[T], due: float) -> T:
        """`await aw`, raising TimeoutError at `due`."""
        self.start(due)
        try:
            got = await aw
        except asyncio.CancelledError as exc:
            if self.ended(exc):
                raise TimeoutError from exc
            raise
        except BaseException:
            self.ended()
            raise
        self.ended()
        return got


class WorkerStream:
    """`async with WorkerStream(...) as s: while (chunk := await s.next_chunk()) is not None: ...`"""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        url: str,
        request: msgspec.Struct,
        *,
        first_chunk_timeout_s: float,
        stall_timeout_s: float,
        path: str = "/generate",
        keep_alive: bool = False,
    ) -> None:
        """`keep_alive`: a finished stream's connection may serve the next request (a server whose
        idle keep-alive outlasts the client pool's, as Lumen's workers' does: a reused connection
        that the server is closing would read as a broken one, i.e. a failed worker)."""
        self._keep_alive = keep_alive
        self._http = http
        self._url = url.rstrip("/") + path
        self._request = request
        self._first_timeout = first_chunk_timeout_s
        self._stall_timeout = stall_timeout_s
        self._resp: aiohttp.ClientResponse | None = None
        self._watch: _Watchdog | None = None
        self._interrupted: WorkerLost | None = None
        self._chunks = 0
        self._received = 0  # output ids received on this stream
        self._tail = b""  # bytes received after the last complete line
        self._lines: list[bytes] = []  # complete `data:` lines not parsed yet (the rest is framing)
        self._done = False  # `[DONE]` was read
        self._finished = False  # the request's last chunk (not an abort) was read

    def interrupt(self, reason: str, kind: Loss = Loss.FENCED) -> None:
        """Stop waiting on this stream now (its worker incarnation failed, or is degraded: `kind`).
        Safe to call any time."""
        if self._interrupted is None:
            self._interrupted = WorkerLost(reason, kind)
        if self._watch is not None:
            self._watch.expire()  # not inside a wait: the next one checks `_interrupted` first

    async def __aenter__(self) -> WorkerStream:
        self._check_interrupted()
        watch = self._watch = _Watchdog(asyncio.get_running_loop())
        try:
            post = self._http.post(self._url, data=encode(self._request), headers=_JSON_HEADERS)
            resp = await watch.wait(post, watch.time() + self._first_timeout)
        except TimeoutError as exc:
            raise self._lost_after_timeout("no response headers") from exc
        except aiohttp.ServerDisconnectedError as exc:
            # closed before any answer: a pooled keep-alive connection the server had just closed
            # (uvicorn drops idle ones after 5 s) looks the same as a dead server. The request moves
            # on; the worker is not failed for it (a dead one refuses the next connect, or its poll).
            # Seen: a healthy loaded real SGLang server failed this way (issue 27's real lane).
            raise WorkerLost(f"connect/post failed: {exc!r}", Loss.UNANSWERED) from exc
        except aiohttp.ClientError as exc:
            raise WorkerLost(f"connect/post failed: {exc!r}", Loss.CONNECTION) from exc
        if resp.status != 200:
            body = await resp.text()
            resp.release()
            raise WorkerRefused(resp.status, body)
        self._resp = resp
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._watch is not None:
            self._watch.close()
        resp, self._resp = self._resp, None
        if resp is None:
            return
        if not (self._finished and self._keep_alive):
            # closing (not releasing) drops the connection, which makes the worker abort the request
            resp.close()
            return
        # the worker finished the request: its connection goes back to the pool once the body's end
        # (`[DONE]`, the chunked terminator) is read, which usually came with the last chunk
        content = resp.content
        with contextlib.suppress(RuntimeError):
            content.read_nowait()
        if content.is_eof():
            resp.release()
        else:
            task = asyncio.get_running_loop().create_task(_release_at_end(resp))
            _draining.add(task)
            task.add_done_callback(_draining.discard)

    async def next_chunk(self) -> GenerateChunk | None:
        """The next chunk, or None after `[DONE]`: every chunk already received, merged (it never
        waits for more once it has one). Raises WorkerLost on any break, stall or fencing."""
        resp, watch = self._resp, self._watch
        if resp is None or watch is None:
            raise RuntimeError("WorkerStream.next_chunk outside `async with`")
        self._check_interrupted()
        timeout = self._first_timeout if self._chunks == 0 else self._stall_timeout
        due = 0.0
        try:
            while True:
                if self._lines:
                    chunk = self._parse()
                    if chunk is not None:
                        return chunk
                if self._done:
                    return None
                if not due:
                    due = watch.time() + timeout
                data = await watch.wait(resp.content.readany(), due)
                if not data:
                    raise WorkerLost("stream ended without [DONE]", Loss.CONNECTION)
                self._feed(data)
        except TimeoutError as exc:
            raise self._lost_after_timeout(f"no chunk for {timeout:.3g} s") from exc
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise WorkerLost(f"stream broke: {exc!r}", Loss.CONNECTION) from exc

    # -- internals ------------------------------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        buf = self._tail + data if self._tail else data
        end = buf.rfind(b"\n")
        if end < 0:
            self._tail = buf
            return
        self._lines += [line for line in buf[:end].split(b"\n") if line.startswith(b"data:")]
        self._tail = buf[end + 1 :]

    def _parse(self) -> GenerateChunk | None:
        """The complete chunks received, merged into one; None when there is none (yet, or `[DONE]`
        came). A chunk that ends the request is the last merged (an abort is never merged: its ids
        were not sent); a bad line after good chunks stays for the next call to raise."""
        lines = self._lines
        got: list[GenerateChunk] = []
        i = 0
        try:
            for line in lines:
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    self._done = True
                    i = len(lines)
                    break
                try:
                    chunk = incremental(decode_chunk(payload), self._received)  # ids and logprob rows
                except StreamError as exc:
                    if got:
                        break
                    status = _status(exc.code)
                    if status in REQUEST_FAULT_STATUSES and self._chunks == 0:
                        # refused before any output, for the request's content (SGLang streams its
                        # validation errors, a prompt past the context length, as this chunk): the
                        # client's 4xx, as when the worker answers the status itself
                        body = msgspec.json.encode({"error": {"message": exc.message}}).decode()
                        raise WorkerRefused(status, body) from exc
                    raise WorkerLost(str(exc), Loss.WORKER_ERROR) from exc
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    if got:
                        break
                    raise WorkerLost(f"malformed chunk from worker: {exc}", Loss.WORKER_ERROR) from exc
                fin = chunk.meta_info.finish_reason
                if fin is not None and fin.type == "abort" and got:
                    break
                i += 1
                self._chunks += 1
                self._received += len(chunk.output_ids)
                if chunk.output_ids or fin is not None:
                    got.append(chunk)
                if fin is not None:
                    self._finished = fin.type != "abort"
                    break
        finally:
            del lines[:i]
        return _merged(got)

    def _check_interrupted(self) -> None:
        if self._interrupted is not None:
            raise WorkerLost(self._interrupted.reason, self._interrupted.kind)

    def _lost_after_timeout(self, what: str) -> WorkerLost:
        if self._interrupted is not None:
            return WorkerLost(self._interrupted.reason, self._interrupted.kind)
        return WorkerLost(f"stall: {what}", Loss.STALLED)  # the gateway's own timeout


_draining: set[asyncio.Task[None]] = set()  # connections being read to their end, then pooled


async def _release_at_end(resp: aiohttp.ClientResponse) -> None:
    """Read what is left of a finished stream's body, then pool its connection (or drop it)."""
    try:
        async with asyncio.timeout(_DRAIN_TIMEOUT_S):
            while await resp.content.readany():
                pass
    except (TimeoutError, aiohttp.ClientError, ConnectionError):
        resp.close()
        return
    resp.release()


def _merged(chunks: list[GenerateChunk]) -> GenerateChunk | None:
    """One chunk of consecutive incremental ones: their ids and logprob rows in order, the last one's
    finish, and the first one's prompt figures (cached and restored tokens)."""
    if len(chunks) <= 1:
        return chunks[0] if chunks else None
    first, last = chunks[0].meta_info, chunks[-1].meta_info
    meta = msgspec.structs.replace(
        last, cached_tokens=first.cached_tokens, restored_tokens=first.restored_tokens
    )
    if any(c.meta_info.output_token_logprobs or c.meta_info.output_top_logprobs for c in chunks):
        meta.output_token_logprobs = [r for c in chunks for r in c.meta_info.output_token_logprobs]
        meta.output_top_logprobs = [r for c in chunks for r in c.meta_info.output_top_logprobs]
    return GenerateChunk([i for c in chunks for i in c.output_ids], meta, chunks[-1].text)
