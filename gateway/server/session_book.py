"""A session's bookkeeping as its tokens arrive and its workers fail: the timestamps, the open
interruption's resume, and the gateway's metrics of both (TTFT, restores and replays, resume delay,
interruptions). The failover loop (sessions.py) calls these; they decide nothing."""

from __future__ import annotations

import structlog

from gateway.protocol.generate import GenerateChunk
from gateway.server.checkpoints import CheckpointManager
from gateway.server.metrics import GatewayMetrics
from gateway.server.session_records import Interruption, Session, restored_tokens
from gateway.server.workers.monitor import WorkerRecord

log = structlog.get_logger("lumen.sessions")


def note_tokens(
    s: Session,
    worker: WorkerRecord,
    n: int,
    chunk: GenerateChunk,
    now: float,
    metrics: GatewayMetrics,
    checkpoints: CheckpointManager | None,
) -> None:
    """`n` tokens of `chunk` reached the session at `now` from `worker`."""
    if s.first_token_at is None:
        s.first_token_at = now
        metrics.ttft.observe(now - s.arrived)
    if s.interruptions and s.interruptions[-1].resumed_at is None:
        restored = restored_tokens(s, worker.engine, chunk)
        it = s.interruptions[-1]
        it.resumed_at = now
        it.resumed_on = worker.id
        it.restored_tokens = restored
        if checkpoints is not None:
            checkpoints.drop_retired(s.job.rid)  # the restore, if any, has read them
        if restored:
            metrics.restored_tokens.inc(restored)
        metrics.resume_delay.observe(it.resume_delay or 0.0)
        metrics.resumes.labels(kind="restore" if restored else "replay").inc()
    s.last_token_at = now
    metrics.output_tokens.inc(n)


def note_interruption(
    s: Session, worker: WorkerRecord, reason: str, now: float, metrics: GatewayMetrics, mode: str
) -> None:
    """The session's attempt on `worker` broke at `now` (it resumes elsewhere)."""
    s.interruptions.append(
        Interruption(worker.id, worker.incarnation, reason, now, len(s.emitted), s.last_token_at or s.arrived)
    )
    metrics.interrupted.labels(mode=mode).inc()
    log.info(
        "request_interrupted",
        rid=s.job.rid,
        worker=worker.id,
        incarnation=worker.incarnation,
        emitted=len(s.emitted),
        attempt=s.attempts,
        reason=reason,
    )
