"""The load monitor's failure detection by silence: the detector's tick, the gateway's own stalls, and
the probes of suspected workers.

The rule is the core's (core/detector.py: each worker's adaptive thresholds, the cluster's verdict);
this is its shell. Every tick (half a heartbeat interval) it forgives the gateway's own stall since
the previous one, measures every live worker's silence, and asks the core for verdicts; the monitor
applies them (the records' states, fences and watchers are its own) and has the probes they ask for
sent from here, to the worker's own HTTP server (probe.py), on a path independent of the heartbeat
stream. An answer that comes after the silence ended is dropped (`WorkerRecord.probe_gen`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

import structlog

from gateway.core import detector as fd
from gateway.core import health
from gateway.core.detector import DetectorParams, HeartbeatDetector, Silence, Verdict
from gateway.protocol.generate import EngineKind
from gateway.server.workers.probe import HttpProbe, Prober
from gateway.server.workers.records import WorkerRecord

log = structlog.get_logger("lumen.monitor")


class SilenceDetection:
    """The detector's state across ticks: the previous tick, the stalls forgiven, the probes out."""

    def __init__(
        self,
        params: DetectorParams,
        *,
        tick_period_s: float,
        correlated_grace_s: float,
        prober: Prober | None,
    ) -> None:
        # the silence rule (core/detector.py); it comes from the [health] section
        self.params = params
        self.tick_period_s = tick_period_s
        self.correlated_grace_s = correlated_grace_s
        # probes suspected Lumen workers (None: `run` makes an HTTP one when probes are on)
        self.prober = prober
        self._probes: set[asyncio.Task[None]] = set()
        self.stall_forgiven_s = 0.0  # the gateway's own stalls, not counted as anyone's silence
        self._last_tick: float | None = None

    def judge(
        self, records: Iterable[WorkerRecord], now: float
    ) -> list[tuple[WorkerRecord, HeartbeatDetector, Verdict]]:
        """Forgive the gateway's own stall, then judge every live record's silence at `now`
        (core/detector.py): each with its detector and its verdict, all made before any is applied."""
        stall = fd.gateway_stall(self._last_tick, now, self.tick_period_s)
        self._last_tick = now
        if stall > 0:
            # the gateway itself stalled (GC, CPU starvation): silence we measured is ours, not theirs
            self.stall_forgiven_s += stall
        judged: list[tuple[WorkerRecord, HeartbeatDetector]] = []
        for rec in records:
            if rec.state in health.ALIVE_STATES:
                det = self.detector_of(rec)
                det.forgive(stall)
                judged.append((rec, det))
        # pauses the other workers showed lately count for each (they stall together on a busy host)
        dets = [det for _, det in judged]
        excess = fd.host_pause(dets, now, 0.0)
        silences: dict[str, Silence] = {}
        for rec, det in judged:
            peers = det.params.interval_s + excess
            # kept on the record: a poller bounds its poll by them, /admin/workers shows them
            rec.thresholds = det.thresholds(now, peers)
            silences[rec.id] = Silence(
                rec.state, det.silence(now), rec.thresholds, det.probe(now), self._probeable(rec)
            )
        verdicts = fd.silence_verdicts(silences, self.correlated_grace_s)
        return [(rec, det, verdicts[rec.id]) for rec, det in judged]

    def detector_of(self, rec: WorkerRecord) -> HeartbeatDetector:
        """`rec`'s detector, for its own heartbeat interval (a polled SGLang server's is its poll
        period, which its poller learns: core/polls.py); a changed interval retunes it, keeping what
        it learned."""
        det = rec.detector
        interval = rec.heartbeat_interval_s or self.params.interval_s
        if det is None:
            det = rec.detector = HeartbeatDetector(self.params.for_interval(interval), rec.last_heartbeat)
        elif det.params.interval_s != interval:
            det.retune(self.params.for_interval(interval))
        return det

    def _probeable(self, rec: WorkerRecord) -> bool:
        """Lumen's workers are probed on their HTTP server; an SGLang server's polls are its heartbeats
        already, and an SGLang sidecar's server says nothing of the sidecar."""
        return (
            self.prober is not None
            and rec.engine is EngineKind.LUMEN
            and rec.heartbeat_interval_s is None
            and bool(rec.http_url)
        )

    def send_probe(self, rec: WorkerRecord, det: HeartbeatDetector, now: float) -> None:
        prober = self.prober
        if prober is None:
            return
        det.probe_sent(now)
        rec.probe_gen += 1
        task = asyncio.get_running_loop().create_task(
            self._probe(prober, rec, rec.probe_gen), name=f"probe-{rec.id}"
        )
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _probe(self, prober: Prober, rec: WorkerRecord, gen: int) -> None:
        try:
            answer = await prober(rec.http_url)
        except Exception as exc:  # a prober's bug is a probe without an answer, never a dead detector
            log.warning("probe_failed", worker=rec.id, error=repr(exc))
            return
        if answer is None or rec.probe_gen != gen or rec.detector is None:
            return  # no answer (the verdict sees the probe still out), or the silence already ended
        rec.detector.probe_answered(answer)
        log.debug("probe_answered", worker=rec.id, incarnation=rec.incarnation, alive=answer)

    async def run(self, tick: Callable[[], None]) -> None:
        """Call `tick` every tick period until cancelled; then cancel the probes still out."""
        own: HttpProbe | None = None
        if self.prober is None and self.params.probe_timeout_s > 0:
            # a probe outlives its verdict's wait only up to the cap, where the silence alone decides
            own = HttpProbe(timeout_s=self.params.max_silence_s)
            self.prober = own
        try:
            while True:
                tick()
                await asyncio.sleep(self.tick_period_s)
        finally:
            for task in list(self._probes):
                task.cancel()
            await asyncio.gather(*self._probes, return_exceptions=True)
            if own is not None:
                self.prober = None
                await own.close()
