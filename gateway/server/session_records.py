"""What a request session records: its progress, and each interruption and how it was resumed
(sessions.py runs them; /admin/sessions, the demo and the sim/live equivalence test read them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.server.api.jobs import GenerateJob


@dataclass(slots=True)
class Interruption:
    worker_id: str
    incarnation: int
    reason: str
    at: float
    emitted_before: int
    # the last token the client got before the failure (or the arrival, if none yet)
    last_token_before: float
    resumed_on: str | None = None
    resumed_at: float | None = None  # first token after the failure
    action: str = "replay"  # how dispatch resumed it: restore (on a holder) or replay
    dispatch_reason: str = ""
    restored_tokens: int = 0  # prefix the resuming worker restored from its checkpoint store

    @property
    def resume_delay(self) -> float | None:
        return None if self.resumed_at is None else self.resumed_at - self.last_token_before


@dataclass(slots=True)
class Session:
    job: GenerateJob
    seed_base: int
    arrived: float
    emitted: list[int] = field(default_factory=list)
    worker_id: str | None = None
    incarnation: int = 0
    attempts: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    interruptions: list[Interruption] = field(default_factory=list)
    finish_reason: str | None = None
    # a resumed stream: "adopt" (taken over on its worker), "replay" (recomputed), "" (not resumed)
    resumed_by: str = ""

    @property
    def remaining(self) -> int:
        return self.job.sampling.max_new_tokens - len(self.emitted)

    def finished_by_tokens(self) -> str | None:
        """Whether the emitted tokens already complete the request (a failure after the last token)."""
        s = self.job.sampling
        if self.emitted and not s.ignore_eos and self.emitted[-1] in s.stop_token_ids:
            return "stop"
        if self.remaining <= 0:
            return "length"
        return None
