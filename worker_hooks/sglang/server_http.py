"""The SGLang server's HTTP endpoints the sidecar agent uses (`ServerHttp`): `GET /ready`, `GET
/v1/loads?include=core` and `POST /abort_request`, each bounded by a timeout, their failures turned into
outcomes (`Probe`, None, `AbortResult`) rather than raised.

A fresh connection per request: a refused connect then always means no server at the URL (a pooled
keep-alive connection the server closed would fail for no fault of the server).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import aiohttp
import msgspec
import structlog

from gateway.protocol.sglang import SGLangAbort, SGLangLoads

log = structlog.get_logger(__name__)


class Probe(StrEnum):
    """One `/ready` poll's outcome."""

    READY = "ready"  # 200
    UNREADY = "unready"  # any other status (SGLang: 503 while starting or unhealthy)
    SILENT = "silent"  # no answer in time (hung)
    REFUSED = "refused"  # the connect failed (refused): nobody listens at the URL


@dataclass(frozen=True, slots=True)
class AbortResult:
    """What `POST /abort_request` got: the server's status, or (status None) the error."""

    status: int | None
    error: str = ""


class ServerHttp:
    """One server's HTTP client; `open` and `close` on the agent's event loop."""

    def __init__(self, url: str, worker_id: str, api_key: str = "") -> None:
        self.url = url
        self.worker_id = worker_id
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}  # its --api-key
        self._http: aiohttp.ClientSession | None = None

    @property
    def is_open(self) -> bool:
        return self._http is not None

    def open(self) -> None:
        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True), headers=self._headers
        )

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def ready(self, timeout_s: float) -> Probe:
        assert self._http is not None
        try:
            async with self._http.get(
                self.url + "/ready", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                return Probe.READY if resp.status == 200 else Probe.UNREADY
        except TimeoutError:
            return Probe.SILENT
        except aiohttp.ClientConnectorError:
            return Probe.REFUSED  # the connect failed: nobody listens at the URL any more
        except (aiohttp.ClientError, ConnectionError):
            return Probe.SILENT  # closed or reset mid-answer: a miss; the next connect will tell

    async def loads(self, timeout_s: float) -> SGLangLoads | None:
        """The server's load now, or None (then the last answer stands)."""
        assert self._http is not None
        try:
            async with self._http.get(
                self.url + "/v1/loads?include=core", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                if resp.status != 200:
                    return None
                return msgspec.json.decode(await resp.read(), type=SGLangLoads)
        except (TimeoutError, aiohttp.ClientError, ConnectionError, msgspec.DecodeError) as exc:
            log.debug("loads poll failed", worker_id=self.worker_id, error=repr(exc))
            return None

    async def abort_all(self, timeout_s: float) -> AbortResult:
        """Ask the server to abort every request it runs (best effort, bounded)."""
        assert self._http is not None
        body = msgspec.json.encode(SGLangAbort(rid="", abort_all=True))
        try:
            async with self._http.post(
                self.url + "/abort_request",
                data=body,
                headers={"content-type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as resp:
                return AbortResult(resp.status)
        except (aiohttp.ClientError, TimeoutError) as exc:
            return AbortResult(None, repr(exc))
