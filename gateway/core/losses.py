"""Why a worker stream ended without finishing: one enum, carried by the gateway's `WorkerLost` and
decided on by kind, never by the text of its reason (issue 28: a stall used to travel as the prefix
`"stall: ..."` of a string). Pure data, shared by the worker registry (the load monitor), the data
client, the sessions and the recovery coordinator.

The first group is the end of the worker incarnation itself, the registry's verdict: every stream
watching the incarnation is interrupted with it. The second group is one stream's own trouble, found
by that stream; what the session does with each is written next to it.
"""

from __future__ import annotations

import enum


class Loss(enum.Enum):
    # -- the incarnation ended (the registry's verdict; its streams are interrupted) -----------------
    # its control stream ended or broke: the process is gone
    KILLED = "killed"
    # silent past the detector's bound with its probe unanswered, or a seed that stopped generating
    HUNG = "hung"
    # failed for another reason: replaced by a new incarnation, removed, a stale epoch (409, reset)
    FENCED = "fenced"
    # a gray failure: alive but far slower per token than its peers (not failed; its streams move)
    DEGRADED = "degraded"
    # -- one stream's own trouble ----------------------------------------------------------------
    # the data connection broke: the session fails the incarnation for it
    CONNECTION = "connection"
    # closed before any answer (a pooled connection the server had just closed): moved, not failed
    UNANSWERED = "unanswered"
    # the gateway's own timeout: no headers or no chunk within the bound; moved, the worker excluded
    STALLED = "stalled"
    # an error or malformed chunk, bad logprobs: alive but gave up on it; moved, the worker excluded
    WORKER_ERROR = "worker_error"
    # the worker aborted the request
    ABORTED = "aborted"
    # the worker dropped it on becoming a new incarnation (another gateway fenced it)
    RESET = "reset"
    # the stream ended without a finish reason
    ENDED = "ended"
    # the incarnation was gone or replaced before the attempt could start
    GONE = "gone"

    @property
    def fails_incarnation(self) -> bool:
        """The session fails the incarnation it addressed (so the next pick does not address it)."""
        return self in (Loss.CONNECTION, Loss.RESET)

    @property
    def excludes_worker(self) -> bool:
        """The worker is alive, but this request does not go back to it."""
        return self in (Loss.STALLED, Loss.WORKER_ERROR)
