"""The cost model's step time as a function of batch aggregates, and summed over runs of decode steps.

`CostModel.step_time` walks the batch request by request. Its terms are linear in a few sums (new
tokens, attention work, KV read), so the simulator keeps those sums per worker and evaluates the same
roofline in O(1); `tests/unit/test_sim_stepcost.py` checks it equals `CostModel.step_time`.

A run of decode-only steps with a fixed batch (B requests, each emitting e tokens per step and
verifying v drafted tokens) has a context sum that grows by B·e per step, so both roofline terms are
linear in the step index j and the step time is `fixed + max(compute(j), memory(j))`. `Run` sums that
in closed form and inverts the sum (`steps_within`), so a worker advances a whole run in one event.
"""

from __future__ import annotations

import math

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
            self.fixed + extra_s,
            self.flop_tok * new + self.flop_attn * ctx_sum * scale,
            self.flop_attn * per_step * scale,
            self.mem_w + self.mem_tok * (ctx_sum + new),
            self.mem_tok * per_step,
        )


class Run:
    """Step j of a decode run takes `fixed + max(ac + bc·j, am + bm·j)` seconds.

    A plain slotted class (not a frozen dataclass, whose `__init__` costs several times more: a worker
    makes one per decode run); its fields are not changed once made. The lines' crossing point and
    their order are worked out once here, not at every `time`.
    """

    __slots__ = ("a1", "a2", "ac", "am", "b1", "b2", "bc", "bm", "cross", "fixed")

    def __init__(self, fixed: float, ac: float, bc: float, am: float, bm: float) -> None:
        self.fixed, self.ac, self.bc, self.am, self.bm = fixed, ac, bc, am, bm
        d0, dd = ac - am, bc - bm
        # steps [0, split) take one line (a1 + b1·j), [split, n) the other, with split the crossing
        # point rounded up and clamped to [0, n] (parallel lines: never, split = n)
        if dd == 0:
            self.cross, first_compute = math.inf, d0 > 0
        elif dd > 0:  # compute overtakes memory at j >= -d0/dd
            self.cross, first_compute = -d0 / dd, False
        else:  # compute is above memory up to j <= -d0/dd
            self.cross, first_compute = -d0 / dd, True
        if first_compute:
            self.a1, self.b1, self.a2, self.b2 = ac, bc, am, bm
        else:
            self.a1, self.b1, self.a2, self.b2 = am, bm, ac, bc

    def step(self, j: int) -> float:
        return self.fixed + max(self.ac + self.bc * j, self.am + self.bm * j)

    def time(self, n: int) -> float:
        """Seconds for the first n steps: `n·fixed + Σ_{j<split} (a1 + b1·j) + Σ_{split<=j<n} (a2 + b2·j)`,
        each sum in closed form (`a·count + b·(lo + hi − 1)·count / 2`)."""
        if n <= 0:
            return 0.0
        x = self.cross
        if x <= 0:
            split = 0
        elif x >= n:
            split = n
        else:
            split = int(x)
            if split != x:
                split += 1
        first = 0.0 if split <= 0 else self.a1 * split + self.b1 * (split - 1) * split / 2.0
        count = n - split
        second = 0.0 if count <= 0 else self.a2 * count + self.b2 * (split + n - 1) * count / 2.0
        return n * self.fixed + first + second

    def steps_within(self, dt: float, limit: int, whole: float | None = None) -> int:
        """The number of whole steps (at most `limit`) that end within `dt` seconds: the n with
        time(n) <= dt < time(n + 1) (`time` increases with n: every step takes at least `fixed`).
        `whole`: time(limit), if the caller has it (a worker keeps its decode run's).

        Guessed from the run's mean step time, then corrected a step at a time (usually none or one
        step, where a bisection takes ~log2(limit) evaluations of `time`)."""
        if dt <= 0:
            return 0
        time = self.time
        if whole is None:
            whole = time(limit)
        if whole <= dt:
            return limit
        n = int(dt / whole * limit)  # time(0) = 0 < dt < time(limit): the walks below end inside
        if time(n) > dt:
            n -= 1
            while n > 0 and time(n) > dt:
                n -= 1
        else:
            while time(n + 1) <= dt:
                n += 1
        return n
