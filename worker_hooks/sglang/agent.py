"""The sidecar agent: one unmodified SGLang server on Lumen's control plane, like Lumen's own workers.

`Sidecar` runs beside one server (at `url`) and attaches to each gateway given (one control session per
gateway, all reporting the same truth) with `worker_hooks.control.ControlClient`; `SGLangRole` is what
differs from Lumen's engine:

- Hello says `engine = "sglang"` and `http_url = url` (the gateway then speaks SGLang's own `/generate`
  to it), the server's pid when the agent launched it, and its capacity from the last `/v1/loads`;
  the incarnation is time-based (microseconds) and strictly increasing across the agent's restarts;
- the KV plane's security for the server (plane_file.py): Hello's `plane_key` is the server's CURVE key,
  which the agent holds; the gateways' `Members` go into the server's 0600 plane file, whose path a
  server the agent launches gets in its environment (`LUMEN_PLANE_FILE`);
- heartbeats (at the Welcome's interval) carry the server's load: running, waiting and KV tokens used,
  summed over DP ranks, from the last answer of `GET /v1/loads?include=core`, which the agent polls at
  its own modest rate (`poll_interval_s`) and reuses between polls; the phase is LOADING_FULL until
  `GET /ready` answers 200, then SERVING (DRAINING once the gateway says Drain);
- with Lumen's storage backend in the server (a `kv_endpoint`), heartbeats also report its holder
  stores as Lumen's own workers report theirs: bytes used, tokens held, and the durable tokens of each
  request held (those that changed since the previous beat, all of them in a session's first beat),
  from the last answer of the stores' status sockets (`holder_report`), polled at `poll_interval_s`
  with a timeout of the same, one socket per rank (`holder_shards`, default `tp`), the minimum over
  ranks;
- when the gateway fences the session (ends the stream), the agent asks the server to abort what it
  runs (`POST /abort_request {"rid": "", "abort_all": true}`) and re-attaches as a new incarnation.
  With several gateways it does not: SGLang aborts by rid prefix or all at once, the agent cannot
  tell one gateway's requests from another's, and the fencing gateway has already dropped its streams
  and aborts its own rids (gateway/server/sessions.py).

A server that stops serving ends every session at once (the gateway fails the incarnation within
milliseconds, not after missed heartbeats): its exit, seen by the launcher's child-exit watcher when
the agent launched it; a refused or reset connection on a poll otherwise; or no 200 from `/ready` for
`poll_interval_s * poll_misses` (a hung or unready server). The sessions then re-attach as new
incarnations in LOADING_FULL and report SERVING once `/ready` is 200 again (after the launcher has
restarted the server, or whoever runs it did).

Seeded reload (with `--launch`): when the server dies, the re-attaching sessions say `awaiting_seed` in
their Hello and heartbeats and the agent waits up to `seed_wait_s` (from the exit) for a gateway's `ReloadFrom{seed}`,
a running server of the same model and TP picked by that gateway. It then launches the server with
SGLang's `--load-format remote_instance` flags naming the seed (launcher.seeded_command; weight-transfer
group ports `weights_group_ports`, by default derived from the server's own port), or from storage when
no seed came. A seeded server that exits before `/ready` answers 200, or is not ready within
`seed_timeout_s` (then the agent kills it), is launched again at once from storage. The reload is
measured from the server's exit to the first 200 from `/ready`, with its source (`peer` or `disk`), and
reported once to each gateway with the first SERVING heartbeat after it (`reload_seconds`,
`reload_source`, `reload_seed`); the first launch is not a reload.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import aiohttp
import msgspec
import structlog

from gateway.protocol import control_pb2 as pb
from gateway.protocol.generate import EngineKind
from gateway.protocol.sglang import SGLangAbort, SGLangLoads
from worker_hooks.control import ControlClient
from worker_hooks.sglang.holder_report import DurableReporter, HolderPoller, HolderReport
from worker_hooks.sglang.launcher import (
    LaunchError,
    ServerExit,
    ServerProcess,
    host_port,
    seeded_command,
    weights_group_ports,
)
from worker_hooks.sglang.plane_file import ServerPlanes
from worker_hooks.sglang.storage_layout import shard_endpoint, status_endpoint_for

log = structlog.get_logger(__name__)

EventSink = Callable[[dict[str, Any]], None]


def now_us() -> int:
    return time.time_ns() // 1000


@dataclass(frozen=True, slots=True)
class SidecarConfig:
    worker_id: str
    url: str  # the server's http://host:port, as the gateway will reach it
    gateways: tuple[str, ...]  # control-plane host:port of each gateway
    token: str = ""  # the control-plane secret (LUMEN_CONTROL_TOKEN; gateway/protocol/secrets.py)
    tls_ca: str = ""  # PEM the gateways' control-plane certificates chain to; "": plaintext
    model: str = ""
    failure_domain: str = ""
    poll_interval_s: float = 0.1
    poll_misses: int = 5  # no 200 from /ready for poll_interval_s x poll_misses: the server is lost
    heartbeat_interval_ms: int = 50  # when a Welcome names none
    abort_timeout_s: float = 2.0
    tp: int = 1  # the server's tensor parallelism: a seed must have the same
    seed_wait_s: float = 2.0  # after the server died, how long to wait for a ReloadFrom (0: never seed)
    seed_timeout_s: float = 300.0  # a seeded server not ready by then is killed and loaded from storage
    weights_group_ports: tuple[int, ...] = ()  # one per TP rank; empty: from the url's port
    # Lumen's storage backend in the server (part 2): where its holder store listens and its budget;
    # reported in Hello so the gateway can make this server a checkpoint holder ("": it holds nothing)
    kv_endpoint: str = ""
    ckpt_budget_bytes: int = 0
    # its holder stores' status sockets (shard 0; rank r at shard_endpoint(base, r)); "": derived from
    # kv_endpoint (`page_store.status_endpoint_for`), as the storage backend derives it
    holder_status_endpoint: str = ""
    holder_shards: int = 0  # holder stores (ranks) to poll; 0: tp
    # the server's plane file (keys and members for its KV plane, plane_file.py; LUMEN_PLANE_FILE): "": a
    # private one the agent creates, and gives a server it launches
    plane_file: str = ""

    def __post_init__(self) -> None:
        if not self.gateways:
            raise ValueError("the agent needs at least one gateway")
        if len(set(self.gateways)) != len(self.gateways):
            raise ValueError(f"a gateway is named twice: {self.gateways}")
        if self.poll_interval_s <= 0 or self.poll_misses < 1:
            raise ValueError("poll_interval_s must be > 0 and poll_misses >= 1")
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, not {self.tp}")
        if self.holder_shards < 0:
            raise ValueError(f"holder_shards must be >= 0, not {self.holder_shards}")
        if self.seed_wait_s < 0 or self.seed_timeout_s <= 0:
            raise ValueError("seed_wait_s must be >= 0 and seed_timeout_s > 0")
        if self.weights_group_ports and len(self.weights_group_ports) < self.tp:
            raise ValueError(
                f"{len(self.weights_group_ports)} weights group port(s) for tp {self.tp}: one per TP rank"
            )

    def group_ports(self) -> list[int]:
        """The weight-transfer group ports a seeded launch names (one per TP rank)."""
        if self.weights_group_ports:
            return list(self.weights_group_ports[: self.tp])
        return weights_group_ports(host_port(self.url)[1], self.tp)

    def status_endpoints(self) -> list[str]:
        """The status sockets of the server's holder stores, rank order (none without a kv_endpoint)."""
        if not self.kv_endpoint:
            return []
        base = self.holder_status_endpoint or status_endpoint_for(self.kv_endpoint)
        return [shard_endpoint(base, r) for r in range(self.holder_shards or self.tp)]


class Source(StrEnum):
    """Where a relaunched server's weights came from."""

    PEER = "peer"  # a running server (the seed), over SGLang's remote_instance loader
    DISK = "disk"  # its own storage


@dataclass(frozen=True, slots=True)
class Reload:
    """One relaunch, from the server's exit to the first 200 from /ready."""

    seq: int  # 1, 2, ... per agent
    seconds: float
    source: Source
    seed: str  # the seed's worker id (peer), the seed that failed (disk), or ""


@dataclass(slots=True)
class Attempt:
    """One launch of the server: seeded (`seed` set) or from storage."""

    seed: str = ""
    seed_url: str = ""
    pid: int | None = None
    ready: bool = False


class Probe(StrEnum):
    """One `/ready` poll's outcome."""

    READY = "ready"  # 200
    UNREADY = "unready"  # any other status (SGLang: 503 while starting or unhealthy)
    SILENT = "silent"  # no answer in time (hung)
    REFUSED = "refused"  # the connect failed (refused): nobody listens at the URL


class SGLangRole:
    """One gateway's session with the server (an `AgentRole`); the truth comes from the Sidecar."""

    def __init__(self, sidecar: Sidecar) -> None:
        self.sidecar = sidecar
        self._incarnation = now_us()
        self.draining = False
        self.reload_reported = 0  # the seq of the last Reload this gateway was told of
        self.durable = DurableReporter()  # what this gateway was told of the holder stores

    @property
    def worker_id(self) -> str:
        return self.sidecar.cfg.worker_id

    @property
    def incarnation(self) -> int:
        return self._incarnation

    def phase(self) -> pb.Phase:
        if not self.sidecar.up:
            return pb.LOADING_FULL
        return pb.DRAINING if self.draining else pb.SERVING

    def hello(self) -> pb.Hello:
        s, cfg = self.sidecar, self.sidecar.cfg
        ranks = s.loads.loads if s.loads is not None else []
        return pb.Hello(
            worker_id=cfg.worker_id,
            model=cfg.model,
            http_url=cfg.url,
            engine=EngineKind.SGLANG,
            phase=self.phase(),
            pid=s.server_pid or 0,
            kv_capacity_tokens=sum(r.max_total_num_tokens for r in ranks),
            max_running_requests=sum(r.max_running_requests for r in ranks),
            failure_domain=cfg.failure_domain,
            tp=cfg.tp,
            awaiting_seed=s.awaiting_seed,
            kv_endpoint=cfg.kv_endpoint,
            plane_key=s.planes.keys.public,
            ckpt_budget_bytes=cfg.ckpt_budget_bytes,
        )

    def heartbeat(self, seq: int, *, full: bool) -> pb.Heartbeat:
        ranks = self.sidecar.loads.loads if self.sidecar.loads is not None else []
        phase = self.phase()
        beat = pb.Heartbeat(
            seq=seq,
            phase=phase,
            running=sum(r.num_running_reqs for r in ranks),
            waiting=sum(r.num_waiting_reqs for r in ranks),
            kv_tokens_used=sum(r.num_used_tokens for r in ranks),
            awaiting_seed=self.sidecar.awaiting_seed,
            pid=self.sidecar.server_pid or 0,  # a server relaunched within this session has a new one
        )
        held = self.sidecar.holder
        if held is not None:
            beat.ckpt_bytes_used = held.bytes_used
            beat.ckpt_tokens_held = held.tokens_held
        if self.sidecar.holders is not None:
            beat.durable.extend(
                pb.DurableTokens(rid=r, tokens=t) for r, t in self.durable.beat(held, full=full).items()
            )
        reload = self.sidecar.reload
        if phase != pb.LOADING_FULL and reload is not None and reload.seq > self.reload_reported:
            self.reload_reported = reload.seq  # once, with the first serving beat after it
            beat.reload_seconds = reload.seconds
            beat.reload_source = reload.source.value
            beat.reload_seed = reload.seed
        return beat

    def command(self, msg: pb.GatewayMessage) -> None:
        kind = msg.WhichOneof("body")
        if kind == "drain":
            log.info("draining", worker_id=self.worker_id)
            self.draining = True
        elif kind == "members":
            self.sidecar.planes.update(self, msg.members)  # the server's plane file follows
        elif kind == "reload_from":
            self.sidecar.offer_seed(msg.reload_from.seed_worker_id, msg.reload_from.seed_url)
        else:
            # holder assignment and draft assist need Lumen's engine; a DropCheckpoint for the server's
            # holder stores is not forwarded (the writer's END or the stores' orphan TTL frees the pages)
            log.info("command ignored: not for an SGLang server", worker_id=self.worker_id, command=kind)

    async def reset(self) -> None:
        s = self.sidecar
        if s.up and len(s.clients) == 1:
            await s.abort_all()
        self._incarnation = max(now_us(), self._incarnation + 1)
        self.draining = False
        s.emit("incarnation", incarnation=self._incarnation)


class Sidecar:
    """The agent beside one SGLang server: polls it, launches it (optional), attaches to the gateways."""

    def __init__(
        self,
        cfg: SidecarConfig,
        *,
        launch: list[str] | None = None,
        launch_env: dict[str, str] | None = None,
        restart: bool = True,
        server_output: int | None = None,
        on_event: EventSink | None = None,
    ) -> None:
        self.cfg = cfg
        # the server's KV-plane keys and the members the gateways send, in the file its processes read
        self.planes = ServerPlanes(cfg.worker_id, cfg.plane_file)
        self.on_event = on_event
        self.events: deque[dict[str, Any]] = deque(maxlen=1000)
        self.up = False  # /ready said 200 and nothing since said the server is lost
        self.loads: SGLangLoads | None = None  # the last /v1/loads answer
        self.generation = 0  # bumped when the server is lost: polls begun before do not count
        self.last_ready = 0.0  # loop time of the last 200 from /ready
        # the server's holder stores (with a kv_endpoint): the poller and its last report
        endpoints = cfg.status_endpoints()
        self.holders = HolderPoller(endpoints, timeout_s=cfg.poll_interval_s) if endpoints else None
        self.holder: HolderReport | None = None
        self.clients = [
            ControlClient(
                SGLangRole(self),
                address,
                token=cfg.token,
                tls_ca=cfg.tls_ca,
                heartbeat_interval_ms=cfg.heartbeat_interval_ms,
            )
            for address in cfg.gateways
        ]
        self.server: ServerProcess | None = None
        self.launch = list(launch) if launch is not None else None  # the command loading from storage
        if launch is not None:
            self.server = ServerProcess(
                launch,
                env={**(launch_env if launch_env is not None else os.environ), **self.planes.env},
                output=server_output,
                restart=restart,
                on_start=self._server_started,
                on_exit=self._server_exited,
                next_command=self._next_command,
            )
        # seeded reload (see the module doc)
        self.seeding = launch is not None and restart and cfg.seed_wait_s > 0
        self.awaiting_seed = False  # between the server's exit and its relaunch, when it may be seeded
        self.attempt = Attempt()  # the launch running now
        self.reload: Reload | None = None  # the last one
        self.reloads = 0
        self._seed_offer: asyncio.Future[tuple[str, str]] | None = None
        self._down_since: float | None = None  # time.monotonic() of the exit being reloaded from
        self._last_exit_at = 0.0
        self._failed_seed = ""  # a seed whose launch failed during the current reload
        self._disk_next = False  # the seeded launch failed: the next one loads from storage
        self._seed_timer: asyncio.Task[None] | None = None
        self.server_pid: int | None = None
        self.exited = asyncio.Event()  # the launched server exited and will not be restarted
        self._signal = asyncio.Event()  # set (and replaced) by every emit
        self._http: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._http is not None:
            raise RuntimeError("sidecar already started")
        # a fresh connection per poll: a refused connect then always means no server at the URL (a
        # pooled keep-alive connection the server closed would fail for no fault of the server)
        self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        if self.server is not None:
            await self.server.spawn()  # first, so the first Hello names its pid
            self._tasks.append(asyncio.create_task(self._run_server(), name="sglang-server"))
        self._tasks.append(asyncio.create_task(self._poll(), name="sglang-poll"))
        if self.holders is not None:
            self._tasks.append(asyncio.create_task(self._poll_holders(), name="sglang-holder-poll"))
        for c in self.clients:
            await c.start()
        self.emit("started", url=self.cfg.url, gateways=list(self.cfg.gateways))

    async def stop(self, grace_s: float = 10.0) -> None:
        """Detach from every gateway (the gateways fail this incarnation at once), then stop the server
        if the agent launched it."""
        for c in self.clients:
            await c.stop()
        tasks = [*self._tasks, *([self._seed_timer] if self._seed_timer is not None else [])]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._seed_timer = None
        if self.server is not None:
            await self.server.stop(grace_s)
        if self._http is not None:
            await self._http.close()
            self._http = None
        if self.holders is not None:
            self.holders.close()
        self.planes.close()

    # -- what the server does -------------------------------------------------------------------
    def server_lost(self, reason: str) -> None:
        """The server stopped serving: every gateway must learn it now, not after missed heartbeats."""
        self.generation += 1
        if not self.up:
            return
        self.up = False
        self.loads = None
        self.holder = None
        if self.holders is not None:
            self.holders.forget()
        ended = sum(c.end_session(reason) for c in self.clients)
        self.emit("server_lost", reason=reason, sessions_ended=ended)
        log.warning("server lost", worker_id=self.cfg.worker_id, reason=reason, sessions_ended=ended)

    def _server_started(self, pid: int) -> None:
        self.server_pid = pid
        self.attempt.pid = pid
        self.emit("server_started", pid=pid, source=(Source.PEER if self.attempt.seed else Source.DISK).value)
        if self.attempt.seed:
            self._seed_timer = asyncio.create_task(
                self._seed_deadline(self.attempt), name="sglang-seed-timer"
            )

    def _server_exited(self, ex: ServerExit) -> None:
        self.server_pid = None
        self._last_exit_at = ex.at
        if self._down_since is None:
            self._down_since = ex.at  # what a relaunch is measured from
        attempt = self.attempt
        if attempt.seed and not attempt.ready:
            # the seed or the transfer failed: the next launch loads from storage, without waiting
            self._failed_seed, self._disk_next = attempt.seed, True
            self.emit("seed_failed", seed=attempt.seed, pid=ex.pid, returncode=ex.returncode)
            log.warning(
                "seeded server exited before ready; loading from storage",
                worker_id=self.cfg.worker_id,
                seed=attempt.seed,
                returncode=ex.returncode,
            )
        # before the sessions end (when the exit, not a refused poll, is the first news): their next
        # Hello says that this relaunch may be seeded, and so does every heartbeat until it launches.
        # Only a server that was serving is seeded; one that died while loading is relaunched from
        # storage at once.
        self.awaiting_seed = self.seeding and attempt.ready and not self._disk_next
        if self.awaiting_seed:
            self._seed_offer = asyncio.get_running_loop().create_future()
        self.emit("server_exited", pid=ex.pid, returncode=ex.returncode, seen_at=ex.at)
        self.server_lost(f"server process {ex.pid} exited with {ex.returncode}")

    # -- seeded reload ----------------------------------------------------------------------------
    def offer_seed(self, seed_worker_id: str, seed_url: str) -> None:
        """A gateway's ReloadFrom: taken when the agent waits for one, else ignored (the first wins)."""
        offer = self._seed_offer
        if not self.awaiting_seed or offer is None or offer.done():
            log.info(
                "ReloadFrom ignored: not waiting for a seed",
                worker_id=self.cfg.worker_id,
                seed=seed_worker_id,
            )
            return
        offer.set_result((seed_worker_id, seed_url))

    async def _next_command(self) -> list[str]:
        """The command of the next relaunch (ServerProcess.next_command): seeded when a gateway named a
        seed within `seed_wait_s` of the exit, else from storage."""
        assert self.launch is not None
        self.attempt = Attempt()
        offer = self._seed_offer
        if not self.awaiting_seed or offer is None:
            self._disk_next = False
            return self.launch
        wait_s = self._last_exit_at + self.cfg.seed_wait_s - time.monotonic()
        try:
            async with asyncio.timeout(max(0.0, wait_s)):
                seed, seed_url = await offer
        except TimeoutError:
            self.emit("no_seed", waited_s=round(max(0.0, wait_s), 3))
            return self.launch
        finally:
            self.awaiting_seed = False
            self._seed_offer = None
        try:
            command = seeded_command(self.launch, seed_url, self.cfg.group_ports(), self.cfg.tp)
        except LaunchError as exc:
            log.warning("cannot seed from the gateway's choice", worker_id=self.cfg.worker_id, error=str(exc))
            self.emit("seed_refused", seed=seed, seed_url=seed_url, error=str(exc))
            return self.launch
        self.attempt = Attempt(seed=seed, seed_url=seed_url)
        self.emit("reload_from", seed=seed, seed_url=seed_url, group_ports=self.cfg.group_ports())
        return command

    async def _seed_deadline(self, attempt: Attempt) -> None:
        """Kill a seeded server that is not ready within seed_timeout_s (it then loads from storage)."""
        await asyncio.sleep(self.cfg.seed_timeout_s)
        if self.attempt is attempt and not attempt.ready and self.server is not None:
            self.emit("seed_timeout", seed=attempt.seed, timeout_s=self.cfg.seed_timeout_s)
            log.warning(
                "seeded server not ready in time; killing it", worker_id=self.cfg.worker_id, seed=attempt.seed
            )
            self.server.kill()

    def _server_ready(self) -> None:
        """The first 200 from /ready of this launch: a relaunch's reload is complete."""
        self.attempt.ready = True
        if self._seed_timer is not None:
            self._seed_timer.cancel()
            self._seed_timer = None
        if self._down_since is None:
            return  # the first launch, or a server the agent does not run
        source = Source.PEER if self.attempt.seed else Source.DISK
        self.reloads += 1
        self.reload = Reload(
            seq=self.reloads,
            seconds=time.monotonic() - self._down_since,
            source=source,
            seed=self.attempt.seed or self._failed_seed,
        )
        self._down_since, self._failed_seed, self._disk_next = None, "", False
        self.emit(
            "reloaded", seconds=round(self.reload.seconds, 4), source=source.value, seed=self.reload.seed
        )
        log.info(
            "server reloaded",
            worker_id=self.cfg.worker_id,
            seconds=round(self.reload.seconds, 3),
            source=source.value,
            seed=self.reload.seed,
        )

    async def _run_server(self) -> None:
        assert self.server is not None
        await self.server.run()  # returns only when the server exited for good (restart off)
        self.exited.set()

    async def abort_all(self) -> None:
        """Ask the server to abort every request it runs (best effort, bounded)."""
        assert self._http is not None
        body = msgspec.json.encode(SGLangAbort(rid="", abort_all=True))
        try:
            async with self._http.post(
                self.cfg.url + "/abort_request",
                data=body,
                headers={"content-type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=self.cfg.abort_timeout_s),
            ) as resp:
                ok = resp.status == 200
            self.emit("abort_all", ok=ok, status=resp.status)
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.emit("abort_all", ok=False, error=repr(exc))
            log.info("abort_all failed", worker_id=self.cfg.worker_id, error=repr(exc))

    # -- polling --------------------------------------------------------------------------------
    async def _poll(self) -> None:
        loop = asyncio.get_running_loop()
        cfg = self.cfg
        window = cfg.poll_interval_s * cfg.poll_misses
        while True:
            generation = self.generation
            probe = await self._probe_ready(window)
            answers = probe in (Probe.READY, Probe.UNREADY)  # a loading server may know its capacity
            loads = await self._probe_loads(window) if answers else None
            if generation == self.generation:  # the server was not lost meanwhile
                now = loop.time()
                if loads is not None:
                    self.loads = loads
                if probe is Probe.READY:
                    self.last_ready = now
                    if not self.up:
                        self.up = True
                        self.emit("server_ready")
                        if self.server_pid is not None and not self.attempt.ready:
                            self._server_ready()
                        log.info("server ready", worker_id=cfg.worker_id, url=cfg.url)
                elif probe is Probe.REFUSED:
                    self.server_lost("connection refused")
                elif self.up and now - self.last_ready >= window:
                    self.server_lost(f"/ready {probe.value} for {1000 * (now - self.last_ready):.0f} ms")
            await asyncio.sleep(cfg.poll_interval_s)

    async def _poll_holders(self) -> None:
        """The holder stores' status, at the poll interval; heartbeats read the last report."""
        assert self.holders is not None
        while True:
            generation = self.generation
            report = await self.holders.poll()
            if generation != self.generation:  # the server was lost meanwhile: its answers with it
                self.holders.forget()
            elif self.up:
                self.holder = report
            await asyncio.sleep(self.cfg.poll_interval_s)

    async def _probe_ready(self, timeout_s: float) -> Probe:
        assert self._http is not None
        try:
            async with self._http.get(
                self.cfg.url + "/ready", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                return Probe.READY if resp.status == 200 else Probe.UNREADY
        except TimeoutError:
            return Probe.SILENT
        except aiohttp.ClientConnectorError:
            return Probe.REFUSED  # the connect failed: nobody listens at the URL any more
        except (aiohttp.ClientError, ConnectionError):
            return Probe.SILENT  # closed or reset mid-answer: a miss; the next connect will tell

    async def _probe_loads(self, timeout_s: float) -> SGLangLoads | None:
        """The server's load now, or None (then the last answer stands)."""
        assert self._http is not None
        try:
            async with self._http.get(
                self.cfg.url + "/v1/loads?include=core", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                if resp.status != 200:
                    return None
                return msgspec.json.decode(await resp.read(), type=SGLangLoads)
        except (TimeoutError, aiohttp.ClientError, ConnectionError, msgspec.DecodeError) as exc:
            log.debug("loads poll failed", worker_id=self.cfg.worker_id, error=repr(exc))
            return None

    # -- observability --------------------------------------------------------------------------
    def emit(self, event: str, **fields: Any) -> None:
        """Record an event (`at`: time.monotonic(), one clock for every process on a Linux host)."""
        ev = {"event": event, "worker_id": self.cfg.worker_id, "at": time.monotonic(), **fields}
        self.events.append(ev)
        if self.on_event is not None:
            self.on_event(ev)

        self._signal.set()
        self._signal = asyncio.Event()

    async def wait_event(self, pred: Callable[[dict[str, Any]], bool], timeout_s: float) -> dict[str, Any]:
        """The first recorded event matching `pred`, waiting for new ones up to `timeout_s`."""
        async with asyncio.timeout(timeout_s):
            while True:
                signal = self._signal  # taken before the scan: an event emitted after it sets this one
                for ev in list(self.events):
                    if pred(ev):
                        return ev
                await signal.wait()
