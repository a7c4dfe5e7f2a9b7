"""The load monitor: the gateway's live view of every worker (its worker registry), fed by the
control plane.

It owns worker state (through the core transition table), fencing of old incarnations, the kind of
each loss (gateway/core/losses.py), failure notifications to the sessions streaming from a worker,
and gray failures (slow per token). Its state changes have one listener, the recovery coordinator
(gateway/server/recovery/coordinator.py), which writes what each failure sets off. It composes the
rest, one module each:

- detection.py: failure detection by silence (the core's adaptive detector and verdict,
  core/detector.py, with an HTTP probe of a suspected worker's own server); the monitor applies the
  verdicts;
- expiry.py: the expiry of records of workers that failed or were removed and never came back, and
  the fences they leave behind;
- views.py: the live ClusterView, updated only for the records that changed.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable

import structlog

from gateway.core import health
from gateway.core.detector import DetectorParams, HeartbeatDetector
from gateway.core.determinism import UNKNOWN
from gateway.core.gray import GrayParams, Observation, gray_verdicts, verdict_inputs
from gateway.core.health import Phase, WorkerState
from gateway.core.losses import Loss
from gateway.core.polls import prime
from gateway.core.types import ClusterView
from gateway.protocol import control_pb2 as pb
from gateway.protocol.generate import EngineKind
from gateway.protocol.kv import DEFAULT_PAGE_SIZE
from gateway.protocol.launch import DEFAULT_MAX_RUNNING_REQUESTS
from gateway.server.workers.detection import SilenceDetection
from gateway.server.workers.expiry import RecordExpiry
from gateway.server.workers.fences import FenceLedger
from gateway.server.workers.probe import Prober
from gateway.server.workers.records import (
    AttachRefused,
    Clock,
    FailureCallback,
    StateEvent,
    WorkerRecord,
    phase_of,
    reload_note,
)
from gateway.server.workers.views import ViewCache

log = structlog.get_logger("lumen.monitor")

__all__ = ["AttachRefused", "LoadMonitor", "Prober", "StateEvent", "WorkerRecord", "phase_of", "reload_note"]


class LoadMonitor:
    def __init__(
        self,
        *,
        clock: Clock,
        heartbeat_interval_s: float,
        heartbeat_misses: int,
        correlated_grace_s: float = 1.0,
        detector: DetectorParams | None = None,
        record_retention_s: float = 300.0,
        prober: Prober | None = None,
        fences: FenceLedger | None = None,
    ) -> None:
        self.clock = clock
        self.interval_s = heartbeat_interval_s
        self.misses = heartbeat_misses
        # the silence rule (core/detector.py); `detector` comes from the [health] section
        self.detection = SilenceDetection(
            detector
            if detector is not None
            else DetectorParams(interval_s=heartbeat_interval_s, misses=heartbeat_misses),
            tick_period_s=heartbeat_interval_s / 2,
            correlated_grace_s=correlated_grace_s,
            prober=prober,
        )
        # fences that outlive this process (gateway.state_dir): what an earlier run of this gateway
        # fenced is refused from the start, and every new fence is written before it takes effect
        self.fences = fences
        self.expiry = RecordExpiry(record_retention_s, fences)
        self.workers: dict[str, WorkerRecord] = {}
        self.events: deque[StateEvent] = deque(maxlen=10_000)
        self._sub_ids = itertools.count(1)
        self._became_healthy = asyncio.Event()
        self.on_state_change: list[Callable[[StateEvent], None]] = []
        # whether sessions measure each worker's time per token (gray failures; see observe_tokens)
        self.measure_tokens = False
        self.token_half_life_s = 2.0
        self.token_min = 32
        self.views = ViewCache()

    # the detector's settings and state (detection.py), as attributes of the monitor
    @property
    def detector_params(self) -> DetectorParams:
        return self.detection.params

    @property
    def tick_period_s(self) -> float:
        return self.detection.tick_period_s

    @property
    def correlated_grace_s(self) -> float:
        return self.detection.correlated_grace_s

    @property
    def prober(self) -> Prober | None:
        return self.detection.prober

    @prober.setter
    def prober(self, prober: Prober | None) -> None:
        self.detection.prober = prober

    @property
    def stall_forgiven_s(self) -> float:
        return self.detection.stall_forgiven_s

    @property
    def record_retention_s(self) -> float:
        return self.expiry.retention_s

    # -- attach / heartbeat / detach ------------------------------------------------------------
    def attach(self, hello: pb.Hello) -> WorkerRecord:
        """Register a worker incarnation. A stale or duplicate incarnation is refused (fencing)."""
        now = self.clock()
        old = self.workers.get(hello.worker_id)
        # an expired record: still fenced
        expired = self.expiry.check_attach(hello.worker_id, hello.incarnation) if old is None else False
        if old is not None:
            if hello.incarnation <= old.incarnation:
                raise AttachRefused(
                    f"incarnation {hello.incarnation} is not newer than {old.incarnation} "
                    f"for worker {hello.worker_id}"
                )
            if old.state in health.ALIVE_STATES:
                # the old incarnation is gone even if we had not noticed: fence it first
                self._fail(old, "replaced by a new incarnation", Loss.FENCED)
        phase = phase_of(hello.phase)
        if old is None:
            state = WorkerState.RESTARTING if expired else WorkerState.JOINING
        elif old.state is WorkerState.REMOVED:
            raise AttachRefused(f"worker {hello.worker_id} was removed")
        else:
            state = WorkerState.RESTARTING
        rec = WorkerRecord(
            id=hello.worker_id,
            incarnation=hello.incarnation,
            state=state,
            http_url=hello.http_url,
            kv_endpoint=hello.kv_endpoint,
            draft_endpoint=hello.draft_endpoint,
            model=hello.model,
            tp=hello.tp,
            pid=hello.pid,
            kv_capacity_tokens=max(1, hello.kv_capacity_tokens),
            ckpt_budget_bytes=hello.ckpt_budget_bytes,
            failure_domain=hello.failure_domain,
            page_size=hello.page_size or DEFAULT_PAGE_SIZE,
            engine=EngineKind.of(hello.engine),
            max_running_requests=hello.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS,
            held_batch=hello.held_batch,
            api_key=hello.api_key,
            phase=phase,
            last_heartbeat=now,
            attached_at=now,
        )
        rec.detector = HeartbeatDetector(self.detector_params, now)
        if rec.engine is EngineKind.SGLANG:
            # what its /server_info says is read once it serves (server_info.py); until then, what the
            # previous incarnation's said (the same server, usually relaunched with the same arguments)
            same = old is not None and old.engine is rec.engine
            rec.determinism = old.determinism if old is not None and same else UNKNOWN
            # no probe confirms an SGLang worker's silence (its polls, or its agent's heartbeats, are
            # all there is): what its previous incarnation taught, and the cap's patience at first
            # (core/polls.py prime; a busy host delays an agent's heartbeats as it slows /ready)
            prime(rec.detector, now, old.detector if old is not None and same else None)
        self.expiry.forget(rec.id)
        self.views.track(rec)
        self.workers[rec.id] = rec
        self._record(rec, old.state if old else None, state, "attached")
        self._apply_phase(rec, phase)
        return rec

    def heartbeat(self, rec: WorkerRecord, hb: pb.Heartbeat) -> None:
        if self.workers.get(rec.id) is not rec or rec.state not in health.ALIVE_STATES:
            return  # a fenced incarnation: ignore
        now = self.clock()
        rec.last_heartbeat = now
        det = self.detection.detector_of(rec)
        gap = det.silence(now)
        det.beat(now)
        rec.probe_gen += 1  # the silence is over: an answer to its probe means nothing now
        rec.heartbeats += 1
        if hb.pid:  # an agent's server relaunched after the session's Hello
            rec.pid = hb.pid
        rec.batch_limit = hb.batch_limit or rec.max_running_requests
        rec.running = hb.running
        rec.waiting = hb.waiting
        rec.kv_tokens_used = hb.kv_tokens_used
        rec.ckpt_bytes = hb.ckpt_bytes_used
        rec.ckpt_tokens = hb.ckpt_tokens_held
        rec.completed_total = hb.completed_total
        rec.restored_tokens_total = hb.restored_tokens_total
        rec.restores_total = hb.restores_total
        rec.ckpt_bytes_sent_total = hb.ckpt_bytes_sent_total
        rec.ckpt_pages_evicted_total = hb.ckpt_pages_evicted_total
        rec.drafted_tokens = hb.draft.drafted_tokens
        rec.accepted_tokens = hb.draft.accepted_tokens
        rec.draft_rounds = hb.draft.rounds
        rec.phase = phase_of(hb.phase)
        note = ""
        if hb.reload_source:
            rec.reload_seconds, rec.reload_source, rec.reload_seed = (
                hb.reload_seconds,
                hb.reload_source,
                hb.reload_seed,
            )
            note = reload_note(hb.reload_seconds, hb.reload_source, hb.reload_seed)
        if rec.state is WorkerState.SUSPECT:
            self._set(rec, WorkerState.HEALTHY, f"heartbeat resumed after {1000 * gap:.0f} ms")
        self._apply_phase(rec, rec.phase, note)

    def detach(self, rec: WorkerRecord, reason: str, kind: Loss = Loss.KILLED) -> None:
        """The control stream of `rec` ended (or the gateway ends it: `kind`): the incarnation is
        failed at once."""
        if self.workers.get(rec.id) is rec and rec.state in health.ALIVE_STATES:
            self._fail(rec, reason, kind)

    def report_data_failure(
        self, worker_id: str, incarnation: int, reason: str, kind: Loss = Loss.CONNECTION
    ) -> None:
        """A session's data connection to the worker broke (or the worker answered as another
        incarnation: `kind`): fail that incarnation at once."""
        rec = self.workers.get(worker_id)
        if rec is not None and rec.incarnation == incarnation and rec.state in health.ALIVE_STATES:
            self._fail(rec, f"data connection: {reason}", kind)

    def remove(self, worker_id: str) -> None:
        rec = self.workers.get(worker_id)
        if rec is None:
            return
        if rec.state in health.ALIVE_STATES:
            self._fail(rec, "removed", Loss.FENCED)
        self._set(rec, WorkerState.REMOVED, "removed")

    # -- failure detection by silence -----------------------------------------------------------
    def tick(self) -> None:
        """One pass of the detector (every half interval): forgive the gateway's own stall, judge every
        live worker's silence (detection.py, core/detector.py), apply the verdicts, send the probes
        they ask for, and expire old records (expiry.py)."""
        now = self.clock()
        for rec, det, v in self.detection.judge(self.workers.values(), now):
            if self.workers.get(rec.id) is not rec or rec.state not in health.ALIVE_STATES:
                continue  # changed by a listener of an earlier verdict
            if v.state is WorkerState.FAILED:
                rec.failed_by_silence = True
                self._fail(rec, v.why, Loss.HUNG)
                continue
            if v.state is not rec.state:
                self._set(rec, v.state, v.why)
            if v.probe:
                self.detection.send_probe(rec, det, now)
        if self.expiry.expire(self.workers, now):
            self.views.invalidate()  # rebuilt without them (with_workers only adds and updates)

    async def run_detector(self) -> None:
        await self.detection.run(self.tick)

    # -- views and subscriptions ----------------------------------------------------------------
    def view(self) -> ClusterView:
        """Every worker as the gateway sees it now (views.py: the same object while no worker
        changed, otherwise updated for the workers that did)."""
        return self.views.view(self.workers)

    def view_changes(self, since: ClusterView) -> tuple[str, ...] | None:
        """The ids of the workers that may differ between `since` and the current view when `since`
        is the view before it; None otherwise (compare them yourself)."""
        return self.views.view_changes(since)

    def healthy_count(self) -> int:
        return sum(1 for w in self.workers.values() if w.state is WorkerState.HEALTHY)

    # -- gray failures ---------------------------------------------------------------------------
    def observe_tokens(self, worker_id: str, incarnation: int, tokens: int, seconds: float) -> None:
        """A stream on this incarnation got `tokens` tokens `seconds` after its previous chunk.

        The worker's time per token is the ratio of two sums that decay with `token_half_life_s`
        (seconds over tokens, not a mean of per-chunk ratios: chunks that arrive together carry
        near-zero gaps that the chunk before them paid for). It counts once `token_min` tokens
        are in the sums, so one step slowed by a prefill chunk does not make a verdict.
        """
        rec = self.workers.get(worker_id)
        if rec is None or rec.incarnation != incarnation or tokens <= 0 or seconds < 0:
            return
        now = self.clock()
        if rec.token_sums_at is not None:
            decay = 0.5 ** ((now - rec.token_sums_at) / self.token_half_life_s)
            rec.token_seconds *= decay
            rec.token_count *= decay
        rec.token_seconds += seconds
        rec.token_count += tokens
        rec.token_sums_at = now
        if rec.token_count >= self.token_min:
            rec.per_token_s = rec.token_seconds / rec.token_count
            rec.per_token_at = now

    def check_gray(
        self, params: GrayParams, window_s: float, probation_s: float, *, migrate: bool = True
    ) -> None:
        """Degrade workers far slower per token than their peers; trust degraded ones again when
        they are back near the peers or, unmeasured, after `probation_s` (core/gray.py)."""
        now = self.clock()
        observations = [
            Observation(r.id, r.state, r.per_token_s, r.per_token_at, r.degraded_at)
            for r in self.workers.values()
        ]
        times, degraded = verdict_inputs(now, observations, window_s, probation_s)
        verdict = gray_verdicts(times, degraded, params)
        for wid in sorted(verdict.degrade):
            rec = self.workers[wid]
            peers = sorted(t for w, t in times.items() if w != wid)
            self._set(
                rec,
                WorkerState.DEGRADED,
                f"gray: {1000 * rec.per_token_s:.1f} ms/token vs peers {[round(1000 * t, 1) for t in peers]}",
            )
            rec.degraded_at = now
            if not migrate:
                continue
            # its streams end here and resume elsewhere through recovery dispatch
            rec.loss = Loss.DEGRADED
            self._notify_watchers(rec, f"degraded: worker {wid} is serving far slower than its peers")
        for wid in sorted(verdict.restore):
            rec = self.workers[wid]
            self._set(rec, WorkerState.HEALTHY, "gray: back near its peers' speed, or probation over")
            rec.degraded_at = None
            # measured afresh on the requests it gets now
            rec.per_token_at = rec.token_sums_at = None
            rec.token_seconds = rec.token_count = 0.0

    def watch(self, worker_id: str, incarnation: int, callback: FailureCallback) -> int | None:
        """Call `callback(reason)` when this incarnation fails (or its streams move: DEGRADED); the
        record's `loss` says which kind. None if it is already gone."""
        rec = self.workers.get(worker_id)
        if rec is None or rec.incarnation != incarnation or rec.state not in health.ALIVE_STATES:
            return None
        sub = next(self._sub_ids)
        rec.watchers[sub] = callback
        return sub

    def unwatch(self, worker_id: str, sub: int) -> None:
        rec = self.workers.get(worker_id)
        if rec is not None:
            rec.watchers.pop(sub, None)

    async def wait_for_healthy(self, timeout_s: float) -> bool:
        try:
            async with asyncio.timeout(timeout_s):
                while self.healthy_count() == 0:
                    self._became_healthy.clear()
                    await self._became_healthy.wait()
        except TimeoutError:
            return False
        return True

    # -- internals -------------------------------------------------------------------------------
    def _apply_phase(self, rec: WorkerRecord, phase: Phase, note: str = "") -> None:
        """Move `rec` to the state its phase implies; `note` (a reload report) goes in the timeline with
        that transition, or as an event of its own when the state stays."""
        dst = health.state_for_phase(rec.state, phase)
        if dst is not rec.state:
            self._set(rec, dst, f"phase {phase.value}; {note}" if note else f"phase {phase.value}")
        elif note:
            self._record(rec, rec.state, rec.state, note)

    def _fail(self, rec: WorkerRecord, reason: str, kind: Loss) -> None:
        if self.fences is not None:  # durable before anything acts on the failure
            self.fences.record(rec.id, rec.incarnation)
        rec.failed_at = self.clock()
        rec.loss = kind
        self._set(rec, WorkerState.FAILED, reason)
        # what a dead incarnation last reported is void (it showed as a stale running count)
        rec.running = rec.waiting = 0
        rec.fence.set()
        self._notify_watchers(rec, reason)

    @staticmethod
    def _notify_watchers(rec: WorkerRecord, reason: str) -> None:
        """Tell every stream watching this incarnation, once."""
        watchers, rec.watchers = rec.watchers, {}
        for cb in watchers.values():
            cb(reason)

    def _set(self, rec: WorkerRecord, dst: WorkerState, reason: str) -> None:
        src = rec.state
        rec.state = health.transition(src, dst)
        if dst in (WorkerState.FAILED, WorkerState.REMOVED):
            rec.ended_at = self.clock()
        self._record(rec, src, dst, reason)

    def _record(self, rec: WorkerRecord, src: WorkerState | None, dst: WorkerState, reason: str) -> None:
        ev = StateEvent(self.clock(), rec.id, rec.incarnation, src, dst, reason)
        self.events.append(ev)
        log.info(
            "worker_state",
            worker=rec.id,
            incarnation=rec.incarnation,
            src=src and src.value,
            dst=dst.value,
            reason=reason,
        )
        for cb in self.on_state_change:
            cb(ev)
        if dst is WorkerState.HEALTHY:
            self._became_healthy.set()
