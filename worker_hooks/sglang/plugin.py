"""Lumen's SGLang plugin (sglang 0.5.23): decode-time KV checkpoints of running requests, no fork.

SGLang writes KV pages to its storage tier only after prefill (chunks) and when a request ends, never
while it decodes, so a server that dies mid-decode leaves nothing of its generated tokens' KV behind.
This plugin closes the gap the way SGLang's PD decode offload does (`srt/disaggregation/
decode_kvcache_offload_manager.py`, called every step from `srt/managers/scheduler_components/
batch_result_processor.py`), from outside SGLang: SGLang loads it through its general plugin entry
point (group `sglang.srt.plugins`, name `lumen`, `SGLANG_PLUGINS=lumen`) in every process; only the
scheduler processes (one per TP/PP rank) ever run its hook.

The hook (AFTER `SchedulerBatchResultProcessor.process_batch_result_decode`) sees every request of the
decode batch once its new tokens are appended and its finish state is set. Requests whose `kv_hints`
carry Lumen's `lumen.checkpoint` action (`gateway.protocol.sglang.kv_hints_for`) have each newly
complete page (KV exists for every token but the last emitted one) copied out of the GPU pool and sent
to their holders over Lumen's KV plane; `plugin_logic.Planner` decides which pages, `plugin_shipper`
sends them from a thread of its own. A finished request gets END; an aborted one nothing (the holders
keep its pages for the gateway to restore from).

Reading KV by page: the request's slot indices are its `req_to_token` row (`ReqToTokenPool.req_to_token
[req.kv.req_pool_idx, start:end]`, as the decode offload manager reads them); the pages are gathered from
the device pool's per-layer buffers (`MHATokenToKVPool.k_buffer[l]`/`v_buffer[l]`, rows [slots, heads,
head_dim]; `MLATokenToKVPool.kv_buffer[l]`, rows [slots, 1, kv_cache_dim]) with `index_select` on the
scheduler's current stream, rearranged on the GPU into the byte order SGLang's HiCache host pool gives a
page (`get_data_page(index, flat=True)` of `mem_cache/pool_host/mha.py` / `mla.py` for the server's
`--hicache-mem-layout`), and copied with non-blocking device→host copies into a ring of pinned host
memory (`plugin_logic.Staging`, allocated once); a CUDA event recorded after them tells the shipper
thread when the bytes are there. So a holder that is an SGLang server with Lumen's HiCache backend
(`hicache_backend.py`) restores these pages into its own host pool byte for byte, and the page keys are
SGLang's own (`pagekeys` = `get_hash_str`).

Never blocking the step: the hook only enqueues GPU work and returns; the scheduler thread never waits
for a copy, a socket or a lock held across I/O. Per step at most `step_bytes` of KV is copied; pages
that find no room in the ring, or whose holders all have half their lag bound on the way
(`Shipper.congested`), wait for a later step; a request whose uncopied pages pass `max_backlog_bytes` is
abandoned with a DROP (the rules: `plugin_logic`). Safety of the slots read: the copy is ordered on the
scheduler's stream, and every later forward waits on that stream (`forward_stream.wait_stream(
schedule_stream)` in `Scheduler.run_batch`), so a slot freed after this step (a finish, a retraction) is
not overwritten before the copy has read it. The step that starts the plugin (the first decode step)
pins the ring and runs one page's copy once (`KvReader.warm_up`).

Supported: MHA pools in NHD layout without scale buffers and with equal K/V head dims, MLA pools without
layer sharding; host layouts layer_first, page_first, page_first_direct (and page_head for MHA);
TP and PP (rank r sends its shard to shard r of each holder, an MLA cache only from TP rank 0, as
`page_store.shard_layout`). Anything else (hybrid SWA/Mamba pools, quantized pools with scales, HND,
context parallelism) turns the plugin off for that server, once, with a log line: requests then run
uncheckpointed, as without the plugin.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import structlog
import torch

from gateway.protocol.pagekeys import namespace_seed
from gateway.protocol.plane_file import FileKeyring, Keyring
from gateway.protocol.sglang import parse_kv_hints
from worker_hooks.sglang.plugin_logic import (
    Copy,
    Outcome,
    Planner,
    PluginOptions,
    ReqStep,
    Staging,
    complete_pages,
    options_from_env,
    token_slice,
)
from worker_hooks.sglang.plugin_shipper import PageRun, ShipJob, Shipper
from worker_hooks.sglang.storage_layout import shard_layout

log = structlog.get_logger("lumen.sglang.plugin")

# the one function hooked, and how (checked against the installed sglang by tests/sglang/test_plugin_paths.py)
DECODE_RESULT_HOOK: Final = (
    "sglang.srt.managers.scheduler_components.batch_result_processor."
    "SchedulerBatchResultProcessor.process_batch_result_decode"
)
HOOKS: Final = ((DECODE_RESULT_HOOK, "AFTER"),)
MHA_LAYOUTS: Final = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS: Final = ("layer_first", "page_first", "page_first_direct")
SWEEP_EVERY: Final = 16  # steps between sweeps for tracked requests that left the decode batch
MAX_HOOK_ERRORS: Final = 3  # then the plugin turns itself off
MAX_IGNORED: Final = 1 << 16  # rids remembered as carrying hints that are not Lumen's


def register() -> None:
    """The `sglang.srt.plugins` entry point: hook the decode result processing (applied by SGLang's
    `load_plugins` right after all plugins registered)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(DECODE_RESULT_HOOK, after_decode_result, HookType.AFTER)


# -- reading pages out of the device pool ---------------------------------------------------------
class Unsupported(Exception):
    """This server's KV pool or layout cannot be checkpointed by the plugin."""


# per host layout: the permutation of the gathered [2, L, n, ps, H, B] (MHA) or [L, n, ps, 1, B] (MLA)
# that puts each page's bytes in SGLang's host-pool page order (mem_cache/pool_host/mha.py, mla.py)
_MHA_PERM: Final = {
    "layer_first": (2, 0, 1, 3, 4, 5),  # page (2, L, ps, H, D)
    "page_first_direct": (2, 0, 1, 3, 4, 5),  # page (2, 1, L, ps, H, D)
    "page_first": (2, 0, 3, 1, 4, 5),  # page (2, ps, L, H, D)
    "page_head": (2, 0, 4, 3, 1, 5),  # page (2, H, ps, L, D)
}
_MLA_PERM: Final = {
    "layer_first": (1, 0, 2, 3, 4),  # page (L, ps, 1, dim)
    "page_first_direct": (1, 0, 2, 3, 4),  # page (1, L, ps, 1, dim)
    "page_first": (1, 2, 0, 3, 4),  # page (ps, L, 1, dim)
}


@dataclass(slots=True, eq=False)
class Staged:
    """One step's pages on their way to host memory."""

    host: torch.Tensor | None
    ready: Callable[[], bool]

    def data(self) -> memoryview:
        assert self.host is not None
        flat: memoryview = self.host.reshape(-1).numpy().data
        return flat

    def release(self) -> None:
        self.host = None  # the pinned block goes back to torch's caching host allocator


class KvReader:
    """Whole pages of a device KV pool as host bytes in SGLang's HiCache page format."""

    def __init__(self, *, mla: bool, buffers: Sequence[Sequence[torch.Tensor]], layout: str, page_size: int):
        perms = _MLA_PERM if mla else _MHA_PERM
        if layout not in perms:
            raise Unsupported(f"host layout {layout!r} (supported: {', '.join(perms)})")
        if page_size < 1 or not buffers or not buffers[0]:
            raise Unsupported("an empty KV pool")
        self.mla, self.layout, self.page_size, self._perm = mla, layout, page_size, perms[layout]
        # byte views of every layer's rows: [slots, heads, head_dim * itemsize]
        self._bufs = [[_bytes_rows(b) for b in group] for group in buffers]
        first = self._bufs[0][0]
        row = tuple(first.shape[1:])
        if any(tuple(b.shape[1:]) != row or b.device != first.device for g in self._bufs for b in g):
            raise Unsupported("KV buffers of different row shapes or devices")
        self.device = first.device
        self.layers = len(self._bufs[0])
        self.row_shape = row
        self.dtype = str(buffers[0][0].dtype).removeprefix("torch.")
        self.page_bytes = len(self._bufs) * self.layers * page_size * row[0] * row[1]
        itemsize = buffers[0][0].element_size()
        if mla:
            self.page_shape = _permuted([self.layers, 1, page_size, 1, row[1] // itemsize], self._perm)[1:]
        else:
            self.page_shape = _permuted(
                [2, self.layers, 1, page_size, row[0], row[1] // itemsize], self._perm
            )[1:]

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """[n_pages, page_bytes] uint8 on the pool's device, for slot indices of whole pages."""
        t = int(slots.numel())
        if t == 0 or t % self.page_size:
            raise ValueError(f"{t} slots are not whole pages of {self.page_size}")
        n = t // self.page_size
        h, b = self.row_shape
        kinds = len(self._bufs)
        out = torch.empty((kinds, self.layers, t, h, b), dtype=torch.uint8, device=self.device)
        for k, group in enumerate(self._bufs):
            for layer, buf in enumerate(group):
                torch.index_select(buf, 0, slots, out=out[k, layer])
        if self.mla:
            x = out[0].view(self.layers, n, self.page_size, h, b)
        else:
            x = out.view(kinds, self.layers, n, self.page_size, h, b)
        return x.permute(self._perm).contiguous().view(n, -1)

    def copy_to(
        self, slots: torch.Tensor, dest: torch.Tensor, spans: Sequence[tuple[int, int]]
    ) -> Callable[[], bool]:
        """Gather the pages of `slots` and copy them, in order, into `dest` (flat uint8 host memory) at
        the (offset, nbytes) `spans`; returns at once on a GPU with a check of whether the copy is done."""
        pages = self.gather(slots).view(-1)
        if sum(n for _, n in spans) != pages.numel():
            raise ValueError(f"spans hold {sum(n for _, n in spans)} bytes, the pages {pages.numel()}")
        pos = 0
        for offset, n in _merged(spans):
            dest[offset : offset + n].copy_(pages[pos : pos + n], non_blocking=dest.is_pinned())
            pos += n
        if self.device.type != "cuda":
            return lambda: True
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record()  # on the current (scheduler) stream, after the copies
        return done.query

    def stage(self, slots: torch.Tensor) -> Staged:
        """The pages of `slots` in a host buffer of their own (pinned on a GPU); returns at once."""
        n = int(slots.numel()) // self.page_size
        host = torch.empty(n * self.page_bytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        ready = self.copy_to(slots, host, [(0, n * self.page_bytes)])
        return Staged(host.view(n, self.page_bytes), ready)

    def warm_up(self, dest: torch.Tensor, timeout_s: float = 5.0) -> None:
        """Copy one page into `dest` once, so the first decode step does not pay for loading the gather
        kernels (the scheduler thread waits here, once, when the plugin starts)."""
        ready = self.copy_to(
            torch.zeros(self.page_size, dtype=torch.int64, device=self.device), dest, [(0, self.page_bytes)]
        )
        deadline = time.monotonic() + timeout_s
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.0005)


def _merged(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent spans as one (a step's reservations are usually contiguous in the ring)."""
    out: list[tuple[int, int]] = []
    for offset, n in spans:
        if out and out[-1][0] + out[-1][1] == offset:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((offset, n))
    return out


def _bytes_rows(t: torch.Tensor) -> torch.Tensor:
    if t.dim() != 3 or t.stride(-1) != 1:
        raise Unsupported(f"KV rows of shape {tuple(t.shape)}, strides {t.stride()}")
    return t.view(torch.uint8)


def _permuted(dims: list[int], perm: Sequence[int]) -> list[int]:
    return [dims[i] for i in perm]


def reader_for_pool(pool: Any, layout: str) -> KvReader:
    """The reader for SGLang's device pool `pool` (`token_to_kv_pool_allocator.get_kvcache()`)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    page_size = int(pool.page_size)
    if type(pool) is MHATokenToKVPool:
        if getattr(pool, "kv_cache_layout", "nhd") != "nhd":
            raise Unsupported(f"device KV layout {pool.kv_cache_layout!r} (only NHD)")
        if getattr(pool, "k_scale_buffer", None) is not None:
            raise Unsupported("a quantized KV cache with scale buffers")
        if pool.head_dim != pool.v_head_dim:
            raise Unsupported("K and V of different head dims")
        return KvReader(mla=False, buffers=[pool.k_buffer, pool.v_buffer], layout=layout, page_size=page_size)
    if type(pool) is MLATokenToKVPool:
        if getattr(pool, "layer_shard_enabled", False):
            raise Unsupported("a layer-sharded MLA cache")
        if getattr(pool, "kv_scale_buffer", None) is not None:
            raise Unsupported("a quantized MLA cache with scale buffers")
        return KvReader(mla=True, buffers=[pool.kv_buffer], layout=layout, page_size=page_size)
    raise Unsupported(f"KV pool {type(pool).__name__} (only MHATokenToKVPool, MLATokenToKVPool)")


# -- the scheduler-side plugin --------------------------------------------------------------------
class Checkpointer:
    """One scheduler rank's decode-time checkpointing: what the hook runs after every decode step.

    Duck-typed on SGLang's objects (a batch with `reqs`; requests with `rid`, `kv_hints`,
    `origin_input_ids`, `output_ids`, `kv.req_pool_idx`, `kv.kv_committed_len`, `finished()`,
    `finished_reason`, `is_retracted`, `extra_key`, `cache_salt`), so it runs on stand-ins in tests.
    """

    def __init__(
        self,
        reader: KvReader,
        req_to_token: torch.Tensor,
        *,
        options: PluginOptions,
        write_to: Sequence[int] = (0,),
        writes: bool = True,
        abort_cls: type = type(None),
        keyring: Keyring | None = None,
    ) -> None:
        """`keyring`: the KV plane's keys to send under; None: the plane file's (production)."""
        if options.staging_bytes < reader.page_bytes:
            raise Unsupported(
                f"staging_bytes {options.staging_bytes} is less than one page ({reader.page_bytes})"
            )
        self.reader, self.writes = reader, writes
        self._abort_cls = abort_cls
        self._rows = req_to_token
        self.staging = Staging(options.staging_bytes)
        # the staging ring: host memory the device→host copies land in (pinned once, at start, on a GPU)
        self._ring = torch.empty(
            options.staging_bytes if writes else 0, dtype=torch.uint8, pin_memory=reader.device.type == "cuda"
        )
        self._ring_view: memoryview = self._ring.numpy().data
        self.planner = Planner(
            page_size=reader.page_size,
            page_bytes=reader.page_bytes,
            options=options,
            staging=self.staging,
            write_to=write_to,
        )
        self.shipper = Shipper(
            options, self.staging, keyring=keyring if keyring is not None else FileKeyring()
        )
        if writes:
            reader.warm_up(self._ring)
        self._reqs: dict[Any, weakref.ref[Any]] = {}
        self._ignored: set[Any] = set()  # requests with hints that are not Lumen's
        self._steps = 0

    def close(self) -> None:
        self.shipper.close()

    def _outcome(self, req: Any) -> Outcome:
        if not req.finished():
            return Outcome.RUNNING
        return Outcome.ABORTED if isinstance(req.finished_reason, self._abort_cls) else Outcome.FINISHED

    def _read_hints(self, req: Any) -> Any:
        try:
            ckpt = parse_kv_hints(msgspec.to_builtins(req.kv_hints))
        except (ValueError, TypeError) as exc:
            log.warning("lumen_kv_hints_refused", rid=req.rid, error=str(exc)[:300])
            return None
        return ckpt

    def after_decode(self, batch: Any) -> None:
        if not self.writes:
            return
        planner = self.planner
        for rid, endpoint in self.shipper.given_up():
            planner.holder_given_up(rid, endpoint)
        steps: list[ReqStep] = []
        live: dict[Any, Any] = {}
        for req in batch.reqs:
            key = req.rid
            tracked = planner.is_tracked(key)
            if not tracked and (req.kv_hints is None or key in self._ignored):
                if key in self._ignored and req.finished():
                    self._ignored.discard(key)
                continue
            outcome = self._outcome(req)
            if outcome is not Outcome.RUNNING:
                if tracked:
                    steps.append(ReqStep(key, None, None, 0, outcome))
                    self._reqs.pop(key, None)
                continue
            if req.is_retracted or req.kv.req_pool_idx is None:
                continue  # no KV on the device now; it comes back after its re-prefill
            ckpt, seed = None, None
            if not tracked:
                ckpt = self._read_hints(req)
                if ckpt is None:
                    if len(self._ignored) >= MAX_IGNORED:
                        self._ignored.clear()
                    self._ignored.add(key)
                    continue
                seed = namespace_seed(req.extra_key, req.cache_salt)
                self._reqs[key] = weakref.ref(req)
            complete = complete_pages(
                len(req.origin_input_ids),
                len(req.output_ids),
                int(req.kv.kv_committed_len),
                planner.page_size,
            )
            steps.append(ReqStep(key, ckpt, seed, complete))
            live[key] = req
        self._steps += 1
        if self._steps % SWEEP_EVERY == 0:
            steps.extend(self._sweep(live))
        plan = planner.step(steps, self.shipper.congested())
        for ctl in plan.controls:
            self.shipper.submit(ctl)
        if plan.copies:
            self._stage(plan.copies, live)

    def _sweep(self, live: dict[Any, Any]) -> list[ReqStep]:
        """Tracked requests not in this batch that ended elsewhere (e.g. in a mixed prefill batch)."""
        out: list[ReqStep] = []
        for key in self.planner.tracked():
            if key in live:
                continue
            ref = self._reqs.get(key)
            req = ref() if ref is not None else None
            if req is None:
                self.planner.forget(key)
                self._reqs.pop(key, None)
            elif req.finished():
                out.append(ReqStep(key, None, None, 0, self._outcome(req)))
                self._reqs.pop(key, None)
        return out

    def _stage(self, copies: Sequence[Copy], live: dict[Any, Any]) -> None:
        try:
            slots = torch.cat(
                [self._rows[live[c.key].kv.req_pool_idx, c.start_token : c.end_token] for c in copies]
            )
            ready = self.reader.copy_to(slots, self._ring, [(c.offset, c.nbytes) for c in copies])
        except Exception:
            log.exception("lumen_kv_copy_failed", pages=sum(c.n_pages for c in copies))
            for c in copies:
                self.staging.release(c.offset)
            for ctl in self.planner.abandon([c.key for c in copies]):
                self.shipper.submit(ctl)
            return
        runs: list[PageRun] = []
        for c in copies:
            req = live[c.key]
            ids = token_slice(req.origin_input_ids, req.output_ids, c.start_token, c.end_token)
            prefix = (
                token_slice(req.origin_input_ids, req.output_ids, 0, c.start_token)
                if c.starts_chain and c.first_page
                else None
            )
            runs.append(PageRun(c, ids, prefix, c.offset))
        self.shipper.submit(
            ShipJob(
                runs,
                ready,
                self._data,
                dtype=self.reader.dtype,
                shape=list(self.reader.page_shape),
            )
        )

    def _data(self) -> memoryview:
        return self._ring_view


def build(processor: Any) -> Checkpointer:
    """The checkpointer of this scheduler rank, from SGLang's result processor and runtime context."""
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled
    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    from sglang.srt.runtime_context import get_memory, get_parallel

    options = options_from_env(os.environ)
    parallel = get_parallel()
    if is_dp_attention_enabled():
        tp_rank, tp_size = int(parallel.attn_tp_rank), int(parallel.attn_tp_size)
    else:
        tp_rank, tp_size = int(parallel.tp_rank), int(parallel.tp_size)
    if int(parallel.attn_cp_size) > 1 or int(getattr(parallel, "attn_dcp_size", 1)) > 1:
        raise Unsupported("context parallelism")
    pool = processor.token_to_kv_pool_allocator.get_kvcache()
    reader = reader_for_pool(pool, str(get_memory().hicache_mem_layout))
    shards = shard_layout(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=int(parallel.pp_rank),
        pp_size=int(parallel.pp_size),
        rank_replicated=reader.mla,
    )
    ckpt = Checkpointer(
        reader,
        processor.req_to_token_pool.req_to_token,
        options=options,
        write_to=shards.write_to,
        # a rank-replicated (MLA) cache is the same on every TP rank: rank 0 writes it to all of them
        writes=not reader.mla or tp_rank == 0,
        abort_cls=FINISH_ABORT,
    )
    atexit.register(ckpt.close)
    log.info(
        "lumen_plugin_started",
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=int(parallel.pp_rank),
        layout=reader.layout,
        page_size=reader.page_size,
        page_bytes=reader.page_bytes,
        writes=ckpt.writes,
    )
    return ckpt


# -- the hook -------------------------------------------------------------------------------------
class _State:
    def __init__(self) -> None:
        self.plugin: Checkpointer | None = None
        self.off: str | None = None  # why the plugin is off in this process
        self.errors = 0
        self.lock = threading.Lock()

    def get(self, processor: Any) -> Checkpointer | None:
        if self.plugin is not None or self.off is not None:
            return self.plugin
        with self.lock:
            if self.plugin is None and self.off is None:
                try:
                    self.plugin = build(processor)
                except Unsupported as exc:
                    self.off = str(exc)
                    log.warning("lumen_plugin_off", reason=self.off)
                except Exception as exc:  # a runtime context or pool this plugin does not know
                    self.off = f"start failed: {exc!r}"[:300]
                    log.exception("lumen_plugin_off", reason=self.off)
        return self.plugin


_state = _State()


def after_decode_result(ret: Any, processor: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook of `process_batch_result_decode(self, batch, result)`: returns None (SGLang keeps the
    original result). Never raises into SGLang: an error is logged, and after a few the plugin stops."""
    if _state.off is not None:
        return None
    try:
        plugin = _state.get(processor)
        if plugin is not None:
            plugin.after_decode(batch)
    except Exception:
        _state.errors += 1
        log.exception("lumen_plugin_hook_failed", errors=_state.errors)
        if _state.errors >= MAX_HOOK_ERRORS:
            _state.off = "too many errors"
            log.error("lumen_plugin_off", reason=_state.off)
    return None
