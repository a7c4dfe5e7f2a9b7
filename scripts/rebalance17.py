"""Issue 17 experiment, not a simulator feature: move queued requests between survivors while recovering.

    .venv/bin/python scripts/rebalance17.py --shapes code,code-lull,conv --seeds 1,2,3,4,5,6,7,8

A lever the code-like timelines suggested and that was measured, then not kept (docs/results.md,
"Queue rebalancing while recovering"). While a recovery lasts in Lumen's modes, once per sampling
tick, the serving worker with the least queued prefill (tokens of the requests it has not begun to
prefill) takes, one at a time, the newest queued first-attempt request of the one with the most,
while that narrows the gap. Variants:

- `all`: requests admitted but not yet begun (their KV reservation given back) and waiting ones;
- `waiting`: waiting ones only (what a gateway that holds an SGLang server's batch could move: those
  requests were never sent);
- `idle`: waiting ones, and only to a worker with nothing queued.

This script patches the simulator's coordinator for its own process (`Coordinator.repair`); nothing
in the simulator or the gateway changes. Rows: `impact TTFT / recovery s / damage request-s` per mode.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from levers17 import scenario_for

from gateway.core.health import WorkerState
from gateway.sim.coordinator import Coordinator
from gateway.sim.request import SimRequest
from gateway.sim.runner import run_scenario
from gateway.sim.worker import SimWorker

VARIANTS = {
    "all": (False, False),
    "waiting": (True, False),
    "idle": (True, True),
}  # (waiting only, idle thief)
KEYS = ("impact_ttft_mean_s", "recovery_time_s", "excess_ttft_request_s")
_active: tuple[bool, bool] | None = None  # the variant in force (None: the simulator as it is)


def _prefill(r: SimRequest) -> int:
    return max(1, r.prompt + r.emitted - r.restored)


def queued_prefill(w: SimWorker) -> int:
    """Tokens of prefill `w` has not begun: its prefill queue's remainders and its waiting requests."""
    return sum(r.prefill_left for r in w.prefill_q) + sum(_prefill(r) for r in w.waiting)


def movable(w: SimWorker, waiting_only: bool) -> list[tuple[str, SimRequest]]:
    """First attempts with nothing restored, newest first: waiting, then admitted but not begun."""
    out = [("waiting", r) for r in reversed(w.waiting) if r.restored == 0]
    if not waiting_only:
        in_step = {id(r) for r, _ in w.chunks}
        out += [
            ("admitted", r)
            for r in reversed(w.prefill_q)
            if id(r) not in in_step and r.restored == 0 and r.kv_ctx == 0
        ]
    return out


def rebalance(coord: Coordinator, now: float, waiting_only: bool, idle_only: bool) -> int:
    serving = [w for w in coord.workers if w.alive and w.state is WorkerState.HEALTHY]
    moved = 0
    while len(serving) > 1:
        load = {w.id: queued_prefill(w) for w in serving}
        thief = min(serving, key=lambda w: (load[w.id], w.id))
        victim = max(serving, key=lambda w: (load[w.id], w.id))
        if idle_only and (thief.waiting or thief.prefill_q):
            break
        pick = next(
            (
                (where, r)
                for where, r in movable(victim, waiting_only)
                if load[thief.id] + _prefill(r) < load[victim.id] and thief not in r.holders
            ),
            None,
        )
        if pick is None:
            break
        where, r = pick
        if where == "waiting":
            victim.waiting.remove(r)
        else:
            victim.prefill_q.remove(r)
            victim.kv_used -= r.kv_reserved
            r.kv_reserved = 0
            victim.running -= 1
        victim.mark_dirty()
        r.worker = thief
        thief.enqueue(r, now, coord.outage.rank(r))
        moved += 1
    return moved


_repair = Coordinator.repair


def _patched_repair(self: Coordinator, now: float) -> None:
    _repair(self, now)
    if _active is not None and self.outage.recovering and self.outage.shaping:
        rebalance(self, now, *_active)


def main() -> int:
    global _active
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="code,code-lull")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--variants", default="all,waiting,idle")
    p.add_argument("--duration", type=float, default=600.0)
    args = p.parse_args()
    Coordinator.repair = _patched_repair  # type: ignore[method-assign]
    variants = args.variants.split(",")
    damage: dict[tuple[str, str], list[float]] = {}
    for shape in args.shapes.split(","):
        for seed in (int(x) for x in args.seeds.split(",")):
            s = scenario_for(shape, seed, args.duration)
            row: dict[str, Any] = {}
            _active = None
            rep = run_scenario(s, ["stop_restart", "fixed_checkpoint", "lumen"], seed)
            for mode, v in rep.modes.items():
                row[mode] = [v.get(k) for k in KEYS]
            for name in variants:
                _active = VARIANTS[name]
                row[f"lumen+{name}"] = [run_scenario(s, ["lumen"], seed).modes["lumen"].get(k) for k in KEYS]
            _active = None
            for name, v in row.items():
                if v[2] is not None:
                    damage.setdefault((shape, name), []).append(v[2])
            cells = " ".join(
                f"{m}={'/'.join('-' if x is None else f'{x:.2f}' for x in v)}" for m, v in row.items()
            )
            print(f"{shape} s{seed} {cells}", flush=True)
    print("\ndamage, sum over seeds, relative to lumen:")
    for shape in args.shapes.split(","):
        ref = sum(damage.get((shape, "lumen"), [])) or float("nan")
        parts = [f"{name}={sum(v) / ref:.3f}" for (sh, name), v in damage.items() if sh == shape]
        print(f"  {shape}: " + " ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
