"""Gateway overhead side by side: the same synthetic workers reached directly, through Lumen, and through SMG.

    python -m loadtests.bench_smg --rates 5,20,40,80,160 --seconds 6 --repeats 2

One local Lumen cluster (`--workers` synthetic workers, `engine.time_scale` small so gateway costs
show). SMG (`pip install smg`, the SGLang model gateway) is started on a free loopback port pointing at
the same worker URLs (from GET /admin/workers), with no shim between them. Each path gets the same
open-loop request mix (Poisson arrivals at each rate, seeded prompt/output lengths, greedy,
`ignore_eos`), and each gateway path is compared with the worker endpoint it ends up calling:

- `direct`: the worker's own `/generate` (token ids), alternating between workers;
- `direct_oai`: the worker's own OpenAI `/v1/completions` (text prompt), alternating between workers;
- `lumen`: Lumen's `/v1/completions` (streamed, token-id prompt); Lumen tokenizes and calls the
  workers' `/generate`, so its baseline is `direct`;
- `lumen_gen`: Lumen's native `/generate` (token ids), baseline `direct`;
- `smg`: SMG's `/v1/completions` (text prompt: SMG refuses token-id prompts). SMG forwards the body
  as it is to the worker's `/v1/completions` (adding `echo: false`), so its baseline is `direct_oai`;
- `smg_gen`: SMG's `/generate` (token ids). SMG forwards it to the worker's `/generate` with SGLang's
  extra fields and no `rid`, which the worker accepts since a63793f; baseline `direct`.

SMG's paths are probed first (one tiny streamed request each); a path that fails is not measured and
the probe's reply is recorded. Paths alternate (rotating order per rate and repeat) so they share
machine state. Reported per path and rate: TTFT and TPOT p50/p99, added latency vs the path's
baseline, errors, offered and achieved rate, and gateway CPU seconds per 1,000 requests (from /proc:
the cluster process for Lumen, the SMG process), raw and net of the process's idle CPU rate measured
while other paths ran. The tables go to stdout and to `--out` with the suffix `.md`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from loadtests.client import RequestResult, stream_completion
from loadtests.cluster_proc import ClusterProcess, free_port


@dataclass(slots=True)
class Sample:
    sched: float  # seconds after the run's start when the request was due
    sent: float = 0.0
    done: float = 0.0
    ttft: float | None = None
    tpot: float | None = None
    tokens: int = 0
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Shape:
    at: float
    prompt_ids: list[int]
    output_tokens: int


@dataclass(slots=True)
class Target:
    """How one path is reached: URL(s), request kind, and which processes count as its gateway."""

    name: str
    urls: list[str]
    kind: str  # "generate" | "completions"
    model: str = ""
    string_prompt: bool = False
    pids: dict[str, int] = field(default_factory=dict)  # whose CPU is this path's gateway CPU
    baseline: str = "direct"


# below this, an added per-token latency is within the run-to-run noise of these machines
NOISE_MS = 0.01


def workload(rate: float, seconds: float, min_requests: int, seed: int) -> list[Shape]:
    rnd = random.Random(seed)
    n = max(min_requests, round(rate * seconds))
    out, t = [], 0.0
    for _ in range(n):
        out.append(
            Shape(t, [rnd.randrange(32, 127) for _ in range(rnd.randint(32, 512))], rnd.randint(16, 128))
        )
        t += rnd.expovariate(rate)
    return out


def cpu_seconds(pid: int) -> float:
    """utime + stime of the process itself (its children, e.g. Lumen's workers, are not counted)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- clients --------------------------------------------------------------------------------------
async def _generate(http: aiohttp.ClientSession, url: str, body: dict[str, Any], s: Sample) -> None:
    s.sent = time.monotonic()
    first = last = 0.0
    finish: Any = None
    done_marker = False
    try:
        async with http.post(url + "/generate", json=body) as resp:
            if resp.status != 200:
                s.error = f"{resp.status}: {(await resp.text())[:200]}"
                return
            async for raw in resp.content:
                done_marker = done_marker or raw.startswith(b"data: [DONE]")
                if not raw.startswith(b"data:") or done_marker:
                    continue
                obj = json.loads(raw[5:])
                if "error" in obj:
                    s.error = str(obj["error"])[:200]
                    return
                meta = obj.get("meta_info", {})
                # workers stream only new ids, Lumen's /generate the cumulative list (SGLang's default):
                # the cumulative completion_tokens counts both
                n = meta.get("completion_tokens", s.tokens + len(obj.get("output_ids", ())))
                if n > s.tokens:
                    last = time.monotonic()
                    first = first or last
                    s.tokens = n
                finish = finish or meta.get("finish_reason")
    except (aiohttp.ClientError, TimeoutError) as exc:
        s.error = f"{type(exc).__name__}: {exc}"
        return
    want = body["sampling_params"]["max_new_tokens"]
    if not finish:
        s.error = f"stream truncated after {s.tokens} of {want} tokens ([DONE] {'seen' if done_marker else 'missing'})"
        return
    if isinstance(finish, dict) and finish.get("type") == "abort":
        s.error = f"aborted after {s.tokens} of {want} tokens: {finish.get('message')}"
        return
    if s.tokens != want:  # ignore_eos: every request must produce exactly max_new_tokens
        s.error = f"short: {s.tokens} of {want} tokens, finish {finish}"
        return
    s.ttft = first - s.sent
    s.tpot = (last - first) / (s.tokens - 1) if s.tokens > 1 else None


async def _one(http: aiohttp.ClientSession, t: Target, i: int, shape: Shape, s: Sample) -> None:
    url = t.urls[i % len(t.urls)]
    if t.kind == "generate":
        body = {
            "rid": f"bench-{t.name[:6]}-{i:010d}",
            "input_ids": shape.prompt_ids,
            "sampling_params": {
                "max_new_tokens": shape.output_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
            },
            "stream": True,
        }
        await _generate(http, url, body, s)
        s.done = time.monotonic()
        return
    r = RequestResult(i, 0.0, shape.prompt_ids, shape.output_tokens, 0.0, None)
    if t.string_prompt:  # SMG's completions take text only; ids 32..126 are printable ASCII bytes
        r.prompt_ids = "".join(map(chr, shape.prompt_ids))  # type: ignore[assignment]
    await stream_completion(http, url, t.model, r)
    s.done, s.sent = time.monotonic(), r.arrival
    s.tokens = r.completion_tokens
    if not r.ok:
        s.error = r.error or f"status {r.status}"
    elif r.completion_tokens != shape.output_tokens:
        s.error = f"short: {r.completion_tokens} of {shape.output_tokens} tokens, finish {r.finish_reason}"
    else:
        s.ttft, s.tpot = r.ttft, r.tpot


async def drive(http: aiohttp.ClientSession, t: Target, shapes: list[Shape]) -> tuple[list[Sample], float]:
    """Open loop: request i is sent at shapes[i].at whatever happened before. Returns samples, t0."""
    samples = [Sample(sh.at) for sh in shapes]
    t0 = time.monotonic()

    async def at(i: int) -> None:
        await asyncio.sleep(max(0.0, t0 + shapes[i].at - time.monotonic()))
        await _one(http, t, i, shapes[i], samples[i])

    await asyncio.gather(*(at(i) for i in range(len(shapes))))
    return samples, t0


# -- SMG ---------------------------------------------------------------------------------------------
def smg_binary(install: bool) -> tuple[str | None, str]:
    exe = Path(sys.executable).parent / "smg"
    if importlib.util.find_spec("smg") is None or not exe.exists():
        if not install:
            return None, "smg is not installed (run `pip install smg` in this venv, or drop --no-install)"
        print("installing smg into this venv (pip install smg)...", file=sys.stderr)
        r = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "smg"], capture_output=True, text=True
        )
        if r.returncode != 0 or not exe.exists():
            return None, f"`pip install smg` failed: {r.stderr.strip()[-400:]}"
    ver = subprocess.run([sys.executable, "-m", "pip", "show", "smg"], capture_output=True, text=True).stdout
    version = next((ln.split(":", 1)[1].strip() for ln in ver.splitlines() if ln.startswith("Version:")), "?")
    return str(exe), version


class Smg:
    """`smg launch` on loopback (metrics too), stopped by its pid."""

    def __init__(self, exe: str, worker_urls: list[str], policy: str, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.n = len(worker_urls)
        self.cmd = [
            exe, "launch", "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--worker-urls", *worker_urls, "--policy", policy, "--log-level", "warn",
            "--shutdown-grace-period-secs", "1",
        ]  # fmt: skip
        self.log = log_path.open("w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)

    async def ready(self, http: aiohttp.ClientSession, timeout_s: float = 60.0) -> dict[str, Any]:
        """SMG says ready on GET /readiness once its workers passed discovery and health checks."""
        deadline = time.monotonic() + timeout_s
        last: dict[str, Any] = {}
        while time.monotonic() < deadline and self.proc.poll() is None:
            with contextlib.suppress(aiohttp.ClientError, json.JSONDecodeError):
                async with http.get(self.url + "/readiness") as r:
                    last = dict(json.loads(await r.text()))
                    if last.get("status") == "ready" and last.get("healthy_workers") == self.n:
                        return last
            await asyncio.sleep(0.25)
        raise RuntimeError(f"SMG not ready in {timeout_s:g} s (exit {self.proc.poll()}): {last}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


async def probe(http: aiohttp.ClientSession, base: str, model: str) -> dict[str, dict[str, Any]]:
    """One tiny streamed request per SMG endpoint: status and the start of the reply."""
    bodies = {
        "/v1/completions": {
            "model": model,
            "prompt": "ABCDEFGH",
            "max_tokens": 4,
            "stream": True,
            "ignore_eos": True,
        },
        "/v1/chat/completions": {
            "model": model,
            "messages": [{"role": "user", "content": "ABCDEFGH"}],
            "max_tokens": 4,
            "stream": True,
            "ignore_eos": True,
        },
        "/generate": {
            "input_ids": list(range(65, 73)),
            "sampling_params": {"max_new_tokens": 4},
            "stream": True,
        },
    }
    out = {}
    for path, body in bodies.items():
        try:
            async with http.post(base + path, json=body) as r:
                text = await r.text()
                ok = r.status == 200 and "[DONE]" in text and "error" not in text
                out[path] = {"ok": ok, "status": r.status, "reply": text[:300]}
        except aiohttp.ClientError as exc:
            out[path] = {"ok": False, "status": None, "reply": f"{type(exc).__name__}: {exc}"}
    return out


# -- summary --------------------------------------------------------------------------------------
def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) * 1000.0 if xs else None


def summarize(runs: list[tuple[list[Sample], float]], rate: float) -> dict[str, Any]:
    ok = [s for samples, _ in runs for s in samples if s.error is None]
    errors = [s.error for samples, _ in runs for s in samples if s.error is not None]
    offered: list[float] = []
    achieved: list[float] = []
    lag: list[float] = []
    for samples, t0 in runs:
        good = [s for s in samples if s.error is None]
        span_sched = samples[-1].sched - samples[0].sched
        offered.append((len(samples) - 1) / span_sched if span_sched > 0 else rate)
        if len(good) > 1:
            # same form as offered: completions over the span between the first and last completion
            achieved.append((len(good) - 1) / (max(s.done for s in good) - min(s.done for s in good)))
        lag.extend(s.sent - t0 - s.sched for s in samples)
    ttft = [s.ttft for s in ok if s.ttft is not None]
    tpot = [s.tpot for s in ok if s.tpot is not None]
    return {
        "rate": rate,
        "requests": sum(len(r[0]) for r in runs),
        "ok": len(ok),
        "errors": len(errors),
        "error_examples": sorted(set(errors))[:3],
        "ttft_p50_ms": _pct(ttft, 50),
        "ttft_p99_ms": _pct(ttft, 99),
        "tpot_p50_ms": _pct(tpot, 50),
        "tpot_p99_ms": _pct(tpot, 99),
        "offered_rps": float(np.mean(offered)),
        "achieved_rps": float(np.mean(achieved)) if achieved else 0.0,
        "send_lag_p99_ms": _pct(lag, 99),
    }


def _commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


def _fmt(x: float | None, nd: int = 2, sign: bool = False) -> str:
    if x is None:
        return "–"
    return f"{x:+.{nd}f}" if sign else f"{x:.{nd}f}"


# -- main -----------------------------------------------------------------------------------------
async def run(args: argparse.Namespace, report: dict[str, Any]) -> None:
    rates = [float(x) for x in args.rates.split(",")]
    overrides: dict[str, Any] = {"engine.time_scale": args.time_scale, "gateway.log_level": "warning"}
    for kv in args.set:
        key, _, value = kv.partition("=")
        overrides[key] = tomllib.loads(f"v = {value}")["v"]
    log_dir = Path(args.out).with_suffix("")
    log_dir.mkdir(parents=True, exist_ok=True)
    exe, smg_info = smg_binary(not args.no_install) if args.smg else (None, "skipped (--no-smg)")
    report["smg"] = {"version_or_reason": smg_info}
    smg: Smg | None = None
    with ClusterProcess(
        workers=args.workers, mode=args.mode, overrides=overrides, log_dir=log_dir
    ) as cluster:
        assert cluster.proc is not None
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=300)) as http:
            async with http.get(cluster.url + "/admin/workers") as r:
                workers = await r.json()
            worker_urls = [w["url"] for w in workers]
            async with http.get(cluster.url + "/v1/models") as r:
                lumen_model = (await r.json())["data"][0]["id"]
            targets = [
                Target("direct", worker_urls, "generate"),
                Target("direct_oai", worker_urls, "completions", lumen_model, True),
                Target(
                    "lumen", [cluster.url], "completions", model=lumen_model, pids={"lumen": cluster.proc.pid}
                ),
            ]
            if args.lumen_generate:
                targets.append(
                    Target("lumen_gen", [cluster.url], "generate", pids={"lumen": cluster.proc.pid})
                )
            try:
                if exe is not None:
                    smg = Smg(exe, worker_urls, args.smg_policy, log_dir / "smg.log")
                    await smg.ready(http)
                    async with http.get(smg.url + "/v1/models") as r:
                        smg_model = (await r.json())["data"][0]["id"]
                    found = await probe(http, smg.url, smg_model)
                    report["smg"]["probe"] = found
                    report["smg"]["cmd"] = " ".join(smg.cmd)
                    print(f"SMG probe against the workers: {json.dumps(found)}", file=sys.stderr)
                    pids = {"smg": smg.proc.pid}
                    if found["/v1/completions"]["ok"]:
                        targets.append(
                            Target("smg", [smg.url], "completions", smg_model, True, pids, "direct_oai")
                        )
                    if found["/generate"]["ok"] and args.smg_generate:
                        targets.append(Target("smg_gen", [smg.url], "generate", pids=pids))
                    report["smg"]["measured"] = [t.name for t in targets if t.name.startswith("smg")]
                    if not report["smg"]["measured"]:
                        report["smg"]["not_measured"] = "no SMG endpoint worked against these workers"
                await _measure(http, targets, rates, args, report)
            finally:
                if smg is not None:
                    smg.stop()


async def _measure(
    http: aiohttp.ClientSession,
    targets: list[Target],
    rates: list[float],
    args: argparse.Namespace,
    report: dict[str, Any],
) -> None:
    all_pids = {k: v for t in targets for k, v in t.pids.items()}
    # per pid: CPU and wall while its path ran ("on") and while others ran ("off", its idle rate)
    acct = {k: {"on_cpu": 0.0, "on_wall": 0.0, "off_cpu": 0.0, "off_wall": 0.0} for k in all_pids}
    for t in targets:  # warm-up: connections, first-request paths
        await drive(http, t, workload(5.0, 1.0, 5, 99))
    runs: dict[tuple[str, float], list[tuple[list[Sample], float]]] = {}
    cpu_on: dict[tuple[str, float], float] = {}
    wall_on: dict[tuple[str, float], float] = {}
    k = 0
    for rep in range(args.repeats):
        for rate in rates:
            shapes = workload(rate, args.seconds, args.min_requests, args.seed + int(rate * 1000) + rep)
            order = targets[k % len(targets) :] + targets[: k % len(targets)]
            k += 1
            for t in order:
                c0 = {p: cpu_seconds(pid) for p, pid in all_pids.items()}
                w0 = time.monotonic()
                samples, t0 = await drive(http, t, shapes)
                wall = time.monotonic() - w0
                for p, pid in all_pids.items():
                    d = cpu_seconds(pid) - c0[p]
                    side = "on" if p in t.pids else "off"
                    acct[p][f"{side}_cpu"] += d
                    acct[p][f"{side}_wall"] += wall
                    if p in t.pids:
                        cpu_on[(t.name, rate)] = cpu_on.get((t.name, rate), 0.0) + d
                        wall_on[(t.name, rate)] = wall_on.get((t.name, rate), 0.0) + wall
                runs.setdefault((t.name, rate), []).append((samples, t0))
                bad = sum(s.error is not None for s in samples)
                print(
                    f"rep {rep + 1} rate {rate:g}/s {t.name}: {len(samples)} req, {bad} errors, {wall:.1f} s",
                    file=sys.stderr,
                )
    idle = {p: a["off_cpu"] / a["off_wall"] if a["off_wall"] else 0.0 for p, a in acct.items()}
    report["idle_cpu_rate"] = idle
    rows: dict[str, dict[str, Any]] = {}
    for t in targets:
        for rate in rates:
            row = summarize(runs[(t.name, rate)], rate)
            if t.pids and row["ok"]:
                raw = cpu_on[(t.name, rate)]
                net = raw - sum(idle[p] for p in t.pids) * wall_on[(t.name, rate)]
                row["cpu_s_per_1000"] = 1000 * raw / row["ok"]
                row["cpu_net_s_per_1000"] = 1000 * net / row["ok"]
            rows[f"{t.name}@{rate:g}"] = row
    for t in targets:
        if t.name.startswith("direct"):
            continue
        for rate in rates:
            row, ref = rows[f"{t.name}@{rate:g}"], rows[f"{t.baseline}@{rate:g}"]
            row["baseline"] = t.baseline
            for m in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"):
                row[f"added_{m}"] = None if row[m] is None or ref[m] is None else row[m] - ref[m]
    for t in targets:
        sustained = [
            r for r in rates
            if rows[f"{t.name}@{r:g}"]["errors"] == 0
            and rows[f"{t.name}@{r:g}"]["achieved_rps"] >= 0.95 * rows[f"{t.name}@{r:g}"]["offered_rps"]
            and (rows[f"{t.name}@{r:g}"]["ttft_p99_ms"] or 1e9) <= args.ttft_bound_ms
        ]  # fmt: skip
        report.setdefault("max_sustained_rps", {})[t.name] = max(sustained) if sustained else None
    report["rows"] = rows
    report["targets"] = [{"name": t.name, "kind": t.kind, "baseline": t.baseline} for t in targets]


def tables(report: dict[str, Any]) -> str:
    """The report as markdown: a header, the full table, the per-token goal, sustained rates, SMG probe."""
    rows = report["rows"]
    smg = report.get("smg", {})
    out = [
        f"`{report['command']}` — {report['machine']}, load average at start "
        + " / ".join(f"{x:.1f}" for x in report["loadavg_at_start"])
        + f", {report['date']}, commit {report['commit']}, smg {smg.get('version_or_reason', '–')}.",
        "Baselines: `lumen`, `lumen_gen`, `smg_gen` against `direct` (worker `/generate`); `smg` against "
        "`direct_oai` (worker `/v1/completions`), the endpoint SMG forwards to.",
        "",
        "| path | rate/s | ok / err | offered / achieved /s | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
        "| added TTFT p50 / p99 ms | added TPOT p50 / p99 ms | gateway CPU s/1000 req (net) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, r in rows.items():
        name = key.split("@")[0]
        added = (
            f"{_fmt(r.get('added_ttft_p50_ms'), 2, True)} / {_fmt(r.get('added_ttft_p99_ms'), 2, True)}",
            f"{_fmt(r.get('added_tpot_p50_ms'), 3, True)} / {_fmt(r.get('added_tpot_p99_ms'), 3, True)}",
        ) if "baseline" in r else ("–", "–")  # fmt: skip
        cpu = f"{r['cpu_s_per_1000']:.1f} ({r['cpu_net_s_per_1000']:.1f})" if "cpu_s_per_1000" in r else "–"
        out.append(
            f"| {name} | {r['rate']:g} | {r['ok']} / {r['errors']} | {r['offered_rps']:.1f} / {r['achieved_rps']:.1f} "
            f"| {_fmt(r['ttft_p50_ms'])} / {_fmt(r['ttft_p99_ms'])} | {_fmt(r['tpot_p50_ms'], 3)} / {_fmt(r['tpot_p99_ms'], 3)} "
            f"| {added[0]} | {added[1]} | {cpu} |"
        )
    names = [t["name"] for t in report["targets"] if not t["name"].startswith("direct")]
    if "smg" in names or "smg_gen" in names:
        ref = "smg" if "smg" in names else "smg_gen"
        out += [
            "",
            f"Goal: Lumen's added TPOT p50 within 2x of SMG's (ms per token, vs each path's baseline; "
            f"ratio lumen / {ref})",
            "",
            "| rate/s | " + " | ".join(f"{n} added TPOT p50" for n in names) + f" | lumen / {ref} |",
            "|---|" + "---|" * (len(names) + 1),
        ]
        for rate in report["args"]["rates"].split(","):
            per_path = {n: rows[f"{n}@{float(rate):g}"].get("added_tpot_p50_ms") for n in names}
            smg_added, lumen_added = per_path.get(ref), per_path.get("lumen")
            if smg_added is None or lumen_added is None:
                ratio = "–"
            elif smg_added < NOISE_MS:
                ratio = f"SMG adds < {NOISE_MS} ms (noise); lumen {_fmt(lumen_added, 3, True)} ms"
            else:
                ratio = f"{lumen_added / smg_added:.2f}"
            out.append(
                f"| {rate} | " + " | ".join(_fmt(per_path[n], 3, True) for n in names) + f" | {ratio} |"
            )
    out += [
        "",
        f"Max sustained rate (achieved ≥ 95% of offered, 0 errors, TTFT p99 ≤ {report['args']['ttft_bound_ms']:g} ms):",
        "",
    ]
    for name, r in report["max_sustained_rps"].items():
        out.append(f"- {name}: {'none of the rates' if r is None else f'{r:g} req/s'}")
    out.append("")
    if smg.get("measured"):
        out.append(f"SMG paths measured (no shim): {', '.join(smg['measured'])}.")
    elif smg:
        out.append(f"SMG not measured: {smg.get('not_measured') or smg.get('version_or_reason')}.")
    for path, p in smg.get("probe", {}).items():
        reply = "" if p["ok"] else f": {p['reply'][:200]}"
        out.append(f"- SMG probe {path}: {'ok' if p['ok'] else 'FAILED'} ({p['status']}){reply}")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="5,10,20,40,80", help="offered request rates, req/s")
    ap.add_argument("--seconds", type=float, default=8.0, help="scheduled length of each (path, rate) run")
    ap.add_argument("--min-requests", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--time-scale", type=float, default=0.05)
    ap.add_argument(
        "--mode", default="stop_restart", help="Lumen recovery mode (stop_restart: no checkpoint streaming)"
    )
    ap.add_argument("--ttft-bound-ms", type=float, default=100.0, help="p99 TTFT bound for 'sustained'")
    ap.add_argument("--smg-policy", default="round_robin")
    ap.add_argument(
        "--no-lumen-generate",
        dest="lumen_generate",
        action="store_false",
        help="skip `lumen_gen` (Lumen's native /generate, like for like with SMG's /generate)",
    )
    ap.add_argument(
        "--no-smg-generate",
        dest="smg_generate",
        action="store_false",
        help="skip `smg_gen` (SMG's /generate passthrough)",
    )
    ap.add_argument("--no-smg", dest="smg", action="store_false")
    ap.add_argument("--no-install", action="store_true", help="do not pip install smg when missing")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra Lumen config override (TOML value)",
    )
    ap.add_argument(
        "--out", default="out/bench_smg.json", help="the JSON report; the tables go beside it as .md"
    )
    args = ap.parse_args(argv)
    report: dict[str, Any] = {
        "command": "python -m loadtests.bench_smg " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores py{platform.python_version()}",
        "loadavg_at_start": os.getloadavg(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _commit(),
        "args": vars(args),
        "smg_on_path": shutil.which("smg"),
    }
    try:
        asyncio.run(run(args, report))
    finally:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1, default=lambda o: asdict(o)))
        print(f"wrote {args.out}", file=sys.stderr)
    md = tables(report)
    Path(args.out).with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
