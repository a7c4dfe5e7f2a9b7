"""Ranges and choices the types alone do not express. Policy bounds are the core's: a section is
checked by building the core parameters it configures, and their ParamError becomes a ConfigError
naming this section's key."""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Callable
from pathlib import Path

from gateway.config.errors import ConfigError
from gateway.config.sections import Config, GatewaySection, server_api_key
from gateway.core.costmodel import GPUS, MODELS
from gateway.core.dispatch import DispatchParams
from gateway.core.draftpairs import DraftError, validate_pairs
from gateway.core.holders import HolderParams
from gateway.core.modes import MODES, DispatchRule
from gateway.core.outage import OUTAGE_KEYS, outage_params
from gateway.core.pairing import PairingParams
from gateway.core.speculation import check_gate_bounds
from gateway.core.types import LoadParams, ParamError
from gateway.protocol.launch import TORCH_PRESETS

MAX_N = 128  # limits.max_n's ceiling
MAX_HTTP_TIMEOUT_S = 3600.0  # limits.header_timeout_s' and limits.body_timeout_s' ceiling


def _check(ok: bool, key: str, value: object, why: str) -> None:
    if not ok:
        raise ConfigError(key, value, why)


def _choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    _check(value in choices, key, value, f"must be one of {', '.join(choices)}")


def _port(key: str, value: int) -> None:
    _check(0 <= value <= 65535, key, value, "must be a TCP port in 0..65535")


def _positive(key: str, value: float) -> None:
    _check(value > 0, key, value, "must be > 0")


def _core(section: str, build: Callable[[], object], keys: dict[str, str] | None = None) -> None:
    """Build core parameters; a ParamError on field f names `section.f` (or `keys[f]`)."""
    try:
        build()
    except ParamError as exc:
        key = (keys or {}).get(exc.field, f"{section}.{exc.field}")
        raise ConfigError(key, exc.value, exc.why) from exc


def validate(cfg: Config) -> None:
    _gateway(cfg)
    _limits(cfg)
    _tokenizer(cfg)
    _model_and_engine(cfg)
    _torch(cfg)
    _health(cfg)
    _policies(cfg)
    _checkpoint(cfg)
    _recovery(cfg)
    _gray(cfg)
    _draft(cfg)
    _timeouts_and_cluster(cfg)
    _sglang(cfg)


def _gateway(cfg: Config) -> None:
    g = cfg.gateway
    _port("gateway.port", g.port)
    _port("gateway.control_port", g.control_port)
    _check(bool(g.served_model_name.strip()), "gateway.served_model_name", g.served_model_name, "empty")
    _choice("gateway.log_level", g.log_level, ("debug", "info", "warning", "error"))
    for i, k in enumerate(g.api_keys):
        _check(len(k) >= 8, f"gateway.api_keys[{i}]", "***", "an API key must have at least 8 characters")
    _check(
        g.record_trace_max_bytes >= 4096,
        "gateway.record_trace_max_bytes",
        g.record_trace_max_bytes,
        "must be >= 4096",
    )
    for i, kid in enumerate(g.resumable_keys):
        _check(
            re.fullmatch(r"key-[0-9a-f]{8}", kid) is not None,
            f"gateway.resumable_keys[{i}]",
            kid,
            "a key id is 'key-' and 8 hex digits (as the logs name keys), not the key itself",
        )
    _control_plane(g)


def _control_plane(g: GatewaySection) -> None:
    """Beyond loopback the control plane needs TLS (the token would cross the network in clear text),
    unless the operator says control_insecure explicitly."""
    if g.control_token:
        _check(len(g.control_token) >= 16, "gateway.control_token", "***", "must have at least 16 characters")
    _check(
        bool(g.control_tls_cert) == bool(g.control_tls_key),
        "gateway.control_tls_key" if g.control_tls_cert else "gateway.control_tls_cert",
        "",
        "control_tls_cert and control_tls_key go together",
    )
    for key, path in (
        ("gateway.control_tls_cert", g.control_tls_cert),
        ("gateway.control_tls_key", g.control_tls_key),
    ):
        if path:
            _check(Path(path).is_file(), key, path, "file not found")
    if not is_loopback(g.control_host) and not g.control_tls_cert and not g.control_insecure:
        raise ConfigError(
            "gateway.control_host",
            g.control_host,
            "binding the control plane beyond loopback needs TLS (gateway.control_tls_cert and "
            "control_tls_key); set gateway.control_insecure = true (lumen gateway --insecure) to accept "
            "a plaintext control plane",
        )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _limits(cfg: Config) -> None:
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
    _check(
        1 <= lim.max_n <= MAX_N,
        "limits.max_n",
        lim.max_n,
        f"must be in 1..{MAX_N} (each choice is a request of its own on the workers)",
    )
    for key, value in (("header_timeout_s", lim.header_timeout_s), ("body_timeout_s", lim.body_timeout_s)):
        _check(
            0 < value <= MAX_HTTP_TIMEOUT_S,
            f"limits.{key}",
            value,
            f"must be in (0, {MAX_HTTP_TIMEOUT_S:g}] seconds (a slow client holds a connection that long)",
        )
    _check(
        0 <= lim.sse_keepalive_s <= MAX_HTTP_TIMEOUT_S,
        "limits.sse_keepalive_s",
        lim.sse_keepalive_s,
        f"must be in [0, {MAX_HTTP_TIMEOUT_S:g}] seconds (0: no keep-alive comments)",
    )
    _check(
        lim.per_key_max_concurrent >= 0,
        "limits.per_key_max_concurrent",
        lim.per_key_max_concurrent,
        "must be >= 0 (0: unlimited)",
    )
    _check(
        0 <= lim.per_key_rate_per_s < math.inf,
        "limits.per_key_rate_per_s",
        lim.per_key_rate_per_s,
        "must be a finite number >= 0 (0: unlimited)",
    )
    _check(lim.per_key_burst >= 0, "limits.per_key_burst", lim.per_key_burst, "must be >= 0")
    _check(
        lim.per_key_burst == 0 or lim.per_key_rate_per_s > 0,
        "limits.per_key_burst",
        lim.per_key_burst,
        "needs limits.per_key_rate_per_s > 0 (the burst is the size of the rate's bucket)",
    )
    _check(
        lim.work_per_worker_tokens >= 0,
        "limits.work_per_worker_tokens",
        lim.work_per_worker_tokens,
        "must be >= 0 (0: no fair shares, every job goes to the workers at once)",
    )
    _check(
        0 < lim.work_queue_timeout_s <= MAX_HTTP_TIMEOUT_S,
        "limits.work_queue_timeout_s",
        lim.work_queue_timeout_s,
        f"must be in (0, {MAX_HTTP_TIMEOUT_S:g}] seconds",
    )


def _tokenizer(cfg: Config) -> None:
    t = cfg.tokenizer
    if t.kind == "hf":
        _check(bool(t.path), "tokenizer.path", t.path, "required when tokenizer.kind = 'hf'")
        _check(Path(t.path).is_file(), "tokenizer.path", t.path, "file not found")
    if t.chat_template:
        _check(Path(t.chat_template).is_file(), "tokenizer.chat_template", t.chat_template, "file not found")


def _model_and_engine(cfg: Config) -> None:
    m = cfg.model
    _check(m.preset in MODELS, "model.preset", m.preset, f"unknown preset; known: {', '.join(MODELS)}")
    _check(m.gpu in GPUS, "model.gpu", m.gpu, f"unknown GPU; known: {', '.join(GPUS)}")
    _check(m.tp in (0, 1, 2, 4, 8), "model.tp", m.tp, "must be 0 (preset default), 1, 2, 4 or 8")
    e = cfg.engine
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
    _check(math.isfinite(e.peer_load_s), "engine.peer_load_s", e.peer_load_s, "must be a finite number")


def _torch(cfg: Config) -> None:
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


def _health(cfg: Config) -> None:
    h = cfg.health
    _check(
        1 <= h.heartbeat_interval_ms <= 10_000,
        "health.heartbeat_interval_ms",
        h.heartbeat_interval_ms,
        "must be in 1..10000",
    )
    _check(h.heartbeat_misses >= 1, "health.heartbeat_misses", h.heartbeat_misses, "must be >= 1")
    _positive("health.correlated_silence_s", h.correlated_silence_s)
    _check(
        h.probe_timeout_ms >= 0, "health.probe_timeout_ms", h.probe_timeout_ms, "must be >= 0 (0: no probe)"
    )
    _positive("health.record_retention_s", h.record_retention_s)
    floor = h.heartbeat_interval_ms * h.heartbeat_misses
    _check(
        h.max_silence_ms >= floor,
        "health.max_silence_ms",
        h.max_silence_ms,
        f"must be >= {floor} (interval x misses)",
    )
    _check(
        h.probe_timeout_ms < h.max_silence_ms,
        "health.probe_timeout_ms",
        h.probe_timeout_ms,
        "must be < health.max_silence_ms",
    )
    # the detector's own bounds (core/detector.py), named by this section's keys
    _core(
        "health",
        h.detector,
        {
            "interval_s": "health.heartbeat_interval_ms",
            "misses": "health.heartbeat_misses",
            "window": "health.detector_window",
            "probe_timeout_s": "health.probe_timeout_ms",
            "max_silence_s": "health.max_silence_ms",
        },
    )


def _policies(cfg: Config) -> None:
    """The core parameters the gateway builds from [load], [checkpoint], [recovery] and [draft]."""
    _core("load", lambda: LoadParams(cfg.load.alpha, cfg.load.beta, cfg.engine.max_running_requests))
    c, r, d = cfg.checkpoint, cfg.recovery, cfg.draft
    _core(
        "checkpoint",
        lambda: HolderParams(replicas=c.replicas, exclude_failure_domain=c.exclude_failure_domain),
    )
    _core("recovery", lambda: HolderParams(placement=r.placement))
    _core(
        "recovery",
        lambda: outage_params(r),
        OUTAGE_KEYS,
    )
    _core(
        "recovery",
        lambda: DispatchParams(rule=r.dispatch_rule, theta=r.theta, theta_mode=r.theta_mode, tau=r.tau),
    )
    _core(
        "draft",
        lambda: PairingParams(hysteresis=d.hysteresis, max_drafters_per_target=d.max_drafters_per_target),
    )
    _core(
        "draft",
        lambda: check_gate_bounds(d.assist_min_gain, d.assist_min_waiting),
        {"min_gain": "draft.assist_min_gain", "min_waiting": "draft.assist_min_waiting"},
    )
    _core("gray", cfg.gray.params)


def _checkpoint(cfg: Config) -> None:
    c = cfg.checkpoint
    _check(c.budget_bytes >= 0, "checkpoint.budget_bytes", c.budget_bytes, "must be >= 0")
    _positive("checkpoint.orphan_ttl_s", c.orphan_ttl_s)
    _check(0 < c.payload_scale <= 1, "checkpoint.payload_scale", c.payload_scale, "must be in (0, 1]")
    _positive("checkpoint.frame_bytes", c.frame_bytes)
    _positive("checkpoint.max_lag_bytes", c.max_lag_bytes)


def _recovery(cfg: Config) -> None:
    r = cfg.recovery
    _choice("recovery.mode", r.mode, tuple(MODES))
    # the ablation switches pick the rule; the config offers the paper's rule and Lumen's cost rule
    _choice("recovery.dispatch_rule", r.dispatch_rule, (DispatchRule.THRESHOLD, DispatchRule.COST))
    _check(1 <= r.max_attempts <= 16, "recovery.max_attempts", r.max_attempts, "must be in 1..16")
    _positive("recovery.first_token_timeout_s", r.first_token_timeout_s)
    _positive("recovery.resume_ttl_s", r.resume_ttl_s)
    _positive("recovery.stall_timeout_s", r.stall_timeout_s)
    _check(r.no_worker_wait_s >= 0, "recovery.no_worker_wait_s", r.no_worker_wait_s, "must be >= 0")


def _gray(cfg: Config) -> None:
    gr = cfg.gray
    _positive("gray.window_s", gr.window_s)
    _check(gr.probation_s >= gr.window_s, "gray.probation_s", gr.probation_s, "must be >= gray.window_s")
    _positive("gray.check_interval_s", gr.check_interval_s)
    _positive("gray.half_life_s", gr.half_life_s)
    _check(gr.min_tokens >= 1, "gray.min_tokens", gr.min_tokens, "must be >= 1")


def _draft(cfg: Config) -> None:
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


def _timeouts_and_cluster(cfg: Config) -> None:
    to = cfg.timeouts
    _positive("timeouts.worker_connect_s", to.worker_connect_s)
    _positive("timeouts.request_timeout_s", to.request_timeout_s)
    _check(to.shutdown_grace_s >= 0, "timeouts.shutdown_grace_s", to.shutdown_grace_s, "must be >= 0")
    _check(
        0 <= to.control_stop_grace_s <= 60,
        "timeouts.control_stop_grace_s",
        to.control_stop_grace_s,
        "must be in [0, 60] seconds",
    )
    cl = cfg.cluster
    _check(1 <= cl.workers <= 256, "cluster.workers", cl.workers, "must be in 1..256")
    _check(
        1 <= cl.failure_domains <= cl.workers,
        "cluster.failure_domains",
        cl.failure_domains,
        "must be in 1..cluster.workers",
    )
    _check(
        cl.hung_restart_grace_s >= 0,
        "cluster.hung_restart_grace_s",
        cl.hung_restart_grace_s,
        "must be >= 0 (0: never)",
    )


def _sglang(cfg: Config) -> None:
    s = cfg.sglang
    _check(
        5 <= s.poll_interval_ms <= 10_000,
        "sglang.poll_interval_ms",
        s.poll_interval_ms,
        "must be in 5..10000",
    )
    ids: set[str] = set()
    for i, w in enumerate(s.workers):
        key = f"sglang.workers[{i}]"
        _check(
            re.fullmatch(r"https?://[^/\s]+(/[^\s]*)?", w.url) is not None,
            f"{key}.url",
            w.url,
            "must be an http:// or https:// URL of an SGLang server",
        )
        _check(0 <= w.held_batch <= 1_000_000, f"{key}.held_batch", w.held_batch, "must be in 0..1000000")
        _check(
            not (w.api_key and w.api_key_file),
            f"{key}.api_key_file",
            w.api_key_file,
            "api_key or api_key_file, not both",
        )
        if w.api_key_file:
            try:
                found = bool(server_api_key(w))
            except OSError as exc:
                raise ConfigError(
                    f"{key}.api_key_file", w.api_key_file, f"unreadable: {exc.strerror}"
                ) from exc
            _check(found, f"{key}.api_key_file", w.api_key_file, "the file holds no key")
        wid = sglang_worker_id(i, w.id)
        _check(wid not in ids, f"{key}.id", wid, "duplicate worker id")
        ids.add(wid)


def sglang_worker_id(index: int, given: str) -> str:
    """The worker id of the index-th configured SGLang server."""
    return given or f"sglang-{index}"
