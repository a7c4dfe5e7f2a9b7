"""Failure-detection benchmark on a real local cluster (issue 15, item 4).

Brings up `lumen cluster up` (the gateway and 3 synthetic worker processes on loopback, default
[health] settings) and measures, from outside, what the failure detector does:

  kill   kill -9 of a worker's process, N trials: time from the signal to the FAILED event
         (the broken control stream); the worker is restarted by the supervisor between trials;
  stop   SIGSTOP, N trials: time to FAILED (silence, then a probe of its HTTP server that goes
         unanswered); then SIGCONT, and the worker resets and re-attaches before the next trial;
  false  D minutes with no fault at all: every FAILED event is a false one; SUSPECT transitions are
         counted too (flaps). Idle, or with a streaming load from a separate driver process.

Each runs quiet or beside `--burners` CPU-burning processes (`python -c 'while True: pass'`, started
here and ended by pid). Signals are sent by this script (os.kill on the worker's pid, which the
gateway reports); the FAILED time is the gateway's event time on the same CLOCK_MONOTONIC
(`started_at_monotonic` of the cluster's ready line + the event's `t`).

Results accumulate in a JSON file (one entry per measurement, replaced when measured again), and the
table and the plot are made from all of it:

    .venv/bin/python scripts/detect_bench.py --trials 30 --minutes 1           # everything, short
    .venv/bin/python scripts/detect_bench.py --only false:load+burn --minutes 10  # one long condition
    .venv/bin/python scripts/detect_bench.py --report                          # table + plot only

Progress goes to stdout as it runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from gateway.protocol.secrets import admin_headers  # noqa: E402
from loadtests.cluster_proc import ClusterProcess  # noqa: E402

DEFAULT_JSON = ROOT / "docs" / "img" / "detect_bench.json"
DEFAULT_PNG = ROOT / "docs" / "img" / "detect_bench.png"
# a restart loads in about a second, so trials follow each other quickly; everything else (heartbeat
# interval, detector, probe) is the default configuration under test
CLUSTER_OVERRIDES: dict[str, Any] = {
    "engine.model_load_s": 1.0,
    "engine.draft_load_s": 0.5,
    "gateway.log_level": "info",
}
TRIAL_KINDS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}
CONDITIONS = ("idle", "idle+burn", "load", "load+burn")
TARGETS = {"kill": 0.020, "stop": 0.300}  # p99 targets (s); stop's on a quiet host


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- the load driver (a separate process) -------------------------------------------------------


async def drive(url: str, concurrency: int, stop_after_s: float) -> dict[str, Any]:
    """`concurrency` loops of streaming completions (16-400 prompt tokens, 60-160 out) until the
    time is up; returns counts."""
    rnd = random.Random(1)
    stats = {"ok": 0, "errors": 0, "tokens": 0}
    deadline = time.monotonic() + stop_after_s
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        async def loop() -> None:
            while time.monotonic() < deadline:
                body = {
                    "model": "lumen-synthetic",
                    "prompt": [rnd.randrange(32, 127) for _ in range(rnd.randrange(16, 400))],
                    "max_tokens": rnd.randrange(60, 160),
                    "temperature": 0.0,
                    "stream": True,
                    "ignore_eos": True,
                }
                try:
                    async with http.post(url + "/v1/completions", json=body) as resp:
                        n = 0
                        async for line in resp.content:
                            n += line.startswith(b"data: {")
                        if resp.status == 200:
                            stats["ok"] += 1
                            stats["tokens"] += n
                        else:
                            stats["errors"] += 1
                except (aiohttp.ClientError, TimeoutError):
                    stats["errors"] += 1
                    await asyncio.sleep(0.1)

        await asyncio.gather(*(loop() for _ in range(concurrency)))
    return stats


# -- helpers around the cluster ---------------------------------------------------------------------


class Burners:
    def __init__(self, n: int) -> None:
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
        if n:
            say(f"  started {n} CPU burners (pids {[p.pid for p in self.procs]})")

    def stop(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
            p.wait()
        if self.procs:
            say(f"  ended {len(self.procs)} CPU burners")
        self.procs = []


async def get(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url, headers=admin_headers(url)) as resp:
        resp.raise_for_status()
        return await resp.json()


async def wait_until(
    http: aiohttp.ClientSession, url: str, pred: Any, timeout_s: float, what: str, poll_s: float = 0.05
) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        ws = await get(http, url + "/admin/workers")
        if pred(ws):
            return ws
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}: {ws}")
        await asyncio.sleep(poll_s)


def all_healthy(n: int) -> Any:
    return lambda ws: sum(w["state"] == "HEALTHY" for w in ws) >= n


async def failed_event(
    http: aiohttp.ClientSession, url: str, worker: str, incarnation: int, timeout_s: float
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        for e in await get(http, url + "/admin/events"):
            if e["worker"] == worker and e["incarnation"] == incarnation and e["to"] == "FAILED":
                return dict(e)
        if time.monotonic() > deadline:
            raise TimeoutError(f"no FAILED event for {worker}/{incarnation} in {timeout_s} s")
        await asyncio.sleep(0.01)


def start_driver(url: str, concurrency: int, seconds: float) -> subprocess.Popen[str]:
    """This script again, as the load driver (`--drive`): its own process, its own CPU time."""
    cmd = [
        sys.executable,
        __file__,
        "--drive",
        url,
        "--concurrency",
        str(concurrency),
        "--seconds",
        str(seconds),
    ]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def start_cluster(log_dir: Path, overrides: dict[str, Any]) -> ClusterProcess:
    c = ClusterProcess(workers=3, overrides={**CLUSTER_OVERRIDES, **overrides}, log_dir=log_dir)
    c.__enter__()
    return c


# -- the measurements ---------------------------------------------------------------------------


async def trials(kind: str, n: int, burners: int, log_dir: Path, overrides: dict[str, Any]) -> dict[str, Any]:
    sig = TRIAL_KINDS[kind]
    c = start_cluster(log_dir / f"{kind}-{burners}b", overrides)
    burn = Burners(burners)
    out: list[dict[str, Any]] = []
    base = float(c.ready["started_at_monotonic"])
    try:
        async with aiohttp.ClientSession() as http:
            await wait_until(http, c.url, all_healthy(3), 60, "3 HEALTHY workers")
            await asyncio.sleep(2.0)  # a few seconds of heartbeats for the detector's window
            for i in range(n):
                ws = await wait_until(http, c.url, all_healthy(3), 60, "3 HEALTHY workers")
                victim = sorted(ws, key=lambda w: w["id"])[i % 3]
                pid, inc = victim["pid"], victim["incarnation"]
                t0 = time.monotonic()
                os.kill(pid, sig)
                ev = await failed_event(http, c.url, victim["id"], inc, 30)
                latency = base + ev["t"] - t0
                if kind == "stop":
                    os.kill(pid, signal.SIGCONT)
                out.append({"worker": victim["id"], "latency_s": latency, "reason": ev["reason"]})
                say(
                    f"  {kind} {i + 1}/{n}: {victim['id']} FAILED after {1000 * latency:.1f} ms ({ev['reason']})"
                )
                # the worker comes back as a new incarnation (restarted, or reset after SIGCONT)
                await wait_until(
                    http,
                    c.url,
                    lambda ws, w=victim["id"], inc=inc: any(
                        x["id"] == w and x["state"] == "HEALTHY" and x["incarnation"] > inc for x in ws
                    ),
                    60,
                    f"{victim['id']} back",
                )
                await asyncio.sleep(1.0 if kind == "kill" else 2.0)
            events = await get(http, c.url + "/admin/events")
    finally:
        burn.stop()
        c.stop()
    lat = sorted(t["latency_s"] for t in out)
    victims = {(t["worker"]) for t in out}
    spurious = [
        e for e in events if e["to"] == "FAILED" and e["worker"] not in victims
    ]  # failures of workers nobody touched
    return {
        "kind": kind,
        "burners": burners,
        "trials": n,
        "latencies_s": lat,
        "p50_s": pct(lat, 50),
        "p99_s": pct(lat, 99),
        "max_s": lat[-1] if lat else None,
        "reasons": sorted({t["reason"].split(" (")[0].split(" for ")[0] for t in out}),
        "other_failures": len(spurious),
    }


async def quiet_period(
    condition: str, minutes: float, burners: int, concurrency: int, log_dir: Path, overrides: dict[str, Any]
) -> dict[str, Any]:
    loaded = condition.startswith("load")
    n_burn = burners if condition.endswith("+burn") else 0
    c = start_cluster(log_dir / f"false-{condition}", overrides)
    burn = Burners(n_burn)
    driver: subprocess.Popen[str] | None = None
    seconds = 60 * minutes
    try:
        async with aiohttp.ClientSession() as http:
            await wait_until(http, c.url, all_healthy(3), 60, "3 HEALTHY workers")
            before = len(await get(http, c.url + "/admin/events"))
            if loaded:
                driver = start_driver(c.url, concurrency, seconds)
                say(f"  load driver pid {driver.pid}: {concurrency} concurrent streams")
            t0 = time.monotonic()
            every = min(30.0, seconds / 4)
            next_report = t0 + every
            while time.monotonic() - t0 < seconds:
                await asyncio.sleep(1.0)
                if time.monotonic() >= next_report:
                    evs = (await get(http, c.url + "/admin/events"))[before:]
                    ws = await get(http, c.url + "/admin/workers")
                    say(
                        f"  {condition}: {time.monotonic() - t0:.0f}/{seconds:.0f} s, "
                        f"FAILED {sum(e['to'] == 'FAILED' for e in evs)}, "
                        f"SUSPECT {sum(e['to'] == 'SUSPECT' for e in evs)}, "
                        f"running {[w['running'] for w in ws]}, load avg {os.getloadavg()[0]:.1f}"
                    )
                    next_report += every
            events = (await get(http, c.url + "/admin/events"))[before:]
        load_stats: dict[str, Any] = {}
        if driver is not None:
            out, _ = driver.communicate(timeout=180)
            driver = None
            lines = [ln for ln in out.splitlines() if ln.startswith("{")]
            load_stats = json.loads(lines[-1]) if lines else {}
    finally:
        if driver is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(driver.pid, signal.SIGKILL)
            driver.wait()
        burn.stop()
        c.stop()
    failed = [e for e in events if e["to"] == "FAILED"]
    return {
        "condition": condition,
        "minutes": minutes,
        "burners": n_burn,
        "concurrency": concurrency if loaded else 0,
        "false_failed": len(failed),
        "failed_reasons": [e["reason"] for e in failed][:20],
        "suspect": sum(e["to"] == "SUSPECT" for e in events),
        "suspect_reasons": [e["reason"] for e in events if e["to"] == "SUSPECT"][:10],
        "load": load_stats,
    }


def pct(xs: list[float], q: float) -> float | None:
    """The q-th percentile, nearest rank (p99 of 30 trials is the largest)."""
    if not xs:
        return None
    s = sorted(xs)
    k = max(0, min(len(s) - 1, -(-len(s) * q // 100) - 1))
    return s[int(k)]


# -- report -------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cpus": os.cpu_count(),
        "cpu": model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg_1_5_15min_at_end": os.getloadavg(),
    }


def quiet_runs(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The no-fault periods, in CONDITIONS order, shorter first."""
    rs = [r for r in data["runs"].values() if "condition" in r]
    return sorted(rs, key=lambda r: (CONDITIONS.index(r["condition"]), r["minutes"]))


def table(data: dict[str, Any]) -> str:
    rows = [
        "| measurement | condition | n | p50 | p99 | max | target | met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for _key, r in sorted(data["runs"].items()):
        if "kind" in r:
            cond = "no burners" if r["burners"] == 0 else f"{r['burners']} CPU burners"
            target = TARGETS[r["kind"]]
            check = "" if r["burners"] else ("yes" if (r["p99_s"] or 1e9) < target else "NO")
            rows.append(
                f"| {'kill -9' if r['kind'] == 'kill' else 'SIGSTOP'} → FAILED | {cond} | {r['trials']} | "
                f"{1000 * r['p50_s']:.1f} ms | {1000 * r['p99_s']:.1f} ms | {1000 * r['max_s']:.1f} ms | "
                f"p99 {'<' if r['kind'] == 'kill' else '≤'} {1000 * target:.0f} ms{' (quiet)' if r['burners'] else ''} | "
                f"{check or '—'} |"
            )
    rows += [
        "",
        "| no fault, 3 workers | minutes | CPU burners | load | false FAILED | SUSPECT | requests ok / errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in quiet_runs(data):
        if "condition" in r:
            ld = r["load"]
            load = f"{r['concurrency']} streams" if r["concurrency"] else "idle"
            reqs = f"{ld.get('ok', 0)} / {ld.get('errors', 0)}" if r["concurrency"] else "—"
            rows.append(
                f"| {r['condition']} | {r['minutes']:g} | {r['burners']} | {load} | {r['false_failed']} | "
                f"{r['suspect']} | {reqs} |"
            )
    return "\n".join(rows)


def plot(data: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, kind in zip(axes[:2], ("kill", "stop"), strict=True):
        for _key, r in sorted(data["runs"].items()):
            if r.get("kind") != kind or not r["latencies_s"]:
                continue
            xs = [1000 * x for x in r["latencies_s"]]
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            label = "no burners" if r["burners"] == 0 else f"{r['burners']} CPU burners"
            ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)}, p99 {xs[-1]:.0f} ms)")
        ax.axvline(
            1000 * TARGETS[kind],
            color="red",
            ls="--",
            lw=1,
            label=f"target p99 {1000 * TARGETS[kind]:.0f} ms",
        )
        ax.set_xlabel("detection latency (ms)")
        ax.set_ylabel("fraction of trials")
        ax.set_title("kill -9 → FAILED" if kind == "kill" else "SIGSTOP → FAILED")
        if kind == "kill":
            ax.set_xscale("log")  # milliseconds on a quiet host, up to a second on a loaded one
        else:
            ax.set_xlim(left=0)
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(alpha=0.3)
    ax = axes[2]
    rs = quiet_runs(data)
    names = [f"{r['condition']}\n{r['minutes']:g} min" for r in rs]
    pos = list(range(len(rs)))
    ax.bar([x - 0.2 for x in pos], [r["false_failed"] for r in rs], 0.4, label="false FAILED", color="C3")
    ax.bar([x + 0.2 for x in pos], [r["suspect"] for r in rs], 0.4, label="SUSPECT transitions", color="C1")
    for x, r in zip(pos, rs, strict=True):
        ax.annotate(
            str(r["false_failed"]), (x - 0.2, r["false_failed"]), ha="center", va="bottom", fontsize=8
        )
        ax.annotate(str(r["suspect"]), (x + 0.2, r["suspect"]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(pos, names, fontsize=8)
    ax.set_title("no fault injected: 3 workers")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.suptitle(
        f"Lumen failure detection ({data.get('machine', {}).get('cpus', '?')}-core VM, default [health])"
    )
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


# -- main -----------------------------------------------------------------------------------------


def measurements(args: argparse.Namespace) -> list[str]:
    if args.only:
        return [str(m) for m in args.only.split(",")]
    out = [f"{k}:{b}" for k in args.phases.split(",") if k in TRIAL_KINDS for b in (0, args.burners)]
    if "false" in args.phases.split(","):
        out += [f"false:{c}" for c in args.conditions.split(",")]
    return out


async def run(args: argparse.Namespace) -> None:
    data: dict[str, Any] = {"runs": {}}
    if args.json.exists():
        data = json.loads(args.json.read_text())
    log_dir = Path(args.log_dir)
    overrides = dict(kv.split("=", 1) for kv in args.set)
    overrides = {k: json.loads(v) for k, v in overrides.items()}
    todo = [] if args.report else measurements(args)
    command = " ".join([Path(sys.executable).name, *sys.argv])
    for m in todo:
        kind, _, arg = m.partition(":")
        load_before = os.getloadavg()
        say(f"== {m} (load average {load_before[0]:.2f})")
        if kind in TRIAL_KINDS:
            r = await trials(kind, args.trials, int(arg), log_dir, overrides)
            say(
                f"   p50 {1000 * r['p50_s']:.1f} ms, p99 {1000 * r['p99_s']:.1f} ms, max {1000 * r['max_s']:.1f} ms"
            )
        elif kind == "false":
            if arg not in CONDITIONS:
                raise SystemExit(f"unknown condition {arg!r}; known: {', '.join(CONDITIONS)}")
            r = await quiet_period(arg, args.minutes, args.burners, args.concurrency, log_dir, overrides)
            say(f"   false FAILED {r['false_failed']}, SUSPECT {r['suspect']}, load {r['load']}")
        else:
            raise SystemExit(f"unknown measurement {m!r}")
        r["command"] = command
        r["date"] = dt.datetime.now().astimezone().isoformat(timespec="seconds")
        r["machine"] = machine()
        r["loadavg_1min_before"] = load_before[0]
        r["overrides"] = overrides
        # no-fault periods of different lengths are kept apart (a short run does not replace a long one)
        data["runs"][m if kind in TRIAL_KINDS else f"{m}/{args.minutes:g}min"] = r
        data["machine"] = r["machine"]
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=1) + "\n")  # after each: a long run keeps its parts
    print(table(data), flush=True)
    if data["runs"]:
        plot(data, args.png)
        say(f"wrote {args.json} and {args.png}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=30, help="kill and SIGSTOP trials per condition")
    ap.add_argument("--minutes", type=float, default=1.0, help="length of each no-fault period")
    ap.add_argument("--burners", type=int, default=4, help="CPU-burning processes beside the cluster")
    ap.add_argument("--concurrency", type=int, default=16, help="streams of the load driver")
    ap.add_argument("--phases", default="kill,stop,false", help="kill, stop, false (comma-separated)")
    ap.add_argument("--conditions", default=",".join(CONDITIONS), help="no-fault conditions")
    ap.add_argument("--only", default="", help="measurements, e.g. stop:0,false:load+burn")
    ap.add_argument("--report", action="store_true", help="only the table and plot from --json")
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    ap.add_argument("--png", type=Path, default=DEFAULT_PNG)
    ap.add_argument("--log-dir", default="/tmp/lumen-detect-bench")
    ap.add_argument("--set", action="append", default=[], help="cluster config override key=JSON")
    # the load driver, run by the bench itself in a separate process
    ap.add_argument("--drive", default="", help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=60.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.drive:
        print(json.dumps(asyncio.run(drive(args.drive, args.concurrency, args.seconds))), flush=True)
        return
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
