"""The overhead bench's Markdown: the full table per path and rate, the per-token goal against SMG,
the max sustained rates and the SMG probe."""

from __future__ import annotations

from typing import Any

# below this, an added per-token latency is within the run-to-run noise of these machines
NOISE_MS = 0.01


def _fmt(x: float | None, nd: int = 2, sign: bool = False) -> str:
    if x is None:
        return "–"
    return f"{x:+.{nd}f}" if sign else f"{x:.{nd}f}"


def label(name: str, report: dict[str, Any]) -> str:
    """A path's name in the tables: `lumen_x2` → `lumen x2 (shared port)`; `lumen` → `lumen x1` when
    several gateway counts were measured."""
    several = len(report.get("lumen_clusters", {})) > 1
    if name in ("lumen", "lumen_gen"):
        return f"{name} x1" if several else name
    base, _, n = name.rpartition("_x")
    if base in ("lumen", "lumen_gen") and n.isdigit():
        return f"{base} x{n} (shared port)"
    return name


def sustained(row: dict[str, Any], bound_ms: float) -> bool:
    """The bench's "sustained": achieved ≥ 95% of offered, 0 errors, TTFT p99 within the bound."""
    return (
        row["errors"] == 0
        and row["achieved_rps"] >= 0.95 * row["offered_rps"]
        and (row["ttft_p99_ms"] if row["ttft_p99_ms"] is not None else 1e9) <= bound_ms
    )


def throughput(report: dict[str, Any]) -> list[str]:
    """Per path and rate: achieved req/s and TTFT p99, ✓ where sustained; then the all-cores goal."""
    rows, bound = report["rows"], report["args"]["ttft_bound_ms"]
    rates = [f"{float(r):g}" for r in report["args"]["rates"].split(",")]
    names = [t["name"] for t in report["targets"]]
    out = [
        f"Throughput: achieved req/s · TTFT p99 ms per offered rate (✓ sustained: ≥ 95% of offered, 0 errors, "
        f"TTFT p99 ≤ {bound:g} ms)",
        "",
        "| path | " + " | ".join(f"{r}/s" for r in rates) + " | max sustained |",
        "|---|" + "---|" * (len(rates) + 1),
    ]
    for n in names:
        cells = []
        for r in rates:
            row = rows[f"{n}@{r}"]
            p99 = "–" if row["ttft_p99_ms"] is None else f"{row['ttft_p99_ms']:.0f}"
            err = f", {row['errors']} err" if row["errors"] else ""
            cells.append(f"{row['achieved_rps']:.1f} · {p99}{err}{' ✓' if sustained(row, bound) else ''}")
        best = report["max_sustained_rps"].get(n)
        out.append(
            f"| {label(n, report)} | " + " | ".join(cells) + f" | {'–' if best is None else f'{best:g}'} |"
        )
    multi = [n for n in names if n.startswith("lumen") and "_x" in n]
    smg_paths = [n for n in names if n.startswith("smg")]
    if multi and smg_paths:
        ms = report["max_sustained_rps"]
        smg_best = max((ms[n] for n in smg_paths if ms[n] is not None), default=None)
        top = max(float(r) for r in rates)
        out += [
            "",
            f"Goal: every Lumen path with several gateways sustains SMG's highest rate "
            f"({'none' if smg_best is None else f'{smg_best:g} req/s'}, best of {', '.join(smg_paths)})",
        ]
        for n in multi:
            got = ms[n]
            if smg_best is None:
                verdict = "SMG sustained none of the rates: not decided"
            elif got is not None and got >= smg_best:
                verdict = f"met ({got:g} ≥ {smg_best:g} req/s)"
            else:
                verdict = f"NOT met ({'none' if got is None else f'{got:g}'} < {smg_best:g} req/s)"
            out.append(f"- {label(n, report)}: {verdict}")
        if smg_best is not None and smg_best >= top:
            out.append(f"- SMG sustained the top of the ladder ({top:g} req/s): its own limit is higher")
    return out


def _quiet_line(report: dict[str, Any]) -> list[str]:
    """How busy the machine was just before the steps (the bench's own idle processes included)."""
    before = sorted(b for r in report["rows"].values() for b in r.get("machine_busy_before_cores", ()))
    if not before:
        return []
    waited = report.get("waited_for_quiet_s", 0.0)
    return [
        f"Machine busy over 1 s before each step: median {before[len(before) // 2]:.2f}, "
        f"max {before[-1]:.2f} cores"
        + (
            f" (waited {waited:.0f} s in all for it to fall to {report['args'].get('wait_quiet', 0):g})."
            if waited
            else "."
        )
    ]


def tables(report: dict[str, Any]) -> str:
    """The report as markdown: a header, the full table, the per-token goal, sustained rates, SMG probe."""
    rows = report["rows"]
    smg = report.get("smg", {})
    out = [
        f"`{report['command']}` — {report['machine']}, load average at start "
        + " / ".join(f"{x:.1f}" for x in report["loadavg_at_start"])
        + f", {report['date']}, commit {report['commit']}, smg {smg.get('version_or_reason', '–')}.",
        *_quiet_line(report),
        "Baselines: `lumen`, `lumen_gen`, `smg_gen` against `direct` (worker `/generate`); `smg` against "
        "`direct_oai` (worker `/v1/completions`), the endpoint SMG forwards to.",
        "",
        "| path | rate/s | ok / err | offered / achieved /s | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
        "| added TTFT p50 / p99 ms | added TPOT p50 / p99 ms | gateway CPU s/1000 req (net) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, r in rows.items():
        name = label(key.split("@")[0], report)
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
        out.append(f"- {label(name, report)}: {'none of the rates' if r is None else f'{r:g} req/s'}")
    out += ["", *throughput(report), ""]
    if smg.get("measured"):
        out.append(f"SMG paths measured (no shim): {', '.join(smg['measured'])}.")
    elif smg:
        out.append(f"SMG not measured: {smg.get('not_measured') or smg.get('version_or_reason')}.")
    for path, p in smg.get("probe", {}).items():
        reply = "" if p["ok"] else f": {p['reply'][:200]}"
        out.append(f"- SMG probe {path}: {'ok' if p['ok'] else 'FAILED'} ({p['status']}){reply}")
    return "\n".join(out) + "\n"
