"""The synthetic model: deterministic next-token choice from a rolling context hash (DESIGN 7).

The context state is a 64-bit hash folded over every token in order, `h_{i+1} = mix64(h_i ^ t_i)`, so
the state after `prompt + emitted` does not depend on where the split between prompt and output lies:
a replay with `input_ids = prompt + emitted` continues exactly where the first attempt left off.

From a state the model derives K candidate ids and K pseudo-logits. Greedy decoding takes the argmax;
sampling applies temperature, top-k and top-p over the candidates and inverts the CDF at a uniform
drawn from `(seed_base, position)` alone, so the same position samples the same token on any worker.
Pure Python and about a dozen integer mixes per token.

Log probabilities (`token_logprob`) are SGLang's (srt/layers/sampler.py, its default): the
log-softmax of the logits divided by the request's temperature (1 for a greedy request), before top-k
and top-p cut anything. The model's distribution is over its K candidates, the mass of candidates that
share an id added up; every other id has probability 0, so at most K distinct ids are ever reported as
the most likely. A pure function of the context state: every worker reports the same values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.protocol.generate import SamplingParams, TokenLogprob

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / golden ratio, the splitmix64 increment
K_CANDIDATES = 8
# pseudo-logits are uniform in [0, LOGIT_SPAN): at temperature 1 the top candidate holds ~40% of the mass
LOGIT_SPAN = 6.0
# at or below this temperature sampling is greedy (SGLang treats tiny temperatures the same way)
GREEDY_TEMPERATURE = 1e-6
_SEED_SALT = 0x4C554D454E  # "LUMEN"
_CANDIDATE_SALTS = tuple(((j + 1) * 0xD1B54A32D192ED03) & MASK64 for j in range(K_CANDIDATES))
_LOGIT_BITS = 24
_LOGIT_SCALE = LOGIT_SPAN / (1 << _LOGIT_BITS)
_LOGIT_MASK = (1 << _LOGIT_BITS) - 1
_INV_2_64 = 1.0 / 18446744073709551616.0


def mix64(x: int) -> int:
    """One splitmix64 step: add the golden increment, then the finalizer. A bijection on 64 bits."""
    z = (x + GOLDEN) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


@dataclass(frozen=True, slots=True)
class Sampler:
    """How one request picks tokens; built once per request from its sampling params."""

    greedy: bool
    temperature: float
    top_k: int  # 0: off
    top_p: float
    seed_key: int  # seed_base folded once, so the per-token uniform costs one mix

    @staticmethod
    def from_params(params: SamplingParams, seed_base: int = 0) -> Sampler:
        greedy = params.temperature <= GREEDY_TEMPERATURE or params.top_k == 1
        # kept as given (the torch backend samples over a real vocabulary); over K candidates any
        # top_k >= K is no cut at all
        top_k = params.top_k if params.top_k >= 1 else 0
        return Sampler(
            greedy=greedy,
            temperature=params.temperature,
            top_k=top_k,
            top_p=params.top_p,
            seed_key=(seed_base * GOLDEN) & MASK64,
        )

    def uniform(self, position: int) -> float:
        """The uniform in [0, 1) that token `position` is sampled with."""
        return mix64(self.seed_key ^ position) * _INV_2_64


class SyntheticModel:
    """Token ids are drawn from [token_lo, token_hi)."""

    __slots__ = ("_h0", "_lo", "_span", "model_seed", "token_hi", "token_lo")

    def __init__(self, model_seed: int, token_lo: int, token_hi: int) -> None:
        if not 0 <= token_lo < token_hi:
            raise ValueError(f"need 0 <= token_lo < token_hi, got [{token_lo}, {token_hi})")
        self.model_seed = model_seed
        self.token_lo = token_lo
        self.token_hi = token_hi
        self._lo = token_lo
        self._span = token_hi - token_lo
        self._h0 = mix64((model_seed & MASK64) ^ _SEED_SALT)

    def initial_state(self) -> int:
        return self._h0

    @staticmethod
    def advance(h: int, token: int) -> int:
        return mix64(h ^ token)

    @staticmethod
    def absorb(h: int, tokens: list[int]) -> int:
        for t in tokens:
            h = mix64(h ^ t)
        return h

    def candidates(self, h: int) -> list[tuple[float, int]]:
        """K (logit, id) pairs for the state `h`, in a fixed candidate order."""
        lo, span = self._lo, self._span
        out = []
        for salt in _CANDIDATE_SALTS:
            c = mix64(h ^ salt)
            out.append(((c & _LOGIT_MASK) * _LOGIT_SCALE, lo + (c >> _LOGIT_BITS) % span))
        return out

    def next_token(self, h: int, position: int, sampler: Sampler) -> int:
        """The token at absolute `position` (= context length) after a context with state `h`."""
        cands = self.candidates(h)
        if sampler.greedy:
            best = cands[0]
            for c in cands:
                if c[0] > best[0]:
                    best = c
            return best[1]
        # stable sort: equal logits keep candidate order, so ties resolve the same everywhere
        cands.sort(key=_logit, reverse=True)
        if sampler.top_k:
            cands = cands[: sampler.top_k]
        top = cands[0][0]
        weights = [math.exp((logit - top) / sampler.temperature) for logit, _ in cands]
        total = sum(weights)
        if sampler.top_p < 1.0:
            # keep the shortest prefix whose mass reaches top_p (at least one candidate)
            keep, mass, bound = 0, 0.0, sampler.top_p * total
            while keep < len(weights) and (keep == 0 or mass < bound):
                mass += weights[keep]
                keep += 1
            weights, total = weights[:keep], mass
        target = sampler.uniform(position) * total
        acc = 0.0
        for w, (_, token) in zip(weights, cands, strict=False):
            acc += w
            if target < acc:
                return token
        return cands[len(weights) - 1][1]

    def token_logprob(self, h: int, token: int, sampler: Sampler, top_n: int = 0) -> TokenLogprob:
        """`token`'s log probability after a context with state `h`, and the `top_n` most likely ids
        (most likely first, ties by id); None for an id the model gives no mass."""
        t = 1.0 if sampler.greedy else sampler.temperature
        scaled: dict[int, list[float]] = {}
        for logit, tid in self.candidates(h):
            scaled.setdefault(tid, []).append(logit / t)
        lse = _logsumexp([x for xs in scaled.values() for x in xs])
        lps = {tid: _logsumexp(xs) - lse for tid, xs in scaled.items()}
        top: tuple[tuple[float | None, int], ...] = ()
        if top_n > 0:
            ranked = sorted(lps.items(), key=_by_logprob)[:top_n]
            top = tuple((lp, tid) for tid, lp in ranked)
        return TokenLogprob(token, lps.get(token), top)


def _logsumexp(xs: list[float]) -> float:
    m = max(xs)
    return m + math.log(sum(math.exp(x - m) for x in xs))


def _by_logprob(item: tuple[int, float]) -> tuple[float, int]:
    return (-item[1], item[0])


def _logit(c: tuple[float, int]) -> float:
    return c[0]


def finish_of(token: int, n_output: int, params: SamplingParams, stop_ids: frozenset[int]) -> str | None:
    """SGLang's order: the length limit first, then a stop token (which stays in the output)."""
    if n_output >= params.max_new_tokens:
        return "length"
    if not params.ignore_eos and token in stop_ids:
        return "stop"
    return None


def expected_output(
    prompt_ids: list[int],
    sampling_params: SamplingParams,
    seed_base: int = 0,
    *,
    model_seed: int = 0,
    token_lo: int = 32,
    token_hi: int = 127,
) -> tuple[list[int], str]:
    """The whole output a synthetic worker produces for this request, and its finish type.

    Ground truth for tests: the engine must stream exactly these ids, however the request is split
    across attempts (`prompt + emitted` with `max_new_tokens` reduced by the emitted count).
    """
    model = SyntheticModel(model_seed, token_lo, token_hi)
    sampler = Sampler.from_params(sampling_params, seed_base)
    stop_ids = frozenset(sampling_params.stop_token_ids)
    if sampling_params.max_new_tokens <= 0:
        return [], "length"
    h = model.absorb(model.initial_state(), prompt_ids)
    position = len(prompt_ids)
    out: list[int] = []
    while True:
        token = model.next_token(h, position, sampler)
        out.append(token)
        finish = finish_of(token, len(out), sampling_params, stop_ids)
        if finish is not None:
            return out, finish
        h = mix64(h ^ token)
        position += 1
