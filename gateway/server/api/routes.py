"""Client routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, POST /generate.

A handler reads and validates the request (gateway.protocol.openai.requests, against the Bounds of
schemas.py), tokenizes it (applying the chat template), builds a `GenerateJob` per choice, and renders
what `Generator.generate` yields (formats.py, over gateway.protocol.openai.envelopes). It never sees
workers.

`n` choices are n jobs, each its own session on the workers (its own rid, `<id>-<i>`; its own seed,
the request's seed + i, or one drawn for it), read together (generation.Choices): a worker failure
resumes only the choices it served, each exactly. A stream's chunks carry their choice's `index`.

Streams are SSE. The first step is awaited before the response starts, so a failure before any
output is an ordinary JSON error with its own status. A GatewayError after the stream has begun is
sent as one `data: {"error": {...}}` event and the stream ends WITHOUT `data: [DONE]`: a missing
[DONE] tells a client the output is incomplete.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
import structlog
from aiohttp import hdrs, web

from gateway.config import Config
from gateway.protocol.openai.envelopes import (
    SSE_DONE,
    SSE_HEADERS,
    ChatEnvelope,
    CompletionEnvelope,
    sse_event,
)
from gateway.protocol.openai.errors import error_body
from gateway.protocol.openai.fields import decode_object
from gateway.protocol.openai.requests import (
    Bounds,
    Prompt,
    SamplingRequest,
    parse_chat,
    parse_completion,
    parse_generate,
)
from gateway.server.api.auth import check_bearer
from gateway.server.api.chat_template import ChatTemplate
from gateway.server.api.detokenize import Detokenizer
from gateway.server.api.errors import (
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    RequestTooLarge,
    UnreadableBody,
)
from gateway.server.api.formats import Format, NativeFormat, OpenAIFormat
from gateway.server.api.generation import Choices, Generation
from gateway.server.api.jobs import GenerateJob, Generator, Sampling
from gateway.server.api.schemas import bounds_of, check_prompt_length
from gateway.server.api.tokenizer import Tokenizer

log = structlog.get_logger(__name__)

# texts longer than this are tokenized off the event loop
_THREAD_ENCODE_CHARS = 32 * 1024


@dataclass(frozen=True, slots=True)
class ClientApi:
    config: Config
    tokenizer: Tokenizer
    generator: Generator
    template: ChatTemplate
    bounds: Bounds
    eos_ids: tuple[int, ...]  # the tokenizer's EOS ids plus tokenizer.eos_token_ids from the config
    created: int

    async def encode(self, prompt: Prompt, *, add_special_tokens: bool, param: str) -> tuple[int, ...]:
        if isinstance(prompt, str):
            encode = self.tokenizer.encode
            if len(prompt) > _THREAD_ENCODE_CHARS:
                ids = await asyncio.to_thread(encode, prompt, add_special_tokens=add_special_tokens)
            else:
                ids = encode(prompt, add_special_tokens=add_special_tokens)
            prompt = tuple(ids)
        check_prompt_length(prompt, self.bounds, param)
        return prompt

    def job(
        self,
        rid: str,
        prompt_ids: tuple[int, ...],
        s: SamplingRequest,
        stream: bool,
        labels: dict[str, str],
        *,
        logprobs: int | None = None,
        choice: int = 0,
    ) -> GenerateJob:
        base = () if s.ignore_eos else self.eos_ids  # the request's own stop ids hold even then
        sampling = Sampling(
            max_new_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            stop_token_ids=tuple(dict.fromkeys((*base, *s.stop_token_ids))),
            ignore_eos=s.ignore_eos,
            seed=None if s.seed is None else (s.seed + choice) % 2**64,
        )
        return GenerateJob(rid, prompt_ids, sampling, stream, labels, logprobs)

    def choices(
        self,
        rid: str,
        prompt_ids: tuple[int, ...],
        s: SamplingRequest,
        stream: bool,
        labels: dict[str, str],
        *,
        n: int = 1,
        logprobs: int | None = None,
    ) -> Choices:
        """The request's n generations: one job each (rid `<rid>-<i>` when n > 1, seed + i)."""
        gens = []
        for i in range(n):
            job_rid = rid if n == 1 else f"{rid}-{i}"
            job = self.job(job_rid, prompt_ids, s, stream, labels, logprobs=logprobs, choice=i)
            gens.append(Generation(self.generator, job, Detokenizer(self.tokenizer, s.stop)))
        return Choices(gens)


CLIENT_API = web.AppKey("lumen_client_api", ClientApi)
KEY_ID = web.RequestKey("lumen_key_id", str)  # the matched API key's key_id; absent when auth is off


def add_client_routes(
    app: web.Application, *, config: Config, tokenizer: Tokenizer, generator: Generator
) -> None:
    """Register the client API on `app`. Raises ConfigError if the chat template does not load."""
    eos = tuple(dict.fromkeys((*tokenizer.eos_token_ids, *config.tokenizer.eos_token_ids)))
    app[CLIENT_API] = ClientApi(
        config=config,
        tokenizer=tokenizer,
        generator=generator,
        template=ChatTemplate.load(config.tokenizer.chat_template, tokenizer),
        bounds=bounds_of(config, tokenizer.vocab_size),
        eos_ids=eos,
        created=int(time.time()),
    )
    guard = _guard(config.gateway.api_keys)
    app.router.add_post("/v1/completions", guard(completions))
    app.router.add_post("/v1/chat/completions", guard(chat_completions))
    app.router.add_get("/v1/models", guard(list_models))
    app.router.add_get("/v1/models/{model:.+}", guard(get_model))  # names may hold "/"
    app.router.add_post("/generate", guard(generate))


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _guard(keys: tuple[str, ...]) -> Callable[[Handler], Handler]:
    def wrap(handler: Handler) -> Handler:
        async def guarded(request: web.Request) -> web.StreamResponse:
            found = check_bearer(request, keys)
            if found is not None:
                request[KEY_ID] = found
            return await handler(request)

        return guarded

    return wrap


def _labels(request: web.Request, endpoint: str) -> dict[str, str]:
    labels = {"endpoint": endpoint}
    if KEY_ID in request:
        labels["api_key"] = request[KEY_ID]
    return labels


# what aiohttp decompresses for us (a body in another encoding would reach the JSON parser as bytes)
READABLE_ENCODINGS = ("identity", "gzip", "deflate")


async def read_json(request: web.Request, limit: int) -> dict[str, object]:
    """The body as one JSON object, refusing (413) more than `limit` bytes before reading them all."""
    if request.content_length is not None and request.content_length > limit:
        raise RequestTooLarge(f"the request body has {request.content_length} bytes; the limit is {limit}")
    encoding = request.headers.get(hdrs.CONTENT_ENCODING, "identity").strip().lower()
    if encoding not in READABLE_ENCODINGS:
        raise InvalidRequest(
            f"Content-Encoding {encoding!r} is not supported (use one of {', '.join(READABLE_ENCODINGS)})",
            param="Content-Encoding",
            code="unsupported_encoding",
        )
    buf = bytearray()
    try:
        async for chunk in request.content.iter_any():
            buf += chunk
            if len(buf) > limit:
                raise RequestTooLarge(f"the request body exceeds the limit of {limit} bytes")
    except web.RequestPayloadError as exc:  # e.g. a gzip body that is not gzip
        raise UnreadableBody(f"the request body could not be read as {encoding}") from exc
    return decode_object(bytes(buf))


async def completions(request: web.Request) -> web.StreamResponse:
    api = request.config_dict[CLIENT_API]
    req = parse_completion(await read_json(request, api.config.limits.max_request_bytes), api.bounds)
    ids = await api.encode(req.prompt, add_special_tokens=True, param="prompt")
    rid = f"cmpl-{uuid.uuid4().hex}"
    labels = _labels(request, "completions")
    choices = api.choices(rid, ids, req.sampling, req.stream, labels, n=req.n, logprobs=req.logprobs)
    envelope = CompletionEnvelope(rid, req.model, int(time.time()), req.include_usage)
    return await respond(request, choices, OpenAIFormat(envelope, api.tokenizer.token_text), req.stream)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    api = request.config_dict[CLIENT_API]
    req = parse_chat(await read_json(request, api.config.limits.max_request_bytes), api.bounds)
    text = api.template.render(req.messages)
    # the template places BOS and other specials itself
    ids = await api.encode(text, add_special_tokens=False, param="messages")
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    labels = _labels(request, "chat")
    choices = api.choices(rid, ids, req.sampling, req.stream, labels, n=req.n, logprobs=req.logprobs)
    envelope = ChatEnvelope(rid, req.model, int(time.time()), req.include_usage)
    return await respond(request, choices, OpenAIFormat(envelope, api.tokenizer.token_text), req.stream)


async def generate(request: web.Request) -> web.StreamResponse:
    api = request.config_dict[CLIENT_API]
    req = parse_generate(await read_json(request, api.config.limits.max_request_bytes), api.bounds)
    param = "text" if isinstance(req.prompt, str) else "input_ids"
    ids = await api.encode(req.prompt, add_special_tokens=True, param=param)
    labels = _labels(request, "generate")
    # a client's rid names the response only: jobs get unique gateway ids, so clients cannot collide
    rid = f"gen-{uuid.uuid4().hex}"
    choices = api.choices(rid, ids, req.sampling, req.stream, labels, logprobs=req.logprobs)
    fmt = NativeFormat(req.rid or rid, api.tokenizer.token_text if req.return_text_in_logprobs else None)
    return await respond(request, choices, fmt, req.stream)


def _model_card(api: ClientApi) -> dict[str, object]:
    return {"id": api.bounds.model, "object": "model", "created": api.created, "owned_by": "lumen"}


async def list_models(request: web.Request) -> web.StreamResponse:
    api = request.config_dict[CLIENT_API]
    return _json({"object": "list", "data": [_model_card(api)]})


async def get_model(request: web.Request) -> web.StreamResponse:
    api = request.config_dict[CLIENT_API]
    if request.match_info["model"] != api.bounds.model:
        raise ModelNotFound(f"the model '{request.match_info['model']}' does not exist", param="model")
    return _json(_model_card(api))


def _json(obj: object) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), content_type="application/json")


async def respond(request: web.Request, choices: Choices, fmt: Format, stream: bool) -> web.StreamResponse:
    gens = choices.gens
    async with choices:  # closes every generator on every way out, cancellation included
        if not stream:
            parts: list[list[str]] = [[] for _ in gens]
            while (got := await choices.next()) is not None:
                parts[got[0]].append(got[1].text)
            return _json(fmt.response(["".join(p) for p in parts], gens))
        first = await choices.next()  # raises before any output: the middleware answers with a status
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        try:
            got = first
            while got is not None:
                index, step = got
                for chunk in fmt.chunks(index, step, gens[index]):
                    await resp.write(sse_event(chunk))
                got = await choices.next()
            for chunk in fmt.closing(gens):
                await resp.write(sse_event(chunk))
            await resp.write(SSE_DONE)
        except ConnectionResetError:
            log.debug("client left mid-stream", rid=choices.job.rid)
        except GatewayError as exc:
            await _write_error(resp, exc.body())
        except Exception:
            # the status is already sent, so the error middleware cannot answer: end the stream cleanly
            log.exception("stream failed", rid=choices.job.rid)
            await _write_error(resp, error_body("internal server error", "internal_error"))
        return resp


async def _write_error(resp: web.StreamResponse, body: dict[str, object]) -> None:
    try:
        await resp.write(sse_event(body))
    except ConnectionResetError:
        pass
