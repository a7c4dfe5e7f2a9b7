"""Requests whose gateway went away mid-stream, kept for another gateway to adopt.

A gateway that crashes leaves its streams to workers half-read. A request sent with
`lumen.orphan_grace_s` > 0 is not aborted then: its handle waits here, still generating (its output
kept in the handle's log), until a gateway adopts it (`POST /lumen/adopt`: the client resumed its
stream on another gateway) or the grace runs out (then it is aborted and its pages freed). A
finished request waits too: its last tokens may never have reached the client.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from worker_hooks.engine.handle import RequestHandle

log = structlog.get_logger(__name__)


class Orphanage:
    def __init__(self, abort: Callable[[str, str], object]) -> None:
        self._abort = abort  # engine.abort(rid, message)
        self._kept: dict[str, tuple[RequestHandle, asyncio.TimerHandle]] = {}
        self.orphaned_total = 0
        self.adopted_total = 0
        self.expired_total = 0

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, handle: RequestHandle) -> None:
        """The handle's reader left before its end: keep it `handle.orphan_grace_s`."""
        self.release(handle.rid)
        timer = asyncio.get_running_loop().call_later(handle.orphan_grace_s, self._expire, handle.rid)
        self._kept[handle.rid] = (handle, timer)
        self.orphaned_total += 1
        log.info("request orphaned", rid=handle.rid, grace_s=handle.orphan_grace_s, finished=handle.finished)

    def adopt(self, rid: str) -> RequestHandle | None:
        kept = self._kept.pop(rid, None)
        if kept is None:
            return None
        handle, timer = kept
        timer.cancel()
        self.adopted_total += 1
        log.info("request adopted", rid=rid, finished=handle.finished, emitted=len(handle.log))
        return handle

    def release(self, rid: str) -> None:
        kept = self._kept.pop(rid, None)
        if kept is not None:
            kept[1].cancel()

    def clear(self) -> None:
        for rid in list(self._kept):
            self.release(rid)

    def _expire(self, rid: str) -> None:
        kept = self._kept.pop(rid, None)
        if kept is None:
            return
        self.expired_total += 1
        if not kept[0].finished:
            self._abort(rid, "orphaned: no gateway adopted it in time")
        log.info("orphan expired", rid=rid)
