"""Host KV pools for the lane: the page methods of SGLang's `HostKVCache` on plain CPU tensors.

SGLang's own host pools (`sglang/srt/mem_cache/pool_host/`) import its CUDA kernels and model configs,
so they cannot be built on a CPU-only machine. These doubles have the attributes and methods a storage
backend uses (`page_size`, `dtype`, `layout`, `get_data_page(index, flat)`, `get_dummy_flat_data_page()`,
`set_from_flat_data_page(index, page)`; test_hicache_backend.py checks the names and signatures against
SGLang's `pool_host/base.py`) with two page geometries: a non-contiguous page (MHA, page_first: K and V
halves apart) and a contiguous one (MLA, page_first).
"""

from __future__ import annotations

import torch


class MhaPageFirstPool:
    """kv_buffer[2, tokens, layers, heads, head_dim]: a page's K and V halves are apart."""

    layout = "page_first"

    def __init__(
        self, pages: int, page_size: int, layers: int = 2, heads: int = 2, head_dim: int = 8
    ) -> None:
        self.page_size = page_size
        self.dtype = torch.bfloat16
        self.shape = (layers, heads, head_dim)
        self.kv_buffer = torch.zeros((2, pages * page_size, layers, heads, head_dim), dtype=self.dtype)
        self.size = pages * page_size

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, index : index + self.page_size]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(
            2 * self.page_size * self.shape[0] * self.shape[1] * self.shape[2], dtype=self.dtype
        )

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.kv_buffer[:, index : index + self.page_size] = data_page.reshape(2, self.page_size, *self.shape)


class MlaPageFirstPool:
    """kv_buffer[tokens, layers, 1, kv_lora_rank + rope_dim]: a page is one contiguous block."""

    layout = "page_first"

    def __init__(self, pages: int, page_size: int, layers: int = 2, dim: int = 24) -> None:
        self.page_size = page_size
        self.dtype = torch.bfloat16
        self.shape = (layers, 1, dim)
        self.kv_buffer = torch.zeros((pages * page_size, layers, 1, dim), dtype=self.dtype)
        self.size = pages * page_size

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[index : index + self.page_size]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.page_size * self.shape[0] * self.shape[2], dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.kv_buffer[index : index + self.page_size] = data_page.reshape(self.page_size, *self.shape)


def fill_random(pool: MhaPageFirstPool | MlaPageFirstPool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=gen).to(pool.dtype))


def page_bytes(pool: MhaPageFirstPool | MlaPageFirstPool, index: int) -> bytes:
    return pool.get_data_page(index, flat=True).contiguous().view(torch.uint8).numpy().tobytes()
