"""Fault injection for a gateway that a local cluster supervisor started (`lumen cluster up`): the
gateway signals the worker process itself, by the pid its Hello reported (same host); the supervisor
sees the process exit or stop and restarts it as usual. `/admin/workers/{id}/kill` calls `kill`."""

from __future__ import annotations

import contextlib
import os
import time

import structlog

from gateway.protocol.faults import FAULT_SIGNALS
from gateway.server.api.errors import NotFound
from gateway.server.workers.monitor import LoadMonitor

log = structlog.get_logger("lumen.faults")

LOCAL_FAULTS_ENV = "LUMEN_LOCAL_FAULTS"  # set by the supervisor on the gateways it starts


class SignalFaults:
    def __init__(self, monitor: LoadMonitor) -> None:
        self.monitor = monitor

    async def kill(self, worker_id: str, mode: str) -> dict[str, object]:
        rec = self.monitor.workers.get(worker_id)
        if rec is None or not rec.pid:
            known = ", ".join(sorted(self.monitor.workers))
            raise NotFound(f"no local worker {worker_id!r} has attached; known: {known}")
        with contextlib.suppress(ProcessLookupError):
            os.kill(rec.pid, FAULT_SIGNALS[mode])
        log.warning("fault_injected", worker=worker_id, pid=rec.pid, mode=mode)
        return {"worker": worker_id, "pid": rec.pid, "mode": mode, "t": time.time()}
