"""The engine's step loop (`StepLoop`): runs the scheduler's steps in (scaled) real time.

Each synthetic step sleeps until an absolute deadline advanced by the modelled step time (times the
slowdown a slow fault sets), so the CPU time the step itself took is not added on top, and timer
granularity (uvloop rounds to 1 ms) evens out over steps. A step that admits a request with a restored
prefix also pays the modelled host-to-device copy of that prefix; an assisted step first waits (at most
draft_timeout) for its drafts and pays for verifying them.

With the torch backend the steps are real: the scheduler plans on the loop, the forward runs on the
backend's step thread (torch_backend.py), nothing is modelled and a step takes what it takes (a slow
fault adds `slowdown - 1` times that).

The loop idles while the scheduler has no work (`wake` restarts it) and while paused (fault injection:
a hung engine whose process is still alive). After each step the engine's `on_step` hands the step's
tokens to their streams; a step that raises calls `on_failure` and ends the loop. The engine
(engine.py) owns the task that runs `run`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import structlog

from gateway.core.costmodel import CostModel, StepWork
from worker_hooks.engine.draft_assist import Assist
from worker_hooks.engine.scheduler import Drafts, Scheduler, StepResult

if TYPE_CHECKING:
    from worker_hooks.engine.torch_backend import TorchBackend
    from worker_hooks.engine.torch_scheduler import TorchScheduler

log = structlog.get_logger(__name__)

# how far the step clock may lag behind wall time before it is pulled forward (no long catch-up bursts)
MAX_LAG_S = 0.005
# the largest step-time multiplier a slow fault may set (beyond it, a stall is the better model)
MAX_SLOWDOWN = 1000.0


class StepLoop:
    def __init__(
        self,
        *,
        worker_id: str,
        scheduler: Scheduler | TorchScheduler,
        cost: CostModel,
        time_scale: float,
        torch: TorchBackend | None,
        assist: Assist,
        on_step: Callable[[StepResult], None],
        on_failure: Callable[[], None],
    ) -> None:
        """`on_step`: after every step that ran (its pages exist, its emissions are to deliver);
        `on_failure`: a step raised (the loop then ends, re-raising it)."""
        self.worker_id = worker_id
        self.scheduler = scheduler
        self.cost = cost
        self.time_scale = time_scale
        self.torch = torch
        self.assist = assist
        self._on_step = on_step
        self._on_failure = on_failure
        self._wake = asyncio.Event()
        # fault injection (gray failure): a paused engine stops stepping while the agent keeps
        # heartbeating, so only the gateway's stall timeout can catch it
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        # fault injection (a slow, degraded GPU): every step takes `slowdown` x its modelled time
        self.slowdown = 1.0
        # a seed sending its weights to a restarting peer (seeding.py): its steps take this much longer
        self.send_slowdown = 1.0
        self.steps_total = 0
        self.modelled_s_total = 0.0  # modelled time of every step so far (restores included)
        self.busy_s_total = 0.0  # wall time the loop spent outside its sleeps

    def wake(self) -> None:
        """There may be work: a request queued, or pages freed that may let a waiting one in."""
        self._wake.set()

    def pause(self) -> None:
        """Freeze the step loop (fault injection: a hung engine whose process is still alive)."""
        log.warning("engine paused (fault injection)", worker_id=self.worker_id)
        self._unpaused.clear()

    def resume(self) -> None:
        self._unpaused.set()

    @property
    def paused(self) -> bool:
        return not self._unpaused.is_set()

    def set_slowdown(self, factor: float) -> None:
        """Stretch every following step to `factor` x its modelled time (fault injection: the engine
        keeps serving, only slower); 1.0 restores normal speed. The step in progress keeps its time."""
        if not (math.isfinite(factor) and 0 < factor <= MAX_SLOWDOWN):
            raise ValueError(f"slowdown must be a number in (0, {MAX_SLOWDOWN:g}], got {factor}")
        log.warning("engine slowdown (fault injection)", worker_id=self.worker_id, slowdown=factor)
        self.slowdown = factor

    @property
    def factor(self) -> float:
        """What a step's time is stretched by: a slow fault's factor times a seed's send factor."""
        return self.slowdown * self.send_slowdown

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        scale = self.time_scale
        try:
            while True:
                if not self.scheduler.has_work:
                    self._wake.clear()
                    await self._wake.wait()
                    deadline = loop.time()
                if not self._unpaused.is_set():
                    await self._unpaused.wait()
                    deadline = loop.time()
                sp = self.assist.speculator
                drafts: dict[str, Drafts] = await sp.collect() if sp is not None else {}  # <= draft_timeout
                t0 = time.perf_counter()
                if not isinstance(self.scheduler, Scheduler):
                    result, t1 = await self._step_torch(drafts)
                    t2 = time.perf_counter()
                else:
                    result = self.scheduler.step(drafts)
                    if not result.empty:
                        modelled = self.cost.step_time(result.work)
                        if result.restored_tokens:
                            modelled += self.cost.restore_time(result.restored_tokens)
                        self.modelled_s_total += modelled
                        deadline = max(deadline, loop.time() - MAX_LAG_S) + modelled * scale * self.factor
                    t1 = time.perf_counter()
                    delay = deadline - loop.time()
                    await asyncio.sleep(delay if delay > 0 else 0)
                    t2 = time.perf_counter()
                if result.empty:
                    # defensive: nothing admissible and nothing running; wait for a submit or an abort
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                self.steps_total += 1
                # the step's pages exist once it has run; its finished requests end after them
                self._on_step(result)
                if self.assist.speculator is not None:
                    # a pair that changed during the step does not count the old pair's verifications
                    verified = result.verified if self.assist.speculator is sp else ()
                    self.assist.speculator.after_step(verified, self.scheduler.decoding())
                self.busy_s_total += (t1 - t0) + (time.perf_counter() - t2)
        except asyncio.CancelledError:
            raise
        except Exception:
            # the outermost loop: fail every request loudly rather than leave streams hanging
            log.exception("engine step failed", worker_id=self.worker_id)
            self._on_failure()
            raise

    async def _step_torch(self, drafts: dict[str, Drafts]) -> tuple[StepResult, float]:
        """One real step: (result, perf_counter at the end of the forward). A slow fault stretches
        the step to `slowdown` x its real time after the forward."""
        torch_backend, scheduler = self.torch, self.scheduler
        assert torch_backend is not None and not isinstance(scheduler, Scheduler)
        out = await torch_backend.step(scheduler, drafts)
        if out is None:
            return StepResult(StepWork(prefill=[], decode_contexts=[]), []), time.perf_counter()
        result, seconds = out
        self.modelled_s_total += seconds  # measured: the step thread's time
        end = time.perf_counter()
        if self.factor != 1.0:
            await asyncio.sleep(seconds * (self.factor - 1.0))
        return result, end
