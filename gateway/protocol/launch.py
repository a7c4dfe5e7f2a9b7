"""What a worker process is started with: one versioned spec, passed as JSON on its command line.

The supervisor builds it from the gateway config; a worker never parses the gateway's TOML.
"""

from __future__ import annotations

from enum import StrEnum

import msgspec

from gateway.protocol.kv import DEFAULT_PAGE_SIZE

# the torch backend's built-in model shapes (models/torch_config.py PRESETS; a test keeps the
# two lists equal), named here so the gateway can check its config without importing torch
TORCH_PRESETS = ("tiny", "tiny-llama", "tiny-draft", "qwen3-0.6b", "qwen3-8b", "qwen3-32b")


# requests a worker runs at once by default (also the nominal batch of the gateway's load estimate)
DEFAULT_MAX_RUNNING_REQUESTS = 64


class Backend(StrEnum):
    """What computes a Lumen worker's steps."""

    SYNTHETIC = "synthetic"  # the roofline cost model's timing, deterministic hashed tokens
    TORCH = "torch"  # a real decoder over a paged KV cache


class Eviction(StrEnum):
    """What a full checkpoint store evicts (worker_hooks/kv/eviction.py)."""

    NONE = "none"
    SHORTEST_PREFIX_FIRST = "shortest_prefix_first"
    LRU = "lru"


class EngineSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    v: int = 1
    worker_id: str
    host: str = "127.0.0.1"
    port: int = 0  # 0: the OS picks; the worker reports its URL in Hello
    control_address: str  # host:port of the gateway's gRPC control plane ("" = run unattached)
    # further gateways of the same cluster: the worker attaches to each (one control session apiece)
    more_control_addresses: list[str] = msgspec.field(default_factory=list)
    # the cluster secret (gateway/protocol/secrets.py): authenticates Hello; the worker's HTTP API
    # then takes only requests with the bearer derived from it. "" (tests only): no checks
    control_token: str = ""
    control_tls_ca: str = ""  # PEM the control plane's TLS certificate must chain to; "": plaintext
    # POST /lumen/fault (slow a worker down) exists only on a worker started for testing
    fault_injection: bool = False
    backend: Backend = Backend.SYNTHETIC
    model: str = "Qwen3-32B"
    gpu: str = "H100-80G"
    tp: int = 0  # 0: the model preset's default
    time_scale: float = 1.0  # modelled seconds x time_scale = wall seconds
    page_size: int = DEFAULT_PAGE_SIZE
    max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS
    chunked_prefill_size: int = 8192
    kv_capacity_tokens: int = 0  # 0: from the cost model
    # synthetic tokens are drawn from [token_lo, token_hi) (printable bytes for the byte tokenizer)
    vocab_size: int = 259
    token_lo: int = 32
    token_hi: int = 127
    model_seed: int = 0
    # modelled full-model load time; None: from the cost model. Only a restart pays it.
    model_load_s: float | None = None
    restart: bool = False
    # seeded reload (worker_hooks/engine/seeding.py): a restart asks the gateway for a running peer
    # to load its weights from (Hello.awaiting_seed) and loads from storage when none is named;
    # peer_load_s is the modelled load from a peer (None: the cost model's, start-up included)
    reload_from_peer: bool = False
    peer_load_s: float | None = None
    heartbeat_interval_ms: int = 20
    failure_domain: str = ""
    # checkpoint store (holder side) and sender (serving side), DESIGN 4.4
    ckpt_budget_bytes: int = 0  # modelled bytes of host DRAM for other workers' KV pages
    ckpt_eviction: Eviction = Eviction.SHORTEST_PREFIX_FIRST
    ckpt_orphan_ttl_s: float = 600.0
    # the synthetic backend sends real bytes = modelled bytes x this, so CPU tests stay small;
    # budgets and reported bytes stay in modelled units
    ckpt_payload_scale: float = 0.001
    ckpt_frame_bytes: int = 1024 * 1024
    ckpt_max_lag_bytes: int = 256 * 1024 * 1024
    draft_model: str = ""
    # progressive recovery (DESIGN 4.5): modelled draft-model load time (None: from the cost model),
    # the synthetic drafter's per-token agreement with its target, and the target's k bounds
    draft_load_s: float | None = None
    draft_agreement: float = 0.7
    draft_k_min: int = 1
    draft_k_max: int = 8
    draft_timeout_ms: int = 30
    # backend "torch" (worker_hooks/engine/torch_backend.py): a preset name (random weights from
    # model_seed) or a HuggingFace folder (config.json + *.safetensors); the drafter's model is another
    # preset or folder, or "self:N" (the target's first N layers); "" = no drafter
    torch_model: str = "tiny"
    torch_draft: str = "tiny-draft"
    torch_dtype: str = "float32"
    torch_device: str = "cpu"
    torch_threads: int = 1  # intra-op threads of this worker process (0: torch's default)
    log_level: str = "info"


# a supervisor hands a worker its spec in this environment variable, never on the command line: the
# spec can hold the control-plane token, and any user on the host can read a process's argv
SPEC_ENV = "LUMEN_ENGINE_SPEC"
# what a worker process must not inherit from the gateway's environment (client and admin keys)
GATEWAY_SECRETS_ENV = ("LUMEN_API_KEYS", "LUMEN_ADMIN_API_KEYS", "LUMEN_ADMIN_API_KEY", "LUMEN_CONTROL_TOKEN")


def worker_env(parent: dict[str, str], spec: EngineSpec, **extra: str) -> dict[str, str]:
    """A worker process's environment: the parent's without the gateway's secrets, plus the spec."""
    env = {k: v for k, v in parent.items() if k not in GATEWAY_SECRETS_ENV}
    env.update(extra)
    env[SPEC_ENV] = encode_spec(spec)
    return env


def encode_spec(spec: EngineSpec) -> str:
    return msgspec.json.encode(spec).decode()


def decode_spec(text: str) -> EngineSpec:
    return msgspec.json.decode(text, type=EngineSpec)
