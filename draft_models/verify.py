"""Verification of k drafts against the target: pure functions of drafts and target outputs.

Three modes:

- GREEDY: accept the longest prefix of drafts equal to the target's greedy tokens, then append the
  target's own token at the first mismatch (or after the last draft: the bonus). The output is exactly
  what plain greedy decoding produces.
- EXACT_SEEDED (what Lumen uses for sampled requests): the same matching, against the target's own
  seeded samples (token at position p drawn with the uniform of `(seed_base, p)`). The output is token
  for token the non-assisted seeded output, so a replay or a restore on another worker stays exact.
  The price: a draft is accepted only when it equals the target's seeded sample, so acceptance is
  P(draft == seeded sample), below rejection sampling's Σ min(p, q) unless the drafter couples its
  own sampling to the same uniform (the synthetic drafter emulates such a coupled drafter).
- REJECTION: standard speculative rejection sampling. Draft x is accepted with probability
  min(1, p(x)/q(x)); on rejection the token is drawn from norm(max(0, p - q)); when all k are accepted
  the bonus is drawn from p. The output distribution is p at every position, but the tokens are not
  the non-assisted seeded ones. Its uniforms come from `(seed_base, position)` through streams salted
  apart from the target's own sampling uniform, so they are deterministic yet independent of it.

Targets are consumed lazily (any iterable), so a caller may compute them up to the first mismatch.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from draft_models.distribution import Dist, residual
from models.synthetic import GOLDEN, MASK64, Sampler, mix64

_ACCEPT_SALT = 0x5350_4543_4143_4350  # "SPECACCP"
_RESIDUAL_SALT = 0x5350_4543_5245_5344  # "SPECRESD"
_INV_2_64 = 1.0 / 18446744073709551616.0


class VerifyMode(enum.Enum):
    GREEDY = "greedy"
    EXACT_SEEDED = "exact_seeded"
    REJECTION = "rejection"


def mode_for(sampler: Sampler, *, exact_seeded: bool = True) -> VerifyMode:
    if sampler.greedy:
        return VerifyMode.GREEDY
    return VerifyMode.EXACT_SEEDED if exact_seeded else VerifyMode.REJECTION


@dataclass(frozen=True, slots=True)
class Verdict:
    """`tokens` = the accepted drafts followed by one token of the target's (never empty)."""

    accepted: int
    tokens: tuple[int, ...]


def verify_match(drafts: Sequence[int], targets: Iterable[int]) -> Verdict:
    """GREEDY and EXACT_SEEDED: `targets[i]` is the target's token at draft position i given the
    context plus `drafts[:i]`; there must be at least one more target than accepted drafts."""
    it = iter(targets)
    for i, d in enumerate(drafts):
        t = next(it, None)
        if t is None:
            raise ValueError(f"{i} target tokens for {len(drafts)} drafts; need one past the last accepted")
        if t != d:
            return Verdict(i, (*drafts[:i], t))
    bonus = next(it, None)
    if bonus is None:
        raise ValueError(f"no bonus token: {len(drafts)} drafts need {len(drafts) + 1} target tokens")
    return Verdict(len(drafts), (*drafts, bonus))


class Uniforms:
    """The deterministic uniforms of rejection sampling for one request (`seed_base`)."""

    __slots__ = ("_accept_key", "_residual_key")

    def __init__(self, seed_base: int) -> None:
        key = (seed_base * GOLDEN) & MASK64
        self._accept_key = mix64(key ^ _ACCEPT_SALT)
        self._residual_key = mix64(key ^ _RESIDUAL_SALT)

    def accept(self, position: int) -> float:
        return mix64(self._accept_key ^ (position & MASK64)) * _INV_2_64

    def resample(self, position: int) -> float:
        return mix64(self._residual_key ^ (position & MASK64)) * _INV_2_64


def verify_rejection(
    drafts: Sequence[int],
    q_rows: Sequence[Dist],
    p_rows: Iterable[Dist],
    uniforms: Uniforms,
    position: int,
) -> Verdict:
    """REJECTION: `q_rows[i]` is the proposal draft i was drawn from, `p_rows[i]` the target's
    distribution at draft position i given the context plus `drafts[:i]` (one more p than accepted
    drafts, for the replacement or the bonus); `position` is the absolute position of the first draft."""
    if len(q_rows) != len(drafts):
        raise ValueError(f"{len(q_rows)} proposal distributions for {len(drafts)} drafts")
    it = iter(p_rows)
    for i, x in enumerate(drafts):
        p = next(it, None)
        if p is None:
            raise ValueError(f"{i} target distributions for {len(drafts)} drafts")
        q = q_rows[i]
        px, qx = p.prob(x), q.prob(x)
        # q(x) = 0 means the draft contradicts its own proposal: treat it as rejected
        if qx > 0.0 and (px >= qx or uniforms.accept(position + i) * qx < px):
            continue
        token = residual(p, q).sample(uniforms.resample(position + i))
        return Verdict(i, (*drafts[:i], token))
    bonus = next(it, None)
    if bonus is None:
        raise ValueError(f"no bonus distribution: {len(drafts)} drafts need {len(drafts) + 1}")
    return Verdict(len(drafts), (*drafts, bonus.sample(uniforms.resample(position + len(drafts)))))
