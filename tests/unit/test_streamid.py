"""Stream positions (SSE ids): round trip, and every way a forged, foreign or mismatched one is refused."""

from __future__ import annotations

import base64
import hashlib
import hmac

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.protocol.streamid import (
    STREAM_ID_VERSION,
    ChoicePosition,
    PositionSigner,
    StreamIdError,
    StreamPosition,
    caller_digest,
    decode_position,
    encode_position,
    read_position,
    request_digest,
    stream_key,
)

KEY = stream_key("cluster-token-0123456789")
BODY = {"prompt": "hi", "max_tokens": 8, "stream": True}
REQ = request_digest(BODY)

choices = st.builds(
    ChoicePosition,
    sent=st.integers(0, 10**6),
    seed=st.integers(0, 2**64 - 1),
    done=st.booleans(),
    worker=st.text(max_size=12),
    wrid=st.text(max_size=40),
    epoch=st.integers(0, 2**63 - 1),
)
positions = st.builds(
    StreamPosition,
    v=st.just(STREAM_ID_VERSION),
    rid=st.text(max_size=40),
    created=st.integers(0, 2**40),
    request=st.just(REQ),
    caller=st.sampled_from(["", caller_digest("key-a")]),
    choices=st.lists(choices, min_size=1, max_size=16).map(tuple),
    closed=st.booleans(),
)


@given(positions)
def test_a_position_round_trips(pos: StreamPosition) -> None:
    text = encode_position(KEY, pos)
    assert "\n" not in text and "\r" not in text  # one SSE id line
    assert decode_position(KEY, text, request=REQ, caller=pos.caller) == pos


@given(positions, st.integers(0, 10**4), st.integers(0, 255))
def test_any_changed_byte_is_refused(pos: StreamPosition, where: int, value: int) -> None:
    text = encode_position(KEY, pos)
    i = where % len(text)
    forged = text[:i] + chr(value) + text[i + 1 :]
    if forged == text:
        return
    with pytest.raises(StreamIdError):
        decode_position(KEY, forged, request=REQ, caller=pos.caller)


def test_foreign_cluster_other_request_other_caller_are_refused() -> None:
    pos = StreamPosition(STREAM_ID_VERSION, "cmpl-1", 1, REQ, caller_digest("key-a"), (ChoicePosition(3, 9),))
    text = encode_position(KEY, pos)
    with pytest.raises(StreamIdError, match="cluster"):
        decode_position(stream_key("another-cluster-token"), text, request=REQ, caller=pos.caller)
    with pytest.raises(StreamIdError, match="another request"):
        decode_position(KEY, text, request=request_digest({**BODY, "max_tokens": 9}), caller=pos.caller)
    with pytest.raises(StreamIdError, match="another caller"):
        decode_position(KEY, text, request=REQ, caller=caller_digest("key-b"))
    for junk in ("", ".", "abc", "!!!.???", "x" * 9000):
        with pytest.raises(StreamIdError):
            decode_position(KEY, junk, request=REQ, caller=pos.caller)


def test_the_request_digest_ignores_key_order_only() -> None:
    assert request_digest({"a": 1, "b": [1, 2]}) == request_digest({"b": [1, 2], "a": 1})
    assert request_digest({"a": 1}) != request_digest({"a": 2})


def test_ids_of_the_previous_format_are_refused() -> None:
    """Version 1 was `base64url(msgpack position) "." base64url(HMAC-SHA256 tag)`: after the upgrade
    such an id is a 400 (the client starts again), never misread."""
    pos = StreamPosition(1, "cmpl-1", 1, REQ, "", (ChoicePosition(3, 9),))
    payload = msgspec.msgpack.encode(pos)
    tag = hmac.new(KEY, payload, hashlib.sha256).digest()[:16]
    old = ".".join(base64.urlsafe_b64encode(b).rstrip(b"=").decode() for b in (payload, tag))
    with pytest.raises(StreamIdError):
        decode_position(KEY, old, request=REQ, caller="")


@given(positions)
def test_a_streams_signer_gives_the_ids_of_its_positions(pos: StreamPosition) -> None:
    seeds = tuple(c.seed for c in pos.choices)
    signer = PositionSigner(KEY, pos.rid, pos.created, pos.request, pos.caller, seeds)
    steps = tuple((c.sent, c.done, c.worker, c.wrid, c.epoch) for c in pos.choices)
    text = signer.sign(steps, closed=pos.closed, cached=pos.cached)
    assert text == encode_position(KEY, pos)
    assert read_position(KEY, text) == pos
