"""One scheduler rank's decode-time checkpointing (`Checkpointer`): what the plugin's hook runs after
every decode step.

It sees every request of the decode batch once its new tokens are appended and its finish state is set.
Requests whose `kv_hints` carry Lumen's `lumen.checkpoint` action (`gateway.protocol.sglang.kv_hints_for`)
have each newly complete page (KV exists for every token but the last emitted one) copied out of the
GPU pool (`KvReader`, plugin_reader.py) into a ring of pinned host memory (`staging.Staging`,
allocated once) and sent to their holders over Lumen's KV plane; `plugin_logic.Planner` decides which
pages, `plugin_shipper` sends them from a thread of its own. A finished request gets END; an aborted one
nothing (the holders keep its pages for the gateway to restore from).

Never blocking the step: `after_decode` only enqueues GPU work and returns; the scheduler thread never
waits for a copy, a socket or a lock held across I/O. Per step at most `step_bytes` of KV is copied;
pages that find no room in the ring, or whose holders all have half their lag bound on the way
(`Shipper.congested`), wait for a later step; a request whose uncopied pages pass `max_backlog_bytes` is
abandoned with a DROP (the rules: `plugin_logic`). Safety of the slots read: the copy is ordered on the
scheduler's stream, and every later forward waits on that stream (`forward_stream.wait_stream(
schedule_stream)` in `Scheduler.run_batch`), so a slot freed after this step (a finish, a retraction) is
not overwritten before the copy has read it. Starting a checkpointer pins the ring and runs one page's
copy once (`KvReader.warm_up`).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence, Set
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
    complete_pages,
    token_slice,
)
from worker_hooks.sglang.plugin_reader import KvReader, Unsupported
from worker_hooks.sglang.plugin_shipper import Shipper
from worker_hooks.sglang.ship_jobs import PageRun, ShipJob
from worker_hooks.sglang.staging import Staging

log = structlog.get_logger("lumen.sglang.plugin")

SWEEP_EVERY: Final = 16  # steps between sweeps for tracked requests that left the decode batch
MAX_IGNORED: Final = 1 << 16  # rids remembered as carrying hints that are not Lumen's


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
        ended: set[Any] = set()  # tracked requests this step closes (their steps say how)
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
                    ended.add(key)
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
            steps.extend(self._sweep(live.keys() | ended))
        plan = planner.step(steps, self.shipper.congested())
        for ctl in plan.controls:
            self.shipper.submit(ctl)
        if plan.copies:
            self._stage(plan.copies, live)

    def _sweep(self, seen: Set[Any]) -> list[ReqStep]:
        """Tracked requests not `seen` in this batch (running, or ending with a step of their own) that
        ended elsewhere (e.g. in a mixed prefill batch). A request this batch ends is not swept: its
        weak reference is already dropped, and the sweep would close it as gone before its finish
        sends END (found by the real lane: a finish on a sweep step lost its END)."""
        out: list[ReqStep] = []
        for key in self.planner.tracked():
            if key in seen:
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
