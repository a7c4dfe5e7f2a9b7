"""Foreground runner for `lumen gateway`: start, wait for a signal, stop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable

import structlog

from gateway.config import Config
from gateway.server.app import Gateway
from gateway.server.local_faults import LOCAL_FAULTS_ENV, SignalFaults

log = structlog.get_logger("lumen.runner")


def stop_event() -> asyncio.Event:
    ev = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, ev.set)
    return ev


async def run_gateway(config: Config, loader: Callable[[], Config] | None = None) -> None:
    """`loader`: the config file and --set the gateway started from, re-read on SIGHUP (live_config.py)."""
    stop = stop_event()
    gw = Gateway(config)
    if os.environ.get(LOCAL_FAULTS_ENV):  # started by a local cluster supervisor
        gw.fault_injector = SignalFaults(gw.monitor)
    await gw.start()
    if loader is not None:
        gw.live.watch_sighup(loader)
    announce(
        {
            "event": "ready",
            "url": f"http://{config.gateway.host}:{gw.http_port}",
            "control_port": gw.control_port,
            "pid": os.getpid(),
            "started_at_monotonic": gw.started_at,
        }
    )
    try:
        await stop.wait()
    finally:
        await gw.stop()
        remove_if_orphaned()


# set by a `lumen cluster up` supervisor on its first gateway: the files it published (control token,
# admin keys, launch registry), removed by that gateway if it stops because the supervisor is gone
# (killed with SIGKILL, it could not remove them itself; the gateway gets SIGTERM by PR_SET_PDEATHSIG)
ORPHAN_FILES_ENV = "LUMEN_SUPERVISOR_FILES"


def remove_if_orphaned() -> None:
    parent = os.environ.get("LUMEN_PARENT_PID", "")
    if not parent.isdigit() or os.getppid() == int(parent):
        return  # a live supervisor cleans up after itself (and may restart this gateway)
    for path in filter(None, os.environ.get(ORPHAN_FILES_ENV, "").split(os.pathsep)):
        with contextlib.suppress(OSError):
            os.unlink(path)


def announce(obj: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()
