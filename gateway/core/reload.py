"""Seeded fast reload (issue 14): which survivor a restarting server loads its weights from.

A restarting SGLang server can load its full weights from a running server of the same model and
tensor parallelism (`--load-format remote_instance`: each TP rank receives its shard from the seed's
matching rank over NCCL or a transfer engine) instead of from its own storage. The gateway picks the
seed when it launches the restart (the seed's address is a launch argument):

- Eligible: HEALTHY (serving) workers other than the restarting one, not already sending to another
  restart (`busy`: SGLang's seed serves one destination at a time), and, when `deployment` is given,
  with the restarting worker's deployment key (model and TP; a worker without a key never qualifies).
- The least loaded by the recovery-load estimate `L̂` (the `LoadParams` given), ties by id: sending
  weights slows the seed a little, and the least loaded has the most room for it.
- None qualifies: None, and the restart loads from its own storage (the `disk` fallback).

`draft_first` is the progressive-recovery rule a restart follows once its sources are known: a draft
model is worth loading first only if it is ready before the full model would be. `DraftFirst` is such
a restart's timeline, the same in the simulator and Lumen's worker (`worker_hooks/engine/loading.py`).

Both are pure: the result depends on the view's contents only, not on the order of the view, of
`busy`, or of `deployment`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from gateway.core.costmodel import ReloadSource
from gateway.core.health import WorkerState
from gateway.core.load import load_table
from gateway.core.types import ClusterView, LoadParams, WorkerId


def choose_seed(
    view: ClusterView,
    restarting: WorkerId,
    params: LoadParams,
    busy: Collection[WorkerId] = (),
    deployment: Mapping[WorkerId, str] | None = None,
) -> WorkerId | None:
    """The seed `restarting` loads its weights from, or None (load from disk); see the module doc."""
    want: str | None = None
    if deployment is not None:
        want = deployment.get(restarting)
        if want is None:
            return None  # a restart of unknown deployment cannot be matched with a seed
    workers = view.workers
    for _, wid in load_table(view, params).ranked:  # serving workers by (L̂, id), lowest first
        if wid == restarting or wid in busy or workers[wid].state is not WorkerState.HEALTHY:
            continue
        if deployment is not None and deployment.get(wid) != want:
            continue
        return wid
    return None


def draft_first(draft_ready_s: float, full_ready_s: float) -> bool:
    """Whether a restart loads its draft model first (and drafts until the full model is in): only if
    the draft would be ready before the full model, the rule Lumen's worker follows too
    (`worker_hooks/engine/loading.py`). A full model seeded from a peer usually arrives first."""
    return draft_ready_s < full_ready_s


@dataclass(frozen=True, slots=True)
class DraftFirst:
    """A restart that loads its draft model first, from the storage the full model comes from.

    The draft is ready at `draft_load_s` (its start-up and weights); the full weights follow it, so
    the full model serves `draft_weights_s` later than a plain restart would (`full_load_s`): one
    storage, read once for both, in order. Loading both side by side would not serve the full model
    any sooner (the bytes share the bandwidth) and would make the draft later.
    """

    full_load_s: float  # a plain restart until it serves
    draft_load_s: float  # until the draft model is ready (drafting starts)
    draft_weights_s: float  # the draft's weights alone (no start-up): what the full model waits

    @property
    def serving_s(self) -> float:
        return self.full_load_s + self.draft_weights_s

    @property
    def delay_s(self) -> float:
        """How much later the full model serves than in a plain restart (the gate's `load_delay_s`)."""
        return self.serving_s - self.full_load_s

    @property
    def window_s(self) -> float:
        """How long the drafter drafts before the full model serves (the gate's `assist_window_s`)."""
        return max(0.0, self.serving_s - self.draft_load_s)


# a seeded reload whose seed was lost mid-way: the rest of the weights came from storage (the
# `reload_source` both shells report)
SEED_LOST_SOURCE = f"{ReloadSource.PEER.value}>{ReloadSource.DISK.value}"


def seeded_draft_first_serving_s(draft_load_s: float, peer_weights_s: float, peer_load_s: float) -> float:
    """When a restart that loads its draft first (from storage) and then its full weights from a seed
    serves: the transfer after the draft is ready, and never sooner than a plain seeded restart
    (`peer_load_s`, start-up included) would. With the cost model's times the first term is the
    larger (a draft's load pays the engine start-up too); the bound keeps load times given by hand
    (a short `draft_load_s`) from making a draft-first restart serve before a plain one."""
    return max(draft_load_s + peer_weights_s, peer_load_s)
