"""One worker in-process: engine + HTTP server + (when a control address is given) the control agent.

    async with start_worker(spec) as w:
        w.url, w.engine, w.incarnation

Shutdown order: the agent detaches, the engine ends every stream with an abort chunk and stops its
loop, then the HTTP server closes. Everything started here is awaited there.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry

from gateway.protocol.launch import EngineSpec
from worker_hooks.agent import Agent
from worker_hooks.engine import info, openai_routes, server
from worker_hooks.engine.auth import bearer_middleware
from worker_hooks.engine.engine import Engine
from worker_hooks.engine.http import WORKER
from worker_hooks.engine.metrics import make_registry

log = structlog.get_logger(__name__)

# how long shutdown waits for HTTP handlers after the engine has ended their streams
SHUTDOWN_TIMEOUT_S = 2.0


class Worker:
    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.engine = Engine(spec)
        self.registry: CollectorRegistry = make_registry(self.engine)
        self.started_at = int(time.time())
        self.url = ""
        self.port = 0
        self.agent: Agent | None = None  # the first gateway's (the only one, mostly)
        self.agents: list[Agent] = []

    @property
    def worker_id(self) -> str:
        return self.engine.worker_id

    @property
    def incarnation(self) -> int:
        return self.engine.incarnation

    @property
    def kv_endpoint(self) -> str:
        """Where this worker's checkpoint store takes pages ("" when it runs none)."""
        return self.engine.ckpt.endpoint

    def make_app(self) -> web.Application:
        app = web.Application(
            client_max_size=64 * 1024**2, middlewares=[bearer_middleware(self.spec.control_token)]
        )
        app[WORKER] = self
        server.add_routes(app, fault_injection=self.spec.fault_injection)
        openai_routes.add_routes(app)  # /v1/completions and /v1/chat/completions
        info.add_routes(app)
        return app


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@asynccontextmanager
async def start_worker(spec: EngineSpec) -> AsyncIterator[Worker]:
    """Start a worker on spec.host:spec.port (0 = any free port) and stop it on exit."""
    worker = Worker(spec)
    runner = web.AppRunner(
        worker.make_app(), handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, spec.host, spec.port)
        await site.start()
        addr = runner.addresses[0]
        worker.port = int(addr[1])
        worker.url = _url(spec.host, worker.port)
        await worker.engine.start()
        try:
            if spec.control_address:
                # one control session per gateway of the cluster, over the one engine
                for address in (spec.control_address, *spec.more_control_addresses):
                    agent = Agent(spec, worker.engine, worker.url, address=address)
                    await agent.start()
                    worker.agents.append(agent)
                for agent in worker.agents:
                    agent.engine_role.siblings = [a for a in worker.agents if a is not agent]
                worker.agent = worker.agents[0]
            log.info(
                "worker listening",
                worker_id=worker.worker_id,
                url=worker.url,
                incarnation=worker.incarnation,
                phase=worker.engine.phase.value,
                kv_endpoint=worker.kv_endpoint,
            )
            try:
                yield worker
            finally:
                for agent in worker.agents:
                    await agent.stop()
        finally:
            await worker.engine.stop()
    finally:
        await runner.cleanup()
