"""The synthetic drafter: agreement rate as configured, state sync, and its distributions."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from draft_models.distribution import Dist, mix, residual, target_dist
from draft_models.synthetic_drafter import SyntheticDrafter
from gateway.protocol.generate import SamplingParams
from models.synthetic import Sampler, SyntheticModel, mix64

LO, HI = 32, 127
GREEDY = Sampler.from_params(SamplingParams(temperature=0.0))


def sampled(seed_base: int = 11, **kw: object) -> Sampler:
    return Sampler.from_params(SamplingParams(**kw), seed_base)  # type: ignore[arg-type]


def agreement_counts(
    drafter: SyntheticDrafter, sampler: Sampler, contexts: int, k: int = 8
) -> tuple[int, int]:
    """(agreeing drafts, drafts): each draft compared with the target's token after the same prefix."""
    model = drafter.target
    agree = total = 0
    for c in range(contexts):
        state = drafter.start([c % 200, c // 200, 7])
        tokens = drafter.propose(state, k, sampler).tokens
        h, pos = state.h, state.position
        for t in tokens:
            agree += t == model.next_token(h, pos, sampler)
            total += 1
            assert LO <= t < HI
            h, pos = mix64(h ^ t), pos + 1
    return agree, total


@pytest.mark.parametrize("sampler", [GREEDY, sampled(temperature=0.8, top_p=0.95)], ids=["greedy", "seeded"])
def test_agreement_rate_is_as_configured(sampler: Sampler) -> None:
    for a in (0.3, 0.7, 0.9):
        agree, total = agreement_counts(SyntheticDrafter(a), sampler, 800)
        assert abs(agree / total - a) < 0.03, (a, agree / total)


@pytest.mark.parametrize("sampler", [GREEDY, sampled(temperature=1.3)], ids=["greedy", "seeded"])
def test_agreement_zero_never_and_one_always_agrees(sampler: Sampler) -> None:
    assert agreement_counts(SyntheticDrafter(0.0), sampler, 200)[0] == 0
    agree, total = agreement_counts(SyntheticDrafter(1.0), sampler, 200)
    assert agree == total


def test_drafts_are_deterministic_and_seeded_by_draft_seed() -> None:
    a, b, c = SyntheticDrafter(0.5), SyntheticDrafter(0.5), SyntheticDrafter(0.5, draft_seed=9)
    ctx = list(range(50))
    draws = [d.propose(d.start(ctx), 32, GREEDY).tokens for d in (a, b, c)]
    assert draws[0] == draws[1] != draws[2]


def test_sync_equals_a_fresh_start_and_proposing_does_not_move_the_state() -> None:
    d = SyntheticDrafter(0.7)
    state = d.start([1, 2, 3])
    before = (state.h, state.position)
    d.propose(state, 5, GREEDY)
    assert (state.h, state.position) == before
    d.sync(state, [4, 5])
    fresh = d.start([1, 2, 3, 4, 5])
    assert (state.h, state.position) == (fresh.h, fresh.position) == (fresh.h, 5)


def test_bad_drafter_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="agreement"):
        SyntheticDrafter(1.5)
    with pytest.raises(ValueError, match="more than 8 token ids"):
        SyntheticDrafter(0.5, token_lo=0, token_hi=8)


def test_off_tokens_are_never_target_candidates() -> None:
    d = SyntheticDrafter(0.0)
    for i in range(500):
        h = mix64(i)
        assert d.off_token(h) not in {t for _, t in d.target.candidates(h)}


def test_q_is_the_target_distribution_mixed_toward_the_off_token() -> None:
    d = SyntheticDrafter(0.7)
    sampler = sampled(temperature=0.9)
    state = d.start([5, 6, 7])
    prop = d.propose(state, 3, sampler, want_q=True)
    assert prop.q is not None and len(prop.q) == 3
    p = target_dist(d.target, state.h, sampler)
    q = prop.q[0]
    assert q.prob(d.off_token(state.h)) == pytest.approx(0.3)
    for t, pt in zip(p.tokens, p.probs, strict=True):
        assert q.prob(t) == pytest.approx(0.7 * pt)
    assert d.propose(state, 3, sampler).q is None


SAMPLERS = [
    sampled(temperature=1.0),
    sampled(temperature=0.5, top_k=3),
    sampled(temperature=1.5, top_p=0.6),
    sampled(temperature=0.7, top_k=5, top_p=0.9),
]


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_target_dist_is_what_next_token_samples(sampler: Sampler) -> None:
    # token_hi small enough that candidates often share an id, so the merging is exercised
    model = SyntheticModel(3, 32, 44)
    n = 4000
    for state in range(3):
        h = mix64(state)
        p = target_dist(model, h, sampler)
        counts = Counter(model.next_token(h, pos, sampler) for pos in range(n))
        assert set(counts) <= set(p.tokens)
        chi2 = sum(
            (counts[t] - n * pt) ** 2 / (n * pt) for t, pt in zip(p.tokens, p.probs, strict=True) if pt > 0
        )
        assert chi2 < 40, (chi2, p, counts)


def test_target_dist_of_greedy_is_the_greedy_token() -> None:
    model = SyntheticModel(0, LO, HI)
    for i in range(200):
        h = mix64(i)
        assert target_dist(model, h, GREEDY) == Dist.point(model.next_token(h, i, GREEDY))


def test_dist_helpers() -> None:
    p = Dist.from_weights([(1, 1.0), (2, 2.0), (1, 1.0)])
    assert p.tokens == (1, 2) and p.probs == (0.5, 0.5)
    assert p.prob(3) == 0.0 and p.sample(0.0) == 1 and p.sample(0.75) == 2 and p.sample(1.0) == 2
    q = Dist((1, 3), (0.8, 0.2))
    r = residual(p, q)
    assert r == Dist((2,), (1.0,))
    assert residual(p, p) == p
    m = mix(p, 9, 0.5)
    assert math.isclose(m.prob(9), 0.5) and math.isclose(m.prob(1), 0.25)
    with pytest.raises(ValueError, match="sum to"):
        Dist((1, 2), (0.5, 0.6))
    with pytest.raises(ValueError, match="repeated"):
        Dist((1, 1), (0.5, 0.5))
