"""Small next-token distributions over a few token ids: the synthetic model's K candidates.

`Dist` is sparse: ids not listed have probability 0. `target_dist` is the distribution the synthetic
model's `next_token` samples from (the same temperature, top-k and top-p rules over the same candidates,
with candidates that share an id merged), so speculative rejection sampling can be checked against it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from models.synthetic import Sampler, SyntheticModel

# a residual with less total mass than this is the numerical remains of p == q
_RESIDUAL_EPS = 1e-12


@dataclass(frozen=True, slots=True)
class Dist:
    """`probs[i]` is the probability of `tokens[i]`; ids are distinct and the probabilities sum to 1."""

    tokens: tuple[int, ...]
    probs: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.probs) or not self.tokens:
            raise ValueError(f"a distribution needs as many probs as ids, got {self.tokens}, {self.probs}")
        if len(set(self.tokens)) != len(self.tokens):
            raise ValueError(f"repeated ids in a distribution: {self.tokens}")
        if any(p < 0.0 or math.isnan(p) for p in self.probs):
            raise ValueError(f"negative or NaN probability: {self.probs}")
        total = math.fsum(self.probs)
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"probabilities sum to {total}, not 1")

    @staticmethod
    def point(token: int) -> Dist:
        return Dist((token,), (1.0,))

    @staticmethod
    def from_weights(pairs: Sequence[tuple[int, float]]) -> Dist:
        """Normalise (id, weight) pairs, summing the weights of repeated ids (first occurrence order)."""
        merged: dict[int, float] = {}
        for token, w in pairs:
            merged[token] = merged.get(token, 0.0) + w
        total = math.fsum(merged.values())
        if not total > 0.0:
            raise ValueError(f"weights sum to {total}; need a positive total")
        return Dist(tuple(merged), tuple(w / total for w in merged.values()))

    def prob(self, token: int) -> float:
        for t, p in zip(self.tokens, self.probs, strict=True):
            if t == token:
                return p
        return 0.0

    def sample(self, u: float) -> int:
        """Invert the CDF (in listed order) at `u` in [0, 1)."""
        acc = 0.0
        for t, p in zip(self.tokens, self.probs, strict=True):
            acc += p
            if u < acc:
                return t
        # u within rounding of 1: the last id with mass
        for t, p in zip(reversed(self.tokens), reversed(self.probs), strict=True):
            if p > 0.0:
                return t
        return self.tokens[-1]


def residual(p: Dist, q: Dist) -> Dist:
    """norm(max(0, p - q)): what a rejected draft is replaced from. Falls back to p when p == q."""
    pairs = [(t, max(0.0, pt - q.prob(t))) for t, pt in zip(p.tokens, p.probs, strict=True)]
    if math.fsum(w for _, w in pairs) <= _RESIDUAL_EPS:
        return p
    return Dist.from_weights([(t, w) for t, w in pairs if w > 0.0])


def mix(p: Dist, token: int, weight: float) -> Dist:
    """(1 - weight)·p + weight·δ_token."""
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"mix weight must be in [0, 1], got {weight}")
    pairs = [(t, (1.0 - weight) * pt) for t, pt in zip(p.tokens, p.probs, strict=True)]
    pairs.append((token, weight))
    return Dist.from_weights([(t, w) for t, w in pairs if w > 0.0])


def target_dist(model: SyntheticModel, h: int, sampler: Sampler) -> Dist:
    """The distribution `model.next_token(h, position, sampler)` draws from (the same for every position)."""
    cands = model.candidates(h)
    if sampler.greedy:
        best = cands[0]
        for c in cands:
            if c[0] > best[0]:
                best = c
        return Dist.point(best[1])
    # the same stable order, truncation and weights as next_token
    cands.sort(key=lambda c: c[0], reverse=True)
    if sampler.top_k:
        cands = cands[: sampler.top_k]
    top = cands[0][0]
    weights = [math.exp((logit - top) / sampler.temperature) for logit, _ in cands]
    if sampler.top_p < 1.0:
        keep, mass, bound = 0, 0.0, sampler.top_p * sum(weights)
        while keep < len(weights) and (keep == 0 or mass < bound):
            mass += weights[keep]
            keep += 1
        weights = weights[:keep]
    return Dist.from_weights([(token, w) for w, (_, token) in zip(weights, cands, strict=False)])
