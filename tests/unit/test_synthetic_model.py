"""The synthetic model: determinism, replay exactness (split invariance), sampling edge cases."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.protocol.generate import SamplingParams
from models.synthetic import (
    K_CANDIDATES,
    MASK64,
    Sampler,
    SyntheticModel,
    expected_output,
    mix64,
)

LO, HI = 32, 127
MODEL = SyntheticModel(0, LO, HI)

prompts = st.lists(st.integers(0, 258), min_size=1, max_size=40)
sampling = st.builds(
    SamplingParams,
    max_new_tokens=st.integers(1, 40),
    temperature=st.sampled_from([0.0, 0.3, 0.7, 1.0, 1.5]),
    top_p=st.sampled_from([1.0, 0.95, 0.5, 0.1]),
    top_k=st.sampled_from([-1, 1, 2, 5, 8, 20]),
)
seeds = st.integers(0, 2**63 - 1)


def greedy(max_new: int = 32, **kw: object) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, temperature=0.0, **kw)  # type: ignore[arg-type]


def test_mix64_is_deterministic_and_spreads_small_inputs() -> None:
    outs = [mix64(i) for i in range(10_000)]
    assert outs == [mix64(i) for i in range(10_000)]
    assert len(set(outs)) == 10_000
    assert all(0 <= o <= MASK64 for o in outs)
    # no fixed point at zero: the golden increment comes before the finalizer
    assert mix64(0) != 0


def test_model_rejects_an_empty_token_range() -> None:
    with pytest.raises(ValueError, match="token_lo"):
        SyntheticModel(0, 10, 10)


def test_state_is_independent_of_how_the_sequence_is_split() -> None:
    seq = [5, 9, 200, 17, 3, 3, 88]
    whole = MODEL.absorb(MODEL.initial_state(), seq)
    for k in range(len(seq) + 1):
        assert MODEL.absorb(MODEL.absorb(MODEL.initial_state(), seq[:k]), seq[k:]) == whole


def test_same_request_same_output_and_seeds_matter() -> None:
    params = SamplingParams(max_new_tokens=64, temperature=1.0)
    a = expected_output([1, 2, 3], params, seed_base=7)
    assert a == expected_output([1, 2, 3], params, seed_base=7)
    assert a[0] != expected_output([1, 2, 3], params, seed_base=8)[0]
    assert a[0] != expected_output([1, 2, 3], params, seed_base=7, model_seed=1)[0]
    assert a[1] == "length" and len(a[0]) == 64
    assert all(LO <= t < HI for t in a[0])


@settings(max_examples=150, deadline=None)
@given(prompt=prompts, params=sampling, seed_base=seeds, data=st.data())
def test_replaying_prompt_plus_emitted_continues_exactly(
    prompt: list[int], params: SamplingParams, seed_base: int, data: st.DataObject
) -> None:
    out, finish = expected_output(prompt, params, seed_base)
    k = data.draw(st.integers(0, len(out) - 1), label="split")
    rest_params = SamplingParams(
        max_new_tokens=params.max_new_tokens - k,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
    )
    assert expected_output(prompt + out[:k], rest_params, seed_base) == (out[k:], finish)


@settings(max_examples=50, deadline=None)
@given(prompt=prompts, seed_base=seeds)
def test_stop_token_ends_the_output_and_is_included(prompt: list[int], seed_base: int) -> None:
    free, _ = expected_output(prompt, greedy(32), seed_base)
    stop = free[5]
    first = free.index(stop)
    out, finish = expected_output(prompt, greedy(32, stop_token_ids=[stop]), seed_base)
    assert out == free[: first + 1]
    assert finish == "stop"
    # ignore_eos generates through stop tokens
    assert expected_output(prompt, greedy(32, stop_token_ids=[stop], ignore_eos=True), seed_base) == (
        free,
        "length",
    )


def test_length_wins_when_the_last_allowed_token_is_a_stop_token() -> None:
    # SGLang checks the length limit before stop tokens
    prompt = next(p for p in ([i, 5, 6] for i in range(100)) if _last_is_new(p))
    free, _ = expected_output(prompt, greedy(10))
    assert expected_output(prompt, greedy(10, stop_token_ids=[free[9]])) == (free, "length")


def _last_is_new(prompt: list[int]) -> bool:
    free, _ = expected_output(prompt, greedy(10))
    return free[9] not in free[:9]


def test_zero_max_new_tokens_produces_nothing() -> None:
    assert expected_output([1, 2], greedy(0)) == ([], "length")


def test_greedy_is_the_argmax_candidate_and_all_greedy_settings_agree() -> None:
    h = MODEL.absorb(MODEL.initial_state(), [10, 20, 30])
    cands = MODEL.candidates(h)
    assert len(cands) == K_CANDIDATES
    best = max(cands, key=lambda c: c[0])[1]
    variants = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1e-9),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-9),
    ]
    for params in variants:
        for pos in range(3, 50):
            assert MODEL.next_token(h, pos, Sampler.from_params(params, seed_base=pos)) == best


@settings(max_examples=100, deadline=None)
@given(tokens=prompts, top_k=st.integers(1, K_CANDIDATES), pos=st.integers(0, 10_000), seed_base=seeds)
def test_top_k_samples_only_among_the_k_best(tokens: list[int], top_k: int, pos: int, seed_base: int) -> None:
    h = MODEL.absorb(MODEL.initial_state(), tokens)
    ranked = sorted(MODEL.candidates(h), key=lambda c: c[0], reverse=True)
    allowed = {tok for _, tok in ranked[:top_k]}
    sampler = Sampler.from_params(SamplingParams(temperature=2.0, top_k=top_k), seed_base)
    assert MODEL.next_token(h, pos, sampler) in allowed


def test_sampling_spreads_over_candidates_and_temperature_sharpens() -> None:
    h = MODEL.absorb(MODEL.initial_state(), [1, 2, 3])
    best = max(MODEL.candidates(h), key=lambda c: c[0])[1]

    def hits(temperature: float) -> int:
        sampler = Sampler.from_params(SamplingParams(temperature=temperature), seed_base=3)
        return sum(MODEL.next_token(h, pos, sampler) == best for pos in range(2000))

    hot, cold = hits(5.0), hits(0.2)
    assert 0 < hot < cold <= 2000
    hot_sampler = Sampler.from_params(SamplingParams(temperature=5.0), seed_base=3)
    assert len({MODEL.next_token(h, pos, hot_sampler) for pos in range(2000)}) > 3


def test_uniform_depends_only_on_seed_base_and_position() -> None:
    a = Sampler.from_params(SamplingParams(temperature=0.5, top_p=0.3), seed_base=11)
    b = Sampler.from_params(SamplingParams(temperature=1.7), seed_base=11)
    c = Sampler.from_params(SamplingParams(temperature=0.5), seed_base=12)
    us = [a.uniform(p) for p in range(1000)]
    assert us == [b.uniform(p) for p in range(1000)]
    assert us != [c.uniform(p) for p in range(1000)]
    assert all(0.0 <= u < 1.0 for u in us)
    assert 0.4 < sum(us) / len(us) < 0.6
