"""The admin API (`/admin/...`, admin key): workers, state events, interrupted sessions, draft-assist
pairs, and fault injection on local clusters."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Awaitable
from typing import Protocol

import aiohttp
import structlog
from aiohttp import web

from gateway.config import Config
from gateway.core.load import estimated_load
from gateway.core.types import LoadParams
from gateway.protocol.faults import FAULT_MODES, SLOWDOWN_RANGE, SPEED_MODES
from gateway.server.api.auth import require_admin
from gateway.server.api.errors import InvalidRequest, NotFound, UpstreamFailed, UpstreamRejected
from gateway.server.recovery.levers import OutageLevers
from gateway.server.recovery.pairing import DraftCoordinator
from gateway.server.sessions import SessionManager
from gateway.server.workers.monitor import LoadMonitor

log = structlog.get_logger("lumen.admin")


class FaultInjector(Protocol):
    """Implemented by the local cluster supervisor: what `/admin/workers/{id}/kill` calls."""

    def kill(self, worker_id: str, mode: str) -> Awaitable[dict[str, object]]: ...


class Administered(Protocol):
    """What the admin API reads of the gateway (gateway.server.app.Gateway)."""

    config: Config
    monitor: LoadMonitor
    sessions: SessionManager | None
    assist: DraftCoordinator | None
    levers: OutageLevers
    load_params: LoadParams
    fault_injector: FaultInjector | None
    started_at: float
    http_port: int

    @property
    def http(self) -> aiohttp.ClientSession | None: ...


class AdminAPI:
    def __init__(self, gw: Administered) -> None:
        self.gw = gw

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/admin/workers", self.workers)
        app.router.add_post("/admin/workers/{id}/kill", self.kill)
        app.router.add_get("/admin/events", self.events)
        app.router.add_get("/admin/sessions", self.sessions)
        app.router.add_get("/admin/assist", self.assist)
        app.router.add_get("/admin/gateway", self.gateway)

    async def gateway(self, request: web.Request) -> web.Response:
        """This gateway process: its pid (for a local cluster's kill-gateway fault) and clock."""
        require_admin(request, self.gw.config.gateway.admin_api_keys)
        return web.json_response(
            {
                "pid": os.getpid(),
                "now": round(time.monotonic() - self.gw.started_at, 4),
                "http_port": self.gw.http_port,
            }
        )

    async def workers(self, request: web.Request) -> web.Response:
        require_admin(request, self.gw.config.gateway.admin_api_keys)
        now = time.monotonic()
        held = self.gw.levers.held
        out = []
        for w in sorted(self.gw.monitor.workers.values(), key=lambda r: r.id):
            out.append(
                {
                    "id": w.id,
                    "state": w.state.value,
                    "phase": w.phase.value,
                    "incarnation": w.incarnation,
                    "url": w.http_url,
                    "pid": w.pid,
                    "running": w.running,
                    "waiting": w.waiting,
                    # the limit in force: a Lumen worker's report, or the gateway's hold of an SGLang server
                    "batch_limit": held.limit(w) if w.held_batch else w.batch_limit or w.max_running_requests,
                    "held_waiting": held.waiting(w.id),  # requests waiting at the gateway for a slot
                    "priority_order": w.priority_order,  # an SGLang server ordering its queue by priority
                    # does it promise bit-equal replays, does it honour seeds (core/determinism.py)
                    "determinism": {
                        "label": w.determinism.label,
                        "bit_equal": w.determinism.bit_equal,
                        "seeded": w.determinism.seeded,
                        "note": w.determinism.note,
                    },
                    # failure detection by silence: its heartbeat period (a polled server's: poll
                    # interval + median answer time) and the silences it is suspected and failed at
                    "detection": None
                    if w.thresholds is None
                    else {
                        "period_ms": round(1000 * (w.heartbeat_interval_s or self.gw.monitor.interval_s), 1),
                        "suspect_after_ms": round(1000 * w.thresholds.suspect_s),
                        "fail_after_ms": round(1000 * w.thresholds.fail_s),
                    },
                    "inflight": w.inflight,
                    "kv_tokens_used": w.kv_tokens_used,
                    "kv_capacity_tokens": w.kv_capacity_tokens,
                    "completed_total": w.completed_total,
                    "ckpt_bytes": w.ckpt_bytes,
                    "ckpt_budget_bytes": w.ckpt_budget_bytes,
                    "ckpt_tokens": w.ckpt_tokens,
                    "ckpt_bytes_sent_total": w.ckpt_bytes_sent_total,
                    "ckpt_pages_evicted_total": w.ckpt_pages_evicted_total,
                    "restores_total": w.restores_total,
                    "restored_tokens_total": w.restored_tokens_total,
                    "kv_endpoint": w.kv_endpoint,
                    "draft_endpoint": w.draft_endpoint,
                    "drafted_tokens": w.drafted_tokens,
                    "accepted_tokens": w.accepted_tokens,
                    "draft_rounds": w.draft_rounds,
                    "drafting_for": next((t for d, t in self.gw.assist.pairs.items() if d == w.id), None)
                    if self.gw.assist is not None
                    else None,
                    "load": round(estimated_load(w.view(), self.gw.load_params), 4),
                    "last_heartbeat_ms_ago": round(1000 * (now - w.last_heartbeat), 1),
                    # the gateway's measured decode speed on this worker (gray-failure verdicts)
                    "per_token_ms": round(1000 * w.per_token_s, 2) if w.per_token_at is not None else None,
                    "failure_domain": w.failure_domain,
                    "tp": w.tp,
                    # the reload this incarnation reported (an SGLang agent's relaunch, a Lumen worker's restart)
                    "reload": None
                    if w.reload_seconds is None
                    else {
                        "seconds": round(w.reload_seconds, 4),
                        "source": w.reload_source,
                        "seed": w.reload_seed,
                    },
                }
            )
        return web.json_response(out)

    async def kill(self, request: web.Request) -> web.Response:
        require_admin(request, self.gw.config.gateway.admin_api_keys)
        wid = request.match_info["id"]
        mode = request.query.get("mode", "kill")
        if mode not in FAULT_MODES:
            raise InvalidRequest(f"mode must be one of {', '.join(FAULT_MODES)}, not {mode!r}", param="mode")
        if not self.gw.config.cluster.fault_injection:  # signals and slowdowns alike: test clusters only
            raise InvalidRequest(
                f"mode={mode} needs a cluster started for testing: set cluster.fault_injection = true",
                param="mode",
            )
        if self.gw.fault_injector is None:
            raise NotFound("fault injection is only available on a local cluster (`lumen cluster up`)")
        if mode in SPEED_MODES:
            factor = _slowdown_factor(request.query.get("factor")) if mode == "slow" else 1.0
            result = await self._set_slowdown(wid, mode, factor)
        else:
            result = await self.gw.fault_injector.kill(wid, mode)
        # on the same clock as /admin/events, so detection latency can be read off
        result["at"] = round(time.monotonic() - self.gw.started_at, 4)
        return web.json_response(result)

    async def _set_slowdown(self, wid: str, mode: str, factor: float) -> dict[str, object]:
        """Forward a slow fault to the worker's own endpoint: only its engine can stretch its steps."""
        rec = self.gw.monitor.workers.get(wid)
        if rec is None or self.gw.http is None:
            known = ", ".join(sorted(self.gw.monitor.workers))
            raise NotFound(f"no worker {wid!r} has attached; known: {known}")
        url = f"{rec.http_url}/lumen/fault"
        try:
            # bounded: a hung (SIGSTOPped) worker never answers
            async with self.gw.http.post(
                url,
                json={"slowdown": factor},
                timeout=aiohttp.ClientTimeout(total=self.gw.config.timeouts.worker_connect_s),
            ) as resp:
                if resp.status != 200:
                    raise UpstreamRejected(f"worker {wid} refused slowdown {factor}: {await resp.text()}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise UpstreamFailed(f"worker {wid} did not take slowdown {factor} at {url}: {exc!r}") from exc
        log.warning("fault_injected", worker=wid, pid=rec.pid, mode=mode, factor=factor)
        return {"worker": wid, "pid": rec.pid, "mode": mode, "factor": factor, "t": time.time()}

    async def events(self, request: web.Request) -> web.Response:
        require_admin(request, self.gw.config.gateway.admin_api_keys)
        return web.json_response(
            [
                {
                    "t": round(e.t - self.gw.started_at, 4),
                    "worker": e.worker_id,
                    "incarnation": e.incarnation,
                    "from": e.src.value if e.src else None,
                    "to": e.dst.value,
                    "reason": e.reason,
                }
                for e in self.gw.monitor.events
            ]
        )

    async def sessions(self, request: web.Request) -> web.Response:
        require_admin(request, self.gw.config.gateway.admin_api_keys)
        if self.gw.sessions is None:
            raise NotFound("gateway not started")
        out = []
        for s in self.gw.sessions.recent_interrupted:
            for it in s.interruptions:
                out.append(
                    {
                        "rid": s.job.rid,
                        "worker": it.worker_id,
                        "incarnation": it.incarnation,
                        "reason": it.reason,
                        "t": round(it.at - self.gw.started_at, 4),
                        "emitted_before": it.emitted_before,
                        "resumed_on": it.resumed_on,
                        "action": it.action,
                        "dispatch_reason": it.dispatch_reason,
                        "restored_tokens": it.restored_tokens,
                        "resume_delay_s": None if it.resume_delay is None else round(it.resume_delay, 4),
                    }
                )
        return web.json_response({"live": len(self.gw.sessions.live), "interrupted": out})

    async def assist(self, request: web.Request) -> web.Response:
        require_admin(request, self.gw.config.gateway.admin_api_keys)
        if self.gw.assist is None:
            return web.json_response({"enabled": False, "pairs": {}, "events": []})
        return web.json_response(
            {
                "enabled": True,
                "pairs": self.gw.assist.pairs,
                "events": [
                    {
                        "t": round(e.t - self.gw.started_at, 4),
                        "drafter": e.drafter,
                        "target": e.target,
                        "started": e.started,
                        "reason": e.reason,
                    }
                    for e in self.gw.assist.events
                ],
            }
        )


def _slowdown_factor(raw: str | None) -> float:
    """`factor` of `mode=slow`; a missing or out-of-range one is the client's error, never a default."""
    lo, hi = SLOWDOWN_RANGE
    try:
        factor = float(raw) if raw is not None else math.nan
    except ValueError:
        factor = math.nan
    if not lo <= factor <= hi:  # NaN (missing, not a number) fails too
        raise InvalidRequest(
            f"mode=slow needs factor, a number in [{lo:g}, {hi:g}]; got {raw!r}", param="factor"
        )
    return factor
