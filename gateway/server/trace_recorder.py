"""An opt-in trace of the gateway's own traffic (issue 30 item 2): `gateway.record_trace = PATH`.

One CSV row per generation (a request's choice) once it ends: its arrival time, prompt tokens and
output tokens, nothing of the text, in the layout `lumen sim --trace` and `lumen tune --trace` read
(`TIMESTAMP, ContextTokens, GeneratedTokens`, gateway/sim/workload.py; TIMESTAMP in UTC with
microseconds). The file is rotated by size: past `gateway.record_trace_max_bytes` it is renamed to
PATH.1 (an older PATH.1 is dropped) and a new PATH begins with the header. Rows are written whole,
one `write` each, to a file opened in append mode; a write that fails is logged once and the
recorder stops (serving goes on).
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

import structlog

log = structlog.get_logger("lumen.trace")

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


class TraceRecorder:
    def __init__(self, path: str | Path, max_bytes: int) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.rows = 0
        self._f: TextIO | None = None
        self._size = 0
        self._broken = False
        self._open()

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 (kept open)
        self._size = self._f.tell()
        if self._size == 0:
            self._write(HEADER)

    def _write(self, line: str) -> None:
        assert self._f is not None
        self._f.write(line)
        self._size += len(line)

    def record(self, arrival_unix: float, prompt_tokens: int, output_tokens: int) -> None:
        if self._broken:
            return
        stamp = datetime.fromtimestamp(arrival_unix, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")
        try:
            if self._size >= self.max_bytes:
                self._rotate()
            self._write(f"{stamp},{prompt_tokens},{output_tokens}\n")
            self.rows += 1
        except OSError as exc:
            self._broken = True
            log.error("trace_recording_stopped", path=str(self.path), error=str(exc))

    def _rotate(self) -> None:
        if self._f is not None:
            self._f.close()
        os.replace(self.path, self.path.with_name(self.path.name + ".1"))
        self._open()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
