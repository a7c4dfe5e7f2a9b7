"""The gateway's logging set-up, under the name `lumen gateway` and `lumen cluster up` import it by:
the one every Lumen process uses (gateway/protocol/logs.py; console or JSON lines on stderr)."""

from __future__ import annotations

from gateway.protocol.logs import configure_logging

__all__ = ["configure_logging"]
