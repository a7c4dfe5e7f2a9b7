"""What Lumen's SGLang plugin decides each decode step, without SGLang or torch (DESIGN 4.4, §10).

The plugin (`plugin.py`) runs inside SGLang's scheduler process and, after every decode step's result
processing, hands this module one `ReqStep` per running request: its checkpoint instruction (the
gateway's `kv_hints`, parsed by `gateway.protocol.sglang.parse_kv_hints`) and its lengths. `Planner`
answers with the page runs to copy out of the GPU pool now (`Copy`) and the KV-plane controls to send
(`Control`: END, DROP). Everything here is deterministic and single-threaded except `Staging`, the ring
of host memory the scheduler thread fills and the shipper thread empties.

Rules (each one tested in tests/unit/test_sglang_plugin_logic.py):

- only computed KV is checkpointed: a request's KV exists for every token but the last one emitted (its
  KV is computed by the next step), and never beyond what SGLang has committed (`kv_committed_len`), so
  `complete_pages` = ⌊min(prompt + output − 1, committed) / page_size⌋;
- every page from the hint's `first_page` on is handed off exactly once, in order, in runs of
  consecutive pages; a step copies at most `step_bytes` (always at least one page, so a page larger than
  the budget still goes), round-robin over the requests with pages waiting, so one long prompt's pages
  spread over several steps instead of stalling one;
- no hints (or no holders, or another page size than the server's) = no checkpoint;
- finish: END once (after the pages handed off so far); abort: nothing (the holders keep the pages, the
  gateway may restore from them); neither sends anything for the request afterwards;
- never waiting: copies go to `Staging`, a ring of host memory the shipper empties; when it has no
  room the step copies less (the pages wait for a later step), and no pages are copied for a request
  all of whose holders have half their lag bound on the way (`congested`), so the checkpoint goes as
  fast as the holders take it;
- abandonment instead of waiting: a request whose complete-but-uncopied pages pass
  `max_backlog_bytes` (its checkpoint lags its KV too far) is abandoned, a DROP frees what its holders
  got; a holder whose KV-plane queue passes `max_lag_bytes` is given up for that request by the sender
  (which queues the DROP itself), and once every holder of a request is given up the request is
  abandoned too. An abandoned request copies nothing more.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Hashable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Final

import msgspec

from gateway.protocol.pagekeys import page_keys
from gateway.protocol.sglang import LumenCheckpoint
from worker_hooks.sglang.staging import Staging
from worker_hooks.sglang.storage_layout import shard_endpoint

ENV_OPTIONS: Final = "LUMEN_SGLANG_PLUGIN"


class PluginOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Tuning, from the JSON object in the environment variable `LUMEN_SGLANG_PLUGIN` (all optional)."""

    # KV bytes copied out of the GPU pool per decode step, at most (at least one page always goes)
    step_bytes: int = 32 << 20
    # pinned host memory (a ring) holding copies until the KV plane takes them; full: copy later
    staging_bytes: int = 256 << 20
    # complete pages of one request not copied yet, at most: beyond it the request is abandoned
    max_backlog_bytes: int = 4 << 30
    max_lag_bytes: int = 256 << 20  # per holder, in the KV plane's sender: beyond it, abandoned there
    frame_bytes: int = 1 << 20
    drain_timeout_s: float = 0.5  # at exit, how long queued pages may still go out
    # seeded reload: the longest a weight-transfer group's set-up may wait for its peer (plugin_seed.py)
    seed_group_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        sizes = (
            self.step_bytes,
            self.staging_bytes,
            self.max_backlog_bytes,
            self.max_lag_bytes,
            self.frame_bytes,
        )
        if min(sizes) < 1:
            raise ValueError(
                "step_bytes, staging_bytes, max_backlog_bytes, max_lag_bytes and frame_bytes must be >= 1"
            )
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must be >= 0")
        if self.seed_group_timeout_s <= 0:
            raise ValueError("seed_group_timeout_s must be > 0")


def options_from_env(env: Mapping[str, str]) -> PluginOptions:
    raw = env.get(ENV_OPTIONS, "").strip()
    if not raw:
        return PluginOptions()
    try:
        return msgspec.convert(json.loads(raw), PluginOptions)
    except (ValueError, msgspec.ValidationError) as exc:
        raise ValueError(f"{ENV_OPTIONS}: {exc}") from exc


# -- lengths ----------------------------------------------------------------------------------------
def kv_tokens(prompt_len: int, output_len: int, committed: int) -> int:
    """Tokens of a running request whose KV exists: all but the last emitted one, and no more than
    SGLang committed (a speculative step's rejected drafts are allocated, never committed)."""
    return max(0, min(prompt_len + output_len - 1, committed))


def complete_pages(prompt_len: int, output_len: int, committed: int, page_size: int) -> int:
    return kv_tokens(prompt_len, output_len, committed) // page_size


def token_slice(prompt: Sequence[int], output: Sequence[int], start: int, end: int) -> list[int]:
    """Ids [start, end) of prompt + output, without building the whole sequence."""
    n = len(prompt)
    if end <= n:
        return [int(t) for t in prompt[start:end]]
    head = [int(t) for t in prompt[start:n]] if start < n else []
    return head + [int(t) for t in output[max(0, start - n) : end - n]]


def parent_key(prefix_ids: Sequence[int], page_size: int, seed: str | None) -> str | None:
    """The key a run starting at page len(prefix_ids) // page_size chains to: the namespace seed for
    page 0 (None without one), else the key of the page before it."""
    if not prefix_ids:
        return seed
    return page_keys(prefix_ids, page_size, seed)[-1]


def holder_endpoints(ckpt: LumenCheckpoint, write_to: Sequence[int]) -> tuple[str, ...]:
    """This rank's endpoints at the request's holders: shard s of each holder for s in `write_to`
    (`storage_layout.shard_layout`); a malformed endpoint is left out."""
    out: list[str] = []
    for holder in ckpt.holders:
        for shard in write_to:
            try:
                out.append(shard_endpoint(holder.kv_endpoint, shard))
            except ValueError:
                continue
    return tuple(dict.fromkeys(out))


# -- planning -------------------------------------------------------------------------------------
class Outcome(enum.Enum):
    RUNNING = "running"
    FINISHED = "finished"  # a normal finish: END
    ABORTED = "aborted"  # nothing: the gateway may restore from what the holders have


@dataclass(frozen=True, slots=True)
class ReqStep:
    """One request as the plugin read it after a decode step."""

    key: Hashable  # SGLang's rid
    ckpt: LumenCheckpoint | None  # parsed kv_hints (None: no checkpoint)
    seed: str | None  # the namespace seed of its page-hash chain (`pagekeys.namespace_seed`)
    complete: int  # complete pages (`complete_pages`); ignored unless RUNNING
    outcome: Outcome = Outcome.RUNNING


@dataclass(frozen=True, slots=True)
class Copy:
    """Copy pages [first_page, first_page + n_pages) of a request out now and hand them off."""

    key: Hashable
    rid: str
    src_worker: str
    epoch: int
    endpoints: tuple[str, ...]
    first_page: int
    n_pages: int
    page_size: int
    # the run starts the request's chain on the holders: its parent key is computed from the ids of
    # pages [0, first_page) and `seed` (`parent_key`); later runs continue the chain (parent None)
    starts_chain: bool
    seed: str | None
    nbytes: int
    offset: int  # where in the staging ring its bytes go

    @property
    def start_token(self) -> int:
        return self.first_page * self.page_size

    @property
    def end_token(self) -> int:
        return (self.first_page + self.n_pages) * self.page_size


class ControlKind(enum.Enum):
    END = "END"
    DROP = "DROP"


@dataclass(frozen=True, slots=True)
class Control:
    kind: ControlKind
    rid: str
    src_worker: str
    epoch: int


@dataclass(slots=True)
class StepPlan:
    copies: list[Copy] = field(default_factory=list)
    controls: list[Control] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class _Track:
    ckpt: LumenCheckpoint
    endpoints: tuple[str, ...]  # not yet given up
    seed: str | None
    next_page: int  # the first page not handed off
    started: bool = False
    abandoned: bool = False


@dataclass(slots=True)
class PlannerStats:
    tracked: int = 0  # requests ever tracked
    pages: int = 0  # pages handed off
    bytes: int = 0
    deferred_steps: int = 0  # steps that left complete pages for later (the step budget)
    ended: int = 0
    aborted: int = 0
    abandoned_backlog: int = 0  # requests abandoned because their uncopied pages passed the bound
    abandoned_holders: int = 0  # requests abandoned because every holder was given up
    refused: int = 0  # hints this server cannot follow (another page size, no usable holder)


class Planner:
    """The per-request checkpoint state of one scheduler rank. Call from the scheduler thread only."""

    def __init__(
        self,
        *,
        page_size: int,
        page_bytes: int,
        options: PluginOptions,
        staging: Staging,
        write_to: Sequence[int] = (0,),
    ) -> None:
        if page_size < 1 or page_bytes < 1:
            raise ValueError("page_size and page_bytes must be >= 1")
        self.page_size, self.page_bytes = page_size, page_bytes
        self.options, self.staging = options, staging
        self.write_to = tuple(write_to)
        self._tracks: dict[Hashable, _Track] = {}
        self._by_rid: dict[str, Hashable] = {}
        self._turn = 0  # round-robin start among requests with pages waiting
        self.stats = PlannerStats()

    def tracked(self) -> list[Hashable]:
        return list(self._tracks)

    def is_tracked(self, key: Hashable) -> bool:
        return key in self._tracks

    def next_page(self, key: Hashable) -> int | None:
        t = self._tracks.get(key)
        return None if t is None else t.next_page

    def _track(self, step: ReqStep) -> _Track | None:
        t = self._tracks.get(step.key)
        if t is not None or step.ckpt is None:
            return t
        ckpt = step.ckpt
        endpoints = holder_endpoints(ckpt, self.write_to)
        if ckpt.page_size != self.page_size or not endpoints or ckpt.rid in self._by_rid:
            self.stats.refused += 1
            # remembered as abandoned, so it is refused once, not every step
            t = _Track(ckpt, (), step.seed, ckpt.first_page, abandoned=True)
        else:
            t = _Track(ckpt, endpoints, step.seed, ckpt.first_page)
            self._by_rid[ckpt.rid] = step.key
            self.stats.tracked += 1
        self._tracks[step.key] = t
        return t

    def step(self, reqs: Iterable[ReqStep], congested: Set[str] = frozenset()) -> StepPlan:
        """This step's copies and controls. Every copy has its staging reserved and its pages count as
        handed off: the caller must copy them out and hand them to the shipper, which releases the
        staging once it has taken the bytes. A request all of whose holders are `congested` (their
        KV-plane queues are long) copies nothing this step."""
        plan = StepPlan()
        waiting: list[tuple[ReqStep, _Track]] = []
        for r in reqs:
            if r.outcome is not Outcome.RUNNING:
                self._close(r.key, r.outcome, plan)
                continue
            t = self._track(r)
            if t is None or t.abandoned:
                continue
            if r.complete > t.next_page:
                waiting.append((r, t))
        if not waiting:
            return plan
        budget = self.options.step_bytes
        start = self._turn % len(waiting)
        self._turn += 1
        order = waiting[start:] + waiting[:start]
        stopped = False
        for i, (r, t) in enumerate(order):
            room = budget // self.page_bytes
            if stopped or (room < 1 and i > 0):
                stopped = True
            elif congested and all(e in congested for e in t.endpoints):
                pass  # its holders are behind: its pages wait
            else:
                n = min(r.complete - t.next_page, max(room, 1))
                offset = None
                while n >= 1:  # fewer pages where the ring has no room for all
                    offset = self.staging.reserve(n * self.page_bytes)
                    if offset is not None:
                        break
                    n //= 2
                if offset is None:
                    stopped = True
                else:
                    self._copy(r, t, n, offset, plan)
                    budget -= n * self.page_bytes
                    stopped = t.next_page < r.complete
            if (r.complete - t.next_page) * self.page_bytes > self.options.max_backlog_bytes:
                self._abandon(r.key, t, plan)
                self.stats.abandoned_backlog += 1
        if any(t.next_page < r.complete and not t.abandoned for r, t in order):
            self.stats.deferred_steps += 1
        return plan

    def _copy(self, r: ReqStep, t: _Track, n: int, offset: int, plan: StepPlan) -> None:
        ckpt = t.ckpt
        nbytes = n * self.page_bytes
        plan.copies.append(
            Copy(
                key=r.key,
                rid=ckpt.rid,
                src_worker=ckpt.src_worker,
                epoch=ckpt.epoch,
                endpoints=t.endpoints,
                first_page=t.next_page,
                n_pages=n,
                page_size=self.page_size,
                starts_chain=not t.started,
                seed=t.seed,
                nbytes=nbytes,
                offset=offset,
            )
        )
        t.next_page += n
        t.started = True
        self.stats.pages += n
        self.stats.bytes += nbytes

    def _close(self, key: Hashable, outcome: Outcome, plan: StepPlan) -> None:
        t = self._tracks.pop(key, None)
        if t is None:
            return
        if self._by_rid.get(t.ckpt.rid) == key:
            del self._by_rid[t.ckpt.rid]
        if t.abandoned:
            return
        if outcome is Outcome.FINISHED:
            c = t.ckpt
            plan.controls.append(Control(ControlKind.END, c.rid, c.src_worker, c.epoch))
            self.stats.ended += 1
        else:
            self.stats.aborted += 1

    def _abandon(self, key: Hashable, t: _Track, plan: StepPlan) -> None:
        t.abandoned = True
        c = t.ckpt
        plan.controls.append(Control(ControlKind.DROP, c.rid, c.src_worker, c.epoch))

    def abandon(self, keys: Iterable[Hashable]) -> list[Control]:
        """Give these requests' checkpoints up (their pages could not be copied): DROPs to send."""
        plan = StepPlan()
        for key in dict.fromkeys(keys):
            t = self._tracks.get(key)
            if t is not None and not t.abandoned:
                self._abandon(key, t, plan)
        return plan.controls

    def forget(self, key: Hashable) -> None:
        """The request is gone without a finish we saw (e.g. the sweep found it released): as abort."""
        self._close(key, Outcome.ABORTED, StepPlan())

    def holder_given_up(self, rid: str, endpoint: str) -> bool:
        """The KV plane gave up `rid` on `endpoint` (its queue passed the lag bound; the sender queued
        the DROP there). True when that was the request's last holder: it is abandoned."""
        key = self._by_rid.get(rid)
        t = self._tracks.get(key) if key is not None else None
        if t is None or t.abandoned:
            return False
        t.endpoints = tuple(e for e in t.endpoints if e != endpoint)
        if t.endpoints:
            return False
        t.abandoned = True
        self.stats.abandoned_holders += 1
        return True
