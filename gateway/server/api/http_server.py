"""The HTTP server under the client API: aiohttp's, with OpenAI error bodies and read deadlines.

aiohttp answers what its HTTP parser refuses (a bad request line or method, a bad header, a header
line over 8190 bytes, a bad or overflowing chunk size) itself, before any middleware runs, in plain
text, through `RequestHandler.handle_error`. No public hook reaches that answer, so the server's
protocol is a `RequestHandler` subclass whose `handle_error` sends OpenAI's error body (and logs a
client's garbage at debug level, without a traceback); `ClientRunner` is the `AppRunner` that makes
its connections with it.

Deadlines (limits.header_timeout_s, limits.body_timeout_s):

- head: aiohttp's keep-alive timer runs from the moment a connection opens, and again from the end of
  each response, until the next request head is complete; the runner sets it to header_timeout_s, so
  a connection that sends nothing, or a head it never finishes (slowloris), is closed by then;
- body: the client routes read a body under body_timeout_s (routes.read_json: 408, then close). A
  chunk size of 2**64 - 1 is valid HTTP; such a body ends in 413 at limits.max_request_bytes or in
  408 at the deadline. After an early answer (401, 413, 408) aiohttp drains what is left of the body
  for at most `lingering_time`, which is body_timeout_s too, then closes.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

import structlog
from aiohttp import http_exceptions, web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from gateway.config import Config
from gateway.server.api.middleware import json_error

log = structlog.get_logger(__name__)

MAX_DETAIL_CHARS = 160  # of aiohttp's description of what it could not parse, echoed to the client


def parse_error_code(exc: BaseException | None) -> str:
    """The error `code` of a request aiohttp's parser refused."""
    if isinstance(exc, http_exceptions.LineTooLong):
        return "header_too_large"
    if isinstance(exc, http_exceptions.BadStatusLine | http_exceptions.BadHttpMethod):
        return "bad_request_line"
    if isinstance(exc, http_exceptions.InvalidHeader):
        return "bad_header"
    return "bad_http_request"


def _detail(exc: BaseException | None, message: str | None) -> str:
    text = getattr(exc, "message", None) or message or ""
    first = str(text).strip().splitlines()[0] if str(text).strip() else ""
    first = first.rstrip(":").strip()
    return first[:MAX_DETAIL_CHARS] + ("..." if len(first) > MAX_DETAIL_CHARS else "")


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase.lower()
    except ValueError:
        return "server error"


class ClientRequestHandler(RequestHandler):
    """aiohttp's protocol, answering what never reaches the app in OpenAI's error shape."""

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:  # as aiohttp: a response has begun, there is no answering
            raise ConnectionError("the response has begun; no error response can follow")
        if status >= 500:
            # a handler's error that escaped the error middleware: a bug, logged, never shown
            log.error("unhandled server error", status=status, remote=request.remote, exc_info=exc)
            resp = json_error(status, _phrase(status), "internal_error", None)
        else:
            detail = _detail(exc, message)
            log.debug("bad http request", status=status, remote=request.remote, detail=detail)
            why = f"malformed HTTP request: {detail}" if detail else "malformed HTTP request"
            resp = json_error(status, why, "invalid_request_error", parse_error_code(exc))
        resp.force_close()
        return resp


class _ClientServer(web.Server):
    def __call__(self) -> RequestHandler:
        return ClientRequestHandler(self, loop=self._loop, **self._kwargs)


class ClientRunner(web.AppRunner):
    """`web.AppRunner` for the client API: ClientRequestHandler connections, the config's deadlines.

    `kwargs` are AppRunner's (access_log, shutdown_timeout, handler_cancellation, ...)."""

    def __init__(self, app: web.Application, config: Config, **kwargs: Any) -> None:
        lim = config.limits
        kwargs.setdefault("keepalive_timeout", lim.header_timeout_s)
        kwargs.setdefault("lingering_time", lim.body_timeout_s)
        super().__init__(app, **kwargs)

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        if type(server) is not web.Server:
            raise TypeError(f"aiohttp's AppRunner made a {type(server).__name__}, not a web.Server")
        server.__class__ = _ClientServer  # the same server, making ClientRequestHandler connections
        return server
