"""Request validation: every bad field gives InvalidRequest naming it (never another exception)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.protocol.openai.fields import decode_object
from gateway.protocol.openai.requests import (
    Bounds,
    ChatRequest,
    SamplingRequest,
    parse_chat,
    parse_completion,
    parse_generate,
)
from gateway.server.api.errors import InvalidRequest, ModelNotFound, PromptTooLong
from gateway.server.api.schemas import check_prompt_length

B = Bounds(model="m", max_new_tokens=100, default_max_tokens=16, max_prompt_tokens=50, vocab_size=259)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}
GENERATE = {"text": "hi"}

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)

# field -> a predicate for the JSON values of a type it accepts (null always means "not given")


def NUMBER(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def INT(v: object) -> bool:
    """An integer as JSON Schema has it: an int, or a float with no fractional part (5.0)."""
    if isinstance(v, float):
        return v.is_integer()
    return isinstance(v, int) and not isinstance(v, bool)


OPENAI_FIELDS: dict[str, Any] = {
    "max_tokens": INT,
    "temperature": NUMBER,
    "top_p": NUMBER,
    "top_k": INT,
    "n": INT,
    "seed": INT,
    "stream": lambda v: isinstance(v, bool),
    "stream_options": lambda v: isinstance(v, dict),
    "stop": lambda v: isinstance(v, str | list),
    "stop_token_ids": lambda v: isinstance(v, list),
    "ignore_eos": lambda v: isinstance(v, bool),
    "presence_penalty": NUMBER,
    "frequency_penalty": NUMBER,
    "user": lambda v: isinstance(v, str),
    "model": lambda v: isinstance(v, str),
}


def wrong_for(field: str, table: dict[str, Any]) -> Any:
    accepts = table[field]
    return json_values.filter(lambda v: v is not None and not accepts(v))


@pytest.mark.parametrize("field", sorted(OPENAI_FIELDS))
@pytest.mark.parametrize("parse,base", [(parse_completion, COMPLETION), (parse_chat, CHAT)])
@given(data=st.data())
def test_wrong_type_names_the_field(field: str, parse: Any, base: dict[str, Any], data: Any) -> None:
    value = data.draw(wrong_for(field, OPENAI_FIELDS))
    with pytest.raises(InvalidRequest) as exc:
        parse({**base, field: value}, B)
    assert exc.value.param == field and exc.value.status == 400


COMPLETION_ONLY: dict[str, Any] = {
    "prompt": lambda v: isinstance(v, str | list),
    "logprobs": lambda v: v is False or (INT(v) and 0 <= v <= 5),
    "echo": lambda v: v is False,
    "best_of": lambda v: INT(v) and v == 1,
    "suffix": lambda v: v == "",
}


@pytest.mark.parametrize("field", sorted(COMPLETION_ONLY))
@given(data=st.data())
def test_completion_only_fields(field: str, data: Any) -> None:
    value = data.draw(wrong_for(field, COMPLETION_ONLY))
    with pytest.raises(InvalidRequest) as exc:
        parse_completion({**COMPLETION, field: value}, B)
    assert exc.value.param == field


@given(
    body=st.dictionaries(
        st.sampled_from(
            [
                *OPENAI_FIELDS,
                "messages",
                "prompt",
                "text",
                "input_ids",
                "sampling_params",
                "rid",
                "logprobs",
                "echo",
            ]
        ),
        json_values,
    )
)
def test_any_body_gives_a_request_or_a_gateway_error(body: dict[str, Any]) -> None:
    for parse in (parse_completion, parse_chat, parse_generate):
        try:
            parse(body, B)
        except (InvalidRequest, ModelNotFound) as exc:
            assert exc.status in (400, 404) and exc.param


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", 0),
        ("max_tokens", -1),
        ("max_tokens", 101),
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("top_p", 0),
        ("top_p", 1.01),
        ("top_k", 0),
        ("top_k", -2),
        ("n", 2),
        ("n", 0),
        ("seed", 2**64),
        ("stop", ["a", "b", "c", "d", "e"]),
        ("stop", [""]),
        ("stop", ["a", 1]),
        ("stop_token_ids", [259]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [True]),
        ("presence_penalty", 0.5),
        ("frequency_penalty", 3),
        ("logit_bias", {"1": 2}),
    ],
)
def test_out_of_range_names_the_field(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequest) as exc:
        parse_completion({**COMPLETION, field: value}, B)
    assert exc.value.param == field
    assert field in exc.value.message


def test_defaults_and_accepted_values() -> None:
    req = parse_completion(COMPLETION, B)
    assert req.prompt == "hi" and not req.stream and not req.include_usage
    assert req.sampling == SamplingRequest(max_tokens=16)
    body = {
        **COMPLETION,
        "max_tokens": 100,
        "temperature": 0,
        "top_p": 1,
        "top_k": 5,
        "n": 1,
        "seed": -1,
        "stop": "x",
        "stop_token_ids": [1, 2],
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "presence_penalty": 0,
        "logprobs": None,
        "echo": False,
        "unknown_field": {"anything": [1]},
    }
    s = parse_completion(body, B).sampling
    assert (s.max_tokens, s.temperature, s.top_k, s.seed, s.stop) == (100, 0.0, 5, 2**64 - 1, ("x",))
    assert s.stop_token_ids == (1, 2) and s.ignore_eos
    assert parse_completion(body, B).include_usage
    assert parse_completion({**COMPLETION, "top_k": -1}, B).sampling.top_k is None
    # include_usage means nothing without a stream
    assert not parse_completion({**COMPLETION, "stream_options": {"include_usage": True}}, B).include_usage


@pytest.mark.parametrize(
    "prompt,expect",
    [("abc", "abc"), ([1, 2], (1, 2)), (["abc"], "abc"), ([[3]], (3,))],
)
def test_prompt_forms(prompt: Any, expect: Any) -> None:
    assert parse_completion({"prompt": prompt}, B).prompt == expect


@pytest.mark.parametrize("prompt", ["", [], ["a", "b"], [""], [[]], [1, "a"], [999], {"a": 1}, 3])
def test_bad_prompts(prompt: Any) -> None:
    with pytest.raises(InvalidRequest) as exc:
        parse_completion({"prompt": prompt}, B)
    assert exc.value.param == "prompt"


def test_missing_prompt_and_unknown_model() -> None:
    with pytest.raises(InvalidRequest, match="'prompt' is required"):
        parse_completion({"model": "m"}, B)
    with pytest.raises(ModelNotFound) as exc:
        parse_completion({**COMPLETION, "model": "gpt-4"}, B)
    assert exc.value.status == 404 and exc.value.code == "model_not_found" and exc.value.param == "model"


@pytest.mark.parametrize(
    "field,value",
    [("echo", True), ("best_of", 2), ("suffix", "x")],
)
def test_unsupported_completion_features(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequest, match="not supported") as exc:
        parse_completion({**COMPLETION, field: value}, B)
    assert exc.value.param == field


def test_chat_messages() -> None:
    body = {
        "messages": [
            {"role": "developer", "content": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None, "name": "bot"},
            {"role": "tool", "content": "42"},
        ],
        "max_tokens": 5,
        "max_completion_tokens": 7,
    }
    req = parse_chat(body, B)
    assert isinstance(req, ChatRequest)
    assert [(m.role, m.content) for m in req.messages] == [
        ("system", "sys"),
        ("user", "a\nb"),
        ("assistant", ""),
        ("tool", "42"),
    ]
    assert req.messages[2].name == "bot" and req.sampling.max_tokens == 7


@pytest.mark.parametrize(
    "messages,param",
    [
        (None, "messages"),
        ([], "messages"),
        ("hi", "messages"),
        ([1], "messages[0]"),
        ([{"content": "x"}], "messages[0].role"),
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": ["x"]}], "messages[0].content[0]"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            "messages[0].content[0].type",
        ),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text"),
        (
            [{"role": "user", "content": "ok"}, {"role": "user", "content": "x", "name": 1}],
            "messages[1].name",
        ),
    ],
)
def test_bad_messages(messages: Any, param: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        parse_chat({"messages": messages}, B)
    assert exc.value.param == param


@pytest.mark.parametrize(
    "field,value",
    [
        ("logprobs", 1),
        ("top_logprobs", 2),  # without logprobs: true
        ("top_logprobs", True),
        ("tools", [{"type": "function"}]),
        ("response_format", {"type": "json_object"}),
        ("max_completion_tokens", 0),
    ],
)
def test_chat_unsupported_or_bad(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequest) as exc:
        parse_chat({**CHAT, field: value}, B)
    assert exc.value.param == field


BN = Bounds(model="m", max_new_tokens=100, default_max_tokens=16, vocab_size=259, max_n=4)


def test_n_and_logprobs() -> None:
    req = parse_completion({**COMPLETION, "n": 4, "best_of": 4, "logprobs": 0}, BN)
    assert (req.n, req.logprobs) == (4, 0)
    assert parse_completion({**COMPLETION, "logprobs": 5}, BN).logprobs == 5
    assert parse_completion({**COMPLETION, "logprobs": False}, BN).logprobs is None  # read as absent
    assert parse_completion(COMPLETION, BN).logprobs is None and parse_completion(COMPLETION, BN).n == 1
    chat = parse_chat({**CHAT, "n": 2, "logprobs": True, "top_logprobs": 20}, BN)
    assert (chat.n, chat.logprobs) == (2, 20)
    assert parse_chat({**CHAT, "logprobs": True}, BN).logprobs == 0
    assert parse_chat({**CHAT, "logprobs": False, "top_logprobs": 0}, BN).logprobs is None
    gen = parse_generate({**GENERATE, "return_logprob": True, "top_logprobs_num": 3}, BN)
    assert gen.logprobs == 3 and not gen.return_text_in_logprobs
    assert parse_generate({**GENERATE, "top_logprobs_num": 3}, BN).logprobs is None


@pytest.mark.parametrize(
    "parse,body,param",
    [
        (parse_completion, {**COMPLETION, "n": 5}, "n"),
        (parse_completion, {**COMPLETION, "n": 0}, "n"),
        (parse_completion, {**COMPLETION, "n": 2, "best_of": 3}, "best_of"),
        (parse_completion, {**COMPLETION, "logprobs": 6}, "logprobs"),
        (parse_completion, {**COMPLETION, "logprobs": -1}, "logprobs"),
        (parse_completion, {**COMPLETION, "logprobs": True}, "logprobs"),
        (parse_chat, {**CHAT, "n": 5}, "n"),
        (parse_chat, {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (parse_chat, {**CHAT, "logprobs": "yes"}, "logprobs"),
        (parse_generate, {**GENERATE, "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
        (parse_generate, {**GENERATE, "return_logprob": True, "logprob_start_len": 0}, "logprob_start_len"),
        (parse_generate, {**GENERATE, "return_logprob": 1}, "return_logprob"),
    ],
)
def test_bad_n_and_logprobs(parse: Any, body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        parse(body, BN)
    assert exc.value.param == param and param in exc.value.message


def test_chat_accepts_neutral_values() -> None:
    body = {**CHAT, "logprobs": False, "top_logprobs": 0, "tools": [], "response_format": {"type": "text"}}
    assert parse_chat(body, B).sampling.max_tokens == 16


def test_generate() -> None:
    req = parse_generate(
        {
            "input_ids": [1, 2],
            "sampling_params": {"max_new_tokens": 3, "stop": "x", "sampling_seed": 7},
            "rid": "r1",
        },
        B,
    )
    assert req.prompt == (1, 2) and req.rid == "r1"
    assert (req.sampling.max_tokens, req.sampling.stop, req.sampling.seed) == (3, ("x",), 7)
    assert parse_generate(GENERATE, B).sampling.max_tokens == 16


@pytest.mark.parametrize(
    "body,param",
    [
        ({}, "text"),
        ({"text": "a", "input_ids": [1]}, "text"),
        ({"text": ""}, "text"),
        ({"text": ["a", "b"]}, "text"),
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [[1]]}, "input_ids"),
        ({"input_ids": [300]}, "input_ids"),
        ({"text": "a", "sampling_params": []}, "sampling_params"),
        ({"text": "a", "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens"),
        ({"text": "a", "sampling_params": {"max_new_tokens": True}}, "sampling_params.max_new_tokens"),
        ({"text": "a", "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
        ({"text": "a", "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
        ({"text": "a", "sampling_params": {"stop_token_ids": "1"}}, "sampling_params.stop_token_ids"),
        ({"text": "a", "sampling_params": {"ignore_eos": 1}}, "sampling_params.ignore_eos"),
        ({"text": "a", "stream": "yes"}, "stream"),
        ({"text": "a", "rid": ""}, "rid"),
        ({"text": "a", "rid": 5}, "rid"),
    ],
)
def test_bad_generate(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        parse_generate(body, B)
    assert exc.value.param == param


def test_prompt_length() -> None:
    check_prompt_length(list(range(50)), B, "prompt")
    with pytest.raises(PromptTooLong) as exc:
        check_prompt_length(list(range(51)), B, "messages")
    assert exc.value.code == "context_length_exceeded" and exc.value.param == "messages"
    assert exc.value.status == 400


@pytest.mark.parametrize(
    "raw,match",
    [
        (b"{", "not valid JSON"),
        (b"", "not valid JSON"),
        (b"[1]", "got array"),
        (b"null", "got null"),
        (b"\xff", "not valid JSON"),
        (b"[" * 100_000, "nested too deeply"),
        (b'{"a": NaN}', "not valid JSON"),
    ],
)
def test_decode_object(raw: bytes, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        decode_object(raw)


def test_decode_object_ok() -> None:
    assert decode_object(b'{"a": [1, 2.5, null]}') == {"a": [1, 2.5, None]}
