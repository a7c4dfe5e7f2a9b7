"""The launcher the SGLang tests put in LUMEN_SGLANG_LAUNCHER (a test fixture, not product code).

    LUMEN_SGLANG_LAUNCHER="python -m tests.e2e.sglang_launch_shim"

It takes `python -m sglang.launch_server`'s arguments as the agent builds them, refuses to start unless
the flags Lumen adds are there (`--sampling-backend pytorch`, `--enable-deterministic-inference`, and
`--host`/`--port`), drops the SGLang flags the stand-in has no use for (`--model-path`, `--tp-size`), and
runs the SGLang stand-in (tests/fixtures/sglang_standin.py) with the rest. Extra stand-in flags
(`--token-delay-ms 20`) can be passed after the agent's `--` like any SGLang flag.
"""

from __future__ import annotations

import argparse
import sys

from tests.fixtures import sglang_standin


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="sglang_launch_shim")
    p.add_argument("--model-path", default="")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--sampling-backend", required=True, choices=["pytorch"])
    p.add_argument("--enable-deterministic-inference", action="store_true")
    args, rest = p.parse_known_args(argv)
    if not args.enable_deterministic_inference:
        p.error("the agent must add --enable-deterministic-inference")
    if "--host" not in rest or "--port" not in rest:
        p.error("the agent must add --host and --port from its --url")
    sglang_standin.main(rest)


if __name__ == "__main__":
    main(sys.argv[1:])
