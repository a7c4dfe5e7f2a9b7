"""Log probabilities on the wire: SGLang's rows read in both streaming forms (gateway/protocol/
generate.py `incremental`, `token_logprobs`), the contract of an SGLang body asking for them, and the
OpenAI shapes the envelopes build (gateway/protocol/openai/envelopes.py), streamed or whole."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.protocol.generate import (
    GenerateChunk,
    GenerateRequest,
    LumenExt,
    MetaInfo,
    SamplingParams,
    TokenLogprob,
    decode_chunk,
    encode,
    incremental,
    logprob_meta,
    token_logprobs,
)
from gateway.protocol.openai.envelopes import (
    ChatEnvelope,
    CompletionEnvelope,
    Logprob,
    TokenText,
    chat_logprobs,
    completion_logprobs,
)
from gateway.protocol.sglang import to_sglang
from gateway.server.api.tokenizer import ByteTokenizer
from tests.fixtures import sglang_api_types as api_types

logprob_values = st.none() | st.floats(-50.0, 0.0)
token_logprob = st.builds(
    TokenLogprob,
    st.integers(0, 258),
    logprob_values,
    st.lists(st.tuples(logprob_values, st.integers(0, 258)), max_size=3).map(tuple),
)


def _meta(n_total: int, lps: list[TokenLogprob], top_n: int) -> MetaInfo:
    return msgspec.convert({"id": "r", "prompt_tokens": 3, "completion_tokens": n_total}
                           | logprob_meta(lps, top_n), MetaInfo)  # fmt: skip


@given(st.lists(st.lists(token_logprob, max_size=4), min_size=1, max_size=8), st.integers(0, 3))
def test_both_streaming_forms_give_the_same_logprobs(steps: list[list[TokenLogprob]], top_n: int) -> None:
    """SGLang's default stream repeats every id and every logprob row so far; the incremental form
    sends the new ones. Both read as the same tokens with the same logprobs, over the wire too."""
    if top_n == 0:
        steps = [[TokenLogprob(t.token_id, t.logprob) for t in step] for step in steps]
    sent: list[TokenLogprob] = []
    got: dict[str, list[TokenLogprob]] = {"cumulative": [], "incremental": []}
    received = {"cumulative": 0, "incremental": 0}
    for new in steps:
        sent.extend(new)
        forms = {
            "cumulative": GenerateChunk([t.token_id for t in sent], _meta(len(sent), sent, top_n), None),
            "incremental": GenerateChunk([t.token_id for t in new], _meta(len(sent), new, top_n), None),
        }
        for form, chunk in forms.items():
            wire = decode_chunk(encode(chunk))  # what the gateway reads off the stream
            inc = incremental(wire, received[form])
            received[form] += len(inc.output_ids)
            got[form].extend(token_logprobs(inc.meta_info, inc.output_ids))
    assert got["cumulative"] == got["incremental"] == sent


def test_rows_that_do_not_match_the_ids_are_refused() -> None:
    lps = [TokenLogprob(5, -0.5), TokenLogprob(6, -1.0)]
    meta = _meta(2, lps, 0)
    assert token_logprobs(meta, [5, 6]) == tuple(lps)
    with pytest.raises(ValueError, match="2 logprob rows"):
        token_logprobs(meta, [5, 6, 7])
    with pytest.raises(ValueError, match="for token 6"):
        token_logprobs(meta, [5, 9])


def test_sglang_rows_decode_with_nulls_and_texts() -> None:
    chunk = decode_chunk(
        b'{"output_ids": [5], "meta_info": {"id": "x", "prompt_tokens": 1, "completion_tokens": 1,'
        b' "output_token_logprobs": [[null, 5, "a"]], "output_top_logprobs": [[[0, 7, null], [-1.5, 5, "a"]]],'
        b' "output_token_logprobs_length": 1, "input_token_logprobs": [[null, 1, null]]}}'
    )
    assert token_logprobs(chunk.meta_info, [5]) == (TokenLogprob(5, None, ((0.0, 7), (-1.5, 5))),)


@pytest.mark.parametrize("top", [0, 5])
def test_a_body_asking_for_logprobs_passes_sglangs_contract(top: int) -> None:
    req = GenerateRequest(
        rid="r-1", input_ids=[1, 2], sampling_params=SamplingParams(max_new_tokens=3),
        return_logprob=True, top_logprobs_num=top, lumen=LumenExt(seed_base=1),
    )  # fmt: skip
    body = json.loads(encode(to_sglang(req, seed_base=1)))
    parsed = api_types.GenerateRequest.from_json_value(body)
    assert parsed.return_logprob is True and (parsed.top_logprobs_num or 0) == top
    assert "logprob_start_len" not in body  # -1: no prompt rows, the prefix cache not limited
    plain = json.loads(encode(to_sglang(GenerateRequest(input_ids=[1], rid="r"), seed_base=None)))
    assert not {"return_logprob", "top_logprobs_num"} & set(plain)


# -- envelopes -------------------------------------------------------------------------------------------

BYTES = ByteTokenizer()


def lp(token: int, value: float | None, *top: tuple[int, float | None]) -> Logprob:
    return Logprob(BYTES.token_text(token), value, tuple((BYTES.token_text(t), v) for t, v in top))


def test_token_strings() -> None:
    e_acute = "é".encode()
    assert BYTES.token_text(e_acute[0]) == TokenText("\ufffd", e_acute[:1])
    assert BYTES.token_text(e_acute[0]).lossless == "\xc3"  # a fragment: its byte as latin-1
    assert TokenText("\ufffd", "\ufffd".encode()).lossless == "\ufffd"  # a real U+FFFD stays
    assert BYTES.token_text(257) == TokenText("<|eos|>", b"<|eos|>")


def test_completion_shape() -> None:
    got, end = completion_logprobs([lp(104, -0.5, (104, -0.5), (105, -2.0)), lp(105, None)], 3)
    assert got == {
        "tokens": ["h", "i"],
        "token_logprobs": [-0.5, -9999.0],
        "top_logprobs": [{"h": -0.5, "i": -2.0}, {}],
        "text_offset": [3, 4],
    }
    assert end == 5


def test_chat_shape() -> None:
    assert chat_logprobs([lp(104, -0.5, (104, -0.5), (105, None))]) == {
        "content": [
            {
                "token": "h",
                "logprob": -0.5,
                "bytes": [104],
                "top_logprobs": [
                    {"token": "h", "logprob": -0.5, "bytes": [104]},
                    {"token": "i", "logprob": -9999.0, "bytes": [105]},
                ],
            }
        ]
    }


def test_streamed_logprobs_wait_for_text_and_choices_are_apart() -> None:
    env = CompletionEnvelope("id", "m", 0)
    assert env.chunks("", None, index=0, logprobs=[lp(104, -1.0)]) == []  # text held back: later
    [c1] = env.chunks("ab", None, index=1, logprobs=[lp(97, -0.1), lp(98, -0.2)])
    [c0] = env.chunks("hi", None, index=0, logprobs=[lp(105, -2.0)])
    assert c0["choices"][0]["logprobs"]["tokens"] == ["h", "i"]
    assert c0["choices"][0]["logprobs"]["text_offset"] == [0, 1]
    assert c1["choices"][0]["index"] == 1 and c1["choices"][0]["logprobs"]["text_offset"] == [0, 1]
    [c0] = env.chunks("", "stop", index=0, logprobs=[lp(33, -3.0)])
    assert c0["choices"][0]["logprobs"]["text_offset"] == [2] and c0["choices"][0]["text"] == ""
    [plain] = CompletionEnvelope("id", "m", 0).chunks("x", None)
    assert plain["choices"][0]["logprobs"] is None  # not asked for


def test_chat_stream_puts_logprobs_on_the_content_or_the_finish() -> None:
    env = ChatEnvelope("id", "m", 0)
    role, content = env.chunks("h", None, index=2, logprobs=[lp(104, -1.0)])
    assert role["choices"][0] == {"index": 2, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}  # fmt: skip
    assert content["choices"][0]["logprobs"]["content"][0]["token"] == "h"
    assert env.chunks("", None, index=2, logprobs=[lp(105, -1.0)]) == []
    [fin] = env.chunks("", "length", index=2, logprobs=[])
    assert fin["choices"][0]["delta"] == {} and len(fin["choices"][0]["logprobs"]["content"]) == 1


steps_st = st.lists(
    st.tuples(st.lists(st.integers(0, 258), max_size=3), st.text(max_size=3)), min_size=1, max_size=8
)


@given(steps_st, st.sampled_from(["completion", "chat"]))
def test_streamed_logprobs_add_up_to_the_whole_responses(
    steps: list[tuple[list[int], str]], kind: str
) -> None:
    """However text is held back between steps, a stream's logprobs are the whole response's, in order."""
    Env = CompletionEnvelope if kind == "completion" else ChatEnvelope
    env = Env("id", "m", 0)
    everything: list[Logprob] = []
    streamed: list[Any] = []
    for k, (ids, text) in enumerate(steps):
        lps = [lp(t, -float(t)) for t in ids]
        everything += lps
        finish = "length" if k == len(steps) - 1 else None
        for chunk in env.chunks(text, finish, logprobs=lps):
            got = chunk["choices"][0]["logprobs"]
            if got is not None:
                streamed.append(got)
    whole = Env("id", "m", 0).choice("", "length", logprobs=everything)["logprobs"]
    if kind == "completion":
        merged = {k: [v for s in streamed for v in s[k]] for k in whole}
        assert merged == whole
    else:
        assert [v for s in streamed for v in s["content"]] == whole["content"]
