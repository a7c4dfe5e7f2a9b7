"""The foundation end to end: `lumen cluster up` with 3 synthetic workers serves 50 concurrent streams."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.e2e.conftest import admin, expected_text, make_requests, run_requests


async def test_fifty_concurrent_streams_are_exact_and_spread(shared_cluster) -> None:
    c = shared_cluster  # shared with test_failover.py: its counters are read as differences
    async with aiohttp.ClientSession() as http:
        async with http.get(c.url + "/health") as resp:
            assert resp.status == 200
            assert (await resp.json())["healthy_workers"] == 3
        async with http.get(c.url + "/v1/models") as resp:
            assert [m["id"] for m in (await resp.json())["data"]] == ["lumen-synthetic"]
    workers = await admin(c.url, "GET", "/admin/workers")
    assert {w["id"] for w in workers} == {"w0", "w1", "w2"}
    assert all({"id", "state", "incarnation", "running", "waiting"} <= w.keys() for w in workers)
    before = {w["id"]: (w["incarnation"], w["completed_total"]) for w in workers}

    reqs = make_requests(50, seed=7, min_out=20, max_out=60)
    results = await run_requests(c.url, reqs)
    assert [r.error for r in results if not r.ok] == []
    assert all(r.text == expected_text(r) for r in results)
    assert all(r.completion_tokens == r.max_tokens for r in results)

    await asyncio.sleep(0.2)  # a heartbeat carries the final counters
    after = await admin(c.url, "GET", "/admin/workers")
    assert {w["id"]: w["incarnation"] for w in after} == {k: v[0] for k, v in before.items()}
    done = {w["id"]: w["completed_total"] - before[w["id"]][1] for w in after}
    assert sum(done.values()) == 50
    # least-loaded routing spreads a burst: every worker took a real share
    assert min(done.values()) >= 8, done
