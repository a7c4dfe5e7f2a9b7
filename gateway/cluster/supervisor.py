"""A local cluster: the gateway plus N worker processes on loopback, supervised.

`lumen cluster up` runs this in the foreground: a killed worker is started again as a new
incarnation, which models its model-load time itself (phase LOADING_FULL) before it serves.
Workers bind port 0 and report their URL in Hello, so several clusters can run side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import structlog

from gateway.cluster.procs import stop_processes
from gateway.config import Config, draft_for, recovery_policy
from gateway.protocol.launch import EngineSpec, worker_env
from gateway.server.api.errors import NotFound

log = structlog.get_logger("lumen.cluster")


# each of gateway.protocol.faults.SIGNAL_MODES as the signal that carries it (tests check they agree)
FAULT_SIGNALS = {
    "kill": signal.SIGKILL,
    "hang": signal.SIGSTOP,
    "resume": signal.SIGCONT,
    "stall": signal.SIGUSR1,
    "unstall": signal.SIGUSR2,
    "term": signal.SIGTERM,
}


@dataclass(slots=True)
class WorkerProcess:
    spec: EngineSpec
    log_path: Path
    proc: asyncio.subprocess.Process | None = None
    starts: int = 0
    hung: bool = False
    supervisor: asyncio.Task[None] | None = None
    exits: list[tuple[float, int]] = field(default_factory=list)


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

    def __init__(self, specs: list[EngineSpec], *, log_dir: Path, restart_killed: bool = True) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        self.restart_killed = restart_killed
        self.workers = {s.worker_id: WorkerProcess(s, log_dir / f"{s.worker_id}.log") for s in specs}
        self._stopping = False

    async def start(self) -> None:
        for wp in self.workers.values():
            await self._spawn(wp, restart=False)
            wp.supervisor = asyncio.create_task(self._supervise(wp), name=f"supervise-{wp.spec.worker_id}")

    async def stop(self, grace_s: float = 5.0) -> None:
        self._stopping = True
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

    # -- internals -------------------------------------------------------------------------------
    async def _spawn(self, wp: WorkerProcess, *, restart: bool) -> None:
        spec = wp.spec if not restart else _with_restart(wp.spec)
        # the spec (with the control token) travels in the environment, not on the command line, and
        # the worker does not inherit the gateway's client and admin keys
        env = worker_env(dict(os.environ), spec, LUMEN_PARENT_PID=str(os.getpid()), PYTHONUNBUFFERED="1")
        with wp.log_path.open("ab") as logf:
            wp.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "worker_hooks.engine",
                stdin=asyncio.subprocess.DEVNULL,
                stdout=logf,
                stderr=logf,
                env=env,
            )
        wp.starts += 1
        wp.hung = False
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


def _with_restart(spec: EngineSpec) -> EngineSpec:
    return msgspec.structs.replace(spec, restart=True)
