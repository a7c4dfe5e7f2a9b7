"""A page's bytes as the page store handles them: any buffer SGLang passes, viewed as flat bytes."""

from __future__ import annotations

from typing import Any

Buffer = bytes | bytearray | memoryview


def flat(data: Any) -> memoryview:
    """`data` (any buffer) as one-dimensional unsigned bytes, without a copy."""
    mv = memoryview(data)
    return mv if mv.ndim == 1 and mv.format == "B" else mv.cast("B")
