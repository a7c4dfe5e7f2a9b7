"""The expiry of the load monitor's ended records, and the fences they leave behind (tombstones).

FAILED and REMOVED records are dropped `retention_s` after they ended (a worker that never came back,
a refused impostor's failed attach), so the monitor does not keep every worker it ever saw. Each
leaves its last incarnation behind, so that incarnation stays fenced (a zombie of it is refused) and a
removed worker stays removed; the oldest are forgotten past TOMBSTONES_MAX. The fences of the durable
ledger (fences.py: what an earlier run of this gateway fenced) start as tombstones.
"""

from __future__ import annotations

from collections import OrderedDict

import structlog

from gateway.core.health import WorkerState
from gateway.server.workers.fences import FenceLedger
from gateway.server.workers.records import AttachRefused, WorkerRecord

log = structlog.get_logger("lumen.monitor")

# expired records whose last incarnation is remembered (fencing), oldest forgotten first
TOMBSTONES_MAX = 4096
EXPIRY_SWEEP_S = 1.0


class RecordExpiry:
    def __init__(self, retention_s: float, fences: FenceLedger | None) -> None:
        # FAILED and REMOVED records are dropped this long after; their last incarnation is kept
        self.retention_s = retention_s
        self._tombstones: OrderedDict[str, tuple[int, bool]] = OrderedDict()
        if fences is not None:
            for worker, incarnation in fences.fences.items():
                self._tombstones[worker] = (incarnation, False)
        self._last_sweep: float | None = None

    def check_attach(self, worker_id: str, incarnation: int) -> bool:
        """For a worker the monitor has no record of: refuse `incarnation` (AttachRefused) if an
        expired record fences it (the worker was removed, or it is not newer than the last one).
        True when there was such a record (the worker is restarting, not joining)."""
        gone = self._tombstones.get(worker_id)
        if gone is None:
            return False
        last, removed = gone
        if removed:
            raise AttachRefused(f"worker {worker_id} was removed")
        if incarnation <= last:
            raise AttachRefused(f"incarnation {incarnation} is not newer than {last} for worker {worker_id}")
        return True

    def forget(self, worker_id: str) -> None:
        """A new incarnation of the worker attached: its record fences the old ones now."""
        self._tombstones.pop(worker_id, None)

    def expire(self, workers: dict[str, WorkerRecord], now: float) -> bool:
        """Drop from `workers` the FAILED and REMOVED records that ended `retention_s` ago or more,
        keeping their last incarnation for fencing (at most once per EXPIRY_SWEEP_S). True when any
        was dropped."""
        if self._last_sweep is not None and now - self._last_sweep < EXPIRY_SWEEP_S:
            return False
        self._last_sweep = now
        gone = [
            rec
            for rec in workers.values()
            if rec.state in (WorkerState.FAILED, WorkerState.REMOVED)
            and rec.ended_at is not None
            and now - rec.ended_at >= self.retention_s
        ]
        for rec in gone:
            del workers[rec.id]
            self._tombstones[rec.id] = (rec.incarnation, rec.state is WorkerState.REMOVED)
            self._tombstones.move_to_end(rec.id)
            log.info(
                "worker_record_expired", worker=rec.id, incarnation=rec.incarnation, state=rec.state.value
            )
        while len(self._tombstones) > TOMBSTONES_MAX:
            self._tombstones.popitem(last=False)
        return bool(gone)
