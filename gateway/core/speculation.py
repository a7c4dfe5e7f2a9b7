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
