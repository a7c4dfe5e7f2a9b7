"""What the gateways say during a chaos run: /admin/workers samples, state events, interruptions.

Every gateway is asked on its own (one may be partitioned away or restarting: that round is simply
missing for it). Times are put on the driver's clock (seconds after its t0): a gateway's /admin clock
counts from its own start, and `/admin/gateway` gives its `now`, so each answer carries the offset.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

WORKER_FIELDS = ("id", "state", "incarnation", "running", "ckpt_bytes", "ckpt_budget_bytes", "ckpt_tokens")
_TIMEOUT = aiohttp.ClientTimeout(total=2.0)


class Observer:
    def __init__(self, http: aiohttp.ClientSession, urls: Sequence[str], admin_key: str, t0: float) -> None:
        self.http = http
        self.urls = list(urls)
        self.headers = {"Authorization": f"Bearer {admin_key}"}
        self.t0 = t0
        self.samples: list[dict[str, Any]] = []
        self.events: dict[tuple[Any, ...], dict[str, Any]] = {}  # deduplicated across polls
        self.interruptions: dict[tuple[Any, ...], dict[str, Any]] = {}

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def _get(self, g: int, path: str) -> Any:
        async with self.http.get(self.urls[g] + path, headers=self.headers, timeout=_TIMEOUT) as resp:
            resp.raise_for_status()
            return await resp.json()

    async def _clock(self, g: int) -> tuple[int, float]:
        """(pid, offset): a gateway time x is x + offset on the driver's clock."""
        sent = self.now()
        info = await self._get(g, "/admin/gateway")
        back = self.now()
        return int(info["pid"]), (sent + back) / 2 - float(info["now"])

    async def sample(self, g: int, *, with_events: bool) -> bool:
        try:
            pid, offset = await self._clock(g)
            workers = await self._get(g, "/admin/workers")
            t = self.now()
            self.samples.append(
                {
                    "t": round(t, 4),
                    "gateway": g,
                    "pid": pid,
                    "workers": [{k: w.get(k) for k in WORKER_FIELDS} for w in workers],
                }
            )
            if with_events:
                for e in await self._get(g, "/admin/events"):
                    t_abs = round(float(e["t"]) + offset, 4)
                    key = (g, pid, e["worker"], e["incarnation"], e["from"], e["to"], e["t"])
                    self.events.setdefault(key, {**e, "t": t_abs, "gateway": g, "pid": pid})
                sessions = await self._get(g, "/admin/sessions")
                for it in sessions.get("interrupted", []):
                    ikey = (g, pid, it["rid"], it["worker"], it["t"])
                    self.interruptions.setdefault(
                        ikey, {**it, "t": round(float(it["t"]) + offset, 4), "gateway": g}
                    )
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
            return False
        return True

    async def run(self, period_s: float, stop: asyncio.Event) -> None:
        """Sample every gateway each period (events every 4th round) until `stop`."""
        n = 0
        while not stop.is_set():
            await asyncio.gather(*(self.sample(g, with_events=n % 4 == 0) for g in range(len(self.urls))))
            n += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), period_s)

    async def drained(self, timeout_s: float) -> bool:
        """Wait until every gateway that answers sees every worker's checkpoint store empty."""
        deadline = self.now() + timeout_s
        while self.now() < deadline:
            before = len(self.samples)
            await asyncio.gather(*(self.sample(g, with_events=True) for g in range(len(self.urls))))
            fresh = self.samples[before:]
            if fresh and all(w["ckpt_bytes"] == 0 for s in fresh for w in s["workers"]):
                return True
            await asyncio.sleep(0.25)
        return False

    async def resume_all(self, workers: Sequence[str]) -> None:
        """SIGCONT every worker through the first gateway that takes it (harmless on a running one)."""
        for w in workers:
            for url in self.urls:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with self.http.post(
                        f"{url}/admin/workers/{w}/kill?mode=resume", headers=self.headers, timeout=_TIMEOUT
                    ) as resp:
                        if resp.status == 200:
                            break

    async def checkpoint_outcomes(self) -> list[dict[str, float] | None]:
        """Per gateway, `lumen_checkpoint_assignments_total` by outcome from /metrics (None: no answer)."""
        out: list[dict[str, float] | None] = []
        for url in self.urls:
            try:
                async with self.http.get(url + "/metrics", headers=self.headers, timeout=_TIMEOUT) as resp:
                    resp.raise_for_status()
                    text = await resp.text()
            except (aiohttp.ClientError, TimeoutError):
                out.append(None)
                continue
            counts: dict[str, float] = {}
            for line in text.splitlines():
                if line.startswith('lumen_checkpoint_assignments_total{outcome="'):
                    name, _, value = line.partition("} ")
                    counts[name.split('"')[1]] = float(value)
            out.append(counts)
        return out

    def dump(self) -> dict[str, Any]:
        return {
            "samples": self.samples,
            "state_events": sorted(self.events.values(), key=lambda e: e["t"]),
            "interruptions": sorted(self.interruptions.values(), key=lambda e: e["t"]),
        }
