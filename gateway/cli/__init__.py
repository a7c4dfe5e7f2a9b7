"""`lumen`: the gateway, workers, a local cluster, fault injection, and the demo."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from gateway.cli import common
from gateway.cli.admin import cmd_cluster_config_set, cmd_cluster_kill, cmd_cluster_status
from gateway.cli.cluster import cmd_cluster_up
from gateway.cli.common import config_args, load_config_args
from gateway.protocol.faults import FAULT_MODES
from gateway.protocol.kv import DEFAULT_PAGE_SIZE
from gateway.protocol.launch import Backend


def cmd_gateway(args: argparse.Namespace) -> int:
    from gateway.server.logs import configure_logging
    from gateway.server.runner import run_gateway

    extra: dict[str, Any] = {}
    if args.port is not None:
        extra["gateway.port"] = args.port
    if args.control_port is not None:
        extra["gateway.control_port"] = args.control_port
    if args.sglang_url:
        extra["sglang.workers"] = [{"url": u} for u in args.sglang_url]
    if args.insecure:
        extra["gateway.control_insecure"] = True
    cfg = load_config_args(args, extra)
    configure_logging(cfg.gateway.log_level, cfg.gateway.log_format)
    # SIGHUP re-reads the same file with the same --set on top (gateway/server/live_config.py)
    common.run_async(run_gateway(cfg, loader=lambda: common.load_config_raising(args, extra)))
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from gateway.protocol.launch import EngineSpec, worker_env
    from gateway.protocol.secrets import SecretError, resolve_token

    port = args.control[0].rpartition(":")[2]
    try:
        token = resolve_token(dict(os.environ), int(port) if port.isdigit() else None)
    except SecretError as exc:
        print(f"lumen worker: {exc}", file=sys.stderr)
        return 2
    if not token:
        print(
            "lumen worker: no control token: set LUMEN_CONTROL_TOKEN or LUMEN_CONTROL_TOKEN_FILE (a gateway "
            "that generated its token logs the 0600 file it wrote)",
            file=sys.stderr,
        )
        return 2
    spec = EngineSpec(
        worker_id=args.id,
        control_address=args.control[0],
        more_control_addresses=args.control[1:],
        port=args.port,
        model=args.model,
        gpu=args.gpu,
        time_scale=args.time_scale,
        control_token=token,
        control_tls_ca=args.control_ca or os.environ.get("LUMEN_CONTROL_CA", ""),
        backend=args.backend,
        page_size=args.page_size,
        kv_capacity_tokens=args.kv_capacity_tokens,
        torch_model=args.torch_model,
        torch_draft=args.torch_draft,
        torch_dtype=args.torch_dtype,
        torch_device=args.torch_device,
    )
    # the spec holds the control token: pass it in the environment, not on the command line
    os.execve(
        sys.executable, [sys.executable, "-m", "worker_hooks.engine"], worker_env(dict(os.environ), spec)
    )
    return 0  # not reached


def exec_sglang_agent(argv: list[str]) -> int:
    """`lumen sglang-agent ARGS`: become the sidecar agent (the gateway's parts never import worker_hooks,
    so the agent runs as its own module; `python -m worker_hooks.sglang --help` lists its flags)."""
    os.execv(sys.executable, [sys.executable, "-m", "worker_hooks.sglang", *argv])
    return 0  # not reached


def cmd_sglang_agent(args: argparse.Namespace) -> int:  # reached only through build_parser() users
    return exec_sglang_agent([])


def cmd_loadtest(args: argparse.Namespace, rest: list[str]) -> int:
    from loadtests.sidebyside import main as sbs_main

    argv = ["--out", args.out, *rest]
    if args.scenario:
        argv += ["--scenario", args.scenario]
    if args.modes:
        argv += ["--modes", args.modes]
    return sbs_main(argv)


def cmd_chaos(args: argparse.Namespace, rest: list[str]) -> int:
    from loadtests.chaos.cli import main as chaos_main

    return chaos_main(rest)


def cmd_demo(args: argparse.Namespace) -> int:
    from loadtests.demo import main as demo_main

    return demo_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lumen", description="Lumen: failure-transparent LLM serving gateway"
    )
    sub = parser.add_subparsers(dest="cmd", metavar="COMMAND")

    p = sub.add_parser("gateway", help="run the gateway (workers attach to its control plane)")
    config_args(p)
    p.add_argument("--port", type=int)
    p.add_argument("--control-port", type=int)
    p.add_argument(
        "--sglang-url",
        action="append",
        default=[],
        metavar="URL",
        help="an unmodified SGLang server to drive (repeatable; also [[sglang.workers]] url = ...)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow a plaintext control plane beyond loopback (gateway.control_insecure)",
    )
    p.set_defaults(func=cmd_gateway)

    p = sub.add_parser(
        "worker", help="run one Lumen worker (synthetic or torch backend) attached to a gateway"
    )
    p.add_argument("--id", required=True)
    p.add_argument(
        "--control",
        required=True,
        action="append",
        help="gateway control plane host:port (repeat it for each gateway of the cluster)",
    )
    p.add_argument(
        "--control-ca",
        default="",
        help="PEM the control plane's TLS certificate chains to (LUMEN_CONTROL_CA)",
    )
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--model", default="Qwen3-32B", help="cost-model preset")
    p.add_argument("--gpu", default="H100-80G")
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--backend", choices=list(Backend), default=Backend.SYNTHETIC)
    p.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE)
    p.add_argument("--kv-capacity-tokens", type=int, default=0, help="0: the backend's default")
    p.add_argument("--torch-model", default="tiny", help="torch: a preset or a HuggingFace folder")
    p.add_argument("--torch-draft", default="tiny-draft", help='torch: a preset, a folder, "self:N" or ""')
    p.add_argument("--torch-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--torch-device", default="cpu", help="cpu, cuda or cuda:N")
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser(
        "sglang-agent",
        add_help=False,
        help="run the sidecar agent beside one SGLang server: --url URL --gateway HOST:PORT [--id ID] "
        "[--launch -- <sglang launch_server args>] (--help: its flags)",
    )
    p.set_defaults(func=cmd_sglang_agent)

    cl = sub.add_parser("cluster", help="a local cluster: gateway + N worker processes")
    csub = cl.add_subparsers(dest="cluster_cmd", metavar="ACTION")
    p = csub.add_parser("up", help="start and supervise; runs until SIGINT/SIGTERM")
    config_args(p)
    p.add_argument("--workers", type=int)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--gateways",
        type=int,
        default=1,
        help="gateway processes, on --port … --port+N-1 (each worker attaches to all)",
    )
    p.add_argument(
        "--shared-port",
        action="store_true",
        help="all gateways accept on --port (SO_REUSEPORT): every core serves",
    )
    p.add_argument("--backend", choices=list(Backend))
    p.add_argument("--time-scale", type=float)
    p.add_argument("--log-dir")
    p.add_argument(
        "--engine",
        choices=["lumen", "sglang"],
        default="lumen",
        help="lumen: Lumen's workers; sglang: one SGLang server per --tp GPUs, each with its sidecar "
        "agent (arguments after -- go to sglang.launch_server)",
    )
    p.add_argument("--model", help="--engine sglang: the model (a HuggingFace folder or hub id)")
    p.add_argument("--tp", type=int, help="--engine sglang: GPUs per server (default 1)")
    p.set_defaults(func=cmd_cluster_up, takes_tail=True)
    p = csub.add_parser("kill", help="kill -9 (or hang, stall, slow) a worker of a running local cluster")
    p.add_argument("worker_id")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--mode",
        dest="kill_mode",
        choices=list(FAULT_MODES),
        default="kill",
    )
    p.add_argument(
        "--factor", type=float, default=5.0, help="--mode slow: every engine step this many times slower"
    )
    p.set_defaults(func=cmd_cluster_kill)
    p = csub.add_parser("status", help="list the workers of a running local cluster")
    p.add_argument("--port", type=int, default=8000)
    p.set_defaults(func=cmd_cluster_status)
    p = csub.add_parser("config", help="the live configuration of a running cluster's gateways")
    cfgsub = p.add_subparsers(dest="config_command", required=True)
    p = cfgsub.add_parser(
        "set", help="change live knobs (KEY=VALUE, keys as in configs/default.toml) on every gateway"
    )
    p.add_argument("assignments", nargs="+", metavar="KEY=VALUE")
    p.add_argument("--port", type=int, action="append", help="a gateway's port (repeatable; default 8000)")
    p.add_argument("--gateways", type=int, default=1, help="gateways on consecutive ports from one --port")
    p.set_defaults(func=cmd_cluster_config_set)

    p = sub.add_parser("demo", help="local cluster + load + a worker killed mid-load; shows the recovery")
    config_args(p)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--rate", type=float, default=16.0, help="requests per second (Poisson)")
    p.add_argument("--kill-at", type=float, default=4.0, help="seconds into the load; < 0: no kill")
    p.add_argument("--kill-mode", choices=["kill", "hang"], default="kill")
    p.add_argument("--port", type=int, default=0, help="gateway port (0: pick a free one)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--compare",
        default="stop_restart,lumen",
        help="after the demo, a short side-by-side run of these modes (empty: skip)",
    )
    p.add_argument("--compare-out", default="out/demo-compare")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser(
        "loadtest",
        help="live side-by-side runs of the recovery modes on a local cluster (other flags: loadtests.sidebyside)",
    )
    p.add_argument("--scenario")
    p.add_argument("--out", required=True)
    p.add_argument("--modes", help="comma-separated; default stop_restart,fixed_checkpoint,lumen")
    p.set_defaults(func=cmd_loadtest, passthrough=True)

    p = sub.add_parser(
        "chaos",
        add_help=False,
        help="a randomized run across network namespaces, checked (root; --help: its flags)",
    )
    p.set_defaults(func=cmd_chaos, passthrough=True)

    from gateway.sim.cli import add_sim_commands

    add_sim_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    command_line = argv is None  # from the command line (a command may then restart itself)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sglang-agent"]:  # every flag, --help and the arguments after -- are the agent's
        return exec_sglang_agent(argv[1:])
    tail: list[str] = []
    if "--" in argv:  # what follows `--` belongs to the command (cluster up: sglang.launch_server)
        i = argv.index("--")
        argv, tail = argv[:i], argv[i + 1 :]
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    args.tail = tail
    # the whole command line, for a command that starts itself again (`lumen sim --native`)
    args.command_line = list(sys.argv[1:]) if command_line else None
    from gateway.config import ConfigError

    try:
        if getattr(args, "passthrough", False):
            return int(func(args, rest + (["--", *tail] if tail else [])) or 0)
        if tail and not getattr(args, "takes_tail", False):
            parser.error(f"unrecognized arguments: -- {' '.join(tail)}")
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return int(func(args) or 0)
    except ConfigError as exc:
        print(f"lumen: invalid configuration: {exc}", file=sys.stderr)
        return 2
