"""A compact Qwen3/Llama decoder in plain torch, over a paged KV cache (`torch_kv_cache`).

The architecture is HuggingFace's Qwen3 (Llama plus a per-head RMSNorm on q and k): token embedding,
pre-norm layers of grouped-query attention with rotate-half RoPE at absolute positions and a SwiGLU
MLP, a final RMSNorm and the LM head (tied to the embedding when the config says so). RMSNorm runs
in float32 and casts back, as HF does. Parameter names are HF's, so checkpoints load as they are.

`PagedKVCache` (torch_kv_cache.py) holds, per layer, K and V as [num_pages, page_size, kv_heads,
head_dim]; a request's page table lists its pages in position order, in any physical order.
`CausalLM.forward_batch` is one continuous-batching step: every item's tokens go through one packed
[T, hidden] pass (embedding, projections, norms, MLP), and per layer the new K/V are written into the
items' pages before attention reads them back, so a step sees exactly what a later step will. Attention is
`scaled_dot_product_attention` in two shapes:
- short items (at most `PADDED_MAX_TOKENS` tokens: decode, or a last token plus drafts) share one
  padded call per length bucket. Grouped-query heads are folded into the query axis
  ([B, kv_heads, group·n, head_dim]) so K and V are gathered once per kv head, never repeated; a
  boolean mask hides padding and enforces causality. Buckets keep padding below twice the real KV;
- longer items (prefill chunks) get one call each: causal within the chunk, full over the cached
  prefix, kv heads repeated.
Items are independent: padding is masked, rows never mix, so an item's logits do not depend on its
batch neighbours beyond float rounding. `forward_dense` is the cache-free reference for tests.

The config and the presets are in `torch_config`; the weights (random, loaded, saved) in
`torch_weights`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from models.torch_config import ModelConfig
from models.torch_kv_cache import PagedKVCache

PADDED_MAX_TOKENS = 16  # items up to this many tokens are attended in the padded batched call


# -- model ------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class BatchItem:
    """One request's part of a step. Page j of `page_table` holds positions [j*page_size, (j+1)*page_size);
    KV for positions [0, start) is already cached; `tokens` (a prefill chunk, one decode token, or the
    last token plus k drafts) sit at positions start.. and are written to the cache by this step.
    Logits come back for tokens[logits_from:]; -1 means only the last token, len(tokens) none."""

    page_table: Sequence[int]
    start: int
    tokens: Sequence[int]
    logits_from: int = -1


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out: torch.Tensor = self.weight * h.to(x.dtype)
        return out


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv, bias=False)
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.shape = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.qk_norm)

    def qkv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q [T, heads, D], k and v [T, kv_heads, D] for normed hidden states h; q and k rotated."""
        heads, kv_heads, d, qk_norm = self.shape
        q = self.q_proj(h).view(-1, heads, d)
        k = self.k_proj(h).view(-1, kv_heads, d)
        if qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, self.v_proj(h).view(-1, kv_heads, d)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """One sequence: q [n, heads, D] over k, v [S, kv_heads, D]; causal when mask is None, as the
    kernels want it (4-D, kv heads repeated as HF's repeat_kv: query head h reads kv head h // group)."""
    (s, kvh, d), group = k.shape, q.shape[1] // k.shape[1]

    def rep(x: torch.Tensor) -> torch.Tensor:
        return x.permute(1, 0, 2)[None, :, None].expand(1, kvh, group, s, d).reshape(1, kvh * group, s, d)

    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], rep(k), rep(v), attn_mask=mask, is_causal=mask is None
    )
    return o[0].transpose(0, 1)


def _key_mask(query_pos: torch.Tensor, keys: int) -> torch.Tensor:
    """[..., keys] bool: key j is visible to a query at position p iff j <= p."""
    return torch.arange(keys, device=query_pos.device) <= query_pos[..., None]


Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def _head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    def _hidden(self, ids: torch.Tensor, pos: torch.Tensor, attend: Attend) -> torch.Tensor:
        """The last layer's output for packed tokens `ids` at absolute positions `pos`."""
        cfg, t = self.cfg, ids.shape[0]
        inv_freq = 1.0 / (
            cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=pos.device).float() / cfg.head_dim)
        )
        freqs = pos.float()[:, None] * inv_freq[None]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(self.dtype)[:, None], emb.sin().to(self.dtype)[:, None]
        x: torch.Tensor = self.model.embed_tokens(ids)
        for i, layer in enumerate(cast("list[Layer]", list(self.model.layers))):
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), cos, sin)
            x = x + layer.self_attn.o_proj(attend(i, q, k, v).reshape(t, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.model.norm(x), self._head_weight()).float().cpu()

    @torch.inference_mode()
    def forward_dense(self, tokens: Sequence[int]) -> torch.Tensor:
        """Reference: causal attention over the whole sequence, no cache. float32 [len, vocab] on CPU."""

        def attend(_: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return _attend_one(q, k, v, None)

        ids = torch.tensor(list(tokens), dtype=torch.long, device=self.device)
        return self._logits(self._hidden(ids, torch.arange(len(ids), device=self.device), attend))

    @torch.inference_mode()
    def forward_batch(
        self, items: Sequence[BatchItem], cache: PagedKVCache, *, padded: bool = True
    ) -> list[torch.Tensor]:
        """One step over every item; per item, float32 logits [n, vocab] on CPU for the requested positions.

        `padded=False` gives every item its own attention call (the general path), for tests.
        """
        cfg, ps, dev = self.cfg, cache.page_size, self.device
        if (cache.num_layers, cache.cfg.num_kv_heads, cache.cfg.head_dim) != (
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim):  # fmt: skip
            raise ValueError("the cache's layers/kv_heads/head_dim do not match the model's")
        if not items:
            return []
        group, n_items = cfg.num_heads // cfg.num_kv_heads, len(items)
        lens = np.array([len(it.tokens) for it in items], dtype=np.int64)
        starts = np.array([it.start for it in items], dtype=np.int64)
        ends, need = starts + lens, -(-(starts + lens) // ps)  # need: pages holding [0, end)
        table = np.zeros((n_items, int(need.max(initial=0))), dtype=np.int64)  # page tables, 0-padded
        for r, it in enumerate(items):
            if lens[r] == 0 or it.start < 0:
                raise ValueError(
                    f"item {r}: needs >= 1 token and start >= 0 (start {it.start}, {lens[r]} tokens)"
                )
            if not -1 <= it.logits_from <= lens[r]:
                raise ValueError(f"item {r}: logits_from {it.logits_from} not in [-1, {lens[r]}]")
            if len(it.page_table) < need[r]:
                raise ValueError(f"item {r}: {len(it.page_table)} pages cannot hold positions [0, {ends[r]})")
            table[r, : need[r]] = it.page_table[: need[r]]
        bad = np.flatnonzero((table < 0).any(1) | (table >= cache.num_pages).any(1))
        if len(bad):
            raise ValueError(
                f"item {bad[0]}: page ids {list(items[bad[0]].page_table)} not in [0, {cache.num_pages})"
            )
        offsets = np.concatenate(([0], np.cumsum(lens)))
        owner = np.repeat(np.arange(n_items), lens)  # token -> item
        local = np.arange(offsets[-1]) - offsets[owner]
        pos = starts[owner] + local
        first = np.array(
            [lens[r] - 1 if it.logits_from == -1 else it.logits_from for r, it in enumerate(items)]
        )
        rows = np.flatnonzero(local >= first[owner])

        def to_dev(a: Any) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(dev)

        def slots(r: np.ndarray, keys: int) -> np.ndarray:  # cache slots of positions [0, keys) for items r
            return (table[r, : -(-keys // ps), None] * ps + np.arange(ps)).reshape(len(r), -1)[:, :keys]

        write = to_dev(table[owner, pos // ps] * ps + pos % ps)
        is_short = lens <= PADDED_MAX_TOKENS if padded else np.zeros(n_items, dtype=bool)
        buckets = [
            _bucket(m, slots(m, int(ends[m].max())), lens, starts, offsets, group, to_dev)
            for m in _buckets(np.flatnonzero(is_short), ends)
        ]
        singles = [  # (the item's rows, its KV slots, its mask or None for plain causal)
            (slice(offsets[r], offsets[r + 1]), to_dev(slots(np.array([r]), int(ends[r]))[0]),
             None if starts[r] == 0 else _key_mask(to_dev(pos[offsets[r] : offsets[r + 1]]), int(ends[r])))
            for r in np.flatnonzero(~is_short)
        ]  # fmt: skip

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            kc = cache.k[layer].view(-1, cfg.num_kv_heads, cfg.head_dim)
            vc = cache.v[layer].view(-1, cfg.num_kv_heads, cfg.head_dim)
            kc.index_copy_(0, write, k.to(cache.dtype))
            vc.index_copy_(0, write, v.to(cache.dtype))
            out = torch.empty_like(q)
            for src, kv_slots, mask, dst, keep in buckets:
                b, n = src.shape  # grouped heads folded into the query axis: row g*n + i
                qb = q[src].view(b, n, cfg.num_kv_heads, group, -1).permute(0, 2, 3, 1, 4)
                kb = kc[kv_slots].to(q.dtype).permute(0, 2, 1, 3)  # [B, kv_heads, L, D]
                vb = vc[kv_slots].to(q.dtype).permute(0, 2, 1, 3)
                o = F.scaled_dot_product_attention(
                    qb.reshape(b, cfg.num_kv_heads, group * n, -1), kb, vb, attn_mask=mask
                )
                o = o.view(b, cfg.num_kv_heads, group, n, -1).permute(0, 3, 1, 2, 4)
                out[dst] = o.reshape(b * n, cfg.num_heads, -1)[keep]
            for rs, kv_slots, causal in singles:
                out[rs] = _attend_one(q[rs], kc[kv_slots].to(q.dtype), vc[kv_slots].to(q.dtype), causal)
            return out

        ids = torch.tensor([tok for it in items for tok in it.tokens], dtype=torch.long, device=dev)
        x = self._hidden(ids, to_dev(pos), attend)
        logits = self._logits(x[to_dev(rows)])
        return list(torch.split(logits, (lens - first).tolist()))


def _buckets(short: np.ndarray, ends: np.ndarray) -> list[np.ndarray]:
    """Short items by KV length, longest first, cut so that padded keys stay under twice the real ones."""
    out: list[list[int]] = []
    longest = real = 0
    for r in sorted(short.tolist(), key=lambda r: -ends[r]):
        if not out or (len(out[-1]) + 1) * longest > 2 * (real + ends[r]):
            out.append([])
            longest = real = int(ends[r])
        else:
            real += int(ends[r])
        out[-1].append(r)
    return [np.array(m) for m in out]


def _bucket(m: np.ndarray, slots: np.ndarray, lens: np.ndarray, starts: np.ndarray, offsets: np.ndarray,
            group: int, to_dev: Callable[[Any], torch.Tensor]) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Index tensors for one padded attention call over items m (KV `slots` [B, L]): query rows [B, n],
    KV slots, mask [B, 1, group*n, L], and where the real rows go (dst) from the flat padded output (keep)."""
    n = int(lens[m].max())
    col = np.minimum(np.arange(n)[None], lens[m, None] - 1)  # padded query rows repeat the item's last
    real = np.arange(n)[None] < lens[m, None]
    mask = _key_mask(to_dev(np.tile(starts[m, None] + col, (1, group)))[:, None], slots.shape[1])
    dst = (offsets[m, None] + np.arange(n)[None])[real]
    return to_dev(offsets[m, None] + col), to_dev(slots), mask, to_dev(dst), to_dev(np.flatnonzero(real))
