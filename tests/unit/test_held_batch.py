"""The gate that holds an SGLang server's batch at the gateway (gateway/server/workers/held.py)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.protocol import control_pb2 as pb
from gateway.server.workers.client import WorkerLost
from gateway.server.workers.held import HeldBatches, SlotGate
from gateway.server.workers.monitor import LoadMonitor


async def holders(gate: SlotGate, priorities: list[int], order: list[int]) -> list[asyncio.Task[None]]:
    """One task per priority that takes a slot, notes its priority, and holds the slot until cancelled."""

    async def hold(p: int) -> None:
        await gate.acquire(p)
        order.append(p)
        try:
            await asyncio.Event().wait()
        finally:
            gate.release()

    tasks = [asyncio.create_task(hold(p)) for p in priorities]
    await asyncio.sleep(0)
    return tasks


async def drain(tasks: list[asyncio.Task[None]]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_at_most_limit_hold_at_once_and_the_rest_go_in_priority_order_fifo_on_ties() -> None:
    gate, order = SlotGate(2), []
    tasks = await holders(gate, [50, 60, 30, 10, 30, 20], order)
    assert order == [50, 60] and gate.running == 2 and gate.waiting == 4
    for t in tasks[:2]:  # the two holders finish: the two lowest waiting go in
        t.cancel()
    await asyncio.gather(*tasks[:2], return_exceptions=True)
    await asyncio.sleep(0)
    assert order == [50, 60, 10, 20] and gate.running == 2
    # then the two equal priorities, in the order they came
    third, fifth = tasks[2], tasks[4]
    tasks[3].cancel()
    tasks[5].cancel()
    await asyncio.gather(tasks[3], tasks[5], return_exceptions=True)
    await asyncio.sleep(0)
    assert order[-2:] == [30, 30] and not third.done() and not fifth.done()
    await drain(tasks)
    assert gate.running == 0


async def test_a_larger_limit_lets_waiters_in_at_once_and_a_smaller_one_lets_holders_finish() -> None:
    gate, order = SlotGate(1), []
    tasks = await holders(gate, [1, 2, 3], order)
    assert order == [1]
    gate.set_limit(3)  # the boost: two more in, no one waits
    await asyncio.sleep(0)
    assert order == [1, 2, 3] and gate.waiting == 0
    gate.set_limit(1)  # the end of the boost: nobody is stopped, nobody new goes in
    late = await holders(gate, [0], order)
    assert gate.running == 3 and gate.waiting == 1
    for t in tasks[:2]:
        t.cancel()
    await asyncio.gather(*tasks[:2], return_exceptions=True)
    await asyncio.sleep(0)
    assert order == [1, 2, 3] and gate.waiting == 1  # still 1 running: the limit
    await drain([tasks[2]])
    await asyncio.sleep(0)
    assert order == [1, 2, 3, 0]
    await drain(late)


async def test_a_waiter_that_leaves_frees_its_place_and_a_failed_gate_ends_every_waiter() -> None:
    gate, order = SlotGate(1), []
    tasks = await holders(gate, [5, 6, 7], order)
    tasks[1].cancel()  # a client leaves while waiting
    await asyncio.gather(tasks[1], return_exceptions=True)
    assert gate.waiting == 1
    gate.fail("worker w0 is failed")
    with pytest.raises(WorkerLost, match="w0 is failed"):
        await tasks[2]
    with pytest.raises(WorkerLost):  # nobody gets in any more
        await gate.acquire(0)
    await drain([tasks[0]])
    assert gate.running == 0 and order == [5]


async def test_a_slot_granted_as_its_waiter_is_cancelled_passes_on() -> None:
    gate = SlotGate(1)
    await gate.acquire(0)
    waiter = asyncio.create_task(gate.acquire(1))
    nxt = asyncio.create_task(gate.acquire(2))
    await asyncio.sleep(0)
    gate.release()  # granted to the first waiter...
    waiter.cancel()  # ...which leaves before it runs
    await asyncio.gather(waiter, return_exceptions=True)
    await asyncio.wait_for(nxt, 1.0)  # the slot went on to the next
    assert gate.running == 1


async def test_a_handed_over_gate_counts_the_old_holders_until_they_release() -> None:
    old, order = SlotGate(2), []
    before = await holders(old, [1, 2], order)
    old.fail("replaced")  # a false failure: the server kept running both streams
    new = SlotGate(2)
    old.hand_over(new)
    after = await holders(new, [3, 4], order)
    assert order == [1, 2] and new.running == 2 and new.waiting == 2  # the server's batch is still full
    await drain([before[0]])  # one old stream ends (its abort landed): one new request goes in
    await asyncio.sleep(0)
    assert order == [1, 2, 3] and new.running == 2
    await drain([before[1]])
    await asyncio.sleep(0)
    assert order == [1, 2, 3, 4] and old.running == 0 and new.running == 2
    await drain(after)
    assert new.running == 0


def _sglang_hello(incarnation: int) -> pb.Hello:
    return pb.Hello(
        protocol_version=1,
        worker_id="s0",
        incarnation=incarnation,
        http_url="http://s0",
        phase=pb.SERVING,
        engine="sglang",
        max_running_requests=3,
        held_batch=2,
    )


async def test_a_new_incarnation_of_a_held_server_admits_only_what_the_old_one_left_free() -> None:
    """The gate per incarnation, through the monitor: the old incarnation fails with two streams still
    on the server (a false failure), the worker attaches again, and its new gate admits nobody until
    those two end, so the server never runs more than its held batch."""
    monitor = LoadMonitor(clock=lambda: 0.0, heartbeat_interval_s=0.05, heartbeat_misses=4)
    held, order = HeldBatches(monitor), []
    monitor.on_state_change.append(held.worker_ended)  # what the recovery coordinator does
    first = monitor.attach(_sglang_hello(10))
    gate = held.gate(first)
    assert gate is not None and gate.limit == 2
    old = await holders(gate, [1, 2], order)
    monitor.report_data_failure("s0", 10, "stream broke")  # FAILED: the gate fails its waiters
    second = monitor.attach(_sglang_hello(11))
    new_gate = held.gate(second)
    assert new_gate is not None and new_gate is not gate and new_gate.running == 2
    new = await holders(new_gate, [3], order)
    assert order == [1, 2] and new_gate.waiting == 1
    await drain(old)
    await asyncio.sleep(0)
    assert order == [1, 2, 3] and new_gate.running == 1
    await drain(new)
    assert new_gate.running == 0


async def test_a_record_of_a_replaced_incarnation_gets_no_slot_and_leaves_the_new_gate_alone() -> None:
    monitor = LoadMonitor(clock=lambda: 0.0, heartbeat_interval_s=0.05, heartbeat_misses=4)
    held = HeldBatches(monitor)
    monitor.on_state_change.append(held.worker_ended)  # what the recovery coordinator does
    stale = monitor.attach(_sglang_hello(10))
    fresh = monitor.attach(_sglang_hello(11))  # the same server, attached again
    gate = held.gate(fresh)
    with pytest.raises(WorkerLost, match="incarnation 10 was replaced by 11"):
        async with held.slot(stale, 0):
            pass
    assert held.gate(fresh) is gate and gate.running == 0 and stale.inflight == 0
