"""Recovery dispatch, live: where each attempt of a request runs.

The first attempt goes where the router says (least queue among HEALTHY workers). An attempt after an
interruption is Algorithm 2 (`gateway.core.dispatch`): resume on a checkpoint holder (restore) unless
the holder is overloaded and the saved prefix short, else replay on the least-loaded survivor. The
decision is the core's; this module only feeds it the live view and waits when no worker is left.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.core.costmodel import CostModel
from gateway.core.dispatch import Decision, DispatchParams, dispatch
from gateway.core.router import choose_worker
from gateway.core.types import ClusterView, LoadParams
from gateway.server.api.errors import NoWorkerAvailable
from gateway.server.checkpoints import CheckpointManager
from gateway.server.workers.monitor import LoadMonitor, WorkerRecord


@dataclass(frozen=True, slots=True)
class Resume:
    """A request about to resume after its worker failed: what dispatch needs to know of it."""

    rid: str
    failed_worker: str
    context_tokens: int  # prompt + emitted
    remaining_tokens: int


class RecoveryDispatcher:
    def __init__(
        self,
        *,
        monitor: LoadMonitor,
        route_params: LoadParams,
        dispatch_params: DispatchParams,
        no_worker_wait_s: float,
        checkpoints: CheckpointManager | None = None,
        cost: CostModel | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.monitor = monitor
        self.route_params = route_params
        self.dispatch_params = dispatch_params
        self.no_worker_wait_s = no_worker_wait_s
        self.checkpoints = checkpoints
        self.cost = cost
        self.clock = clock
        # called as each interrupted request is about to resume (the outage admission listens)
        self.resume_hooks: list[Callable[[], None]] = []

    async def pick(
        self, resume: Resume | None, excluded: set[str], emitted: int
    ) -> tuple[WorkerRecord, Decision | None]:
        """The worker for the next attempt and, for a resume with checkpoints, the dispatch decision.

        Waits up to `no_worker_wait_s` for a HEALTHY worker; `excluded` (stalled or refusing workers)
        is cleared when nothing else is left. Raises NoWorkerAvailable.
        """
        if resume is not None:
            for hook in self.resume_hooks:
                hook()
        deadline = self.clock() + self.no_worker_wait_s
        while True:
            view = self.checkpoints.view() if self.checkpoints is not None else self.monitor.view()
            decision = self.decide(view, resume)
            wid = None if decision is None or decision.worker in excluded else decision.worker
            if wid is None:
                wid = choose_worker(view, self.route_params, exclude=excluded)
            if wid is None and excluded:
                # everything else is down: an excluded (stalled/refusing) worker beats no worker
                excluded.clear()
                wid = choose_worker(view, self.route_params)
            if wid is not None:
                return self.monitor.workers[wid], decision
            left = deadline - self.clock()
            if left <= 0 or not await self.monitor.wait_for_healthy(left):
                raise NoWorkerAvailable(
                    f"no healthy worker within {self.no_worker_wait_s:g} s "
                    f"({emitted} tokens were generated before)"
                )

    def decide(self, view: ClusterView, resume: Resume | None) -> Decision | None:
        """Algorithm 2 for a resuming request (None for a first attempt or without checkpoints)."""
        if self.checkpoints is None or resume is None:
            return None
        req = self.checkpoints.interrupted(
            resume.rid, resume.failed_worker, resume.context_tokens, resume.remaining_tokens
        )
        return dispatch(view, req, self.dispatch_params, self.cost)
