"""Adaptive speculation length for draft assist (DESIGN 4.5).

With per-token acceptance rate a and k drafted tokens, a target step emits on average
`(1 − a^{k+1}) / (1 − a)` tokens (the accepted prefix plus the target's own next token), and costs
the verification of k extra tokens per request. `choose_k` picks the k that maximises tokens per
unit of step time; `AcceptanceEstimator` tracks a from verification rounds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from gateway.core.costmodel import CostModel
from gateway.core.types import WorkerView, check

# step time with k extra verified tokens per request, relative to (or in the same unit as) k = 0
CostOfK = Callable[[int], float]


def expected_tokens_per_step(a: float, k: int) -> float:
    """Mean tokens one target step emits for a request with k drafts at acceptance rate a."""
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"acceptance rate must be in [0, 1], got {a}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if a == 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def choose_k(a: float, k_min: int, k_max: int, cost: CostOfK | float) -> int:
    """The k in [k_min, k_max] with the most expected tokens per unit of step time; ties: smaller k.

    `cost` is either a function k → step time (any unit, > 0) or the extra cost of one drafted token
    per request as a fraction of the plain step, i.e. cost(k) = 1 + cost·k.
    """
    if not 0 <= k_min <= k_max:
        raise ValueError(f"need 0 <= k_min <= k_max, got {k_min}, {k_max}")
    if callable(cost):
        cost_of = cost
    else:
        ratio = float(cost)
        if not (ratio >= 0 and math.isfinite(ratio)):
            raise ValueError(f"the per-token cost ratio must be a finite number >= 0, got {ratio}")

        def cost_of(k: int) -> float:
            return 1.0 + ratio * k

    best_k, best = k_min, -math.inf
    for k in range(k_min, k_max + 1):
        c = cost_of(k)
        if not (c > 0 and math.isfinite(c)):
            raise ValueError(f"the cost of k={k} must be a finite number > 0, got {c}")
        value = expected_tokens_per_step(a, k) / c
        if value > best:  # strict: a tie keeps the smaller k
            best_k, best = k, value
    return best_k


@dataclass(frozen=True, slots=True)
class AcceptanceEstimator:
    """Exponentially weighted estimate of the per-token acceptance rate a.

    A round that proposed k drafts and accepted the first n of them tested n + 1 tokens when n < k
    (n agreements, then one disagreement) and k tokens when n = k. The estimate is the ratio of the
    EWMAs of agreements and tested tokens, so rounds with more drafts weigh more and the first round
    is not biased towards the prior.
    """

    prior: float = 0.7
    weight: float = 0.1  # weight of the newest round
    accepted: float = 0.0
    tested: float = 0.0
    rounds: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.prior <= 1.0:
            raise ValueError(f"prior must be in [0, 1], got {self.prior}")
        if not 0.0 < self.weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got {self.weight}")

    @property
    def rate(self) -> float:
        return self.prior if self.tested <= 0 else self.accepted / self.tested

    def update(self, accepted: int, proposed: int) -> AcceptanceEstimator:
        """The estimate after one round; a round with no drafts carries no information."""
        if not 0 <= accepted <= proposed:
            raise ValueError(f"need 0 <= accepted <= proposed, got {accepted}, {proposed}")
        if proposed == 0:
            return self
        tested = accepted + 1 if accepted < proposed else proposed
        w = self.weight
        return AcceptanceEstimator(
            prior=self.prior,
            weight=w,
            accepted=(1 - w) * self.accepted + w * accepted,
            tested=(1 - w) * self.tested + w * tested,
            rounds=self.rounds + 1,
        )


# -- when draft assist pays (issue 17) ----------------------------------------------------------------

# a target is paired only when drafting raises the rate at which it completes requests (and so frees
# batch slots for its queue) by at least this factor: the break-even of a drafter that is loaded
# anyway is 1, and the margin covers the cost model's error (within 1.5 % of the simulator's
# saturated worker on conversation and code-like loads, tests/unit/test_core_assist_gate.py; not
# yet calibrated on a GPU)
ASSIST_MIN_GAIN = 1.1
# ... and it is overloaded: at least this many requests waiting for a batch slot
ASSIST_MIN_WAITING = 1
# mean context assumed for a target that reports no KV in use
DEFAULT_CONTEXT = 1000.0
# the mean prompt and output tokens of the requests a target serves, when the shell does not say: the
# shared Azure LLM inference conversation trace's (19,366 requests: 1,154.7 / 211.1)
DEFAULT_PROMPT_TOKENS = 1155.0
DEFAULT_OUTPUT_TOKENS = 211.0
# prefill tokens per engine step (SGLang's --chunked-prefill-size default, the simulator's)
DEFAULT_CHUNK = 8192


@dataclass(frozen=True, slots=True)
class AssistGate:
    """The cost model of draft assist on one target (DESIGN 4.5, issue 17).

    A drafted step verifies k drafts per request (`target.batch_step_time` with b·k more tokens) and,
    with `drafter` set, first waits for the drafter's k decode steps over the same batch (the drafter
    drafts for every request of the target's batch at once). `drafter` None models free drafts (the
    optimistic model the simulator used before issue 17).

    What a queued request waits for is a batch slot, so the gate judges the rate at which the target
    completes requests (`request_time`), not its decode throughput: every completed request's slot
    goes to a queued request whose prompt (`prompt_tokens`) is prefilled inside the same steps, and
    drafting speeds up only the decoding part (and slows the prefill steps down by the drafter's
    wait and the verification). `prompt_tokens` 0 leaves prefill out (decode throughput only).

    `load_delay_s` and `assist_window_s` are what drafting costs a restart before it drafts at all:
    loading the draft model first makes the full model serve `load_delay_s` later (the draft's
    weights, read first from the same storage: core/reload.py `DraftFirst`, the timeline of both the
    simulator and Lumen's worker) and the drafter then drafts for `assist_window_s` (`load_pays`).
    """

    target: CostModel
    drafter: CostModel | None = None
    agreement: float = 0.7
    k_min: int = 1
    k_max: int = 8
    min_gain: float = ASSIST_MIN_GAIN
    min_waiting: int = ASSIST_MIN_WAITING
    # the target's batch limit: a request counts as waiting only beyond a full batch (0: any queue)
    nominal_batch: int = 0
    # the shape of the load: mean prompt and output tokens per request, prefill tokens per step
    prompt_tokens: float = DEFAULT_PROMPT_TOKENS
    output_tokens: float = DEFAULT_OUTPUT_TOKENS
    chunk: int = DEFAULT_CHUNK
    # a restart that loads its draft model first: how much later its full model serves, and how long
    # it drafts until then (seconds)
    load_delay_s: float = 0.0
    assist_window_s: float = 0.0

    def __post_init__(self) -> None:
        check(0.0 <= self.agreement <= 1.0, "agreement", self.agreement, "must be in [0, 1]")
        check(0 <= self.k_min <= self.k_max, "k_min", self.k_min, "need 0 <= k_min <= k_max")
        check_gate_bounds(self.min_gain, self.min_waiting)
        check(self.nominal_batch >= 0, "nominal_batch", self.nominal_batch, "must be >= 0")
        p, o = self.prompt_tokens, self.output_tokens
        check(p >= 0 and math.isfinite(p), "prompt_tokens", p, "must be a finite number >= 0")
        check(o >= 1 and math.isfinite(o), "output_tokens", o, "must be a finite number >= 1")
        check(self.chunk >= 1, "chunk", self.chunk, "must be >= 1")
        for name in ("load_delay_s", "assist_window_s"):
            v = getattr(self, name)
            check(v >= 0 and math.isfinite(v), name, v, "must be a finite number >= 0")


def check_gate_bounds(min_gain: float, min_waiting: int) -> None:
    """The bounds of the gate's two knobs (raises `ParamError` naming the field)."""
    ok = min_gain >= 0 and math.isfinite(min_gain)
    check(ok, "min_gain", min_gain, "must be a finite number >= 0")
    check(min_waiting >= 0, "min_waiting", min_waiting, "must be >= 0")


def _step_time(cost: CostModel, new: float, attn: float, kv_read: float) -> float:
    """`CostModel.step_time` from the step's sums: `new` tokens computed, `attn` = Σ attended context
    over them, `kv_read` = Σ context read (the same roofline, O(1))."""
    m, g = cost.model, cost.gpu
    flops = 2.0 * m.params * new + 4.0 * m.layers * m.q_dim * attn
    bytes_moved = m.weight_bytes + (kv_read + new) * m.kv_bytes_per_token
    compute_s = flops / (g.peak_flops * g.mfu * cost.tp)
    memory_s = bytes_moved / (g.hbm_bw * g.mbu * cost.tp)
    comm_s = 2 * m.layers * g.tp_allreduce_s if cost.tp > 1 else 0.0
    return cost.step_overhead_s + max(compute_s, memory_s) + comm_s


def request_time(gate: AssistGate, batch: int, context: float, k: int) -> float:
    """Seconds of the target's time per completed request with k drafts per step (k = 0: plain).

    The steady state of an overloaded target: `batch` requests of mean context `context` decode, and
    each freed slot is taken at once by a queued request. Each step emits E = `expected_tokens_per_step`
    tokens per request, so a request takes n = O / (b·E) of the batch's steps (O = `output_tokens`).
    The newcomer's prompt (P = `prompt_tokens`) is prefilled inside decode steps, p = min(chunk,
    P·max(1, 1/n)) tokens per step (prompts share a step when more than one request ends per step),
    each token attending to P/2 earlier ones of its prompt on average: P/p mixed steps per request.

        T(k) = (P/p)·t_mixed(k) + max(0, n − P/p)·t_decode(k)

    Both step times include the verification of b·k drafts and the drafter's k steps over the batch.
    With P = 0 it is n·t_decode(k), and T(0)/T(k) is the decode-only gain E·t(0)/t(k).
    """
    b = max(1, batch)
    ctx = max(1.0, context)
    e = expected_tokens_per_step(gate.agreement, k)
    wait = k * gate.drafter.batch_step_time(b, ctx) if gate.drafter is not None and k else 0.0
    decode = gate.target.batch_step_time(b, ctx, b * k) + wait
    n = gate.output_tokens / (b * e)
    prompt = gate.prompt_tokens
    if prompt <= 0:
        return n * decode
    p = min(float(gate.chunk), prompt * max(1.0, 1.0 / n))
    mixed_steps = prompt / p
    # the chunk attends to P/2 earlier tokens of its prompt on average, and reads the KV of the
    # prompt's earlier chunks (none when the whole prompt fits in one step)
    new = p + b * (1 + k)
    attn = p * prompt / 2.0 + b * ctx * (1 + k)
    kv = b * ctx + max(0.0, prompt - p) / 2.0
    mixed = _step_time(gate.target, new, attn, kv) + wait
    return mixed_steps * mixed + max(0.0, n - mixed_steps) * decode


def assist_gain(gate: AssistGate, batch: int, context: float) -> tuple[int, float]:
    """The best k for a target decoding `batch` requests of mean context `context`, and how much
    faster it completes requests at that k than without drafts (`request_time`; > 1: drafting pays).
    Ties go to the smaller k."""
    a = gate.agreement

    def cost(k: int) -> float:  # choose_k maximises E(a, k) / cost(k): here the rate 1 / T(k)
        return expected_tokens_per_step(a, k) * request_time(gate, batch, context, k)

    k = choose_k(a, gate.k_min, gate.k_max, cost)
    return k, request_time(gate, batch, context, 0) / request_time(gate, batch, context, k)


def load_pays(gate: AssistGate, gain: float) -> bool:
    """Whether drafting at `gain` for `assist_window_s` makes up for the full model serving
    `load_delay_s` later: the target (a worker like the restarting one) completes (gain − 1)·window
    worker-seconds of extra requests while the delay costs the restarting worker delay seconds of its
    own. Assumes the target stays overloaded for the whole window (optimistic otherwise)."""
    return (gain - 1.0) * gate.assist_window_s >= gate.load_delay_s


def overloaded(gate: AssistGate, w: WorkerView) -> bool:
    """`w` has at least `min_waiting` requests queued beyond a full batch (a momentary queue of a
    request about to be admitted into a batch with room is not overload)."""
    queued = w.running + w.waiting - gate.nominal_batch if gate.nominal_batch else w.waiting
    return min(w.waiting, queued) >= gate.min_waiting


def view_gain(gate: AssistGate, w: WorkerView) -> tuple[int, float]:
    """`assist_gain` for `w` as the view reports it, in the steady state the gate models: the batch
    it runs while its queue lasts (its running requests plus the queued ones, up to the batch limit
    and to what its KV holds at its mean size per request: a snapshot taken while freed slots are
    being refilled would otherwise judge a smaller batch than the one drafting runs on), of the
    load's mean context P + O/2 (its KV in use per request when prefill is left out). So every full
    batch is judged alike, and a restart that loads its draft model because a target would be paired
    (`draft_first_pays`) finds one still paired when the draft is ready, unless the load changed."""
    running, used = w.running, w.kv_tokens_used
    per_request = used / running if running > 0 and used > 0 else DEFAULT_CONTEXT
    batch = running
    if gate.nominal_batch and w.waiting and running < gate.nominal_batch:
        fits = int(w.kv_capacity_tokens // per_request) if used > 0 else gate.nominal_batch
        batch = max(running, min(gate.nominal_batch, running + w.waiting, fits))
    ctx = gate.prompt_tokens + gate.output_tokens / 2.0 if gate.prompt_tokens > 0 else per_request
    return assist_gain(gate, batch, ctx)


def assist_pays(gate: AssistGate, w: WorkerView) -> bool:
    """Draft for `w` only if it is overloaded (`overloaded`) and drafting makes it complete requests
    at least `min_gain` times faster: an idle target, a large batch, or a load whose time goes mostly
    to prefill gains less than the drafts cost."""
    if gate.min_waiting > 0 and not overloaded(gate, w):
        return False
    return view_gain(gate, w)[1] >= gate.min_gain
