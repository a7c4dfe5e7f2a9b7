"""What an SGLang server was launched with, read from its `GET /server_info` once it serves.

Two things are read. Its numerics (dtype, device, attention and sampling backends, deterministic
inference), judged by `gateway.core.determinism.judge_numerics` into the record's `determinism`: does
it promise bit-equal replays, does it honour `sampling_seed` (/admin/workers, `lumen cluster status`,
the non-exact resume count, the `Lumen-Replay` header). And the queue order
(`gateway.protocol.sglang.orders_by_priority`): a server launched
with `--enable-priority-scheduling --schedule-low-priority-values-first --disable-priority-preemption`
(and the default FCFS policy) is sent each request's `priority` (`gateway.core.outage.queue_priority`),
so it keeps the queue order the simulator and Lumen's own workers keep: resumed requests first, FIFO,
and aged shortest-prefill-first while a recovery lasts. Lumen's SGLang agent adds those flags to the
servers it launches (worker_hooks/sglang/launcher.py); agentless servers are read the same way.

Each incarnation is asked once, when it turns HEALTHY, in a task of its own under a deadline; a server
that does not answer, or answers something else, is sent no priority (its own FIFO order) and keeps
the judgement `UNKNOWN` (promises nothing). Servers behind a sidecar agent are read the same way, at
the URL their agent reports.
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import msgspec
import structlog

from gateway.core.determinism import Numerics, judge_numerics
from gateway.core.health import WorkerState
from gateway.protocol.generate import EngineKind
from gateway.protocol.sglang import SGLangServerInfo, orders_by_priority
from gateway.server.workers.monitor import LoadMonitor, StateEvent

log = structlog.get_logger("lumen.sglang")

_DECODE = msgspec.json.Decoder(SGLangServerInfo)


class ServerInfoReader:
    def __init__(self, monitor: LoadMonitor, http: aiohttp.ClientSession, timeout_s: float = 5.0) -> None:
        self.monitor = monitor
        self.http = http
        self.timeout_s = timeout_s
        self._tasks: set[asyncio.Task[None]] = set()
        self._asked: dict[str, int] = {}  # worker -> the incarnation last asked

    def serving(self, ev: StateEvent) -> None:
        """A worker turned HEALTHY (the recovery coordinator tells): an SGLang incarnation not asked
        yet is asked, in a task of its own."""
        rec = self.monitor.workers.get(ev.worker_id)
        if ev.dst is not WorkerState.HEALTHY or rec is None or rec.engine is not EngineKind.SGLANG:
            return
        if rec.incarnation != ev.incarnation or self._asked.get(rec.id) == rec.incarnation:
            return
        self._asked[rec.id] = rec.incarnation
        task = asyncio.get_running_loop().create_task(self._read(rec.id, rec.incarnation, rec.http_url))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _read(self, worker_id: str, incarnation: int, url: str) -> None:
        try:
            async with self.http.get(
                url + "/server_info", timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            ) as resp:
                if resp.status != 200:
                    raise ValueError(f"/server_info answered {resp.status}")
                info = _DECODE.decode(await resp.read())
        except (aiohttp.ClientError, TimeoutError, ValueError, msgspec.DecodeError) as exc:
            log.warning("sglang_server_info_unread", worker=worker_id, error=repr(exc))
            return
        rec = self.monitor.workers.get(worker_id)
        if rec is None or rec.incarnation != incarnation:
            return
        rec.priority_order = orders_by_priority(info)
        rec.determinism = judge_numerics(numerics(info))
        log.info(
            "sglang_server_info",
            worker=worker_id,
            priority_order=rec.priority_order,
            bit_equal=rec.determinism.bit_equal,
            seeded=rec.determinism.seeded,
            determinism=rec.determinism.note,
        )

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task


def numerics(info: SGLangServerInfo) -> Numerics:
    return Numerics(
        dtype=info.dtype or "auto",
        attention_backend=info.attention_backend or "",
        sampling_backend=info.sampling_backend or "",
        deterministic_inference=info.enable_deterministic_inference,
        device=info.device or "",
    )
