"""Checkpoint holder placement: Algorithm 1 and the DéjàVu ring it is compared with (DESIGN 6).

A holder receives a request's full KV pages in its host DRAM while the request is served elsewhere.
Eligible holders are HEALTHY, are not the serving worker, and have room in their checkpoint budget
(`ckpt_budget_bytes − ckpt_bytes ≥ need`; a budget of 0 means the worker holds nothing).

Failure domains: the empty string means "not declared". An undeclared domain is never excluded and is
never counted as "different", so clusters that declare no domains behave as if there were none.

Many requests may be assigned between two heartbeats; the shell keeps them balanced by folding each
tentative assignment into its view with `with_assignment` before choosing the next holder.

Cost: candidates are visited in rank order (the view's `LoadTable`, or its ring order, both kept
with the view) and the scan stops at the first that fits, so a choice is O(holders) plus the
candidates skipped, not a sort of the whole cluster.
"""

from __future__ import annotations

import functools
import re
from bisect import bisect_right
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import cast

from gateway.core.load import SERVING, load_table
from gateway.core.modes import PLACEMENTS, Placement
from gateway.core.types import ClusterView, LoadParams, WorkerId, WorkerView, check


@dataclass(frozen=True, slots=True)
class HolderParams:
    load: LoadParams = field(default_factory=LoadParams)
    replicas: int = 1  # 2 survives the serving worker and one holder dying together
    exclude_failure_domain: bool = False
    placement: Placement = Placement.LOAD_AWARE
    # issue 17: stream a request's prompt pages as each prefill chunk writes them, not only once its
    # prefill is done (measured in the simulator: no gain worth its cost, so off; docs/results.md)
    stream_prefill: bool = False

    def __post_init__(self) -> None:
        check(self.replicas in (1, 2), "replicas", self.replicas, "must be 1 or 2")
        check(
            self.placement in PLACEMENTS,
            "placement",
            self.placement,
            f"must be one of {', '.join(PLACEMENTS)}",
        )


@functools.lru_cache(maxsize=4096)
def ring_key(worker: WorkerId) -> tuple[tuple[int, int, str], ...]:
    """Natural id order for the ring ("w2" before "w10"); the raw id, last, breaks ties like "w01"/"w1".

    The end marker sorts first, so an id comes before its extensions ("w" before "w0").
    """
    # re.split with a group puts the digit runs at the odd positions
    parts = re.split(r"(\d+)", worker)
    key = tuple((1, int(p), "") if i % 2 else (0, 0, p) for i, p in enumerate(parts) if p)
    return (*key, (-1, 0, worker))


def can_hold(w: WorkerView, need_bytes: int) -> bool:
    """Whether w may take a checkpoint of `need_bytes` now: HEALTHY and within its budget."""
    if w.state not in SERVING or w.ckpt_budget_bytes <= 0:
        return False
    return w.ckpt_budget_bytes - w.ckpt_bytes >= need_bytes


def _same_domain(a: str, b: str) -> bool:
    return a != "" and a == b


def choose_holders(
    view: ClusterView, serving: WorkerId, need_bytes: int, params: HolderParams
) -> tuple[WorkerId, ...]:
    """Up to `params.replicas` distinct holders for a request served by `serving` (empty: none fits).

    `need_bytes` is what the checkpoint will occupy on each holder. The result does not depend on the
    order of workers in the view.
    """
    return reassign_holders(view, serving, (), need_bytes, params)


def reassign_holders(
    view: ClusterView,
    serving: WorkerId,
    alive_holders: Collection[WorkerId],
    need_bytes: int,
    params: HolderParams,
) -> tuple[WorkerId, ...]:
    """The holders to ADD for a request whose holder(s) died, given those still alive.

    Tops the request up to `params.replicas` holders (nothing when the live ones already suffice);
    the new ones are chosen as in `choose_holders`, never among `alive_holders`, and in a different
    failure domain from them when possible. A new holder starts the checkpoint from scratch, so
    `need_bytes` is the request's whole current KV size.
    """
    if need_bytes < 0:
        raise ValueError(f"need_bytes must be >= 0, got {need_bytes}")
    # (no set to make for no live holder: the common case, a new request's `choose_holders`)
    count = params.replicas - len(set(alive_holders)) if alive_holders else params.replicas
    if count <= 0:
        return ()
    workers = view.workers
    server = workers.get(serving)
    banned_domain = server.failure_domain if server is not None and params.exclude_failure_domain else ""
    # candidates in preference order, as (rank key, id): by (L̂, id), or around the ring from just
    # after `serving`; eligibility is tested as the scan reaches them
    order: Sequence[tuple[object, WorkerId]]
    if params.placement == "ring":
        ring = _ring(view).entries
        # ring keys are unique (they end with the raw id): those after `serving`'s, then the rest
        start = bisect_right(ring, (ring_key(serving), serving))
        order = ring[start:] + ring[:start]
    else:
        order = load_table(view, params.load).ranked
    taken_domains = (
        {workers[h].failure_domain for h in alive_holders if h in workers} if alive_holders else set()
    )
    if count == 1 and not taken_domains:
        # one holder to add and no domain to avoid (the common case, once per request): the scan
        # below then returns the first eligible candidate; this is that scan without its books
        for _, wid in order:
            w = workers[wid]
            # can_hold(w, need_bytes) and not _same_domain(w.failure_domain, banned_domain), inlined
            if (
                wid != serving
                and wid not in alive_holders
                and w.state in SERVING
                and w.ckpt_budget_bytes > 0
                and w.ckpt_budget_bytes - w.ckpt_bytes >= need_bytes
                and (w.failure_domain == "" or w.failure_domain != banned_domain)
            ):
                return (wid,)
        return ()

    n, pos = len(order), 0
    eligible: list[WorkerView] = []  # the eligible candidates the scan has reached, in order
    chosen: list[WorkerId] = []
    domains = set(taken_domains)
    for _ in range(count):
        # the first eligible, unchosen candidate outside every domain used so far, else the first
        # eligible unchosen one (_pick on the whole ranked list, stopping as soon as it is decided)
        first: WorkerView | None = None
        best: WorkerView | None = None
        i = 0
        while True:
            if i < len(eligible):
                w = eligible[i]
            else:
                while pos < n:
                    w = workers[order[pos][1]]
                    pos += 1
                    if (
                        w.id != serving
                        and w.id not in alive_holders
                        and can_hold(w, need_bytes)
                        and not _same_domain(w.failure_domain, banned_domain)
                    ):
                        eligible.append(w)
                        break
                else:
                    break  # no candidate left
            i += 1
            if w.id in chosen:
                continue
            if first is None:
                first = w
            # not any(_same_domain(w.failure_domain, d) for d in domains)
            if w.failure_domain == "" or w.failure_domain not in domains:
                best = w
                break
        best = best or first
        if best is None:
            break
        chosen.append(best.id)
        domains.add(best.failure_domain)
    return tuple(chosen)


class _Ring:
    """Every worker of a view as (ring_key, id), in ring order; kept with the view."""

    __slots__ = ("entries",)

    def __init__(self, ids: Iterable[WorkerId]) -> None:
        self.entries = sorted((ring_key(i), i) for i in ids)

    def derive(self, changes: list[tuple[WorkerView | None, WorkerView]]) -> _Ring | None:
        # the order depends on the ids only: unchanged unless a worker was added
        return self if self.update(changes) else None

    def update(self, changes: list[tuple[WorkerView | None, WorkerView]]) -> bool:
        return all(old is not None for old, _ in changes)


_RING = "holders.ring"


def _ring(view: ClusterView) -> _Ring:
    ring = view.derived.get(_RING)
    if ring is None:
        ring = view.derived[_RING] = _Ring([w.id for w in view.workers.values()])
    return cast(_Ring, ring)


def with_assignment(view: ClusterView, holder: WorkerId, tokens: int, nbytes: int) -> ClusterView:
    """`view` with a tentative checkpoint of `tokens`/`nbytes` added to `holder`'s store.

    Negative amounts undo an assignment (a drop). The view is not changed; a new one is returned
    (through `ClusterView.with_workers`, which keeps the view's derived tables up to date).
    """
    w = view.workers.get(holder)
    if w is None:
        raise ValueError(f"holder {holder!r} is not in the view")
    ckpt_tokens, ckpt_bytes = w.ckpt_tokens + tokens, w.ckpt_bytes + nbytes
    if ckpt_tokens < 0 or ckpt_bytes < 0:
        raise ValueError(
            f"holder {holder!r} would hold {ckpt_tokens} tokens / {ckpt_bytes} bytes (< 0) "
            f"after adding {tokens} tokens / {nbytes} bytes"
        )
    return view.with_workers((w.with_checkpoints(ckpt_tokens, ckpt_bytes),))
