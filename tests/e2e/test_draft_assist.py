"""LUMEN mechanism 3 end to end: a killed worker restarts, drafts for a loaded survivor while its full
model loads, then serves again, with every client output exact throughout."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.e2e.conftest import (
    admin,
    assert_exact,
    kill_busiest,
    make_requests,
    run_requests,
    wait_for,
)

# the restart: the draft model is in after 0.3 s, the full one 4 s after the process starts
PROGRESSIVE = {
    "engine.page_size": 16,
    "engine.draft_load_s": 0.3,
    "engine.model_load_s": 4.0,
    "draft.agreement": 0.7,
    # the mechanism, not when it pays: the assist gate (draft.assist_gate, on by default) judges that
    # drafting for a survivor this lightly loaded costs more than it saves, and would not pair
    "draft.assist_gate": False,
}


def by_id(ws: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {w["id"]: w for w in ws}


@pytest.mark.slow  # in process: integration/test_draft_coordinator.py, test_progressive_recovery.py
async def test_restarted_worker_drafts_for_a_survivor_then_serves(cluster_factory) -> None:
    c = cluster_factory(workers=3, mode="lumen", **PROGRESSIVE)
    reqs = make_requests(36, seed=31, min_out=350, max_out=500)
    load = asyncio.create_task(run_requests(c.url, reqs))
    killed = await kill_busiest(c.url, "kill", min_running=5)
    victim, old_incarnation = killed["worker"], killed["victim"]["incarnation"]

    # the new incarnation drafts (DRAFT_READY) and is paired with a survivor
    ws = await wait_for(
        c.url, lambda ws: by_id(ws)[victim]["state"] == "DRAFT_READY", 15, "the restarted worker to draft"
    )
    assert by_id(ws)[victim]["incarnation"] > old_incarnation and by_id(ws)[victim]["draft_endpoint"]
    assist = await admin(c.url, "GET", "/admin/assist")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while victim not in assist["pairs"] and loop.time() < deadline:
        await asyncio.sleep(0.05)
        assist = await admin(c.url, "GET", "/admin/assist")
    target = assist["pairs"].get(victim)
    assert target is not None, assist

    # the full model loads; the worker serves again and the pair ends
    await wait_for(c.url, lambda ws: by_id(ws)[victim]["state"] == "HEALTHY", 15, "the restart to serve")
    results = await load
    assert_exact(results)
    events = (await admin(c.url, "GET", "/admin/assist"))["events"]
    mine = [(e["started"], e["target"]) for e in events if e["drafter"] == victim]
    assert mine[0] == (True, target) and mine[-1][0] is False, events
    ws = by_id(await admin(c.url, "GET", "/admin/workers"))
    t = ws[target]
    assert t["accepted_tokens"] > 0 and t["drafted_tokens"] >= t["accepted_tokens"] and t["draft_rounds"] > 0
    print(
        f"target {target}: {t['accepted_tokens']}/{t['drafted_tokens']} drafts accepted "
        f"over {t['draft_rounds']} assisted steps"
    )

    # the restarted worker takes new requests like any other (it is the least loaded one now)
    before = ws[victim]["completed_total"]
    more = make_requests(9, seed=32, min_out=20, max_out=60)
    assert_exact(await run_requests(c.url, more))
    ws = by_id(await admin(c.url, "GET", "/admin/workers"))
    assert ws[victim]["state"] == "HEALTHY" and ws[victim]["completed_total"] > before
