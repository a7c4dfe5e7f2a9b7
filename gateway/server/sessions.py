"""Request sessions: one client request, spliced from one or more worker streams into one stream.

A session keeps what it needs to resume anywhere: the prompt ids, every output id already sent to
the client, the sampling parameters with the seed base, and the serving worker and incarnation. When
that worker fails (detected by the monitor, a broken connection, or a stall), the session resumes on
a survivor with `input_ids = prompt + emitted`; the client sees one stream with no token duplicated,
missing or reordered. With seeded sampling the worker samples position p with RNG(seed_base, p), so
the continuation is the one the failed worker would have produced.

A job resumed on this gateway after another one died (Last-Event-ID; `job.adopt`) first tries to
adopt the request still running on its worker (`POST /lumen/adopt`: Lumen's workers keep a request
whose gateway vanished for `recovery.orphan_grace_s`); if the worker is gone or no longer has it, the
session replays it from the prompt with the same seed, which gives the same tokens. Either way the
session yields the output from its first id; the API skips what the client already has. A session
that gives up on an attempt (the client left, a stop string matched, the request moved) aborts it on
its worker by rid, since a dropped connection alone no longer does.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

import aiohttp
import msgspec
import structlog

from gateway.config import RecoverySection
from gateway.core.costmodel import CostModel
from gateway.core.determinism import UNKNOWN, nonexact_sides, seed_ignored_by
from gateway.core.dispatch import DispatchParams
from gateway.core.health import ALIVE_STATES
from gateway.core.loadshape import LoadShape
from gateway.core.losses import Loss
from gateway.core.modes import RecoveryPolicy, policy_for
from gateway.core.router import routing_params
from gateway.core.types import LoadParams
from gateway.protocol.generate import (
    INCARNATION_RESET_ABORT,
    AdoptRequest,
    EngineKind,
    GenerateChunk,
    HolderRef,
)
from gateway.protocol.sglang import SGLangGenerate, sglang_rid, to_sglang
from gateway.server.api.errors import Overloaded, UpstreamFailed, UpstreamRejected
from gateway.server.api.jobs import Attempt, GenerateJob, TokenDelta, attempt_rid
from gateway.server.checkpoints import CheckpointManager
from gateway.server.metrics import GatewayMetrics
from gateway.server.recovery.assisted import AssistedStream, GatewayVerifier
from gateway.server.recovery.dispatch import RecoveryDispatcher, Resume
from gateway.server.recovery.levers import OutageLevers
from gateway.server.session_records import Session
from gateway.server.workers.aborts import Aborts
from gateway.server.workers.client import WorkerLost, WorkerRefused, WorkerStream
from gateway.server.workers.monitor import LoadMonitor, WorkerRecord

log = structlog.get_logger("lumen.sessions")

# attempts a worker refused as addressed to an incarnation it no longer is (409), or dropped when it
# became a new incarnation, do not count toward recovery.max_attempts; in all, a session makes at
# most this many times max_attempts
STALE_REFUSALS_FACTOR = 3


class SessionManager:
    """Implements `jobs.Generator` for the HTTP API."""

    def __init__(
        self,
        *,
        monitor: LoadMonitor,
        http: aiohttp.ClientSession,
        recovery: RecoverySection,
        load_params: LoadParams,
        metrics: GatewayMetrics,
        policy: RecoveryPolicy | None = None,
        checkpoints: CheckpointManager | None = None,
        dispatch_params: DispatchParams | None = None,
        cost: CostModel | None = None,
        max_concurrent: int = 8192,
        clock: Callable[[], float] = time.monotonic,
        route_params: LoadParams | None = None,
        verifier: GatewayVerifier | None = None,
    ) -> None:
        self.max_concurrent = max_concurrent
        self.policy = policy or policy_for(recovery.mode)
        self.checkpoints = checkpoints if self.policy.checkpointing else None
        self.dispatch_params = dispatch_params or DispatchParams(load=load_params)
        self.cost = cost
        self.monitor = monitor
        self.http = http
        self.recovery = recovery
        self.load_params = load_params
        # what new requests (and resumes that dispatch leaves open) are routed by: see routing_params
        self.route_params = route_params or routing_params(load_params)
        self.metrics = metrics
        self.clock = clock
        self.dispatcher = RecoveryDispatcher(
            monitor=monitor,
            route_params=self.route_params,
            dispatch_params=self.dispatch_params,
            no_worker_wait_s=recovery.no_worker_wait_s,
            checkpoints=self.checkpoints,
            cost=cost,
            clock=clock,
        )
        self.verifier = verifier  # draft assist on SGLang targets (gateway-level verification)
        self.live: dict[str, Session] = {}
        self._aborts = Aborts(http)  # /abort_request calls in flight
        # recently finished sessions with interruptions, for /admin/sessions and the demo
        self.recent_interrupted: deque[Session] = deque(maxlen=2000)
        # the load's shape as completed requests show it (the draft-assist gate judges it)
        self.load_shape = LoadShape()
        # the outage levers as SGLang servers take them (set by the app): each request's queue rank
        # as a priority, and the batch the gateway holds a server to
        self.levers: OutageLevers | None = None

    def replay_note(self, sampled: bool) -> str | None:
        """What a sampled request's response says of its replay (the `Lumen-Replay` header), or None:
        not reproducible where a live server it may be served or resumed on ignores `sampling_seed`
        (SGLang without --enable-deterministic-inference, core/determinism.py). Greedy requests: None."""
        if not sampled:
            return None
        live = [(w.id, w.determinism) for w in self.monitor.workers.values() if w.state in ALIVE_STATES]
        ignoring = seed_ignored_by(live)
        if not ignoring:
            return None
        return f'not-reproducible; reason="sampling_seed ignored by {", ".join(ignoring)}"'

    async def generate(self, job: GenerateJob) -> AsyncIterator[TokenDelta]:
        if len(self.live) >= self.max_concurrent:
            raise Overloaded(f"the gateway is at its limit of {self.max_concurrent} concurrent requests")
        seed = job.sampling.seed if job.sampling.seed is not None else secrets.randbits(63)
        session = Session(job=job, seed_base=seed, arrived=self.clock())
        self.live[job.rid] = session
        self.metrics.inflight.inc()
        try:
            async for delta in self._run(session):
                yield delta
        finally:
            self.metrics.inflight.dec()
            del self.live[job.rid]
            if self.checkpoints is not None:
                self.checkpoints.release_session(job.rid)
            if session.interruptions:
                self.recent_interrupted.append(session)
            if session.finish_reason is not None:
                self.load_shape.observe(len(job.prompt_ids), len(session.emitted))

    # -- the failover loop ----------------------------------------------------------------------
    async def _run(self, s: Session) -> AsyncIterator[TokenDelta]:
        rec_cfg = self.recovery
        excluded: set[str] = set()
        if s.job.adopt is not None:
            adopted = False
            async for delta in self._adopt(s, s.job.adopt):
                adopted = True
                yield delta
                if delta.finish_reason is not None:
                    return
            if adopted:  # adopted, then lost: its worker failed; resume from what it gave
                excluded.add(s.job.adopt.worker_id)
        while True:
            done = s.finished_by_tokens() if s.attempts > 0 else None
            if done is not None:
                s.finish_reason = done
                yield TokenDelta((), finish_reason=done)  # type: ignore[arg-type]
                return
            worker = await self._pick(s, excluded)
            if s.emitted and s.worker_id is not None:
                self._note_resume(s, s.worker_id, worker)
            s.attempts += 1
            s.worker_id, s.incarnation = worker.id, worker.incarnation
            try:
                async for delta in self._attempt(s, worker):
                    yield delta
                    if delta.finish_reason is not None:
                        return
                raise WorkerLost("stream ended without a finish reason", Loss.ENDED)
            except WorkerRefused as exc:
                if exc.request_fault:  # the request's own fault: the client's 4xx, never a 502
                    self.metrics.worker_refusals.labels(status=str(exc.status), outcome="client_error").inc()
                    log.info("worker_refused_request", rid=s.job.rid, worker=worker.id, status=exc.status)
                    raise UpstreamRejected(
                        f"worker {worker.id} refused the request: {exc.message}",
                        status=413 if exc.status == 413 else 400,
                    ) from exc
                self.metrics.worker_refusals.labels(status=str(exc.status), outcome="retried").inc()
                lost_reason, lost_kind = str(exc), None
                if exc.stale_incarnation:
                    # the worker runs a newer incarnation than the one we addressed (it restarted and
                    # our view lags): that one is gone, so fence it; the worker's new incarnation is
                    # welcome once it attaches. Nothing ran: the attempt does not count.
                    self.monitor.report_data_failure(
                        worker.id, worker.incarnation, "answered 409 stale_epoch", Loss.FENCED
                    )
                    s.refused += 1
                else:  # still loading (503), in trouble (5xx) or refusing on its own account (e.g. 403,
                    # 404, 429): another worker, not a failure of it
                    excluded.add(worker.id)
            except WorkerLost as exc:
                lost_reason, lost_kind = exc.reason, exc.kind
                if exc.kind.fails_incarnation:
                    # the incarnation is gone: fail it here too, so the next pick does not address it;
                    # a reset (another gateway fenced the worker), like a 409, costs no attempt
                    reset = exc.kind is Loss.RESET
                    self.monitor.report_data_failure(
                        worker.id, worker.incarnation, exc.reason, Loss.FENCED if reset else Loss.CONNECTION
                    )
                    s.refused += int(reset)
                elif exc.kind.excludes_worker:  # alive, but stuck on or gave up on this request
                    if exc.kind is Loss.STALLED:
                        self.metrics.stalls.inc()
                    excluded.add(worker.id)
            self._interrupted(s, worker, lost_reason, lost_kind)
            if not self.policy.failover:
                raise UpstreamFailed(
                    f"worker {worker.id} failed mid-request ({lost_reason}); recovery mode is 'none'"
                )
            tried = s.attempts - s.refused
            if tried >= rec_cfg.max_attempts or s.attempts >= STALE_REFUSALS_FACTOR * rec_cfg.max_attempts:
                raise UpstreamFailed(f"gave up after {tried} worker attempts; last: {lost_reason}")

    def _note_resume(self, s: Session, off_id: str, onto: WorkerRecord) -> None:
        """Count (and log) a resume off or onto a server that does not promise bit-equal logits
        (core/determinism.py): coherent, never a duplicate or a gap, but maybe not the uninterrupted
        run's continuation."""
        off = self.monitor.workers.get(off_id)
        sides = nonexact_sides(off.determinism if off is not None else UNKNOWN, onto.determinism)
        if not sides:
            return
        for side in sides:
            self.metrics.nonexact_resumes.labels(side=side).inc()
        log.info(
            "nonexact_resume",
            rid=s.job.rid,
            off=off_id,
            onto=onto.id,
            sides=list(sides),
            emitted=len(s.emitted),
            off_determinism=off.determinism.note if off is not None else UNKNOWN.note,
            onto_determinism=onto.determinism.note,
        )

    async def _pick(self, s: Session, excluded: set[str]) -> WorkerRecord:
        """The worker for the next attempt: the router for the first, recovery dispatch afterwards."""
        it = s.resuming
        resume = None
        if it is not None:
            context = len(s.job.prompt_ids) + len(s.emitted)
            resume = Resume(s.job.rid, it.worker_id, context, max(0, s.remaining))
        worker, decision = await self.dispatcher.pick(resume, excluded, len(s.emitted))
        if it is not None and decision is not None:
            it.action, it.dispatch_reason = decision.action, decision.reason
        return worker

    async def _adopt(self, s: Session, at: Attempt) -> AsyncIterator[TokenDelta]:
        """Take over the request another gateway left running on `at.worker_id`; yields nothing when
        it cannot (worker gone, request aborted or expired): the caller replays it then."""
        worker = self.monitor.workers.get(at.worker_id)
        usable = (
            worker is not None
            and worker.engine is not EngineKind.SGLANG  # SGLang aborts a request whose client left
            and worker.incarnation == at.epoch
            and worker.state in ALIVE_STATES
        )
        if worker is None or not usable:
            self._resumed(s, "replay", at, "its worker is gone")
            return
        if at.base:
            # the attempt started mid-choice (it had moved before): its worker's output begins at id
            # `base`, and this gateway lacks the ids before it, so the choice is replayed (exact, same
            # seed) instead of adopted
            self._resumed(s, "replay", at, f"its attempt starts at output id {at.base}")
            return
        s.attempts += 1
        s.worker_id, s.incarnation = worker.id, worker.incarnation
        stream = WorkerStream(
            self.http,
            worker.http_url,
            AdoptRequest(rid=at.wrid, epoch=at.epoch),
            first_chunk_timeout_s=self.recovery.first_token_timeout_s,
            stall_timeout_s=self.recovery.stall_timeout_s,
            path="/lumen/adopt",
            keep_alive=True,
        )
        try:
            async for delta in self._stream(
                s, worker, stream, at.wrid, on_open=lambda: self._resumed(s, "adopt", at)
            ):
                yield delta
        except WorkerRefused as exc:  # 404: no longer there; 409: another incarnation
            self._resumed(s, "replay", at, f"adoption refused ({exc.status})")
        except WorkerLost as exc:
            if exc.kind is Loss.CONNECTION:
                self.monitor.report_data_failure(worker.id, worker.incarnation, exc.reason)
            if not s.resumed_by:  # it died before answering: recompute
                self._resumed(s, "replay", at, exc.reason)
            else:
                self._interrupted(s, worker, exc.reason, exc.kind)

    def _resumed(self, s: Session, how: str, at: Attempt, why: str = "") -> None:
        s.resumed_by = how
        self.metrics.stream_resumes.labels(how=how).inc()
        log.info("stream_resumed", rid=s.job.rid, how=how, worker=at.worker_id, wrid=at.wrid, why=why or None)

    async def _attempt(self, s: Session, worker: WorkerRecord) -> AsyncIterator[TokenDelta]:
        sp = s.job.sampling
        wrid = attempt_rid(s.job.rid, s.attempts, len(s.emitted))
        sglang = worker.engine is EngineKind.SGLANG
        holders: list[HolderRef] = []
        # an SGLang server checkpoints only through Lumen's plugin and page store (its agent then
        # reports a KV endpoint); an agentless one is never given holders
        if self.checkpoints is not None and (not sglang or worker.kv_endpoint):
            # books keyed by the rid the pages are filed under (an SGLang server's is sglang_rid),
            # so holders' durable reports and DROPs name the same request
            holders = self.checkpoints.assign(
                s.job.rid,
                sglang_rid(wrid) if sglang else wrid,
                worker,
                len(s.job.prompt_ids) + len(s.emitted),
                s.remaining,
            )
        req = s.next_request(wrid, worker.incarnation, holders, self.recovery.orphan_grace_s)
        # an SGLang server gets SGLang's own body (its contract refuses Lumen's extension)
        levers = self.levers if sglang else None
        rank = levers.queue_priority(s.attempts, len(req.input_ids)) if levers is not None else 0
        priority = rank if levers is not None and worker.priority_order else None
        body: msgspec.Struct = (
            to_sglang(
                req, seed_base=s.seed_base, epoch=worker.incarnation, src_worker=worker.id, priority=priority
            )
            if sglang
            else req
        )
        # an SGLang server the gateway holds to its batch (held.py): a slot first, in queue-rank order
        async with levers.held.slot(worker, rank) if levers is not None else contextlib.nullcontext():
            assist = None
            # assisted output must stay exact, and has no logprobs (a verification gives only the top-1)
            greedy = (sp.temperature <= 0.0 or sp.top_k == 1) and s.job.logprobs is None
            if isinstance(body, SGLangGenerate) and greedy and self.verifier is not None:
                assist = self.verifier.for_target(worker.id)
            stream: WorkerStream | AssistedStream
            if assist is not None and isinstance(body, SGLangGenerate):
                _drafter, plane, estimate = assist
                stream = AssistedStream(
                    self.http,
                    worker.http_url,
                    body,
                    plane,
                    estimate,
                    k_min=self.verifier.k_min if self.verifier else 1,
                    k_max=self.verifier.k_max if self.verifier else 1,
                    timeout_s=self.recovery.stall_timeout_s,
                )
            else:
                stream = WorkerStream(
                    self.http,
                    worker.http_url,
                    body,
                    first_chunk_timeout_s=self._first_chunk_timeout(s),
                    stall_timeout_s=self.recovery.stall_timeout_s,
                    keep_alive=not sglang,  # uvicorn drops idle connections after 5 s, before the pool
                )
            try:
                async for delta in self._stream(s, worker, stream, wrid):
                    yield delta
            finally:
                if assist is not None and isinstance(stream, AssistedStream) and self.verifier is not None:
                    self.verifier.record(assist[0], worker.id, stream)
                    self.metrics.gateway_drafts.labels(target=worker.id, outcome="proposed").inc(
                        stream.drafted
                    )
                    self.metrics.gateway_drafts.labels(target=worker.id, outcome="accepted").inc(
                        stream.accepted
                    )
                    if stream.refused is not None:
                        self.metrics.draft_refusals.labels(target=worker.id).inc()
                if s.finish_reason is None:
                    # given up here (client gone, stop string, moved elsewhere): a dropped connection does
                    # not end it on the worker (orphan grace; some SGLang deployments), its rid does
                    self._abort_on(worker, body.rid if isinstance(body, SGLangGenerate) else wrid)

    async def _stream(
        self,
        s: Session,
        worker: WorkerRecord,
        stream: WorkerStream | AssistedStream,
        wrid: str,
        on_open: Callable[[], None] | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """One attempt's chunks as deltas, with the worker watched (its failure interrupts the stream)."""
        sub = self.monitor.watch(
            worker.id, worker.incarnation, lambda why: stream.interrupt(why, worker.loss or Loss.FENCED)
        )
        if sub is None:
            raise WorkerLost(f"worker {worker.id} incarnation {worker.incarnation} is gone", Loss.GONE)
        worker.inflight += 1
        prev_chunk_at: float | None = None
        source = Attempt(worker.id, wrid, worker.incarnation)
        try:
            async with stream:
                if on_open is not None:
                    on_open()
                while (chunk := await stream.next_chunk()) is not None:
                    ids = chunk.output_ids
                    fin = chunk.meta_info.finish_reason
                    if not ids and fin is None:
                        continue
                    if fin is not None and fin.type == "abort":  # its ids were not sent: not emitted
                        raise WorkerLost(
                            f"worker aborted the request: {fin.message or ''}",
                            Loss.RESET if fin.message == INCARNATION_RESET_ABORT else Loss.ABORTED,
                        )
                    lps = s.chunk_logprobs(chunk, worker.id)
                    if ids:
                        now = self.clock()
                        self._tokens_arrived(s, worker, len(ids), chunk, now)
                        if prev_chunk_at is not None and self.monitor.measure_tokens:  # gray failures
                            self.monitor.observe_tokens(
                                worker.id, worker.incarnation, len(ids), now - prev_chunk_at
                            )
                        prev_chunk_at = now
                        s.emitted.extend(ids)
                    finish = None if fin is None else fin.type
                    s.finish_reason = finish
                    yield TokenDelta(
                        tuple(ids),
                        finish_reason=finish,
                        matched_stop=fin.matched
                        if fin is not None and isinstance(fin.matched, int)
                        else None,
                        cached_tokens=chunk.meta_info.cached_tokens,
                        logprobs=lps,
                        attempt=source,
                    )
                    if finish is not None:
                        return
        finally:
            worker.inflight -= 1
            self.monitor.unwatch(worker.id, sub)

    # -- a session's metrics (its bookkeeping is its own: session_records.py) -------------------------
    def _tokens_arrived(
        self, s: Session, worker: WorkerRecord, n: int, chunk: GenerateChunk, now: float
    ) -> None:
        """`n` tokens of `chunk` reached the session at `now` from `worker`: TTFT, a resume's delay and
        what it restored, the output count; the checkpoints a restore has read are dropped."""
        got = s.tokens_arrived(worker.engine, worker.id, chunk, now)
        if got.first:
            self.metrics.ttft.observe(now - s.arrived)
        it = got.resumed
        if it is not None:
            if self.checkpoints is not None:
                self.checkpoints.drop_retired(s.job.rid)  # the restore, if any, has read them
            if it.restored_tokens:
                self.metrics.restored_tokens.inc(it.restored_tokens)
            self.metrics.resume_delay.observe(it.resume_delay or 0.0)
            self.metrics.resumes.labels(kind="restore" if it.restored_tokens else "replay").inc()
        self.metrics.output_tokens.inc(n)

    def _interrupted(self, s: Session, worker: WorkerRecord, reason: str, kind: Loss | None) -> None:
        """The session's attempt on `worker` broke (it resumes elsewhere)."""
        s.interrupted(worker.id, worker.incarnation, reason, kind, self.clock())
        self.metrics.interrupted.labels(mode=self.recovery.mode).inc()
        log.info(
            "request_interrupted",
            rid=s.job.rid,
            worker=worker.id,
            incarnation=worker.incarnation,
            emitted=len(s.emitted),
            attempt=s.attempts,
            reason=reason,
            kind=kind.value if kind is not None else "refused",
        )

    def _first_chunk_timeout(self, s: Session) -> float:
        """How long an attempt may wait for its first chunk: `first_token_timeout_s` while the client
        has no token yet; once its stream has started (a resumed attempt), the stall bound between
        two of its chunks, `stall_timeout_s` (a resumed attempt used to wait the first-token bound)."""
        r = self.recovery
        return r.stall_timeout_s if s.emitted else r.first_token_timeout_s

    def _abort_on(self, worker: WorkerRecord, rid: str) -> None:
        """Ask a worker to drop `rid` (the client left, or the request moved elsewhere)."""
        if worker.state in ALIVE_STATES:  # a dead worker needs no abort
            self._aborts.post(worker.http_url, rid)
