"""Lumen's SGLang plugin on CUDA, with stand-ins for SGLang's scheduler objects (no sglang needed): pages
read out of a GPU KV pool through pinned host memory equal the CPU reader's bytes for every layout and
dtype; the copy is ordered before later work on a stream that waits on the scheduler's stream (so a slot
reused after the step still reads as it was); staging returns before the copy completes (the step
never waits); and a decode run checkpoints the hinted requests into a real holder over ZMQ.
Every test here carries the `gpu` marker (tests/conftest.py): `pytest -m gpu` runs them."""

from __future__ import annotations

import statistics
import time

import pytest

torch = pytest.importorskip("torch")

from gateway.protocol.plane_file import plaintext_keyring  # noqa: E402
from tests.fixtures.sglang_plugin_standins import check_run, close_run, decode_run  # noqa: E402
from worker_hooks.sglang.plugin_reader import MHA_LAYOUTS, MLA_LAYOUTS, KvReader  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is false)"
)

PS = 64


def wait_ready(staged: object, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not staged.ready():  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the device-to-host copy never completed"
        time.sleep(0.0002)


@pytest.mark.parametrize("layout", MHA_LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_mha_pages_on_cuda_equal_the_cpu_reader(layout: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    k = [torch.randn(8192, 8, 128, generator=g).to(dtype) for _ in range(4)]
    v = [torch.randn(8192, 8, 128, generator=g).to(dtype) for _ in range(4)]
    slots = torch.randperm(8192, generator=g)[: 5 * PS]
    cpu = KvReader(mla=False, buffers=[k, v], layout=layout, page_size=PS)
    gpu = KvReader(
        mla=False, buffers=[[t.cuda() for t in k], [t.cuda() for t in v]], layout=layout, page_size=PS
    )
    staged = gpu.stage(slots.to(torch.int32).cuda())
    assert staged.host is not None and staged.host.is_pinned()
    wait_ready(staged)
    assert bytes(staged.data()) == bytes(cpu.stage(slots).data())


@pytest.mark.parametrize("layout", MLA_LAYOUTS)
def test_mla_pages_on_cuda_equal_the_cpu_reader(layout: str) -> None:
    g = torch.Generator().manual_seed(1)
    kv = [torch.randn(4096, 1, 576, generator=g).to(torch.bfloat16) for _ in range(3)]
    slots = torch.randperm(4096, generator=g)[: 3 * PS]
    cpu = KvReader(mla=True, buffers=[kv], layout=layout, page_size=PS)
    gpu = KvReader(mla=True, buffers=[[t.cuda() for t in kv]], layout=layout, page_size=PS)
    staged = gpu.stage(slots.cuda())
    wait_ready(staged)
    assert bytes(staged.data()) == bytes(cpu.stage(slots).data())


def test_the_copy_is_ordered_before_a_forward_that_reuses_the_slots() -> None:
    """SGLang's scheduler runs under its schedule stream and every forward first waits on it
    (`forward_stream.wait_stream(schedule_stream)`): a slot freed after this step and rewritten by the
    next forward still reads as it was when the plugin staged it."""
    schedule, forward = torch.cuda.Stream(), torch.cuda.Stream()
    # a pool big enough that the copy is still running when the overwrite is queued
    k = [torch.randn(65536, 8, 128, device="cuda").to(torch.bfloat16) for _ in range(8)]
    v = [torch.randn(65536, 8, 128, device="cuda").to(torch.bfloat16) for _ in range(8)]
    torch.cuda.synchronize()
    slots = torch.arange(0, 256 * PS, device="cuda", dtype=torch.int32)
    before = KvReader(
        mla=False,
        buffers=[[t[: 256 * PS].cpu() for t in k], [t[: 256 * PS].cpu() for t in v]],
        layout="page_first",
        page_size=PS,
    ).stage(torch.arange(0, 256 * PS))
    reader = KvReader(mla=False, buffers=[k, v], layout="page_first", page_size=PS)
    with torch.cuda.stream(schedule):
        staged = reader.stage(slots)
        not_ready_at_return = not staged.ready()
    with torch.cuda.stream(forward):
        forward.wait_stream(schedule)
        for t in (*k, *v):
            t[: 256 * PS].zero_()
    wait_ready(staged)
    torch.cuda.synchronize()
    assert bytes(staged.data()) == bytes(before.data())
    print(
        f"stage() returned before its {len(bytes(before.data())) >> 20} MiB copy completed: {not_ready_at_return}"
    )


def test_a_decode_run_checkpoints_into_a_real_holder() -> None:
    run = decode_run("cuda", page_size=PS, layers=4, heads=8, head_dim=128, steps=600)
    try:
        check_run(run)
        us = sorted(s * 1e6 for s in run.hook_s)
        p50, p99 = statistics.median(us), us[int(0.99 * (len(us) - 1))]
        slowest = sorted(range(len(run.hook_s)), key=lambda i: -run.hook_s[i])[:5]
        print(
            f"after_decode: p50 {p50:.0f} us, p99 {p99:.0f} us, max {us[-1]:.0f} us over {len(us)} steps;"
            f" slowest steps {[(i, round(run.hook_s[i] * 1e6)) for i in slowest]};"
            f" pages {run.ckpt.planner.stats.pages} ({run.ckpt.reader.page_bytes >> 10} KiB each)"
        )
        assert p50 < 5_000
    finally:
        close_run(run)


def test_the_hooks_cost_at_a_real_models_page_size() -> None:
    """Llama-3-8B's KV geometry on one GPU (32 layers, 8 KV heads of 128, bf16: 8 MiB pages of 64
    tokens): 16 requests decode 128 steps of ~10 ms GPU work after 512-token prompts, all checkpointed to
    one holder in another process over loopback ZMQ. Reports the scheduler thread's time in the hook per
    step and how much the KV plane delivered; a request is either wholly held or was abandoned (and then
    freed at its holder), never held in part."""
    from tests.fixtures.kv_holder import HolderProcess, wait_until
    from tests.fixtures.sglang_plugin_standins import Batch, KvInfo, Req, lumen_hints
    from worker_hooks.sglang.plugin_checkpointer import Checkpointer
    from worker_hooks.sglang.plugin_logic import PluginOptions

    layers, heads, dim, n_req, prompt, steps = 32, 8, 128, 16, 512, 128
    per_req = prompt + steps + PS
    slots = n_req * per_req
    k = [torch.empty(slots, heads, dim, device="cuda", dtype=torch.bfloat16).normal_() for _ in range(layers)]
    v = [torch.empty(slots, heads, dim, device="cuda", dtype=torch.bfloat16).normal_() for _ in range(layers)]
    rows = torch.arange(slots, device="cuda", dtype=torch.int32).view(n_req, per_req)
    holder = HolderProcess(budget=8 << 30)
    reader = KvReader(mla=False, buffers=[k, v], layout="page_first", page_size=PS)
    ckpt = Checkpointer(reader, rows, options=PluginOptions(), keyring=plaintext_keyring)
    rids = [f"r{i}" for i in range(n_req)]
    try:
        reqs = [
            Req(
                rid=f"s{i}",
                origin_input_ids=[(i * 7919 + j) % 30_000 for j in range(prompt)],
                kv=KvInfo(i, prompt),
                kv_hints=lumen_hints(rids[i], holder.endpoint, PS),
            )
            for i in range(n_req)
        ]
        hook_s: list[float] = []
        t_start = time.perf_counter()
        for step in range(steps):
            for r in reqs:
                r.output_ids.append((step * 31 + len(r.rid)) % 30_000)
                r.kv.kv_committed_len = len(r.tokens) - 1
            torch.cuda._sleep(10_000_000)  # ~ a decode step's GPU work, queued as the forward would be
            t0 = time.perf_counter()
            ckpt.after_decode(Batch(reqs))
            hook_s.append(time.perf_counter() - t0)
            torch.cuda.synchronize()  # the scheduler's per-step wait for the step's result
        decode_s = time.perf_counter() - t_start
        for _ in range(40):  # let the step budget drain the backlog, then let the KV plane catch up
            ckpt.after_decode(Batch(reqs))
            time.sleep(0.01)
        assert ckpt.shipper.flush(60)
        want = [((len(r.tokens) - 1) // PS) * PS for r in reqs]
        stats = ckpt.planner.stats

        def settled() -> bool:
            held = holder.durable(rids)
            return all(h in (w, 0) for h, w in zip(held, want, strict=True))

        wait_until(settled, 60)
        held = holder.durable(rids)
        shipped_s = time.perf_counter() - t_start
        us = sorted(s * 1e6 for s in hook_s)
        print(
            f"8 MiB pages: {stats.pages} pages ({stats.bytes / 2**30:.2f} GiB) staged over {steps} steps of"
            f" {decode_s / steps * 1e3:.1f} ms; hook p50 {statistics.median(us):.0f} us,"
            f" p99 {us[int(0.99 * (len(us) - 1))]:.0f} us, max {us[-1]:.0f} us; settled after {shipped_s:.2f} s;"
            f" requests wholly held {sum(h > 0 for h in held)}/{n_req}; abandoned (backlog, holder lag)"
            f" {stats.abandoned_backlog}, {stats.abandoned_holders}; deferred steps {stats.deferred_steps}"
        )
        assert statistics.median(us) < 2_000
    finally:
        ckpt.close()
        holder.close()
