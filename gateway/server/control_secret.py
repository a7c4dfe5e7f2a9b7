"""The gateway's side of its secrets (gateway/protocol/secrets.py): a control token and an admin key
are always set; generated ones are published in files only their owner can read (the runtime
directory, mode 0600), for workers started by hand and for the owner's `lumen` commands."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import structlog

from gateway.config import Config, ConfigError
from gateway.config.sections import GatewaySection
from gateway.protocol.secrets import (
    SecretError,
    default_admin_key_path,
    default_token_path,
    generate_token,
    read_token_file,
    write_token_file,
)

log = structlog.get_logger("lumen.control")


def with_control_token(config: Config) -> tuple[Config, bool]:
    """`config` with a control token: the configured one, else the one in `control_token_file`, else a
    new random one. The flag says whether it was generated (and so must be published).

    A `control_token_file` that exists must be this user's own regular file, accessible by nobody
    else (a ConfigError naming the key otherwise)."""
    g = config.gateway
    if g.control_token:
        return config, False
    if g.control_token_file and os.path.lexists(g.control_token_file):
        try:
            token, generated = read_token_file(Path(g.control_token_file)), False
        except SecretError as exc:
            raise ConfigError("gateway.control_token_file", g.control_token_file, str(exc)) from exc
    else:
        token, generated = generate_token(), True
    return dataclasses.replace(config, gateway=dataclasses.replace(g, control_token=token)), generated


def publish_token(g: GatewaySection, control_port: int) -> Path:
    """Write a generated token (mode 0600) where workers on this host look for it; returns the path.
    The token itself is never logged."""
    path = Path(g.control_token_file) if g.control_token_file else default_token_path(control_port)
    write_token_file(path, g.control_token)
    log.info("control_token_generated", file=str(path), hint="workers read it from LUMEN_CONTROL_TOKEN_FILE")
    return path


def with_admin_key(config: Config) -> tuple[Config, bool]:
    """`config` with an admin key: the configured ones, else a new random one (the flag says it was
    generated, and so must be published with `publish_admin_key`). The admin API is never open."""
    g = config.gateway
    if g.admin_api_keys:
        return config, False
    key = generate_token()
    return dataclasses.replace(config, gateway=dataclasses.replace(g, admin_api_keys=(key,))), True


def publish_admin_key(key: str, http_port: int) -> Path | None:
    """Write a generated admin key (mode 0600, in the per-user runtime directory) where the owner's
    `lumen cluster status/kill` look for it: `admin-key-<http_port>`. The key is never logged. Where
    the runtime directory cannot be written (a read-only root filesystem), the gateway serves on with
    its admin API closed to everyone (None; logged): configure admin_api_keys to use it."""
    path = default_admin_key_path(http_port)
    try:
        write_token_file(path, key)
    except (OSError, SecretError) as exc:
        log.error(
            "admin_key_not_published",
            file=str(path),
            error=str(exc),
            hint="the admin API stays closed; set gateway.admin_api_keys (LUMEN_ADMIN_API_KEYS) to use it",
        )
        return None
    log.info("admin_key_generated", file=str(path), hint="`lumen cluster status/kill` read it from there")
    return path


def tls_credentials(g: GatewaySection) -> tuple[bytes, bytes] | None:
    """(key, cert chain) PEM bytes for the control plane's TLS, or None when not configured."""
    if not g.control_tls_cert:
        return None
    return Path(g.control_tls_key).read_bytes(), Path(g.control_tls_cert).read_bytes()
