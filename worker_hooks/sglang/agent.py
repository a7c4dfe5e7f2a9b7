"""The sidecar agent: one unmodified SGLang server on Lumen's control plane, like Lumen's own workers.

`Sidecar` runs beside one server (at `url`) and attaches to each gateway given (one control session per
gateway, all reporting the same truth) with `worker_hooks.control.ControlClient`; `SGLangRole`
(agent_role.py) is what differs from Lumen's engine. The sidecar owns what the sessions report:

- the server's load: the last answer of `GET /v1/loads?include=core` (server_http.py), which the agent
  polls at its own modest rate (`poll_interval_s`) and reuses between polls; whether it is up: `GET
  /ready` answered 200 and nothing since said the server is lost;
- the KV plane's security for the server (plane_file.py): the server's CURVE keys, and the gateways'
  `Members` in the server's 0600 plane file, whose path a server the agent launches gets in its
  environment (`LUMEN_PLANE_FILE`);
- with Lumen's storage backend in the server (a `kv_endpoint`), its holder stores' status: the last
  answer of the stores' status sockets (`holder_report`), polled at `poll_interval_s` with a timeout of
  the same, one socket per rank (`holder_shards`, default `tp`), the minimum over ranks;
- the server's process when the agent launched it (launcher.py), and its seeded reloads
  (agent_reload.py);
- the events it records (`emit`, `wait_event`).

A server that stops serving ends every session at once (the gateway fails the incarnation within
milliseconds, not after missed heartbeats): its exit, seen by the launcher's child-exit watcher when
the agent launched it; a refused or reset connection on a poll otherwise; or no 200 from `/ready` for
longer than the server's answers make normal (a hung or unready server): the gateway's rule for
polled servers (gateway/core/polls.py: the heartbeat detector in units of the server's poll period,
`poll_interval_s` plus its median answer time, with floor `poll_misses` periods; at most
max(`DetectorParams.max_silence_s`, 3 s, `poll_misses` periods) after the last 200). The sessions then re-attach as new
incarnations in LOADING_FULL and report SERVING once `/ready` is 200 again (after the launcher has
restarted the server, or whoever runs it did).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import structlog

from gateway.core.health import WorkerState
from gateway.core.polls import (
    DetectorParams,
    HeartbeatDetector,
    PollClock,
    poll_timeout_s,
    poll_verdict,
    prime,
)
from gateway.protocol.planes import PlaneAuth
from gateway.protocol.sglang import SGLangLoads
from worker_hooks.control import ControlClient
from worker_hooks.sglang.agent_config import SidecarConfig
from worker_hooks.sglang.agent_draft import RestartDrafter
from worker_hooks.sglang.agent_reload import Reloader
from worker_hooks.sglang.agent_role import SGLangRole
from worker_hooks.sglang.holder_report import HolderPoller, HolderReport
from worker_hooks.sglang.launcher import ServerExit, ServerProcess, cpu_environment, host_port
from worker_hooks.sglang.plane_file import ServerPlanes
from worker_hooks.sglang.server_http import Probe, ServerHttp

log = structlog.get_logger(__name__)

EventSink = Callable[[dict[str, Any]], None]


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
        # seeded reload (agent_reload.py); `launch` is the command loading from storage
        self.reloader = Reloader(
            cfg,
            list(launch) if launch is not None else None,
            seeding=launch is not None and restart and cfg.seed_wait_s > 0,
            emit=self.emit,
            kill=self._kill_server,
        )
        if launch is not None:
            base = dict(launch_env if launch_env is not None else os.environ)
            self.server = ServerProcess(
                launch,
                # on CPU (--device cpu) what an unmodified SGLang needs there (launcher.cpu_environment)
                env={**base, **cpu_environment(launch, base), **self.planes.env},
                output=server_output,
                restart=restart,
                on_start=self._server_started,
                on_exit=self._server_exited,
                next_command=self.reloader.next_command,
            )
        # with a draft model, the drafter of its relaunches (agent_draft.py); bound at start
        self.drafter: RestartDrafter | None = None
        if cfg.draft_model and launch is not None and restart:
            self.drafter = RestartDrafter(
                cfg.worker_id,
                cfg.draft_model,
                auth=PlaneAuth(self.planes.keys, self.planes.members),
                host=host_port(cfg.url)[0],
                device=cfg.draft_device,
                draft_timeout_ms=cfg.draft_timeout_ms,
                emit=self.emit,
            )
        self.server_pid: int | None = None
        self.exited = asyncio.Event()  # the launched server exited and will not be restarted
        self._signal = asyncio.Event()  # set (and replaced) by every emit
        self.http = ServerHttp(cfg.url, cfg.worker_id, cfg.api_key)
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        if self.http.is_open:
            raise RuntimeError("sidecar already started")
        self.http.open()
        if self.drafter is not None:
            await self.drafter.start()  # bound before the first Hello, which names its endpoint
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
        timer = self.reloader.take_timer()
        tasks = [*self._tasks, *([timer] if timer is not None else [])]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        if self.server is not None:
            await self.server.stop(grace_s)
        await self.http.close()
        if self.drafter is not None:
            await self.drafter.close()
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
        if self.drafter is not None and self.server is not None:
            self.drafter.relaunching()  # before the sessions end: their next Hello says LOADING_DRAFT
        if self.holders is not None:
            self.holders.forget()
        ended = sum(c.end_session(reason) for c in self.clients)
        self.emit("server_lost", reason=reason, sessions_ended=ended)
        log.warning("server lost", worker_id=self.cfg.worker_id, reason=reason, sessions_ended=ended)

    def _server_started(self, pid: int) -> None:
        self.server_pid = pid
        self.reloader.started(pid)

    def _server_exited(self, ex: ServerExit) -> None:
        self.server_pid = None
        self.reloader.exited(ex)
        self.emit("server_exited", pid=ex.pid, returncode=ex.returncode, seen_at=ex.at)
        self.server_lost(f"server process {ex.pid} exited with {ex.returncode}")

    def _kill_server(self) -> None:
        if self.server is not None:
            self.server.kill()

    async def _run_server(self) -> None:
        assert self.server is not None
        await self.server.run()  # returns only when the server exited for good (restart off)
        self.exited.set()

    async def abort_all(self) -> None:
        """Ask the server to abort every request it runs (best effort, bounded)."""
        result = await self.http.abort_all(self.cfg.abort_timeout_s)
        if result.status is not None:
            self.emit("abort_all", ok=result.status == 200, status=result.status)
        else:
            self.emit("abort_all", ok=False, error=result.error)
            log.info("abort_all failed", worker_id=self.cfg.worker_id, error=result.error)

    # -- polling --------------------------------------------------------------------------------
    async def _poll(self) -> None:
        loop = asyncio.get_running_loop()
        cfg = self.cfg
        # /ready's 200s are the server's heartbeats, judged as the gateway judges polled servers
        # (gateway/core/polls.py): in units of its poll period, learned from its answer times
        # (the floor, poll_misses periods, may pass the default cap on silence: the cap follows it, or
        # the rule refuses to build and the poll task dies: no server would ever be seen ready)
        floor_s = cfg.poll_interval_s * cfg.poll_misses
        rule = DetectorParams(
            interval_s=cfg.poll_interval_s,
            misses=cfg.poll_misses,
            max_silence_s=max(DetectorParams().max_silence_s, floor_s),
        )
        clock = PollClock(cfg.poll_interval_s)
        det = HeartbeatDetector(rule, loop.time())  # replaced when the server comes up
        while True:
            generation = self.generation
            sent = loop.time()
            # a poll may wait until the silence it ends would be a failure (not up: the cap)
            window = (
                poll_timeout_s(det.thresholds(sent), det.silence(sent), cfg.poll_interval_s)
                if self.up
                else rule.max_silence_s
            )
            probe = await self.http.ready(window)
            answered = loop.time()
            answers = probe in (Probe.READY, Probe.UNREADY)  # a loading server may know its capacity
            loads = await self.http.loads(window) if answers else None
            if generation == self.generation:  # the server was not lost meanwhile
                now = loop.time()
                if loads is not None:
                    self.loads = loads
                if probe is Probe.READY:
                    self.last_ready = now
                    clock.answered(answered - sent)
                    if self.up:
                        det.retune(clock.params(rule))
                        det.beat(answered)
                    else:  # what the previous one learned, and patience at first (polls.prime)
                        det, earlier = HeartbeatDetector(clock.params(rule), answered), det
                        prime(det, answered, earlier)
                        self.up = True
                        if self.drafter is not None:
                            self.drafter.served()
                        self.emit("server_ready")
                        if self.server_pid is not None and not self.reloader.attempt.ready:
                            self.reloader.ready()
                        log.info("server ready", worker_id=cfg.worker_id, url=cfg.url)
                elif probe is Probe.REFUSED:
                    self.server_lost("connection refused")
                elif self.up and (verdict := poll_verdict(det, now)).state is WorkerState.FAILED:
                    self.server_lost(f"/ready {probe.value}: {verdict.why}")
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
