"""The chaos checker on hand-made histories: a clean one passes, and each rule has one that breaks it."""

from __future__ import annotations

from typing import Any

import pytest

from loadtests.chaos.checker import FENCE_SLACK_S, check_history

WANT = "abcdefghij"


def expected(h: dict[str, Any]) -> str:
    return WANT[: h["max_tokens"]]


def request(
    idx: int = 0, chunks: tuple[str, ...] = ("abc", "def", "ghij"), worker: str = "w0"
) -> dict[str, Any]:
    events, t, sent = [], 0.1, 0
    for c in chunks:
        sent += len(c)
        events.append([t, 0, c, sent, worker, 7, sent == len(WANT), True])
        t += 0.1
    return {
        "idx": idx,
        "prompt_ids": [65],
        "max_tokens": len(WANT),
        "temperature": 0.0,
        "seed": None,
        "events": events,
        "attempts": [{"t": 0.0, "gateway": 0, "resumed": False, "status": 200, "end": "done", "error": None}],
        "status": 200,
        "error": None,
        "finish_reason": "length",
    }


def history(*reqs: dict[str, Any]) -> dict[str, Any]:
    return {
        "ok_start": True,
        "requests": list(reqs) or [request()],
        "samples": [
            {"t": 1.0, "gateway": 0, "workers": [{"id": "w0", "ckpt_bytes": 10, "ckpt_budget_bytes": 100}]}
        ],
        "state_events": [],
        "faults": [{"kind": "kill", "mode": "kill", "ok": True, "undo_of": None}],
        "net_faults": [
            {"kind": "partition", "mode": "inject", "ok": True},
            {"kind": "partition", "mode": "heal", "ok": True},
        ],
        "drained": True,
    }


def rules(h: dict[str, Any]) -> dict[str, int]:
    return check_history(h, expected).by_rule()


def test_a_clean_history_passes() -> None:
    resumed = request(1)
    resumed["attempts"].insert(0, {"t": 0.0, "gateway": 1, "resumed": False, "end": "broken", "error": "x"})
    resumed["attempts"][1]["resumed"] = True
    rep = check_history(history(request(), resumed), expected)
    assert rep.ok, rep.violations
    assert (rep.requests, rep.exact, rep.resumed, rep.events_checked) == (2, 2, 1, 6)
    assert rep.faults == {"kill": 1, "partition": 1}


def test_a_clean_error_is_not_a_violation() -> None:
    r = request(chunks=("abc",))
    r.update(error="no worker", finish_reason=None)
    r["attempts"][-1]["end"] = "error"
    rep = check_history(history(r), expected)
    assert rep.ok and rep.clean_errors == 1 and rep.exact == 0


def test_a_run_that_did_not_start_fails() -> None:
    assert rules({"ok_start": False, "error": "no cluster"}) == {"start": 1}


@pytest.mark.parametrize(
    ("change", "rule"),
    [
        ("wrong_text", "outcome"),
        ("truncated", "outcome"),
        ("duplicate", "stream"),
        ("skip", "stream"),
        ("bad_position", "stream"),
        ("forged_id", "stream"),
        ("over_budget", "budget"),
        ("not_drained", "drain"),
        ("fenced_output", "fenced"),
    ],
)
def test_each_rule_catches_its_violation(change: str, rule: str) -> None:
    h = history()
    r = h["requests"][0]
    if change == "wrong_text":  # completed, every position consistent, other tokens
        r["events"][1][2] = "dXf"
    elif change == "truncated":  # the stream stopped, no error the client could act on
        r["events"] = r["events"][:2]
        r.update(finish_reason=None, error="stream truncated")
        r["attempts"][-1]["end"] = "broken"
    elif change == "duplicate":  # a resumed stream repeats what the client had
        r["events"].insert(2, [0.25, 1, "def", 9, "w1", 3, False, True])
    elif change == "skip":  # a token missing, the rest shifted: positions say so
        r["events"][1] = [0.2, 0, "de", 6, "w0", 7, False, True]
    elif change == "bad_position":  # the text is right but the id counts otherwise
        r["events"][0][3] = 4
    elif change == "forged_id":
        r["events"][2][7] = False
    elif change == "over_budget":
        h["samples"].append(
            {"t": 2.0, "gateway": 0, "workers": [{"id": "w1", "ckpt_bytes": 101, "ckpt_budget_bytes": 100}]}
        )
    elif change == "not_drained":
        h["drained"] = False
    elif change == "fenced_output":  # gateway 0 fenced w0/7 at 0.1 s; its event at 0.1 + slack + 0.1 s
        h["state_events"] = [{"t": 0.1, "gateway": 0, "worker": "w0", "incarnation": 7, "to": "FAILED"}]
        r["events"][2][0] = 0.1 + FENCE_SLACK_S + 0.1
    got = rules(h)
    assert got.get(rule, 0) >= 1, got
    # a broken stream is also a wrong outcome, and wrong text also breaks the stream rule
    allowed = {rule, "outcome", "stream"} if rule == "outcome" else {rule, "outcome"}
    assert set(got) <= allowed, got


def test_fencing_is_per_gateway_and_per_incarnation() -> None:
    """Output of w0/7 through gateway 1 after gateway 0 (only) fenced it is allowed: gateway 1 has not
    fenced it; output of another incarnation after the fence is allowed too."""
    h = history()
    h["state_events"] = [{"t": 0.0, "gateway": 0, "worker": "w0", "incarnation": 7, "to": "FAILED"}]
    for ev in h["requests"][0]["events"]:
        ev[1] = 1
        ev[0] += FENCE_SLACK_S + 1
    assert rules(h) == {}
    h2 = history()
    h2["state_events"] = [{"t": 0.0, "gateway": 0, "worker": "w0", "incarnation": 6, "to": "FAILED"}]
    for ev in h2["requests"][0]["events"]:
        ev[0] += FENCE_SLACK_S + 1
    assert rules(h2) == {}


def test_output_written_before_the_fence_may_arrive_late_nothing_after_it() -> None:
    """A partition between gateway and client holds what the gateway wrote before its fence until the
    heal: those positions (up to the interruption's `emitted_before`) arrive late and are no violation;
    one position more from the fenced incarnation is (as in the 30-minute soak, request 6018)."""

    def late_history(emitted_before: int) -> dict[str, Any]:
        h = history()
        r = h["requests"][0]
        r["rid"] = "cmpl-1"
        h["state_events"] = [{"t": 0.0, "gateway": 0, "worker": "w0", "incarnation": 7, "to": "FAILED"}]
        for ev in r["events"]:
            ev[0] += FENCE_SLACK_S + 1  # all of it after the slack
        h["interruptions"] = [
            {
                "t": 0.0,
                "gateway": 0,
                "rid": "cmpl-1",
                "worker": "w0",
                "incarnation": 7,
                "emitted_before": emitted_before,
            }
        ]
        return h

    assert rules(late_history(len(WANT))) == {}  # every position was written before the fence
    assert rules(late_history(len(WANT) - 1)) == {"fenced": 1}  # the last one was not
    other = late_history(len(WANT))
    other["interruptions"][0]["incarnation"] = 6  # an interruption of another incarnation excuses nothing
    assert rules(other) == {"fenced": 1}
