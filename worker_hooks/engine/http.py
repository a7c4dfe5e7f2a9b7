"""What the worker's HTTP route modules share: the app key of the running worker, and JSON responses.

The route modules (server.py, info.py, openai_routes.py) read the worker through `WORKER`, typed by
`WorkerView` (what they use of service.Worker), so they never import the module that assembles them.
"""

from __future__ import annotations

from typing import Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry

from gateway.protocol.generate import encode
from gateway.protocol.launch import EngineSpec
from worker_hooks.engine.engine import Engine


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
