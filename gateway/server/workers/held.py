"""The outage batch boost for SGLang servers: the gateway holds their batch (issue 17).

Lumen's workers change their batch limit at run time (`SetAdmission` leases); an SGLang 0.5.23 server
cannot (`--max-running-requests` is a launch argument). So Lumen's agent launches a server with room
for the boost (its `--max-running-requests B` becomes ceil(B x headroom), and its Hello says
`held_batch = B`), and the gateway holds that server to B requests at a time outside a recovery:
each attempt takes a slot before its body is sent and gives it back when its stream ends. While a
recovery lasts (`OutageAdmission`), the gate's limit is `admission_limit(B, boost)`, never above what
the server admits (Hello `max_running_requests`), exactly the factor Lumen's workers are granted.

Requests over the limit wait here, in the order of their queue rank (`gateway.core.outage.
queue_priority`: resumed first, FIFO, aged shortest-prefill-first while recovering), and count in
the worker's `inflight` meanwhile, so routing sees them as the worker's load (its view's `pending`)
just as the simulator sees a worker's queue. A worker that fails or leaves ends its waiters with
`WorkerLost` (they resume elsewhere; nothing was sent); a waiter whose client leaves just leaves the
queue. Its holders keep counting against the server: when the same worker comes back as a new
incarnation (a relaunch, or a false failure that left the server running until the gateway's aborts
land), the old gate hands its taken slots to the new one, which admits only what the server's batch
has left until those streams end.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import AsyncIterator

from gateway.core.health import ALIVE_STATES
from gateway.core.losses import Loss
from gateway.core.outage import admission_limit
from gateway.protocol.generate import EngineKind
from gateway.server.workers.client import WorkerLost
from gateway.server.workers.monitor import LoadMonitor, StateEvent, WorkerRecord


class SlotGate:
    """At most `limit` holders at once; the others wait, lowest priority value first, FIFO on ties."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self.running = 0
        self._queue: list[tuple[int, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()
        self._failed: str | None = None
        self._successor: SlotGate | None = None  # where this gate's releases go once handed over

    @property
    def waiting(self) -> int:
        return sum(1 for _p, _s, fut in self._queue if not fut.done())

    def set_limit(self, limit: int) -> None:
        self.limit = max(1, limit)
        self._wake()

    async def acquire(self, priority: int) -> None:
        """Take a slot, waiting for one in priority order; raises WorkerLost if the gate fails."""
        if self._failed is not None:
            raise WorkerLost(self._failed, Loss.GONE)
        if self.running < self.limit and not self._queue:
            self.running += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._queue, (priority, next(self._seq), fut))
        self._wake()  # slots may be free behind waiters that left
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release()  # granted just as the waiter left: pass the slot on
            raise

    def release(self) -> None:
        self.running -= 1
        if self._successor is not None:  # a slot of the server's batch, which the successor now keeps
            self._successor.release()
        else:
            self._wake()

    def hand_over(self, successor: SlotGate) -> None:
        """The same server is held by `successor` from now on (a new incarnation): this gate's taken
        slots count against the successor's limit until their holders release them."""
        successor.running += self.running
        self._successor = successor

    def fail(self, reason: str) -> None:
        """The worker is gone: every waiter raises WorkerLost(reason), and so does any later acquire."""
        self._failed = reason
        for _p, _s, fut in self._queue:
            if not fut.done():
                fut.set_exception(WorkerLost(reason, Loss.GONE))
        self._queue.clear()

    def _wake(self) -> None:
        while self._queue and self.running < self.limit:
            _p, _s, fut = heapq.heappop(self._queue)
            if not fut.done():  # a waiter cancelled meanwhile is skipped
                self.running += 1
                fut.set_result(None)


class HeldBatches:
    """One gate per SGLang incarnation that reported a `held_batch`, at the current boost."""

    def __init__(self, monitor: LoadMonitor) -> None:
        self.monitor = monitor
        self.boost = 1.0
        self._gates: dict[str, tuple[int, SlotGate]] = {}  # worker -> (incarnation, gate)
        self._retired: dict[str, SlotGate] = {}  # a failed incarnation's gate with slots still taken

    def limit(self, rec: WorkerRecord) -> int:
        """`held_batch` under the boost, never above what the server admits (its heartbeats' report)."""
        limit = admission_limit(rec.held_batch, self.boost)
        admits = rec.batch_limit or rec.max_running_requests
        return min(limit, admits) if admits > 0 else limit

    def gate(self, rec: WorkerRecord) -> SlotGate | None:
        """The gate of `rec`'s incarnation (made on first use), or None: the gateway holds nothing.
        Raises WorkerLost for a record of an incarnation older than the gate's (the attempt resumes
        elsewhere; a newer incarnation's gate is never replaced by an older one's)."""
        if rec.held_batch <= 0 or rec.engine is not EngineKind.SGLANG:
            return None
        held = self._gates.get(rec.id)
        if held is not None and rec.incarnation < held[0]:  # an attempt still holding a replaced record
            raise WorkerLost(
                f"worker {rec.id} incarnation {rec.incarnation} was replaced by {held[0]}", Loss.GONE
            )
        if held is None or held[0] != rec.incarnation:
            gate = SlotGate(self.limit(rec))
            old = held[1] if held is not None else self._retired.get(rec.id)
            self._retired.pop(rec.id, None)
            if held is not None:
                held[1].fail(f"worker {rec.id} incarnation {held[0]} was replaced")
            if old is not None and old.running > 0:
                old.hand_over(gate)
            held = (rec.incarnation, gate)
            self._gates[rec.id] = held
        return held[1]

    @contextlib.asynccontextmanager
    async def slot(self, rec: WorkerRecord, rank: int) -> AsyncIterator[None]:
        """A slot of `rec`'s held batch for one attempt (nothing to take where it is not held): waited
        for in queue-rank order, counted meanwhile as the worker's load (its view's `pending`)."""
        gate = self.gate(rec)
        if gate is None:
            yield
            return
        rec.inflight += 1
        try:
            await gate.acquire(rank)
        finally:
            rec.inflight -= 1
        try:
            yield
        finally:
            gate.release()

    def set_boost(self, boost: float) -> None:
        if boost == self.boost:
            return
        self.boost = boost
        for wid, (incarnation, gate) in self._gates.items():
            rec = self.monitor.workers.get(wid)
            if rec is not None and rec.incarnation == incarnation:
                gate.set_limit(self.limit(rec))

    def waiting(self, worker_id: str) -> int:
        held = self._gates.get(worker_id)
        return held[1].waiting if held is not None else 0

    def worker_ended(self, ev: StateEvent) -> None:
        """After a state change (the recovery coordinator calls it on every one): an incarnation that
        failed or left fails its gate's waiters (they resume elsewhere)."""
        held = self._gates.get(ev.worker_id)
        if held is None or held[0] != ev.incarnation or ev.dst in ALIVE_STATES:
            return
        del self._gates[ev.worker_id]
        held[1].fail(f"worker {ev.worker_id} is {ev.dst.value.lower()}: {ev.reason}")
        if held[1].running > 0:  # its streams still end (or are aborted) on the server: hand them over
            self._retired[ev.worker_id] = held[1]
