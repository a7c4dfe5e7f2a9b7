"""The client request bodies and the error body as msgspec types, for JSON Schema (`/openapi.json`).

The bodies are parsed by requests.py (typed reads with errors naming the parameter); these types
state the same fields and bounds for clients and fuzzers, built from the same `Bounds` and constants,
so a server's schema says what that server accepts (its model name, max_tokens, n, vocabulary).
`tests/unit/test_openapi.py` checks that the parsers read exactly the fields declared here.
What a schema cannot say is in the field's description: `best_of` equal to `n`, `top_logprobs` only
with `logprobs: true`, a prompt's length once tokenized; a completion's prompt may also be a
one-element array, which is not declared.
Every optional field may be null, which reads as absent. Unknown top-level fields are ignored;
unknown `sampling_params` keys are refused.
"""

from __future__ import annotations

from types import GenericAlias
from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta

from gateway.protocol.openai.chat import ROLES
from gateway.protocol.openai.requests import (
    MAX_COMPLETION_LOGPROBS,
    MAX_RID_LEN,
    MAX_STOP_NATIVE,
    MAX_STOP_OPENAI,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    SEED_MAX,
    SEED_MIN,
    Bounds,
)
from gateway.protocol.openai.sampling import HONOURED_BY_GATEWAY, NEUTRAL

INT64_MAX = 2**63 - 1
Field = tuple[str, Any, Any]  # (name, type, default) as msgspec.defstruct takes them


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(msgspec.Struct):
    """OpenAI's error body, every client API error's."""

    error: ErrorDetail


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["text"]


class TextPart(msgspec.Struct):
    type: Literal["text"]
    text: str


def chat_message(role: str) -> type[msgspec.Struct]:
    """A message of one role, tagged by `role`; content is a string or text parts (an assistant's may
    be null or absent). `developer` reads as system."""
    content = str | list[TextPart]
    required = role != "assistant"
    fields: list[Field] = [
        ("content", content if required else content | None, msgspec.NODEFAULT if required else None),
        ("name", str | None, None),
    ]
    name = f"{role.capitalize()}Message"
    return msgspec.defstruct(name, fields, tag_field="role", tag=role, kw_only=True)


MESSAGE_ROLES = (*ROLES, "developer")


def _opt(t: Any, description: str = "") -> Any:
    """`t` or null (null reads as absent)."""
    t = None if t is None else t | None
    return Annotated[t, Meta(description=description)] if description else t


def _list_of(item: Any) -> Any:
    return GenericAlias(list, (item,))


def _token_id(b: Bounds) -> Any:
    return Annotated[int, Meta(ge=0, le=b.vocab_size - 1)]


def _stop(max_items: int) -> Any:
    nonempty = Annotated[str, Meta(min_length=1)]
    return _opt(nonempty | Annotated[list[nonempty], Meta(max_length=max_items)])


def _sampling(b: Bounds, max_key: str, seed_key: str) -> list[Field]:
    """The sampling fields both OpenAI bodies share (and /generate's, by other names)."""
    max_tokens = Annotated[int, Meta(ge=b.min_new_tokens, le=b.max_new_tokens)]
    top_k = Literal[-1] | Annotated[int, Meta(ge=1, le=b.max_top_k)]
    return [
        (max_key, _opt(max_tokens), None),
        ("temperature", _opt(Annotated[float, Meta(ge=0.0, le=2.0)]), None),
        ("top_p", _opt(Annotated[float, Meta(gt=0.0, le=1.0)]), None),
        ("top_k", _opt(top_k, "-1: off"), None),
        (
            "stop_token_ids",
            _opt(Annotated[_list_of(_token_id(b)), Meta(max_length=MAX_STOP_TOKEN_IDS)]),
            None,
        ),
        ("ignore_eos", _opt(bool), None),
        # the parsers take seeds up to SEED_MAX (2**64 - 1); msgspec's bounds stop at int64's
        (seed_key, _opt(Annotated[int, Meta(ge=SEED_MIN, le=min(SEED_MAX, INT64_MAX))]), None),
    ]


def _openai_common(b: Bounds) -> list[Field]:
    zero = Annotated[float, Meta(ge=0.0, le=0.0, description="only 0 (penalties are not supported)")]
    return [
        ("model", _opt(Literal[b.model]), None),
        ("n", _opt(Annotated[int, Meta(ge=1, le=b.max_n)]), None),
        ("stream", _opt(bool), None),
        ("stream_options", _opt(StreamOptions), None),
        ("stop", _stop(MAX_STOP_OPENAI), None),
        ("presence_penalty", _opt(zero), None),
        ("frequency_penalty", _opt(zero), None),
        ("logit_bias", _opt(Annotated[dict[str, float], Meta(max_length=0, description="only {}")]), None),
        ("user", _opt(str), None),
    ]


def completion_request(b: Bounds) -> type[msgspec.Struct]:
    ids: Any = Annotated[_list_of(_token_id(b)), Meta(min_length=1)]
    # also taken: a one-element array holding either (not declared: a schema cannot say "one" there)
    prompt: Any = Annotated[Annotated[str, Meta(min_length=1)] | ids, Meta(description="text or token ids")]
    logprobs = Annotated[int, Meta(ge=0, le=MAX_COMPLETION_LOGPROBS)] | Literal[False]
    fields: list[Field] = [
        ("prompt", prompt, msgspec.NODEFAULT),
        *_openai_common(b),
        *_sampling(b, "max_tokens", "seed"),
        ("logprobs", _opt(logprobs), None),
        ("echo", _opt(Literal[False]), None),
        ("suffix", _opt(Annotated[str, Meta(max_length=0)]), None),
        ("best_of", _opt(Annotated[int, Meta(ge=1)], "must equal n"), None),
    ]
    return msgspec.defstruct("CompletionRequest", fields, kw_only=True)


def chat_request(b: Bounds) -> type[msgspec.Struct]:
    max_tokens = Annotated[int, Meta(ge=b.min_new_tokens, le=b.max_new_tokens)]
    fields: list[Field] = [
        ("messages", Annotated[_list_of(_messages()), Meta(min_length=1)], msgspec.NODEFAULT),
        *_openai_common(b),
        *_sampling(b, "max_tokens", "seed"),
        ("max_completion_tokens", _opt(max_tokens), None),
        ("logprobs", _opt(bool), None),
        (
            "top_logprobs",
            _opt(Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)], "> 0 only with logprobs: true"),
            None,
        ),
        ("tools", _opt(Annotated[list[Any], Meta(max_length=0)]), None),
        ("functions", _opt(Annotated[list[Any], Meta(max_length=0)]), None),
        ("response_format", _opt(ResponseFormat), None),
    ]
    return msgspec.defstruct("ChatCompletionRequest", fields, kw_only=True)


def _messages() -> Any:
    return Union[tuple(chat_message(role) for role in MESSAGE_ROLES)]  # noqa: UP007


def sampling_params(b: Bounds) -> type[msgspec.Struct]:
    """/generate's `sampling_params`: what the gateway honours, and SGLang's others at neutral values."""
    max_new = Annotated[int, Meta(ge=b.min_new_tokens, le=b.max_new_tokens)]
    fields = _sampling(b, "max_new_tokens", "sampling_seed")
    fields[0] = ("max_new_tokens", _opt(max_new), None)
    fields.append(("stop", _stop(MAX_STOP_NATIVE), None))
    for key, neutral in NEUTRAL.items():
        if key not in HONOURED_BY_GATEWAY:
            fields.append((key, _opt(_neutral_type(neutral), "not supported: null or this value only"), None))
    return msgspec.defstruct("GenerateSamplingParams", fields, kw_only=True, forbid_unknown_fields=True)


def _neutral_type(neutral: tuple[object, ...]) -> Any:
    if not neutral:
        return None
    v = neutral[0]
    if isinstance(v, bool | str | int):
        return Literal[v]
    if isinstance(v, float):
        return Annotated[float, Meta(ge=v, le=v)]
    if isinstance(v, dict):
        return Annotated[dict[str, Any], Meta(max_length=0)]
    return Annotated[list[Any], Meta(max_length=0)]


def generate_requests(b: Bounds) -> tuple[type[msgspec.Struct], type[msgspec.Struct]]:
    """/generate's body, one type with `text` and one with `input_ids`: exactly one is given."""
    common: list[Field] = [
        ("sampling_params", _opt(sampling_params(b)), None),
        ("stream", _opt(bool), None),
        ("rid", _opt(Annotated[str, Meta(min_length=1, max_length=MAX_RID_LEN, pattern=r"^[ -~]+$")]), None),
        ("return_logprob", _opt(bool), None),
        ("top_logprobs_num", _opt(Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]), None),
        ("logprob_start_len", _opt(Annotated[int, Meta(ge=-1)], "only -1 with return_logprob"), None),
        ("return_text_in_logprobs", _opt(bool), None),
    ]
    text: list[Field] = [("text", Annotated[str, Meta(min_length=1)], msgspec.NODEFAULT)]
    ids: list[Field] = [
        ("input_ids", Annotated[_list_of(_token_id(b)), Meta(min_length=1)], msgspec.NODEFAULT)
    ]
    return (
        msgspec.defstruct("GenerateTextRequest", text + common, kw_only=True),
        msgspec.defstruct("GenerateIdsRequest", ids + common, kw_only=True),
    )


def request_bodies(b: Bounds) -> dict[str, tuple[type[msgspec.Struct], ...]]:
    """Each client request body by its route's body name (routes.py): the types it may be, exactly
    one of them (`oneOf`)."""
    return {
        "completion": (completion_request(b),),
        "chat": (chat_request(b),),
        "generate": generate_requests(b),
    }
