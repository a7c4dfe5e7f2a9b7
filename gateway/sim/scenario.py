"""Simulator scenarios (EVALUATION.md "Scenarios"): a cluster, a workload, failures, and knobs.

A scenario is a TOML file in `configs/scenarios/` (or any path). Every table and key is optional
except `cluster.workers`; unknown keys and wrong types are errors that name the key. Workers are
`w0 … w{N−1}`; with D failure domains, worker i is in domain `d{i·D // N}` (contiguous blocks, as
racks are, so a worker's ring successor usually shares its domain).
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NoReturn

import numpy as np

from gateway.config.convert import build
from gateway.core.costmodel import GPUS, MODELS, ReloadSource
from gateway.core.detector import DetectorParams
from gateway.core.dispatch import DispatchParams, ThetaMode
from gateway.core.gray import GrayParams
from gateway.core.holders import HolderParams, ring_key
from gateway.core.outage import OUTAGE_KEYS, OutageParams, outage_params
from gateway.core.pairing import PairingParams
from gateway.core.speculation import ASSIST_MIN_GAIN, ASSIST_MIN_WAITING, check_gate_bounds
from gateway.core.types import LoadParams, ParamError
from gateway.protocol.kv import DEFAULT_PAGE_SIZE
from gateway.protocol.launch import DEFAULT_MAX_RUNNING_REQUESTS

SCENARIO_DIR = Path(__file__).resolve().parents[2] / "configs" / "scenarios"
GiB = 1024**3
# policy defaults come from the core parameters that own them (as the live gateway's config does)
_LOAD, _DISPATCH, _HOLDERS = LoadParams(), DispatchParams(), HolderParams()
_PAIRING, _GRAY = PairingParams(), GrayParams()
_OUTAGE = OutageParams()


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    workers: int = 4
    model: str = "Qwen3-32B"
    gpu: str = "H100-80G"
    tp: int = 0  # 0: the model preset's default
    draft_model: str = "Qwen3-1.7B"
    failure_domains: int = 1
    max_running_requests: int = (
        DEFAULT_MAX_RUNNING_REQUESTS  # batch limit, also the nominal batch of the load estimate
    )
    chunked_prefill_size: int = 8192
    page_size: int = DEFAULT_PAGE_SIZE
    kv_capacity_tokens: int = 0  # 0: from the cost model
    ckpt_budget_bytes: int = 64 * GiB  # host DRAM per holder
    network_bw: float = 25e9  # bytes/s between workers (checkpoint pages); 200 Gb/s
    model_load_s: float = -1.0  # full model reload; < 0: from the cost model
    draft_load_s: float = -1.0  # draft model load (with engine start-up); < 0: from the cost model
    # seeded reload (recovery.reload = "peer"): GPU -> GPU bandwidth per GPU between a seed and the
    # restarting server (0: the GPU preset's `peer_bw`), and the whole reload from a seed, start-up
    # included (< 0: from the cost model; model_load_s overrides only the disk reload)
    peer_bw: float = 0.0
    peer_load_s: float = -1.0


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    source: Literal["synthetic", "trace"] = "synthetic"
    rate: float = 0.0  # requests/s for the whole cluster; 0: rate_per_worker × workers
    rate_per_worker: float = 0.0
    burst_cv: float = 1.0  # coefficient of variation of inter-arrival times (1: Poisson)
    # synthetic lengths (workload.SHAPES): conv (the Azure conv fit), code (~2k-token prompts, ~30-token
    # outputs), long_output (~2k-token prompts, ~450-token outputs)
    shape: Literal["conv", "code", "long_output"] = "conv"
    duration_s: float = 240.0
    trace: str = ""  # CSV path (relative to the repository root, or absolute)
    trace_speedup: float = 1.0
    # trace file missing: false (default) is an error naming the file; true runs the generator at the
    # trace's rate × speedup instead, and the summary says so in capitals (a bad row is always an error)
    fallback: bool = False


@dataclass(frozen=True, slots=True)
class FailureSpec:
    at_s: float = 60.0
    # kill: the process dies (its streams break: detected `recovery.detection_s` later); hang: it
    # stops and answers nothing (detected by silence, core/detector.py; restarted after
    # `recovery.hung_restart_grace_s`); slow: its steps take `slowdown` x longer (a gray failure);
    # capacity: a bound, not a fault: the worker's capacity is gone for its reload as in a kill, but
    # no work is lost and nothing waits for detection (docs/evaluation.md, "The capacity bound")
    kind: Literal["kill", "slow", "hang", "capacity"] = "kill"
    # victims: explicit ids, or a seeded random fraction of the workers, or a failure domain, or the
    # worker holding most checkpoints of a worker that failed earlier (ring successor without any)
    workers: tuple[str, ...] = ()
    fraction: float = 0.0
    domain: str = ""
    holder_of: str = ""
    slowdown: float = 5.0  # kind = "slow": step time multiplier


@dataclass(frozen=True, slots=True)
class RecoverySpec:
    detection_s: float = 0.06  # a kill (a broken stream) is detected this long after
    # hangs are detected by silence: heartbeats this often, judged by the live gateway's detector
    heartbeat_interval_s: float = 0.02
    hung_restart_grace_s: float = 5.0  # a hung worker still FAILED this long is killed and restarted
    restart: bool = True
    alpha: float = _LOAD.alpha
    beta: float = _LOAD.beta
    route_by_checkpoint_load: bool = False  # route new requests by L̂ (the paper) instead of queue
    theta: float = _DISPATCH.theta
    theta_mode: ThetaMode = _DISPATCH.theta_mode
    tau: int = _DISPATCH.tau
    replicas: int = _HOLDERS.replicas
    # applies to load-aware placement only (not the DéjàVu ring)
    exclude_failure_domain: bool = _HOLDERS.exclude_failure_domain
    service_steps: int = _DISPATCH.service_steps
    no_worker_wait_s: float = 5.0
    # where a restart's full weights come from: its own storage, or a seed survivor (gateway.core.reload;
    # falls back to disk when no survivor qualifies or the seed is lost mid-transfer)
    reload: ReloadSource = ReloadSource.DISK
    # step-time factor on a seed while it sends (0: the cost model's `seed_slowdown`, ~1.016 on H100)
    seed_slowdown: float = 0.0
    # issue 17 levers (gateway.core.outage; the live gateway's recovery section): resumed requests go
    # first in their new worker's queue; in Lumen's modes, while a failure's outage or its backlog
    # lasts, the serving workers admit workers/(workers - down) x their batch, at most
    # outage_batch_boost (1: off)
    resumed_first: bool = _OUTAGE.resumed_first
    # stream prompt pages as each prefill chunk writes them (gateway.core.holders.HolderParams)
    stream_prefill: bool = _HOLDERS.stream_prefill
    outage_batch_boost: float = _OUTAGE.batch_boost
    outage_shortest_first: bool = _OUTAGE.shortest_first  # queues by prefill size while recovering
    outage_shortest_first_rate: float = _OUTAGE.shortest_first_rate  # ... aged (tokens per s waited)
    # the boost only where the cost model says it completes requests this many times faster for the
    # load's shape (gateway.core.outage.boost_gain; 0: on every shape)
    outage_boost_min_gain: float = _OUTAGE.boost_min_gain


@dataclass(frozen=True, slots=True)
class GraySpec:
    """Gray-failure handling, as the live gateway's [gray] section (core/gray.py); off by default."""

    enabled: bool = False
    slow_factor: float = _GRAY.slow_factor
    recover_factor: float = _GRAY.recover_factor
    min_peers: int = _GRAY.min_peers
    window_s: float = 5.0
    probation_s: float = 30.0
    migrate: bool = True


@dataclass(frozen=True, slots=True)
class DraftSpec:
    agreement: float = 0.7  # per-token acceptance rate a of the draft model
    k_min: int = 1
    k_max: int = 8
    hysteresis: float = _PAIRING.hysteresis
    max_drafters_per_target: int = _PAIRING.max_drafters_per_target
    # true (default since issue 17): the target also waits, every step, for the drafter's k
    # draft-model decode steps; false: a drafted step costs only the verification of k extra tokens
    drafter_latency: bool = True
    # draft only where the cost model says it pays (gateway.core.speculation.assist_pays; the live
    # gateway's draft.assist_gate, assist_min_gain, assist_min_waiting)
    assist_gate: bool = True
    assist_min_gain: float = ASSIST_MIN_GAIN
    assist_min_waiting: int = ASSIST_MIN_WAITING


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str = "unnamed"
    description: str = ""
    seed: int = 1
    sample_s: float = 1.0  # sampling period of the time series (queue depth, checkpoint load)
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    recovery: RecoverySpec = field(default_factory=RecoverySpec)
    gray: GraySpec = field(default_factory=GraySpec)
    draft: DraftSpec = field(default_factory=DraftSpec)
    failures: tuple[FailureSpec, ...] = ()

    @property
    def worker_ids(self) -> list[str]:
        return [f"w{i}" for i in range(self.cluster.workers)]

    def domain_of(self, index: int) -> str:
        return f"d{index * self.cluster.failure_domains // self.cluster.workers}"

    @property
    def rate(self) -> float:
        w = self.workload
        return w.rate if w.rate > 0 else w.rate_per_worker * self.cluster.workers

    @property
    def failure_at(self) -> float | None:
        return min((f.at_s for f in self.failures), default=None)

    def victims(self, seed: int) -> list[list[str]]:
        """Each failure's workers, the same in every mode (`holder_of` is resolved when it strikes: [])."""
        rng = np.random.default_rng([seed, 7919])
        ids = self.worker_ids
        out: list[list[str]] = []
        for f in self.failures:
            if f.workers:
                out.append(list(f.workers))
            elif f.domain:
                out.append([w for i, w in enumerate(ids) if self.domain_of(i) == f.domain])
            elif f.fraction:
                n = max(1, round(f.fraction * len(ids)))
                out.append(sorted((ids[i] for i in rng.choice(len(ids), n, replace=False)), key=ring_key))
            else:
                out.append([])
        return out


class ScenarioError(ValueError):
    """A scenario file that cannot be used; the message names the key."""


def _fail(key: str, value: object, why: str) -> NoReturn:
    raise ScenarioError(f"{key}: {why}, got {value!r}")


def _core(section: str, make: Callable[[], object], keys: dict[str, str] | None = None) -> None:
    """Bounds of policy parameters are the core's: build them, and name the scenario key on error
    (`section.field`, or `keys[field]` where the scenario's key has another name)."""
    try:
        make()
    except ParamError as exc:
        key = (keys or {}).get(exc.field, f"{section}.{exc.field}")
        raise ScenarioError(f"{key}: {exc.why}, got {exc.value!r}") from exc


def parse_scenario(data: dict[str, Any], name: str = "unnamed") -> Scenario:
    data = {"name": name, **data}
    scenario: Scenario = build(Scenario, data, "", _fail)
    validate(scenario)
    return scenario


def validate(s: Scenario) -> None:
    c, w, r, d = s.cluster, s.workload, s.recovery, s.draft
    checks = [
        (c.workers >= 1, "cluster.workers must be >= 1"),
        (c.model in MODELS, f"cluster.model: unknown preset {c.model!r}; known: {sorted(MODELS)}"),
        (c.draft_model in MODELS, f"cluster.draft_model: unknown preset {c.draft_model!r}"),
        (c.gpu in GPUS, f"cluster.gpu: unknown preset {c.gpu!r}; known: {sorted(GPUS)}"),
        (c.tp >= 0, "cluster.tp must be >= 0"),
        (1 <= c.failure_domains <= c.workers, "cluster.failure_domains must be in [1, workers]"),
        (
            c.max_running_requests >= 1 and c.chunked_prefill_size >= 1 and c.page_size >= 1,
            "cluster.max_running_requests, chunked_prefill_size and page_size must be >= 1",
        ),
        (c.kv_capacity_tokens >= 0 and c.ckpt_budget_bytes >= 0, "cluster capacities must be >= 0"),
        (c.network_bw > 0, "cluster.network_bw must be > 0"),
        (c.peer_bw >= 0, "cluster.peer_bw must be >= 0 (0: the GPU preset's)"),
        (
            r.seed_slowdown == 0 or r.seed_slowdown >= 1,
            "recovery.seed_slowdown must be 0 (the cost model's) or >= 1",
        ),
        (w.source == "trace" or s.rate > 0, "workload: set rate or rate_per_worker (> 0)"),
        (w.source == "synthetic" or w.trace != "", "workload.trace: a trace source needs a path"),
        (
            w.burst_cv > 0 and w.duration_s > 0 and w.trace_speedup > 0,
            "workload.burst_cv, duration_s and trace_speedup must be > 0",
        ),
        (r.detection_s >= 0 and r.no_worker_wait_s >= 0, "recovery times must be >= 0"),
        (0.0 <= d.agreement <= 1.0, "draft.agreement must be in [0, 1]"),
        (0 <= d.k_min <= d.k_max, "draft: need 0 <= k_min <= k_max"),
        (s.sample_s > 0, "sample_s must be > 0"),
        (0 < s.gray.window_s <= s.gray.probation_s, "gray: need 0 < window_s <= probation_s"),
    ]
    for ok, message in checks:
        if not ok:
            raise ScenarioError(message)
    _core("recovery", lambda: LoadParams(r.alpha, r.beta, c.max_running_requests))
    try:
        DetectorParams(interval_s=r.heartbeat_interval_s)
    except ParamError as exc:
        raise ScenarioError(f"recovery.heartbeat_interval_s: {exc.why}, got {exc.value!r}") from exc
    if not r.hung_restart_grace_s >= 0:
        raise ScenarioError(f"recovery.hung_restart_grace_s: must be >= 0, got {r.hung_restart_grace_s!r}")
    _core(
        "recovery", lambda: HolderParams(replicas=r.replicas, exclude_failure_domain=r.exclude_failure_domain)
    )
    _core(
        "recovery",
        lambda: DispatchParams(
            theta=r.theta, theta_mode=r.theta_mode, tau=r.tau, service_steps=r.service_steps
        ),
    )
    _core(
        "draft",
        lambda: PairingParams(hysteresis=d.hysteresis, max_drafters_per_target=d.max_drafters_per_target),
    )
    _core(
        "recovery",
        lambda: outage_params(r),
        OUTAGE_KEYS,
    )
    _core("draft", lambda: check_gate_bounds(d.assist_min_gain, d.assist_min_waiting))
    g = s.gray
    _core("gray", lambda: GrayParams(g.enabled, g.slow_factor, g.recover_factor, g.min_peers))
    ids = set(s.worker_ids)
    domains = {s.domain_of(i) for i in range(c.workers)}
    for i, f in enumerate(s.failures):
        where = f"failures[{i}]"
        chosen = sum(bool(x) for x in (f.workers, f.fraction, f.domain, f.holder_of))
        if chosen != 1:
            raise ScenarioError(f"{where}: set exactly one of workers, fraction, domain, holder_of")
        bad = [x for x in (*f.workers, *([f.holder_of] if f.holder_of else [])) if x not in ids]
        if bad:
            raise ScenarioError(f"{where}: unknown worker(s) {bad}; workers are w0..w{c.workers - 1}")
        if f.domain and f.domain not in domains:
            raise ScenarioError(f"{where}.domain: unknown domain {f.domain!r}; known: {sorted(domains)}")
        if not (0 <= f.fraction <= 1 and f.at_s >= 0 and f.slowdown >= 1):
            raise ScenarioError(f"{where}: need 0 <= fraction <= 1, at_s >= 0, slowdown >= 1")


def scenario_path(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix == ".toml" or p.exists():
        return p
    return SCENARIO_DIR / f"{name_or_path}.toml"


def load_scenario(name_or_path: str) -> Scenario:
    """A scenario by name (configs/scenarios/NAME.toml) or by path."""
    path = scenario_path(name_or_path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        known = ", ".join(scenario_names()) or "none"
        raise ScenarioError(f"no scenario {name_or_path!r} (looked for {path}); known: {known}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{path}: {exc}") from exc
    name = data.pop("name", path.stem)
    return parse_scenario(data, name=name if isinstance(name, str) else path.stem)


def scenario_names() -> list[str]:
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.toml"))
