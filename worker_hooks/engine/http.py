"""What the worker's HTTP route modules share: the app key of the running worker, JSON responses, and
the one place where errors become responses.

The route modules (server.py, info.py, openai_routes.py) read the worker through `WORKER`, typed by
`WorkerView` (what they use of service.Worker), so they never import the module that assembles them.
A refusal is an `OpenAIError` (errors.py); `error_response` answers it (status and OpenAI's body), and
`decoded` turns a body msgspec cannot decode into one (`MalformedRequest`).
"""

from __future__ import annotations

from typing import Protocol, TypeVar

import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry

from gateway.protocol.generate import encode
from gateway.protocol.launch import EngineSpec
from gateway.protocol.openai.errors import OpenAIError
from worker_hooks.engine.engine import Engine
from worker_hooks.engine.errors import MalformedRequest

T = TypeVar("T")


class WorkerView(Protocol):
    """The running worker as the route handlers see it (service.Worker is one)."""

    spec: EngineSpec
    engine: Engine
    registry: CollectorRegistry
    started_at: int  # unix seconds
    url: str
    port: int


WORKER: web.AppKey[WorkerView] = web.AppKey("worker")


def json_response(obj: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=encode(obj), content_type="application/json")


def error_response(exc: OpenAIError) -> web.Response:
    """A refusal's answer: its status and OpenAI's error body."""
    return json_response(exc.body(), status=exc.status)


def decoded(decoder: msgspec.json.Decoder[T], body: bytes, what: str) -> T:
    """`body` decoded, or `MalformedRequest` naming `what` (a route) when it is not JSON of that shape."""
    try:
        return decoder.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise MalformedRequest(f"invalid {what} body: {exc}") from exc
