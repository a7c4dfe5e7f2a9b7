"""OpenAI-compatible `/v1/completions` and `/v1/chat/completions` on the worker.

Gateways such as SMG forward OpenAI requests to a worker as they are (SMG adds `echo: false` or
`logprobs: false` and nothing else), and clients may talk to a worker directly. Both routes run the
worker's own /generate path: the request becomes a `GenerateRequest` for `Engine.submit`, the handle's
emissions are read in order (one SSE event per engine step, whatever else is already queued coalesced
into one write), and a client that goes away aborts the request in the engine, as /generate does.

Text: the synthetic model's vocabulary is the byte vocabulary (`gateway.protocol.bytevocab`, which
the gateway's `ByteTokenizer` uses too: ids 0..255 are bytes, 256..258 the specials). Text prompts
are encoded as the gateway encodes them, so a text prompt reaches the engine
with the same ids it would have through Lumen's gateway; output ids decode as UTF-8, incrementally
while streaming (a multi-byte character is never split across chunks). Chat messages are rendered
with the gateway's default chat template (`<|role|>\\ncontent\\n` per message, then `<|assistant|>\\n`).
A worker with another vocabulary has no tokenizer here and answers 501.

Sampling follows the gateway's mapping: `seed` (modulo 2**64) is the engine's `seed_base` (0 when
absent, as for a /generate without Lumen's extension); the EOS id stops a generation unless
`ignore_eos`. `max_tokens` defaults to 16 for completions (OpenAI's default) and to 128 for chat
(/generate's default). Unknown fields are ignored; known fields the worker cannot honour (stop strings,
logprobs, echo, n > 1, penalties, tools, ...) are refused with 400 unless they hold a neutral value.
Errors use OpenAI's body, `{"error": {"message", "type", "param", "code"}}`. A stream that the engine
aborts ends with one `data: {"error": ...}` event and no `data: [DONE]`, as Lumen's gateway does.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog
from aiohttp import web

from gateway.protocol import bytevocab
from gateway.protocol.generate import GenerateRequest, LumenExt, SamplingParams
from gateway.protocol.launch import EngineSpec
from worker_hooks.engine.errors import EngineError, PromptTooLong
from worker_hooks.engine.handle import RequestHandle
from worker_hooks.engine.scheduler import Emission
from worker_hooks.engine.server import WORKER, json_response

log = structlog.get_logger(__name__)

Json = dict[str, Any]

ROLES = ("system", "user", "assistant", "tool")

DEFAULT_MAX_TOKENS_COMPLETIONS = 16
DEFAULT_MAX_TOKENS_CHAT = SamplingParams().max_new_tokens
MAX_STOP_TOKEN_IDS = 256
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_DONE = b"data: [DONE]\n\n"
_encoder = msgspec.json.Encoder()


class OpenAIError(Exception):
    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body: Json = {"error": {"message": message, "type": type, "param": param, "code": code}}

    @classmethod
    def of(cls, exc: EngineError, param: str | None = None) -> OpenAIError:
        return cls(exc.message, status=exc.status, type=exc.type, param=param, code=exc.code)

    def response(self) -> web.Response:
        return json_response(self.body, status=self.status)


# -- chat ----------------------------------------------------------------------------------------------


def render_chat(messages: list[tuple[str, str]]) -> str:
    """The gateway's default chat template (gateway.server.chat_template.DEFAULT_TEMPLATE)."""
    return "".join(f"<|{role}|>\n{content}\n" for role, content in messages) + "<|assistant|>\n"


# -- request parsing -----------------------------------------------------------------------------------


def _type(v: object) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int | float):
        return "number"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


def _fail(param: str, why: str, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(f"'{param}' {why}", param=param, code=code)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _Fields:
    """Typed reads from one JSON object; `null` reads as not given."""

    def __init__(self, obj: Json, prefix: str = "") -> None:
        self.obj, self.prefix = obj, prefix

    def get(self, key: str) -> Any:
        return self.obj.get(key)

    def fail(self, key: str, why: str, code: str = "invalid_value") -> OpenAIError:
        return _fail(self.prefix + key, why, code)

    def wrong(self, key: str, want: str) -> OpenAIError:
        return self.fail(key, f"must be {want}, got {_type(self.obj[key])}", "invalid_type")

    def integer(self, key: str, default: int, lo: int, hi: int | None = None) -> int:
        v = self.obj.get(key)
        if v is None:
            return default
        if not _is_int(v):
            raise self.wrong(key, "an integer")
        if v < lo or (hi is not None and v > hi):
            raise self.fail(key, f"must be in [{lo}, {'inf' if hi is None else hi}], got {v}")
        return int(v)

    def number(self, key: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
        v = self.obj.get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise self.wrong(key, "a finite number")
        if v > hi or v < lo or (lo_open and v == lo):
            raise self.fail(key, f"must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v}")
        return float(v)

    def boolean(self, key: str, default: bool) -> bool:
        v = self.obj.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise self.wrong(key, "a boolean")
        return v

    def string(self, key: str) -> str | None:
        v = self.obj.get(key)
        if v is not None and not isinstance(v, str):
            raise self.wrong(key, "a string")
        return v

    def token_ids(self, key: str, vocab: int, *, required: bool = False) -> list[int]:
        v = self.obj.get(key)
        if v is None:
            return []
        if not isinstance(v, list):
            raise self.wrong(key, "an array of token ids")
        if required and not v:
            raise self.fail(key, "must not be empty")
        for i, t in enumerate(v):
            if not _is_int(t) or not 0 <= t < vocab:
                raise self.fail(key, f"[{i}] = {t!r} is not a token id (0..{vocab - 1})")
        return v

    def neutral(self, key: str, allowed: tuple[object, ...], what: str) -> None:
        """Refuse a known field the worker cannot honour unless it holds a neutral value."""
        v = self.obj.get(key)
        if v is not None and not any(v == a and type(v) is type(a) for a in allowed):
            raise self.fail(key, f"is not supported ({what})", "unsupported_parameter")


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    input_ids: list[int]
    params: SamplingParams
    seed: int
    stream: bool
    include_usage: bool
    model: str


def _decode_body(raw: bytes) -> Json:
    try:
        body = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise OpenAIError(f"the request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise OpenAIError(f"the request body must be a JSON object, got {_type(body)}", code="invalid_json")
    return body


def _common(
    f: _Fields, spec: EngineSpec, ids: list[int], max_keys: tuple[str, ...], default_max: int
) -> OpenAIRequest:
    model = f.string("model") or spec.model
    stream = f.boolean("stream", False)
    opts = f.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise f.wrong("stream_options", "an object")
    include_usage = _Fields(opts, "stream_options.").boolean("include_usage", False) if opts else False
    max_tokens = default_max
    for key in max_keys:  # the later key (max_completion_tokens) wins when both are given
        max_tokens = f.integer(key, max_tokens, 0)
    if f.integer("n", 1, 1) != 1:
        raise f.fail("n", "must be 1: the worker returns one choice per request", "unsupported_parameter")
    for key in ("presence_penalty", "frequency_penalty"):
        if f.number(key, 0.0, -2.0, 2.0) != 0.0:
            raise f.fail(key, "is not supported (only 0)", "unsupported_parameter")
    if f.number("repetition_penalty", 1.0, 0.0, 2.0, lo_open=True) != 1.0:
        raise f.fail("repetition_penalty", "is not supported (only 1)", "unsupported_parameter")
    f.neutral("logit_bias", ({},), "logit bias")
    f.neutral("stop", ("", []), "stop strings; send stop_token_ids")
    f.string("user")
    top_k = f.integer("top_k", -1, -1)
    if top_k == 0:
        raise f.fail("top_k", "must be -1 (disabled) or >= 1, got 0")
    ignore_eos = f.boolean("ignore_eos", False)
    stop_ids = f.token_ids("stop_token_ids", spec.vocab_size)
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise f.fail("stop_token_ids", f"may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(stop_ids)}")
    if not ignore_eos:  # the request's own stop ids hold even with ignore_eos
        stop_ids = [bytevocab.EOS_ID, *(t for t in stop_ids if t != bytevocab.EOS_ID)]
    v = f.get("seed")
    if v is not None and (not _is_int(v) or not SEED_MIN <= v <= SEED_MAX):
        raise f.fail("seed", f"must be an integer in [{SEED_MIN}, {SEED_MAX}], got {v!r}")
    params = SamplingParams(
        max_new_tokens=max_tokens,
        temperature=f.number("temperature", 1.0, 0.0, 2.0),
        top_p=f.number("top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=top_k,
        stop_token_ids=stop_ids,
        ignore_eos=ignore_eos,
    )
    return OpenAIRequest(ids, params, 0 if v is None else v % 2**64, stream, include_usage and stream, model)


def parse_completion(body: Json, spec: EngineSpec) -> OpenAIRequest:
    f = _Fields(body)
    f.neutral("echo", (False,), "the prompt cannot be echoed")
    f.neutral("logprobs", (0,), "log probabilities are not returned")
    f.neutral("best_of", (1,), "only best_of = 1")
    f.neutral("suffix", ("",), "suffixes are not supported")
    prompt = f.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise f.fail("prompt", f"must hold one prompt; batches ({len(prompt)}) are not supported")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = bytevocab.encode(prompt)
    elif isinstance(prompt, list):
        ids = _Fields({"prompt": prompt}).token_ids("prompt", spec.vocab_size)
    elif prompt is None:
        raise f.fail("prompt", "is required", "missing_required_parameter")
    else:
        raise f.wrong("prompt", "a string or an array of token ids")
    if not ids:
        raise f.fail("prompt", "is empty")
    return _common(f, spec, ids, ("max_tokens",), DEFAULT_MAX_TOKENS_COMPLETIONS)


def parse_chat(body: Json, spec: EngineSpec) -> OpenAIRequest:
    f = _Fields(body)
    f.neutral("logprobs", (False,), "log probabilities are not returned")
    f.neutral("top_logprobs", (0,), "log probabilities are not returned")
    f.neutral("tools", ([],), "tool calling is not supported")
    f.neutral("functions", ([],), "function calling is not supported")
    f.neutral("response_format", ({"type": "text"},), "only response_format type 'text'")
    items = f.get("messages")
    if items is None:
        raise f.fail("messages", "is required", "missing_required_parameter")
    if not isinstance(items, list):
        raise f.wrong("messages", "an array of messages")
    if not items:
        raise f.fail("messages", "must not be empty")
    messages = [_message(m, f"messages[{i}]") for i, m in enumerate(items)]
    ids = bytevocab.encode(render_chat(messages))
    return _common(f, spec, ids, ("max_tokens", "max_completion_tokens"), DEFAULT_MAX_TOKENS_CHAT)


def _message(m: object, where: str) -> tuple[str, str]:
    if not isinstance(m, dict):
        raise _fail(where, f"must be an object, got {_type(m)}", "invalid_type")
    mf = _Fields(m, f"{where}.")
    role = mf.string("role")
    if role is None:
        raise mf.fail("role", "is required", "missing_required_parameter")
    role = "system" if role == "developer" else role  # OpenAI's newer name for system
    if role not in ROLES:
        raise mf.fail("role", f"must be one of {', '.join(ROLES)}, got {role!r}")
    content = m.get("content")
    if content is None and role == "assistant":
        return role, ""
    if isinstance(content, str):
        return role, content
    if not isinstance(content, list):
        raise _fail(f"{where}.content", f"must be a string or an array of text parts, got {_type(content)}")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise _fail(at, "must be a text part {'type': 'text', 'text': string} (only text is supported)")
        texts.append(part["text"])
    return role, "\n".join(texts)


# -- responses -----------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Format:
    kind: str  # "completion" | "chat"
    rid: str
    model: str
    created: int
    include_usage: bool
    started: bool = False

    def base(self, obj: str, choices: list[Json]) -> Json:
        return {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _chunk(self, choice: Json) -> bytes:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        chunk = self.base(obj, [choice])
        if self.include_usage:
            chunk["usage"] = None  # OpenAI: with include_usage, every chunk but the last has usage: null
        return b"data: " + _encoder.encode(chunk) + b"\n\n"

    def events(self, text: str, finish: str | None) -> bytes:
        """The SSE events of one engine step."""
        if self.kind == "completion":
            if not text and finish is None:
                return b""
            return self._chunk({"index": 0, "text": text, "logprobs": None, "finish_reason": finish})
        out = b""
        if not self.started:
            self.started = True
            out += self._delta({"role": "assistant", "content": ""}, None)
        if text:
            out += self._delta({"content": text}, None)
        if finish is not None:
            out += self._delta({}, finish)
        return out

    def _delta(self, delta: Json, finish: str | None) -> bytes:
        return self._chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish})

    def usage_event(self, usage: Json) -> bytes:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        return b"data: " + _encoder.encode(self.base(obj, []) | {"usage": usage}) + b"\n\n"

    def response(self, text: str, finish: str, usage: Json) -> Json:
        if self.kind == "completion":
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            return self.base("text_completion", [choice]) | {"usage": usage}
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        return self.base("chat.completion", [choice]) | {"usage": usage}


def _usage(handle: RequestHandle, completion_tokens: int) -> Json:
    return {
        "prompt_tokens": handle.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": handle.prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": handle.restored_tokens},
    }


def _aborted(e: Emission) -> OpenAIError | None:
    if e.finish is None or e.finish.type != "abort":
        return None
    return OpenAIError(
        f"the generation was aborted: {e.finish.message or 'aborted'}",
        status=503,
        type="service_unavailable",
        code="request_aborted",
    )


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "completion", "cmpl", "prompt", parse_completion)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, "chat", "chatcmpl", "messages", parse_chat)


async def _serve(
    request: web.Request,
    kind: str,
    prefix: str,
    prompt_param: str,
    parse: Callable[[Json, EngineSpec], OpenAIRequest],
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
        req = parse(_decode_body(await request.read()), worker.spec)
        gen = GenerateRequest(
            input_ids=req.input_ids,
            rid=rid,
            sampling_params=req.params,
            stream=req.stream,
            lumen=LumenExt(seed_base=req.seed),  # epoch 0: not fenced by an incarnation reset
        )
        try:
            handle = engine.submit(gen)
        except PromptTooLong as exc:
            raise OpenAIError.of(exc, prompt_param) from exc
        except EngineError as exc:
            raise OpenAIError.of(exc) from exc
    except OpenAIError as exc:
        return exc.response()
    fmt = _Format(kind, rid, req.model, int(time.time()), req.include_usage)
    try:
        if req.stream:
            return await _stream(request, handle, fmt)
        return await _unary(handle, fmt)
    finally:
        # the client went away (handler cancelled or write failed) before the request finished
        if not handle.finished:
            engine.abort(handle.rid, "client disconnected")


async def _stream(request: web.Request, handle: RequestHandle, fmt: _Format) -> web.StreamResponse:
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
                    data += b"data: " + _encoder.encode(err.body) + b"\n\n"
                    await resp.write(bytes(data))
                    return resp
                if e.finish is not None:
                    data += fmt.events(text.step(e.new_ids) + text.finish(), e.finish.type)
                    last = e
                    break
                data += fmt.events(text.step(e.new_ids), None)
                e = handle.next_nowait()
            if last is not None:
                if fmt.include_usage:
                    data += fmt.usage_event(_usage(handle, last.completion_tokens))
                data += SSE_DONE
                await resp.write(bytes(data))
                break
            if data:
                await resp.write(bytes(data))
        await resp.write_eof()
    except ConnectionResetError:
        log.info("client disconnected", rid=handle.rid)
    return resp


async def _unary(handle: RequestHandle, fmt: _Format) -> web.Response:
    output: list[int] = []
    while True:
        e = await handle.next()
        if (err := _aborted(e)) is not None:
            return err.response()
        output.extend(e.new_ids)
        if e.finish is not None:
            text = bytevocab.Utf8Stream()
            body = fmt.response(
                text.step(output) + text.finish(), e.finish.type, _usage(handle, e.completion_tokens)
            )
            return json_response(body)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
