"""The gateway's configuration: one TOML schema of frozen dataclasses, validated on load.

- `sections`: the schema (defaults from the core parameters that own them),
- `convert`: TOML tables to dataclasses by type hints (shared with the simulator's scenarios),
- `loader`: file, `--set` overrides and environment secrets,
- `validate`: the bounds, delegated to the core parameters where they own them.

A bad value makes the gateway refuse to start with a ConfigError naming the key, the value, and why.
"""

from gateway.config.errors import ConfigError
from gateway.config.loader import DEFAULT_CONFIG_PATH, from_dict, load_config, parse_set, with_overrides
from gateway.config.sections import (
    CheckpointSection,
    ClusterSection,
    Config,
    DraftPair,
    DraftSection,
    EngineSection,
    GatewaySection,
    GraySection,
    HealthSection,
    LimitsSection,
    LoadSection,
    LogFormat,
    ModelSection,
    RecoverySection,
    SGLangSection,
    SGLangWorker,
    TimeoutsSection,
    TokenizerKind,
    TokenizerSection,
    TorchSection,
    draft_for,
    recovery_policy,
    server_api_key,
)
from gateway.config.validate import sglang_worker_id, validate

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "CheckpointSection",
    "ClusterSection",
    "Config",
    "ConfigError",
    "DraftPair",
    "DraftSection",
    "EngineSection",
    "GatewaySection",
    "GraySection",
    "HealthSection",
    "LimitsSection",
    "LoadSection",
    "LogFormat",
    "ModelSection",
    "RecoverySection",
    "SGLangSection",
    "SGLangWorker",
    "TimeoutsSection",
    "TokenizerKind",
    "TokenizerSection",
    "TorchSection",
    "draft_for",
    "from_dict",
    "load_config",
    "parse_set",
    "recovery_policy",
    "server_api_key",
    "sglang_worker_id",
    "validate",
    "with_overrides",
]
