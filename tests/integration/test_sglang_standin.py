"""The SGLang stand-in (tests/fixtures/sglang_standin.py) behaves like SGLang 0.5.23 where Lumen relies on it.

In-process servers, real HTTP over loopback; one test runs it as a process. Each test waits on events
(stream chunks, the engine's state changes), never on a timer.
"""

from __future__ import annotations

import asyncio
import base64
import glob
import hashlib
import json
import os
import re
import signal
import sys
import time
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.fixtures import sglang_api_types as api
from tests.fixtures.sglang_standin import SGLangStandIn, Vocab, expected_ids, greedy_ids, start_standin

REPO = Path(__file__).resolve().parents[2]
VENDORED = REPO / "tests" / "fixtures" / "sglang_api_types.py"
HEADER_END = "# ---- end of vendoring header: the original file follows verbatim ----\n"
WHEEL_MEMBER = "sglang/api/v1/api_types.py"
PROMPT = list(b"The stand-in answers like SGLang. ")
LONG = 20_000  # new tokens for a stream a test ends early (context length 32768)

Json = dict[str, Any]


# --------------------------------------------------------------------------------------------------
# helpers


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def standin() -> AsyncIterator[SGLangStandIn]:
    server = await start_standin(token_delay_ms=1)
    yield server
    await server.stop()


def body(input_ids: list[int], max_new_tokens: int | None, **extra: Any) -> Json:
    sampling = {"max_new_tokens": max_new_tokens, "temperature": 0.0, **extra.pop("sampling", {})}
    return {"input_ids": input_ids, "sampling_params": sampling, **extra}


def conforms(answer: Json) -> Json:
    """Every answer decodes with SGLang's own response contract (text is never null there)."""
    if "error" in answer:
        api.GenerateStreamError.from_json_value(answer)
    else:
        api.GenerateResponse.from_json_value(answer)
    return answer


async def generate(http: aiohttp.ClientSession, server: SGLangStandIn, payload: Json) -> tuple[int, Any]:
    async with http.post(server.url + "/generate", json=payload) as resp:
        answer = await resp.json()
        return resp.status, conforms(answer) if resp.status == 200 else answer


async def events(resp: aiohttp.ClientResponse) -> AsyncIterator[Json | None]:
    """SSE `data:` payloads; None for `[DONE]`."""
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        yield None if data == "[DONE]" else conforms(json.loads(data))


async def stream_all(http: aiohttp.ClientSession, url: str, payload: Json) -> list[Json | None]:
    async with http.post(url + "/generate", json={**payload, "stream": True}) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        return [e async for e in events(resp)]


def text_of(ids: list[int]) -> str:
    return bytes(ids).decode()


# --------------------------------------------------------------------------------------------------
# the vendored contract


def _vendored_parts() -> tuple[str, bytes]:
    text = VENDORED.read_bytes()
    header, sep, original = text.partition(HEADER_END.encode())
    assert sep, "the vendoring header's end line is missing"
    return header.decode(), original


def test_vendored_contract_sha256_matches_its_header() -> None:
    header, original = _vendored_parts()
    recorded = re.search(r"^#\s+sha256:\s+([0-9a-f]{64})", header, re.MULTILINE)
    assert recorded, "the header records no sha256"
    assert hashlib.sha256(original).hexdigest() == recorded.group(1)
    assert "Apache License, Version 2.0" in header and "sglang 0.5.23" in header


def _local_wheel() -> str | None:
    named = os.environ.get("LUMEN_SGLANG_WHEEL")
    if named:
        return named if os.path.exists(named) else None
    found = sorted(glob.glob("/tmp/sgl/sglang-0.5.23-*.whl"))
    return found[0] if found else None


def test_vendored_contract_equals_the_wheels_file() -> None:
    wheel = _local_wheel()
    if wheel is None:
        pytest.skip("no sglang 0.5.23 wheel here: set LUMEN_SGLANG_WHEEL or put it in /tmp/sgl/")
    _, original = _vendored_parts()
    with zipfile.ZipFile(wheel) as zf:
        assert zf.read(WHEEL_MEMBER) == original
        record = zf.read("sglang-0.5.23.dist-info/RECORD").decode()
    digest = base64.urlsafe_b64encode(hashlib.sha256(original).digest()).rstrip(b"=").decode()
    assert f"{WHEEL_MEMBER},sha256={digest}," in record


# --------------------------------------------------------------------------------------------------
# /generate: contract, determinism, replay


async def test_contract_refuses_an_unknown_sampling_key_and_admits_a_normal_body(
    http: aiohttp.ClientSession, standin: SGLangStandIn
) -> None:
    bad = body(PROMPT, 4, sampling={"frequency_penalties": 0.5})
    status, answer = await generate(http, standin, bad)
    assert status == 400
    assert answer["error"].startswith("unknown field `frequency_penalties`, expected one of `max_new_tokens`")
    assert standin.refused == [{"stage": "contract", "error": answer["error"], "body": bad}]

    status, answer = await generate(http, standin, body(PROMPT, 4, rid="ok-1"))
    assert status == 200 and answer["output_ids"] == greedy_ids(PROMPT, 4)
    async with http.get(standin.url + "/standin/stats") as resp:
        stats = await resp.json()
    assert stats["refused_count"] == 1 and stats["rids"] == ["ok-1"] and stats["requests"] == 1


async def test_value_errors_are_400s_or_sse_error_chunks(
    http: aiohttp.ClientSession, standin: SGLangStandIn
) -> None:
    status, answer = await generate(http, standin, body(PROMPT, 4, sampling={"temperature": -1.0}))
    assert status == 400 and answer == {
        "error": {"message": "temperature must be a non-negative finite number, got -1.0."}
    }
    chunks = await stream_all(http, standin.url, body([], 4))
    assert chunks == [
        {
            "error": {
                "message": "input_ids cannot be empty.",
                "type": "invalid_request_error",
                "code": 400,
                "retryable": False,
            }
        },
        None,
    ]
    assert [r["stage"] for r in standin.refused] == ["request", "request"]


async def test_greedy_is_deterministic_and_a_replay_continues_exactly(
    http: aiohttp.ClientSession, standin: SGLangStandIn
) -> None:
    want = expected_ids(PROMPT, 24, temperature=0.0)
    status, answer = await generate(http, standin, body(PROMPT, 24, rid="g-1"))
    assert status == 200 and answer["output_ids"] == want
    assert answer["text"] == text_of(want)
    meta = answer["meta_info"]
    assert meta["id"] == "g-1" and meta["finish_reason"] == {"type": "length", "length": 24}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(PROMPT), 24)
    assert meta["e2e_latency"] > 0
    assert all(32 <= t < 127 for t in want)
    for k in (1, 9, 23):  # resume after k tokens: prompt + emitted ids, fewer new tokens
        status, replay = await generate(http, standin, body(PROMPT + want[:k], 24 - k))
        assert replay["output_ids"] == want[k:]
    # top_k == 1 is greedy too, whatever the temperature
    status, answer = await generate(
        http, standin, body(PROMPT, 24, sampling={"temperature": 0.9, "top_k": 1})
    )
    assert answer["output_ids"] == want


@pytest.mark.parametrize("seed", [1234, -(2**63)])
async def test_seeded_sampling_is_deterministic_and_replays(
    http: aiohttp.ClientSession, standin: SGLangStandIn, seed: int
) -> None:
    sampling = {"temperature": 1.3, "top_p": 0.95, "sampling_seed": seed}
    want = expected_ids(PROMPT, 32, temperature=1.3, seed=seed, top_p=0.95)
    _, first = await generate(http, standin, body(PROMPT, 32, sampling=sampling))
    _, second = await generate(http, standin, body(PROMPT, 32, sampling=sampling))
    assert first["output_ids"] == second["output_ids"] == want
    assert want != greedy_ids(PROMPT, 32)
    assert want != expected_ids(PROMPT, 32, temperature=1.3, seed=seed + 1, top_p=0.95)
    _, replay = await generate(http, standin, body(PROMPT + want[:13], 19, sampling=sampling))
    assert replay["output_ids"] == want[13:]


async def test_unseeded_sampling_stays_in_the_token_range(http: aiohttp.ClientSession) -> None:
    server = await start_standin(token_delay_ms=1, vocab=Vocab(vocab_size=1000, token_lo=500, token_hi=520))
    try:
        _, answer = await generate(http, server, body([1, 2, 3], 64, sampling={"temperature": 2.0}))
        assert all(500 <= t < 520 for t in answer["output_ids"]) and len(answer["output_ids"]) == 64
        with pytest.raises(ValueError):
            expected_ids([1, 2, 3], 4, temperature=2.0)
    finally:
        await server.stop()


async def test_text_prompts_are_bytes(http: aiohttp.ClientSession, standin: SGLangStandIn) -> None:
    _, answer = await generate(
        http, standin, {"text": "héllo", "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
    )
    assert answer["output_ids"] == greedy_ids(list("héllo".encode()), 5)
    assert answer["meta_info"]["prompt_tokens"] == 6


async def test_stop_token_ids_and_stop_strings(http: aiohttp.ClientSession, standin: SGLangStandIn) -> None:
    want = greedy_ids(PROMPT, 40)
    stop_at = next(i for i in range(5, 40) if want[i] not in want[:i])
    stop_id = want[stop_at]
    _, answer = await generate(http, standin, body(PROMPT, 40, sampling={"stop_token_ids": [stop_id]}))
    assert answer["output_ids"] == want[: stop_at + 1]  # the stop id is kept in output_ids...
    assert answer["text"] == text_of(want[:stop_at])  # ...and trimmed from the text
    assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    _, answer = await generate(
        http, standin, body(PROMPT, 40, sampling={"stop_token_ids": [stop_id], "ignore_eos": True})
    )
    assert answer["output_ids"] == want  # ignore_eos also ignores stop_token_ids in SGLang

    full = text_of(want)
    stop = next(full[i : i + 2] for i in range(6, 30) if full[i : i + 2] not in full[: i + 1])
    _, answer = await generate(http, standin, body(PROMPT, 40, sampling={"stop": [stop]}))
    assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert answer["text"] == full[: full.index(stop)]
    assert answer["output_ids"] == want[: full.index(stop) + 2]


async def test_context_length_bounds_max_new_tokens(http: aiohttp.ClientSession) -> None:
    server = await start_standin(token_delay_ms=1, context_length=64)
    try:
        prompt = PROMPT[:30]
        status, answer = await generate(http, server, body(prompt, 40))
        assert (
            status == 400 and "exceeds the model's maximum context length of 64" in answer["error"]["message"]
        )
        for max_new in (None, 34):  # unbounded, or exactly the context: SGLang keeps one slot back
            _, answer = await generate(http, server, body(prompt, max_new))
            assert answer["output_ids"] == greedy_ids(prompt, 33)
            assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 33}
    finally:
        await server.stop()


# --------------------------------------------------------------------------------------------------
# streaming


async def test_default_streaming_sends_cumulative_ids(
    http: aiohttp.ClientSession, standin: SGLangStandIn
) -> None:
    want = greedy_ids(PROMPT, 12)
    chunks = await stream_all(http, standin.url, body(PROMPT, 12, rid="s-1"))
    assert chunks[-1] is None
    data = [c for c in chunks[:-1] if c is not None]
    for chunk in data:
        ids = chunk["output_ids"]
        assert ids == want[: len(ids)] and chunk["meta_info"]["completion_tokens"] == len(ids)
        # _stream_one_response resolves the deferred text: every chunk carries the text so far
        assert chunk["text"] == text_of(ids)
    assert [c["meta_info"]["finish_reason"] for c in data[:-1]] == [None] * (len(data) - 1)
    assert data[-1]["output_ids"] == want
    assert data[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert "e2e_latency" in data[-1]["meta_info"] and "response_sent_to_client_ts" in data[0]["meta_info"]


async def test_incremental_streaming_sends_new_ids_only(http: aiohttp.ClientSession) -> None:
    server = await start_standin(token_delay_ms=1, incremental_streaming_output=True)
    try:
        want = greedy_ids(PROMPT, 12)
        chunks = await stream_all(http, server.url, body(PROMPT, 12, return_logprob=True))
        data = [c for c in chunks if c is not None]
        assert [i for c in data for i in c["output_ids"]] == want
        assert "".join(c["text"] for c in data) == text_of(want)
        assert data[-1]["meta_info"]["completion_tokens"] == 12
        rows = [r for c in data for r in c["meta_info"]["output_token_logprobs"]]
        assert [r[1] for r in rows] == want  # output-side logprobs are sliced per chunk too
    finally:
        await server.stop()


# --------------------------------------------------------------------------------------------------
# aborts


async def _first_chunk(resp: aiohttp.ClientResponse) -> Json:
    async for event in events(resp):
        assert event is not None and "error" not in event, event
        return event
    raise AssertionError("the stream ended before its first chunk")


async def _final_chunk(resp: aiohttp.ClientResponse) -> Json:
    last: Json | None = None
    async for event in events(resp):
        if event is None:
            assert last is not None
            return last
        last = event
    raise AssertionError("the stream ended without [DONE]")


async def test_abort_matches_rid_prefixes_of_a_live_rid(
    http: aiohttp.ClientSession, standin: SGLangStandIn
) -> None:
    url = standin.url + "/generate"
    rids = ["job42", "job42-b", "other"]
    streams = [await http.post(url, json=body(PROMPT, LONG, rid=r, stream=True)) for r in rids]
    try:
        for resp in streams:
            await _first_chunk(resp)
        for rid in ("job4", "nobody", ""):  # not a live rid: SGLang's tokenizer manager drops it
            async with http.post(standin.url + "/abort_request", json={"rid": rid}) as resp:
                assert resp.status == 200
        async with http.post(standin.url + "/abort_request", json={"rid": "job42"}) as resp:
            assert resp.status == 200
        for resp in streams[:2]:
            final = await _final_chunk(resp)
            assert final["meta_info"]["finish_reason"] == {
                "type": "abort",
                "message": "Aborted",
                "status_code": None,
                "err_type": None,
            }
            assert final["output_ids"] == greedy_ids(PROMPT, len(final["output_ids"]))
        assert standin.engine.running and standin.engine.running[0].rid == "other"
        async with http.post(standin.url + "/abort_request", json={"rid": "", "abort_all": True}):
            pass
        assert (await _final_chunk(streams[2]))["meta_info"]["finish_reason"]["type"] == "abort"
        assert sorted(standin.stats()["aborted_rids"]) == sorted(rids)
    finally:
        for resp in streams:
            resp.release()


async def test_loads_count_waiting_requests_and_an_abort_in_the_queue(http: aiohttp.ClientSession) -> None:
    server = await start_standin(token_delay_ms=1, max_running_requests=1)
    try:
        url = server.url + "/generate"
        first = await http.post(url, json=body(PROMPT, LONG, rid="run", stream=True))
        await _first_chunk(first)
        second = await http.post(url, json=body(PROMPT, 5, rid="queued", stream=True))
        await server.wait_for(lambda e: len(e.waiting) == 1)
        async with http.get(server.url + "/v1/loads?include=core") as resp:
            loads = await resp.json()
        assert (
            loads["version"] == "0.5.23" and {"timestamp", "accelerator", "num_accelerators"} <= loads.keys()
        )
        (load,) = loads["loads"]
        assert (load["dp_rank"], load["num_running_reqs"], load["num_waiting_reqs"]) == (0, 1, 1)
        assert load["max_running_requests"] == 1 and load["max_total_num_tokens"] > 0
        assert load["num_used_tokens"] > len(PROMPT) and 0 < load["token_usage"] < 1
        assert "memory" not in load
        async with http.get(server.url + "/v1/loads") as resp:
            assert {"memory", "disaggregation", "queues"} <= (await resp.json())["loads"][0].keys()
        async with http.get(server.url + "/v1/loads?include=bogus") as resp:
            assert resp.status == 400 and (await resp.json())["object"] == "error"

        async with http.post(server.url + "/abort_request", json={"rid": "queued"}):
            pass
        final = await _final_chunk(second)
        assert final["output_ids"] == [] and final["meta_info"]["completion_tokens"] == 0
        assert final["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
        first.close()  # a client that disconnects is aborted
        await server.wait_for(lambda e: not e.running and not e.live)
    finally:
        await server.stop()


# --------------------------------------------------------------------------------------------------
# logprobs: the gateway-level greedy verification path


async def test_greedy_verification_of_drafts_through_input_top_logprobs(
    http: aiohttp.ClientSession, standin: SGLangStandIn
) -> None:
    context = PROMPT * 3
    greedy = greedy_ids(context, 6)
    accepted = 3
    wrong = next(t for t in range(32, 127) if t != greedy[accepted])
    drafts = [*greedy[:accepted], wrong, *greedy_ids(context + greedy[:accepted] + [wrong], 2)]
    payload = body(
        context + drafts,
        1,
        return_logprob=True,
        logprob_start_len=len(context) - 1,
        top_logprobs_num=1,
    )
    status, answer = await generate(http, standin, payload)
    assert status == 200
    meta = answer["meta_info"]
    tops, tokens = meta["input_top_logprobs"], meta["input_token_logprobs"]
    assert len(tops) == len(tokens) == len(drafts) + 1
    assert tops[0] is None and tokens[0] == [None, context[-1], None]
    for i, draft in enumerate(drafts, start=1):
        target = greedy_ids(context + drafts[: i - 1], 1)[0]
        ((top_lp, top_id, top_text),) = tops[i]
        assert top_id == target and top_text is None
        assert tokens[i][1] == draft
        assert (tokens[i][0] == top_lp) == (draft == target)
        assert tokens[i][0] <= top_lp
    targets = [tops[i][0][1] for i in range(1, len(drafts) + 1)]
    n_accepted = next(i for i, (d, t) in enumerate(zip(drafts, targets, strict=True)) if d != t)
    assert n_accepted == accepted
    bonus = greedy_ids(context + drafts, 1)
    assert answer["output_ids"] == bonus
    assert (
        meta["output_token_logprobs"][0][1] == bonus[0] and meta["output_top_logprobs"][0][0][1] == bonus[0]
    )
    assert meta["cached_tokens"] <= len(context) - 1


async def test_logprob_defaults_top_n_and_a_start_past_the_input(
    http: aiohttp.ClientSession, standin: SGLangStandIn
) -> None:
    _, answer = await generate(http, standin, body(PROMPT, 3, return_logprob=True, top_logprobs_num=3))
    meta = answer["meta_info"]
    assert meta["input_token_logprobs"] == [] and meta["input_top_logprobs"] == []
    assert meta["output_token_logprobs_length"] == 3
    for row, token in zip(meta["output_top_logprobs"], answer["output_ids"], strict=True):
        assert len(row) == 3 and row[0][1] == token
        assert row[0][0] > row[1][0] > row[2][0]
        assert sum(2.718281828459045 ** r[0] for r in row) < 1.0
    _, answer = await generate(
        http,
        standin,
        body([256, 65, 258, 66], 1, return_logprob=True, logprob_start_len=0, top_logprobs_num=12),
    )
    # ids >= vocab_size - 1 are reported as 0 (logprob_result_processor); rows go past the candidates
    assert [row[1] for row in answer["meta_info"]["input_token_logprobs"]] == [256, 65, 0, 66]
    assert [len(row) for row in answer["meta_info"]["input_top_logprobs"][1:]] == [12, 12, 12]
    status, answer = await generate(
        http, standin, body(PROMPT, 3, return_logprob=True, logprob_start_len=len(PROMPT) + 1)
    )
    assert status == 400 and "is higher than the number of input tokens" in answer["error"]["message"]


# --------------------------------------------------------------------------------------------------
# cached_tokens (the radix-cache stand-in)


async def test_cached_tokens_are_page_aligned_prefix_hits(
    http: aiohttp.ClientSession, standin: SGLangStandIn
) -> None:
    prompt = [32 + (i * 7) % 90 for i in range(200)]
    _, first = await generate(http, standin, body(prompt, 4))
    assert first["meta_info"]["cached_tokens"] == 0
    _, again = await generate(http, standin, body(prompt, 4))
    assert again["meta_info"]["cached_tokens"] == 192  # at most len - 1 = 199, by pages of 64
    _, shared = await generate(http, standin, body(prompt[:130] + [33] * 70, 4))
    assert shared["meta_info"]["cached_tokens"] == 128
    extended = prompt + first["output_ids"][:3] + [40] * 60  # a finished request's output is cached too
    _, longer = await generate(http, standin, body(extended, 4))
    assert longer["meta_info"]["cached_tokens"] == 192
    _, with_logprobs = await generate(
        http, standin, body(prompt, 1, return_logprob=True, logprob_start_len=100)
    )
    assert with_logprobs["meta_info"]["cached_tokens"] == 64  # capped by logprob_start_len


# --------------------------------------------------------------------------------------------------
# health, ready, models


async def test_health_ready_and_model_routes(http: aiohttp.ClientSession, standin: SGLangStandIn) -> None:
    async with http.get(standin.url + "/ready") as resp:
        assert resp.status == 200 and await resp.read() == b""
    started = time.monotonic()
    async with http.get(standin.url + "/health_generate") as resp:
        assert resp.status == 200
    assert time.monotonic() - started >= 1.0
    async with http.get(standin.url + "/v1/models") as resp:
        (card,) = (await resp.json())["data"]
        assert card["object"] == "model" and card["owned_by"] == "sglang"
    async with http.get(standin.url + "/get_model_info") as resp:
        assert (await resp.json())["is_generation"] is True
    async with http.get(standin.url + "/metrics") as resp:
        assert resp.status == 404
    assert standin.stats()["rids"] == [] and standin.stats()["health_checks"] == 1


# --------------------------------------------------------------------------------------------------
# faults


async def _fault(http: aiohttp.ClientSession, server: SGLangStandIn, kind: str, **params: Any) -> Json:
    async with http.post(server.url + "/standin/fault", json={"kind": kind, **params}) as resp:
        assert resp.status == 200
        answer: Json = await resp.json()
        return answer


async def test_fault_kill_drops_connections_and_stops_answering(http: aiohttp.ClientSession) -> None:
    server = await start_standin(token_delay_ms=1)
    try:
        resp = await http.post(server.url + "/generate", json=body(PROMPT, LONG, stream=True))
        await _first_chunk(resp)
        await _fault(http, server, "kill")
        with pytest.raises(aiohttp.ClientError):
            async for event in events(resp):
                assert event is not None  # never [DONE]
        resp.release()
        async with aiohttp.ClientSession() as fresh:
            with pytest.raises(aiohttp.ClientConnectionError):
                await fresh.get(server.url + "/ready")
    finally:
        await server.stop()


async def test_fault_hang_stops_tokens_and_answers_until_normal(
    http: aiohttp.ClientSession, standin: SGLangStandIn
) -> None:
    want = greedy_ids(PROMPT, 300)
    async with http.post(standin.url + "/generate", json=body(PROMPT, 300, stream=True)) as resp:
        await _first_chunk(resp)
        await _fault(http, standin, "hang")
        generated = standin.engine.counters.total_generated_tokens
        for path in ("/ready", "/v1/loads"):
            with pytest.raises(TimeoutError):
                await http.get(standin.url + path, timeout=aiohttp.ClientTimeout(total=0.3))
        assert standin.engine.counters.total_generated_tokens == generated
        await _fault(http, standin, "normal")
        final = await _final_chunk(resp)
        assert final["output_ids"] == want
    async with http.get(standin.url + "/ready") as ready:
        assert ready.status == 200


async def test_fault_stall_fails_health_then_ready(http: aiohttp.ClientSession) -> None:
    server = await start_standin(token_delay_ms=1, health_check_timeout_s=1.0, enable_metrics=True)
    try:
        async with http.get(server.url + "/metrics") as resp:
            assert "sglang:num_running_reqs" in await resp.text()
        server.stall()
        async with http.get(server.url + "/v1/loads?include=core") as resp:
            first = (await resp.json())["loads"][0]
        async with http.get(server.url + "/ready") as resp:
            assert resp.status == 200  # the HTTP side still answers...
        async with http.get(server.url + "/health") as resp:
            assert resp.status == 503  # ...but the 1-token generation never comes back
        async with http.get(server.url + "/ready") as resp:
            assert resp.status == 503
        async with http.get(server.url + "/v1/loads?include=core") as resp:
            assert (await resp.json())["loads"][0]["timestamp"] == first["timestamp"]  # frozen
        server.normal()
        async with http.get(server.url + "/ready") as resp:
            assert resp.status == 200
    finally:
        await server.stop()


async def test_fault_slow_and_not_ready(http: aiohttp.ClientSession) -> None:
    server = await start_standin(token_delay_ms=2)
    try:
        await _fault(http, server, "slow", factor=20)
        _, answer = await generate(http, server, body(PROMPT, 5))
        assert answer["meta_info"]["e2e_latency"] >= 5 * 0.040 * 0.9
        await _fault(http, server, "not_ready")
        async with http.get(server.url + "/ready") as resp:
            assert resp.status == 503
        await _fault(http, server, "normal")
        async with http.get(server.url + "/ready") as resp:
            assert resp.status == 200
        assert server.stats()["faults"]["slow_factor"] == 1.0
    finally:
        await server.stop()


async def test_fault_error_chunk_ends_a_stream_mid_way(
    http: aiohttp.ClientSession, standin: SGLangStandIn
) -> None:
    await _fault(http, standin, "error_chunk", after_tokens=3, message="boom")
    chunks = await stream_all(http, standin.url, body(PROMPT, LONG, rid="err-1"))
    assert chunks[-1] is None
    error = chunks[-2]
    assert error == {
        "error": {"message": "boom", "type": "invalid_request_error", "code": 500, "retryable": False}
    }
    data = [c for c in chunks[:-2] if c is not None]
    assert data and data[-1]["meta_info"]["completion_tokens"] >= 3
    assert data[-1]["output_ids"] == greedy_ids(PROMPT, len(data[-1]["output_ids"]))
    await standin.wait_for(lambda e: not e.running)
    assert standin.stats()["aborted_rids"] == ["err-1"]

    # scope "all": every running stream
    url = standin.url + "/generate"
    streams = [await http.post(url, json=body(PROMPT, LONG, rid=f"all-{i}", stream=True)) for i in range(2)]
    for resp in streams:
        await _first_chunk(resp)
    assert (await _fault(http, standin, "error_chunk", scope="all"))["streams"] == 2
    for resp in streams:
        tail = [e async for e in events(resp)]
        assert tail[-1] is None and tail[-2] is not None and tail[-2]["error"]["code"] == 500
        resp.release()


# --------------------------------------------------------------------------------------------------
# as a real process


async def _start_process(*args: str) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.fixtures.sglang_standin",
        "--port",
        "0",
        "--token-delay-ms",
        "1",
        *args,
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    async with asyncio.timeout(30):
        line = await proc.stdout.readline()
    ready = json.loads(line)
    assert ready["event"] == "ready" and ready["pid"] == proc.pid
    return proc, ready["url"]


async def test_runs_as_a_process_and_dies_by_its_pid(http: aiohttp.ClientSession) -> None:
    proc, url = await _start_process()
    try:
        async with http.post(url + "/generate", json=body(PROMPT, 8)) as resp:
            assert (await resp.json())["output_ids"] == greedy_ids(PROMPT, 8)
        chunks = await stream_all(http, url, body(PROMPT, 8, rid="p-1"))
        assert chunks[-2] is not None and chunks[-2]["output_ids"] == greedy_ids(PROMPT, 8)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        assert await proc.wait() == -signal.SIGKILL


async def test_the_kill_fault_exits_a_process_at_once(http: aiohttp.ClientSession) -> None:
    proc, url = await _start_process("--incremental-streaming-output")
    try:
        async with http.post(url + "/standin/fault", json={"kind": "kill"}) as resp:
            assert resp.status == 200
        assert await proc.wait() == 137
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
