"""The KV plane attack of issue 15 against a real `lumen cluster up` (real worker processes on loopback):
200 forged PAGES pushed to a worker's `kv_endpoint` in a real worker's name with a high incarnation
used to be stored (12,800 tokens, 262 MB of holder budget). With CURVE on the plane, the plaintext
connection never completes its handshake: the store holds nothing, and the worker logs the refusal.
Checkpoints between the workers themselves still flow."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from gateway.protocol import kv
from tests.e2e.conftest import admin, make_requests, run_requests, wait_for
from worker_hooks.kv.payload import page_bytes

FORGED = 200
PS = 64


def forged(i: int, incarnation: int) -> list[bytes]:
    ids = [(11 * i + j) % 50_000 for j in range(PS)]
    header = kv.pages_header(
        rid=f"forged-{i}",
        src_worker="w1",
        incarnation=incarnation,
        first_page=0,
        page_size=PS,
        token_ids=ids,
        page_bytes=64 << 10,
    )
    return [kv.encode_header(header), page_bytes(f"{i:064x}", 64 << 10)]


# the default run has its in-process twin (tests/integration/test_plane_security.py
# test_forged_pages_from_a_plaintext_push_store_nothing); this one, with real worker processes, ~11 s
@pytest.mark.slow
async def test_forged_pages_to_a_live_worker_store_nothing(cluster_factory: Any, tmp_path: Path) -> None:
    c = cluster_factory(
        workers=2, mode="lumen", **{"engine.page_size": 16, "checkpoint.payload_scale": 0.001}
    )
    ws = await admin(c.url, "GET", "/admin/workers")
    w0 = next(w for w in ws if w["id"] == "w0")
    w1 = next(w for w in ws if w["id"] == "w1")
    assert w0["kv_endpoint"].startswith("tcp://") and w0["ckpt_tokens"] == 0

    # the worker logged the refused handshake (its log is in the cluster's log folder)
    def logged() -> bool:
        logs = [p for p in Path(c.stderr_path).parent.rglob("*") if p.is_file()]
        return any("kv_handshake_failed" in p.read_text(errors="replace") for p in logs)

    ctx = zmq.asyncio.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(w0["kv_endpoint"])
    try:
        for i in range(FORGED):
            with contextlib.suppress(zmq.Again):
                await push.send_multipart(forged(i, int(w1["incarnation"]) + 10**9), flags=zmq.NOBLOCK)
        await asyncio.sleep(1.0)  # many heartbeats: the store's use would show by now
        # the attacker stays connected meanwhile: libzmq reconnects every 100 ms, and which side of a
        # mismatched greeting hangs up first is a race (the server sees a handshake failure or just a
        # disconnect), so each attempt is one more chance for the server to see and log a failure
        for _ in range(100):
            if logged():
                break
            await asyncio.sleep(0.1)
    finally:
        push.close(0)
        ctx.term()
    assert logged()
    ws = await admin(c.url, "GET", "/admin/workers")
    w0_after = next(w for w in ws if w["id"] == "w0")
    assert (w0_after["ckpt_bytes"], w0_after["ckpt_tokens"]) == (0, 0)
    # the attack fenced nothing (SUSPECT is only a late heartbeat on a busy machine)
    assert w0_after["incarnation"] == w0["incarnation"] and w0_after["state"] in ("HEALTHY", "SUSPECT")

    # the workers' own checkpoints still reach their holders
    reqs = make_requests(6, seed=5, min_out=300, max_out=400)
    load = asyncio.create_task(run_requests(c.url, reqs))
    await wait_for(c.url, lambda ws: sum(w["ckpt_tokens"] for w in ws) > 500, 20, "checkpoints to build up")
    results = await load
    assert all(r.ok for r in results), [(r.idx, r.error) for r in results if not r.ok]
