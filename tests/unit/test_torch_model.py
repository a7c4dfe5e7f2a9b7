"""The torch Qwen3/Llama model over the paged KV cache: paged == dense, batch independence, the padded
attention path == the per-item one, page export/import (a restore), checkpoints, configs, random init."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from models.torch_config import PRESETS, ModelConfig, parse_dtype, resolve_config  # noqa: E402
from models.torch_kv_cache import PagedKVCache  # noqa: E402
from models.torch_model import BatchItem, CausalLM, _buckets  # noqa: E402
from models.torch_weights import load_model, load_or_init, random_model, save_model  # noqa: E402

PS = 4  # page size: small, so that every test crosses many page boundaries
PROMPT = [(i * 37 + 11) % 256 for i in range(45)]
PINNED_EMBED_00 = -0.6217  # random_model(PRESETS["tiny"], 1): embed_tokens.weight[0, 0], on any machine


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny matrices gain nothing from intra-op threads, and spinning ones slow a shared machine down."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny() -> CausalLM:
    return random_model(PRESETS["tiny"], 1)


def shuffled_pages(n: int, seed: int, total: int) -> list[int]:
    """n distinct page ids out of [0, total), neither contiguous nor in order."""
    return torch.randperm(total, generator=torch.Generator().manual_seed(seed))[:n].tolist()


def prefill(model: CausalLM, cache: PagedKVCache, pages: list[int], tokens: list[int], chunks: list[int],
            *, padded: bool = True) -> list[torch.Tensor]:  # fmt: skip
    """Prefill `tokens` in chunks of the given sizes, every position's logits."""
    assert sum(chunks) == len(tokens)
    out, pos = [], 0
    for c in chunks:
        out.append(
            model.forward_batch([BatchItem(pages, pos, tokens[pos : pos + c], 0)], cache, padded=padded)[0]
        )
        pos += c
    return out


def greedy_paged(model: CausalLM, cache: PagedKVCache, pages: list[int], prompt: list[int], chunks: list[int],
                 steps: int, *, padded: bool = True) -> tuple[list[int], torch.Tensor]:  # fmt: skip
    """Prefill in chunks, then decode one token per step; the sequence and all logits."""
    logits = prefill(model, cache, pages, prompt, chunks, padded=padded)
    seq = [*prompt, int(logits[-1][-1].argmax())]
    for _ in range(steps - 1):
        logits.append(
            model.forward_batch([BatchItem(pages, len(seq) - 1, seq[-1:])], cache, padded=padded)[0]
        )
        seq.append(int(logits[-1][-1].argmax()))
    return seq, torch.cat(logits)


# -- the dense path == HF's Qwen3/Llama math -----------------------------------------------------------
def reference_logits(model: CausalLM, tokens: list[int]) -> np.ndarray:
    """The HF Qwen3/Llama forward written out independently, in float64 numpy: RoPE as a complex rotation
    of (x[i], x[i + D/2]) pairs, attention one head at a time, query head h on kv head h // group."""
    cfg, w = model.cfg, {k: v.double().numpy() for k, v in model.state_dict().items()}
    d, group, n = cfg.head_dim, cfg.num_heads // cfg.num_kv_heads, len(tokens)
    angle = np.arange(n)[:, None] * cfg.rope_theta ** (-np.arange(0, d, 2) / d)  # [n, D/2]

    def norm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return weight * x / np.sqrt((x**2).mean(-1, keepdims=True) + cfg.rms_norm_eps)

    def rope(x: np.ndarray) -> np.ndarray:  # [n, heads, D]
        z = (x[..., : d // 2] + 1j * x[..., d // 2 :]) * np.exp(1j * angle)[:, None]
        return np.concatenate([z.real, z.imag], axis=-1)

    x = w["model.embed_tokens.weight"][tokens]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        h = norm(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(n, cfg.num_heads, d)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(n, cfg.num_kv_heads, d)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(n, cfg.num_kv_heads, d)
        if cfg.qk_norm:
            q, k = norm(q, w[p + "self_attn.q_norm.weight"]), norm(k, w[p + "self_attn.k_norm.weight"])
        q, k = rope(q), rope(k)
        heads = []
        for head in range(cfg.num_heads):
            scores = q[:, head] @ k[:, head // group].T / np.sqrt(d) + np.triu(np.full((n, n), -np.inf), 1)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            heads.append((probs / probs.sum(-1, keepdims=True)) @ v[:, head // group])
        x = x + np.concatenate(heads, axis=-1) @ w[p + "self_attn.o_proj.weight"].T
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    head = w["model.embed_tokens.weight"] if cfg.tie_word_embeddings else w["lm_head.weight"]
    return norm(x, w["model.norm.weight"]) @ head.T


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama", "tiny-draft"])
def test_dense_forward_matches_an_independent_reference(preset: str) -> None:
    # faster rotation: RoPE matters more; the draft preset with a tied LM head
    cfg = dataclasses.replace(
        PRESETS[preset], rope_theta=10_000.0, tie_word_embeddings=preset == "tiny-draft"
    )
    model = random_model(cfg, 5)
    got = model.forward_dense(PROMPT[:24])
    np.testing.assert_allclose(got.numpy(), reference_logits(model, PROMPT[:24]), atol=1e-4, rtol=0)


# -- paged == dense -------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_paged_prefill_and_decode_match_the_dense_reference(preset: str) -> None:
    model = random_model(PRESETS[preset], 7)
    pages = [7, 2, 9, *(p for p in shuffled_pages(30, 3, 30) if p not in (7, 2, 9))][:17]  # 68 positions
    assert len(pages) * PS >= len(PROMPT) + 20 and pages != sorted(pages)
    # chunks: one longer than the padded path takes (causal from 0), one short (padded path, start > 0),
    # one long with a cached prefix (explicit mask)
    seq, logits = greedy_paged(model, PagedKVCache(model.cfg, 30, PS), pages, PROMPT, [20, 7, 18], 20)
    dense = model.forward_dense(seq)
    assert logits.shape == (len(seq) - 1, model.cfg.vocab_size)
    torch.testing.assert_close(logits, dense[:-1], atol=1e-4, rtol=0)
    assert seq[len(PROMPT) :] == [int(r.argmax()) for r in dense[len(PROMPT) - 1 : -1]]
    # the general (per-item) attention path gives the same
    seq2, logits2 = greedy_paged(
        model, PagedKVCache(model.cfg, 30, PS), pages, PROMPT, [20, 7, 18], 20, padded=False
    )
    assert seq2 == seq
    torch.testing.assert_close(logits2, logits, atol=1e-5, rtol=0)


def test_a_wrong_kv_write_or_read_is_visible(tiny: CausalLM) -> None:
    """Sanity of the reference check: a corrupted cached page changes the continuation's logits."""
    pages = shuffled_pages(15, 5, 20)
    cache = PagedKVCache(tiny.cfg, 20, PS)
    prefill(tiny, cache, pages, PROMPT, [45])
    before = tiny.forward_batch([BatchItem(pages, 45, [3])], copy.deepcopy(cache))[0]
    cache.k[1][pages[2]] += 1.0
    after = tiny.forward_batch([BatchItem(pages, 45, [3])], cache)[0]
    assert (after - before).abs().max() > 1e-3


# -- batching --------------------------------------------------------------------------------------
def test_items_are_independent_of_their_batch(tiny: CausalLM) -> None:
    cache = PagedKVCache(tiny.cfg, 40, PS)
    perm = shuffled_pages(40, 9, 40)
    a_pages, b_pages, c_pages = perm[:12], perm[12:22], perm[22:32]
    b_ctx, c_ctx = PROMPT[:30], PROMPT[10:35]
    prefill(tiny, cache, b_pages, b_ctx, [30])
    prefill(tiny, cache, c_pages, c_ctx, [25])
    items = [
        BatchItem(a_pages, 0, PROMPT[:21], 0),  # a prefill chunk, every position's logits
        BatchItem(b_pages, 30, [42]),  # a decode token
        BatchItem(c_pages, 25, [7, 8, 9, 10, 11], 0),  # last token + 4 drafts
    ]
    for padded in (True, False):
        together_cache = copy.deepcopy(cache)
        together = tiny.forward_batch(items, together_cache, padded=padded)
        assert [t.shape[0] for t in together] == [21, 1, 5]
        for item, got in zip(items, together, strict=True):
            alone_cache = copy.deepcopy(cache)
            (alone,) = tiny.forward_batch([item], alone_cache, padded=padded)
            torch.testing.assert_close(got, alone, atol=1e-5, rtol=0)
        for got_k, alone_k in zip(together_cache.k, alone_cache.k, strict=True):  # C's written KV
            torch.testing.assert_close(got_k[c_pages[:8]], alone_k[c_pages[:8]], atol=1e-5, rtol=0)


def test_padded_path_matches_the_per_item_path_for_mixed_decode_and_verify(tiny: CausalLM) -> None:
    contexts = [3, 17, 40, 5, 63, 9, 1]  # lengths far apart: the padded path splits them into buckets
    cache = PagedKVCache(tiny.cfg, 7 * 17, PS)
    tables = [list(range(i, 7 * 17, 7)) for i in range(7)]  # interleaved pages
    for table, n in zip(tables, contexts, strict=True):
        prefill(tiny, cache, table, PROMPT[:n] if n <= 45 else (PROMPT * 2)[:n], [n])
    items = [BatchItem(t, n, [n % 200 + 1]) for t, n in zip(tables[1:], contexts[1:], strict=True)]
    items.append(BatchItem(tables[0], 3, [4, 5, 6], 0))  # last token + 2 drafts, all logits
    ends = np.array([it.start + len(it.tokens) for it in items])
    assert len(_buckets(np.arange(len(items)), ends)) >= 2  # several padded calls, not one
    fast = tiny.forward_batch(items, copy.deepcopy(cache), padded=True)
    general = tiny.forward_batch(items, copy.deepcopy(cache), padded=False)
    for a, b in zip(fast, general, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert [t.shape[0] for t in fast] == [1] * 6 + [3]


def test_a_decode_batch_is_one_attention_call_per_layer(
    tiny: CausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = PagedKVCache(tiny.cfg, 32 * 3, PS)
    items = [BatchItem(list(range(3 * i, 3 * i + 3)), 10 + i % 2, [i + 1]) for i in range(32)]
    sdpa, calls = torch.nn.functional.scaled_dot_product_attention, []

    def counting(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    tiny.forward_batch(items, cache)
    assert len(calls) == tiny.cfg.num_layers
    tiny.forward_batch(items, cache, padded=False)
    assert len(calls) == tiny.cfg.num_layers * 33


def test_logits_from_selects_positions_and_bad_items_are_refused(tiny: CausalLM) -> None:
    cache = PagedKVCache(tiny.cfg, 8, PS)
    ref = tiny.forward_dense([1, 2, 3, 4, 5])
    got = tiny.forward_batch(
        [BatchItem([0, 1], 0, [1, 2, 3, 4, 5], 2), BatchItem([2, 3], 0, [1, 2, 3], 3)], cache
    )
    torch.testing.assert_close(got[0], ref[2:], atol=1e-5, rtol=0)
    assert got[1].shape == (0, tiny.cfg.vocab_size)
    with pytest.raises(ValueError, match="cannot hold positions"):
        tiny.forward_batch([BatchItem([0], 3, [1, 2])], cache)
    with pytest.raises(ValueError, match=r"item 1: page ids \[0, 99\] not in \[0, 8\)"):
        tiny.forward_batch([BatchItem([0], 0, [1]), BatchItem([0, 99], 3, [1, 2])], cache)
    with pytest.raises(ValueError, match="logits_from"):
        tiny.forward_batch([BatchItem([0, 1], 0, [1, 2], 3)], cache)
    with pytest.raises(ValueError, match="1 token"):
        tiny.forward_batch([BatchItem([0, 1], 0, [])], cache)


# -- page export / import (restore) ------------------------------------------------------------------
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_exported_pages_restore_into_other_page_ids(dtype_name: str) -> None:
    dtype = parse_dtype(dtype_name)
    model = random_model(PRESETS["tiny"], 2, dtype=dtype)
    src_pages, dst_pages = [5, 0, 9, 2, 7, 11, 3, 1], [12, 4, 0, 15, 8, 1, 9, 14]
    src = PagedKVCache(model.cfg, 12, PS, dtype=dtype)
    prefill(model, src, src_pages, PROMPT[:30], [30])
    data = src.export_pages(src_pages[:8])
    assert data.dtype.itemsize == 1 and data.nbytes == 8 * src.page_nbytes
    assert src.page_nbytes == PS * model.cfg.kv_bytes_per_token(dtype)
    # layout: page 1 (id 0), layer 1, V block comes right after that layer's K block
    block = PS * model.cfg.num_kv_heads * model.cfg.head_dim * dtype.itemsize
    at = src.page_nbytes + 3 * block
    assert data[at : at + block].tobytes() == src.v[1][0].contiguous().view(torch.uint8).numpy().tobytes()

    with torch.inference_mode():  # an engine may build its cache there; imports happen outside
        dst = PagedKVCache(model.cfg, 16, PS, dtype=dtype)
    dst.import_pages(dst_pages, data.tobytes())  # bytes, as they arrive from a store
    assert dst.export_pages(dst_pages).tobytes() == data.tobytes()
    with pytest.raises(ValueError, match="bytes"):
        dst.import_pages(dst_pages[:3], data)
    # continuation from the restored pages == continuation from the original ones, bit for bit
    tok = 17
    for pos in range(30, 32):
        a = model.forward_batch([BatchItem(src_pages, pos, [tok])], src)[0]
        b = model.forward_batch([BatchItem(dst_pages, pos, [tok])], dst)[0]
        assert torch.equal(a, b)
        tok = int(a.argmax())


def test_copy_pages_moves_a_request(tiny: CausalLM) -> None:
    cache = PagedKVCache(tiny.cfg, 20, PS)
    old, new = [3, 8, 1, 6, 0, 2, 4, 5], [19, 10, 12, 11, 18, 13, 14, 15]
    prefill(tiny, cache, old, PROMPT[:29], [29])
    cache.copy_pages(old[:8], new)
    a = tiny.forward_batch([BatchItem(old, 29, [1])], cache)[0]
    b = tiny.forward_batch([BatchItem(new, 29, [1])], cache)[0]
    assert torch.equal(a, b)
    with pytest.raises(ValueError):
        cache.copy_pages([1, 2], [3])


# -- checkpoints ------------------------------------------------------------------------------------
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("shard_bytes", [None, 20_000])
def test_save_and_load_round_trip(tmp_path: Path, tied: bool, shard_bytes: int | None) -> None:
    cfg = dataclasses.replace(PRESETS["tiny"], tie_word_embeddings=tied)
    model = random_model(cfg, 4)
    save_model(model, tmp_path, shard_bytes=shard_bytes)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert (len(files) > 1) == (shard_bytes is not None)
    assert (tmp_path / "model.safetensors.index.json").exists() == (shard_bytes is not None)
    loaded = load_model(tmp_path)
    assert loaded.cfg == cfg
    assert ("lm_head.weight" in loaded.state_dict()) == (not tied)
    assert torch.equal(loaded.forward_dense(PROMPT[:12]), model.forward_dense(PROMPT[:12]))


def test_load_refuses_missing_misshapen_and_unknown_tensors(tmp_path: Path, tiny: CausalLM) -> None:
    save_model(tiny, tmp_path)
    path = tmp_path / "model.safetensors"
    good = safetensors_torch.load_file(str(path))

    def store(tensors: dict[str, torch.Tensor]) -> None:
        safetensors_torch.save_file(tensors, str(path))

    store({k: v for k, v in good.items() if k != "model.layers.1.mlp.up_proj.weight"})
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_model(tmp_path)
    store({**good, "model.norm.weight": torch.ones(63)})
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' has shape \(63,\)"):
        load_model(tmp_path)
    store({**good, "model.layers.0.self_attn.q_proj.bias": torch.zeros(64)})
    with pytest.raises(ValueError, match=r"bias tensor 'model\.layers\.0\.self_attn\.q_proj\.bias'"):
        load_model(tmp_path)
    store({**good, "model.extra.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.extra\.weight'"):
        load_model(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        load_model(tmp_path)


def test_self_draft_keeps_the_first_layers_and_the_head(tmp_path: Path) -> None:
    target = load_or_init("tiny", 3)
    save_model(target, tmp_path)
    for draft in (load_or_init("tiny", 3, num_layers=1), load_or_init(str(tmp_path), 3, num_layers=1)):
        assert draft.cfg == PRESETS["tiny"].truncated(1) and len(draft.model.layers) == 1
        got, want = draft.state_dict(), target.state_dict()
        assert set(got) == {k for k in want if not k.startswith("model.layers.1.")}
        for name, t in got.items():
            assert torch.equal(t, want[name]), name
    with pytest.raises(ValueError, match="neither a preset"):
        load_or_init(str(tmp_path / "nope"), 0)


# -- configs and random init -----------------------------------------------------------------------
def test_config_hf_round_trip_and_defaults(tmp_path: Path) -> None:
    for cfg in PRESETS.values():
        assert ModelConfig.from_hf(cfg.to_hf()) == cfg
        assert ModelConfig.from_hf(json.loads(json.dumps(cfg.to_hf()))) == cfg
    hf_06b = {
        "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
        "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000, "tie_word_embeddings": True, "hidden_act": "silu",
        "max_position_embeddings": 40960, "torch_dtype": "bfloat16", "rope_scaling": None,
    }  # fmt: skip
    assert ModelConfig.from_hf(hf_06b) == PRESETS["qwen3-0.6b"]
    small = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2}
    llama = ModelConfig.from_hf({"model_type": "llama", "num_attention_heads": 8, **small})
    assert (llama.num_kv_heads, llama.head_dim, llama.qk_norm, llama.rope_theta) == (8, 8, False, 10_000.0)
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf({**hf_06b, "model_type": "mistral"})
    with pytest.raises(ValueError, match="rope_scaling"):
        ModelConfig.from_hf({**hf_06b, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    assert PRESETS["qwen3-8b"].kv_bytes_per_token(torch.bfloat16) == 144 * 1024
    assert PRESETS["tiny"].kv_bytes_per_token(torch.float32) == 2 * 2 * 2 * 16 * 4
    assert PRESETS["qwen3-32b"].truncated(4).num_layers == 4
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["tiny-llama"].to_hf()))
    assert (
        resolve_config(str(tmp_path)) == PRESETS["tiny-llama"] and resolve_config("tiny") == PRESETS["tiny"]
    )
    assert parse_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="float32, bfloat16, float16"):
        parse_dtype("fp8")


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"hidden_size": 0}, "hidden_size"),
        ({"vocab_size": -1}, "vocab_size"),
        ({"num_heads": 6, "num_kv_heads": 4}, "num_heads"),
        ({"head_dim": 15}, "head_dim"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
        ({"rope_theta": float("nan")}, "rope_theta"),
    ],
)
def test_bad_config_values_name_the_field(change: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(PRESETS["tiny"], **change)
    with pytest.raises(ValueError, match="num_layers"):
        PRESETS["tiny"].truncated(3)


def test_random_model_is_deterministic_and_greedy_output_varies(tiny: CausalLM) -> None:
    again = random_model(PRESETS["tiny"], 1)
    other = random_model(PRESETS["tiny"], 2)
    for name, t in tiny.state_dict().items():
        assert torch.equal(t, again.state_dict()[name]), name
    assert not torch.equal(tiny.model.embed_tokens.weight, other.model.embed_tokens.weight)
    assert round(float(tiny.model.embed_tokens.weight[0, 0]), 4) == pytest.approx(PINNED_EMBED_00, abs=1e-4)
    seq, logits = greedy_paged(tiny, PagedKVCache(tiny.cfg, 20, 8), list(range(20)), [1, 2, 3], [3], 64)
    assert len(set(seq[3:])) >= 8, seq
    top2 = logits.topk(2, dim=-1).values
    assert 0.5 < float(logits.std()) < 2 and float((top2[:, 0] - top2[:, 1]).median()) > 0.05
    # tied: the embedding is the LM head and gets its scale, so logits stay ~1 (not ~sqrt(hidden))
    tied = random_model(dataclasses.replace(PRESETS["tiny"], tie_word_embeddings=True), 1)
    assert 0.5 < float(tied.forward_dense(PROMPT[:16]).std()) < 2
