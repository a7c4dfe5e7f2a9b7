"""A simulated worker: continuous batching, paged KV admission, chunked prefill, restore, speculation.

Time advances in whole engine steps. A step with prefill work (chunks of up to `chunk` tokens, FIFO)
also decodes every running request, and is one event. Decode-only steps with an unchanged batch form
a run, advanced in one event to the next step at which a request finishes (`stepcost.Run`); an
arrival, a finished restore or a speculation change cuts the run at the end of the step in progress.
So the work per event is O(1) plus O(requests that join or leave), never per token.

Decoding requests are positioned on the worker's step counter `k` (see `batch.DecodeBatch`).

Admission reserves the request's final KV size (context + remaining output), as Lumen's engine does,
so nothing is ever preempted; at most `max_running` requests run (restoring, prefilling, decoding).
A restore copies the durable prefix host → GPU over the worker's one H2D link (copies queue FIFO),
then the tail is prefilled; `prefill_left` is at least 1 (the last token is recomputed for logits).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

from gateway.core.health import WorkerState
from gateway.core.types import WorkerView
from gateway.sim.batch import RID_BITS, DecodeBatch
from gateway.sim.events import RESTORED, STEP, EventQueue
from gateway.sim.request import SimRequest
from gateway.sim.stepcost import Run, StepCost

IDLE, PREFILL, DECODE = 0, 1, 2


def fifo_rank(q: SimRequest) -> tuple[int, float]:
    """A queued request's rank outside a recovery: resumed first, else FIFO (core/outage.queue_rank)."""
    return (0 if q.attempts > 1 else 1, 0)


class EngineHost(Protocol):
    """What a worker reports to the simulation (the gateway side)."""

    queue: EventQueue

    def on_prefilled(self, r: SimRequest, now: float) -> None: ...
    def on_finished(self, r: SimRequest, now: float) -> None: ...
    def on_rejected(self, r: SimRequest, now: float) -> None: ...


class SimWorker:
    def __init__(
        self,
        host: EngineHost,
        wid: str,
        domain: str,
        cost: StepCost,
        restore_s_per_token: float,
        max_running: int,
        chunk: int,
        kv_capacity: int,
        ckpt_budget_bytes: int,
    ) -> None:
        self.host, self.id, self.domain, self.cost = host, wid, domain, cost
        self._queue = host.queue  # the simulation's event queue
        self.restore_s_per_token = restore_s_per_token
        self.max_running, self.chunk, self.kv_capacity = max_running, chunk, kv_capacity
        self.ckpt_budget_bytes = ckpt_budget_bytes
        # gateway's view of it
        self.state = WorkerState.HEALTHY
        self.incarnation = 1
        # checkpoint holder side: the requests whose KV pages this worker holds
        self.held: set[SimRequest] = set()
        self.ckpt_tokens = 0
        self.ckpt_bytes = 0
        self.alive = True
        self.dirty = True  # the gateway's view of this worker is out of date
        # where mark_dirty reports the worker (the coordinator's list of workers to refresh; until a
        # coordinator gives its own, a list nobody reads)
        self.dirty_sink: list[SimWorker] = []
        # the gateway's entry for it (set and changed in place by `SeenCluster`, seen.py)
        self.seen: WorkerView | None = None
        self.lost: list[SimRequest] = []
        self.lost_at_kill = 0  # requests lost in a failure, until the gateway detects it
        # a queued request's rank (`enqueue`); the coordinator ranks by prefill size while recovering.
        # A rank_of must give a request the same rank for as long as it is one attempt (what it reads
        # of the request, its prompt, progress and restored prefix, changes only with a new attempt):
        # `enqueue` memoises it per (rank_of, attempt); a new ranking is a new rank_of object
        self.rank_of: Callable[[SimRequest], tuple[int, float]] = fifo_rank
        # step-time factor in effect (`slow`): a slow fault's (`fault_slow`, a gray failure) times a
        # seed's while it streams its weights to a restarting worker (`send_slow`)
        self.slow = 1.0
        self.fault_slow = 1.0
        self.send_slow = 1.0
        # the gateway's measurement of its time per token (gray failures), and when it was degraded
        self.per_token_s = 0.0
        self.per_token_at: float | None = None
        self.degraded_at: float | None = None
        # plan version: a STEP event for an older plan is stale; never reset, so events of a dead
        # incarnation can never match a plan of the next one
        self.version = 0
        self._reset_engine()

    def _reset_engine(self) -> None:
        self.k = 0  # steps done
        self.batch = DecodeBatch()
        self.spec_k = 0  # drafted tokens verified per request per step
        self.spec_wait_s = 0.0  # per step, waiting for the drafter (draft.drafter_latency)
        self.pending_spec: tuple[int, float, float] | None = None
        self.pending_slow: float | None = None
        self.prefill_q: deque[SimRequest] = deque()
        self.waiting: deque[SimRequest] = deque()
        self.restoring: set[SimRequest] = set()
        self.running = 0
        self.kv_used = 0
        self.h2d_free = 0.0
        self.busy = IDLE
        self.seg_start = 0.0
        self.seg_steps = 0
        self.seg_time = 0.0  # a decode run's: run.time(seg_steps), the unslowed seconds of its steps
        self.run: Run | None = None
        self.chunks: list[tuple[SimRequest, int]] = []

    def mark_dirty(self) -> None:
        """The gateway's view of this worker is out of date (reported once until it is refreshed)."""
        if not self.dirty:
            self.dirty = True
            self.dirty_sink.append(self)

    # -- work arriving ---------------------------------------------------------------------------
    def enqueue(self, r: SimRequest, now: float, rank: tuple[int, float] = (1, 0)) -> None:
        """r joins the queue behind every request of rank <= `rank` (core/outage.queue_rank: (1, 0)
        is plain FIFO; a resumed request ranks first; `rank_of` ranks the queued ones)."""
        if not self.dirty:  # self.mark_dirty(), inlined (the hot path)
            self.dirty = True
            self.dirty_sink.append(self)
        if not self.alive:
            self.lost.append(r)  # sent to a dead worker the gateway has not yet declared failed
            return
        if rank == (1, 0) and (not self.waiting or self.rank_of(self.waiting[-1]) <= rank):
            self.waiting.append(r)
        else:
            i = 0
            rank_of = self.rank_of
            for q in self.waiting:
                # rank_of(q), memoised on q for this rank_of and attempt (see `rank_of`)
                m = q.rank_memo
                if m is not None and m[0] is rank_of and m[1] == q.attempts:
                    q_rank = m[2]
                else:
                    q_rank = rank_of(q)
                    q.rank_memo = (rank_of, q.attempts, q_rank)
                if q_rank > rank:
                    break
                i += 1
            self.waiting.insert(i, r)
        self.kick(now)

    def kick(self, now: float) -> None:
        """New work: start a step when idle, or end the current decode run after its current step."""
        busy = self.busy
        if busy == IDLE:
            self._plan(now)
        elif busy == DECODE:
            run = self.run
            assert run is not None
            slow = self.slow
            done = run.steps_within((now - self.seg_start) / slow, self.seg_steps, self.seg_time)
            if done + 1 < self.seg_steps:
                self.seg_steps = done + 1
                self.version = version = self.version + 1
                self.seg_time = seg_time = run.time(done + 1)
                end = self.seg_start + seg_time * slow
                self._queue.push(end, STEP, self, version)

    def set_speculation(self, k: int, e: float, now: float, wait_s: float = 0.0) -> None:
        """From the next step boundary: verify k drafts per request per step, emit e tokens per step on
        average, and wait `wait_s` per step for the drafts."""
        self.pending_spec = (k, e, wait_s)
        self.kick(now)

    def set_slowdown(self, factor: float, now: float) -> None:
        """A slow fault: every step `factor` times slower from the next step boundary."""
        self.fault_slow = factor
        self.pending_slow = factor * self.send_slow
        self.kick(now)

    def set_send_slowdown(self, factor: float, now: float) -> None:
        """Sending weights to a restarting worker (a seed): steps `factor` times slower (1: done)."""
        self.send_slow = factor
        self.pending_slow = self.fault_slow * factor
        self.kick(now)

    def on_restored(self, r: SimRequest, now: float) -> None:
        self.restoring.discard(r)
        self.prefill_q.append(r)
        self.kick(now)

    # -- steps -----------------------------------------------------------------------------------
    def on_step(self, now: float, version: int) -> None:
        if version != self.version or not self.alive:
            return  # superseded by a cut, or the worker died
        if self.busy == PREFILL:
            self.k = k = self.k + 1
            heap = self.batch.heap
            if heap and heap[0] >> RID_BITS <= k:  # a request finishes (the test of pop_finished)
                self._finish_due(now)
            chunks, self.chunks = self.chunks, []
            for r, n in chunks:
                r.prefill_left -= n
                r.kv_ctx += n
                if r.prefill_left == 0:
                    self.prefill_q.popleft()
                    self._prefilled(r, now)
        else:
            self.k = k = self.k + self.seg_steps
            heap = self.batch.heap
            if heap and heap[0] >> RID_BITS <= k:  # a request finishes (the run's end, not a cut)
                self._finish_due(now)
        self.busy = IDLE
        self._plan(now)

    def _plan(self, now: float) -> None:
        if self.pending_spec is not None or self.pending_slow is not None:
            self._apply_pending()
        if self.waiting:
            self._admit(now)
        batch = self.batch
        # len(batch.members) and batch.ctx_sum(k) inlined below (the same operations)
        if self.prefill_q:
            budget, new, attn, kv = self.chunk, 0, 0.0, 0.0
            chunks = self.chunks
            for r in self.prefill_q:
                n = r.prefill_left
                if budget < n:
                    n = budget
                c = r.kv_ctx
                chunks.append((r, n))
                new += n
                attn += n * (c + n / 2.0)
                kv += c
                budget -= n
                if budget == 0:
                    break
            b = len(batch.members)
            if b:
                v = self.spec_k * b
                ctx_sum = batch.a_sum + self.k * b * batch.e
                new += b + v
                attn += ctx_sum * (1.0 + v / b)
                kv += ctx_sum
            dt = self.cost.step(new, attn, kv) + (self.spec_wait_s if b else 0.0)
            self.busy, self.seg_start, self.seg_steps = PREFILL, now, 1
            self.version = version = self.version + 1
            self._queue.push(now + dt * self.slow, STEP, self, version)
        elif batch.members:
            b, k = len(batch.members), self.k
            ctx_sum = batch.a_sum + k * b * batch.e
            self.run = run = self.cost.decode_run(b, ctx_sum, b * batch.e, self.spec_k * b, self.spec_wait_s)
            self.busy, self.seg_start = DECODE, now
            self.seg_steps = steps = (batch.heap[0] >> RID_BITS) - k  # batch.next_finish() - k
            self.seg_time = seg_time = run.time(steps)
            self.version = version = self.version + 1
            self._queue.push(now + seg_time * self.slow, STEP, self, version)

    def _admit(self, now: float) -> None:
        waiting, capacity = self.waiting, self.kv_capacity
        while waiting and self.running < self.max_running:
            r = waiting[0]
            ctx = r.prompt + r.emitted  # r.context
            need = ctx + (r.output - r.emitted)
            if need > capacity:
                waiting.popleft()
                self.host.on_rejected(r, now)
                continue
            if self.kv_used + need > capacity:
                break  # FIFO: wait for KV to free up
            waiting.popleft()
            self.kv_used += need
            r.kv_reserved = need
            self.running += 1
            if not self.dirty:  # self.mark_dirty(), inlined
                self.dirty = True
                self.dirty_sink.append(self)
            prefill = ctx - r.restored
            if prefill < 1:
                prefill = 1
            r.prefill_left = prefill
            r.kv_ctx = ctx - prefill
            if r.kv_ctx > 0:
                start = max(now, self.h2d_free)
                self.h2d_free = start + r.kv_ctx * self.restore_s_per_token
                self.restoring.add(r)
                self._queue.push(self.h2d_free, RESTORED, self, (r, self.incarnation))
            else:
                self.prefill_q.append(r)

    def _prefilled(self, r: SimRequest, now: float) -> None:
        self.host.on_prefilled(r, now)  # emits the attempt's first token
        if r.output - r.emitted <= 0:
            self._release(r)
            self.host.on_finished(r, now)
        else:
            self.batch.start(r, self.k)

    def _finish_due(self, now: float) -> None:
        finished = self.batch.pop_finished(self.k)
        if not finished:
            return
        on_finished = self.host.on_finished
        for r in finished:
            # self._release(r) and mark_dirty, inlined
            if not self.dirty:
                self.dirty = True
                self.dirty_sink.append(self)
            self.running -= 1
            self.kv_used -= r.kv_reserved
            r.kv_reserved = 0
            r.emitted = r.output
            on_finished(r, now)

    def _release(self, r: SimRequest) -> None:
        if not self.dirty:
            self.mark_dirty()
        self.running -= 1
        self.kv_used -= r.kv_reserved
        r.kv_reserved = 0

    def _apply_pending(self) -> None:
        """Re-base every decoding request at the current step for a new e (and apply a slowdown)."""
        if self.pending_slow is not None:
            self.slow, self.pending_slow = self.pending_slow, None
        if self.pending_spec is None:
            return
        (self.spec_k, e, self.spec_wait_s), self.pending_spec = self.pending_spec, None
        self.batch.rebase(self.k, e)

    # -- observation and failure -----------------------------------------------------------------
    def step_at(self, t: float) -> tuple[int, float]:
        """The worker's step counter at time t (within the current run) and when that step began."""
        if self.busy == DECODE and t > self.seg_start:
            assert self.run is not None
            n = self.run.steps_within((t - self.seg_start) / self.slow, self.seg_steps, self.seg_time)
            return self.k + n, self.seg_start + self.run.time(n) * self.slow
        return self.k, self.seg_start

    def measure(self, now: float) -> None:
        """What the gateway measures on this worker's streams: the time per token of its current decode
        run (step time over tokens per step), if it is decoding."""
        if not self.alive or self.busy != DECODE or self.run is None or self.seg_steps <= 0:
            return
        step = self.run.time(self.seg_steps) / self.seg_steps * self.slow
        self.per_token_s = step / max(1e-9, self.batch.e)
        self.per_token_at = now

    def evict(self, now: float) -> list[SimRequest]:
        """Every request leaves this (live) worker to resume elsewhere; its KV here is freed. Returns
        them, with client progress set, as `kill` does; the worker stays up, idle, as slow as it was."""
        out = self._take_all(now)
        slow, pending = self.slow, self.pending_slow
        self.version += 1  # the current plan's STEP event is stale now
        self._reset_engine()
        self.slow, self.pending_slow = slow, pending
        self.mark_dirty()
        return out

    def _take_all(self, now: float) -> list[SimRequest]:
        """Every request on the worker, with the client's progress set from the steps done by `now`."""
        k, began = self.step_at(now)
        out: list[SimRequest] = []
        for r in self.batch.members.values():
            r.emitted = min(r.output - 1, int(self.batch.emitted_at(r, k) + 1e-9))
            if k > r.k_join:
                r.last_token = began
            out.append(r)
        out.extend(self.prefill_q)
        out.extend(sorted(self.restoring, key=lambda r: r.rid))
        out.extend(self.waiting)
        return out

    def kill(self, now: float) -> list[SimRequest]:
        """The worker dies: every request on it loses its KV. Returns them, with client progress set."""
        lost = self._take_all(now)
        self.alive = False
        self.mark_dirty()
        self.lost = lost
        self.lost_at_kill = len(lost)
        self._reset_engine()
        return lost

    def restart(self) -> None:
        """A new incarnation starts (loading): empty engine, no checkpoints."""
        self.alive = True
        self.mark_dirty()
        self.incarnation += 1
        self.slow = self.fault_slow = self.send_slow = 1.0
        self._reset_engine()
