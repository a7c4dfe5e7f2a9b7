"""The decode batch of one simulated worker: its requests positioned on the worker's step counter.

Request r emits `e` tokens per step (1, or the draft-assist mean) from step `r.k_join` on, so at step
k it has emitted `r.emitted_base + (k − r.k_join)·e` tokens and finishes at step
`r.k_join + ⌈r.rem_base / e⌉`. The batch's context sum at step k is `A + k·B·e` with
`A = Σ (r.ctx_base − r.k_join·e)`, so the step time of the whole batch is O(1) to evaluate, and a
request joins or leaves in O(log B) (a heap of finish steps). Changing e re-bases every request.
"""

from __future__ import annotations

import math
from heapq import heappop, heappush
from typing import Final

from gateway.sim.request import SimRequest

# A finish-heap entry is one int, `finish step << RID_BITS | rid`, ordered as (finish step, rid) (a
# request's id is its index in the workload: 0 <= rid < 2**RID_BITS), and cheaper to compare than a
# tuple; `entry >> RID_BITS` is its finish step
RID_BITS: Final = 40
_RID_MASK: Final = (1 << RID_BITS) - 1


class DecodeBatch:
    __slots__ = ("a_sum", "e", "heap", "members")

    def __init__(self) -> None:
        self.members: dict[int, SimRequest] = {}
        self.heap: list[int] = []  # finish step << RID_BITS | rid
        self.a_sum = 0.0
        self.e = 1.0

    def __len__(self) -> int:
        return len(self.members)

    def ctx_sum(self, k: int) -> float:
        """Σ context of the batch's requests at step k."""
        return self.a_sum + k * len(self.members) * self.e

    def next_finish(self) -> int:
        return self.heap[0] >> RID_BITS

    def emitted_at(self, r: SimRequest, k: int) -> float:
        return r.emitted_base + max(0, k - r.k_join) * self.e

    def start(self, r: SimRequest, k: int) -> None:
        """r's prefill just emitted a token at step k: it decodes from the next step on."""
        r.k_join = k
        emitted = r.emitted
        r.emitted_base = float(emitted)
        r.ctx_base = ctx = float(r.prompt + emitted)  # r.context
        r.rem_base = rem = float(r.output - emitted)
        # _join(r, k), inlined (the hot path: once per request)
        e = self.e
        steps = math.ceil(rem / e - 1e-9)
        r.finish_step = finish = k + (steps if steps > 1 else 1)
        r.a_term = a_term = ctx - k * e
        self.a_sum += a_term
        self.members[r.rid] = r
        heappush(self.heap, finish << RID_BITS | r.rid)

    def _join(self, r: SimRequest, k: int) -> None:
        r.finish_step = k + max(1, math.ceil(r.rem_base / self.e - 1e-9))
        r.a_term = r.ctx_base - r.k_join * self.e
        self.a_sum += r.a_term
        self.members[r.rid] = r
        heappush(self.heap, r.finish_step << RID_BITS | r.rid)

    def pop_finished(self, k: int) -> list[SimRequest]:
        """Remove and return the requests that have emitted all their tokens by step k."""
        heap, members, out = self.heap, self.members, []
        limit = (k + 1) << RID_BITS  # the entries of finish steps <= k
        while heap and heap[0] < limit:
            entry = heappop(heap)
            r = members.get(entry & _RID_MASK)
            if r is None or r.finish_step != entry >> RID_BITS:
                continue
            del members[r.rid]
            self.a_sum -= r.a_term
            out.append(r)
        if not members:
            self.a_sum = 0.0  # drop accumulated rounding
        return out

    def rebase(self, k: int, e: float) -> None:
        """From step k on, every request emits e tokens per step."""
        members = list(self.members.values())
        old_e = self.e
        self.members, self.heap, self.a_sum, self.e = {}, [], 0.0, e
        for r in members:
            adv = (k - r.k_join) * old_e
            r.emitted_base += adv
            r.ctx_base += adv
            r.rem_base -= adv
            r.k_join = k
            self._join(r, k)
