"""A local cluster whose every process is placed on a host of its own: a command prefix that starts
it there and the address it binds (loadtests/chaos: `ip netns exec <namespace>` and the namespace's
address on a bridge).

    python -m gateway.cluster.placed SPEC.json      # runs until SIGTERM/SIGINT

The supervision is `lumen cluster up`'s (GatewayFleet restarts a gateway that exits, LocalCluster a
worker, as a new incarnation); only the command lines and addresses differ. The control plane then
crosses a network, so it runs over TLS (the spec's certificate and key; workers trust that
certificate) with the cluster's control token; the admin API beyond loopback needs an admin key
(LUMEN_ADMIN_API_KEYS in this process's environment, which the gateways inherit and the workers do
not). Hung-worker restarts stay off: a worker cut off from every gateway looks hung, and a placed
cluster is where one wants to see it rejoin by itself. The spec file holds the token: keep it 0600.

stdout: one JSON line `{"event": "ready", "urls": [...]}` (or "degraded") once every gateway sees
every worker, and `{"event": "stopped", "worker_restarts": {...}, "gateway_restarts": [...]}` at exit.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import msgspec
import structlog

from gateway.cluster.fleet import GatewayFleet, GatewayProcess, healthy_everywhere
from gateway.cluster.supervisor import LocalCluster, synthetic_token_range, worker_specs
from gateway.config import Config, load_config
from gateway.protocol.launch import EngineSpec
from gateway.server.api.tokenizer import make_tokenizer
from gateway.server.local_faults import LaunchRegistry
from gateway.server.logs import configure_logging
from gateway.server.runner import announce, stop_event

log = structlog.get_logger("lumen.placed")

HTTP_PORT = 8000
CONTROL_PORT = 50151


class Place(msgspec.Struct, frozen=True):
    prefix: list[str]  # the command prefix that starts a process on this host
    addr: str  # the address it binds


class PlacedSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    gateways: list[Place]
    workers: dict[str, Place]  # worker id -> its host
    overrides: dict[str, Any] = msgspec.field(default_factory=dict)  # config keys (as --set)
    token: str  # the cluster's control token
    cert: str  # PEM certificate (valid for every gateway address) and key of the control plane
    key: str
    log_dir: str
    ready_timeout_s: float = 60.0


def placed_config(spec: PlacedSpec) -> Config:
    return load_config(overrides=_overrides(spec) | {"gateway.control_token": spec.token})


def _overrides(spec: PlacedSpec) -> dict[str, Any]:
    first = spec.gateways[0].addr
    return {
        **spec.overrides,
        "cluster.workers": len(spec.workers),
        "gateway.host": first,
        "gateway.control_host": first,
        "gateway.port": HTTP_PORT,
        "gateway.control_port": CONTROL_PORT,
        "gateway.control_tls_cert": spec.cert,
        "gateway.control_tls_key": spec.key,
        "cluster.hung_restart_grace_s": 0.0,
    }


class PlacedGateways(GatewayFleet):
    """GatewayFleet with gateway i on `places[i]`, every one on the same ports of its own address."""

    def __init__(self, config: Config, config_args: list[str], places: list[Place], log_dir: Path) -> None:
        super().__init__(
            config, config_args, gateways=len(places), port=HTTP_PORT, shared_port=False, log_dir=log_dir
        )
        self.places = places
        for g in self.gateways:
            g.http_port, g.control_port = HTTP_PORT, CONTROL_PORT

    @property
    def control_addresses(self) -> list[str]:
        return [f"{p.addr}:{CONTROL_PORT}" for p in self.places]

    def urls(self) -> list[str]:
        return [f"http://{p.addr}:{HTTP_PORT}" for p in self.places]

    def _argv(self, g: GatewayProcess) -> list[str]:
        p = self.places[g.index]
        addr = json.dumps(p.addr)
        return [
            *p.prefix,
            *super()._argv(g),
            "--set",
            f"gateway.host={addr}",
            "--set",
            f"gateway.control_host={addr}",
        ]


class PlacedWorkers(LocalCluster):
    """LocalCluster whose worker w is started with `prefixes[w]`."""

    def __init__(self, specs: list[EngineSpec], prefixes: dict[str, list[str]], log_dir: Path) -> None:
        super().__init__(specs, log_dir=log_dir, restart_killed=True, hung_restart_grace_s=0.0)
        self.prefixes = prefixes

    def worker_argv(self, spec: EngineSpec) -> list[str]:
        return [*self.prefixes[spec.worker_id], *super().worker_argv(spec)]


def placed_worker_specs(config: Config, control: list[str], workers: dict[str, Place]) -> list[EngineSpec]:
    """One spec per worker: bound to its host's address, attached to every gateway."""
    tokens = synthetic_token_range(config.tokenizer.kind, make_tokenizer(config.tokenizer).vocab_size)
    base = worker_specs(config, control[0], tokens)
    return [
        msgspec.structs.replace(
            base[i % len(base)], worker_id=wid, host=place.addr, more_control_addresses=control[1:]
        )
        for i, (wid, place) in enumerate(workers.items())
    ]


async def run_placed(spec: PlacedSpec) -> None:
    stop = stop_event()
    config = placed_config(spec)
    # the gateways load what this process did; the token reaches them in their environment
    args: list[str] = []
    for k, v in _overrides(spec).items():
        if k not in ("gateway.host", "gateway.control_host", "gateway.port", "gateway.control_port"):
            args += ["--set", f"{k}={json.dumps(v)}"]
    logs = Path(spec.log_dir)
    fleet = PlacedGateways(config, args, spec.gateways, logs)
    workers = PlacedWorkers(
        placed_worker_specs(config, fleet.control_addresses, spec.workers),
        {w: p.prefix for w, p in spec.workers.items()},
        logs,
    )
    # signal faults as `lumen cluster up` has them: with cluster.fault_injection, to what we launched
    launched = LaunchRegistry.create() if config.cluster.fault_injection else None
    if launched is not None:
        fleet.launched, workers.launched = launched.path, launched
    try:
        # together: a worker retries its attach (backoff capped at 1 s) until its gateways listen
        await asyncio.gather(fleet.start(), workers.start())
        ready = await healthy_everywhere(fleet.urls(), len(spec.workers), spec.ready_timeout_s, stop)
        announce({"event": "ready" if ready else "degraded", "urls": fleet.urls()})
        await stop.wait()
    finally:
        await fleet.stop(2.0)
        await workers.stop(2.0)
        announce(
            {
                "event": "stopped",
                "worker_restarts": {w: wp.starts - 1 for w, wp in workers.workers.items()},
                "gateway_restarts": [g.starts - 1 for g in fleet.gateways],
            }
        )
        if launched is not None:
            launched.remove()


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m gateway.cluster.placed SPEC.json", file=sys.stderr)
        return 2
    spec = msgspec.json.decode(Path(args[0]).read_bytes(), type=PlacedSpec)
    if not spec.gateways or not spec.workers:
        print("gateway.cluster.placed: the spec needs at least one gateway and one worker", file=sys.stderr)
        return 2
    Path(spec.log_dir).mkdir(parents=True, exist_ok=True)
    configure_logging("info", "console")
    import uvloop

    uvloop.run(run_placed(spec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
