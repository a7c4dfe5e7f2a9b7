"""The client API over HTTP, in process, against a fake Generator (the seam in gateway/server/jobs.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.config import Config, GatewaySection, LimitsSection, TokenizerSection
from gateway.protocol.generate import TokenLogprob
from gateway.protocol.streamid import RESUMABLE_HEADERS
from gateway.server.api.errors import GatewayError, NoWorkerAvailable, UpstreamFailed
from gateway.server.api.jobs import GenerateJob, TokenDelta
from gateway.server.api.middleware import error_middleware
from gateway.server.api.routes import add_client_routes
from gateway.server.api.tokenizer import ByteTokenizer

KEY = "secret-key-0001"
CONFIG = Config(
    gateway=GatewaySection(served_model_name="m"),
    limits=LimitsSection(
        max_request_bytes=16 * 1024, max_prompt_tokens=200, max_new_tokens=100, default_max_tokens=16
    ),
    tokenizer=TokenizerSection(eos_token_ids=(7,)),
)


class FakeGenerator:
    """Echoes the prompt ids (cycling), `per` ids a delta. A stop id ends the output with "stop".

    `fail_at`: raise `error` once that many ids were sent. Records every job, and which iterators
    finished on their own and which were closed (aclose or cancellation) before finishing.
    """

    def __init__(
        self,
        *,
        per: int = 1,
        delay: float = 0.0,
        fail_at: int | None = None,
        error: BaseException | None = None,
        cached: int = 0,
    ) -> None:
        self.per, self.delay, self.fail_at, self.cached = per, delay, fail_at, cached
        self.error = error or UpstreamFailed("worker w0 failed")
        self.jobs: list[GenerateJob] = []
        self.finished: list[str] = []
        self.closed: list[str] = []

    async def generate(self, job: GenerateJob) -> AsyncIterator[TokenDelta]:
        self.jobs.append(job)
        s, prompt, sent, done = job.sampling, job.prompt_ids, 0, False
        try:
            while True:
                if self.fail_at is not None and sent >= self.fail_at:
                    raise self.error
                ids: list[int] = []
                lps: list[TokenLogprob] = []
                finish, matched = None, None
                while len(ids) < self.per and finish is None:
                    tok = prompt[sent % len(prompt)]
                    ids.append(tok)
                    if job.logprobs is not None:
                        lps.append(fake_logprob(tok, sent, job.logprobs))
                    sent += 1
                    if tok in s.stop_token_ids:
                        finish, matched = "stop", tok
                    elif sent >= s.max_new_tokens:
                        finish = "length"
                if self.delay:
                    await asyncio.sleep(self.delay)
                if finish is not None:  # the final delta: closing the iterator after it is normal
                    done = True
                    self.finished.append(job.rid)
                yield TokenDelta(tuple(ids), finish, matched, self.cached, tuple(lps))  # type: ignore[arg-type]
                if done:
                    return
        finally:
            if not done:
                self.closed.append(job.rid)


def fake_logprob(token: int, position: int, top_n: int) -> TokenLogprob:
    """Output position p's logprob is -p/8; its top tokens are the token and the bytes after it."""
    lp = -position / 8
    return TokenLogprob(token, lp, tuple((lp - j, (token + j) % 256) for j in range(top_n)))


Factory = Callable[..., Awaitable[tuple[TestClient[web.Request, web.Application], FakeGenerator]]]


@pytest.fixture
async def make() -> AsyncIterator[Factory]:
    clients: list[TestClient[web.Request, web.Application]] = []

    async def factory(config: Config = CONFIG, **fake: Any) -> tuple[TestClient[Any, Any], FakeGenerator]:
        gen = FakeGenerator(**fake)
        app = web.Application(middlewares=[error_middleware])
        add_client_routes(app, config=config, tokenizer=ByteTokenizer(), generator=gen)

        async def boom(request: web.Request) -> web.Response:
            raise RuntimeError("secret internal detail")

        app.router.add_get("/boom", boom)
        client = TestClient(TestServer(app))
        await client.start_server()
        clients.append(client)
        return client, gen

    yield factory
    for c in clients:
        await c.close()


def sse_events(raw: str) -> list[Any]:
    assert raw.endswith("\n\n")
    out = []
    for block in raw.split("\n\n")[:-1]:
        if block.startswith("id: "):  # a stream position (resumable streams)
            event_id, _, block = block.partition("\n")
            assert "\n" not in event_id and len(event_id) > 10
        assert block.startswith("data: ")
        payload = block[len("data: ") :]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


async def post(client: TestClient[Any, Any], path: str, body: Any) -> tuple[int, Any]:
    resp = await client.post(path, json=body)
    text = await resp.text()
    if resp.content_type == "text/event-stream":
        return resp.status, sse_events(text)
    return resp.status, json.loads(text)


def assert_error(status: int, body: Any, want_status: int, param: str | None = None) -> dict[str, Any]:
    assert status == want_status, body
    err: dict[str, Any] = body["error"]
    assert set(err) >= {"message", "type", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    return err


# --------------------------------------------------------------------------------------------------
# completions


async def test_completion(make: Factory) -> None:
    client, gen = await make(cached=2)
    status, body = await post(
        client, "/v1/completions", {"model": "m", "prompt": "hello world", "max_tokens": 5}
    )
    assert status == 200
    assert body["object"] == "text_completion" and body["model"] == "m" and body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": "hello", "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {
        "prompt_tokens": 11,
        "completion_tokens": 5,
        "total_tokens": 16,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    job = gen.jobs[0]
    assert len(job.rid) == len("cmpl-") + 32 and job.rid == body["id"]
    assert job.sampling.stop_token_ids == (257, 7) and job.sampling.seed is None
    assert job.labels == {"endpoint": "completions"} and gen.finished == [job.rid]


async def test_completion_token_prompt_and_job_fields(make: Factory) -> None:
    client, gen = await make()
    status, body = await post(
        client,
        "/v1/completions",
        {
            "prompt": [104, 105],
            "max_tokens": 3,
            "temperature": 0,
            "top_k": 4,
            "top_p": 0.5,
            "seed": 9,
            "stop_token_ids": [5, 7],
            "ignore_eos": False,
        },
    )
    assert status == 200 and body["choices"][0]["text"] == "hih"
    s = gen.jobs[0].sampling
    assert (s.temperature, s.top_k, s.top_p, s.seed, s.max_new_tokens) == (0.0, 4, 0.5, 9, 3)
    assert s.stop_token_ids == (257, 7, 5)
    await post(client, "/v1/completions", {"prompt": "x", "ignore_eos": True, "stop_token_ids": [5]})
    assert gen.jobs[1].sampling.stop_token_ids == (5,) and gen.jobs[1].sampling.ignore_eos


async def test_completion_stream_with_usage(make: Factory) -> None:
    client, _ = await make(per=2)
    status, events = await post(
        client,
        "/v1/completions",
        {"prompt": "héllo 世界", "max_tokens": 26, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert status == 200 and events[-1] == "[DONE]"
    chunks = events[:-1]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert "".join(texts) == "héllo 世界héllo 世界"  # 13 bytes, echoed twice, 2 bytes a delta
    assert all("\ufffd" not in t for t in texts)  # a character split over deltas is never broken
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 26


async def test_stop_token_is_not_rendered(make: Factory) -> None:
    client, _ = await make()
    _, body = await post(client, "/v1/completions", {"prompt": "hi<|eos|>more"})
    assert body["choices"][0] == {"index": 0, "text": "hi", "logprobs": None, "finish_reason": "stop"}
    assert body["usage"]["completion_tokens"] == 3  # the stop token counts as generated
    _, body = await post(client, "/v1/completions", {"prompt": "hello world", "stop_token_ids": [32]})
    assert body["choices"][0]["text"] == "hello" and body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("per", [1, 2, 3, 50])
async def test_stop_string_across_chunks_closes_generator(make: Factory, per: int) -> None:
    client, gen = await make(per=per)
    body = {"prompt": "hello world, hello moon", "stop": ["o w", "zzz"], "max_tokens": 100}
    _, resp = await post(client, "/v1/completions", body)
    assert resp["choices"][0]["text"] == "hell" and resp["choices"][0]["finish_reason"] == "stop"
    _, events = await post(client, "/v1/completions", {**body, "stream": True})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == "hell" and events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    if per < 50:  # the generation was cut short: the generator is closed, not run to its end
        assert gen.closed == [j.rid for j in gen.jobs] and gen.finished == []


# --------------------------------------------------------------------------------------------------
# chat


CHAT = {"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]}
RENDERED = "<|system|>\ns\n<|user|>\nhi\n<|assistant|>\n"


async def test_chat(make: Factory) -> None:
    client, gen = await make()
    status, body = await post(client, "/v1/chat/completions", {**CHAT, "max_completion_tokens": 12})
    assert status == 200 and body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": RENDERED[:12]},
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    assert (
        body["usage"]["prompt_tokens"] == len(RENDERED.encode()) and body["usage"]["completion_tokens"] == 12
    )
    assert gen.jobs[0].prompt_ids == tuple(RENDERED.encode()) and len(gen.jobs[0].rid) == 9 + 32


async def test_chat_stream(make: Factory) -> None:
    client, _ = await make(per=4)
    status, events = await post(client, "/v1/chat/completions", {**CHAT, "max_tokens": 10, "stream": True})
    assert status == 200 and events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == RENDERED[:10]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


async def test_chat_stream_usage_chunk(make: Factory) -> None:
    client, _ = await make()
    body = {**CHAT, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    _, events = await post(client, "/v1/chat/completions", body)
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == len(RENDERED.encode()) + 3


# --------------------------------------------------------------------------------------------------
# n choices, log probabilities


async def test_n_choices_with_logprobs(make: Factory) -> None:
    client, gen = await make(per=3, cached=2)
    body = {"prompt": "hello", "max_tokens": 7, "n": 3, "seed": 5, "logprobs": 2}
    status, resp = await post(client, "/v1/completions", body)
    assert status == 200 and [c["index"] for c in resp["choices"]] == [0, 1, 2]
    assert all(c["text"] == "hellohe" and c["finish_reason"] == "length" for c in resp["choices"])
    # the prompt counts once, completions add up, cached tokens are the first choice's
    assert resp["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 21,
        "total_tokens": 26,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    lp = resp["choices"][1]["logprobs"]
    assert lp["tokens"] == list("hellohe") and lp["text_offset"] == list(range(7))
    assert lp["token_logprobs"] == [-p / 8 for p in range(7)]
    assert lp["top_logprobs"][0] == {"h": 0.0, "i": -1.0}
    rid = resp["id"]
    assert [j.rid for j in gen.jobs] == [f"{rid}-{i}" for i in range(3)]
    assert [j.sampling.seed for j in gen.jobs] == [5, 6, 7] and all(j.logprobs == 2 for j in gen.jobs)


async def test_n_choices_stream(make: Factory) -> None:
    client, gen = await make(per=2)
    body = {**CHAT, "max_tokens": 5, "n": 2, "stream": True, "logprobs": True, "top_logprobs": 1}
    body["stream_options"] = {"include_usage": True}
    status, events = await post(client, "/v1/chat/completions", body)
    assert status == 200 and events[-1] == "[DONE]"
    chunks = events[:-2]
    assert all(len(c["choices"]) == 1 for c in chunks)
    for i in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(m["delta"].get("content", "") for m in mine) == RENDERED[:5]
        assert [m["finish_reason"] for m in mine][-1] == "length"
        content = [e for m in mine if m["logprobs"] for e in m["logprobs"]["content"]]
        assert [e["token"] for e in content] == list(RENDERED[:5])
        assert [e["logprob"] for e in content] == [-p / 8 for p in range(5)]
        assert all(e["bytes"] == list(e["token"].encode()) and len(e["top_logprobs"]) == 1 for e in content)
    assert events[-2]["usage"]["completion_tokens"] == 10
    # a stream draws each choice's own seed at the API (so a resumed stream samples the same tokens)
    seeds = [g.sampling.seed for g in gen.jobs]
    assert all(seed is not None for seed in seeds) and len(set(seeds)) == 2


@pytest.mark.parametrize("per", [1, 2, 3])
async def test_stop_string_across_chunks_keeps_logprobs(make: Factory, per: int) -> None:
    """A stop string split over deltas: the text stops before it; logprobs cover every id received."""
    client, _ = await make(per=per)
    body = {"prompt": "hello world", "stop": "o w", "max_tokens": 50, "logprobs": 0, "stream": True}
    _, events = await post(client, "/v1/completions", body)
    choices = [e["choices"][0] for e in events[:-1]]
    assert "".join(c["text"] for c in choices) == "hell" and choices[-1]["finish_reason"] == "stop"
    tokens = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
    received = -(-len("hello w") // per) * per  # whole deltas, up to the one that completed the stop
    assert "".join(tokens) == "hello world"[:received]
    offsets = [o for c in choices if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert offsets == list(range(len(tokens)))
    assert all(c["logprobs"]["top_logprobs"] == [{}] * len(c["logprobs"]["tokens"]) for c in choices)


async def test_one_failing_choice_fails_the_request(make: Factory) -> None:
    client, gen = await make(per=1, delay=0.001, fail_at=3)
    status, body = await post(client, "/v1/completions", {"prompt": "hello", "n": 2, "max_tokens": 9})
    assert_error(status, body, 502)
    assert sorted(gen.closed) == sorted(j.rid for j in gen.jobs)  # nothing left running


async def test_generate_with_logprobs(make: Factory) -> None:
    client, _ = await make(per=2)
    body = {"input_ids": [104, 105, 106], "sampling_params": {"max_new_tokens": 3}, "return_logprob": True,
            "top_logprobs_num": 1, "return_text_in_logprobs": True, "stream": True}  # fmt: skip
    _, events = await post(client, "/generate", body)
    meta = events[-2]["meta_info"]
    assert meta["output_token_logprobs"] == [[0.0, 104, "h"], [-0.125, 105, "i"], [-0.25, 106, "j"]]
    assert meta["output_top_logprobs"] == [[r] for r in meta["output_token_logprobs"]]
    assert len(events[0]["meta_info"]["output_token_logprobs"]) == 2  # cumulative, as the ids


# --------------------------------------------------------------------------------------------------
# SGLang native /generate


async def test_generate(make: Factory) -> None:
    client, gen = await make()
    status, body = await post(
        client,
        "/generate",
        {"text": "hello", "sampling_params": {"max_new_tokens": 3}, "rid": "my-rid", "return_logprob": False},
    )
    assert status == 200
    assert body == {
        "text": "hel",
        "output_ids": [104, 101, 108],
        "meta_info": {
            "id": "my-rid",
            "prompt_tokens": 5,
            "completion_tokens": 3,
            "cached_tokens": 0,
            "finish_reason": {"type": "length", "length": 3},
        },
    }
    assert gen.jobs[0].rid.startswith("gen-")  # the client's rid names the response only


async def test_generate_stream_is_cumulative(make: Factory) -> None:
    client, gen = await make(per=2)
    _, events = await post(
        client, "/generate", {"input_ids": list(b"abcdef"), "stream": True, "sampling_params": {"stop": "de"}}
    )
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    # "d" is held back as a possible start of "de"; the delta that completes the stop ends the text
    assert [c["text"] for c in chunks] == ["ab", "abc", "abc"]
    assert [c["output_ids"] for c in chunks] == [[97, 98], [97, 98, 99, 100], list(b"abcdef")]
    assert chunks[0]["meta_info"]["finish_reason"] is None
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": "de"}
    assert chunks[-1]["meta_info"]["id"] == gen.jobs[0].rid and gen.closed == [gen.jobs[0].rid]


async def test_generate_stop_token(make: Factory) -> None:
    client, _ = await make()
    _, body = await post(client, "/generate", {"text": "ab<|eos|>"})
    assert body["text"] == "ab" and body["output_ids"] == [97, 98, 257]
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": 257}


# --------------------------------------------------------------------------------------------------
# validation errors


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 101}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": True}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "n": 17}, 400, "n"),
        ("/v1/completions", {"prompt": "x", "logprobs": 6}, 400, "logprobs"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            400,
            "top_logprobs",
        ),
        ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"prompt": []}, 400, "prompt"),
        ("/v1/completions", {}, 400, "prompt"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            400,
            "messages[0].content[0].type",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400, "top_p"),
        (
            "/generate",
            {"text": "x", "sampling_params": {"max_new_tokens": 1000}},
            400,
            "sampling_params.max_new_tokens",
        ),
        ("/generate", {"input_ids": [1, 999]}, 400, "input_ids"),
    ],
)
async def test_validation_errors(make: Factory, path: str, body: Any, status: int, param: str) -> None:
    client, gen = await make()
    for stream in (False, True):
        got, resp = await post(client, path, {**body, "stream": stream})
        assert_error(got, resp, status, param)
    assert gen.jobs == []  # bad input changes nothing


@pytest.mark.parametrize(
    "raw,match",
    [
        (b"{bad", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b"", "not valid JSON"),
        (b'"s"', "JSON object"),
    ],
)
async def test_malformed_bodies(make: Factory, raw: bytes, match: str) -> None:
    client, _ = await make()
    for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
        resp = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
        err = assert_error(resp.status, await resp.json(), 400)
        assert match in err["message"] and err["type"] == "invalid_request_error"


async def test_prompt_over_the_limit(make: Factory) -> None:
    client, _ = await make()
    status, body = await post(client, "/v1/completions", {"prompt": "x" * 201})
    assert assert_error(status, body, 400, "prompt")["code"] == "context_length_exceeded"
    status, body = await post(
        client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 190}]}
    )
    assert assert_error(status, body, 400, "messages")["code"] == "context_length_exceeded"
    status, body = await post(client, "/generate", {"input_ids": [1] * 201})
    assert assert_error(status, body, 400, "input_ids")["code"] == "context_length_exceeded"
    status, body = await post(client, "/v1/completions", {"prompt": "x" * 200, "max_tokens": 1})
    assert status == 200


async def test_oversize_body(make: Factory) -> None:
    client, gen = await make()
    big = {"prompt": "x", "junk": "y" * 20_000}
    status, body = await post(client, "/v1/completions", big)
    assert assert_error(status, body, 413)["code"] == "request_too_large"

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: the limit holds while reading
        yield b'{"prompt": "x", "junk": "'
        for _ in range(20):
            yield b"y" * 1024
        yield b'"}'

    resp = await client.post("/v1/completions", data=chunks())
    assert_error(resp.status, await resp.json(), 413)
    assert gen.jobs == []


async def test_unknown_route_and_method(make: Factory) -> None:
    client, _ = await make()
    resp = await client.post("/v1/nothing", json={})
    assert_error(resp.status, await resp.json(), 404)
    resp = await client.get("/v1/completions")
    err = assert_error(resp.status, await resp.json(), 405)
    assert err["code"] == "method_not_allowed" and "POST" in resp.headers["Allow"]


async def test_internal_error_is_generic(make: Factory) -> None:
    client, _ = await make()
    resp = await client.get("/boom")
    text = await resp.text()
    assert resp.status == 500 and "secret" not in text and "Traceback" not in text
    assert json.loads(text)["error"]["message"] == "internal server error"


# --------------------------------------------------------------------------------------------------
# models and auth


async def test_models(make: Factory) -> None:
    client, _ = await make()
    resp = await client.get("/v1/models")
    body = await resp.json()
    assert body["object"] == "list" and [(m["id"], m["owned_by"]) for m in body["data"]] == [("m", "lumen")]
    assert (await (await client.get("/v1/models/m")).json())["id"] == "m"
    resp = await client.get("/v1/models/other")
    assert assert_error(resp.status, await resp.json(), 404)["code"] == "model_not_found"


async def test_auth(make: Factory) -> None:
    config = Config(
        gateway=GatewaySection(served_model_name="m", api_keys=(KEY, "another-key-2")), limits=CONFIG.limits
    )
    client, gen = await make(config)
    for headers in (
        {},
        {"Authorization": "Bearer wrong-key-123"},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": "Bearer"},
    ):
        for method, path in (
            ("POST", "/v1/completions"),
            ("GET", "/v1/models"),
            ("POST", "/generate"),
            ("POST", "/v1/chat/completions"),
        ):
            resp = await client.request(method, path, json={"prompt": "x"}, headers=headers)
            err = assert_error(resp.status, await resp.json(), 401)
            assert err["type"] == "authentication_error" and resp.headers["WWW-Authenticate"] == "Bearer"
    assert gen.jobs == []
    resp = await client.post(
        "/v1/completions", json={"prompt": "x"}, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert resp.status == 200
    assert gen.jobs[0].labels["api_key"].startswith("key-") and KEY not in gen.jobs[0].labels["api_key"]


# --------------------------------------------------------------------------------------------------
# generator errors and disconnects


@pytest.mark.parametrize(
    "path,body",
    [("/v1/completions", {"prompt": "hello"}), ("/generate", {"text": "hi"}), ("/v1/chat/completions", CHAT)],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_error_before_first_token(make: Factory, path: str, body: Any, stream: bool) -> None:
    client, gen = await make(fail_at=0, error=NoWorkerAvailable("no healthy worker within 5 s"))
    status, resp = await post(client, path, {**body, "stream": stream})
    assert assert_error(status, resp, 503)["code"] == "no_healthy_worker"
    assert gen.closed == [gen.jobs[0].rid]


async def test_error_after_first_token_streams_an_error_event(make: Factory) -> None:
    client, _ = await make(fail_at=3)
    status, events = await post(client, "/v1/chat/completions", {**CHAT, "stream": True})
    assert status == 200 and "[DONE]" not in events
    assert events[-1] == UpstreamFailed("worker w0 failed").body()
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == RENDERED[:3]
    status, body = await post(client, "/v1/completions", {"prompt": "hello"})  # not streamed: a plain error
    assert assert_error(status, body, 502)["code"] == "worker_failed"


async def test_unexpected_generator_exception(make: Factory) -> None:
    client, _ = await make(fail_at=2, error=RuntimeError("secret bug"))
    status, events = await post(client, "/generate", {"text": "hello", "stream": True})
    assert status == 200 and events[-1]["error"]["message"] == "internal server error"
    resp = await client.post("/generate", json={"text": "hello"})
    assert resp.status == 500 and "secret" not in await resp.text()


@pytest.mark.parametrize("error", [GatewayError("x"), UpstreamFailed("y")])
async def test_gateway_error_statuses(make: Factory, error: GatewayError) -> None:
    client, _ = await make(fail_at=0, error=error)
    status, body = await post(client, "/v1/completions", {"prompt": "hello"})
    assert status == error.status and body == error.body()


async def test_client_disconnect_closes_generator(make: Factory) -> None:
    client, gen = await make(delay=0.01)
    body = {"prompt": "abc", "max_tokens": 100, "stream": True}
    resp = await client.post("/v1/completions", json=body, headers=RESUMABLE_HEADERS)
    assert resp.status == 200
    first = await resp.content.readuntil(b"\n\n")
    assert first.startswith(b"id: ") and b"\ndata: " in first
    resp.close()  # the client goes away mid-stream
    for _ in range(200):
        if gen.closed:
            break
        await asyncio.sleep(0.01)
    assert gen.closed == [gen.jobs[0].rid] and gen.finished == []


async def test_model_name_with_a_slash(make: Factory) -> None:
    config = Config(gateway=GatewaySection(served_model_name="org/model-1"), limits=CONFIG.limits)
    client, _ = await make(config)
    assert (await (await client.get("/v1/models/org/model-1")).json())["id"] == "org/model-1"
    status, body = await post(
        client, "/v1/completions", {"model": "org/model-1", "prompt": "x", "max_tokens": 1}
    )
    assert status == 200 and body["model"] == "org/model-1"
