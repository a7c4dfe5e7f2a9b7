"""The paged KV cache of the torch decoder (`torch_model`): per layer, K and V as
[num_pages, page_size, kv_heads, head_dim].

A request's page table lists its pages in position order, in any physical order (page j holds
positions [j*page_size, (j+1)*page_size)). Pages move in and out as host bytes (`export_pages`,
`import_pages`: per page, per layer in order, K then V), which is what a checkpoint holder stores and
a restore copies back into any free pages.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch

from models.torch_config import ModelConfig


class PagedKVCache:
    """Per layer K and V tensors of shape [num_pages, page_size, num_kv_heads, head_dim]."""

    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, *,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:  # fmt: skip
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
        self.cfg, self.num_pages, self.page_size = cfg, num_pages, page_size
        self.dtype, self.device, self.num_layers = dtype, torch.device(device), cfg.num_layers
        shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(cfg.num_layers)]

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page over all layers, K and V."""
        return self.page_size * self.cfg.kv_bytes_per_token(self.dtype)

    def _index(self, page_ids: Sequence[int]) -> torch.Tensor:
        ids = np.asarray(page_ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_pages):
            raise ValueError(f"page ids must be in [0, {self.num_pages}), got {ids.min()}..{ids.max()}")
        return torch.from_numpy(ids).to(self.device)

    def _blocks_shape(self, n: int) -> tuple[int, ...]:
        return (n, 2 * self.num_layers, self.page_size, self.cfg.num_kv_heads, self.cfg.head_dim)

    @torch.inference_mode()
    def export_pages(self, page_ids: Sequence[int]) -> np.ndarray:
        """The pages' bytes in host memory: per page, per layer in order, K then V (C-contiguous).

        On CUDA the pages are gathered on the device, copied with non_blocking into a pinned host
        buffer, and a CUDA event recorded after the copy is waited on before returning, so the bytes
        are complete; the array is a view of that pinned buffer (which it keeps alive).
        """
        idx = self._index(page_ids)
        blocks = torch.empty(self._blocks_shape(len(idx)), dtype=self.dtype, device=self.device)
        for layer in range(self.num_layers):
            blocks[:, 2 * layer] = self.k[layer].index_select(0, idx)
            blocks[:, 2 * layer + 1] = self.v[layer].index_select(0, idx)
        raw = blocks.view(torch.uint8).reshape(-1)  # bf16 has no numpy dtype: go through raw bytes
        if self.device.type != "cuda":
            return raw.cpu().numpy()
        host = torch.empty(raw.numel(), dtype=torch.uint8, pin_memory=True)
        host.copy_(raw, non_blocking=True)
        _wait_for_stream()
        return host.numpy()

    @torch.inference_mode()
    def import_pages(self, page_ids: Sequence[int], data: bytes | memoryview | np.ndarray) -> None:
        """Write bytes laid out as `export_pages` makes them into `page_ids`.

        On CUDA the host bytes go to the device with non_blocking from pinned memory (the caller's
        buffer when it is pinned, else a pinned staging copy); the call waits on a CUDA event after
        the scatter, so the caller may reuse its buffer at once.
        """
        idx = self._index(page_ids)
        arr = (
            np.ascontiguousarray(data).reshape(-1)
            if isinstance(data, np.ndarray)
            else np.frombuffer(data, np.uint8)
        )
        arr = arr.view(np.uint8)
        if arr.nbytes != len(idx) * self.page_nbytes:
            raise ValueError(
                f"import of {len(idx)} pages needs {len(idx) * self.page_nbytes} bytes, got {arr.nbytes}"
            )
        if arr.ctypes.data % 16:
            arr = arr.copy()  # aligned for the dtype view below
        with warnings.catch_warnings():  # read-only buffers: the tensor is only ever read
            warnings.simplefilter("ignore", UserWarning)
            host = torch.from_numpy(arr)
        if self.device.type == "cuda":
            if not host.is_pinned():
                host = torch.empty(arr.nbytes, dtype=torch.uint8, pin_memory=True).copy_(host)
            raw = host.to(self.device, non_blocking=True)
        else:
            raw = host
        blocks = raw.view(self.dtype).view(self._blocks_shape(len(idx)))
        for layer in range(self.num_layers):
            self.k[layer].index_copy_(0, idx, blocks[:, 2 * layer])
            self.v[layer].index_copy_(0, idx, blocks[:, 2 * layer + 1])
        if self.device.type == "cuda":
            _wait_for_stream()

    @torch.inference_mode()
    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        if len(src) != len(dst):
            raise ValueError(f"copy_pages: {len(src)} source pages but {len(dst)} destinations")
        s, d = self._index(src), self._index(dst)
        for t in (*self.k, *self.v):
            t.index_copy_(0, d, t.index_select(0, s))


def _wait_for_stream() -> None:
    """Block until the work queued so far on the current CUDA stream is done (an event, not a device sync)."""
    done = torch.cuda.Event()  # type: ignore[no-untyped-call]
    done.record()
    done.synchronize()
