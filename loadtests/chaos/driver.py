"""The chaos run itself, inside the load client's namespace: `python -m loadtests.chaos.driver PLAN`.

It starts the cluster with every gateway and worker in its own namespace (`python -m
gateway.cluster.placed`, each process prefixed with `ip netns exec <namespace>`), waits until every
gateway sees every worker, then runs the plan's load with the recording client while the fault
schedule fires (process faults through the gateways' admin API, network faults with nft/tc in the
namespaces) and the observer samples the gateways. After the load: every network fault is healed,
every worker is sent a resume (a hang whose undo could not be delivered ends there), the stores get
`drain_s` to empty, and the history goes to `plan.out` as JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import structlog

from gateway.protocol.streamid import stream_key
from loadtests.chaos.history import new_history, run_request
from loadtests.chaos.netfaults import HostAddr, NetFaultRunner, NetFaults, delay_backend
from loadtests.chaos.netspec import check_hosts
from loadtests.chaos.observe import Observer
from loadtests.chaos.plan import PROGRESS_EVENT, PROGRESS_S, Plan, request_specs, split_faults
from loadtests.faults import FaultRunner, FaultSchedule

log = structlog.get_logger("lumen.chaos")

# process-fault records that undo an earlier fault (not faults of their own)
UNDO_MODES = ("resume", "unstall", "normal")

CLUSTER_READY_TIMEOUT_S = 90.0


def placed_spec(plan: Plan) -> dict[str, Any]:
    """gateway.cluster.placed's spec: each process prefixed with `ip netns exec` into its host."""

    def place(host: str) -> dict[str, Any]:
        ns, addr = plan.hosts[host]
        return {"prefix": ["ip", "netns", "exec", ns], "addr": addr}

    return {
        "gateways": [place(g) for g in plan.gateways],
        "workers": {w: place(w) for w in plan.workers},
        "overrides": plan.overrides,
        "token": plan.token,
        "cert": plan.cert,
        "key": plan.key,
        "log_dir": plan.log_dir,
        "ready_timeout_s": 60.0,
    }


async def run_plan(plan: Plan) -> dict[str, Any]:
    schedule, net = split_faults(plan.faults)
    check_hosts(net, list(plan.hosts))
    schedule.check_workers(plan.workers)
    out: dict[str, Any] = {"plan": msgspec.to_builtins(plan), "ok_start": False}
    out["plan"]["token"] = out["plan"]["admin_key"] = "<redacted>"
    spec_path = Path(plan.log_dir) / "placed.json"
    spec_path.touch(mode=0o600)
    spec_path.write_text(json.dumps(placed_spec(plan)))
    env = dict(os.environ, LUMEN_ADMIN_API_KEYS=plan.admin_key, PYTHONUNBUFFERED="1")
    with (Path(plan.log_dir) / "cluster.log").open("ab") as logf:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway.cluster.placed", str(spec_path),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=logf, env=env,
        )  # fmt: skip
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(CLUSTER_READY_TIMEOUT_S):
            ready = json.loads(await proc.stdout.readline() or b"{}")
        spec_path.unlink()
        if ready.get("event") != "ready":
            out["error"] = (
                f"the cluster did not come up ({ready.get('event', 'no answer')}); see {plan.log_dir}"
            )
            return out
        out["ok_start"] = True
        out.update(await _load(plan, list(ready["urls"]), schedule, net))
    except TimeoutError:
        out["error"] = f"the cluster did not come up within {CLUSTER_READY_TIMEOUT_S:g} s; see {plan.log_dir}"
    finally:
        spec_path.unlink(missing_ok=True)
        if proc.returncode is None:
            proc.terminate()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(20.0):
                for line in (await proc.stdout.read()).splitlines():
                    with contextlib.suppress(ValueError):
                        msg = json.loads(line)
                        if msg.get("event") == "stopped":
                            out["restarts"], out["gateway_restarts"] = (
                                msg["worker_restarts"],
                                msg["gateway_restarts"],
                            )
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
    return out


async def _load(plan: Plan, urls: list[str], schedule: FaultSchedule, net: list[Any]) -> dict[str, Any]:
    key = stream_key(plan.token)
    reqs = request_specs(plan)
    histories = [
        new_history(r["idx"], r["prompt_ids"], r["max_tokens"], r["temperature"], r["seed"]) for r in reqs
    ]
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as http:
        t0 = time.monotonic()
        obs = Observer(http, urls, plan.admin_key, t0)
        stop_obs = asyncio.Event()
        observer = asyncio.create_task(obs.run(plan.sample_s, stop_obs))
        runner = FaultRunner(
            http,
            urls[0],
            schedule,
            seed=plan.seed,
            t0=t0,
            headers={"Authorization": f"Bearer {plan.admin_key}"},
            gateway_urls=urls,
        )
        netrun = NetFaultRunner(
            NetFaults({h: HostAddr(ns, addr) for h, (ns, addr) in plan.hosts.items()}), net, t0=t0
        )
        faults = [asyncio.create_task(runner.run()), asyncio.create_task(netrun.run())]

        async def progress() -> None:  # a line for `lumen chaos` to show (orchestrate.py tails the log)
            while True:
                await asyncio.sleep(PROGRESS_S)
                log.info(
                    PROGRESS_EVENT,
                    t=round(time.monotonic() - t0),
                    ended=sum(1 for h in histories if h["ended_at"] is not None),
                    requests=len(histories),
                    faults=sum(1 for f in runner.fired if f["ok"] and f["mode"] not in UNDO_MODES)
                    + sum(1 for f in netrun.fired if f["ok"] and f["mode"] == "inject"),
                )

        reporter = asyncio.create_task(progress())

        async def one(r: dict[str, Any], h: dict[str, Any]) -> None:
            await asyncio.sleep(max(0.0, r["at"] - (time.monotonic() - t0)))
            await run_request(
                http,
                urls,
                r["gateway"],
                h,
                key,
                model=str(plan.overrides.get("gateway.served_model_name", "lumen-synthetic")),
                read_timeout_s=plan.read_timeout_s,
                t0=t0,
            )

        budget = plan.deadline_s - 30.0
        try:
            async with asyncio.timeout(budget):
                await asyncio.gather(*(one(r, h) for r, h in zip(reqs, histories, strict=True)))
        except TimeoutError:
            log.error("chaos_load_timeout", budget_s=budget)
        reporter.cancel()
        load_end = time.monotonic() - t0
        # the schedule's remaining undos and heals run out; anything still pending is cancelled
        # (NetFaultRunner heals every fault it applied on its way out)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(1.0, _schedule_end(plan) - load_end + 2.0)):
                await asyncio.gather(*faults, return_exceptions=True)
        for task in faults:
            task.cancel()
        await asyncio.gather(*faults, return_exceptions=True)
        await obs.resume_all(plan.workers)  # a hang whose resume could not be sent ends here
        drained = await obs.drained(plan.drain_s)
        stop_obs.set()
        await observer
        outcomes = await obs.checkpoint_outcomes()
        return {
            "t_load_end": round(load_end, 4),
            "requests": histories,
            "faults": runner.fired,
            "net_faults": netrun.fired,
            # how delay faults were injected here ("netem", "nfqueue"; None: they could not be)
            "delay_backend": delay_backend() if any(f.kind == "delay" for f in net) else None,
            "drained": drained,
            "checkpoint_outcomes": outcomes,
            "urls": urls,
            **obs.dump(),
        }


def _schedule_end(plan: Plan) -> float:
    schedule, net = split_faults(plan.faults)
    ends = [e.at + (e.duration or 0.0) for e in schedule.events] + [f.at + (f.duration or 0.0) for f in net]
    return max(ends, default=0.0)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m loadtests.chaos.driver PLAN.json", file=sys.stderr)
        return 2
    plan = msgspec.json.decode(Path(args[0]).read_bytes(), type=Plan)
    Path(plan.log_dir).mkdir(parents=True, exist_ok=True)
    import uvloop

    result = uvloop.run(run_plan(plan))
    Path(plan.out).write_text(json.dumps(result))
    return 0 if result.get("ok_start") else 1


if __name__ == "__main__":
    sys.exit(main())
