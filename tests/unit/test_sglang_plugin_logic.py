"""Lumen's SGLang checkpoint plugin without SGLang: the kv_hints schema (and SGLang's JSON contract for
it), the planner's page rules (hypothesis: every complete page handed off exactly once, in order, none
incomplete, nothing after a finish or an abort, END once, abandonment instead of waiting), and the
shipper over the real KV plane (ZMQ on loopback) into a real holder store: pages under SGLang's page
keys, bytes intact, END frees, an abort keeps, a resumed request chains to the held prefix, a lagging
holder is given up.

The hooks that touch SGLang objects (worker_hooks/sglang/plugin.py) are tested in tests/sglang and, on
CUDA, tests/gpu/test_sglang_plugin_cuda.py.
"""

from __future__ import annotations

import hashlib
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.protocol.pagekeys import namespace_seed, page_keys
from gateway.protocol.plane_file import plaintext_keyring
from gateway.protocol.sglang import (
    LUMEN_CHECKPOINT_ACTION,
    LumenCheckpoint,
    LumenKvHolder,
    kv_hints_for,
    parse_kv_hints,
)
from tests.fixtures import sglang_api_types as api
from tests.fixtures.kv_holder import Holder, wait_until
from worker_hooks.sglang.plugin_logic import (
    ENV_OPTIONS,
    Control,
    ControlKind,
    Copy,
    Outcome,
    Planner,
    PluginOptions,
    ReqStep,
    Staging,
    complete_pages,
    holder_endpoints,
    kv_tokens,
    options_from_env,
    parent_key,
    token_slice,
)
from worker_hooks.sglang.plugin_shipper import Shipper
from worker_hooks.sglang.ship_jobs import PageRun, ShipJob

REPO = Path(__file__).resolve().parents[2]
PS = 16
NB = 512  # bytes per page


def ckpt(
    rid: str = "r1",
    holders: tuple[str, ...] = ("tcp://127.0.0.1:5600",),
    *,
    page_size: int = PS,
    first_page: int = 0,
    epoch: int = 3,
) -> LumenCheckpoint:
    hints = kv_hints_for(
        rid,
        epoch=epoch,
        src_worker="sgl-0",
        holders=[(f"h{i}", e) for i, e in enumerate(holders)],
        page_size=page_size,
        first_page=first_page,
    )
    parsed = parse_kv_hints(msgspec.to_builtins(hints))
    assert parsed is not None
    return parsed


# -- kv_hints ----------------------------------------------------------------------------------------
def test_kv_hints_pass_sglangs_contract_and_round_trip() -> None:
    hints = kv_hints_for(
        "a" * 32, epoch=7, src_worker="sgl-1", holders=[("sgl-2", "tcp://10.0.0.2:5600")], first_page=2
    )
    value = msgspec.to_builtins(hints)
    assert value == {
        "protocol_version": "lumen.kv.v1",
        "message_id": "a" * 32,
        "actions": [
            {
                "action_id": "a" * 32,
                "action_type": "lumen.checkpoint",
                "action_version": "1",
                "payload": {
                    "epoch": 7,
                    "src_worker": "sgl-1",
                    "holders": [{"worker_id": "sgl-2", "kv_endpoint": "tcp://10.0.0.2:5600"}],
                    "page_size": 64,
                    "first_page": 2,
                },
            }
        ],
    }
    body = {
        "rid": "a" * 32,
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 4},
        "kv_hints": value,
    }
    req = api.GenerateRequest.from_json_value(body)
    assert req.kv_hints is not None
    # what SGLang keeps on the request, back to JSON, is what the plugin parses
    again = parse_kv_hints(msgspec.to_builtins(req.kv_hints.to_json_value()))
    assert again == LumenCheckpoint(
        rid="a" * 32,
        epoch=7,
        src_worker="sgl-1",
        holders=(LumenKvHolder(worker_id="sgl-2", kv_endpoint="tcp://10.0.0.2:5600"),),
        page_size=64,
        first_page=2,
    )


def test_parse_ignores_what_is_not_lumens_and_refuses_a_malformed_lumen_action() -> None:
    assert parse_kv_hints(None) is None
    assert parse_kv_hints({"protocol_version": "other.v1", "message_id": "m", "actions": []}) is None
    other = {"action_id": "x", "action_type": "vendor.prefetch", "action_version": "1", "payload": {}}
    newer = {"action_id": "x", "action_type": LUMEN_CHECKPOINT_ACTION, "action_version": "2", "payload": {}}
    assert (
        parse_kv_hints({"protocol_version": "lumen.kv.v1", "message_id": "m", "actions": [other, newer]})
        is None
    )
    good = msgspec.to_builtins(kv_hints_for("m", epoch=0, src_worker="w", holders=[("h", "tcp://h:1")]))
    good["actions"].insert(0, other)
    parsed = parse_kv_hints(good)
    assert parsed is not None and parsed.rid == "m"
    bad = msgspec.to_builtins(kv_hints_for("m", epoch=0, src_worker="w", holders=[("h", "tcp://h:1")]))
    bad["actions"][0]["payload"]["epoch"] = -1
    with pytest.raises(ValueError, match=r"lumen\.checkpoint"):
        parse_kv_hints(bad)
    bad["actions"][0]["payload"] = {"epoch": 0, "src_worker": "w"}  # no holders
    with pytest.raises(ValueError):
        parse_kv_hints(bad)
    with pytest.raises(ValueError):
        parse_kv_hints({"protocol_version": "lumen.kv.v1", "message_id": "m", "actions": "x"})
    with pytest.raises(msgspec.ValidationError):
        kv_hints_for("", epoch=0, src_worker="w", holders=[])


def test_the_entry_point_is_declared() -> None:
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    eps = meta["project"]["entry-points"]["sglang.srt.plugins"]
    assert eps == {"lumen": "worker_hooks.sglang.plugin:register"}


def test_the_documented_defaults_are_the_defaults() -> None:
    doc = (REPO / "docs" / "sglang.md").read_text()
    quoted = (
        doc.split("### Decode-time checkpoint plugin", 1)[1].split(f"{ENV_OPTIONS}='", 1)[1].split("'", 1)[0]
    )
    assert options_from_env({ENV_OPTIONS: quoted.replace("\n", " ")}) == PluginOptions()


def test_options_from_the_environment() -> None:
    assert options_from_env({}) == PluginOptions()
    opts = options_from_env({ENV_OPTIONS: '{"step_bytes": 4096, "staging_bytes": 65536}'})
    assert (opts.step_bytes, opts.staging_bytes) == (4096, 65536)
    for bad in ('{"step_bytez": 1}', '{"step_bytes": 0}', "not json"):
        with pytest.raises(ValueError, match=ENV_OPTIONS):
            options_from_env({ENV_OPTIONS: bad})


# -- lengths and keys -------------------------------------------------------------------------------
def test_only_computed_kv_counts() -> None:
    # the last emitted token's KV does not exist yet, and nothing beyond what SGLang committed
    assert kv_tokens(10, 0, 10) == 9
    assert kv_tokens(10, 5, 14) == 14
    assert kv_tokens(10, 5, 12) == 12  # a verify step's drafts not committed
    assert kv_tokens(0, 0, 0) == 0
    assert complete_pages(2 * PS, 1, 10 * PS, PS) == 2
    assert complete_pages(2 * PS, 0, 10 * PS, PS) == 1  # the prompt's last token is recomputed


@given(
    st.lists(st.integers(0, 1 << 40), max_size=40), st.lists(st.integers(0, 1 << 40), max_size=40), st.data()
)
def test_token_slice_is_a_slice_of_the_concatenation(prompt: list[int], output: list[int], data: Any) -> None:
    n = len(prompt) + len(output)
    a = data.draw(st.integers(0, n))
    b = data.draw(st.integers(a, n))
    assert token_slice(prompt, output, a, b) == (prompt + output)[a:b]


def test_parent_keys_chain_like_sglangs_hash() -> None:
    ids = list(range(5 * PS))
    seed = namespace_seed("tenant", None)
    assert parent_key([], PS, None) is None
    assert parent_key([], PS, seed) == seed
    assert parent_key(ids[: 3 * PS], PS, seed) == page_keys(ids, PS, seed)[2]


def test_holder_endpoints_follow_the_shard_layout() -> None:
    c = ckpt(holders=("tcp://10.0.0.2:5600", "ipc:///tmp/h", "bogus", "tcp://10.0.0.2:5600"))
    assert holder_endpoints(c, (0,)) == ("tcp://10.0.0.2:5600", "ipc:///tmp/h")
    assert holder_endpoints(c, (1,)) == ("tcp://10.0.0.2:5601", "ipc:///tmp/h.shard1")
    assert holder_endpoints(c, (0, 1)) == (
        "tcp://10.0.0.2:5600",
        "tcp://10.0.0.2:5601",
        "ipc:///tmp/h",
        "ipc:///tmp/h.shard1",
    )


# -- the planner ------------------------------------------------------------------------------------
def planner(
    *, step_bytes: int = 1 << 30, staging_bytes: int = 1 << 30, page_bytes: int = NB, backlog: int = 1 << 40
) -> tuple[Planner, Staging]:
    staging = Staging(staging_bytes)
    opts = PluginOptions(step_bytes=step_bytes, staging_bytes=staging_bytes, max_backlog_bytes=backlog)
    return Planner(page_size=PS, page_bytes=page_bytes, options=opts, staging=staging), staging


def release_all(staging: Staging) -> None:
    for offset, _ in staging.regions():
        staging.release(offset)


def test_pages_go_once_in_order_and_end_follows() -> None:
    p, staging = planner()
    c = ckpt()
    plan = p.step([ReqStep("k", c, None, complete=3)])
    assert [(x.first_page, x.n_pages, x.starts_chain) for x in plan.copies] == [(0, 3, True)]
    assert staging.used == 3 * NB
    assert p.step([ReqStep("k", c, None, complete=3)]).copies == []
    plan = p.step([ReqStep("k", c, None, complete=5)])
    assert [(x.first_page, x.n_pages, x.starts_chain) for x in plan.copies] == [(3, 2, False)]
    plan = p.step([ReqStep("k", None, None, 0, Outcome.FINISHED)])
    assert plan.controls == [Control(ControlKind.END, "r1", "sgl-0", 3)] and not plan.copies
    assert p.step([ReqStep("k", None, None, 0, Outcome.FINISHED)]).controls == []  # once
    assert not p.is_tracked("k")


def test_an_abort_sends_nothing_and_absent_or_foreign_hints_checkpoint_nothing() -> None:
    p, _ = planner()
    p.step([ReqStep("k", ckpt(), None, complete=2)])
    plan = p.step([ReqStep("k", None, None, 0, Outcome.ABORTED)])
    assert plan.controls == [] and plan.copies == [] and p.stats.aborted == 1
    assert p.step([ReqStep("n", None, None, complete=9)]).copies == []
    # another page size than the server's, or no usable holder: refused once, nothing sent
    for refused in (ckpt("r2", page_size=2 * PS), ckpt("r3", holders=("nope",))):
        assert p.step([ReqStep(refused.rid, refused, None, complete=9)]).copies == []
        assert p.step([ReqStep(refused.rid, None, None, complete=10)]).copies == []
    assert p.stats.refused == 2
    # a second SGLang request under the same Lumen rid (parallel sampling copies the hints) is refused
    p.step([ReqStep("a", ckpt("same"), None, complete=1)])
    assert p.step([ReqStep("b", ckpt("same"), None, complete=1)]).copies == []


def test_first_page_starts_the_chain_there() -> None:
    p, _ = planner()
    c = ckpt(first_page=2)
    assert p.step([ReqStep("k", c, "s" * 64, complete=2)]).copies == []
    (copy,) = p.step([ReqStep("k", None, None, complete=4)]).copies
    assert (copy.first_page, copy.n_pages, copy.starts_chain, copy.seed) == (2, 2, True, "s" * 64)


def test_the_step_budget_spreads_a_long_prompt_round_robin() -> None:
    p, _ = planner(step_bytes=3 * NB)
    a, b = ckpt("a"), ckpt("b")
    seen: dict[str, list[tuple[int, int]]] = {"a": [], "b": []}
    steps = [ReqStep("a", a, None, complete=7), ReqStep("b", b, None, complete=2)]
    for _ in range(6):
        plan = p.step(steps)
        assert sum(c.nbytes for c in plan.copies) <= 3 * NB
        for c in plan.copies:
            seen[c.rid].append((c.first_page, c.n_pages))
        steps = [ReqStep("a", None, None, complete=7), ReqStep("b", None, None, complete=2)]
    for rid, n in (("a", 7), ("b", 2)):
        pages = [i for first, k in seen[rid] for i in range(first, first + k)]
        assert pages == list(range(n))
    # a page larger than the whole budget still goes, one per step
    p, _ = planner(step_bytes=NB // 2)
    assert [c.n_pages for c in p.step([ReqStep("a", a, None, complete=3)]).copies] == [1]


def test_a_full_ring_defers_and_a_too_long_backlog_abandons() -> None:
    p, staging = planner(staging_bytes=3 * NB, backlog=6 * NB)
    a, b = ckpt("a"), ckpt("b")
    sent: dict[str, list[int]] = {"a": [], "b": []}

    def step(*reqs: ReqStep) -> list[Control]:
        plan = p.step(reqs)
        for c in plan.copies:
            sent[c.rid].extend(range(c.first_page, c.first_page + c.n_pages))
        return plan.controls

    assert step(ReqStep("a", a, None, complete=2)) == []
    assert staging.regions() == [(0, 2 * NB)]
    # one page of room for three waiting pages: one goes, the rest waits (never blocks, nothing dropped)
    assert step(ReqStep("a", None, None, complete=3), ReqStep("b", b, None, complete=2)) == []
    assert len(sent["a"]) + len(sent["b"]) == 3 and p.stats.deferred_steps == 1
    release_all(staging)
    assert step(ReqStep("a", None, None, complete=3), ReqStep("b", None, None, complete=2)) == []
    assert sent == {"a": [0, 1, 2], "b": [0, 1]}
    # the holders lag: nothing is released, a's backlog passes its bound and a is given up
    release_all(staging)
    assert step(ReqStep("a", None, None, complete=8), ReqStep("b", None, None, complete=2)) == []
    controls = step(ReqStep("a", None, None, complete=14), ReqStep("b", None, None, complete=2))
    assert [(c.kind, c.rid) for c in controls] == [(ControlKind.DROP, "a")]
    assert p.stats.abandoned_backlog == 1
    release_all(staging)
    step(ReqStep("a", None, None, complete=20), ReqStep("b", None, None, complete=3))
    assert sent["a"] == [0, 1, 2, 3, 4, 5] and sent["b"] == [0, 1, 2]
    # ... and an abandoned request ends without END
    assert step(ReqStep("a", None, None, 0, Outcome.FINISHED)) == []


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40)), max_size=200), st.integers(1, 100))
def test_the_staging_ring_never_hands_out_overlapping_memory(ops: list[tuple[bool, int]], cap: int) -> None:
    ring = Staging(cap)
    live: list[tuple[int, int]] = []
    for reserve, n in ops:
        if reserve or not live:
            off = ring.reserve(n)
            if off is not None:
                assert off >= 0 and off + n <= cap
                assert all(off + n <= o or o + m <= off for o, m in live)
                live.append((off, n))
            elif not live:
                assert n > cap  # an empty ring takes anything that fits in it
        else:
            off, _ = live.pop(n % len(live))  # released in any order
            ring.release(off)
        assert ring.used == sum(m for _, m in live)
        assert sorted(ring.regions()) == sorted(live)
    for off, _ in live:
        ring.release(off)
    assert ring.used == 0 and ring.reserve(cap) == 0
    with pytest.raises(RuntimeError):
        ring.release(cap + 1)


def test_a_request_is_abandoned_once_every_holder_is_given_up() -> None:
    p, _ = planner()
    c = ckpt(holders=("tcp://h:1", "tcp://h:2"))
    p.step([ReqStep("k", c, None, complete=1)])
    assert not p.holder_given_up("r1", "tcp://h:1")
    (copy,) = p.step([ReqStep("k", None, None, complete=2)]).copies
    assert copy.endpoints == ("tcp://h:2",)
    assert p.holder_given_up("r1", "tcp://h:2")
    assert p.step([ReqStep("k", None, None, complete=3)]).copies == []
    assert not p.holder_given_up("unknown", "tcp://h:2")


@dataclass
class _Sim:
    prompt: int
    out: int = 0
    committed: int = 0
    state: str = "new"  # new, running, finished, aborted
    pages: list[int] = field(default_factory=list)
    closes: list[ControlKind] = field(default_factory=list)


@given(st.data())
def test_planner_invariants(data: Any) -> None:
    """Random requests grow (one token or a speculative run per step, commits lagging), finish or
    abort; budgets are random and the shipper frees staging at random. Every page handed off is
    complete when handed off, each once and in order from first_page; after a finish or an abort
    nothing more is handed off; END once per finished, non-abandoned request; DROP only for a backlog
    past its bound."""
    page_bytes = data.draw(st.integers(1, 4 * NB), label="page_bytes")
    step_bytes = data.draw(st.integers(1, 16 * NB), label="step_bytes")
    staging_bytes = data.draw(st.integers(page_bytes, 32 * NB), label="staging_bytes")
    backlog = data.draw(st.integers(1, 64 * NB), label="backlog")
    p, staging = planner(
        step_bytes=step_bytes, staging_bytes=staging_bytes, page_bytes=page_bytes, backlog=backlog
    )
    n = data.draw(st.integers(1, 5), label="requests")
    sims = {f"q{i}": _Sim(prompt=data.draw(st.integers(1, 6 * PS), label="prompt")) for i in range(n)}
    firsts = {k: data.draw(st.integers(0, 2), label="first_page") for k in sims}
    held: list[int] = []  # staged reservations the "shipper" has not taken yet
    held_bytes = 0
    for _ in range(data.draw(st.integers(1, 40), label="steps")):
        steps: list[ReqStep] = []
        complete_now: dict[str, int] = {}
        for k, s in sims.items():
            if s.state in ("finished", "aborted"):
                if data.draw(st.booleans()):  # overlap scheduling shows a finished request again
                    steps.append(
                        ReqStep(
                            k, None, None, 0, Outcome.FINISHED if s.state == "finished" else Outcome.ABORTED
                        )
                    )
                continue
            grow = data.draw(st.integers(0, 4))
            s.out += grow
            s.committed = max(s.committed, s.prompt + s.out - 1 - data.draw(st.integers(0, 2)))
            end = data.draw(st.sampled_from(["run", "run", "run", "finish", "abort"]))
            if end != "run":
                s.state = "finished" if end == "finish" else "aborted"
                steps.append(
                    ReqStep(k, None, None, 0, Outcome.FINISHED if end == "finish" else Outcome.ABORTED)
                )
                continue
            c = ckpt(k, first_page=firsts[k]) if s.state == "new" else None
            s.state = "running"
            complete_now[k] = complete_pages(s.prompt, s.out, s.committed, PS)
            steps.append(ReqStep(k, c, None, complete_now[k]))
        plan = p.step(steps)
        assert sum(c.nbytes for c in plan.copies) <= max(step_bytes, page_bytes)
        for c in plan.copies:
            s = sims[c.rid]
            assert s.state == "running" and not s.closes
            assert c.first_page + c.n_pages <= complete_now[c.rid]  # only complete pages
            assert c.starts_chain == (not s.pages)
            s.pages.extend(range(c.first_page, c.first_page + c.n_pages))
            held.append(c.offset)
            held_bytes += c.nbytes
        for ctl in plan.controls:
            sims[ctl.rid].closes.append(ctl.kind)
            if ctl.kind is ControlKind.DROP:  # only a backlog past its bound
                t_pages = len(sims[ctl.rid].pages)
                assert (complete_now[ctl.rid] - firsts[ctl.rid] - t_pages) * page_bytes > backlog
        assert staging.used == held_bytes
        if held and data.draw(st.booleans()):  # the shipper takes some, oldest first or not
            for off in held[: data.draw(st.integers(1, len(held)))]:
                staging.release(off)
            held_bytes = staging.used
            held = [o for o, _ in staging.regions()]
    for k, s in sims.items():
        assert s.pages == list(range(firsts[k], firsts[k] + len(s.pages)))  # once, in order
        assert len(s.closes) <= 1
        if s.closes == [ControlKind.END]:
            assert s.state == "finished"
        if s.state == "aborted":
            assert ControlKind.END not in s.closes
    assert p.stats.abandoned_backlog == sum(s.closes == [ControlKind.DROP] for s in sims.values())


@given(st.lists(st.integers(0, 3), min_size=1, max_size=60), st.integers(1, 8))
def test_with_room_every_complete_page_goes(growth: list[int], budget_pages: int) -> None:
    p, staging = planner(step_bytes=budget_pages * NB)
    c = ckpt()
    prompt, out, sent = 3 * PS + 5, 0, 0
    for i, g in enumerate([*growth, *[0] * 100]):
        out += g
        done = complete_pages(prompt, out, prompt + out, PS)
        plan = p.step([ReqStep("k", c if i == 0 else None, None, done)])
        for copy in plan.copies:
            assert copy.first_page == sent
            sent += copy.n_pages
        release_all(staging)
    assert sent == complete_pages(prompt, out, prompt + out, PS)


# -- the shipper over the real KV plane ---------------------------------------------------------------
@pytest.fixture
def holder() -> Iterator[Holder]:
    h = Holder()
    yield h
    h.close()


def kv_of(ids: list[int], page_size: int = PS, nbytes: int = NB) -> bytes:
    """Stand-in KV of pages of `ids`: a pure function of each page's tokens."""
    out = b""
    for i in range(0, len(ids), page_size):
        h = hashlib.sha256(repr(ids[: i + page_size]).encode()).digest()
        out += (h * (nbytes // 32 + 1))[:nbytes]
    return out


class Driver:
    """What plugin.py does each step, with stand-in KV: plan, stage (a copy that is ready after a few
    polls), submit."""

    def __init__(self, p: Planner, shipper: Shipper) -> None:
        self.p, self.shipper = p, shipper
        self.reqs: dict[str, tuple[list[int], LumenCheckpoint | None, str | None]] = {}

    def step(self, status: dict[str, tuple[int, Outcome]]) -> None:
        for rid, endpoint in self.shipper.given_up():
            self.p.holder_given_up(rid, endpoint)
        steps = []
        for key, (n_tokens, outcome) in status.items():
            _, c, seed = self.reqs[key]
            first = not self.p.is_tracked(key)
            done = complete_pages(n_tokens, 0, n_tokens, PS)
            steps.append(ReqStep(key, c if first else None, seed, done, outcome))
        plan = self.p.step(steps, self.shipper.congested())
        for ctl in plan.controls:
            self.shipper.submit(ctl)
        if plan.copies:
            self.shipper.submit(self.job(plan.copies))

    def job(self, copies: list[Copy]) -> ShipJob:
        runs, data, offset = [], b"", 0
        for c in copies:
            ids = self.reqs[str(c.key)][0]
            data += kv_of(ids[: c.end_token])[c.first_page * NB :]
            prefix = ids[: c.start_token] if c.starts_chain and c.first_page else None
            runs.append(PageRun(c, ids[c.start_token : c.end_token], prefix, offset))
            offset += c.nbytes
        polls = iter(range(3))
        return ShipJob(runs, lambda: next(polls, None) is None, lambda: memoryview(data))


@pytest.fixture
def shipping() -> Iterator[Callable[..., tuple[Driver, Shipper, Staging]]]:
    made: list[Shipper] = []

    def make(**opts: Any) -> tuple[Driver, Shipper, Staging]:
        options = PluginOptions(**opts)
        staging = Staging(options.staging_bytes)
        p = Planner(page_size=PS, page_bytes=NB, options=options, staging=staging)
        shipper = Shipper(options, staging, keyring=plaintext_keyring)
        made.append(shipper)
        return Driver(p, shipper), shipper, staging

    yield make
    for s in made:
        s.close()


def test_pages_reach_the_holder_under_sglangs_keys_and_end_frees_them(
    holder: Holder, shipping: Callable[..., tuple[Driver, Shipper, Staging]]
) -> None:
    drv, shipper, staging = shipping(step_bytes=2 * NB)
    ids = [(i * 31 + 7) % 40_000 for i in range(6 * PS + 3)]
    seed = namespace_seed(None, "salt")  # a namespaced request: page 0 chains to the seed
    drv.reqs["k"] = (ids, ckpt("rid-1", (holder.endpoint,)), seed)
    for n in (PS + 1, 3 * PS, 3 * PS + 1, 6 * PS + 3, 6 * PS + 3, 6 * PS + 3):
        drv.step({"k": (n, Outcome.RUNNING)})
    assert shipper.flush(5)
    wait_until(lambda: holder.read(lambda s: s.durable_tokens("rid-1")) == 6 * PS)
    keys = page_keys(ids, PS, seed)
    pages = holder.read(lambda s: [bytes(s.page(k) or b"") for k in keys])
    assert b"".join(pages) == kv_of(ids[: 6 * PS])
    info = holder.read(lambda s: s.chain("rid-1"))
    assert (info.src_worker, info.incarnation, info.page_size) == ("sgl-0", 3, PS)
    assert staging.used == 0 and shipper.stats.jobs >= 4
    drv.step({"k": (6 * PS + 4, Outcome.FINISHED)})
    wait_until(lambda: holder.read(lambda s: s.durable_tokens("rid-1")) == 0)


def test_an_abort_keeps_the_pages_and_a_resumed_request_chains_to_them(
    holder: Holder, shipping: Callable[..., tuple[Driver, Shipper, Staging]]
) -> None:
    drv, shipper, _ = shipping()
    ids = [(i * 17 + 3) % 30_000 for i in range(5 * PS)]
    drv.reqs["a"] = (ids, ckpt("first", (holder.endpoint,)), None)
    drv.step({"a": (3 * PS + 1, Outcome.RUNNING)})
    drv.step({"a": (3 * PS + 2, Outcome.ABORTED)})
    assert shipper.flush(5)
    wait_until(lambda: holder.read(lambda s: s.durable_tokens("first")) == 3 * PS)
    # the gateway resumes it elsewhere with first_page=3: the new attempt adopts the held prefix
    drv.reqs["b"] = (ids, ckpt("second", (holder.endpoint,), first_page=3, epoch=4), None)
    drv.step({"b": (5 * PS + 1, Outcome.RUNNING)})
    assert shipper.flush(5)
    wait_until(lambda: holder.read(lambda s: s.durable_tokens("second")) == 5 * PS)
    keys = page_keys(ids, PS)
    assert holder.read(lambda s: b"".join(bytes(s.page(k) or b"") for k in keys)) == kv_of(ids)


def test_a_lagging_holder_holds_its_requests_back_then_they_are_given_up(
    shipping: Callable[..., tuple[Driver, Shipper, Staging]],
) -> None:
    # nobody listens at the endpoint: the KV plane's queue for it fills to half its lag bound, the
    # request's pages then wait uncopied, and once that backlog passes its bound the request is dropped
    drv, shipper, staging = shipping(max_lag_bytes=4 * NB, frame_bytes=NB, max_backlog_bytes=8 * NB)
    dead = "tcp://127.0.0.1:9"
    ids = list(range(40 * PS))
    drv.reqs["k"] = (ids, ckpt("slow", (dead,)), None)
    t0 = time.perf_counter()
    drv.step({"k": (4 * PS + 1, Outcome.RUNNING)})
    wait_until(lambda: dead in shipper.congested())
    copied = drv.p.stats.pages
    drv.step({"k": (8 * PS + 1, Outcome.RUNNING)})
    assert drv.p.stats.pages == copied  # held back, not queued behind the dead holder
    drv.step({"k": (20 * PS + 1, Outcome.RUNNING)})  # the backlog passes 8 pages: given up
    assert time.perf_counter() - t0 < 2.0  # no step waited
    assert drv.p.stats.abandoned_backlog == 1
    drv.step({"k": (40 * PS, Outcome.RUNNING)})
    assert drv.p.stats.pages == copied  # nothing more copied for it
    wait_until(lambda: staging.used == 0 and shipper.idle())


def test_the_sender_gives_up_a_holder_that_lags_past_its_bound(
    shipping: Callable[..., tuple[Driver, Shipper, Staging]],
) -> None:
    # one step's pages alone overflow the holder's queue: the KV plane gives the request up there
    drv, shipper, _ = shipping(max_lag_bytes=2 * NB, frame_bytes=NB)
    drv.reqs["k"] = (list(range(40 * PS)), ckpt("slow", ("tcp://127.0.0.1:9",)), None)
    drv.step({"k": (10 * PS + 1, Outcome.RUNNING)})

    def given_up() -> bool:
        drv.step({"k": (10 * PS + 2, Outcome.RUNNING)})  # the next step learns what the KV plane gave up
        return drv.p.stats.abandoned_holders == 1

    wait_until(given_up)
    assert not shipper.congested()


def test_congested_holders_defer_only_requests_with_no_other_holder() -> None:
    p, _ = planner()
    one = ckpt("one", ("tcp://h:1",))
    two = ckpt("two", ("tcp://h:1", "tcp://h:2"))
    plan = p.step([ReqStep("a", one, None, 2), ReqStep("b", two, None, 2)], frozenset({"tcp://h:1"}))
    assert [c.rid for c in plan.copies] == ["two"]
    plan = p.step([ReqStep("a", None, None, 2), ReqStep("b", None, None, 2)])
    assert [c.rid for c in plan.copies] == ["one"]


def test_a_failed_copy_drops_the_job_and_gives_its_request_up(
    holder: Holder, shipping: Callable[..., tuple[Driver, Shipper, Staging]]
) -> None:
    drv, shipper, staging = shipping()
    c = ckpt("bad", (holder.endpoint,))
    (copy,) = drv.p.step([ReqStep("k", c, None, 2)]).copies
    run = PageRun(copy, list(range(2 * PS)), None, 0)

    def boom() -> memoryview:
        raise RuntimeError("CUDA error")

    shipper.submit(ShipJob([run], lambda: True, boom))
    wait_until(lambda: shipper.stats.failed_jobs == 1)
    assert staging.used == 0
    assert shipper.given_up() == [("bad", holder.endpoint)]


def test_closing_releases_what_was_never_shipped(
    shipping: Callable[..., tuple[Driver, Shipper, Staging]],
) -> None:
    drv, shipper, staging = shipping(drain_timeout_s=0.05)
    c = ckpt("never", ("tcp://127.0.0.1:9",))
    (copy,) = drv.p.step([ReqStep("k", c, None, 2)]).copies
    shipper.submit(
        ShipJob([PageRun(copy, list(range(2 * PS)), None, 0)], lambda: False, lambda: memoryview(b""))
    )
    shipper.close()
    assert staging.used == 0
    assert not shipper.submit(Control(ControlKind.END, "never", "sgl-0", 3))


def test_shipper_start_and_stop_leave_no_thread_behind() -> None:
    s = Shipper(PluginOptions(), Staging(1 << 20), keyring=plaintext_keyring)
    thread = s._thread
    assert thread.is_alive() and thread.daemon
    s.close()
    assert not thread.is_alive()
    s.close()  # idempotent
