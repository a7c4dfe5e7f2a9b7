"""`lumen cluster up` with Lumen's workers: a supervisor process that serves nothing itself.

It starts N gateway processes (`lumen gateway`, HTTP on P … P+N−1, or all on P with SO_REUSEPORT)
and the workers, each worker attached to every gateway; it restarts any of them that exits. A gateway
killed -9 is started again on the same ports while the workers keep serving the other gateways and
keep its orphaned requests for adoption (recovery.orphan_grace_s), so its clients resume their
streams anywhere with Last-Event-ID. All gateways share one control token (the configured one, else
one generated here), handed to children in their environment, never argv.

Gateways get their configuration as the supervisor's own command line had it (`--config`, `--set`),
plus their ports; they inject faults by signalling the worker pids their Hellos reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import structlog

from gateway.cluster.procs import stop_processes
from gateway.config import Config
from gateway.protocol.secrets import ADMIN_KEYS_ENV, TOKEN_ENV
from gateway.server.control_secret import publish_admin_key
from gateway.server.local_faults import LOCAL_FAULTS_ENV
from gateway.server.runner import ORPHAN_FILES_ENV

log = structlog.get_logger("lumen.fleet")

GATEWAY_READY_TIMEOUT_S = 60.0
RESTART_PAUSE_S = 0.2  # between a child's exit and its restart: no spinning on one that dies at once


_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent(parent: int) -> Callable[[], None] | None:
    """A `preexec_fn` that makes the child get SIGTERM when this supervisor dies, however it dies
    (PR_SET_PDEATHSIG; the gateway then stops as on any SIGTERM), and exit at once if the supervisor
    is already gone. None off Linux."""
    libc = _LIBC
    if libc is None:
        return None

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(slots=True)
class GatewayProcess:
    index: int
    http_port: int
    control_port: int
    log_path: Path
    proc: asyncio.subprocess.Process | None = None
    ready: dict[str, Any] = field(default_factory=dict)
    starts: int = 0
    supervisor: asyncio.Task[None] | None = None
    up: asyncio.Event = field(default_factory=asyncio.Event)


class GatewayFleet:
    """The N gateway processes of a local cluster."""

    def __init__(
        self,
        config: Config,
        config_args: list[str],
        *,
        gateways: int,
        port: int,
        shared_port: bool,
        log_dir: Path,
        admin_key: str = "",
        launched: Path | None = None,
    ) -> None:
        self.config = config
        # a generated admin key (the gateways get it in their environment and the owner's tools from
        # the 0600 file `admin-key-<port>`, published once a gateway says its port); "": configured
        self.admin_key = admin_key
        self.admin_key_files: set[Path] = set()
        # the registry of launched workers the gateways check a pid against (None: no signal faults)
        self.launched = launched
        # the files this supervisor publishes (its first gateway removes them if the supervisor dies)
        self.files: Callable[[], list[Path]] | None = None
        self.config_args = config_args
        self.shared_port = shared_port
        self.log_dir = log_dir
        host = config.gateway.control_host
        self.gateways = [
            GatewayProcess(
                i,
                port if shared_port else port + i,
                config.gateway.control_port + i if config.gateway.control_port else free_port(host),
                log_dir / f"gateway-{i}.log",
            )
            for i in range(gateways)
        ]
        self._stopping = False

    @property
    def control_addresses(self) -> list[str]:
        return [f"{self.config.gateway.control_host}:{g.control_port}" for g in self.gateways]

    def urls(self) -> list[str]:
        return [f"http://{self.config.gateway.host}:{g.http_port}" for g in self.gateways]

    async def start(self) -> None:
        for g in self.gateways:
            await self._spawn(g)
            g.supervisor = asyncio.create_task(self._supervise(g), name=f"supervise-gateway-{g.index}")
        async with asyncio.timeout(GATEWAY_READY_TIMEOUT_S):
            for g in self.gateways:
                await g.up.wait()

    async def stop(self, grace_s: float) -> None:
        self._stopping = True
        for g in self.gateways:
            if g.supervisor is not None:
                g.supervisor.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await g.supervisor
        await stop_processes([g.proc for g in self.gateways if g.proc is not None], grace_s)

    def _argv(self, g: GatewayProcess) -> list[str]:
        argv = [sys.executable, "-m", "gateway.cli", "gateway", *self.config_args]
        argv += ["--port", str(g.http_port), "--control-port", str(g.control_port)]
        if self.shared_port:
            argv += ["--set", "gateway.reuse_port=true"]
        # each gateway keeps its fences across its restarts (gateway/server/workers/fences.py): in
        # <state_dir>/gateway-<i> when one is configured, else beside its log
        base = Path(self.config.gateway.state_dir) if self.config.gateway.state_dir else self.log_dir
        argv += ["--set", f"gateway.state_dir={json.dumps(str(base / f'gateway-{g.index}'))}"]
        return argv

    async def _spawn(self, g: GatewayProcess) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", LUMEN_PARENT_PID=str(os.getpid()))
        env.pop(LOCAL_FAULTS_ENV, None)
        if self.launched is not None:  # signal faults: only with cluster.fault_injection
            env[LOCAL_FAULTS_ENV] = str(self.launched)
        env[TOKEN_ENV] = self.config.gateway.control_token
        if self.admin_key:
            env[ADMIN_KEYS_ENV] = self.admin_key
        if g.index == 0 and self.files:  # removed by it if this supervisor dies (runner.py)
            env[ORPHAN_FILES_ENV] = os.pathsep.join(str(p) for p in self.files())
        g.up.clear()
        with g.log_path.open("ab") as logf:
            g.proc = await asyncio.create_subprocess_exec(
                *self._argv(g), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=logf,
                env=env, preexec_fn=die_with_parent(os.getpid()),
            )  # fmt: skip
        g.starts += 1
        log.info("gateway_started", index=g.index, pid=g.proc.pid, port=g.http_port, restart=g.starts > 1)

    def _publish_admin_key(self, ready: dict[str, Any]) -> None:
        """The generated admin key in `admin-key-<port>` of the port a gateway announced."""
        port = urlsplit(str(ready.get("url", ""))).port
        if self.admin_key and port:
            path = publish_admin_key(self.admin_key, port)
            if path is not None:
                self.admin_key_files.add(path)

    def remove_files(self) -> None:
        """Remove the admin key files published (every exit path of the supervisor that runs code)."""
        for path in self.admin_key_files:
            path.unlink(missing_ok=True)
        self.admin_key_files.clear()

    async def _supervise(self, g: GatewayProcess) -> None:
        while g.proc is not None:
            proc = g.proc
            assert proc.stdout is not None
            async for line in proc.stdout:  # the ready line, then nothing (logs go to the log file)
                with contextlib.suppress(ValueError):
                    msg = json.loads(line)
                    if msg.get("event") == "ready":
                        g.ready = msg
                        self._publish_admin_key(msg)
                        g.up.set()
            rc = await proc.wait()
            g.up.clear()
            if self._stopping:
                return
            log.warning("gateway_exited", index=g.index, returncode=rc, restart=True)
            await asyncio.sleep(RESTART_PAUSE_S)
            await self._spawn(g)


async def healthy_everywhere(urls: list[str], want: int, timeout_s: float, stop: asyncio.Event) -> bool:
    """Whether every gateway reports `want` healthy workers within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline and not stop.is_set():
            counts = []
            for url in urls:
                try:
                    async with http.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                        counts.append(int((await resp.json()).get("healthy_workers", 0)))
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    counts.append(0)
            if min(counts) >= want:
                return True
            await asyncio.sleep(0.1)
    return False
