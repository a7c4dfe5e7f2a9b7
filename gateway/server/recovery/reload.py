"""The reload coordinator: which survivor a restarting worker loads its weights from (issue 14).

A restarting Lumen worker started with `engine.reload = "peer"` asks the same way in its Hello
(worker_hooks/engine/seeding.py) and loads from storage when no answer names a seed.

An SGLang agent whose server died re-attaches in LOADING_FULL with `awaiting_seed` in its Hello (or in
its heartbeats, when the session re-attached before the agent saw the exit) and waits a moment (its
`--seed-wait-s`) before relaunching the server. The coordinator answers once per incarnation with
`ReloadFrom{seed_worker_id, seed_url}`: the seed is chosen by the core's pure rule
(`gateway.core.reload.choose_seed`): a HEALTHY SGLang worker of the same model and TP (`Hello.model`,
`Hello.tp`), not already seeding another restart, the least loaded by the recovery-load estimate. With
no such worker nothing is sent and the agent loads from storage (`disk`).

A seed counts as busy from the ReloadFrom until its restart reports its reload, leaves its loading
state, or the seed itself fails: SGLang's seed sends to one destination at a time.

Only where the operator asked for it: with `engine.reload = "disk"` (the default) no SGLang server is
ever named a seed (the choice is recorded as `off`), so its restart loads from storage; `"peer"` turns it
on. (Seen on real SGLang: a peer reload ran though engine.reload was "disk": the agent asks whenever its
`--seed-wait-s` allows.) A Lumen worker asks only when its own `engine.reload`, from the same
configuration, is "peer".

A seed is watched while it sends: SGLang's seed builds the transfer group in its scheduler and serves
nothing until the restarting server joins, while its `/ready` still answers 200 (seen on real SGLang:
the seed hung in that set-up, no answer to `/generate` in 15 s, a request through the gateway hung 35 s,
the seed stayed HEALTHY). So every `probe.interval_s` the coordinator sends an SGLang seed a one-token
`/generate` (a generation probe, not `/ready`); when none answers within `probe.timeout_s` and no
stream of the seed got a token meanwhile, the seed is declared FAILED ("seed stopped generating"): its
streams resume elsewhere, its claim ends, and its agent re-attaches it. Lumen's plugin in the seed
time-boxes the set-up itself (worker_hooks/sglang/plugin_seed.py), so such a seed serves again later.

The agent reports how the reload went with its first SERVING heartbeat (`reload_seconds`,
`reload_source`, `reload_seed`): the monitor puts it in the state timeline (`/admin/events`), and the
coordinator in `lumen_reload_seconds{source}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
import structlog

from gateway.core.costmodel import ReloadSource
from gateway.core.health import ALIVE_STATES, WorkerState
from gateway.core.losses import Loss
from gateway.core.reload import choose_seed
from gateway.core.types import LoadParams
from gateway.protocol import control_pb2 as pb
from gateway.protocol.generate import EngineKind
from gateway.server.metrics import GatewayMetrics
from gateway.server.workers.control import ControlService
from gateway.server.workers.monitor import LoadMonitor, StateEvent, WorkerRecord

log = structlog.get_logger("lumen.reload")

# the engines that reload from a seed: SGLang (`--load-format remote_instance`, its agent) and
# Lumen's workers (worker_hooks/engine/seeding.py)
_SEEDED = frozenset({EngineKind.SGLANG, EngineKind.LUMEN})
# the states a restart waits for its weights in; leaving them ends its claim on the seed
_LOADING = frozenset({WorkerState.JOINING, WorkerState.RESTARTING})


@dataclass(frozen=True, slots=True)
class SeedProbe:
    """How a seed is watched while it sends weights (a generation probe, not `/ready`)."""

    interval_s: float = 1.0  # between two probes
    timeout_s: float = 10.0  # a probe with no token by then (and no stream's token meanwhile): stopped


# a one-token /generate: what a serving SGLang server answers at once, and a hung scheduler never does
ProbeFn = Callable[[WorkerRecord, float], Awaitable[bool]]


@dataclass(frozen=True, slots=True)
class StoppedSeed:
    t: float
    seed: str
    incarnation: int
    restart: str  # the restart it was sending to
    reason: str


@dataclass(frozen=True, slots=True)
class SeedChoice:
    t: float
    worker: str  # the restarting worker
    incarnation: int
    seed: str | None  # None: no seed qualified, or seeding is off (it loads from storage)
    seed_url: str
    off: bool = False  # engine.reload is "disk": no seed is ever named


def deployment_key(rec: WorkerRecord) -> str | None:
    """What a seed must share with the restart: the engine (SGLang servers seed SGLang servers,
    Lumen's workers Lumen's), the model and the TP; None: cannot be matched."""
    if rec.engine not in _SEEDED or not rec.model or rec.tp < 1:
        return None
    return f"{rec.engine.value}\x00{rec.model}\x00tp{rec.tp}"


class ReloadCoordinator:
    def __init__(
        self,
        *,
        monitor: LoadMonitor,
        control: ControlService,
        load_params: LoadParams,
        metrics: GatewayMetrics,
        reload: ReloadSource = ReloadSource.DISK,
        http: Callable[[], aiohttp.ClientSession | None] = lambda: None,
        probe: ProbeFn | None = None,
        probe_params: SeedProbe = SeedProbe(),
    ) -> None:
        """`reload`: the configured `engine.reload` (seeds only with "peer"); `http`: the gateway's client
        session (for the seed probe); `probe`: replaces the HTTP probe (tests)."""
        self.monitor = monitor
        self.control = control
        self.load_params = load_params
        self.metrics = metrics
        self.peer = ReloadSource(reload) is ReloadSource.PEER
        self._http = http
        self._probe = probe if probe is not None else self._generate_probe
        self.probe_params = probe_params
        self.seeding: dict[str, str] = {}  # restarting worker -> the seed it was sent to
        self.answered: dict[str, int] = {}  # worker -> the incarnation last answered
        self.choices: deque[SeedChoice] = deque(maxlen=1000)
        self.stopped: deque[StoppedSeed] = deque(maxlen=1000)  # seeds declared FAILED by the probe
        self._watches: dict[str, asyncio.Task[None]] = {}  # seed -> its probe loop

    async def close(self) -> None:
        """Stop watching seeds (the gateway stops)."""
        tasks, self._watches = list(self._watches.values()), {}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def choose(self, worker_id: str) -> str | None:
        """The seed for `worker_id` now (core rule over the monitor's view), or None."""
        deployment = {
            w.id: key for w in self.monitor.workers.values() if (key := deployment_key(w)) is not None
        }
        return choose_seed(
            self.monitor.view(),
            worker_id,
            self.load_params,
            busy=frozenset(self.seeding.values()),
            deployment=deployment,
        )

    def on_attach(self, rec: WorkerRecord, hello: pb.Hello) -> None:
        if hello.awaiting_seed:
            self.answer(rec)

    def answer(self, rec: WorkerRecord) -> None:
        """Send a restarting worker its seed (once per incarnation), or nothing if none fits."""
        if rec.engine not in _SEEDED or self.answered.get(rec.id) == rec.incarnation:
            return
        self.answered[rec.id] = rec.incarnation
        self.seeding.pop(rec.id, None)  # an earlier incarnation's claim, if any
        if not self.peer and rec.engine is EngineKind.SGLANG:
            # (a Lumen worker asks only when its own engine.reload, from the same config, says "peer";
            # an SGLang agent asks whenever it may, so the gateway's setting decides)
            self.choices.append(SeedChoice(self.monitor.clock(), rec.id, rec.incarnation, None, "", off=True))
            self.metrics.reload_seeds.labels(outcome="off").inc()
            log.info(
                "reload_seed",
                worker=rec.id,
                incarnation=rec.incarnation,
                seed=None,
                why="engine.reload is disk",
            )
            return
        seed = self.choose(rec.id)
        url = self.monitor.workers[seed].http_url if seed is not None else ""
        if seed is not None and not self.control.send(
            rec.id, pb.GatewayMessage(reload_from=pb.ReloadFrom(seed_worker_id=seed, seed_url=url))
        ):
            seed, url = None, ""  # detached meanwhile
        if seed is not None:
            self.seeding[rec.id] = seed
            self._watch(seed)
        self.choices.append(SeedChoice(self.monitor.clock(), rec.id, rec.incarnation, seed, url))
        self.metrics.reload_seeds.labels(outcome="seed" if seed is not None else "none").inc()
        log.info("reload_seed", worker=rec.id, incarnation=rec.incarnation, seed=seed, seed_url=url or None)

    def on_heartbeat(self, rec: WorkerRecord, hb: pb.Heartbeat) -> None:
        if hb.awaiting_seed:
            self.answer(rec)
        if not hb.reload_source:
            return
        self.seeding.pop(rec.id, None)
        self.metrics.reload_seconds.labels(source=hb.reload_source).observe(max(0.0, hb.reload_seconds))
        log.info(
            "reloaded",
            worker=rec.id,
            incarnation=rec.incarnation,
            seconds=round(hb.reload_seconds, 3),
            source=hb.reload_source,
            seed=hb.reload_seed or None,
        )

    def seed_claims(self, ev: StateEvent) -> None:
        """The claims a state change ends (the recovery coordinator calls it on every one)."""
        if ev.worker_id in self.seeding and ev.dst not in _LOADING:
            del self.seeding[ev.worker_id]  # it serves (or failed again): its seed is free
        if ev.dst in (WorkerState.FAILED, WorkerState.REMOVED):
            for restart in [w for w, s in self.seeding.items() if s == ev.worker_id]:
                del self.seeding[restart]  # the seed died: the restart falls back to storage itself

    # -- the seed's generation probe ---------------------------------------------------------------
    def _watch(self, seed: str) -> None:
        """Probe an SGLang seed while it is one (one loop per seed)."""
        rec = self.monitor.workers.get(seed)
        if rec is None or rec.engine is not EngineKind.SGLANG:
            return
        task = self._watches.get(seed)
        if task is not None and not task.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a synchronous caller, tests): nothing to watch with
            return
        self._watches[seed] = loop.create_task(self._watch_seed(rec), name=f"seed-probe-{seed}")

    def _restart_of(self, seed: str) -> str | None:
        return next((w for w, s in self.seeding.items() if s == seed), None)

    async def _watch_seed(self, rec: WorkerRecord) -> None:
        """Until `rec` is no longer a seed (or no longer this incarnation, or failed): a one-token probe
        every interval; a probe unanswered in its timeout, with no token from any of the seed's streams
        meanwhile, declares the seed FAILED."""
        p = self.probe_params
        try:
            while True:
                restart = self._restart_of(rec.id)
                if (
                    restart is None
                    or self.monitor.workers.get(rec.id) is not rec
                    or rec.state not in ALIVE_STATES
                ):
                    return
                start = self.monitor.clock()
                answered = await self._probe(rec, p.timeout_s)
                streamed = rec.token_sums_at is not None and rec.token_sums_at >= start
                restart = self._restart_of(rec.id)
                if answered or streamed or restart is None:
                    await asyncio.sleep(p.interval_s)
                    continue
                if self.monitor.workers.get(rec.id) is not rec or rec.state not in ALIVE_STATES:
                    return
                reason = (
                    f"seed stopped generating: no token from a 1-token /generate in {p.timeout_s:g} s "
                    f"while sending weights to {restart}"
                )
                self.stopped.append(
                    StoppedSeed(self.monitor.clock(), rec.id, rec.incarnation, restart, reason)
                )
                self.metrics.reload_seeds.labels(outcome="seed_stopped").inc()
                log.warning(
                    "seed_stopped_generating", seed=rec.id, incarnation=rec.incarnation, restart=restart
                )
                # FAILED: its streams resume elsewhere, its claim ends (seed_claims), it is fenced
                self.monitor.detach(rec, reason, Loss.HUNG)
                return
        finally:
            if self._watches.get(rec.id) is asyncio.current_task():
                del self._watches[rec.id]

    async def _generate_probe(self, rec: WorkerRecord, timeout_s: float) -> bool:
        """Whether the SGLang server `rec` answers a one-token greedy /generate within `timeout_s`."""
        http = self._http()
        if http is None or not rec.http_url:
            return True  # nothing to probe with: not a verdict
        body = {
            "rid": f"lumen-seed-probe-{uuid.uuid4().hex[:16]}",
            "input_ids": [0],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        }
        with contextlib.suppress(TimeoutError, aiohttp.ClientError, OSError):
            async with asyncio.timeout(timeout_s):
                async with http.post(f"{rec.http_url}/generate", json=body) as resp:
                    await resp.read()
                    # any answer means its scheduler ran the request (a 4xx too: it was parsed)
                    return True
        return False
