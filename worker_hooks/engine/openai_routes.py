"""OpenAI-compatible `/v1/completions` and `/v1/chat/completions` on the worker.

Gateways such as SMG forward OpenAI requests to a worker as they are (SMG adds `echo: false` or
`logprobs: false` and nothing else), and clients may talk to a worker directly. Both routes run the
worker's own /generate path: the request becomes a `GenerateRequest` for `Engine.submit`, the handle's
emissions are read in order (one SSE event per engine step, whatever else is already queued coalesced
into one write), and a client that goes away aborts the request in the engine, as /generate does.

The wire shapes are Lumen's gateway's (gateway.protocol.openai): the request parsing, checked against
`Bounds` built from the EngineSpec (any model name is served and echoed, as SGLang does; max_tokens
is >= 0 with no limit of the worker's own and defaults to 16 for completions, OpenAI's default, and to
128 for chat, /generate's), the chat messages and default template, the response envelopes and the
error body `{"error": {"message", "type", "param", "code"}}`. What is the worker's own: the fields it
cannot honour on top of those the gateway refuses (stop strings, repetition_penalty, n > 1), refused
with 400 unless they hold a neutral value; text; sampling; and reading emissions.

Log probabilities (a completion's `logprobs`, a chat's `logprobs` + `top_logprobs`) are the engine's
(`return_logprob` on its /generate path), rendered by the shared envelopes with the byte vocabulary's
token texts, as Lumen's gateway renders them.

Text: the synthetic model's vocabulary is the byte vocabulary (`gateway.protocol.bytevocab`, which
the gateway's `ByteTokenizer` uses too), so a text prompt reaches the engine with the same ids it
would have through Lumen's gateway; output ids decode as UTF-8, incrementally while streaming (a
multi-byte character is never split across chunks). A worker with another vocabulary has no
tokenizer here and answers 501.

Sampling follows the gateway's mapping: `seed` (modulo 2**64) is the engine's `seed_base` (0 when
absent, as for a /generate without Lumen's extension); the EOS id stops a generation unless
`ignore_eos`. A stream that the engine aborts ends with one `data: {"error": ...}` event and no
`data: [DONE]`, as Lumen's gateway does.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog
from aiohttp import web

from gateway.protocol import bytevocab
from gateway.protocol.generate import GenerateRequest, LumenExt, SamplingParams, TokenLogprob
from gateway.protocol.launch import EngineSpec
from gateway.protocol.openai import requests
from gateway.protocol.openai.chat import render_default
from gateway.protocol.openai.envelopes import (
    SSE_DONE,
    SSE_HEADERS,
    ChatEnvelope,
    CompletionEnvelope,
    Envelope,
    Json,
    Logprob,
    TokenText,
    sse_event,
    usage,
)
from gateway.protocol.openai.errors import OpenAIError, PromptTooLong
from gateway.protocol.openai.fields import UNSUPPORTED, Fields, decode_object
from gateway.protocol.openai.requests import Bounds, SamplingRequest
from worker_hooks.engine.handle import RequestHandle
from worker_hooks.engine.http import WORKER, error_response, json_response
from worker_hooks.engine.scheduler import Emission

log = structlog.get_logger(__name__)

DEFAULT_MAX_TOKENS_COMPLETIONS = 16
DEFAULT_MAX_TOKENS_CHAT = SamplingParams().max_new_tokens

# fields the worker cannot honour (beyond those the shared parser refuses): refused unless neutral,
# then dropped before the shared parser sees them (which would read "" as a stop string, 0 as logprobs)
Refused = tuple[tuple[str, tuple[object, ...], str], ...]  # (field, its neutral values, why)
REFUSED: Refused = (("stop", ("", []), "stop strings; send stop_token_ids"),)
REFUSED_COMPLETION: Refused = REFUSED


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    input_ids: list[int]
    params: SamplingParams
    seed: int
    stream: bool
    include_usage: bool
    model: str
    logprobs: int | None = None  # None: none returned; k: each token's and its top k


def bounds(spec: EngineSpec, default_max_tokens: int) -> Bounds:
    return Bounds(
        model=spec.model,
        vocab_size=spec.vocab_size,
        default_max_tokens=default_max_tokens,
        max_new_tokens=None,
        min_new_tokens=0,
        max_top_k=None,
        echo_model=True,
    )


def parse_completion(body: Json, spec: EngineSpec) -> OpenAIRequest:
    req = requests.parse_completion(
        _refuse(body, REFUSED_COMPLETION), bounds(spec, DEFAULT_MAX_TOKENS_COMPLETIONS)
    )
    ids = bytevocab.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
    return _request(spec, ids, req.sampling, req.stream, req.include_usage, req.model, req.logprobs)


def parse_chat(body: Json, spec: EngineSpec) -> OpenAIRequest:
    req = requests.parse_chat(_refuse(body, REFUSED), bounds(spec, DEFAULT_MAX_TOKENS_CHAT))
    ids = bytevocab.encode(render_default((m.role, m.content) for m in req.messages))
    return _request(spec, ids, req.sampling, req.stream, req.include_usage, req.model, req.logprobs)


def _refuse(body: Json, refused: Refused) -> Json:
    """Refuse what the worker cannot honour; the body without the (neutral) refusable fields."""
    f = Fields(body)
    if f.number("repetition_penalty", 1.0, 0.0, 2.0, lo_open=True) != 1.0:
        raise f.fail("repetition_penalty", "is not supported (only 1)", UNSUPPORTED)
    for key, allowed, what in refused:
        f.unsupported(key, allowed, what)
    dropped = {key for key, _, _ in refused}
    return {k: v for k, v in body.items() if k not in dropped}


def _request(
    spec: EngineSpec,
    ids: list[int],
    s: SamplingRequest,
    stream: bool,
    include_usage: bool,
    model: str,
    logprobs: int | None,
) -> OpenAIRequest:
    stop_ids = list(s.stop_token_ids)
    if not s.ignore_eos:  # the request's own stop ids hold even with ignore_eos
        stop_ids = [bytevocab.EOS_ID, *(t for t in stop_ids if t != bytevocab.EOS_ID)]
    params = SamplingParams(
        max_new_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=-1 if s.top_k is None else s.top_k,
        stop_token_ids=stop_ids,
        ignore_eos=s.ignore_eos,
    )
    # an empty model name reads as none
    return OpenAIRequest(ids, params, s.seed or 0, stream, include_usage, model or spec.model, logprobs)


def _token_text(token_id: int) -> TokenText:
    raw = bytevocab.token_bytes(token_id)
    return TokenText(raw.decode("utf-8", errors="replace"), raw)


def _logprobs(req: OpenAIRequest, lps: Sequence[TokenLogprob]) -> list[Logprob] | None:
    if req.logprobs is None:
        return None
    tt = _token_text
    return [Logprob(tt(t.token_id), t.logprob, tuple((tt(i), v) for v, i in t.top)) for t in lps]


# -- errors --------------------------------------------------------------------------------------------


def _aborted(e: Emission) -> OpenAIError | None:
    if e.finish is None or e.finish.type != "abort":
        return None
    return OpenAIError(
        f"the generation was aborted: {e.finish.message or 'aborted'}",
        status=503,
        type="service_unavailable",
        code="request_aborted",
    )


# -- routes --------------------------------------------------------------------------------------------

Parse = Callable[[Json, EngineSpec], OpenAIRequest]


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, CompletionEnvelope, "cmpl", "prompt", parse_completion)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, ChatEnvelope, "chatcmpl", "messages", parse_chat)


async def _serve(
    request: web.Request, envelope: type[Envelope], prefix: str, prompt_param: str, parse: Parse
) -> web.StreamResponse:
    worker = request.app[WORKER]
    engine = worker.engine
    rid = f"{prefix}-{uuid.uuid4().hex}"
    try:
        if worker.spec.vocab_size != bytevocab.VOCAB_SIZE:
            raise OpenAIError(
                f"this worker has no tokenizer for its vocabulary ({worker.spec.vocab_size} ids; only the "
                f"byte vocabulary of {bytevocab.VOCAB_SIZE} has one here): use /generate with token ids",
                status=501,
                type="not_implemented",
                code="no_tokenizer",
            )
        req = parse(decode_object(await request.read()), worker.spec)
        gen = GenerateRequest(
            input_ids=req.input_ids,
            rid=rid,
            sampling_params=req.params,
            stream=req.stream,
            return_logprob=req.logprobs is not None,
            top_logprobs_num=req.logprobs or 0,
            lumen=LumenExt(seed_base=req.seed),  # epoch 0: not fenced by an incarnation reset
        )
        try:
            handle = engine.submit(gen)
        except PromptTooLong as exc:  # the client's prompt is its `prompt` or `messages`
            raise PromptTooLong(exc.message, param=prompt_param) from exc
    except OpenAIError as exc:
        return error_response(exc)
    env = envelope(rid, req.model, int(time.time()), req.include_usage)
    try:
        if req.stream:
            return await _stream(request, handle, env, req)
        return await _unary(handle, env, req)
    finally:
        # the client went away (handler cancelled or write failed) before the request finished
        if not handle.finished:
            engine.abort(handle.rid, "client disconnected")


def _events(chunks: list[Json]) -> bytes:
    return b"".join(sse_event(c) for c in chunks)


def _usage(handle: RequestHandle, completion_tokens: int) -> Json:
    return usage(handle.prompt_tokens, completion_tokens, handle.restored_tokens)


async def _stream(
    request: web.Request, handle: RequestHandle, env: Envelope, req: OpenAIRequest
) -> web.StreamResponse:
    resp = web.StreamResponse(headers=SSE_HEADERS)
    text = bytevocab.Utf8Stream()
    try:
        await resp.prepare(request)
        while True:
            e: Emission | None = await handle.next()
            data = bytearray()
            last: Emission | None = None
            while e is not None:  # coalesce whatever else is already queued into one write
                if (err := _aborted(e)) is not None:
                    data += sse_event(err.body())
                    await resp.write(bytes(data))
                    return resp
                lps = _logprobs(req, e.logprobs)
                if e.finish is not None:
                    tail = text.step(e.new_ids) + text.finish()
                    data += _events(env.chunks(tail, e.finish.type, logprobs=lps))
                    last = e
                    break
                data += _events(env.chunks(text.step(e.new_ids), None, logprobs=lps))
                e = handle.next_nowait()
            if last is not None:
                if env.include_usage:
                    data += sse_event(env.usage_chunk(_usage(handle, last.completion_tokens)))
                data += SSE_DONE
                await resp.write(bytes(data))
                break
            if data:
                await resp.write(bytes(data))
        await resp.write_eof()
    except ConnectionResetError:
        log.info("client disconnected", rid=handle.rid)
    return resp


async def _unary(handle: RequestHandle, env: Envelope, req: OpenAIRequest) -> web.Response:
    output: list[int] = []
    logprobs: list[TokenLogprob] = []
    while True:
        e = await handle.next()
        if (err := _aborted(e)) is not None:
            return error_response(err)
        output.extend(e.new_ids)
        logprobs.extend(e.logprobs)
        if e.finish is not None:
            text = bytevocab.Utf8Stream()
            counts = _usage(handle, e.completion_tokens)
            body = env.response(
                text.step(output) + text.finish(), e.finish.type, counts, logprobs=_logprobs(req, logprobs)
            )
            return json_response(body)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
