"""The shape of the load a cluster serves: running means of prompt and output tokens (issue 17).

Draft assist's cost gate (speculation.AssistGate) judges how much faster a target completes requests
with drafts; that depends on the load's shape: long outputs gain most, long prompts with short
outputs (code-like loads) spend their time in prefill, which drafting slows. Both shells feed one
estimator with every request that completes (the live gateway's sessions, the simulator's finished
requests) and retune the gate from it (`pairing.with_load_shape`), instead of judging every workload
at the conversation trace's shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.core.speculation import DEFAULT_OUTPUT_TOKENS, DEFAULT_PROMPT_TOKENS
from gateway.core.types import check

# about this many of the latest completed requests make the means (the weight of each is 1 / span),
# and no shape is reported before this many have completed: the first requests to complete are the
# short ones (and during a failure the long ones are the ones still running), so a short window is
# biased; over a long one completions are the arrivals' mix
SHAPE_SPAN = 1000


@dataclass(slots=True)
class LoadShape:
    """Exponentially weighted means over about `span` completed requests; until `span` requests
    have completed, `ready` is False and the gate keeps the conversation trace's means."""

    prompt_tokens: float = DEFAULT_PROMPT_TOKENS
    output_tokens: float = DEFAULT_OUTPUT_TOKENS
    span: int = SHAPE_SPAN
    seen: int = 0

    def __post_init__(self) -> None:
        check(self.span >= 1, "span", self.span, "must be >= 1")

    @property
    def ready(self) -> bool:
        return self.seen >= self.span

    def means(self) -> tuple[float, float]:
        """(mean prompt tokens, mean output tokens) as a gate judges them: the measured means once
        `ready`, the conversation trace's before."""
        if self.seen >= self.span:
            return (self.prompt_tokens, self.output_tokens)
        return (DEFAULT_PROMPT_TOKENS, DEFAULT_OUTPUT_TOKENS)

    def observe(self, prompt_tokens: int, output_tokens: int) -> None:
        """One completed request. The first `span` are averaged evenly (no pull towards the prior
        once real requests exist), later ones with weight 1 / span."""
        self.seen = seen = self.seen + 1
        span = self.span
        # min(seen, span) and max(1, output_tokens) without the calls (the same values: once per
        # completed request in the simulator)
        w = 1.0 / (seen if seen < span else span)
        self.prompt_tokens += w * (prompt_tokens - self.prompt_tokens)
        self.output_tokens += w * ((output_tokens if output_tokens > 1 else 1) - self.output_tokens)
