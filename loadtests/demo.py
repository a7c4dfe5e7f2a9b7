"""`lumen demo`: a local cluster of synthetic workers, a streaming load, a worker killed mid-load.

Shows live progress, the failure being detected, the interrupted requests resuming on survivors, the
killed worker restarting and rejoining, and a final summary with the client-visible error count and
an exactness check of every output against the synthetic model's deterministic expectation.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np

from gateway.protocol.generate import SamplingParams
from gateway.protocol.secrets import admin_headers
from loadtests.client import RequestResult, stream_completion
from loadtests.cluster_proc import ClusterProcess
from models.synthetic import expected_output

# the demo runs modelled GPU time at 2x real speed; a restart loads its draft model in 2 modelled s and
# its full model in 10; 16-token KV pages (default 64) so the demo's short prompts fill pages quickly
DEMO_OVERRIDES = {
    "engine.time_scale": 0.5,
    "engine.model_load_s": 10.0,
    "engine.draft_load_s": 2.0,
    "engine.page_size": 16,
    "gateway.log_level": "warning",
}


@dataclass(slots=True)
class Workload:
    results: list[RequestResult]
    gaps: list[float]


def make_workload(n: int, rate: float, seed: int) -> Workload:
    """Conv-like shapes, scaled down so a laptop-size demo finishes in seconds."""
    rnd = random.Random(seed)
    results, gaps = [], []
    for i in range(n):
        plen = int(min(1500, max(8, rnd.lognormvariate(5.0, 0.8))))
        olen = int(min(300, max(8, rnd.lognormvariate(4.8, 0.5))))
        greedy = i % 2 == 0
        results.append(
            RequestResult(
                idx=i,
                arrival=0.0,
                prompt_ids=[rnd.randrange(32, 127) for _ in range(plen)],
                max_tokens=olen,
                temperature=0.0 if greedy else 0.8,
                seed=None if greedy else rnd.randrange(1, 2**31),
            )
        )
        gaps.append(rnd.expovariate(rate))
    return Workload(results, gaps)


def expected_text(r: RequestResult) -> str:
    """The synthetic model's output for `r` with no failure: what the client must have received."""
    sp = SamplingParams(
        max_new_tokens=r.max_tokens, temperature=r.temperature, stop_token_ids=[257], ignore_eos=True
    )
    ids, _ = expected_output(r.prompt_ids, sp, r.seed or 0, model_seed=0, token_lo=32, token_hi=127)
    return bytes(ids).decode()


async def _drive(url: str, wl: Workload, kill_at: float, kill_mode: str, out: dict[str, Any]) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        model = (await (await http.get(f"{url}/v1/models")).json())["data"][0]["id"]
        t0 = time.monotonic()
        tasks: list[asyncio.Task[RequestResult]] = []
        progress = asyncio.create_task(_progress(http, url, wl, t0, out))
        killer = (
            asyncio.create_task(_kill_busiest(http, url, t0, kill_at, kill_mode, out))
            if kill_at >= 0
            else None
        )
        for r, gap in zip(wl.results, wl.gaps, strict=True):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(stream_completion(http, url, model, r)))
        await asyncio.gather(*tasks)
        if killer is not None:
            await killer
        out["load_s"] = time.monotonic() - t0
        # wait (bounded) for the killed worker to come back
        if out.get("killed"):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                ws = await (
                    await http.get(f"{url}/admin/workers", headers=admin_headers(f"{url}/admin/workers"))
                ).json()
                if all(w["state"] == "HEALTHY" for w in ws):
                    break
                await asyncio.sleep(0.2)
        progress.cancel()
        await asyncio.gather(progress, return_exceptions=True)
        out["events"] = await (
            await http.get(f"{url}/admin/events", headers=admin_headers(f"{url}/admin/events"))
        ).json()
        out["sessions"] = await (
            await http.get(f"{url}/admin/sessions", headers=admin_headers(f"{url}/admin/sessions"))
        ).json()
        out["workers"] = await (
            await http.get(f"{url}/admin/workers", headers=admin_headers(f"{url}/admin/workers"))
        ).json()
        out["assist"] = await (
            await http.get(f"{url}/admin/assist", headers=admin_headers(f"{url}/admin/assist"))
        ).json()


async def _kill_busiest(
    http: aiohttp.ClientSession, url: str, t0: float, at: float, mode: str, out: dict[str, Any]
) -> None:
    await asyncio.sleep(max(0.0, at - (time.monotonic() - t0)))
    ws = await (await http.get(f"{url}/admin/workers", headers=admin_headers(f"{url}/admin/workers"))).json()
    busiest = max(
        (w for w in ws if w["state"] == "HEALTHY"), key=lambda w: (w["running"] + w["waiting"], w["id"])
    )
    res = await (
        await http.post(
            f"{url}/admin/workers/{busiest['id']}/kill?mode={mode}",
            headers=admin_headers(f"{url}/admin/workers/{busiest['id']}/kill?mode={mode}"),
        )
    ).json()
    out["killed"] = {**res, "running": busiest["running"], "waiting": busiest["waiting"]}
    _say(
        f"\n  !! {'kill -9' if mode == 'kill' else 'SIGSTOP'} {busiest['id']} (pid {res['pid']}) with "
        f"{busiest['running']} running / {busiest['waiting']} waiting requests\n"
    )


async def _progress(
    http: aiohttp.ClientSession, url: str, wl: Workload, t0: float, out: dict[str, Any]
) -> None:
    tty = sys.stdout.isatty()
    seen_events = 0
    while True:
        await asyncio.sleep(0.5)
        try:
            ws = await (
                await http.get(f"{url}/admin/workers", headers=admin_headers(f"{url}/admin/workers"))
            ).json()
            events = await (
                await http.get(f"{url}/admin/events", headers=admin_headers(f"{url}/admin/events"))
            ).json()
        except aiohttp.ClientError:
            continue
        for ev in events[seen_events:]:
            if ev["from"] is not None and ev["to"] in ("FAILED", "RESTARTING", "HEALTHY", "SUSPECT"):
                _say(f"\n  -> {ev['worker']}: {ev['from']} -> {ev['to']} ({ev['reason']})\n")
        seen_events = len(events)
        done = sum(1 for r in wl.results if r.finish_reason or r.error)
        errs = sum(1 for r in wl.results if r.error)
        toks = sum(len(r.chunk_times) for r in wl.results)
        el = time.monotonic() - t0
        states = " ".join(f"{w['id']}:{w['state'][:4]}({w['running'] + w['waiting']})" for w in ws)
        line = f"  t={el:5.1f}s  done {done:4d}/{len(wl.results)}  errors {errs}  tokens {toks:6d}  {states}"
        _say(("\r" + line) if tty else (line + "\n"))


def _say(s: str) -> None:
    sys.stdout.write(s)
    sys.stdout.flush()


def _pct(xs: list[float], q: float) -> str:
    return f"{1000 * float(np.percentile(xs, q)):.0f} ms" if xs else "-"


def torch_expected_texts(wl: Workload, model: str, model_seed: int, page_size: int) -> list[str]:
    """The torch backend's outputs for the workload with no failure, as the byte tokenizer decodes
    them (computed here with the same random weights every worker builds)."""
    from gateway.protocol.bytevocab import decode
    from worker_hooks.engine.torch_backend import expected_outputs

    reqs = [
        (
            r.prompt_ids,
            SamplingParams(max_new_tokens=r.max_tokens, temperature=r.temperature, ignore_eos=True),
            r.seed or 0,
        )
        for r in wl.results
    ]
    return [
        decode(ids) for ids in expected_outputs(reqs, model=model, model_seed=model_seed, page_size=page_size)
    ]


def summarize(wl: Workload, out: dict[str, Any], mode: str, expected: list[str] | None = None) -> int:
    res = wl.results
    ok = [r for r in res if r.ok]
    errors = [r for r in res if not r.ok]
    want = expected if expected is not None else [expected_text(r) for r in res]
    exact = sum(1 for r in ok if r.text == want[r.idx])
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    toks = sum(r.completion_tokens for r in ok)
    killed = out.get("killed")
    print("\n\n== Lumen demo summary " + "=" * 50)
    print(f"recovery mode           {mode}")
    print(
        f"requests                {len(res)} sent, {len(ok)} completed, {len(errors)} client-visible errors"
    )
    print(f"exact outputs           {exact}/{len(ok)} equal the no-failure expectation")
    print(f"TTFT p50 / p99          {_pct(ttft, 50)} / {_pct(ttft, 99)}")
    print(f"TPOT p50 / p99          {_pct(tpot, 50)} / {_pct(tpot, 99)}")
    print(f"throughput              {toks / out['load_s']:.0f} tokens/s over {out['load_s']:.1f} s")
    if killed:
        wid = killed["worker"]
        failed = [e for e in out["events"] if e["worker"] == wid and e["to"] == "FAILED"]
        back = [
            e for e in out["events"] if e["worker"] == wid and e["to"] == "HEALTHY" and e["from"] != "SUSPECT"
        ]
        det = (
            f"{1000 * (failed[0]['t'] - killed['at']):.1f} ms ({failed[0]['reason'].split(':')[0]})"
            if failed
            else "not detected"
        )
        print(
            f"worker killed           {wid} ({killed['mode']}), {killed['running']} running + {killed['waiting']} waiting"
        )
        print(f"failure detected after  {det}")
        inter = out["sessions"]["interrupted"]
        delays = [i["resume_delay_s"] for i in inter if i["resume_delay_s"] is not None]
        print(
            f"interrupted requests    {len(inter)} resumed on {sorted({i['resumed_on'] for i in inter if i['resumed_on']})}"
        )
        restored = [i for i in inter if i.get("restored_tokens")]
        print(
            f"resumed by restore       {len(restored)} on their checkpoint holders "
            f"({sum(i['restored_tokens'] for i in restored)} KV tokens restored, not recomputed); "
            f"by replay {len(inter) - len(restored)}"
        )
        print(f"resume delay p50 / max  {_pct(delays, 50)} / {_pct(delays, 100)}")
        pairs = [e for e in out.get("assist", {}).get("events", []) if e["started"]]
        if pairs:
            acc = {w["id"]: (w["accepted_tokens"], w["drafted_tokens"]) for w in out["workers"]}
            for e in pairs:
                a, d = acc.get(e["target"], (0, 0))
                rate = f"{a / d:.0%} of {d} drafted tokens accepted" if d else "no drafts verified"
                print(
                    f"draft assist            {e['drafter']} drafted for {e['target']} from t={e['t']:.1f}s: {rate}"
                )
        rejoin = [e for e in back if e["t"] > killed["at"]]
        print(
            f"killed worker rejoined  {'yes, %.1f s after the kill' % (rejoin[0]['t'] - killed['at']) if rejoin else 'not yet'}"
        )
    for r in errors[:5]:
        print(f"  error in request {r.idx}: {r.status} {r.error}")
    return 0 if not errors or mode == "none" else 1


def main(args: argparse.Namespace) -> int:
    from gateway.config import load_config, parse_set

    overrides = {**DEMO_OVERRIDES, **parse_set(args.set)}
    cfg = load_config(args.config, overrides)
    torch_backend = cfg.engine.backend == "torch"
    mode = args.mode or "lumen"
    wl = make_workload(args.requests, args.rate, args.seed)
    workers = (
        f"torch workers ({cfg.torch.model}, {cfg.torch.dtype} on {cfg.torch.device}, real)"
        if torch_backend
        else f"synthetic workers ({cfg.model.preset} on {cfg.model.gpu}, modelled)"
    )
    print(
        f"Lumen demo: {args.workers} {workers}, {args.requests} streaming "
        f"requests at {args.rate:g}/s, recovery mode '{mode}'; "
        + (
            f"the busiest worker is killed {args.kill_at:g} s into the load"
            if args.kill_at >= 0
            else "no failure"
        )
    )
    print("starting the cluster ...")
    out: dict[str, Any] = {}
    with ClusterProcess(
        workers=args.workers, port=args.port, mode=mode, config=args.config, overrides=overrides
    ) as c:
        print(f"cluster ready at {c.url} (worker logs in {c.ready.get('logs')})")
        asyncio.run(_drive(c.url, wl, args.kill_at, args.kill_mode, out))
    expected = None
    if torch_backend:
        print("computing the no-failure outputs of the torch model for the exactness check ...")
        expected = torch_expected_texts(wl, cfg.torch.model, cfg.engine.model_seed, cfg.engine.page_size)
    rc = summarize(wl, out, mode, expected)
    if args.compare and args.kill_at >= 0:
        if torch_backend:
            print("(the side-by-side comparison runs synthetic workers only; skipped for the torch backend)")
        else:
            compare(args)
    return rc


def compare(args: argparse.Namespace) -> None:
    """The same short workload, seed and kill against a fresh cluster in each mode, plus one run
    without the failure: `lumen loadtest` (loadtests.sidebyside) and EVALUATION.md's metrics."""
    from loadtests.sidebyside import main as sidebyside

    modes = args.compare
    print(
        f"\n== Side by side: {modes.replace(',', ' vs ')} on the same workload and kill "
        "(a fresh cluster per mode, and one run without the failure) " + "=" * 10
    )
    argv = [
        "--modes", modes,
        "--workers", str(args.workers),
        "--duration", "14",
        "--rate", "10",
        "--fault", "kill:busiest@5",
        "--time-scale", "1",
        "--max-running", "8",
        "--model-load-s", "4",
        "--seed", str(args.seed),
        "--out", args.compare_out,
        "--set", "engine.draft_load_s=1",
        "--set", "engine.page_size=16",
        "--set", "gateway.log_level=warning",
    ]  # fmt: skip
    sidebyside(argv)
    print(f"(full report, JSON and timelines: {args.compare_out}/)")
