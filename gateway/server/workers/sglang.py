"""Agentless SGLang servers: the gateway itself attaches, watches and loads them over their own HTTP API.

For each configured server (`[[sglang.workers]]` or `lumen gateway --sglang-url URL`) a poller:

- waits until `GET /ready` answers 200 (never the slow `/health`, which runs a generation), then
  attaches it to the load monitor as an `engine = "sglang"` worker, a new incarnation each time;
- polls `GET /ready` and `GET /v1/loads?include=core` every `sglang.poll_interval_ms`; each answer is
  that worker's heartbeat (running, waiting, KV tokens used, summed over DP ranks), so failure
  detection by silence works as for Lumen's workers, in units of the server's poll period: the poll
  interval plus its normal answer time, learned from its answers (core/polls.py `PollClock`; the
  record's `heartbeat_interval_s`, which retunes its detector);
- lets each poll wait for its answer until the silence it ends would fail the server anyway
  (core/polls.py `poll_timeout_s`, from the thresholds of the detector's last tick): a slow answer is
  a late heartbeat, never a miss (idle real servers on a busy machine took 190–270 ms to answer, and
  SUSPECT flapped while polls were cut at `heartbeat_misses` × interval);
- fails the incarnation at once when a poll's connection is refused or reset; a hung server is
  FAILED by the detector's verdict on its silence (at most max(`health.max_silence_ms`,
  `heartbeat_misses` poll periods) after its last answer), and one that keeps answering 503 on /ready after `health.heartbeat_misses` such answers (its
  running requests resume elsewhere; it re-attaches as a new incarnation once /ready is 200 again).

A watcher never dies of one bad poll: each poll runs in a task of its own under one deadline (an HTTP
client's timeout machinery then cannot leave a stray cancellation on the watcher: aiohttp's timeouts
count as cancellations of the task that awaits them), and an unexpected error is logged and counted as
a missed poll. A watcher that ended anyway is logged and started again.

Broken `/generate` streams fail the incarnation too (sessions report them, as for every worker).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import msgspec
import structlog

from gateway.core.health import ALIVE_STATES
from gateway.core.polls import PollClock, poll_timeout_s
from gateway.protocol import control_pb2 as pb
from gateway.protocol.generate import EngineKind
from gateway.protocol.sglang import SGLangLoads
from gateway.server.workers.monitor import AttachRefused, LoadMonitor, WorkerRecord

log = structlog.get_logger("lumen.sglang")


@dataclass(frozen=True, slots=True)
class SGLangTarget:
    worker_id: str
    url: str
    model: str = ""
    held_batch: int = 0  # the batch the gateway holds it to (held.py); 0: not held


class _Unready(Exception):
    pass


class SGLangPoller:
    def __init__(
        self,
        monitor: LoadMonitor,
        http: aiohttp.ClientSession,
        targets: list[SGLangTarget],
        *,
        poll_interval_s: float,
        misses: int,
    ) -> None:
        self.monitor = monitor
        self.http = http
        self.targets = targets
        self.interval_s = poll_interval_s
        self.misses = misses
        self._tasks: list[asyncio.Task[None]] = []
        self._incarnation: dict[str, int] = {}
        # what each server's answers taught (its answer times, so its poll period), across incarnations
        self.clocks: dict[str, PollClock] = {t.worker_id: PollClock(poll_interval_s) for t in targets}
        self._stopping = False
        # called after each poll that served as a heartbeat (the app's recovery bookkeeping)
        self.heartbeat_hooks: list[Callable[[WorkerRecord], None]] = []

    def start(self) -> None:
        for t in self.targets:
            self._start_watch(t)

    def _start_watch(self, t: SGLangTarget) -> None:
        task = asyncio.create_task(self._watch(t), name=f"sglang-poll-{t.worker_id}")
        task.add_done_callback(lambda done: self._watch_ended(t, done))
        self._tasks.append(task)

    def _watch_ended(self, t: SGLangTarget, task: asyncio.Task[None]) -> None:
        if self._stopping:
            return
        with contextlib.suppress(ValueError):
            self._tasks.remove(task)
        error = None if task.cancelled() else task.exception()
        log.error("sglang_watcher_ended", worker=t.worker_id, error=repr(error), restarting=True)
        self._start_watch(t)

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            # bounded: a poll inside the HTTP client ends by its own deadline at the latest
            _, late = await asyncio.wait(self._tasks, timeout=2 * self.attach_timeout_s + 1.0)
            for task in late:
                log.warning("sglang_watcher_slow_to_stop", task=task.get_name())
        self._tasks.clear()

    # -- one server ------------------------------------------------------------------------------
    async def _watch(self, t: SGLangTarget) -> None:
        rec: WorkerRecord | None = None
        unready = 0
        # not `while True`: Python 3.11's wait_for (in _poll) returns the poll's result, or raises its
        # error, when the stop's cancellation arrives just as the poll ends; the cancellation is lost and
        # only this ends the watcher (else stop() waits out its bound)
        while not self._stopping:
            if (
                rec is None
                or self.monitor.workers.get(t.worker_id) is not rec
                or rec.state not in ALIVE_STATES
            ):
                rec = await self._attach_when_ready(t)
                unready = 0
            clock = self.clocks[t.worker_id]
            sent = self.monitor.clock()
            try:
                loads = await self._poll(t, self._timeout(rec, sent))
            except _Unready:
                unready += 1
                if unready >= self.misses:
                    self.monitor.report_data_failure(t.worker_id, rec.incarnation, "/ready answers 503")
            except (aiohttp.ClientConnectionError, ConnectionError) as exc:
                if not isinstance(exc, aiohttp.ServerTimeoutError):
                    self.monitor.report_data_failure(t.worker_id, rec.incarnation, f"poll: {exc!r}")
            except (TimeoutError, aiohttp.ClientError, msgspec.DecodeError) as exc:
                log.debug("sglang_poll_failed", worker=t.worker_id, error=repr(exc))  # silence decides
            except Exception as exc:  # a bug or a surprise: a missed poll, never a dead watcher
                log.warning("sglang_poll_error", worker=t.worker_id, error=repr(exc))
            else:
                unready = 0
                clock.answered(self.monitor.clock() - sent)
                # its detector judges in units of its poll period from now on (retuned, not reset)
                rec.heartbeat_interval_s = clock.period_s()
                self.monitor.heartbeat(rec, _heartbeat(loads))
                for hook in self.heartbeat_hooks:
                    hook(rec)
            await asyncio.sleep(self.interval_s)

    async def _attach_when_ready(self, t: SGLangTarget) -> WorkerRecord:
        while True:
            if self._stopping:  # a stop's cancellation lost in _poll (see _watch)
                raise asyncio.CancelledError
            try:
                loads = await self._poll(t)
            except (_Unready, TimeoutError, aiohttp.ClientError, ConnectionError, msgspec.DecodeError):
                await asyncio.sleep(self.interval_s)
                continue
            except Exception as exc:
                log.warning("sglang_poll_error", worker=t.worker_id, error=repr(exc))
                await asyncio.sleep(self.interval_s)
                continue
            # microseconds since the epoch, rising: newer than any this gateway fenced before a
            # restart (its fences outlive it, gateway.state_dir), as a Lumen worker's are
            incarnation = max(time.time_ns() // 1000, self._incarnation.get(t.worker_id, 0) + 1)
            self._incarnation[t.worker_id] = incarnation
            first = loads.loads[0] if loads.loads else None
            hello = pb.Hello(
                worker_id=t.worker_id,
                incarnation=incarnation,
                http_url=t.url,
                model=t.model,
                engine=EngineKind.SGLANG,
                phase=pb.SERVING,
                kv_capacity_tokens=sum(r.max_total_num_tokens for r in loads.loads),
                max_running_requests=sum(r.max_running_requests for r in loads.loads) if first else 0,
                held_batch=t.held_batch,
            )
            try:
                rec = self.monitor.attach(hello)
            except AttachRefused as exc:
                log.warning("sglang_attach_refused", worker=t.worker_id, reason=str(exc))
                await asyncio.sleep(self.interval_s)
                continue
            # its detector (primed by the monitor: its earlier incarnation's history, the cap's
            # patience at first) judges in units of its poll period
            rec.heartbeat_interval_s = self.clocks[t.worker_id].period_s()
            self.monitor.heartbeat(rec, _heartbeat(loads))
            log.info("sglang_attached", worker=t.worker_id, url=t.url, incarnation=incarnation)
            return rec

    @property
    def attach_timeout_s(self) -> float:
        """How long a poll of a server not attached may wait: the detector's cap (a server whose answers
        take longer than `misses` intervals must still attach)."""
        return self.monitor.detector_params.max_silence_s

    def _timeout(self, rec: WorkerRecord, now: float) -> float:
        """How long the poll sent now may wait: until the server's silence reaches its fail threshold
        at the detector's last tick (before any tick: the attach phase's)."""
        det = rec.detector
        if det is None:
            return self.attach_timeout_s
        th = rec.thresholds or det.thresholds(now)
        return poll_timeout_s(th, det.silence(now), self.interval_s)

    async def _poll(self, t: SGLangTarget, timeout_s: float | None = None) -> SGLangLoads:
        """/ready, then /v1/loads, within `timeout_s` (default the attach phase's); raises _Unready on
        a non-200 from /ready. The requests run in a task of their own (`wait_for`), so nothing the HTTP client does
        to its task's cancellation state reaches the watcher; a cancellation of that inner task that
        nobody asked for (not a stop of the watcher) counts as a failed poll."""
        try:
            timeout = self.attach_timeout_s if timeout_s is None else timeout_s
            return await asyncio.wait_for(self._fetch(t, timeout), timeout)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the watcher itself is being stopped
            raise TimeoutError("poll cancelled inside the HTTP client") from None

    async def _fetch(self, t: SGLangTarget, timeout_s: float) -> SGLangLoads:
        # the HTTP client's own deadline too: a cancellation lost inside it cannot keep a poll
        # (and stop()) waiting on a server that never answers
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with self.http.get(t.url + "/ready", timeout=timeout) as ready:
            if ready.status != 200:
                raise _Unready()
        async with self.http.get(t.url + "/v1/loads?include=core", timeout=timeout) as loads:
            loads.raise_for_status()
            return msgspec.json.decode(await loads.read(), type=SGLangLoads)


def _heartbeat(loads: SGLangLoads) -> pb.Heartbeat:
    return pb.Heartbeat(
        phase=pb.SERVING,
        running=sum(r.num_running_reqs for r in loads.loads),
        waiting=sum(r.num_waiting_reqs for r in loads.loads),
        kv_tokens_used=sum(r.num_used_tokens for r in loads.loads),
    )
