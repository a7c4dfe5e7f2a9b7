"""The worker's HTTP API takes requests only from its cluster: every route but `/health` needs the
bearer the gateway derives from the control token (gateway/protocol/secrets.py). A worker run without
a token (in-process tests) checks nothing. A refusal is a 401 in the OpenAI error shape, and logged."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import structlog
from aiohttp import web
from aiohttp.typedefs import Middleware

from gateway.protocol.openai.errors import Unauthorized
from gateway.protocol.secrets import bearer_matches, worker_http_bearer
from worker_hooks.engine.http import error_response

log = structlog.get_logger(__name__)

OPEN_PATHS = frozenset({"/health"})  # liveness probes need no secret and learn nothing

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def bearer_middleware(control_token: str) -> Middleware:
    expected = worker_http_bearer(control_token)

    @web.middleware
    async def check_bearer(request: web.Request, handler: Handler) -> web.StreamResponse:
        open_path = not expected or request.path in OPEN_PATHS
        if not open_path and not bearer_matches(request.headers.get("Authorization"), expected):
            log.warning("http_unauthorized", path=request.path, peer=request.remote)
            return error_response(Unauthorized("this worker takes requests from its cluster's gateway only"))
        return await handler(request)

    return check_bearer
