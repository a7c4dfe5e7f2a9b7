"""Seeded reload end to end on Lumen's workers (`engine.reload = "peer"`): a worker killed mid-load
restarts under the supervisor, the gateway names a survivor as its seed, it serves again on the
peer's load time rather than storage's, and every client stream is exact."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.e2e.conftest import admin, assert_exact, kill_busiest, make_requests, run_requests, wait_for

SEEDED = {
    "engine.page_size": 16,
    "engine.reload": "peer",
    "engine.model_load_s": 30.0,  # from storage: longer than the test waits
    "engine.peer_load_s": 1.0,
}


def by_id(ws: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {w["id"]: w for w in ws}


@pytest.mark.slow  # in process: integration/test_lumen_seeded_reload.py
async def test_a_killed_worker_reloads_from_a_survivor_and_no_stream_notices(cluster_factory) -> None:
    c = cluster_factory(workers=3, mode="lumen", **SEEDED)
    reqs = make_requests(24, seed=41, min_out=150, max_out=250)
    load = asyncio.create_task(run_requests(c.url, reqs))
    killed = await kill_busiest(c.url, "kill", min_running=3)
    victim = killed["worker"]
    ws = await wait_for(
        c.url,
        lambda ws: by_id(ws)[victim]["state"] == "HEALTHY" and by_id(ws)[victim]["reload"] is not None,
        15,
        "the restart to serve, seeded",
    )
    reload = by_id(ws)[victim]["reload"]
    assert reload["source"] == "peer" and reload["seed"] in by_id(ws).keys() - {victim}, reload
    assert 1.0 <= reload["seconds"] < 10.0, reload  # the peer's 1 s, not storage's 30
    assert_exact(await load)
    events = await admin(c.url, "GET", "/admin/events")
    assert any(f"reloaded from {reload['seed']} (peer)" in str(e) for e in events), events[-5:]
