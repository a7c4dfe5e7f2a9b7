"""How every Lumen process logs: structlog lines on stderr (or a given stream), for people (`console`)
or one JSON object a line (`json`, with the traceback of a logged exception as `exception`), stamped
in UTC (ISO 8601) and filtered by level.

The one set-up of the gateway (`lumen gateway`, `lumen cluster up`: gateway/server/logs.py), Lumen's
worker (worker_hooks/engine/__main__.py) and the SGLang agent (worker_hooks/sglang/__main__.py), here
because gateway.protocol is what the gateway and the workers share.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog

FORMATS = ("console", "json")


def configure_logging(level: str = "info", fmt: str = "console", *, stream: TextIO | None = None) -> None:
    """Log at `level` (a logging level name; an unknown one is info) and above, in `fmt`, to `stream`
    (default: stderr)."""
    processors: list[structlog.typing.Processor] = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if fmt == "json":
        processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        processors.append(structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr if stream is None else stream),
        cache_logger_on_first_use=True,
    )
