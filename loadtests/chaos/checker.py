"""A Jepsen-style checker for one chaos run's history (loadtests/chaos/driver.py writes it). Pure: a
history in, a report out; tests feed it hand-made histories that break each rule.

Rules:
- `outcome`: every request either completed with exactly its no-failure output, or ended with a clean
  error the client saw (an HTTP error status or an SSE error event). A stream that just stopped (no
  [DONE], no error, every resume tried) or a completed one with other text is a violation.
- `stream`: no token duplicated or skipped: each event's text continues the expected output exactly
  where the previous one ended, and its signed position (`id:`) counts exactly the tokens received;
  a position whose signature does not verify is a violation too.
- `budget`: no holder ever reported more checkpoint bytes than its budget (every /admin/workers sample).
- `drain`: after the load every store emptied (every gateway that answered saw 0 bytes everywhere).
- `fenced`: no event served by an incarnation reached the client through a gateway later than
  `FENCE_SLACK_S` after that gateway declared the incarnation FAILED (events already in flight —
  retransmitted under loss — get that much time; measured on one clock, the driver's), unless the
  gateway had written it before the fence: its position is within the output the gateway recorded as
  emitted when it noticed the failure (`emitted_before` of the request's interruption, from
  /admin/sessions). A partition between that gateway and the client holds such events in the
  gateway's socket until it heals, which can be longer than any fixed slack (the 30-minute soak: a
  token written just as `gw0|all` began arrived 1.17 s after gw0's fence, 0.15 s after the heal).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec

FENCE_SLACK_S = 1.0
RULES = ("start", "outcome", "stream", "budget", "drain", "fenced")


class Violation(msgspec.Struct, frozen=True):
    rule: str
    detail: str
    request: int | None = None


class CheckReport(msgspec.Struct):
    requests: int = 0
    exact: int = 0
    clean_errors: int = 0
    resumed: int = 0
    events_checked: int = 0
    failed_events: int = 0  # worker incarnations some gateway declared FAILED
    faults: dict[str, int] = msgspec.field(default_factory=dict)
    violations: list[Violation] = msgspec.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def by_rule(self) -> dict[str, int]:
        return dict(Counter(v.rule for v in self.violations))


def synthetic_expected(h: dict[str, Any]) -> str:
    """The synthetic model's no-failure output for a request of the history."""
    from loadtests.client import RequestResult
    from loadtests.demo import expected_text

    r = RequestResult(h["idx"], 0.0, h["prompt_ids"], h["max_tokens"], h["temperature"], h["seed"])
    return expected_text(r)


def check_history(
    history: dict[str, Any], expected: Callable[[dict[str, Any]], str] = synthetic_expected
) -> CheckReport:
    rep = CheckReport()
    if not history.get("ok_start"):
        rep.violations.append(Violation("start", str(history.get("error", "the run did not start"))))
        return rep
    fences = _fences(history.get("state_events", []))
    written = _written_before_fence(history.get("interruptions", []))
    rep.failed_events = len(fences)
    for f in [*history.get("faults", []), *history.get("net_faults", [])]:
        if f.get("mode") not in ("heal", "heal-at-end") and not f.get("undo_of"):
            name = f"{f.get('kind')}{'' if f.get('ok') else ' (not fired)'}"
            rep.faults[name] = rep.faults.get(name, 0) + 1
    for h in history.get("requests", []):
        rep.requests += 1
        rep.resumed += sum(1 for a in h.get("attempts", [])[1:] if a.get("resumed"))
        want = expected(h)
        _check_outcome(h, want, rep)
        _check_stream(h, want, fences, written, rep)
    _check_budget(history.get("samples", []), rep)
    if not history.get("drained", False):
        rep.violations.append(
            Violation("drain", "the checkpoint stores were not all empty after the drain wait")
        )
    return rep


def _fences(events: list[dict[str, Any]]) -> dict[tuple[int, str, int], float]:
    """(gateway, worker, incarnation) -> when that gateway first declared it FAILED."""
    out: dict[tuple[int, str, int], float] = {}
    for e in events:
        if e.get("to") == "FAILED":
            k = (int(e["gateway"]), str(e["worker"]), int(e["incarnation"]))
            out[k] = min(out.get(k, float("inf")), float(e["t"]))
    return out


def _written_before_fence(interruptions: list[dict[str, Any]]) -> dict[tuple[int, str, str, int | None], int]:
    """(gateway, rid, worker, incarnation or None) -> the output the gateway had emitted to the client
    when it noticed that worker's failure (the most, over that request's interruptions there)."""
    out: dict[tuple[int, str, str, int | None], int] = {}
    for it in interruptions:
        inc = it.get("incarnation")
        k = (int(it["gateway"]), str(it["rid"]), str(it["worker"]), None if inc is None else int(inc))
        out[k] = max(out.get(k, 0), int(it.get("emitted_before", 0)))
    return out


def _check_outcome(h: dict[str, Any], want: str, rep: CheckReport) -> None:
    text = "".join(ev[2] for ev in h.get("events", []))
    idx = int(h["idx"])
    if h.get("error") is None and h.get("finish_reason") is not None:
        if text == want:
            rep.exact += 1
        else:
            at = next(
                (i for i, (a, b) in enumerate(zip(text, want, strict=False)) if a != b),
                min(len(text), len(want)),
            )
            rep.violations.append(
                Violation(
                    "outcome",
                    f"completed with other text: {len(text)} chars vs {len(want)}, first difference at {at}",
                    idx,
                )
            )
        return
    ends = [a.get("end") for a in h.get("attempts", [])]
    if ends and ends[-1] == "error":
        rep.clean_errors += 1
    else:
        rep.violations.append(
            Violation(
                "outcome", f"no answer and no clean error after {len(ends)} attempts: {h.get('error')}", idx
            )
        )


def _check_stream(
    h: dict[str, Any],
    want: str,
    fences: dict[tuple[int, str, int], float],
    written: dict[tuple[int, str, str, int | None], int],
    rep: CheckReport,
) -> None:
    idx = int(h["idx"])
    acc = 0
    for t, g, text, sent, worker, epoch, _done, id_ok in h.get("events", []):
        rep.events_checked += 1
        if not id_ok:
            rep.violations.append(
                Violation("stream", f"event at {t:.3f}s has an id that does not verify", idx)
            )
            return
        if text:
            if want[acc : acc + len(text)] != text:
                what = "repeats tokens" if text and want[max(0, acc - len(text)) : acc] == text else "differs"
                rep.violations.append(
                    Violation("stream", f"text at position {acc} {what} ({text[:20]!r})", idx)
                )
                return
            acc += len(text)
        if sent is not None and sent != acc:
            kind = "skipped" if sent > acc else "duplicated"
            rep.violations.append(
                Violation("stream", f"position says {sent} tokens, the client has {acc}: tokens {kind}", idx)
            )
            return
        if worker and epoch is not None:
            fenced_at = fences.get((int(g), str(worker), int(epoch)))
            before = max(
                written.get((int(g), str(h.get("rid", "")), str(worker), int(epoch)), -1),
                written.get((int(g), str(h.get("rid", "")), str(worker), None), -1),
            )
            late = fenced_at is not None and t > fenced_at + FENCE_SLACK_S
            if late and not (sent is not None and sent <= before):
                rep.violations.append(
                    Violation(
                        "fenced",
                        f"{worker} incarnation {epoch} output reached the client through gateway {g} at "
                        f"{t:.3f}s, {t - fenced_at:.3f}s after that gateway fenced it",
                        idx,
                    )
                )
                return


def _check_budget(samples: list[dict[str, Any]], rep: CheckReport) -> None:
    for s in samples:
        for w in s.get("workers", []):
            budget, used = w.get("ckpt_budget_bytes") or 0, w.get("ckpt_bytes") or 0
            if budget > 0 and used > budget:
                rep.violations.append(
                    Violation(
                        "budget",
                        f"{w['id']} held {used} bytes over its budget {budget} at {s['t']}s (gateway {s['gateway']})",
                    )
                )
                return
