"""The gateway's configuration schema: one frozen dataclass per TOML section.

Policy defaults (θ, τ, α, β, replicas, pairing, gray-failure factors) are read from the core parameter
dataclasses that own them, wire defaults (page size, backends, eviction) from gateway.protocol; a
section only adds what is the gateway's own (ports, limits, timeouts). Bounds live with the owner
too: validate.py checks a section by building the core parameters from it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from gateway.core.costmodel import ReloadSource
from gateway.core.detector import DetectorParams
from gateway.core.dispatch import DispatchParams, ThetaMode
from gateway.core.gray import GrayParams
from gateway.core.holders import HolderParams
from gateway.core.modes import DispatchRule, Placement, RecoveryPolicy, policy_for
from gateway.core.outage import OutageParams
from gateway.core.pairing import PairingParams
from gateway.core.speculation import ASSIST_MIN_GAIN, ASSIST_MIN_WAITING
from gateway.core.types import LoadParams
from gateway.protocol.kv import DEFAULT_PAGE_SIZE
from gateway.protocol.launch import DEFAULT_MAX_RUNNING_REQUESTS, Backend, Eviction

GiB = 1024**3

# a holder's host memory for other servers' pages: SGLang's HiCache backend and the torch backend hold
# real pages, so the default must fit the machine it runs on
HOLDER_BUDGET_CAP = 64 * GiB
HOLDER_BUDGET_RAM_FRACTION = 0.25


def machine_holder_budget(physical_bytes: int | None = None) -> int:
    """The default `checkpoint.budget_bytes`: min(64 GiB, a quarter of the machine's physical memory);
    64 GiB where the memory cannot be read."""
    if physical_bytes is None:
        try:
            physical_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):
            return HOLDER_BUDGET_CAP
    if physical_bytes <= 0:
        return HOLDER_BUDGET_CAP
    return min(HOLDER_BUDGET_CAP, int(physical_bytes * HOLDER_BUDGET_RAM_FRACTION))


DEFAULT_HOLDER_BUDGET = machine_holder_budget()

_LOAD = LoadParams()
_DISPATCH = DispatchParams()
_HOLDERS = HolderParams()
_PAIRING = PairingParams()
_OUTAGE = OutageParams()
_GRAY = GrayParams()
_DETECT = DetectorParams()


class LogFormat(StrEnum):
    CONSOLE = "console"
    JSON = "json"


class TokenizerKind(StrEnum):
    BYTE = "byte"  # Lumen's byte vocabulary (synthetic workers)
    HF = "hf"  # a HuggingFace tokenizer.json


@dataclass(frozen=True, slots=True)
class GatewaySection:
    host: str = "127.0.0.1"
    port: int = 8000
    control_host: str = "127.0.0.1"
    control_port: int = 50151  # 0: the OS picks (local clusters)
    served_model_name: str = "lumen-synthetic"
    # bearer keys for the client API; empty: no auth. Also from LUMEN_API_KEYS (comma-separated).
    api_keys: tuple[str, ...] = ()
    # bearer keys for /admin; empty: the gateway generates one and keeps it in a 0600 file of the
    # per-user runtime directory (admin-key-<port>, where `lumen cluster status/kill` find it); the
    # admin API is never open. Also from LUMEN_ADMIN_API_KEYS.
    admin_api_keys: tuple[str, ...] = ()
    # /metrics without a key (what Prometheus scrapers expect): counts, latencies and states, no
    # prompt, output or secret, API keys only by key_id. false: /metrics needs a client API key or an
    # admin key as its bearer (issue 29)
    metrics_public: bool = True
    # resumable streams (`id:` lines, `Last-Event-ID`, keep-alive comments; gateway/protocol/streamid.py):
    # false: only for requests that ask (header `Lumen-Resumable: 1`) and the keys below; other streams
    # are framed as SGLang and OpenAI servers frame them. true: every stream
    resumable_streams: bool = False
    # key ids (`key-` + 8 hex digits, as in the logs and metrics) whose every stream is resumable
    resumable_keys: tuple[str, ...] = ()
    # a CSV trace of the traffic (arrival, prompt and output tokens; no text) in the layout `lumen sim
    # --trace` and `lumen tune --trace` read (gateway/server/trace_recorder.py); "": none
    record_trace: str = ""
    record_trace_max_bytes: int = 64 * 1024 * 1024  # past this the file is rotated to PATH.1
    # shared secret workers present in Hello. Also from LUMEN_CONTROL_TOKEN. Empty: the gateway
    # generates one at start and writes it to control_token_file (gateway/protocol/secrets.py)
    control_token: str = ""
    # a 0600 file: read for the token when set and present (also LUMEN_CONTROL_TOKEN_FILE); where a
    # generated token is written (default: $XDG_RUNTIME_DIR/lumen/control-token-<control port>)
    control_token_file: str = ""
    # TLS for the control plane (PEM files); required, with a token, when control_host is not
    # loopback, unless control_insecure says the operator accepts a plaintext control plane
    control_tls_cert: str = ""
    control_tls_key: str = ""
    control_insecure: bool = False
    # accept on `port` with SO_REUSEPORT, beside other gateway processes of one cluster (all cores)
    reuse_port: bool = False
    # a directory for state that must outlive the process: the fences (worker incarnations this
    # gateway declared failed, refused again after a restart; gateway/server/workers/fences.py).
    # Empty: none, and a restarted gateway forgets its fences. One directory per gateway process.
    state_dir: str = ""
    log_level: str = "info"
    log_format: LogFormat = LogFormat.CONSOLE


@dataclass(frozen=True, slots=True)
class LimitsSection:
    max_request_bytes: int = 4 * 1024 * 1024
    max_prompt_tokens: int = 32768
    max_new_tokens: int = 8192  # upper bound on max_tokens a client may ask for
    default_max_tokens: int = 256
    max_concurrent_requests: int = 8192
    max_n: int = 16  # the most choices (`n`) one request may ask for; each is a session of its own
    # a connection has this long, from when it opens or its last response ends, to send a whole
    # request head (slowloris); it is also the idle keep-alive time
    header_timeout_s: float = 30.0
    # a request body must arrive whole within this; also how long an unread body is drained after
    # an early answer (401, 413, ...) before the connection closes
    body_timeout_s: float = 30.0
    # a streaming response that has written nothing this long since its headers (a recovery pause, a
    # resumed stream replaying what its client already has) writes the SSE comment `: keep-alive`,
    # so a client's read timeout tells a working gateway from a partitioned one; 0: never
    sse_keepalive_s: float = 1.0
    # per API key (per client address when no keys are configured), 429 + Retry-After beyond; 0: unlimited
    per_key_max_concurrent: int = 0
    per_key_rate_per_s: float = 0.0  # requests per second, a token bucket refilled continuously
    per_key_burst: int = 0  # the bucket's size; 0: the rate rounded up (at least 1)
    # fair shares of work between keys (issue 29; server/api/admission.py): work in flight, in tokens
    # (each choice's prompt + max new tokens, released as they are done), up to this per healthy
    # worker; beyond it jobs queue per key and the least served key goes next, while a key with
    # nothing in flight always starts at once. About 4 prefill chunks of 8192. 0: off
    work_per_worker_tokens: int = 32768
    work_queue_timeout_s: float = 60.0  # a job queued longer than this is refused (429)


@dataclass(frozen=True, slots=True)
class TokenizerSection:
    kind: TokenizerKind = TokenizerKind.BYTE
    path: str = ""  # tokenizer.json for kind = "hf"
    chat_template: str = ""  # path to a Jinja chat template; "": the built-in default
    eos_token_ids: tuple[int, ...] = ()  # extra stop ids; the tokenizer's own EOS is always added


@dataclass(frozen=True, slots=True)
class ModelSection:
    preset: str = "Qwen3-32B"  # cost-model preset (gateway/core/costmodel.py)
    gpu: str = "H100-80G"
    tp: int = 0  # 0: the preset's default


@dataclass(frozen=True, slots=True)
class EngineSection:
    """Lumen's own workers (synthetic or torch backend)."""

    backend: Backend = Backend.SYNTHETIC
    time_scale: float = 1.0  # modelled seconds x time_scale = wall seconds
    page_size: int = DEFAULT_PAGE_SIZE
    max_running_requests: int = (
        DEFAULT_MAX_RUNNING_REQUESTS  # also the nominal batch size of the load estimate
    )
    chunked_prefill_size: int = 8192
    kv_capacity_tokens: int = 0  # 0: from the cost model
    model_load_s: float = -1.0  # < 0: from the cost model (weights / load bandwidth + start-up)
    draft_load_s: float = -1.0  # restart: draft model load time; < 0: from the cost model
    model_seed: int = 0
    # where a restart's full weights come from: "disk" (its storage) or "peer" (a running worker the
    # gateway names, storage if none: seeded reload, worker_hooks/engine/seeding.py)
    reload: ReloadSource = ReloadSource.DISK
    peer_load_s: float = -1.0  # restart from a peer: load time; < 0: from the cost model


@dataclass(frozen=True, slots=True)
class TorchSection:
    """The torch backend's model (engine.backend = "torch"); [model] still names the cost-model preset
    the gateway estimates load with."""

    model: str = "tiny"  # a preset (tiny, tiny-llama, qwen3-8b, ...: random weights) or a HF folder
    draft: str = "tiny-draft"  # a preset, a HF folder, "self:N" (the target's first N layers) or ""
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "cpu"  # cpu | cuda | cuda:N
    threads: int = 1  # intra-op threads per worker process (0: torch's default)


@dataclass(frozen=True, slots=True)
class HealthSection:
    """Failure detection by silence (core/detector.py: adaptive thresholds, confirmed by a probe)."""

    heartbeat_interval_ms: int = 20
    heartbeat_misses: int = _DETECT.misses  # FAILED never before this many intervals of silence
    # when most workers go silent at once, the gateway is the likelier culprit: wait this long
    correlated_silence_s: float = 1.0
    detector_window: int = _DETECT.window  # heartbeat gaps the adaptive thresholds are learnt from
    phi_suspect: float = _DETECT.phi_suspect  # SUSPECT past this suspicion level (φ-accrual)
    phi_fail: float = _DETECT.phi_fail  # FAILED past this one (and the floors, and a probe)
    min_std_ratio: float = _DETECT.min_std_ratio  # the gaps' deviation is taken as >= this x interval
    pause_factor: float = _DETECT.pause_factor  # FAILED never before this x the longest recent gap
    pause_half_life_s: float = _DETECT.pause_half_life_s  # a long gap is remembered, halving this often
    # a suspected Lumen worker's /health is probed; unanswered this long confirms FAILED (0: no probe)
    probe_timeout_ms: int = round(1000 * _DETECT.probe_timeout_s)
    max_silence_ms: int = round(1000 * _DETECT.max_silence_s)  # FAILED after this silence, whatever else
    # FAILED and REMOVED worker records (of workers that never came back) are dropped after this
    record_retention_s: float = 300.0

    def detector(self) -> DetectorParams:
        return DetectorParams(
            interval_s=self.heartbeat_interval_ms / 1000,
            misses=self.heartbeat_misses,
            window=self.detector_window,
            phi_suspect=self.phi_suspect,
            phi_fail=self.phi_fail,
            min_std_ratio=self.min_std_ratio,
            pause_factor=self.pause_factor,
            pause_half_life_s=self.pause_half_life_s,
            probe_timeout_s=self.probe_timeout_ms / 1000,
            max_silence_s=self.max_silence_ms / 1000,
        )


@dataclass(frozen=True, slots=True)
class LoadSection:
    alpha: float = _LOAD.alpha
    beta: float = _LOAD.beta
    # new requests go to the least queue (False) or the least L̂ with its checkpoint term (the paper)
    route_by_checkpoint_load: bool = False


@dataclass(frozen=True, slots=True)
class CheckpointSection:
    enabled: bool = True
    budget_bytes: int = DEFAULT_HOLDER_BUDGET  # per holder, host DRAM: min(64 GiB, RAM / 4)
    replicas: int = _HOLDERS.replicas
    eviction: Eviction = Eviction.SHORTEST_PREFIX_FIRST
    exclude_failure_domain: bool = _HOLDERS.exclude_failure_domain
    orphan_ttl_s: float = 600.0
    # the synthetic backend sends real bytes of modelled size x payload_scale (small on CPU)
    payload_scale: float = 0.001
    frame_bytes: int = 1024 * 1024  # group pages into frames of at least this size where possible
    max_lag_bytes: int = 256 * 1024 * 1024  # sender queue per holder beyond which a checkpoint is abandoned
    # stream prompt pages as each prefill chunk writes them (simulator only; off: it did not pay)
    stream_prefill: bool = _HOLDERS.stream_prefill


@dataclass(frozen=True, slots=True)
class GraySection:
    """Gray failures: a worker far slower per token than its peers is DEGRADED (core/gray.py)."""

    # off by default: in the simulator, excluding a slow worker cost more TTFT than it saved, because
    # the queue-based router already gives it less work (docs/results.md, "Gray failures")
    enabled: bool = False
    slow_factor: float = _GRAY.slow_factor  # DEGRADED above this x the median time per token of its peers
    recover_factor: float = _GRAY.recover_factor  # HEALTHY again below this x (hysteresis)
    min_peers: int = _GRAY.min_peers  # measured peers needed for a verdict
    window_s: float = 5.0  # a measurement older than this does not count
    probation_s: float = 30.0  # an unmeasured DEGRADED worker gets requests again after this
    check_interval_s: float = 0.5
    migrate: bool = True  # move a degraded worker's running requests elsewhere (else they finish there)
    half_life_s: float = 2.0  # the measured time per token forgets with this half-life
    min_tokens: int = 32  # tokens a measurement needs before it counts

    def params(self) -> GrayParams:
        return GrayParams(self.enabled, self.slow_factor, self.recover_factor, self.min_peers)


@dataclass(frozen=True, slots=True)
class RecoverySection:
    mode: str = (
        "lumen"  # none | stop_restart | fixed_checkpoint | lumen | lumen-no-draft | ... (core/modes.py)
    )
    dispatch_rule: DispatchRule = _DISPATCH.rule  # threshold (the paper's) | cost
    theta: float = _DISPATCH.theta
    theta_mode: ThetaMode = _DISPATCH.theta_mode  # relative (x survivors' mean load) | absolute
    tau: int = _DISPATCH.tau  # tokens
    placement: Placement = _HOLDERS.placement  # load_aware | ring (ablation lumen-fixed-placement)
    always_holder: bool = False  # ablation lumen-always-holder
    draft_assist: bool = True  # ablation lumen-no-draft
    # issue 17 (gateway.core.outage): resumed requests first in their new worker's queue; in Lumen's
    # modes, while a failure's outage or backlog lasts, the serving workers' batch limit x what keeps
    # the cluster's batch slots, at most outage_batch_boost (1: off; Lumen's workers, not SGLang's)
    resumed_first: bool = _OUTAGE.resumed_first
    outage_batch_boost: float = _OUTAGE.batch_boost
    outage_shortest_first: bool = _OUTAGE.shortest_first  # queues by prefill size (SGLang: priorities)
    outage_shortest_first_rate: float = _OUTAGE.shortest_first_rate  # ... aged: tokens per s waited
    # the boost only where the cost model says it makes a worker complete requests this many times
    # faster for the load's shape (gateway.core.outage.boost_gain: not on code-like loads; 0: always)
    outage_boost_min_gain: float = _OUTAGE.boost_min_gain
    max_attempts: int = 4  # worker attempts per request, the first included
    first_token_timeout_s: float = 120.0
    stall_timeout_s: float = 10.0  # between chunks once a stream has started
    no_worker_wait_s: float = 5.0  # how long a request waits for a HEALTHY worker before failing
    # a Lumen worker keeps a request running this long after its gateway's connection drops, for
    # another gateway to adopt when the client resumes its stream there (0: abort at once)
    orphan_grace_s: float = 30.0
    # a stream id (Last-Event-ID) older than this, from its response's `created`, resumes nothing
    # (400 expired_last_event_id): whoever holds an old id and its body cannot read the rest of that
    # stream forever (issue 29). Longer than the longest stream plus a client's reconnection
    resume_ttl_s: float = 3600.0


@dataclass(frozen=True, slots=True)
class DraftPair:
    target: str
    draft: str


@dataclass(frozen=True, slots=True)
class DraftSection:
    pairs: tuple[DraftPair, ...] = (
        DraftPair("Qwen3-32B", "Qwen3-1.7B"),
        DraftPair("Qwen3-14B", "Qwen3-0.6B"),
        DraftPair("Qwen3-8B", "Qwen3-0.6B"),
        DraftPair("Llama-3-70B", "Llama-3.2-1B"),
        DraftPair("Llama-3.1-8B", "Llama-3.2-1B"),
    )
    k_min: int = 1
    k_max: int = 8
    k_initial: int = 4
    draft_timeout_ms: int = 30
    agreement: float = 0.7  # synthetic draft/target per-token agreement probability
    hysteresis: float = (
        _PAIRING.hysteresis
    )  # re-pair only if another target's load exceeds the current by this
    max_drafters_per_target: int = _PAIRING.max_drafters_per_target
    # draft only where the cost model says it pays (issue 17): the target has at least
    # assist_min_waiting requests waiting and drafting (drafter latency and target batch modelled)
    # speeds its batch up by at least assist_min_gain; false: wherever Algorithm 3 pairs
    assist_gate: bool = True
    assist_min_gain: float = ASSIST_MIN_GAIN
    assist_min_waiting: int = ASSIST_MIN_WAITING


@dataclass(frozen=True, slots=True)
class TimeoutsSection:
    worker_connect_s: float = 2.0
    request_timeout_s: float = 3600.0
    shutdown_grace_s: float = 5.0
    # how long a stopping gateway lets its control-plane calls end before cancelling them; the
    # workers' Attach streams never end by themselves, so with workers attached a stop takes all of it
    control_stop_grace_s: float = 0.5


@dataclass(frozen=True, slots=True)
class ClusterSection:
    workers: int = 3
    failure_domains: int = 1
    restart_killed: bool = True
    # local workers serve POST /lumen/fault (`lumen cluster kill --mode slow`): for test clusters only
    fault_injection: bool = False
    # a worker still FAILED this long after (silent, e.g. hung) while its process runs is killed
    # (SIGKILL) and restarted as usual; 0: never
    hung_restart_grace_s: float = 5.0


@dataclass(frozen=True, slots=True)
class SGLangWorker:
    """One unmodified SGLang server the gateway drives itself (agentless; docs/sglang.md)."""

    url: str = ""  # http://host:port of `python -m sglang.launch_server`
    id: str = ""  # worker id; "": sglang-<index>
    # a server launched with room for the outage batch boost (--max-running-requests ceil(1.5 B)): the
    # gateway holds it to B running requests outside a recovery (0: not held; docs/sglang.md)
    held_batch: int = 0
    # the server's --api-key, sent as the bearer of every request the gateway makes to it
    # (gateway/server/workers/server_keys.py); or a file holding it (read at start). Neither: the
    # environment's LUMEN_SGLANG_API_KEY or LUMEN_SGLANG_API_KEY_FILE, else no key
    api_key: str = field(default="", repr=False)
    api_key_file: str = ""


def server_api_key(w: SGLangWorker) -> str:
    """The configured server's API key: `api_key`, else the first line of `api_key_file`, else ""."""
    if w.api_key:
        return w.api_key
    if w.api_key_file:
        return Path(w.api_key_file).read_text().strip()
    return ""


@dataclass(frozen=True, slots=True)
class SGLangSection:
    workers: tuple[SGLangWorker, ...] = ()
    # the gateway polls each server's /ready and /v1/loads this often; the answers are its heartbeats
    poll_interval_ms: int = 50
    # `lumen cluster up --engine sglang`: a small model sharing the servers' tokenizer (a Hugging Face
    # folder) each agent drafts with while a server it relaunched loads, in modes with draft assist
    # (worker_hooks/sglang/agent_draft.py); "": no drafting
    draft_model: str = ""


@dataclass(frozen=True, slots=True)
class Config:
    gateway: GatewaySection = field(default_factory=GatewaySection)
    limits: LimitsSection = field(default_factory=LimitsSection)
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    model: ModelSection = field(default_factory=ModelSection)
    engine: EngineSection = field(default_factory=EngineSection)
    torch: TorchSection = field(default_factory=TorchSection)
    health: HealthSection = field(default_factory=HealthSection)
    load: LoadSection = field(default_factory=LoadSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    recovery: RecoverySection = field(default_factory=RecoverySection)
    gray: GraySection = field(default_factory=GraySection)
    draft: DraftSection = field(default_factory=DraftSection)
    timeouts: TimeoutsSection = field(default_factory=TimeoutsSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    sglang: SGLangSection = field(default_factory=SGLangSection)

    def replace(self, **sections: Any) -> Config:
        return dataclasses.replace(self, **sections)


def draft_for(pairs: tuple[DraftPair, ...], target: str) -> str | None:
    """The draft model configured for `target` (draft.pairs), or None."""
    return next((p.draft for p in pairs if p.target == target), None)


def recovery_policy(cfg: Config) -> RecoveryPolicy:
    """The recovery policy in force: the mode's own, with the ablation switches applied to `lumen`."""
    r = cfg.recovery
    base = policy_for(r.mode)
    if r.mode != "lumen":
        return base
    return dataclasses.replace(
        base,
        placement=r.placement,
        dispatch=DispatchRule.ALWAYS_HOLDER if r.always_holder else r.dispatch_rule,
        draft_assist=r.draft_assist,
        checkpointing=cfg.checkpoint.enabled,
    )
