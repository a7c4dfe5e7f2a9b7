"""The torch backend's scheduler on a tiny random model (fp32, CPU): exact restores from real KV pages,
draft verification identical to plain decoding, and a page pool that never leaks."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest

torch = pytest.importorskip("torch")

from draft_models.torch_drafter import TorchDrafter  # noqa: E402
from gateway.protocol.generate import SamplingParams  # noqa: E402
from gateway.protocol.launch import EngineSpec  # noqa: E402
from models.synthetic import Sampler  # noqa: E402
from models.torch_sampling import sample_token  # noqa: E402
from worker_hooks.engine.pages import PagePool  # noqa: E402
from worker_hooks.engine.scheduler import Drafts, StepResult  # noqa: E402
from worker_hooks.engine.torch_backend import TorchBackend  # noqa: E402
from worker_hooks.engine.torch_scheduler import TorchScheduler, TorchSeq  # noqa: E402

PS = 8
GREEDY = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=40, temperature=0.8, top_p=0.9, top_k=50, ignore_eos=True)


def spec(**kw: Any) -> EngineSpec:
    base: dict[str, Any] = {
        "worker_id": "w",
        "control_address": "",
        "backend": "torch",
        "torch_model": "tiny",
        "page_size": PS,
        "torch_threads": 1,  # torch's default (one per core) spins against the rest of a loaded box
    }
    return EngineSpec(**(base | kw))


class Rig:
    """One engine's model side without the engine shell: the real backend, pool and scheduler."""

    def __init__(self, pages: int = 256, max_running: int = 16, chunk: int = 24) -> None:
        self.pool = PagePool(pages * PS, PS)
        self.backend = TorchBackend(spec(), self.pool.capacity_tokens)
        self.backend.load_target()
        self.sched = TorchScheduler(self.pool, max_running=max_running, chunked_prefill_size=chunk)

    def submit(
        self,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        seed: int = 0,
        restored: int = 0,
        data: bytes | None = None,
    ) -> TorchSeq:
        seq = self.sched.make_seq(rid, prompt, params, seed, restored, data)
        self.sched.add(seq)
        return seq

    def step(self, drafts: dict[str, Drafts] | None = None) -> StepResult:
        plan = self.sched.plan(drafts)
        logits = self.backend.run(plan)
        return self.sched.commit(plan, logits)

    def run(self, outs: dict[str, list[int]] | None = None, drafter: Any = None) -> dict[str, list[int]]:
        outs = {} if outs is None else outs
        while self.sched.has_work:
            drafts = drafter(self.sched) if drafter is not None else None
            for e in self.step(drafts).emissions:
                outs.setdefault(e.rid, []).extend(e.new_ids)
            self.pool.check_integrity()
        return outs


def prompt_of(n: int, salt: int = 0) -> list[int]:
    r = random.Random(salt)
    return [r.randrange(0, 256) for _ in range(n)]


def test_paged_batched_decoding_matches_the_dense_reference() -> None:
    rig = Rig()
    prompt = prompt_of(37, 1)
    rig.submit("a", prompt, GREEDY)
    rig.submit("b", prompt_of(11, 2), GREEDY)  # a neighbour in every batch
    out = rig.run()["a"]
    model = rig.backend.model
    assert model is not None
    ctx, ref = list(prompt), []
    for _ in range(GREEDY.max_new_tokens):
        token = int(torch.argmax(model.forward_dense(ctx)[-1]))
        ref.append(token)
        ctx.append(token)
    assert out == ref
    assert len(set(out)) > 4  # the random model does not just repeat itself


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_request_restored_from_checkpointed_pages_continues_exactly(params: SamplingParams) -> None:
    prompt = prompt_of(29, 3)
    ref = Rig()
    ref.submit("r", prompt, params, seed=7)
    truth = ref.run()["r"]

    # worker A: decode part-way, then read the full pages out, as the checkpoint sender does
    a = Rig()
    seq = a.submit("r", prompt, params, seed=7)
    emitted: list[int] = []
    while len(emitted) < 13:
        for e in a.step().emissions:
            emitted.extend(e.new_ids)
    full = seq.kv_len // PS
    data = bytes(a.backend.export(seq, 0, full))
    assert len(data) == full * a.backend.page_nbytes

    # worker B (another pool, other page ids): prompt + emitted, restored prefix, the rest prefilled
    b = Rig()
    b.pool.allocate("someone-else", 5)  # B's free pages are not A's
    resumed = prompt + emitted
    left = msgspec.structs.replace(params, max_new_tokens=params.max_new_tokens - len(emitted))
    seq_b = b.submit("r2", resumed, left, seed=7, restored=full * PS, data=data)
    assert 0 < seq_b.restored < len(resumed)
    result = b.run()["r2"]
    assert emitted + result == truth

    # without the restore (a replay) the tokens are the same too
    c = Rig()
    c.submit("r3", resumed, left, seed=7)
    assert emitted + c.run()["r3"] == truth


def drafts_from(drafter: TorchDrafter, k: int) -> Any:
    """Per step, k drafts for every decoding request from `drafter` (as the draft plane would)."""

    def make(sched: TorchScheduler) -> dict[str, Drafts]:
        out = {}
        for seq in sched.decoding():
            ctx = seq.context(0, seq.context_len)
            state = drafter.start(ctx)
            proposal = drafter.propose(state, k, seq.sampler)
            out[seq.rid] = Drafts(seq.context_len, proposal.tokens)
        return out

    return make


def garbage(k: int) -> Any:
    def make(sched: TorchScheduler) -> dict[str, Drafts]:
        return {
            s.rid: Drafts(s.context_len, tuple((s.context_len * 31 + i) % 259 for i in range(k)))
            for s in sched.decoding()
        }

    return make


@pytest.mark.parametrize("draft", ["self:2", "self:1", "tiny-draft", "garbage"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_draft_assisted_output_is_plain_decoding_token_for_token(draft: str, params: SamplingParams) -> None:
    prompts = [prompt_of(n, 10 + n) for n in (5, 17, 40)]
    plain = Rig()
    for i, p in enumerate(prompts):
        plain.submit(f"r{i}", p, params, seed=i)
    truth = plain.run()

    rig = Rig()
    if draft == "garbage":
        drafter = garbage(4)
    else:
        model = TorchBackend(spec(torch_draft=draft), rig.pool.capacity_tokens).load_draft()
        drafter = drafts_from(TorchDrafter(model), 4)
    for i, p in enumerate(prompts):
        rig.submit(f"r{i}", p, params, seed=i)
    outs: dict[str, list[int]] = {}
    accepted = drafted = 0
    while rig.sched.has_work:
        result = rig.step(drafter(rig.sched))
        for e in result.emissions:
            outs.setdefault(e.rid, []).extend(e.new_ids)
        drafted += sum(v.drafted for v in result.verified)
        accepted += sum(v.accepted for v in result.verified)
        rig.pool.check_integrity()
    assert outs == truth
    assert drafted > 0
    if draft == "self:2":  # the whole target as its own draft: every draft is the target's token
        assert accepted == drafted
    if draft == "garbage":
        assert accepted < drafted


def test_sampling_is_a_function_of_logits_seed_and_position() -> None:
    logits = torch.randn(259, generator=torch.Generator().manual_seed(0))
    s = Sampler.from_params(SEEDED, seed_base=5)
    a = [sample_token(logits, s, p) for p in range(64)]
    assert a == [sample_token(logits, s, p) for p in range(64)]
    assert len(set(a)) > 5  # positions draw different uniforms
    greedy = int(torch.argmax(logits))
    top1 = Sampler.from_params(msgspec.structs.replace(SEEDED, top_k=1), seed_base=5)
    assert sample_token(logits, top1, 3) == greedy
    tight = Sampler.from_params(SamplingParams(temperature=1.0, top_p=1e-9), seed_base=5)
    assert sample_token(logits, tight, 3) == greedy  # top_p keeps one token


def test_500_mixed_requests_with_aborts_never_leak_a_page() -> None:
    rnd = random.Random(42)
    rig = Rig(pages=96, max_running=24, chunk=32)
    total = rig.pool.total_pages
    live: list[str] = []
    submitted = aborted = finished = 0
    while submitted < 500 or rig.sched.has_work:
        for _ in range(rnd.randrange(0, 6)):
            if submitted == 500:
                break
            params = SamplingParams(
                max_new_tokens=rnd.randrange(0, 12),
                temperature=rnd.choice([0.0, 0.7]),
                stop_token_ids=[rnd.randrange(0, 259)],
            )
            rid = f"r{submitted}"
            rig.submit(rid, prompt_of(rnd.randrange(1, 60), submitted), params, seed=submitted)
            live.append(rid)
            submitted += 1
        if live and rnd.random() < 0.3:  # abort a random request: waiting, prefilling or decoding
            rid = live.pop(rnd.randrange(len(live)))
            if rig.sched.abort(rid) is not None:
                aborted += 1
        if rig.sched.has_work:
            for e in rig.step().emissions:
                if e.finish is not None:
                    finished += 1
                    live.remove(e.rid)
        rig.pool.check_integrity()
    assert submitted == 500 and aborted > 50 and finished + aborted == 500
    assert (rig.pool.free_pages, rig.pool.available_pages) == (total, total)


def test_the_gateway_knows_every_torch_preset() -> None:
    from gateway.protocol.launch import TORCH_PRESETS
    from models.torch_config import PRESETS

    assert set(TORCH_PRESETS) == set(PRESETS)
