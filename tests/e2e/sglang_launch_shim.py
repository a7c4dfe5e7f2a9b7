"""The launcher the SGLang tests put in LUMEN_SGLANG_LAUNCHER (a test fixture, not product code).

    LUMEN_SGLANG_LAUNCHER="python -m tests.e2e.sglang_launch_shim"

It takes `python -m sglang.launch_server`'s arguments as the agent builds them, refuses to start unless
the flags Lumen adds are there (`--sampling-backend pytorch`, `--enable-deterministic-inference`, and
`--host`/`--port`), drops the SGLang flags the stand-in has no use for (`--model-path`, `--tp-size`), and
runs the SGLang stand-in (tests/fixtures/sglang_standin.py) with the rest. Extra stand-in flags
(`--token-delay-ms 20`) can be passed after the agent's `--` like any SGLang flag.

Seeded reloads (`--load-format remote_instance` and the `--remote-instance-weight-loader-*` flags): the
shim refuses (exit 2) settings SGLang would silently ignore (seed ip or port missing, fewer group ports
than TP ranks, a backend other than nccl), then asks the seed's `/ready` as the first thing a real
transfer needs from it (exit 3 unless 200). Environment:

- `LUMEN_SHIM_RECORD=PATH`: append one JSON line per start to PATH (pid, argv, and the reload flags);
- `LUMEN_SHIM_SEED_FAILS=1`: a seeded start exits 1 before it is ready (a failed transfer);
- `LUMEN_SHIM_LOAD_S_DISK`, `LUMEN_SHIM_LOAD_S_PEER` (seconds, default 0): the weight load of a start
  from storage and from a seed, slept before the stand-in listens.

HiCache flags (`lumen cluster up --engine sglang` in a mode with checkpoints adds them): the shim refuses
a storage backend other than Lumen's, and a `"lumen"` extra config Lumen's backend would refuse
(worker_hooks/sglang/storage_layout.py); the stand-in itself stores nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request

RECORD_ENV = "LUMEN_SHIM_RECORD"
SEED_FAILS_ENV = "LUMEN_SHIM_SEED_FAILS"
LOAD_S_ENV = {"disk": "LUMEN_SHIM_LOAD_S_DISK", "peer": "LUMEN_SHIM_LOAD_S_PEER"}


def check_hicache(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What SGLang would need to load Lumen's storage backend, and Lumen's backend to accept its config."""
    from worker_hooks.sglang.storage_layout import options_from_extra_config

    extra = args.hicache_storage_backend_extra_config
    if not args.enable_hierarchical_cache:
        p.error("a HiCache storage backend needs --enable-hierarchical-cache")
    if args.hicache_storage_backend != "dynamic" or not isinstance(extra, dict):
        p.error("Lumen's backend is loaded as --hicache-storage-backend dynamic with an extra config")
    if extra.get("module_path") != "worker_hooks.sglang.hicache_backend" or extra.get("interface_v1") != 1:
        p.error(f"not Lumen's v1 backend: {extra}")
    try:
        options_from_extra_config(extra)
    except ValueError as exc:
        p.error(str(exc))


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="sglang_launch_shim")
    p.add_argument("--model-path", default="")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--sampling-backend", required=True, choices=["pytorch"])
    p.add_argument("--enable-deterministic-inference", action="store_true")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--remote-instance-weight-loader-seed-instance-ip")
    p.add_argument("--remote-instance-weight-loader-seed-instance-service-port", type=int)
    p.add_argument("--remote-instance-weight-loader-send-weights-group-ports", type=json.loads)
    p.add_argument("--remote-instance-weight-loader-backend", default="nccl")
    p.add_argument("--enable-hierarchical-cache", action="store_true")
    p.add_argument("--hicache-write-policy")
    p.add_argument("--hicache-storage-prefetch-policy")
    p.add_argument("--hicache-storage-backend")
    p.add_argument("--hicache-storage-backend-extra-config", type=json.loads)
    args, rest = p.parse_known_args(argv)
    if args.hicache_storage_backend is not None:
        check_hicache(p, args)
    if not args.enable_deterministic_inference:
        p.error("the agent must add --enable-deterministic-inference")
    if "--host" not in rest or "--port" not in rest:
        p.error("the agent must add --host and --port from its --url")
    seeded = args.load_format == "remote_instance"
    ip = args.remote_instance_weight_loader_seed_instance_ip
    port = args.remote_instance_weight_loader_seed_instance_service_port
    ports = args.remote_instance_weight_loader_send_weights_group_ports
    if seeded:
        # SGLang would fall back to loading from storage, silently (srt/arg_groups/model_path_hook.py)
        if ip is None or port is None:
            p.error("remote_instance needs the seed's ip and service port")
        if (
            not isinstance(ports, list)
            or len(ports) < args.tp_size
            or not all(isinstance(x, int) for x in ports)
        ):
            p.error(f"remote_instance needs one group port per TP rank ({args.tp_size}), got {ports!r}")
        if args.remote_instance_weight_loader_backend != "nccl":
            p.error("the agent asks for the nccl backend")
    record = os.environ.get(RECORD_ENV)
    if record:
        line = {
            "pid": os.getpid(),
            "at": time.monotonic(),
            "argv": argv,
            "load_format": args.load_format,
            "seed_ip": ip,
            "seed_port": port,
            "group_ports": ports,
            "backend": args.remote_instance_weight_loader_backend,
            "tp": args.tp_size,
            "hicache": args.hicache_storage_backend_extra_config,
        }
        with open(record, "a") as f:
            f.write(json.dumps(line) + "\n")
    source = "peer" if seeded else "disk"
    if seeded:
        try:
            with urllib.request.urlopen(f"http://{ip}:{port}/ready", timeout=2) as resp:
                ok = resp.status == 200
        except OSError as exc:
            print(f"sglang_launch_shim: seed {ip}:{port} unreachable: {exc}", file=sys.stderr)
            ok = False
        if not ok:
            sys.exit(3)
    time.sleep(float(os.environ.get(LOAD_S_ENV[source], "0") or 0))
    if seeded and os.environ.get(SEED_FAILS_ENV) == "1":
        print("sglang_launch_shim: the weight transfer from the seed failed (simulated)", file=sys.stderr)
        sys.exit(1)
    from tests.fixtures import sglang_standin  # after the record: a start killed early is still on it

    sglang_standin.main(rest)


if __name__ == "__main__":
    main(sys.argv[1:])
