"""Run one worker: `python -m worker_hooks.engine` with its EngineSpec JSON in LUMEN_ENGINE_SPEC (a supervisor's way), or `--spec '<JSON>'` / `--spec-file PATH`.

On start it prints one JSON line to stdout,
`{"event": "listening", "worker_id", "url", "incarnation", "kv_endpoint", "draft_endpoint"}`,
so a supervisor can learn the bound port; logs go to stderr. SIGTERM/SIGINT shut it down cleanly.
When started by a supervisor that sets LUMEN_PARENT_PID, the worker also shuts down once that parent
is gone, so a crashed gateway leaves no orphan workers behind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path

import msgspec
import structlog
import uvloop

from gateway.protocol.launch import SPEC_ENV, EngineSpec, decode_spec
from gateway.protocol.logs import configure_logging
from worker_hooks.engine.service import start_worker

PARENT_POLL_S = 0.5


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


async def serve(spec: EngineSpec) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    parent = os.environ.get("LUMEN_PARENT_PID", "")
    watchdog = asyncio.create_task(watch_parent(int(parent), stop)) if parent.isdigit() else None
    try:
        async with start_worker(spec) as worker:
            line = {
                "event": "listening",
                "worker_id": worker.worker_id,
                "url": worker.url,
                "incarnation": worker.incarnation,
                "kv_endpoint": worker.kv_endpoint,
                "draft_endpoint": worker.engine.assist.endpoint,
            }
            # fault injection for gray failures: SIGUSR1 freezes the engine loop, SIGUSR2 resumes it
            loop.add_signal_handler(signal.SIGUSR1, worker.engine.pause)
            loop.add_signal_handler(signal.SIGUSR2, worker.engine.resume)
            sys.stdout.write(json.dumps(line) + "\n")
            sys.stdout.flush()
            await stop.wait()
            structlog.get_logger(__name__).info("shutting down", worker_id=worker.worker_id)
    finally:
        if watchdog is not None:
            watchdog.cancel()
            await asyncio.gather(watchdog, return_exceptions=True)


def parse_spec(argv: list[str] | None) -> EngineSpec:
    parser = argparse.ArgumentParser(prog="python -m worker_hooks.engine", description=__doc__)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--spec", help=f"EngineSpec as JSON (default: the {SPEC_ENV} environment variable)")
    group.add_argument("--spec-file", type=Path, help="file holding the EngineSpec JSON")
    args = parser.parse_args(argv)
    if args.spec is not None:
        text = args.spec
    elif args.spec_file is not None:
        text = args.spec_file.read_text()
    else:
        # a supervisor's way (the spec may hold the control token); not passed on to our children
        text = os.environ.pop(SPEC_ENV, "")
        if not text:
            parser.error(f"no EngineSpec: give --spec, --spec-file or the {SPEC_ENV} environment variable")
    try:
        spec = decode_spec(text)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        parser.error(f"invalid EngineSpec: {exc}")
    if spec.log_level.upper() not in logging.getLevelNamesMapping():
        parser.error(f"invalid EngineSpec: unknown log_level {spec.log_level!r}")
    return spec


def main(argv: list[str] | None = None) -> int:
    spec = parse_spec(argv)
    configure_logging(spec.log_level, "json")
    try:
        uvloop.run(serve(spec))
    except (ValueError, KeyError, OSError) as exc:
        # a spec the engine cannot run (unknown preset, bad capacity) or a port it cannot bind
        structlog.get_logger(__name__).error("worker failed to start", error=str(exc))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
