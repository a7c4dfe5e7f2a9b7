"""Fault schedules against real processes: selectors resolve to the intended workers at fire time, the
streams stay exact, and a slow fault really slows a worker down (and `normal` undoes it)."""

from __future__ import annotations

import asyncio
import random
import statistics
import time

import aiohttp
import pytest

from gateway.protocol.secrets import admin_headers, default_token_path, read_token_file, worker_http_bearer
from loadtests.client import RequestResult
from loadtests.faults import FaultRunner, FaultSchedule, resolve_group
from tests.e2e.conftest import admin, assert_exact, make_requests, run_requests, wait_for

# small pages and a light payload so that checkpoints build up within a second or two
LUMEN = {"engine.page_size": 16, "checkpoint.payload_scale": 0.001, "recovery.tau": 0}


@pytest.mark.slow  # the default run fires a schedule too: the slow-fault test below
async def test_slow_then_top_holder_and_random_killed_at_once(cluster_factory) -> None:
    c = cluster_factory(workers=4, mode="lumen", **LUMEN)
    reqs = make_requests(32, seed=31, min_out=150, max_out=250)
    load = asyncio.create_task(run_requests(c.url, reqs))
    await wait_for(c.url, lambda ws: sum(w["ckpt_tokens"] for w in ws) > 2000, 20, "checkpoints to build up")
    schedule = FaultSchedule.parse(["slow:w1@0x3", "kill:top-holder@0.8", "kill:random@0.8"])
    async with aiohttp.ClientSession() as http:
        runner = FaultRunner(http, c.url, schedule, seed=7, t0=time.monotonic())
        await runner.run()
    results = await load
    assert_exact(results)

    fired = runner.fired
    assert [(f["target"], f["mode"], f["ok"]) for f in fired] == [
        ("w1", "slow", True),
        ("top-holder", "kill", True),
        ("random", "kill", True),
    ], fired
    assert fired[0]["worker"] == "w1" and fired[0]["factor"] == 3.0
    top, rnd = fired[1], fired[2]
    # both kills were resolved from one snapshot taken when they fired; replaying the resolution on it
    # with the same seed (the slow event drew nothing) gives the same workers
    snap = top["snapshot"]
    assert snap == rnd["snapshot"]
    workers = [{"id": wid, **fields} for wid, fields in snap.items()]
    group = [e for e in schedule.events if e.at == 0.8]
    assert resolve_group(group, workers, random.Random(7)) == [top["worker"], rnd["worker"]]
    healthy = {wid: f for wid, f in snap.items() if f["state"] == "HEALTHY"}
    assert snap[top["worker"]]["ckpt_tokens"] == max(f["ckpt_tokens"] for f in healthy.values()) > 0
    assert rnd["worker"] in healthy and rnd["worker"] != top["worker"]
    # and both really died, after their kill
    events = await admin(c.url, "GET", "/admin/events")
    for f in (top, rnd):
        assert any(e["worker"] == f["worker"] and e["to"] == "FAILED" and e["t"] >= f["at"] for e in events)


async def _mean_tpot(url: str, seed: int, n: int = 3, tokens: int = 40) -> float:
    reqs: list[RequestResult] = make_requests(n, seed=seed, min_out=tokens, max_out=tokens + 1)
    results = await run_requests(url, reqs)
    assert_exact(results)
    return statistics.median(r.tpot for r in results if r.tpot is not None)


async def test_slow_fault_slows_the_token_rate_and_normal_restores_it(cluster_factory) -> None:
    # one worker, so every request runs on it; the same small batch in each phase
    c = cluster_factory(workers=1, mode="stop_restart")
    base = await _mean_tpot(c.url, seed=41)
    res = await admin(c.url, "POST", "/admin/workers/w0/kill?mode=slow&factor=4")
    assert res["mode"] == "slow" and res["factor"] == 4.0 and res["worker"] == "w0"
    slow = await _mean_tpot(c.url, seed=42)
    await admin(c.url, "POST", "/admin/workers/w0/kill?mode=normal")
    again = await _mean_tpot(c.url, seed=43)
    # ratios, not absolute times: 4x the modelled step time, with room for a loaded 2-core machine
    assert 2.0 < slow / base < 8.0, (base, slow)
    assert 0.5 < again / base < 1.6, (base, again)
    ws = await admin(c.url, "GET", "/admin/workers")
    assert ws[0]["state"] == "HEALTHY"  # slow is not a failure: heartbeats and streams go on

    async with aiohttp.ClientSession() as http:
        for query in ("mode=slow", "mode=slow&factor=0.5", "mode=slow&factor=fast", "mode=slow&factor=nan"):
            async with http.post(
                f"{c.url}/admin/workers/w0/kill?{query}", headers=admin_headers(c.url)
            ) as resp:
                assert resp.status == 400, query
                err = (await resp.json())["error"]
                assert err["type"] == "invalid_request_error" and err["param"] == "factor", err
        async with http.post(
            f"{c.url}/admin/workers/w9/kill?mode=slow&factor=2", headers=admin_headers(c.url)
        ) as resp:
            assert resp.status == 404
        # the worker's own endpoint takes the cluster's bearer only (derived from the token the gateway
        # generated and published, 0600, for its control port)
        token = read_token_file(default_token_path(c.ready["control_port"]))
        async with http.post(f"{ws[0]['url']}/lumen/fault", json={"slowdown": 2}) as resp:
            assert resp.status == 401
            assert (await resp.json())["error"]["type"] == "authentication_error"
        bearer = {"Authorization": f"Bearer {worker_http_bearer(token)}"}
        async with http.post(f"{ws[0]['url']}/lumen/fault", json={"slowdown": -1}, headers=bearer) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["type"] == "invalid_request_error"
