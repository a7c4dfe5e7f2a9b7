"""One simulated client request: what the client has seen, and its current attempt on a worker."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.core.evaluation import RequestRecord
from gateway.sim.fastvalues import request_record

if TYPE_CHECKING:
    from gateway.sim.worker import SimWorker


class SimRequest:
    """Mutable state of one request (a plain slotted class: the simulator touches it in its hot loop).

    Client side: `emitted` output tokens received, first/last token times, interruption and error.
    Attempt side (valid while `worker` serves it): the KV it has (`kv_ctx`), prefill still to do,
    and, once decoding, its position in the worker's step counter (`k_join`, `emitted_base`,
    `ctx_base`, `rem_base`: the values at step `k_join`; they advance by the worker's tokens per step).
    Checkpoint side: its holders, the tokens charged to each (`ck_tokens`), and when the checkpoint
    stream started (`ck_time`, with `ck_base` tokens of context to send in bulk first).
    """

    __slots__ = (
        "a_term",
        "arrival",
        "attempts",
        "awaiting_resume",
        "ck_base",
        "ck_time",
        "ck_tokens",
        "ctx_base",
        "done",
        "durable",
        "emitted",
        "emitted_base",
        "error",
        "finish_step",
        "first_token",
        "holders",
        "interrupted",
        "k_join",
        "kv_ctx",
        "kv_reserved",
        "last_before",
        "last_token",
        "output",
        "prefill_left",
        "prompt",
        "rank_memo",
        "rem_base",
        "restored",
        "resume_delay",
        "rid",
        "worker",
    )

    def __init__(self, rid: int, arrival: float, prompt: int, output: int) -> None:
        self.rid = rid
        self.arrival = arrival
        self.prompt = prompt
        self.output = output
        self.emitted = 0
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.interrupted = False
        self.error = False
        self.done = False
        self.resume_delay: float | None = None
        self.awaiting_resume = False
        self.last_before: float | None = None
        self.attempts = 0
        self.worker: SimWorker | None = None
        self.kv_ctx = 0
        self.kv_reserved = 0
        self.prefill_left = 0
        self.restored = 0
        self.k_join = 0
        self.emitted_base = 0.0
        self.ctx_base = 0.0
        self.rem_base = 0.0
        self.a_term = 0.0
        self.finish_step = 0
        self.holders: tuple[SimWorker, ...] = ()
        self.ck_tokens = 0
        self.ck_time: float | None = None
        self.ck_base = 0
        self.durable = 0
        # (rank_of, attempt, rank): its rank in a worker's queue, as `SimWorker.enqueue` last asked
        self.rank_memo: tuple[object, int, tuple[int, float]] | None = None

    @property
    def context(self) -> int:
        """Prompt plus the output the client has received: what a new attempt must have in KV."""
        return self.prompt + self.emitted

    def record(self) -> RequestRecord:
        first = self.first_token
        last = self.last_token if first is not None else None
        return request_record(
            self.arrival,
            first,
            last,
            self.emitted if first is not None else 0,
            self.interrupted,
            self.error,
            self.resume_delay,
        )
