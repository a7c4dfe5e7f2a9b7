"""The engine's part in KV checkpointing (DESIGN 4.4): holding other workers' pages, streaming its own
requests' pages to their holders, and finding a restorable prefix for a new request.

Holder side: a `CheckpointStore` behind a `StoreServer` (ZMQ PULL) bound at `endpoint`. Budgets and
reported bytes are modelled; the synthetic backend sends pages of modelled size × payload_scale real
bytes, so the store's real budget is scaled the same way. Orphans (writer gone without END or DROP)
expire on an owned timer. A worker with a zero budget runs no store and advertises no endpoint.

Serving side: one `CheckpointSender` per incarnation. After each engine step `after_step` hands every
page a tracked request completed to `send_pages`, with its token ids and its bytes: synthetic ones (a
pure function of the page key, as real KV is of its prefix), or, with a real model (`pages`, the
torch backend), the KV itself read out of the paged cache; then bytes are real and budgets are in real
bytes. Only full pages whose KV exists are sent:
the last emitted token's KV is computed by the next step, so when a request finishes its holders
hold floor((prompt + output − 1) / page_size) pages. Aborts keep the pages (the gateway may resume
from them); only an explicit drop discards them.

Both sides run under the worker's `PlaneAuth` (gateway/protocol/planes.py): the store admits only the
gateway's current members, each under its own identity, and the senders reach holders by the server
key the member table gives for their endpoints.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import structlog
import zmq.asyncio

from gateway.core.costmodel import ModelSpec
from gateway.protocol.launch import EngineSpec
from gateway.protocol.pagekeys import page_keys
from gateway.protocol.planes import Security
from worker_hooks.engine.scheduler import Seq
from worker_hooks.kv.payload import model_page_nbytes
from worker_hooks.kv.receiver import StoreServer
from worker_hooks.kv.sender import CheckpointSender
from worker_hooks.kv.store import CheckpointStore

log = structlog.get_logger(__name__)


def store_bind(host: str) -> str:
    """The store's PULL endpoint: the worker's own address (spec.host), any free port."""
    return f"tcp://{host}:0"


# how long closing a sender (reset, shutdown) waits for queued pages to reach the holders
SENDER_DRAIN_S = 0.1
EXPIRE_PERIOD_MAX_S = 5.0
_ENDPOINT = re.compile(r"^(tcp://\S+:\d+|ipc://\S+|inproc://\S+)$")
_GOLDEN = np.uint64(0x9E37_79B9_7F4A_7C15)


def valid_endpoint(endpoint: str) -> bool:
    return _ENDPOINT.match(endpoint) is not None


class PageBytes:
    """The synthetic bytes of `worker_hooks.kv.payload.page_bytes`, many pages in one buffer.

    Same bytes (a counter times an odd constant, XORed with the key's first 64 bits), written page by
    page into one fresh buffer through a cached counter row and a scratch row: the per-page helper
    allocates and copies four times per page, which at realistic page sizes costs more than
    everything else on the step path.
    """

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._words = np.arange((nbytes + 7) // 8, dtype=np.uint64) * _GOLDEN
        self._row = np.empty_like(self._words)

    def of(self, keys: Sequence[str]) -> memoryview:
        n = self.nbytes
        out = np.empty(len(keys) * n, dtype=np.uint8)  # the sender keeps it until sent: never reused
        row = self._row.view(np.uint8)[:n]
        for i, key in enumerate(keys):
            np.bitwise_xor(self._words, np.uint64(int(key[:16], 16)), out=self._row)
            out[i * n : (i + 1) * n] = row
        return out.data


class PageSource(Protocol):
    """Real KV pages: `page_nbytes` per page, `export` a request's pages [first, end) as one buffer."""

    page_nbytes: int

    def export(self, seq: Seq, first: int, end: int) -> memoryview: ...


@dataclass(frozen=True, slots=True)
class CheckpointStats:
    """Bytes in modelled units (what the full-size KV would take)."""

    budget_bytes: int
    bytes_used: int
    tokens_held: int
    pages_evicted: int
    bytes_sent: int  # to all holders, by this worker's senders so far
    streaming: int  # requests whose pages this worker is streaming
    restores: int  # requests admitted with a restored prefix
    restored_tokens: int


@dataclass(slots=True, eq=False)
class _Stream:
    seq: Seq
    holders: list[str]
    sent: int = 0  # pages handed to the sender
    last_key: str | None = None  # key of page `sent - 1`: the next page's prior
    # holders it was handed to; a new holder set re-sends everything to the ones not in here
    reached: set[str] = field(default_factory=set)


class Checkpointer:
    def __init__(
        self,
        spec: EngineSpec,
        worker_id: str,
        model: ModelSpec,
        *,
        auth: Security,
        pages: PageSource | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.auth = auth
        self.host = spec.host
        self.page_size = spec.page_size
        self._source = pages
        if pages is not None:
            self.page_nbytes = pages.page_nbytes
            modelled_page = pages.page_nbytes  # real KV: modelled bytes are real bytes
        else:
            self.page_nbytes = model_page_nbytes(model, spec.page_size, spec.ckpt_payload_scale)
            modelled_page = spec.page_size * model.kv_bytes_per_token
        # synthetic page bytes, only where no real KV is sent
        self._page_bytes = PageBytes(self.page_nbytes) if pages is None else None
        # real bytes -> modelled bytes, exact for pages of this model
        self._modelled = modelled_page / self.page_nbytes
        self.budget_bytes = spec.ckpt_budget_bytes
        self.store: CheckpointStore | None = None
        if spec.ckpt_budget_bytes > 0:
            # whole pages first, so a budget of n modelled pages holds n real ones despite rounding
            whole, rest = divmod(spec.ckpt_budget_bytes, modelled_page)
            real = whole * self.page_nbytes + int(rest / self._modelled)
            self.store = CheckpointStore(real, spec.ckpt_eviction, spec.ckpt_orphan_ttl_s)
        # frame and lag bounds are about this process's queues and sockets: real bytes
        self._frame_bytes = spec.ckpt_frame_bytes
        self._max_lag_bytes = spec.ckpt_max_lag_bytes
        self.endpoint = ""
        self._ctx: zmq.asyncio.Context | None = None
        self.server: StoreServer | None = None  # the store's PULL side, while started
        self.sender: CheckpointSender | None = None
        self._streams: dict[str, _Stream] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._expire_task: asyncio.Task[None] | None = None
        self._retired_sent = 0  # real bytes sent by senders of earlier incarnations
        self.restores = self.restored_tokens = 0

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self, incarnation: int) -> None:
        if self._ctx is not None:
            raise RuntimeError("checkpointer already started")
        self._ctx = zmq.asyncio.Context()
        self.sender = self._new_sender(incarnation)
        if self.store is not None:
            self.server = StoreServer(self.store, store_bind(self.host), auth=self.auth, ctx=self._ctx)
            self.endpoint = await self.server.start()
            period = min(self.store.orphan_ttl_s / 4, EXPIRE_PERIOD_MAX_S)
            self._expire_task = asyncio.create_task(
                self._expire(period), name=f"ckpt-expire-{self.worker_id}"
            )

    def _new_sender(self, incarnation: int) -> CheckpointSender:
        return CheckpointSender(
            self.worker_id,
            incarnation,
            auth=self.auth,
            ctx=self._ctx,
            frame_bytes=self._frame_bytes,
            max_lag_bytes=self._max_lag_bytes,
        )

    def reset(self, incarnation: int) -> None:
        """A new incarnation: the old sender flushes what it queued and closes; the store keeps its
        pages (they belong to other workers' requests)."""
        self._streams.clear()
        old = self.sender
        if old is None:
            return
        self._retired_sent += _sent(old)
        self.sender = self._new_sender(incarnation)
        task = asyncio.create_task(old.close(drain_timeout_s=SENDER_DRAIN_S), name="ckpt-sender-close")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        self._streams.clear()
        if self._expire_task is not None:
            self._expire_task.cancel()
            await asyncio.gather(self._expire_task, return_exceptions=True)
            self._expire_task = None
        if self.sender is not None:
            self._retired_sent += _sent(self.sender)
            await self.sender.close(drain_timeout_s=SENDER_DRAIN_S)
            self.sender = None
        await asyncio.gather(*self._closing)
        if self.server is not None:
            await self.server.close()
            self.server = None
        if self._ctx is not None:
            # every socket is closed; term waits at most for the senders' linger (SENDER_DRAIN_S)
            self._ctx.term()
            self._ctx = None

    async def _expire(self, period_s: float) -> None:
        store = self.store
        if store is None:
            return
        while True:
            await asyncio.sleep(period_s)
            expired = store.expire_orphans()
            if expired:
                log.info("checkpoint orphans expired", worker_id=self.worker_id, rids=expired)

    # -- restore --------------------------------------------------------------------------------
    def restorable(self, input_ids: list[int]) -> int:
        """Tokens of `input_ids` the local store can restore: full pages, never the last token
        (its logits are needed, so it is always recomputed)."""
        return self._held_prefix(input_ids)[0]

    def restore(self, input_ids: list[int]) -> tuple[int, bytes | None]:
        """`restorable` with the pages' bytes, copied out of the store (an eviction after this
        cannot take them); (0, None) when nothing is restorable."""
        tokens, pages = self._held_prefix(input_ids)
        return (tokens, b"".join(pages)) if tokens else (0, None)

    def _held_prefix(self, input_ids: list[int]) -> tuple[int, list[memoryview]]:
        ps = self.page_size
        limit = (len(input_ids) - 1) // ps * ps
        if self.store is None or limit <= 0 or not self.store.bytes_used:
            return 0, []
        return self.store.longest_prefix(input_ids[:limit], ps)

    # -- streaming (serving side) -----------------------------------------------------------------
    def admitted(self, seq: Seq, holders: Iterable[str]) -> None:
        """A request was accepted: count its restore, and stream its full pages (restored ones
        included: a resumed request needs a fresh checkpoint) to `holders` from the next step on."""
        if seq.restored:
            self.restores += 1
            self.restored_tokens += seq.restored
        unique = list(dict.fromkeys(holders))
        if unique:
            self._streams[seq.rid] = _Stream(seq, unique)

    def after_step(self) -> None:
        """Hand the pages completed since the last call to the sender. Called after every step."""
        sender = self.sender
        if sender is None or not self._streams:
            return
        ps = self.page_size
        failed: list[str] = []
        for st in self._streams.values():
            full = st.seq.kv_len // ps
            if full > st.sent and not self._send(sender, st, st.holders, st.sent, full):
                failed.append(st.seq.rid)
        for rid in failed:
            del self._streams[rid]

    def _send(self, sender: CheckpointSender, st: _Stream, holders: list[str], first: int, end: int) -> bool:
        ps = self.page_size
        prior = st.last_key if first == st.sent else None  # a re-send starts at page 0
        ids = st.seq.context(first * ps, end * ps)
        keys = page_keys(ids, ps, prior)
        if self._page_bytes is not None:
            payload = self._page_bytes.of(keys)
        else:
            assert self._source is not None
            payload = self._source.export(st.seq, first, end)
        try:
            sender.send_pages(st.seq.rid, holders, first, ids, payload, page_size=ps)
        except ValueError as exc:  # an endpoint zmq will not connect to
            log.warning("checkpoint streaming stopped", rid=st.seq.rid, holders=holders, error=str(exc))
            return False
        if end > st.sent:
            st.sent, st.last_key = end, keys[-1]
        st.reached.update(holders)
        return True

    def end(self, rid: str) -> None:
        """The request finished: its holders keep the pages until the gateway drops them."""
        if self._streams.pop(rid, None) is not None and self.sender is not None:
            self.sender.end(rid)

    def forget(self, rid: str, *, drop: bool) -> None:
        """The request was aborted. Keep what the holders have unless `drop` (the client gave up)."""
        if self._streams.pop(rid, None) is not None and drop and self.sender is not None:
            self.sender.drop(rid)

    def drop(self, rids: Sequence[str]) -> None:
        """DropCheckpoint: free these requests' pages here, and at their holders if we serve them."""
        for rid in rids:
            if self.store is not None:
                self.store.release(rid)
            self.forget(rid, drop=True)

    def assign(self, seq: Seq, holders: Sequence[str]) -> int:
        """A new holder set for a running request: later pages go to all of them, and every page
        sent so far is re-sent to those that never got it. Returns the pages re-sent."""
        st = self._streams.get(seq.rid)
        if st is None:
            st = self._streams[seq.rid] = _Stream(seq, [])
        st.holders = list(dict.fromkeys(holders))
        fresh = [h for h in st.holders if h not in st.reached]
        if not fresh or not st.sent or self.sender is None:
            return 0
        if not self._send(self.sender, st, fresh, 0, st.sent):
            del self._streams[seq.rid]
            return 0
        return st.sent

    def streaming(self, rid: str) -> bool:
        return rid in self._streams

    # -- reports --------------------------------------------------------------------------------
    def stats(self) -> CheckpointStats:
        used = held = evicted = 0
        if self.store is not None:
            s = self.store.stats()
            used, held, evicted = s.bytes_used, s.tokens_held, s.evicted_pages
        sent = self._retired_sent + (_sent(self.sender) if self.sender is not None else 0)
        return CheckpointStats(
            budget_bytes=self.budget_bytes if self.store is not None else 0,
            bytes_used=round(used * self._modelled),
            tokens_held=held,
            pages_evicted=evicted,
            bytes_sent=round(sent * self._modelled),
            streaming=len(self._streams),
            restores=self.restores,
            restored_tokens=self.restored_tokens,
        )

    def durable(self, *, full: bool = False) -> dict[str, int]:
        """Durable tokens per held request that changed since the last call (0: no longer held);
        with `full`, every request held (for a new control session) and nothing pending."""
        store = self.store
        if store is None:
            return {}
        deltas = store.durable_deltas()
        if not full:
            return deltas
        return {rid: store.durable_tokens(rid) for rid in store.rids()}

    def plane_refusals(self) -> dict[str, int]:
        """What the store's KV plane refused so far, by reason (gateway/protocol/planes.py)."""
        srv = self.server
        if srv is None:
            return {}
        st = srv.stats
        return {
            "handshake": srv.handshakes_failed,
            "unauthenticated": st.unauthenticated,
            "impersonated": st.impersonated,
            "stale_epoch": st.stale_epoch,
        }

    def abandoned(self) -> list[str]:
        """Requests whose checkpoint the sender gave up on since the last call (a holder lagged)."""
        if self.sender is None:
            return []
        return list(dict.fromkeys(a.rid for a in self.sender.abandoned()))


def _sent(sender: CheckpointSender) -> int:
    return sum(link.bytes for link in sender.stats().values())
