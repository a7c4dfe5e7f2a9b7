"""The gateway's data-path client: one `/generate` SSE stream from one worker incarnation.

A stream can be interrupted from outside (its worker was declared failed), time out (stall), or carry
an error chunk; all surface as `WorkerLost` from `next_chunk`, so the session's failover logic has
one case to handle. Chunks come out incremental whatever the worker sends (SGLang's default
streaming repeats every id so far).
"""

from __future__ import annotations

import asyncio
from types import TracebackType

import aiohttp
import msgspec

from gateway.protocol.generate import (
    GenerateChunk,
    StreamError,
    decode_chunk,
    encode,
    incremental,
)


class WorkerLost(Exception):
    """The stream from a worker ended without finishing: the request must resume elsewhere."""

    def __init__(self, reason: str, *, connection_broke: bool = False, worker_error: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        # the TCP connection itself failed (as opposed to a stall or a fencing decision)
        self.connection_broke = connection_broke
        # the worker sent an error chunk: it is alive, but should not get this request again
        self.worker_error = worker_error


class WorkerRefused(Exception):
    """The worker answered with an error status."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"worker answered {status}: {body[:200]}")
        self.status = status
        self.body = body

    @property
    def retryable(self) -> bool:
        # 409: stale incarnation (our view lags); 503: still loading; 5xx: worker trouble
        return self.status == 409 or self.status >= 500


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
    ) -> None:
        self._http = http
        self._url = url.rstrip("/") + path
        self._request = request
        self._first_timeout = first_chunk_timeout_s
        self._stall_timeout = stall_timeout_s
        self._resp: aiohttp.ClientResponse | None = None
        self._timeout: asyncio.Timeout | None = None
        self._interrupted: str | None = None
        self._chunks = 0
        self._received = 0  # output ids received on this stream

    def interrupt(self, reason: str) -> None:
        """Stop waiting on this stream now (its worker incarnation failed). Safe to call any time."""
        if self._interrupted is None:
            self._interrupted = reason
        if self._timeout is not None:
            try:
                self._timeout.reschedule(asyncio.get_running_loop().time())
            except RuntimeError:
                pass  # not inside a wait right now: the next wait checks `_interrupted` first

    async def __aenter__(self) -> WorkerStream:
        self._check_interrupted()
        try:
            async with self._deadline(self._first_timeout) as _:
                resp = await self._http.post(
                    self._url, data=encode(self._request), headers={"Content-Type": "application/json"}
                )
        except TimeoutError as exc:
            raise self._lost_after_timeout("no response headers") from exc
        except aiohttp.ClientError as exc:
            raise WorkerLost(f"connect/post failed: {exc!r}", connection_broke=True) from exc
        if resp.status != 200:
            body = await resp.text()
            resp.release()
            raise WorkerRefused(resp.status, body)
        self._resp = resp
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._resp is not None:
            # closing (not releasing) drops the connection, which makes the worker abort the request
            self._resp.close()
            self._resp = None

    async def next_chunk(self) -> GenerateChunk | None:
        """The next chunk, or None after `[DONE]`. Raises WorkerLost on any break, stall or fencing."""
        if self._resp is None:
            raise RuntimeError("WorkerStream.next_chunk outside `async with`")
        self._check_interrupted()
        timeout = self._first_timeout if self._chunks == 0 else self._stall_timeout
        content = self._resp.content
        try:
            async with self._deadline(timeout):
                while True:
                    line = await content.readline()
                    if not line:
                        raise WorkerLost("stream ended without [DONE]", connection_broke=True)
                    if not line.startswith(b"data:"):
                        continue  # blank separators, comments
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        return None
                    self._chunks += 1
                    chunk = incremental(decode_chunk(payload), self._received)  # ids and logprob rows
                    self._received += len(chunk.output_ids)
                    return chunk
        except TimeoutError as exc:
            raise self._lost_after_timeout(f"no chunk for {timeout:.3g} s") from exc
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise WorkerLost(f"stream broke: {exc!r}", connection_broke=True) from exc
        except StreamError as exc:
            raise WorkerLost(str(exc), worker_error=True) from exc
        except msgspec.DecodeError as exc:
            raise WorkerLost(f"malformed chunk from worker: {exc}", worker_error=True) from exc

    # -- internals ------------------------------------------------------------------------------
    def _deadline(self, seconds: float) -> asyncio.Timeout:
        t = asyncio.timeout(seconds)
        self._timeout = t
        return t

    def _check_interrupted(self) -> None:
        if self._interrupted is not None:
            raise WorkerLost(self._interrupted)

    def _lost_after_timeout(self, what: str) -> WorkerLost:
        if self._interrupted is not None:
            return WorkerLost(self._interrupted)
        return WorkerLost(f"stall: {what}")
