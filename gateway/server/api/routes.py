"""Client routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, POST /generate.

A handler reads and validates the request (gateway.protocol.openai.requests, against the Bounds of
schemas.py), tokenizes it (applying the chat template), builds a `GenerateJob` per choice, and renders
what `Generator.generate` yields (formats.py, over gateway.protocol.openai.envelopes). It never sees
workers.

`n` choices are n jobs, each its own session on the workers (its own rid, `<id>-<i>`; its own seed,
the request's seed + i, or one drawn for it), read together (generation.Choices): a worker failure
resumes only the choices it served, each exactly. A stream's chunks carry their choice's `index`.

Streams are SSE (respond.py: the response, whole or streamed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import structlog
from aiohttp import hdrs, web

from gateway.config import Config
from gateway.protocol.openai.envelopes import (
    ChatEnvelope,
    CompletionEnvelope,
)
from gateway.protocol.openai.fields import decode_object
from gateway.protocol.openai.requests import (
    Bounds,
    Prompt,
    SamplingRequest,
    parse_chat,
    parse_completion,
    parse_generate,
)
from gateway.protocol.streamid import RESUMABLE_HEADER, asks_resumable, stream_key
from gateway.server.api.admission import KEY_ID, fair_generator, guard, limiter_of
from gateway.server.api.chat_template import ChatTemplate
from gateway.server.api.detokenize import Detokenizer
from gateway.server.api.errors import (
    InvalidRequest,
    ModelNotFound,
    RequestTimeout,
    RequestTooLarge,
    UnreadableBody,
)
from gateway.server.api.formats import NativeFormat, OpenAIFormat
from gateway.server.api.generation import Choices, Generation
from gateway.server.api.jobs import GenerateJob, Generator, Sampling
from gateway.server.api.openapi import ClientRoute, document
from gateway.server.api.ratelimit import KeyLimiter
from gateway.server.api.respond import REPLAY_HEADER, json_response, respond
from gateway.server.api.resume import LAST_EVENT_ID, ResumePoint, StreamIds, draw_seed, resume_point
from gateway.server.api.schemas import bounds_of, check_prompt_length
from gateway.server.api.tokenizer import Tokenizer
from gateway.server.trace_recorder import TraceRecorder

log = structlog.get_logger(__name__)

# texts longer than this are tokenized off the event loop
_THREAD_ENCODE_CHARS = 32 * 1024


@dataclass(slots=True)
class ClientApi:
    # config and bounds are replaced whole by a live change of the limits (server/live_config.py)
    config: Config
    tokenizer: Tokenizer
    generator: Generator
    template: ChatTemplate
    bounds: Bounds
    eos_ids: tuple[int, ...]  # the tokenizer's EOS ids plus tokenizer.eos_token_ids from the config
    created: int
    stream_key: bytes  # signs stream positions (resume.py); the same on every gateway of the cluster
    # the guarded client routes by (method, canonical path), and /openapi.json once built
    routes: dict[tuple[str, str], ClientRoute] = field(default_factory=dict)
    openapi: dict[str, bytes] = field(default_factory=dict)
    # what a sampled request's replay is (the `Lumen-Replay` header's value, or None): sessions.py
    replay_note: Callable[[bool], str | None] | None = None
    # the traffic trace (gateway.record_trace; trace_recorder.py), or None
    recorder: TraceRecorder | None = None
    # the per-key limiter the admission guard uses (None: no per-key limit at start); its limits are
    # replaced by a live change (server/live_config.py)
    limiter: KeyLimiter | None = None

    def replay_headers(self, s: SamplingRequest) -> dict[str, str]:
        """`Lumen-Replay: not-reproducible; reason=...` for a sampled request where a live server
        ignores `sampling_seed` (docs/sglang.md, Determinism); nothing otherwise."""
        sampled = s.temperature > 0.0 and s.top_k != 1
        note = self.replay_note(sampled) if self.replay_note is not None else None
        return {REPLAY_HEADER: note} if note else {}

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

    async def read_body(self, request: web.Request) -> dict[str, object]:
        lim = self.config.limits
        return await read_json(request, lim.max_request_bytes, lim.body_timeout_s)

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
        seed: int | None = None,
    ) -> GenerateJob:
        """`seed`: the choice's seed base when the request names none (drawn for streams, so a
        resumed stream samples the same tokens; taken from the position when resuming)."""
        base = () if s.ignore_eos else self.eos_ids  # the request's own stop ids hold even then
        sampling = Sampling(
            max_new_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            stop_token_ids=tuple(dict.fromkeys((*base, *s.stop_token_ids))),
            ignore_eos=s.ignore_eos,
            seed=seed if s.seed is None else (s.seed + choice) % 2**64,
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
        resume: ResumePoint | None = None,
    ) -> Choices:
        """The request's n generations: one job each (rid `<rid>-<i>` when n > 1, seed + i). A
        resumed request's jobs get rids of their own (its first attempts may still run somewhere)."""
        gens = []
        base_rid = rid if resume is None else f"{rid}.r{secrets.token_hex(3)}"
        for i in range(n):
            job_rid = base_rid if n == 1 else f"{base_rid}-{i}"
            seed = resume.seed(i) if resume is not None else draw_seed() if stream else None
            job = self.job(job_rid, prompt_ids, s, stream, labels, logprobs=logprobs, choice=i, seed=seed)
            if resume is not None:
                job = dataclasses.replace(job, adopt=resume.adopt(i))
            detok = Detokenizer(self.tokenizer, s.stop)
            gens.append(
                Generation(self.generator, job, detok, resume.resumed(i) if resume is not None else None)
            )
        return Choices(gens)

    def resume_point(
        self, request: web.Request, body: dict[str, object], n: int, stream: bool
    ) -> ResumePoint | None:
        caller = request.get(KEY_ID, "")
        return resume_point(
            request.headers.get(LAST_EVENT_ID),
            self.stream_key,
            body,
            caller,
            n,
            stream,
            ttl_s=self.config.recovery.resume_ttl_s,
        )

    def stream_ids(
        self, request: web.Request, body: dict[str, object], rid: str, created: int, choices: Choices,
        resume: ResumePoint | None,
    ) -> StreamIds | None:  # fmt: skip
        """The positions of a resumable stream, or None: a stream framed as SGLang and OpenAI servers
        frame theirs (no `id:` lines, no keep-alive comments) unless the request asks (header
        `Lumen-Resumable`, or a Last-Event-ID) or the gateway or the caller's key is configured so."""
        caller = request.get(KEY_ID, "")
        g = self.config.gateway
        wanted = (
            resume is not None
            or g.resumable_streams
            or asks_resumable(request.headers.get(RESUMABLE_HEADER))
            or (bool(caller) and caller in g.resumable_keys)
        )
        if not wanted:
            return None
        return StreamIds(self.stream_key, body, caller, rid, created, choices.gens, resume)


CLIENT_API = web.AppKey("lumen_client_api", ClientApi)


def add_client_routes(
    app: web.Application,
    *,
    config: Config,
    tokenizer: Tokenizer,
    generator: Generator,
    replay_note: Callable[[bool], str | None] | None = None,
) -> None:
    """Register the client API and /openapi.json on `app`. Raises ConfigError if the chat template
    does not load."""
    eos = tuple(dict.fromkeys((*tokenizer.eos_token_ids, *config.tokenizer.eos_token_ids)))
    api = app[CLIENT_API] = ClientApi(
        config=config,
        tokenizer=tokenizer,
        # each choice's work admitted through fair shares between keys (admission.py, issue 29)
        generator=fair_generator(generator, config.limits),
        template=ChatTemplate.load(config.tokenizer.chat_template, tokenizer),
        bounds=bounds_of(config, tokenizer.vocab_size),
        eos_ids=eos,
        created=int(time.time()),
        stream_key=stream_key(config.gateway.control_token),
        replay_note=replay_note,
    )
    g = config.gateway
    if g.record_trace:
        api.recorder = TraceRecorder(g.record_trace, g.record_trace_max_bytes)

        async def close_trace(_app: web.Application) -> None:
            if api.recorder is not None:
                api.recorder.close()

        app.on_cleanup.append(close_trace)
    api.limiter = limiter_of(config.limits)
    guarded = guard(config.gateway.api_keys, api.limiter)
    for method, path, handler, body in (
        ("POST", "/v1/completions", completions, "completion"),
        ("POST", "/v1/chat/completions", chat_completions, "chat"),
        ("GET", "/v1/models", list_models, None),
        ("GET", "/v1/models/{model:.+}", get_model, None),  # names may hold "/"
        ("POST", "/generate", generate, "generate"),
    ):
        add = app.router.add_get if method == "GET" else app.router.add_post  # a GET answers HEAD too
        route = add(path, guarded(handler))
        canonical = route.resource.canonical if route.resource is not None else path
        api.routes[(method, canonical)] = ClientRoute(method, canonical, body)
    app.router.add_get("/openapi.json", openapi_json)


def _labels(request: web.Request, endpoint: str) -> dict[str, str]:
    labels = {"endpoint": endpoint}
    if KEY_ID in request:
        labels["api_key"] = request[KEY_ID]
    return labels


# what aiohttp decompresses for us (a body in another encoding would reach the JSON parser as bytes)
READABLE_ENCODINGS = ("identity", "gzip", "deflate")


async def read_json(request: web.Request, limit: int, timeout_s: float) -> dict[str, object]:
    """The body as one JSON object, refusing (413) more than `limit` bytes before reading them all,
    and (408) a body still incomplete after `timeout_s`."""
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
        async with asyncio.timeout(timeout_s):
            async for chunk in request.content.iter_any():
                buf += chunk
                if len(buf) > limit:
                    raise RequestTooLarge(f"the request body exceeds the limit of {limit} bytes")
    except web.RequestPayloadError as exc:  # e.g. a gzip body that is not gzip
        raise UnreadableBody(f"the request body could not be read as {encoding}") from exc
    except TimeoutError as exc:
        raise RequestTimeout(
            f"the request body did not arrive within {timeout_s:g} s ({len(buf)} bytes read)"
        ) from exc
    return decode_object(bytes(buf))


async def completions(request: web.Request) -> web.StreamResponse:
    """OpenAI completions"""
    api = request.config_dict[CLIENT_API]
    body = await api.read_body(request)
    req = parse_completion(body, api.bounds)
    resume = api.resume_point(request, body, req.n, req.stream)
    ids = await api.encode(req.prompt, add_special_tokens=True, param="prompt")
    rid, created = (resume.rid, resume.created) if resume else (f"cmpl-{uuid.uuid4().hex}", int(time.time()))
    labels = _labels(request, "completions")
    choices = api.choices(
        rid, ids, req.sampling, req.stream, labels, n=req.n, logprobs=req.logprobs, resume=resume
    )
    envelope = CompletionEnvelope(rid, req.model, created, req.include_usage)
    fmt = OpenAIFormat(envelope, api.tokenizer.token_text)
    positions = api.stream_ids(request, body, rid, created, choices, resume) if req.stream else None
    return await respond(
        request,
        choices,
        fmt,
        req.stream,
        api.config.limits.sse_keepalive_s,
        positions,
        headers=api.replay_headers(req.sampling),
        record=api.recorder.record if api.recorder is not None else None,
    )


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """OpenAI chat completions"""
    api = request.config_dict[CLIENT_API]
    body = await api.read_body(request)
    req = parse_chat(body, api.bounds)
    resume = api.resume_point(request, body, req.n, req.stream)
    text = api.template.render(req.messages)
    # the template places BOS and other specials itself
    ids = await api.encode(text, add_special_tokens=False, param="messages")
    rid, created = (
        (resume.rid, resume.created) if resume else (f"chatcmpl-{uuid.uuid4().hex}", int(time.time()))
    )
    labels = _labels(request, "chat")
    choices = api.choices(
        rid, ids, req.sampling, req.stream, labels, n=req.n, logprobs=req.logprobs, resume=resume
    )
    envelope = ChatEnvelope(rid, req.model, created, req.include_usage)
    fmt = OpenAIFormat(envelope, api.tokenizer.token_text)
    positions = api.stream_ids(request, body, rid, created, choices, resume) if req.stream else None
    return await respond(
        request,
        choices,
        fmt,
        req.stream,
        api.config.limits.sse_keepalive_s,
        positions,
        headers=api.replay_headers(req.sampling),
        record=api.recorder.record if api.recorder is not None else None,
    )


async def generate(request: web.Request) -> web.StreamResponse:
    """SGLang-native generation from text or token ids"""
    api = request.config_dict[CLIENT_API]
    body = await api.read_body(request)
    req = parse_generate(body, api.bounds)
    resume = api.resume_point(request, body, 1, req.stream)
    param = "text" if isinstance(req.prompt, str) else "input_ids"
    ids = await api.encode(req.prompt, add_special_tokens=True, param=param)
    labels = _labels(request, "generate")
    # a client's rid names the response only: jobs get unique gateway ids, so clients cannot collide
    rid = resume.rid if resume else f"gen-{uuid.uuid4().hex}"
    choices = api.choices(rid, ids, req.sampling, req.stream, labels, logprobs=req.logprobs, resume=resume)
    fmt = NativeFormat(req.rid or rid, api.tokenizer.token_text if req.return_text_in_logprobs else None)
    positions = api.stream_ids(request, body, rid, 0, choices, resume) if req.stream else None
    return await respond(
        request,
        choices,
        fmt,
        req.stream,
        api.config.limits.sse_keepalive_s,
        positions,
        headers=api.replay_headers(req.sampling),
        record=api.recorder.record if api.recorder is not None else None,
    )


def _model_card(api: ClientApi) -> dict[str, object]:
    return {"id": api.bounds.model, "object": "model", "created": api.created, "owned_by": "lumen"}


async def list_models(request: web.Request) -> web.StreamResponse:
    """The served model"""
    api = request.config_dict[CLIENT_API]
    return json_response({"object": "list", "data": [_model_card(api)]})


async def get_model(request: web.Request) -> web.StreamResponse:
    """The served model by name"""
    api = request.config_dict[CLIENT_API]
    if request.match_info["model"] != api.bounds.model:
        raise ModelNotFound(f"the model '{request.match_info['model']}' does not exist", param="model")
    return json_response(_model_card(api))


async def openapi_json(request: web.Request) -> web.StreamResponse:
    """This API as OpenAPI 3.1"""
    api = request.config_dict[CLIENT_API]
    if "doc" not in api.openapi:
        doc = document(
            request.app.router.routes(),
            api.routes,
            api.bounds,
            title="Lumen gateway client API",
            version=_version(),
            keys=bool(api.config.gateway.api_keys),
        )
        api.openapi["doc"] = msgspec.json.encode(doc)
    return web.Response(body=api.openapi["doc"], content_type="application/json")


def _version() -> str:
    try:
        return importlib.metadata.version("lumen")
    except importlib.metadata.PackageNotFoundError:
        return "0"
