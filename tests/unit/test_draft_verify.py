"""Verification: greedy and exact-seeded output equal plain decoding; rejection sampling keeps p."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from draft_models.distribution import Dist, target_dist
from draft_models.synthetic_drafter import SyntheticDrafter, verify_synthetic
from draft_models.verify import Uniforms, Verdict, VerifyMode, mode_for, verify_match, verify_rejection
from gateway.protocol.generate import SamplingParams
from models.synthetic import Sampler, SyntheticModel, expected_output, finish_of, mix64

LO, HI = 32, 127
MODEL = SyntheticModel(0, LO, HI)


def chi2(counts: Counter[int], p: Dist, n: int) -> float:
    assert set(counts) <= {t for t, pt in zip(p.tokens, p.probs, strict=True) if pt > 0}
    return sum(
        (counts[t] - n * pt) ** 2 / (n * pt) for t, pt in zip(p.tokens, p.probs, strict=True) if pt > 0
    )


def test_match_accepts_the_longest_equal_prefix_then_the_targets_token() -> None:
    assert verify_match([5, 6, 7], [5, 6, 9, 1]) == Verdict(2, (5, 6, 9))
    assert verify_match([5, 6, 7], [4]) == Verdict(0, (4,))
    assert verify_match([5, 6], [5, 6, 8]) == Verdict(2, (5, 6, 8))
    assert verify_match([], [3]) == Verdict(0, (3,))
    with pytest.raises(ValueError, match="bonus"):
        verify_match([5, 6], [5, 6])
    with pytest.raises(ValueError, match="need one past"):
        verify_match([5, 6], [5])


def test_mode_for() -> None:
    assert mode_for(Sampler.from_params(SamplingParams(temperature=0.0))) is VerifyMode.GREEDY
    hot = Sampler.from_params(SamplingParams(temperature=0.7))
    assert mode_for(hot) is VerifyMode.EXACT_SEEDED
    assert mode_for(hot, exact_seeded=False) is VerifyMode.REJECTION


def decode_with_drafts(
    prompt: list[int], params: SamplingParams, seed_base: int, rounds: st.DataObject | None = None
) -> tuple[list[int], int]:
    """A target loop: each round drafts (from hypothesis or a drafter), verifies, emits. (output, steps)"""
    sampler = Sampler.from_params(params, seed_base)
    mode = mode_for(sampler)
    drafter = SyntheticDrafter(0.6)
    h, pos = MODEL.absorb(MODEL.initial_state(), prompt), len(prompt)
    out: list[int] = []
    steps = 0
    stop_ids = frozenset(params.stop_token_ids)
    while True:
        steps += 1
        if rounds is not None:
            drafts = rounds.draw(st.lists(st.integers(LO, HI - 1), max_size=6))
            # half the time start from the true continuation, so long accepted prefixes happen
            if rounds.draw(st.booleans()):
                hh, pp, good_list = h, pos, []
                for _ in range(len(drafts)):
                    t = MODEL.next_token(hh, pp, sampler)
                    good_list.append(t)
                    hh, pp = mix64(hh ^ t), pp + 1
                cut = rounds.draw(st.integers(0, len(drafts)))
                drafts = good_list[:cut] + drafts[cut:]
        else:
            state = drafter.start([])
            state.h, state.position = h, pos
            drafts = list(drafter.propose(state, 4, sampler).tokens)
        verdict = verify_synthetic(MODEL, h, pos, sampler, drafts, mode=mode)
        assert verdict.tokens[: verdict.accepted] == tuple(drafts[: verdict.accepted])
        for t in verdict.tokens:
            out.append(t)
            if finish_of(t, len(out), params, stop_ids) is not None:
                return out, steps
            h, pos = mix64(h ^ t), pos + 1


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 258), min_size=1, max_size=30),
    max_new=st.integers(1, 40),
    stop=st.lists(st.integers(LO, HI - 1), max_size=2),
    data=st.data(),
)
def test_greedy_verification_of_random_drafts_equals_plain_greedy(
    prompt: list[int], max_new: int, stop: list[int], data: st.DataObject
) -> None:
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, stop_token_ids=stop)
    got, _ = decode_with_drafts(prompt, params, 0, data)
    assert got == expected_output(prompt, params)[0]


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 258), min_size=1, max_size=30),
    max_new=st.integers(1, 40),
    temperature=st.sampled_from([0.3, 0.8, 1.0, 1.6]),
    top_p=st.sampled_from([1.0, 0.9, 0.5]),
    top_k=st.sampled_from([-1, 2, 5]),
    seed=st.integers(0, 2**63 - 1),
    data=st.data(),
)
def test_exact_seeded_verification_equals_non_assisted_seeded_decoding(
    prompt: list[int],
    max_new: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int,
    data: st.DataObject,
) -> None:
    params = SamplingParams(max_new_tokens=max_new, temperature=temperature, top_p=top_p, top_k=top_k)
    got, _ = decode_with_drafts(prompt, params, seed, data)
    assert got == expected_output(prompt, params, seed)[0]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_drafter_loop_is_exact_and_takes_fewer_steps(temperature: float) -> None:
    params = SamplingParams(max_new_tokens=300, temperature=temperature, ignore_eos=True)
    got, steps = decode_with_drafts([1, 2, 3], params, 77)
    assert got == expected_output([1, 2, 3], params, 77)[0]
    # agreement 0.6, k = 4: (1 - 0.6^5) / 0.4 ≈ 2.3 tokens per step
    assert 300 / steps > 1.8


P = Dist((10, 11, 12), (0.5, 0.3, 0.2))
QS = [
    Dist((10, 11, 12, 13), (0.1, 0.6, 0.1, 0.2)),  # overlaps p, with mass outside its support
    Dist((13,), (1.0,)),  # disjoint: every draft rejected
    P,  # q = p: every draft accepted
    Dist((12, 10), (0.9, 0.1)),
]


@pytest.mark.parametrize("q", QS)
def test_rejection_sampling_preserves_the_target_distribution(q: Dist) -> None:
    n = 20_000
    first: Counter[int] = Counter()
    second: Counter[int] = Counter()
    p2 = Dist((10, 20), (0.25, 0.75))
    n2 = first_accepted = 0
    for seed in range(n):
        # the draft is drawn from q with a uniform of its own
        x1 = q.sample(mix64(seed ^ 0xABCDEF) / 2**64)
        x2 = q.sample(mix64(seed ^ 0x123457) / 2**64)
        verdict = verify_rejection([x1, x2], [q, q], [P, p2, P], Uniforms(seed), position=100)
        first[verdict.tokens[0]] += 1
        if verdict.accepted >= 1:
            first_accepted += 1
            second[verdict.tokens[1]] += 1
            n2 += 1
    assert chi2(first, P, n) < 30
    if n2 > 1000:
        assert chi2(second, p2, n2) < 30
    # the acceptance rate of the first draft is Σ min(p, q)
    overlap = sum(min(pt, q.prob(t)) for t, pt in zip(P.tokens, P.probs, strict=True))
    assert abs(first_accepted / n - overlap) < 0.02


def test_rejection_uniforms_are_a_stream_apart_from_the_targets_sampling() -> None:
    sampler = Sampler.from_params(SamplingParams(temperature=1.0), 5)
    u = Uniforms(5)
    us = [(sampler.uniform(i), u.accept(i), u.resample(i)) for i in range(100)]
    assert all(len(set(t)) == 3 for t in us)
    assert Uniforms(5).accept(3) == u.accept(3) != Uniforms(6).accept(3)


def test_rejection_with_the_synthetic_drafter_keeps_the_target_distribution() -> None:
    params = SamplingParams(temperature=1.0)
    drafter = SyntheticDrafter(0.7)

    def verify(context: list[int], seed: int) -> Verdict:
        sampler = Sampler.from_params(params, seed)
        state = drafter.start(context)
        prop = drafter.propose(state, 2, sampler, want_q=True)
        assert prop.q is not None
        return verify_synthetic(
            MODEL,
            state.h,
            state.position,
            sampler,
            prop.tokens,
            mode=VerifyMode.REJECTION,
            q_rows=prop.q,
            uniforms=Uniforms(seed),
        )

    # one context, many seeds: the first emitted token follows p
    n = 6000
    counts = Counter(verify([4, 5, 6], seed).tokens[0] for seed in range(n))
    h = MODEL.absorb(MODEL.initial_state(), [4, 5, 6])
    assert chi2(counts, target_dist(MODEL, h, Sampler.from_params(params)), n) < 40
    # agreement is a function of the context: over many contexts, 0.7 + 0.7^2 drafts accepted per round
    accepted = sum(verify([4, 5, c], c).accepted for c in range(n))
    assert abs(accepted / n - 1.19) < 0.06
    with pytest.raises(ValueError, match="q distributions"):
        verify_synthetic(MODEL, h, 3, Sampler.from_params(params), [1], mode=VerifyMode.REJECTION)


def test_rejection_argument_checks() -> None:
    with pytest.raises(ValueError, match="1 proposal distributions for 2 drafts"):
        verify_rejection([10, 11], [P], [P, P, P], Uniforms(0), 0)
    with pytest.raises(ValueError, match="no bonus"):
        verify_rejection([10], [P], [P], Uniforms(0), 0)
    # a draft its own q gives no mass is rejected, never accepted
    v = verify_rejection([10], [Dist((11,), (1.0,))], [P, P], Uniforms(0), 0)
    assert v.accepted == 0
