"""The cost model's step time as a function of batch aggregates, and summed over runs of decode steps.

`CostModel.step_time` walks the batch request by request. Its terms are linear in a few sums (new
tokens, attention work, KV read), so the simulator keeps those sums per worker and evaluates the same
roofline in O(1); `tests/unit/test_sim_stepcost.py` checks it equals `CostModel.step_time`.

A run of decode-only steps with a fixed batch (B requests, each emitting e tokens per step and
verifying v drafted tokens) has a context sum that grows by B·e per step, so both roofline terms are
linear in the step index j and the step time is `fixed + max(compute(j), memory(j))`. `Run` sums that
in closed form and inverts the sum by bisection, so a worker advances a whole run in one event.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.core.costmodel import CostModel


class StepCost:
    """Roofline step time from aggregates, for one (model, GPU, TP) deployment."""

    __slots__ = ("fixed", "flop_attn", "flop_tok", "mem_tok", "mem_w")

    def __init__(self, cost: CostModel) -> None:
        m, g, tp = cost.model, cost.gpu, cost.tp
        cdiv = g.peak_flops * g.mfu * tp
        mdiv = g.hbm_bw * g.mbu * tp
        comm = 2 * m.layers * g.tp_allreduce_s if tp > 1 else 0.0
        self.fixed = cost.step_overhead_s + comm
        self.flop_tok = 2.0 * m.params / cdiv
        self.flop_attn = 4.0 * m.layers * m.q_dim / cdiv
        self.mem_w = m.weight_bytes / mdiv
        self.mem_tok = m.kv_bytes_per_token / mdiv

    def step(self, new_tokens: float, attn: float, kv_read: float) -> float:
        """One step: `new_tokens` computed, `attn` = Σ attended context (prefill: n·(ctx + n/2)),
        `kv_read` = Σ context read."""
        if new_tokens <= 0:
            return 0.0
        compute = self.flop_tok * new_tokens + self.flop_attn * attn
        memory = self.mem_w + self.mem_tok * (kv_read + new_tokens)
        return self.fixed + (compute if compute > memory else memory)

    def decode_run(
        self, batch: int, ctx_sum: float, per_step: float, verify: int, extra_s: float = 0.0
    ) -> Run:
        """Decode steps of `batch` requests whose contexts sum to `ctx_sum` at the first step and grow
        by `per_step` (= batch·e) per step, with `verify` drafted tokens verified per step in total and
        `extra_s` added to every step (time spent waiting for drafts)."""
        new = batch + verify
        # verification attends over the batch's mean context per drafted token (CostModel.step_time)
        scale = 1.0 + verify / batch
        return Run(
            fixed=self.fixed + extra_s,
            ac=self.flop_tok * new + self.flop_attn * ctx_sum * scale,
            bc=self.flop_attn * per_step * scale,
            am=self.mem_w + self.mem_tok * (ctx_sum + new),
            bm=self.mem_tok * per_step,
        )


@dataclass(frozen=True, slots=True)
class Run:
    """Step j of a decode run takes `fixed + max(ac + bc·j, am + bm·j)` seconds."""

    fixed: float
    ac: float
    bc: float
    am: float
    bm: float

    def step(self, j: int) -> float:
        return self.fixed + max(self.ac + self.bc * j, self.am + self.bm * j)

    def time(self, n: int) -> float:
        """Seconds for the first n steps."""
        if n <= 0:
            return 0.0
        d0, dd = self.ac - self.am, self.bc - self.bm
        # steps [0, split) take one line, [split, n) the other
        if dd == 0:
            split, first_compute = n, d0 > 0
        elif dd > 0:  # compute overtakes memory at j >= -d0/dd
            split, first_compute = _clamp_ceil(-d0 / dd, n), False
        else:  # compute is above memory up to j <= -d0/dd
            split, first_compute = _clamp_ceil(-d0 / dd, n), True
        a1, b1, a2, b2 = (self.ac, self.bc, self.am, self.bm)
        if not first_compute:
            a1, b1, a2, b2 = a2, b2, a1, b1
        return n * self.fixed + _line_sum(a1, b1, 0, split) + _line_sum(a2, b2, split, n)

    def steps_within(self, dt: float, limit: int) -> int:
        """The number of whole steps (at most `limit`) that end within `dt` seconds."""
        if dt <= 0:
            return 0
        lo, hi = 0, limit
        if self.time(hi) <= dt:
            return hi
        while hi - lo > 1:  # time(lo) <= dt < time(hi)
            mid = (lo + hi) // 2
            if self.time(mid) <= dt:
                lo = mid
            else:
                hi = mid
        return lo


def _clamp_ceil(x: float, n: int) -> int:
    if x <= 0:
        return 0
    if x >= n:
        return n
    i = int(x)
    return i if i == x else i + 1


def _line_sum(a: float, b: float, lo: int, hi: int) -> float:
    """Σ_{j=lo}^{hi-1} (a + b·j)."""
    if hi <= lo:
        return 0.0
    count = hi - lo
    return a * count + b * (lo + hi - 1) * count / 2.0
