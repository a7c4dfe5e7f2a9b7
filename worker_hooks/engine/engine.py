"""The engine shell: runs the scheduler in (scaled) real time and hands tokens to request streams.

It owns the step loop and the model-load timer (both started by `start()` and awaited by `stop()`),
the worker's incarnation and phase, the checkpointer (store, sender, restores), the draft-assist
roles (draft_assist.py) and one `RequestHandle` per live request. Each step sleeps until an absolute
deadline advanced by the modelled step time (times the slowdown a slow fault sets), so the CPU time
the step itself took is not added on top, and timer granularity (uvloop rounds to 1 ms) evens out
over steps. A step that admits a request with a restored prefix also pays the modelled
host-to-device copy of that prefix; an assisted step first waits (at most draft_timeout) for its
drafts and pays for verifying them.

A restart walks its load plan (loading.py). The switch to SERVING is one assignment in the load task,
so the first request after it is admitted by the next step with no load wait left.

With `backend = "torch"` the steps are real: the scheduler plans on the loop, the forward runs on the
backend's step thread (torch_backend.py), nothing is modelled and a step takes what it takes (a slow
fault adds `slowdown - 1` times that). Loading is real too, and the load plan's times become minimums:
a restart loads the draft model before DRAFT_READY and the full model before SERVING.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from gateway.core.costmodel import CostModel, StepWork
from gateway.core.health import Phase
from gateway.core.outage import OutageParams, queue_first
from gateway.protocol.generate import FinishReason, GenerateRequest
from gateway.protocol.launch import EngineSpec
from gateway.protocol.planes import PlaneAuth
from gateway.protocol.versions import GENERATE_PROTOCOL_VERSION
from models.synthetic import SyntheticModel
from worker_hooks.engine import errors
from worker_hooks.engine.checkpointing import Checkpointer, valid_endpoint
from worker_hooks.engine.draft_assist import Assist
from worker_hooks.engine.handle import RequestHandle
from worker_hooks.engine.loading import load_plan
from worker_hooks.engine.orphans import Orphanage
from worker_hooks.engine.pages import PagePool
from worker_hooks.engine.scheduler import Drafts, Emission, Scheduler, Seq, StepResult
from worker_hooks.engine.validation import validate

log = structlog.get_logger(__name__)

# how far the step clock may lag behind wall time before it is pulled forward (no long catch-up bursts)
MAX_LAG_S = 0.005
# the largest step-time multiplier a slow fault may set (beyond it, a stall is the better model)
MAX_SLOWDOWN = 1000.0
# the torch backend's KV pool when engine.kv_capacity_tokens is 0 (the cost model's figure is for the
# modelled GPU, not for this process)
TORCH_DEFAULT_KV_TOKENS = 32768

if TYPE_CHECKING:
    from worker_hooks.engine.torch_backend import TorchBackend
    from worker_hooks.engine.torch_scheduler import TorchScheduler


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
    modelled_s_total: float  # modelled time of every step so far (restores included)
    busy_s_total: float  # wall time the step loop spent outside its sleeps


class Engine:
    def __init__(self, spec: EngineSpec, worker_id: str | None = None) -> None:
        if spec.backend not in ("synthetic", "torch"):
            raise ValueError(f"backend {spec.backend!r} is not available (synthetic | torch)")
        if spec.time_scale < 0:
            raise ValueError(f"time_scale must be >= 0, got {spec.time_scale}")
        self.spec = spec
        self.worker_id = worker_id or spec.worker_id
        self.cost = CostModel.preset(spec.model, spec.gpu, spec.tp or None)
        batching = {
            "max_running": spec.max_running_requests,
            "chunked_prefill_size": spec.chunked_prefill_size,
        }
        self.torch: TorchBackend | None = None
        self.scheduler: Scheduler | TorchScheduler
        if spec.backend == "torch":
            # imported here: a synthetic worker (and the gateway's tests) never load torch
            from worker_hooks.engine.torch_backend import TorchBackend
            from worker_hooks.engine.torch_scheduler import TorchScheduler

            self.pool = PagePool(spec.kv_capacity_tokens or TORCH_DEFAULT_KV_TOKENS, spec.page_size)
            self.torch = TorchBackend(spec, self.pool.capacity_tokens)
            self.scheduler = TorchScheduler(self.pool, **batching)
        else:
            self.pool = PagePool(spec.kv_capacity_tokens or self.cost.kv_capacity_tokens(), spec.page_size)
            model = SyntheticModel(spec.model_seed, spec.token_lo, spec.token_hi)
            self.scheduler = Scheduler(model, self.pool, **batching)
        self.incarnation = now_us()
        self.load_plan = load_plan(spec, self.cost)
        self.phase = self.load_plan.first
        # the data planes' CURVE keypair of this process (Hello.plane_key) and the members it trusts
        # (the gateway's Members): always on, never plaintext (gateway/protocol/planes.py)
        self.planes = PlaneAuth.generate()
        # a restarting worker with a draft model drafts for a survivor while its full model loads
        self.assist = Assist(spec, self.worker_id, self.cost, drafter=self.load_plan.drafts, auth=self.planes)
        self.ckpt = Checkpointer(spec, self.worker_id, self.cost.model, auth=self.planes, pages=self.torch)
        self._handles: dict[str, RequestHandle] = {}
        # requests whose gateway went away, kept for another to adopt (orphans.py)
        self.orphans = Orphanage(lambda rid, message: self.abort(rid, message))
        self._wake = asyncio.Event()
        # fault injection (gray failure): a paused engine stops stepping while the agent keeps
        # heartbeating, so only the gateway's stall timeout can catch it
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        # fault injection (a slow, degraded GPU): every step takes `slowdown` x its modelled time
        self.slowdown = 1.0
        self._loop_task: asyncio.Task[None] | None = None
        self._load_task: asyncio.Task[None] | None = None
        self.requests_total = 0
        self.aborted_total = 0
        self.prompt_tokens_total = 0
        self.generated_tokens_total = 0
        self.steps_total = 0
        self.modelled_s_total = 0.0
        self.busy_s_total = 0.0

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._loop_task is not None:
            raise RuntimeError("engine already started")
        if self.torch is not None and not self.load_plan.changes:
            await self.torch.load_target_async()  # a first start serves at once: load before that
        await self.ckpt.start(self.incarnation)
        await self.assist.start()  # a drafter binds now: Hello carries its endpoint from the first session
        self._loop_task = asyncio.create_task(self._run(), name=f"engine-{self.worker_id}")
        if self.load_plan.changes:
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

    def set_slowdown(self, factor: float) -> None:
        """Stretch every following step to `factor` x its modelled time (fault injection: the engine
        keeps serving, only slower); 1.0 restores normal speed. The step in progress keeps its time."""
        if not (math.isfinite(factor) and 0 < factor <= MAX_SLOWDOWN):
            raise ValueError(f"slowdown must be a number in (0, {MAX_SLOWDOWN:g}], got {factor}")
        log.warning("engine slowdown (fault injection)", worker_id=self.worker_id, slowdown=factor)
        self.slowdown = factor

    async def stop(self) -> None:
        """Abort every request (their streams end with an abort chunk) and stop the owned tasks."""
        self.phase = Phase.DRAINING  # refuse what arrives until the HTTP server has closed
        self.abort_all("worker shutting down")
        tasks = (self._load_task, self._loop_task)
        for task in tasks:
            if task is not None:
                task.cancel()
        try:
            for task in tasks:
                if task is not None:
                    try:
                        await task
                    except asyncio.CancelledError:
                        pass
        finally:  # a crashed loop re-raises here; the sockets still close
            self._load_task = self._loop_task = None
            await self.assist.close()
            await self.ckpt.close()
            if self.torch is not None:
                self.torch.close()

    async def _load(self) -> None:
        """Walk the load plan; once serving, retire the drafter (after its pairs and rounds end)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        log.info("loading model", worker_id=self.worker_id, plan=self.load_plan)
        for at, phase in self.load_plan.changes:
            if self.torch is not None:  # real loads; the plan's times are minimums
                if phase is Phase.DRAFT_READY and self.assist.drafter is not None:
                    self.assist.drafter.set_model(await self.torch.load_draft_async())
                elif phase is Phase.SERVING:
                    await self.torch.load_target_async()
            await asyncio.sleep(max(0.0, start + at - loop.time()))
            if self.phase in (Phase.DRAINING, Phase.SERVING):
                break  # drained while loading: stays so
            if phase is Phase.DRAFT_READY and self.assist.drafter is not None:
                self.assist.drafter.set_ready()
            self.phase = phase
            log.info("phase", worker_id=self.worker_id, phase=phase.value, incarnation=self.incarnation)
        if self.assist.drafter is not None:
            await self.assist.drafter.retire()

    def drain(self) -> None:
        """Stop taking new requests; those in flight finish."""
        self.phase = Phase.DRAINING

    def reset_incarnation(self) -> int:
        """Become a new incarnation: nobody trusts our in-flight requests any more (DESIGN 4.3)."""
        old = self.incarnation
        fenced = [rid for rid, h in list(self._handles.items()) if h.fenced_by_reset]
        n = sum(1 for rid in fenced if self.abort(rid, "worker incarnation reset"))
        self.incarnation = max(now_us(), old + 1)
        self.ckpt.reset(self.incarnation)
        self.assist.reset()  # the gateway drops every pair of the old incarnation without telling us
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
        validate(req, self.spec.vocab_size)
        seed_base = ext.seed_base if ext else 0
        seq: Seq
        if not isinstance(self.scheduler, Scheduler):
            restored, data = self.ckpt.restore(req.input_ids)  # real KV bytes, copied out now
            seq = self.scheduler.make_seq(
                req.rid, req.input_ids, req.sampling_params, seed_base, restored, data
            )
        else:
            restored = self.ckpt.restorable(req.input_ids)
            seq = self.scheduler.make_seq(req.rid, req.input_ids, req.sampling_params, seed_base, restored)
        seq.top_logprobs = req.top_logprobs_num if req.return_logprob else -1
        seq.resumed = ext is not None and queue_first(ext.attempt, OutageParams())
        if not self.scheduler.fits_ever(seq):
            raise errors.PromptTooLong(
                f"prompt ({len(req.input_ids)}) + max_new_tokens ({req.sampling_params.max_new_tokens}) "
                f"exceeds the KV capacity of {self.pool.capacity_tokens} tokens"
            )
        if req.rid in self._handles:
            raise errors.DuplicateRequest(f"request id {req.rid!r} is already in flight")
        self.scheduler.add(seq)
        handle = RequestHandle(req.rid, len(req.input_ids), self.incarnation, restored, seq.top_logprobs)
        # only requests a Lumen gateway sent under an epoch are fenced by an incarnation reset;
        # clients talking to the worker directly (or through another gateway) keep their streams
        handle.fenced_by_reset = ext is not None and ext.epoch != 0
        handle.orphan_grace_s = ext.orphan_grace_s if ext is not None else 0.0
        self._handles[req.rid] = handle
        self.requests_total += 1
        self.prompt_tokens_total += len(req.input_ids)
        self.ckpt.admitted(seq, [h.kv_endpoint for h in ext.checkpoint] if ext else [])
        self._wake.set()
        return handle

    def abort(self, rid: str, message: str = "aborted", *, drop_checkpoint: bool = False) -> bool:
        """Abort one request by exact id; its stream (if anyone reads it) ends with an abort chunk.

        Its checkpoint stays with its holders (the gateway may resume from it) unless
        `drop_checkpoint`: the client itself gave up on the request.
        """
        seq = self.scheduler.abort(rid)
        handle = self._handles.pop(rid, None)
        self.orphans.release(rid)
        self.ckpt.forget(rid, drop=drop_checkpoint)
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
        return [r for r in rids if self.abort(r, message, drop_checkpoint=True)]

    def abort_all(self, message: str) -> list[str]:
        self.orphans.clear()
        return [r for r in self.scheduler.rids() if self.abort(r, message)]

    def orphan(self, handle: RequestHandle) -> None:
        """The handle's reader left before its end: keep it for adoption if its gateway asked for a
        grace, else abort it (freeing its pages at once)."""
        if handle.orphan_grace_s > 0 and (handle.finished or handle.rid in self._handles):
            self.orphans.keep(handle)
        elif not handle.finished:
            self.abort(handle.rid, "client disconnected")

    def adopt(self, rid: str, epoch: int = 0) -> RequestHandle:
        """A gateway takes over an orphaned request (raises NotFound / StaleEpoch, changing nothing)."""
        if epoch and epoch != self.incarnation:
            raise errors.StaleEpoch(
                f"adopt for incarnation {epoch}, this worker is incarnation {self.incarnation}"
            )
        handle = self.orphans.adopt(rid)
        if handle is None:
            raise errors.NotFound(f"no orphaned request {rid!r} here (finished, aborted or never seen)")
        return handle

    # -- checkpoint commands (control plane; DropCheckpoint goes to `ckpt.drop`) --------------------
    def assign_holders(self, rid: str, endpoints: list[str]) -> int:
        """AssignHolder: stream a running request to a new holder set (re-sending what new holders
        lack); returns the pages re-sent, 0 for a request not running here."""
        seq = self.scheduler.get(rid)
        good = [e for e in endpoints if valid_endpoint(e)]
        if seq is None or len(good) != len(endpoints):
            log.info("assign_holder ignored", rid=rid, running=seq is not None, endpoints=endpoints)
            return 0
        return self.ckpt.assign(seq, good)

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
            modelled_s_total=self.modelled_s_total,
            busy_s_total=self.busy_s_total,
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
                        deadline = max(deadline, loop.time() - MAX_LAG_S) + modelled * scale * self.slowdown
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
                self.ckpt.after_step()
                self._deliver(result.emissions)
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
            self.phase = Phase.DRAINING  # refuse new work: nothing would run it
            self.abort_all("engine error")
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
        if self.slowdown != 1.0:
            await asyncio.sleep(seconds * (self.slowdown - 1.0))
        return result, end

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
                self.ckpt.end(e.rid)
