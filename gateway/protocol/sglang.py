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
from collections.abc import Sequence
from typing import Annotated, Any, Final

import msgspec

from gateway.protocol.generate import GenerateRequest
from gateway.protocol.kv import DEFAULT_PAGE_SIZE

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
    # Lumen's checkpoint instruction for the plugin (part 2); None: no checkpoint of this attempt
    kv_hints: LumenKvHints | None = None
    # the server's queue order (`--enable-priority-scheduling --schedule-low-priority-values-first`:
    # lower first, then FIFO); None: not sent (a server without priority scheduling is given none)
    priority: int | None = None


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


def to_sglang(
    req: GenerateRequest,
    *,
    seed_base: int | None,
    epoch: int = 0,
    src_worker: str = "",
    priority: int | None = None,
) -> SGLangGenerate:
    """Lumen's data-path request as SGLang's: the same ids and sampling, no extension.

    A greedy request carries no seed (it needs none); `seed_base` None sends none either. The holders
    of the `lumen` extension, if any, become `kv_hints` for Lumen's plugin (checkpoints, part 2), for
    serving incarnation `epoch` of `src_worker`. `priority`: the queue position the gateway asks for
    (`gateway.core.outage.queue_priority`), sent only to servers launched with priority scheduling.
    """
    rid = sglang_rid(req.rid)
    holders = req.lumen.checkpoint if req.lumen is not None else []
    hints = None
    if holders and src_worker:
        hints = kv_hints_for(
            rid, epoch=epoch, src_worker=src_worker, holders=[(h.worker_id, h.kv_endpoint) for h in holders]
        )
    sp = req.sampling_params
    greedy = sp.temperature <= 0.0 or sp.top_k == 1
    return SGLangGenerate(
        rid=rid,
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
        kv_hints=hints,
        priority=priority,
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


class SGLangServerInfo(msgspec.Struct, kw_only=True):
    """The parts of `GET /server_info` Lumen reads: SGLang 0.5.23 answers the resolved server arguments
    by field name (`srt/server_args.py ServerArgs.resolved_dict`, fields in `srt/arg_groups/fields/`);
    more fields ignored. The queue order (schedule.py) and the numerics a replay's exactness depends on
    (`gateway.core.determinism`): dtype, device, the attention and sampling backends, deterministic
    inference (a real CPU server answers float32, cpu, torch_native, pytorch, false)."""

    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    disable_priority_preemption: bool = False
    schedule_policy: str = "fcfs"
    dtype: str | None = None
    device: str | None = None
    attention_backend: str | None = None
    sampling_backend: str | None = None
    enable_deterministic_inference: bool = False


def orders_by_priority(info: SGLangServerInfo) -> bool:
    """Whether a server orders its waiting queue by Lumen's priorities: lower values first, then by
    when each request queued (the FCFS policy's sort, `srt/managers/schedule_policy.py
    _sort_by_priority_and_fcfs`), and never preempts a running request for a queued one (Lumen's
    priorities are virtual arrival times, far apart: SGLang's preemption threshold is 10)."""
    return (
        info.enable_priority_scheduling
        and info.schedule_low_priority_values_first
        and info.disable_priority_preemption
        and info.schedule_policy == "fcfs"
    )


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


# -- kv_hints: Lumen's checkpoint instructions to an SGLang server's plugin ------------------------------
# SGLang 0.5.23 carries `kv_hints` on `/generate` (`srt/managers/kv_hints.py`: an envelope of versioned
# actions) and keeps it on the request (`Req.kv_hints`); nothing in SGLang reads it. Lumen's plugin
# (`worker_hooks/sglang/plugin.py`) reads one `lumen.checkpoint` action: stream this request's KV pages,
# as they complete, to its holders over the KV plane (DESIGN 4.4). The envelope must pass SGLang's JSON
# contract (`sglang/api/v1/api_types.py`: every action needs `action_id`, `action_type` and
# `action_version`, and SGLang's own decoder requires all three); the payload is Lumen's own.

LUMEN_KV_HINTS_PROTOCOL: Final = "lumen.kv.v1"
LUMEN_CHECKPOINT_ACTION: Final = "lumen.checkpoint"
LUMEN_CHECKPOINT_ACTION_VERSION: Final = "1"

_NonNeg = Annotated[int, msgspec.Meta(ge=0)]
_PageSize = Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
_Name = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]


class LumenKvHolder(msgspec.Struct, frozen=True, kw_only=True):
    """A checkpoint holder: its worker id and its KV plane endpoint (shard 0 of an SGLang holder)."""

    worker_id: _Name
    kv_endpoint: _Name


class LumenCheckpointPayload(msgspec.Struct, frozen=True, kw_only=True):
    epoch: _NonNeg  # the serving worker's incarnation: the KV header's `incarnation`
    src_worker: _Name  # the serving worker's id at the gateway
    holders: list[LumenKvHolder]
    page_size: _PageSize = DEFAULT_PAGE_SIZE  # must equal the server's --page-size
    # pages [0, first_page) are already held (a resumed request): streaming starts here, chained to them
    first_page: _NonNeg = 0


class LumenKvHintAction(msgspec.Struct, frozen=True, kw_only=True):
    action_id: _Name  # the attempt's rid
    action_type: str = LUMEN_CHECKPOINT_ACTION
    action_version: str = LUMEN_CHECKPOINT_ACTION_VERSION
    payload: LumenCheckpointPayload


class LumenKvHints(msgspec.Struct, frozen=True, kw_only=True):
    """The `kv_hints` envelope of one attempt (`message_id`: the attempt's rid)."""

    protocol_version: str = LUMEN_KV_HINTS_PROTOCOL
    message_id: _Name
    actions: list[LumenKvHintAction]


class LumenCheckpoint(msgspec.Struct, frozen=True, kw_only=True):
    """What the plugin acts on: request `rid`'s pages go to `holders` under `src_worker`/`epoch`."""

    rid: str
    epoch: int
    src_worker: str
    holders: tuple[LumenKvHolder, ...]
    page_size: int
    first_page: int


def kv_hints_for(
    rid: str,
    *,
    epoch: int,
    src_worker: str,
    holders: Sequence[tuple[str, str]],
    page_size: int = DEFAULT_PAGE_SIZE,
    first_page: int = 0,
) -> LumenKvHints:
    """The `kv_hints` that make an SGLang server with Lumen's plugin checkpoint attempt `rid` to
    `holders` ((worker id, KV endpoint) pairs); `msgspec.to_builtins` gives the JSON body value."""
    hints = LumenKvHints(
        message_id=rid,
        actions=[
            LumenKvHintAction(
                action_id=rid,
                payload=LumenCheckpointPayload(
                    epoch=epoch,
                    src_worker=src_worker,
                    holders=[LumenKvHolder(worker_id=w, kv_endpoint=e) for w, e in holders],
                    page_size=page_size,
                    first_page=first_page,
                ),
            )
        ],
    )
    # the same checks a receiver applies (bounds, non-empty names)
    return msgspec.convert(msgspec.to_builtins(hints), LumenKvHints)


def parse_kv_hints(value: Any) -> LumenCheckpoint | None:
    """Lumen's checkpoint instruction in a `kv_hints` value (JSON-like, as `msgspec.to_builtins` gives
    SGLang's `KvHintsEnvelope`): None when there is none (no hints, another protocol, only actions of
    other types or versions, which SGLang's contract says to ignore); ValueError when Lumen's own action
    is malformed."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("protocol_version") != LUMEN_KV_HINTS_PROTOCOL:
        return None
    actions = value.get("actions")
    if not isinstance(actions, list):
        raise ValueError("kv_hints: actions must be a list")
    for raw in actions:
        if (
            not isinstance(raw, dict)
            or raw.get("action_type") != LUMEN_CHECKPOINT_ACTION
            or raw.get("action_version") != LUMEN_CHECKPOINT_ACTION_VERSION
        ):
            continue
        try:
            action = msgspec.convert(raw, LumenKvHintAction)
            rid = msgspec.convert(value.get("message_id"), _Name)
        except msgspec.ValidationError as exc:
            raise ValueError(f"kv_hints: malformed {LUMEN_CHECKPOINT_ACTION} action: {exc}") from exc
        p = action.payload
        return LumenCheckpoint(
            rid=rid,
            epoch=p.epoch,
            src_worker=p.src_worker,
            holders=tuple(dict.fromkeys(p.holders)),
            page_size=p.page_size,
            first_page=p.first_page,
        )
    return None
