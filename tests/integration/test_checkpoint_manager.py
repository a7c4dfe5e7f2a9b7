"""The gateway's checkpoint manager with the real monitor and control service (no sockets)."""

from __future__ import annotations

import asyncio

from gateway.core.holders import HolderParams
from gateway.core.types import LoadParams
from gateway.protocol import control_pb2 as pb
from gateway.server.checkpoints import CheckpointManager
from gateway.server.metrics import GatewayMetrics
from gateway.server.recovery.coordinator import RecoveryCoordinator
from gateway.server.recovery.rehoming import Rehoming
from gateway.server.workers.control import ControlService
from gateway.server.workers.monitor import LoadMonitor
from tests.fixtures.clock import FakeClock

KV = 1000  # bytes per token, small to keep numbers readable


def make(n: int = 4, replicas: int = 1, budget: int = 10**9):
    clock = FakeClock()
    mon = LoadMonitor(clock=clock, heartbeat_interval_s=0.02, heartbeat_misses=3)
    ctl = ControlService(mon, token="", heartbeat_interval_ms=20)
    mgr = CheckpointManager(
        monitor=mon,
        control=ctl,
        params=HolderParams(load=LoadParams(), replicas=replicas),
        kv_bytes_per_token=KV,
        metrics=GatewayMetrics(),
    )
    # as the gateway wires them: heartbeats and failures reach the books through the coordinator
    rehoming = Rehoming(checkpoints=mgr, control=ctl, metrics=GatewayMetrics())
    RecoveryCoordinator(monitor=mon, control=ctl, checkpoints=mgr, rehoming=rehoming)
    recs = {}
    for i in range(n):
        hello = pb.Hello(
            protocol_version=1,
            worker_id=f"w{i}",
            incarnation=10,
            http_url=f"http://w{i}",
            kv_endpoint=f"tcp://w{i}",
            kv_capacity_tokens=100_000,
            ckpt_budget_bytes=budget,
            phase=pb.SERVING,
        )
        recs[f"w{i}"] = mon.attach(hello)
        ctl.outboxes[f"w{i}"] = asyncio.Queue()
    return mon, ctl, mgr, recs


def drain(ctl: ControlService, wid: str) -> list[pb.GatewayMessage]:
    """The commands queued for `wid`, less the Members updates every membership change sends."""
    box = ctl.outboxes[wid]
    out = []
    while not box.empty():
        msg = box.get_nowait()
        if msg.WhichOneof("body") != "members":
            out.append(msg)
    return out


async def test_assignments_spread_over_holders_between_heartbeats() -> None:
    _mon, _ctl, mgr, recs = make(4)
    counts: dict[str, int] = {}
    for i in range(30):
        refs = mgr.assign(f"s{i}", f"s{i}-1", recs["w0"], context=500, remaining=100)
        assert len(refs) == 1 and refs[0].worker_id != "w0"
        assert refs[0].kv_endpoint == f"tcp://{refs[0].worker_id}"
        counts[refs[0].worker_id] = counts.get(refs[0].worker_id, 0) + 1
    assert sorted(counts) == ["w1", "w2", "w3"]
    assert max(counts.values()) - min(counts.values()) <= 1


async def test_durable_prefix_feeds_dispatch_and_release_drops_pages() -> None:
    mon, ctl, mgr, recs = make(3)
    [ref] = mgr.assign("s1", "s1-1", recs["w0"], context=300, remaining=200)
    holder = ref.worker_id
    hb = pb.Heartbeat(seq=1, phase=pb.SERVING, durable=[pb.DurableTokens(rid="s1-1", tokens=256)])
    mon.heartbeat(recs[holder], hb)
    mgr.on_heartbeat(recs[holder], hb)
    req = mgr.interrupted("s1", failed="w0", context=350, remaining=150)
    assert req.holders == (holder,) and req.durable_tokens == 256
    # a worker that is not the holder reporting the rid changes nothing
    other = next(w for w in ("w1", "w2") if w != holder)
    mgr.on_heartbeat(recs[other], pb.Heartbeat(durable=[pb.DurableTokens(rid="s1-1", tokens=999)]))
    assert mgr.interrupted("s1", failed="w0", context=350, remaining=150).durable_tokens == 256
    mgr.release_session("s1")
    [msg] = drain(ctl, holder)
    assert list(msg.drop_checkpoint.rids) == ["s1-1"] and msg.incarnation == 10
    assert mgr.assigned_tokens == {} and mgr.by_wrid == {}


async def test_holder_failure_reassigns_and_tells_the_serving_worker() -> None:
    mon, ctl, mgr, recs = make(4)
    [ref] = mgr.assign("s1", "s1-1", recs["w0"], context=300, remaining=100)
    mon.detach(recs[ref.worker_id], "killed")
    await asyncio.sleep(0)  # failures found in one detector pass are handled together, just after
    [msg] = drain(ctl, "w0")
    new = [h.worker_id for h in msg.assign_holder.holders]
    assert msg.assign_holder.rid == "s1-1"
    assert len(new) == 1 and new[0] not in ("w0", ref.worker_id)
    # nothing reported durable yet: the new holder is still offered, with |C_r| = 0
    ir = mgr.interrupted("s1", failed="w0", context=300, remaining=100)
    assert (ir.holders, ir.durable_tokens) == ((new[0],), 0)


async def test_abandoned_checkpoint_is_not_offered_for_restore() -> None:
    _mon, _ctl, mgr, recs = make(3)
    [ref] = mgr.assign("s1", "s1-1", recs["w0"], context=300, remaining=100)
    mgr.on_heartbeat(recs[ref.worker_id], pb.Heartbeat(durable=[pb.DurableTokens(rid="s1-1", tokens=128)]))
    mgr.on_heartbeat(recs["w0"], pb.Heartbeat(abandoned_checkpoints=["s1-1"]))
    assert mgr.interrupted("s1", failed="w0", context=300, remaining=100).durable_tokens == 0
    assert mgr.coverage(["s1-1"]) == 0.0


async def test_two_replicas_and_the_prefix_both_hold() -> None:
    _mon, _ctl, mgr, recs = make(4, replicas=2)
    refs = mgr.assign("s1", "s1-1", recs["w0"], context=300, remaining=100)
    assert len({r.worker_id for r in refs}) == 2
    a, b = (r.worker_id for r in refs)
    mgr.on_heartbeat(recs[a], pb.Heartbeat(durable=[pb.DurableTokens(rid="s1-1", tokens=256)]))
    mgr.on_heartbeat(recs[b], pb.Heartbeat(durable=[pb.DurableTokens(rid="s1-1", tokens=192)]))
    req = mgr.interrupted("s1", failed="w0", context=300, remaining=100)
    assert set(req.holders) == {a, b} and req.durable_tokens == 192


async def test_no_budget_means_no_holder() -> None:
    _mon, _ctl, mgr, recs = make(3, budget=0)
    assert mgr.assign("s1", "s1-1", recs["w0"], context=300, remaining=100) == []
    assert mgr.coverage(["s1-1"]) == 0.0


async def test_failures_detected_together_never_rehome_onto_each_other() -> None:
    mon, ctl, mgr, recs = make(4)
    # w0 serves; its holder is w1. w1 and w2 die in one detector pass: the new holder must be w3
    # although w2 was still HEALTHY when w1's failure was recorded
    [ref] = mgr.assign("s1", "s1-1", recs["w0"], context=300, remaining=100)
    assert ref.worker_id == "w1"
    mon.detach(recs["w1"], "killed")
    mon.detach(recs["w2"], "killed")
    await asyncio.sleep(0)
    [msg] = drain(ctl, "w0")
    assert [h.worker_id for h in msg.assign_holder.holders] == ["w3"]


async def test_a_new_attempt_retires_the_old_checkpoint_and_drops_it_once_streaming() -> None:
    _mon, ctl, mgr, recs = make(4)
    [old] = mgr.assign("s1", "s1-1", recs["w0"], context=300, remaining=100)
    mgr.on_heartbeat(recs[old.worker_id], pb.Heartbeat(durable=[pb.DurableTokens(rid="s1-1", tokens=256)]))
    # w0 died; the request restores on its holder, which gets a holder of its own
    [new] = mgr.assign("s1", "s1-2", recs[old.worker_id], context=350, remaining=50)
    assert mgr.assigned_tokens == {new.worker_id: 400}  # the old checkpoint is no longer charged
    assert mgr.interrupted("s1", failed=old.worker_id, context=350, remaining=50).holders == (new.worker_id,)
    assert drain(ctl, old.worker_id) == []  # not dropped yet: the restore reads those pages
    mgr.drop_retired("s1")
    [msg] = drain(ctl, old.worker_id)
    assert list(msg.drop_checkpoint.rids) == ["s1-1"]
    mgr.release_session("s1")
    assert mgr.assigned_tokens == {} and mgr.by_wrid == {}
