"""Best-effort `/abort_request` by rid, in the background (SGLang's body; Lumen's workers take it too).

A gateway aborts what it gives up on (a client gone, a stop string, a request moved elsewhere): a
dropped connection alone does not end it where workers keep orphaned requests for adoption, nor on
every SGLang deployment. A failed abort is logged, never raised.
"""

from __future__ import annotations

import asyncio

import aiohttp
import structlog

from gateway.protocol.generate import encode
from gateway.protocol.sglang import SGLangAbort

log = structlog.get_logger("lumen.sessions")

ABORT_TIMEOUT_S = 2.0


class Aborts:
    def __init__(self, http: aiohttp.ClientSession) -> None:
        self.http = http
        self._tasks: set[asyncio.Task[None]] = set()

    def post(self, url: str, rid: str) -> None:
        task = asyncio.get_running_loop().create_task(self._post(url, rid))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _post(self, url: str, rid: str) -> None:
        try:
            async with self.http.post(
                url.rstrip("/") + "/abort_request",
                data=encode(SGLangAbort(rid=rid)),
                headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=ABORT_TIMEOUT_S),
            ) as resp:
                if resp.status != 200:
                    log.warning("abort_refused", url=url, rid=rid, status=resp.status)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.info("abort_failed", url=url, rid=rid, error=repr(exc))
