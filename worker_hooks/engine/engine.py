"""The engine shell: runs the scheduler in (scaled) real time and hands tokens to request streams.

It owns the step loop and the model-load timer (both started by `start()` and awaited by `stop()`),
the worker's incarnation and phase, and one `RequestHandle` per live request. Each step sleeps until an
absolute deadline advanced by the modelled step time, so the CPU time the step itself took is not
added on top, and timer granularity (uvloop rounds to 1 ms) evens out over steps.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import structlog

from gateway.core.costmodel import CostModel
from gateway.core.health import Phase
from gateway.protocol.generate import FinishReason, GenerateRequest
from gateway.protocol.launch import EngineSpec
from gateway.protocol.versions import GENERATE_PROTOCOL_VERSION
from worker_hooks.engine import errors
from worker_hooks.engine.pages import PagePool
from worker_hooks.engine.scheduler import Emission, Scheduler
from worker_hooks.engine.synthetic import SyntheticModel

log = structlog.get_logger(__name__)

# how far the step clock may lag behind wall time before it is pulled forward (no long catch-up bursts)
MAX_LAG_S = 0.005


def now_us() -> int:
    return time.time_ns() // 1000


@dataclass(frozen=True, slots=True)
class EngineStats:
    phase: Phase
    incarnation: int
    running: int
    waiting: int
    kv_tokens_used: int
    kv_capacity_tokens: int
    kv_pages_used: int
    max_running_requests: int
    requests_total: int
    completed_total: int
    aborted_total: int
    prompt_tokens_total: int
    generated_tokens_total: int
    steps_total: int


class RequestHandle:
    """The receiving end of one request: emissions in order, the last one with a finish reason."""

    __slots__ = ("_queue", "finished", "incarnation", "prompt_tokens", "rid")

    def __init__(self, rid: str, prompt_tokens: int, incarnation: int) -> None:
        self.rid = rid
        self.prompt_tokens = prompt_tokens
        self.incarnation = incarnation  # the incarnation that accepted the request
        self.finished = False
        self._queue: asyncio.Queue[Emission] = asyncio.Queue()

    def _push(self, emission: Emission) -> None:
        self._queue.put_nowait(emission)
        if emission.finish is not None:
            self.finished = True

    async def next(self) -> Emission:
        return await self._queue.get()

    def next_nowait(self) -> Emission | None:
        return None if self._queue.empty() else self._queue.get_nowait()


class Engine:
    def __init__(self, spec: EngineSpec, worker_id: str | None = None) -> None:
        if spec.backend != "synthetic":
            raise ValueError(f"backend {spec.backend!r} is not available in this engine (only 'synthetic')")
        if spec.time_scale < 0:
            raise ValueError(f"time_scale must be >= 0, got {spec.time_scale}")
        self.spec = spec
        self.worker_id = worker_id or spec.worker_id
        self.cost = CostModel.preset(spec.model, spec.gpu, spec.tp or None)
        capacity = spec.kv_capacity_tokens or self.cost.kv_capacity_tokens()
        self.pool = PagePool(capacity, spec.page_size)
        self.model = SyntheticModel(spec.model_seed, spec.token_lo, spec.token_hi)
        self.scheduler = Scheduler(
            self.model,
            self.pool,
            max_running=spec.max_running_requests,
            chunked_prefill_size=spec.chunked_prefill_size,
        )
        self.incarnation = now_us()
        self.phase = Phase.LOADING_FULL if spec.restart else Phase.SERVING
        self._handles: dict[str, RequestHandle] = {}
        self._wake = asyncio.Event()
        # fault injection (gray failure): a paused engine stops stepping while the agent keeps
        # heartbeating, so only the gateway's stall timeout can catch it
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._loop_task: asyncio.Task[None] | None = None
        self._load_task: asyncio.Task[None] | None = None
        self.requests_total = 0
        self.aborted_total = 0
        self.prompt_tokens_total = 0
        self.generated_tokens_total = 0
        self.steps_total = 0

    # -- lifecycle ------------------------------------------------------------------------------
    def load_time_s(self) -> float:
        load = self.spec.model_load_s if self.spec.model_load_s is not None else self.cost.load_time()
        return load * self.spec.time_scale

    async def start(self) -> None:
        if self._loop_task is not None:
            raise RuntimeError("engine already started")
        self._loop_task = asyncio.create_task(self._run(), name=f"engine-{self.worker_id}")
        if self.phase is Phase.LOADING_FULL:
            self._load_task = asyncio.create_task(self._load(), name=f"load-{self.worker_id}")

    def pause(self) -> None:
        """Freeze the step loop (fault injection: a hung engine whose process is still alive)."""
        log.warning("engine paused (fault injection)", worker_id=self.worker_id)
        self._unpaused.clear()

    def resume(self) -> None:
        self._unpaused.set()

    @property
    def paused(self) -> bool:
        return not self._unpaused.is_set()

    async def stop(self) -> None:
        """Abort every request (their streams end with an abort chunk) and stop the owned tasks."""
        self.phase = Phase.DRAINING  # refuse what arrives until the HTTP server has closed
        self.abort_all("worker shutting down")
        for task in (self._load_task, self._loop_task):
            if task is not None:
                task.cancel()
        for task in (self._load_task, self._loop_task):
            if task is not None:
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        self._load_task = self._loop_task = None

    async def _load(self) -> None:
        t = self.load_time_s()
        log.info("loading model", worker_id=self.worker_id, modelled_s=t)
        await asyncio.sleep(t)
        if self.phase is Phase.LOADING_FULL:
            self.phase = Phase.SERVING
            log.info("serving", worker_id=self.worker_id, incarnation=self.incarnation)

    def drain(self) -> None:
        """Stop taking new requests; those in flight finish."""
        self.phase = Phase.DRAINING

    def reset_incarnation(self) -> int:
        """Become a new incarnation: nobody trusts our in-flight requests any more (DESIGN 4.3)."""
        old = self.incarnation
        n = len(self.abort_all("worker incarnation reset"))
        self.incarnation = max(now_us(), old + 1)
        log.info("incarnation reset", worker_id=self.worker_id, old=old, new=self.incarnation, aborted=n)
        return self.incarnation

    # -- requests -------------------------------------------------------------------------------
    def submit(self, req: GenerateRequest) -> RequestHandle:
        """Validate and queue a request; raises an EngineError subclass and changes nothing if refused."""
        ext = req.lumen
        if ext is not None:
            if ext.v != GENERATE_PROTOCOL_VERSION:
                raise errors.UnsupportedVersion(
                    f"lumen.v {ext.v} is not supported (this worker speaks {GENERATE_PROTOCOL_VERSION})"
                )
            if ext.epoch != 0 and ext.epoch != self.incarnation:
                raise errors.StaleEpoch(
                    f"request for incarnation {ext.epoch}, this worker is incarnation {self.incarnation}"
                )
        if self.phase is not Phase.SERVING:
            raise errors.NotServing(f"worker {self.worker_id} is {self.phase.value}")
        self._validate(req)
        seq = self.scheduler.make_seq(
            req.rid, req.input_ids, req.sampling_params, ext.seed_base if ext else 0
        )
        if not self.scheduler.fits_ever(seq):
            raise errors.PromptTooLong(
                f"prompt ({len(req.input_ids)}) + max_new_tokens ({req.sampling_params.max_new_tokens}) "
                f"exceeds the KV capacity of {self.pool.capacity_tokens} tokens"
            )
        if req.rid in self._handles:
            raise errors.DuplicateRequest(f"request id {req.rid!r} is already in flight")
        self.scheduler.add(seq)
        handle = RequestHandle(req.rid, len(req.input_ids), self.incarnation)
        self._handles[req.rid] = handle
        self.requests_total += 1
        self.prompt_tokens_total += len(req.input_ids)
        self._wake.set()
        return handle

    def _validate(self, req: GenerateRequest) -> None:
        p = req.sampling_params
        if not req.rid:
            raise errors.InvalidRequest("rid must be a non-empty string")
        if not req.input_ids:
            raise errors.InvalidRequest("input_ids must not be empty")
        vocab = self.spec.vocab_size
        bad = next((t for t in req.input_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise errors.InvalidRequest(f"input id {bad} is outside the vocabulary [0, {vocab})")
        if p.max_new_tokens < 0:
            raise errors.InvalidRequest(f"max_new_tokens must be >= 0, got {p.max_new_tokens}")
        if not p.temperature >= 0.0:
            raise errors.InvalidRequest(f"temperature must be >= 0, got {p.temperature}")
        if not 0.0 < p.top_p <= 1.0:
            raise errors.InvalidRequest(f"top_p must be in (0, 1], got {p.top_p}")
        if p.top_k != -1 and p.top_k < 1:
            raise errors.InvalidRequest(f"top_k must be -1 (disabled) or >= 1, got {p.top_k}")

    def abort(self, rid: str, message: str = "aborted") -> bool:
        """Abort one request by exact id; its stream (if anyone reads it) ends with an abort chunk."""
        seq = self.scheduler.abort(rid)
        handle = self._handles.pop(rid, None)
        if seq is None and handle is None:
            return False
        self.aborted_total += 1
        self._wake.set()  # freed pages may let a waiting request in
        if handle is not None:
            done = len(seq.output) if seq is not None else 0
            handle._push(Emission(rid, [], done, FinishReason(type="abort", message=message)))
        return True

    def abort_prefix(self, prefix: str, message: str = "aborted by request") -> list[str]:
        """SGLang's /abort_request semantics: every request whose id starts with `prefix`."""
        rids = [r for r in self.scheduler.rids() if r.startswith(prefix)]
        return [r for r in rids if self.abort(r, message)]

    def abort_all(self, message: str) -> list[str]:
        return [r for r in self.scheduler.rids() if self.abort(r, message)]

    # -- stats ----------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            phase=self.phase,
            incarnation=self.incarnation,
            running=len(s.running),
            waiting=len(s.waiting),
            kv_tokens_used=s.kv_tokens_used(),
            kv_capacity_tokens=self.pool.capacity_tokens,
            kv_pages_used=self.pool.used_pages,
            max_running_requests=s.max_running,
            requests_total=self.requests_total,
            completed_total=s.completed_total,
            aborted_total=self.aborted_total,
            prompt_tokens_total=self.prompt_tokens_total,
            generated_tokens_total=self.generated_tokens_total,
            steps_total=self.steps_total,
        )

    # -- the step loop --------------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        scale = self.spec.time_scale
        try:
            while True:
                if not self.scheduler.has_work:
                    self._wake.clear()
                    await self._wake.wait()
                    deadline = loop.time()
                if not self._unpaused.is_set():
                    await self._unpaused.wait()
                    deadline = loop.time()
                result = self.scheduler.step()
                if result.empty:
                    # defensive: nothing admissible and nothing running; wait for a submit or an abort
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                self.steps_total += 1
                dt = self.cost.step_time(result.work) * scale
                deadline = max(deadline, loop.time() - MAX_LAG_S) + dt
                delay = deadline - loop.time()
                await asyncio.sleep(delay if delay > 0 else 0)
                self._deliver(result.emissions)
        except asyncio.CancelledError:
            raise
        except Exception:
            # the outermost loop: fail every request loudly rather than leave streams hanging
            log.exception("engine step failed", worker_id=self.worker_id)
            self.phase = Phase.DRAINING  # refuse new work: nothing would run it
            self.abort_all("engine error")
            raise

    def _deliver(self, emissions: list[Emission]) -> None:
        handles = self._handles
        for e in emissions:
            handle = handles.get(e.rid)
            if handle is None:
                continue  # aborted while the step ran
            self.generated_tokens_total += len(e.new_ids)
            handle._push(e)
            if e.finish is not None:
                del handles[e.rid]
