"""Each SGLang server's API key, sent as the bearer of every request the gateway makes to it.

An SGLang server launched with `--api-key` refuses (401) every request without it except /health,
/ready and /metrics. The key of an agentless server comes from its `[[sglang.workers]]` entry
(`api_key`, `api_key_file`, or the environment's LUMEN_SGLANG_API_KEY / LUMEN_SGLANG_API_KEY_FILE);
an agent reports its server's key in Hello (`api_key`, over the authenticated control plane): the one
the user gave its `--launch` arguments or `--api-key-file`, else one it generated and launched the
server with (worker_hooks/sglang/launcher.py). It is never put on a command line the gateway builds.

One client middleware on the gateway's worker session (app.py) puts the key of the request's origin
in place of the session's default bearer (the one Lumen's own workers take): the configured keys
first (they are needed before a server attaches: its first polls), then the attached records'.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import aiohttp
from aiohttp import hdrs
from yarl import URL

from gateway.server.workers.records import WorkerRecord


def origin(url: str | URL) -> str:
    u = URL(url) if isinstance(url, str) else url
    return f"{u.scheme}://{u.host}:{u.port}"


class ServerKeys:
    """Origin (scheme://host:port) -> API key: the configured ones, then the records' (Hello)."""

    def __init__(
        self, configured: Mapping[str, str], records: Callable[[], Iterable[WorkerRecord]] | None = None
    ) -> None:
        self._configured = {origin(u): k for u, k in configured.items() if k}
        self._records = records

    def key_for(self, url: URL) -> str:
        o = origin(url)
        key = self._configured.get(o)
        if key:
            return key
        if self._records is not None:
            for rec in self._records():
                if rec.api_key and origin(rec.http_url) == o:
                    return rec.api_key
        return ""

    async def middleware(
        self, request: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType
    ) -> aiohttp.ClientResponse:
        key = self.key_for(request.url)
        if key:
            request.headers[hdrs.AUTHORIZATION] = f"Bearer {key}"
        return await handler(request)
