"""Fault injection for a gateway that a local cluster supervisor started (`lumen cluster up`): the
gateway signals a worker's process itself (same host); the supervisor sees the process exit or stop
and restarts it as usual. `/admin/workers/{id}/kill` calls `kill`. An SGLang worker's Hello reports
its server's pid (not its agent's), so the server is what a fault hits and its agent restarts it; only
the modes an SGLang server understands apply to it.

Signal only what the supervisor started (issue 29). A pid is only a worker's claim: a worker holding
the control token could report any process's pid and have the gateway kill it. So the supervisor
keeps a registry of what it launched, `{worker_id: [[pid, start time], ...]}` (start time: field 22 of
/proc/<pid>/stat, clock ticks since boot, so a reused pid never matches), in a 0600 file of the
per-user runtime directory whose path it gives its gateways in LUMEN_LOCAL_FAULTS. Before a signal the
gateway opens a pidfd for the reported pid (from then on the pid cannot name another process), checks
that the process is, or descends from (an SGLang agent's server), one the registry lists for that very
worker, with the same start time, and signals through the pidfd. Anything else is refused (403).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import structlog

from gateway.protocol.faults import FAULT_SIGNALS, SERVER_SIGNAL_MODES
from gateway.protocol.generate import EngineKind
from gateway.protocol.secrets import SecretError, private_runtime_dir, read_token_file, write_token_file
from gateway.server.api.errors import Forbidden, InvalidRequest, NotFound
from gateway.server.workers.monitor import LoadMonitor

log = structlog.get_logger("lumen.faults")

# set by the supervisor on the gateways it starts, only with cluster.fault_injection: the registry's path
LOCAL_FAULTS_ENV = "LUMEN_LOCAL_FAULTS"
# how many parents up from a reported pid a launched process may be (agent -> launcher shim -> server)
MAX_DESCENT = 4


# -- processes as /proc shows them ------------------------------------------------------------------
def proc_stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks since boot) of `pid`, or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: the fields after its last ')'
    fields = raw[raw.rindex(b")") + 2 :].split()
    return int(fields[1]), int(fields[19])  # fields 4 (ppid) and 22 (starttime)


def start_time(pid: int) -> int | None:
    st = proc_stat(pid)
    return None if st is None else st[1]


def descends_from(pid: int, ancestors: set[tuple[int, int]], depth: int = MAX_DESCENT) -> bool:
    """Whether `pid` or one of its `depth` nearest ancestors is one of `ancestors` ((pid, start time))."""
    for _ in range(depth + 1):
        st = proc_stat(pid)
        if st is None:
            return False
        if (pid, st[1]) in ancestors:
            return True
        pid = st[0]
        if pid <= 1:
            return False
    return False


def signal_launched(pid: int, launched: set[tuple[int, int]], sig: int) -> bool:
    """Send `sig` to `pid` if it is, or descends from, a process of `launched` ((pid, start time));
    through a pidfd opened first, so the pid checked is the process signalled. False: refused; a
    process already gone counts as signalled (True)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        if not descends_from(pid, launched):
            return False
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, sig)
        return True
    finally:
        os.close(pidfd)


# -- the supervisor's registry ----------------------------------------------------------------------
class LaunchRegistry:
    """What a supervisor launched, per worker id, kept in a file its gateways read (module doc)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.launched: dict[str, list[tuple[int, int]]] = {}

    @classmethod
    def create(cls) -> LaunchRegistry:
        """A registry in the per-user runtime directory, named by this process's pid."""
        return cls(private_runtime_dir() / f"launched-{os.getpid()}.json")

    def add(self, worker_id: str, pid: int) -> None:
        """Record a process just launched for `worker_id` (the last few per worker are kept)."""
        t = start_time(pid)
        if t is None:
            return  # already gone: nothing to signal
        entries = [e for e in self.launched.get(worker_id, []) if start_time(e[0]) == e[1]][-3:]
        self.launched[worker_id] = [*entries, (pid, t)]
        write_token_file(self.path, json.dumps(self.launched))

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def read_registry(path: Path) -> dict[str, set[tuple[int, int]]]:
    """A registry file (this user's own, 0600: read_token_file's checks); {} when unreadable."""
    try:
        raw = json.loads(read_token_file(path, "launch registry"))
    except (SecretError, ValueError) as exc:
        log.warning("launch_registry_unreadable", file=str(path), error=str(exc)[:300])
        return {}
    if not isinstance(raw, dict):
        return {}
    out: dict[str, set[tuple[int, int]]] = {}
    for wid, entries in raw.items():
        with contextlib.suppress(TypeError, ValueError):
            out[str(wid)] = {(int(p), int(t)) for p, t in entries}
    return out


class SignalFaults:
    def __init__(self, monitor: LoadMonitor, registry: Path | None = None) -> None:
        self.monitor = monitor
        if registry is None:
            value = os.environ.get(LOCAL_FAULTS_ENV, "")
            registry = Path(value) if value.startswith("/") else None
        self.registry = registry

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
        pid = rec.pid
        launched = read_registry(self.registry).get(worker_id, set()) if self.registry else set()
        if not signal_launched(pid, launched, FAULT_SIGNALS[mode]):
            log.warning("fault_refused", worker=worker_id, pid=pid, mode=mode, why="not launched by us")
            raise Forbidden(
                f"worker {worker_id!r} reports pid {pid}, which is not a process this cluster's "
                "supervisor started for it; nothing was signalled"
            )
        log.warning("fault_injected", worker=worker_id, pid=pid, mode=mode)
        return {"worker": worker_id, "pid": pid, "mode": mode, "t": time.time()}
