"""Fences that outlive the gateway process: a small append-only file under `gateway.state_dir`.

A gateway that declares a worker incarnation FAILED (silence, a broken stream, removal) fences it:
that incarnation is never admitted again, so a zombie cut off by a partition cannot stream the output
of requests that already resumed elsewhere. The fence used to live only in memory, so a gateway that
was killed and restarted admitted the fenced incarnation when the partition healed (the chaos soak's
`fenced` violation, docs/chaos.md). The ledger writes each fence to disk (flushed and fsynced) before
anything acts on it, and the monitor starts from it, so the restarted gateway refuses that incarnation
and the worker resets and rejoins as a new one, as if the gateway had never gone.

The file keeps only the highest fenced incarnation per worker: it is rewritten compactly (to a
temporary file, then renamed) when it has grown to several lines per worker. A torn last line (the
process died while writing it, before its fence took effect) and lines of another version are skipped
and logged. Fences recorded while the gateway shuts down are not written: its own streams ending is
not a failure of the workers (the monitor stops recording first).
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

import msgspec
import structlog

from gateway.config.errors import ConfigError
from gateway.protocol.fence_ledger import FENCE_LEDGER_VERSION, FenceEntry

log = structlog.get_logger("lumen.fences")

LEDGER_FILE = "fences.jsonl"
# rewrite the file when it holds more than this many lines per fenced worker (and at least this many)
COMPACT_FACTOR = 4
COMPACT_MIN_LINES = 64
# workers remembered at most (the least recently fenced forgotten first), as the monitor's tombstones
MAX_WORKERS = 4096
# what a line may hold (issue 29: a corrupt or hostile ledger must not lock a worker out for good).
# Incarnations are microseconds since the epoch (max(now, previous + 1)): one more than a day ahead
# of this gateway's clock is no incarnation any worker has had, and would fence all its future ones
MAX_AHEAD_US = 86_400 * 1_000_000
MAX_LINE_BYTES = 4096
MAX_WORKER_ID_CHARS = 256


class FenceLedger:
    def __init__(self, state_dir: str | Path) -> None:
        self.dir = Path(state_dir)
        self.path = self.dir / LEDGER_FILE
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.fences = self._read()
            self._lines = len(self.fences)
            self._compact()  # start from one line per worker
        except OSError as exc:
            raise ConfigError("gateway.state_dir", str(self.dir), f"cannot keep fences there: {exc}") from exc
        self._encoder = msgspec.json.Encoder()
        self.closed = False

    def _read(self) -> dict[str, int]:
        fences: dict[str, int] = {}
        if not self.path.exists():
            return fences
        decoder = msgspec.json.Decoder(FenceEntry)
        latest = time.time_ns() // 1000 + MAX_AHEAD_US
        with self.path.open("rb") as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                if len(line) > MAX_LINE_BYTES:
                    log.warning("fence_line_skipped", file=str(self.path), line=n, error=f"{len(line)} bytes")
                    continue
                try:
                    e = decoder.decode(line)
                except msgspec.DecodeError as exc:
                    log.warning("fence_line_skipped", file=str(self.path), line=n, error=str(exc)[:200])
                    continue
                if e.v != FENCE_LEDGER_VERSION:
                    log.warning("fence_line_skipped", file=str(self.path), line=n, error=f"version {e.v}")
                    continue
                if not 0 <= e.incarnation <= latest or not 0 < len(e.worker) <= MAX_WORKER_ID_CHARS:
                    log.warning(
                        "fence_line_skipped",
                        file=str(self.path),
                        line=n,
                        error=f"out of bounds: worker of {len(e.worker)} chars, incarnation {e.incarnation} "
                        f"(more than {MAX_AHEAD_US // 1_000_000} s ahead of now, or negative)",
                    )
                    continue
                fences[e.worker] = max(e.incarnation, fences.pop(e.worker, e.incarnation))
        while len(fences) > MAX_WORKERS:
            del fences[next(iter(fences))]
        if fences:
            log.info("fences_loaded", file=str(self.path), workers=len(fences))
        return fences

    def record(self, worker: str, incarnation: int) -> None:
        """Make `worker`'s incarnations up to `incarnation` fenced, durably, before returning."""
        if self.closed or incarnation <= self.fences.get(worker, -1):
            return
        self.fences.pop(worker, None)
        self.fences[worker] = incarnation  # the most recently fenced last
        if len(self.fences) > MAX_WORKERS:
            del self.fences[next(iter(self.fences))]
        line = self._encoder.encode(FenceEntry(worker, incarnation, round(time.time(), 3))) + b"\n"
        try:
            with self.path.open("ab") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            self._lines += 1
            if self._lines > max(COMPACT_MIN_LINES, COMPACT_FACTOR * len(self.fences)):
                self._compact()
        except OSError as exc:  # the fence still holds in memory; only a restart would forget it
            log.error(
                "fence_not_persisted",
                file=str(self.path),
                worker=worker,
                incarnation=incarnation,
                error=str(exc),
            )

    def _compact(self) -> None:
        # a new file of a random name (O_EXCL, O_NOFOLLOW: nothing planted there is written through)
        tmp = self.path.with_name(f".{self.path.name}.{secrets.token_hex(8)}")
        now = round(time.time(), 3)
        enc = msgspec.json.Encoder()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                for worker, inc in self.fences.items():
                    f.write(enc.encode(FenceEntry(worker, inc, now)) + b"\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._lines = len(self.fences)

    def close(self) -> None:
        """Stop recording (the gateway is shutting down: its streams ending fence nothing)."""
        self.closed = True
