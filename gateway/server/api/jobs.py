"""The seam between the HTTP API and the request sessions.

The API turns a client request into a `GenerateJob` (token ids + sampling), hands it to
`SessionManager.generate`, and renders the `TokenDelta`s it gets back; it never sees workers,
failures or replays. Everything behind `generate` (routing, streaming from a worker, failover) is
the sessions' business.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

from gateway.protocol.generate import TokenLogprob

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True, slots=True)
class Sampling:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    # token ids that end generation (the tokenizer's EOS plus the request's own); ignored if ignore_eos
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # None: the gateway draws one; token at position p is sampled with RNG(seed, p) -> replay-exact
    seed: int | None = None


@dataclass(frozen=True, slots=True)
class Attempt:
    """A worker attempt of a job: where its tokens come from (and where another gateway may adopt it)."""

    worker_id: str
    wrid: str  # the request's id on that worker (`attempt_rid`)
    epoch: int  # the worker's incarnation

    @property
    def base(self) -> int:
        """Output ids of the choice before this attempt's first (its worker's output starts there)."""
        return attempt_base(self.wrid)


def attempt_rid(rid: str, n: int, base: int) -> str:
    """The id of a job's n-th attempt on its worker. One that starts after `base` output ids (a resume:
    its prompt carries them) says so, `<rid>-<n>+<base>`, so that a gateway adopting it later knows
    where its output starts in the choice (the id travels in the signed stream position)."""
    return f"{rid}-{n}" if base == 0 else f"{rid}-{n}+{base}"


def attempt_base(wrid: str) -> int:
    _, plus, base = wrid.rpartition("+")
    return int(base) if plus and base.isdigit() else 0


@dataclass(frozen=True, slots=True)
class GenerateJob:
    rid: str
    prompt_ids: tuple[int, ...]
    sampling: Sampling
    stream: bool = True
    # free-form labels for logs and metrics (endpoint, api key id)
    labels: dict[str, str] = field(default_factory=dict)
    # None: no log probabilities; k >= 0: every output token's, with the k most likely at its position
    logprobs: int | None = None
    # a resumed stream (Last-Event-ID): the attempt that served it on the gateway that lost it; the
    # session tries to adopt it there before replaying
    adopt: Attempt | None = None


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """New output ids, in order. The last delta of a generation carries `finish_reason`."""

    ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    # the stop token id that ended generation, when finish_reason == "stop" by token
    matched_stop: int | None = None
    # cached/restored prompt tokens reported by the worker (for usage details)
    cached_tokens: int = 0
    # with job.logprobs set: one per id, in order (the same on every worker a resumed stream uses)
    logprobs: tuple[TokenLogprob, ...] = ()
    attempt: Attempt | None = None  # the attempt these ids came from


class Generator(Protocol):
    def generate(self, job: GenerateJob) -> AsyncIterator[TokenDelta]:
        """Stream the job's output. Raises a GatewayError subclass on an unrecoverable failure.

        Closing the iterator early (client gone, stop string matched) aborts the work on the worker.
        """
        ...
