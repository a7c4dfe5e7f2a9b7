"""The gateway's configuration: one TOML schema of frozen dataclasses, validated on load.

Every knob DESIGN.md names lives here, including those later features consume. A bad value makes the
gateway refuse to start with a ConfigError naming the key, the value, and the reason.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draft_models.registry import DraftError, validate_pairs
from gateway.core.gray import GrayParams
from gateway.core.modes import MODES, RecoveryPolicy, policy_for
from gateway.protocol.launch import TORCH_PRESETS

DEFAULT_CONFIG_PATH = Path(__file__).resolve().parents[2] / "configs" / "default.toml"

GiB = 1024**3


class ConfigError(ValueError):
    """An invalid configuration value; the message names the key, the value and why."""

    def __init__(self, key: str, value: object, why: str) -> None:
        super().__init__(f"config key '{key}' = {value!r}: {why}")
        self.key = key
        self.value = value
        self.why = why


@dataclass(frozen=True, slots=True)
class GatewaySection:
    host: str = "127.0.0.1"
    port: int = 8000
    control_host: str = "127.0.0.1"
    control_port: int = 50151  # 0: the OS picks (local clusters)
    served_model_name: str = "lumen-synthetic"
    # bearer keys for the client API; empty: no auth. Also from LUMEN_API_KEYS (comma-separated).
    api_keys: tuple[str, ...] = ()
    # bearer keys for /admin; empty: admin is open on loopback only. Also from LUMEN_ADMIN_API_KEYS.
    admin_api_keys: tuple[str, ...] = ()
    # shared secret workers present in Hello; empty: none. Also from LUMEN_CONTROL_TOKEN.
    control_token: str = ""
    log_level: str = "info"
    log_format: str = "console"  # console | json


@dataclass(frozen=True, slots=True)
class LimitsSection:
    max_request_bytes: int = 4 * 1024 * 1024
    max_prompt_tokens: int = 32768
    max_new_tokens: int = 8192  # upper bound on max_tokens a client may ask for
    default_max_tokens: int = 256
    max_concurrent_requests: int = 8192
    max_n: int = 1


@dataclass(frozen=True, slots=True)
class TokenizerSection:
    kind: str = "byte"  # byte | hf
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

    backend: str = "synthetic"  # synthetic | torch
    time_scale: float = 1.0  # modelled seconds x time_scale = wall seconds
    page_size: int = 64
    max_running_requests: int = 64  # also the nominal batch size of the load estimate
    chunked_prefill_size: int = 8192
    kv_capacity_tokens: int = 0  # 0: from the cost model
    model_load_s: float = -1.0  # < 0: from the cost model (weights / load bandwidth + start-up)
    draft_load_s: float = -1.0  # restart: draft model load time; < 0: from the cost model
    model_seed: int = 0


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
    heartbeat_interval_ms: int = 20
    heartbeat_misses: int = 3
    # when most workers go silent at once, the gateway is the likelier culprit: wait this long
    correlated_silence_s: float = 1.0


@dataclass(frozen=True, slots=True)
class LoadSection:
    alpha: float = 1.0
    beta: float = 1.0
    # new requests go to the least queue (False) or the least L̂ with its checkpoint term (the paper)
    route_by_checkpoint_load: bool = False


@dataclass(frozen=True, slots=True)
class CheckpointSection:
    enabled: bool = True
    budget_bytes: int = 64 * GiB  # per holder, host DRAM
    replicas: int = 1
    eviction: str = "shortest_prefix_first"  # none | shortest_prefix_first | lru
    exclude_failure_domain: bool = False
    orphan_ttl_s: float = 600.0
    # the synthetic backend sends real bytes of modelled size x payload_scale (small on CPU)
    payload_scale: float = 0.001
    frame_bytes: int = 1024 * 1024  # group pages into frames of at least this size where possible
    max_lag_bytes: int = 256 * 1024 * 1024  # sender queue per holder beyond which a checkpoint is abandoned


@dataclass(frozen=True, slots=True)
class GraySection:
    """Gray failures: a worker far slower per token than its peers is DEGRADED (core/gray.py)."""

    # off by default: in the simulator, excluding a slow worker cost more TTFT than it saved, because
    # the queue-based router already gives it less work (docs/results.md, "Gray failures")
    enabled: bool = False
    slow_factor: float = 2.5  # DEGRADED above this x the median time per token of its peers
    recover_factor: float = 1.5  # HEALTHY again below this x (hysteresis)
    min_peers: int = 2  # measured peers needed for a verdict
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
    dispatch_rule: str = "threshold"  # threshold (the paper's) | cost
    theta: float = 2.0
    theta_mode: str = "relative"  # relative (x survivors' mean load) | absolute
    tau: int = 512  # tokens
    placement: str = "load_aware"  # load_aware | ring (ablation lumen-fixed-placement)
    always_holder: bool = False  # ablation lumen-always-holder
    draft_assist: bool = True  # ablation lumen-no-draft
    max_attempts: int = 4  # worker attempts per request, the first included
    first_token_timeout_s: float = 120.0
    stall_timeout_s: float = 10.0  # between chunks once a stream has started
    no_worker_wait_s: float = 5.0  # how long a request waits for a HEALTHY worker before failing


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
    hysteresis: float = 0.25  # re-pair only if another target's load exceeds the current by this
    max_drafters_per_target: int = 1


@dataclass(frozen=True, slots=True)
class TimeoutsSection:
    worker_connect_s: float = 2.0
    request_timeout_s: float = 3600.0
    shutdown_grace_s: float = 5.0


@dataclass(frozen=True, slots=True)
class ClusterSection:
    workers: int = 3
    failure_domains: int = 1
    restart_killed: bool = True


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

    def replace(self, **sections: Any) -> Config:
        return dataclasses.replace(self, **sections)

    def with_overrides(self, overrides: dict[str, Any]) -> Config:
        """Apply dotted-key overrides (`{"recovery.mode": "none"}`), then validate."""
        raw = to_dict(self)
        for dotted, value in overrides.items():
            section, _, key = dotted.partition(".")
            if section not in raw or not key:
                raise ConfigError(dotted, value, "unknown key")
            raw[section][key] = value
        return from_dict(raw)


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
        placement="ring" if r.placement == "ring" else "load_aware",
        dispatch="always_holder"
        if r.always_holder
        else ("cost" if r.dispatch_rule == "cost" else "threshold"),
        draft_assist=r.draft_assist,
        checkpointing=cfg.checkpoint.enabled,
    )


# --------------------------------------------------------------------------------------------------
# parsing


def _convert(key: str, value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, value, "must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, value, "must be an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(key, value, "must be a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(key, value, "must be a string")
        return value
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(key, value, "must be a list")
        (item_tp, _ellipsis) = typing.get_args(tp)
        return tuple(_convert(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value))
    if origin in (types.UnionType, typing.Union):
        raise TypeError(f"unsupported union type for {key}")
    if dataclasses.is_dataclass(tp):
        if dataclasses.is_dataclass(value):
            return value
        if not isinstance(value, dict):
            raise ConfigError(key, value, "must be a table")
        return _build(key, tp, value)
    raise TypeError(f"unsupported config type {tp!r} for {key}")


def _build(prefix: str, cls: Any, table: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for k, v in table.items():
        key = f"{prefix}.{k}" if prefix else k
        if k not in names:
            raise ConfigError(key, v, f"unknown key (known: {', '.join(sorted(names))})")
        kwargs[k] = _convert(key, v, hints[k])
    return cls(**kwargs)


def from_dict(raw: dict[str, Any]) -> Config:
    cfg: Config = _build("", Config, raw)
    cfg = _apply_env(cfg)
    validate(cfg)
    return cfg


def to_dict(cfg: Any) -> Any:
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, tuple):
        return [to_dict(v) for v in cfg]
    return cfg


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Load `path` (default: configs/default.toml), apply overrides and environment, validate."""
    p = Path(path) if path else DEFAULT_CONFIG_PATH
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError("--config", str(p), f"cannot read: {exc.strerror}") from exc
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("--config", str(p), f"not valid TOML: {exc}") from exc
    cfg = from_dict(raw)
    return cfg.with_overrides(overrides) if overrides else cfg


def _apply_env(cfg: Config) -> Config:
    g = cfg.gateway
    env = os.environ

    def keys(name: str, current: tuple[str, ...]) -> tuple[str, ...]:
        v = env.get(name)
        return tuple(k.strip() for k in v.split(",") if k.strip()) if v else current

    g = dataclasses.replace(
        g,
        api_keys=keys("LUMEN_API_KEYS", g.api_keys),
        admin_api_keys=keys("LUMEN_ADMIN_API_KEYS", g.admin_api_keys),
        control_token=env.get("LUMEN_CONTROL_TOKEN", g.control_token),
    )
    return dataclasses.replace(cfg, gateway=g)


# --------------------------------------------------------------------------------------------------
# validation: ranges and choices that the types alone do not express


def _check(ok: bool, key: str, value: object, why: str) -> None:
    if not ok:
        raise ConfigError(key, value, why)


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    _check(value in choices, key, value, f"must be one of {', '.join(choices)}")


def _port(key: str, value: int) -> None:
    _check(0 <= value <= 65535, key, value, "must be a TCP port in 0..65535")


def _positive(key: str, value: float) -> None:
    _check(value > 0, key, value, "must be > 0")


def validate(cfg: Config) -> None:
    from gateway.core.costmodel import GPUS, MODELS

    g = cfg.gateway
    _port("gateway.port", g.port)
    _port("gateway.control_port", g.control_port)
    _check(bool(g.served_model_name.strip()), "gateway.served_model_name", g.served_model_name, "empty")
    _choice("gateway.log_level", g.log_level, ("debug", "info", "warning", "error"))
    _choice("gateway.log_format", g.log_format, ("console", "json"))
    for i, k in enumerate(g.api_keys):
        _check(len(k) >= 8, f"gateway.api_keys[{i}]", "***", "an API key must have at least 8 characters")

    lim = cfg.limits
    _positive("limits.max_request_bytes", lim.max_request_bytes)
    _positive("limits.max_prompt_tokens", lim.max_prompt_tokens)
    _positive("limits.max_new_tokens", lim.max_new_tokens)
    _check(
        0 < lim.default_max_tokens <= lim.max_new_tokens,
        "limits.default_max_tokens",
        lim.default_max_tokens,
        f"must be in 1..limits.max_new_tokens ({lim.max_new_tokens})",
    )
    _positive("limits.max_concurrent_requests", lim.max_concurrent_requests)
    _check(lim.max_n == 1, "limits.max_n", lim.max_n, "only n = 1 is supported")

    t = cfg.tokenizer
    _choice("tokenizer.kind", t.kind, ("byte", "hf"))
    if t.kind == "hf":
        _check(bool(t.path), "tokenizer.path", t.path, "required when tokenizer.kind = 'hf'")
        _check(Path(t.path).is_file(), "tokenizer.path", t.path, "file not found")
    if t.chat_template:
        _check(Path(t.chat_template).is_file(), "tokenizer.chat_template", t.chat_template, "file not found")

    m = cfg.model
    _check(m.preset in MODELS, "model.preset", m.preset, f"unknown preset; known: {', '.join(MODELS)}")
    _check(m.gpu in GPUS, "model.gpu", m.gpu, f"unknown GPU; known: {', '.join(GPUS)}")
    _check(m.tp in (0, 1, 2, 4, 8), "model.tp", m.tp, "must be 0 (preset default), 1, 2, 4 or 8")

    e = cfg.engine
    _choice("engine.backend", e.backend, ("synthetic", "torch"))
    _positive("engine.time_scale", e.time_scale)
    _check(
        e.page_size > 0 and e.page_size & (e.page_size - 1) == 0,
        "engine.page_size",
        e.page_size,
        "must be a power of two",
    )
    _positive("engine.max_running_requests", e.max_running_requests)
    _check(
        e.chunked_prefill_size >= e.page_size,
        "engine.chunked_prefill_size",
        e.chunked_prefill_size,
        "must be >= engine.page_size",
    )
    _check(e.kv_capacity_tokens >= 0, "engine.kv_capacity_tokens", e.kv_capacity_tokens, "must be >= 0")
    tc = cfg.torch
    _choice("torch.dtype", tc.dtype, ("float32", "bfloat16", "float16"))
    _check(
        tc.device == "cpu" or re.fullmatch(r"cuda(:\d+)?", tc.device) is not None,
        "torch.device",
        tc.device,
        "must be cpu, cuda or cuda:N",
    )
    _check(tc.threads >= 0, "torch.threads", tc.threads, "must be >= 0")
    _check(bool(tc.model), "torch.model", tc.model, "a preset name or a model folder is required")
    for key, name in (("torch.model", tc.model), ("torch.draft", tc.draft)):
        if not name or (key == "torch.draft" and name.startswith("self:")):
            continue
        _check(
            name in TORCH_PRESETS or Path(name, "config.json").is_file(),
            key,
            name,
            f"neither a preset ({', '.join(TORCH_PRESETS)}) nor a folder with a config.json",
        )
    if tc.draft.startswith("self:"):
        n = tc.draft.removeprefix("self:")
        _check(n.isdigit() and int(n) >= 1, "torch.draft", tc.draft, "self:N needs N >= 1 layers")

    h = cfg.health
    _check(
        1 <= h.heartbeat_interval_ms <= 10_000,
        "health.heartbeat_interval_ms",
        h.heartbeat_interval_ms,
        "must be in 1..10000",
    )
    _check(h.heartbeat_misses >= 1, "health.heartbeat_misses", h.heartbeat_misses, "must be >= 1")
    _positive("health.correlated_silence_s", h.correlated_silence_s)

    _check(cfg.load.alpha >= 0, "load.alpha", cfg.load.alpha, "must be >= 0")
    _check(cfg.load.beta >= 0, "load.beta", cfg.load.beta, "must be >= 0")
    _check(cfg.load.alpha + cfg.load.beta > 0, "load.beta", cfg.load.beta, "alpha and beta cannot both be 0")

    c = cfg.checkpoint
    _check(c.budget_bytes >= 0, "checkpoint.budget_bytes", c.budget_bytes, "must be >= 0")
    _check(c.replicas in (1, 2), "checkpoint.replicas", c.replicas, "must be 1 or 2")
    _choice("checkpoint.eviction", c.eviction, ("none", "shortest_prefix_first", "lru"))
    _positive("checkpoint.orphan_ttl_s", c.orphan_ttl_s)
    _check(0 < c.payload_scale <= 1, "checkpoint.payload_scale", c.payload_scale, "must be in (0, 1]")
    _positive("checkpoint.frame_bytes", c.frame_bytes)
    _positive("checkpoint.max_lag_bytes", c.max_lag_bytes)

    r = cfg.recovery
    _choice("recovery.mode", r.mode, tuple(MODES))
    _choice("recovery.dispatch_rule", r.dispatch_rule, ("threshold", "cost"))
    _positive("recovery.theta", r.theta)
    _choice("recovery.theta_mode", r.theta_mode, ("relative", "absolute"))
    _check(r.tau >= 0, "recovery.tau", r.tau, "must be >= 0 tokens")
    _choice("recovery.placement", r.placement, ("load_aware", "ring"))
    _check(1 <= r.max_attempts <= 16, "recovery.max_attempts", r.max_attempts, "must be in 1..16")
    _positive("recovery.first_token_timeout_s", r.first_token_timeout_s)
    _positive("recovery.stall_timeout_s", r.stall_timeout_s)
    _check(r.no_worker_wait_s >= 0, "recovery.no_worker_wait_s", r.no_worker_wait_s, "must be >= 0")

    gr = cfg.gray
    _check(gr.slow_factor > 1, "gray.slow_factor", gr.slow_factor, "must be > 1")
    _check(
        1 < gr.recover_factor < gr.slow_factor,
        "gray.recover_factor",
        gr.recover_factor,
        "must be > 1 and < gray.slow_factor",
    )
    _check(gr.min_peers >= 1, "gray.min_peers", gr.min_peers, "must be >= 1")
    _positive("gray.window_s", gr.window_s)
    _check(gr.probation_s >= gr.window_s, "gray.probation_s", gr.probation_s, "must be >= gray.window_s")
    _positive("gray.check_interval_s", gr.check_interval_s)
    _positive("gray.half_life_s", gr.half_life_s)
    _check(gr.min_tokens >= 1, "gray.min_tokens", gr.min_tokens, "must be >= 1")

    d = cfg.draft
    for i, pair in enumerate(d.pairs):
        _check(pair.target in MODELS, f"draft.pairs[{i}].target", pair.target, "unknown preset")
        _check(pair.draft in MODELS, f"draft.pairs[{i}].draft", pair.draft, "unknown preset")
    try:
        validate_pairs((p.target, p.draft) for p in d.pairs)
    except DraftError as exc:
        idx = getattr(exc, "index", None)
        key = f"draft.pairs[{idx}]" if idx is not None else "draft.pairs"
        value = f"{getattr(exc, 'target', '?')} -> {getattr(exc, 'draft', '?')}"
        raise ConfigError(key, value, getattr(exc, "why", str(exc))) from exc
    _check(d.k_min >= 1, "draft.k_min", d.k_min, "must be >= 1")
    _check(d.k_max >= d.k_min, "draft.k_max", d.k_max, "must be >= draft.k_min")
    _check(d.k_min <= d.k_initial <= d.k_max, "draft.k_initial", d.k_initial, "must be in k_min..k_max")
    _positive("draft.draft_timeout_ms", d.draft_timeout_ms)
    _check(0 <= d.agreement <= 1, "draft.agreement", d.agreement, "must be in [0, 1]")
    _check(d.hysteresis >= 0, "draft.hysteresis", d.hysteresis, "must be >= 0")
    _check(d.max_drafters_per_target >= 1, "draft.max_drafters_per_target", d.max_drafters_per_target, ">= 1")

    to = cfg.timeouts
    _positive("timeouts.worker_connect_s", to.worker_connect_s)
    _positive("timeouts.request_timeout_s", to.request_timeout_s)
    _check(to.shutdown_grace_s >= 0, "timeouts.shutdown_grace_s", to.shutdown_grace_s, "must be >= 0")

    cl = cfg.cluster
    _check(1 <= cl.workers <= 256, "cluster.workers", cl.workers, "must be in 1..256")
    _check(
        1 <= cl.failure_domains <= cl.workers,
        "cluster.failure_domains",
        cl.failure_domains,
        "must be in 1..cluster.workers",
    )
