"""What Lumen sends an unmodified SGLang server (sglang 0.5.23's native `/generate` and
`/abort_request`), and how its answers map onto Lumen's chunk schema.

Every body built here must pass SGLang's generated JSON contract (`sglang/api/v1/api_types.py`,
`GenerateRequest.from_json_value`): only fields that contract knows, Lumen's `lumen` extension never.
Differences from a Lumen worker's request:

- rids are fixed-length (32 hex digits of a hash of Lumen's attempt id): SGLang's `/abort_request`
  matches rids by prefix, and no fixed-length rid is a prefix of another;
- the seed travels as `sampling_params.sampling_seed` (SGLang hashes seed and position, so a replay of
  prompt + emitted ids continues identically; the server needs `--sampling-backend pytorch`), mapped
  into SGLang's signed 64-bit range;
- SGLang's default streaming sends cumulative ids, and cumulative logprob rows with
  `return_logprob` (`generate.incremental` handles both forms);
- logprobs: `return_logprob` and `top_logprobs_num` pass through; SGLang's rows are
  `[logprob, id, null]` (`srt/managers/tokenizer_manager.py` `detokenize_logprob_tokens`), of the
  temperature-scaled distribution before top-k/top-p for a sampled request and of the model's own for
  a greedy one (`srt/layers/sampler.py`, unless the server runs with SGLANG_RETURN_ORIGINAL_LOGPROB=1).
"""

from __future__ import annotations

import hashlib

import msgspec

from gateway.protocol.generate import GenerateRequest

RID_HEX_DIGITS = 32
_I64 = 1 << 63


class SGLangSamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 disables top-k in SGLang too
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    sampling_seed: int | None = None


class SGLangGenerate(msgspec.Struct, omit_defaults=True, kw_only=True):
    rid: str
    input_ids: list[int]
    sampling_params: SGLangSamplingParams
    stream: bool = False  # SGLang's default: with omit_defaults, True is always written out
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0


class SGLangAbort(msgspec.Struct, kw_only=True):
    rid: str
    abort_all: bool = False


def sglang_rid(attempt_rid: str) -> str:
    """A fixed-length rid for one attempt (no rid is a prefix of another: prefix-safe aborts)."""
    return hashlib.blake2b(attempt_rid.encode(), digest_size=RID_HEX_DIGITS // 2).hexdigest()


def sglang_seed(seed_base: int) -> int:
    """Lumen's 64-bit seed base as SGLang's signed 64-bit `sampling_seed` (a bijection)."""
    seed = seed_base % (1 << 64)
    return seed - (1 << 64) if seed >= _I64 else seed


def to_sglang(req: GenerateRequest, *, seed_base: int | None) -> SGLangGenerate:
    """Lumen's data-path request as SGLang's: the same ids and sampling, no extension.

    A greedy request carries no seed (it needs none); `seed_base` None sends none either.
    """
    sp = req.sampling_params
    greedy = sp.temperature <= 0.0 or sp.top_k == 1
    return SGLangGenerate(
        rid=sglang_rid(req.rid),
        input_ids=req.input_ids,
        sampling_params=SGLangSamplingParams(
            max_new_tokens=sp.max_new_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k,
            stop_token_ids=list(sp.stop_token_ids),
            ignore_eos=sp.ignore_eos,
            sampling_seed=None if greedy or seed_base is None else sglang_seed(seed_base),
        ),
        stream=req.stream,
        # output logprobs only: logprob_start_len stays -1 (SGLang: len(input_ids), no prompt rows,
        # and the prefix cache is not limited by it, srt/managers/scheduler.py)
        return_logprob=req.return_logprob,
        top_logprobs_num=req.top_logprobs_num if req.return_logprob else 0,
    )


class SGLangRankLoad(msgspec.Struct, kw_only=True):
    """One DP rank of `GET /v1/loads?include=core` (srt/managers/load_snapshot.py); more fields ignored."""

    dp_rank: int = 0
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_used_tokens: int = 0
    max_total_num_tokens: int = 0
    max_running_requests: int = 0
    token_usage: float = 0.0


class SGLangLoads(msgspec.Struct, kw_only=True):
    loads: list[SGLangRankLoad] = msgspec.field(default_factory=list)


class SGLangVerifyMeta(msgspec.Struct, kw_only=True):
    id: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # one row per input position from logprob_start_len on: [[logprob, token_id, text], ...] (most
    # likely first), the first row null (srt/managers/scheduler_components/logprob_result_processor.py)
    input_top_logprobs: list[list[tuple[float | None, int, str | None]] | None] = msgspec.field(
        default_factory=list
    )


class SGLangVerifyResponse(msgspec.Struct, kw_only=True):
    output_ids: list[int] = msgspec.field(default_factory=list)
    meta_info: SGLangVerifyMeta = msgspec.field(default_factory=SGLangVerifyMeta)


def verify_body(rid: str, context: list[int], drafts: list[int]) -> SGLangGenerate:
    """One greedy verification of `drafts` after `context` on an unmodified SGLang server.

    `input_ids = context + drafts`, one new token, temperature 0, and the top-1 of every position
    from the last context token on: row i + 1 of `input_top_logprobs` is the target's greedy choice
    where draft i stands; the one output token is its choice after the last draft (the bonus).
    """
    return SGLangGenerate(
        rid=rid,
        input_ids=[*context, *drafts],
        sampling_params=SGLangSamplingParams(max_new_tokens=1, temperature=0.0),
        stream=False,
        return_logprob=True,
        logprob_start_len=len(context) - 1,
        top_logprobs_num=1,
    )


def verified_tokens(drafts: list[int], resp: SGLangVerifyResponse) -> tuple[list[int], int]:
    """(the tokens plain greedy decoding would emit next, how many drafts were accepted): the longest
    prefix of `drafts` the target agrees with, then the target's own token after it."""
    rows = resp.meta_info.input_top_logprobs
    if len(rows) != len(drafts) + 1:
        raise ValueError(f"expected {len(drafts) + 1} logprob rows, got {len(rows)}")
    for i, d in enumerate(drafts):
        row = rows[i + 1]
        if not row:
            raise ValueError(f"no top-1 at draft position {i}")
        top = row[0][1]
        if top != d:
            return [*drafts[:i], top], i
    if len(resp.output_ids) != 1:
        raise ValueError(f"expected one output token, got {len(resp.output_ids)}")
    return [*drafts, resp.output_ids[0]], len(drafts)
