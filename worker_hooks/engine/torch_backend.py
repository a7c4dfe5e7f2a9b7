"""The torch backend's model side: loading, the paged KV cache, one step's forward, page export/import.

`TorchBackend` is created with the worker's spec and loads nothing until asked, so a restarting worker
can load its draft model first (`load_draft`) and the full model after (`load_target`), both on the
engine's step thread. Weights come from a HuggingFace folder or, for a preset name, from random
initialisation seeded by `model_seed` (every worker of a cluster then holds bit-identical weights,
which is what makes a replay, a restore or a draft on another worker exact).

Everything blocking runs on one step thread owned here (`step`, `load_target_async`,
`load_draft_async` are the event loop's side): the loop keeps serving heartbeats, streams and the draft
plane while a forward runs, and forwards never overlap. `run(plan)` first copies the restored prefixes' KV bytes into their pages, then runs the step's
forward over every batch item, and reports the seconds each took. `export(seq, first, end)` reads a
request's pages [first, end) out as one host buffer for the checkpoint sender: for each page, every
layer's K block then V block (models/torch_kv_cache.py's layout), so a holder stores real KV bytes and
a restore is their byte-for-byte copy back into any free pages.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import structlog
import torch

from gateway.protocol.generate import SamplingParams
from gateway.protocol.launch import Backend, EngineSpec
from models.torch_config import ModelConfig, parse_dtype, resolve_config
from models.torch_kv_cache import PagedKVCache
from models.torch_model import CausalLM
from models.torch_weights import load_or_init
from worker_hooks.engine.pages import PagePool
from worker_hooks.engine.scheduler import Drafts, Seq, StepResult
from worker_hooks.engine.torch_scheduler import StepPlan, TorchScheduler, TorchSeq

log = structlog.get_logger(__name__)
T = TypeVar("T")

SELF_DRAFT = "self:"


def draft_layers(name: str) -> int | None:
    """N for a self-draft "self:N" (the target's first N layers), else None."""
    if not name.startswith(SELF_DRAFT):
        return None
    n = name.removeprefix(SELF_DRAFT)
    if not n.isdigit() or int(n) < 1:
        raise ValueError(f"torch draft {name!r}: self:N needs N >= 1 layers")
    return int(n)


class TorchBackend:
    def __init__(self, spec: EngineSpec, capacity_tokens: int) -> None:
        self.spec = spec
        self.dtype = parse_dtype(spec.torch_dtype)
        self.device = torch.device(spec.torch_device)
        self.cfg: ModelConfig = resolve_config(spec.torch_model)
        if spec.vocab_size > self.cfg.vocab_size:
            raise ValueError(
                f"the tokenizer's vocabulary ({spec.vocab_size}) is larger than the model's "
                f"({self.cfg.vocab_size}): ids the model has no embedding for would be accepted"
            )
        self.page_size = spec.page_size
        self.num_pages = capacity_tokens // spec.page_size
        self.page_nbytes = self.cfg.kv_bytes_per_token(self.dtype) * spec.page_size
        self.model: CausalLM | None = None
        self.cache: PagedKVCache | None = None
        self.load_s = 0.0
        self.draft_load_s = 0.0
        self.restore_s_total = 0.0
        self.forward_s_total = 0.0
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"torch-{spec.worker_id}")
        if spec.torch_threads > 0:
            torch.set_num_threads(spec.torch_threads)

    async def _on_thread(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn)

    async def load_target_async(self) -> None:
        await self._on_thread(self.load_target)

    async def load_draft_async(self) -> CausalLM | None:
        return await self._on_thread(self.load_draft)

    async def step(
        self, scheduler: TorchScheduler, drafts: Mapping[str, Drafts]
    ) -> tuple[StepResult, float] | None:
        """Plan on the loop, forward on the step thread, commit on the loop: (result, wall seconds of
        the thread's work), or None when there is nothing to run."""
        plan = scheduler.plan(drafts)
        if plan.empty:
            return None
        t0 = time.perf_counter()
        logits = await self._on_thread(lambda: self.run(plan))
        seconds = time.perf_counter() - t0
        return scheduler.commit(plan, logits), seconds

    def close(self) -> None:
        """Stop the step thread (a forward in progress finishes on its own; nobody awaits it)."""
        self._thread.shutdown(wait=False, cancel_futures=True)

    @property
    def loaded(self) -> bool:
        return self.model is not None

    # -- loading (blocking: run on the step thread) -----------------------------------------------
    def load_target(self) -> None:
        t0 = time.perf_counter()
        model = load_or_init(
            self.spec.torch_model, self.spec.model_seed, dtype=self.dtype, device=self.device
        )
        cache = PagedKVCache(model.cfg, self.num_pages, self.page_size, dtype=self.dtype, device=self.device)
        self.model, self.cache = model, cache
        self.load_s = time.perf_counter() - t0
        log.info(
            "torch model loaded",
            worker_id=self.spec.worker_id,
            model=self.spec.torch_model,
            dtype=self.spec.torch_dtype,
            device=str(self.device),
            kv_pages=self.num_pages,
            seconds=round(self.load_s, 3),
        )

    def load_draft(self) -> CausalLM | None:
        """The drafter's model ("" in the spec: none)."""
        name = self.spec.torch_draft
        if not name:
            return None
        t0 = time.perf_counter()
        n = draft_layers(name)
        source = self.spec.torch_model if n is not None else name
        model = load_or_init(source, self.spec.model_seed, dtype=self.dtype, device=self.device, num_layers=n)
        self.draft_load_s = time.perf_counter() - t0
        log.info(
            "torch draft model loaded", worker_id=self.spec.worker_id, draft=name, seconds=self.draft_load_s
        )
        return model

    # -- one step (blocking: run on the step thread) ----------------------------------------------
    def run(self, plan: StepPlan) -> list[torch.Tensor]:
        """Copy in the restored prefixes, then one forward; returns the logits per batch item."""
        model, cache = self._ready()
        t0 = time.perf_counter()
        for pages, data in plan.restores:
            cache.import_pages(pages, data)
        if plan.restores and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t1 = time.perf_counter()
        logits = model.forward_batch(plan.items, cache) if plan.works else []
        t2 = time.perf_counter()
        self.restore_s_total += t1 - t0
        self.forward_s_total += t2 - t1
        return logits

    def export(self, seq: Seq, first: int, end: int) -> memoryview:
        """KV bytes of the request's pages [first, end) (checkpoint streaming)."""
        _, cache = self._ready()
        if not isinstance(seq, TorchSeq):
            raise TypeError(f"request {seq.rid!r} has no torch page table")
        data: memoryview = cache.export_pages(seq.page_table[first:end]).data
        return data

    def _ready(self) -> tuple[CausalLM, PagedKVCache]:
        if self.model is None or self.cache is None:
            raise RuntimeError("the torch model is not loaded")
        return self.model, self.cache


def expected_outputs(
    requests: Sequence[tuple[list[int], SamplingParams, int]],
    *,
    model: str = "tiny",
    model_seed: int = 0,
    page_size: int = 16,
    kv_tokens: int = 1 << 16,
) -> list[list[int]]:
    """Ground truth for tests: the ids a torch worker of this model produces for each
    (prompt, sampling params, seed_base), run together in one uninterrupted local engine."""
    spec = EngineSpec(
        worker_id="reference",
        control_address="",
        backend=Backend.TORCH,
        torch_model=model,
        model_seed=model_seed,
        page_size=page_size,
        torch_threads=0,
    )
    pool = PagePool(kv_tokens, page_size)
    backend = TorchBackend(spec, pool.capacity_tokens)
    backend.load_target()
    sched = TorchScheduler(pool, max_running=len(requests) or 1, chunked_prefill_size=8192)
    for i, (prompt, params, seed_base) in enumerate(requests):
        sched.add(sched.make_seq(str(i), prompt, params, seed_base))
    outs: list[list[int]] = [[] for _ in requests]
    while sched.has_work:
        plan = sched.plan()
        logits = backend.run(plan)
        for e in sched.commit(plan, logits).emissions:
            outs[int(e.rid)].extend(e.new_ids)
    backend.close()
    return outs
