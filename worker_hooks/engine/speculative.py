"""The target's side of draft assist (DESIGN 4.5): drafts from a paired drafter, verified in the step.

Per engine step, with a drafter paired (`start`):
- right after a step's tokens are delivered, `after_step` picks the decoding requests with the most
  tokens left (up to `max_items`), and sends one round asking k drafts for each (the DraftClient sends
  only the ids accepted since the drafter last saw the request);
- at the start of the next step, `collect` waits for that round's reply, never longer than
  `draft_timeout`: a late, lost or refused round means the step runs without drafts. Drafts are
  handed to the scheduler with the context length they were made for, so they are verified only if
  the request is still exactly there.

k adapts per pair: an `AcceptanceEstimator` follows the acceptance rate a, and `choose_k` weighs the
expected tokens per step against the modelled cost of k (verifying k more tokens per request in the
target's step, plus waiting for k draft-model steps on the drafter). When even the smallest k is not
worth its cost (a ≈ 0), rounds pause and a probe round is sent every `PROBE_EVERY` steps to re-measure.
k is also kept small enough for the drafter's modelled time to fit well inside `draft_timeout`.

After `MAX_MISSES` consecutive missed rounds (timed out: a hung or overloaded drafter; or refused by
the DEALER, which does not queue for a peer that is not connected: a drafter that is gone) rounds
stop for a backoff of steps that doubles up to `MAX_BACKOFF_STEPS`, so a dead drafter costs a probe
now and then, not a context sync every step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import structlog

from draft_models.client import DraftClient
from gateway.core.costmodel import CostModel, StepWork
from gateway.core.speculation import AcceptanceEstimator, choose_k, expected_tokens_per_step
from gateway.protocol.planes import Security
from worker_hooks.engine.scheduler import Drafts, Seq, Verification

log = structlog.get_logger(__name__)

MAX_ITEMS = 64  # requests assisted per step at most
WARMUP = 8  # verifications before k moves away from StartDraftAssist's k
PROBE_EVERY = 32  # steps between probe rounds while drafting is not worth its cost
MAX_MISSES = 3  # consecutive timeouts
MAX_UNSENT = 16  # consecutive rounds refused for want of a connection (the first connect takes a few)
MIN_BACKOFF_STEPS = 32
MAX_BACKOFF_STEPS = 1024
POLL_GRACE_S = 0.005
# the drafter's modelled time for k drafts must stay below this share of draft_timeout
TIMEOUT_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class AssistTotals:
    """A target's assist counts: tokens drafted for it and verified, accepted, and assisted steps."""

    drafted: int = 0
    accepted: int = 0
    rounds: int = 0

    def __add__(self, other: AssistTotals) -> AssistTotals:
        return AssistTotals(
            self.drafted + other.drafted, self.accepted + other.accepted, self.rounds + other.rounds
        )


class _Context(Sequence[int]):
    """prompt + output of a request without copying them (the client slices only what is new)."""

    __slots__ = ("_seq",)

    def __init__(self, seq: Seq) -> None:
        self._seq = seq

    def __len__(self) -> int:
        return self._seq.context_len

    def __iter__(self) -> Iterator[int]:
        return iter(self._seq.context(0, self._seq.context_len))

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[int]: ...
    def __getitem__(self, i: int | slice) -> int | Sequence[int]:
        n = self._seq.context_len
        if isinstance(i, slice):
            start, stop, step = i.indices(n)
            if step != 1:
                raise ValueError("only contiguous slices of a context")
            return self._seq.context(start, max(start, stop))
        if not -n <= i < n:
            raise IndexError(i)
        return self._seq.context(i % n, i % n + 1)[0]


class Speculator:
    """One pair, seen from its target. Owns its DraftClient (closed by `close`)."""

    def __init__(
        self,
        peer_id: str,
        endpoint: str,
        *,
        auth: Security,
        server_key: str = "",
        k: int,
        k_min: int,
        k_max: int,
        timeout_s: float,
        cost: CostModel,
        draft_cost: CostModel | None = None,
        time_scale: float = 1.0,
        max_items: int = MAX_ITEMS,
    ) -> None:
        if not 1 <= k_min <= k_max:
            raise ValueError(f"need 1 <= k_min <= k_max, got {k_min}, {k_max}")
        self.peer_id = peer_id
        self.client = DraftClient(endpoint, auth=auth, server_key=server_key, pair=peer_id)
        self.k_min, self.k_max = k_min, k_max
        self.k_initial = min(max(k, k_min), k_max)
        self.k = self.k_initial
        self.timeout_s = timeout_s
        self.cost = cost
        self.draft_cost = draft_cost
        self.time_scale = time_scale
        self.max_items = max_items
        self.estimator = AcceptanceEstimator()
        self.assisted_steps = 0
        self._round = 0
        self._pending: dict[str, int] | None = None  # rid -> position, of the round awaiting its reply
        self._synced: set[str] = set()  # rids the drafter holds a context for
        self._steps = 0
        self._misses = 0
        self._unsent = 0
        self._collecting = False
        self._close_requested = False
        self._backoff = MIN_BACKOFF_STEPS
        self._resume_at = 0  # step from which rounds are sent again
        self._idle_since = 0  # first step not drafted for because a = 0 makes drafts worthless

    def close(self) -> None:
        """Close the client, or, while the step loop awaits a reply on it, as soon as it returns:
        closing a zmq socket under a pending await cancels that await, which would end the loop."""
        if self._collecting:
            self._close_requested = True
        else:
            self.client.close()

    def totals(self) -> AssistTotals:
        s = self.client.stats
        return AssistTotals(s.drafted, s.accepted, self.assisted_steps)

    # -- the step loop's calls ------------------------------------------------------------------
    async def collect(self) -> dict[str, Drafts]:
        """The drafts of the round sent after the previous step (waits at most `timeout_s`)."""
        pending, self._pending = self._pending, None
        if not pending:
            return {}
        timeouts = self.client.stats.timeouts
        self._collecting = True
        try:
            # DraftClient.poll can block in its recv after a readable poll when the drafter's socket
            # closes mid-round (its reply is dropped with the connection): bound the whole call
            async with asyncio.timeout(self.timeout_s + POLL_GRACE_S):
                got = await self.client.poll(self._round, self.timeout_s)
        except TimeoutError:
            got = None
            self.client.stats.timeouts += 1
        finally:
            self._collecting = False
            if self._close_requested:
                self.client.close()
        if self._close_requested:
            return {}  # the pair ended meanwhile
        if got is None:
            if self.client.stats.timeouts > timeouts:
                self._missed()
            return {}
        self._misses, self._backoff = 0, MIN_BACKOFF_STEPS
        return {rid: Drafts(pending[rid], d.tokens) for rid, d in got.items() if d.tokens and rid in pending}

    def after_step(self, verified: Sequence[Verification], decoding: Sequence[Seq]) -> None:
        """Account the step's verifications, then send the round for the next step."""
        self._steps += 1
        for v in verified:
            self.client.record(v.drafted, v.accepted)
            self.estimator = self.estimator.update(v.accepted, v.drafted)
        if verified:
            self.assisted_steps += 1
        live = {s.rid for s in decoding}
        for rid in self._synced - live:  # finished or aborted: the drafter frees its state
            self.client.forget(rid)
        self._synced &= live
        if self._steps < self._resume_at or not decoding:
            return
        chosen = sorted(decoding, key=lambda s: (-s.tokens_left, s.rid))[: self.max_items]
        k = self._next_k([s.context_len for s in decoding], [s.context_len for s in chosen])
        if k == 0:
            return
        items = []
        for s in chosen:
            n = min(k, s.tokens_left - 1)  # the bonus token must still fit
            if n < 1:
                continue
            p = s.params
            items.append(
                self.client.sync_item(
                    s.rid,
                    _Context(s),
                    n,
                    temperature=p.temperature,
                    top_p=p.top_p,
                    top_k=p.top_k,
                    seed_base=s.seed_base,
                )
            )
        if not items:
            return
        self._round += 1
        unsent = self.client.stats.unsent
        self.client.request(self._round, items)
        if self.client.stats.unsent > unsent:
            self._unsent += 1  # no drafter connected (not yet, or gone): nothing to wait for
            if self._unsent >= MAX_UNSENT:
                self._pause()
            return
        self._unsent = 0
        self._synced.update(i.rid for i in items)
        self._pending = {i.rid: i.position for i in items}

    # -- policy ---------------------------------------------------------------------------------
    def _missed(self) -> None:
        self._misses += 1
        if self._misses >= MAX_MISSES:
            self._pause()

    def _pause(self) -> None:
        self._resume_at = self._steps + self._backoff
        log.warning(
            "drafter not answering",
            peer=self.peer_id,
            timeouts=self._misses,
            unsent=self._unsent,
            pause_steps=self._backoff,
        )
        self._backoff = min(MAX_BACKOFF_STEPS, self._backoff * 2)
        self._misses = self._unsent = 0

    def _next_k(self, contexts: list[int], assisted: list[int]) -> int:
        """k for the next round (`contexts`: every decoding request's, `assisted`: those asked for
        drafts); 0: skip the round, drafting costs more than it brings."""
        n = len(assisted)
        draft_step = self.draft_cost.decode_step_time(assisted) if self.draft_cost is not None else 0.0
        # modelled time the target pays for k drafts: verification in its step + waiting for the drafter
        plain = self.cost.step_time(StepWork(decode_contexts=contexts))

        def cost(k: int) -> float:
            verify = self.cost.step_time(StepWork(decode_contexts=contexts, verify_tokens=k * n))
            return verify + k * draft_step

        k_max = self.k_max
        while k_max > self.k_min and k_max * draft_step * self.time_scale > TIMEOUT_SHARE * self.timeout_s:
            k_max -= 1
        if self.estimator.rounds < WARMUP:
            self.k = min(self.k_initial, k_max)
            return self.k
        a = self.estimator.rate
        self.k = choose_k(a, self.k_min, k_max, cost)
        if expected_tokens_per_step(a, self.k) / cost(self.k) > 1.0 / plain:
            self._idle_since = self._steps
            return self.k
        # not worth it now; probe now and then, so a drafter that improves is noticed
        return self.k_min if (self._steps - self._idle_since) % PROBE_EVERY == 0 else 0
