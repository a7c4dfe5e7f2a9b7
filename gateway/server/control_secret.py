"""The gateway's side of the cluster secret (gateway/protocol/secrets.py): a token is always set, and a
generated one is published in a file only its owner can read, for workers started by hand."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import structlog

from gateway.config import Config
from gateway.config.sections import GatewaySection
from gateway.protocol.secrets import default_token_path, generate_token, read_token_file, write_token_file

log = structlog.get_logger("lumen.control")


def with_control_token(config: Config) -> tuple[Config, bool]:
    """`config` with a control token: the configured one, else the one in `control_token_file`, else a
    new random one. The flag says whether it was generated (and so must be published)."""
    g = config.gateway
    if g.control_token:
        return config, False
    if g.control_token_file and Path(g.control_token_file).exists():
        token, generated = read_token_file(Path(g.control_token_file)), False
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


def tls_credentials(g: GatewaySection) -> tuple[bytes, bytes] | None:
    """(key, cert chain) PEM bytes for the control plane's TLS, or None when not configured."""
    if not g.control_tls_cert:
        return None
    return Path(g.control_tls_key).read_bytes(), Path(g.control_tls_cert).read_bytes()
