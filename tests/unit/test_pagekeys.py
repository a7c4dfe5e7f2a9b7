"""HiCache-compatible page keys: hand-computed vectors and prefix properties."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.protocol.pagekeys import namespace_seed, page_keys


def u32(ids: list[int]) -> bytes:
    return b"".join(t.to_bytes(4, "little", signed=False) for t in ids)


def test_first_page_is_sha256_of_little_endian_uint32_ids() -> None:
    assert page_keys([1, 2, 3, 4], 4) == [hashlib.sha256(u32([1, 2, 3, 4])).hexdigest()]
    # pinned literal: SHA-256(01000000 02000000), the same bytes SGLang's get_hash_str([1, 2]) hashes
    assert page_keys([1, 2], 2) == ["34fb5c825de7ca4aea6e712f19d439c1da0c92c37b423936c5f618545ca4fa1f"]


def test_each_key_chains_the_raw_digest_of_the_previous_one() -> None:
    ids = [7, 8, 9, 10, 11, 12, 13]  # two full pages of 3 and a partial tail
    d1 = hashlib.sha256(u32([7, 8, 9])).digest()
    d2 = hashlib.sha256(d1 + u32([10, 11, 12])).digest()
    assert page_keys(ids, 3) == [d1.hex(), d2.hex()]


def test_prior_continues_a_chain_and_empty_prior_means_none() -> None:
    ids = list(range(100, 116))
    keys = page_keys(ids, 4)
    assert page_keys(ids[8:], 4, prior=keys[1]) == keys[2:]
    assert page_keys(ids, 4, prior="") == keys


def test_page_with_an_id_above_uint32_uses_the_wide_encoding() -> None:
    big = 2**32 + 5
    d1 = hashlib.sha256(u32([1, 2])).digest()
    wide = b"\xff" + b"".join(t.to_bytes(8, "little") for t in [3, big])
    d2 = hashlib.sha256(d1 + wide).digest()
    d3 = hashlib.sha256(d2 + u32([4, 5])).digest()
    assert page_keys([1, 2, 3, big, 4, 5], 2) == [d1.hex(), d2.hex(), d3.hex()]
    assert page_keys([2**32 - 1], 1) == [hashlib.sha256(u32([2**32 - 1])).hexdigest()]


def test_namespace_seed_matches_sglang_storage_namespace() -> None:
    assert namespace_seed(None, None) is None
    h = hashlib.sha256(b"sglang-cache-namespace-v1")
    h.update(b"\x01" + (6).to_bytes(8, "little") + b"tenant")
    h.update(b"\x00")
    assert namespace_seed("tenant", None) == h.hexdigest()
    assert len({namespace_seed("", None), namespace_seed(None, ""), namespace_seed("ab", None)}) == 3
    seed = namespace_seed("tenant", None)
    assert seed is not None
    expected = hashlib.sha256(bytes.fromhex(seed) + u32([1, 2])).hexdigest()
    assert page_keys([1, 2], 2, prior=seed) == [expected]


def test_numpy_input_matches_list_input() -> None:
    ids = list(range(1000, 1130))
    assert page_keys(np.array(ids, dtype=np.int32), 16) == page_keys(ids, 16)
    assert page_keys(np.array(ids, dtype=np.uint64), 16) == page_keys(ids, 16)


@pytest.mark.parametrize(
    ("ids", "page_size", "prior"),
    [([-1], 1, None), ([2**63], 1, None), ([1], 0, None), ([1], 1, "abc"), ([1], 1, "zz" * 32)],
)
def test_bad_input_is_refused(ids: list[int], page_size: int, prior: str | None) -> None:
    with pytest.raises(ValueError):
        page_keys(ids, page_size, prior)


def test_too_short_for_one_page_has_no_keys() -> None:
    assert page_keys([1, 2, 3], 4) == []
    assert page_keys([], 4) == []


@settings(max_examples=60, deadline=None)
@given(
    ids=st.lists(st.integers(0, 2**33), max_size=80),
    page_size=st.integers(1, 9),
    cut=st.integers(0, 80),
)
def test_keys_of_a_prefix_are_a_prefix_of_the_keys(ids: list[int], page_size: int, cut: int) -> None:
    keys = page_keys(ids, page_size)
    assert len(keys) == len(ids) // page_size
    assert page_keys(ids[:cut], page_size) == keys[: min(cut, len(ids)) // page_size]


@settings(max_examples=40, deadline=None)
@given(
    a=st.lists(st.integers(0, 50), min_size=4, max_size=4),
    b=st.lists(st.integers(0, 50), min_size=4, max_size=4),
)
def test_different_prefixes_get_different_keys(a: list[int], b: list[int]) -> None:
    assert (page_keys(a, 2)[-1] == page_keys(b, 2)[-1]) == (a == b)
