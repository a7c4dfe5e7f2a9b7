"""Start one SGLang server as a child process, watch it, and start it again when it dies.

The command is `python -m sglang.launch_server ARGS` plus the flags Lumen needs when ARGS lack them:

- `--host` / `--port` from the agent's `--url` (the URL the gateway is told; a different one is refused);
- `--sampling-backend pytorch`: seeded sampling (`sampling_seed`) needs it (flashinfer's sampler refuses a
  seed), and a replay after a failure continues a seeded stream only with it;
- `--enable-deterministic-inference`: batch-invariant logits, so a replay on another server in another
  batch continues greedy and seeded streams token for token. Added only where the server can take it
  (`takes_deterministic_flag`): SGLang 0.5.23 refuses it on CPU and with an attention backend outside
  its deterministic list (`srt/arg_groups/overrides.py`); there the gateway reads that the server does
  not promise bit-equal replays from its `/server_info` and says so (docs/sglang.md, "Determinism").

On CPU (`--device cpu` in the launch arguments) the server's environment also gets what an unmodified
SGLang needs there (`cpu_environment`): `SGLANG_USE_CPU_ENGINE=1` and, first on PYTHONPATH, Lumen's
empty stand-in for sgl_kernel's CUDA-only `common_ops` (worker_hooks/sglang/cpu_shim).

Seeded reload: a restart may load its weights from a running server of the same model and TP (the
seed) instead of from storage, with SGLang's `--load-format remote_instance` (`seeded_command`): each TP
rank r receives its shard from the seed's rank r over an NCCL group of two whose store listens on the
seed's host at group port r (`--remote-instance-weight-loader-send-weights-group-ports`, one port per
rank, free on the seed's host). SGLang falls back to loading from storage, silently, when any of
these settings is missing, so all of them are always given together.

Nothing of sglang is imported here or anywhere in Lumen: the server runs in its own interpreter.
`sglang_installed()` only asks the import system whether the package is there.

Testing hook: the environment variable `LUMEN_SGLANG_LAUNCHER` replaces `python -m sglang.launch_server`
with another command line (split like a shell would), e.g.
`LUMEN_SGLANG_LAUNCHER="python -m tests.fixtures.sglang_standin"`; the same flags are added. It is how
the tests run the agent and `lumen cluster up --engine sglang` without GPUs or sglang.

The server is started without the event loop's process machinery (`spawn_child`): `subprocess.Popen`
with no `preexec_fn` starts it with vfork/exec and runs no Python code and no fork handler in the child.
uvloop's subprocess support (the agent runs on uvloop) forks and then runs Python's after-fork hooks in
the child (`PyOS_AfterFork_Child`: threading's, and gRPC's own where gRPC's fork support is on) while
the agent's gRPC and ZMQ threads run: seen on a real server, the relaunched child died with SIGSEGV
2 ms after the fork, right after gRPC's "Other threads are currently calling into gRPC, skipping
fork() handlers". The child-exit watcher is a pidfd the loop reads (`ChildProcess.wait`; a thread
waiting on the child where pidfds are missing): it returns the moment the server exits, so the agent
ends its control streams at once instead of waiting for a failed poll. The server runs in its own
process group (SGLang's scheduler and detokenizer processes with it), which is killed whole after the
server exits and when the agent stops; on Linux the server also dies with the agent (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import structlog

from gateway.core.determinism import DETERMINISTIC_ATTENTION_BACKENDS

log = structlog.get_logger(__name__)

LAUNCHER_ENV = "LUMEN_SGLANG_LAUNCHER"
SGLANG_MODULE = "sglang.launch_server"

# flags Lumen needs, added when the launch arguments lack them (value None: a switch)
REQUIRED_FLAGS: tuple[tuple[str, str | None], ...] = (("--sampling-backend", "pytorch"),)
DETERMINISTIC = "--enable-deterministic-inference"
CPU_SHIM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_shim")

# the queue order Lumen asks of a server by each request's priority (gateway/core/outage.py
# queue_priority): lower values first, no preemption of running requests (srt/arg_groups/fields/
# schedule.py). Added unless the launch arguments choose priority scheduling or a policy themselves;
# the gateway reads what the server runs with from its /server_info either way.
PRIORITY_FLAGS = (
    "--enable-priority-scheduling",
    "--schedule-low-priority-values-first",
    "--disable-priority-preemption",
)


# flags of SGLang's remote-instance weight loader (srt/arg_groups/fields/model.py), all taking one value
LOAD_FORMAT = "--load-format"
SEED_IP = "--remote-instance-weight-loader-seed-instance-ip"
SEED_PORT = "--remote-instance-weight-loader-seed-instance-service-port"
GROUP_PORTS = "--remote-instance-weight-loader-send-weights-group-ports"
LOADER_BACKEND = "--remote-instance-weight-loader-backend"
REMOTE_FLAGS = (LOAD_FORMAT, SEED_IP, SEED_PORT, GROUP_PORTS, LOADER_BACKEND)
TP_FLAGS = ("--tp-size", "--tensor-parallel-size", "--tp")
# default weight-transfer group ports: the restarting server's own port + this + TP rank. SGLang itself
# derives ports from its --port at +1, +13, +233..+240 and +10000; +500.. is clear of them
WEIGHTS_GROUP_PORT_DELTA = 500


class LaunchError(Exception):
    """The server cannot be launched as asked (its arguments contradict the agent's, sglang missing)."""


def sglang_installed() -> bool:
    """Whether `import sglang` would find the package (nothing is imported)."""
    return importlib.util.find_spec("sglang") is not None


def launcher_prefix(env: dict[str, str] | None = None) -> list[str]:
    """The command that starts a server: LUMEN_SGLANG_LAUNCHER's, else `python -m sglang.launch_server`."""
    override = (os.environ if env is None else env).get(LAUNCHER_ENV, "").strip()
    if override:
        return shlex.split(override)
    if not sglang_installed():
        raise LaunchError(
            f"sglang is not installed in this Python ({sys.executable}): the agent launches the server "
            "with its own interpreter, so run it from SGLang's environment with Lumen installed there, "
            "or pip install 'lumen[sglang]' (sglang 0.5.23; CUDA GPUs, or --device cpu; docs/sglang.md), "
            f"or set {LAUNCHER_ENV} to another launcher"
        )
    return [sys.executable, "-m", SGLANG_MODULE]


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of `flag` in args (`--flag V` or `--flag=V`), "" for a bare switch, None if absent."""
    for i, a in enumerate(args):
        if a == flag:
            nxt = args[i + 1] if i + 1 < len(args) else ""
            return "" if nxt.startswith("--") else nxt
        if a.startswith(flag + "="):
            return a[len(flag) + 1 :]
    return None


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.port is None:
        raise LaunchError(f"--url must be http://HOST:PORT with an explicit port, not {url!r}")
    if parts.port == 0:
        raise LaunchError(f"--url needs a fixed port to launch a server on, not {url!r}")
    return parts.hostname, parts.port


def server_args(url: str, args: Sequence[str]) -> list[str]:
    """`args` plus the flags Lumen needs; raises LaunchError where args contradict them."""
    host, port = host_port(url)
    out = list(args)
    given_host, given_port = _flag_value(args, "--host"), _flag_value(args, "--port")
    if given_host is not None and given_host != host:
        raise LaunchError(f"--host {given_host} in the launch arguments, but --url says {host}")
    if given_port is not None and given_port != str(port):
        raise LaunchError(f"--port {given_port} in the launch arguments, but --url says {port}")
    if given_host is None:
        out += ["--host", host]
    if given_port is None:
        out += ["--port", str(port)]
    for flag, value in REQUIRED_FLAGS:
        given = _flag_value(args, flag)
        if given is None:
            out += [flag] if value is None else [flag, value]
        elif value is not None and given != value:
            raise LaunchError(
                f"{flag} {given}: Lumen needs {flag} {value} (seeded sampling and exact replays)"
            )
    if _flag_value(args, DETERMINISTIC) is None and takes_deterministic_flag(args):
        out.append(DETERMINISTIC)
    if _flag_value(args, PRIORITY_FLAGS[0]) is None and _flag_value(args, "--schedule-policy") is None:
        out += list(PRIORITY_FLAGS)
    return out


def device_of(args: Sequence[str]) -> str:
    """The device the launch arguments ask for (`--device`), "cuda" (SGLang's default) if none."""
    return _flag_value(args, "--device") or "cuda"


def takes_deterministic_flag(args: Sequence[str]) -> bool:
    """Whether SGLang 0.5.23 starts with `--enable-deterministic-inference` given these arguments: not on
    CPU (it falls back to fa3 there and fails), not with an attention backend outside its list."""
    if device_of(args) == "cpu":
        return False
    backend = _flag_value(args, "--attention-backend")
    return not backend or backend in DETERMINISTIC_ATTENTION_BACKENDS


def cpu_environment(args: Sequence[str], env: Mapping[str, str]) -> dict[str, str]:
    """What a server's environment needs beyond `env` to run on CPU when `args` say `--device cpu`
    (else {}): SGLANG_USE_CPU_ENGINE=1 and the common_ops stand-in first on PYTHONPATH."""
    if device_of(args) != "cpu":
        return {}
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != CPU_SHIM_DIR]
    return {
        "SGLANG_USE_CPU_ENGINE": env.get("SGLANG_USE_CPU_ENGINE", "1"),
        "PYTHONPATH": os.pathsep.join([CPU_SHIM_DIR, *path]),
    }


PAGE_SIZE = "--page-size"


def with_page_size(args: Sequence[str], page_size: int) -> list[str]:
    """`args` with `--page-size page_size` when they give none (the gateway's engine.page_size: the
    page size of its checkpoint hints and the plugin's pages); unchanged when they do or page_size is 0."""
    if page_size <= 0 or _flag_value(args, PAGE_SIZE) is not None:
        return list(args)
    return [*args, PAGE_SIZE, str(page_size)]


def page_size_of(args: Sequence[str]) -> int:
    """The page size the launch arguments give (`--page-size`), 0 if none (SGLang's own default)."""
    given = _flag_value(args, PAGE_SIZE)
    return _positive_int(PAGE_SIZE, given) if given else 0


MAX_RUNNING = "--max-running-requests"
# the default room a launched server gets for the outage batch boost: the gateway's default cap
# (gateway.core.outage.OutageParams.batch_boost)
OUTAGE_HEADROOM = 1.5


def with_headroom(args: Sequence[str], headroom: float) -> tuple[list[str], int]:
    """`args` with `--max-running-requests B` raised to ceil(B x headroom), and B: the batch the
    gateway holds the server to outside a recovery (gateway/server/workers/held.py). Without an
    explicit B (SGLang sizes its own) or with headroom <= 1: `args` unchanged and 0 (not held)."""
    given = _flag_value(args, MAX_RUNNING)
    if not given or headroom <= 1:
        return list(args), 0
    base = _positive_int(MAX_RUNNING, given)
    return [*without_flags(args, [MAX_RUNNING]), MAX_RUNNING, str(math.ceil(base * headroom))], base


def server_command(url: str, args: Sequence[str], env: dict[str, str] | None = None) -> list[str]:
    return [*launcher_prefix(env), *server_args(url, args)]


def tp_of(args: Sequence[str]) -> int:
    """The tensor parallelism the launch arguments ask for (`--tp-size` or an alias), 1 if none."""
    for flag in TP_FLAGS:
        given = _flag_value(args, flag)
        if given:
            return _positive_int(flag, given)
    return 1


def _positive_int(flag: str, given: str) -> int:
    try:
        value = int(given)
    except ValueError:
        raise LaunchError(f"{flag} {given}: not an integer") from None
    if value < 1:
        raise LaunchError(f"{flag} {given}: must be >= 1")
    return value


def lumen_storage_config(args: Sequence[str]) -> dict[str, object]:
    """The `"lumen"` object of `--hicache-storage-backend-extra-config` in launch args ({} if none):
    the holder endpoint and budget Lumen's storage backend runs with (docs/sglang.md)."""
    raw = _flag_value(args, "--hicache-storage-backend-extra-config")
    if raw is None:
        return {}
    try:
        extra = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--hicache-storage-backend-extra-config is not JSON: {exc}") from exc
    lumen = extra.get("lumen") if isinstance(extra, dict) else None
    return lumen if isinstance(lumen, dict) else {}


def weights_group_ports(port: int, tp: int) -> list[int]:
    """The default weight-transfer group ports of a server at `port`: one per TP rank, from
    port + WEIGHTS_GROUP_PORT_DELTA (below the port when that would pass 65535)."""
    base = port + WEIGHTS_GROUP_PORT_DELTA
    if base + tp - 1 > 65535:
        base = port - WEIGHTS_GROUP_PORT_DELTA - tp
    return [base + r for r in range(tp)]


def remote_instance_args(seed_url: str, group_ports: Sequence[int], tp: int) -> list[str]:
    """SGLang's flags that load every TP rank's weights from the seed at `seed_url` over NCCL; raises
    LaunchError when they would be incomplete (SGLang would quietly load from storage instead)."""
    try:
        host, port = host_port(seed_url)
    except LaunchError:
        raise LaunchError(f"seed url must be http://HOST:PORT, not {seed_url!r}") from None
    if len(group_ports) < tp:
        raise LaunchError(f"{len(group_ports)} weight-transfer group port(s) for TP {tp}: one per rank")
    if any(not 0 < p <= 65535 for p in group_ports):
        raise LaunchError(f"weight-transfer group ports out of range: {list(group_ports)}")
    return [
        *(LOAD_FORMAT, "remote_instance"),
        *(SEED_IP, host),
        *(SEED_PORT, str(port)),
        *(GROUP_PORTS, json.dumps(list(group_ports[:tp]), separators=(",", ":"))),
        *(LOADER_BACKEND, "nccl"),
    ]


def without_flags(args: Sequence[str], flags: Sequence[str]) -> list[str]:
    """`args` without each of `flags` (`--flag V` or `--flag=V`; every one takes a value)."""
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if a in flags:
            skip = True
            continue
        if a.startswith("--") and a.split("=", 1)[0] in flags and "=" in a:
            continue
        out.append(a)
    return out


def seeded_command(command: Sequence[str], seed_url: str, group_ports: Sequence[int], tp: int) -> list[str]:
    """The server command loading its weights from the seed at `seed_url`: the disk command without
    any load-format or remote-instance flag of its own, plus `remote_instance_args`."""
    return [*without_flags(command, REMOTE_FLAGS), *remote_instance_args(seed_url, group_ports, tp)]


@dataclass(frozen=True, slots=True)
class ServerExit:
    pid: int
    returncode: int
    at: float  # time.monotonic() when the agent saw the exit (one clock for every process of a Linux host)
    uptime_s: float


# Run in a fresh interpreter just before the server's own exec: the child gets SIGKILL when the agent
# dies (Linux), and exits at once if the agent is gone already. Not a preexec_fn: the agent process has
# threads (gRPC, ZMQ's authenticator), and Python code between fork and exec in such a process can
# crash the child (seen: a segfault in threading._after_fork).
_PARENT_DEATH_WRAPPER = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGKILL)\n"
    "if os.getppid() != int(sys.argv[1]): sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def with_parent_death(command: list[str]) -> list[str]:
    """`command`, made to die with this process where Linux allows it."""
    if not sys.platform.startswith("linux"):
        return command
    return [sys.executable, "-c", _PARENT_DEATH_WRAPPER, str(os.getpid()), *command]


class ServerProcess:
    """One server: started by `run()`, restarted after each exit (unless `restart` is False), ended by
    `stop()`. `on_exit` is called first thing after the exit is seen, before any cleanup; `next_command`,
    when given, is awaited before each restart (after the backoff) for the command to start then."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        on_start: Callable[[int], None],
        on_exit: Callable[[ServerExit], None],
        next_command: Callable[[], Awaitable[Sequence[str]]] | None = None,
        env: dict[str, str] | None = None,
        output: int | None = None,
        restart: bool = True,
        backoff_start_s: float = 0.5,
        backoff_cap_s: float = 30.0,
        stable_after_s: float = 60.0,
    ) -> None:
        self.command = list(command)
        self.on_start = on_start
        self.on_exit = on_exit
        self.next_command = next_command
        self.env = env
        self.output = output  # where the server's stdout and stderr go; None: the agent's stderr
        self.restart = restart
        self.backoff_start_s = backoff_start_s
        self.backoff_cap_s = backoff_cap_s
        self.stable_after_s = stable_after_s
        self.proc: ChildProcess | None = None
        self.starts = 0
        self._started_at = 0.0
        self._unwatched: ChildProcess | None = None  # started by spawn(), for run()
        self.exits: list[ServerExit] = []

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.returncode is None else None

    async def spawn(self) -> None:
        """Start the server now (run() then watches it); raises OSError if the command cannot start."""
        if self._unwatched is not None:
            raise RuntimeError(f"server {self._unwatched.pid} was started and is not watched yet")
        self._unwatched = await self._spawn()

    async def run(self) -> None:
        """Start (unless spawn() did), watch, restart; returns only when the server exited and `restart`
        is off."""
        backoff = self.backoff_start_s
        proc, self._unwatched = self._unwatched or await self._spawn(), None
        while True:
            started = self._started_at
            rc = await proc.wait()  # the child-exit watcher
            now = time.monotonic()
            seen = ServerExit(proc.pid, rc, now, now - started)
            self.exits.append(seen)
            self.on_exit(seen)  # first: the gateway must learn it before anything else happens
            _kill_group(proc.pid, signal.SIGKILL)  # what the server started dies with it
            log.warning("server exited", pid=proc.pid, returncode=rc, uptime_s=round(seen.uptime_s, 3))
            if not self.restart:
                return
            backoff = self.backoff_start_s if seen.uptime_s >= self.stable_after_s else backoff
            await asyncio.sleep(backoff)
            backoff = min(self.backoff_cap_s, backoff * 2)
            if self.next_command is not None:
                self.command = list(await self.next_command())
            proc = await self._spawn()

    def kill(self) -> bool:
        """SIGKILL the running server's process group (run() sees the exit as any other); False if none
        runs."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return False
        _kill_group(proc.pid, signal.SIGKILL)
        return True

    async def stop(self, grace_s: float = 10.0) -> None:
        """Terminate the server's process group; SIGKILL what is left after `grace_s`."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        _kill_group(proc.pid, signal.SIGCONT)  # a stopped (hung) server cannot act on SIGTERM
        _kill_group(proc.pid, signal.SIGTERM)
        try:
            async with asyncio.timeout(grace_s):
                await proc.wait()
        except TimeoutError:
            log.warning("server ignored SIGTERM; killing it", pid=proc.pid, grace_s=grace_s)
        _kill_group(proc.pid, signal.SIGKILL)
        await proc.wait()

    async def _spawn(self) -> ChildProcess:
        """Start one server process (the only place one is started)."""
        out = self.output if self.output is not None else sys.stderr.fileno()
        self.proc = spawn_child(with_parent_death(self.command), env=self.env, output=out)
        self.starts += 1
        self._started_at = time.monotonic()
        log.info("server started", pid=self.proc.pid, command=shlex.join(self.command), starts=self.starts)
        self.on_start(self.proc.pid)
        return self.proc


class ChildProcess:
    """A child started by `spawn_child`: its pid, its return code once it exited, and `wait()`, which
    returns the moment it exits (a pidfd the running loop reads; a thread waiting on it without one)."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self.pid = popen.pid
        self._exited: asyncio.Future[int] | None = None

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    async def wait(self) -> int:
        if self.popen.returncode is not None:
            return self.popen.returncode
        if self._exited is None:
            self._exited = self._watch()
        return await asyncio.shield(self._exited)

    def _watch(self) -> asyncio.Future[int]:
        loop = asyncio.get_running_loop()
        try:
            fd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):  # no pidfds (not Linux >= 5.3): a thread waits on the child
            return asyncio.ensure_future(asyncio.to_thread(self.popen.wait))
        exited: asyncio.Future[int] = loop.create_future()

        def readable() -> None:  # the child exited: reap it (at once) and say so
            loop.remove_reader(fd)
            os.close(fd)
            if not exited.done():
                exited.set_result(self.popen.wait())

        loop.add_reader(fd, readable)
        return exited


def spawn_child(command: Sequence[str], *, env: Mapping[str, str] | None, output: int) -> ChildProcess:
    """Start `command` in its own session (process group), stdin from /dev/null, stdout and stderr to
    `output`, with `subprocess.Popen` and no `preexec_fn`: CPython starts it with vfork (or fork) and
    exec in C, running neither Python's after-fork hooks nor, with vfork, any pthread_atfork handler in
    the child; safe while the agent's threads (gRPC, ZMQ) run. Raises OSError if it cannot start."""
    popen = subprocess.Popen(
        list(command),
        stdin=subprocess.DEVNULL,
        stdout=output,
        stderr=output,
        env=None if env is None else dict(env),
        start_new_session=True,  # its own process group: the whole server is killed together
    )
    return ChildProcess(popen)


def _kill_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
