"""The plugin's page reader on CPU torch: pages gathered out of per-layer KV buffers come out in the byte
order of SGLang's HiCache host-pool pages, for every supported layout (the order is built here element by
element from the meaning of SGLang's host-pool dimensions; tests/sglang/test_plugin_paths.py checks it
against SGLang's own `get_data_page` code). CUDA (pinned memory, events) is tests/gpu/test_sglang_plugin_cuda.py.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from worker_hooks.sglang.plugin_reader import KvReader, Unsupported  # noqa: E402

PS, L, H, D = 4, 3, 2, 5
SLOTS = 64


def mha_pool(dtype: torch.dtype = torch.bfloat16) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    k = [torch.randn(SLOTS, H, D, generator=g).to(dtype) for _ in range(L)]
    v = [torch.randn(SLOTS, H, D, generator=g).to(dtype) for _ in range(L)]
    return k, v


def expected_mha(k: list[torch.Tensor], v: list[torch.Tensor], slots: list[int], layout: str) -> bytes:
    """One page as SGLang's MHA host pool flattens it (pool_host/mha.py `get_data_page`)."""
    kv = (k, v)

    def el(c: int, layer: int, t: int) -> torch.Tensor:  # [H, D]
        return kv[c][layer][slots[t]]

    if layout in ("layer_first", "page_first_direct"):  # (2, L, ps, H, D)
        x = torch.stack(
            [
                torch.stack([torch.stack([el(c, l_, t) for t in range(PS)]) for l_ in range(L)])
                for c in range(2)
            ]
        )
    elif layout == "page_first":  # (2, ps, L, H, D)
        x = torch.stack(
            [
                torch.stack([torch.stack([el(c, l_, t) for l_ in range(L)]) for t in range(PS)])
                for c in range(2)
            ]
        )
    else:  # page_head: (2, H, ps, L, D)
        x = torch.stack(
            [
                torch.stack(
                    [
                        torch.stack([torch.stack([el(c, l_, t)[h] for l_ in range(L)]) for t in range(PS)])
                        for h in range(H)
                    ]
                )
                for c in range(2)
            ]
        )
    return x.contiguous().view(torch.uint8).numpy().tobytes()


def expected_mla(kv: list[torch.Tensor], slots: list[int], layout: str) -> bytes:
    """pool_host/mla.py `get_data_page`: layer_first / page_first_direct (L, ps, 1, dim), page_first (ps, L, 1, dim)."""
    if layout == "page_first":
        x = torch.stack([torch.stack([kv[l_][slots[t]] for l_ in range(L)]) for t in range(PS)])
    else:
        x = torch.stack([torch.stack([kv[l_][slots[t]] for t in range(PS)]) for l_ in range(L)])
    return x.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
def test_mha_pages_in_host_pool_order(layout: str, dtype: torch.dtype) -> None:
    k, v = mha_pool(dtype)
    reader = KvReader(mla=False, buffers=[k, v], layout=layout, page_size=PS)
    pages = [[5, 6, 7, 8], [40, 41, 42, 43], [12, 13, 14, 15]]  # slots of three pages, any order
    slots = torch.tensor([s for p in pages for s in p], dtype=torch.int32)
    out = reader.stage(slots)
    assert out.ready()
    data = bytes(out.data())
    assert reader.page_bytes == 2 * L * PS * H * D * k[0].element_size()
    assert len(data) == 3 * reader.page_bytes
    for i, p in enumerate(pages):
        assert data[i * reader.page_bytes : (i + 1) * reader.page_bytes] == expected_mha(k, v, p, layout)
    assert reader.dtype == str(dtype).removeprefix("torch.")
    assert int(torch.tensor(reader.page_shape).prod()) * k[0].element_size() == reader.page_bytes
    out.release()
    assert out.host is None


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_mla_pages_in_host_pool_order(layout: str) -> None:
    g = torch.Generator().manual_seed(1)
    kv = [torch.randn(SLOTS, 1, 24, generator=g).to(torch.bfloat16) for _ in range(L)]
    reader = KvReader(mla=True, buffers=[kv], layout=layout, page_size=PS)
    pages = [[20, 21, 22, 23], [0, 1, 2, 3]]
    data = bytes(reader.stage(torch.tensor([s for p in pages for s in p])).data())
    for i, p in enumerate(pages):
        assert data[i * reader.page_bytes : (i + 1) * reader.page_bytes] == expected_mla(kv, p, layout)


def test_strided_layer_views_read_like_packed_ones() -> None:
    # SGLang may hand out per-layer K/V as views of one fused buffer
    fused = torch.randn(L, 2, SLOTS, H, D).to(torch.bfloat16)
    k = [fused[i, 0] for i in range(L)]
    v = [fused[i, 1] for i in range(L)]
    slots = torch.arange(8, 12)
    a = KvReader(mla=False, buffers=[k, v], layout="page_first", page_size=PS).stage(slots).data()
    b = (
        KvReader(
            mla=False,
            buffers=[[t.clone() for t in k], [t.clone() for t in v]],
            layout="page_first",
            page_size=PS,
        )
        .stage(slots)
        .data()
    )
    assert bytes(a) == bytes(b)


def test_what_the_reader_refuses() -> None:
    k, v = mha_pool()
    with pytest.raises(Unsupported, match="page_first_kv_split"):
        KvReader(mla=False, buffers=[k, v], layout="page_first_kv_split", page_size=PS)
    with pytest.raises(Unsupported, match="page_head"):
        KvReader(mla=True, buffers=[k], layout="page_head", page_size=PS)
    with pytest.raises(Unsupported):
        KvReader(mla=False, buffers=[k, [t[:, :1] for t in v]], layout="page_first", page_size=PS)
    with pytest.raises(Unsupported):
        KvReader(mla=False, buffers=[[t.transpose(1, 2) for t in k], v], layout="page_first", page_size=PS)
    reader = KvReader(mla=False, buffers=[k, v], layout="page_first", page_size=PS)
    with pytest.raises(ValueError, match="whole pages"):
        reader.gather(torch.arange(PS + 1))


# -- the hook's work on stand-in SGLang requests -----------------------------------------------------
def test_decode_steps_checkpoint_the_hinted_requests_into_a_real_holder() -> None:
    from tests.fixtures.sglang_plugin_standins import check_run, close_run, decode_run

    run = decode_run("cpu")
    try:
        check_run(run)
        assert run.ckpt.planner.stats.aborted == 1
    finally:
        close_run(run)


def test_a_small_step_budget_still_gets_every_page_out() -> None:
    from tests.fixtures.sglang_plugin_standins import check_run, close_run, decode_run
    from worker_hooks.sglang.plugin_logic import PluginOptions

    page = 2 * 2 * 16 * 2 * 8 * 2  # K and V, 2 layers, 16 tokens, 2 heads, 8 dims, bf16
    run = decode_run("cpu", options=PluginOptions(step_bytes=page), steps=160)
    try:
        check_run(run)
        assert run.ckpt.planner.stats.deferred_steps > 0
    finally:
        close_run(run)


# Found by the real lane (tests/sglang/test_real_checkpoints.py, about 1 run in 15): a request that
# finished on a step that was also a sweep step lost its END. The sweep looked at it (tracked, not
# running) after its weak reference had been dropped, took it for gone and closed it as aborted, and
# the finish then found nothing to END: the holder kept the pages until its orphan TTL.
def test_a_finish_on_a_sweep_step_still_sends_end() -> None:
    from tests.fixtures.sglang_plugin_standins import check_run, close_run, decode_run
    from worker_hooks.sglang.plugin_checkpointer import SWEEP_EVERY

    run = decode_run("cpu", steps=8 * SWEEP_EVERY - 1)  # check_run's finishing step is a sweep step
    try:
        check_run(run)
        assert run.ckpt.planner.stats.aborted == 1  # the one aborted request only
    finally:
        close_run(run)
