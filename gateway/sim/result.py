"""What one simulated run produced: the client-side records, time series, and recovery statistics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gateway.core.evaluation import RecordArrays, RequestRecord
from gateway.sim.request import SimRequest
from gateway.sim.scenario import FailureSpec

# one sample: (time, running + waiting per worker, checkpoint tokens held per worker)
Sample = tuple[float, list[int], list[int]]


@dataclass(frozen=True, slots=True)
class Reload:
    """One restart's reload, on the recovery timeline (simulated seconds)."""

    worker: str
    incarnation: int  # the new incarnation that loads
    started_s: float  # the restart began (the failure was detected)
    # "disk", "peer", or "peer>disk" (the seed was lost before or during the transfer: the rest of
    # the weights came from disk)
    source: str
    seed: str | None  # the survivor the weights came (or were to come) from
    draft_first: bool  # loaded its draft model first (progressive recovery) and drafted meanwhile
    draft_ready_s: float | None  # when it became DRAFT_READY (absolute)
    serving_s: float | None  # when the full model served (absolute); None: killed while loading
    transfer_s: float  # seconds the seed streamed weights (0 from disk)

    @property
    def reload_s(self) -> float | None:
        """Restart to serving with the full model."""
        return None if self.serving_s is None else self.serving_s - self.started_s


@dataclass(frozen=True, slots=True)
class BoostJudgement:
    """The outage boost as judged when a recovery began or more workers went out (core/outage.py):
    the factor the cluster's lost slots call for, the gain the cost model gives it for the load's
    shape then (None: no gate), and whether it was granted."""

    at_s: float
    factor: float
    gain: float | None
    granted: bool


@dataclass(frozen=True, slots=True)
class RunStats:
    restores: int
    replays: int
    restored_tokens: int
    coverage: float | None  # killed workers' running requests with a live checkpoint
    holder_balance: float | None  # max/min checkpoint tokens over HEALTHY workers at the first kill
    acceptance_rate: float | None  # draft assist: the draft model's per-token acceptance (if used)
    draft_k_mean: float | None
    pairings: int
    events: int
    degradations: int = 0  # gray-failure verdicts (workers marked DEGRADED)
    reloads: tuple[Reload, ...] = ()  # every restart's reload, in the order they began
    boosts: tuple[BoostJudgement, ...] = ()  # Lumen's modes: every judgement of the outage boost


@dataclass(frozen=True, slots=True)
class RunResult:
    """A run's outputs. Its client-side records are kept as columns (`arrays`: what the summaries read,
    and what a worker process sends back, ~100x faster to pickle than the records one by one);
    `records` gives them as `RequestRecord`s, made from the columns when first asked for in a process
    that received the run (the same records: `RecordArrays.records`)."""

    arrays: RecordArrays
    failure_at: float | None
    simulated_s: float
    worker_ids: tuple[str, ...]
    sample_times: np.ndarray  # (T,)
    queue: np.ndarray  # (T, N) requests running + waiting per worker
    ckpt_tokens: np.ndarray  # (T, N) checkpoint tokens each worker holds for others
    stats: RunStats
    cached_records: tuple[RequestRecord, ...] | None = field(default=None, repr=False, compare=False)

    @property
    def records(self) -> tuple[RequestRecord, ...]:
        if self.cached_records is None:
            object.__setattr__(self, "cached_records", self.arrays.records())
        assert self.cached_records is not None
        return self.cached_records

    def __reduce__(self) -> tuple[Any, ...]:
        # pickled without the records (the columns hold them)
        return (
            RunResult,
            (
                self.arrays,
                self.failure_at,
                self.simulated_s,
                self.worker_ids,
                self.sample_times,
                self.queue,
                self.ckpt_tokens,
                self.stats,
            ),
        )

    @staticmethod
    def collect(
        requests: Sequence[SimRequest],
        failures: Sequence[FailureSpec],
        end: float,
        worker_ids: Sequence[str],
        samples: Sequence[Sample],
        stats: RunStats,
    ) -> RunResult:
        n = len(worker_ids)
        records = tuple(r.record() for r in requests)
        return RunResult(
            arrays=RecordArrays.of(records),
            failure_at=min((f.at_s for f in failures), default=None),
            simulated_s=end,
            worker_ids=tuple(worker_ids),
            sample_times=np.array([s[0] for s in samples]),
            queue=np.array([s[1] for s in samples], dtype=np.int64).reshape(len(samples), n),
            ckpt_tokens=np.array([s[2] for s in samples], dtype=np.int64).reshape(len(samples), n),
            stats=stats,
            cached_records=records,
        )
