"""The outage batch boost end to end (gateway/core/outage.py, gateway/server/recovery/outage.py):
a worker killed mid-stream, the survivor admits a larger batch until the recovery is over, and every
client's tokens are exact."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.e2e.conftest import assert_exact, kill_busiest, make_requests, run_requests, wait_for


def limits(ws: list[dict[str, Any]]) -> dict[str, int]:
    return {w["id"]: w["batch_limit"] for w in ws if w["state"] == "HEALTHY"}


@pytest.mark.slow  # in process: integration/test_outage_admission.py, unit/test_admission_leases.py
async def test_the_survivor_runs_a_larger_batch_while_the_cluster_recovers(cluster_factory) -> None:
    # 2 workers of 4 slots; one dies: the survivor gets min(1.5, 2/1) x 4 = 6 until the killed one
    # serves again and the backlog has drained
    c = cluster_factory(
        workers=2,
        mode="lumen",
        **{"engine.max_running_requests": 4, "recovery.outage_batch_boost": 1.5, "engine.model_load_s": 3.0},
    )
    reqs = make_requests(24, seed=5, min_out=150, max_out=250)
    load = asyncio.create_task(run_requests(c.url, reqs))
    killed = await kill_busiest(c.url, "kill", min_running=4)
    survivor = "w1" if killed["worker"] == "w0" else "w0"
    await wait_for(c.url, lambda ws: limits(ws).get(survivor) == 6, 20, "the survivor's larger batch")
    assert_exact(await load)
    # the recovery is over (both serve, no backlog): both back to their own limit
    await wait_for(c.url, lambda ws: limits(ws) == {"w0": 4, "w1": 4}, 30, "the batch limits to return to 4")
