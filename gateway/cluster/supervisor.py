"""A local cluster: the gateway plus N worker processes on loopback, supervised.

`lumen cluster up` runs this in the foreground: a killed worker is started again as a new
incarnation, which models its model-load time itself (phase LOADING_FULL) before it serves.
Workers bind port 0 and report their URL in Hello, so several clusters can run side by side.

A worker whose process is alive but silent (hung: SIGSTOPped, `--mode hang`, a deadlock) is failed by
the gateway's detector, but never exits, so nothing would restart it. Following the gateways (`follow`
for a gateway in this process, its monitor's events; `follow_gateways` for gateway processes, their
admin API), the supervisor kills (SIGKILL) a worker the detector failed by silence that is still
FAILED `hung_restart_grace_s` later, with no newer incarnation attached and no gateway hearing from
it, while the same process still runs; the usual restart follows. A worker wrongly failed (alive,
only late) re-attaches as a new incarnation well within the grace and is left alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import structlog

from gateway.cluster.procs import stop_processes
from gateway.config import Config, draft_for, recovery_policy
from gateway.core.costmodel import ReloadSource
from gateway.core.detector import SILENCE_REASON
from gateway.core.health import WorkerState
from gateway.protocol.faults import FAULT_SIGNALS
from gateway.protocol.launch import EngineSpec, worker_env
from gateway.server.api.errors import NotFound
from gateway.server.local_faults import LaunchRegistry
from gateway.server.recovery.coordinator import RecoveryCoordinator
from gateway.server.workers.monitor import LoadMonitor, StateEvent

log = structlog.get_logger("lumen.cluster")


@dataclass(slots=True)
class WorkerProcess:
    spec: EngineSpec
    log_path: Path
    proc: asyncio.subprocess.Process | None = None
    starts: int = 0
    hung: bool = False
    supervisor: asyncio.Task[None] | None = None
    exits: list[tuple[float, int]] = field(default_factory=list)
    hung_restarts: int = 0  # times it was killed for staying FAILED by silence past the grace


def synthetic_token_range(tokenizer_kind: str, vocab_size: int) -> tuple[int, int, int]:
    """(vocab, lo, hi): synthetic workers emit ids in [lo, hi). Printable ASCII for the byte tokenizer,
    so demo output is readable text."""
    if tokenizer_kind == "byte":
        return vocab_size, 32, 127
    return vocab_size, 0, vocab_size


def worker_specs(config: Config, control_address: str, token_range: tuple[int, int, int]) -> list[EngineSpec]:
    vocab, lo, hi = token_range
    e, m, cl = config.engine, config.model, config.cluster
    return [
        EngineSpec(
            worker_id=f"w{i}",
            control_address=control_address,
            control_token=config.gateway.control_token,
            # a local worker trusts the gateway's own certificate (self-signed or not)
            control_tls_ca=config.gateway.control_tls_cert,
            fault_injection=cl.fault_injection,
            backend=e.backend,
            model=m.preset,
            gpu=m.gpu,
            tp=m.tp,
            time_scale=e.time_scale,
            page_size=e.page_size,
            max_running_requests=e.max_running_requests,
            chunked_prefill_size=e.chunked_prefill_size,
            kv_capacity_tokens=e.kv_capacity_tokens,
            vocab_size=vocab,
            token_lo=lo,
            token_hi=hi,
            model_seed=e.model_seed,
            model_load_s=None if e.model_load_s < 0 else e.model_load_s,
            reload_from_peer=e.reload == ReloadSource.PEER,
            peer_load_s=None if e.peer_load_s < 0 else e.peer_load_s,
            heartbeat_interval_ms=config.health.heartbeat_interval_ms,
            failure_domain=f"d{i % cl.failure_domains}",
            ckpt_budget_bytes=config.checkpoint.budget_bytes,
            ckpt_eviction=config.checkpoint.eviction,
            ckpt_orphan_ttl_s=config.checkpoint.orphan_ttl_s,
            ckpt_payload_scale=config.checkpoint.payload_scale,
            ckpt_frame_bytes=config.checkpoint.frame_bytes,
            ckpt_max_lag_bytes=config.checkpoint.max_lag_bytes,
            draft_model=(draft_for(config.draft.pairs, m.preset) or "")
            if recovery_policy(config).draft_assist
            else "",
            draft_load_s=None if e.draft_load_s < 0 else e.draft_load_s,
            draft_agreement=config.draft.agreement,
            draft_k_min=config.draft.k_min,
            draft_k_max=config.draft.k_max,
            draft_timeout_ms=config.draft.draft_timeout_ms,
            torch_model=config.torch.model,
            torch_draft=config.torch.draft,
            torch_dtype=config.torch.dtype,
            torch_device=config.torch.device,
            torch_threads=config.torch.threads,
            log_level=config.gateway.log_level,
        )
        for i in range(cl.workers)
    ]


class LocalCluster:
    """Starts, supervises, kills and stops worker processes. Implements app.FaultInjector."""

    def __init__(
        self,
        specs: list[EngineSpec],
        *,
        log_dir: Path,
        restart_killed: bool = True,
        hung_restart_grace_s: float = 0.0,
        launched: LaunchRegistry | None = None,
    ) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        # what this supervisor launched, for gateways in other processes to check a pid against
        self.launched = launched
        self.restart_killed = restart_killed
        self.hung_restart_grace_s = hung_restart_grace_s  # 0: hung workers are left alone
        self.workers = {s.worker_id: WorkerProcess(s, log_dir / f"{s.worker_id}.log") for s in specs}
        self._stopping = False
        self._monitor: LoadMonitor | None = None
        self._hung_checks: set[asyncio.TimerHandle] = set()

    def follow(self, coordinator: RecoveryCoordinator) -> None:
        """Watch the verdicts of a gateway in this process: restart workers that stay FAILED by silence
        (module doc). Its recovery coordinator tells each failure, as its last step."""
        self._monitor = coordinator.monitor
        coordinator.supervisor = self.worker_failed

    async def start(self) -> None:
        for wp in self.workers.values():
            await self._spawn(wp, restart=False)
            wp.supervisor = asyncio.create_task(self._supervise(wp), name=f"supervise-{wp.spec.worker_id}")

    async def stop(self, grace_s: float = 5.0) -> None:
        self._stopping = True
        for handle in self._hung_checks:
            handle.cancel()
        self._hung_checks.clear()
        for wp in self.workers.values():
            if wp.supervisor is not None:
                wp.supervisor.cancel()
        for wp in self.workers.values():
            if wp.supervisor is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await wp.supervisor
        await stop_processes([wp.proc for wp in self.workers.values() if wp.proc is not None], grace_s)

    async def kill(self, worker_id: str, mode: str) -> dict[str, object]:
        wp = self.workers.get(worker_id)
        if wp is None or wp.proc is None:
            raise NotFound(f"no local worker {worker_id!r}; known: {', '.join(sorted(self.workers))}")
        sig = FAULT_SIGNALS[mode]
        pid = wp.proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        wp.hung = mode == "hang"
        log.warning("fault_injected", worker=worker_id, pid=pid, mode=mode)
        return {"worker": worker_id, "pid": pid, "mode": mode, "t": time.time()}

    # -- hung workers ----------------------------------------------------------------------------
    def worker_failed(self, ev: StateEvent) -> None:
        grace = self.hung_restart_grace_s
        if ev.dst is not WorkerState.FAILED or grace <= 0 or not self.restart_killed or self._stopping:
            return
        if ev.worker_id not in self.workers:
            return
        loop = asyncio.get_running_loop()
        handle: asyncio.TimerHandle | None = None

        def check() -> None:
            if handle is not None:
                self._hung_checks.discard(handle)
            self._restart_if_hung(ev.worker_id, ev.incarnation)

        handle = loop.call_later(grace, check)
        self._hung_checks.add(handle)

    def _restart_if_hung(self, worker_id: str, incarnation: int) -> None:
        mon, wp = self._monitor, self.workers[worker_id]
        rec = mon.workers.get(worker_id) if mon is not None else None
        if self._stopping or rec is None or rec.incarnation != incarnation:
            return  # a newer incarnation attached (a live worker wrongly failed resets and comes back)
        if rec.state is not WorkerState.FAILED or not rec.failed_by_silence:
            return  # a broken stream: the process exited and is restarted already
        proc = wp.proc
        if proc is None or proc.returncode is not None or (rec.pid and rec.pid != proc.pid):
            return  # that process is gone; its successor is ours to keep
        self._kill_hung(wp, proc, incarnation)

    def _kill_hung(self, wp: WorkerProcess, proc: asyncio.subprocess.Process, incarnation: int) -> None:
        wp.hung_restarts += 1
        log.warning(
            "hung_worker_killed",
            worker=wp.spec.worker_id,
            pid=proc.pid,
            incarnation=incarnation,
            failed_for_s=self.hung_restart_grace_s,
        )
        with contextlib.suppress(ProcessLookupError):
            proc.kill()  # SIGKILL works on a stopped process too; _supervise restarts it

    async def follow_gateways(
        self, urls: list[str], stop: asyncio.Event, *, admin_key: str | None = None, poll_s: float = 0.5
    ) -> None:
        """`follow` for gateways in other processes: poll each one's /admin/workers every `poll_s`.
        A worker is hung when every gateway with a record of its running process (by pid) has it
        FAILED, for the same incarnation, through the whole grace, and a gateway's FAILED event for
        that incarnation says silence (`SILENCE_REASON`), not a broken stream. A gateway that cannot be
        asked (restarting) stops the verdict for that round. `admin_key`: the admin bearer (default:
        the first of LUMEN_ADMIN_API_KEYS, if set)."""
        grace = self.hung_restart_grace_s
        if grace <= 0 or not self.restart_killed:
            return
        if admin_key is None:
            admin_key = os.environ.get("LUMEN_ADMIN_API_KEYS", "").split(",")[0].strip()
        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        period = min(poll_s, grace / 4)
        since: dict[tuple[str, int, int], float] = {}  # (worker, pid, incarnation) -> FAILED since
        timeout = aiohttp.ClientTimeout(total=max(1.0, period * 4))
        async with aiohttp.ClientSession(headers=headers, timeout=timeout) as http:
            while not stop.is_set():
                views = await asyncio.gather(*(_admin_get(http, u + "/admin/workers") for u in urls))
                now = time.monotonic()
                seen: set[tuple[str, int, int]] = set()
                for wid, wp in self.workers.items():
                    proc = wp.proc
                    if proc is None or proc.returncode is not None or any(v is None for v in views):
                        continue
                    recs = [
                        w for v in views for w in v or () if w.get("id") == wid and w.get("pid") == proc.pid
                    ]
                    if not recs or any(w.get("state") != "FAILED" for w in recs):
                        continue
                    key = (wid, proc.pid, max(int(w.get("incarnation", 0)) for w in recs))
                    seen.add(key)
                    if now - since.setdefault(key, now) < grace:
                        continue
                    if await _failed_by_silence(http, urls, wid, key[2]):
                        self._kill_hung(wp, proc, key[2])
                        del since[key]
                for key in set(since) - seen:
                    del since[key]
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), period)

    def worker_argv(self, spec: EngineSpec) -> list[str]:
        """The command a worker runs (loadtests/chaos prefixes it to start it in a network namespace)."""
        return [sys.executable, "-m", "worker_hooks.engine"]

    # -- internals -------------------------------------------------------------------------------
    async def _spawn(self, wp: WorkerProcess, *, restart: bool) -> None:
        spec = wp.spec if not restart else _with_restart(wp.spec)
        # the spec (with the control token) travels in the environment, not on the command line, and
        # the worker does not inherit the gateway's client and admin keys
        env = worker_env(dict(os.environ), spec, LUMEN_PARENT_PID=str(os.getpid()), PYTHONUNBUFFERED="1")
        with wp.log_path.open("ab") as logf:
            wp.proc = await asyncio.create_subprocess_exec(
                *self.worker_argv(spec),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=logf,
                stderr=logf,
                env=env,
            )
        wp.starts += 1
        wp.hung = False
        if self.launched is not None:
            self.launched.add(spec.worker_id, wp.proc.pid)
        log.info(
            "worker_started", worker=spec.worker_id, pid=wp.proc.pid, restart=restart, log=str(wp.log_path)
        )

    async def _supervise(self, wp: WorkerProcess) -> None:
        while wp.proc is not None:
            rc = await wp.proc.wait()
            wp.exits.append((time.time(), rc))
            if self._stopping:
                return
            log.warning("worker_exited", worker=wp.spec.worker_id, returncode=rc, restart=self.restart_killed)
            if not self.restart_killed:
                return
            await asyncio.sleep(0.05)  # do not spin if it dies at once
            await self._spawn(wp, restart=True)


async def _admin_get(http: aiohttp.ClientSession, url: str) -> list[dict[str, Any]] | None:
    try:
        async with http.get(url) as resp:
            if resp.status != 200:
                return None
            body = await resp.json()
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
    return body if isinstance(body, list) else None


async def _failed_by_silence(
    http: aiohttp.ClientSession, urls: list[str], worker: str, incarnation: int
) -> bool:
    """Whether some gateway failed this incarnation by silence (its FAILED event's reason)."""
    for url in urls:
        for e in await _admin_get(http, url + "/admin/events") or ():
            if (
                e.get("worker") == worker
                and e.get("incarnation") == incarnation
                and e.get("to") == "FAILED"
                and str(e.get("reason", "")).startswith(SILENCE_REASON)
            ):
                return True
    return False


def _with_restart(spec: EngineSpec) -> EngineSpec:
    return msgspec.structs.replace(spec, restart=True)
