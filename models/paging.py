"""Page arithmetic shared by the engine's page pool and every paged KV cache (a drafter's too)."""

from __future__ import annotations


def pages_for(tokens: int, page_size: int) -> int:
    """The pages that hold `tokens` positions (page j holds [j*page_size, (j+1)*page_size))."""
    return -(-tokens // page_size)
