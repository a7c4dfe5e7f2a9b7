"""The live outage batch boost (gateway/server/recovery/outage.py) with the real monitor and control
service (no sockets): the grants it sends while a recovery lasts, their renewal, and their end."""

from __future__ import annotations

import asyncio

from structlog.testing import capture_logs

from gateway.core.costmodel import CostModel
from gateway.core.loadshape import LoadShape
from gateway.core.outage import BoostGate, OutageParams
from gateway.protocol import control_pb2 as pb
from gateway.server.recovery.outage import OutageAdmission
from gateway.server.workers.control import ControlService
from gateway.server.workers.monitor import LoadMonitor
from tests.fixtures.clock import FakeClock


def hello(wid: str, inc: int, engine: str = "lumen") -> pb.Hello:
    return pb.Hello(
        protocol_version=1,
        worker_id=wid,
        incarnation=inc,
        http_url=f"http://{wid}",
        kv_capacity_tokens=1000,
        phase=pb.SERVING,
        engine=engine,
    )


ORDERS: list[tuple[bool, float]] = []  # (shortest_first, its rate) of every grant `grants` saw


def grants(ctl: ControlService, wid: str) -> list[float]:
    """The batch boosts granted to `wid` since the last call (their queue orders go to ORDERS)."""
    out = []
    while not ctl.outboxes[wid].empty():
        msg = ctl.outboxes[wid].get_nowait()
        if msg.WhichOneof("body") == "set_admission":
            a = msg.set_admission
            out.append(round(a.batch_boost, 4))
            ORDERS.append((a.shortest_first, a.shortest_first_rate))
    return out


async def test_survivors_get_the_clusters_slots_while_the_recovery_lasts_and_lose_them_after() -> None:
    clock = FakeClock()
    mon = LoadMonitor(clock=clock, heartbeat_interval_s=0.05, heartbeat_misses=3)
    ctl = ControlService(mon, token="", heartbeat_interval_ms=50)
    params = OutageParams(batch_boost=1.5, shortest_first=True, shortest_first_rate=2000.0)
    out = OutageAdmission(monitor=mon, control=ctl, params=params, clock=clock, lease_s=3.0)
    ids = ("w0", "w1", "w2", "w3", "sg")
    recs = {w: mon.attach(hello(w, 1, "sglang" if w == "sg" else "lumen")) for w in ids}
    for w in ids:
        ctl.outboxes[w] = asyncio.Queue()
    out.tick()  # no recovery: nothing sent
    assert all(grants(ctl, w) == [] for w in ids)

    mon.detach(recs["w0"], "killed")
    out.on_resume()  # the first interrupted request resumes elsewhere
    assert out.recovering and out.boost == 1.25  # 5 workers, 1 out
    ORDERS.clear()
    assert [grants(ctl, w) for w in ("w1", "w2", "w3")] == [[1.25]] * 3
    assert ORDERS == [(True, 2000.0)] * 3  # and their queues shortest prefill first, aged
    assert grants(ctl, "sg") == []  # an SGLang server's batch limit is fixed at launch
    out.tick()
    clock.t += 0.5
    out.tick()
    assert [grants(ctl, w) for w in ("w1", "w2", "w3")] == [[]] * 3  # granted < a third of a lease ago
    clock.t += 0.6
    out.tick()
    assert [grants(ctl, w) for w in ("w1", "w2", "w3")] == [[1.25]] * 3  # renewed

    # w0 back, but the survivors still hold a backlog: the boost stays (the most out at once was 1)
    recs["w0"] = mon.attach(hello("w0", 2))
    ctl.outboxes["w0"] = asyncio.Queue()
    mon.heartbeat(recs["w1"], pb.Heartbeat(phase=pb.SERVING, running=64, waiting=30))
    out.tick()
    assert out.recovering and out.boost == 1.25
    assert grants(ctl, "w0") == [1.25]
    # the backlog drains: the grants are withdrawn (boost 1) from every worker that had one
    mon.heartbeat(recs["w1"], pb.Heartbeat(phase=pb.SERVING, running=64, waiting=1))
    out.tick()
    assert not out.recovering and out.boost == 1.0
    ORDERS.clear()
    assert [grants(ctl, w) for w in ("w0", "w1", "w2", "w3")] == [[1.0]] * 4
    assert [o[0] for o in ORDERS] == [False] * 4  # FIFO again
    out.tick()
    assert all(grants(ctl, w) == [] for w in ids)


async def test_the_boost_follows_the_most_workers_out_and_stops_at_the_cap() -> None:
    clock = FakeClock()
    mon = LoadMonitor(clock=clock, heartbeat_interval_s=0.05, heartbeat_misses=3)
    ctl = ControlService(mon, token="", heartbeat_interval_ms=50)
    out = OutageAdmission(monitor=mon, control=ctl, params=OutageParams(batch_boost=1.5), clock=clock)
    recs = {w: mon.attach(hello(w, 1)) for w in ("w0", "w1", "w2", "w3")}
    for w in recs:
        ctl.outboxes[w] = asyncio.Queue()
    mon.detach(recs["w0"], "killed")
    out.on_resume()
    assert out.boost == 4 / 3
    mon.detach(recs["w1"], "killed")
    out.tick()
    assert out.boost == 1.5  # 4/2 = 2, capped
    assert grants(ctl, "w2") == [round(4 / 3, 4), 1.5]


async def test_on_a_measured_prefill_bound_load_the_survivors_keep_their_batch_and_the_log_says_why() -> None:
    """The boost gate (core/outage.py `boost_gain`) live: the sessions' estimate of the load's shape
    says code-like (long prompts, short outputs), so a failure starts a recovery with the queue order
    but no larger batch; the judgement is logged with its figures. A second recovery on a measured
    decode-bound shape is boosted."""
    clock = FakeClock()
    mon = LoadMonitor(clock=clock, heartbeat_interval_s=0.05, heartbeat_misses=3)
    ctl = ControlService(mon, token="", heartbeat_interval_ms=50)
    cost = CostModel.preset("Qwen3-32B", "H100-80G")
    gate = BoostGate(cost, 64, cost.kv_capacity_tokens(), 8192)
    out = OutageAdmission(monitor=mon, control=ctl, params=OutageParams(), clock=clock, gate=gate)
    shape = out.shape = LoadShape(span=10)
    for _ in range(10):
        shape.observe(2400, 40)
    recs = {w: mon.attach(hello(w, 1)) for w in ("w0", "w1", "w2", "w3")}
    for w in recs:
        ctl.outboxes[w] = asyncio.Queue()

    mon.detach(recs["w0"], "killed")
    ORDERS.clear()
    with capture_logs() as logs:
        out.on_resume()
    assert out.recovering and out.boost == 1.0
    assert [grants(ctl, w) for w in ("w1", "w2", "w3")] == [[1.0]] * 3  # the queue order only
    assert ORDERS == [(True, 2000.0)] * 3
    (judged,) = [e for e in logs if e["event"] == "outage boost judged"]
    assert judged["granted"] is False and judged["gain"] < 1.05 and judged["factor"] == 1.333
    assert judged["shape_measured"] is True and judged["output_tokens"] == 40.0

    # the recovery ends; the load turns decode-bound (long outputs); the next failure is boosted
    recs["w0"] = mon.attach(hello("w0", 2))
    ctl.outboxes["w0"] = asyncio.Queue()
    out.tick()
    assert not out.recovering
    for _ in range(40):
        shape.observe(2400, 470)
    mon.detach(recs["w1"], "killed")
    out.on_resume()
    assert out.recovering and out.boost == 4 / 3
