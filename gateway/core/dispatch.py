"""Recovery dispatch: where an interrupted request resumes (Algorithm 2, DESIGN 6).

Survivors are the HEALTHY workers other than the failed one. A live holder is a HEALTHY survivor
listed among the request's holders; a holder in any other state (SUSPECT, DRAINING, ...) is skipped.

Rules:
- `threshold` (the paper's): restore on the least-loaded live holder h if `L̂(h) ≤ θ_eff` or
  `|C_r| > τ`; otherwise replay on the least-loaded survivor. θ_eff = θ in "absolute" mode and
  θ × (mean L̂ of the survivors) in "relative" mode; when that mean is ≤ 0 (an idle cluster, where a
  relative threshold means nothing) θ itself is used. Trying holders from the lowest load is the
  same as trying them all: if the least-loaded one fails the test, every other one fails it too.
  A replay may land on a holder (when it is the least-loaded survivor); the paper's rule calls that
  a replay, and a Lumen engine will still find the pages in its local store by prefix lookup.
- `always_holder` (DéjàVu, ablation): restore on the least-loaded live holder, whatever its load.
- `replay` (stop-and-restart): always replay on the least-loaded survivor.
- `cost` (Lumen's own): the smaller estimated completion delay, restoring on the best holder or
  replaying on the least-loaded survivor (see `completion_delay`); a tie restores.
Every rule replays when no holder is live, and decides nothing (worker None) when no survivor is
left. A live holder with |C_r| = 0 is still a holder: the gateway learns durable prefixes from
heartbeats, so |C_r| is a lower bound that lags the holder's store by up to one interval, and a
holder the rule accepts restores whatever it has by then (a short prefix when the rule says so). Ties between equal loads or delays go to the smaller id, so decisions do not depend
on the order of the view or of the holders.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from gateway.core.costmodel import CostModel, StepWork
from gateway.core.load import SERVING, LoadTable, estimated_load, load_table
from gateway.core.modes import DISPATCH_RULES, DispatchRule
from gateway.core.router import choose_worker
from gateway.core.types import ClusterView, LoadParams, WorkerId, WorkerView, check


class ThetaMode(StrEnum):
    """θ as a multiple of the survivors' mean `L̂` (relative) or as an `L̂` value (absolute)."""

    RELATIVE = "relative"
    ABSOLUTE = "absolute"


THETA_MODES: tuple[str, ...] = tuple(ThetaMode)
Action = Literal["restore", "replay"]


@dataclass(frozen=True, slots=True)
class InterruptedRequest:
    """A request that was in flight on `failed_worker` when it failed.

    `durable_tokens` is |C_r|: the prefix every listed holder has durably stored (with two holders
    the shell passes the smaller count, or lists only the holders that have it).
    """

    rid: str
    failed_worker: WorkerId
    holders: tuple[WorkerId, ...] = ()
    durable_tokens: int = 0
    context_tokens: int = 0  # prompt + emitted output
    remaining_tokens: int = 0  # output tokens still to generate

    def __post_init__(self) -> None:
        if min(self.durable_tokens, self.context_tokens, self.remaining_tokens) < 0:
            raise ValueError(f"request {self.rid!r}: token counts must be >= 0")
        if self.durable_tokens > self.context_tokens:
            raise ValueError(
                f"request {self.rid!r}: {self.durable_tokens} durable tokens exceed its context of "
                f"{self.context_tokens}"
            )


@dataclass(frozen=True, slots=True)
class DispatchParams:
    load: LoadParams = field(default_factory=LoadParams)
    rule: DispatchRule = DispatchRule.THRESHOLD
    theta: float = 2.0
    theta_mode: ThetaMode = ThetaMode.RELATIVE
    tau: int = 512  # tokens
    # cost rule: decode steps a running request still needs on average before it frees its batch
    # slot (about half the Azure conversation trace's median output of ~129 tokens)
    service_steps: int = 64

    def __post_init__(self) -> None:
        check(self.rule in DISPATCH_RULES, "rule", self.rule, f"must be one of {', '.join(DISPATCH_RULES)}")
        check(
            self.theta_mode in THETA_MODES, "theta_mode", self.theta_mode, "must be one of relative, absolute"
        )
        check(
            self.theta >= 0 and math.isfinite(self.theta), "theta", self.theta, "must be a finite number >= 0"
        )
        check(self.tau >= 0, "tau", self.tau, "must be >= 0 tokens")
        check(self.service_steps >= 0, "service_steps", self.service_steps, "must be >= 0")


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    worker: WorkerId | None  # None only when no survivor is left
    reason: str


def dispatch(
    view: ClusterView, request: InterruptedRequest, params: DispatchParams, cost: CostModel | None = None
) -> Decision:
    """Where `request` resumes after its worker failed. The `cost` rule needs `cost`."""
    if params.rule == "cost" and cost is None:
        # a configuration error, not a runtime condition: fail before looking at the view
        raise ValueError("the cost dispatch rule needs a cost model")
    # survivors: the serving workers but the failed one, ranked by (L̂, id) in the view's table
    table = load_table(view, params.load)
    failed = request.failed_worker
    least = choose_worker(view, params.load, exclude=(failed,))
    if least is None:
        return Decision("replay", None, "no survivor")
    if params.rule == "replay":
        return Decision("replay", least, "replay rule")
    workers, load_params = view.workers, params.load
    live = sorted(
        {
            (estimated_load(w, load_params), h)
            for h in request.holders
            if h != failed and (w := workers.get(h)) is not None and w.state in SERVING
        }
    )
    if not live:
        return Decision("replay", least, "no live holder")
    load, best = live[0]
    if params.rule == "always_holder":
        return Decision("restore", best, "always_holder rule")
    if params.rule == "cost" and cost is not None:
        return _by_cost(workers[least], [workers[h] for _, h in live], request, params, cost)
    theta = _theta(table, failed in workers and workers[failed].state in SERVING, failed, params)
    if request.durable_tokens > params.tau:
        return Decision("restore", best, f"|C_r|={request.durable_tokens} > tau={params.tau}")
    if load <= theta:
        return Decision("restore", best, f"L(h)={load:.3g} <= theta_eff={theta:.3g}")
    return Decision(
        "replay",
        least,
        f"L(h)={load:.3g} > theta_eff={theta:.3g} and |C_r|={request.durable_tokens} <= tau={params.tau}",
    )


def _theta(table: LoadTable, failed_serving: bool, failed: WorkerId, params: DispatchParams) -> float:
    """`theta_eff` of the survivors (the table's workers but `failed`), from the table's loads."""
    if params.theta_mode == "absolute":
        return params.theta
    if failed_serving:  # the failed worker is still serving in this view: leave it out
        survivors = [load for load, wid in table.ranked if wid != failed]
        count, total = len(survivors), math.fsum(survivors)
    else:
        count, total = len(table.ranked), table.total()
    if not count:
        return params.theta
    mean = total / count
    return params.theta * mean if mean > 0 else params.theta


def theta_eff(survivors: list[WorkerView], params: DispatchParams) -> float:
    """The overload threshold holders are compared with (see the module docstring for mean ≤ 0)."""
    if params.theta_mode == "absolute" or not survivors:
        return params.theta
    # fsum is exactly rounded, so the mean does not depend on the order of the view
    mean = math.fsum(estimated_load(w, params.load) for w in survivors) / len(survivors)
    return params.theta * mean if mean > 0 else params.theta


def completion_delay(
    w: WorkerView, request: InterruptedRequest, restored: int, params: DispatchParams, cost: CostModel
) -> float:
    """Estimated seconds until `request` finishes on `w` after restoring `restored` of its tokens.

    The sum of
    - queue wait: the two terms of L̂(w) turned into time. Requests beyond the nominal batch wait for
      slots; slots free at `nominal_batch` per `service_steps` full-batch decode steps, so the wait is
      excess / nominal_batch × service_steps × step. And w's checkpoints (other than r's own) are a
      restore backlog it may have to absorb: restore_time of those tokens. α and β are priorities,
      not times, so they are not applied here;
    - restore_time(restored), host DRAM → GPU;
    - the prefill of the tail (context − restored) in one step alongside w's decode batch;
    - the remaining decode steps at w's batch size (so a swamped worker also decodes slower).
    The batch's other requests are assumed to have r's context length (the view carries no better).
    """
    batch = params.load.nominal_batch
    ahead = w.running + w.waiting + w.pending
    in_batch = min(ahead, max(0, batch - 1))
    ctx = request.context_tokens
    decode = uniform_step_time(cost, in_batch + 1, ctx)  # cost.decode_step_time([ctx] * (in_batch + 1))
    excess = max(0, ahead + 1 - batch)
    wait = excess / max(1, batch) * params.service_steps * decode
    # r's own pages on w are restored (counted below) or dropped, never a backlog
    own = request.durable_tokens if w.id in request.holders else 0
    backlog = cost.restore_time(max(0, w.ckpt_tokens - own))
    tail = request.context_tokens - restored
    prefill = uniform_step_time(cost, in_batch, ctx, (tail, restored))
    return wait + backlog + cost.restore_time(restored) + prefill + request.remaining_tokens * decode


def uniform_step_time(
    cost: CostModel, decoding: int, context: int, prefill: tuple[int, int] | None = None
) -> float:
    """`cost.step_time` of `decoding` requests of `context` tokens each (plus one `prefill` chunk of
    (new tokens, context)), without building the batch.

    The same float as `cost.step_time(StepWork(prefill=(prefill,) if prefill else (),
    decode_contexts=(context,) * decoding))`: the same operations in the same order (the per-request
    attention FLOPs are still added one by one, as float sums are not associative), only without the
    per-request tuples and generators. A CostModel subclass that overrides the step time is asked.
    """
    if type(cost).step_time is not CostModel.step_time:
        work = StepWork(prefill=(prefill,) if prefill else (), decode_contexts=(context,) * decoding)
        return cost.step_time(work)
    m, g = cost.model, cost.gpu
    new_tokens = decoding
    kv_read_tokens = 0
    if prefill is not None:
        new_tokens += prefill[0]
    if new_tokens == 0:
        return 0.0
    flops = 2.0 * m.params * new_tokens
    if prefill is not None:
        n, pctx = prefill
        flops += 4.0 * m.layers * m.q_dim * n * (pctx + n / 2.0)
        kv_read_tokens += pctx
    per_request = 4.0 * m.layers * m.q_dim * context
    for _ in range(decoding):
        flops += per_request
    kv_read_tokens += context * decoding
    bytes_moved = m.weight_bytes + (kv_read_tokens + new_tokens) * m.kv_bytes_per_token
    compute_s = flops / (g.peak_flops * g.mfu * cost.tp)
    memory_s = bytes_moved / (g.hbm_bw * g.mbu * cost.tp)
    comm_s = 2 * m.layers * g.tp_allreduce_s if cost.tp > 1 else 0.0
    return cost.step_overhead_s + max(compute_s, memory_s) + comm_s


def _by_cost(
    least: WorkerView,
    holders: list[WorkerView],
    request: InterruptedRequest,
    params: DispatchParams,
    cost: CostModel,
) -> Decision:
    c = request.durable_tokens
    delay, holder = min((completion_delay(h, request, c, params, cost), h.id) for h in holders)
    replay = completion_delay(least, request, 0, params, cost)
    if delay <= replay:
        return Decision("restore", holder, f"restore {delay:.3g}s <= replay {replay:.3g}s")
    return Decision("replay", least.id, f"replay {replay:.3g}s < restore {delay:.3g}s")
