"""The draft-assist plane's messages: round trips, version refusal, validation."""

from __future__ import annotations

import msgspec
import pytest

from gateway.protocol import draft
from gateway.protocol.versions import DRAFT_PROTOCOL_VERSION


def item(**kw: object) -> draft.DraftItem:
    base: dict[str, object] = dict(rid="r1", sync_tokens=[1, 2, 3], position=3, k=4, full=True)
    base.update(kw)
    return draft.DraftItem(**base)  # type: ignore[arg-type]


def test_request_round_trip() -> None:
    req = draft.DraftRequest(
        round=7,
        batch=[
            item(),
            item(
                rid="r2",
                sync_tokens=[9],
                position=40,
                full=False,
                temperature=0.7,
                top_p=0.9,
                top_k=5,
                seed_base=2**63 + 5,
                want_q=True,
            ),
        ],
        release=["old"],
    )
    got = draft.decode_request(draft.encode_request(req))
    assert got == req and got.v == DRAFT_PROTOCOL_VERSION
    assert got.batch[1].seed_base == 2**63 + 5


def test_reply_round_trip_with_and_without_q() -> None:
    rep = draft.DraftReply(
        round=7,
        drafts=[
            draft.DraftTokens(rid="r1", tokens=[5, 6]),
            draft.DraftTokens(
                rid="r2",
                tokens=[8],
                q_probs=[draft.QDist(tokens=[8, 9], probs=[0.75, 0.25])],
            ),
            draft.DraftTokens(rid="r3", tokens=[], resync=True),
        ],
    )
    got = draft.decode_reply(draft.encode_reply(rep))
    assert got == rep
    assert got.drafts[0].q_probs is None and got.drafts[2].resync


def test_a_wrong_version_is_a_clear_error() -> None:
    raw = msgspec.msgpack.encode({**msgspec.structs.asdict(draft.DraftRequest(round=1, batch=[])), "v": 2})
    with pytest.raises(draft.DraftProtocolError, match="draft protocol version 2 is not supported"):
        draft.decode_request(raw)
    raw = msgspec.msgpack.encode({"v": 0, "round": 1, "drafts": []})
    with pytest.raises(draft.DraftProtocolError, match="version 0 is not supported"):
        draft.decode_reply(raw)


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (b"\xc1garbage", "malformed"),
        (b"", "malformed"),
        (msgspec.msgpack.encode({"v": 1, "round": -1, "batch": []}), "malformed"),
        (msgspec.msgpack.encode({"v": 1, "round": 1, "batch": [], "extra": 1}), "malformed"),
        (draft.encode_request(draft.DraftRequest(round=1, batch=[item(k=65)])), "malformed"),
        (draft.encode_request(draft.DraftRequest(round=1, batch=[item(rid="")])), "malformed"),
        (draft.encode_request(draft.DraftRequest(round=1, batch=[item(top_p=0.0)])), "malformed"),
        (draft.encode_request(draft.DraftRequest(round=1, batch=[item(), item()])), "appears twice"),
        (draft.encode_request(draft.DraftRequest(round=1, batch=[item(position=4)])), "full sync of 3"),
        (
            draft.encode_request(draft.DraftRequest(round=1, batch=[item(full=False, position=2)])),
            "exceed position",
        ),
    ],
)
def test_bad_requests_are_refused(payload: bytes, match: str) -> None:
    with pytest.raises(draft.DraftProtocolError, match=match):
        draft.decode_request(payload)


def test_bad_replies_are_refused() -> None:
    too_many_q = draft.DraftReply(
        round=1, drafts=[draft.DraftTokens(rid="r", tokens=[1], q_probs=[draft.QDist([1], [1.0])] * 2)]
    )
    with pytest.raises(draft.DraftProtocolError, match="2 q rows for 1 drafts"):
        draft.decode_reply(draft.encode_reply(too_many_q))
    ragged = draft.DraftReply(
        round=1, drafts=[draft.DraftTokens(rid="r", tokens=[1], q_probs=[draft.QDist([1, 2], [1.0])])]
    )
    with pytest.raises(draft.DraftProtocolError, match="2 ids, 1 probs"):
        draft.decode_reply(draft.encode_reply(ragged))
    bad_prob = msgspec.msgpack.encode(
        {
            "v": 1,
            "round": 1,
            "drafts": [{"rid": "r", "tokens": [1], "q_probs": [{"tokens": [1], "probs": [1.5]}]}],
        }
    )
    with pytest.raises(draft.DraftProtocolError, match="malformed"):
        draft.decode_reply(bad_prob)
    with pytest.raises(draft.DraftProtocolError, match="drafts exceed"):
        draft.decode_reply(
            draft.encode_reply(draft.DraftReply(round=1, drafts=[draft.DraftTokens("r", [1] * 65)]))
        )
