"""The gateway side of the simulator: the same core policies the live gateway calls, on a virtual clock.

Routing (`choose_worker`), holder placement (`choose_holders`, `reassign_holders`), recovery dispatch
(`dispatch`), draft-assist pairing (`pair_drafters`, `draft_first_pays`, `assist_gain`) and worker
state changes (`transition`) all come from `gateway.core`; this module only keeps the books they read
(the gateway's view of the workers: seen.py).

A holder is charged a checkpoint's final size (context + remaining output) from assignment until
release, as the live checkpoint manager does. A checkpoint streams once the attempt's prefill is
done: the prefilled context in bulk, then each full page as it fills; a page is durable once it
has crossed device→host and the network (`lag_per_token` per token), so at time t the durable prefix
is the smaller of what the bulk transfer has moved and the full pages produced by t − page lag.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection

from gateway.core.costmodel import CostModel
from gateway.core.dispatch import Decision, DispatchParams, InterruptedRequest, dispatch
from gateway.core.health import WorkerState, transition
from gateway.core.holders import HolderParams, choose_holders, reassign_holders
from gateway.core.loadshape import LoadShape
from gateway.core.modes import RecoveryPolicy
from gateway.core.outage import BoostGate, OutageParams, queue_rank
from gateway.core.pairing import (
    PairingParams,
    draft_first_pays,
    pair_drafters,
    with_batch_limit,
    with_load_shape,
)
from gateway.core.reload import choose_seed
from gateway.core.router import choose_worker, routing_params
from gateway.core.speculation import (
    DEFAULT_CHUNK,
    DEFAULT_OUTPUT_TOKENS,
    DEFAULT_PROMPT_TOKENS,
    AssistGate,
    assist_gain,
    choose_k,
    expected_tokens_per_step,
)
from gateway.core.types import ClusterView, LoadParams
from gateway.sim.outage import SimOutage
from gateway.sim.request import SimRequest
from gateway.sim.scenario import DraftSpec
from gateway.sim.seen import SeenCluster
from gateway.sim.stepcost import StepCost
from gateway.sim.worker import SimWorker


class Coordinator:
    def __init__(
        self,
        workers: list[SimWorker],
        policy: RecoveryPolicy,
        cost: CostModel,
        load: LoadParams,
        holders: HolderParams,
        dispatch_params: DispatchParams,
        pairing: PairingParams,
        draft: DraftSpec,
        draft_step: StepCost,
        kv_bytes_per_token: int,
        page_size: int,
        lag_per_token: float,
        route_by_checkpoint_load: bool = False,
        outage: OutageParams | None = None,
        boost_gate: BoostGate | None = None,
    ) -> None:
        self.workers = workers
        self.by_id = {w.id: w for w in workers}
        self.policy, self.cost, self.load, self.holder_params = policy, cost, load, holders
        self.dispatch_params, self.pairing_params, self.draft = dispatch_params, pairing, draft
        self.draft_step = draft_step
        self.kvb, self.page, self.lag_per_token = kv_bytes_per_token, page_size, lag_per_token
        self.route_load = routing_params(load, route_by_checkpoint_load)
        # the gateway's view of the workers (seen.py); the decisions below read view()
        self.seen = SeenCluster(workers)
        self.view: Callable[[], ClusterView] = self.seen.view
        self.freeze: Callable[[SimWorker], None] = self.seen.freeze
        self.pairs: dict[str, str] = {}
        self.decisions: Counter[str] = Counter()
        self.restored_tokens = 0
        self.spec_ks: list[int] = []
        # the load's shape as completed requests show it: the draft-assist and boost gates judge it
        self.shape = LoadShape()
        # survivors' admission while a failure's outage or backlog lasts (gateway.core.outage)
        self.outage = SimOutage(workers, outage or OutageParams(), policy.outage_admission, boost_gate, self.shape)
        # outside a recovery a queue rank depends only on whether the attempt is the first
        # (core `queue_rank`: `(first, 0)`): a first attempt's and a resumed one's, asked once here
        params = self.outage.params
        self._calm_ranks = (queue_rank(1, 1, params, False), queue_rank(2, 1, params, False))

    def set_state(self, w: SimWorker, state: WorkerState) -> None:
        w.state = transition(w.state, state)
        w.mark_dirty()

    # -- routing and attempts -----------------------------------------------------------------------
    def route(self, r: SimRequest, now: float) -> bool:
        wid = choose_worker(self.seen.view(), self.route_load)  # (seen.view: a direct call compiled)
        if wid is None:
            return False
        self.start(r, self.by_id[wid], now, 0)
        return True

    def start(self, r: SimRequest, w: SimWorker, now: float, restored: int) -> None:
        """A new attempt of r on w, restoring `restored` tokens from w's host memory."""
        if r.holders:
            self.release(r)
        else:
            r.ck_time = None  # what release does for a request with no holders
        r.attempts += 1
        r.worker = w
        r.restored = restored
        r.durable = 0
        if self.policy.checkpointing:
            expected = r.prompt + r.emitted + (r.output - r.emitted)  # r.context + what is left
            nbytes = expected * self.kvb
            chosen = choose_holders(self.seen.view(), w.id, nbytes, self.holder_params)
            by_id = self.by_id
            holders = (by_id[chosen[0]],) if len(chosen) == 1 else tuple([by_id[h] for h in chosen])
            self._charge(r, holders, expected)
        outage = self.outage
        w.enqueue(r, now, outage.rank(r) if outage.recovering else self._calm_ranks[r.attempts > 1])

    def _charge(self, r: SimRequest, holders: tuple[SimWorker, ...], tokens: int) -> None:
        nbytes = tokens * self.kvb
        for h in holders:
            h.ckpt_tokens += tokens
            h.ckpt_bytes += nbytes
            h.held.add(r)
            if not h.dirty:  # h.mark_dirty(), inlined
                h.dirty = True
                h.dirty_sink.append(h)
        r.holders = r.holders + holders if r.holders else holders
        r.ck_tokens = tokens

    def release(self, r: SimRequest) -> None:
        """Every holder drops r's checkpoint (the request ended, or a new attempt starts)."""
        tokens = r.ck_tokens
        nbytes = tokens * self.kvb
        for h in r.holders:
            h.ckpt_tokens -= tokens
            h.ckpt_bytes -= nbytes
            h.held.discard(r)
            if not h.dirty:  # h.mark_dirty(), inlined
                h.dirty = True
                h.dirty_sink.append(h)
        r.holders = ()
        r.ck_time = None

    # -- checkpoints --------------------------------------------------------------------------------
    def stream_from(self, r: SimRequest, now: float, tokens: int) -> None:
        """r's serving worker starts sending its pages: `tokens` of context in bulk, then as produced."""
        if r.holders:
            r.ck_time, r.ck_base = now, tokens

    def durable_at(self, r: SimRequest, now: float) -> int:
        """Full pages of r every holder has in host memory at `now` (0 without a stream)."""
        w = r.worker
        if r.ck_time is None or not r.holders or w is None:
            if self.holder_params.stream_prefill and r.holders and w is not None:
                return prefilled_pages(r, self.page)
            return 0
        page_lag = self.page * self.lag_per_token
        bulk_s = r.ck_base * self.lag_per_token
        if now - r.ck_time < bulk_s + page_lag:
            sent = r.ck_base * min(1.0, (now - r.ck_time) / bulk_s) if bulk_s > 0 else 0.0
            tokens = int(sent)
        else:
            # r.emitted (what the client has) is only brought up to date at a kill; count from the steps
            k, _ = w.step_at(now - page_lag)
            tokens = max(r.prompt + int(w.batch.emitted_at(r, k) + 1e-9), r.ck_base)
        return tokens - tokens % self.page

    def holder_failed(self, dead: SimWorker, now: float) -> None:
        """`dead`'s checkpoints are gone; requests still served elsewhere get a new holder."""
        affected = sorted(dead.held, key=lambda r: r.rid)
        dead.held.clear()
        dead.ckpt_tokens = dead.ckpt_bytes = 0
        dead.mark_dirty()
        for r in affected:
            r.holders = tuple(h for h in r.holders if h is not dead)
            w = r.worker
            if r.done or w is None or not w.alive or w.state is not WorkerState.HEALTHY:
                continue  # r is itself interrupted: dispatch uses the holders left
            new = reassign_holders(
                self.view(), w.id, [h.id for h in r.holders], r.ck_tokens * self.kvb, self.holder_params
            )
            self._charge(r, tuple(self.by_id[h] for h in new), r.ck_tokens)
            if new and r.rid in w.batch.members:
                k, _ = w.step_at(now)
                self.stream_from(r, now, r.prompt + int(w.batch.emitted_at(r, k)))

    # -- recovery -------------------------------------------------------------------------------------
    def recover(self, r: SimRequest, failed: SimWorker, now: float) -> bool:
        """Algorithm 2 for an interrupted request; False when no survivor is left."""
        ir = InterruptedRequest(
            rid=str(r.rid),
            failed_worker=failed.id,
            holders=tuple(h.id for h in r.holders),
            durable_tokens=min(r.durable, r.context),
            context_tokens=r.context,
            remaining_tokens=r.output - r.emitted,
        )
        decision: Decision = dispatch(self.view(), ir, self.dispatch_params, self.cost)
        if decision.worker is None:
            return False
        self.begin_recovery(now)
        self.decisions[decision.action] += 1
        target = self.by_id[decision.worker]
        # the engine finds r's pages in its own store by prefix lookup, whatever the rule called it
        restored = ir.durable_tokens if target in r.holders else 0
        self.restored_tokens += restored
        self.start(r, target, now, restored)
        return True

    # -- seeded reload ----------------------------------------------------------------------------------
    def choose_seed(self, w: SimWorker, busy: Collection[str]) -> SimWorker | None:
        """The survivor restarting `w` loads its weights from (every simulated worker serves the same
        model and TP), or None: from disk. `busy`: seeds already sending to another restart."""
        wid = choose_seed(self.view(), w.id, self.load, busy)
        return None if wid is None else self.by_id[wid]

    # -- the outage: survivors' queue order and batch limit (gateway/sim/outage.py) ---------------
    def begin_recovery(self, now: float) -> None:
        """A recovery starts, or goes on (a later dispatch): the outage's queue order and limit."""
        if not self.outage.recovering:
            self._admitting(self.outage.set_recovering(True, now))
        elif self.outage.shaping:
            self._admitting(self.outage.check(now))

    def check_backlog(self, now: float) -> None:
        """End the recovery once the backlog has drained (or raise the boost if more are out)."""
        self._admitting(self.outage.check(now))

    def _admitting(self, limit: int | None) -> None:
        """The draft-assist gate judges the batch limit in force (`pairing.with_batch_limit`)."""
        if limit is not None:
            self.pairing_params = with_batch_limit(self.pairing_params, limit)

    # -- draft assist (Algorithm 3) ---------------------------------------------------------------
    def assist_wanted(self) -> bool:
        """Whether a restart should load its draft model first (`pairing.draft_first_pays`): some
        survivor would be drafted for now and drafting for it makes up for the full model's later
        start (the gate's `load_delay_s` over its `assist_window_s`); no gate: yes."""
        self.pairing_params = with_load_shape(self.pairing_params, self.shape)
        return draft_first_pays(self.view(), self.pairing_params)

    def repair(self, now: float) -> None:
        self.check_backlog(now)
        drafters = [w.id for w in self.workers if w.state is WorkerState.DRAFT_READY]
        if not drafters and not self.pairs:
            return
        self.pairing_params = with_load_shape(self.pairing_params, self.shape)
        new = pair_drafters(self.view(), drafters, self.pairs, self.pairing_params)
        before, after = set(self.pairs.values()), set(new.values())
        self.pairs = new
        for wid in sorted(before - after):
            self.by_id[wid].set_speculation(0, 1.0, now)
        for wid in sorted(after - before):
            target = self.by_id[wid]
            k, wait = self._choose_k(target)
            self.spec_ks.append(k)
            target.set_speculation(k, expected_tokens_per_step(self.draft.agreement, k), now, wait)

    def _choose_k(self, w: SimWorker) -> tuple[int, float]:
        """k for target w's current batch, and the per-step wait for the drafter it implies. With the
        cost gate, the k that completes requests fastest (`speculation.assist_gain`: the prefill of
        the requests taking freed slots included), as the gate judged the pair; without, the k with
        the most decode throughput (the paper's)."""
        b = max(1, len(w.batch))
        ctx = w.batch.ctx_sum(w.k) / b if w.batch else 1000.0
        # one draft-model decode step for the whole batch (only with draft.drafter_latency)
        draft_s = self.draft_step.step(b, b * ctx, b * ctx) if self.draft.drafter_latency else 0.0
        gate = self.pairing_params.gate
        if gate is not None:
            k = assist_gain(gate, b, ctx)[0]
            return k, k * draft_s

        def step(k: int) -> float:
            return w.cost.step(b * (1 + k), b * ctx * (1 + k), b * ctx) + k * draft_s

        d = self.draft
        k = choose_k(d.agreement, d.k_min, d.k_max, step)
        return k, k * draft_s

    # -- metrics ----------------------------------------------------------------------------------------
    def has_live_checkpoint(self, r: SimRequest, dead: set[SimWorker]) -> bool:
        return r.durable > 0 and any(h not in dead for h in r.holders)


def prefilled_pages(r: SimRequest, page: int) -> int:
    """With `stream_prefill`: the full pages of the prefill chunks this attempt has written (a
    restored prefix does not count: the new holders do not have it yet). Optimistic by the transfer
    of the last chunk (~13 µs per token on H100 over 200 Gb/s, below one prefill step)."""
    if r.restored or r.prefill_left <= 0 or r.kv_ctx <= 0:
        return 0
    return r.kv_ctx - r.kv_ctx % page


def assist_gate(
    draft: DraftSpec,
    target: CostModel,
    drafter: CostModel,
    nominal_batch: int,
    *,
    prompt_tokens: float = DEFAULT_PROMPT_TOKENS,
    output_tokens: float = DEFAULT_OUTPUT_TOKENS,
    chunk: int = DEFAULT_CHUNK,
    load_delay_s: float | None = None,
    assist_window_s: float | None = None,
) -> AssistGate | None:
    """The draft-assist cost gate of a scenario (None: `draft.assist_gate` off); the drafter's own
    steps are charged only with `draft.drafter_latency`, as `Coordinator._choose_k` does.

    The load's shape (mean prompt and output tokens, prefill chunk) defaults to the conversation
    trace's. The restart's timeline defaults to the simulator's from the cost models: the draft model
    loads first (engine start-up + its weights), then the full weights, so the full model serves the
    draft's weights time later than a plain restart and the drafter drafts for the full weights' time.
    A scenario that sets `cluster.draft_load_s` or `model_load_s` has another timeline: pass it.
    """
    if not draft.assist_gate:
        return None
    return AssistGate(
        target,
        drafter if draft.drafter_latency else None,
        draft.agreement,
        draft.k_min,
        draft.k_max,
        draft.assist_min_gain,
        draft.assist_min_waiting,
        nominal_batch,
        prompt_tokens,
        output_tokens,
        chunk,
        drafter.weights_time() if load_delay_s is None else load_delay_s,
        target.weights_time() if assist_window_s is None else assist_window_s,
    )


def lag_per_token(kv_bytes_per_token: int, d2h_bw: float, network_bw: float) -> float:
    """Seconds per token of KV from a serving GPU into a remote holder's host memory."""
    return kv_bytes_per_token / d2h_bw + kv_bytes_per_token / network_bw
