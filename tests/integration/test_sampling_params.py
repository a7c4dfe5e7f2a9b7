"""`/generate`'s sampling_params are checked as strictly as the OpenAI bodies, with one parser
(gateway.protocol.openai.requests.parse_sampling_params), on the gateway and on Lumen's worker: an
unknown key, an SGLang key not honoured at a non-neutral value, or a value out of range is a 400 in
OpenAI's error shape naming `sampling_params.<key>`; SGLang's defaults (what SMG sends) are served."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.config import Config
from gateway.protocol.launch import EngineSpec
from gateway.server.api.jobs import GenerateJob, TokenDelta
from gateway.server.api.middleware import error_middleware
from gateway.server.api.routes import add_client_routes
from gateway.server.api.tokenizer import ByteTokenizer
from worker_hooks.engine.service import Worker, start_worker


class OneToken:
    def __init__(self) -> None:
        self.jobs: list[GenerateJob] = []

    async def generate(self, job: GenerateJob) -> AsyncIterator[TokenDelta]:
        self.jobs.append(job)
        yield TokenDelta((65,), "length")


@pytest.fixture
async def gateway() -> AsyncIterator[tuple[TestClient[Any, Any], OneToken]]:
    gen = OneToken()
    app = web.Application(middlewares=[error_middleware])
    add_client_routes(app, config=Config(), tokenizer=ByteTokenizer(), generator=gen)
    async with TestClient(TestServer(app)) as client:
        yield client, gen


@pytest.fixture
async def worker() -> AsyncIterator[Worker]:
    spec = EngineSpec(
        worker_id="w-sp", control_address="", model="Qwen3-0.6B", gpu="H100-80G", time_scale=0.01
    )
    async with start_worker(spec) as w:
        yield w


# (sampling_params, the param named, the code): refused on both sides
REFUSED = [
    ({"bogus": 1}, "sampling_params.bogus", "unknown_parameter"),
    ({"max_new_tokens": 4, "Temperature": 0.5}, "sampling_params.Temperature", "unknown_parameter"),
    ({"repetition_penalty": 1.2}, "sampling_params.repetition_penalty", "unsupported_parameter"),
    ({"min_p": 0.1}, "sampling_params.min_p", "unsupported_parameter"),
    ({"n": 2}, "sampling_params.n", "unsupported_parameter"),
    ({"regex": "a+"}, "sampling_params.regex", "unsupported_parameter"),
    ({"skip_special_tokens": False}, "sampling_params.skip_special_tokens", "unsupported_parameter"),
    ({"temperature": -1}, "sampling_params.temperature", "invalid_value"),
    ({"temperature": "hot"}, "sampling_params.temperature", "invalid_type"),
    ({"top_p": 0}, "sampling_params.top_p", "invalid_value"),
    ({"top_k": 0}, "sampling_params.top_k", "invalid_value"),
    ({"max_new_tokens": -1}, "sampling_params.max_new_tokens", "invalid_value"),
    ({"ignore_eos": "yes"}, "sampling_params.ignore_eos", "invalid_type"),
    ({"stop_token_ids": [1, 100000]}, "sampling_params.stop_token_ids", "invalid_value"),
    ([1, 2], "sampling_params", "invalid_type"),
]
# SGLang's defaults, as SGLang clients and SMG send them: served
NEUTRAL = {
    "max_new_tokens": 3,
    "temperature": 0,
    "repetition_penalty": 1.0,
    "frequency_penalty": 0,
    "presence_penalty": 0.0,
    "min_p": 0.0,
    "min_new_tokens": 0,
    "n": 1,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
    "logit_bias": {},
    "json_schema": None,
    "stop_regex": "",
}


def assert_refusal(status: int, body: Any, param: str, code: str) -> None:
    assert status == 400, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, code), err


@pytest.mark.parametrize(("sp", "param", "code"), REFUSED)
async def test_the_gateway_refuses_bad_sampling_params(
    gateway: tuple[TestClient[Any, Any], OneToken], sp: Any, param: str, code: str
) -> None:
    client, gen = gateway
    async with client.post("/generate", json={"input_ids": [1, 2], "sampling_params": sp}) as r:
        assert_refusal(r.status, await r.json(), param, code)
    assert gen.jobs == []


@pytest.mark.parametrize(("sp", "param", "code"), REFUSED)
async def test_the_worker_refuses_bad_sampling_params(worker: Worker, sp: Any, param: str, code: str) -> None:
    body = {"rid": "r1", "input_ids": [1, 2], "sampling_params": sp, "stream": False}
    async with aiohttp.ClientSession() as http, http.post(worker.url + "/generate", json=body) as r:
        assert_refusal(r.status, await r.json(), param, code)
    assert worker.engine.stats().requests_total == 0


async def test_the_gateway_serves_sglang_defaults_and_honours_stop_and_seed(
    gateway: tuple[TestClient[Any, Any], OneToken],
) -> None:
    client, gen = gateway
    sp = NEUTRAL | {"stop": ["x"], "sampling_seed": 7}
    async with client.post("/generate", json={"input_ids": [1, 2], "sampling_params": sp}) as r:
        assert r.status == 200, await r.text()
    assert gen.jobs[0].sampling.seed == 7 and gen.jobs[0].sampling.max_new_tokens == 3


async def test_the_worker_serves_sglang_defaults_but_not_stop_strings_or_seeds(worker: Worker) -> None:
    async with aiohttp.ClientSession() as http:
        body = {"input_ids": [72, 105], "sampling_params": NEUTRAL, "stream": False}
        async with http.post(worker.url + "/generate", json=body) as r:
            assert r.status == 200, await r.text()
            assert len((await r.json())["output_ids"]) == 3
        for key, value in (("stop", "x"), ("sampling_seed", 7)):
            body = {"input_ids": [72], "sampling_params": {key: value}}
            async with http.post(worker.url + "/generate", json=body) as r:
                assert_refusal(r.status, await r.json(), f"sampling_params.{key}", "unsupported_parameter")


async def test_the_worker_refuses_invalid_utf8_with_a_400(worker: Worker) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.post(worker.url + "/generate", data=b'{"input_ids": [1], "rid": "\xff"}') as r,
    ):
        assert r.status == 400
        assert (await r.json())["error"]["type"] == "invalid_request_error"
