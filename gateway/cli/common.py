"""What every `lumen` command shares: the configuration flags and their loading, and the event loop."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from gateway.core.modes import MODES


def config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML config (default: configs/default.toml)")
    p.add_argument("--mode", choices=list(MODES), help="recovery mode or ablation")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set recovery.theta=1.5 (value parsed as TOML)",
    )


def load_config_raising(args: argparse.Namespace, extra: dict[str, Any]) -> Any:
    """The config the command line names (file, --mode, --set, `extra`); raises ConfigError."""
    from gateway.config import load_config, parse_set

    overrides: dict[str, Any] = dict(extra)
    if getattr(args, "mode", None):
        overrides["recovery.mode"] = args.mode
    overrides.update(parse_set(args.set))
    return load_config(args.config, overrides)


def load_config_args(args: argparse.Namespace, extra: dict[str, Any]) -> Any:
    from gateway.config import ConfigError

    try:
        return load_config_raising(args, extra)
    except ConfigError as exc:
        print(f"lumen: invalid configuration: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc


def run_async(coro: Any) -> None:
    import uvloop

    try:
        uvloop.run(coro)
    except KeyboardInterrupt:
        pass
