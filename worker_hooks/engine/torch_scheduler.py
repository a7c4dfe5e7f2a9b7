"""Continuous batching for the torch backend: the same policy as the synthetic scheduler, in three parts.

The synthetic scheduler computes a step's tokens inside `step()`. A real forward pass takes real time
and must not block the event loop (heartbeats, streams and the draft plane run on it), so here a step
is split:

1. `plan(drafts)`, on the loop: admit, choose prefill chunks, grow every request's pages to cover
   what this step writes, and describe the step as `BatchItem`s (a prefill chunk; one decode token;
   or the last token plus k drafts, whose logits are all needed) plus the restored prefixes to copy
   into the paged cache first;
2. the forward pass (`TorchBackend.run`), on the engine's single step thread;
3. `commit(plan, logits)`, on the loop: sample, verify drafts, emit, finish.

A request aborted while its forward ran is skipped by `commit`; its pages were freed by the abort, and
nothing allocates pages until the next `plan`, so the forward's writes into them land in pages nobody
owns yet. Admission, chunking and the page reservations are exactly the synthetic scheduler's.

Tokens are sampled from the logits at absolute position p with the uniform of `(seed_base, p)`
(`Sampler.uniform`; `sample_token`, models/torch_sampling.py), so a seeded request samples the same tokens on any worker, however the request
was split across attempts, restores and steps. Drafts are verified by exact match against the
target's own greedy or seeded tokens (draft_models/verify.py), so assisted output is token for token
plain decoding's.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

import torch

from draft_models.verify import verify_match
from gateway.core.costmodel import StepWork
from gateway.protocol.generate import FinishReason, SamplingParams, TokenLogprob
from models.paging import pages_for
from models.synthetic import Sampler
from models.torch_model import BatchItem
from models.torch_sampling import sample_token, token_logprob
from worker_hooks.engine.scheduler import (
    BatchScheduler,
    Drafts,
    Emission,
    Seq,
    StepResult,
    Verification,
)


@dataclass(slots=True, eq=False)
class TorchSeq(Seq):
    # the pool's live page list (pages.py `pages_of`), set at admission
    page_table: list[int] = field(default_factory=list)
    # the restored prefix's KV bytes, copied out of the checkpoint store when the request was
    # accepted (so an eviction before admission cannot take them); consumed at admission
    restore_data: bytes | None = None


class Kind(Enum):
    PREFILL = 0
    DECODE = 1
    VERIFY = 2


@dataclass(frozen=True, slots=True)
class Work:
    seq: TorchSeq
    kind: Kind
    item: BatchItem
    drafts: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class StepPlan:
    works: list[Work]
    restores: list[tuple[list[int], bytes]]  # (page ids, their KV bytes), copied in before the forward
    work: StepWork
    restored_tokens: int

    @property
    def empty(self) -> bool:
        return not self.works

    @property
    def items(self) -> list[BatchItem]:
        return [w.item for w in self.works]


class TorchScheduler(BatchScheduler):
    def make_seq(
        self,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        seed_base: int = 0,
        restored: int = 0,
        restore_data: bytes | None = None,
    ) -> TorchSeq:
        """`restored` prompt tokens come from `restore_data` (whole pages; the last prompt token is
        always prefilled, its logits give the first output token)."""
        ps = self.pool.page_size
        if restored < 0 or (restored and (restored >= len(prompt) or restored % ps)):
            raise ValueError(f"restored prefix {restored} must be whole pages in [0, {len(prompt)})")
        if bool(restored) != (restore_data is not None):
            raise ValueError("a restored prefix needs its KV bytes, and only then")
        return TorchSeq(
            rid=rid,
            prompt=prompt,
            params=params,
            sampler=Sampler.from_params(params, seed_base),
            stop_ids=frozenset(params.stop_token_ids),
            reserve_pages=pages_for(len(prompt) + max(params.max_new_tokens, 0), ps),
            state=0,
            seed_base=seed_base,
            prefilled=restored,
            restored=restored,
            restore_data=restore_data,
        )

    # -- 1. plan --------------------------------------------------------------------------------
    def plan(self, drafts: Mapping[str, Drafts] | None = None) -> StepPlan:
        decoding = self.decoding()
        works: list[Work] = []
        restores: list[tuple[list[int], bytes]] = []
        prefill: list[tuple[int, int]] = []
        budget = self.chunked_prefill_size
        restored = 0
        for seq in [s for s in self.running if s.prefilling]:
            if budget == 0:
                break
            budget -= self._plan_prefill(_torch(seq), budget, works, prefill)
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.max_running
            and self.pool.can_allocate(self.waiting[0].reserve_pages)
        ):
            seq = _torch(self.waiting.popleft())
            self.pool.allocate(seq.rid, 0, reserve=seq.reserve_pages)
            seq.page_table = self.pool.pages_of(seq.rid)
            self.running.append(seq)
            if seq.restored and seq.restore_data is not None:
                n = seq.restored // self.pool.page_size
                self.pool.grow_to(seq.rid, n)
                restores.append((seq.page_table[:n], seq.restore_data))
                seq.restore_data = None
                restored += seq.restored
            budget -= self._plan_prefill(seq, budget, works, prefill)

        verify_tokens = 0
        for s in decoding:
            seq = _torch(s)
            start = seq.context_len - 1  # the last emitted token's KV is computed now
            d = drafts.get(seq.rid) if drafts else None
            ks: tuple[int, ...] = ()
            if d is not None and d.position == seq.context_len:
                # never verify past the length limit: the bonus token is the last one it may emit
                ks = tuple(d.tokens[: max(0, seq.tokens_left - 1)])
            tokens = [seq.output[-1], *ks]
            self.pool.grow_to(seq.rid, pages_for(start + len(tokens), self.pool.page_size))
            if ks:
                works.append(Work(seq, Kind.VERIFY, BatchItem(seq.page_table, start, tokens, 0), ks))
                verify_tokens += len(ks)
            else:
                works.append(Work(seq, Kind.DECODE, BatchItem(seq.page_table, start, tokens)))
        work = StepWork(
            prefill=prefill, decode_contexts=[s.context_len for s in decoding], verify_tokens=verify_tokens
        )
        return StepPlan(works, restores, work, restored)

    def _plan_prefill(
        self, seq: TorchSeq, budget: int, works: list[Work], prefill: list[tuple[int, int]]
    ) -> int:
        start = seq.prefilled
        n = min(budget, len(seq.prompt) - start)
        seq.prefilled = start + n
        self.pool.grow_to(seq.rid, pages_for(seq.prefilled, self.pool.page_size))
        tokens = seq.prompt[start : start + n]
        # logits only where the prompt completes and a first token is wanted
        last = not seq.prefilling and seq.params.max_new_tokens > 0
        works.append(Work(seq, Kind.PREFILL, BatchItem(seq.page_table, start, tokens, -1 if last else n)))
        prefill.append((n, start))
        return n

    # -- 3. commit ------------------------------------------------------------------------------
    def commit(self, plan: StepPlan, logits: list[torch.Tensor]) -> StepResult:
        if len(logits) != len(plan.works):
            raise ValueError(f"{len(logits)} logits for {len(plan.works)} batch items")
        emissions: list[Emission] = []
        finished: list[Seq] = []
        verified: list[Verification] = []
        for w, lg in zip(plan.works, logits, strict=True):
            seq = w.seq
            if self._by_rid.get(seq.rid) is not seq:
                continue  # aborted while the forward ran
            if w.kind is Kind.PREFILL:
                if seq.prefilling:
                    continue  # a middle chunk: no token yet
                if seq.params.max_new_tokens <= 0:
                    emissions.append(Emission(seq.rid, [], 0, FinishReason(type="length", length=0)))
                    finished.append(seq)
                    continue
                token = _sample(lg[-1], seq, seq.context_len)
                self._emit(seq, [token], emissions, finished, _logprobs(lg[-1:], seq, [token]))
            elif w.kind is Kind.DECODE:
                token = _sample(lg[-1], seq, seq.context_len)
                self._emit(seq, [token], emissions, finished, _logprobs(lg[-1:], seq, [token]))
            else:
                # the target's own token at each draft position, computed only up to the first mismatch
                verdict = verify_match(w.drafts, _targets(lg, seq, len(w.drafts) + 1))
                verified.append(Verification(seq.rid, len(w.drafts), verdict.accepted))
                self._emit(seq, verdict.tokens, emissions, finished, _logprobs(lg, seq, verdict.tokens))
        for done in finished:
            self.running.remove(done)
            self.pool.free(done.rid)
            del self._by_rid[done.rid]
            self.completed_total += 1
        return StepResult(plan.work, emissions, plan.restored_tokens, tuple(verified))


def _targets(logits: torch.Tensor, seq: Seq, n: int) -> Iterator[int]:
    ctx = seq.context_len
    for i in range(n):
        yield _sample(logits[i], seq, ctx + i)


def _logprobs(rows: torch.Tensor, seq: Seq, tokens: Sequence[int]) -> list[TokenLogprob]:
    """Token i's logprob from logits row i (the row it was sampled from), when the request asked."""
    if seq.top_logprobs < 0:
        return []
    return [token_logprob(rows[i], seq.sampler, t, seq.top_logprobs) for i, t in enumerate(tokens)]


def _sample(logits: torch.Tensor, seq: Seq, position: int) -> int:
    return sample_token(logits, seq.sampler, position)


def _torch(seq: Seq) -> TorchSeq:
    if not isinstance(seq, TorchSeq):
        raise TypeError(f"request {seq.rid!r} was not made by the torch scheduler")
    return seq
