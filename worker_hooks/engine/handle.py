"""The receiving end of one request inside the engine: its emissions, in order, for the HTTP stream.

Every emission is also kept in `log`, so a gateway that adopts the request after its first reader
went away (orphans.py) can replay the output from the start and follow it live.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from worker_hooks.engine.scheduler import Emission


class RequestHandle:
    """Emissions in order, the last one with a finish reason."""

    __slots__ = (
        "_changed",
        "_queue",
        "fenced_by_reset",
        "finished",
        "incarnation",
        "log",
        "orphan_grace_s",
        "prompt_tokens",
        "restored_tokens",
        "rid",
        "top_logprobs",
    )

    def __init__(
        self, rid: str, prompt_tokens: int, incarnation: int, restored_tokens: int = 0, top_logprobs: int = -1
    ) -> None:
        self.rid = rid
        # -1: no logprobs asked for; k >= 0: each token's, with the k most likely (Seq.top_logprobs)
        self.top_logprobs = top_logprobs
        self.prompt_tokens = prompt_tokens
        self.incarnation = incarnation  # the incarnation that accepted the request
        # prompt tokens restored from the local checkpoint store instead of prefilled
        self.restored_tokens = restored_tokens
        self.finished = False
        self.fenced_by_reset = True
        self.orphan_grace_s = 0.0  # the gateway's LumenExt.orphan_grace_s
        self.log: list[Emission] = []
        self._queue: asyncio.Queue[Emission] = asyncio.Queue()
        self._changed = asyncio.Event()

    def _push(self, emission: Emission) -> None:
        self._queue.put_nowait(emission)
        self.log.append(emission)
        self._changed.set()
        if emission.finish is not None:
            self.finished = True

    async def next(self) -> Emission:
        return await self._queue.get()

    def next_nowait(self) -> Emission | None:
        return None if self._queue.empty() else self._queue.get_nowait()

    async def follow(self) -> AsyncIterator[list[Emission]]:
        """Everything emitted so far, then each new batch as it comes, until the last emission."""
        seen = 0
        while True:
            if seen == len(self.log):
                self._changed.clear()
                await self._changed.wait()
                continue
            batch = self.log[seen:]
            seen += len(batch)
            yield batch
            if batch[-1].finish is not None:
                return
