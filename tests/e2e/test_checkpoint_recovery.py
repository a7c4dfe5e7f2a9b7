"""LUMEN mechanisms 1 and 2 end to end: KV pages stream to holders; interrupted requests restore there."""

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

# long prompts so that restoring beats replaying, and small pages so checkpoints build up quickly
LUMEN = {"engine.page_size": 16, "checkpoint.payload_scale": 0.001}


def streamed(ws: list[dict[str, Any]], pages_per_request: int) -> bool:
    """Whether every worker running requests has sent `pages_per_request` pages per request to holders."""
    held = [w for w in ws if w["ckpt_tokens"]]
    if not held:
        return False
    bytes_per_token = max(w["ckpt_bytes"] / w["ckpt_tokens"] for w in held)
    page = LUMEN["engine.page_size"] * bytes_per_token
    busy = [w for w in ws if w["state"] == "HEALTHY" and w["running"]]
    return bool(busy) and all(
        w["ckpt_bytes_sent_total"] >= w["running"] * pages_per_request * page for w in busy
    )


async def settle_to_zero(url: str) -> list[dict[str, Any]]:
    """Every holder's store must drain to zero once all requests have finished."""
    return await wait_for(
        url,
        lambda ws: all(w["ckpt_bytes"] == 0 for w in ws if w["state"] == "HEALTHY"),
        10,
        "stores to drain",
    )


async def test_kill_in_lumen_mode_restores_on_holders(cluster_factory) -> None:
    c = cluster_factory(workers=3, mode="lumen", **LUMEN, **{"recovery.tau": 0})
    reqs = make_requests(40, seed=21, min_out=150, max_out=250)
    load = asyncio.create_task(run_requests(c.url, reqs))
    # every serving worker (the victim among them) has streamed a few pages per running request: a
    # kill in the middle of the first prefill leaves nothing to restore, which is right but not tested here
    await wait_for(c.url, lambda ws: streamed(ws, pages_per_request=4), 20, "checkpoints to build up")
    killed = await kill_busiest(c.url, "kill", min_running=5)
    results = await load
    assert_exact(results)
    inter = [
        i
        for i in (await admin(c.url, "GET", "/admin/sessions"))["interrupted"]
        if i["worker"] == killed["worker"]
    ]
    restored = [i for i in inter if i["action"] == "restore" and i["restored_tokens"] > 0]
    brief = [(i["action"], i["dispatch_reason"], i["restored_tokens"], i["resumed_on"]) for i in inter]
    assert len(restored) >= len(inter) // 2, brief
    assert all(i["resumed_on"] != killed["worker"] for i in inter)
    ws = await settle_to_zero(c.url)
    assert sum(w["restores_total"] for w in ws) >= len(restored)


@pytest.mark.slow  # re-homing: also in integration/test_checkpoint_manager.py, in process
async def test_holder_dying_first_gets_its_requests_a_new_holder(cluster_factory) -> None:
    c = cluster_factory(
        workers=4, mode="lumen", **LUMEN, **{"recovery.tau": 0, "cluster.restart_killed": False}
    )
    reqs = make_requests(30, seed=22, min_out=300, max_out=400)
    load = asyncio.create_task(run_requests(c.url, reqs))
    ws = await wait_for(c.url, lambda ws: sum(w["ckpt_tokens"] for w in ws) > 2000, 20, "checkpoints")
    holder = max(ws, key=lambda w: w["ckpt_tokens"])
    await admin(c.url, "POST", f"/admin/workers/{holder['id']}/kill?mode=kill")
    # the requests it held are re-streamed to new holders by their serving workers
    await wait_for(
        c.url,
        lambda ws: sum(w["ckpt_tokens"] for w in ws if w["state"] == "HEALTHY") > 2000,
        10,
        "re-streaming",
    )
    await asyncio.sleep(0.5)
    server = await kill_busiest(c.url, "kill", min_running=2, exclude=(holder["id"],))
    results = await load
    assert_exact(results)
    inter = [
        i
        for i in (await admin(c.url, "GET", "/admin/sessions"))["interrupted"]
        if i["worker"] == server["worker"]
    ]
    assert any(i["action"] == "restore" and i["restored_tokens"] > 0 for i in inter), inter


@pytest.mark.slow  # two replicas: also in integration/test_checkpoint_manager.py, in process
async def test_two_replicas_survive_server_and_holder_dying_together(cluster_factory) -> None:
    c = cluster_factory(
        workers=4,
        mode="lumen",
        **LUMEN,
        **{"recovery.tau": 0, "checkpoint.replicas": 2, "cluster.restart_killed": False},
    )
    reqs = make_requests(30, seed=23, min_out=200, max_out=300)
    load = asyncio.create_task(run_requests(c.url, reqs))
    await wait_for(c.url, lambda ws: sum(w["ckpt_tokens"] for w in ws) > 4000, 20, "checkpoints")
    server = await kill_busiest(c.url, "kill", min_running=3)
    ws = await admin(c.url, "GET", "/admin/workers")
    holder = max((w for w in ws if w["id"] != server["worker"]), key=lambda w: w["ckpt_tokens"])
    await admin(c.url, "POST", f"/admin/workers/{holder['id']}/kill?mode=kill")
    results = await load
    assert_exact(results)
    inter = [
        i
        for i in (await admin(c.url, "GET", "/admin/sessions"))["interrupted"]
        if i["worker"] == server["worker"]
    ]
    assert any(i["action"] == "restore" and i["restored_tokens"] > 0 for i in inter), inter
