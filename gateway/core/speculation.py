"""Adaptive speculation length for draft assist (DESIGN 4.5).

With per-token acceptance rate a and k drafted tokens, a target step emits on average
`(1 − a^{k+1}) / (1 − a)` tokens (the accepted prefix plus the target's own next token), and costs
the verification of k extra tokens per request. `choose_k` picks the k that maximises tokens per
unit of step time; `AcceptanceEstimator` tracks a from verification rounds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from gateway.core.costmodel import CostModel
from gateway.core.types import WorkerView, check

# step time with k extra verified tokens per request, relative to (or in the same unit as) k = 0
CostOfK = Callable[[int], float]


def expected_tokens_per_step(a: float, k: int) -> float:
    """Mean tokens one target step emits for a request with k drafts at acceptance rate a."""
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"acceptance rate must be in [0, 1], got {a}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if a == 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def choose_k(a: float, k_min: int, k_max: int, cost: CostOfK | float) -> int:
    """The k in [k_min, k_max] with the most expected tokens per unit of step time; ties: smaller k.

    `cost` is either a function k → step time (any unit, > 0) or the extra cost of one drafted token
    per request as a fraction of the plain step, i.e. cost(k) = 1 + cost·k.
    """
    if not 0 <= k_min <= k_max:
        raise ValueError(f"need 0 <= k_min <= k_max, got {k_min}, {k_max}")
    if callable(cost):
        cost_of = cost
    else:
        ratio = float(cost)
        if not (ratio >= 0 and math.isfinite(ratio)):
            raise ValueError(f"the per-token cost ratio must be a finite number >= 0, got {ratio}")

        def cost_of(k: int) -> float:
            return 1.0 + ratio * k

    best_k, best = k_min, -math.inf
    for k in range(k_min, k_max + 1):
        c = cost_of(k)
        if not (c > 0 and math.isfinite(c)):
            raise ValueError(f"the cost of k={k} must be a finite number > 0, got {c}")
        value = expected_tokens_per_step(a, k) / c
        if value > best:  # strict: a tie keeps the smaller k
            best_k, best = k, value
    return best_k


@dataclass(frozen=True, slots=True)
class AcceptanceEstimator:
    """Exponentially weighted estimate of the per-token acceptance rate a.

    A round that proposed k drafts and accepted the first n of them tested n + 1 tokens when n < k
    (n agreements, then one disagreement) and k tokens when n = k. The estimate is the ratio of the
    EWMAs of agreements and tested tokens, so rounds with more drafts weigh more and the first round
    is not biased towards the prior.
    """

    prior: float = 0.7
    weight: float = 0.1  # weight of the newest round
    accepted: float = 0.0
    tested: float = 0.0
    rounds: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.prior <= 1.0:
            raise ValueError(f"prior must be in [0, 1], got {self.prior}")
        if not 0.0 < self.weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got {self.weight}")

    @property
    def rate(self) -> float:
        return self.prior if self.tested <= 0 else self.accepted / self.tested

    def update(self, accepted: int, proposed: int) -> AcceptanceEstimator:
        """The estimate after one round; a round with no drafts carries no information."""
        if not 0 <= accepted <= proposed:
            raise ValueError(f"need 0 <= accepted <= proposed, got {accepted}, {proposed}")
        if proposed == 0:
            return self
        tested = accepted + 1 if accepted < proposed else proposed
        w = self.weight
        return AcceptanceEstimator(
            prior=self.prior,
            weight=w,
            accepted=(1 - w) * self.accepted + w * accepted,
            tested=(1 - w) * self.tested + w * tested,
            rounds=self.rounds + 1,
        )


# -- when draft assist pays (issue 17) ----------------------------------------------------------------

# a target is paired only when drafting raises its decode throughput by at least this factor
ASSIST_MIN_GAIN = 1.1
# ... and it is overloaded: at least this many requests waiting for a batch slot
ASSIST_MIN_WAITING = 1
# mean context assumed for a target that reports no KV in use
DEFAULT_CONTEXT = 1000.0


@dataclass(frozen=True, slots=True)
class AssistGate:
    """The cost model of draft assist on one target (DESIGN 4.5, issue 17).

    A drafted step verifies k drafts per request (`target.batch_step_time` with b·k more tokens) and,
    with `drafter` set, first waits for the drafter's k decode steps over the same batch (the drafter
    drafts for every request of the target's batch at once). Its throughput relative to a plain step is
    `expected_tokens_per_step(a, k) · t_plain / t_drafted`. `drafter` None models free drafts (the
    optimistic model the simulator used before issue 17).
    """

    target: CostModel
    drafter: CostModel | None = None
    agreement: float = 0.7
    k_min: int = 1
    k_max: int = 8
    min_gain: float = ASSIST_MIN_GAIN
    min_waiting: int = ASSIST_MIN_WAITING
    # the target's batch limit: a request counts as waiting only beyond a full batch (0: any queue)
    nominal_batch: int = 0

    def __post_init__(self) -> None:
        check(0.0 <= self.agreement <= 1.0, "agreement", self.agreement, "must be in [0, 1]")
        check(0 <= self.k_min <= self.k_max, "k_min", self.k_min, "need 0 <= k_min <= k_max")
        check_gate_bounds(self.min_gain, self.min_waiting)
        check(self.nominal_batch >= 0, "nominal_batch", self.nominal_batch, "must be >= 0")


def check_gate_bounds(min_gain: float, min_waiting: int) -> None:
    """The bounds of the gate's two knobs (raises `ParamError` naming the field)."""
    ok = min_gain >= 0 and math.isfinite(min_gain)
    check(ok, "min_gain", min_gain, "must be a finite number >= 0")
    check(min_waiting >= 0, "min_waiting", min_waiting, "must be >= 0")


def assist_gain(gate: AssistGate, batch: int, context: float) -> tuple[int, float]:
    """The best k for a target decoding `batch` requests of mean context `context`, and the
    throughput of drafted steps at that k relative to plain steps (> 1: drafting is faster)."""
    b = max(1, batch)
    ctx = max(1.0, context)
    plain = gate.target.batch_step_time(b, ctx)
    draft_s = gate.drafter.batch_step_time(b, ctx) if gate.drafter is not None else 0.0

    def step(k: int) -> float:
        return gate.target.batch_step_time(b, ctx, b * k) + k * draft_s

    k = choose_k(gate.agreement, gate.k_min, gate.k_max, step)
    return k, expected_tokens_per_step(gate.agreement, k) * plain / step(k)


def overloaded(gate: AssistGate, w: WorkerView) -> bool:
    """`w` has at least `min_waiting` requests queued beyond a full batch (a momentary queue of a
    request about to be admitted into a batch with room is not overload)."""
    queued = w.running + w.waiting - gate.nominal_batch if gate.nominal_batch else w.waiting
    return min(w.waiting, queued) >= gate.min_waiting


def assist_pays(gate: AssistGate, w: WorkerView) -> bool:
    """Draft for `w` only if it is overloaded (`overloaded`) and drafting speeds its batch up by at
    least `min_gain`: an idle target or a large batch gains less than the drafts cost."""
    if gate.min_waiting > 0 and not overloaded(gate, w):
        return False
    ctx = w.kv_tokens_used / w.running if w.running > 0 and w.kv_tokens_used > 0 else DEFAULT_CONTEXT
    return assist_gain(gate, w.running, ctx)[1] >= gate.min_gain
