"""Foreground runner for `lumen cluster up --engine sglang`: one gateway in this process plus SGLang
servers beside their supervised sidecar agents (`SGLangCluster`), until a signal. Lumen's own workers
run under a supervisor that serves nothing (fleet_run.py). The ready line also carries the gateway's start on `time.monotonic()`
(`started_at_monotonic`): `/admin/events` times are relative to it, so a test on the same Linux host
can put a worker's events (agents print theirs on the same clock) and the gateway's on one line.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import structlog

from gateway.cluster.sglang import SGLangCluster, SGLangLaunch, agent_specs
from gateway.config import Config
from gateway.server.app import Gateway
from gateway.server.runner import announce, stop_event

log = structlog.get_logger("lumen.runner")

SGLANG_READY_TIMEOUT_S = 1800.0  # a real model takes minutes to load


async def run_cluster(
    config: Config,
    *,
    log_dir: Path | None = None,
    ready_timeout_s: float | None = None,
    sglang: SGLangLaunch,
) -> None:
    stop = stop_event()
    logs = log_dir or Path(tempfile.mkdtemp(prefix="lumen-cluster-"))
    cluster: SGLangCluster | None = None
    gw = Gateway(config)
    config = gw.config  # with the control token the gateway generated when none was configured
    await gw.start()
    try:
        control = f"{config.gateway.control_host}:{gw.control_port}"
        agents = agent_specs(
            sglang,
            control,
            default_workers=config.cluster.workers,
            failure_domains=config.cluster.failure_domains,
            restart=config.cluster.restart_killed,
            log_level=config.gateway.log_level,
            stop_grace_s=config.timeouts.shutdown_grace_s,
        )
        cluster = SGLangCluster(
            agents,
            log_dir=logs,
            control_token=config.gateway.control_token,
            control_ca=config.gateway.control_tls_cert,
            restart_agents=config.cluster.restart_killed,
        )
        n = len(agents)
        timeout_s = SGLANG_READY_TIMEOUT_S if ready_timeout_s is None else ready_timeout_s
        gw.fault_injector = cluster
        await cluster.start()
        ready = await _wait_healthy(gw, n, timeout_s, stop)
        if not ready:
            log.error("cluster_not_ready", healthy=gw.monitor.healthy_count(), want=n, logs=str(logs))
        announce(
            {
                "event": "ready" if ready else "degraded",
                "url": f"http://{config.gateway.host}:{gw.http_port}",
                "control_port": gw.control_port,
                "workers": n,
                "healthy_workers": gw.monitor.healthy_count(),
                "mode": config.recovery.mode,
                "engine": "lumen" if sglang is None else "sglang",
                "logs": str(logs),
                "started_at_monotonic": gw.started_at,
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
