"""A request session and what it records: its progress, each interruption and how it was resumed
(sessions.py runs them; /admin/sessions, the demo and the sim/live equivalence test read them).

A session's bookkeeping is its own methods, so following a request does not leave the session: what
its next attempt sends (`next_request`), a chunk's logprobs (`chunk_logprobs`), tokens arriving
(`tokens_arrived`: the first token, the open interruption's resume and what it restored), an attempt
breaking (`interrupted`), whether it is already done (`finished_by_tokens`). They decide nothing and
touch no metrics: the failover loop (sessions.py) does, from what they return."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.core.losses import Loss
from gateway.protocol.generate import (
    EngineKind,
    GenerateChunk,
    GenerateRequest,
    HolderRef,
    LumenExt,
    SamplingParams,
    TokenLogprob,
    token_logprobs,
)
from gateway.server.api.jobs import GenerateJob
from gateway.server.workers.client import WorkerLost


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
    kind: Loss | None = None  # the kind of loss (gateway/core/losses.py); None: the worker refused

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
    # attempts addressed to an incarnation the worker no longer is (a 409, or dropped at its reset)
    refused: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    interruptions: list[Interruption] = field(default_factory=list)
    finish_reason: str | None = None
    # a resumed stream: "adopt" (taken over on its worker), "replay" (recomputed), "" (not resumed)
    resumed_by: str = ""

    @property
    def remaining(self) -> int:
        return self.job.sampling.max_new_tokens - len(self.emitted)

    @property
    def resuming(self) -> Interruption | None:
        """The interruption this session is resuming from (no token since), if any."""
        it = self.interruptions[-1] if self.interruptions else None
        return it if it is not None and it.resumed_at is None else None

    def next_request(
        self, wrid: str, epoch: int, holders: list[HolderRef], orphan_grace_s: float
    ) -> GenerateRequest:
        """The `/generate` body of the next attempt: the prompt and everything emitted so far, the rest
        of the budget, the seed base."""
        return attempt_request(self, wrid, epoch, holders, orphan_grace_s)

    def chunk_logprobs(self, chunk: GenerateChunk, worker_id: str) -> tuple[TokenLogprob, ...]:
        """The chunk's logprobs when the job asked for them; a chunk without them is the worker's error."""
        return chunk_logprobs(self, chunk, worker_id)

    def tokens_arrived(self, engine: EngineKind, worker_id: str, chunk: GenerateChunk, now: float) -> Arrival:
        """Tokens of `chunk` reached the session at `now` from `worker_id`: the first token's time, and
        the open interruption resumed (with the prefix its attempt restored)."""
        first = self.first_token_at is None
        if first:
            self.first_token_at = now
        it = self.resuming
        if it is not None:
            it.restored_tokens = restored_tokens(self, engine, chunk)
            it.resumed_at = now
            it.resumed_on = worker_id
        self.last_token_at = now
        return Arrival(first, it)

    def interrupted(
        self, worker_id: str, incarnation: int, reason: str, kind: Loss | None, now: float
    ) -> Interruption:
        """The attempt on `worker_id` broke at `now` (`kind`; None: the worker refused the attempt):
        the interruption it resumes from."""
        it = Interruption(
            worker_id,
            incarnation,
            reason,
            now,
            len(self.emitted),
            self.last_token_at or self.arrived,
            kind=kind,
        )
        self.interruptions.append(it)
        return it

    def finished_by_tokens(self) -> str | None:
        """Whether the emitted tokens already complete the request (a failure after the last token)."""
        s = self.job.sampling
        if self.emitted and not s.ignore_eos and self.emitted[-1] in s.stop_token_ids:
            return "stop"
        if self.remaining <= 0:
            return "length"
        return None


@dataclass(frozen=True, slots=True)
class Arrival:
    """What tokens arriving did to a session (`Session.tokens_arrived`)."""

    first: bool  # the session's first token
    resumed: Interruption | None  # the interruption they end, if any


def attempt_request(
    s: Session, wrid: str, epoch: int, holders: list[HolderRef], orphan_grace_s: float
) -> GenerateRequest:
    """The `/generate` body of the session's next attempt: the prompt and everything emitted so far,
    the rest of the budget, the session's seed base."""
    sp = s.job.sampling
    return GenerateRequest(
        rid=wrid,
        input_ids=[*s.job.prompt_ids, *s.emitted],
        sampling_params=SamplingParams(
            max_new_tokens=s.remaining,
            temperature=sp.temperature,
            top_p=sp.top_p,
            top_k=sp.top_k if sp.top_k is not None else -1,
            stop_token_ids=list(sp.stop_token_ids),
            ignore_eos=sp.ignore_eos,
        ),
        stream=True,
        return_logprob=s.job.logprobs is not None,
        top_logprobs_num=s.job.logprobs or 0,
        lumen=LumenExt(
            epoch=epoch,
            seed_base=s.seed_base,
            attempt=s.attempts,
            checkpoint=holders,
            orphan_grace_s=orphan_grace_s,
        ),
    )


def restored_tokens(s: Session, engine: EngineKind, chunk: GenerateChunk) -> int:
    """Prompt tokens this attempt restored instead of recomputing. SGLang reports no such count:
    on a resume dispatched to a checkpoint holder its `cached_tokens` (HiCache hits on the pages
    Lumen's backend holds, plus radix-cache hits) stands for it."""
    if engine is not EngineKind.SGLANG:
        return chunk.meta_info.restored_tokens
    it = s.interruptions[-1] if s.interruptions else None
    if it is not None and it.resumed_at is None and it.action == "restore":
        return chunk.meta_info.cached_tokens
    return 0


def chunk_logprobs(s: Session, chunk: GenerateChunk, worker_id: str) -> tuple[TokenLogprob, ...]:
    """The chunk's logprobs when the job asked for them; a chunk without them is the worker's error."""
    if s.job.logprobs is None or not chunk.output_ids:
        return ()
    try:
        return token_logprobs(chunk.meta_info, chunk.output_ids)
    except ValueError as exc:
        raise WorkerLost(f"worker {worker_id} sent bad logprobs: {exc}", Loss.WORKER_ERROR) from exc
