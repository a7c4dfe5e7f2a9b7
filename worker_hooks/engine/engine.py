"""The engine shell: runs the scheduler in (scaled) real time and hands tokens to request streams.

It owns the step loop's task (stepping.py: how a step is paced, paused and slowed) and the
model-load timer (both started by `start()` and awaited by `stop()`), the worker's incarnation and
phase, the checkpointer (store, sender, restores), the draft-assist roles (draft_assist.py) and one
`RequestHandle` per live request: it admits, aborts and adopts requests, and hands each step's tokens
to their streams.

A restart walks its load plan (loading.py). The switch to SERVING is one assignment in the load task,
so the first request after it is admitted by the next step with no load wait left.

With `backend = "torch"` the steps are real (stepping.py). Loading is real too, and the load plan's
times become minimums: a restart loads the draft model before DRAFT_READY and the full model before
SERVING.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from gateway.core.costmodel import CostModel
from gateway.core.health import Phase
from gateway.core.outage import OutageParams, queue_first
from gateway.protocol.generate import INCARNATION_RESET_ABORT, FinishReason, GenerateRequest
from gateway.protocol.launch import EngineSpec
from gateway.protocol.openai.errors import PromptTooLong
from gateway.protocol.planes import PlaneAuth
from gateway.protocol.versions import GENERATE_PROTOCOL_VERSION
from models.synthetic import SyntheticModel
from worker_hooks.engine import errors
from worker_hooks.engine.admission import Admission
from worker_hooks.engine.checkpointing import Checkpointer, valid_endpoint
from worker_hooks.engine.draft_assist import Assist
from worker_hooks.engine.handle import RequestHandle
from worker_hooks.engine.loading import LoadPlan, load_plan, plain_plan, walk_plan
from worker_hooks.engine.orphans import Orphanage
from worker_hooks.engine.pages import PagePool
from worker_hooks.engine.scheduler import Emission, Scheduler, Seq, StepResult
from worker_hooks.engine.seeding import SeededReload
from worker_hooks.engine.stepping import StepLoop
from worker_hooks.engine.validation import validate

log = structlog.get_logger(__name__)

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
        self.steps = StepLoop(
            worker_id=self.worker_id,
            scheduler=self.scheduler,
            cost=self.cost,
            time_scale=spec.time_scale,
            torch=self.torch,
            assist=self.assist,
            on_step=self._after_step,
            on_failure=self._step_failed,
        )
        # the batch limit while the cluster recovers: the gateways' leases of a larger one (admission.py)
        self.admission = Admission(self.worker_id, self.scheduler, spec.max_running_requests, self.steps.wake)
        self._loop_task: asyncio.Task[None] | None = None
        self._load_task: asyncio.Task[None] | None = None
        self.replanned = asyncio.Event()  # skip_draft or a seed replaced the load plan
        self.load_started = 0.0  # loop time the load plan's times count from (walk_plan)
        # a restart's weights from a peer, and this worker as a peer's seed (seeding.py)
        self.seeding = SeededReload(self)
        self.requests_total = 0
        self.aborted_total = 0
        self.prompt_tokens_total = 0
        self.generated_tokens_total = 0

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._loop_task is not None:
            raise RuntimeError("engine already started")
        if self.torch is not None and not self.load_plan.changes:
            await self.torch.load_target_async()  # a first start serves at once: load before that
        await self.ckpt.start(self.incarnation)
        await self.assist.start()  # a drafter binds now: Hello carries its endpoint from the first session
        self._loop_task = asyncio.create_task(self.steps.run(), name=f"engine-{self.worker_id}")
        if self.load_plan.changes:
            self._load_task = asyncio.create_task(walk_plan(self), name=f"load-{self.worker_id}")

    def pause(self) -> None:
        """Freeze the step loop (fault injection: a hung engine whose process is still alive)."""
        self.steps.pause()

    def resume(self) -> None:
        self.steps.resume()

    @property
    def paused(self) -> bool:
        return self.steps.paused

    def set_slowdown(self, factor: float) -> None:
        """Stretch every following step to `factor` x its modelled time (fault injection: the engine
        keeps serving, only slower); 1.0 restores normal speed. The step in progress keeps its time."""
        self.steps.set_slowdown(factor)

    @property
    def slowdown(self) -> float:
        return self.steps.slowdown

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
            await self.seeding.close()
            await self.assist.close()
            await self.ckpt.close()
            if self.torch is not None:
                self.torch.close()

    def skip_draft(self) -> None:
        """Load the full model only, as a plain restart (the gateway's Welcome.skip_draft): from
        LOADING_DRAFT to LOADING_FULL, serving when a restart without a draft model would. Too late
        once the draft is ready (it drafts until the full model serves)."""
        if self.phase is not Phase.LOADING_DRAFT or not self.load_plan.drafts:
            return
        self.replan(plain_plan(self.spec, self.cost, self.seeding.weights_source))
        log.info("draft model skipped", worker_id=self.worker_id, plan=self.load_plan)

    def replan(self, plan: LoadPlan) -> None:
        """Replace the load plan (times from the load's start); the loading task re-reads it."""
        self.load_plan = plan
        self.phase = plan.first
        self.replanned.set()

    def drain(self) -> None:
        """Stop taking new requests; those in flight finish."""
        self.phase = Phase.DRAINING

    def set_admission(
        self, source: str, boost: float, lease_s: float, shortest_first_rate: float | None = None
    ) -> int:
        """A gateway's lease of a larger batch and an aged shortest-first queue while the cluster
        recovers (`SetAdmission`, admission.py); the batch limit now."""
        return self.admission.grant(source, boost, lease_s, shortest_first_rate)

    def reset_incarnation(self) -> int:
        """Become a new incarnation: nobody trusts our in-flight requests any more (DESIGN 4.3)."""
        old = self.incarnation
        fenced = [rid for rid, h in list(self._handles.items()) if h.fenced_by_reset]
        n = sum(1 for rid in fenced if self.abort(rid, INCARNATION_RESET_ABORT))
        self.incarnation = max(now_us(), old + 1)
        self.ckpt.reset(self.incarnation)
        self.assist.reset()  # the gateway drops every pair of the old incarnation without telling us
        self.admission.clear()  # grants were to the old incarnation
        log.info("incarnation reset", worker_id=self.worker_id, old=old, new=self.incarnation, aborted=n)
        return self.incarnation

    # -- requests -------------------------------------------------------------------------------
    def submit(self, req: GenerateRequest) -> RequestHandle:
        """Validate and queue a request; raises an OpenAIError (errors.py) and changes nothing if refused."""
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
        seq.enqueued_at = time.monotonic()
        if not self.scheduler.fits_ever(seq):
            raise PromptTooLong(
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
        self.steps.wake()
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
        self.steps.wake()  # freed pages may let a waiting request in
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
        """A gateway takes over an orphaned request (raises NoOrphan / StaleEpoch, changing nothing)."""
        if epoch and epoch != self.incarnation:
            raise errors.StaleEpoch(
                f"adopt for incarnation {epoch}, this worker is incarnation {self.incarnation}"
            )
        handle = self.orphans.adopt(rid)
        if handle is None:
            raise errors.NoOrphan(f"no orphaned request {rid!r} here (finished, aborted or never seen)")
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
            steps_total=self.steps.steps_total,
            modelled_s_total=self.steps.modelled_s_total,
            busy_s_total=self.steps.busy_s_total,
        )

    # -- the step loop's callbacks (stepping.py) ------------------------------------------------
    def _after_step(self, result: StepResult) -> None:
        """A step ran: its pages exist, so the checkpointer sends them first; then its tokens go out and
        its finished requests end."""
        self.ckpt.after_step()
        self._deliver(result.emissions)

    def _step_failed(self) -> None:
        self.phase = Phase.DRAINING  # refuse new work: nothing would run it
        self.abort_all("engine error")

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
