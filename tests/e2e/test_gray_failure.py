"""A gray failure end to end: a worker slows down without dying; the gateway sees it serving far
slower per token than its peers, marks it DEGRADED, moves its running requests elsewhere (restoring
them on their checkpoint holders), and trusts it again after probation. Every client's tokens stay
exact."""

from __future__ import annotations

import asyncio

import pytest

from tests.e2e.conftest import admin, assert_exact, make_requests, run_requests, wait_for

GRAY = {
    "engine.page_size": 16,
    "checkpoint.payload_scale": 0.001,
    "recovery.tau": 0,
    "gray.window_s": 1.0,
    "gray.probation_s": 3.0,
    "gray.enabled": True,
}


@pytest.mark.slow  # in process by default: tests/integration/test_gray_monitor.py
async def test_slow_worker_is_degraded_its_requests_move_and_it_comes_back(cluster_factory) -> None:
    c = cluster_factory(workers=4, mode="lumen", **GRAY)
    reqs = make_requests(32, seed=41, min_out=200, max_out=300)
    load = asyncio.create_task(run_requests(c.url, reqs))
    ws = await wait_for(
        c.url, lambda ws: sum(w["ckpt_tokens"] for w in ws) > 2000, 20, "checkpoints to build up"
    )
    slow = max(ws, key=lambda w: (w["running"], w["id"]))["id"]
    await admin(c.url, "POST", f"/admin/workers/{slow}/kill?mode=slow&factor=8")
    ws = await wait_for(
        c.url, lambda ws: any(w["id"] == slow and w["state"] == "DEGRADED" for w in ws), 15, "the verdict"
    )
    results = await load
    assert_exact(results)

    events = await admin(c.url, "GET", "/admin/events")
    degraded = [e for e in events if e["to"] == "DEGRADED"]
    assert [e["worker"] for e in degraded][:1] == [slow], degraded  # no other worker, none before
    assert all(e["worker"] == slow for e in degraded)
    moved = [
        i
        for i in (await admin(c.url, "GET", "/admin/sessions"))["interrupted"]
        if i["worker"] == slow and i["reason"].startswith("degraded")
    ]
    assert moved, "the slow worker's running requests were not moved"
    assert all(i["resumed_on"] not in (None, slow) for i in moved)
    assert any(i["action"] == "restore" and i["restored_tokens"] > 0 for i in moved), moved
    # no FAILED transition: it never died
    assert not [e for e in events if e["worker"] == slow and e["to"] == "FAILED"]
    # probation over (nothing measures it while it gets no requests): HEALTHY again
    await wait_for(
        c.url, lambda ws: any(w["id"] == slow and w["state"] == "HEALTHY" for w in ws), 10, "probation"
    )
