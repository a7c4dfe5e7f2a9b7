"""Fault schedules for live load tests: which fault strikes which worker when; parsed, validated, fired.

    --fault kill:w0@15                kill -9 worker w0 15 s into the load
    --fault hang:busiest@10+3         SIGSTOP the worker running most requests, SIGCONT it 3 s later
    --fault stall:random@8+2          freeze a random HEALTHY worker's engine loop (heartbeats go on)
    --fault slow:w1@5x4               every engine step of w1 takes 4x its time from 5 s on
    --fault slow:top-holder@5:factor=4:duration=10
                                      the worker holding most checkpoint tokens, normal again at 15 s
    --fault kill-gateway:0@12         kill -9 gateway 0 of a cluster up with --gateways N; clients
                                      resume their streams on another gateway (Last-Event-ID)

Grammar: `KIND:TARGET@SECONDS[xFACTOR][+DURATION][:factor=F][:duration=D]`. KIND is kill, hang, stall,
slow or kill-gateway (TARGET: a gateway's index; its supervisor restarts it); only hang, stall and slow can be undone after DURATION (resume, unstall, normal speed): a
killed worker is restarted by the supervisor. FACTOR is slow's step-time multiplier (default
`DEFAULT_SLOWDOWN`, the simulator's). TARGET is a worker id or a selector resolved when the fault
fires, from one `GET /admin/workers` snapshot per instant:
- `random`: a HEALTHY worker drawn by a generator seeded with the run's seed, so every mode sees the
  same draws from the same healthy set;
- `busiest`: the HEALTHY worker running most requests (then most waiting);
- `top-holder`: the HEALTHY worker holding most checkpoint tokens (`ckpt_tokens`; in modes without
  checkpoints every count is 0 and the busiest breaks the tie).
Events at the same second strike together. Within such a group explicit ids are taken first, then
busiest and top-holder, then random, and no selector picks a worker the group already hit: "kill
top-holder and random at 12" kills two different workers, the top holder and another one.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import re
import signal
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import structlog

from gateway.protocol.faults import SLOWDOWN_RANGE
from gateway.protocol.secrets import admin_headers

log = structlog.get_logger("lumen.faults")

FaultKind = Literal["kill", "hang", "stall", "slow", "kill-gateway"]
KINDS: tuple[FaultKind, ...] = ("kill", "hang", "stall", "slow", "kill-gateway")
GATEWAY_KINDS = ("kill-gateway",)  # their target is a gateway's index, not a worker
# the admin mode that undoes each kind after its duration (kill has none)
UNDO: Mapping[str, str] = {"hang": "resume", "stall": "unstall", "slow": "normal"}
SELECTORS = ("random", "busiest", "top-holder")
NET_KINDS = ("partition", "loss", "bw", "delay")  # loadtests/chaos/netspec.py parses and fires them
DEFAULT_SLOWDOWN = 5.0  # as the simulator's `slow` failure (gateway.sim.scenario.FailureSpec)
GRAMMAR = "KIND:TARGET@SECONDS[xFACTOR][+DURATION][:factor=F][:duration=D]"

_NUM = r"((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)"
_WHEN = re.compile(rf"{_NUM}(?:x{_NUM})?(?:\+{_NUM})?")
_WORKER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
# selectors are resolved in this order within one instant; explicit ids (rank 0) come first
_RANK = {"busiest": 1, "top-holder": 1, "random": 2}


class FaultSpecError(ValueError):
    """A fault spec that cannot be used; the message quotes the spec and says why."""


@dataclass(frozen=True, slots=True)
class FaultEvent:
    kind: FaultKind
    target: str  # a worker id or one of SELECTORS
    at: float  # seconds after the load starts
    factor: float | None = None  # slow only
    duration: float | None = None  # hang, stall, slow: undone this long after `at`
    spec: str = field(default="", compare=False)  # the text it was parsed from, for messages

    @property
    def undo_mode(self) -> str | None:
        return UNDO[self.kind] if self.duration is not None else None

    def __str__(self) -> str:
        """The canonical spec: parses back to an equal event."""
        s = f"{self.kind}:{self.target}@{_num(self.at)}"
        if self.factor is not None:
            s += f"x{_num(self.factor)}"
        if self.duration is not None:
            s += f"+{_num(self.duration)}"
        return s


def _num(x: float) -> str:
    """Shortest text that parses back to exactly `x` (repr), without a trailing `.0`."""
    return repr(x).removesuffix(".0")


def parse_fault(spec: str) -> FaultEvent:
    """One `--fault` value; raises FaultSpecError naming the spec and what is wrong with it."""

    def bad(why: str) -> FaultSpecError:
        return FaultSpecError(f"fault spec {spec!r}: {why} (expected {GRAMMAR})")

    parts = spec.strip().split(":")
    if len(parts) < 2:
        raise bad("no ':' between KIND and TARGET")
    kind, where, options = parts[0], parts[1], parts[2:]
    if kind in NET_KINDS:
        raise bad(f"{kind} is a network fault: `lumen chaos` runs those (its hosts are network namespaces)")
    if kind not in KINDS:
        raise bad(f"unknown kind {kind!r}; one of {', '.join(KINDS)}")
    target, at_sign, when = where.partition("@")
    if not at_sign:
        raise bad("no @SECONDS after the target")
    if kind in GATEWAY_KINDS:
        if not target.isdigit():
            raise bad(f"{kind} takes a gateway's index (0, 1, ...), not {target!r}")
    elif target not in SELECTORS and not _WORKER_ID.fullmatch(target):
        raise bad(f"target {target!r} is neither a worker id nor one of {', '.join(SELECTORS)}")
    m = _WHEN.fullmatch(when)
    if m is None:
        raise bad(f"{when!r} is not SECONDS[xFACTOR][+DURATION] with non-negative decimal numbers")
    at = float(m[1])
    factor = float(m[2]) if m[2] is not None else None
    duration = float(m[3]) if m[3] is not None else None
    for opt in options:
        key, eq, value = opt.partition("=")
        if not eq or key not in ("factor", "duration"):
            raise bad(f"option {opt!r} is not factor=F or duration=D")
        try:
            number = float(value)
        except ValueError:
            raise bad(f"{key} {value!r} is not a number") from None
        if key == "factor":
            if factor is not None:
                raise bad("the factor is given twice")
            factor = number
        else:
            if duration is not None:
                raise bad("the duration is given twice")
            duration = number
    if factor is not None and kind != "slow":
        raise bad(f"only slow takes a factor, not {kind}")
    if kind == "slow" and factor is None:
        factor = DEFAULT_SLOWDOWN
    lo, hi = SLOWDOWN_RANGE
    if factor is not None and not lo <= factor <= hi:
        raise bad(f"slowdown factor {factor:g} is outside [{lo:g}, {hi:g}]")
    if duration is not None:
        if kind not in UNDO:
            raise bad(f"{kind} cannot be undone after a duration (the supervisor restarts a killed worker)")
        if not (math.isfinite(duration) and duration > 0):
            raise bad(f"duration {duration:g} must be a positive number of seconds")
    if not math.isfinite(at):
        raise bad(f"time {at:g} is not finite")
    return FaultEvent(kind, target, at, factor, duration, spec=spec)


@dataclass(frozen=True, slots=True)
class FaultSchedule:
    """Fault events in firing order (by time; specs at the same time keep their order)."""

    events: tuple[FaultEvent, ...] = ()

    @classmethod
    def parse(
        cls, specs: Iterable[str], *, victims: Sequence[str] = (), kill_at: float | None = None
    ) -> FaultSchedule:
        """`--fault` specs plus the `--victims`/`--kill-at` shorthand (kill -9 of each victim)."""
        events = [parse_fault(s) for s in specs]
        if victims:
            if kill_at is None:
                raise FaultSpecError(f"victims {','.join(victims)} given without a kill time")
            events += [parse_fault(f"kill:{v}@{_num(kill_at)}") for v in victims]
        return cls.of(events)

    @classmethod
    def of(cls, events: Iterable[FaultEvent]) -> FaultSchedule:
        ordered = tuple(sorted(events, key=lambda e: e.at))
        seen: dict[tuple[float, str], FaultEvent] = {}
        for e in ordered:
            if e.target in SELECTORS or e.kind in GATEWAY_KINDS:
                continue
            other = seen.setdefault((e.at, e.target), e)
            if other is not e:
                raise FaultSpecError(
                    f"fault specs {other.spec or str(other)!r} and {e.spec or str(e)!r} both strike "
                    f"{e.target} at {e.at:g} s; give one of them another time"
                )
        return cls(ordered)

    def __bool__(self) -> bool:
        return bool(self.events)

    @property
    def first_at(self) -> float | None:
        return self.events[0].at if self.events else None

    def groups(self) -> list[tuple[float, tuple[FaultEvent, ...]]]:
        """Events that strike at the same instant, in time order."""
        out: list[tuple[float, tuple[FaultEvent, ...]]] = []
        for e in self.events:
            if out and out[-1][0] == e.at:
                out[-1] = (e.at, (*out[-1][1], e))
            else:
                out.append((e.at, (e,)))
        return out

    def check_workers(self, worker_ids: Collection[str]) -> None:
        """Every explicit target must be a worker of the cluster the schedule runs against."""
        for e in self.events:
            if e.kind in GATEWAY_KINDS:
                continue
            if e.target not in SELECTORS and e.target not in worker_ids:
                raise FaultSpecError(
                    f"fault spec {e.spec or str(e)!r}: no worker {e.target!r} in this cluster "
                    f"({', '.join(sorted(worker_ids))})"
                )


def resolve_group(
    events: Sequence[FaultEvent], workers: Sequence[Mapping[str, Any]], rng: random.Random
) -> list[str | None]:
    """The worker each event of one instant strikes, from one `/admin/workers` snapshot (None: no
    HEALTHY worker left for a selector). Explicit ids first, then busiest/top-holder, then random;
    a selector never picks a worker this instant already strikes. `rng` is drawn only by `random`."""
    by_id = sorted(workers, key=lambda w: str(w["id"]))
    taken = {e.target for e in events if e.target not in SELECTORS and e.kind not in GATEWAY_KINDS}
    out: list[str | None] = [None] * len(events)
    for i in sorted(range(len(events)), key=lambda i: _RANK.get(events[i].target, 0)):
        target = events[i].target
        if target not in SELECTORS or events[i].kind in GATEWAY_KINDS:
            out[i] = target
            continue
        free = [w for w in by_id if w.get("state") == "HEALTHY" and w["id"] not in taken]
        if not free:
            continue
        if target == "random":
            chosen = rng.choice(free)
        elif target == "busiest":
            chosen = max(free, key=lambda w: (w.get("running", 0), w.get("waiting", 0)))
        else:  # top-holder; the first maximum in id order breaks remaining ties
            chosen = max(
                free, key=lambda w: (w.get("ckpt_tokens", 0), w.get("running", 0), w.get("waiting", 0))
            )
        wid = str(chosen["id"])
        out[i] = wid
        taken.add(wid)
    return out


SNAPSHOT_FIELDS = ("state", "running", "waiting", "ckpt_tokens")


class FaultRunner:
    """Fires a schedule against a gateway's admin API during a load that started at monotonic `t0`.

    `fired` records every injection and undo: `t` (s after t0 when it was sent), `spec`, `kind`,
    `mode`, `target`, the resolved `worker`, `factor`, `undo_of`, `ok`/`status`/`error`, the gateway's
    `at` (the /admin/events clock), and the `/admin/workers` snapshot the target was resolved from.
    A failed injection is recorded and logged, never raised: the load goes on.
    """

    def __init__(
        self,
        http: aiohttp.ClientSession,
        url: str,
        schedule: FaultSchedule,
        *,
        seed: int,
        t0: float,
        headers: Mapping[str, str] | None = None,
        gateway_urls: Sequence[str] = (),
    ) -> None:
        """`gateway_urls`: every gateway of the cluster (kill-gateway targets index them; snapshots
        come from the first that answers)."""
        self.http = http
        self.url = url
        self.gateway_urls = list(gateway_urls) or [url]
        self.schedule = schedule
        self.rng = random.Random(seed)
        self.t0 = t0
        # the admin key: given, else the one the gateway at `url` generated (runtime directory)
        self.headers = dict(headers) if headers is not None else admin_headers(url)
        self.fired: list[dict[str, Any]] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def run(self) -> None:
        """Fire every group at its time, then wait for the undos; cancel to stop early."""
        undos: list[asyncio.Task[None]] = []
        try:
            for at, group in self.schedule.groups():
                await asyncio.sleep(max(0.0, at - self.now()))
                try:
                    workers = await self._workers()
                except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                    for e in group:
                        await self._fire(e, e.kind, None, None, error=f"GET /admin/workers failed: {exc!r}")
                    continue
                snapshot = {str(w["id"]): {k: w.get(k) for k in SNAPSHOT_FIELDS} for w in workers}
                targets = resolve_group(group, workers, self.rng)
                records = await asyncio.gather(
                    *(self._fire(e, e.kind, w, snapshot) for e, w in zip(group, targets, strict=True))
                )
                for e, rec in zip(group, records, strict=True):
                    if e.duration is not None and rec["ok"]:
                        undos.append(asyncio.create_task(self._undo(e, rec["worker"])))
            await asyncio.gather(*undos)
        finally:
            for task in undos:
                task.cancel()
            await asyncio.gather(*undos, return_exceptions=True)

    async def _workers(self) -> list[dict[str, Any]]:
        """/admin/workers from the first gateway that answers (one may have been killed)."""
        error: Exception | None = None
        for url in dict.fromkeys([self.url, *self.gateway_urls]):
            try:
                async with self.http.get(f"{url}/admin/workers", headers=self.headers) as resp:
                    resp.raise_for_status()
                    return list(await resp.json())
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                error = exc
        assert error is not None
        raise error

    async def _kill_gateway(self, index: int) -> dict[str, Any]:
        """kill -9 the gateway process at `gateway_urls[index]` (its pid from /admin/gateway)."""
        url = self.gateway_urls[index]
        async with self.http.get(f"{url}/admin/gateway", headers=self.headers) as resp:
            resp.raise_for_status()
            info = await resp.json()
        os.kill(int(info["pid"]), signal.SIGKILL)
        return {"at": info.get("now")}

    async def _undo(self, e: FaultEvent, worker: str) -> None:
        assert e.duration is not None and e.undo_mode is not None
        await asyncio.sleep(max(0.0, e.at + e.duration - self.now()))
        await self._fire(e, e.undo_mode, worker, None, undo=True)

    async def _fire(
        self,
        e: FaultEvent,
        mode: str,
        worker: str | None,
        snapshot: dict[str, Any] | None,
        *,
        undo: bool = False,
        error: str = "no HEALTHY worker left to strike",
    ) -> dict[str, Any]:
        factor = e.factor if mode == "slow" else None
        rec: dict[str, Any] = {
            "t": round(self.now(), 4),
            "spec": e.spec or str(e),
            "kind": e.kind,
            "mode": mode,
            "target": e.target,
            "worker": worker,
            "factor": factor,
            "undo_of": str(e) if undo else None,
            "ok": False,
            "status": None,
            "error": None,
            "at": None,
            "snapshot": snapshot,
        }
        self.fired.append(rec)
        if worker is None:
            rec["error"] = error
        elif e.kind in GATEWAY_KINDS:
            try:
                index = int(worker)
                if index >= len(self.gateway_urls):
                    raise ValueError(f"no gateway {index}: the cluster has {len(self.gateway_urls)}")
                rec["at"] = (await self._kill_gateway(index))["at"]
                rec["ok"] = True
            except (aiohttp.ClientError, TimeoutError, ValueError, OSError) as exc:
                rec["error"] = f"{type(exc).__name__}: {exc}"
        else:
            query = f"mode={mode}" + (f"&factor={factor!r}" if factor is not None else "")
            try:
                async with self.http.post(
                    f"{self.url}/admin/workers/{worker}/kill?{query}", headers=self.headers
                ) as resp:
                    rec["status"] = resp.status
                    body = await resp.json(content_type=None)
                rec["ok"] = resp.status == 200
                if rec["ok"]:
                    rec["at"] = body.get("at")
                else:
                    rec["error"] = str(body.get("error", body))[:300]
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                rec["error"] = f"{type(exc).__name__}: {exc}"
        if rec["ok"]:
            log.info("fault_fired", t=rec["t"], mode=rec["mode"], worker=worker, spec=rec["spec"])
        else:
            log.warning("fault_not_fired", t=rec["t"], spec=rec["spec"], worker=worker, error=rec["error"])
        return rec
