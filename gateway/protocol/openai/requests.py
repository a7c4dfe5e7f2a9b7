"""Client request bodies: OpenAI /v1/completions and /v1/chat/completions, SGLang-native /generate.

Each `parse_*` takes the decoded JSON object and the server's `Bounds`, and returns a frozen request
value or raises InvalidRequest (400) / ModelNotFound (404) naming the offending parameter. Unknown
top-level fields are ignored (OpenAI clients send many); known fields that cannot be honoured
(echo, penalties, tools, n above the server's limit, ...) are refused rather than silently dropped.
/generate's `sampling_params` are strict, as SGLang's are: an unknown key is refused too (sampling.py).
The gateway builds its Bounds from its config, a worker from its EngineSpec.

Log probabilities, as OpenAI defines them: a completion's `logprobs` is an integer 0..5 (the chosen
token's logprob and that many most likely tokens; `false` reads as absent), a chat's `logprobs: true`
with `top_logprobs` 0..20. Both become `logprobs`: None (not asked for) or the number of top tokens.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from gateway.protocol.openai.chat import ChatMessage, parse_messages
from gateway.protocol.openai.errors import InvalidRequest, ModelNotFound
from gateway.protocol.openai.fields import INVALID_VALUE, UNSUPPORTED, Fields, check_token_ids
from gateway.protocol.openai.sampling import HONOURED_BY_GATEWAY, check_keys

MAX_STOP_OPENAI = 4
MAX_STOP_NATIVE = 16
MAX_STOP_TOKEN_IDS = 256
MAX_RID_LEN = 128
SGLANG_MAX_TOP_K = 2**31 - 1  # SGLang's top_k is an int32
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound on a completion's `logprobs`
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on a chat's `top_logprobs` (and Lumen's on /generate's)


@dataclass(frozen=True, slots=True, kw_only=True)
class Bounds:
    """What a request is checked against: the served model, the token limits, the vocabulary."""

    model: str  # the served model, also the name answered when a request names none
    vocab_size: int
    default_max_tokens: int  # when a request gives no max_tokens / max_new_tokens
    max_new_tokens: int | None  # None: no limit of its own (the engine's capacity decides)
    min_new_tokens: int = 1
    max_top_k: int | None = SGLANG_MAX_TOP_K  # None: any (a top_k >= the vocabulary cuts nothing)
    max_prompt_tokens: int | None = None  # checked by the server once the prompt is tokenized
    echo_model: bool = False  # True: any model name is served and answered (SGLang's way); False: 404
    max_n: int = 1  # the most choices (`n`) one request may ask for


@dataclass(frozen=True, slots=True)
class SamplingRequest:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None  # in 0..2**64-1 (negative seeds are taken modulo 2**64)


Prompt = str | tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    prompt: Prompt
    sampling: SamplingRequest
    stream: bool = False
    include_usage: bool = False
    model: str = ""  # the model named in responses
    n: int = 1  # choices
    logprobs: int | None = None  # None: none returned; k: each token's logprob and its top k


@dataclass(frozen=True, slots=True)
class ChatRequest:
    messages: tuple[ChatMessage, ...]
    sampling: SamplingRequest
    stream: bool = False
    include_usage: bool = False
    model: str = ""
    n: int = 1
    logprobs: int | None = None  # None unless `logprobs: true`; then `top_logprobs` (0 when absent)


@dataclass(frozen=True, slots=True)
class NativeRequest:
    prompt: Prompt
    sampling: SamplingRequest
    stream: bool = False
    rid: str | None = None
    logprobs: int | None = None  # None unless `return_logprob`; then `top_logprobs_num`
    return_text_in_logprobs: bool = False


def parse_completion(body: dict[str, Any], b: Bounds) -> CompletionRequest:
    f = Fields(body)
    model = _model(f, b)
    for key, allowed, what in (
        ("echo", (False,), "the prompt cannot be echoed"),
        ("suffix", ("",), "suffixes are not supported"),
    ):
        f.unsupported(key, allowed, what)
    n = _n(f, b)
    best_of = f.opt_int("best_of", lo=1)
    if best_of is not None and best_of != n:
        raise f.fail(
            "best_of", f"is not supported (only best_of = n = {n}: choices are not ranked)", UNSUPPORTED
        )
    # `false` reads as absent: some clients send it although OpenAI's type is an integer
    logprobs = None if f.raw("logprobs") is False else f.opt_int("logprobs", 0, MAX_COMPLETION_LOGPROBS)
    stream, usage = _stream(f)
    prompt = _prompt(f, b)
    sampling = _openai_sampling(f, b, ("max_tokens",))
    return CompletionRequest(prompt, sampling, stream, usage, model, n, logprobs)


def parse_chat(body: dict[str, Any], b: Bounds) -> ChatRequest:
    f = Fields(body)
    model = _model(f, b)
    for key, allowed, what in (
        ("tools", ([],), "tool calling is not supported"),
        ("functions", ([],), "function calling is not supported"),
        ("response_format", ({"type": "text"},), "only response_format type 'text'"),
    ):
        f.unsupported(key, allowed, what)
    n = _n(f, b)
    want_logprobs = f.boolean("logprobs", False)
    top = f.integer("top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    if top and not want_logprobs:
        raise f.fail("top_logprobs", "needs 'logprobs': true")
    stream, usage = _stream(f)
    sampling = _openai_sampling(f, b, ("max_tokens", "max_completion_tokens"))
    logprobs = top if want_logprobs else None
    return ChatRequest(parse_messages(f), sampling, stream, usage, model, n, logprobs)


def parse_generate(body: dict[str, Any], b: Bounds) -> NativeRequest:
    f = Fields(body)
    if f.given("text") == f.given("input_ids"):
        raise InvalidRequest("exactly one of 'text' and 'input_ids' is required", param="text")
    if f.given("text"):
        prompt: Prompt = _text(f, "text")
    else:
        prompt = _ids(f, "input_ids", b.vocab_size)
    sampling = parse_sampling_params(f, b)
    rid = f.string("rid")
    if rid is not None and not (0 < len(rid) <= MAX_RID_LEN and rid.isprintable()):
        raise f.fail("rid", f"must be 1..{MAX_RID_LEN} printable characters")
    want_logprobs = f.boolean("return_logprob", False)
    top = f.integer("top_logprobs_num", 0, 0, MAX_TOP_LOGPROBS)
    if want_logprobs and f.integer("logprob_start_len", -1, lo=-1) != -1:
        raise f.fail(
            "logprob_start_len", "is not supported (prompt logprobs are not returned; only -1)", UNSUPPORTED
        )
    text_in = f.boolean("return_text_in_logprobs", False)
    return NativeRequest(
        prompt, sampling, f.boolean("stream", False), rid, top if want_logprobs else None, text_in
    )


def parse_sampling_params(
    body: Fields,
    b: Bounds,
    *,
    honoured: Collection[str] = HONOURED_BY_GATEWAY,
    max_stop_token_ids: int | None = MAX_STOP_TOKEN_IDS,
) -> SamplingRequest:
    """A /generate body's `sampling_params` (absent or null: every default). A key that is not
    `honoured` is refused unless SGLang defines it and it holds its neutral value (sampling.py); a
    server that does not honour `stop` or `sampling_seed` gets none from it."""
    sp = body.obj("sampling_params") or Fields({}, prefix="sampling_params.")
    check_keys(sp, honoured)
    return SamplingRequest(
        max_tokens=sp.integer("max_new_tokens", b.default_max_tokens, b.min_new_tokens, b.max_new_tokens),
        temperature=sp.number("temperature", 1.0, 0.0, 2.0),
        top_p=sp.number("top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=_top_k(sp, b),
        stop=sp.stop("stop", MAX_STOP_NATIVE) if "stop" in honoured else (),
        stop_token_ids=sp.token_ids("stop_token_ids", b.vocab_size, max_len=max_stop_token_ids),
        ignore_eos=sp.boolean("ignore_eos", False),
        seed=_seed(sp, "sampling_seed") if "sampling_seed" in honoured else None,
    )


# --------------------------------------------------------------------------------------------------


def _model(f: Fields, b: Bounds) -> str:
    model = f.string("model")
    if model is None:
        return b.model
    if model != b.model and not b.echo_model:
        raise ModelNotFound(
            f"the model '{model}' does not exist; this server serves '{b.model}'", param="model"
        )
    return model


def _stream(f: Fields) -> tuple[bool, bool]:
    stream = f.boolean("stream", False)
    opts = f.obj("stream_options")
    # stream_options without stream is ignored, not refused: it changes nothing in a whole response
    include_usage = opts.boolean("include_usage", False) if opts is not None else False
    return stream, include_usage and stream


def _openai_sampling(f: Fields, b: Bounds, max_keys: tuple[str, ...]) -> SamplingRequest:
    max_tokens = b.default_max_tokens
    for key in max_keys:  # the later key (max_completion_tokens) wins when both are given
        if f.given(key):
            max_tokens = f.integer(key, 0, b.min_new_tokens, b.max_new_tokens)
    for key in ("presence_penalty", "frequency_penalty"):
        if f.number(key, 0.0, -2.0, 2.0) != 0.0:
            raise f.fail(key, "is not supported (only 0)", UNSUPPORTED)
    f.unsupported("logit_bias", ({},), "logit bias is not supported")
    f.string("user")
    return SamplingRequest(
        max_tokens=max_tokens,
        temperature=f.number("temperature", 1.0, 0.0, 2.0),
        top_p=f.number("top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=_top_k(f, b),
        stop=f.stop("stop", MAX_STOP_OPENAI),
        stop_token_ids=f.token_ids("stop_token_ids", b.vocab_size, max_len=MAX_STOP_TOKEN_IDS),
        ignore_eos=f.boolean("ignore_eos", False),
        seed=_seed(f, "seed"),
    )


def _n(f: Fields, b: Bounds) -> int:
    n = f.integer("n", 1, lo=1)
    if n > b.max_n:
        why = "one choice per request is returned" if b.max_n == 1 else f"this server's limit is {b.max_n}"
        raise f.fail(
            "n", f"must be in 1..{b.max_n}, got {n} ({why})", UNSUPPORTED if b.max_n == 1 else INVALID_VALUE
        )
    return n


def _top_k(f: Fields, b: Bounds) -> int | None:
    k = f.integer("top_k", -1, lo=-1, hi=b.max_top_k)
    if k == 0:
        raise f.fail("top_k", "must be -1 (disabled) or >= 1, got 0")
    return None if k == -1 else k


def _seed(f: Fields, key: str) -> int | None:
    seed = f.opt_int(key, SEED_MIN, SEED_MAX)
    return None if seed is None else seed % 2**64


def _text(f: Fields, key: str) -> str:
    v = f.raw(key)
    if not isinstance(v, str):
        raise f.wrong(key, "a string (batched requests are not supported)")
    if not v:
        raise f.fail(key, "must not be empty")
    return v


def _ids(f: Fields, key: str, vocab_size: int) -> tuple[int, ...]:
    v = f.array(key)
    if not v:
        raise f.fail(key, "must be a non-empty array of token ids")
    return check_token_ids(v, f.name(key), vocab_size)


def _prompt(f: Fields, b: Bounds) -> Prompt:
    """A string, an array of token ids, or an array holding exactly one of those."""
    v = f.raw("prompt")
    if v is None:
        raise f.missing("prompt")
    if isinstance(v, list) and v and isinstance(v[0], str | list):
        if len(v) != 1:
            raise f.fail("prompt", f"must hold one prompt; batches ({len(v)} prompts) are not supported")
        f = Fields({"prompt": v[0]})
        v = v[0]
    if isinstance(v, str):
        return _text(f, "prompt")
    if isinstance(v, list):
        return _ids(f, "prompt", b.vocab_size)
    raise f.wrong("prompt", "a string or an array of token ids")
