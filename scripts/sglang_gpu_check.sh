#!/usr/bin/env bash
# Lumen in front of real SGLang servers, on GPUs: a check for whoever has them (docs/sglang.md).
#
#   scripts/sglang_gpu_check.sh --model /models/Qwen3-8B [--tp 1] [--requests 16] [--max-tokens 256]
#                               [--port 8000] [--out out/sglang-gpu-check] [-- extra launch_server args]
#
# Needs sglang (pip install 'lumen[sglang]', sglang 0.5.23) and at least 2 x TP NVIDIA GPUs; refuses to
# run (exit 2) without them. --model must be a local HuggingFace folder with tokenizer.json (the gateway
# tokenizes itself). What it does:
#
#   1. `lumen cluster up --engine sglang --model M --workers 2 --tp TP`: a gateway and two SGLang
#      servers, each launched and supervised by its sidecar agent (`lumen sglang-agent --launch`);
#   2. a reference pass: --requests streaming /v1/completions (half greedy, half seeded), no fault;
#   3. the same requests again; once they stream, the busiest server is killed (`kill -9` of the server,
#      not its agent: POST /admin/workers/ID/kill); its agent relaunches it, seeded from the survivor
#      when the gateway names one (`--load-format remote_instance`), else from storage;
#   4. reports: every output equal to the reference or not, the interruptions (/admin/sessions:
#      tokens emitted before, restored tokens, resume delay, where resumed), the killed worker's
#      FAILED -> RESTARTING -> HEALTHY timeline with the reload time and source (/admin/events), and
#      the gateway's lumen_reload_seconds histogram. JSON in --out/report.json, logs in --out/logs.
#
# With LUMEN_SGLANG_LAUNCHER set (the agent's testing hook) it skips the sglang and GPU checks and runs on
# stand-ins: a dry run of the script's mechanism, not of SGLang.
#
# It has never been run on GPUs: none of the machines Lumen was built on had sglang and GPUs together.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi

TP=1
for ((i = 1; i <= $#; i++)); do
    [[ "${!i}" == "--" ]] && break
    if [[ "${!i}" == "--tp" ]]; then j=$((i + 1)); TP="${!j}"; fi
    if [[ "${!i}" == --tp=* ]]; then TP="${!i#--tp=}"; fi
done

refuse() {
    echo "sglang_gpu_check: $*" >&2
    exit 2
}

if [[ -n "${LUMEN_SGLANG_LAUNCHER:-}" ]]; then
    # the testing hook of `lumen sglang-agent` (worker_hooks/sglang/launcher.py): stand-ins, no GPUs
    echo "sglang_gpu_check: LUMEN_SGLANG_LAUNCHER is set: a dry run of the mechanism on stand-ins, not a GPU check" >&2
elif ! "$PY" -c 'import importlib.util, sys; sys.exit(0 if importlib.util.find_spec("sglang") else 1)'; then
    refuse "sglang is not installed for $PY: pip install 'lumen[sglang]' (sglang 0.5.23, CUDA GPUs), or set PYTHON"
fi
if [[ -z "${LUMEN_SGLANG_LAUNCHER:-}" ]]; then
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        refuse "no NVIDIA GPU: nvidia-smi is not on PATH"
    fi
    if ! GPUS=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | grep -c .); then
        refuse "no NVIDIA GPU: nvidia-smi lists none (driver not loaded?)"
    fi
    if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
        GPUS=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c . || true)
    fi
    if ((GPUS < 2 * TP)); then
        refuse "two servers of --tp $TP need $((2 * TP)) GPUs; $GPUS visible"
    fi
fi

exec "$PY" - "$@" <<'PY'
"""The check itself (see the script's header)."""

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import aiohttp

p = argparse.ArgumentParser(prog="scripts/sglang_gpu_check.sh")
p.add_argument("--model", required=True)
p.add_argument("--tp", type=int, default=1)
p.add_argument("--requests", type=int, default=16)
p.add_argument("--max-tokens", type=int, default=256)
p.add_argument("--port", type=int, default=8000)
p.add_argument("--out", default="out/sglang-gpu-check")
p.add_argument("--ready-timeout-s", type=float, default=1800.0)
argv = sys.argv[1:]
tail = argv[argv.index("--") + 1 :] if "--" in argv else []
args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
if not os.environ.get("LUMEN_SGLANG_LAUNCHER") and not (Path(args.model) / "tokenizer.json").is_file():
    sys.exit(f"sglang_gpu_check: --model must be a local folder with tokenizer.json, not {args.model!r}")
out = Path(args.out)
(out / "logs").mkdir(parents=True, exist_ok=True)
GW = f"http://127.0.0.1:{args.port}"
HEADERS = {"Authorization": f"Bearer {os.environ['LUMEN_ADMIN_API_KEY']}"} if os.environ.get("LUMEN_ADMIN_API_KEY") else {}


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


async def start_cluster() -> tuple[asyncio.subprocess.Process, dict]:
    cmd = [
        sys.executable, "-m", "gateway.cli", "cluster", "up", "--engine", "sglang", "--model", args.model,
        "--tp", str(args.tp), "--workers", "2", "--port", str(args.port), "--log-dir", str(out / "logs"),
        # seeded reload is on only where the configuration says so (default "disk")
        "--set", 'engine.reload="peer"',
        "--", *tail,
    ]  # fmt: skip
    say("starting: " + " ".join(cmd))
    err = (out / "logs" / "cluster.stderr").open("wb")
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, stderr=err)
    assert proc.stdout is not None
    async with asyncio.timeout(args.ready_timeout_s + 60):
        while line := await proc.stdout.readline():
            try:
                ev = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(ev, dict) and ev.get("event") in ("ready", "degraded"):
                if ev["event"] != "ready":
                    raise SystemExit(f"sglang_gpu_check: the cluster did not become ready: {ev}")
                return proc, ev
    raise SystemExit(f"sglang_gpu_check: `lumen cluster up` exited ({await proc.wait()}); see {out / 'logs'}")


def bodies() -> list[dict]:
    out = []
    for i in range(args.requests):
        body = {
            "model": args.model,
            "prompt": f"Request {i}: write a long, detailed story about the number {i * 7 + 3}.",
            "max_tokens": args.max_tokens,
            "stream": True,
            "temperature": 0.0 if i % 2 == 0 else 0.8,
        }
        if i % 2:
            body["seed"] = 1000 + i
        out.append(body)
    return out


async def stream(http: aiohttp.ClientSession, body: dict, progress: list[int], i: int) -> str:
    text = []
    async with http.post(GW + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            return f"<HTTP {resp.status}: {await resp.text()}>"
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                return f"<error chunk: {chunk['error']}>"
            text.append(chunk["choices"][0].get("text", ""))
            progress[i] += 1
    return "".join(text)


async def get(http: aiohttp.ClientSession, path: str):
    async with http.get(GW + path, headers=HEADERS) as resp:
        resp.raise_for_status()
        return await (resp.json() if path.startswith("/admin") else resp.text())


async def run_pass(http: aiohttp.ClientSession, kill: bool) -> tuple[list[str], dict | None]:
    progress = [0] * args.requests
    tasks = [asyncio.create_task(stream(http, b, progress, i)) for i, b in enumerate(bodies())]
    killed = None
    if kill:
        while sum(1 for n in progress if n >= 8) < args.requests // 2 and not all(t.done() for t in tasks):
            await asyncio.sleep(0.05)
        workers = await get(http, "/admin/workers")
        victim = max(workers, key=lambda w: (w["inflight"], w["id"]))
        async with http.post(GW + f"/admin/workers/{victim['id']}/kill?mode=kill", headers=HEADERS) as resp:
            killed = {**await resp.json(), "worker": victim["id"], "incarnation": victim["incarnation"]}
        say(f"killed the SGLang server of {victim['id']} (pid {killed.get('pid')}) with {victim['inflight']} streams on it")
    return list(await asyncio.gather(*tasks)), killed


async def main() -> int:
    proc, ready = await start_cluster()
    say(f"cluster ready: {ready}")
    report: dict = {"ready": ready, "model": args.model, "tp": args.tp, "requests": args.requests}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as http:
            say("reference pass (no fault)")
            reference, _ = await run_pass(http, kill=False)
            say("pass with a server killed mid-stream")
            got, killed = await run_pass(http, kill=True)
            assert killed is not None
            wid = killed["worker"]
            report["killed"] = killed
            report["exact"] = [g == r for g, r in zip(got, reference, strict=True)]
            say(f"outputs equal to the reference: {sum(report['exact'])}/{len(got)}")
            say(f"waiting for {wid} to be HEALTHY again (its agent relaunches it)")
            deadline = time.monotonic() + args.ready_timeout_s
            back = None
            while time.monotonic() < deadline and back is None:
                events = await get(http, "/admin/events")
                back = next(
                    (e for e in events if e["worker"] == wid and e["to"] == "HEALTHY"
                     and e["incarnation"] > killed["incarnation"]), None,
                )  # fmt: skip
                await asyncio.sleep(1.0)
            events = [e for e in await get(http, "/admin/events") if e["worker"] == wid and e["t"] >= killed["at"] - 1]
            report["timeline"] = events
            sessions = (await get(http, "/admin/sessions"))["interrupted"]
            report["interruptions"] = [s for s in sessions if s["worker"] == wid]
            report["workers"] = await get(http, "/admin/workers")
            report["reload_metrics"] = [
                line
                for line in (await get(http, "/metrics")).splitlines()
                if line.startswith(("lumen_reload_seconds_count", "lumen_reload_seconds_sum", "lumen_reload_seed_choices_total"))
            ]
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(120):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()
    (out / "report.json").write_text(json.dumps(report, indent=2))

    print("\n== interruptions (from /admin/sessions)")
    for s in report["interruptions"]:
        print(
            f"  {s['rid']}: emitted {s['emitted_before']} before, resumed on {s['resumed_on']} "
            f"({s['action']}), restored {s['restored_tokens']} tokens, resume delay {s['resume_delay_s']} s"
        )
    delays = [s["resume_delay_s"] for s in report["interruptions"] if s["resume_delay_s"] is not None]
    restored = sum(s["restored_tokens"] or 0 for s in report["interruptions"])
    print(f"  {len(report['interruptions'])} interrupted, restored tokens {restored}, "
          f"resume delay max {max(delays, default=float('nan')):.3f} s")  # fmt: skip
    print(f"\n== {report['killed']['worker']} timeline (from /admin/events; t = s since the gateway started)")
    print(f"  {report['killed']['at']:9.3f}  kill sent")
    for e in report["timeline"]:
        print(f"  {e['t']:9.3f}  {e['from']} -> {e['to']}: {e['reason']}")
    reloads = [e["reason"] for e in report["timeline"] if "reloaded" in e["reason"]]
    print(f"\n== reload: {reloads[-1] if reloads else 'none reported (did the server come back?)'}")
    for line in report["reload_metrics"]:
        print(f"  {line}")
    exact = all(report["exact"])
    print(f"\n== every output equal to the reference: {exact}; report: {out / 'report.json'}")
    return 0 if exact and reloads else 1


sys.exit(asyncio.run(main()))
PY
