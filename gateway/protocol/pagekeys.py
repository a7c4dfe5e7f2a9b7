"""Content addresses of KV pages, compatible with SGLang HiCache (DESIGN 4.4).

One key per *full* page; key_i = SHA-256(raw 32-byte digest of key_{i-1} ‖ page i's token ids), as
lowercase hex. The first page has no predecessor digest unless a prior is given (a namespace seed, or
the key of the page before when hashing a continuation). Token ids are little-endian uint32; a page
holding any id above 2^32−1 is instead hashed as one 0xff marker byte followed by every id of that
page as little-endian uint64 (SGLang's native hasher, `mem_cache/cpp_utils/hash_binding.cpp`; the odd
byte count keeps the two encodings apart). Ids must lie in [0, 2^63−1].

SGLang seeds a chain from the request's `extra_key`/`cache_salt` only when one is set
(`storage_namespace_seed` in `mem_cache/utils.py`); `namespace_seed` reproduces it byte for byte.
Because each key folds in its parent, a key names a whole prefix: keys of a prefix are a prefix of
the keys, and equal keys mean equal prefixes, so shared prefixes dedupe in a content-addressed store.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

_U32_MAX = 0xFFFF_FFFF
_WIDE_MARKER = b"\xff"
KEY_HEX_LEN = 64


def namespace_seed(extra_key: str | None, cache_salt: str | None) -> str | None:
    """The prior SGLang gives page 0 of a namespaced request; None (no seed) when both are unset."""
    if extra_key is None and cache_salt is None:
        return None
    digest = hashlib.sha256(b"sglang-cache-namespace-v1")
    # presence byte and a length prefix keep (absent, empty, "a"+"b" vs "ab") distinct
    for part in (extra_key, cache_salt):
        if part is None:
            digest.update(b"\x00")
            continue
        encoded = part.encode("utf-8")
        digest.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return digest.hexdigest()


def is_key(s: str) -> bool:
    """Whether `s` is a well-formed page key (64 lowercase or uppercase hex characters)."""
    if len(s) != KEY_HEX_LEN:
        return False
    try:
        bytes.fromhex(s)
    except ValueError:
        return False
    return True


def _prior_digest(prior: str | None) -> bytes | None:
    # SGLang tests `if prior_hash:`, so an empty string means "no prior" there too
    if not prior:
        return None
    if len(prior) != KEY_HEX_LEN:
        raise ValueError(f"prior key must be {KEY_HEX_LEN} hex characters, got {len(prior)}")
    try:
        return bytes.fromhex(prior)
    except ValueError as exc:
        raise ValueError(f"prior key is not hex: {prior!r}") from exc


def as_token_array(token_ids: Sequence[int] | npt.NDArray[np.integer]) -> npt.NDArray[np.int64]:
    """Token ids as a 1-D int64 array, refusing ids outside [0, 2^63−1]."""
    try:
        arr = np.asarray(token_ids, dtype=np.int64)
    except OverflowError as exc:
        raise ValueError("token ids must lie in [0, 2^63-1]") from exc
    if arr.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {arr.shape}")
    # (a uint64 array above 2^63-1 wraps to negative here and is refused with the rest)
    if arr.size and int(arr.min()) < 0:
        raise ValueError(f"token ids must lie in [0, 2^63-1], got {int(arr.min())}")
    return arr


def page_key(page_ids: npt.NDArray[np.int64], prior: bytes | None) -> bytes:
    """Raw 32-byte digest of one page given its predecessor's raw digest (or None)."""
    h = hashlib.sha256()
    if prior is not None:
        h.update(prior)
    if page_ids.size and int(page_ids.max()) > _U32_MAX:
        h.update(_WIDE_MARKER)
        h.update(page_ids.astype("<u8").tobytes())
    else:
        h.update(page_ids.astype("<u4").tobytes())
    return h.digest()


def page_keys(
    token_ids: Sequence[int] | npt.NDArray[np.integer],
    page_size: int,
    prior: str | None = None,
) -> list[str]:
    """Hex keys of the full pages of `token_ids`; a partial tail page has no key.

    `prior` is the hex key of the page before `token_ids[0]` (or a namespace seed) and None at the
    start of a sequence.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    arr = as_token_array(token_ids)
    n_pages = arr.size // page_size
    if n_pages == 0:
        return []
    digest = _prior_digest(prior)
    keys: list[str] = []
    if int(arr[: n_pages * page_size].max()) <= _U32_MAX:
        # common case: one conversion, then per-page slices of the same byte buffer
        raw = arr[: n_pages * page_size].astype("<u4").tobytes()
        step = 4 * page_size
        for i in range(n_pages):
            h = hashlib.sha256()
            if digest is not None:
                h.update(digest)
            h.update(raw[i * step : (i + 1) * step])
            digest = h.digest()
            keys.append(digest.hex())
        return keys
    for i in range(n_pages):
        digest = page_key(arr[i * page_size : (i + 1) * page_size], digest)
        keys.append(digest.hex())
    return keys
