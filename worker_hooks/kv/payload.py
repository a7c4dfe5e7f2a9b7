"""Synthetic KV page bytes for the synthetic engine, tests and benchmarks.

A page's bytes are a pure function of its page key, as real KV is a pure function of the prefix it
encodes: two requests sharing a prefix produce identical pages (so the store dedupes them) and a
restore can check that what came back is byte-for-byte what was sent. Size = page_size ×
kv_bytes_per_token × payload_scale (scale < 1 shrinks pages for cheap runs on CPU machines).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gateway.core.costmodel import ModelSpec
from gateway.protocol.pagekeys import page_keys

_GOLDEN = np.uint64(0x9E37_79B9_7F4A_7C15)  # odd multiplier: distinct words for distinct positions


def page_nbytes(page_size: int, kv_bytes_per_token: int, payload_scale: float = 1.0) -> int:
    """Bytes of one synthetic page (at least 1)."""
    if page_size < 1 or kv_bytes_per_token < 1 or payload_scale <= 0:
        raise ValueError(
            f"need page_size >= 1, kv_bytes_per_token >= 1, payload_scale > 0; got "
            f"{page_size}, {kv_bytes_per_token}, {payload_scale}"
        )
    return max(1, int(page_size * kv_bytes_per_token * payload_scale))


def model_page_nbytes(model: ModelSpec, page_size: int, payload_scale: float = 1.0) -> int:
    return page_nbytes(page_size, model.kv_bytes_per_token, payload_scale)


def page_bytes(key: str, nbytes: int) -> bytes:
    """Deterministic bytes of the page with hex key `key`: a counter mixed with the key's seed."""
    seed = np.uint64(int(key[:16], 16))
    words = np.arange((nbytes + 7) // 8, dtype=np.uint64)
    words *= _GOLDEN
    words ^= seed
    return words.tobytes()[:nbytes]


def pages_payload(
    token_ids: Sequence[int], page_size: int, nbytes: int, prior: str | None = None
) -> tuple[list[str], bytes]:
    """Keys and concatenated synthetic bytes of the full pages of `token_ids` (one payload frame)."""
    keys = page_keys(token_ids, page_size, prior)
    return keys, b"".join(page_bytes(k, nbytes) for k in keys)


def verify(key: str, data: bytes | memoryview) -> bool:
    """Whether `data` is the synthetic page of `key` (restore round-trip check)."""
    mv = memoryview(data).cast("B") if memoryview(data).format != "B" else memoryview(data)
    return mv == page_bytes(key, mv.nbytes)
