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
