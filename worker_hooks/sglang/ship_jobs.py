"""What the scheduler thread hands Lumen's SGLang plugin shipper (plugin_shipper.py): one `ShipJob` per
decode step, the page runs its device→host copy holds. No sglang, no torch."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from worker_hooks.sglang.plugin_logic import Copy

POLL_S: Final = 0.0002  # how often a pending device→host copy is polled


@dataclass(frozen=True, slots=True)
class PageRun:
    """One `Copy`'s pages as the KV plane sends them: ids, and where its bytes sit in the job's buffer
    (its staging reservation is `copy.offset`, released once the bytes are taken)."""

    copy: Copy
    token_ids: list[int]  # ids of pages [first_page, first_page + n_pages)
    prefix_ids: list[int] | None  # ids of pages [0, first_page) when the run starts the chain there
    offset: int  # byte offset in `ShipJob.data()`


@dataclass(slots=True, eq=False)
class ShipJob:
    """One step's copies: the host bytes a device→host copy is filling, and the runs they hold."""

    runs: list[PageRun]
    ready: Callable[[], bool]  # the device→host copy has completed
    data: Callable[[], memoryview]  # the host bytes (flat), read once `ready`
    dtype: str = "uint8"
    shape: list[int] | None = None  # one page's layout, informative

    def copied(self) -> bool:
        """Whether the device→host copy is done; a failed copy counts as done (reading `data` then
        fails too, and the job is dropped)."""
        try:
            return self.ready()
        except Exception:
            return True

    async def until_copied(self) -> None:
        """Poll the device→host copy (a CUDA event has nothing to await on)."""
        while True:  # a poll, not an event: the copy is the GPU's, not this loop's
            if self.copied():
                return
            await asyncio.sleep(POLL_S)
