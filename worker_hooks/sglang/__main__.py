"""Run the sidecar agent beside one SGLang server (`lumen sglang-agent` execs this).

    python -m worker_hooks.sglang --url http://127.0.0.1:30000 --gateway 127.0.0.1:50151 [--gateway ...]
        [--id ID] [--tp N] [--seed-wait-s 2] [--seed-timeout-s 300] [--weights-group-ports P0,P1,...]
        [--page-size 64] [--draft-model DIR] [--launch -- <sglang launch_server args>]

Without `--launch` the server is someone else's: the agent only watches it. With `--launch` the agent
starts `python -m sglang.launch_server ARGS` with its own interpreter, so it runs from SGLang's Python
environment (plus the flags Lumen needs, `--page-size` when ARGS give none, and on `--device cpu` the
CPU environment; see launcher.py), restarts it when it dies (unless `--no-restart`: then the agent exits
1 once it died), and stops it on exit.
`LUMEN_SGLANG_LAUNCHER` replaces the launcher command (a testing hook: launcher.py). With `--draft-model
DIR` the agent drafts with that model while a server it relaunched loads (agent_draft.py).

Seeded reload (with `--launch`; agent_reload.py): after the server died, the agent waits up to `--seed-wait-s`
for a gateway to name a running server of the same model and TP, and relaunches loading the weights from
it (`--load-format remote_instance` over NCCL), or from storage when none is named, when the seeded
server exits before it is ready, or when it is not ready within `--seed-timeout-s`. The NCCL groups
listen on the seed's host at `--weights-group-ports` (one port per TP rank, free there; default: this
server's port + 500 + rank, launcher.WEIGHTS_GROUP_PORT_DELTA). `--seed-wait-s 0` never seeds.

The control-plane secret comes from LUMEN_CONTROL_TOKEN, else the 0600 file LUMEN_CONTROL_TOKEN_FILE
names, else the file a gateway on this host published for the first gateway's port (never argv);
LUMEN_CONTROL_CA names the PEM a TLS control plane's certificate chains to. The server's KV-plane keys and the
gateways' members go to a 0600 plane file (worker_hooks/sglang/plane_file.py): LUMEN_PLANE_FILE names
it (give a server the agent does not launch the same variable), else the agent makes a private one and
passes it to the server it launches. The agent prints one JSON line per event to
stdout (`started`, `server_started` with the server's pid, `server_ready`, `server_exited`,
`server_lost`, `incarnation`, `abort_all`, and for relaunches `reload_from`, `no_seed`, `seed_failed`,
`seed_timeout`, `reloaded` with its seconds and source; `at` is time.monotonic(), comparable across the processes of
a Linux host); logs go to stderr, and so does the server's own output. SIGTERM/SIGINT stop it
cleanly; started by a supervisor that sets LUMEN_PARENT_PID, it also stops once that parent is gone.
"""

from __future__ import annotations

import os

# gRPC's fork support off in the agent, before anything imports grpc: with it on, gRPC runs fork
# handlers around every fork of this process, and a fork while its threads run skips them ("Other
# threads are currently calling into gRPC, skipping fork() handlers"; seen right before a relaunched
# server died with SIGSEGV). The agent starts its server without forking Python (launcher.spawn_child);
# this keeps gRPC out of any fork that still happens. The server gets the environment as it was.
GRPC_FORK_ENV = "GRPC_ENABLE_FORK_SUPPORT"
GRPC_FORK_SET_HERE = GRPC_FORK_ENV not in os.environ
os.environ.setdefault(GRPC_FORK_ENV, "false")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402
from urllib.parse import urlsplit  # noqa: E402

import structlog  # noqa: E402
import uvloop  # noqa: E402

from gateway.protocol.kv import DEFAULT_PAGE_SIZE  # noqa: E402
from gateway.protocol.logs import configure_logging  # noqa: E402
from gateway.protocol.secrets import SecretError, resolve_token  # noqa: E402
from worker_hooks.sglang.agent import Sidecar  # noqa: E402
from worker_hooks.sglang.agent_config import DRAFT_TIMEOUT_MS, SidecarConfig  # noqa: E402
from worker_hooks.sglang.launcher import (  # noqa: E402
    OUTAGE_HEADROOM,
    WEIGHTS_GROUP_PORT_DELTA,
    LaunchError,
    host_port,
    lumen_storage_config,
    page_size_of,
    server_command,
    tp_of,
    with_headroom,
    with_page_size,
)
from worker_hooks.sglang.server_key import given_key, launch_key  # noqa: E402

PARENT_POLL_S = 0.5


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lumen sglang-agent",
        description="The sidecar agent: one unmodified SGLang server on Lumen's control plane.",
        epilog="Arguments after `--` go to `python -m sglang.launch_server` (with --launch).",
    )
    p.add_argument("--url", required=True, help="the SGLang server's http://HOST:PORT")
    p.add_argument(
        "--gateway",
        action="append",
        required=True,
        metavar="HOST:PORT",
        help="a gateway's control plane (repeatable: one control session per gateway)",
    )
    p.add_argument(
        "--api-key-file",
        metavar="PATH",
        help="a file holding the server's API key (also LUMEN_SGLANG_API_KEY[_FILE]); with --launch and "
        "no key given (here or as --api-key after --) the agent generates one",
    )
    p.add_argument("--id", help="worker id (default: sglang-<port>)")
    p.add_argument("--model", help="model name for Hello (default: --model-path of the launch arguments)")
    p.add_argument("--failure-domain", default="")
    p.add_argument("--launch", action="store_true", help="start and supervise the server (args after --)")
    p.add_argument("--no-restart", action="store_true", help="--launch: exit once the server died")
    p.add_argument("--poll-ms", type=int, default=100, help="how often /ready and /v1/loads are polled")
    p.add_argument(
        "--poll-misses", type=int, default=5, help="no 200 from /ready for poll-ms x this: the server is lost"
    )
    p.add_argument(
        "--heartbeat-ms", type=int, default=50, help="heartbeat interval if the gateway names none"
    )
    p.add_argument(
        "--stop-grace-s", type=float, default=10.0, help="--launch: on exit, SIGTERM, then SIGKILL after this"
    )
    p.add_argument(
        "--tp",
        type=int,
        help="the server's tensor parallelism (default: --tp-size of the launch arguments, else 1)",
    )
    p.add_argument(
        "--seed-wait-s",
        type=float,
        default=2.0,
        help="--launch: after the server died, wait this long for a seed to reload from (0: always from storage)",
    )
    p.add_argument(
        "--seed-timeout-s",
        type=float,
        default=300.0,
        help="--launch: a seeded server not ready after this is killed and launched from storage",
    )
    p.add_argument(
        "--weights-group-ports",
        type=_ports,
        metavar="P0,P1,...",
        help="--launch: weight-transfer group ports on the seed's host, one per TP rank "
        f"(default: this server's port + {WEIGHTS_GROUP_PORT_DELTA} + rank)",
    )
    p.add_argument(
        "--kv-endpoint",
        help="the server's Lumen holder store (default: holder_endpoint of the launch args' storage config)",
    )
    p.add_argument(
        "--ckpt-budget-bytes",
        type=int,
        help="its holder budget (default: holder_budget_bytes of the launch args' storage config)",
    )
    p.add_argument(
        "--holder-status-endpoint",
        help="its holder stores' status sockets (default: status_endpoint of the launch args' storage "
        "config, else derived from the holder endpoint)",
    )
    p.add_argument(
        "--holder-shards",
        type=int,
        default=0,
        help="holder stores (ranks) whose status to poll (default: the TP size)",
    )
    p.add_argument(
        "--outage-headroom",
        type=float,
        default=OUTAGE_HEADROOM,
        help="--launch with --max-running-requests B: launch the server with room for ceil(B x this) "
        "running requests and have the gateway hold it to B outside a recovery, so it can take the "
        "outage batch boost (1: no room, not held)",
    )
    p.add_argument(
        "--held-batch",
        type=int,
        default=None,
        metavar="B",
        help="a server started elsewhere with room for the outage batch boost (e.g. "
        "--max-running-requests 96 for a normal batch of 64): have the gateway hold it to B running "
        "requests outside a recovery (with --launch: from --max-running-requests and --outage-headroom)",
    )
    p.add_argument(
        "--page-size",
        type=int,
        default=DEFAULT_PAGE_SIZE,
        help="--launch: the server's --page-size when the launch arguments give none: the gateway's "
        f"engine.page_size (default {DEFAULT_PAGE_SIZE}; 0: SGLang's own). Reported to the gateway",
    )
    p.add_argument(
        "--draft-model",
        default="",
        metavar="DIR",
        help="--launch: a small model sharing the server's tokenizer (a Hugging Face folder): while a "
        "relaunched server loads, the agent drafts with it for the survivor the gateway pairs it with",
    )
    p.add_argument("--draft-device", default="cpu", help="torch device of --draft-model (default: cpu)")
    p.add_argument(
        "--draft-timeout-ms",
        type=float,
        default=DRAFT_TIMEOUT_MS,
        help="how long the gateway waits for a draft round (its draft.draft_timeout_ms)",
    )
    p.add_argument("--log-level", default="info")
    return p


def _ports(text: str) -> tuple[int, ...]:
    try:
        ports = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of ports: {text!r}") from None
    if not ports or any(not 0 < p <= 65535 for p in ports):
        raise argparse.ArgumentTypeError(f"ports must be 1..65535: {text!r}")
    return ports


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The agent's arguments, and the server's (those after the first `--`)."""
    if "--" in argv:
        i = argv.index("--")
        argv, tail = argv[:i], argv[i + 1 :]
    else:
        tail = []
    parser = build_parser()
    args = parser.parse_args(argv)
    if tail and not args.launch:
        parser.error("arguments after -- are for the server: add --launch")
    if args.no_restart and not args.launch:
        parser.error("--no-restart needs --launch")
    if args.page_size < 0:
        parser.error(f"--page-size must be >= 0, not {args.page_size}")
    if args.draft_model and not args.launch:
        parser.error("--draft-model needs --launch (the agent drafts while a server it relaunched loads)")
    if args.draft_model and not os.path.isfile(os.path.join(args.draft_model, "config.json")):
        parser.error(
            f"--draft-model {args.draft_model!r}: no config.json there (a Hugging Face model folder)"
        )
    if args.held_batch is not None and args.held_batch < 1:
        parser.error(f"--held-batch must be >= 1, not {args.held_batch}")
    if args.log_level.upper() not in logging.getLevelNamesMapping():
        parser.error(f"unknown --log-level {args.log_level!r}")
    try:
        host_port(args.url)
    except LaunchError as exc:
        parser.error(str(exc))
    return args, tail


def _launch_model(tail: list[str]) -> str:
    for i, a in enumerate(tail):
        if a in ("--model-path", "--model") and i + 1 < len(tail):
            return tail[i + 1]
        if a.startswith(("--model-path=", "--model=")):
            return a.split("=", 1)[1]
    return ""


def _print_event(ev: dict[str, Any]) -> None:
    try:
        sys.stdout.write(json.dumps(ev) + "\n")
        sys.stdout.flush()
    except (BrokenPipeError, ValueError):  # nobody reads them any more: the events are only a report
        pass


async def watch_parent(parent_pid: int, stop: asyncio.Event) -> None:
    """Set `stop` once we are re-parented (the parent died); there is no event for that, so poll."""
    while os.getppid() == parent_pid:
        try:
            await asyncio.wait_for(stop.wait(), PARENT_POLL_S)
            return
        except TimeoutError:
            pass
    structlog.get_logger(__name__).warning("parent process gone", parent_pid=parent_pid)
    stop.set()


async def serve(cfg: SidecarConfig, launch: list[str] | None, restart: bool, stop_grace_s: float) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    parent = os.environ.get("LUMEN_PARENT_PID", "")
    watchdog = asyncio.create_task(watch_parent(int(parent), stop)) if parent.isdigit() else None
    sidecar = Sidecar(
        cfg, launch=launch, launch_env=server_environment(), restart=restart, on_event=_print_event
    )
    try:
        try:
            await sidecar.start()
        except OSError as exc:  # the launcher command cannot start
            structlog.get_logger(__name__).error("cannot launch the server", error=str(exc))
            return 2
        stopped = asyncio.create_task(stop.wait())
        exited = asyncio.create_task(sidecar.exited.wait())
        done, pending = await asyncio.wait({stopped, exited}, return_when=asyncio.FIRST_COMPLETED)
        for t in pending:
            t.cancel()
        return 1 if exited in done else 0  # 1: --no-restart, and the server died
    finally:
        await sidecar.stop(stop_grace_s)
        if watchdog is not None:
            watchdog.cancel()
            await asyncio.gather(watchdog, return_exceptions=True)


def server_environment() -> dict[str, str]:
    """The environment a launched server starts from: the agent's, without the gRPC setting the agent
    made for itself (the Sidecar adds the CPU environment and the plane file)."""
    env = dict(os.environ)
    if GRPC_FORK_SET_HERE:
        env.pop(GRPC_FORK_ENV, None)
    return env


def _token(gateways: list[str]) -> str:
    port = gateways[0].rpartition(":")[2] if gateways else ""
    return resolve_token(dict(os.environ), int(port) if port.isdigit() else None)


def configure(args: argparse.Namespace, tail: list[str]) -> tuple[SidecarConfig, list[str] | None]:
    """The agent's config and, with --launch, the server's command; raises LaunchError, ValueError or
    SecretError when the arguments cannot be run."""
    port = urlsplit(args.url).port
    launch: list[str] | None = None
    tp = args.tp if args.tp is not None else tp_of(tail)
    held = args.held_batch or 0
    api_key = given_key(args.api_key_file, os.environ)
    if args.launch:
        tail, from_launch = with_headroom(tail, args.outage_headroom)
        tail = with_page_size(tail, args.page_size)
        tail, api_key = launch_key(tail, api_key)  # generated when none was given (server_key.py)
        held = held or from_launch
        launch = server_command(args.url, tail)
    storage = lumen_storage_config(tail)
    cfg = SidecarConfig(
        worker_id=args.id or f"sglang-{port}",
        url=args.url.rstrip("/"),
        gateways=tuple(args.gateway),
        token=_token(args.gateway),
        tls_ca=os.environ.get("LUMEN_CONTROL_CA", ""),
        model=args.model if args.model is not None else _launch_model(tail),
        failure_domain=args.failure_domain,
        poll_interval_s=args.poll_ms / 1000.0,
        poll_misses=args.poll_misses,
        heartbeat_interval_ms=args.heartbeat_ms,
        tp=tp,
        seed_wait_s=args.seed_wait_s,
        seed_timeout_s=args.seed_timeout_s,
        weights_group_ports=args.weights_group_ports or (),
        kv_endpoint=args.kv_endpoint
        if args.kv_endpoint is not None
        else str(storage.get("holder_endpoint", "")),
        ckpt_budget_bytes=args.ckpt_budget_bytes
        if args.ckpt_budget_bytes is not None
        else int(str(storage.get("holder_budget_bytes", 0))),
        holder_status_endpoint=args.holder_status_endpoint
        if args.holder_status_endpoint is not None
        else str(storage.get("status_endpoint") or ""),
        holder_shards=args.holder_shards,
        plane_file=os.environ.get("LUMEN_PLANE_FILE", ""),
        held_batch=held,
        page_size=page_size_of(tail),
        api_key=api_key,
        draft_model=args.draft_model,
        draft_device=args.draft_device,
        draft_timeout_ms=args.draft_timeout_ms,
    )
    return cfg, launch


def main(argv: list[str] | None = None) -> int:
    args, tail = parse(list(sys.argv[1:] if argv is None else argv))
    configure_logging(args.log_level, "json")
    try:
        cfg, launch = configure(args, tail)
    except (LaunchError, ValueError, SecretError) as exc:
        print(f"lumen sglang-agent: {exc}", file=sys.stderr)
        return 2
    return uvloop.run(serve(cfg, launch, restart=not args.no_restart, stop_grace_s=args.stop_grace_s))


if __name__ == "__main__":
    sys.exit(main())
