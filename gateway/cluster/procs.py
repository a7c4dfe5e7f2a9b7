"""Stopping supervised child processes: SIGCONT (a hung one cannot act on SIGTERM), SIGTERM, then
SIGKILL for whoever is still there after the grace period."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Sequence


async def stop_processes(procs: Sequence[asyncio.subprocess.Process], grace_s: float) -> None:
    live = [p for p in procs if p.returncode is None]
    for p in live:
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGCONT)
            p.terminate()
    try:
        async with asyncio.timeout(grace_s):
            for p in live:
                await p.wait()
    except TimeoutError:
        for p in live:
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                await p.wait()
