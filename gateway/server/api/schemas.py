"""The gateway's side of request parsing: its `Bounds` from its config, and the prompt-length check.

The request bodies themselves are parsed by gateway.protocol.openai.requests (shared with the workers'
OpenAI routes) against these Bounds: only the served model is accepted (404 otherwise), max_tokens is
in 1..limits.max_new_tokens, n in 1..limits.max_n. Prompts are checked against limits.max_prompt_tokens once tokenized.
"""

from __future__ import annotations

from gateway.config import Config
from gateway.protocol.openai.errors import InvalidRequest, PromptTooLong
from gateway.protocol.openai.requests import Bounds


def bounds_of(config: Config, vocab_size: int) -> Bounds:
    lim = config.limits
    return Bounds(
        model=config.gateway.served_model_name,
        vocab_size=vocab_size,
        default_max_tokens=lim.default_max_tokens,
        max_new_tokens=lim.max_new_tokens,
        max_prompt_tokens=lim.max_prompt_tokens,
        max_n=lim.max_n,
    )


def check_prompt_length(ids: list[int] | tuple[int, ...], b: Bounds, param: str) -> None:
    if b.max_prompt_tokens is not None and len(ids) > b.max_prompt_tokens:
        raise PromptTooLong(
            f"the prompt has {len(ids)} tokens; this gateway accepts at most {b.max_prompt_tokens}",
            param=param,
        )
    if not ids:
        raise InvalidRequest("the prompt is empty after tokenization", param=param)
