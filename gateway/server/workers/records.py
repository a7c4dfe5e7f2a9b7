"""What the gateway knows of one worker incarnation (WorkerRecord), and the state events it emits."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.core.detector import HeartbeatDetector, Thresholds
from gateway.core.determinism import LUMEN_WORKER, Determinism
from gateway.core.health import Phase, WorkerState
from gateway.core.losses import Loss
from gateway.core.types import WorkerView
from gateway.protocol import control_pb2 as pb
from gateway.protocol.generate import EngineKind
from gateway.protocol.kv import DEFAULT_PAGE_SIZE
from gateway.protocol.launch import DEFAULT_MAX_RUNNING_REQUESTS

Clock = Callable[[], float]
FailureCallback = Callable[[str], None]

_PHASES: dict[int, Phase] = {
    pb.LOADING_DRAFT: Phase.LOADING_DRAFT,
    pb.DRAFT_READY: Phase.DRAFT_READY,
    pb.LOADING_FULL: Phase.LOADING_FULL,
    pb.SERVING: Phase.SERVING,
    pb.DRAINING: Phase.DRAINING,
}


def phase_of(value: int) -> Phase:
    return _PHASES.get(value, Phase.LOADING_FULL)


def reload_note(seconds: float, source: str, seed: str) -> str:
    """A reload in the timeline: "reloaded from s1 (peer) in 3.20 s", "reloaded from storage (disk) in
    41.00 s, seed s1 failed"."""
    if source == "peer":
        return f"reloaded from {seed or 'a peer'} (peer) in {seconds:.2f} s"
    failed = f", seed {seed} failed" if seed else ""
    return f"reloaded from storage ({source}) in {seconds:.2f} s{failed}"


@dataclass(frozen=True, slots=True)
class StateEvent:
    t: float
    worker_id: str
    incarnation: int
    src: WorkerState | None
    dst: WorkerState
    reason: str


# the record fields a WorkerView is made of: writing one of them invalidates the record's view
_VIEW_FIELDS = frozenset(
    {
        "id",
        "state",
        "incarnation",
        "running",
        "waiting",
        "kv_tokens_used",
        "kv_capacity_tokens",
        "ckpt_tokens",
        "ckpt_bytes",
        "ckpt_budget_bytes",
        "failure_domain",
        "inflight",
    }
)


@dataclass(slots=True)
class WorkerRecord:
    """Mutable per-worker record; only the monitor changes it (and sessions its `inflight`).

    Its WorkerView is kept until a field it is made of is written (`__setattr__`); the first such
    write after the view was made also puts the record on its monitor's list of changed records, so
    the monitor's ClusterView is updated for those workers only.
    """

    id: str
    incarnation: int
    state: WorkerState
    http_url: str
    kv_endpoint: str = ""
    draft_endpoint: str = ""
    # the CURVE public key of its data planes (Hello.plane_key; "": none, e.g. an agentless SGLang server)
    plane_key: str = ""
    model: str = ""
    tp: int = 0  # tensor parallelism (0: not reported)
    pid: int = 0
    kv_capacity_tokens: int = 1
    ckpt_budget_bytes: int = 0
    failure_domain: str = ""
    page_size: int = DEFAULT_PAGE_SIZE
    engine: EngineKind = EngineKind.LUMEN
    # an SGLang server that orders its queue by each request's priority (its /server_info, read once
    # it serves: gateway/server/workers/server_info.py)
    priority_order: bool = False
    # whether it promises bit-equal replays and honours seeds (core/determinism.py): Lumen's workers by
    # construction; an SGLang server as its /server_info says (UNKNOWN until read: server_info.py)
    determinism: Determinism = LUMEN_WORKER
    # an SGLang server launched with room for the outage boost: the gateway holds it to this batch
    # outside a recovery (Hello.held_batch; 0: not held; gateway/server/workers/held.py)
    held_batch: int = 0
    # an SGLang server's API key (Hello.api_key): the bearer of the gateway's requests to http_url
    # (server_keys.py); "": none. Not shown anywhere
    api_key: str = field(default="", repr=False)
    # seconds between this worker's heartbeats (None: the control plane's interval); an agentless
    # SGLang server's heartbeats are the gateway's own polls of its /v1/loads
    heartbeat_interval_s: float | None = None
    max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS
    # the batch limit the worker reports in force (an outage grant may raise it); 0: none reported
    batch_limit: int = 0
    phase: Phase = Phase.SERVING
    last_heartbeat: float = 0.0
    heartbeats: int = 0
    running: int = 0
    waiting: int = 0
    kv_tokens_used: int = 0
    ckpt_bytes: int = 0
    ckpt_tokens: int = 0
    completed_total: int = 0
    restored_tokens_total: int = 0
    restores_total: int = 0
    ckpt_bytes_sent_total: int = 0
    ckpt_pages_evicted_total: int = 0
    # draft assist, as a target: tokens drafted for it, accepted, and assisted steps
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    draft_rounds: int = 0
    # the reload this incarnation reported (an SGLang agent's relaunch): seconds, "peer"/"disk", seed
    reload_seconds: float | None = None
    reload_source: str = ""
    reload_seed: str = ""
    # requests this gateway has in flight on the worker
    inflight: int = 0
    attached_at: float = 0.0
    failed_at: float | None = None
    failed_by_silence: bool = False  # FAILED by the detector (not a broken stream): maybe hung
    # why its streams were last interrupted (its failure's kind, or DEGRADED): what they raise
    loss: Loss | None = None
    # when it became FAILED or REMOVED (the record expires `record_retention_s` later)
    ended_at: float | None = None
    # failure detection by silence (core/detector.py): this worker's heartbeat history and the probe
    # of its current silence; `probe_gen` tells a probe's answer from an answer to an older one
    detector: HeartbeatDetector | None = None
    # its silence thresholds at the detector's last tick (None before one)
    thresholds: Thresholds | None = None
    probe_gen: int = 0
    # time per output token the gateway measures on this incarnation's streams (EWMA), and when
    # it was last updated; DEGRADED since when (gray failures, core/gray.py)
    per_token_s: float = 0.0
    per_token_at: float | None = None
    degraded_at: float | None = None
    # decayed sums behind per_token_s (see LoadMonitor.observe_tokens)
    token_seconds: float = 0.0
    token_count: float = 0.0
    token_sums_at: float | None = None
    # called once when this incarnation fails; keyed by a subscription id
    watchers: dict[int, FailureCallback] = field(default_factory=dict)
    # set by the monitor to end the control stream of this incarnation
    fence: asyncio.Event = field(default_factory=asyncio.Event)
    # the WorkerView of the current fields (None: to be made), and where to report a change to it
    _view: WorkerView | None = field(default=None, init=False, repr=False, compare=False)
    _changed: list[WorkerRecord] | None = field(default=None, init=False, repr=False, compare=False)

    def __setattr__(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)
        if name in _VIEW_FIELDS:
            try:
                cached = self._view
            except AttributeError:  # __init__ has not set it yet
                return
            if cached is not None:
                object.__setattr__(self, "_view", None)
                if self._changed is not None:
                    self._changed.append(self)

    def view(self) -> WorkerView:
        if self._view is None:
            object.__setattr__(self, "_view", self._make_view())
        assert self._view is not None
        return self._view

    def _make_view(self) -> WorkerView:
        reported = self.running + self.waiting
        return WorkerView(
            id=self.id,
            state=self.state,
            incarnation=self.incarnation,
            running=self.running,
            waiting=self.waiting,
            kv_tokens_used=self.kv_tokens_used,
            kv_capacity_tokens=max(1, self.kv_capacity_tokens),
            ckpt_tokens=self.ckpt_tokens,
            ckpt_bytes=self.ckpt_bytes,
            ckpt_budget_bytes=self.ckpt_budget_bytes,
            failure_domain=self.failure_domain,
            # routed here but not yet visible in the worker's own report
            pending=max(0, self.inflight - reported),
        )


class AttachRefused(Exception):
    pass
