"""Foreground runner for `lumen cluster up`: the gateway plus supervised workers, until a signal."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import structlog

from gateway.cluster.supervisor import LocalCluster, synthetic_token_range, worker_specs
from gateway.config import Config
from gateway.server.app import Gateway
from gateway.server.runner import announce, stop_event

log = structlog.get_logger("lumen.runner")


async def run_cluster(config: Config, *, log_dir: Path | None = None, ready_timeout_s: float = 60.0) -> None:
    stop = stop_event()
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
        announce(
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
