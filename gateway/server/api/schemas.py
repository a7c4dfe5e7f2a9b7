"""Client request schemas: OpenAI /v1/completions and /v1/chat/completions, SGLang-native /generate.

Each `parse_*` takes the decoded JSON object and returns a frozen request value, or raises
InvalidRequest (400) / ModelNotFound (404) naming the offending parameter. Unknown top-level fields
are ignored (OpenAI clients send many); known fields this gateway cannot honour (logprobs, echo,
penalties, n > 1, tools, ...) are rejected rather than silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.config import Config
from gateway.server.api.chat_template import ROLES, ChatMessage
from gateway.server.api.errors import InvalidRequest, ModelNotFound, PromptTooLong
from gateway.server.api.params import Fields, check_token_ids, json_type

MAX_STOP_OPENAI = 4
MAX_STOP_NATIVE = 16
MAX_STOP_TOKEN_IDS = 256
MAX_RID_LEN = 128
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


@dataclass(frozen=True, slots=True)
class Bounds:
    """What a request is checked against: the served model, the limits, the vocabulary."""

    model: str
    max_new_tokens: int
    default_max_tokens: int
    max_prompt_tokens: int
    vocab_size: int

    @classmethod
    def of(cls, config: Config, vocab_size: int) -> Bounds:
        lim = config.limits
        return cls(
            config.gateway.served_model_name,
            lim.max_new_tokens,
            lim.default_max_tokens,
            lim.max_prompt_tokens,
            vocab_size,
        )


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


@dataclass(frozen=True, slots=True)
class ChatRequest:
    messages: tuple[ChatMessage, ...]
    sampling: SamplingRequest
    stream: bool = False
    include_usage: bool = False


@dataclass(frozen=True, slots=True)
class NativeRequest:
    prompt: Prompt
    sampling: SamplingRequest
    stream: bool = False
    rid: str | None = None


def parse_completion(body: dict[str, Any], b: Bounds) -> CompletionRequest:
    f = Fields(body)
    _model(f, b)
    for key, allowed, what in (
        ("logprobs", (), "log probabilities are not returned"),
        ("echo", (False,), "the prompt cannot be echoed"),
        ("best_of", (1,), "only best_of = 1"),
        ("suffix", ("",), "suffixes are not supported"),
    ):
        f.unsupported(key, allowed, what)
    stream, usage = _stream(f)
    return CompletionRequest(_prompt(f, b), _openai_sampling(f, b, ("max_tokens",)), stream, usage)


def parse_chat(body: dict[str, Any], b: Bounds) -> ChatRequest:
    f = Fields(body)
    _model(f, b)
    for key, allowed, what in (
        ("logprobs", (False,), "log probabilities are not returned"),
        ("top_logprobs", (0,), "log probabilities are not returned"),
        ("tools", ([],), "tool calling is not supported"),
        ("functions", ([],), "function calling is not supported"),
        ("response_format", ({"type": "text"},), "only response_format type 'text'"),
    ):
        f.unsupported(key, allowed, what)
    stream, usage = _stream(f)
    sampling = _openai_sampling(f, b, ("max_tokens", "max_completion_tokens"))
    return ChatRequest(_messages(f), sampling, stream, usage)


def parse_generate(body: dict[str, Any], b: Bounds) -> NativeRequest:
    f = Fields(body)
    if f.given("text") == f.given("input_ids"):
        raise InvalidRequest("exactly one of 'text' and 'input_ids' is required", param="text")
    if f.given("text"):
        prompt: Prompt = _text(f, "text")
    else:
        prompt = _ids(f, "input_ids", b.vocab_size)
    sp = f.obj("sampling_params") or Fields({}, prefix="sampling_params.")
    sampling = SamplingRequest(
        max_tokens=sp.integer("max_new_tokens", b.default_max_tokens, 1, b.max_new_tokens),
        temperature=sp.number("temperature", 1.0, 0.0, 2.0),
        top_p=sp.number("top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=_top_k(sp),
        stop=sp.stop("stop", MAX_STOP_NATIVE),
        stop_token_ids=sp.token_ids("stop_token_ids", b.vocab_size, max_len=MAX_STOP_TOKEN_IDS),
        ignore_eos=sp.boolean("ignore_eos", False),
        seed=_seed(sp, "sampling_seed"),
    )
    rid = f.string("rid")
    if rid is not None and not (0 < len(rid) <= MAX_RID_LEN and rid.isprintable()):
        raise f.fail("rid", f"must be 1..{MAX_RID_LEN} printable characters")
    return NativeRequest(prompt, sampling, f.boolean("stream", False), rid)


def check_prompt_length(ids: list[int] | tuple[int, ...], b: Bounds, param: str) -> None:
    if len(ids) > b.max_prompt_tokens:
        raise PromptTooLong(
            f"the prompt has {len(ids)} tokens; this gateway accepts at most {b.max_prompt_tokens}",
            param=param,
        )
    if not ids:
        raise InvalidRequest("the prompt is empty after tokenization", param=param)


# --------------------------------------------------------------------------------------------------


def _model(f: Fields, b: Bounds) -> None:
    model = f.string("model")
    if model is not None and model != b.model:
        raise ModelNotFound(
            f"the model '{model}' does not exist; this gateway serves '{b.model}'", param="model"
        )


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
            max_tokens = f.integer(key, 0, 1, b.max_new_tokens)
    if f.integer("n", 1, lo=1) != 1:
        raise f.fail("n", "must be 1: this gateway returns one choice per request")
    for key in ("presence_penalty", "frequency_penalty"):
        if f.number(key, 0.0, -2.0, 2.0) != 0.0:
            raise f.fail(key, "is not supported (only 0)")
    f.unsupported("logit_bias", ({},), "logit bias is not supported")
    f.string("user")
    return SamplingRequest(
        max_tokens=max_tokens,
        temperature=f.number("temperature", 1.0, 0.0, 2.0),
        top_p=f.number("top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=_top_k(f),
        stop=f.stop("stop", MAX_STOP_OPENAI),
        stop_token_ids=f.token_ids("stop_token_ids", b.vocab_size, max_len=MAX_STOP_TOKEN_IDS),
        ignore_eos=f.boolean("ignore_eos", False),
        seed=_seed(f, "seed"),
    )


def _top_k(f: Fields) -> int | None:
    k = f.integer("top_k", -1, lo=-1, hi=2**31 - 1)
    if k == 0:
        raise f.fail("top_k", "must be -1 (disabled) or >= 1, got 0")
    return None if k == -1 else k


def _seed(f: Fields, key: str) -> int | None:
    seed = f.opt_int(key, SEED_MIN, SEED_MAX)
    return None if seed is None else seed % 2**64


def _text(f: Fields, key: str) -> str:
    v = f.raw(key)
    if not isinstance(v, str):
        raise f.fail(key, f"must be a string, got {json_type(v)} (batched requests are not supported)")
    if not v:
        raise f.fail(key, "must not be empty")
    return v


def _ids(f: Fields, key: str, vocab_size: int) -> tuple[int, ...]:
    v = f.array(key)
    if not v:
        raise f.fail(key, "must be a non-empty array of token ids")
    check_token_ids(v, f.name(key), vocab_size)
    return tuple(v)


def _prompt(f: Fields, b: Bounds) -> Prompt:
    """A string, an array of token ids, or an array holding exactly one of those."""
    v = f.raw("prompt")
    if v is None:
        raise f.fail("prompt", "is required")
    if isinstance(v, list) and v and isinstance(v[0], str | list):
        if len(v) != 1:
            raise f.fail("prompt", f"must hold one prompt; batches ({len(v)} prompts) are not supported")
        f = Fields({"prompt": v[0]})
        v = v[0]
    if isinstance(v, str):
        return _text(f, "prompt")
    if isinstance(v, list):
        return _ids(f, "prompt", b.vocab_size)
    raise f.fail("prompt", f"must be a string or an array of token ids, got {json_type(v)}")


def _messages(f: Fields) -> tuple[ChatMessage, ...]:
    items = f.array("messages")
    if not items:
        raise f.fail("messages", "must be a non-empty array of messages")
    out = []
    for i, m in enumerate(items):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InvalidRequest(f"'{where}' must be an object, got {json_type(m)}", param=where)
        mf = Fields(m, prefix=f"{where}.")
        role = mf.string("role")
        if role is None:
            raise mf.fail("role", "is required")
        role = "system" if role == "developer" else role  # OpenAI's newer name for system
        if role not in ROLES:
            raise mf.fail("role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        out.append(ChatMessage(role, _content(mf, role), mf.string("name")))
    return tuple(out)


def _content(mf: Fields, role: str) -> str:
    """A string, or text parts joined by newlines; assistant messages may have none."""
    v = mf.raw("content")
    if v is None and role == "assistant":
        return ""
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise mf.fail("content", f"must be a string or an array of content parts, got {json_type(v)}")
    texts = []
    for j, part in enumerate(v):
        where = f"{mf.name('content')}[{j}]"
        if not isinstance(part, dict):
            raise InvalidRequest(f"'{where}' must be an object, got {json_type(part)}", param=where)
        if part.get("type") != "text":
            raise InvalidRequest(
                f"'{where}.type' {part.get('type')!r} is not supported (only 'text')", param=f"{where}.type"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequest(
                f"'{where}.text' must be a string, got {json_type(text)}", param=f"{where}.text"
            )
        texts.append(text)
    return "\n".join(texts)
