"""The draft-assist coordinator with the real monitor and control service (no sockets)."""

from __future__ import annotations

import asyncio

from gateway.core.pairing import PairingParams
from gateway.protocol import control_pb2 as pb
from gateway.server.metrics import GatewayMetrics
from gateway.server.recovery.pairing import DraftCoordinator
from gateway.server.workers.control import ControlService
from gateway.server.workers.monitor import LoadMonitor


def hello(wid: str, inc: int, phase: int) -> pb.Hello:
    return pb.Hello(
        protocol_version=1,
        worker_id=wid,
        incarnation=inc,
        http_url=f"http://{wid}",
        draft_endpoint=f"tcp://{wid}-draft",
        kv_capacity_tokens=1000,
        phase=phase,
    )


def drain(ctl: ControlService, wid: str) -> list[pb.GatewayMessage]:
    """The commands queued for `wid`, less the Members updates every membership change sends."""
    out = []
    while not ctl.outboxes[wid].empty():
        msg = ctl.outboxes[wid].get_nowait()
        if msg.WhichOneof("body") != "members":
            out.append(msg)
    return out


async def test_a_draft_ready_worker_drafts_for_the_most_loaded_survivor_until_it_serves() -> None:
    mon = LoadMonitor(clock=lambda: 0.0, heartbeat_interval_s=0.02, heartbeat_misses=3)
    ctl = ControlService(mon, token="", heartbeat_interval_ms=20)
    coord = DraftCoordinator(
        monitor=mon, control=ctl, params=PairingParams(), k_initial=4, view=mon.view, metrics=GatewayMetrics()
    )
    recs = {w: mon.attach(hello(w, 1, pb.SERVING)) for w in ("w0", "w1", "w2")}
    for w in recs:
        ctl.outboxes[w] = asyncio.Queue()
    mon.heartbeat(recs["w1"], pb.Heartbeat(phase=pb.SERVING, running=40))
    mon.heartbeat(recs["w2"], pb.Heartbeat(phase=pb.SERVING, running=10))
    # w0 dies and comes back with its draft model loaded
    mon.detach(recs["w0"], "killed")
    recs["w0"] = mon.attach(hello("w0", 2, pb.LOADING_DRAFT))
    coord.reconcile()
    assert coord.pairs == {}
    mon.heartbeat(recs["w0"], pb.Heartbeat(phase=pb.DRAFT_READY))
    coord.reconcile()
    assert coord.pairs == {"w0": "w1"}
    [to_target] = drain(ctl, "w1")
    assert to_target.start_draft_assist.role == "target"
    assert to_target.start_draft_assist.peer_endpoint == "tcp://w0-draft"
    [to_drafter] = drain(ctl, "w0")
    assert to_drafter.start_draft_assist.role == "drafter" and to_drafter.incarnation == 2
    coord.reconcile()  # stable: nothing re-sent
    assert drain(ctl, "w1") == [] and drain(ctl, "w0") == []
    # the drafter's full model is loaded: it serves on its own and the pair ends
    mon.heartbeat(recs["w0"], pb.Heartbeat(phase=pb.SERVING))
    coord.reconcile()
    assert coord.pairs == {}
    [stop] = drain(ctl, "w1")
    assert stop.stop_draft_assist.peer_id == "w0"
    assert [e.started for e in coord.events] == [True, False]
