"""Foreground runner for `lumen cluster up`: a supervisor that serves nothing, N gateway processes,
and W workers attached to every gateway — Lumen's own workers, or (`--engine sglang`) SGLang servers
beside their sidecar agents (gateway/cluster/sglang.py), which the agents start and restart.

The ready line (one JSON object on stdout) gives the first gateway's `url` and `control_port` as
before, every gateway's in `urls` / `control_ports` / `gateway_pids`, and the first gateway's start on
`time.monotonic()` (`started_at_monotonic`, the clock of its /admin/events).
"""

from __future__ import annotations

import asyncio
import signal
import tempfile
from pathlib import Path

import msgspec
import structlog

from gateway.cluster.fleet import GatewayFleet, healthy_everywhere
from gateway.cluster.sglang import Checkpoints, SGLangCluster, SGLangLaunch, agent_specs
from gateway.cluster.supervisor import LocalCluster, synthetic_token_range, worker_specs
from gateway.config import Config, recovery_policy
from gateway.core.costmodel import ReloadSource
from gateway.core.modes import policy_for
from gateway.protocol.secrets import default_admin_key_path
from gateway.server.api.tokenizer import make_tokenizer
from gateway.server.control_secret import publish_token, with_admin_key, with_control_token
from gateway.server.local_faults import LaunchRegistry
from gateway.server.runner import announce, stop_event

log = structlog.get_logger("lumen.runner")

SGLANG_READY_TIMEOUT_S = 1800.0  # a real model takes minutes to load


def sglang_checkpoints(config: Config) -> Checkpoints | None:
    """Lumen's checkpoints in the SGLang servers when the recovery mode writes any."""
    if not (config.checkpoint.enabled and policy_for(config.recovery.mode).checkpointing):
        return None
    return Checkpoints(budget_bytes=config.checkpoint.budget_bytes, page_size=config.engine.page_size)


async def run_fleet(
    config: Config,
    config_args: list[str],
    *,
    gateways: int = 1,
    shared_port: bool = False,
    log_dir: Path | None = None,
    ready_timeout_s: float | None = None,
    sglang: SGLangLaunch | None = None,
) -> None:
    stop = stop_event()
    logs = log_dir or Path(tempfile.mkdtemp(prefix="lumen-cluster-"))
    logs.mkdir(parents=True, exist_ok=True)
    # a hangup ends the cluster as SIGINT/SIGTERM do: every exit path that runs code cleans up
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, stop.set)
    config, _ = with_control_token(config)  # one token for every gateway (a generated one if none)
    # one admin key for every gateway: the configured ones, else one generated here (never open)
    config, admin_generated = with_admin_key(config)
    # signal faults only on a cluster started for testing, and only to what this supervisor launched
    launched = LaunchRegistry.create() if config.cluster.fault_injection else None
    fleet = GatewayFleet(
        config,
        config_args,
        gateways=gateways,
        port=config.gateway.port,
        shared_port=shared_port,
        log_dir=logs,
        admin_key=config.gateway.admin_api_keys[0] if admin_generated else "",
        launched=None if launched is None else launched.path,
    )
    token_file = publish_token(config.gateway, fleet.gateways[0].control_port)
    # what the first gateway removes should this supervisor die without cleaning up (SIGKILL)
    fleet.files = lambda: [
        token_file,
        *(default_admin_key_path(g.http_port) for g in fleet.gateways if admin_generated and g.http_port),
        *([launched.path] if launched is not None else []),
    ]
    cluster: LocalCluster | SGLangCluster | None = None
    watcher: asyncio.Task[None] | None = None
    try:
        await fleet.start()
        first, *more = fleet.control_addresses
        if sglang is None:
            tokens = synthetic_token_range(config.tokenizer.kind, make_tokenizer(config.tokenizer).vocab_size)
            specs = [
                msgspec.structs.replace(s, more_control_addresses=more)
                for s in worker_specs(config, first, tokens)
            ]
            local = LocalCluster(
                specs,
                log_dir=logs,
                restart_killed=config.cluster.restart_killed,
                hung_restart_grace_s=config.cluster.hung_restart_grace_s,
                launched=launched,
            )
            cluster, n = local, len(specs)
            await local.start()
            watcher = asyncio.create_task(
                local.follow_gateways(fleet.urls(), stop, admin_key=config.gateway.admin_api_keys[0]),
                name="hung-workers",
            )
        else:
            agents = agent_specs(
                sglang,
                first,
                more_control_addresses=more,
                checkpoints=sglang_checkpoints(config),
                default_workers=config.cluster.workers,
                failure_domains=config.cluster.failure_domains,
                restart=config.cluster.restart_killed,
                log_level=config.gateway.log_level,
                stop_grace_s=config.timeouts.shutdown_grace_s,
                page_size=config.engine.page_size,
                peer_reload=config.engine.reload is ReloadSource.PEER,
                draft_model=config.sglang.draft_model if recovery_policy(config).draft_assist else "",
                draft_timeout_ms=config.draft.draft_timeout_ms,
            )
            cluster, n = (
                SGLangCluster(
                    agents,
                    log_dir=logs,
                    control_token=config.gateway.control_token,
                    control_ca=config.gateway.control_tls_cert,
                    restart_agents=config.cluster.restart_killed,
                    launched=launched,
                ),
                len(agents),
            )
            await cluster.start()
        if ready_timeout_s is None:
            ready_timeout_s = 60.0 if sglang is None else SGLANG_READY_TIMEOUT_S
        urls = fleet.urls()
        ready = await healthy_everywhere(urls, n, ready_timeout_s, stop)
        if not ready:
            log.error("cluster_not_ready", want=n, logs=str(logs))
        g0 = fleet.gateways[0]
        announce(
            {
                "event": "ready" if ready else "degraded",
                "url": urls[0],
                "urls": urls,
                "control_port": g0.control_port,
                "control_ports": [g.control_port for g in fleet.gateways],
                "gateway_pids": [g.proc.pid if g.proc else 0 for g in fleet.gateways],
                "workers": n,
                "healthy_workers": n if ready else 0,
                "gateways": gateways,
                "mode": config.recovery.mode,
                "engine": "lumen" if sglang is None else "sglang",
                "logs": str(logs),
                "started_at_monotonic": g0.ready.get("started_at_monotonic", 0.0),
            }
        )
        await stop.wait()
    finally:
        if watcher is not None:
            watcher.cancel()
        log.info("cluster_stopping")
        try:
            await fleet.stop(config.timeouts.shutdown_grace_s)
            if cluster is not None:
                await cluster.stop(config.timeouts.shutdown_grace_s)
        finally:  # the secrets' files go even when stopping fails or is cancelled
            token_file.unlink(missing_ok=True)
            fleet.remove_files()
            if launched is not None:
                launched.remove()
