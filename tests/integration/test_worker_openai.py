"""The worker's OpenAI /v1/completions and /v1/chat/completions, in-process on loopback.

Ground truth is the worker's own /generate: the same prompt ids, greedy or seeded sampling params
give the same tokens through every route, streamed or not.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from gateway.protocol import bytevocab
from gateway.protocol.generate import SamplingParams
from gateway.protocol.launch import EngineSpec
from gateway.protocol.openai.chat import render_default as render_chat
from gateway.server.api.chat_template import ChatMessage, ChatTemplate
from gateway.server.api.tokenizer import ByteTokenizer
from models.synthetic import expected_output
from worker_hooks.engine.service import Worker, start_worker

FAST = {"model": "Qwen3-0.6B", "gpu": "H100-80G", "time_scale": 0.01}
PROMPT = "The quick brown fox jumps over the lazy dog. "
MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]},
]
RENDERED = [("system", "be brief"), ("user", "hello\nthere")]
# sampling params as (OpenAI fields, /generate sampling_params, seed_base)
SAMPLING = {
    "greedy": ({"temperature": 0.0}, {"temperature": 0.0}, 0),
    "seeded": (
        {"temperature": 0.9, "top_p": 0.8, "top_k": 5, "seed": 1234},
        {"temperature": 0.9, "top_p": 0.8, "top_k": 5},
        1234,
    ),
}


def spec(**kw: Any) -> EngineSpec:
    return EngineSpec(**{"worker_id": "w-oai", "control_address": "", **FAST, **kw})


@pytest.fixture
async def worker() -> AsyncIterator[Worker]:
    async with start_worker(spec()) as w:
        yield w


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as cs:
        yield cs


async def via_generate(
    client: aiohttp.ClientSession, w: Worker, ids: list[int], params: dict[str, Any], seed: int
) -> tuple[list[int], str]:
    body = {
        "input_ids": ids,
        "sampling_params": params,
        "stream": False,
        "lumen": {"seed_base": seed},
    }
    async with client.post(w.url + "/generate", json=body) as r:
        assert r.status == 200
        out = await r.json()
    return out["output_ids"], out["meta_info"]["finish_reason"]["type"]


async def sse(resp: aiohttp.ClientResponse) -> tuple[list[dict[str, Any]], bool]:
    """The JSON events of one stream, and whether it ended with [DONE] (and nothing after it)."""
    events, done = [], False
    async for line in resp.content:
        if not line.strip():
            continue
        assert line.startswith(b"data: ") and not done
        payload = line[6:].strip()
        if payload == b"[DONE]":
            done = True
        else:
            events.append(json.loads(payload))
    return events, done


async def wait_until(cond: Any, within: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


def text_of(ids: list[int]) -> str:
    return bytes(i for i in ids if i < 256).decode()


# -- tokenisation is the gateway's ---------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "plain ascii", "héllo ✓ 𝄞", "<|bos|>a<|eos|><|pad|>b<|eos", "<|eos|>"])
def test_text_encodes_as_the_gateways_byte_tokenizer(text: str) -> None:
    assert bytevocab.encode(text) == ByteTokenizer().encode(text)


def test_chat_renders_as_the_gateways_default_template() -> None:
    template = ChatTemplate.load("", ByteTokenizer())
    messages = tuple(ChatMessage(role, content) for role, content in RENDERED)
    assert render_chat(RENDERED) == template.render(messages)


def test_streamed_text_never_splits_a_character() -> None:
    data = "a é ✓ 𝄞".encode()
    ts = bytevocab.Utf8Stream()
    pieces = [ts.step([b]) for b in data] + [ts.step([257]), ts.finish()]
    assert "".join(pieces) == "a é ✓ 𝄞"
    assert all(p.isprintable() for p in pieces)  # no U+FFFD from a half character
    ts = bytevocab.Utf8Stream()
    assert ts.step(list("é".encode())[:1]) == "" and ts.finish() == "\ufffd"


# -- completions -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("prompt_form", ["text", "ids", "text_list", "ids_list"])
async def test_completion_matches_generate(
    worker: Worker, client: aiohttp.ClientSession, sampling: str, prompt_form: str
) -> None:
    oai, params, seed = SAMPLING[sampling]
    ids = list(PROMPT.encode())
    prompt: Any = {"text": PROMPT, "ids": ids, "text_list": [PROMPT], "ids_list": [ids]}[prompt_form]
    want, finish = await via_generate(client, worker, ids, params | {"max_new_tokens": 30}, seed)
    sp = SamplingParams(max_new_tokens=30, **params)
    assert (want, finish) == expected_output(ids, sp, seed)
    body = {"model": worker.spec.model, "prompt": prompt, "max_tokens": 30, **oai}
    async with client.post(worker.url + "/v1/completions", json=body) as r:
        assert r.status == 200
        out = await r.json()
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
    assert out["model"] == worker.spec.model
    [choice] = out["choices"]
    assert choice == {"index": 0, "text": text_of(want), "logprobs": None, "finish_reason": "length"}
    usage = {"prompt_tokens": len(ids), "completion_tokens": 30, "total_tokens": len(ids) + 30}
    assert out["usage"] == usage | {"prompt_tokens_details": {"cached_tokens": 0}}


@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("include_usage", [True, False])
async def test_streamed_completion_matches_generate(
    worker: Worker, client: aiohttp.ClientSession, sampling: str, include_usage: bool
) -> None:
    oai, params, seed = SAMPLING[sampling]
    ids = list(PROMPT.encode())
    want, _ = await via_generate(client, worker, ids, params | {"max_new_tokens": 25}, seed)
    body = {"prompt": PROMPT, "max_tokens": 25, "stream": True, **oai}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    async with client.post(worker.url + "/v1/completions", json=body) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        events, done = await sse(r)
    assert done
    chunks = events[:-1] if include_usage else events
    assert len({e["id"] for e in events}) == 1
    assert all(e["object"] == "text_completion" for e in events)
    # one chunk per engine step, one token each; the finish reason only on the last
    assert [c["choices"][0]["text"] for c in chunks] == [chr(t) for t in want]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 24 + ["length"]
    if include_usage:
        assert all(c["usage"] is None for c in chunks)
        assert events[-1]["choices"] == []
        assert events[-1]["usage"]["prompt_tokens"] == len(ids)
        assert events[-1]["usage"]["completion_tokens"] == 25
        assert events[-1]["usage"]["total_tokens"] == len(ids) + 25
    else:
        assert all("usage" not in e for e in events)


async def test_stop_token_ids_end_with_stop_and_eos_is_a_default_stop(
    worker: Worker, client: aiohttp.ClientSession
) -> None:
    ids = list(PROMPT.encode())
    full, _ = await via_generate(client, worker, ids, {"temperature": 0.0, "max_new_tokens": 40}, 0)
    stop = full[10]
    cut = full[: full.index(stop) + 1]
    for stream in (False, True):
        body = {"prompt": ids, "max_tokens": 40, "temperature": 0, "stop_token_ids": [stop], "stream": stream}
        body["stream_options"] = {"include_usage": True}  # ignored without stream
        async with client.post(worker.url + "/v1/completions", json=body) as r:
            if stream:
                events, _ = await sse(r)
                text = "".join(c["text"] for e in events for c in e["choices"])
                finish = events[-2]["choices"][0]["finish_reason"]
                usage = events[-1]["usage"]
            else:
                out = await r.json()
                text, finish, usage = (
                    out["choices"][0]["text"],
                    out["choices"][0]["finish_reason"],
                    out["usage"],
                )
        assert (text, finish, usage["completion_tokens"]) == (text_of(cut), "stop", len(cut))
    # the byte tokenizer's EOS stops a generation unless ignore_eos (as through Lumen's gateway)
    async with start_worker(spec(token_lo=250, token_hi=259)) as w:
        sp = SamplingParams(max_new_tokens=200, temperature=0.0, stop_token_ids=[257])
        want, finish = expected_output([65, 66], sp, token_lo=250, token_hi=259)
        assert finish == "stop" and want[-1] == 257
        body = {"prompt": "AB", "max_tokens": 200, "temperature": 0}
        async with client.post(w.url + "/v1/completions", json=body) as r:
            out = await r.json()
        assert out["choices"][0]["finish_reason"] == "stop"
        assert out["usage"]["completion_tokens"] == len(want)
        async with client.post(w.url + "/v1/completions", json=body | {"ignore_eos": True}) as r:
            out = await r.json()
        assert out["choices"][0]["finish_reason"] == "length"
        assert out["usage"]["completion_tokens"] == 200


async def test_smgs_forwarded_bodies_are_served(worker: Worker, client: aiohttp.ClientSession) -> None:
    """The bodies SMG 1.13 sends to a worker (recorded): its additions are accepted."""
    model = worker.spec.model
    cmpl = {"model": model, "prompt": "ABCDEFGH", "echo": False, "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0.0, "ignore_eos": True}  # fmt: skip
    chat = {"messages": [{"role": "user", "content": "hi"}], "model": model, "logprobs": False,
            "max_tokens": 4, "stream": False, "temperature": 0.0}  # fmt: skip
    async with client.post(worker.url + "/v1/completions", json=cmpl) as r:
        events, done = await sse(r)
        assert r.status == 200 and done and events[-1]["usage"]["completion_tokens"] == 4
    async with client.post(worker.url + "/v1/chat/completions", json=chat) as r:
        assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 4


# -- chat ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", SAMPLING)
async def test_chat_matches_generate(worker: Worker, client: aiohttp.ClientSession, sampling: str) -> None:
    oai, params, seed = SAMPLING[sampling]
    ids = ByteTokenizer().encode(render_chat(RENDERED))
    want, _ = await via_generate(client, worker, ids, params | {"max_new_tokens": 20}, seed)
    body = {"model": "any-name", "messages": MESSAGES, "max_completion_tokens": 20, **oai}
    async with client.post(worker.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        out = await r.json()
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    assert out["model"] == "any-name"  # the requested name is echoed, as SGLang does
    [choice] = out["choices"]
    assert choice["message"] == {"role": "assistant", "content": text_of(want)}
    assert choice["finish_reason"] == "length"
    assert out["usage"]["prompt_tokens"] == len(ids) and out["usage"]["completion_tokens"] == 20
    assert out["usage"]["total_tokens"] == len(ids) + 20


@pytest.mark.parametrize("sampling", SAMPLING)
async def test_streamed_chat_matches_generate(
    worker: Worker, client: aiohttp.ClientSession, sampling: str
) -> None:
    oai, params, seed = SAMPLING[sampling]
    ids = ByteTokenizer().encode(render_chat(RENDERED))
    want, _ = await via_generate(client, worker, ids, params | {"max_new_tokens": 20}, seed)
    body = {"messages": MESSAGES, "max_tokens": 20, "stream": True, **oai}
    body["stream_options"] = {"include_usage": True}
    async with client.post(worker.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        events, done = await sse(r)
    assert done and all(e["object"] == "chat.completion.chunk" for e in events)
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert deltas[0] == {"role": "assistant", "content": ""} and deltas[-1] == {}
    assert "".join(d.get("content", "") for d in deltas) == text_of(want)
    assert len(deltas) == 20 + 2  # the role, one content delta per token, the finish
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]] == [None] * 21 + ["length"]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 20
    assert events[-1]["usage"]["prompt_tokens"] == len(ids)


# -- refusals --------------------------------------------------------------------------------------------

BAD_COMMON: list[tuple[dict[str, Any], str]] = [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"n": 2}, "n"),
    ({"stop": "x"}, "stop"),
    ({"stop": ["a", "b"]}, "stop"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"logit_bias": {"65": 1}}, "logit_bias"),
    ({"seed": 1.5}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": [1]}, "stream_options"),
    ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"stop_token_ids": [1, 259]}, "stop_token_ids"),
    ({"ignore_eos": "no"}, "ignore_eos"),
    ({"model": 7}, "model"),
]
BAD_COMPLETION: list[tuple[dict[str, Any], str]] = [
    ({"prompt": None}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": 42}, "prompt"),
    ({"prompt": [1, 259]}, "prompt"),
    ({"prompt": [1, -1]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"echo": True}, "echo"),
    ({"logprobs": 6}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"best_of": 3}, "best_of"),
]
BAD_CHAT: list[tuple[dict[str, Any], str]] = [
    ({"messages": None}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type"),
    ({"logprobs": 1}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"max_completion_tokens": -5}, "max_completion_tokens"),
]
GOOD = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
}
CASES = [("/v1/completions", c) for c in BAD_COMMON + BAD_COMPLETION] + [
    ("/v1/chat/completions", c) for c in BAD_COMMON + BAD_CHAT
]


def assert_openai_error(err: dict[str, Any], param: str | None) -> None:
    assert set(err) == {"error"} and set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["type"] == "invalid_request_error" and err["error"]["message"]
    assert err["error"]["param"] == param


@pytest.mark.parametrize(("path", "case"), CASES, ids=[f"{p[4:]}-{c[1]}-{c[0]}" for p, c in CASES])
async def test_bad_input_gets_400_with_an_openai_error_body(
    worker: Worker, client: aiohttp.ClientSession, path: str, case: tuple[dict[str, Any], str]
) -> None:
    fields, param = case
    async with client.post(worker.url + path, json=GOOD[path] | fields) as r:
        assert r.status == 400
        assert_openai_error(await r.json(), param)
    assert worker.engine.stats().requests_total == 0


@pytest.mark.parametrize("path", GOOD)
@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b""])
async def test_a_body_that_is_not_a_json_object_gets_400(
    worker: Worker, client: aiohttp.ClientSession, path: str, raw: bytes
) -> None:
    async with client.post(worker.url + path, data=raw) as r:
        assert r.status == 400
        assert_openai_error(await r.json(), None)


async def test_engine_refusals_keep_their_status_in_openai_shape(client: aiohttp.ClientSession) -> None:
    async with start_worker(spec(kv_capacity_tokens=256, page_size=16)) as w:
        async with client.post(w.url + "/v1/completions", json={"prompt": "x" * 200, "max_tokens": 100}) as r:
            assert r.status == 400
            err = await r.json()
            assert_openai_error(err, "prompt")
            assert err["error"]["code"] == "context_length_exceeded"
        w.engine.drain()
        async with client.post(w.url + "/v1/chat/completions", json=GOOD["/v1/chat/completions"]) as r:
            assert r.status == 503
            assert (await r.json())["error"]["code"] == "not_serving"
    other = {"prompt": [1, 2], "max_tokens": 2}
    async with (
        start_worker(spec(vocab_size=1000, token_lo=0, token_hi=1000)) as w,
        client.post(w.url + "/v1/completions", json=other) as r,
    ):
        assert r.status == 501 and (await r.json())["error"]["code"] == "no_tokenizer"


# -- aborts ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_aborts_the_request(client: aiohttp.ClientSession, stream: bool) -> None:
    async with start_worker(spec(time_scale=1.0)) as w:
        body = {"prompt": "x" * 64, "max_tokens": 100_000, "stream": stream}
        if stream:
            resp = await client.post(w.url + "/v1/completions", json=body)
            await resp.content.readuntil(b"\n\n")
            resp.close()
        else:
            # the client leaves once its request runs (not after a fixed 0.2 s: a busy box may not have
            # sent it by then, and then there is nothing to abort)
            post = asyncio.create_task(client.post(w.url + "/v1/completions", json=body))
            await wait_until(lambda: w.engine.stats().running == 1)
            post.cancel()
            with pytest.raises(asyncio.CancelledError):
                await post
        await wait_until(lambda: w.engine.stats().aborted_total == 1)
        s = w.engine.stats()
        assert (s.aborted_total, s.running, s.waiting, w.engine.pool.used_pages) == (1, 0, 0, 0)


async def test_an_engine_abort_ends_the_stream_with_an_error_and_no_done(
    client: aiohttp.ClientSession,
) -> None:
    async with start_worker(spec(time_scale=1.0)) as w:
        body = {"prompt": "x" * 64, "max_tokens": 100_000, "stream": True}
        async with client.post(w.url + "/v1/completions", json=body) as resp:
            await resp.content.readuntil(b"\n\n")
            async with client.post(w.url + "/abort_request", json={"rid": "cmpl-"}) as r:
                assert len((await r.json())["aborted"]) == 1
            events, done = await sse(resp)
        assert not done and events[-1]["error"]["code"] == "request_aborted"
        body["stream"] = False
        unary = asyncio.create_task(client.post(w.url + "/v1/completions", json=body))
        await wait_until(lambda: w.engine.stats().running == 1)
        async with client.post(w.url + "/abort_request", json={"rid": "cmpl-"}) as r:
            assert len((await r.json())["aborted"]) == 1
        async with await unary as resp:
            assert resp.status == 503
            err = await resp.json()
        assert err["error"]["code"] == "request_aborted" and err["error"]["type"] == "service_unavailable"


# -- log probabilities -----------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", SAMPLING)
async def test_logprobs_are_the_engines(worker: Worker, client: aiohttp.ClientSession, sampling: str) -> None:
    """/generate's rows, the completion's and the chat's logprobs are the same numbers, streamed or not."""
    oai, params, seed = SAMPLING[sampling]
    ids = list(PROMPT.encode())
    body = {"input_ids": ids, "sampling_params": params | {"max_new_tokens": 12}, "stream": False,
            "lumen": {"seed_base": seed}, "return_logprob": True, "top_logprobs_num": 3}  # fmt: skip
    async with client.post(worker.url + "/generate", json=body) as r:
        meta = (await r.json())["meta_info"]
    rows, tops = meta["output_token_logprobs"], meta["output_top_logprobs"]
    assert len(rows) == len(tops) == 12 and all(len(t) <= 3 for t in tops)
    cmpl = {"prompt": ids, "max_tokens": 12, "logprobs": 3, **oai}
    async with client.post(worker.url + "/v1/completions", json=cmpl) as r:
        lp = (await r.json())["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [row[0] for row in rows]
    assert [list(d.values()) for d in lp["top_logprobs"]] == [[t[0] for t in top] for top in tops]
    async with client.post(worker.url + "/v1/completions", json=cmpl | {"stream": True}) as r:
        events, _ = await sse(r)
    streamed = [
        v
        for e in events
        if e["choices"]
        for v in (e["choices"][0]["logprobs"] or {}).get("token_logprobs", [])
    ]
    assert streamed == lp["token_logprobs"]
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "logprobs": True, **oai}
    async with client.post(worker.url + "/v1/chat/completions", json=chat) as r:
        content = (await r.json())["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(c["top_logprobs"] == [] and c["bytes"] for c in content)
