"""Foreground runners for `lumen gateway` and `lumen cluster up`: start, wait for a signal, stop."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import tempfile
from pathlib import Path

import structlog

from gateway.server.app import Gateway
from gateway.server.cluster import LocalCluster, synthetic_token_range, worker_specs
from gateway.server.config import Config

log = structlog.get_logger("lumen.runner")


def _stop_event() -> asyncio.Event:
    ev = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, ev.set)
    return ev


async def run_gateway(config: Config) -> None:
    stop = _stop_event()
    gw = Gateway(config)
    await gw.start()
    _announce(
        {
            "event": "ready",
            "url": f"http://{config.gateway.host}:{gw.http_port}",
            "control_port": gw.control_port,
        }
    )
    try:
        await stop.wait()
    finally:
        await gw.stop()


async def run_cluster(config: Config, *, log_dir: Path | None = None, ready_timeout_s: float = 60.0) -> None:
    stop = _stop_event()
    logs = log_dir or Path(tempfile.mkdtemp(prefix="lumen-cluster-"))
    cluster: LocalCluster | None = None
    gw = Gateway(config)
    await gw.start()
    try:
        tokens = synthetic_token_range(config.tokenizer.kind, gw.tokenizer.vocab_size)
        specs = worker_specs(config, f"{config.gateway.control_host}:{gw.control_port}", tokens)
        cluster = LocalCluster(specs, log_dir=logs, restart_killed=config.cluster.restart_killed)
        gw.fault_injector = cluster
        await cluster.start()
        ready = await _wait_healthy(gw, len(specs), ready_timeout_s, stop)
        if not ready:
            log.error(
                "cluster_not_ready", healthy=gw.monitor.healthy_count(), want=len(specs), logs=str(logs)
            )
        _announce(
            {
                "event": "ready" if ready else "degraded",
                "url": f"http://{config.gateway.host}:{gw.http_port}",
                "control_port": gw.control_port,
                "workers": len(specs),
                "healthy_workers": gw.monitor.healthy_count(),
                "mode": config.recovery.mode,
                "logs": str(logs),
            }
        )
        await stop.wait()
    finally:
        log.info("cluster_stopping")
        await gw.stop()
        if cluster is not None:
            await cluster.stop(config.timeouts.shutdown_grace_s)


async def _wait_healthy(gw: Gateway, n: int, timeout_s: float, stop: asyncio.Event) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline and not stop.is_set():
        if gw.monitor.healthy_count() >= n:
            return True
        await asyncio.sleep(0.05)
    return gw.monitor.healthy_count() >= n


def _announce(obj: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()
