"""Fault injection for a gateway that a local cluster supervisor started (`lumen cluster up`): the
gateway signals the worker process itself, by the pid its Hello reported (same host); the supervisor
sees the process exit or stop and restarts it as usual. `/admin/workers/{id}/kill` calls `kill`. An
SGLang worker's Hello reports its server's pid (not its agent's), so the server is what a fault hits
and its agent restarts it; only the modes an SGLang server understands apply to it."""

from __future__ import annotations

import contextlib
import os
import time

import structlog

from gateway.protocol.faults import FAULT_SIGNALS, SERVER_SIGNAL_MODES
from gateway.protocol.generate import EngineKind
from gateway.server.api.errors import InvalidRequest, NotFound
from gateway.server.workers.monitor import LoadMonitor

log = structlog.get_logger("lumen.faults")

LOCAL_FAULTS_ENV = "LUMEN_LOCAL_FAULTS"  # set by the supervisor on the gateways it starts


class SignalFaults:
    def __init__(self, monitor: LoadMonitor) -> None:
        self.monitor = monitor

    async def kill(self, worker_id: str, mode: str) -> dict[str, object]:
        rec = self.monitor.workers.get(worker_id)
        if rec is not None and rec.engine is not EngineKind.LUMEN and mode not in SERVER_SIGNAL_MODES:
            raise InvalidRequest(
                f"mode {mode!r} does not apply to an SGLang server; use one of {', '.join(SERVER_SIGNAL_MODES)}",
                param="mode",
            )
        if rec is None or not rec.pid:
            known = ", ".join(sorted(self.monitor.workers))
            state = (
                "" if rec is None else f" (worker {worker_id!r} reports no process id now: {rec.state.value})"
            )
            raise NotFound(f"no local worker {worker_id!r} has attached{state}; known: {known}")
        with contextlib.suppress(ProcessLookupError):
            os.kill(rec.pid, FAULT_SIGNALS[mode])
        log.warning("fault_injected", worker=worker_id, pid=rec.pid, mode=mode)
        return {"worker": worker_id, "pid": rec.pid, "mode": mode, "t": time.time()}
