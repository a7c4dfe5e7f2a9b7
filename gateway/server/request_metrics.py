"""What every HTTP answer of the gateway was, for /metrics (issue 30: the alert rules in deploy/prometheus/).

One middleware, outside the error middleware (so it sees the status a client got, errors included):
`lumen_requests{endpoint, outcome}` by the route's canonical path ("unmatched" for others: no label per
probed path) and status class (2xx, 4xx, 5xx); and, for requests that resume a stream (a
`Last-Event-ID`), `lumen_stream_resume_requests{outcome}`: ok (2xx), refused (4xx: a forged, foreign or
stale id) or failed (5xx). A stream's status is counted when it ends. And `lumen_tpot_seconds`: each
choice's time per output token as its client got them (respond.py `StepTimes`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import Counter, Histogram

from gateway.server.api.respond import TPOT_KEY
from gateway.server.api.resume import LAST_EVENT_ID
from gateway.server.metrics import GatewayMetrics

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def outcome_of(status: int) -> str:
    return f"{status // 100}xx"


def request_metrics_middleware(
    metrics: GatewayMetrics,
) -> Middleware:
    resumes = Counter(
        "lumen_stream_resume_requests",
        "Requests that resume a stream (Last-Event-ID), by outcome: ok, refused (4xx), failed (5xx)",
        ["outcome"],
        registry=metrics.registry,
    )
    for o in ("ok", "refused", "failed"):
        resumes.labels(outcome=o)  # exported from the start, at 0
    tpot = Histogram(
        "lumen_tpot_seconds",
        "Time per output token as each client got them (a choice's steps after its first)",
        buckets=(0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5),
        registry=metrics.registry,
    )

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            resource = request.match_info.route.resource
            endpoint = resource.canonical if resource is not None else "unmatched"
            metrics.requests.labels(endpoint=endpoint, outcome=outcome_of(status)).inc()
            for seconds in request.get(TPOT_KEY, ()):
                tpot.observe(seconds)
            if LAST_EVENT_ID in request.headers:
                kind = "ok" if status < 400 else "refused" if status < 500 else "failed"
                resumes.labels(outcome=kind).inc()

    return middleware
