"""The one place errors become HTTP responses: OpenAI's `{"error": {"message", "type", "param", "code"}}`.

GatewayError -> its status and body; aiohttp's own HTTP errors (unknown route, wrong method, body too
large) -> the same JSON shape; anything else -> 500 with a generic message, the traceback logged and
never shown. A stream that has begun handles its own errors (see routes.py), since its status is sent.
Errors before a request reaches the app (aiohttp's HTTP parser: a bad request line, header or chunk
size) get the same body from http_server.py, which reuses `json_error`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec
import structlog
from aiohttp import hdrs, web

from gateway.protocol.openai.errors import error_body
from gateway.server.api.errors import (
    GatewayError,
    NotFound,
    Overloaded,
    RequestTimeout,
    RequestTooLarge,
    Unauthorized,
    UnreadableBody,
)
from gateway.server.api.ratelimit import retry_after

log = structlog.get_logger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_error(
    status: int, message: str, type_: str, code: str | None, headers: dict[str, str] | None = None
) -> web.Response:
    body = error_body(message, type_, code)
    return web.Response(
        status=status, body=msgspec.json.encode(body), content_type="application/json", headers=headers
    )


# after these the connection's input is unread or in an unknown state: the answer closes it
_CLOSING = (UnreadableBody, RequestTooLarge, RequestTimeout)


class _ClosedAfterResponse(web.Response):
    """An answer whose connection closes as soon as it is written: a request body that did not arrive
    in time is not drained for another limits.body_timeout_s (aiohttp's lingering close) with the
    socket held open (issue 29: a held body's 408 came at 30 s, its close at 60 s)."""

    async def write_eof(self, data: bytes = b"") -> None:
        transport = self._req.transport if self._req is not None else None  # write_eof forgets _req
        await super().write_eof(data)
        if transport is not None:
            transport.close()  # what is written is flushed first; the client is sending nothing


def error_response(exc: GatewayError) -> web.Response:
    headers = {hdrs.WWW_AUTHENTICATE: "Bearer"} if isinstance(exc, Unauthorized) else None
    if isinstance(exc, Overloaded):
        headers = {hdrs.RETRY_AFTER: retry_after(exc.retry_after_s)}
    resp = (_ClosedAfterResponse if isinstance(exc, RequestTimeout) else web.Response)(
        status=exc.status,
        body=msgspec.json.encode(exc.body()),
        content_type="application/json",
        headers=headers,
    )
    if isinstance(exc, _CLOSING):
        resp.force_close()
    return resp


def _http_error(request: web.Request, exc: web.HTTPException) -> web.Response:
    if exc.status == 404:
        return error_response(NotFound(f"no route for {request.method} {request.path}", code="unknown_route"))
    if exc.status == 413:
        return error_response(RequestTooLarge(exc.text or "request body too large"))
    if exc.status == 405:
        allow = exc.headers.get(hdrs.ALLOW, "")
        return json_error(
            405,
            f"method {request.method} is not allowed for {request.path} (allowed: {allow})",
            "invalid_request_error",
            "method_not_allowed",
            {hdrs.ALLOW: allow},
        )
    type_ = "invalid_request_error" if exc.status < 500 else "internal_error"
    return json_error(exc.status, exc.reason, type_, None)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except GatewayError as exc:
        return error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _http_error(request, exc)
    except ConnectionResetError:
        raise  # the client left: there is nobody to answer
    except Exception:
        # the outermost boundary: a bug must not leak a traceback, nor kill the connection silently
        log.exception("unhandled error", method=request.method, path=request.path)
        return json_error(500, "internal server error", "internal_error", None)
