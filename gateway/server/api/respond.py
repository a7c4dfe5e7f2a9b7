"""A generation's HTTP response (routes.py's handlers end here): the whole JSON body, or its SSE stream.

The first step is awaited before the response starts, so a failure before any output is an ordinary
JSON error with its own status. A GatewayError after the stream has begun is sent as one
`data: {"error": {...}}` event and the stream ends WITHOUT `data: [DONE]`: a missing [DONE] tells a
client the output is incomplete. Once the headers are out, a stream silent for `keepalive_s`
(`limits.sse_keepalive_s`) gets a `: keep-alive` comment line (keepalive.py).

Only a resumable stream (`positions`: the client asked, resume.py) carries `id:` lines and keep-alive
comments; any other is framed as SGLang and OpenAI servers frame theirs: `data:` lines, blank lines.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import msgspec
import structlog
from aiohttp import web

from gateway.protocol.openai.envelopes import SSE_DONE, Json, sse_event
from gateway.protocol.openai.errors import error_body
from gateway.server.api.errors import GatewayError
from gateway.server.api.formats import Format
from gateway.server.api.generation import Choices, Step
from gateway.server.api.keepalive import SseResponse
from gateway.server.api.resume import StreamIds

log = structlog.get_logger("lumen.api")


# a sampled request's response where its replay is not reproducible (docs/sglang.md, Determinism)
REPLAY_HEADER = "Lumen-Replay"
# the request's per-choice time per output token, as the client got them (request_metrics.py observes)
TPOT_KEY = web.RequestKey("lumen_tpot_seconds", list)


class StepTimes:
    """When each choice's steps came (not the replayed ones of a resumed stream): its time per output
    token after the first step, for /metrics."""

    def __init__(self) -> None:
        self._first: dict[int, tuple[float, int]] = {}  # index -> (time, ids) of its first step
        self._last: dict[int, tuple[float, int]] = {}  # index -> (time, ids so far)

    def saw(self, got: tuple[int, Step] | None) -> tuple[int, Step] | None:
        if got is not None and got[1].ids and not got[1].replay:
            i, n, now = got[0], len(got[1].ids), time.monotonic()
            if i not in self._first:
                self._first[i] = (now, n)
            self._last[i] = (now, self._last.get(i, (0.0, 0))[1] + n)
        return got

    def tpots(self) -> list[float]:
        out = []
        for i, (t0, n0) in self._first.items():
            t1, n = self._last[i]
            if n > n0 and t1 > t0:
                out.append((t1 - t0) / (n - n0))
        return out


def json_response(obj: object, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), content_type="application/json", headers=headers)


async def respond(
    request: web.Request,
    choices: Choices,
    fmt: Format,
    stream: bool,
    keepalive_s: float,
    positions: StreamIds | None = None,
    headers: Mapping[str, str] | None = None,
    record: Callable[[float, int, int], None] | None = None,
) -> web.StreamResponse:
    """The whole response, or its SSE stream: each step's events in one write, the last with the
    stream's position as its `id` (resume.py); replayed steps of a resumed stream are not written.
    `record(arrival, prompt tokens, output tokens)`: each choice once the response ended (the trace
    recorder, gateway.record_trace)."""
    arrival = time.time()
    times = StepTimes()
    try:
        return await _respond(request, choices, fmt, stream, keepalive_s, positions, headers, times)
    finally:
        request[TPOT_KEY] = times.tpots()
        if record is not None:
            for g in choices.gens:
                if g.completion_tokens:  # a request refused before any output is not traffic served
                    record(arrival, g.prompt_tokens, g.completion_tokens)


async def _respond(
    request: web.Request,
    choices: Choices,
    fmt: Format,
    stream: bool,
    keepalive_s: float,
    positions: StreamIds | None,
    headers: Mapping[str, str] | None,
    times: StepTimes,
) -> web.StreamResponse:
    gens = choices.gens
    async with choices:  # closes every generator on every way out, cancellation included
        if not stream:
            parts: list[list[str]] = [[] for _ in gens]
            while (got := times.saw(await choices.next())) is not None:
                parts[got[0]].append(got[1].text)
            return json_response(fmt.response(["".join(p) for p in parts], gens), headers)
        first = times.saw(await choices.next())  # raises before any output: the middleware answers
        # from here on, silence longer than limits.sse_keepalive_s gets a comment line (keepalive.py)
        # keep-alive comments only on resumable streams: a client parsing SSE line by line (as SGLang's
        # own bench_serving does) reads a comment line as a broken data line
        resp = SseResponse(keepalive_s if positions is not None else 0.0)
        if headers:
            resp.headers.update(headers)
        await resp.prepare(request)
        try:
            got = first
            while got is not None:
                index, step = got
                events = fmt.chunks(index, step, gens[index])  # a replayed step updates the format
                if step.replay:
                    got = times.saw(await choices.next())
                    continue
                # every step's ids count toward the stream's position, also a step whose text is held
                # back (a byte-level token that ends no character writes no event): the next event's
                # id must cover them, or a stream resumed from it would repeat that text
                if positions is not None:
                    positions.step(index, step)
                if events:
                    await resp.write(_events(events, positions))
                got = times.saw(await choices.next())
            if positions is None or not positions.closed:
                closing = fmt.closing(gens)
                if closing:
                    await resp.write(_events(closing, positions, closed=True))
            await resp.write(SSE_DONE)
        except ConnectionResetError:
            log.debug("client left mid-stream", rid=choices.job.rid)
        except GatewayError as exc:
            await _write_error(resp, exc.body())
        except Exception:
            # the status is already sent, so the error middleware cannot answer: end the stream cleanly
            log.exception("stream failed", rid=choices.job.rid)
            await _write_error(resp, error_body("internal server error", "internal_error"))
        finally:
            resp.stop_keepalive()  # the stream ended, or the handler was cancelled (client gone)
        return resp


def _events(objs: list[Json], positions: StreamIds | None, *, closed: bool = False) -> bytes:
    """The events of one step; with positions, the last carries the stream's position as its id."""
    if positions is None:
        return b"".join([sse_event(o) for o in objs])
    last = b"id: " + positions.position(closed=closed).encode() + b"\n" + sse_event(objs[-1])
    return b"".join([sse_event(o) for o in objs[:-1]]) + last if len(objs) > 1 else last


async def _write_error(resp: web.StreamResponse, body: dict[str, object]) -> None:
    try:
        await resp.write(sse_event(body))
    except ConnectionResetError:
        pass
