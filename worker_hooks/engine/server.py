"""The worker's HTTP data API: SGLang's native `/generate` subset plus health and abort (DESIGN 4.2).

Streams send one SSE chunk per engine step carrying only that step's new ids (SGLang's
`--incremental-streaming-output`), the finish reason on the last chunk, then `data: [DONE]`; every
chunk carries the prefix restored from the checkpoint store (`restored_tokens`, `cached_tokens`).
With `return_logprob` a chunk carries its ids' `output_token_logprobs` (and `output_top_logprobs`
with `top_logprobs_num` > 0) in SGLang's row shape `[logprob, id, null]`, incremental like the ids;
a whole (non-streamed) response carries every id's.
A request whose client goes away is aborted in the engine, so its KV pages are freed at once; its
checkpoint stays with its holders (the gateway may resume it), while `/abort_request` drops it too.
Discovery, load and metrics endpoints live in info.py, the OpenAI routes in openai_routes.py;
service.py puts them on one app.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import msgspec
import structlog
from aiohttp import web

from gateway.core.health import Phase
from gateway.protocol.generate import (
    SSE_DONE,
    AbortRequest,
    AdoptRequest,
    GenerateChunk,
    LogprobRow,
    MetaInfo,
    SeedSend,
    TokenLogprob,
    encode_sse_chunk,
    request_decoder,
)
from gateway.protocol.openai.errors import OpenAIError
from worker_hooks.engine.engine import Engine
from worker_hooks.engine.errors import MalformedRequest, NotServing
from worker_hooks.engine.handle import RequestHandle
from worker_hooks.engine.http import WORKER, decoded, error_response, json_response
from worker_hooks.engine.scheduler import Emission
from worker_hooks.engine.validation import check_body

log = structlog.get_logger(__name__)

_abort_decoder = msgspec.json.Decoder(AbortRequest)


class FaultRequest(msgspec.Struct, forbid_unknown_fields=True):
    """`POST /lumen/fault` (fault injection, local clusters): `slowdown` x the modelled step time."""

    slowdown: float


# bounds of a seed's send (a restart asks for its transfer's wall length and the cost model's factor)
MAX_SEND_S = 3600.0
MAX_SEND_SLOWDOWN = 10.0

_fault_decoder = msgspec.json.Decoder(FaultRequest)
_seed_send_decoder = msgspec.json.Decoder(SeedSend)
_adopt_decoder = msgspec.json.Decoder(AdoptRequest)


def _chunk(
    engine: Engine,
    handle: RequestHandle,
    e: Emission,
    output_ids: list[int],
    logprobs: Sequence[TokenLogprob] | None = None,
) -> GenerateChunk:
    lps = e.logprobs if logprobs is None else logprobs
    rows: list[LogprobRow] = []
    tops: list[list[LogprobRow] | None] = []
    if handle.top_logprobs >= 0:
        rows = [(t.logprob, t.token_id, None) for t in lps]
        if handle.top_logprobs > 0:
            tops = [[(v, i, None) for v, i in t.top] for t in lps]
    return GenerateChunk(
        output_ids=output_ids,
        meta_info=MetaInfo(
            id=handle.rid,
            prompt_tokens=handle.prompt_tokens,
            completion_tokens=e.completion_tokens,
            # SGLang reports prefix-cache hits as cached tokens; a restored prefix is one
            cached_tokens=handle.restored_tokens,
            restored_tokens=handle.restored_tokens,
            finish_reason=e.finish,
            worker_id=engine.worker_id,
            incarnation=handle.incarnation,
            output_token_logprobs=rows,
            output_top_logprobs=tops,
        ),
    )


async def generate(request: web.Request) -> web.StreamResponse:
    engine = request.app[WORKER].engine
    body = await request.read()
    try:
        check_body(body, engine.spec.vocab_size)  # sampling_params as the gateway checks them
        req = decoded(request_decoder, body, "/generate")
        if not req.rid:
            req = msgspec.structs.replace(req, rid=f"w-{uuid.uuid4().hex}")
        handle = engine.submit(req)
    except OpenAIError as exc:
        return error_response(exc)
    delivered = False
    try:
        if req.stream:
            resp, delivered = await _stream(request, engine, handle)
            return resp
        resp = await _unary(engine, handle)
        delivered = True
        return resp
    finally:
        # the client went away (handler cancelled or write failed) before it had the whole output:
        # kept for adoption within the gateway's orphan grace, else aborted
        if not delivered:
            engine.orphan(handle)


async def _stream(
    request: web.Request, engine: Engine, handle: RequestHandle
) -> tuple[web.StreamResponse, bool]:
    """The request's SSE stream; also says whether the client got all of it."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    try:
        await resp.prepare(request)
        while True:
            e: Emission | None = await handle.next()
            # coalesce whatever else is already queued into one write; still one chunk per step
            data = bytearray()
            while e is not None:
                data += encode_sse_chunk(_chunk(engine, handle, e, e.new_ids))
                if e.finish is not None:
                    break
                e = handle.next_nowait()
            if e is not None and e.finish is not None:
                data += SSE_DONE
                await resp.write(bytes(data))
                break
            await resp.write(bytes(data))
        await resp.write_eof()
    except ConnectionResetError:
        log.info("client disconnected", rid=handle.rid)
        return resp, False
    return resp, True


async def adopt(request: web.Request) -> web.StreamResponse:
    """`POST /lumen/adopt`: a gateway takes over an orphaned request; its stream from the first id."""
    engine = request.app[WORKER].engine
    try:
        req = decoded(_adopt_decoder, await request.read(), "/lumen/adopt")
        handle = engine.adopt(req.rid, req.epoch)
    except OpenAIError as exc:
        return error_response(exc)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    delivered = False
    try:
        await resp.prepare(request)
        async for batch in handle.follow():  # the first batch: everything so far, as one chunk
            last = batch[-1]
            ids = [i for e in batch for i in e.new_ids]
            lps = [lp for e in batch for lp in e.logprobs]
            data = encode_sse_chunk(_chunk(engine, handle, last, ids, lps))
            await resp.write(data + SSE_DONE if last.finish is not None else data)
        await resp.write_eof()
        delivered = True
    except ConnectionResetError:
        log.info("adopting gateway disconnected", rid=handle.rid)
    finally:
        if not delivered:
            engine.orphan(handle)  # left again: another gateway may still come
    return resp


async def _unary(engine: Engine, handle: RequestHandle) -> web.Response:
    output: list[int] = []
    logprobs: list[TokenLogprob] = []
    while True:
        e = await handle.next()
        output.extend(e.new_ids)
        logprobs.extend(e.logprobs)
        if e.finish is not None:
            # GenerateChunk omits its defaults; SGLang's unary response always carries `text`
            result = msgspec.to_builtins(_chunk(engine, handle, e, output, logprobs))
            result["text"] = ""
            return json_response(result)


async def abort_request(request: web.Request) -> web.Response:
    engine = request.app[WORKER].engine
    try:
        req = decoded(_abort_decoder, await request.read(), "/abort_request")
    except OpenAIError as exc:
        return error_response(exc)
    if not req.rid and not req.abort_all:
        return error_response(MalformedRequest("rid must be a non-empty prefix (or abort_all true)"))
    aborted = engine.abort_prefix("" if req.abort_all else req.rid)
    log.info("abort_request", prefix=req.rid, aborted=len(aborted))
    return json_response({"aborted": aborted})


async def fault(request: web.Request) -> web.Response:
    """A slow, degraded GPU: the engine keeps serving, every step `slowdown` x slower (1.0 restores)."""
    engine = request.app[WORKER].engine
    try:
        engine.set_slowdown(decoded(_fault_decoder, await request.read(), "/lumen/fault").slowdown)
    except ValueError as exc:  # a slowdown the engine refuses
        return error_response(MalformedRequest(f"invalid /lumen/fault body: {exc}"))
    except OpenAIError as exc:
        return error_response(exc)
    return json_response({"worker_id": engine.worker_id, "slowdown": engine.slowdown})


async def seed_send(request: web.Request) -> web.Response:
    """A restarting peer loads its weights from this worker (seeding.py): its steps are slower for
    the transfer's length, and the answer comes when the transfer ends."""
    engine = request.app[WORKER].engine
    try:
        req = decoded(_seed_send_decoder, await request.read(), "/lumen/seed_send")
    except OpenAIError as exc:
        return error_response(exc)
    if not (0 <= req.seconds <= MAX_SEND_S and 1.0 <= req.slowdown <= MAX_SEND_SLOWDOWN):
        return error_response(
            MalformedRequest(
                f"seconds must be in [0, {MAX_SEND_S:g}] and slowdown in [1, {MAX_SEND_SLOWDOWN:g}]"
            )
        )
    if engine.phase is not Phase.SERVING:
        return error_response(MalformedRequest(f"this worker is {engine.phase.value}, not serving: no seed"))
    if not await engine.seeding.send(req.seconds, req.slowdown):
        return error_response(NotServing("this worker stopped during the transfer"))
    return json_response({"worker_id": engine.worker_id, "sent_s": req.seconds})


async def health(request: web.Request) -> web.Response:
    engine = request.app[WORKER].engine
    if engine.phase is Phase.SERVING:
        return web.Response(status=200)
    return web.Response(status=503, text=engine.phase.value)


def add_routes(app: web.Application, *, fault_injection: bool = False) -> None:
    app.router.add_post("/generate", generate)
    app.router.add_put("/generate", generate)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_post("/lumen/adopt", adopt)
    app.router.add_post("/lumen/seed_send", seed_send)
    if fault_injection:  # a worker started for testing only (EngineSpec.fault_injection)
        app.router.add_post("/lumen/fault", fault)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health)
