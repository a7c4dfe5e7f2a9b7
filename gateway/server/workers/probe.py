"""The failure detector's independent probe: is a silent worker's process still there?

Heartbeats travel on the control stream; the probe takes another path, a fresh TCP connection to the
worker's own HTTP server and `GET /health` on it. Any HTTP answer (200, 503 while loading, 401 without
the cluster's bearer) means the process runs its event loop; a refused or reset connection means it is
gone; no answer yet means nothing, and the detector (core/detector.py) decides when "not yet" has
lasted long enough. A stopped process (SIGSTOP) still gets its TCP connections accepted by the
kernel, so only a real answer counts as life.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp
import structlog

log = structlog.get_logger("lumen.probe")

# `await prober(http_url)`: True (the worker's process answered), False (refused: it is gone), None
Prober = Callable[[str], Awaitable[bool | None]]


class HttpProbe:
    """`await probe(url)`: True (answered), False (refused: the process is gone), None (no answer
    within `timeout_s`, or an error that says neither)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._http: aiohttp.ClientSession | None = None

    async def __call__(self, url: str) -> bool | None:
        if self._http is None:
            # a fresh connection per probe: a kept-alive one could hide a worker that stopped accepting
            self._http = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True, limit=0),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            )
        try:
            async with self._http.get(url + "/health", allow_redirects=False) as resp:
                await resp.read()
                return True
        except aiohttp.ClientConnectorError as exc:
            return False if isinstance(exc.os_error, ConnectionRefusedError) else None
        except (aiohttp.ServerDisconnectedError, ConnectionResetError):
            return False
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            log.debug("probe_unanswered", url=url, error=repr(exc))
            return None

    async def close(self) -> None:
        http, self._http = self._http, None
        if http is not None:
            await http.close()
            await asyncio.sleep(0)
