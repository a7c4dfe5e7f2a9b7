"""The receiving end of one request inside the engine: its emissions, in order, for the HTTP stream."""

from __future__ import annotations

import asyncio

from worker_hooks.engine.scheduler import Emission


class RequestHandle:
    """Emissions in order, the last one with a finish reason."""

    __slots__ = (
        "_queue",
        "fenced_by_reset",
        "finished",
        "incarnation",
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
        self._queue: asyncio.Queue[Emission] = asyncio.Queue()

    def _push(self, emission: Emission) -> None:
        self._queue.put_nowait(emission)
        if emission.finish is not None:
            self.finished = True

    async def next(self) -> Emission:
        return await self._queue.get()

    def next_nowait(self) -> Emission | None:
        return None if self._queue.empty() else self._queue.get_nowait()
