"""Continuous batching: what one engine step prefills and decodes, and which tokens it produces.

Pure and synchronous: the engine shell calls `step()`, sleeps for the modelled time of the returned
`StepWork`, then delivers the emissions. Policy, as in SGLang with mixed chunked prefill:
- the waiting queue is FCFS (resumed requests ahead of new ones, issue 17); its head is admitted while fewer than `max_running` requests run, the
  step still has prefill budget, and the KV pool can reserve the request's worst case
  (prompt + max_new_tokens), so decode never runs out of pages and nothing is ever preempted;
- at most `chunked_prefill_size` prompt tokens are prefilled per step, requests already part-way
  through their prompt first; a long prompt spans several steps;
- every request that was decoding at the start of the step decodes one token; the step that
  completes a prompt also yields that request's first token;
- a decoding request may come with drafts (speculative decoding, DESIGN 4.5): the step verifies them
  in the same forward pass (`StepWork.verify_tokens`) and emits the accepted prefix plus the target's
  own next token, one by one up to a finish. Greedy and seeded requests are verified by exact match
  against the target's own tokens, so the output is token for token what plain decoding emits;
- a request may arrive with a restored prefix (KV pages loaded from the checkpoint store): those
  tokens are in context from admission on and only the rest of the prompt is prefilled; the step
  that admits it reports them so the engine can charge the host-to-device copy;
- a request that asked for log probabilities (`Seq.top_logprobs` >= 0) gets one per emitted token,
  from the distribution that token was chosen from (models/synthetic.py `token_logprob`; the torch
  scheduler's from the step's logits), drafts accepted by a verification included.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from draft_models.synthetic_drafter import verify_synthetic
from draft_models.verify import mode_for
from gateway.core.costmodel import StepWork
from gateway.protocol.generate import FinishReason, SamplingParams, TokenLogprob
from models.paging import pages_for
from models.synthetic import Sampler, SyntheticModel, finish_of, mix64
from worker_hooks.engine.pages import PagePool


@dataclass(slots=True, eq=False)
class Seq:
    """One request inside the engine. `state` is the context hash over prompt[:prefilled] + output."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    sampler: Sampler
    stop_ids: frozenset[int]
    reserve_pages: int
    state: int
    seed_base: int = 0
    prefilled: int = 0
    restored: int = 0  # prompt tokens whose KV came from the checkpoint store, not from prefill
    output: list[int] = field(default_factory=list)
    # -1: no log probabilities; k >= 0: each emitted token's, with the k most likely at its position
    top_logprobs: int = -1
    # a resumed attempt queued ahead of new requests (gateway.core.outage.queue_first)
    resumed: bool = False
    # when it was queued (the engine's clock) and in which order: aged shortest-first ranks by it
    enqueued_at: float = 0.0
    seqno: int = 0

    @property
    def context_len(self) -> int:
        return self.prefilled + len(self.output)

    @property
    def kv_len(self) -> int:
        """Tokens whose KV exists: the last emitted token is only fed to the model by the next step."""
        return self.prefilled + max(len(self.output) - 1, 0)

    def context(self, start: int, end: int) -> list[int]:
        """Context token ids [start, end): the prompt, then the output."""
        n = len(self.prompt)
        if end <= n:
            return self.prompt[start:end]
        return self.prompt[start:] + self.output[: end - n] if start < n else self.output[start - n : end - n]

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.prompt)

    @property
    def tokens_left(self) -> int:
        return self.params.max_new_tokens - len(self.output)


@dataclass(frozen=True, slots=True)
class Drafts:
    """Draft tokens for one request, proposed after a context of length `position` (valid only there)."""

    position: int
    tokens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Verification:
    """One request's verification in a step: `accepted` of its `drafted` drafts were kept."""

    rid: str
    drafted: int
    accepted: int


@dataclass(frozen=True, slots=True)
class Emission:
    """What one step produced for one request: new ids, and the finish reason on the last one."""

    rid: str
    new_ids: list[int]
    completion_tokens: int
    finish: FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per new id when the request asked for them


@dataclass(frozen=True, slots=True)
class StepResult:
    work: StepWork
    emissions: list[Emission]
    restored_tokens: int = 0  # restored prefixes of the requests this step admitted (host -> GPU)
    verified: tuple[Verification, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.work.prefill and not self.work.decode_contexts


def _fifo_rank(seq: Seq) -> tuple[int, float]:
    """Resumed first (in their queue order), then FIFO: the order outside a recovery."""
    return (0 if seq.resumed else 1, seq.seqno)


class BatchScheduler:
    """What every backend's scheduler shares: the queues, admission bookkeeping, aborts, emission."""

    def __init__(self, pool: PagePool, *, max_running: int, chunked_prefill_size: int) -> None:
        if max_running < 1 or chunked_prefill_size < 1:
            raise ValueError(
                f"need max_running >= 1 and chunked_prefill_size >= 1, got "
                f"{max_running} and {chunked_prefill_size}"
            )
        self.pool = pool
        self.max_running = max_running
        self.chunked_prefill_size = chunked_prefill_size
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []  # in admission order
        self._by_rid: dict[str, Seq] = {}
        self.completed_total = 0
        # the waiting queue's order while the cluster recovers (None: resumed first, then FIFO)
        self.rank: Callable[[Seq], tuple[int, float]] | None = None
        self._added = 0

    # -- requests ---------------------------------------------------------------------------------
    def fits_ever(self, seq: Seq) -> bool:
        """Whether the request could be admitted into an otherwise empty engine."""
        return seq.reserve_pages <= self.pool.total_pages

    def add(self, seq: Seq) -> None:
        """Queue `seq`: FCFS, except that a resumed request (`seq.resumed`) goes ahead of every new
        one, behind the resumed requests queued before it; with a `rank` (set_rank), behind every
        queued request of a rank <= its own."""
        if seq.rid in self._by_rid:
            raise ValueError(f"duplicate request id {seq.rid!r}")
        self._by_rid[seq.rid] = seq
        self._added += 1
        seq.seqno = self._added
        rank = self.rank or _fifo_rank
        mine = rank(seq)
        if not self.waiting or rank(self.waiting[-1]) <= mine:
            self.waiting.append(seq)
            return
        i = 0
        for queued in self.waiting:
            if rank(queued) > mine:
                break
            i += 1
        self.waiting.insert(i, seq)

    def set_rank(self, rank: Callable[[Seq], tuple[int, float]] | None) -> None:
        """Order the waiting queue by `rank` from now on (stable: queue order among equal ranks);
        None: back to resumed first, then FIFO."""
        self.rank = rank
        self.waiting = deque(sorted(self.waiting, key=rank or _fifo_rank))

    def __contains__(self, rid: str) -> bool:
        return rid in self._by_rid

    def get(self, rid: str) -> Seq | None:
        return self._by_rid.get(rid)

    def abort(self, rid: str) -> Seq | None:
        """Remove a request wherever it is and free its pages."""
        seq = self._by_rid.pop(rid, None)
        if seq is None:
            return None
        if seq in self.running:
            self.running.remove(seq)
            self.pool.free(rid)
        else:
            self.waiting.remove(seq)
        return seq

    def rids(self) -> list[str]:
        return list(self._by_rid)

    # -- stats ----------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def kv_tokens_used(self) -> int:
        return sum(s.context_len for s in self.running)

    def decoding(self) -> list[Seq]:
        """The running requests whose next step decodes (their prompt is in context)."""
        return [s for s in self.running if not s.prefilling]

    def _emit(
        self,
        seq: Seq,
        tokens: Sequence[int],
        emissions: list[Emission],
        finished: list[Seq],
        logprobs: Sequence[TokenLogprob] = (),
    ) -> None:
        """Append `tokens` one by one, stopping at the first that finishes the request; `logprobs`
        (one per token, when the request asked for them) go with the tokens emitted."""
        new: list[int] = []
        finish = None
        for token in tokens:
            seq.output.append(token)
            self._absorb(seq, token)
            new.append(token)
            kind = finish_of(token, len(seq.output), seq.params, seq.stop_ids)
            if kind == "length":
                finish = FinishReason(type="length", length=seq.params.max_new_tokens)
            elif kind == "stop":
                finish = FinishReason(type="stop", matched=token)
            if finish is not None:
                break
        self.pool.grow_to(seq.rid, pages_for(seq.context_len, self.pool.page_size))
        emissions.append(Emission(seq.rid, new, len(seq.output), finish, tuple(logprobs[: len(new)])))
        if finish is not None:
            finished.append(seq)

    def _absorb(self, seq: Seq, token: int) -> None:
        """Fold an emitted token into the request's model state (the synthetic context hash)."""


class Scheduler(BatchScheduler):
    """The synthetic backend's scheduler: tokens come from the context hash (models/synthetic.py)."""

    def __init__(
        self, model: SyntheticModel, pool: PagePool, *, max_running: int, chunked_prefill_size: int
    ) -> None:
        super().__init__(pool, max_running=max_running, chunked_prefill_size=chunked_prefill_size)
        self.model = model

    def make_seq(
        self, rid: str, prompt: list[int], params: SamplingParams, seed_base: int = 0, restored: int = 0
    ) -> Seq:
        """`restored` prompt tokens start in context (at least the last prompt token is prefilled)."""
        if restored < 0 or (restored and restored >= len(prompt)):
            raise ValueError(f"restored prefix {restored} must lie in [0, {len(prompt)})")
        return Seq(
            rid=rid,
            prompt=prompt,
            params=params,
            sampler=Sampler.from_params(params, seed_base),
            stop_ids=frozenset(params.stop_token_ids),
            reserve_pages=pages_for(len(prompt) + max(params.max_new_tokens, 0), self.pool.page_size),
            state=self.model.absorb(self.model.initial_state(), prompt[:restored]),
            seed_base=seed_base,
            prefilled=restored,
            restored=restored,
        )

    # -- one step -------------------------------------------------------------------------------
    def step(self, drafts: Mapping[str, Drafts] | None = None) -> StepResult:
        """One step; `drafts` (by rid) are verified for the decoding requests whose context they fit."""
        decoding = self.decoding()
        decode_contexts = [s.context_len for s in decoding]
        prefill: list[tuple[int, int]] = []
        emissions: list[Emission] = []
        finished: list[Seq] = []
        budget = self.chunked_prefill_size
        restored = 0

        for seq in [s for s in self.running if s.prefilling]:
            if budget == 0:
                break
            budget -= self._prefill(seq, budget, prefill, emissions, finished)
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.max_running
            and self.pool.can_allocate(self.waiting[0].reserve_pages)
        ):
            seq = self.waiting.popleft()
            self.pool.allocate(seq.rid, 0, reserve=seq.reserve_pages)
            self.running.append(seq)
            restored += seq.restored
            budget -= self._prefill(seq, budget, prefill, emissions, finished)

        verified: list[Verification] = []
        for seq in decoding:
            d = drafts.get(seq.rid) if drafts else None
            if d is None or d.position != seq.context_len:
                self._emit_token(seq, emissions, finished)  # no drafts, or drafts for a stale context
            else:
                self._verify(seq, d.tokens, emissions, finished, verified)

        for seq in finished:
            self.running.remove(seq)
            self.pool.free(seq.rid)
            del self._by_rid[seq.rid]
            self.completed_total += 1
        work = StepWork(
            prefill=prefill, decode_contexts=decode_contexts, verify_tokens=sum(v.drafted for v in verified)
        )
        return StepResult(work, emissions, restored, tuple(verified))

    def _prefill(
        self,
        seq: Seq,
        budget: int,
        prefill: list[tuple[int, int]],
        emissions: list[Emission],
        finished: list[Seq],
    ) -> int:
        start = seq.prefilled
        n = min(budget, len(seq.prompt) - start)
        h = seq.state
        for t in seq.prompt[start : start + n]:
            h = mix64(h ^ t)
        seq.state = h
        seq.prefilled = start + n
        prefill.append((n, start))
        self.pool.grow_to(seq.rid, pages_for(seq.context_len, self.pool.page_size))
        if not seq.prefilling:
            if seq.params.max_new_tokens <= 0:
                emissions.append(Emission(seq.rid, [], 0, FinishReason(type="length", length=0)))
                finished.append(seq)
            else:
                self._emit_token(seq, emissions, finished)
        return n

    def _emit_token(self, seq: Seq, emissions: list[Emission], finished: list[Seq]) -> None:
        token = self.model.next_token(seq.state, seq.context_len, seq.sampler)
        self._emit(seq, [token], emissions, finished, self._logprobs(seq, [token]))

    def _logprobs(self, seq: Seq, tokens: Sequence[int]) -> list[TokenLogprob]:
        """The logprobs of `tokens` emitted in order after the request's current context."""
        if seq.top_logprobs < 0:
            return []
        out = []
        h = seq.state
        for t in tokens:
            out.append(self.model.token_logprob(h, t, seq.sampler, seq.top_logprobs))
            h = mix64(h ^ t)
        return out

    def _verify(
        self,
        seq: Seq,
        drafts: Sequence[int],
        emissions: list[Emission],
        finished: list[Seq],
        verified: list[Verification],
    ) -> None:
        # never verify past the length limit: the bonus token is the last one the request may emit
        drafts = drafts[: max(0, seq.tokens_left - 1)]
        if not drafts:
            self._emit_token(seq, emissions, finished)
            return
        mode = mode_for(seq.sampler)  # GREEDY or EXACT_SEEDED: outputs stay token-for-token exact
        verdict = verify_synthetic(self.model, seq.state, seq.context_len, seq.sampler, drafts, mode=mode)
        verified.append(Verification(seq.rid, len(drafts), verdict.accepted))
        self._emit(seq, verdict.tokens, emissions, finished, self._logprobs(seq, verdict.tokens))

    def _absorb(self, seq: Seq, token: int) -> None:
        seq.state = mix64(seq.state ^ token)
