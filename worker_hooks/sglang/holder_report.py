"""The sidecar agent's view of its server's holder stores, for its heartbeats (docs/sglang.md).

The holder stores live inside the SGLang server (one per rank, `page_store.PageStore`), out of the
agent's reach; each answers a local status socket (`gateway.protocol.holder_status`). `HolderPoller`
asks every rank's socket at once, each with a timeout, and keeps each rank's last answer: a rank that
does not answer in time is reported from its last answer, so a slow or hung server never delays a
heartbeat (the heartbeat reads the last `HolderReport`, never the network).

Ranks: every TP (and PP) rank holds its own shard of each page, and a request restores only when every
rank has its pages (SGLang takes the least prefix any rank has). So the report is the *minimum* over
the ranks: a request's durable tokens are the fewest any rank holds (0 where a complete answer lacks it);
tokens held are the fewest any rank holds; bytes used are the sum (the budget reported in Hello is the
whole server's, split across the ranks). Until every rank has answered once nothing is reported.

`DurableReporter` turns successive reports into what Lumen's own workers send (worker_hooks/agent.py):
the durable tokens of each request that changed since the previous beat (0: no longer held), all of
them in a session's first beat. One per control session, so each gateway gets its own deltas.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import structlog
import zmq
import zmq.asyncio

from gateway.protocol import holder_status as hs

log = structlog.get_logger(__name__)

MAX_ANSWER_BYTES = 64 << 20  # far above the largest bounded answer


@dataclass(frozen=True, slots=True)
class HolderReport:
    """The server's holder stores, merged over ranks (see the module doc)."""

    gen: int  # bumped whenever any rank's answer changed
    bytes_used: int
    tokens_held: int
    durable: dict[str, int]  # rid -> durable tokens (> 0)
    complete: bool  # no rank left requests out: a request missing here is not held


def merge(statuses: Sequence[hs.HolderStatus], gen: int) -> HolderReport:
    if not statuses:
        return HolderReport(gen, 0, 0, {}, True)
    rids = dict.fromkeys(rid for s in statuses for rid in s.durable)
    durable: dict[str, int] = {}
    for rid in rids:
        t: int | None = None
        for s in statuses:
            tokens = s.durable.get(rid)
            if tokens is None and not s.truncated:  # a complete answer without it: not held there
                t = 0
                break
            if tokens is not None:
                t = tokens if t is None else min(t, tokens)
        if t:
            durable[rid] = t
    return HolderReport(
        gen=gen,
        bytes_used=sum(s.bytes_used for s in statuses),
        tokens_held=min(s.tokens_held for s in statuses),
        durable=durable,
        complete=not any(s.truncated for s in statuses),
    )


def peer_refusal(endpoint: str) -> str | None:
    """Why the status socket at an ipc:// `endpoint` must not be read (None: it may): the process
    listening there must run as this user (SO_PEERCRED of a connection to it), or another user's
    socket could answer with an invented status (issue 29). tcp:// endpoints are the operator's
    explicit choice and are not checked."""
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint.removeprefix("ipc://")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            s.connect(path)
            _pid, uid, _gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    except OSError as exc:
        return f"cannot check its owner: {exc.strerror or exc}"
    if uid != os.geteuid():
        return f"its listener runs as uid {uid}, not as this user (uid {os.geteuid()})"
    return None


class HolderPoller:
    """Polls the status sockets of one server's ranks (`endpoints`, rank order)."""

    def __init__(self, endpoints: Sequence[str], *, timeout_s: float) -> None:
        if not endpoints:
            raise ValueError("the poller needs at least one status endpoint")
        self.endpoints = tuple(endpoints)
        self.timeout_s = timeout_s
        self._ctx = zmq.asyncio.Context()
        self._socks: list[zmq.asyncio.Socket | None] = [None] * len(self.endpoints)
        self._last: list[hs.HolderStatus | None] = [None] * len(self.endpoints)
        self._gen = 0
        self.report: HolderReport | None = None  # the last merged report; None until every rank answered
        self.failures = 0

    async def poll(self) -> HolderReport | None:
        """Ask every rank (at most `timeout_s`); returns (and keeps) the merged report."""
        answers = await asyncio.gather(*(self._ask(i) for i in range(len(self.endpoints))))
        changed = False
        for i, answer in enumerate(answers):
            if answer is not None and answer != self._last[i]:
                self._last[i] = answer
                changed = True
        last = self._last
        if any(s is None for s in last):
            return self.report
        if changed or self.report is None:
            self._gen += 1
            self.report = merge([s for s in last if s is not None], self._gen)
        return self.report

    def forget(self) -> None:
        """The server is gone: its stores with it (a relaunched server's start empty)."""
        self._last = [None] * len(self.endpoints)
        self.report = None
        for i in range(len(self._socks)):
            self._drop(i)

    def close(self) -> None:
        for i in range(len(self._socks)):
            self._drop(i)
        self._ctx.term()

    async def _ask(self, i: int) -> hs.HolderStatus | None:
        sock = self._socks[i]
        if sock is None:
            refused = peer_refusal(self.endpoints[i])
            if refused is not None:
                self.failures += 1
                log.warning("holder_status_peer_refused", endpoint=self.endpoints[i][:200], reason=refused)
                return None
            sock = self._socks[i] = self._ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_ANSWER_BYTES)
            sock.connect(self.endpoints[i])
        try:
            async with asyncio.timeout(self.timeout_s):
                await sock.send(hs.encode(hs.HolderStatusRequest()))
                data = await sock.recv()
            return hs.decode_status(data)
        except (TimeoutError, zmq.ZMQError, ValueError) as exc:
            # a REQ socket without its answer cannot ask again: a fresh one next time
            self._drop(i)
            self.failures += 1
            log.debug("holder status poll failed", endpoint=self.endpoints[i], error=repr(exc))
            return None

    def _drop(self, i: int) -> None:
        sock = self._socks[i]
        self._socks[i] = None
        if sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                sock.close(0)


class DurableReporter:
    """One control session's durable-token reports (deltas; everything in its first beat)."""

    MAX_TOLD = 4 * hs.MAX_STATUS_REQUESTS

    def __init__(self) -> None:
        self._told: dict[str, int] = {}
        self._gen = -1

    def beat(self, report: HolderReport | None, *, full: bool) -> dict[str, int]:
        if full:
            self._told = dict(report.durable) if report is not None else {}
            self._gen = report.gen if report is not None else -1
            return dict(self._told)
        if report is None or report.gen == self._gen:
            return {}
        self._gen = report.gen
        told = self._told
        out = {rid: t for rid, t in report.durable.items() if told.get(rid) != t}
        if report.complete:
            out.update((rid, 0) for rid in told if rid not in report.durable)
        for rid, t in out.items():
            if t:
                told.pop(rid, None)
                told[rid] = t  # re-inserted last: the oldest is forgotten first
            else:
                told.pop(rid, None)
        while len(told) > self.MAX_TOLD:
            del told[next(iter(told))]
        return out
