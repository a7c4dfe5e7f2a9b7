"""The one logging set-up of every Lumen process (gateway/protocol/logs.py): the gateway's console or
JSON lines, the workers' JSON lines (with tracebacks), level filtering, the stream."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import pytest
import structlog

from gateway.protocol.logs import configure_logging


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    before = structlog.get_config()
    yield
    structlog.reset_defaults()
    structlog.configure(**before)


def test_json_lines_carry_level_utc_time_and_the_traceback() -> None:
    out = io.StringIO()
    configure_logging("info", "json", stream=out)
    log = structlog.get_logger("t")
    log.debug("hidden")
    try:
        raise ZeroDivisionError("boom")
    except ZeroDivisionError:
        log.exception("failed", rid="r1")
    (line,) = out.getvalue().splitlines()
    entry = json.loads(line)
    assert entry["event"] == "failed" and entry["level"] == "error" and entry["rid"] == "r1"
    assert entry["timestamp"].endswith("Z") and "ZeroDivisionError: boom" in entry["exception"]


def test_console_lines_and_an_unknown_level_is_info() -> None:
    out = io.StringIO()
    configure_logging("no-such-level", "console", stream=out)
    log = structlog.get_logger("t")
    log.debug("hidden")
    log.info("shown", worker="w0")
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and "shown" in lines[0] and "worker=w0" in lines[0] and "[info" in lines[0]


def test_every_process_uses_the_one_set_up() -> None:
    import gateway.server.logs as gateway_logs
    import worker_hooks.engine.__main__ as engine_main

    assert gateway_logs.configure_logging is configure_logging
    assert engine_main.configure_logging is configure_logging
