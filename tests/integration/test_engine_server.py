"""The worker's HTTP server in-process on loopback, driven by a real aiohttp client."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from gateway.protocol.generate import GenerateChunk, SamplingParams, decode_chunk, encode
from gateway.protocol.launch import EngineSpec, encode_spec
from gateway.protocol.sglang import SGLangAbort
from models.synthetic import expected_output
from worker_hooks.engine.service import Worker, start_worker

FAST = {"model": "Qwen3-0.6B", "gpu": "H100-80G", "time_scale": 0.01}


def spec(**kw: Any) -> EngineSpec:
    return EngineSpec(**{"worker_id": "w-test", "control_address": "", **FAST, **kw})


@pytest.fixture
async def worker() -> AsyncIterator[Worker]:
    async with start_worker(spec()) as w:
        yield w


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as cs:
        yield cs


def body(rid: str, prompt: list[int], stream: bool = True, **params: Any) -> dict[str, Any]:
    return {"rid": rid, "input_ids": prompt, "sampling_params": params, "stream": stream}


async def read_sse(resp: aiohttp.ClientResponse) -> tuple[list[GenerateChunk], bool]:
    """All chunks of one SSE stream, and whether it ended with [DONE]."""
    chunks, done = [], False
    async for line in resp.content:
        if not line.strip():
            continue
        payload = line.removeprefix(b"data: ").strip()
        assert not done, "data after [DONE]"
        if payload == b"[DONE]":
            done = True
        else:
            chunks.append(decode_chunk(payload))
    return chunks, done


async def wait_until(cond: Any, within: float = 5.0) -> None:
    """Poll a condition on engine state (which has no event to wait on) until it holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not cond():
        if loop.time() > deadline:
            raise TimeoutError(f"condition not met within {within} s")
        await asyncio.sleep(0.005)


# -- /generate ----------------------------------------------------------------------------------------


async def test_stream_sends_one_new_id_per_chunk_and_matches_ground_truth(
    worker: Worker, client: aiohttp.ClientSession
) -> None:
    prompt = list(range(40, 90))
    params: dict[str, Any] = {"max_new_tokens": 25, "temperature": 0.8, "top_p": 0.9}
    req = body("s1", prompt, **params) | {"lumen": {"seed_base": 42, "epoch": worker.incarnation}}
    async with client.post(worker.url + "/generate", json=req) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        chunks, done = await read_sse(resp)
    want, finish = expected_output(prompt, SamplingParams(**params), seed_base=42)
    assert done
    assert [c.output_ids for c in chunks] == [[t] for t in want]
    assert [c.meta_info.completion_tokens for c in chunks] == list(range(1, 26))
    assert all(c.meta_info.finish_reason is None for c in chunks[:-1])
    last = chunks[-1].meta_info
    assert last.finish_reason is not None and (last.finish_reason.type, last.finish_reason.length) == (
        finish,
        25,
    )
    assert (last.id, last.prompt_tokens, last.cached_tokens) == ("s1", 50, 0)
    assert (last.worker_id, last.incarnation) == ("w-test", worker.incarnation)


async def test_unary_returns_everything_at_once(worker: Worker, client: aiohttp.ClientSession) -> None:
    prompt = [72, 101, 108, 108, 111]
    greedy, _ = expected_output(prompt, SamplingParams(max_new_tokens=30, temperature=0.0))
    stop = greedy[7]
    req = body("u1", prompt, stream=False, max_new_tokens=30, temperature=0.0, stop_token_ids=[stop])
    async with client.post(worker.url + "/generate", json=req) as resp:
        assert resp.status == 200
        got = await resp.json()
    want = greedy[: greedy.index(stop) + 1]
    assert got["output_ids"] == want and got["text"] == ""
    assert got["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert got["meta_info"]["completion_tokens"] == len(want)


async def test_twenty_concurrent_streams_are_all_exact(worker: Worker, client: aiohttp.ClientSession) -> None:
    async def one(i: int) -> None:
        prompt = [32 + (i * 7 + j) % 90 for j in range(10 + 13 * i)]
        params: dict[str, Any] = {
            "max_new_tokens": 20 + i,
            "temperature": 0.0 if i % 3 == 0 else 1.0,
            "top_k": 5,
        }
        req = body(f"c{i:03d}", prompt, **params) | {"lumen": {"seed_base": i}}
        async with client.post(worker.url + "/generate", json=req) as resp:
            chunks, done = await read_sse(resp)
        want, _ = expected_output(prompt, SamplingParams(**params), seed_base=i)
        assert done and [t for c in chunks for t in c.output_ids] == want

    await asyncio.gather(*(one(i) for i in range(20)))
    s = worker.engine.stats()
    assert (s.running, s.waiting, s.kv_tokens_used, s.completed_total) == (0, 0, 0, 20)
    assert worker.engine.pool.used_pages == 0


# -- refusals -------------------------------------------------------------------------------------------


async def post_error(
    client: aiohttp.ClientSession, url: str, data: bytes | dict[str, Any]
) -> tuple[int, Any]:
    kw: dict[str, Any] = {"data": data} if isinstance(data, bytes) else {"json": data}
    async with client.post(url + "/generate", **kw) as resp:
        return resp.status, await resp.json()


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b"{not json", "invalid /generate body"),
        ({"rid": "x", "input_ids": "abc"}, "input_ids"),
        ({"rid": "x", "input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p"),
        ({"rid": "x", "input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k"),
        ({"rid": "x", "input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
        ({"rid": "x", "input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"rid": "x", "input_ids": []}, "input_ids"),
        ({"rid": "x", "input_ids": [1, 100000]}, "vocabulary"),
        ({"rid": "x", "input_ids": [1], "lumen": {"v": 99}}, "lumen.v"),
    ],
)
async def test_bad_requests_get_400_in_openai_shape(
    worker: Worker, client: aiohttp.ClientSession, data: Any, fragment: str
) -> None:
    status, err = await post_error(client, worker.url, data)
    assert status == 400
    assert set(err["error"]) == {"message", "type", "param", "code"}  # OpenAI's shape
    assert err["error"]["type"] == "invalid_request_error" and fragment in err["error"]["message"]
    assert worker.engine.stats().requests_total == 0


async def test_wrong_epoch_is_fenced_with_409(worker: Worker, client: aiohttp.ClientSession) -> None:
    stale = body("e1", [1, 2], max_new_tokens=2) | {"lumen": {"epoch": worker.incarnation - 1}}
    status, err = await post_error(client, worker.url, stale)
    assert status == 409 and err["error"]["code"] == "stale_epoch"
    # epoch 0 means "not fenced"
    async with client.post(worker.url + "/generate", json=body("e2", [1, 2]) | {"lumen": {}}) as resp:
        assert resp.status == 200
        await resp.read()


async def test_prompt_beyond_kv_capacity_and_duplicate_rid_are_refused(client: aiohttp.ClientSession) -> None:
    async with start_worker(spec(kv_capacity_tokens=256, page_size=16, time_scale=1.0)) as w:
        status, err = await post_error(client, w.url, body("big", [1] * 200, max_new_tokens=100))
        assert status == 400 and err["error"]["code"] == "context_length_exceeded"
        async with client.post(w.url + "/generate", json=body("dup", [1], max_new_tokens=10_000 // 100)) as r:
            await r.content.readuntil(b"\n\n")
            status, err = await post_error(client, w.url, body("dup", [1]))
            assert status == 400 and err["error"]["code"] == "duplicate_request_id"


async def test_restart_serves_503_while_loading_then_200(client: aiohttp.ClientSession) -> None:
    async with start_worker(spec(restart=True, model_load_s=30.0)) as w:  # 0.3 s at time_scale 0.01
        async with client.get(w.url + "/health") as r:
            assert r.status == 503
        status, err = await post_error(client, w.url, body("early", [1, 2]))
        assert status == 503 and err["error"]["code"] == "not_serving"
        async with client.get(w.url + "/v1/models") as r:
            assert r.status == 200  # discovery works while loading
        await wait_until(lambda: w.engine.phase.value == "SERVING")
        for path in ("/health", "/health_generate"):
            async with client.get(w.url + path) as r:
                assert r.status == 200
        async with client.post(w.url + "/generate", json=body("late", [1, 2], max_new_tokens=3)) as r:
            assert r.status == 200
            assert (await read_sse(r))[1]


async def test_draining_worker_refuses_new_requests(worker: Worker, client: aiohttp.ClientSession) -> None:
    worker.engine.drain()
    status, _ = await post_error(client, worker.url, body("d", [1]))
    assert status == 503
    async with client.get(worker.url + "/health") as r:
        assert r.status == 503


# -- aborts ----------------------------------------------------------------------------------------------


async def test_abort_request_matches_by_prefix_and_frees_pages(client: aiohttp.ClientSession) -> None:
    async with start_worker(spec(time_scale=1.0)) as w:
        streams = [
            await client.post(w.url + "/generate", json=body(rid, [5] * 100, max_new_tokens=100_000))
            for rid in ("job-1-a", "job-1-b", "job-2-a")
        ]
        await wait_until(lambda: w.engine.stats().running == 3)
        assert w.engine.pool.used_pages > 0
        async with client.post(w.url + "/abort_request", json={"rid": "job-1"}) as r:
            assert r.status == 200 and sorted((await r.json())["aborted"]) == ["job-1-a", "job-1-b"]
        for resp in streams[:2]:
            chunks, done = await read_sse(resp)
            fr = chunks[-1].meta_info.finish_reason
            assert done and fr is not None and fr.type == "abort"
        assert w.engine.stats().running == 1
        async with client.post(w.url + "/abort_request", json={"rid": "job-2-a"}) as r:
            assert (await r.json())["aborted"] == ["job-2-a"]
        await read_sse(streams[2])
        assert w.engine.pool.used_pages == 0 and w.engine.stats().aborted_total == 3
        async with client.post(w.url + "/abort_request", json={"rid": ""}) as r:
            assert r.status == 400


async def test_the_gateways_abort_body_is_taken_and_abort_all_drops_everything(
    client: aiohttp.ClientSession,
) -> None:
    """The gateway sends every worker SGLang's abort body (`SGLangAbort`: rid and abort_all): a Lumen
    worker takes it as it is (it refused it with 400 before, so aborts of moved or abandoned requests
    never reached Lumen's workers)."""
    async with start_worker(spec(time_scale=1.0)) as w:
        streams = [
            await client.post(w.url + "/generate", json=body(rid, [5] * 100, max_new_tokens=100_000))
            for rid in ("job-1-a", "job-2-a", "job-3-a")
        ]
        await wait_until(lambda: w.engine.stats().running == 3)
        headers = {"Content-Type": "application/json"}
        async with client.post(
            w.url + "/abort_request", data=encode(SGLangAbort(rid="job-1")), headers=headers
        ) as r:
            assert r.status == 200 and (await r.json())["aborted"] == ["job-1-a"]
        async with client.post(
            w.url + "/abort_request", data=encode(SGLangAbort(rid="", abort_all=True)), headers=headers
        ) as r:
            assert r.status == 200 and sorted((await r.json())["aborted"]) == ["job-2-a", "job-3-a"]
        for resp in streams:
            await read_sse(resp)
        assert w.engine.stats().running == 0 and w.engine.pool.used_pages == 0


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_aborts_the_request(client: aiohttp.ClientSession, stream: bool) -> None:
    async with start_worker(spec(time_scale=1.0)) as w:
        req = body("gone", [7] * 64, stream=stream, max_new_tokens=100_000)
        if stream:
            resp = await client.post(w.url + "/generate", json=req)
            await resp.content.readuntil(b"\n\n")
            resp.close()
        else:
            with pytest.raises(TimeoutError):
                await client.post(w.url + "/generate", json=req, timeout=aiohttp.ClientTimeout(total=0.2))
        await wait_until(lambda: w.engine.stats().aborted_total == 1)
        s = w.engine.stats()
        assert (s.running, s.waiting, s.kv_tokens_used) == (0, 0, 0)
        assert w.engine.pool.used_pages == 0


async def test_incarnation_reset_aborts_streams_and_fences_the_old_epoch(
    worker: Worker, client: aiohttp.ClientSession
) -> None:
    old = worker.incarnation
    req = body("r", [3] * 10, max_new_tokens=100_000) | {"lumen": {"epoch": old}}
    async with client.post(worker.url + "/generate", json=req) as resp:
        await resp.content.readuntil(b"\n\n")
        new = worker.engine.reset_incarnation()
        chunks, done = await read_sse(resp)
    fr = chunks[-1].meta_info.finish_reason
    assert new > old and done and fr is not None and fr.type == "abort"
    assert worker.engine.pool.used_pages == 0
    status, _ = await post_error(client, worker.url, req)
    assert status == 409


# -- discovery, loads, metrics ---------------------------------------------------------------------------


async def get_json(client: aiohttp.ClientSession, url: str) -> Any:
    async with client.get(url) as r:
        assert r.status == 200
        return await r.json()


async def test_discovery_endpoints_look_like_sglang(worker: Worker, client: aiohttp.ClientSession) -> None:
    models = await get_json(client, worker.url + "/v1/models")
    assert models["object"] == "list" and models["data"][0]["id"] == "Qwen3-0.6B"
    assert models["data"][0]["owned_by"] == "sglang"
    for path in ("/model_info", "/get_model_info"):
        info = await get_json(client, worker.url + path)
        assert info["model_path"] == "Qwen3-0.6B" and info["is_generation"] is True
    for path in ("/server_info", "/get_server_info"):
        info = await get_json(client, worker.url + path)
        assert info["tp_size"] == 1 and info["dp_size"] == 1 and info["port"] == worker.port
        assert info["max_total_num_tokens"] == worker.engine.pool.capacity_tokens
        assert not {"model", "model_id"} & set(info)  # SMG reads them as one aliased field
        assert info["lumen"]["incarnation"] == worker.incarnation
    assert "version" in await get_json(client, worker.url + "/version")


async def test_loads_and_metrics_report_the_engine(client: aiohttp.ClientSession) -> None:
    async with start_worker(spec(time_scale=1.0, max_running_requests=2)) as w:
        streams = [
            await client.post(w.url + "/generate", json=body(f"m{i}", [9] * 30, max_new_tokens=100_000))
            for i in range(3)
        ]
        await wait_until(lambda: w.engine.stats().running == 2 and w.engine.stats().waiting == 1)
        loads = await get_json(client, w.url + "/v1/loads")
        (load,) = loads["loads"]
        assert loads["dp_rank_count"] == 1 and load["num_running_reqs"] == 2 and load["num_waiting_reqs"] == 1
        assert load["num_used_tokens"] > 0 and 0 < load["token_usage"] < 1
        assert loads["aggregate"]["total_reqs"] == 3
        async with client.get(w.url + "/metrics") as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
            text = await r.text()
        assert 'sglang:num_running_reqs{model_name="Qwen3-0.6B"} 2.0' in text
        assert 'sglang:num_queue_reqs{model_name="Qwen3-0.6B"} 1.0' in text
        assert "sglang:token_usage" in text and 'lumen_requests_total{model_name="Qwen3-0.6B"} 3.0' in text
        assert 'lumen_phase{phase="SERVING"} 1.0' in text
        for s in streams:
            s.close()


# -- the process entry point -----------------------------------------------------------------------------


async def test_module_entry_point_prints_its_url_and_stops_on_sigterm(client: aiohttp.ClientSession) -> None:
    text = encode_spec(spec(log_level="warning"))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "worker_hooks.engine", "--spec", text,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = json.loads(await asyncio.wait_for(proc.stdout.readline(), 20))
        assert line["event"] == "listening" and line["worker_id"] == "w-test" and line["incarnation"] > 0
        async with client.post(line["url"] + "/generate", json=body("p", [1, 2], stream=False)) as r:
            assert (await r.json())["output_ids"] == expected_output([1, 2], SamplingParams())[0]
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_module_entry_point_rejects_a_bad_spec() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "worker_hooks.engine", "--spec", '{"worker_id": "x"}',
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await proc.communicate()
    assert proc.returncode == 2 and b"control_address" in err


async def test_parent_watchdog_stops_an_orphaned_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker_hooks.engine.__main__ import watch_parent

    stop = asyncio.Event()
    await asyncio.wait_for(watch_parent(os.getppid() + 1_000_000, stop), 1)  # "re-parented" already
    assert stop.is_set()
    # a live parent: the watchdog polls on and on. Poll often, and count its looks at the parent
    monkeypatch.setattr(sys.modules[watch_parent.__module__], "PARENT_POLL_S", 0.01)
    getppid, looks = os.getppid, []
    parent = getppid()

    def counting_getppid() -> int:
        looks.append(1)
        return getppid()

    monkeypatch.setattr(os, "getppid", counting_getppid)
    stop = asyncio.Event()
    task = asyncio.create_task(watch_parent(parent, stop))
    async with asyncio.timeout(5):
        while len(looks) < 3:  # the parent seen at the start and after two polls
            await asyncio.sleep(0.005)
    assert not task.done() and not stop.is_set()
    stop.set()  # a normal shutdown ends the watchdog too
    await asyncio.wait_for(task, 1)


async def test_a_crashed_engine_loop_ends_streams_and_refuses_work(client: aiohttp.ClientSession) -> None:
    class Boom(RuntimeError):
        pass

    with pytest.raises(Boom):
        async with start_worker(spec(time_scale=1.0)) as w:
            resp = await client.post(w.url + "/generate", json=body("x", [1] * 5, max_new_tokens=10_000))
            await resp.content.readuntil(b"\n\n")

            def explode(*_: object) -> None:
                raise Boom("step failed")

            w.engine.scheduler.step = explode  # type: ignore[method-assign,assignment]
            chunks, done = await read_sse(resp)
            fr = chunks[-1].meta_info.finish_reason
            assert done and fr is not None and (fr.type, fr.message) == ("abort", "engine error")
            async with client.get(w.url + "/health") as r:
                assert r.status == 503
            status, _ = await post_error(client, w.url, body("y", [1]))
            assert status == 503
    # the crash surfaces when the worker is stopped, after everything was cleaned up


async def test_sglang_style_body_with_extra_fields_and_no_rid_is_served(
    worker: Worker, client: aiohttp.ClientSession
) -> None:
    """What SMG sends: SGLang's extra fields, no rid. Unknown fields are ignored; a rid is made up."""
    body = {
        "model": "unknown",
        "input_ids": [72, 105],
        "sampling_params": {"max_new_tokens": 4, "temperature": 0, "repetition_penalty": 1.0},
        "return_text_in_logprobs": False,
        "stream": False,
        "log_metrics": True,
    }
    async with client.post(worker.url + "/generate", json=body) as r:
        assert r.status == 200, await r.text()
        out = await r.json()
    assert len(out["output_ids"]) == 4 and out["meta_info"]["id"].startswith("w-")
