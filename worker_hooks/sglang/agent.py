"""The sidecar agent: one unmodified SGLang server on Lumen's control plane, like Lumen's own workers.

`Sidecar` runs beside one server (at `url`) and attaches to each gateway given (one control session per
gateway, all reporting the same truth) with `worker_hooks.control.ControlClient`; `SGLangRole` is what
differs from Lumen's engine:

- Hello says `engine = "sglang"` and `http_url = url` (the gateway then speaks SGLang's own `/generate`
  to it), the server's pid when the agent launched it, and its capacity from the last `/v1/loads`;
  the incarnation is time-based (microseconds) and strictly increasing across the agent's restarts;
- heartbeats (at the Welcome's interval) carry the server's load: running, waiting and KV tokens used,
  summed over DP ranks, from the last answer of `GET /v1/loads?include=core`, which the agent polls at
  its own modest rate (`poll_interval_s`) and reuses between polls; the phase is LOADING_FULL until
  `GET /ready` answers 200, then SERVING (DRAINING once the gateway says Drain);
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
"""

from __future__ import annotations

import asyncio
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
from worker_hooks.sglang.launcher import ServerExit, ServerProcess

log = structlog.get_logger(__name__)

EventSink = Callable[[dict[str, Any]], None]


def now_us() -> int:
    return time.time_ns() // 1000


@dataclass(frozen=True, slots=True)
class SidecarConfig:
    worker_id: str
    url: str  # the server's http://host:port, as the gateway will reach it
    gateways: tuple[str, ...]  # control-plane host:port of each gateway
    token: str = ""  # the control-plane secret (LUMEN_CONTROL_TOKEN)
    model: str = ""
    failure_domain: str = ""
    poll_interval_s: float = 0.1
    poll_misses: int = 5  # no 200 from /ready for poll_interval_s x poll_misses: the server is lost
    heartbeat_interval_ms: int = 50  # when a Welcome names none
    abort_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.gateways:
            raise ValueError("the agent needs at least one gateway")
        if len(set(self.gateways)) != len(self.gateways):
            raise ValueError(f"a gateway is named twice: {self.gateways}")
        if self.poll_interval_s <= 0 or self.poll_misses < 1:
            raise ValueError("poll_interval_s must be > 0 and poll_misses >= 1")


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
        )

    def heartbeat(self, seq: int, *, full: bool) -> pb.Heartbeat:
        ranks = self.sidecar.loads.loads if self.sidecar.loads is not None else []
        return pb.Heartbeat(
            seq=seq,
            phase=self.phase(),
            running=sum(r.num_running_reqs for r in ranks),
            waiting=sum(r.num_waiting_reqs for r in ranks),
            kv_tokens_used=sum(r.num_used_tokens for r in ranks),
        )

    def command(self, msg: pb.GatewayMessage) -> None:
        kind = msg.WhichOneof("body")
        if kind == "drain":
            log.info("draining", worker_id=self.worker_id)
            self.draining = True
        else:
            # holders, checkpoints and draft assist need Lumen's engine; the gateway sends none to an
            # SGLang worker (its Hello offers no KV or draft endpoint)
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
        self.on_event = on_event
        self.events: deque[dict[str, Any]] = deque(maxlen=1000)
        self.up = False  # /ready said 200 and nothing since said the server is lost
        self.loads: SGLangLoads | None = None  # the last /v1/loads answer
        self.generation = 0  # bumped when the server is lost: polls begun before do not count
        self.last_ready = 0.0  # loop time of the last 200 from /ready
        self.clients = [
            ControlClient(
                SGLangRole(self), address, token=cfg.token, heartbeat_interval_ms=cfg.heartbeat_interval_ms
            )
            for address in cfg.gateways
        ]
        self.server: ServerProcess | None = None
        if launch is not None:
            self.server = ServerProcess(
                launch,
                env=launch_env,
                output=server_output,
                restart=restart,
                on_start=self._server_started,
                on_exit=self._server_exited,
            )
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
        for c in self.clients:
            await c.start()
        self.emit("started", url=self.cfg.url, gateways=list(self.cfg.gateways))

    async def stop(self, grace_s: float = 10.0) -> None:
        """Detach from every gateway (the gateways fail this incarnation at once), then stop the server
        if the agent launched it."""
        for c in self.clients:
            await c.stop()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self.server is not None:
            await self.server.stop(grace_s)
        if self._http is not None:
            await self._http.close()
            self._http = None

    # -- what the server does -------------------------------------------------------------------
    def server_lost(self, reason: str) -> None:
        """The server stopped serving: every gateway must learn it now, not after missed heartbeats."""
        self.generation += 1
        if not self.up:
            return
        self.up = False
        self.loads = None
        ended = sum(c.end_session(reason) for c in self.clients)
        self.emit("server_lost", reason=reason, sessions_ended=ended)
        log.warning("server lost", worker_id=self.cfg.worker_id, reason=reason, sessions_ended=ended)

    def _server_started(self, pid: int) -> None:
        self.server_pid = pid
        self.emit("server_started", pid=pid)

    def _server_exited(self, ex: ServerExit) -> None:
        self.server_pid = None
        self.emit("server_exited", pid=ex.pid, returncode=ex.returncode, seen_at=ex.at)
        self.server_lost(f"server process {ex.pid} exited with {ex.returncode}")

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
                        log.info("server ready", worker_id=cfg.worker_id, url=cfg.url)
                elif probe is Probe.REFUSED:
                    self.server_lost("connection refused")
                elif self.up and now - self.last_ready >= window:
                    self.server_lost(f"/ready {probe.value} for {1000 * (now - self.last_ready):.0f} ms")
            await asyncio.sleep(cfg.poll_interval_s)

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
