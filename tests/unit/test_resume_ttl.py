"""Stream ids expire (issue 29): a Last-Event-ID older than recovery.resume_ttl_s, counted from its
response's `created`, resumes nothing (400 expired_last_event_id); a fresh one resumes as before."""

from __future__ import annotations

import time

import pytest

from gateway.config import ConfigError, load_config
from gateway.protocol.streamid import ChoiceStep, PositionSigner, caller_digest, request_digest, stream_key
from gateway.server.api.errors import InvalidRequest
from gateway.server.api.resume import resume_point

KEY = stream_key("control-token-for-tests-0123456789")
BODY: dict[str, object] = {"prompt": "hi", "stream": True}


def an_id(created: int) -> str:
    signer = PositionSigner(KEY, "cmpl-1", created, request_digest(BODY), caller_digest(""), (7,))
    step: ChoiceStep = (3, False, "w0", "r-1", 1)
    return signer.sign((step,))


def test_an_old_stream_id_is_refused_and_a_fresh_one_resumes() -> None:
    now = time.time()
    ttl = load_config().recovery.resume_ttl_s
    assert ttl == 3600.0  # the documented default
    fresh = resume_point(an_id(int(now) - 60), KEY, BODY, "", 1, True, ttl_s=ttl, now=now)
    assert fresh is not None and fresh.resumed(0).sent == 3
    with pytest.raises(InvalidRequest) as err:
        resume_point(an_id(int(now - ttl) - 5), KEY, BODY, "", 1, True, ttl_s=ttl, now=now)
    assert err.value.code == "expired_last_event_id" and "recovery.resume_ttl_s" in str(err.value)


def test_the_ttl_must_be_positive() -> None:
    with pytest.raises(ConfigError, match=r"recovery\.resume_ttl_s"):
        load_config(overrides={"recovery.resume_ttl_s": 0})
