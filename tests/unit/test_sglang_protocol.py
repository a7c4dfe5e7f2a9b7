"""What the gateway sends SGLang and how it reads SGLang's streams (gateway/protocol/sglang.py,
gateway/protocol/generate.py): bodies pass SGLang's own contract, rids are prefix-safe, seeds map
bijectively, and both streaming forms yield the same ids."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.protocol.generate import (
    GenerateChunk,
    GenerateRequest,
    HolderRef,
    LumenExt,
    MetaInfo,
    SamplingParams,
    StreamError,
    decode_chunk,
    encode,
    new_output_ids,
)
from gateway.protocol.sglang import (
    RID_HEX_DIGITS,
    SGLangAbort,
    SGLangVerifyMeta,
    SGLangVerifyResponse,
    parse_kv_hints,
    sglang_rid,
    sglang_seed,
    to_sglang,
    verified_tokens,
    verify_body,
)
from tests.fixtures import sglang_api_types as api_types


def _req(**sp: object) -> GenerateRequest:
    return GenerateRequest(
        rid="req-abc-3",
        input_ids=[1, 2, 3],
        sampling_params=SamplingParams(**sp),  # type: ignore[arg-type]
        lumen=LumenExt(epoch=4, seed_base=99),
    )


@pytest.mark.parametrize(
    "sp",
    [
        {"max_new_tokens": 5, "temperature": 0.0},
        {"max_new_tokens": 5, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "stop_token_ids": [7]},
        {"max_new_tokens": 1, "temperature": 1.0, "ignore_eos": True},
    ],
)
def test_bodies_pass_sglangs_own_contract(sp: dict[str, object]) -> None:
    body = json.loads(encode(to_sglang(_req(**sp), seed_base=2**64 - 1)))
    parsed = api_types.GenerateRequest.from_json_value(body)
    assert "lumen" not in body and parsed.input_ids == [1, 2, 3]
    assert parsed.sampling_params.max_new_tokens == sp["max_new_tokens"]
    api_types.AbortRequest.from_json_value(json.loads(encode(SGLangAbort(rid=body["rid"]))))


def test_the_contract_refuses_lumens_extension_in_sampling_params() -> None:
    """The stand-in's contract is strict where SGLang is: an unknown sampling key is a 400."""
    with pytest.raises(api_types.JsonContractError):
        api_types.GenerateRequest.from_json_value(
            {"input_ids": [1], "sampling_params": {"max_new_tokens": 1, "seed_base": 3}}
        )


def test_greedy_sends_no_seed_and_sampling_sends_a_signed_one() -> None:
    assert to_sglang(_req(temperature=0.0), seed_base=5).sampling_params.sampling_seed is None
    assert to_sglang(_req(temperature=0.8), seed_base=2**64 - 1).sampling_params.sampling_seed == -1


@given(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1))
def test_seed_mapping_is_a_bijection_into_int64(a: int, b: int) -> None:
    assert -(2**63) <= sglang_seed(a) < 2**63
    assert (sglang_seed(a) == sglang_seed(b)) == (a == b)


@given(st.lists(st.text(min_size=1, max_size=20), min_size=2, max_size=20, unique=True))
def test_rids_are_fixed_length_and_no_one_is_a_prefix_of_another(rids: list[str]) -> None:
    out = [sglang_rid(r) for r in rids]
    assert all(len(r) == RID_HEX_DIGITS for r in out) and len(set(out)) == len(out)
    assert not any(a != b and b.startswith(a) for a in out for b in out)


@given(st.lists(st.lists(st.integers(0, 1000), max_size=4), min_size=1, max_size=8))
def test_both_streaming_forms_give_the_same_ids(steps: list[list[int]]) -> None:
    """SGLang's default (cumulative ids) and incremental streaming read as the same sequence."""
    sent: list[int] = []
    cumulative_got: list[int] = []
    incremental_got: list[int] = []
    for new in steps:
        sent.extend(new)
        cum = GenerateChunk(list(sent), MetaInfo("r", 3, len(sent)), None)
        inc = GenerateChunk(list(new), MetaInfo("r", 3, len(sent)), None)
        cumulative_got += new_output_ids(cum, len(cumulative_got))
        incremental_got += new_output_ids(inc, len(incremental_got))
    assert cumulative_got == incremental_got == sent


def test_sglang_chunks_and_error_chunks_decode() -> None:
    chunk = decode_chunk(
        b'{"text": null, "output_ids": [5, 6], "meta_info": {"id": "x", "finish_reason": null,'
        b' "prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 0, "e2e_latency": 0.1}}'
    )
    assert chunk.output_ids == [5, 6] and chunk.text is None
    done = decode_chunk(
        b'{"text": "ab", "output_ids": [5, 6], "meta_info": {"id": "x", "prompt_tokens": 3,'
        b' "completion_tokens": 2, "finish_reason": {"type": "stop", "matched": "\\n"}}}'
    )
    assert done.meta_info.finish_reason is not None and done.meta_info.finish_reason.matched == "\n"
    with pytest.raises(StreamError, match="out of memory"):
        decode_chunk(b'{"error": {"message": "out of memory", "code": 500}}')
    with pytest.raises(msgspec.ValidationError):
        decode_chunk(b'{"something": 1}')


def _verify_answer(context: list[int], drafts: list[int], greedy: list[int]) -> SGLangVerifyResponse:
    """What SGLang answers a verification: row 0 null, row i + 1 the greedy token where draft i is,
    and the output token after the last draft. `greedy[j]` is the target's token at context end + j."""
    rows = [None, *([(-0.1, greedy[i], None)] for i in range(len(drafts)))]
    return SGLangVerifyResponse(
        output_ids=[greedy[len(drafts)]], meta_info=SGLangVerifyMeta(input_top_logprobs=rows)
    )


@given(st.lists(st.integers(0, 5), min_size=0, max_size=8), st.data())
def test_verified_tokens_are_plain_greedy_decodings(drafts: list[int], data: st.DataObject) -> None:
    greedy = data.draw(st.lists(st.integers(0, 5), min_size=len(drafts) + 1, max_size=len(drafts) + 1))
    tokens, n_ok = verified_tokens(drafts, _verify_answer([1, 2], drafts, greedy))
    agree = 0
    while agree < len(drafts) and drafts[agree] == greedy[agree]:
        agree += 1
    assert n_ok == agree and tokens == greedy[: agree + 1]


def test_verify_body_asks_for_the_top1_of_every_draft_position() -> None:
    body = verify_body("r" * 32, [5, 6, 7], [8, 9])
    assert body.input_ids == [5, 6, 7, 8, 9] and body.logprob_start_len == 2 and body.top_logprobs_num == 1
    assert body.sampling_params.max_new_tokens == 1 and body.sampling_params.temperature == 0.0
    api_types.GenerateRequest.from_json_value(json.loads(encode(body)))
    with pytest.raises(ValueError, match="logprob rows"):
        verified_tokens([1], SGLangVerifyResponse(output_ids=[1]))


def test_a_streaming_request_says_so() -> None:
    """SGLang's default is not to stream: `stream: true` must be on the wire."""
    assert json.loads(encode(to_sglang(_req(temperature=0.0), seed_base=None)))["stream"] is True


def test_holders_become_kv_hints_that_pass_sglangs_contract() -> None:
    req = GenerateRequest(
        rid="req-9-1",
        input_ids=[1, 2, 3],
        sampling_params=SamplingParams(max_new_tokens=4, temperature=0.0),
        lumen=LumenExt(epoch=7, checkpoint=[HolderRef(worker_id="sg1", kv_endpoint="tcp://10.0.0.2:7000")]),
    )
    body = json.loads(encode(to_sglang(req, seed_base=None, epoch=7, src_worker="sg0")))
    api_types.GenerateRequest.from_json_value(body)
    ck = parse_kv_hints(body["kv_hints"])
    assert ck is not None and ck.rid == body["rid"] and ck.epoch == 7 and ck.src_worker == "sg0"
    assert [(h.worker_id, h.kv_endpoint) for h in ck.holders] == [("sg1", "tcp://10.0.0.2:7000")]
    # no holders, or no serving worker named: no hints at all
    assert "kv_hints" not in json.loads(encode(to_sglang(_req(temperature=0.0), seed_base=None)))
