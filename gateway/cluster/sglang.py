"""`lumen cluster up --engine sglang`: one SGLang server per GPU group, each with its sidecar agent.

Each worker is one agent process, `python -m worker_hooks.sglang --launch -- <launch_server args>`,
which starts its SGLang server on a port chosen here (on GPUs, or on CPU when the arguments say
`--device cpu`), attaches it to the gateway's control plane, and
restarts it when it dies (docs/design.md; worker_hooks/sglang). The supervisor here only starts the
agents (a GPU group each, through CUDA_VISIBLE_DEVICES), restarts an agent that dies, stops them all,
and injects faults into the servers for `/admin/workers/{id}/kill`: the agents print each server's
pid (`server_started` events on their stdout), which is what `kill`, `hang`, `resume` and `term`
signal. The gateway process never imports sglang or worker_hooks: both run in child processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from gateway.cluster.procs import stop_processes
from gateway.protocol.faults import FAULT_SIGNALS, SERVER_SIGNAL_MODES
from gateway.protocol.kv import DEFAULT_PAGE_SIZE
from gateway.protocol.launch import GATEWAY_SECRETS_ENV
from gateway.server.api.errors import InvalidRequest, NotFound
from gateway.server.local_faults import LaunchRegistry, signal_launched, start_time

log = structlog.get_logger("lumen.cluster")

# the faults that make sense for an SGLang server, each with the signal that carries it
SERVER_SIGNALS = {mode: FAULT_SIGNALS[mode] for mode in SERVER_SIGNAL_MODES}
AGENT_MODULE = "worker_hooks.sglang"
AGENT_STOP_SLACK_S = 5.0  # an agent's own shutdown, on top of its server's grace


@dataclass(frozen=True, slots=True)
class SGLangLaunch:
    """What `lumen cluster up --engine sglang` was asked to run."""

    model: str
    tp: int = 1
    workers: int | None = None  # None: as many as the GPUs allow (or cluster.workers without GPUs)
    extra: tuple[str, ...] = ()  # more `launch_server` arguments (after `--`)
    gpus: tuple[str, ...] | None = None  # GPU ids to group by `tp`; None: none (CPU, or a stand-in launcher)

    @property
    def on_cpu(self) -> bool:
        """Whether the launch arguments say `--device cpu` (SGLang's CPU engine: no GPU groups)."""
        return launch_device(self.extra) == "cpu"


def launch_device(args: Sequence[str]) -> str:
    """The `--device` of launch_server arguments (`--device D` or `--device=D`), "" if none."""
    for i, a in enumerate(args):
        if a == "--device" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--device="):
            return a.split("=", 1)[1]
    return ""


# SGLang 0.5.23's HiCache host pool registers its memory with CUDA (srt/mem_cache/pool_host/common.py
# `_cuda_host_register`), so a CPU server launched with a HiCache storage backend dies at start-up
CPU_NO_HICACHE = "HiCache's host pool needs CUDA in SGLang 0.5.23 (pool_host/common.py _cuda_host_register)"


@dataclass(frozen=True, slots=True)
class Checkpoints:
    """Lumen's KV checkpoints in the servers of `lumen cluster up --engine sglang`: each server gets
    SGLang's HiCache flags with Lumen's storage backend (docs/sglang.md, "Storage backend"), under its
    own worker id, with a holder store of `budget_bytes` on a port of its own."""

    budget_bytes: int
    page_size: int


# the storage backend's class, as SGLang's "dynamic" StorageBackendFactory loads it (docs/sglang.md)
HICACHE_BACKEND = {
    "backend_name": "lumen",
    "module_path": "worker_hooks.sglang.hicache_backend",
    "class_name": "LumenHiCacheStorage",
    "interface_v1": 1,
}


def hicache_args(worker_id: str, holder_endpoint: str, ckpt: Checkpoints, given: Sequence[str]) -> list[str]:
    """The launch_server flags that make one server write its pages to Lumen's holders and hold other
    servers' pages (docs/sglang.md); none when `given` (the user's own arguments) already configure a
    HiCache storage backend, and no --page-size when it names one."""
    if any(a == "--hicache-storage-backend" or a.startswith("--hicache-storage-backend=") for a in given):
        return []
    extra = {
        **HICACHE_BACKEND,
        "prefetch_threshold": ckpt.page_size,
        "lumen": {
            "worker_id": worker_id,
            "holder_endpoint": holder_endpoint,
            "holder_budget_bytes": ckpt.budget_bytes,
        },
    }
    out = ["--enable-hierarchical-cache"]
    if not any(a == "--page-size" or a.startswith("--page-size=") for a in given):
        out += ["--page-size", str(ckpt.page_size)]
    return [
        *out,
        *("--hicache-write-policy", "write_through", "--hicache-storage-prefetch-policy", "wait_complete"),
        *("--hicache-storage-backend", "dynamic"),
        *("--hicache-storage-backend-extra-config", json.dumps(extra, separators=(",", ":"))),
    ]


@dataclass(frozen=True, slots=True)
class AgentSpec:
    worker_id: str
    url: str
    argv: tuple[str, ...]
    gpus: tuple[str, ...] | None  # CUDA_VISIBLE_DEVICES for its server; None: left as it is


def visible_gpus(env: Mapping[str, str]) -> tuple[str, ...] | None:
    """The GPU ids this process may use: CUDA_VISIBLE_DEVICES, else what nvidia-smi lists; None if
    neither says (no NVIDIA driver here)."""
    given = env.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return tuple(g.strip() for g in given.split(",") if g.strip())
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return tuple(line.strip() for line in out.stdout.splitlines() if line.strip())


def gpu_groups(gpus: Sequence[str], tp: int, workers: int | None) -> list[tuple[str, ...]]:
    """Consecutive groups of `tp` GPUs, one per server; raises ValueError when they do not fit."""
    if tp < 1:
        raise ValueError(f"--tp must be >= 1, not {tp}")
    fit = len(gpus) // tp
    n = fit if workers is None else workers
    if n < 1 or n > fit:
        raise ValueError(
            f"{n if workers is not None else 'no'} server(s) of --tp {tp} need {max(n, 1) * tp} GPUs; "
            f"{len(gpus)} visible ({','.join(gpus) or 'none'})"
        )
    return [tuple(gpus[i * tp : (i + 1) * tp]) for i in range(n)]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def agent_specs(
    launch: SGLangLaunch,
    control_address: str,
    *,
    more_control_addresses: Sequence[str] = (),
    checkpoints: Checkpoints | None = None,
    default_workers: int,
    failure_domains: int = 1,
    restart: bool = True,
    host: str = "127.0.0.1",
    log_level: str = "info",
    stop_grace_s: float = 5.0,
    page_size: int = DEFAULT_PAGE_SIZE,
    peer_reload: bool = False,
    draft_model: str = "",
    draft_timeout_ms: float | None = None,
) -> list[AgentSpec]:
    """One agent per server, each with its GPU group; without GPUs (`launch.gpus` None: `--device cpu`
    or a stand-in launcher) `launch.workers` or `default_workers` agents, devices left alone. Every
    agent attaches to `control_address` and each of `more_control_addresses` (one per gateway) and
    launches its server at `page_size` (the gateway's engine.page_size) unless the launch arguments
    give one; with `draft_model` each agent drafts with it while a server it relaunched loads. Unless `peer_reload` (the gateway's engine.reload = "peer"), agents do not wait for a seed
    before a relaunch (`--seed-wait-s 0`): the gateway names none. With `checkpoints` every server runs Lumen's HiCache storage backend under its worker id
    (`hicache_args`), except on CPU, where SGLang's HiCache cannot start (`CPU_NO_HICACHE`): there the
    servers run without it, and the log says so."""
    if checkpoints is not None and launch.on_cpu:
        log.warning("sglang_checkpoints_off_on_cpu", reason=CPU_NO_HICACHE, failover="replay")
        checkpoints = None
    if launch.gpus is None:
        groups: list[tuple[str, ...] | None] = [None] * (launch.workers or default_workers)
    else:
        groups = list(gpu_groups(launch.gpus, launch.tp, launch.workers))
    out = []
    for i, group in enumerate(groups):
        wid = f"w{i}"
        url = f"http://{host}:{free_port(host)}"
        argv = [
            *("--url", url, "--gateway", control_address, "--id", wid, "--model", launch.model),
            *(a for more in more_control_addresses for a in ("--gateway", more)),
            *("--failure-domain", f"d{i % max(1, failure_domains)}", "--log-level", log_level),
            *("--stop-grace-s", f"{stop_grace_s:g}", "--page-size", str(page_size), "--launch"),
            *(() if restart else ("--no-restart",)),
            *(() if peer_reload else ("--seed-wait-s", "0")),
            *(("--draft-model", draft_model) if draft_model else ()),
            *(
                ("--draft-timeout-ms", f"{draft_timeout_ms:g}")
                if draft_model and draft_timeout_ms is not None
                else ()
            ),
            "--",
            *("--model-path", launch.model, "--tp-size", str(launch.tp)),
            *launch.extra,
        ]
        if checkpoints is not None:
            holder = f"tcp://{host}:{free_port(host)}"
            argv += hicache_args(wid, holder, checkpoints, launch.extra)
        out.append(AgentSpec(wid, url, tuple(argv), group))
    return out


@dataclass(slots=True)
class AgentProcess:
    spec: AgentSpec
    log_path: Path
    proc: asyncio.subprocess.Process | None = None
    server_pid: int | None = None  # the SGLang server's, from the agent's `server_started` events
    starts: int = 0
    supervisor: asyncio.Task[None] | None = None
    reader: asyncio.Task[None] | None = None
    events: list[dict[str, object]] = field(default_factory=list)


class SGLangCluster:
    """Starts, supervises and stops the agents (which run the servers). Implements app.FaultInjector."""

    def __init__(
        self,
        specs: list[AgentSpec],
        *,
        log_dir: Path,
        control_token: str = "",
        control_ca: str = "",
        restart_agents: bool = True,
        launched: LaunchRegistry | None = None,
    ) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        # the agents this supervisor launched: a gateway signals only their servers (local_faults.py)
        self.launched = launched
        self.log_dir = log_dir
        self.control_token = control_token
        self.control_ca = control_ca
        self.restart_agents = restart_agents
        self.agents = {s.worker_id: AgentProcess(s, log_dir / f"{s.worker_id}.log") for s in specs}
        self._stopping = False

    async def start(self) -> None:
        for ap in self.agents.values():
            await self._spawn(ap)
            ap.supervisor = asyncio.create_task(self._supervise(ap), name=f"supervise-{ap.spec.worker_id}")

    async def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM every agent, which gives its server `grace_s` (--stop-grace-s) to stop; SIGKILL the
        agents left after that and AGENT_STOP_SLACK_S more (their servers die with them)."""
        self._stopping = True
        tasks = [t for ap in self.agents.values() for t in (ap.supervisor,) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for ap in self.agents.values():  # a hung (SIGSTOPped) server cannot act on its agent's SIGTERM
            if ap.server_pid is not None:
                _signal_server(ap, ap.server_pid, signal.SIGCONT)
        agents = [ap.proc for ap in self.agents.values() if ap.proc is not None]
        await stop_processes(agents, grace_s + AGENT_STOP_SLACK_S)
        readers = [ap.reader for ap in self.agents.values() if ap.reader is not None]
        await asyncio.gather(*readers, return_exceptions=True)

    async def kill(self, worker_id: str, mode: str) -> dict[str, object]:
        """Signal a worker's SGLang server (not its agent, which notices and restarts the server)."""
        ap = self.agents.get(worker_id)
        if ap is None:
            raise NotFound(f"no local worker {worker_id!r}; known: {', '.join(sorted(self.agents))}")
        sig = SERVER_SIGNALS.get(mode)
        if sig is None:
            raise InvalidRequest(
                f"mode {mode!r} does not apply to an SGLang server; use one of {', '.join(SERVER_SIGNALS)}",
                param="mode",
            )
        pid = ap.server_pid
        if pid is None:
            raise NotFound(f"worker {worker_id!r} runs no server right now")
        if not _signal_server(ap, pid, sig):
            raise NotFound(f"worker {worker_id!r}'s server (pid {pid}) is not its agent's child any more")
        log.warning("fault_injected", worker=worker_id, pid=pid, mode=mode, target="sglang server")
        return {"worker": worker_id, "pid": pid, "mode": mode, "t": time.time()}

    # -- internals -------------------------------------------------------------------------------
    async def _spawn(self, ap: AgentProcess) -> None:
        # the agent gets the control token (and the CA of a TLS control plane) in its environment,
        # never the gateway's client and admin keys
        env = {k: v for k, v in os.environ.items() if k not in GATEWAY_SECRETS_ENV}
        env.update(
            LUMEN_PARENT_PID=str(os.getpid()), LUMEN_CONTROL_TOKEN=self.control_token, PYTHONUNBUFFERED="1"
        )
        if self.control_ca:
            env["LUMEN_CONTROL_CA"] = self.control_ca
        if ap.spec.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(ap.spec.gpus)
        argv = [sys.executable, "-m", AGENT_MODULE, *ap.spec.argv]
        with ap.log_path.open("ab") as logf:
            ap.proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=logf,
                env=env,
            )
        ap.starts += 1
        ap.server_pid = None
        if self.launched is not None:
            self.launched.add(ap.spec.worker_id, ap.proc.pid)
        ap.reader = asyncio.create_task(self._read_events(ap, ap.proc), name=f"events-{ap.spec.worker_id}")
        log.info(
            "sglang_agent_started",
            worker=ap.spec.worker_id,
            pid=ap.proc.pid,
            url=ap.spec.url,
            gpus=None if ap.spec.gpus is None else ",".join(ap.spec.gpus),
            log=str(ap.log_path),
        )

    async def _read_events(self, ap: AgentProcess, proc: asyncio.subprocess.Process) -> None:
        """The agent's stdout: one JSON event a line, kept in its log and read for the server's pid."""
        assert proc.stdout is not None
        with ap.log_path.open("ab") as logf:
            while line := await proc.stdout.readline():
                logf.write(line)
                logf.flush()
                try:
                    ev = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if not isinstance(ev, dict):
                    continue
                ap.events.append(ev)
                if ev.get("event") == "server_started" and isinstance(ev.get("pid"), int):
                    ap.server_pid = ev["pid"]
                elif ev.get("event") == "server_exited" and ev.get("pid") == ap.server_pid:
                    ap.server_pid = None

    async def _supervise(self, ap: AgentProcess) -> None:
        while ap.proc is not None:
            rc = await ap.proc.wait()
            if self._stopping:
                return
            log.warning("sglang_agent_exited", worker=ap.spec.worker_id, returncode=rc)
            if not self.restart_agents:
                return
            await asyncio.sleep(0.5)  # do not spin if it dies at once
            await self._spawn(ap)


def _signal_server(ap: AgentProcess, pid: int, sig: int) -> bool:
    """Signal the server pid an agent printed, only while it descends from that agent (our child,
    checked with its start time: local_faults.signal_launched); False when it does not."""
    agent = ap.proc
    if agent is None or agent.returncode is not None:
        return False
    t = start_time(agent.pid)
    return t is not None and signal_launched(pid, {(agent.pid, t)}, sig)
