"""Whole pages of SGLang's device KV pool as host bytes in HiCache's page format (the plugin's reader).

The plugin (plugin.py) reads a request's KV by page: its slot indices are its `req_to_token` row
(`ReqToTokenPool.req_to_token[req.kv.req_pool_idx, start:end]`, as SGLang's decode offload manager reads
them); `KvReader` gathers the pages from the device pool's per-layer buffers (`MHATokenToKVPool.k_buffer
[l]`/`v_buffer[l]`, rows [slots, heads, head_dim]; `MLATokenToKVPool.kv_buffer[l]`, rows [slots, 1,
kv_cache_dim]) with `index_select` on the current (scheduler) stream, rearranges them on the GPU into the
byte order SGLang's HiCache host pool gives a page (`get_data_page(index, flat=True)` of
`mem_cache/pool_host/mha.py` / `mla.py` for the server's `--hicache-mem-layout`), and copies them with
non-blocking device→host copies into host memory; a CUDA event recorded after them says when the bytes
are there. So a holder that is an SGLang server with Lumen's HiCache backend (`hicache_backend.py`)
restores these pages into its own host pool byte for byte.

Supported: MHA pools in NHD layout without scale buffers and with equal K/V head dims, MLA pools without
layer sharding; host layouts layer_first, page_first, page_first_direct (and page_head for MHA).
Anything else raises `Unsupported` (`reader_for_pool`), which turns the plugin off for that server.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import torch

MHA_LAYOUTS: Final = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS: Final = ("layer_first", "page_first", "page_first_direct")


class Unsupported(Exception):
    """This server's KV pool or layout cannot be checkpointed by the plugin."""


# per host layout: the permutation of the gathered [2, L, n, ps, H, B] (MHA) or [L, n, ps, 1, B] (MLA)
# that puts each page's bytes in SGLang's host-pool page order (mem_cache/pool_host/mha.py, mla.py)
_MHA_PERM: Final = {
    "layer_first": (2, 0, 1, 3, 4, 5),  # page (2, L, ps, H, D)
    "page_first_direct": (2, 0, 1, 3, 4, 5),  # page (2, 1, L, ps, H, D)
    "page_first": (2, 0, 3, 1, 4, 5),  # page (2, ps, L, H, D)
    "page_head": (2, 0, 4, 3, 1, 5),  # page (2, H, ps, L, D)
}
_MLA_PERM: Final = {
    "layer_first": (1, 0, 2, 3, 4),  # page (L, ps, 1, dim)
    "page_first_direct": (1, 0, 2, 3, 4),  # page (1, L, ps, 1, dim)
    "page_first": (1, 2, 0, 3, 4),  # page (ps, L, 1, dim)
}


@dataclass(slots=True, eq=False)
class Staged:
    """One step's pages on their way to host memory."""

    host: torch.Tensor | None
    ready: Callable[[], bool]

    def data(self) -> memoryview:
        assert self.host is not None
        flat: memoryview = self.host.reshape(-1).numpy().data
        return flat

    def release(self) -> None:
        self.host = None  # the pinned block goes back to torch's caching host allocator


class KvReader:
    """Whole pages of a device KV pool as host bytes in SGLang's HiCache page format."""

    def __init__(self, *, mla: bool, buffers: Sequence[Sequence[torch.Tensor]], layout: str, page_size: int):
        perms = _MLA_PERM if mla else _MHA_PERM
        if layout not in perms:
            raise Unsupported(f"host layout {layout!r} (supported: {', '.join(perms)})")
        if page_size < 1 or not buffers or not buffers[0]:
            raise Unsupported("an empty KV pool")
        self.mla, self.layout, self.page_size, self._perm = mla, layout, page_size, perms[layout]
        # byte views of every layer's rows: [slots, heads, head_dim * itemsize]
        self._bufs = [[_bytes_rows(b) for b in group] for group in buffers]
        first = self._bufs[0][0]
        row = tuple(first.shape[1:])
        if any(tuple(b.shape[1:]) != row or b.device != first.device for g in self._bufs for b in g):
            raise Unsupported("KV buffers of different row shapes or devices")
        self.device = first.device
        self.layers = len(self._bufs[0])
        self.row_shape = row
        self.dtype = str(buffers[0][0].dtype).removeprefix("torch.")
        self.page_bytes = len(self._bufs) * self.layers * page_size * row[0] * row[1]
        itemsize = buffers[0][0].element_size()
        if mla:
            self.page_shape = _permuted([self.layers, 1, page_size, 1, row[1] // itemsize], self._perm)[1:]
        else:
            self.page_shape = _permuted(
                [2, self.layers, 1, page_size, row[0], row[1] // itemsize], self._perm
            )[1:]

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """[n_pages, page_bytes] uint8 on the pool's device, for slot indices of whole pages."""
        t = int(slots.numel())
        if t == 0 or t % self.page_size:
            raise ValueError(f"{t} slots are not whole pages of {self.page_size}")
        n = t // self.page_size
        h, b = self.row_shape
        kinds = len(self._bufs)
        out = torch.empty((kinds, self.layers, t, h, b), dtype=torch.uint8, device=self.device)
        for k, group in enumerate(self._bufs):
            for layer, buf in enumerate(group):
                torch.index_select(buf, 0, slots, out=out[k, layer])
        if self.mla:
            x = out[0].view(self.layers, n, self.page_size, h, b)
        else:
            x = out.view(kinds, self.layers, n, self.page_size, h, b)
        return x.permute(self._perm).contiguous().view(n, -1)

    def copy_to(
        self, slots: torch.Tensor, dest: torch.Tensor, spans: Sequence[tuple[int, int]]
    ) -> Callable[[], bool]:
        """Gather the pages of `slots` and copy them, in order, into `dest` (flat uint8 host memory) at
        the (offset, nbytes) `spans`; returns at once on a GPU with a check of whether the copy is done."""
        pages = self.gather(slots).view(-1)
        if sum(n for _, n in spans) != pages.numel():
            raise ValueError(f"spans hold {sum(n for _, n in spans)} bytes, the pages {pages.numel()}")
        pos = 0
        for offset, n in _merged(spans):
            dest[offset : offset + n].copy_(pages[pos : pos + n], non_blocking=dest.is_pinned())
            pos += n
        if self.device.type != "cuda":
            return lambda: True
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record()  # on the current (scheduler) stream, after the copies
        return done.query

    def stage(self, slots: torch.Tensor) -> Staged:
        """The pages of `slots` in a host buffer of their own (pinned on a GPU); returns at once."""
        n = int(slots.numel()) // self.page_size
        host = torch.empty(n * self.page_bytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        ready = self.copy_to(slots, host, [(0, n * self.page_bytes)])
        return Staged(host.view(n, self.page_bytes), ready)

    def warm_up(self, dest: torch.Tensor, timeout_s: float = 5.0) -> None:
        """Copy one page into `dest` once, so the first decode step does not pay for loading the gather
        kernels (the scheduler thread waits here, once, when the plugin starts)."""
        ready = self.copy_to(
            torch.zeros(self.page_size, dtype=torch.int64, device=self.device), dest, [(0, self.page_bytes)]
        )
        deadline = time.monotonic() + timeout_s
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.0005)


def _merged(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent spans as one (a step's reservations are usually contiguous in the ring)."""
    out: list[tuple[int, int]] = []
    for offset, n in spans:
        if out and out[-1][0] + out[-1][1] == offset:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((offset, n))
    return out


def _bytes_rows(t: torch.Tensor) -> torch.Tensor:
    if t.dim() != 3 or t.stride(-1) != 1:
        raise Unsupported(f"KV rows of shape {tuple(t.shape)}, strides {t.stride()}")
    return t.view(torch.uint8)


def _permuted(dims: list[int], perm: Sequence[int]) -> list[int]:
    return [dims[i] for i in perm]


def reader_for_pool(pool: Any, layout: str) -> KvReader:
    """The reader for SGLang's device pool `pool` (`token_to_kv_pool_allocator.get_kvcache()`)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    page_size = int(pool.page_size)
    if type(pool) is MHATokenToKVPool:
        if getattr(pool, "kv_cache_layout", "nhd") != "nhd":
            raise Unsupported(f"device KV layout {pool.kv_cache_layout!r} (only NHD)")
        if getattr(pool, "k_scale_buffer", None) is not None:
            raise Unsupported("a quantized KV cache with scale buffers")
        if pool.head_dim != pool.v_head_dim:
            raise Unsupported("K and V of different head dims")
        return KvReader(mla=False, buffers=[pool.k_buffer, pool.v_buffer], layout=layout, page_size=page_size)
    if type(pool) is MLATokenToKVPool:
        if getattr(pool, "layer_shard_enabled", False):
            raise Unsupported("a layer-sharded MLA cache")
        if getattr(pool, "kv_scale_buffer", None) is not None:
            raise Unsupported("a quantized MLA cache with scale buffers")
        return KvReader(mla=True, buffers=[pool.kv_buffer], layout=layout, page_size=page_size)
    raise Unsupported(f"KV pool {type(pool).__name__} (only MHATokenToKVPool, MLATokenToKVPool)")
