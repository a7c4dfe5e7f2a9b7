"""The live shell's views are kept incrementally (LoadMonitor.view, CheckpointManager.view) and must
always equal the view rebuilt from scratch, with ranked load tables equal to freshly built ones,
whatever sequence of heartbeats, routing, assignments, releases, failures and restarts came before.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest

from gateway.core.holders import HolderParams
from gateway.core.load import load_table
from gateway.core.types import ClusterView, LoadParams
from gateway.protocol import control_pb2 as pb
from gateway.server.checkpoints import CheckpointManager
from gateway.server.metrics import GatewayMetrics
from gateway.server.recovery.coordinator import RecoveryCoordinator
from gateway.server.recovery.rehoming import Rehoming
from gateway.server.workers.control import ControlService
from gateway.server.workers.monitor import LoadMonitor
from tests.fixtures.clock import FakeClock

KV = 1000
PARAMS = LoadParams(nominal_batch=8)


def hello(wid: str, incarnation: int) -> pb.Hello:
    return pb.Hello(
        protocol_version=1,
        worker_id=wid,
        incarnation=incarnation,
        http_url=f"http://{wid}",
        kv_endpoint=f"tcp://{wid}",
        kv_capacity_tokens=20_000,
        ckpt_budget_bytes=10**8,
        failure_domain=f"d{int(wid[1:]) % 2}",
        phase=pb.SERVING,
    )


def reference(mon: LoadMonitor, mgr: CheckpointManager) -> ClusterView:
    """CheckpointManager.view as first written: every worker rebuilt on every call."""
    out = {}
    for wid, rec in mon.workers.items():
        w = rec._make_view()
        assigned = mgr.assigned_tokens.get(wid, 0)
        if assigned > w.ckpt_tokens:
            w = dataclasses.replace(w, ckpt_tokens=assigned, ckpt_bytes=max(w.ckpt_bytes, assigned * KV))
        out[wid] = w
    return ClusterView(out)


@pytest.mark.parametrize("seed", range(12))
def test_kept_views_equal_rebuilt_ones(seed: int) -> None:
    rnd = random.Random(seed)
    clock = FakeClock()
    mon = LoadMonitor(clock=clock, heartbeat_interval_s=0.02, heartbeat_misses=3)
    ctl = ControlService(mon, token="", heartbeat_interval_ms=20)
    mgr = CheckpointManager(
        monitor=mon,
        control=ctl,
        params=HolderParams(load=PARAMS, replicas=rnd.choice([1, 2])),
        kv_bytes_per_token=KV,
        metrics=GatewayMetrics(),
    )
    rehoming = Rehoming(checkpoints=mgr, control=ctl, metrics=GatewayMetrics())
    RecoveryCoordinator(monitor=mon, control=ctl, rehoming=rehoming)  # failures re-home checkpoints
    incarnation: dict[str, int] = {}

    def attach(wid: str) -> None:
        incarnation[wid] = incarnation.get(wid, 0) + 1
        mon.attach(hello(wid, incarnation[wid]))
        ctl.outboxes[wid] = asyncio.Queue()

    for i in range(6):
        attach(f"w{i}")
    sessions: list[str] = []
    for step in range(400):
        op = rnd.random()
        recs = list(mon.workers.values())
        rec = rnd.choice(recs)
        if op < 0.25:
            clock.t += 0.005
            mon.heartbeat(
                rec,
                pb.Heartbeat(
                    seq=step,
                    phase=pb.SERVING,
                    running=rnd.randrange(8),
                    waiting=rnd.randrange(4),
                    ckpt_tokens_held=rnd.choice([0, 500, 3000]),
                    ckpt_bytes_used=rnd.choice([0, 500_000]),
                ),
            )
        elif op < 0.4:
            rec.inflight = max(0, rec.inflight + rnd.choice([-1, 1, 1]))
        elif op < 0.65:
            sid = f"s{step}"
            mgr.assign(sid, f"{sid}-1", rec, context=rnd.randrange(2000), remaining=rnd.randrange(500))
            sessions.append(sid)
        elif op < 0.8 and sessions:
            mgr.release_session(sessions.pop(rnd.randrange(len(sessions))))
        elif op < 0.85:
            mon.detach(rec, "killed")  # FAILED; its checkpoints are re-homed
        elif op < 0.9:
            attach(rec.id)  # a new incarnation replaces the record (and fails the old one)
        elif op < 0.93:
            attach(f"w{len(incarnation)}")  # a new worker
        elif op < 0.96:
            clock.t += 0.05  # silence: SUSPECT or FAILED for workers that stopped heartbeating
            mon.tick()
        if rnd.random() < 0.7:  # decisions read the view at random moments, not after every change
            got, want = mgr.view(), reference(mon, mgr)
            assert got == want, step
            assert mon.view() == ClusterView({w.id: w._make_view() for w in mon.workers.values()})
            fresh = ClusterView(dict(got.workers))
            for p in (PARAMS, mgr.params.load):
                assert load_table(got, p).ranked == load_table(fresh, p).ranked, step
