"""`lumen cluster up`: a local cluster of Lumen's workers or SGLang servers behind one or more gateways."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import gateway.cli.common as common
from gateway.cli.common import load_config_args


def cmd_cluster_up(args: argparse.Namespace) -> int:
    from pathlib import Path

    from gateway.cluster.fleet_run import run_fleet
    from gateway.server.logs import configure_logging

    extra: dict[str, Any] = {"gateway.port": args.port, "gateway.control_port": 0}
    if args.workers is not None:
        extra["cluster.workers"] = args.workers
    if args.backend:
        extra["engine.backend"] = args.backend
    if args.time_scale is not None:
        extra["engine.time_scale"] = args.time_scale
    sglang = None
    if args.engine == "sglang":
        sglang = _sglang_launch(args)
        extra["gateway.served_model_name"] = args.model  # SGLang's own default name
        if (Path(args.model) / "tokenizer.json").is_file():
            extra["tokenizer.kind"] = "hf"
            extra["tokenizer.path"] = str(Path(args.model) / "tokenizer.json")
    elif args.tail or args.model or args.tp is not None:
        raise usage("--model, --tp and arguments after -- are for --engine sglang")
    cfg = load_config_args(args, extra)
    configure_logging(cfg.gateway.log_level, cfg.gateway.log_format)
    log_dir = Path(args.log_dir) if args.log_dir else None
    if args.gateways < 1:
        raise usage("--gateways must be at least 1")
    # the gateways load the configuration as this command did (their ports are the supervisor's)
    config_args = [
        *(["--config", args.config] if args.config else []),
        *(["--mode", args.mode] if args.mode else []),
    ]
    for item in args.set:
        config_args += ["--set", item]
    for key, value in extra.items():
        if key not in ("gateway.port", "gateway.control_port"):
            config_args += ["--set", f"{key}={json.dumps(value)}"]
    common.run_async(
        run_fleet(
            cfg,
            config_args,
            gateways=args.gateways,
            shared_port=args.shared_port,
            log_dir=log_dir,
            sglang=sglang,
        )
    )
    return 0


SGLANG_MISSING = (
    "lumen: sglang is not installed. `lumen cluster up --engine sglang` runs SGLang servers "
    "(sglang 0.5.23) on CUDA GPUs, or on CPU with `-- --device cpu`: pip install 'lumen[sglang]' "
    "(see docs/sglang.md)."
)


def _sglang_launch(args: argparse.Namespace) -> Any:
    """What to launch for `--engine sglang`, or SystemExit(2) with the reason (sglang missing, no GPUs).
    With `--device cpu` in the launch arguments the servers run on CPU: no GPU is needed or grouped."""
    import importlib.util

    from gateway.cluster.sglang import SGLangLaunch, gpu_groups, launch_device, visible_gpus

    if not args.model:
        raise usage("--engine sglang needs --model PATH (a HuggingFace folder or hub id)")
    # the testing hook: another launcher (a stand-in) in place of `python -m sglang.launch_server`
    stand_in = bool(os.environ.get("LUMEN_SGLANG_LAUNCHER", "").strip())
    if not stand_in and importlib.util.find_spec("sglang") is None:  # looked up, never imported
        print(SGLANG_MISSING, file=sys.stderr)
        raise SystemExit(2)
    tp = 1 if args.tp is None else args.tp
    cpu = launch_device(args.tail) == "cpu"
    gpus = None if cpu else visible_gpus(os.environ) or None
    if gpus is None and not stand_in and not cpu:
        print("lumen: --engine sglang needs CUDA GPUs, and none is visible (nvidia-smi, CUDA_VISIBLE_DEVICES); "
              "on CPU give the servers `-- --device cpu`", file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    if gpus is not None:
        try:
            gpu_groups(gpus, tp, args.workers)
        except ValueError as exc:
            print(f"lumen: {exc}", file=sys.stderr)
            raise SystemExit(2) from exc
    return SGLangLaunch(model=args.model, tp=tp, workers=args.workers, extra=tuple(args.tail), gpus=gpus)


def usage(message: str) -> SystemExit:
    print(f"lumen cluster up: {message}", file=sys.stderr)
    return SystemExit(2)
