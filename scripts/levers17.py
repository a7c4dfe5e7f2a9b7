"""Issue 17: Lumen's recovery levers, measured side by side over seeds (simulator).

    .venv/bin/python scripts/levers17.py calibrate            # rates / trace speedup for ~1.2 s TTFT
    .venv/bin/python scripts/levers17.py run --shapes conv,code --seeds 1,2,3 --out out/levers17
    # the capacity bound beside lumen: the same run losing no work (docs/evaluation.md)
    .venv/bin/python scripts/levers17.py run --shapes code --seeds 1,2,3 --out out/bound17 \
        --variants '{"lumen": {}, "bound": {"failure.kind": "capacity"}}'

Each workload shape is a paper-4w cluster (4 x Qwen3-32B TP2, w0 killed) with a synthetic shape
(`workload.shape`) or the shared conversation trace; `lull` kills w0 at the start of the longest gap
in arrivals near the usual kill time. For the trace, a seed moves the kill time (the trace is fixed).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np

from gateway.core import evaluation as ev
from gateway.core.modes import policy_for
from gateway.sim.runner import build_workload, calibrate_rate, run_scenario
from gateway.sim.scenario import FailureSpec, Scenario, load_scenario
from gateway.sim.simulation import Simulation

Shape = Literal["conv", "code", "long_output"]
TRACE = "../shared/traces/AzureLLMInferenceTrace_conv.csv"
# calibrated for ~1.2 s no-failure mean TTFT (stop_restart), seed 1 (see `calibrate`)
RATES = {"conv": 35.82, "code": 30.075, "long_output": 15.731}
TRACE_SPEEDUP = 5.481
CODE_CV = 4.0  # very bursty arrivals


def shape_scenario(shape: str, duration: float, rate: float | None = None) -> Scenario:
    if shape == "paper-8w":  # its own calibrated conv-like load (docs/results.md, issue 6)
        base = load_scenario("paper-8w")
        return replace(base, workload=replace(base.workload, duration_s=duration))
    base = load_scenario("paper-4w")
    w = base.workload
    if shape == "trace":
        w = replace(w, source="trace", trace=TRACE, trace_speedup=TRACE_SPEEDUP, fallback=False)
    else:
        cv = CODE_CV if shape in ("code", "code-lull") else 1.0
        name = "code" if shape == "code-lull" else shape
        w = replace(w, shape=cast(Shape, name), burst_cv=cv, rate=rate or RATES[name])
    return replace(base, name=shape, workload=replace(w, duration_s=duration))


def lull_at(s: Scenario, seed: int, near: float) -> float:
    """Start of the longest arrival gap within +-60 s of `near` (the kill lands in a lull)."""
    a = build_workload(s, seed).arrivals
    lo, hi = np.searchsorted(a, near - 60), np.searchsorted(a, near + 60)
    gaps = np.diff(a[lo:hi])
    i = int(np.argmax(gaps))
    return float(a[lo + i]) + 1e-3


def scenario_for(shape: str, seed: int, duration: float) -> Scenario:
    if shape.startswith("scale-"):  # its own load and failure (25 % of the workers at 120 s)
        base = load_scenario(shape)
        return replace(base, workload=replace(base.workload, duration_s=duration))
    s = shape_scenario(shape, duration)
    at = 120.0
    if shape == "trace":
        at = 120.0 + 60.0 * (seed - 1)
    elif shape == "code-lull":
        at = lull_at(s, seed, 120.0)
    return replace(s, failures=(FailureSpec(at_s=at, workers=("w0",)),))


def no_failure_ttft(s: Scenario, seed: int) -> float:
    s = replace(s, failures=())
    run = Simulation(s, policy_for("stop_restart"), build_workload(s, seed), seed, failures=False).run()
    return ev.mean_metric(run.records, "ttft") or math.inf


def calibrate(args: argparse.Namespace) -> None:
    for shape in ("code", "long_output"):
        s = shape_scenario(shape, args.duration, rate=30.0)
        rate, ttft = calibrate_rate(s, 1.2, 1, iters=12)
        print(json.dumps({"shape": shape, "rate": round(rate, 3), "ttft": round(ttft, 3)}), flush=True)
    s = shape_scenario("trace", 3600.0)
    lo, hi = 1.0, 20.0
    best = (lo, math.inf)
    for _ in range(12):
        mid = (lo + hi) / 2
        t = no_failure_ttft(replace(s, workload=replace(s.workload, trace_speedup=mid)), 1)
        if abs(t - 1.2) < abs(best[1] - 1.2):
            best = (mid, t)
        lo, hi = (mid, hi) if t < 1.2 else (lo, mid)
    print(json.dumps({"shape": "trace", "speedup": round(best[0], 4), "ttft": round(best[1], 3)}), flush=True)


KEYS = (
    "impact_ttft_mean_s",
    "ttft_mean_s",
    "recovery_time_s",
    "excess_ttft_request_s",
    "impact_tpot_mean_s",
    "checkpoint_coverage",
    "resume_delay_mean_s",
    "reload_s",
)


def run(args: argparse.Namespace) -> None:
    """Baseline modes once per reload source (with the levers as they were: none of them), then
    lumen once per variant (overrides applied to lumen only)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    variants: dict[str, dict[str, Any]] = json.loads(args.variants) if args.variants else {"default": {}}
    before = {"recovery.resumed_first": False, "recovery.outage_batch_boost": 1.0}
    for shape in args.shapes.split(","):
        for seed in (int(x) for x in args.seeds.split(",")):
            base = scenario_for(shape, seed, args.duration)
            jobs: list[tuple[str, dict[str, Any], list[str]]] = []
            for reload in args.baseline_reload.split(","):
                if reload:
                    over = {**before, "recovery.reload": reload}
                    jobs.append((f"base-{reload}", over, args.modes.split(",")))
            for name, over in variants.items():  # "mode": run that mode instead of lumen, reported as lumen
                over = dict(over)
                jobs.append((name, over, [over.pop("mode", "lumen")]))
            for vname, over, modes in jobs:
                s = apply(base, over)
                rep = run_scenario(s, modes, seed, jobs=args.jobs)
                if modes != ["lumen"] and not vname.startswith("base-"):
                    rep.modes = {"lumen": rep.modes[modes[0]]}
                    rep.runs = {"lumen": rep.runs[modes[0]]}
                row = {
                    "shape": shape,
                    "seed": seed,
                    "variant": vname,
                    "failure_at": s.failure_at,
                    "wall_s": round(rep.wall_s, 1),
                    "modes": {m: pick(v, rep.runs[m].records, s.failure_at) for m, v in rep.modes.items()},
                }
                with open(out / "rows.jsonl", "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(summary_line(row), flush=True)


WINDOW_S = 300.0  # a fixed window for every mode: mean TTFT of the requests arriving in it


def pick(v: dict[str, Any], records: Any, failure_at: float | None) -> dict[str, Any]:
    out = {k: v.get(k) for k in KEYS}
    if failure_at is not None:
        impact = ev.failure_impact(records, failure_at, WINDOW_S)
        out["ttft_300s"] = impact.mean_ttft
        out["tpot_300s"] = impact.mean_tpot
        # the tail of the same window (what a shortest-first order may starve)
        ttfts = sorted(
            r.first_token - r.arrival
            for r in records
            if failure_at <= r.arrival <= failure_at + WINDOW_S and r.first_token is not None
        )
        if ttfts:
            out["ttft_p99_300s"] = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]
            out["ttft_max_300s"] = ttfts[-1]
    out["pairs"] = v.get("draft_pairings")
    out["draft_first"] = [r["draft_first"] for r in v.get("reloads", [])]
    return out


def apply(s: Scenario, over: dict[str, Any]) -> Scenario:
    """`section.key` overrides; `failure.KEY` sets KEY on every failure (`failure.kind: capacity`:
    the capacity bound, docs/evaluation.md)."""
    for key, value in over.items():
        section, field = key.split(".")
        if section == "failure":
            s = replace(s, failures=tuple(replace(f, **{field: value}) for f in s.failures))
            continue
        sub = getattr(s, section)
        s = replace(s, **{section: replace(sub, **{field: value})})
    return s


def summary_line(row: dict[str, Any]) -> str:
    m = row["modes"]
    parts = [f"{row['shape']} s{row['seed']} {row['variant']} ({row['wall_s']}s)"]
    for mode, v in m.items():
        parts.append(f"{mode}={v['impact_ttft_mean_s']}")
    lum = m.get("lumen", {}).get("impact_ttft_mean_s")
    for ref in ("stop_restart", "fixed_checkpoint"):
        r = m.get(ref, {}).get("impact_ttft_mean_s")
        if lum and r:
            parts.append(f"lumen/{ref}={lum / r:.3f}")
    return " ".join(parts)


METRICS = (
    ("impact_ttft_mean_s", "impact TTFT"),
    ("ttft_300s", "TTFT 300 s"),
    ("excess_ttft_request_s", "damage"),
)


def load_rows(out: str) -> list[dict[str, Any]]:
    with open(Path(out) / "rows.jsonl") as f:
        return [json.loads(x) for x in f]


def ratios(
    rows: list[dict[str, Any]], metric: str, reload: str | None = None
) -> dict[tuple[str, str, str], list[float]]:
    """(shape, lumen variant, baseline mode) -> lumen / baseline per seed. The baseline runs with the
    variant's own reload source unless `reload` names one."""
    base: dict[tuple[str, int, str], dict[str, Any]] = {}
    for r in rows:
        if r["variant"].startswith("base-"):
            base[(r["shape"], r["seed"], r["variant"][5:])] = r["modes"]
    out: dict[tuple[str, str, str], list[float]] = {}
    for r in rows:
        if r["variant"].startswith("base-"):
            continue
        src = reload or ("peer" if "peer" in r["variant"] else "disk")
        b = base.get((r["shape"], r["seed"], src))
        x = r["modes"]["lumen"].get(metric)
        if b is None or x is None:
            continue
        for mode in ("stop_restart", "fixed_checkpoint"):
            y = b[mode].get(metric)
            if y:
                out.setdefault((r["shape"], r["variant"], mode), []).append(x / y)
    return out


def fmt(v: list[float]) -> str:
    return f"{statistics.mean(v):.2f} ({min(v):.2f}–{max(v):.2f})" if v else "–"


def table(args: argparse.Namespace) -> None:
    rows = load_rows(args.out)
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows if not r["variant"].startswith("base-")))
    for metric, label in METRICS:
        for reload in (None, "disk"):
            rs = ratios(rows, metric, reload)
            which = (
                "baselines with the variant's reload" if reload is None else "baselines reloading from disk"
            )
            print(
                f"\n{label}: lumen / stop_restart, lumen / fixed_checkpoint ({which}); mean (min–max) over seeds\n"
            )
            print("| variant | " + " | ".join(shapes) + " |")
            print("|---|" + "---:|" * len(shapes))
            for v in variants:
                cells = [
                    f"{fmt(rs.get((sh, v, 'stop_restart'), []))} / {fmt(rs.get((sh, v, 'fixed_checkpoint'), []))}"
                    for sh in shapes
                ]
                print(f"| {v} | " + " | ".join(cells) + " |")
    recovery_spread(rows)


def recovery_diffs(rows: list[dict[str, Any]]) -> dict[tuple[str, str], tuple[list[float], list[float]]]:
    """(shape, variant) -> (lumen − fixed_checkpoint, stop_restart − fixed_checkpoint) recovery
    seconds, paired by seed, baselines from disk; seeds where one of them did not recover are left out."""
    base: dict[tuple[str, int], dict[str, Any]] = {}
    for r in rows:
        if r["variant"] == "base-disk":
            base[(r["shape"], r["seed"])] = r["modes"]
    cells: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
    for r in rows:
        if r["variant"].startswith("base-") or "peer" in r["variant"]:
            continue
        b = base.get((r["shape"], r["seed"]))
        if b is None:
            continue
        lum = r["modes"]["lumen"].get("recovery_time_s")
        fix, sr = b["fixed_checkpoint"].get("recovery_time_s"), b["stop_restart"].get("recovery_time_s")
        if lum is None or fix is None or sr is None:
            continue  # one of them did not recover within the run: no difference to take
        d = cells.setdefault((r["shape"], r["variant"]), ([], []))
        d[0].append(lum - fix)
        d[1].append(sr - fix)
    return cells


def recovery_spread(rows: list[dict[str, Any]]) -> None:
    """Recovery time, paired by seed: lumen − fixed_checkpoint beside stop_restart − fixed_checkpoint.

    The two baselines differ only in whether an interrupted request restores its checkpoint, which
    on short-output loads moves almost no work, so their per-seed difference is the measure's own
    spread on that shape (on bursty arrivals the recovery instant snaps to the start of a burst)."""
    print(
        "\nRecovery time (s), paired by seed, baselines from disk: median (min – max), and the seeds where "
        "lumen recovered no later than fixed_checkpoint\n"
    )
    print("| shape | variant | seeds | lumen − fixed | stop_restart − fixed | lumen ≤ fixed |")
    print("|---|---|---:|---|---|---:|")
    cells = recovery_diffs(rows)
    for (shape, variant), (ld, sd) in cells.items():
        print(
            f"| {shape} | {variant} | {len(ld)} | {statistics.median(ld):+.1f} ({min(ld):+.1f} – {max(ld):+.1f}) "
            f"| {statistics.median(sd):+.1f} ({min(sd):+.1f} – {max(sd):+.1f}) | {sum(x <= 0 for x in ld)} of {len(ld)} |"
        )


def plot(args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = load_rows(args.out)
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    variants = (
        args.variants.split(",")
        if args.variants
        else list(dict.fromkeys(r["variant"] for r in rows if not r["variant"].startswith("base-")))
    )
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    for ax, mode, goal in zip(axes, ("stop_restart", "fixed_checkpoint"), (0.50, 0.85), strict=True):
        rs = ratios(rows, args.metric, args.reload or None)
        width = 0.8 / len(variants)
        for i, v in enumerate(variants):
            means, lo, hi = [], [], []
            for sh in shapes:
                xs = rs.get((sh, v, mode), [])
                m = statistics.mean(xs) if xs else math.nan
                means.append(m)
                lo.append(m - min(xs) if xs else 0)
                hi.append(max(xs) - m if xs else 0)
            pos = [j + (i - len(variants) / 2 + 0.5) * width for j in range(len(shapes))]
            ax.bar(pos, means, width, yerr=[lo, hi], label=v, capsize=2)
        ax.axhline(goal, color="k", ls="--", lw=1)
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_xticks(range(len(shapes)), shapes)
        base = f"{args.reload} reload" if args.reload else "same reload"
        ax.set_title(f"lumen / {mode} ({base}), {args.metric}; dashed: goal {goal}", fontsize=9)
    axes[0].set_ylabel("ratio, lower is better (min–max over seeds)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"wrote {args.png}")


def plot_recovery(args: argparse.Namespace) -> None:
    """Per seed, recovery time minus fixed_checkpoint's (baselines from disk): each lumen variant's
    points beside stop_restart's, the yardstick of the measure's own spread on the shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = recovery_diffs(load_rows(args.out))
    shapes = list(dict.fromkeys(sh for sh, _ in cells))
    variants = list(dict.fromkeys(v for _, v in cells))
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 4.2), sharey=True, squeeze=False)
    for ax, sh in zip(axes[0], shapes, strict=True):
        labels = ["stop_restart", *variants]
        series = [cells[(sh, variants[0])][1], *[cells.get((sh, v), ([], []))[0] for v in variants]]
        for i, ys in enumerate(series):
            ax.scatter([i] * len(ys), ys, s=22, alpha=0.7, color="grey" if i == 0 else f"C{i - 1}")
            if ys:
                ax.hlines(statistics.median(ys), i - 0.25, i + 0.25, color="k", lw=1.5)
        ax.axhline(0.0, color="k", lw=0.6, ls="--")
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.set_title(f"{sh}: recovery − fixed_checkpoint's, per seed (bar: median)", fontsize=9)
    axes[0][0].set_ylabel("seconds (below 0: recovered sooner)")
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"wrote {args.png}")


def main() -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(required=True)
    c = sub.add_parser("calibrate")
    c.add_argument("--duration", type=float, default=600.0)
    c.set_defaults(func=calibrate)
    r = sub.add_parser("run")
    r.add_argument("--shapes", default="conv,code,long_output,trace,code-lull")
    r.add_argument("--seeds", default="1,2,3")
    r.add_argument("--modes", default="stop_restart,fixed_checkpoint")
    r.add_argument("--duration", type=float, default=600.0)
    r.add_argument("--variants", default="", help='JSON {"name": {"section.key": value}}')
    r.add_argument("--baseline-reload", default="disk,peer")
    r.add_argument("--out", default="out/levers17")
    r.add_argument("--jobs", type=int, default=1, help="runs at once, in processes (the same results)")
    r.set_defaults(func=run)
    t = sub.add_parser("table")
    t.add_argument("--out", default="out/levers17")
    t.set_defaults(func=table)
    g = sub.add_parser("plot")
    g.add_argument("--out", default="out/levers17")
    g.add_argument("--metric", default="ttft_300s")
    g.add_argument("--png", default="docs/img/levers17.png")
    g.add_argument("--reload", default="", help="baselines' reload (default: each variant's own)")
    g.add_argument("--variants", default="", help="comma-separated lumen variants (default: all)")
    g.set_defaults(func=plot)
    gr = sub.add_parser("plot-recovery", help="per-seed recovery time minus fixed_checkpoint's")
    gr.add_argument("--out", default="out/levers17")
    gr.add_argument("--png", default="docs/img/levers17-recovery.png")
    gr.set_defaults(func=plot_recovery)
    args = p.parse_args()
    args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
